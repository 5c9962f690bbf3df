"""commfuse.fusion: every pattern found and rewritten, results against the unfused graph, every
negative case skipped with its reason.

Graphs are captured the way a torch.compile backend sees them (dynamo's torch-level graph, by a
backend that keeps it), plus make_fx's aten-level graph and torch.fx.symbolic_trace's; the pass runs
on them directly (no compiler: fast on a CPU), and one end-to-end test goes through
commfuse.fusion.compile with aot_eager. Multi-rank tests (mpi, world >= 2) run over gloo on CPU:
there the all-reduce is exact and the fused route is commfuse.reference, so a rewrite is bit-exact
wherever the graph computes in commfuse's rounding order; where the report notes another order
(HF's weight multiply after the cast back), the residual is exact, the norm within 1 ulp of T, and the
codes those of the fused norm (docs/fusion.md, "Tolerances").
"""
import collections
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F

import commfuse
from commfuse import fusion, reference, tolerance
from commfuse.fusion import graph as G
from commfuse.tail.spec import code as spec_code, public

from compare import assert_within_ulp, bits_equal
from inputs import rank_inputs, tail_inputs

mpi = pytest.mark.mpi(min_size=2)
BF16 = torch.bfloat16
FUSED_AR = torch.ops.commfuse.fused_all_reduce.default
LOCAL = torch.ops.commfuse.fused_add_rmsnorm.default
GATED = torch.ops.commfuse.gated_rmsnorm.default


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# --------------------------------------------------------------------------- helpers


def capture(fn, *args, dynamic=False, raises=None):
    """(dynamo's graph of fn(*args) as a torch.compile backend receives it, copies of its inputs in the
    graph's own order: placeholders follow first use, and closed-over tensors are inputs too)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, _cloned(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=keep, fullgraph=True, dynamic=dynamic)
    if raises is None:
        compiled(*_cloned(args))
    else:
        with pytest.raises(raises):
            compiled(*_cloned(args))
    assert len(graphs) == 1
    return graphs[0]


def on_gpu(gm, monkeypatch, sm=(9, 0)):
    """gm's metadata as on a graph captured on a CUDA device of SM `sm` (this machine has none): each value a
    fake CUDA tensor of its shape, dtype and strides. The pass then plans the local ops as on that GPU. sm None:
    the SM is this process's own to read (none without CUDA)."""
    if sm is not None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: sm)

    def cuda(v):
        if not isinstance(v, torch.Tensor) or getattr(v, "fake_mode", None) is None:
            return v
        with v.fake_mode:
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda")

    for n in gm.graph.nodes:
        for key in ("val", "example_value"):
            if key in n.meta:
                n.meta[key] = torch.utils._pytree.tree_map(cuda, n.meta[key])
    return gm


def _cloned(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


_EPS_ARG = {FUSED_AR: 4, LOCAL: 4, GATED: 4, torch.ops.commfuse.moe_all_reduce.default: 7}


def op_eps(gm) -> list:
    """The eps argument of each fused op of the graph: the graph's own norm's, which the outputs barely
    show (rows of mean square far above eps)."""
    return [n.args[_EPS_ARG[n.target]] for n in gm.graph.nodes if n.target in _EPS_ARG]


def counts(gm) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function"
                               and str(n.target).startswith("commfuse."))


def fuse_and_run(fn, args, comm, **capture_kw):
    """(graph, report, unfused outputs, fused outputs): the graph is captured, run, fused in place, run again."""
    gm, inputs = capture(fn, *args, **capture_kw)
    want = gm(*_cloned(inputs))
    report = fusion.fuse(gm, comm)
    got = gm(*_cloned(inputs))
    return gm, report, list(want), list(got)


def sum_order() -> str:
    """What sets the unfused graph's outputs apart from commfuse's. "none": nothing, bit for bit (at most two
    ranks: gloo sums in T in its own order, which for two ranks is one addition, the fp32 rank-order sum rounded
    once; on the CPU the fused op is the separated reference). "norm": on a GPU the fused op is a kernel with the
    reference's bits, but the graph's norm sums its squares in torch's CUDA order, so a norm may land 1 ulp of T
    away and its codes on a neighbour. "sum": more than two ranks, whose sums round in another order too."""
    world = dist.get_world_size() if dist.is_initialized() else 1  # the local tests need no group
    if world > 2:
        return "sum"
    return "norm" if torch.cuda.is_available() else "none"


def exact_sums() -> bool:
    return sum_order() == "none"


def assert_close_under_norm_order(g, w, i):
    """A GPU kernel against the graph at two ranks at most ("norm" above): T values within 1 ulp; float32 values
    (scales that follow the norm's maximum) within 2^-7, one bf16 ulp, of the graph's; FP8 codes equal or a
    neighbour; integer and bool outputs equal; packed codes and scale factors (uint8, int32)
    as assert_close_under_sum_order takes them."""
    assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}"
    if g.numel() == 0:
        return
    if g.dtype in (torch.bfloat16, torch.float16):
        assert_within_ulp(g, w, 1, f"output {i}")
    elif g.dtype == torch.float32:  # one bf16 ulp of a maximum (amax / 448 or 448 / amax), NaN and Inf exactly
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g)), f"output {i}: non-finite values differ"
        assert torch.equal(g[~finite].nan_to_num(), w[~finite].nan_to_num()), f"output {i}: non-finite values differ"
        assert ((g[finite] - w[finite]).abs() <= 2.0 ** -7 * w[finite].abs()).all(), f"output {i} beyond 2^-7"
    elif g.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        nan = 0x7F if g.dtype == torch.float8_e4m3fn else None  # e5m2's NaNs and infinities: the exponent's top codes
        why, _ = tolerance.codes_close(g.view(torch.uint8), w.view(torch.uint8), 0x80, 1.0, f"output {i}", nan)
        assert why is None, why
    elif g.dtype in (torch.uint8, torch.int32):
        assert_close_under_sum_order(g, w, i)
    else:
        assert torch.equal(g, w), f"output {i} differs"


def assert_close_under_sum_order(g, w, i):
    """More than two ranks: the graph's sum and commfuse's differ by a few ulps of T, which the norm and
    quantization carry on; values (dequantized codes for FP8) within 5% of the output's largest
    magnitude, byte outputs (packed codes, scale factors) equal in at least 90% of places, integer and bool
    outputs equal."""
    assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}"
    if g.numel() == 0:
        return
    if g.dtype == torch.float8_e4m3fn:  # values of codes: a step is 12.5% of a value
        gf, wf = g.float(), w.float()
        scale = wf[torch.isfinite(wf)].abs().max().clamp_min(1e-30)
        assert ((gf - wf).abs() <= 0.13 * wf.abs() + 0.05 * scale).all(), f"output {i}: FP8 beyond the sum's order"
        return
    if g.dtype in (torch.uint8, torch.int32):
        assert (g != w).float().mean() <= 0.1, f"output {i}: over 10% of its bytes differ"
        return
    if not (g.is_floating_point() or g.is_complex()):
        assert torch.equal(g, w), f"output {i} differs"
        return
    gf, wf = g.float(), w.float()
    finite = torch.isfinite(wf)
    assert torch.equal(finite, torch.isfinite(gf)), f"output {i}: non-finite values differ"
    assert torch.equal(gf[~finite].nan_to_num(), wf[~finite].nan_to_num()), f"output {i}: non-finite values differ"
    if finite.any():
        scale = wf[finite].abs().max().clamp_min(1e-30)
        assert ((gf[finite] - wf[finite]).abs() <= 0.05 * scale).all(), f"output {i} differs beyond the sum's order"


def assert_close(g, w, i):
    """Output i of a fused graph against the unfused one's, as close as sum_order() allows."""
    order = sum_order()
    if order == "none":
        assert bits_equal(g, w), f"output {i} differs"
    elif order == "norm":
        assert_close_under_norm_order(g, w, i)
    else:
        assert_close_under_sum_order(g, w, i)


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, i)


def assert_rounding_order_close(got, want, kinds):
    """Outputs of a rewrite whose report notes another rounding order: kinds[i] is "residual" (exact),
    "norm" (1 ulp of T) or "fp8" (a neighbouring code at most)."""
    if sum_order() == "sum":
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close_under_sum_order(g, w, i)
        return
    for g, w, k in zip(got, want, kinds):
        assert g.shape == w.shape and g.dtype == w.dtype, k
        if k == "residual":
            assert bits_equal(g, w), "residual differs"
        elif k == "norm":
            assert_within_ulp(g, w, 1, "norm")
        else:
            why, _ = tolerance.codes_close(g.view(torch.uint8), w.view(torch.uint8), 0x80, 1.0, "fp8", 0x7F)
            assert why is None, why


def assert_codes_of_the_fused_norm(q, h, weight, scale, eps=1e-6, weight_offset=0.0):
    """The FP8 codes of a fused tail whose graph rounds in another order: exactly the codes of commfuse's norm of
    its residual output h (the op's semantics), where the route is exact; assert_rounding_order_close only
    bounds them by a neighbouring code of the graph's."""
    if exact_sums():
        norm = reference.rmsnorm(h.reshape(-1, h.shape[-1]), weight, eps, weight_offset)
        assert bits_equal(q.reshape(norm.shape), reference.quantize_fp8(norm, scale)), "codes"


def setup(comm, gen, t=6, h=128, dtype=BF16, quant=None, shape=None):
    x, _ = rank_inputs(comm, gen, shape or (t, h), dtype)
    residual, weight, scale = tail_inputs(comm, gen, t, h, dtype, quant)
    if shape is not None:
        residual = residual.view(shape)
    wo = (torch.randn(h, h, generator=gen) / h ** 0.5).to(comm.device, dtype)
    return x, residual, weight, scale, wo


def rms_norm_module(weight, eps):
    """An nn.RMSNorm holding `weight` (of the norm's hidden size, dtype and device)."""
    norm = torch.nn.RMSNorm(weight.shape[-1], eps=eps, dtype=weight.dtype, device=weight.device)
    norm.weight.copy_(weight)
    return norm


def all_reduced_sum(x, residual, wo):
    """A row-parallel projection's end as models write it: linear, in-place dist.all_reduce, residual add."""
    y = F.linear(x, wo)
    dist.all_reduce(y)
    return residual + y


def hf_norm(h, w, eps=1e-6):
    """HF LlamaRMSNorm.forward (Qwen2 and Mistral write the same)."""
    input_dtype = h.dtype
    hidden_states = h.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return w * hidden_states.to(input_dtype)


def weight_before_cast_norm(h, w, eps=1e-6):
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (hf * w).to(h.dtype)


def torch_norm(h, w, eps=1e-6):
    return F.rms_norm(h, (h.shape[-1],), w, eps)


def gemma_norm(h, w, eps=1e-6):
    """HF GemmaRMSNorm.forward."""
    x = h.float()
    output = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + w.float())
    return output.type_as(h)


def twice_cast_norm(h, w, eps=1e-6):
    """The input cast to float32 twice (two nodes: one for the square, one for the multiply)."""
    v = h.float().pow(2).mean(-1, keepdim=True)
    return w * (h.float() * torch.rsqrt(v + eps)).to(h.dtype)


NORMS = {"hf": hf_norm, "weight_before_cast": weight_before_cast_norm, "torch": torch_norm,
         "twice_cast": twice_cast_norm}
EXACT = {"hf": False, "weight_before_cast": True, "torch": True, "twice_cast": False}


def reduce(kind, comm, y):
    if kind == "dist":
        dist.all_reduce(y)
        return y
    if kind == "funcol":
        return fc.all_reduce(y, "sum", dist.group.WORLD)
    if kind == "funcol waited":  # waited explicitly: a second wait_tensor in the graph
        return fc.wait_tensor(fc.all_reduce(y, "sum", dist.group.WORLD))
    return commfuse.ops.all_reduce(comm, y)


def fp8(n, scale):
    return (n / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


# --------------------------------------------------------------------------- all-reduce + add + norm (+ quant)


@mpi
@pytest.mark.parametrize("collective", ["dist", "funcol", "funcol waited", "commfuse"])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_all_reduce_add_norm_is_fused(quiet_comm, gen, collective, norm):
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    def layer(x, residual, weight, wo):
        y = reduce(collective, c, F.linear(x, wo))
        h = residual + y
        return norm_fn(h, weight), h

    norm_fn = NORMS[norm]
    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm) == {FUSED_AR: 1} and op_eps(gm) == [1e-6], report
    assert report.count("commfuse::fused_all_reduce") == 1 and not report.skipped, report
    f = report.fused[0]
    assert f.pattern == "all_reduce + add + rmsnorm" and f.comm == c.name
    if EXACT[norm]:
        assert_same(got, want)
    else:
        assert any("after the cast back" in n for _, n in report.numerics), report
        assert_rounding_order_close(got, want, ["norm", "residual"])


@mpi
@pytest.mark.parametrize("order", ["residual + y", "y + residual"])
def test_either_add_operand_order(quiet_comm, gen, order):
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    def layer(x, residual, weight, wo):
        y = F.linear(x, wo)
        dist.all_reduce(y)
        h = residual + y if order == "residual + y" else y + residual
        return torch_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm) == {FUSED_AR: 1}, report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("norm", ["hf", "torch"])
def test_fp8_consumer_feeding_scaled_mm(quiet_comm, gen, norm):
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="fp8")
    wq = (torch.randn(64, 128, generator=gen) * 4).clamp(-448, 448).to(c.device, torch.float8_e4m3fn)
    w_scale = torch.tensor([0.01], device=c.device)

    def layer(x, residual, weight, wo, scale):
        h = all_reduced_sum(x, residual, wo)
        n = NORMS[norm](h, weight)
        q = fp8(n, scale)
        out = torch._scaled_mm(q, wq.t(), scale_a=scale, scale_b=w_scale, out_dtype=BF16)
        return q, h, out

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, scale), c)
    assert counts(gm) == {FUSED_AR: 1}, report
    f = report.fused[0]
    assert f.pattern == "all_reduce + add + rmsnorm + fp8" and f.quant == "fp8" and not f.return_norm, report
    if norm == "torch":
        assert_same(got, want)
    else:
        assert_rounding_order_close(got[:2], want[:2], ["fp8", "residual"])
        assert_codes_of_the_fused_norm(got[0], got[1], weight, scale)


