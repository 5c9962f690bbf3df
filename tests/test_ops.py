"""commfuse.ops: the Communicator's calls as custom ops, compiled with torch.compile(fullgraph=True).

A compiled function calling the ops must give the bits of the eager Communicator call (same inputs,
same route), with a dynamic number of tokens and, on a GPU, inside CUDA graphs (mode
"reduce-overhead"). Runs on every rank (the ops are collectives): gloo on CPU with the aot_eager
backend, NCCL on GPUs with inductor.
"""
import pytest
import torch
import torch.distributed as dist

import commfuse
from commfuse import ops
from commfuse.tail.spec import code, public

from conftest import error_cycle
from compare import bits_equal
from inputs import rank_inputs, tail_inputs
from test_communicator import _checked_by, exact_sum

mpi = pytest.mark.mpi  # any world size, one process too (under mpirun)
PATTERNS = [  # (quant, return_norm, sf_layout)
    (None, False, "swizzled"), ("fp8", False, "swizzled"), ("fp8", True, "swizzled"),
    ("nvfp4", False, "swizzled"), ("nvfp4", True, "linear"), ("mxfp8", True, "swizzled"),
]


def backend(comm) -> str:
    return "inductor" if comm.device.type == "cuda" else "aot_eager"


@mpi
@pytest.mark.parametrize("quant, return_norm, sf_layout", PATTERNS)
def test_compiled_ops_match_eager_calls(quiet_comm, gen, quant, return_norm, sf_layout):
    c = quiet_comm
    torch._dynamo.reset()

    def layer(x, residual, weight, scale):
        y = ops.all_reduce(c, x)
        r = ops.fused_all_reduce(c, x, residual, weight, eps=1e-5, quant=quant, scale=scale,
                                 return_norm=return_norm, sf_layout=sf_layout)
        return y, r

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=backend(c))
    for i, t in enumerate((3, 130, 17)):  # padding rows of the swizzled layout at 130
        x, _ = rank_inputs(c, gen, (t, 256), torch.bfloat16)
        residual, weight, scale = tail_inputs(c, gen, t, 256, torch.bfloat16, quant)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):  # one graph for every token count
            y, r = compiled(x, residual, weight, scale)
        want_y = c.all_reduce(x)
        want = c.fused_all_reduce(x, residual, weight, 1e-5, quant, scale, return_norm, sf_layout)
        assert bits_equal(y, want_y), f"t={t}: all_reduce"
        for name in ("residual", "norm", "quant", "scale_factors"):
            assert bits_equal(getattr(r, name), getattr(want, name)), f"t={t}: {name}"


@mpi
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_a_post_weight_through_the_ops_eager_compiled_and_opchecked(quiet_comm, gen, quant):
    """ops.fused_all_reduce(post_weight=) (docs/semantics.md section 2a): compiled (one graph for every token
    count) and with out= the bits of the eager call, which is the Communicator's; the op passes opcheck with it."""
    c = quiet_comm
    torch._dynamo.reset()
    post = (1 + 0.1 * torch.randn(256, generator=gen)).bfloat16().to(c.device)

    def layer(x, residual, weight, scale, post):
        return ops.fused_all_reduce(c, x, residual, weight, quant=quant, scale=scale, post_weight=post)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=backend(c))
    for i, t in enumerate((3, 17)):
        x, _ = rank_inputs(c, gen, (t, 256), torch.bfloat16)
        residual, weight, scale = tail_inputs(c, gen, t, 256, torch.bfloat16, quant)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            r = compiled(x, residual, weight, scale, post)
        want = c.fused_all_reduce(x, residual, weight, quant=quant, scale=scale, post_weight=post)
        assert not bits_equal(want.residual, c.fused_all_reduce(x, residual, weight, quant=quant, scale=scale).residual)
        out = tuple(torch.empty_like(f) if f is not None else None for f in (want.residual, want.norm, want.quant)) \
            + (None, None)
        into = torch.compile(lambda *a: ops.fused_all_reduce(c, *a[:3], quant=quant, scale=a[3], out=out,
                                                             post_weight=a[4]), fullgraph=True,
                             backend="aot_eager")(x, residual, weight, scale, post)
        for name in ("residual", "norm", "quant"):
            assert bits_equal(getattr(r, name), getattr(want, name)), f"t={t}: {name}"
            assert bits_equal(getattr(into, name), getattr(want, name)), f"t={t}: out.{name}"
    torch.library.opcheck(torch.ops.commfuse.fused_all_reduce.default,
                          (x, residual, weight, scale, 1e-6, 0.0, code(quant), c.name, post))


@mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_ops_in_cuda_graphs_of_reduce_overhead(quiet_comm, gen):
    c = quiet_comm
    torch._dynamo.reset()

    def layer(x, residual, weight, scale):
        r = ops.fused_all_reduce(c, x, residual, weight, quant="fp8", scale=scale, return_norm=True)
        return r.residual, r.norm, r.quant

    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    for step in range(4):  # warm-up, recording, then replays with new values
        x, _ = rank_inputs(c, gen, (8, 1024), torch.bfloat16)
        residual, weight, scale = tail_inputs(c, gen, 8, 1024, torch.bfloat16, "fp8")
        got = [v.clone() for v in compiled(x, residual, weight, scale)]
        want = c.fused_all_reduce(x, residual, weight, quant="fp8", scale=scale, return_norm=True)
        for g, w, name in zip(got, (want.residual, want.norm, want.quant), ("residual", "norm", "quant")):
            assert bits_equal(g, w), f"step {step}: {name}"
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@mpi
def test_opcheck_all_reduce(quiet_comm, gen):
    """torch.library's own checks of the schema, the fake implementation and dynamic shapes."""
    x, _ = rank_inputs(quiet_comm, gen, (5, 128), torch.bfloat16)
    torch.library.opcheck(torch.ops.commfuse.all_reduce.default, (x, quiet_comm.name))


@mpi
@pytest.mark.parametrize("quant, return_norm, sf_layout", PATTERNS)
def test_opcheck_fused_all_reduce(quiet_comm, gen, quant, return_norm, sf_layout):
    c = quiet_comm
    x, _ = rank_inputs(c, gen, (5, 128), torch.bfloat16)
    residual, weight, scale = tail_inputs(c, gen, 5, 128, torch.bfloat16, quant)
    torch.library.opcheck(torch.ops.commfuse.fused_all_reduce.default,
                          (x, residual, weight, scale, 1e-6, 0.0, code(quant, return_norm, sf_layout), c.name))


@mpi
@pytest.mark.parametrize("compiled", [False, True])
def test_empty_quant_string_is_refused_eager_and_compiled(quiet_comm, gen, compiled):
    """quant="" is no format: refused as comm.fused_all_reduce and the local ops refuse it, eager and compiled
    alike (eager calls took it for no quantization, compiled ones refused it). Refused before any exchange, so
    the ranks stay in step."""
    x, _ = rank_inputs(quiet_comm, gen, (3, 64), torch.bfloat16)
    residual, weight, _ = tail_inputs(quiet_comm, gen, 3, 64, torch.bfloat16, None)
    calls = [lambda: ops.fused_all_reduce(quiet_comm, x, residual, weight, quant="").residual,
             lambda: ops.moe_all_reduce(quiet_comm, x.view(3, 1, 64), torch.ones(3, 1, device=x.device), residual,
                                        weight, quant="").residual]
    for call in calls:
        if compiled:
            torch._dynamo.reset()
            call = torch.compile(call, fullgraph=True, backend="aot_eager")
        with pytest.raises(Exception, match="quant must be one of .*got ''"):
            call()
    want = quiet_comm.fused_all_reduce(x, residual, weight)  # the ranks are still in step
    assert bits_equal(want.residual, quiet_comm.fused_all_reduce(x, residual, weight).residual)


