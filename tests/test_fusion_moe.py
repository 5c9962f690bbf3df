"""commfuse.fusion on tensor-parallel MoE blocks: the expert combine before the all-reduce, the
all-reduce, the residual add, the RMSNorm (+ static FP8) become one commfuse::moe_all_reduce.

Each rank holds its shard of every expert (and of a shared expert), so its combined rows are partial
sums that the all-reduce adds, as in a tensor-parallel MoE layer. The routing (softmax + top-k,
renormalised) is computed in the graph, and the combine is written as models write it: Qwen-MoE /
DeepSeek's `(y * w.unsqueeze(-1)).sum(dim=1)` on y [t, k, h], HF's batched_mm experts'
`(rows * w.reshape(-1).unsqueeze(-1)).view(t, k, h).sum(dim=1)`, with the weights in float32 or cast
to T, with or without a shared expert; HF's grouped_mm experts' rows in expert order gathered back
to token order (the finalize form). The fused outputs are compared bit for bit (2 ranks, gloo,
CPU: the op is commfuse.reference's) with the same model written in commfuse's rounding order (the
combine in fp32 in slot order: reference.moe_reduce), and with the unfused graph where the report has
no numerics note on the combine. Negative cases: what is not the combine is reported with its reason,
and the all-reduce tail is still fused.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import commfuse
from commfuse import fusion, reference

from inputs import tail_inputs
from test_fusion import (BF16, FUSED_AR, _cloned, assert_close_under_sum_order, assert_codes_of_the_fused_norm,
                         assert_rounding_order_close, assert_same, counts, fp8, fuse_and_run, hf_norm, op_eps, reduce,
                         weight_before_cast_norm)

mpi = pytest.mark.mpi(min_size=1)
MOE_AR = torch.ops.commfuse.moe_all_reduce.default
E, FF = 8, 32  # experts, each expert's (sharded) intermediate size
NORMS = {"hf": hf_norm, "weight_before_cast": weight_before_cast_norm}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def moe_setup(c, gen, t, h, quant=None):
    """x [t, h] and the router (replicated), this rank's shard of the experts and of a shared expert,
    the residual, the norm's weight and the FP8 scale."""
    x = torch.randn(t, h, generator=gen).to(BF16)
    x[0] *= 40
    router = (torch.randn(E, h, generator=gen) / h ** 0.5).to(BF16)
    shards = [((torch.randn(E, FF, h, generator=gen) / h ** 0.5).to(BF16),
               (torch.randn(E, h, FF, generator=gen) / FF ** 0.5).to(BF16),
               (torch.randn(FF, h, generator=gen) / h ** 0.5).to(BF16),
               (torch.randn(h, FF, generator=gen) / FF ** 0.5).to(BF16)) for _ in range(c.world_size)]
    w_up, w_down, ws_up, ws_down = shards[dist.get_rank(c.group)]
    residual, weight, scale = tail_inputs(c, gen, t, h, BF16, quant)
    return [a.to(c.device) for a in (x, router, w_up, w_down, ws_up, ws_down, residual, weight)], scale