@mpi
def test_fp8_norm_with_several_consumers_keeps_the_norm(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="fp8")

    def layer(x, residual, weight, wo, scale):
        h = all_reduced_sum(x, residual, wo)
        n = hf_norm(h, weight)
        q1, q2 = fp8(n, scale), fp8(n, scale)  # e.g. two projections sharing the input scale
        return q1, q2, n * 2, h + 1  # the norm read elsewhere; the residual used later

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, scale), c)
    assert counts(gm) == {FUSED_AR: 1}, report
    assert report.fused[0].return_norm and report.fused[0].quant == "fp8", report
    q1, q2, n2, h1 = got
    assert bits_equal(q1, q2)
    assert bits_equal(q1, reference.quantize_fp8(n2 / 2, scale)), "codes are not those of the fused norm"
    assert_rounding_order_close(got, want, ["fp8", "fp8", "norm", "residual"])


@mpi
def test_fp8_through_a_view_other_nodes_read_is_reported(quiet_comm, gen):
    """The quantization reads the norm through a view that a router linear reads too (a MoE block's
    x.view(-1, h)): not fused, and the report says why (it used to pass over it in silence)."""
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="fp8")

    def layer(x, residual, weight, wo, scale):
        h = all_reduced_sum(x, residual, wo)
        flat = hf_norm(h, weight).view(-1, 128)
        return fp8(flat, scale), F.linear(flat, wo).sum(), flat, h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, scale), c)
    assert counts(gm) == {FUSED_AR: 1} and report.fused[0].quant is None, report
    why = _skip_reasons(report, "quantization")
    assert len(why) == 1 and "quantizes the norm through flat" in why[0] and "also reads" in why[0], report
    q, _, flat, h = got
    assert bits_equal(q, reference.quantize_fp8(flat, scale)), "the graph's own quantization of the fused norm"
    assert_rounding_order_close([q, flat, h], [want[0], want[2], want[3]], ["fp8", "norm", "residual"])


@mpi
@pytest.mark.parametrize("sf_layout", ["swizzled", "linear"])
def test_nvfp4_through_commfuse_quantize(quiet_comm, gen, sf_layout):
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="nvfp4")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = rms_norm_module(weight, 1e-5)

        def forward(self, x, residual, wo, scale):
            y = commfuse.ops.all_reduce(c, F.linear(x, wo))
            h = y + residual
            q, sf, _ = commfuse.quantize(self.norm(h), "nvfp4", scale, sf_layout)
            return q, sf, h

    gm, report, want, got = fuse_and_run(Block(), (x, residual, wo, scale), c)
    assert counts(gm) == {FUSED_AR: 1} and op_eps(gm) == [1e-5], report
    assert report.fused[0].quant == "nvfp4" and "torch.rms_norm" in report.fused[0].spelling, report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("quant, kw", [("mxfp8", dict(sf_layout="linear")), ("mxfp8", {}),
                                       ("fp8_block", dict(scale_layout="mn_major", scale_ue8m0=True))])
def test_computed_scale_formats_through_commfuse_quantize(quiet_comm, gen, quant, kw):
    """A format that computes its scales (no scale in the graph), with its layout options, is fused into the
    all-reduce tail as commfuse.quantize states it: every output of the quantize op is the fused op's."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = rms_norm_module(weight, 1e-5)

        def forward(self, x, residual, wo):
            y = commfuse.ops.all_reduce(c, F.linear(x, wo))
            h = y + residual
            q, sf, s = commfuse.quantize(self.norm(h), quant, **kw)
            return q, sf if sf is not None else s, h

    gm, report, want, got = fuse_and_run(Block(), (x, residual, wo), c)
    assert counts(gm) == {FUSED_AR: 1} and op_eps(gm) == [1e-5], report
    assert report.fused[0].quant == quant, report
    assert_same(got, want)


@mpi
def test_view_reshape_and_no_op_cast_chains(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="fp8", shape=(2, 3, 128))

    def layer(x, residual, weight, wo, scale):
        y = F.linear(x, wo).reshape(-1, 128)  # [b, s, h] -> [t, h] for the collective, and back
        y = fc.all_reduce(y, "sum", dist.group.WORLD).view(2, 3, 128).to(BF16)
        h = residual + y
        n = torch_norm(h, weight)
        q = fp8(n.view(-1, 128), scale).view(2, 3, 128)
        return q, h, n

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, scale), c)
    assert counts(gm) == {FUSED_AR: 1}, report
    assert [tuple(g.shape) for g in got] == [(2, 3, 128)] * 3
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("spelling", ["F.dropout", "nn.Dropout", "torch.dropout", "training"])
def test_dropout_outside_training_is_no_step(quiet_comm, gen, spelling):
    """Dropout on the residual branch (Seed-OSS's, Phi-3's) returns its input outside training: the tail is fused
    across it. In training it draws a mask, and the all-reduce is left as written."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    module = torch.nn.Dropout(0.1).eval()
    drop = {"F.dropout": lambda y: F.dropout(y, p=0.1, training=False), "nn.Dropout": module,
            "torch.dropout": lambda y: torch.dropout(y, 0.1, False), "training": lambda y: F.dropout(y, 0.1, True)}[spelling]

    def layer(x, residual, weight, wo):
        y = F.linear(x, wo)
        dist.all_reduce(y)
        h = residual + drop(y)
        return torch_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    if spelling == "training":
        assert counts(gm).get(FUSED_AR, 0) == 0, report
        assert [s.what for s in report.skipped] == ["all-reduce"], report
        return
    assert counts(gm) == {FUSED_AR: 1} and not report.skipped, report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("spelling", ["F.dropout", "F.alpha_dropout", "F.feature_alpha_dropout", "nn.Dropout1d"])
def test_all_reduce_in_place_of_a_dropout_output_is_not_fused(quiet_comm, gen, spelling):
    """Outside training every dropout returns its input itself: an in-place all-reduce of its output writes the
    sum into the projection's output too, which the graph also returns; fused, that output would keep the
    partial product."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    drop = {"F.dropout": lambda y: F.dropout(y, 0.1, False), "F.alpha_dropout": lambda y: F.alpha_dropout(y, 0.1, False),
            "F.feature_alpha_dropout": lambda y: F.feature_alpha_dropout(y, 0.1, False),
            "nn.Dropout1d": torch.nn.Dropout1d(0.1).eval()}[spelling]

    def layer(x, residual, weight, wo):
        y = F.linear(x, wo)
        z = drop(y)
        dist.all_reduce(z)
        h = residual + z
        return torch_norm(h, weight), h, y * 1.0

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm).get(FUSED_AR, 0) == 0 and [s.what for s in report.skipped] == ["all-reduce"], report
    assert_same(got, want)


@mpi
def test_commfuse_local_op_after_all_reduce_becomes_fused_all_reduce(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="fp8")

    def layer(x, residual, weight, wo, scale):
        y = fc.all_reduce(F.linear(x, wo), "sum", dist.group.WORLD)
        t = commfuse.fused_add_rmsnorm(y, residual, weight, 1e-6, quant="fp8", scale=scale, return_norm=True)
        return t.residual, t.norm, t.quant

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, scale), c)
    assert counts(gm) == {FUSED_AR: 1}, report
    assert_same(got, want)


@mpi
def test_the_local_op_called_with_keywords_after_an_all_reduce_is_fused(quiet_comm, gen):
    """torch.ops.commfuse.fused_add_rmsnorm with its arguments by keyword (as a graph may carry them): read by
    the schema's names, not unpacked by position (the pass raised)."""
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="fp8")
    tail = spec_code("fp8", return_norm=True)

    def layer(x, residual, weight, wo, scale):
        y = fc.all_reduce(F.linear(x, wo), "sum", dist.group.WORLD)
        return tuple(LOCAL(y, residual=residual, weight=weight, scale=scale, eps=1e-6, weight_offset=0.0, tail=tail))

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, scale), c)
    assert counts(gm) == {FUSED_AR: 1}, report
    assert_same(got, want)


@mpi
def test_commfuse_local_op_after_all_reduce_whose_input_is_written_between_stays(quiet_comm, gen):
    """y written in place between its functional all-reduce and the local op that reads the sum: commfuse's
    fused_all_reduce in the local op's place would reduce the written y. The all-reduce stays, reported with the
    write, as for the same tail written out."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    def layer(x, residual, weight, wo):
        y = F.linear(x, wo)
        s = fc.wait_tensor(fc.all_reduce(y, "sum", dist.group.WORLD))
        y.mul_(0)
        t = commfuse.fused_add_rmsnorm(s, residual, weight, 1e-6)
        return t.residual, t.norm

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert FUSED_AR not in counts(gm) and not report.fused, report
    assert any("the x y is written in place (mul_) between" in r for r in _skip_reasons(report, "all-reduce")), report
    assert_same(got, want)


@mpi
def test_layers_chain_and_report_prints(quiet_comm, gen):
    """Two decoder-like tails: the first's residual output is the second's residual input."""
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="fp8")

    def two(x, residual, weight, wo, scale):
        h = all_reduced_sum(x, residual, wo)
        q = fp8(torch_norm(h, weight), scale)
        y2 = F.linear(q.to(BF16), wo)
        dist.all_reduce(y2)
        h2 = h + y2
        return torch_norm(h2, weight), h2

    gm, report, want, got = fuse_and_run(two, (x, residual, weight, wo, scale), c)
    assert counts(gm) == {FUSED_AR: 2}, report
    assert_same(got, want)
    text = str(report)
    assert "2 fused, 0 skipped" in text and "commfuse::fused_all_reduce" in text and "route:" in text, text


# --------------------------------------------------------------------------- negative cases (mpi)


def _skip_reasons(report, what=None):
    return [s.reason for s in report.skipped if what is None or s.what == what]


@mpi
def test_nvfp4_needs_h_multiple_of_16(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, h=40, quant="nvfp4")

    def layer(x, residual, weight, wo, scale):
        h = all_reduced_sum(x, residual, wo)
        # the op itself
        return commfuse.quantize(torch_norm(h, weight), "nvfp4", scale)

    gm, _ = capture(layer, x, residual, weight, wo, scale, raises=ValueError)  # the graph itself raises: h % 16
    report = fusion.fuse(gm, c)
    assert any("h % 16 == 0, h = 40" in r for r in _skip_reasons(report, "quantization")), report
    assert counts(gm)[FUSED_AR] == 1 and report.fused[0].quant is None, report  # add + norm still fused


@mpi
def test_fp32_activations_are_skipped(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen, dtype=torch.float32)

    def layer(x, residual, weight, wo):
        h = all_reduced_sum(x, residual, wo)
        return hf_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert not counts(gm) and not report.fused, report
    assert any("float32 activations" in r for r in _skip_reasons(report)), report
    # Every reason is true: a norm reads the all-reduce's sum, so the all-reduce's line says why it is not fused.
    (ar,) = _skip_reasons(report, "all-reduce")
    assert "feeds a residual add + RMSNorm" in ar and "float32 activations" in ar and "no residual" not in ar, report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("between", ["post-norm", "post-norm, no norm after the add", "multiplier"])
def test_an_all_reduce_whose_sum_is_not_the_residual_adds_says_what_reads_it(quiet_comm, gen, between):
    """Gemma 2 / 3 normalise the all-reduced sum before the residual add (a post-norm): with the next norm after the
    add, all of it becomes fused_all_reduce with the post-norm's weight as post_weight, the graph's bits. Without a
    norm after the add (EXAONE 4's layers) the post-norm stays, and so does Granite's residual_multiplier between
    the sum and the add: the all-reduce's reason names the norm, or the node, that reads its sum."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    post = (0.1 * torch.randn(weight.shape, generator=gen)).to(weight.device, weight.dtype)

    def layer(x, residual, weight, wo, post):  # Gemma's norms, which round as the fused ops do
        w = weight - 1
        y = F.linear(x, wo)
        dist.all_reduce(y)
        y = gemma_norm(y, post) if between.startswith("post-norm") else y * 0.5
        h = residual + y
        return (h * 1, h) if between.endswith("after the add") else (gemma_norm(h, w), h)

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, post), c)
    if between == "post-norm":
        assert counts(gm).get(FUSED_AR) == 1 and not _skip_reasons(report, "all-reduce"), report
        (fused,) = [f for f in report.fused if "post-norm" in f.pattern]
        assert fused.pattern == "all_reduce + rmsnorm (post-norm) + add + rmsnorm", report
    else:
        assert FUSED_AR not in counts(gm), report
        (ar,) = _skip_reasons(report, "all-reduce")
    if between == "post-norm, no norm after the add":
        norm = next(f for f in report.fused if "add" not in f.pattern)  # the post-norm, matched alone
        assert f"the input of the RMSNorm {norm.replaced[-1]} (a post-norm), which fused_all_reduce takes only" in ar, \
            report
    elif between == "multiplier":
        found = re.search(r"reads its sum: it is read by (\w+) \(mul\)$", ar)
        assert found, report
        (mul,) = [n for n in gm.graph.nodes if n.name == found.group(1)]
        assert 0.5 in mul.args and G.kind(mul) == "mul", mul.args
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("differs", ["eps", "weight offset"])
def test_a_post_norm_the_op_cannot_take_leaves_the_all_reduce_with_the_reason(quiet_comm, gen, differs):
    """fused_all_reduce gives both norms one eps and one weight offset: a post-norm that differs from the norm after
    the add in either is not its post_weight; the all-reduce stays, its reason says which, and the graph computes
    what it did."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    post = (0.1 * torch.randn(weight.shape, generator=gen)).to(weight.device, weight.dtype)

    def plain_norm(h, w, eps=1e-6):  # weight offset 0, rounded once as the ops round
        v = h.float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.float()).type_as(h)

    def layer(x, residual, weight, wo, post):
        y = F.linear(x, wo)
        dist.all_reduce(y)
        y = gemma_norm(y, post, eps=1e-5) if differs == "eps" else plain_norm(y, post + 1)
        h = residual + y
        return gemma_norm(h, weight - 1), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, post), c)
    assert FUSED_AR not in counts(gm), report
    (ar,) = _skip_reasons(report, "all-reduce")
    words = {"eps": "eps 1e-05 is not the norm's 1e-06", "weight offset": "weight offset 0 is not the norm's 1"}
    assert words[differs] in ar, report
    assert_same(got, want)


@mpi
def test_a_post_norm_that_rounds_in_another_order_says_the_residual_carries_it(quiet_comm, gen):
    """GLM-4's post-norms multiply by the weight after the cast to T (HF LlamaRMSNorm's order): fused, the report
    says so for the post-norm too, and that the residual output carries it (the post-normed sum is added to the
    residual); the residual within an ulp of the post-normed sum and one of its own of the graph's."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    post = (1 + 0.1 * torch.randn(weight.shape, generator=gen)).to(weight.device, weight.dtype)

    def layer(x, residual, weight, wo, post):
        y = F.linear(x, wo)
        dist.all_reduce(y)
        h = residual + hf_norm(y, post)
        return hf_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, post), c)
    assert counts(gm).get(FUSED_AR) == 1, report
    (fused,) = report.fused
    assert fused.pattern == "all_reduce + rmsnorm (post-norm) + add + rmsnorm", report
    assert any(n.startswith("the post-norm: ") and n.endswith("carries it") for n in fused.notes), fused.notes
    y = F.linear(x, wo)
    summed = c.all_reduce(y)
    why = tolerance.post_residual_within(got[1], want[1], hf_norm(summed, post), "residual")
    assert why is None or sum_order() == "sum", why
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close_under_sum_order(g, w, i)