def test_a_layout_of_another_type_is_named():
    """The ops' tail number of a list or dict layout: the error names the argument (a TypeError, not an
    unhashable-type error from the lookup), as eager calls name it."""
    for kw, name in (({"sf_layout": ["swizzled"]}, "sf_layout"), ({"scale_layout": {}}, "scale_layout"),
                     ({"quant": ["fp8"]}, "quant")):
        with pytest.raises(TypeError, match=f"^{name} must be .*, got {type(next(iter(kw.values()))).__name__}$"):
            code(**kw)


def test_bad_arguments_name_themselves(comm):
    x = torch.ones(2, 16, dtype=torch.bfloat16, device=comm.device)
    with pytest.raises(TypeError, match="scale"):
        ops.fused_all_reduce(comm, x, x, x[0], quant="fp8", scale=0.5)
    with pytest.raises(LookupError, match="no-such"):
        torch.ops.commfuse.all_reduce(x, "no-such")
    with pytest.raises(ValueError, match="quant"):
        ops.fused_all_reduce(comm, x, x, x[0], quant="int4")
    for falsy in (False, 0):  # only "" stands for None: any other value is checked, eager as compiled
        with pytest.raises(TypeError, match="quant"):
            ops.fused_all_reduce(comm, x, x, x[0], quant=falsy)
        with pytest.raises(TypeError, match="quant"):
            ops.moe_all_reduce(comm, x.view(2, 1, 16), torch.ones(2, 1, device=comm.device), x, x[0], quant=falsy)
    with pytest.raises(ValueError, match="tail must be the code of a tail spec"):
        torch.ops.commfuse.fused_all_reduce(x, x, x[0], None, 1e-6, 0.0, 255, comm.name)


@pytest.mark.parametrize("op", ["fused_all_reduce", "moe_all_reduce"])
@pytest.mark.parametrize("name, value, error", [
    ("eps", True, "eps must be a number, got bool"), ("weight_offset", True, "weight_offset must be a number"),
    ("weight_offset", "1", "weight_offset must be a number, got str"), ("return_norm", 1, "return_norm must be a bool"),
    ("weight_offset", 10 ** 400, "weight_offset must be a finite float32 number, got inf")],
    ids=["eps True", "weight_offset True", "weight_offset '1'", "return_norm 1", "weight_offset 10**400"])
def test_compiled_calls_refuse_what_eager_calls_refuse(comm, gen, op, name, value, error):
    """The ops' schemas would take eps=True or weight_offset="1" as 1.0 (Gemma's offset, silently) and fail on an
    int past any float naming nothing: compiled calls check them first, as the eager calls do. Both raise before
    any collective."""
    x = torch.randn(2, 16, generator=gen).to(torch.bfloat16).to(comm.device)
    w = torch.rand(2, 1, generator=gen).to(comm.device)
    calls = {"fused_all_reduce": lambda: ops.fused_all_reduce(comm, x, x, x[0], **{name: value}).residual,
             "moe_all_reduce": lambda: ops.moe_all_reduce(comm, x.view(2, 1, 16), w, x, x[0], **{name: value}).residual}
    with pytest.raises((TypeError, ValueError), match=error):
        calls[op]()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=error):
        torch.compile(calls[op], fullgraph=True, backend="aot_eager")()