def route(x, router, k, wdtype):
    probs = F.softmax(F.linear(x, router).float(), dim=-1)
    w, sel = torch.topk(probs, k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return (w if wdtype == "f32" else w.to(x.dtype)), sel


def expert_rows(x, sel, w_up, w_down):
    """Each token's k expert outputs, token-major rows [t * k, h] (HF's batched_mm experts)."""
    xs = x.repeat_interleave(sel.shape[-1], dim=0)
    e = sel.reshape(-1)
    mid = F.silu(torch.bmm(w_up[e], xs.unsqueeze(-1)).squeeze(-1))
    return torch.bmm(w_down[e], mid.unsqueeze(-1)).squeeze(-1)


def written_combine(rows, w, shared, k, layout, wdtype, shared_at):
    """The combine of rows [t * k, h] as `layout` writes it, the shared expert's output added in shared_at."""
    t, h = rows.shape[0] // k, rows.shape[1]
    if layout == "tkh":  # Qwen-MoE / DeepSeek
        out = (rows.view(t, k, h) * (w.unsqueeze(-1) if wdtype == "f32" else w[..., None])).sum(dim=1)
    else:  # HF batched_mm: the rows weighted first, then viewed as [t, k, h]
        out = (rows * w.reshape(-1).unsqueeze(-1)).view(t, k, h).sum(dim=1)
    if shared_at == "f32":
        out = out + shared
    out = out.to(rows.dtype)
    return out + shared if shared_at == "T" else out


def moe_layer(k, wdtype, layout, shared_at, norm, quant, ref=False, collective="dist", comm=None):
    """The layer: route, experts, combine (as `layout` writes it, or commfuse's order when ref), the
    all-reduce (in place by default), the residual add, the norm (+ FP8)."""

    def layer(x, router, w_up, w_down, ws_up, ws_down, residual, weight, scale=None):
        t, h = x.shape
        w, sel = route(x, router, k, wdtype)
        rows = expert_rows(x, sel, w_up, w_down)
        shared = F.linear(F.silu(F.linear(x, ws_up)), ws_down) if shared_at else None
        if ref:
            out = reference.moe_reduce(rows.view(t, k, h), w, shared)
        else:
            out = written_combine(rows, w, shared, k, layout, wdtype, shared_at)
        out = reduce(collective, comm, out)
        hs = residual + out
        n = NORMS[norm](hs, weight)
        return (fp8(n, scale) if quant else n), hs

    return layer


CASES = [  # layout, k, weights dtype, shared expert added in, norm, quant, h
    ("tkh", 2, "f32", None, "weight_before_cast", None, 64),
    ("tkh", 4, "f32", "T", "hf", "fp8", 128),
    ("tkh", 2, "T", "T", "weight_before_cast", "fp8", 256),
    ("rows", 2, "f32", "f32", "weight_before_cast", None, 128),
    ("rows", 4, "T", None, "hf", None, 64),
    ("rows", 4, "f32", None, "weight_before_cast", "fp8", 256),
]


@mpi
@pytest.mark.parametrize("layout,k,wdtype,shared_at,norm,quant,h", CASES)
def test_moe_combine_all_reduce_tail_is_fused(quiet_comm, gen, layout, k, wdtype, shared_at, norm, quant, h):
    c = quiet_comm
    t = 6
    args, scale = moe_setup(c, gen, t, h, quant)
    if quant:
        args.append(scale)
    gm, report, want, got = fuse_and_run(moe_layer(k, wdtype, layout, shared_at, norm, quant), args, c)
    assert counts(gm) == {MOE_AR: 1}, report
    assert report.count("commfuse::moe_all_reduce") == 1 and report.count() == 1 and not report.skipped, report
    f = report.fused[0]
    assert f.pattern == "moe_combine + all_reduce + add + rmsnorm" + (" + fp8" if quant else ""), report
    assert f.with_all_reduce and f.comm == c.name and f.spelling.startswith(
        "(y * w.unsqueeze(-1))" if layout == "tkh" else "(rows * w[:, None]).view(t, k, h)"), report
    assert "combine: one kernel with the tail at world size 1" in f.route, report
    notes = " | ".join(f.notes)
    assert ("rounding each product" in notes) == (wdtype == "T"), report
    assert ("not necessarily slot order" in notes) == (k > 2), report
    assert ("shared expert's output" in notes) == bool(shared_at), report
    kinds = ["fp8" if quant else "norm", "residual"]
    # Against the model written in commfuse's rounding order (the combine in fp32, slot order).
    ref = list(moe_layer(k, wdtype, layout, shared_at, norm, quant, ref=True)(*_cloned(args)))
    if norm == "weight_before_cast":
        assert_same(got, ref)
    else:
        assert_rounding_order_close(got, ref, kinds)
        if quant:
            assert_codes_of_the_fused_norm(got[0], got[1], args[7], scale)
    # Against the unfused graph: its combine is commfuse's order where the report notes none.
    combine_notes = wdtype == "T" or k > 2 or shared_at
    if not combine_notes and norm == "weight_before_cast":
        assert_same(got, want)
    elif not combine_notes:
        assert_rounding_order_close(got, want, kinds)
    else:
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close_under_sum_order(g, w, i)


@mpi
@pytest.mark.parametrize("layout,k,wdtype,shared_at,norm,quant,h", CASES)
def test_moe_tail_fused_inside_inductor(quiet_comm, gen, layout, k, wdtype, shared_at, norm, quant, h):
    """commfuse.fusion.post_grad_pass on Inductor's graph of the combine, the shared expert's down projection
    (which Inductor folds with its add to the combine into one addmm, split back by the pass), the all-reduce and
    the tail: one commfuse::moe_all_reduce with the eager call's bits. The expert rows and the routing weights
    are inputs, so both sides read the same bits."""
    import torch._inductor.config as inductor_config

    c, t = quiet_comm, 5
    (x, router, w_up, w_down, ws_up, ws_down, residual, weight), scale = moe_setup(c, gen, t, h, quant)
    w, sel = route(x, router, k, wdtype)
    rows, mid = expert_rows(x, sel, w_up, w_down), F.silu(F.linear(x, ws_up))

    def layer(rows, w, mid, ws_down, residual, weight, scale):
        shared = F.linear(mid, ws_down) if shared_at else None
        hs = residual + reduce("dist", c, written_combine(rows, w, shared, k, layout, wdtype, shared_at))
        n = NORMS[norm](hs, weight)
        return (fp8(n, scale) if quant else n), hs

    reports: list = []
    torch._dynamo.reset()
    patch = dict(fx_graph_cache=False, post_grad_custom_post_pass=fusion.post_grad_pass(c, reports=reports))
    with inductor_config.patch(patch):
        got = torch.compile(layer, backend="inductor", fullgraph=True)(rows, w, mid, ws_down, residual, weight, scale)
    assert reports[-1].count("commfuse::moe_all_reduce") == 1 and not reports[-1].skipped, reports[-1]
    want = c.moe_all_reduce(rows.view(t, k, h), w, residual, weight, 1e-6, quant, scale,
                            shared=F.linear(mid, ws_down) if shared_at else None)
    assert_same(got, [want.quant if quant else want.norm, want.residual])


@mpi
def test_inductors_addmm_stays_where_no_moe_op_takes_it(quiet_comm, gen):
    """Inductor folds the shared expert's projection and its add to the combine into one addmm, which the pass
    splits for its matcher: where no moe_all_reduce takes the split (no all-reduce after the block; the combine
    read elsewhere too, so only the all-reduce tail is fused), the addmm is put back and the combine has
    Inductor's own bits."""
    import torch._inductor.config as inductor_config

    c, t, k, h = quiet_comm, 5, 2, 128
    (x, router, w_up, w_down, ws_up, ws_down, residual, weight), _ = moe_setup(c, gen, t, h)
    w, sel = route(x, router, k, "T")
    rows, mid = expert_rows(x, sel, w_up, w_down), F.silu(F.linear(x, ws_up))

    def block(rows, w, mid, ws_down, residual, weight):
        return written_combine(rows, w, F.linear(mid, ws_down), k, "tkh", "T", "T"),

    def combine_read_twice(rows, w, mid, ws_down, residual, weight):
        out = written_combine(rows, w, F.linear(mid, ws_down), k, "tkh", "T", "T")
        hs = residual + reduce("dist", c, out.clone())
        return out, weight_before_cast_norm(hs, weight), hs

    for fn, fused in ((block, 0), (combine_read_twice, 1)):
        got = {}
        for with_pass in (True, False):
            reports: list = []
            torch._dynamo.reset()
            patch = dict(fx_graph_cache=False, post_grad_custom_post_pass=fusion.post_grad_pass(c, reports=reports)
                         if with_pass else None)
            with inductor_config.patch(patch):
                got[with_pass] = torch.compile(fn, backend="inductor", fullgraph=True)(rows, w, mid, ws_down,
                                                                                       residual, weight)
            if with_pass:
                assert reports[-1].count() == reports[-1].count("commfuse::fused_all_reduce") == fused, reports[-1]
        assert torch.equal(got[True][0], got[False][0]), fn.__name__


@mpi
@pytest.mark.parametrize("order", ["routed + shared", "shared + routed"])
@pytest.mark.parametrize("collective", ["dist", "funcol"])
def test_shared_expert_all_reduced_apart_is_the_ops_shared_input(quiet_comm, gen, order, collective):
    """transformers' expert parallelism all-reduces the routed combine, and its row-parallel shared expert
    all-reduces its own down_proj, then adds the two sums: one moe_all_reduce with the shared expert's partial
    output as `shared` (each rank adds its part before the one collective)."""
    c = quiet_comm
    t, h, k = 6, 128, 2
    args, _ = moe_setup(c, gen, t, h)

    def layer(x, router, w_up, w_down, ws_up, ws_down, residual, weight, ref=False):
        w, sel = route(x, router, k, "f32")
        rows = expert_rows(x, sel, w_up, w_down)
        shared = F.linear(F.silu(F.linear(x, ws_up)), ws_down)
        if ref:  # commfuse's order: the shared output starts each rank's float32 combine, one all-reduce
            out = reduce("dist", c, reference.moe_reduce(rows.view(t, k, h), w, shared))
        else:
            routed = reduce(collective, c, (rows.view(t, k, h) * w.unsqueeze(-1)).sum(dim=1).to(x.dtype))
            shared = reduce(collective, c, shared)
            out = routed + shared if order == "routed + shared" else shared + routed
        hs = residual + out
        return weight_before_cast_norm(hs, weight), hs

    gm, report, want, got = fuse_and_run(layer, args, c)
    assert counts(gm) == {MOE_AR: 1} and not report.skipped, report
    f = report.fused[0]
    assert "all-reduced apart" in f.spelling and any("apart" in n for n in f.notes), report
    assert_same(got, list(layer(*_cloned(args), ref=True)))
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close_under_sum_order(g, w, i)


@mpi
def test_two_all_reduces_added_without_a_combine_are_reported(quiet_comm, gen):
    """A parallel block's attention and MLP outputs, each all-reduced, then added: no fused op takes two
    collectives' inputs; the add + RMSNorm become the local op and the outputs stay the graph's."""
    c = quiet_comm
    args, _ = moe_setup(c, gen, 6, 128)

    def layer(x, router, w_up, w_down, ws_up, ws_down, residual, weight):
        a = F.linear(x, ws_down @ ws_up)
        b = F.linear(F.silu(F.linear(x, ws_up)), ws_down)
        dist.all_reduce(a)
        dist.all_reduce(b)
        hs = residual + (a + b)
        return weight_before_cast_norm(hs, weight), hs

    gm, report, want, got = fuse_and_run(layer, args, c)
    assert counts(gm).get(MOE_AR, 0) == 0 and counts(gm).get(FUSED_AR, 0) == 0, report
    assert any(s.what == "all-reduce" and "sums of two all-reduces are added" in s.reason for s in report.skipped), \
        report
    assert_same(got, want)


@mpi
def test_one_combine_all_reduced_twice_and_added_is_no_shared_expert(quiet_comm, gen):
    """all_reduce(combine) + all_reduce(combine): the second collective's input is the combine itself, no shared
    expert's output beside it (taken for one, it was an input of the op that replaces it: the pass failed). The
    sums are reported and left, the add + RMSNorm become the local op, and the outputs are the graph's."""
    c = quiet_comm
    t, h, k = 6, 64, 2
    args, _ = moe_setup(c, gen, t, h)

    def layer(x, router, w_up, w_down, ws_up, ws_down, residual, weight):
        w, sel = route(x, router, k, "f32")
        routed = (expert_rows(x, sel, w_up, w_down).view(t, k, h) * w.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        hs = residual + (reduce("funcol", c, routed) + reduce("funcol", c, routed))
        return weight_before_cast_norm(hs, weight), hs

    gm, report, want, got = fuse_and_run(layer, args, c)
    assert MOE_AR not in counts(gm) and FUSED_AR not in counts(gm), report
    assert any(s.what == "all-reduce" and "sums of two all-reduces are added" in s.reason for s in report.skipped), \
        report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("collective", ["funcol", "commfuse"])
def test_moe_combine_other_collectives_dynamic_tokens(quiet_comm, gen, collective):
    """Functional collectives and commfuse.ops.all_reduce, the token count symbolic (dynamic=True; top-k
    written as a literal, as a model's config gives it: a closed-over int would become symbolic too)."""
    c = quiet_comm
    args, scale = moe_setup(c, gen, 5, 128, "fp8")

    def layer(x, router, w_up, w_down, ws_up, ws_down, residual, weight, scale, ref=False):
        w, sel = route(x, router, 2, "T")
        rows = expert_rows(x, sel, w_up, w_down)
        shared = F.linear(F.silu(F.linear(x, ws_up)), ws_down)
        if ref:
            out = reference.moe_reduce(rows.view(x.shape[0], 2, x.shape[1]), w, shared)
        else:
            out = (rows * w.reshape(-1)[:, None]).view(-1, 2, 128).sum(dim=1) + shared  # literal sizes too
        hs = residual + reduce(collective, c, out)
        return fp8(weight_before_cast_norm(hs, weight), scale), hs

    gm, report, want, got = fuse_and_run(layer, args + [scale], c, dynamic=True)
    assert counts(gm) == {MOE_AR: 1}, report
    assert report.count("commfuse::moe_all_reduce") == 1 and not report.skipped, report
    assert "planned for 1 token" in report.fused[0].route, report
    assert_same(got, list(layer(*_cloned(args + [scale]), ref=True)))


@mpi
def test_hf_mixtral_batched_mm_block(quiet_comm, gen):
    """transformers' MixtralSparseMoeBlock with experts_implementation="batched_mm" (one graph: the rows
    weighted, viewed [t, k, h], summed, cast, reshaped to [b, s, h]), all-reduced in place, then
    MixtralRMSNorm (HF: the weight after the cast back)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm, MixtralSparseMoeBlock

    c = quiet_comm
    h = 64
    cfg = transformers.MixtralConfig(hidden_size=h, intermediate_size=FF, num_local_experts=E, num_experts_per_tok=2)
    cfg._experts_implementation = "batched_mm"
    torch.manual_seed(1234 + dist.get_rank(c.group))  # each rank its shard of the experts
    block = MixtralSparseMoeBlock(cfg).to(BF16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    block.gate.weight.data = (torch.randn(E, h, generator=gen) / h ** 0.5).to(BF16)  # the router: replicated
    norm = MixtralRMSNorm(h, eps=1e-5).to(BF16)
    norm.weight.data = (1 + 0.1 * torch.randn(h, generator=gen)).to(BF16)
    block, norm = block.to(c.device), norm.to(c.device)
    x = torch.randn(1, 5, h, generator=gen).to(BF16).to(c.device)
    residual = torch.randn(1, 5, h, generator=gen).to(BF16).to(c.device)

    def layer(x, residual):
        out = block(x)
        dist.all_reduce(out)
        hs = residual + out
        return norm(hs), hs

    gm, report, want, got = fuse_and_run(layer, (x, residual), c)
    assert counts(gm) == {MOE_AR: 1} and op_eps(gm) == [1e-5], report
    assert report.count("commfuse::moe_all_reduce") == 1 and not report.skipped, report
    assert report.fused[0].spelling.startswith("(rows * w[:, None]).view(t, k, h).sum(dim=1).to(bfloat16)"), report
    assert got[0].shape == (1, 5, h) and got[1].shape == (1, 5, h)
    assert_rounding_order_close(got, want, ["norm", "residual"])  # k = 2, float32 weights: the combine exact


# --------------------------------------------------------------------------- not the combine: reported, the tail fused


def _tail(out, residual, weight):
    dist.all_reduce(out)
    hs = residual + out
    return weight_before_cast_norm(hs, weight), hs


def with_combine(c, gen, combine, t=6, k=2, h=64):
    """fuse_and_run of the layer with `combine(x, rows, w, t, k, h)` written in (float32 routing weights)."""
    args, _ = moe_setup(c, gen, t, h)

    def layer(x, router, w_up, w_down, ws_up, ws_down, residual, weight):
        w, sel = route(x, router, k, "f32")
        rows = expert_rows(x, sel, w_up, w_down)
        return _tail(combine(x, rows, w, t, k, h), residual, weight)

    return fuse_and_run(layer, args, c)


def negative(c, gen, combine, skipped=1, **shape):
    """The layer with `combine` written in: the tail fused without it, the outputs the graph's; returns the
    report's "moe combine" skips (`skipped` of them; the only one where that is 1)."""
    gm, report, want, got = with_combine(c, gen, combine, **shape)
    assert counts(gm) == {FUSED_AR: 1}, report
    assert report.count("commfuse::fused_all_reduce") == 1, report
    skips = [s for s in report.skipped if s.what == "moe combine"]
    assert len(skips) == skipped, report
    assert_same(got, want)  # the combine stays as the graph has it; the tail is exact
    return skips[0] if skipped == 1 else skips


@mpi
@pytest.mark.parametrize("added_in", ["T", "float32"])
def test_the_combine_added_to_itself_is_no_shared_expert(quiet_comm, gen, added_in):
    """routed + routed is twice the combine, not a shared expert's output added to it: the combine stays
    in the graph, and the all-reduce tail is fused as usual."""
    def combine(x, rows, w, t, k, h):
        routed = (rows.view(t, k, h) * w.unsqueeze(-1)).sum(dim=1)
        if added_in == "T":
            routed = routed.to(x.dtype)
            return routed + routed
        return (routed + routed).to(x.dtype)

    negative(quiet_comm, gen, combine, skipped=0)


@mpi
def test_the_combine_as_its_own_sums_residual_is_not_erased(quiet_comm, gen):
    """all_reduce(routed) + routed: the add's residual is the combine itself, which the op would erase while
    reading it (the pass stopped on its own assertion). The combine stays; the all-reduce tail is fused."""
    t, k, h = 6, 2, 64
    c = quiet_comm
    args, _ = moe_setup(c, gen, t, h)

    def layer(x, router, w_up, w_down, ws_up, ws_down, residual, weight):
        w, sel = route(x, router, k, "f32")
        routed = (expert_rows(x, sel, w_up, w_down).view(t, k, h) * w.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        hs = reduce("funcol", c, routed) + routed
        return weight_before_cast_norm(hs, weight), hs

    gm, report, want, got = fuse_and_run(layer, args, c)
    assert counts(gm) == {FUSED_AR: 1}, report
    (s,) = [s for s in report.skipped if s.what == "moe combine"]
    assert s.kind == "pattern" and "is the combine's own result" in s.reason, report
    assert_same(got, want)


@mpi
def test_one_tokens_combine_broadcast_by_the_shared_add_is_no_combine(quiet_comm, gen):
    """(routed + shared.float()).to(T) where routed is one token's combine that the add broadcasts over every
    token: the op's combine is one row per token, so it stays in the graph (not reported: no combine of the
    all-reduce's rows is there), and the tail is fused."""
    def combine(x, rows, w, t, k, h):
        routed = (rows.view(t, k, h)[:1] * w[:1].unsqueeze(-1)).sum(dim=1)
        return (routed + x.float()).to(x.dtype)

    negative(quiet_comm, gen, combine, skipped=0)


@mpi
@pytest.mark.parametrize("form", ["reduce", "gathered"])
def test_sum_in_t_of_float32_products_is_noted(quiet_comm, gen, form):
    """sum(dim=1, dtype=T) casts each float32 product to T before the sum: the op's combine rounds once, so the
    report says so (its numerics note) and spells the dtype. gathered: HF grouped_mm's spelling, rows in expert
    order weighted, gathered back by the inverse permutation, then the same sum."""
    def combine(x, rows, w, t, k, h, cast=True):
        if form == "reduce":
            products = rows.view(t, k, h).float() * w.unsqueeze(-1)
        else:
            perm = _reversed(t * k, x.device)
            weighted = rows[perm] * w.reshape(-1)[perm].unsqueeze(-1)  # float32 products (w is float32)
            products = weighted[_hf_inverse(perm, t * k)].view(t, k, h)
        return products.sum(dim=1, dtype=x.dtype) if cast else products.sum(dim=1).to(x.dtype)

    same = torch.Generator().set_state(gen.get_state())
    gm, report, _, got = with_combine(quiet_comm, gen, combine)
    assert counts(gm) == {MOE_AR: 1}, report
    f = report.fused[0]
    assert ".sum(dim=1, dtype=bfloat16)" in f.spelling, report
    assert any("rounding each product" in n and "dtype=" in n for n in f.notes), report
    # The op's combine is the float32 sum's (k = 2: exact), whatever the graph's dtype=.
    _, _, want, _ = with_combine(quiet_comm, same, lambda *a: combine(*a, cast=False))
    assert_same(got, want)


@mpi
def test_products_in_t_summed_in_float32_are_noted(quiet_comm, gen):
    """(y * w.to(T).unsqueeze(-1)).sum(dim=1, dtype=float32): the products are computed, so rounded, in T before the
    sum's dtype= casts them to float32; the op's are float32, so the report says so (its numerics note)."""
    def combine(x, rows, w, t, k, h, rounded=True):
        y, wt = rows.view(t, k, h), w.to(x.dtype).unsqueeze(-1)
        products = y * wt if rounded else y.float() * wt.float()
        return products.sum(dim=1, dtype=torch.float32).to(x.dtype)

    same = torch.Generator().set_state(gen.get_state())
    gm, report, _, got = with_combine(quiet_comm, gen, combine)
    assert counts(gm) == {MOE_AR: 1}, report
    assert any("multiplies the expert outputs by the routing weights in bfloat16, rounding each product" in n
               for n in report.fused[0].notes), report
    # The op's combine is that of the float32 products (exact: bf16 times bf16), whatever the graph rounds.
    _, _, want, _ = with_combine(quiet_comm, same, lambda *a: combine(*a, rounded=False))
    assert_same(got, want)


@mpi
def test_sum_over_another_dim_is_not_the_combine(quiet_comm, gen):
    def combine(x, rows, w, t, k, h):  # the slots on dim 0: [k, t, h]
        return (rows.view(t, k, h).transpose(0, 1) * w.t().unsqueeze(-1)).sum(dim=0).to(x.dtype)

    s = negative(quiet_comm, gen, combine)
    assert s.kind == "pattern" and "over dim 0" in s.reason and "summed over dim 1" in s.reason, s


@mpi
def test_a_combine_summed_in_float64_is_reported(quiet_comm, gen):
    """.sum(dim=1, dtype=torch.float64).to(T): another sum than the op's (float32), left with the tail fused; the
    report said nothing of it."""
    def combine(x, rows, w, t, k, h):
        return (rows.view(t, k, h) * w.unsqueeze(-1)).sum(dim=1, dtype=torch.float64).to(x.dtype)

    s = negative(quiet_comm, gen, combine)
    assert s.kind == "pattern" and "casts the products to float64" in s.reason, s


@mpi
def test_weights_on_another_axis_are_not_routing_weights(quiet_comm, gen):
    def combine(x, rows, w, t, k, h):  # a per-token gate over h, not one weight per (token, slot)
        g = torch.sigmoid(x.float())
        return (rows.view(t, k, h) * g.unsqueeze(1)).sum(dim=1).to(x.dtype)

    s = negative(quiet_comm, gen, combine)
    assert s.kind == "pattern" and "not expert outputs" in s.reason and "[6, 2, 1]" in s.reason, s


@mpi
def test_combine_read_elsewhere_is_not_replaced(quiet_comm, gen):
    t, k, h = 6, 2, 64
    c = quiet_comm
    args, _ = moe_setup(c, gen, t, h)

    def layer(x, router, w_up, w_down, ws_up, ws_down, residual, weight):
        w, sel = route(x, router, k, "f32")
        rows = expert_rows(x, sel, w_up, w_down)
        routed = (rows.view(t, k, h) * w.unsqueeze(-1)).sum(dim=1)
        peak = routed.abs().amax()  # read before the all-reduce: the op does not return it
        n, hs = _tail(routed.to(x.dtype), residual, weight)
        return n, hs, peak

    gm, report, want, got = fuse_and_run(layer, args, c)
    assert counts(gm) == {FUSED_AR: 1}, report
    (s,) = [s for s in report.skipped if s.what == "moe combine"]
    assert s.kind == "guard" and "also read by" in s.reason, report
    assert_same(got, want)


@mpi
def test_shared_add_with_alpha_is_not_the_combine(quiet_comm, gen):
    """torch.add(routed, shared, alpha=2) in float32 scales the shared term: not the op's combine, so the
    combine stays in the graph (the tail is still fused) and the outputs are the graph's."""
    def combine(x, rows, w, t, k, h):
        routed = (rows.view(t, k, h) * w.unsqueeze(-1)).sum(dim=1)
        return torch.add(routed, (x * 0.5).float(), alpha=2.0).to(x.dtype)

    negative(quiet_comm, gen, combine, skipped=0)


def _gathered(perm_of, inverse, permute_weights=True):
    """HF grouped_mm's combine order: the rows in expert order (perm), weighted, gathered back to token
    order by `inverse(perm, n)`, summed over the top-k axis."""

    def combine(x, rows, w, t, k, h):
        perm = perm_of(t * k, x.device)
        wp = w.reshape(-1)[perm] if permute_weights else w.reshape(-1)
        weighted = rows[perm] * wp.unsqueeze(-1)
        return weighted[inverse(perm, t * k)].view(t, k, h).sum(dim=1).to(x.dtype)

    return combine


def _reversed(n, device):
    return torch.arange(n - 1, -1, -1, device=device)


def _hf_inverse(perm, n, values=lambda n, device: torch.arange(n, device=device)):
    inv = torch.empty_like(perm)
    inv[perm] = values(n, perm.device)
    return inv


def _sorted_perm(n, device):
    """A sort's indices (transformers sorts the expert ids): 5 is coprime to n = t * k here, so the keys are
    distinct and the permutation is not the identity."""
    return torch.argsort(torch.arange(n, device=device) * 5 % n)


# The inverse permutation as transformers versions write it: scattered by setitem, or the argsort of the sort's
# indices (a permutation, whose argsort is its inverse).
INVERSES = {"setitem": (_reversed, _hf_inverse), "argsort": (_sorted_perm, lambda perm, n: torch.argsort(perm)),
            "sort's indices": (lambda n, d: torch.sort(torch.arange(n, device=d) * 5 % n)[1],
                               lambda perm, n: perm.argsort(stable=True))}


@mpi
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("inverse", sorted(INVERSES))
def test_gathered_rows_are_the_finalize_form(quiet_comm, gen, k, inverse):
    """HF grouped_mm's experts: rows in expert order weighted, gathered back by the inverse permutation, summed
    over the top-k axis: moe_all_reduce's finalize form (y the rows, row_index the inverse viewed [t, k])."""
    gm, report, want, got = with_combine(quiet_comm, gen, _gathered(*INVERSES[inverse]), k=k)
    assert counts(gm) == {MOE_AR: 1}, report
    assert not report.skipped, report
    assert report.fused[0].spelling.startswith("(rows * w[perm][:, None])[inv_perm].view(t, k, h).sum(dim=1)"), report
    (op,) = [n for n in gm.graph.nodes if n.target is MOE_AR]
    assert op.args[2] is not None  # the row index: the finalize form
    if k == 2:  # float32 products, two terms: the combine exact; the tail as the graph's
        assert_same(got, want)
    else:  # four: torch's sum order and the op's slot order a few float32 ulps apart
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close_under_sum_order(g, w, i)


@mpi
def test_the_sorts_values_written_in_place_leave_its_permutation_alone(quiet_comm, gen):
    """HF grouped_mm sorts the expert ids (`expert_ids_g, perm = torch.sort(expert_ids)`) and may clamp the sorted
    ids in place before the gather (`expert_ids_g.clamp_`, as some transformers versions do): sort's two outputs
    are separate tensors, so the permutation is unchanged and the combine is still the finalize form."""
    def combine(x, rows, w, t, k, h):
        ids = torch.arange(t * k, device=x.device) * 5 % (t * k)  # 5 coprime to t * k = 12: distinct keys
        ids_sorted, perm = torch.sort(ids)
        weighted = rows[perm] * w.reshape(-1)[perm].unsqueeze(-1)
        ids_sorted.clamp_(max=3)
        return weighted[_hf_inverse(perm, t * k)].view(t, k, h).sum(dim=1).to(x.dtype)

    gm, report, want, got = with_combine(quiet_comm, gen, combine)
    assert counts(gm) == {MOE_AR: 1}, report
    assert not report.skipped, report
    assert_same(got, want)


@mpi
def test_a_write_to_the_rows_a_gather_copied_leaves_the_combine_alone(quiet_comm, gen):
    """rows[perm] is a copy (indexing by a tensor): a write to the rows after the gather changes nothing the combine
    reads, so the combine is still the finalize form. The gather was taken for a view, the expert outputs for
    "written in place", and the whole tail left unfused."""
    def combine(x, rows, w, t, k, h):
        r = rows * 1.0
        ids_sorted, perm = torch.sort(torch.arange(t * k, device=x.device) * 5 % (t * k))
        yg = r[perm]
        weighted = yg * w.reshape(-1)[perm].unsqueeze(-1)
        out = weighted[_hf_inverse(perm, t * k)].view(t, k, h).sum(dim=1).to(x.dtype)
        r.mul_(0)  # the gather's source, not its copy
        return out

    gm, report, want, got = with_combine(quiet_comm, gen, combine)
    assert counts(gm) == {MOE_AR: 1}, report
    assert not report.skipped, report
    assert_same(got, want)


def _zeroed(mask_shape, value=0.0, after_gather=False):
    """transformers 5.8-5.9's grouped_mm combine: the weighted rows of some slots (expert-parallel sentinels,
    the sorted ids past the experts) zeroed in place between the products and the gather."""
    def combine(x, rows, w, t, k, h):
        n = t * k
        ids_sorted, perm = torch.sort(torch.arange(n, device=x.device) * 5 % n)
        mask = ids_sorted >= n - 3  # three rows zeroed
        mask = mask.unsqueeze(-1) if mask_shape == "[R, 1]" else mask
        weighted = rows[perm] * w.reshape(-1)[perm].unsqueeze(-1)
        if not after_gather:
            weighted.masked_fill_(mask, value)
        gathered = weighted[_hf_inverse(perm, n)]
        if after_gather:
            weighted.masked_fill_(mask, value)
        return gathered.view(t, k, h).sum(dim=1).to(x.dtype)

    return combine


@mpi
def test_gathered_rows_zeroed_by_a_mask_are_dropped_slots(quiet_comm, gen):
    """Rows zeroed by masked_fill_(mask, 0) before the gather add nothing: the op takes their slots as dropped
    (row index -1; its sum starts at +0.0, so a zeroed row's +0.0 changes nothing either), and the outputs are
    the graph's bit for bit (k = 2: the combine exact)."""
    gm, report, want, got = with_combine(quiet_comm, gen, _zeroed("[R, 1]"))
    assert counts(gm) == {MOE_AR: 1}, report
    assert not report.skipped, report
    assert ".masked_fill_(mask, 0)[inv_perm]" in report.fused[0].spelling, report
    (op,) = [n for n in gm.graph.nodes if n.target is MOE_AR]
    assert op.args[2] is not None  # the row index, with -1 where the mask holds
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("spelling", ["the mask", "its source through a no-op cast", "its source through ravel"])
def test_gathered_rows_mask_written_after_the_fill_is_not_matched(quiet_comm, gen, spelling):
    """The op reads the zeroed rows' mask at the tail: a write to it after the fill, also through the tensor a
    no-op cast (.bool() of a bool tensor) or ravel returns itself, keeps the combine in the graph."""
    def combine(x, rows, w, t, k, h):
        n = t * k
        ids_sorted, perm = torch.sort(torch.arange(n, device=x.device) * 5 % n)
        flags = (ids_sorted >= n - 3).view(1, n)
        mask = {"the mask": (ids_sorted >= n - 3).unsqueeze(-1), "its source through a no-op cast": flags.bool()[0, :, None],
                "its source through ravel": flags.ravel().unsqueeze(-1)}[spelling]
        weighted = rows[perm] * w.reshape(-1)[perm].unsqueeze(-1)
        weighted.masked_fill_(mask, 0.0)
        out = weighted[_hf_inverse(perm, n)].view(t, k, h).sum(dim=1).to(x.dtype)
        (mask if spelling == "the mask" else flags).fill_(False)
        return out

    gm, report, want, got = with_combine(quiet_comm, gen, combine)
    assert MOE_AR not in counts(gm), report
    assert "mask" in " ".join(s.reason for s in report.skipped if "written in place" in s.reason), report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("case", ["filled with 1", "filled after the gather", "a mask over the columns"])
def test_gathered_rows_filled_otherwise_are_not_matched(quiet_comm, gen, case):
    """A fill with another value is no dropped slot, one after the gather leaves the gathered rows as they were
    (the op reads the rows at the tail), and a mask of R = t * k = h elements broadcasts over the columns, not
    the rows: the combine stays in the graph, reported, the tail fused."""
    combine = {"filled with 1": _zeroed("[R, 1]", value=1.0), "filled after the gather": _zeroed("[R, 1]", after_gather=True),
               "a mask over the columns": _zeroed("[R]")}[case]
    s = negative(quiet_comm, gen, combine, **({"t": 32} if case == "a mask over the columns" else {}))
    assert "also read by masked_fill_" in s.reason, s


@mpi
@pytest.mark.parametrize("case", ["gathered by the permutation", "not its inverse", "weights not permuted",
                                  "argsort of an index not known to be a permutation", "descending argsort"])
def test_gathered_rows_not_the_finalize_form(quiet_comm, gen, case):
    """Gathers that are not the inverse of the rows' permutation, or weights not permuted with the rows: the
    combine left as written, reported, the tail fused. The argsort of an index is its inverse only where the
    index is a permutation, which the graph shows only for a sort's indices."""
    combine = {"gathered by the permutation": _gathered(_reversed, lambda perm, n: perm),
               "not its inverse": _gathered(lambda n, d: torch.arange(n, device=d) * 5 % n,  # 5 coprime to t * k = 12
                                            lambda p, n: _hf_inverse(p, n, _reversed)),
               "weights not permuted": _gathered(_reversed, _hf_inverse, permute_weights=False),
               "argsort of an index not known to be a permutation": _gathered(_reversed, lambda p, n: torch.argsort(p)),
               "descending argsort": _gathered(_sorted_perm, lambda p, n: torch.argsort(p, descending=True))}[case]
    s = negative(quiet_comm, gen, combine)
    assert s.kind == "pattern" and "gathered" in s.reason, s


@mpi
def test_gathered_rows_weights_broadcast_over_rows_are_not_matched(quiet_comm, gen):
    """w[perm] viewed [1, t * k] multiplies each row by every weight, which t * k == h lets broadcast: not one
    weight per row, so not the finalize form, though every node but the multiplier's shape is."""
    def combine(x, rows, w, t, k, h):
        perm = _reversed(t * k, x.device)
        weighted = rows[perm] * w.reshape(-1)[perm].view(1, -1)
        return weighted[_hf_inverse(perm, t * k)].view(t, k, h).sum(dim=1).to(x.dtype)

    s = negative(quiet_comm, gen, combine, t=32)
    assert "permuted like them" in s.reason, s


@mpi
def test_gathered_rows_weights_of_more_than_the_rows_are_not_matched(quiet_comm, gen):
    """w_all[perm] where w_all holds more weights than there are rows: the gather picks one a row, but the op
    takes the routing weights as [t, k] of w_all itself. Not matched, reported; the tail fused."""
    def combine(x, rows, w, t, k, h):
        perm = _reversed(t * k, x.device)
        w_all = torch.cat([w.reshape(-1), torch.ones(2, device=x.device)])
        weighted = rows[perm] * w_all[perm].unsqueeze(-1)
        return weighted[_hf_inverse(perm, t * k)].view(t, k, h).sum(dim=1).to(x.dtype)

    s = negative(quiet_comm, gen, combine)
    assert "permuted like them" in s.reason, s


@mpi
@pytest.mark.parametrize("written", ["perm", "perm through out=", "rows"])
def test_gathered_rows_written_in_place_are_not_matched(quiet_comm, gen, written):
    """perm changed in place after the rows and weights were permuted by it (inv is then not their inverse;
    also as a call's `out=`, which dynamo keeps), or the rows written after the combine read them (the op
    would read them at the tail): not fused with the combine, and the outputs are the graph's."""
    def combine(x, rows, w, t, k, h):
        perm = _sorted_perm(t * k, x.device)
        permuted = rows[perm]
        weighted = permuted * w.reshape(-1)[perm].unsqueeze(-1)
        if written == "perm":
            perm.copy_(perm.roll(1))
        elif written == "perm through out=":
            torch.remainder(perm + 1, t * k, out=perm)
        inverse = torch.argsort(perm) if written == "perm through out=" else _hf_inverse(perm, t * k)
        out = weighted[inverse].view(t, k, h).sum(dim=1).to(x.dtype)
        if written == "rows":
            permuted.mul_(3)
        return out

    gm, report, want, got = with_combine(quiet_comm, gen, combine)
    assert MOE_AR not in counts(gm), report
    reasons = " ".join(s.reason for s in report.skipped)
    assert ("written in place (mul_)" if written == "rows" else "not the inverse of a permutation") in reasons, report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("written", ["weights", "float32 outputs", "gathered weights", "weights through a no-op cast",
                                     "weights through ravel", "weights through an in-place op's result",
                                     "weights gathered, then written"])
def test_combine_inputs_written_after_their_reads_are_not_matched(quiet_comm, gen, written):
    """An input of the combine written in place after the graph read it through a view, a cast or a gather
    (the weights' unsqueeze, y's float32 cast, w[perm]; a cast to the dtype w has, ravel and an in-place op return
    w itself), before the tail: the op would read it at the tail, after the write. Nothing is fused, the reason
    says so, and the outputs are the graph's."""
    def combine(x, rows, w, t, k, h):
        if written == "weights":
            out = (rows.view(t, k, h) * w.unsqueeze(-1)).sum(dim=1)
            w.mul_(0.5)
        elif written == "weights gathered, then written":  # the gather copies w before the write
            n = t * k
            perm = _reversed(n, x.device)
            gw = w.reshape(-1)[perm]
            w.mul_(3.0)
            out = (rows[perm] * gw.unsqueeze(-1))[_hf_inverse(perm, n)].view(t, k, h).sum(dim=1)
        elif written == "weights through an in-place op's result":
            alias = w.mul_(1.0)
            out = (rows.view(t, k, h) * w.unsqueeze(-1)).sum(dim=1)
            alias.mul_(3.0)
        elif written in ("weights through a no-op cast", "weights through ravel"):
            n = t * k
            _, perm = torch.sort(torch.arange(n, device=x.device) * 5 % n)
            wv = w.type(torch.float32).reshape(-1) if written == "weights through a no-op cast" else w.ravel()
            out = (rows[perm] * wv[perm].unsqueeze(-1))[_hf_inverse(perm, n)].view(t, k, h).sum(dim=1)
            w.mul_(2.0)
        elif written == "float32 outputs":
            y = rows.to(x.dtype).view(t, k, h)
            out = (y.float() * w[..., None]).sum(dim=1)
            y.mul_(3)
        else:
            perm = _reversed(t * k, x.device)
            out = (rows[perm] * w.reshape(-1)[perm].unsqueeze(-1))[_hf_inverse(perm, t * k)].view(t, k, h).sum(dim=1)
            w.view(-1)[0] = 100
        return out.to(x.dtype)

    gm, report, want, got = with_combine(quiet_comm, gen, combine)
    assert MOE_AR not in counts(gm) and FUSED_AR not in counts(gm), report
    assert "is written in place" in " ".join(s.reason for s in report.skipped), report
    assert_same(got, want)


@mpi
def test_index_add_combine_is_reported(quiet_comm, gen):
    """HF Mixtral's older eager experts loop: one graph in torch 2.13 (torch.where per expert traced with
    data-dependent sizes), the combine an index_add_ into zeros: not matched, the tail still fused."""
    t, k, h = 6, 2, 64
    c = quiet_comm
    args, _ = moe_setup(c, gen, t, h)

    def layer(x, router, w_up, w_down, ws_up, ws_down, residual, weight):
        w, sel = route(x, router, k, "T")
        final = torch.zeros((t, h), dtype=x.dtype, device=x.device)
        mask = F.one_hot(sel, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            slot, tok = torch.where(mask[e])
            cur = F.linear(F.silu(F.linear(x[tok], w_up[e])), w_down[e]) * w[tok, slot, None]
            final.index_add_(0, tok, cur.to(x.dtype))
        return _tail(final, residual, weight)

    try:
        gm, report, want, got = fuse_and_run(layer, args, c)
    except Exception as e:  # noqa: BLE001 - a torch that cannot trace it in one graph: nothing to fuse
        pytest.skip(f"dynamo does not trace the per-expert loop in one graph here: {type(e).__name__}")
    assert counts(gm) == {FUSED_AR: 1}, report
    (s,) = [s for s in report.skipped if s.what == "moe combine"]
    assert s.kind == "pattern" and "the all-reduced tensor is built by an index_add_" in s.reason, report
    assert_same(got, want)