@mpi
@pytest.mark.parametrize("compiler", [None, "inductor"])
def test_an_all_reduce_read_through_a_shared_view_names_that_view(quiet_comm, gen, compiler):
    """The sum reaches its residual add + RMSNorm through a view that another node reads too (the fused op would not
    write the view): the all-reduce is left, and its reason names the view. It was called a post-norm (the add, a
    norm's input, taken for the sum), or said that no residual add + RMSNorm reads the sum, naming the local op the
    add + norm had become."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    def layer(x, residual, weight, wo):
        y = F.linear(x, wo)
        dist.all_reduce(y)
        v = y.view(y.shape)
        h = residual + v
        return gemma_norm(h, weight - 1), h, v * 2

    gm, _ = capture(layer, x, residual, weight, wo)
    report = fusion.fuse(gm, c, compiler=compiler)
    (ar,) = _skip_reasons(report, "all-reduce")
    found = re.fullmatch(r"its sum reaches the residual add \+ RMSNorm at (\w+) through (\w+), which (\w+) reads too: "
                         r"the fused op does not write \2", ar)
    assert found, report
    nodes = {n.name: n for n in gm.graph.nodes}
    view, other = nodes[found.group(2)], nodes[found.group(3)]
    assert G.kind(view) == "view" and G.kind(other) == "mul" and view in other.args, (view, other)


@mpi
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_rms_norm_of_float32_casts_cast_back_is_fused(quiet_comm, gen, quant):
    """F.rms_norm(h.float(), (h,), w.float(), eps).to(T): a float32 norm and weight multiply rounded once, the fused
    op's own math: fused, bit for bit (the all-reduce's sum across ranks within its order)."""
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant=quant)

    def layer(x, residual, weight, wo, scale):
        h = all_reduced_sum(x, residual, wo)
        n = F.rms_norm(h.float(), (h.shape[-1],), weight.float(), 1e-6).to(h.dtype)
        return (n if quant is None else fp8(n, scale)), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, scale), c)
    assert counts(gm) == {FUSED_AR: 1} and not report.skipped, report
    assert "float32 casts" in report.fused[0].spelling, report
    assert_same(got, want)


@mpi
def test_rms_norm_of_float32_casts_with_a_float32_weight_is_reported_truly(quiet_comm, gen):
    """rms_norm(h.float(), (h,), w32): the activations are bfloat16, cast up for the norm; the weight is float32,
    which no fused op takes. The norm's reason says so (not "float32 activations"), and the all-reduce's says that
    a norm reads its sum (not that none does)."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    w32 = weight.float()

    def layer(x, residual, w32, wo):
        h = all_reduced_sum(x, residual, wo)
        return F.rms_norm(h.float(), (h.shape[-1],), w32, 1e-6).to(h.dtype), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, w32, wo), c)
    assert not counts(gm) and not report.fused, report
    (norm,) = _skip_reasons(report, "rmsnorm")
    assert "float32 of the torch.bfloat16" in norm and "weight of torch.float32" in norm, report
    assert "float32 activations" not in norm, report
    (ar,) = _skip_reasons(report, "all-reduce")
    assert "feeds a residual add + RMSNorm" in ar and "no residual" not in ar, report
    assert_same(got, want)


@mpi
def test_a_sum_read_through_a_view_taken_before_the_all_reduce_is_reported_so(quiet_comm, gen):
    """y2 = y.view(...); dist.all_reduce(y); y2 + residual: the add reads the sum through a view taken before the
    collective, which the pass does not follow. The add + norm become the local op, and the all-reduce's reason
    says how its sum is read (not that nothing reads it)."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen, shape=(2, 3, 128))

    def layer(x, residual, weight, wo):
        y = F.linear(x, wo)
        y2 = y.view(residual.shape)
        dist.all_reduce(y)
        h = y2 + residual
        return weight_before_cast_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm) == {LOCAL: 1}, report
    (ar,) = _skip_reasons(report, "all-reduce")
    assert "a view of y taken before the in-place all-reduce" in ar and "no residual" not in ar, report
    assert_same(got, want)


@mpi
def test_non_sum_all_reduce_is_not_fused(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    def layer(x, residual, weight, wo):
        y = fc.all_reduce(F.linear(x, wo), "max", dist.group.WORLD)
        h = residual + y
        return torch_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm) == {LOCAL: 1}, report  # the add + norm still become the local op
    assert any("reduce op 'max'" in r for r in _skip_reasons(report, "all-reduce")), report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("collective", ["dist", "funcol"])
def test_sum_also_read_elsewhere_keeps_the_all_reduce(quiet_comm, gen, collective):
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    def layer(x, residual, weight, wo):
        y = reduce(collective, c, F.linear(x, wo))
        h = residual + y
        return torch_norm(h, weight), h, y * 2  # the all-reduced sum has another reader

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm) == {LOCAL: 1}, report
    assert any("also read by" in r for r in _skip_reasons(report, "all-reduce")), report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("case", ["sa + sb", "sb + sa", "both fusable", "the norm not fused"])
def test_two_all_reduced_sums_added_each_tried_and_reported(quiet_comm, gen, case):
    """h = sa + sb of two all-reduced sums, sa also read elsewhere: sa's all-reduce cannot fuse (the op does not
    return the sum), sb's fuses with sa as the residual, in either operand order. Every all-reduce left is reported
    at its collective with a true reason (none as one whose sum no norm reads): sa's as read elsewhere, the second
    of two fusable ones as the fused op's residual, both with the norm's reason where the norm is not fused."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    def layer(x, residual, weight, wo):
        sa = reduce("funcol", c, F.linear(x, wo))
        sb = reduce("funcol", c, F.linear(residual, wo))
        h = sb + sa if case == "sb + sa" else sa + sb
        n = torch_norm(h, weight.float() if case == "the norm not fused" else weight)
        return (n, h) if case == "both fusable" else (n, h, sa * 2)

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    skips = [s for s in report.skipped if s.what == "all-reduce"]
    collectives = {n.name for n in gm.graph.nodes if G.kind(n) == "funcol_all_reduce"}
    assert {s.where for s in skips} == collectives and len(skips) == len(collectives), report
    expect = {"sa + sb": "is also read by mul", "sb + sa": "is also read by mul",
              "both fusable": "is an all-reduced sum too, tried first",
              "the norm not fused": "feeds a residual add + RMSNorm (n) that is not fused: the weight is"}
    assert all(expect[case] in s.reason for s in skips), report
    assert counts(gm) == ({} if case == "the norm not fused" else {FUSED_AR: 1}), report
    assert_same(got, want)


@mpi
def test_all_reduce_of_a_graph_input_in_place_is_not_fused(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, _, _ = setup(c, gen)

    def layer(x, residual, weight):
        dist.all_reduce(x)  # the caller sees x modified
        h = residual + x
        return torch_norm(h, weight), h

    gm, _ = capture(layer, x, residual, weight)
    report = fusion.fuse(gm, c)
    assert counts(gm) == {LOCAL: 1}, report
    assert any("graph input" in r for r in _skip_reasons(report, "all-reduce")), report


@mpi
def test_all_reduce_of_a_private_view_in_place_is_fused(quiet_comm, gen):
    """dist.all_reduce of a view whose base nothing else reads (HF's MoE blocks return out.reshape(b, s, h))."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    def layer(x, residual, weight, wo):
        y = F.linear(x, wo)
        v = y.reshape(2, 3, 128)
        dist.all_reduce(v)
        h = residual.view(2, 3, 128) + v
        return torch_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm) == {FUSED_AR: 1} and not report.skipped, report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("split", ["chunk", "vsplit", "unsafe_split", "unsafe_chunk"])
def test_all_reduce_of_a_split_item_in_place_is_not_fused(quiet_comm, gen, split):
    """An item of a split is a view of its input (vsplit's and unsafe_split's too, whose names and schemas do not
    say so): the all-reduce writes the base, which the graph returns, so the fused op may not replace it."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    cut = {"chunk": lambda y: torch.chunk(y, 2), "vsplit": lambda y: torch.vsplit(y, 2),
           "unsafe_split": lambda y: torch.unsafe_split(y, 3), "unsafe_chunk": lambda y: y.unsafe_chunk(2)}[split]

    def layer(x, residual, weight, wo):
        y = F.linear(x, wo)
        a, _ = cut(y)
        dist.all_reduce(a)  # y's first rows hold the sum
        h = residual + a
        return torch_norm(h, weight), h, y

    gm, report, want, got = fuse_and_run(layer, (x, residual[:3].clone(), weight, wo), c)
    assert FUSED_AR not in counts(gm), report
    assert any("a view of another tensor" in r for r in _skip_reasons(report, "all-reduce")), report
    assert_same(got, want)


ALIASES = {"view": lambda y: y.view(y.shape), "mT": lambda y: y.mT, "swapdims": lambda y: torch.swapdims(y, 0, 1),
           "moveaxis": lambda y: torch.moveaxis(y, 0, 1), "broadcast_to": lambda y: torch.broadcast_to(y, y.shape),
           "to(device)": lambda y: y.to(y.device)}


@mpi
@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_all_reduce_through_any_view_spelling_is_not_fused(quiet_comm, gen, alias):
    """A view taken before the collective holds the sum, and an all-reduce of a graph input's view writes the
    caller's tensor: so neither is fused, whatever the view's spelling (also those dynamo keeps as a function or
    an attribute: y.mT is getattr(y, "mT"))."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    view = ALIASES[alias]

    def view_before(x, residual, weight, wo):
        y = F.linear(x, wo)
        a = view(y)
        dist.all_reduce(y)
        h = residual + y
        return torch_norm(h, weight), h, a * 2

    gm, report, want, got = fuse_and_run(view_before, (x, residual, weight, wo), c)
    assert counts(gm) == {LOCAL: 1}, report
    assert any("taken before the collective" in r for r in _skip_reasons(report, "all-reduce")), report
    assert_same(got, want)

    def input_view(x, residual, weight):
        y = view(view(x)) if alias in ("mT", "swapdims", "moveaxis") else view(x)
        dist.all_reduce(y)
        h = residual + y
        return torch_norm(h, weight), h

    gm, report, want, got = fuse_and_run(input_view, (x, residual, weight), c)
    assert FUSED_AR not in counts(gm), report
    assert any("view of another tensor" in r for r in _skip_reasons(report, "all-reduce")), report
    assert_same(got, want)


IN_PLACE_RESULTS = {"add_": lambda y, b: y.add_(b), "F.relu(inplace=True)": lambda y, b: F.relu(y, inplace=True),
                    "mul_": lambda y, b: y.mul_(2)}


@mpi
@pytest.mark.parametrize("op", sorted(IN_PLACE_RESULTS))
@pytest.mark.parametrize("reduced", ["the result", "the operand"])
def test_all_reduce_of_an_in_place_ops_result_is_not_fused_where_the_operand_is_read(quiet_comm, gen, op, reduced):
    """z = y.add_(b) is y itself: dist.all_reduce(z) writes the sum into y too, which the graph returns (and
    all_reduce(y) into z). The fused op would write neither, so the all-reduce is not fused, and the outputs
    are the graph's."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    bias = torch.randn(128, generator=gen).to(x.dtype).to(x.device)

    def layer(x, residual, weight, wo, bias):
        y = F.linear(x, wo)
        z = IN_PLACE_RESULTS[op](y, bias)
        v, other = (z, y) if reduced == "the result" else (y, z)
        dist.all_reduce(v)
        h = residual + v
        return torch_norm(h, weight), h, other

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, bias), c)
    assert FUSED_AR not in counts(gm), report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("op", sorted(IN_PLACE_RESULTS) + ["+="])