def test_a_compiled_moe_call_names_its_own_wrong_argument(comm, gen):
    """A compiled moe_all_reduce refuses y of the wrong rank (either form) and a residual without rows as the
    eager call does, naming y or the residual, not the dense ops' x; the op's fake names the residual too."""
    x = torch.randn(2, 16, generator=gen).to(torch.bfloat16).to(comm.device)
    w = torch.rand(2, 1, generator=gen).to(comm.device)
    idx = torch.arange(2, dtype=torch.int32, device=comm.device).view(2, 1)
    cases = [(lambda: ops.moe_all_reduce(comm, x[0, 0], w, x, x[0]).residual, r"y must be \[t, k, h\]"),
             (lambda: ops.moe_all_reduce(comm, x.view(2, 1, 16), w, x, x[0], row_index=idx).residual,
              r"with row_index, y must be the rows \[R, h\]"),
             (lambda: ops.moe_all_reduce(comm, x.view(2, 1, 16), w, x[0, 0], x[0]).residual,
              r"residual must have shape \[\.\.\., h\]")]
    for call, error in cases:
        with pytest.raises((TypeError, ValueError), match=error):
            call()
        torch._dynamo.reset()
        with pytest.raises(Exception, match=error):
            torch.compile(call, fullgraph=True, backend="aot_eager")()
    with torch._subclasses.fake_tensor.FakeTensorMode():
        y, empty = torch.empty(2, 1, 0, dtype=torch.bfloat16), torch.empty(2, 0, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"^residual must have shape"):
            torch.ops.commfuse.moe_all_reduce(y, torch.empty(2, 1), None, None, empty, torch.empty(0), None, 1e-6, 0.0,
                                              0, comm.name)
        with pytest.raises(ValueError, match=r"^residual must have shape \[\.\.\., h\] with h > 0, got \(\)"):
            torch.ops.commfuse.moe_all_reduce(y, torch.empty(2, 1), None, None, torch.empty((), dtype=torch.bfloat16),
                                              torch.empty(0), None, 1e-6, 0.0, 0, comm.name)  # was an IndexError


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["gloo route", "COMMFUSE_CHECK"])
@pytest.mark.parametrize("op", ["fused_all_reduce", "moe_all_reduce"])
def test_an_eager_op_call_with_a_number_scale_on_one_rank_keeps_the_ranks_in_step(comm, gen, check, op):
    """The ops take scale as a tensor. Rank 0 gives a Python number: it raises TypeError through the
    Communicator's refusal, its peers raise CallMismatchError naming it, and the next calls sum right. Before,
    rank 0 raised before its Communicator's exchange: its peers timed out, and the check group was broken."""
    c = _checked_by(comm, check)
    rank = dist.get_rank(c.group)
    t, h = 4, 64
    residual, weight, scale = tail_inputs(c, gen, t, h, torch.bfloat16, "fp8")

    def call(x, s):
        if op == "fused_all_reduce":
            return ops.fused_all_reduce(c, x, residual, weight, quant="fp8", scale=s).residual
        return ops.moe_all_reduce(c, x.view(t, 1, h), torch.ones(t, 1, device=c.device), residual, weight,
                                  quant="fp8", scale=s).residual

    steps = [rank_inputs(c, gen, (t, h), torch.bfloat16) for _ in range(2)]
    cycle = None
    if rank == 0:
        with pytest.raises(TypeError, match="scale must be a float32 tensor of one element, got float") as raised:
            call(steps[0][0], 0.5)
        cycle = error_cycle(raised.value)  # the frames that made and raised it held it: asserted last
    else:
        with pytest.raises(commfuse.CallMismatchError, match="rank 0: a call that raised TypeError: scale must be"):
            call(steps[0][0], scale)
    x, xs = steps[1]
    want = commfuse.reference.fused_tail(commfuse.reference.all_reduce_sum(xs), residual, weight, 1e-6).residual
    got = call(x, scale)
    assert bits_equal(got, want) if exact_sum(c) else torch.allclose(got.float(), want.float(), rtol=2e-2)
    assert cycle is None, cycle


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", ["gloo route", "COMMFUSE_CHECK"])
@pytest.mark.parametrize("op", ["fused_all_reduce", "fused_all_reduce_out", "moe_all_reduce"])
def test_a_raw_op_call_with_a_bad_tail_code_on_one_rank_keeps_the_ranks_in_step(comm, gen, check, op):
    """A tail code that does not decode, on rank 0 only: it raises ValueError through the Communicator's refusal,
    its peers raise CallMismatchError naming it, and the next calls sum right (before, rank 0 raised before the
    exchange: the peers paired their call with its next one, then timed out)."""
    c = _checked_by(comm, check)
    rank = dist.get_rank(c.group)
    t, h = 4, 64
    residual, weight, _ = tail_inputs(c, gen, t, h, torch.bfloat16, None)

    def call(x, tail):
        if op == "fused_all_reduce":
            return torch.ops.commfuse.fused_all_reduce(x, residual, weight, None, 1e-6, 0.0, tail, c.name)[0]
        if op == "moe_all_reduce":
            return torch.ops.commfuse.moe_all_reduce(x.view(t, 1, h), torch.ones(t, 1, device=c.device), None, None,
                                                     residual, weight, None, 1e-6, 0.0, tail, c.name)[0]
        out = torch.full_like(residual, float("nan"))
        torch.ops.commfuse.fused_all_reduce_out(x, residual, weight, None, 1e-6, 0.0, tail, c.name, out, None, None,
                                                None, None)
        return out

    steps = [rank_inputs(c, gen, (t, h), torch.bfloat16) for _ in range(2)]
    if rank == 0:
        with pytest.raises(ValueError, match="tail must be the code of a tail spec"):
            call(steps[0][0], 255)
    else:
        with pytest.raises(commfuse.CallMismatchError, match="rank 0: a call that raised ValueError: tail must be"):
            call(steps[0][0], 0)
    x, xs = steps[1]
    want = commfuse.reference.fused_tail(commfuse.reference.all_reduce_sum(xs), residual, weight, 1e-6).residual
    got = call(x, 0)
    assert bits_equal(got, want) if exact_sum(c) else torch.allclose(got.float(), want.float(), rtol=2e-2)


