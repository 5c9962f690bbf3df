"""commfuse.fusion.lowering: Inductor's code calls each commfuse op through commfuse.kernels.native.direct,
without re-checking its outputs, and returns the op's results.

On any device: the generated wrapper (on a CPU, Inductor's CPU backend: the graphs hold only commfuse ops,
so it builds no C++) and its outputs against the eager op calls, for every op. GPU: the extension's direct
functions against torch.ops' calls of the same op, bit for bit.
"""
import re

import pytest
import torch

from commfuse.fusion import lowering
from commfuse.kernels import native
from commfuse.tail.spec import code

from compare import bits_equal
from conftest import needs_gpu
from inputs import tail_inputs
from test_local import inputs
from test_moe import moe_inputs

mpi = pytest.mark.mpi(min_size=1)
BF16 = torch.bfloat16


def compiled_code(f, *args):
    """[outputs of each call] and the wrapper code of f compiled afresh by Inductor (one graph, dynamic
    token counts) with commfuse's lowerings; args: a list of argument tuples, one per call."""
    from torch._inductor.utils import run_and_get_code

    lowering.install()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="inductor")
    with torch._inductor.config.patch(force_disable_caches=True):
        first, (wrapper, *_) = run_and_get_code(compiled, *args[0])
        with torch._dynamo.config.patch(error_on_recompile=True):
            rest = [compiled(*a) for a in args[1:]]
    return [first, *rest], wrapper


def assert_direct_calls(wrapper: str, ops: list) -> None:
    """Each op called once through the imported `direct`, none through torch.ops, and no size or stride
    check of an op's output (the graph's inputs keep theirs)."""
    assert "from commfuse.kernels.native import direct as commfuse_direct" in wrapper
    called = re.findall(r"= commfuse_direct\.(\w+)\(", wrapper)
    assert sorted(called) == sorted(ops), called
    assert "torch.ops.commfuse" not in wrapper
    checked = re.findall(r"assert_size_stride\((\w+),", wrapper)
    assert checked and all(re.fullmatch(r"arg\d+_1", name) for name in checked), checked


def devices():
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_compiled_local_ops_call_direct(gen, device, quant):
    h, group = 256, 64

    def f(x, residual, weight, z, scale):
        tail = torch.ops.commfuse.fused_add_rmsnorm(x, residual, weight, scale, 1e-5, 0.0, code(quant, True))
        gated = torch.ops.commfuse.gated_rmsnorm(x, z, weight, scale, 1e-5, group, False, code(quant))
        return tail + gated + torch.ops.commfuse.quantize(tail[1], scale, code(quant))

    args = []
    for t in (5, 130):
        x, residual, weight, scale = inputs(gen, t, h, BF16, device, quant)
        args.append((x, residual, weight, torch.randn(t, h, generator=gen).to(BF16).to(device), scale))
    outs, wrapper = compiled_code(f, *args)
    assert_direct_calls(wrapper, ["fused_add_rmsnorm", "gated_rmsnorm", "quantize"])
    for got, a in zip(outs, args):
        want = f(*a)
        assert len(got) == len(want) and all(bits_equal(g, w) for g, w in zip(got, want))


def test_ops_in_a_torch_cond_branch_call_direct(gen):
    """A subgraph's code (torch.cond's branches) reaches the imported name too."""
    h = 64

    def f(p, x, residual, weight):
        def add_norm(x, residual, weight):
            return torch.ops.commfuse.fused_add_rmsnorm(x, residual, weight, None, 1e-5, 0.0, 0)[1]

        def norm(x, residual, weight):
            return torch.ops.commfuse.fused_add_rmsnorm(x, None, weight, None, 1e-5, 0.0, 0)[0]

        return torch.cond(p, add_norm, norm, (x, residual, weight))

    x, residual, weight, _ = inputs(gen, 4, h, BF16)
    args = [(torch.tensor(p), x, residual, weight) for p in (True, False)]
    outs, wrapper = compiled_code(f, *args)
    assert re.findall(r"= commfuse_direct\.(\w+)\(", wrapper) == ["fused_add_rmsnorm"] * 2
    assert "torch.ops.commfuse" not in wrapper
    for got, a in zip(outs, args):
        assert bits_equal(got, f(*a))


@mpi
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_compiled_collective_ops_call_direct(quiet_comm, gen, quant):
    c = quiet_comm
    h, k = 256, 2

    def f(x, residual, weight, scale, y, w, idx):
        summed = torch.ops.commfuse.all_reduce(x, c.name)
        tail = torch.ops.commfuse.fused_all_reduce(x, residual, weight, scale, 1e-5, 0.0, code(quant), c.name)
        # With a post weight: Inductor's code passes the schema's last argument only where it is not its default.
        post = torch.ops.commfuse.fused_all_reduce(x, residual, weight, scale, 1e-5, 0.0, code(quant), c.name,
                                                   weight.flip(0))
        moe = torch.ops.commfuse.moe_all_reduce(y, w, idx, None, residual, weight, scale, 1e-5, 0.0, code(quant),
                                                c.name)
        return [summed] + tail + post + moe

    args = []
    for t in (3, 17):
        residual, weight, scale = tail_inputs(c, gen, t, h, BF16, quant)
        x = torch.randn(t, h, generator=gen).to(BF16).to(c.device)
        per_rank, rank = moe_inputs(c, gen, t, k, h, BF16, "finalize", torch.float32, False)
        y, w, idx, _ = per_rank[rank]
        args.append((x, residual, weight, scale, y, w, idx))
    outs, wrapper = compiled_code(f, *args)
    assert_direct_calls(wrapper, ["all_reduce", "fused_all_reduce", "fused_all_reduce", "moe_all_reduce"])
    for got, a in zip(outs, args):
        want = f(*a)
        assert len(got) == len(want) and all(bits_equal(g, w) for g, w in zip(got, want))


def test_direct_names_the_ops_only():
    with pytest.raises(AttributeError, match="no op 'Table'"):
        native.direct.Table
    if native.unavailable() is not None:  # the extension is off: the ops themselves
        assert native.direct.quantize is torch.ops.commfuse.quantize.default


@needs_gpu
@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4", "mxfp8"])
def test_gpu_direct_functions_match_the_ops(gen, quant):
    """The extension's bindings run the op kernels: the same bits as torch.ops' calls of the ops."""
    if native.unavailable() is not None:
        pytest.skip(f"the extension is off: {native.unavailable()}")
    assert native.direct.fused_add_rmsnorm is not torch.ops.commfuse.fused_add_rmsnorm.default
    t, h = 37, 512
    x, residual, weight, scale = inputs(gen, t, h, BF16, "cuda", quant)
    z = torch.randn(t, h, generator=gen).to(BF16).cuda()
    calls = [("fused_add_rmsnorm", (x, residual, weight, scale, 1e-5, 0.0, code(quant, quant is not None))),
             ("fused_add_rmsnorm", (x, None, weight, scale, 1e-5, 1.0, code(quant))),
             ("gated_rmsnorm", (x, z, weight, scale, 1e-5, 128, True, code(quant)))]
    if quant is not None:
        calls.append(("quantize", (x, scale, code(quant))))
    for name, a in calls:
        got = getattr(native.direct, name)(*a)
        want = getattr(torch.ops.commfuse, name).default(*a)
        assert len(got) == len(want) and all(bits_equal(g, w) for g, w in zip(got, want)), name