def test_all_reduce_of_an_in_place_ops_result_is_fused_where_nothing_else_reads_the_operand(quiet_comm, gen, op):
    """A row-parallel layer that adds its bias in place before the all-reduce (`y += b`, `y.add_(b)`): nothing
    but the in-place op reads y, so no reader can miss the sum, and the tail fuses into the collective."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    bias = torch.randn(128, generator=gen).to(x.dtype).to(x.device)

    def layer(x, residual, weight, wo, bias):
        y = F.linear(x, wo)
        if op == "+=":
            y += bias
        else:
            y = IN_PLACE_RESULTS[op](y, bias)
        dist.all_reduce(y)
        h = residual + y
        return torch_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, bias), c)
    assert counts(gm) == {FUSED_AR: 1} and not report.skipped, report
    assert_same(got, want)


@mpi
def test_all_reduce_of_a_view_in_place_is_not_fused(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    def layer(x, residual, weight, wo):
        y = F.linear(x, wo)
        v = y.view(-1)
        dist.all_reduce(v)  # y holds the sum too
        h = residual + v.view(6, 128)
        return torch_norm(h, weight), h, y

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm) == {LOCAL: 1}, report
    assert any("a view of another tensor" in r for r in _skip_reasons(report, "all-reduce")), report
    assert_same(got, want)


@mpi
def test_consumers_with_different_scales(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="fp8")
    scale2 = scale * 2

    def layer(x, residual, weight, wo, scale, scale2):
        h = all_reduced_sum(x, residual, wo)
        n = torch_norm(h, weight)
        return fp8(n, scale), fp8(n, scale2), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, scale, scale2), c)
    assert counts(gm) == {FUSED_AR: 1} and report.fused[0].quant is None, report
    assert any("different scales" in r for r in _skip_reasons(report, "quantization")), report
    assert_same(got, want)


@mpi
def test_other_group_and_no_communicator(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    other = dist.new_group(list(range(dist.get_world_size())), backend="gloo")

    def layer(x, residual, weight, wo):
        y = fc.all_reduce(F.linear(x, wo), "sum", other)
        h = residual + y
        return torch_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm) == {LOCAL: 1}, report
    assert any("is not the Communicator's" in r for r in _skip_reasons(report, "all-reduce")), report
    assert_same(got, want)
    gm, _ = capture(layer, x, residual, weight, wo)
    report = fusion.fuse(gm, None)
    assert any("no Communicator given" in r for r in _skip_reasons(report, "all-reduce")), report


@mpi
def test_unclamped_fp8_cast_and_python_scale_are_not_fused(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="fp8")

    def layer(x, residual, weight, wo, scale):
        h = all_reduced_sum(x, residual, wo)
        n = torch_norm(h, weight)
        return (n / scale).to(torch.float8_e4m3fn), (n / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo, scale), c)
    assert counts(gm) == {FUSED_AR: 1} and report.fused[0].quant is None, report
    reasons = _skip_reasons(report, "quantization")
    assert any("without a clamp" in r for r in reasons) and any("Python number" in r for r in reasons), report
    assert_same(got, want)


@pytest.mark.parametrize("scale_kind", ["bf16", "per_channel"])
def test_fp8_scale_other_than_one_float32_element_is_reported(gen, scale_kind):
    """An FP8 quantization scaled by a tensor the fused ops do not take (bf16, or one scale a channel) is left in
    the graph with a report line; the add + RMSNorm still fuse, and a plain division by such a tensor (no FP8
    cast after it) is none of the pass's business."""
    x, residual, weight, scale = _local_inputs(gen)
    odd = scale.to(BF16) if scale_kind == "bf16" else 0.02 + 0.01 * torch.rand(64, generator=gen)

    def layer(x, residual, weight, odd):
        h = x + residual
        n = torch_norm(h, weight)
        return fp8(n, odd), n / odd, h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, odd), None)
    assert counts(gm) == {LOCAL: 1} and report.fused[0].quant is None, report
    reasons = _skip_reasons(report, "quantization")
    what = "a bfloat16 tensor" if scale_kind == "bf16" else "a float32 tensor of shape (64,)"
    assert len(reasons) == 1 and f"scales by {what}" in reasons[0] and "float32 tensor of one element" in reasons[0], \
        report
    assert_same(got, want)


def test_fp8_scale_traced_from_a_python_number_is_reported_as_one(gen):
    """Under dynamic=True dynamo traces a Python-number scale as a SymFloat node: the report calls it a Python
    number (not a tensor of dtype None), and the add + RMSNorm still fuse."""
    x, residual, weight, _ = _local_inputs(gen)

    def layer(x, residual, weight, s):
        h = x + residual
        n = F.rms_norm(h, (64,), weight, 1e-6)
        return fp8(n, s), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, 0.02), None, dynamic=True)
    assert counts(gm) == {LOCAL: 1} and report.fused[0].quant is None, report
    (why,) = _skip_reasons(report, "quantization")
    assert "Python number" in why and "None" not in why, report
    assert_same(got, want)


@mpi
def test_in_place_functional_all_reduce_is_reported(quiet_comm, gen):
    """torch.ops._c10d_functional.all_reduce_ (in place) is not matched, and the report says so rather than
    dropping it; the add + RMSNorm after it still fuse, and the outputs stay the unfused graph's."""
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)
    group = dist.group.WORLD.group_name

    def layer(x, residual, weight, wo):
        y = F.linear(x, wo)
        torch.ops._c10d_functional.all_reduce_(y, "sum", group)
        h = residual + torch.ops._c10d_functional.wait_tensor(y)
        return torch_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm) == {LOCAL: 1}, report
    (why,) = _skip_reasons(report, "all-reduce")
    assert "in-place all_reduce_" in why, report
    assert_same(got, want)


@mpi
def test_gemma_norm_fuses_with_the_all_reduce(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, _, wo = setup(c, gen)

    def layer(x, residual, weight, wo):
        h = all_reduced_sum(x, residual, wo)
        return gemma_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, residual, weight, wo), c)
    assert counts(gm) == {FUSED_AR: 1}, report
    node = next(n for n in gm.graph.nodes if n.target is FUSED_AR)
    assert node.args[5] == 1.0 and op_eps(gm) == [1e-6]  # weight_offset, eps
    assert_same(got, want)


# --------------------------------------------------------------------------- torch.compile end to end (mpi)


@mpi
def test_compile_end_to_end_dynamic_tokens(quiet_comm, gen):
    c = quiet_comm
    h = 128

    class Block(torch.nn.Module):  # parameters: static shapes under dynamic=True, as in models
        def __init__(self):
            super().__init__()
            self.wo = torch.nn.Parameter((torch.randn(h, h, generator=gen) / h ** 0.5).to(BF16))
            self.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(h, generator=gen)).to(BF16))
            self.register_buffer("scale", torch.tensor([0.02]))

        def forward(self, x, residual):
            y = F.linear(x, self.wo)
            dist.all_reduce(y)
            h1 = residual + y
            q = fp8(weight_before_cast_norm(h1, self.weight), self.scale)
            y2 = F.linear(q.to(BF16), self.wo)
            dist.all_reduce(y2)
            h2 = h1 + y2
            return torch_norm(h2, self.weight), h2, q

    block = Block().to(c.device)
    torch._dynamo.reset()
    compiled = fusion.compile(block, c, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, t in enumerate((5, 17, 3)):
        x, _ = rank_inputs(c, gen, (t, h), BF16)
        residual = torch.randn(t, h, generator=gen).to(c.device, BF16)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(x.clone(), residual)
        want = block(x.clone(), residual)
        for j, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, j)
    assert len(compiled.fusion_reports) == 1, compiled.fusion_reports
    (report,) = compiled.fusion_reports
    assert report.count("commfuse::fused_all_reduce") == 2 and report.fused[0].quant == "fp8", report


# --------------------------------------------------------------------------- local patterns (one process)


def _local_inputs(gen, t=5, h=64, dtype=BF16):
    x = torch.randn(t, h, generator=gen).to(dtype)
    residual = torch.randn(t, h, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    return x, residual, weight, torch.tensor([0.02])


@pytest.mark.parametrize("norm", sorted(NORMS) + ["gemma"])
def test_local_add_norm_fp8(gen, norm):
    x, residual, weight, scale = _local_inputs(gen)
    norm_fn = gemma_norm if norm == "gemma" else NORMS[norm]

    def f(x, residual, weight, scale):
        h = x + residual
        n = norm_fn(h, weight)
        return fp8(n, scale), n, h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight, scale), None)
    assert counts(gm) == {LOCAL: 1}, report
    assert report.fused[0].pattern == "add + rmsnorm + fp8" and report.fused[0].return_norm, report
    if not EXACT.get(norm, True):
        assert_rounding_order_close(got, want, ["fp8", "norm", "residual"])
        assert_codes_of_the_fused_norm(got[0], got[2], weight, scale)
        assert bits_equal(got[1], reference.rmsnorm(got[2], weight, 1e-6))
    else:
        assert_same(got, want)


def test_plain_norm_without_add_and_eps_none(gen):
    x, _, weight, scale = _local_inputs(gen)

    def f(x, weight, scale):
        n = F.rms_norm(x, (64,), weight)  # eps=None
        q, sf, _ = commfuse.quantize(n, "nvfp4", scale)
        return q, sf

    gm, report, want, got = fuse_and_run(f, (x, weight, scale), None)
    assert counts(gm) == {LOCAL: 1}, report
    node = next(n for n in gm.graph.nodes if n.target is LOCAL)
    assert node.args[1] is None and public(node.args[6])["quant"] == "nvfp4"
    assert any("finfo(float32).eps" in n for _, n in report.numerics), report
    assert_same(got, want)


@pytest.mark.parametrize("spelling", ["by hand", "F.rms_norm"])
def test_a_plain_norm_whose_weight_cast_comes_first_is_fused(gen, spelling):
    """w.float() hoisted above the norm's input: the op went before the norm's first node, that cast, where its
    input did not exist yet, and the report said the input "is computed after the tail starts"."""
    x, _, weight, _ = _local_inputs(gen)

    def f(x, w):
        wf = w.float()
        hf = (x * 2).float()
        if spelling == "by hand":
            return ((hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * wf).to(BF16),)
        return (F.rms_norm(hf, (64,), wf, 1e-6).to(BF16),)

    gm, report, want, got = fuse_and_run(f, (x, weight), None)
    assert counts(gm) == {LOCAL: 1} and not report.skipped, report
    assert_same(got, want)


def test_a_norm_computed_in_float64_is_skipped(gen):
    """mean(..., dtype=torch.float64) makes the inverse RMS and the products float64: another rounding than the
    fused ops' float32, which the pass fused without a word."""
    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, w):
        h = x + residual
        hf = h.float()
        var = hf.pow(2).mean(-1, keepdim=True, dtype=torch.float64)
        return ((hf * torch.rsqrt(var + 1e-6)) * w).to(BF16), h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight), None)
    assert not counts(gm), report
    assert any("the mean of squares is torch.float64" in r for r in _skip_reasons(report, "rmsnorm")), report
    assert_same(got, want)


@pytest.mark.parametrize("computed", ["w + w", "1 + w in T"])
def test_a_weight_computed_by_an_add_is_a_weight(gen, computed):
    """A T weight that an add computes (a merged LoRA's w + w; Gemma's 1 + w rounded in T) is the op's weight: it
    was refused as "not a torch.bfloat16 weight", which it is."""
    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, w):
        w2 = w + w if computed == "w + w" else 1 + w
        h = x + residual
        hf = h.float()
        return ((hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)) * w2).to(BF16), h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight), None)
    assert counts(gm) == {LOCAL: 1} and not report.skipped, report
    node = next(n for n in gm.graph.nodes if n.target is LOCAL)
    assert node.args[5] == 0.0  # no offset: the weight's value is the T tensor the add gave
    assert_same(got, want)


def mamba2_gated_norm(x, gate, weight, group_size, eps=1e-5):
    """HF Mamba2 / Nemotron-H MambaRMSNormGated.forward (the torch path; groups as Nemotron-H's)."""
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32)
    hidden_states = hidden_states * F.silu(gate.to(torch.float32))
    shape = hidden_states.shape
    hidden_states = hidden_states.view(*shape[:-1], shape[-1] // group_size, group_size)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    hidden_states = hidden_states.view(shape)
    return weight * hidden_states.to(input_dtype)


def mamba_ssm_norm_before_gate(x, z, weight, eps=1e-5):
    """mamba_ssm's rms_norm_ref with norm_before_gate=True, group_size=None (rstd as rsqrt)."""
    dtype = x.dtype
    x, z = x.float(), z.float()
    rstd = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    out = x * rstd * weight.float()
    out = out * F.silu(z)
    return out.to(dtype)


@pytest.mark.parametrize("form", ["mamba2_grouped", "mamba2_one_group", "norm_before_gate"])
def test_gated_rmsnorm_is_found(gen, form):
    x, z, weight, _ = _local_inputs(gen, h=64)

    eps = 0.25  # not the models' default 1e-5: the op must take the graph's

    def f(x, z, weight):
        if form == "mamba2_grouped":
            return (mamba2_gated_norm(x, z, weight, 16, eps),)
        if form == "mamba2_one_group":
            return (mamba2_gated_norm(x, z, weight, 64, eps),)
        return (mamba_ssm_norm_before_gate(x, z, weight, eps),)

    gm, report, want, got = fuse_and_run(f, (x, z, weight), None)
    assert counts(gm) == {GATED: 1}, report
    node = next(n for n in gm.graph.nodes if n.target is GATED)
    assert node.args[5] == {"mamba2_grouped": 16}.get(form, 64) and node.args[6] is (form == "norm_before_gate")
    assert op_eps(gm) == [eps]
    if form == "norm_before_gate":
        assert_same(got, want)
    else:
        assert_rounding_order_close(got, want, ["norm"])


def test_norm_before_gate_whose_gate_cast_is_read_elsewhere_keeps_the_cast(gen):
    """mamba_ssm's norm_before_gate=True with z.float() read by another node too: the gated norm fuses and the cast
    stays for that reader (the pass erased it with the norm and failed on the reader left)."""
    x, z, weight, _ = _local_inputs(gen, h=64)

    def f(x, z, weight):
        xf, zf = x.float(), z.float()
        rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + 1e-5)
        out = xf * rstd * weight.float()
        return (out * F.silu(zf)).to(x.dtype), zf.sum(-1)

    gm, report, want, got = fuse_and_run(f, (x, z, weight), None)
    assert counts(gm) == {GATED: 1}, report
    assert_same(got, want)