@mpi
def test_out_ops_write_the_callers_tensors(quiet_comm, gen):
    c = quiet_comm
    x, _ = rank_inputs(c, gen, (5, 128), torch.bfloat16)
    residual, weight, scale = tail_inputs(c, gen, 5, 128, torch.bfloat16, "fp8")
    want = c.fused_all_reduce(x, residual, weight, quant="fp8", scale=scale, return_norm=True)
    out = commfuse.reference.Tail(torch.empty_like(want.residual), torch.empty_like(want.norm),
                                  torch.empty_like(want.quant), None)
    got = ops.fused_all_reduce(c, x, residual, weight, quant="fp8", scale=scale, return_norm=True, out=out)
    total = torch.empty_like(x)
    assert ops.all_reduce(c, x, out=total) is total and bits_equal(total, c.all_reduce(x))
    for name in ("residual", "norm", "quant"):
        assert getattr(got, name) is getattr(out, name) and bits_equal(getattr(out, name), getattr(want, name)), name
    torch.library.opcheck(torch.ops.commfuse.all_reduce_out.default, (x, c.name, torch.empty_like(x)))
    # (Without quantization: opcheck's schema test multiplies mutated outputs, which float8 lacks on the CPU.)
    torch.library.opcheck(torch.ops.commfuse.fused_all_reduce_out.default,
                          (x, residual, weight, None, 1e-6, 0.0, code(), c.name,
                           torch.empty_like(want.residual), torch.empty_like(want.norm), None, None, None))


@mpi
def test_out_with_a_field_left_none_returns_the_same_eager_and_compiled(quiet_comm, gen):
    """out= naming only the residual, on a call that also has a norm: the norm is made and not returned
    (the out op returns nothing of its own), eager as compiled."""
    c = quiet_comm
    x, _ = rank_inputs(c, gen, (5, 128), torch.bfloat16)
    residual, weight, _ = tail_inputs(c, gen, 5, 128, torch.bfloat16, None)
    want = c.fused_all_reduce(x, residual, weight)

    def f(x, residual, weight, mine):
        t = ops.fused_all_reduce(c, x, residual, weight, out=commfuse.reference.Tail(mine, None, None, None, None))
        return t.residual, t.norm

    torch._dynamo.reset()
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        mine = torch.empty_like(want.residual)
        got, norm = fn(x, residual, weight, mine)
        assert norm is None and bits_equal(mine, want.residual) and bits_equal(got, want.residual)