def test_gated_rmsnorm_under_dynamic_shapes(gen):
    """Mamba2's gated norm reads the sizes of x * silu(z) (`shape = hidden_states.shape`), which dynamo
    queries with size() under dynamic shapes: the pass answers them from x and fuses the norm, for any
    token count without a recompile."""
    _, _, weight, _ = _local_inputs(gen, h=64)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(weight.clone())

        def forward(self, x, z):
            return mamba2_gated_norm(x, z, self.weight, 16)

    torch._dynamo.reset()
    compiled = fusion.compile(M(), None, backend="aot_eager", fullgraph=True)
    for i, t in enumerate((5, 17, 3)):
        x, z = (torch.randn(t, 64, generator=gen).to(BF16) for _ in range(2))
        for a in (x, z):
            torch._dynamo.mark_dynamic(a, 0)  # the tokens, as a model's activations (its hidden size is static)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(x, z)
        assert bits_equal(got, reference.gated_rmsnorm(x, z, weight, 1e-5, 16, False)), t
    (report,) = compiled.fusion_reports
    assert report.count("commfuse::gated_rmsnorm") == 1, report


def test_a_sequence_first_residual_stream_is_left_whole(gen):
    """[s, b, h] views of [b, s, h] tensors (Megatron's sequence-first layout): the add and the norm keep their
    inputs' transposed strides in eager, and a reader may .view them as only those strides allow. The fused
    ops write dense rows, so the pass leaves the norm, saying why, and the compiled model runs as eager."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(64, eps=1e-6, dtype=BF16)

        def forward(self, x_bsh, r_bsh):
            h = x_bsh.transpose(0, 1) + r_bsh.transpose(0, 1)
            b, s, d = x_bsh.shape
            return self.norm(h), h.transpose(0, 1).view(b * s, d)

    m = Block().eval()
    with torch.no_grad():
        m.norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=gen))
    x, r = (torch.randn(2, 5, 64, generator=gen).to(BF16) for _ in range(2))
    torch._dynamo.reset()
    compiled = fusion.compile(m, None, backend="aot_eager", rewrite="all")
    with torch.inference_mode():
        got, want = compiled(x, r), m(x, r)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    (report,) = compiled.fusion_reports
    assert not report.fused and any("is not contiguous" in why for why in _skip_reasons(report)), report

    # The same under ShapeProp's metadata (TensorMetadata, no fake tensor): its strides were not read, the norm
    # was fused, and the graph's .view of the dense result failed.
    from torch.fx.passes.shape_prop import ShapeProp
    gm = torch.fx.symbolic_trace(m)
    ShapeProp(gm).propagate(x, r)
    report = fusion.fuse(gm, None, rewrite="all")
    assert not report.fused and any("is not contiguous (strides (64, 320, 1))" in why
                                    for why in _skip_reasons(report)), report
    assert all(torch.equal(a, b) for a, b in zip(gm(x, r), want))


def test_a_graph_autograd_differentiates_is_left_whole(gen):
    """With grad mode on and a parameter that requires grad, the fused ops (which have no gradient) would
    take the place of nodes that backward differentiates, and the gradients through them would be missing
    (torch only warns): the pass leaves such a graph alone, saying why, and the gradients are eager's. Under
    torch.no_grad() dynamo compiles another graph, which is fused."""
    x, residual, weight, _ = _local_inputs(gen)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64, dtype=BF16)
            self.weight = torch.nn.Parameter(weight.clone())

        def forward(self, x, residual):
            return weight_before_cast_norm(self.proj(x) + residual, self.weight).float().sum()

    m = M()
    with torch.enable_grad():
        m(x, residual).backward()
        want = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        torch._dynamo.reset()
        compiled = fusion.compile(m, None, backend="aot_eager", rewrite="all", fullgraph=True)
        compiled(x, residual).backward()
        assert all(p.grad is not None and torch.equal(p.grad, g) for p, g in zip(m.parameters(), want))
    (report,) = compiled.fusion_reports
    assert not report.fused and [s.what for s in report.skipped] == ["graph"], report
    assert "requires grad" in report.skipped[0].reason and "torch.no_grad()" in report.skipped[0].reason, report
    assert "\n  - graph (guard): " in str(report), report  # the whole graph: no "at the graph"
    compiled(x, residual)  # under the module's no_grad: dynamo's other graph, fused
    assert compiled.fusion_reports[-1].count("commfuse::fused_add_rmsnorm") == 1, compiled.fusion_reports[-1]


# ---- rewrite="auto": a local pattern is left to Inductor where commfuse.fusion.evidence says it does as well


def _local_graphs(gen):
    """(name, function, inputs) of a local add + norm + FP8, a gated norm, and a norm quantized by
    commfuse.quantize."""
    x, residual, weight, scale = _local_inputs(gen)

    def add_norm_fp8(x, residual, weight, scale):
        h = x + residual
        return fp8(hf_norm(h, weight), scale), h

    def gated(x, z, weight):
        return (mamba2_gated_norm(x, z, weight, 16),)

    def nvfp4_op(x, weight, scale):
        q, sf, _ = commfuse.quantize(F.rms_norm(x, (64,), weight, 1e-6), "nvfp4", scale)
        return q, sf

    return [("add_norm_fp8", add_norm_fp8, (x, residual, weight, scale)), ("gated", gated, (x, residual, weight)),
            ("nvfp4_op", nvfp4_op, (x, weight, scale))]


@pytest.mark.parametrize("case", ["add_norm_fp8", "gated", "nvfp4_op"])
def test_auto_leaves_local_patterns_to_inductor(gen, monkeypatch, case):
    name, f, args = next(c for c in _local_graphs(gen) if c[0] == case)
    gm, inputs = capture(f, *args)
    want = gm(*_cloned(inputs))
    on_gpu(gm, monkeypatch)
    report = fusion.fuse(gm, None, compiler="inductor")
    if case == "nvfp4_op":  # two commfuse launches become one: it always pays
        assert counts(gm) == {LOCAL: 1} and not report.skipped, report
        return
    if case == "gated":  # measured to pay in a compiled model in Inductor's default mode too (evidence.py)
        assert counts(gm) == {GATED: 1} and not report.skipped, report
        return
    assert not counts(gm) and not report.fused, report
    (skip,) = report.skipped
    assert skip.kind == "evidence" and skip.reason.startswith("left to Inductor") and " us " in skip.reason, report
    assert "rewrite='all'" in skip.reason and "evidence" in str(report)
    assert all(bits_equal(a, b) for a, b in zip(gm(*_cloned(inputs)), want))  # the graph is untouched
    forced = fusion.fuse(gm, None, compiler="inductor", rewrite="all")
    assert counts(gm) == {LOCAL: 1} and not forced.skipped, forced


@pytest.mark.parametrize("case", ["add_norm_fp8", "gated"])
def test_auto_leaves_local_patterns_to_inductor_where_the_op_would_run_separated_ops(gen, monkeypatch, case):
    """Where the local op's kernel cannot run on the graph's device (CPU tensors, an SM below 8.0) it would run
    torch's unfused kernels in place of Inductor's one: the pass leaves the pattern, naming the op's reason,
    also under CUDA graphs and for the gated norm (which it rewrites where the kernel runs). rewrite='all' and
    other compilers still rewrite it; so does a norm feeding a commfuse.quantize op (one call for two)."""
    name, f, args = next(c for c in _local_graphs(gen) if c[0] == case)
    target = GATED if case == "gated" else LOCAL
    for sm, why in ((None, "tensors on cpu"), ((7, 5), "SM 7.5 < 8.0")):
        for cuda_graphs in (False, True):
            gm, inputs = capture(f, *args)
            if sm is not None:
                on_gpu(gm, monkeypatch, sm)
            want = gm(*_cloned(inputs)) if sm is None else None
            report = fusion.fuse(gm, None, compiler="inductor", cuda_graphs=cuda_graphs)
            assert not counts(gm) and not report.fused, report
            (skip,) = report.skipped
            assert skip.kind == "evidence" and skip.reason.startswith("left to Inductor") and why in skip.reason \
                and "separated" in skip.reason and "rewrite='all'" in skip.reason, report
            if want is not None:
                assert all(bits_equal(a, b) for a, b in zip(gm(*_cloned(inputs)), want))  # the graph is untouched
            forced = fusion.fuse(gm, None, compiler="inductor", rewrite="all")
            assert counts(gm) == {target: 1} and not forced.skipped, forced
    for compiler in (None, "aot_eager"):
        gm, _ = capture(f, *args)
        assert fusion.fuse(gm, None, compiler=compiler).count() == 1
    name, f, args = next(c for c in _local_graphs(gen) if c[0] == "nvfp4_op")
    gm, _ = capture(f, *args)
    assert fusion.fuse(gm, None, compiler="inductor").count() == 1 and counts(gm) == {LOCAL: 1}


def test_a_cuda_graph_fuses_where_this_process_cannot_read_the_sm(gen, monkeypatch):
    """A graph whose metadata says CUDA, fused in a process without CUDA (e.g. the pass run on its own): no
    crash, whatever the policy; Inductor's rule then has no device to ask and rewrites as on a GPU."""
    if torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None: (_ for _ in ()).throw(RuntimeError("no CUDA here")))
    for kw in (dict(), dict(rewrite="all"), dict(compiler="aot_eager"), dict(compiler="inductor")):
        _, f, args = next(c for c in _local_graphs(gen) if c[0] == "gated")
        gm, _ = capture(f, *args)
        report = fusion.fuse(on_gpu(gm, monkeypatch, sm=None), None, **kw)
        assert counts(gm) == {GATED: 1} and not report.skipped, (kw, report)


def test_auto_leaves_a_plain_rmsnorm_to_inductor_citing_its_own_evidence(gen, monkeypatch):
    """A plain RMSNorm (no residual add) is left to Inductor on the decoder's measurement; the add + RMSNorm's
    kernel timings, which say nothing of it, are not cited."""
    x, _, weight, _ = _local_inputs(gen)
    gm, inputs = capture(lambda x, weight: (F.rms_norm(x, (64,), weight, 1e-6),), x, weight)
    report = fusion.fuse(on_gpu(gm, monkeypatch), None, compiler="inductor")
    (skip,) = report.skipped
    assert skip.kind == "evidence" and "decoder" in skip.reason and " us " not in skip.reason, report
    assert not counts(gm)


@pytest.mark.parametrize("compiler", [None, "aot_eager", "eager"])
def test_auto_rewrites_local_patterns_for_other_compilers(gen, compiler):
    for name, f, args in _local_graphs(gen):
        gm, _ = capture(f, *args)
        report = fusion.fuse(gm, None, compiler=compiler)
        assert report.count() == 1 and not report.skipped, (name, report)


def test_auto_rewrites_local_patterns_under_cuda_graphs(gen, monkeypatch):
    """Replayed from CUDA graphs a call has no host time: the kernels' GPU time decides, and the local ops'
    (commfuse.fusion.evidence) are the faster."""
    for name, f, args in _local_graphs(gen):
        gm, _ = capture(f, *args)
        report = fusion.fuse(on_gpu(gm, monkeypatch), None, compiler="inductor", cuda_graphs=True)
        assert report.count() == 1 and not report.skipped, (name, report)


@pytest.mark.parametrize("mode, options, graphs", [(None, None, False), ("reduce-overhead", None, True),
                                                   ("max-autotune", None, True),
                                                   ("max-autotune-no-cudagraphs", None, False),
                                                   (None, {"triton.cudagraphs": True}, True),
                                                   (None, {"triton.cudagraphs": False}, False)])
def test_backend_tells_the_pass_whether_inductor_replays_cuda_graphs(gen, monkeypatch, mode, options, graphs):
    import importlib

    B = importlib.import_module("commfuse.fusion.backend")  # the module (commfuse.fusion.backend is the function)
    seen = []
    monkeypatch.setattr(B, "fuse", lambda gm, comm, **kw: seen.append(kw) or fusion.FusionReport())
    monkeypatch.setattr(B, "_inner_compiler", lambda *a: (lambda gm, inputs: gm))
    _, f, args = _local_graphs(gen)[0]
    gm, inputs = capture(f, *args)
    fusion.backend(None, inner="inductor", mode=mode, options=options)(gm, inputs)
    assert seen == [dict(rewrite="auto", compiler="inductor", cuda_graphs=graphs)]


def test_compile_arguments_are_checked_when_compiling_not_at_the_first_call():
    """As torch.compile's: a bad mode, option or backend name, and mode with options, raise at once."""
    model = torch.nn.Linear(4, 4)
    for kw, error in ((dict(mode="bogus", backend="inductor"), "mode=bogus"), (dict(backend="nonexistent"), "nonexistent"),
                      (dict(options={"no_such_option": 1}, backend="inductor"), "no_such_option"),
                      (dict(mode="reduce-overhead", options={}, backend="inductor"), "Either mode or options")):
        with pytest.raises(Exception, match=error):
            fusion.compile(model, None, **kw)


def test_a_graph_the_inner_backend_fails_to_compile_has_no_report(gen):
    """Where the inner backend raises (dynamo may then run the frame eagerly), no report says it fused."""
    _, f, args = _local_graphs(gen)[0]
    gm, inputs = capture(f, *args)

    def failing(gm, inputs):
        raise RuntimeError("the inner backend failed")

    reports = []
    with pytest.raises(RuntimeError, match="the inner backend failed"):
        fusion.backend(None, inner=failing, reports=reports)(gm, inputs)
    assert reports == []


def test_a_compile_after_dynamo_reset_adds_its_own_report(gen):
    """torch._dynamo.reset() numbers compiles from 0/0 again: the next graph's report is added, not put in the
    place of the last one (which a restart of the same compile does)."""
    _, f, args = _local_graphs(gen)[0]
    reports = []
    be = fusion.backend(None, reports=reports, rewrite="all")  # the local op whatever the machine's evidence rule
    for i in range(2):
        torch._dynamo.reset()
        torch.compile(f, backend=be, fullgraph=True)(*_cloned(args))
        assert len(reports) == i + 1 and reports[-1].count() == 1, reports
    assert reports[0].compile_id == reports[1].compile_id  # the same id: why the id alone cannot tell


def test_rewrite_value_is_checked(gen):
    _, f, args = _local_graphs(gen)[0]
    gm, _ = capture(f, *args)
    with pytest.raises(ValueError, match="rewrite must be one of"):
        fusion.fuse(gm, None, rewrite="some")
    with pytest.raises(ValueError, match="rewrite must be one of"):
        fusion.backend(None, rewrite="none")


@mpi
def test_auto_rewrites_collective_tails_for_inductor(quiet_comm, gen):
    c = quiet_comm
    x, residual, weight, scale, wo = setup(c, gen, quant="fp8")

    def layer(x, residual, weight, wo, scale):
        h = all_reduced_sum(x, residual, wo)
        return fp8(hf_norm(h, weight), scale), h

    gm, inputs = capture(layer, x, residual, weight, wo, scale)
    report = fusion.fuse(gm, c, compiler="inductor")
    assert counts(gm) == {FUSED_AR: 1} and not report.skipped, report


def test_casts_merged_only_where_nothing_writes_their_tensor_between(gen):
    """A norm whose input is cast twice matches as one cast; where something could tell the two casts apart (the
    tensor written in place between them, through a view too; a cast's result written, through a list argument
    too; both returned) they stay two, and the graph computes what it did."""
    x, residual, weight, _ = _local_inputs(gen)

    def once(x, residual, weight):
        return twice_cast_norm(x + residual, weight)

    def written(x, residual, weight):
        h = x + residual
        v = h.float().pow(2).mean(-1, keepdim=True)
        h.view(-1).mul_(2)
        return weight * (h.float() * torch.rsqrt(v + 1e-6)).to(h.dtype)

    def result_written(x, residual, weight):  # merged, the first cast would see the second's write
        h = x + residual
        a, b = h.float(), h.float()
        b.mul_(2)
        return a * b

    def foreach_written(x, residual, weight):  # a write through a list argument
        h = x + residual
        a, b = h.float(), h.float()
        torch._foreach_mul_([b], 2.0)
        return a * b

    def returned(x, residual, weight):  # merged, the caller would get one tensor twice
        h = x + residual
        a, b = h.float(), h.float()
        return a * b, a, b

    gm, inputs = capture(once, x, residual, weight)
    assert fusion.fuse(gm, None, rewrite="all").count() == 1
    # each pair meets in one computation (the merge's other condition), so only the writes or the output keep it two
    for fn in (written, result_written, foreach_written, returned):
        gm, inputs = capture(fn, x, residual, weight)
        want = gm(*_cloned(inputs))
        casts = sum(G.kind(n) == "cast" for n in gm.graph.nodes)
        report = fusion.fuse(gm, None, rewrite="all")
        assert report.count() == 0 and sum(G.kind(n) == "cast" for n in gm.graph.nodes) == casts, report
        got = gm(*_cloned(inputs))
        assert all(bits_equal(g, w) for g, w in zip(got, want)), fn.__name__
        assert len({g.data_ptr() for g in got}) == len(got), fn.__name__


def test_two_norms_of_one_tensor_keep_their_casts(gen):
    """A parallel block's two RMSNorms of one residual stream, each casting it to float32: the casts are not merged
    (each norm would see its cast read by the other's nodes and be refused); both norms fuse, bit for bit."""
    x, residual, weight, _ = _local_inputs(gen)
    other = torch.randn(weight.shape, generator=gen).to(weight.dtype)

    def parallel(x, residual, weight, other):
        h = x + residual
        return weight_before_cast_norm(h, weight), weight_before_cast_norm(h, other), h

    gm, inputs = capture(parallel, x, residual, weight, other)
    want = gm(*_cloned(inputs))
    report = fusion.fuse(gm, None, rewrite="all")
    assert report.count() == 2 and not report.skipped, report
    got = gm(*_cloned(inputs))
    assert all(bits_equal(g, w) for g, w in zip(got, want))


def test_casts_written_by_a_reader_are_not_merged(gen):
    """Ops that read as computations (silu, clamp) but write a cast or its tensor (`inplace=True`, `out=`): the two
    casts stay two, and the graph computes what it did (merged, one cast would see the other's write, or the cast
    after the write the value before it)."""
    x, residual, weight, _ = _local_inputs(gen)

    def silu_in_place(x, residual, weight):
        h = x + residual
        a, b = h.float(), h.float()
        F.silu(b, inplace=True)
        return a * b

    def clamp_out(x, residual, weight):
        h = x + residual
        a = h.float()
        torch.clamp(h, 0, 1, out=h)
        return a + h.float()

    for fn in (silu_in_place, clamp_out):
        gm, inputs = capture(fn, x, residual, weight)
        want = gm(*_cloned(inputs))
        report = fusion.fuse(gm, None, rewrite="all")
        assert sum(G.kind(n) == "cast" for n in gm.graph.nodes) == 2, (fn.__name__, report)
        got = gm(*_cloned(inputs))
        assert bits_equal(got[0], want[0]) and bits_equal(want[0], fn(*_cloned((x, residual, weight)))), fn.__name__


def test_a_result_given_out_is_its_out_tensor(gen):
    """`hh = torch.add(x, x, out=z)` is z: a write to z between two casts of hh tells them apart, so they stay two."""
    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, weight):
        z = residual * 1
        hh = torch.add(x, x, out=z)
        a = hh.float()
        z.mul_(2)
        return a + hh.float()

    gm, inputs = capture(f, x, residual, weight)
    want = gm(*_cloned(inputs))
    fusion.fuse(gm, None, rewrite="all")
    assert sum(G.kind(n) == "cast" for n in gm.graph.nodes) == 2, gm.code
    assert bits_equal(gm(*_cloned(inputs))[0], want[0])


def test_post_grad_pass_cache_key_hashes_every_file_auto_reads(monkeypatch):
    """rewrite="auto" asks routes.plan whether a kernel would run, which reads the gated norm's and quantize's limits
    and rejections, jit's targets and topology's SM floor: an edit there must change Inductor's key (only
    kernels/family.py was hashed, so cached code fused under the old limits was reused)."""
    import importlib

    import torch._inductor.custom_graph_pass as custom_graph_pass

    backend = importlib.import_module("commfuse.fusion.backend")  # the module: fusion.backend is a function

    hashed = []
    monkeypatch.setattr(custom_graph_pass, "get_hash_for_files", lambda files: hashed.extend(files) or b"key")
    backend._post_grad_pass_class.cache_clear()
    try:
        fusion.post_grad_pass(None).uuid()
    finally:
        backend._post_grad_pass_class.cache_clear()  # the next one binds torch's hash again
    package = Path(commfuse.__file__).parent
    names = {Path(f).relative_to(package).as_posix() for f in hashed}
    assert {"routes.py", "local.py", "ops.py", "topology.py", "kernels/family.py", "kernels/gated_norm.py",
            "kernels/quantize.py", "kernels/fused_tail.py", "kernels/jit.py", "fusion/evidence.py",
            "tail/spec.py"} <= names, sorted(names)


@mpi
def test_post_grad_pass_cache_key_tells_communicators_of_other_groups_apart(comm, monkeypatch):
    """Inductor reuses a cached graph whose pass key is the same without running the pass; the cached code names its
    Communicator ("commfuse-0" in every process that makes one first). A Communicator of that name over another
    group (a fused all-reduce over WORLD would then run over it) has another key; so has COMMFUSE_DISABLE_FUSION
    (rewrite="auto" reads it); the same settings have the same key."""
    rank = dist.get_rank()
    solo = commfuse.Communicator([dist.new_group([r]) for r in range(dist.get_world_size())][rank])
    whole = commfuse.Communicator(comm.group)
    monkeypatch.setattr(solo, "name", whole.name)
    key = lambda c: fusion.post_grad_pass(c).uuid()  # noqa: E731
    assert key(whole) == key(whole) and key(None) == key(None)
    assert key(solo) != key(whole) and key(None) != key(whole)
    monkeypatch.setenv("COMMFUSE_DISABLE_FUSION", "1")
    with_fusion_off = key(whole)
    monkeypatch.delenv("COMMFUSE_DISABLE_FUSION")
    assert with_fusion_off != key(whole)


@mpi
def test_post_grad_pass_fuses_inside_inductor(quiet_comm, gen):
    """commfuse.fusion.post_grad_pass as Inductor's post-grad custom pass: Inductor's own graph of the model (aten
    ops, the in-place all-reduce functionalized, the norm's input cast to float32 twice) is fused into one op,
    whose outputs are the eager Communicator call's bits."""
    import torch._inductor.config as inductor_config

    c = quiet_comm
    x, residual, weight, scale, _ = setup(c, gen, quant="fp8")
    reports = []

    def compiled(fn, *args, dynamic=None, fullgraph=True):
        # No FX graph cache: a cached graph would not run the pass.
        patch = dict(fx_graph_cache=False, post_grad_custom_post_pass=fusion.post_grad_pass(c, reports=reports))
        torch._dynamo.reset()
        with inductor_config.patch(patch), torch.no_grad():
            return torch.compile(fn, backend="inductor", fullgraph=fullgraph, dynamic=dynamic)(*args)

    def layer(x, residual, weight, scale):
        y = x.clone()
        dist.all_reduce(y, group=c.group)
        h = residual + y
        return fp8(twice_cast_norm(h, weight), scale), h

    want = c.fused_all_reduce(x, residual, weight, 1e-6, "fp8", scale)
    for fullgraph in (True, False):  # without fullgraph, torch.compile deep-copies Inductor's config, the pass too
        q, h = compiled(layer, x, residual, weight, scale, fullgraph=fullgraph)
        report = reports[-1]
        assert report.count("commfuse::fused_all_reduce") == 1 and report.level == "Inductor post-grad graph", report
        assert "route: " in str(report) and "route: unknown" not in str(report), report  # planned on real tensors
        assert bits_equal(h, want.residual) and bits_equal(q, want.quant)
    assert len(reports) == 2, reports
    with pytest.raises(ValueError, match="rewrite must be one of"):
        fusion.post_grad_pass(c, rewrite="some")

    # The nodes around the op written as aten ops, which Inductor lowers there: [b, s, h] rows reshaped to
    # [tokens, h] and back (b and s symbolic when marked dynamic: read by aten.sym_size), the reciprocal of a scale.
    def layer_3d(x, residual, weight, scale):
        q, h = layer(x, residual, weight, scale)
        return q, h, h.shape[0] * h.shape[1]

    def inverse_scale(x, residual, weight, scale):
        y = x.clone()
        dist.all_reduce(y, group=c.group)
        h = residual + y
        return (hf_norm(h, weight) * scale).clamp(-448, 448).to(torch.float8_e4m3fn), h

    x3, residual3 = x.view(2, 3, -1), residual.view(2, 3, -1)
    for fn, args, dynamic in ((layer_3d, (x3, residual3, weight, scale), False),
                              (layer_3d, (x3, residual3, weight, scale), True),
                              (inverse_scale, (x, residual, weight, 1 / scale), False)):
        if dynamic:
            for t, d in ((x3, 0), (x3, 1), (residual3, 0), (residual3, 1)):
                torch._dynamo.mark_dynamic(t, d)
        got = compiled(fn, *args)
        assert reports[-1].count("commfuse::fused_all_reduce") == 1, (fn.__name__, dynamic, reports[-1])
        want = c.fused_all_reduce(x, residual, weight, 1e-6, "fp8", torch.reciprocal(1 / scale) if fn is inverse_scale
                                  else scale)
        assert got[0].shape == got[1].shape == args[1].shape, (fn.__name__, got[0].shape, got[1].shape)
        assert bits_equal(got[0].view(want.quant.shape), want.quant), fn.__name__
        assert bits_equal(got[1].view_as(residual), want.residual), fn.__name__
        assert fn is not layer_3d or got[2] == 6, got[2]

    # dynamic=True makes the hidden size symbolic, and (torch 2.13) the norm's eps a graph input, a one-element
    # tensor in Inductor's graph: not fused, the report saying why for the norm and for the all-reduce whose sum it
    # reads; the model compiles as without the pass.
    def layer_eps(x, residual, weight):
        y = x.clone()
        dist.all_reduce(y, group=c.group)
        h = residual + y
        return hf_norm(h, weight), h

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        want = torch.compile(layer_eps, backend="inductor", fullgraph=True, dynamic=True)(x, residual, weight)
    got = compiled(layer_eps, x, residual, weight, dynamic=True)
    (norm,), (ar,) = ([s for s in reports[-1].skipped if s.what == what] for what in ("rmsnorm", "all-reduce"))
    assert reports[-1].count() == 0 and norm.reason in ar.reason and any(
        why in norm.reason for why in ("eps is a one-element tensor", "the hidden size is symbolic")), reports[-1]
    assert all(bits_equal(g, w) for g, w in zip(got, want))