@mpi
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("t", [5, 130])
def test_compiled_out_takes_mn_major_scales(quiet_comm, gen, ue8m0, t):
    """A caller's MN-major out.scales in compiled code: its [t, K] elements get the eager call's bits on every
    backend (compiled code writes back a mutated argument's view: the op's writes to the padding rows, which
    lie outside it, cannot reach the caller), and the padding stays as it was."""
    c, h = quiet_comm, 512
    x, _ = rank_inputs(c, gen, (t, h), torch.bfloat16)
    residual, weight, _ = tail_inputs(c, gen, t, h, torch.bfloat16, None)
    kw = dict(quant="fp8_block", scale_layout="mn_major", scale_ue8m0=ue8m0)
    want = c.fused_all_reduce(x, residual, weight, **kw)
    tp = want.scales.stride(1)
    storage = torch.full((want.scales.shape[1] * tp,), 7, dtype=want.scales.dtype, device=c.device)
    out = commfuse.reference.Tail(torch.empty_like(want.residual), None, torch.empty_like(want.quant), None,
                                  storage.as_strided(want.scales.shape, want.scales.stride()))

    def f(x, residual, weight, out):
        return ops.fused_all_reduce(c, x, residual, weight, out=out, **kw)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend=backend(c))(x, residual, weight, out)
    assert got.scales is out.scales
    for name in ("residual", "quant", "scales"):
        assert bits_equal(getattr(out, name), getattr(want, name)), name
    padding = storage.view(-1, tp)[:, t:]
    assert bool((padding == 7).all()), padding
    bad = {"quant": torch.empty(t, h, device=c.device), "residual": torch.empty(3, t, h, device=c.device),
           "norm": torch.empty_like(want.residual), "scales": torch.empty(want.scales.shape, dtype=want.scales.dtype,
                                                                          device=c.device)}
    for name, tensor in bad.items():  # checked as eager calls check them, not cast or broadcast into
        torch._dynamo.reset()
        with pytest.raises(Exception, match=f"out.{name}"):
            torch.compile(f, fullgraph=True, backend=backend(c))(x, residual, weight, out._replace(**{name: tensor}))


@mpi
def test_eager_wrappers_give_the_ops_bits(quiet_comm, gen):
    """Outside torch.compile the wrappers call the Communicator directly: the same bits as the op."""
    c = quiet_comm
    x, _ = rank_inputs(c, gen, (6, 256), torch.bfloat16)
    residual, weight, scale = tail_inputs(c, gen, 6, 256, torch.bfloat16, "nvfp4")
    via_op = torch.ops.commfuse.fused_all_reduce(x, residual, weight, scale, 1e-6, 0.0, code("nvfp4", True), c.name)
    direct = ops.fused_all_reduce(c, x, residual, weight, quant="nvfp4", scale=scale, return_norm=True)
    assert len(via_op) == 4  # the op returns what the call has: no scales for NVFP4
    for name, a, b in zip(("residual", "norm", "quant", "scale_factors"), direct, via_op):
        assert bits_equal(a, b), name
    assert bits_equal(ops.all_reduce(c, x), torch.ops.commfuse.all_reduce(x, c.name))