def test_aten_level_graph_from_make_fx(gen):
    """The same pattern as torch.compile decomposes it (aten ops, _to_copy to float8)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, residual, weight, scale = _local_inputs(gen)

    def f(x, residual, weight, scale):
        h = x + residual
        return fp8(weight_before_cast_norm(h, weight), scale), h

    def g(x, residual, weight, scale):
        h = x + residual
        return fp8(torch_norm(h, weight), scale), h

    for fn, kw in ((f, {}), (g, {}), (g, {"pre_dispatch": True})):  # g: F.rms_norm decomposed / as aten.rms_norm
        gm = make_fx(fn, **kw)(x, residual, weight, scale)
        assert any(str(n.target).startswith("aten.") for n in gm.graph.nodes)
        want = gm(x, residual, weight, scale)
        report = fusion.fuse(gm)
        assert counts(gm) == {LOCAL: 1}, (kw, report)
        assert_same(list(gm(x, residual, weight, scale)), list(want))


def test_symbolic_trace_with_rmsnorm_module(gen):
    x, residual, weight, scale = _local_inputs(gen)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(64, eps=1e-6, dtype=BF16)
            self.norm.weight.copy_(weight)

        def forward(self, x, residual, scale):
            h = x + residual
            return fp8(self.norm(h), scale), h

    gm = torch.fx.symbolic_trace(M())
    want = gm(x, residual, scale)
    report = fusion.fuse(gm, example_inputs=(x, residual, scale))
    assert counts(gm) == {LOCAL: 1}, report
    assert report.fused[0].spelling.startswith("nn.RMSNorm"), report
    assert_same(list(gm(x, residual, scale)), list(want))


@pytest.mark.parametrize("module", ["nn.Identity", "nn.Flatten", "nn.Unflatten"])
def test_symbolic_trace_modules_that_return_their_input_alias_it(gen, module):
    """Under symbolic_trace an nn.Identity, nn.Flatten or nn.Unflatten is a call_module node that returns its input
    itself or a view of it: an in-place nn.ReLU of its result writes the residual sum between the add and the norm,
    and the pattern is skipped with that write (the fused op would normalise the sum before it)."""
    x, residual, weight, _ = _local_inputs(gen)
    passes = {"nn.Identity": torch.nn.Identity(), "nn.Flatten": torch.nn.Flatten(),
              "nn.Unflatten": torch.nn.Unflatten(1, (8, 8))}

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = rms_norm_module(weight, 1e-6)
            self.passes = passes[module]
            self.act = torch.nn.ReLU(inplace=True)

        def forward(self, x, residual):
            h = x + residual
            self.act(self.passes(h))
            return self.norm(h), h

    gm = torch.fx.symbolic_trace(M())
    want = gm(*_cloned((x, residual)))
    report = fusion.fuse(gm, example_inputs=_cloned((x, residual)))
    assert not counts(gm), report
    assert any("written in place (act)" in r for r in _skip_reasons(report, "rmsnorm")), report
    assert_same(list(gm(*_cloned((x, residual)))), list(want))


@mpi
def test_symbolic_trace_with_a_functional_all_reduce(quiet_comm, gen):
    """torch.fx.symbolic_trace keeps funcol's wrapper of the all-reduce's result (_wrap_tensor_autograd) where
    dynamo has the wait: the tail after it is fused into the collective all the same."""
    import torch.distributed._functional_collectives as fc

    c = quiet_comm
    x, residual, weight, _, _ = setup(c, gen)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = rms_norm_module(weight, 1e-6)

        def forward(self, x, residual):
            h = fc.all_reduce(x, "sum", c.group) + residual
            return self.norm(h), h

    gm = torch.fx.symbolic_trace(M())
    assert any(G.kind(n) == "wait" and "wrap_tensor" in str(n.target) for n in gm.graph.nodes)
    want = gm(x, residual)
    report = fusion.fuse(gm, c, example_inputs=(x, residual))
    assert counts(gm) == {FUSED_AR: 1} and not report.skipped, report
    assert_same(list(gm(x, residual)), list(want))


def test_local_negative_cases(gen):
    x, residual, weight, scale = _local_inputs(gen)

    def f(x, residual, weight):
        h = x + residual
        hf = h.float()
        inv = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
        n1 = (hf * inv).to(BF16)  # no weight
        w32 = weight.float()
        n2 = F.rms_norm(h, (64,), w32, 1e-6)  # a float32 weight
        return n1, n2

    gm, report, want, got = fuse_and_run(f, (x, residual, weight), None)
    assert not counts(gm), report
    reasons = _skip_reasons(report, "rmsnorm")
    assert any("no multiply by a bfloat16 weight" in r for r in reasons) and any("float32" in r for r in reasons), report
    assert_same(got, want)


def test_rsqrt_written_as_one_over_sqrt(gen):
    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, weight):
        h = residual + x
        hf = h.float()
        out = hf * (1 / torch.sqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)) * weight.float()
        return out.to(BF16), h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight), None)
    assert counts(gm) == {LOCAL: 1}, report
    assert any("1/sqrt" in n for _, n in report.numerics), report
    assert_rounding_order_close(got, want, ["norm", "residual"])


FP8_MAX = 448.0  # a float global: under dynamic=True dynamo lifts it to a graph input (a SymFloat)


def test_dynamic_floats_eps_and_clamp_bounds(gen):
    x, residual, weight, scale = _local_inputs(gen)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(weight)
            self.eps = 1e-6

        def forward(self, x, residual, scale):
            h = x + residual
            n = weight_before_cast_norm(h, self.weight, self.eps)
            return (n / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), h

    gm, report, want, got = fuse_and_run(M(), (x, residual, scale), None, dynamic=True)
    assert counts(gm) == {LOCAL: 1} and report.fused[0].quant == "fp8", report
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "item" and not n.users]
    assert_same(got, want)


def test_local_and_gated_rewrites_keep_the_graphs_eps(gen):
    """The op takes the graph's own eps (0.25 here: a value the outputs show), not a default."""
    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, weight):
        h = x + residual
        return weight_before_cast_norm(h, weight, eps=0.25), h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight), None)
    assert counts(gm) == {LOCAL: 1} and op_eps(gm) == [0.25], report
    assert_same(got, want)


# --------------------------------------------------------------------------- what looks like the pattern and is not


def _norm_of(inv):
    """A norm of h whose inverse RMS is inv(hf) and whose weight multiplies after it, in float32."""
    def norm(h, w, s):
        hf = h.float()
        return (hf * inv(hf) * w.float()).to(BF16), h
    return norm


def _quant_of(q):
    def quant(h, w, s):
        return q(weight_before_cast_norm(h, w), s), h
    return quant


NOT_THE_PATTERN = {  # each differs from the norm or the quantization in one operand
    "hf.pow(4).mean(-1)": _norm_of(lambda hf: torch.rsqrt(hf.pow(4).mean(-1, keepdim=True) + 1e-6)),
    "hf.pow(2).mean(0)": _norm_of(lambda hf: torch.rsqrt(hf.pow(2).mean(0, keepdim=True) + 1e-6)),
    "2 / sqrt(ms + eps)": _norm_of(lambda hf: 2 / torch.sqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)),
    "(scale / n).to(fp8)": _quant_of(lambda n, s: (s / n.float()).clamp(-448, 448).to(torch.float8_e4m3fn)),
    "n * (2 / scale)": _quant_of(lambda n, s: (n.float() * (2 / s)).clamp(-448, 448).to(torch.float8_e4m3fn)),
    "rsqrt(ms + -1e-6)": _norm_of(lambda hf: torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + -1e-6)),  # eps < 0
}


@pytest.mark.parametrize("case", sorted(NOT_THE_PATTERN))
def test_what_differs_from_the_norm_or_the_quantization_in_one_operand_is_not_fused(gen, case):
    """A fourth power, the mean over tokens, a 2 for the 1 of 1/sqrt, a negative eps, the scale divided by the
    norm or a 2 for the 1 of 1/scale: not what the ops compute. The norm is left as written (so is the add it reads); the
    quantization is left to the graph (the add + norm before it may fuse, without it). The outputs are the
    graph's."""
    x, residual, weight, scale = _local_inputs(gen)

    def f(x, residual, weight, scale):
        return NOT_THE_PATTERN[case](x + residual, weight, scale)

    gm, report, want, got = fuse_and_run(f, (x, residual, weight, scale), None)
    quantized = case.startswith(("(scale", "n *"))
    assert all(f.quant is None for f in report.fused) if quantized else not counts(gm), report
    assert_same(got, want)


def _add_one(h, w, s):
    h.add_(1.0)  # the norm below reads h, the add's node: written after it
    return weight_before_cast_norm(h, w), h


def _zero_columns(h, w, s):
    h[:, :8] = 0
    return weight_before_cast_norm(h, w), h


def _scale_norm(h, w, s):
    n = weight_before_cast_norm(h, w)
    n.mul_(4)
    return fp8(n, s), h


def _scale_weight(h, w, s):
    w.mul_(2)  # an input, which the op would read before the write (at the add)
    return weight_before_cast_norm(h, w), h


_RELU = torch.nn.ReLU(inplace=True)


def _relu_in_place(h, w, s):
    F.relu(h, inplace=True)  # dynamo keeps the keyword: no schema, no trailing underscore
    return weight_before_cast_norm(h, w), h


def _relu_module_in_place(h, w, s):
    _RELU(h)
    return weight_before_cast_norm(h, w), h


def _hardtanh_in_place_by_position(h, w, s):
    F.hardtanh(h, -1.0, 1.0, True)
    return weight_before_cast_norm(h, w), h


def _foreach_in_place(h, w, s):
    torch._foreach_mul_([w, h], 2.0)  # a list of tensors written in place
    return weight_before_cast_norm(h, w), h


def _through(view):
    def write(h, w, s):
        view(h).mul_(2)  # a write to h through a view whose spelling names no view
        return weight_before_cast_norm(h, w), h
    return write


IN_PLACE = {"h.add_ before the norm": _add_one, "h[:, :8] = 0 before the norm": _zero_columns,
            "n.mul_ before the FP8 quant": _scale_norm, "weight.mul_ between the add and the norm": _scale_weight,
            "F.relu(h, inplace=True)": _relu_in_place, "nn.ReLU(inplace=True)(h)": _relu_module_in_place,
            "F.hardtanh(h, -1, 1, True)": _hardtanh_in_place_by_position,
            "torch._foreach_mul_([w, h], 2)": _foreach_in_place,
            "h.T.mul_": _through(lambda h: h.T), "h.data.mul_": _through(lambda h: h.data),
            "torch.swapdims(h, 0, 1).mul_": _through(lambda h: torch.swapdims(h, 0, 1)),
            "torch.moveaxis(h, 0, 1).mul_": _through(lambda h: torch.moveaxis(h, 0, 1)),
            "h.adjoint().mul_": _through(lambda h: h.adjoint()),
            "torch.atleast_2d(h).mul_": _through(torch.atleast_2d),
            # no dtype: h itself where the device and layout are h's already
            "h.to('cpu').mul_": _through(lambda h: h.to("cpu")),
            "h.to(h.device).mul_": _through(lambda h: h.to(h.device)),
            "h.to(memory_format=torch.contiguous_format).mul_":
                _through(lambda h: h.to(memory_format=torch.contiguous_format))}


@pytest.mark.parametrize("case", sorted(IN_PLACE))
def test_in_place_writes_inside_the_pattern_are_not_fused(gen, case):
    """The fused op computes from the values before such a write: the pattern is skipped, saying what is
    written by which node, and the outputs are the graph's. A write after the pattern still fuses."""
    x, residual, weight, scale = _local_inputs(gen)

    def f(x, residual, weight, scale):
        return IN_PLACE[case](x + residual, weight, scale)

    gm, report, want, got = fuse_and_run(f, (x, residual, weight, scale), None)
    assert not counts(gm), report
    assert any("written in place" in r for r in _skip_reasons(report, "rmsnorm")), report
    assert_same(got, want)

    def after(x, residual, weight):
        h = x + residual
        n = weight_before_cast_norm(h, weight)
        h.add_(1.0)
        return n, h

    gm, report, want, got = fuse_and_run(after, (x, residual, weight), None)
    assert counts(gm) == {LOCAL: 1}, report
    assert_same(got, want)


def test_a_write_through_an_in_place_ops_result_is_seen(gen):
    """`alias = sc.mul_(1.0)` is sc itself: a write through it between the add (where the op would read the
    scale) and the quantization (where the graph does) is a write to the scale, so the pattern is skipped."""
    x, residual, weight, scale = _local_inputs(gen)

    def f(x, residual, weight, scale):
        sc = scale * 1.0
        alias = sc.mul_(1.0)
        h = x + residual
        n = weight_before_cast_norm(h, weight)
        alias.mul_(4)
        return fp8(n, sc), h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight, scale), None)
    assert not counts(gm), report
    assert any("the scale sc is written in place (mul__1)" in r for r in _skip_reasons(report, "rmsnorm")), report
    assert_same(got, want)


def test_an_input_written_after_its_last_read_still_fuses(gen):
    """x written after the residual add, its only read, and before the norm: the fused op reads x at the add
    too, so the write changes nothing it reads, and the pattern fuses (the report named no write to skip for)."""
    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, weight):
        h = x + residual
        x.mul_(2)
        return weight_before_cast_norm(h, weight), h, x

    gm, report, want, got = fuse_and_run(f, (x, residual, weight), None)
    assert counts(gm) == {LOCAL: 1} and not report.skipped, report
    assert_same(got, want)


def test_an_integer_scales_reciprocal_is_quantized_as_the_graph_does(gen):
    """n * s.reciprocal() with an int32 s (its reciprocal is float32): the op takes only a float32 scale, so the
    pass does not hand it s; the compiled call runs, and its codes are the graph's."""
    x, residual, weight, _ = _local_inputs(gen)
    s = torch.tensor([3], dtype=torch.int32)

    def f(x, residual, weight, s):
        r = s.reciprocal()
        h = x + residual
        return (weight_before_cast_norm(h, weight).float() * r).clamp(-448, 448).to(torch.float8_e4m3fn), h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight, s), None)
    assert counts(gm) == {LOCAL: 1}, report
    assert_same(got, want)