@mpi
def test_collective_ops_have_no_gradient(quiet_comm, gen):
    """Inputs that require grad: the collective ops' outputs are plain tensors with the bits of a call without
    grad, as the Communicator's are (torch's fallback would give them a grad_fn passing back no gradient)."""
    c = quiet_comm
    x, _ = rank_inputs(c, gen, (6, 256), torch.bfloat16)
    residual, weight, scale = tail_inputs(c, gen, 6, 256, torch.bfloat16, "fp8")
    want = torch.ops.commfuse.fused_all_reduce(x, residual, weight, scale, 1e-6, 0.0, code("fp8", True), c.name)
    got = torch.ops.commfuse.fused_all_reduce(x.clone().requires_grad_(), residual, weight.clone().requires_grad_(),
                                              scale, 1e-6, 0.0, code("fp8", True), c.name)
    got += (torch.ops.commfuse.all_reduce(x.clone().requires_grad_(), c.name),)
    want += (torch.ops.commfuse.all_reduce(x, c.name),)
    for g, w in zip(got, want):
        assert not g.requires_grad and g.grad_fn is None and bits_equal(g, w)


def first_plan_reasons(c, args) -> str:
    x, residual, weight, scale, eps, weight_offset, tail, _ = args
    p = c.plan(x, residual, weight, eps=eps, scale=scale, weight_offset=weight_offset, **public(tail))
    return f"{p.collective} + {p.tail}: " + "; ".join(p.reasons)


@mpi
def test_cuda_op_kernels_serve_planned_calls_in_cpp(quiet_comm, gen, monkeypatch):
    """On CUDA, torch.ops.commfuse's fused_all_reduce and all_reduce are C++ kernels (commfuse.kernels.native)
    that launch a signature the communicator has planned without calling Python, with the bits of the
    direct call; a signature not planned yet goes to the Python kernel, which plans it."""
    c = quiet_comm
    if c.device.type != "cuda":
        pytest.skip("the C++ op kernels are CUDA kernels: no GPU here")
    from commfuse.kernels import native
    if native.unavailable() is not None:
        pytest.skip(f"native path off: {native.unavailable()}")
    t, h, dtype = 5, 512, torch.bfloat16
    x, _ = rank_inputs(c, gen, (t, h), dtype)
    residual, weight, scale = tail_inputs(c, gen, t, h, dtype, "fp8")
    args = (x, residual, weight, scale, 1e-5, 0.0, code("fp8", True), c.name)

    class PythonKernelCalled(Exception):
        pass

    def refuse(*a, **k):
        raise PythonKernelCalled()

    with monkeypatch.context() as m:  # not planned yet: the C++ kernel hands it to Python
        m.setattr(ops, "_fused_all_reduce", refuse)
        with pytest.raises(PythonKernelCalled):
            torch.ops.commfuse.fused_all_reduce(*args)
    entries = len(c.table)
    first = torch.ops.commfuse.fused_all_reduce(*args)  # the Python kernel plans it
    assert len(c.table) == entries + 1, first_plan_reasons(c, args)
    plain_first = torch.ops.commfuse.all_reduce(x, c.name)
    with monkeypatch.context() as m:
        m.setattr(ops, "_fused_all_reduce", refuse)
        m.setattr(ops, "_all_reduce", refuse)
        again = torch.ops.commfuse.fused_all_reduce(*args)
        plain_again = torch.ops.commfuse.all_reduce(x, c.name)
    direct = c.fused_all_reduce(x, residual, weight, 1e-5, "fp8", scale, True, "swizzled")
    assert len(first) == len(again) == 3  # residual, norm, quant: the outputs the call has
    for u, v, w in zip(first, again, (direct.residual, direct.norm, direct.quant)):
        assert bits_equal(u, v) and bits_equal(v, w)
    assert bits_equal(plain_first, plain_again)
    # With the per-call check on, every call goes to Python (its launcher is the check's Python wrapper).
    c.check_calls = True
    try:
        with monkeypatch.context() as m:
            m.setattr(ops, "_fused_all_reduce", refuse)
            with pytest.raises(PythonKernelCalled):
                torch.ops.commfuse.fused_all_reduce(*args)
    finally:
        c.check_calls = False