def test_in_place_write_in_an_aten_graph_is_not_fused(gen):
    from torch.fx.experimental.proxy_tensor import make_fx

    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, weight):
        h = x + residual
        h[:, :8] = 0  # a write through a view: the norm reads the add's node
        return torch_norm(h, weight), h

    gm = make_fx(f)(x, residual, weight)
    want = gm(x, residual, weight)
    report = fusion.fuse(gm)
    assert not counts(gm) and any("written in place" in r for r in _skip_reasons(report)), report
    assert_same(list(gm(x, residual, weight)), list(want))


def test_a_foreach_write_in_an_aten_graph_is_not_fused(gen):
    """aten._foreach_mul_ marks its list of tensors written (`Tensor(a!)[]`): a write to h in that list, between the
    add and the norm, keeps the pattern unfused."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, weight):
        h = x + residual
        torch._foreach_mul_([weight, h], 2.0)
        return torch_norm(h, weight), h

    gm = make_fx(f)(x.clone(), residual, weight.clone())
    want = gm(x.clone(), residual, weight.clone())
    report = fusion.fuse(gm)
    assert not counts(gm) and any("written in place" in r for r in _skip_reasons(report)), report
    assert_same(list(gm(x.clone(), residual, weight.clone())), list(want))


def test_a_norm_viewed_back_to_rows_keeps_the_graphs_shape(gen):
    """A norm of [b, s, h] computed on its [b * s, h] rows and left as rows: the fused op's norm has the
    graph's [b * s, h] shape (not the input's), so its readers (a sum over rows here) see the same shapes."""
    x, residual, weight, _ = _local_inputs(gen, t=6)

    def f(x, residual, weight):
        h = x + residual
        hf = h.float().view(-1, 64)
        hf = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).view(-1, 64)
        n = (hf * weight).to(h.dtype)
        return n, n.sum(0), h

    gm, report, want, got = fuse_and_run(f, (x.view(2, 3, 64), residual.view(2, 3, 64), weight), None)
    assert counts(gm) == {LOCAL: 1}, report
    assert [g.shape for g in got] == [w.shape for w in want]
    assert_same(got, want)


def test_a_norm_viewed_to_another_shape_is_not_fused(gen):
    """A grouped gated norm viewed back to [3, 2, h] from its [6, h] input: neither the input's shape nor
    rows, so the pass leaves it, saying why."""
    x, z, weight, _ = _local_inputs(gen, t=6)

    def f(x, z, weight):
        g = (x.float() * F.silu(z.float())).view(6, 4, 16)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)
        return (g.view(3, 2, 64) * weight).to(x.dtype)

    gm, report, want, got = fuse_and_run(f, (x, z, weight), None)
    assert not counts(gm), report
    assert any("the fused ops give the input's shape" in r for r in _skip_reasons(report, "rmsnorm")), report
    assert_same(got, want)


def test_an_fp8_scale_that_broadcasts_the_codes_is_not_fused(gen):
    """A one-element scale of higher rank than the norm makes the graph's codes [1, t, h]: the fused op's
    would be [t, h], so the quantization stays in the graph (the add + norm still fuse)."""
    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, weight, scale):
        n = weight_before_cast_norm(x + residual, weight)
        return fp8(n.float(), scale)

    gm, report, want, got = fuse_and_run(f, (x, residual, weight, torch.full((1, 1, 1), 0.02)), None)
    assert report.fused and report.fused[0].quant is None, report
    assert any("broadcasts" in r for r in _skip_reasons(report, "quantization")), report
    assert [g.shape for g in got] == [w.shape for w in want]
    assert_same(got, want)


def test_torch_rms_norm_over_a_symbolic_hidden_size_says_so(gen):
    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, weight):
        h = x + residual
        return F.rms_norm(h, (h.shape[-1],), weight, 1e-5), h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight), None, dynamic=True)
    assert not counts(gm), report
    assert _skip_reasons(report, "rmsnorm") == ["the hidden size is symbolic: the fused ops need a fixed one"], report
    assert_same(got, want)


@pytest.mark.parametrize("clamps, fused", [
    (lambda q: q.clamp_max(100).clamp(-448, 448), False),
    (lambda q: q.clamp(min=0).clamp(-448, 448), False),
    (lambda q: q.clamp(-1000, 1000).clamp(-448, 448), True),  # a looser clamp first changes nothing
    (lambda q: q.clamp(min=-448).clamp(max=448), True),
])
def test_fp8_clamp_chains_must_clamp_to_exactly_448(gen, clamps, fused):
    x, residual, weight, scale = _local_inputs(gen)

    def f(x, residual, weight, scale):
        h = x + residual
        return clamps(weight_before_cast_norm(h, weight) / scale).to(torch.float8_e4m3fn), h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight, scale), None)
    assert counts(gm) == {LOCAL: 1}, report
    assert report.fused[0].quant == ("fp8" if fused else None), report
    if not fused:
        assert any("not [-448, 448]" in r for r in _skip_reasons(report, "quantization")), report
    assert_same(got, want)


def test_arguments_that_change_an_add_or_a_division_are_not_the_pattern(gen):
    """torch.div(n, s, rounding_mode="floor") is no FP8 quantization's division, and torch.add(mean, eps,
    alpha=a) no norm's mean + eps."""
    x, residual, weight, scale = _local_inputs(gen)

    def floor_div(x, residual, weight, scale):
        h = x + residual
        n = weight_before_cast_norm(h, weight)
        return torch.div(n.float(), scale, rounding_mode="floor").clamp(-448, 448).to(torch.float8_e4m3fn), h

    gm, report, want, got = fuse_and_run(floor_div, (x, residual, weight, scale), None)
    assert counts(gm) == {LOCAL: 1} and report.fused[0].quant is None, report
    assert_same(got, want)

    def eps_alpha(x, residual, weight):
        h = (x + residual).float()
        inv = torch.rsqrt(torch.add(h.pow(2).mean(-1, keepdim=True), 1e-6, alpha=1e6))
        return (h * inv * weight.float()).to(BF16)

    gm, report, want, got = fuse_and_run(eps_alpha, (x, residual, weight), None)
    assert not counts(gm), report
    assert_same(got, want)


def test_a_residual_add_given_out_is_no_residual_add(gen):
    """`torch.add(x, r, out=r)` (a residual updated in place, as vLLM's fused_add_rms_norm does) writes the caller's
    r: an op in the add's place would not. The add stays; the norm of its result fuses alone."""
    x, residual, weight, _ = _local_inputs(gen)

    def f(x, residual, weight):
        h = torch.add(x, residual, out=residual)
        return torch_norm(h, weight), h

    gm, inputs = capture(f, x, residual, weight)
    unfused, fused = _cloned(inputs), _cloned(inputs)
    want = gm(*unfused)
    report = fusion.fuse(gm, None)
    got = gm(*fused)
    assert counts(gm) == {LOCAL: 1} and report.fused[0].pattern == "rmsnorm", report
    assert_same(list(got), list(want))
    assert all(bits_equal(a, b) for a, b in zip(fused, unfused)) and not bits_equal(fused[1], inputs[1])


@pytest.mark.parametrize("between", ["n.to(T)", "n.to(T).view(-1, h)", "n.view(1, -1, h).contiguous().type_as(n)"])
def test_no_op_casts_and_copies_before_a_quantization_are_not_replayed_on_the_codes(gen, between):
    """A cast of the norm to the dtype it has (models' `.to(input_dtype)`) or a copy between the norm and its FP8
    quantization computes nothing: the op's codes take its place as they are, float8 (a cast replayed on them
    would give T values of the codes); the views among them are replayed."""
    x, residual, weight, scale = _local_inputs(gen)

    def f(x, residual, weight, scale):
        h = x + residual
        n = torch_norm(h, weight)
        if between == "n.to(T)":
            m = n.to(BF16)
        elif between == "n.to(T).view(-1, h)":
            m = n.to(BF16).view(-1, 64)
        else:
            m = n.view(1, -1, 64).contiguous().type_as(n)
        return fp8(m, scale), h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight, scale), None)
    assert counts(gm) == {LOCAL: 1} and report.fused[0].pattern == "add + rmsnorm + fp8", report
    assert got[0].dtype == torch.float8_e4m3fn and tuple(got[0].shape) == tuple(want[0].shape), report
    assert_same(got, want)


@pytest.mark.parametrize("case", ["written", "returned", "read"])
def test_identical_quantizations_share_the_codes_only_where_nothing_tells_them_apart(gen, case):
    """Two FP8 quantizations of the norm with one scale are one op output, read twice, only where nothing can tell
    the two apart; where one is written in place (`q1.view(torch.uint8).zero_()`) or the graph returns them (the
    caller may write one), the second reads a copy of its own."""
    x, residual, weight, scale = _local_inputs(gen)

    def f(x, residual, weight, scale):
        h = x + residual
        n = torch_norm(h, weight)
        q1, q2 = fp8(n, scale), fp8(n, scale)
        if case == "written":
            q1.view(torch.uint8).zero_()
        if case == "read":
            return q1.float() + q2.float(), h
        return q1, q2, h

    gm, report, want, got = fuse_and_run(f, (x, residual, weight, scale), None)
    assert counts(gm) == {LOCAL: 1} and report.fused[0].pattern == "add + rmsnorm + fp8", report
    assert_same(got, want)
    copies = sum(n.op == "call_method" and n.target == "clone" for n in gm.graph.nodes)
    assert copies == (case != "read"), gm.code
    if case == "returned":
        assert got[0].data_ptr() != got[1].data_ptr()


@pytest.mark.parametrize("form", ["norm_before_gate", "grouped"])
def test_a_gated_norm_of_1_plus_w_is_skipped(gen, form):
    """Gemma's (1 + w) weight in a gated or grouped norm: commfuse.gated_rmsnorm takes no offset (the pass fused it
    and dropped the 1, off by up to 6 here)."""
    x, z, weight, _ = _local_inputs(gen, h=64)

    def f(x, z, w):
        if form == "norm_before_gate":
            xf, zf = x.float(), z.float()
            out = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + 1e-5) * (1.0 + w.float())
            return ((out * F.silu(zf)).to(x.dtype),)
        hs = x.to(torch.float32) * F.silu(z.to(torch.float32))
        g = hs.view(*hs.shape[:-1], 4, 16)
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)).view(hs.shape)
        return ((g * (1.0 + w.float())).to(x.dtype),)

    gm, report, want, got = fuse_and_run(f, (x, z, weight), None)
    assert not counts(gm), report
    assert any("multiplied by 1 + w, and commfuse.gated_rmsnorm takes no weight offset" in r
               for r in _skip_reasons(report, "rmsnorm")), report
    assert_same(got, want)


@pytest.mark.parametrize("z_shape", [(5, 1), (1, 64)])
def test_gated_norm_with_a_broadcast_gate_is_skipped(gen, z_shape):
    x, _, weight, _ = _local_inputs(gen, h=64)
    z = torch.randn(*z_shape, generator=gen).to(BF16)

    gm, report, want, got = fuse_and_run(lambda x, z, w: (mamba2_gated_norm(x, z, w, 16),), (x, z, weight), None)
    assert not counts(gm), report
    assert any(f"z has shape {list(z_shape)}" in r for r in _skip_reasons(report, "rmsnorm")), report
    assert_same(got, want)


def test_a_norm_centred_over_another_dim_is_not_called_a_layernorm(gen):
    """x - x.mean(0) is not a LayerNorm's centring (that is over the normalised, last dim): its reason does not say
    LayerNorm."""
    x, residual, weight, _ = _local_inputs(gen)

    def norm(x, residual, weight):
        h = x + residual
        hf = h.float()
        c = hf - hf.mean(0, keepdim=True)
        return (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(BF16), h

    gm, report, want, got = fuse_and_run(norm, (x, residual, weight), None)
    reasons = _skip_reasons(report, "rmsnorm")
    assert reasons and not any("LayerNorm" in r for r in reasons), report
    assert_same(got, want)


@pytest.mark.parametrize("centred", ["once", "twice"])
def test_a_layernorm_of_half_activations_is_called_a_layernorm(gen, centred):
    """x.float() - mean is normalised in float32: not an RMSNorm of float32 activations; the reason says that it is
    a LayerNorm. Cohere's norm computes x - mean twice (for the variance and for the product), where the reason was
    that no multiply of the normalised tensor by the inverse RMS was found."""
    x, residual, weight, _ = _local_inputs(gen)

    def layer_norm(x, residual, weight):
        h = x + residual
        hf = h.float()
        mean = hf.mean(-1, keepdim=True)
        c = hf - mean
        inv = torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
        return ((c if centred == "once" else hf - mean) * inv * weight.float()).to(BF16), h

    gm, report, want, got = fuse_and_run(layer_norm, (x, residual, weight), None)
    assert not counts(gm), report
    reasons = _skip_reasons(report, "rmsnorm")
    assert len(reasons) == 1 and "it normalises" in reasons[0] and reasons[0].startswith("LayerNorm at inv:"), report
    assert reasons[0].endswith("its input minus the input's mean; commfuse's fused ops take RMSNorm"), report
    assert_same(got, want)


@mpi
@pytest.mark.parametrize("collective", ["dist", "funcol", "commfuse", "commfuse op after"])
def test_the_sum_added_to_itself_is_no_residual_add(quiet_comm, gen, collective):
    """h = y + y of an all-reduced y: the residual is the sum itself, which the fused op cannot take as an
    input. The all-reduce stays, the report says why, the add + norm become the local op."""
    c = quiet_comm
    x, _, weight, _, wo = setup(c, gen)

    def layer(x, weight, wo):
        y = reduce("dist" if collective == "commfuse op after" else collective, c, F.linear(x, wo))
        if collective == "commfuse op after":
            r = commfuse.fused_add_rmsnorm(y, y, weight)
            return r.norm, r.residual
        h = y + y
        return torch_norm(h, weight), h

    gm, report, want, got = fuse_and_run(layer, (x, weight, wo), c)
    assert FUSED_AR not in counts(gm), report
    assert any("computed from the all-reduce's sum too" in r for r in _skip_reasons(report, "all-reduce")), report
    assert_same(got, want)
