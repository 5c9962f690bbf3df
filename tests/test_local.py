"""commfuse.local: the local fused ops (no collective) against commfuse.reference and independent formulas.

CPU: semantics, argument errors, out=, the route's reasons, opcheck of the custom ops, torch.compile.
GPU (skipped on a CPU machine): the fused kernel route against the reference, within the tolerances
of docs/semantics.md section 9.
"""
import collections
import functools
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import commfuse
from commfuse import local, reference, routes
from commfuse.routes import Call, Machine, TensorMeta
from commfuse.tail.spec import TailSpec, code
from commfuse.reference import Tail

from compare import assert_tail_close, assert_within_ulp, bits_equal, poisoned_runs
from conftest import needs_gpu

BF16 = torch.bfloat16
DTYPES = [torch.bfloat16, torch.float16]


def inputs(gen, t, h, dtype, device="cpu", quant=None):
    x = (torch.randn(t, h, generator=gen) * 3).to(dtype).to(device)
    residual = torch.randn(t, h, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).to(device)
    scale = {"fp8": 0.02, "nvfp4": 0.004}.get(quant)
    scale = None if scale is None else torch.tensor([scale], device=device)
    return x, residual, weight, scale


PATTERNS = [(None, False, "swizzled"), ("fp8", False, "swizzled"), ("fp8", True, "swizzled"),
            ("nvfp4", False, "swizzled"), ("nvfp4", True, "linear"), ("mxfp8", False, "swizzled"),
            ("mxfp8", True, "linear")]


@pytest.mark.parametrize("quant, return_norm, sf_layout", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
def test_fused_add_rmsnorm_is_the_reference_tail(gen, quant, return_norm, sf_layout, dtype):
    """Every option reaches the route (on the CPU the separated one, the reference's own code; the poison there
    checks the Python launchers' outputs where a GPU runs them: test_gpu_fused_route_matches_reference)."""
    x, residual, weight, scale = inputs(gen, 7, 256, dtype, quant=quant)
    runs = poisoned_runs(lambda: commfuse.fused_add_rmsnorm(x, residual, weight, 1e-5, quant=quant, scale=scale,
                                                            return_norm=return_norm, sf_layout=sf_layout))
    for a, b in zip(*runs):
        assert bits_equal(a, b), "an output element is left unwritten"
    got = runs[0]
    want = reference.fused_tail(x, residual, weight, 1e-5, quant, scale, return_norm, sf_layout)
    assert_tail_close(got, want, quant, sf_layout, exact=True)


@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4"])
def test_without_residual_is_rmsnorm_then_quant(gen, quant):
    x, _, weight, scale = inputs(gen, 3, 64, BF16, quant=quant)
    got = commfuse.fused_add_rmsnorm(x.view(1, 3, 64), None, weight, 1e-6, quant=quant, scale=scale, return_norm=True)
    n = reference.rmsnorm(x, weight, 1e-6)
    assert got.residual is None and bits_equal(got.norm, n)
    if quant == "fp8":
        assert bits_equal(got.quant, reference.quantize_fp8(n, scale)) and got.scale_factors is None
    elif quant == "nvfp4":
        q, sf = reference.quantize_nvfp4(n, scale)
        assert bits_equal(got.quant, q) and bits_equal(got.scale_factors, sf)


def test_weight_offset_is_gemmas_one_plus_w(gen):
    x, residual, weight, _ = inputs(gen, 4, 128, BF16)
    got = commfuse.fused_add_rmsnorm(x, residual, weight, 1e-6, weight_offset=1.0)
    h = (x.float() + residual.float()).to(BF16)  # independent: HF GemmaRMSNorm on the residual sum
    hf = h.float()
    out = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = (out * (1.0 + weight.float())).to(BF16)
    assert bits_equal(got.residual, h) and bits_equal(got.norm, want)


def test_python_float_scale_and_shapes(gen):
    x, residual, weight, _ = inputs(gen, 6, 64, BF16)
    got = commfuse.fused_add_rmsnorm(x.view(2, 3, 64), residual.view(2, 3, 64), weight, quant="fp8", scale=0.02)
    want = reference.fused_tail(x, residual, weight, 1e-6, "fp8", 0.02)
    assert got.residual.shape == (6, 64) and bits_equal(got.quant, want.quant) and got.norm is None


def _local_plan(op="local", dtype=BF16, h=64, quant="fp8", residual=True, scale=True, sm=(9, 0),
                group_size=0):
    """routes.plan of a local call on a simulated CUDA device (metadata only)."""
    cuda = torch.device("cuda", 0)
    m = lambda shape, d=dtype: TensorMeta(shape, d, cuda)  # noqa: E731
    spec = TailSpec.of(quant)
    c = Call(op, m((4, h)), m((4, h)) if residual and op == "local" else None, m((h,)),
             TensorMeta((1,), torch.float32, cuda) if scale and spec.format.takes_scale else None,
             m((4, h)) if op == "gated" else None, spec,
             group_size=group_size)
    return routes.plan(c, Machine("local", sm=sm))


def test_plan_names_the_route(gen):
    x, residual, weight, scale = inputs(gen, 2, 64, BF16, quant="fp8")
    p = local.plan(x, residual, weight, quant="fp8", scale=scale)
    assert p.tail == "separated" and "cpu" in p.reasons[0]
    assert "cpu" in local.plan(x, None, weight).reasons[0]
    assert _local_plan().tail == "fused"
    assert _local_plan(residual=False).tail == "fused"  # plain RMSNorm: the same kernel
    for quant in ("fp8_per_token", "fp8_block"):  # no scale argument
        assert _local_plan(quant=quant, scale=False, h=256).tail == "fused"
    assert "multiple of 128" in _local_plan(quant="fp8_block", h=192).reasons[0]
    assert "SM 7.5" in _local_plan(sm=(7, 5)).reasons[0]
    assert "float32 CUDA tensor" in _local_plan(scale=False).reasons[0]
    assert "multiple of 8" in _local_plan(h=60).reasons[0]
    assert "float16 and bfloat16" in _local_plan(dtype=torch.float32).reasons[0]


def test_bad_arguments_name_themselves(gen):
    x, residual, weight, scale = inputs(gen, 2, 64, BF16, quant="fp8")
    f = commfuse.fused_add_rmsnorm
    cases = [
        (TypeError, "x must be", lambda: f("x", residual, weight)),
        (ValueError, "residual must have", lambda: f(x, residual[:1], weight)),
        (TypeError, "residual dtype", lambda: f(x, residual.half(), weight)),
        (ValueError, "weight must have shape", lambda: f(x, residual, weight[:3])),
        (TypeError, "weight dtype", lambda: f(x, residual, weight.float())),
        (ValueError, "eps", lambda: f(x, residual, weight, -1.0)),
        (ValueError, "weight_offset", lambda: f(x, residual, weight, weight_offset=float("nan"))),
        (ValueError, "quant must be", lambda: f(x, residual, weight, quant="int4", scale=scale)),
        (ValueError, "needs scale", lambda: f(x, residual, weight, quant="fp8")),
        (TypeError, "scale must be float32", lambda: f(x, residual, weight, quant="fp8", scale=scale.double())),
        (TypeError, "scale must be a dense tensor", lambda: f(x, residual, weight, quant="fp8", scale=scale.to_sparse())),
        (TypeError, "residual is a lazily negated view", lambda: f(x, torch._neg_view(residual), weight)),
        (ValueError, "scale is only meaningful", lambda: f(x, residual, weight, scale=scale)),
        (ValueError, "multiple of 16", lambda: f(x[:, :40], residual[:, :40], weight[:40], quant="nvfp4",
                                                 scale=scale)),
        (ValueError, "sf_layout", lambda: f(x, residual, weight, sf_layout="tiled")),
        (ValueError, "scale is on meta, but x is on cpu", lambda: f(x, residual, weight, quant="fp8",
                                                                    scale=scale.to("meta"))),
        (ValueError, "scale is on meta, but x is on cpu", lambda: commfuse.quantize(x, "fp8", scale.to("meta"))),
        (ValueError, "^residual is on meta, but x is on cpu", lambda: f(x, residual.to("meta"), weight)),
        (ValueError, "^weight is on meta, but x is on cpu", lambda: f(x, residual, weight.to("meta"))),
        (ValueError, "^z is on meta, but x is on cpu",
         lambda: commfuse.gated_rmsnorm(x, residual.to("meta"), weight, 1e-5, 16, False)),
        (TypeError, "^scale_ue8m0 must be a bool, got int", lambda: f(x, residual, weight, quant="fp8_block",
                                                                       scale_ue8m0=1)),
        (ValueError, r"^x must have shape \[\.\.\., h\] with h > 0, got \(2, 0\)",
         lambda: f(x[:, :0], residual[:, :0], weight[:0])),
        (ValueError, r"^x must have shape \[\.\.\., h\] with h > 0", lambda: commfuse.quantize(x[:, :0], "fp8_per_token")),
        (ValueError, "^group_size must be a positive divisor of h=64, got -64",
         lambda: commfuse.gated_rmsnorm(x, residual, weight, 1e-5, -64, False)),
        (ValueError, "^group_size must be a positive divisor of h=64, got 0",
         lambda: commfuse.gated_rmsnorm(x, residual, weight, 1e-5, 0, False)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


def test_out_tensors_are_written_in_place(gen):
    x, residual, weight, scale = inputs(gen, 5, 64, BF16, quant="fp8")
    want = reference.fused_tail(x, residual, weight, 1e-6, "fp8", scale, True)
    res = residual.clone()
    q = torch.empty(5, 64, dtype=torch.float8_e4m3fn)
    got = commfuse.fused_add_rmsnorm(x, res, weight, quant="fp8", scale=scale, return_norm=True,
                                     out=Tail(res, None, q, None))  # residual updated in place, norm allocated
    assert got.residual is res and got.quant is q and bits_equal(res, want.residual) and bits_equal(q, want.quant)
    assert bits_equal(got.norm, want.norm)
    bad = [
        (TypeError, "out must be", ("a", "b")),
        (ValueError, "out.scale_factors must be None", Tail(None, None, None, torch.empty(4, dtype=torch.float8_e4m3fn))),
        (ValueError, "out.quant must have shape .* and dtype torch.float8_e4m3fn", Tail(None, None, torch.empty(5, 64), None)),
        (ValueError, "out.residual must have shape", Tail(torch.empty(4, 64, dtype=BF16), None, None, None)),
        (ValueError, "out.norm must be contiguous", Tail(None, torch.empty(64, 5, dtype=BF16).t(), None, None)),
    ]
    for exc, match, out in bad:
        with pytest.raises(exc, match=match):
            commfuse.fused_add_rmsnorm(x, residual, weight, quant="fp8", scale=scale, return_norm=True, out=out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_a_tuple_out_that_answers_fields_is_read_by_name(gen, device):
    """A tuple subclass whose instances answer _fields (its type has none) was checked by its attributes' names in
    Python and keyed and written by position in the native table (csrc/host_launch.cpp): a wrong tensor at a
    position, with a right one under that name, passed the checks, and a planned call wrote the wrong one. Both now
    read it by name: the tensor at the position is neither checked nor written. A namedtuple is read by name in
    any field order; a plain tuple by position."""
    x, residual, weight, _ = inputs(gen, 4, 64, BF16, device)
    want = reference.fused_tail(x.cpu(), residual.cpu(), weight.cpu(), 1e-6, None, None, True)

    class Record(tuple):  # a record type answering any attribute from a dict of its own
        def __getattr__(self, name):
            return Tail._fields if name == "_fields" else self.__dict__["named"].get(name)

    wrong = torch.full((3, 64), 7.0, dtype=BF16, device=device)
    for _ in range(2):  # the signature's first call, then a planned one
        right = torch.full((4, 64), float("nan"), dtype=BF16, device=device)
        out = Record((None, wrong, None, None))
        out.named = {"norm": right}
        got = commfuse.fused_add_rmsnorm(x, residual, weight, out=out)
        assert got.norm is right and torch.equal(wrong, torch.full_like(wrong, 7.0))
        assert_tail_close(Tail(got.residual.cpu(), right.cpu(), None, None), want, None, exact=device == "cpu")
    Named = collections.namedtuple("Named", ["norm", "residual", "quant", "scale_factors"])  # not Tail's order
    norm = torch.empty(4, 64, dtype=BF16, device=device)
    assert commfuse.fused_add_rmsnorm(x, residual, weight, out=Named(norm, None, None, None)).norm is norm
    plain = torch.empty(4, 64, dtype=BF16, device=device)
    assert commfuse.fused_add_rmsnorm(x, residual, weight, out=(None, plain, None, None)).norm is plain


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_a_residual_of_another_shape_is_updated_in_place_through_a_view(gen, device):
    """The outputs are [t, h]: a [b, s, h] residual is updated in place through residual.view(-1, h), its own
    memory; a view of a strided residual is not its memory (the kernels read a dense copy of it) and raises.
    On a GPU the planned call is checked by the native launcher (csrc/host_launch.cpp), the first by Python."""
    x, residual, weight, _ = inputs(gen, 6, 64, BF16, device)
    x, residual = x.view(2, 3, 64), residual.view(2, 3, 64)
    want = reference.fused_tail(x.cpu(), residual.cpu(), weight.cpu(), 1e-6, None, None, True)
    for _ in range(2):  # the signature's first call, then a planned one
        res = residual.clone()
        got = commfuse.fused_add_rmsnorm(x, res, weight, return_norm=True, out=Tail(res.view(-1, 64), None, None, None))
        assert got.residual.data_ptr() == res.data_ptr()
        assert_tail_close(Tail(res.view(-1, 64).cpu(), got.norm.cpu(), None, None), want, None, exact=device == "cpu")
    wide = torch.zeros(6, 128, dtype=BF16, device=device)
    strided = wide[:, :64]
    strided.copy_(residual.view(6, 64))
    for _ in range(2):
        with pytest.raises(ValueError, match="out.residual overlaps residual: .*a \\[t, h\\] view of a contiguous "
                                             "residual"):
            commfuse.fused_add_rmsnorm(x.view(6, 64), strided, weight,
                                       out=Tail(wide.view(-1)[:6 * 64].view(6, 64), None, None, None))


# Tensors whose memory is not their values: a lazily negated view holds t's memory and means -t (the kernels would
# read t); a zero tensor (forward-mode AD's tangent of a constant) has none, and its null pointer would read as an
# argument not given (no gate: norm(x) * w instead of 0; no residual: an output left unwritten).
UNREAL = {"a negated view": (torch._neg_view, "is a lazily negated view"),
          "a zero tensor": (lambda t: torch._efficientzerotensor(t.shape, dtype=t.dtype, device=t.device),
                            "is a zero tensor without memory")}


@pytest.mark.parametrize("kind", sorted(UNREAL))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_a_tensor_whose_memory_is_not_its_values_is_refused_on_a_planned_signature(gen, device, kind):
    """The plan tables do not key such a tensor, so a call of a planned signature goes to planning, which names
    it, on every route and for every tensor argument and output."""
    unreal, says = UNREAL[kind]
    x, residual, weight, scale = inputs(gen, 4, 64, BF16, device, quant="fp8")
    want = reference.fused_tail(x.cpu(), residual.cpu(), weight.cpu(), 1e-6, "fp8", scale.cpu())
    for name in ("x", "residual", "weight"):
        args = dict(x=x, residual=residual, weight=weight)
        got = commfuse.fused_add_rmsnorm(**args, quant="fp8", scale=scale)  # the signature, planned
        assert bits_equal(got.quant.cpu(), want.quant)
        args[name] = unreal(args[name])
        with pytest.raises(TypeError, match=f"{name} {says}"):
            commfuse.fused_add_rmsnorm(**args, quant="fp8", scale=scale)
    got = commfuse.fused_add_rmsnorm(x, residual.clone(), weight, out=Tail(None, None, None, None))
    with pytest.raises(TypeError, match=f"out.norm {says}"):
        commfuse.fused_add_rmsnorm(x, residual.clone(), weight, out=Tail(None, unreal(got.norm), None, None))
    with pytest.raises(TypeError, match=f"x {says}"):
        commfuse.quantize(unreal(x), "fp8", scale)
    with pytest.raises(TypeError, match=f"scale {says}"):
        commfuse.quantize(x, "fp8", unreal(scale))
    z = torch.randn(4, 64, generator=gen).to(BF16).to(device)
    gated = commfuse.gated_rmsnorm(x, z, weight, 1e-5, 16, False).norm  # planned
    assert bits_equal(gated.cpu(), reference.gated_rmsnorm(x.cpu(), z.cpu(), weight.cpu(), 1e-5, 16, False))
    with pytest.raises(TypeError, match=f"z {says}"):
        commfuse.gated_rmsnorm(x, unreal(z), weight, 1e-5, 16, False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_a_fake_tensor_is_refused_on_a_planned_signature(gen, device):
    """A FakeTensor (tracing with fake tensors, e.g. make_fx or torch.export, outside commfuse.ops) keys as
    the real tensor would, but holds no memory: a planned signature's call goes to planning, which names it,
    instead of launching on a null pointer (on a GPU the native launcher would have)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, residual, weight, scale = inputs(gen, 4, 64, BF16, device, quant="fp8")
    want = reference.fused_tail(x.cpu(), residual.cpu(), weight.cpu(), 1e-6, "fp8", scale.cpu())
    mode = FakeTensorMode()
    for name in ("x", "residual", "weight", "scale"):
        args = dict(x=x, residual=residual, weight=weight, scale=scale)
        got = commfuse.fused_add_rmsnorm(**args, quant="fp8")  # the signature, planned
        assert bits_equal(got.quant.cpu(), want.quant)
        args[name] = mode.from_tensor(args[name])
        with mode, pytest.raises(TypeError, match=f"{name} is a FakeTensor"):
            commfuse.fused_add_rmsnorm(**args, quant="fp8")
    assert bits_equal(commfuse.fused_add_rmsnorm(x, residual, weight, quant="fp8", scale=scale).quant.cpu(), want.quant)
    # torch.func.functionalize's wrappers are plain torch.Tensor objects whose memory is not their values either.
    with pytest.raises(TypeError, match="x is a tensor of torch.func.functionalize"):
        torch.func.functionalize(lambda a: commfuse.fused_add_rmsnorm(a, residual, weight, quant="fp8", scale=scale))(x)
    # So are torch.func's transforms' (vmap's batched tensor: one example's sizes over the batch's memory; grad's),
    # on the planned signature too (a key of the example's sizes would find another signature's launcher).
    batch = torch.stack([x, x + 1])
    commfuse.fused_add_rmsnorm(batch[0], residual, weight, quant="fp8", scale=scale)  # the example's signature
    for transform, wrapped in ((torch.vmap, batch), (torch.func.grad, x.float())):
        with pytest.raises(TypeError, match="x is a tensor of a torch.func transform"):
            transform(lambda a: commfuse.fused_add_rmsnorm(a.to(BF16), residual, weight, quant="fp8",
                                                           scale=scale).quant.float().sum())(wrapped)


def test_separated_outputs_have_no_autograd_history(gen):
    """The ops are outside autograd on every route (the kernels write behind it): on the separated route (CPU)
    too, no output and no caller tensor given as out= gains a history from a weight that requires grad (an
    nn.Parameter), so that out= is reusable call after call; inference-mode inputs mixed with inputs that
    require grad compute as any others."""
    x, residual, weight, scale = inputs(gen, 4, 64, BF16, quant="fp8")
    param = torch.nn.Parameter(weight.clone())
    want = reference.fused_tail(x, residual, weight, 1e-6, "fp8", scale, True)
    norm = torch.empty_like(residual)
    for _ in range(2):
        got = commfuse.fused_add_rmsnorm(x, residual, param, quant="fp8", scale=scale, return_norm=True,
                                         out=Tail(None, norm, None, None))
        assert got.norm is norm and not norm.requires_grad and norm.grad_fn is None
        assert not any(t.requires_grad for t in got[:4] if t is not None)
        assert bits_equal(norm, want.norm) and bits_equal(got.quant, want.quant)
    with torch.inference_mode():
        frozen = x.float()
    z = residual.float().requires_grad_()
    g = commfuse.gated_rmsnorm(frozen, z, param.float(), 1e-5, 16, False)
    assert not g.norm.requires_grad
    assert bits_equal(g.norm, reference.gated_rmsnorm(frozen, z.detach(), weight.float(), 1e-5, 16, False))
    q = commfuse.quantize(x.float().requires_grad_(), "fp8", scale)
    assert not q.quant.requires_grad


def test_separated_out_writes_mn_major_padding_rows(gen):
    """On the separated route (CPU), caller-owned MN-major scales get the padding rows of their storage
    written, as the fused kernels write them: a view of one column (h = 128) reads as contiguous."""
    t, h = 5, 128
    x, residual, weight, _ = inputs(gen, t, h, BF16)
    want = reference.fused_tail(x, residual, weight, 1e-6, "fp8_block", scale_layout="mn_major")
    n = want.scales.shape[1] * want.scales.stride(1)  # roundup(t, 4) rows: 3 of padding
    storage = torch.full((n,), 7.0)
    scales = storage.as_strided(want.scales.shape, want.scales.stride())
    got = commfuse.fused_add_rmsnorm(x, residual, weight, quant="fp8_block", scale_layout="mn_major",
                                     out=Tail(None, None, None, None, scales))
    assert got.scales is scales and bits_equal(got.quant, want.quant)
    assert bits_equal(storage, torch.as_strided(want.scales, (n,), (1,)))


def _mamba_ssm_rms_norm_ref(x, weight, z, eps, group_size, norm_before_gate):
    """mamba_ssm.ops.triton.layernorm_gated.rms_norm_ref (bias None, upcast), rstd as rsqrt."""
    dtype = x.dtype
    weight, x, z = weight.float(), x.float(), z.float() if z is not None else z
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    t, h = x.shape
    x_group = x.view(t, h // group_size, group_size)
    rstd = torch.rsqrt(x_group.square().mean(dim=-1, keepdim=True) + eps)
    out = (x_group * rstd).view(t, h) * weight
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out.to(dtype)


@pytest.mark.parametrize("group_size", [None, 16, 64])
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("magnitude", [1.0, 1e-3])  # 1e-3: groups whose mean square is of eps's order
def test_gated_rmsnorm_matches_mamba_ssm_reference(gen, group_size, norm_before_gate, gated, magnitude):
    x, z, weight, _ = inputs(gen, 5, 128, BF16)
    x = (x.float() * magnitude).to(BF16)
    z = z if gated else None
    got = commfuse.gated_rmsnorm(x, z, weight, 1e-5, group_size, norm_before_gate)
    want = _mamba_ssm_rms_norm_ref(x, weight, z, 1e-5, group_size or 128, norm_before_gate)
    assert got.residual is None and got.quant is None and bits_equal(got.norm, want)


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rmsnorm_of_a_strided_x_is_the_dense_ones_bits(gen, norm_before_gate):
    """The oracle sums each group in row order whatever x's strides (float32 x transposed in memory summed in
    another order, 4-6 ulps off the library's, which normalises a dense copy)."""
    x = torch.randn(1024, 64, generator=gen).t()  # [64, 1024], column-major
    z = torch.randn(64, 1024, generator=gen)
    w = 1 + 0.1 * torch.randn(1024, generator=gen)
    for group in (256, 1024):
        want = reference.gated_rmsnorm(x.contiguous(), z, w, 1e-5, group, norm_before_gate)
        assert bits_equal(reference.gated_rmsnorm(x, z, w, 1e-5, group, norm_before_gate), want)
        assert bits_equal(commfuse.gated_rmsnorm(x, z, w, 1e-5, group, norm_before_gate).norm, want)


def test_gated_rmsnorm_quant_and_errors(gen):
    x, z, weight, scale = inputs(gen, 3, 64, BF16, quant="nvfp4")
    got = commfuse.gated_rmsnorm(x, z, weight, 1e-5, 32, False, quant="nvfp4", scale=scale, return_norm=True)
    norm = reference.gated_rmsnorm(x, z, weight, 1e-5, 32, False)
    q, sf = reference.quantize_nvfp4(norm, scale)
    assert bits_equal(got.norm, norm) and bits_equal(got.quant, q) and bits_equal(got.scale_factors, sf)
    with pytest.raises(ValueError, match="group_size"):
        commfuse.gated_rmsnorm(x, z, weight, 1e-5, 48, False)
    with pytest.raises(ValueError, match="z must have"):
        commfuse.gated_rmsnorm(x, z[:1], weight, 1e-5, None, False)
    with pytest.raises(TypeError, match="norm_before_gate"):
        commfuse.gated_rmsnorm(x, z, weight, 1e-5, None, "yes")


def test_quantize_alone(gen):
    x, _, _, scale = inputs(gen, 4, 64, BF16, quant="fp8")
    q = commfuse.quantize(x.view(2, 2, 64), "fp8", scale)
    assert q.scale_factors is None and q.scales is None and bits_equal(q.quant, reference.quantize_fp8(x, scale))
    q = commfuse.quantize(x, "nvfp4", scale, "linear")
    want = reference.quantize_nvfp4(x, scale, "linear")
    assert bits_equal(q.quant, want[0]) and bits_equal(q.scale_factors, want[1]) and q.scales is None
    x = torch.randn(4, 256, generator=gen).to(BF16)
    q = commfuse.quantize(x, "fp8_block", scale_layout="mn_major", scale_ue8m0=True)
    want = reference.quantize_fp8_block(x, 128, "mn_major", True)
    assert bits_equal(q.quant, want[0]) and bits_equal(q.scales, want[1]) and q.scales.stride() == want[1].stride()
    p = local.plan_quantize(x, "fp8_block")
    assert (p.collective, p.tail, p.route) == ("none", "separated", "separated") and "tensors on cpu" in p.reasons[0]
    with pytest.raises(ValueError, match="quant must name a format"):
        commfuse.quantize(x, None, scale)
    with pytest.raises(ValueError, match="computes its scales"):
        commfuse.quantize(x, "fp8_block", scale)


@pytest.mark.parametrize("quant, return_norm, sf_layout", PATTERNS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_opcheck_fused_add_rmsnorm(gen, quant, return_norm, sf_layout, with_residual):
    x, residual, weight, scale = inputs(gen, 5, 128, BF16, quant=quant)
    torch.library.opcheck(torch.ops.commfuse.fused_add_rmsnorm.default,
                          (x, residual if with_residual else None, weight, scale, 1e-6, 0.0,
                           code(quant, return_norm, sf_layout)))


@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4"])
def test_opcheck_gated_and_quantize(gen, quant):
    x, z, weight, scale = inputs(gen, 5, 128, BF16, quant=quant)
    torch.library.opcheck(torch.ops.commfuse.gated_rmsnorm.default,
                          (x, z, weight, scale, 1e-5, 32, False, code(quant, True)))
    if quant:
        torch.library.opcheck(torch.ops.commfuse.quantize.default, (x, scale, code(quant)))
        from torch._subclasses.fake_tensor import FakeTensorMode

        with pytest.raises(ValueError, match="quantize returns no norm"):  # the real kernel and the fake alike
            torch.ops.commfuse.quantize(x, scale, code(quant, True))
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match="quantize returns no norm"):
            torch.ops.commfuse.quantize(x, scale, code(quant, True))
    else:  # a code without a format: the fake raised nothing and a graph failed only when it ran
        from torch._subclasses.fake_tensor import FakeTensorMode

        with pytest.raises(ValueError, match="quantize's code must name a format"):
            torch.ops.commfuse.quantize(x, scale, code(None))
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match="must name a format"):
            torch.ops.commfuse.quantize(x, scale, code(None))


def test_ops_have_no_gradient_as_the_eager_calls(gen):
    """Inputs that require grad (a model's parameters outside no_grad): the ops' outputs, eager, through torch.ops
    and compiled, are plain tensors with the bits of a call without grad, as the eager calls' are (torch's
    fallback for an op without autograd would give them a grad_fn that passes back no gradient)."""
    x, residual, weight, scale = inputs(gen, 5, 128, BF16, quant="nvfp4")
    z = torch.randn(5, 128, generator=gen).to(BF16)
    calls = {
        "fused_add_rmsnorm": lambda x, w: commfuse.fused_add_rmsnorm(x, residual, w, quant="nvfp4", scale=scale,
                                                                     return_norm=True),
        "gated_rmsnorm": lambda x, w: commfuse.gated_rmsnorm(x, z, w, 1e-5, 32, False),
        "quantize": lambda x, w: commfuse.quantize(x * 1, "fp8_per_token"),  # x * 1: a tensor with a grad_fn
        "op": lambda x, w: torch.ops.commfuse.fused_add_rmsnorm(x, None, w, None, 1e-6, 0.0, code(None)),
    }
    for name, call in calls.items():
        want = [v for v in call(x, weight) if v is not None]
        for how, f in (("eager", call), ("compiled", torch.compile(call, fullgraph=True, backend="aot_eager"))):
            torch._dynamo.reset()
            got = [v for v in f(x.clone().requires_grad_(), weight.clone().requires_grad_()) if v is not None]
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert not g.requires_grad and g.grad_fn is None, (name, how)
                assert bits_equal(g, w), (name, how)


def test_compiled_ops_dynamic_tokens(gen):
    def f(x, residual, weight, z, scale):
        t = commfuse.fused_add_rmsnorm(x, residual, weight, quant="nvfp4", scale=scale, return_norm=True)
        g = commfuse.gated_rmsnorm(t.norm, z, weight, 1e-5, 32, False)
        return t.residual, t.quant, t.scale_factors, g.norm

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, t in enumerate((3, 130)):
        x, residual, weight, scale = inputs(gen, t, 64, BF16, quant="nvfp4")
        z = torch.randn(t, 64, generator=gen).to(BF16)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(x, residual, weight, z, scale)
        for a, b in zip(got, f(x, residual, weight, z, scale)):
            assert bits_equal(a, b)


def test_compiled_gated_norm_keeps_a_dynamic_hidden_size(gen):
    """group_size None is the row, x.shape[-1]: a symbol under dynamic shapes, which the op's schema took as an int
    and so specialised (a graph for every hidden size; a ConstraintViolationError where the size was marked
    dynamic). One graph serves every hidden size, with the eager bits."""
    def f(x, z, weight):
        return commfuse.gated_rmsnorm(x, z, weight, 1e-5, None, True).norm

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, h in enumerate((256, 512, 384)):
        x, z = (torch.randn(3, h, generator=gen).to(BF16) for _ in range(2))
        weight = (1 + 0.1 * torch.randn(h, generator=gen)).to(BF16)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(x, z, weight)
        assert bits_equal(got, f(x, z, weight)), h


@pytest.mark.parametrize("ue8m0", [False, True])
def test_compiled_mn_major_scales_take_an_unbacked_token_count(gen, ue8m0):
    """The token count as an unbacked symbol (data-dependent, as after a nonzero or a MoE routing): the fakes of the
    MN-major scales, whose rows are padded to a multiple of 4, must not branch on it; the outputs are the eager
    call's, strides and bits."""
    def f(x, residual, weight):
        return commfuse.fused_add_rmsnorm(x, residual, weight, quant="fp8_block", scale_layout="mn_major",
                                          scale_ue8m0=ue8m0)

    torch._dynamo.reset()
    x, residual, weight, _ = inputs(gen, 6, 256, BF16)
    for a in (x, residual):
        torch._dynamo.decorators.mark_unbacked(a, 0)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, residual, weight)
    want = f(x, residual, weight)
    assert [g is None for g in got] == [w is None for w in want]
    for g, w in zip(got, want):
        assert g is None or (g.shape == w.shape and g.stride() == w.stride() and bits_equal(g, w))


@pytest.mark.parametrize("case, error", [
    ("quantize quant ''", "quant must be one of"), ("fused quant ''", "quant must be one of"),
    ("norm_before_gate None", "norm_before_gate must be a bool"), ("group_size True", "group_size must be an int"),
    ("eps True", "eps must be a number"), ("weight_offset True", "weight_offset must be a number"),
    ("eps 10**400", "eps must be a finite float32 number"),
    ("0-dim x", r"x must have shape \[\.\.\., h\]")])
def test_compiled_calls_refuse_what_eager_calls_refuse(gen, case, error):
    """Compiled code passes the arguments to the ops, whose schemas would convert a wrong value silently
    (norm_before_gate None to False, eps True to 1.0), and whose "" stands for no quantization (a compiled
    quantize(x, "") returned nothing): the public functions check them first, as eager calls do."""
    x, residual, weight, scale = inputs(gen, 4, 64, BF16, quant="fp8")
    calls = {
        "quantize quant ''": lambda: commfuse.quantize(x, "").quant,
        "fused quant ''": lambda: commfuse.fused_add_rmsnorm(x, residual, weight, quant="").residual,
        "norm_before_gate None": lambda: commfuse.gated_rmsnorm(x, residual, weight, 1e-5, 16, None).norm,
        "group_size True": lambda: commfuse.gated_rmsnorm(x, residual, weight, 1e-5, True, False).norm,
        "eps True": lambda: commfuse.fused_add_rmsnorm(x, residual, weight, True).residual,
        "weight_offset True": lambda: commfuse.fused_add_rmsnorm(x, residual, weight, weight_offset=True).residual,
        "eps 10**400": lambda: commfuse.gated_rmsnorm(x, residual, weight, 10 ** 400, 16, False).norm,
        "0-dim x": lambda: commfuse.quantize(x[0, 0], "fp8", scale).quant,
    }
    with pytest.raises(Exception, match=error):  # eager
        calls[case]()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=error):
        torch.compile(calls[case], fullgraph=True, backend="aot_eager")()


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_compiled_ops_take_a_python_number_scale(gen, quant):
    """A Python number scale, which eager calls take, in compiled code too: the eager call's bits, for each
    value (no stale specialisation); one that is no positive finite float32 raises naming the scale."""
    def f(x, residual, weight, z, scale):
        t = commfuse.fused_add_rmsnorm(x, residual, weight, quant=quant, scale=scale)
        g = commfuse.gated_rmsnorm(x, z, weight, 1e-5, 32, False, quant=quant, scale=scale)
        return t.quant, g.quant, commfuse.quantize(x, quant, scale).quant

    x, residual, weight, scale = inputs(gen, 5, 64, BF16, quant=quant)
    z = torch.randn(5, 64, generator=gen).to(BF16)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for s in (float(scale), float(scale) * 3):
        for a, b in zip(compiled(x, residual, weight, z, s), f(x, residual, weight, z, s)):
            assert bits_equal(a, b)
    with pytest.raises(Exception, match="scale must be positive and finite in float32"):
        compiled(x, residual, weight, z, 1e-50)
    with pytest.raises(Exception, match="scale must be a float32 tensor of one element or a Python number"):
        compiled(x, residual, weight, z, True)


@functools.cache
def inductor_cpu_fails() -> str:
    """Why Inductor cannot build CPU code here ('' where it can). On the GPU machine under mpirun, its
    precompiled-header build ran a mangled command line (the compiler and its source as one path)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "Inductor's CPU code needs a C++ compiler"
    try:
        torch._dynamo.reset()
        torch.compile(lambda v: v * 2 + 1, fullgraph=True, backend="inductor")(torch.arange(4.0))
    except Exception as e:  # torch._inductor.exc.InductorError wraps the toolchain's failure
        return f"Inductor cannot build CPU code here: {str(e).splitlines()[0][:200]}"
    return ""


def test_inductor_passes_inputs_as_they_are(gen):
    """The functional ops take any layout: Inductor writes an input read by two ops once (under the
    default exact-strides rule it wrote one copy per op), and a transposed input reaches the op as a
    strided view, which it reads right."""
    from torch._inductor.utils import run_and_get_code

    if inductor_cpu_fails():
        pytest.skip(inductor_cpu_fails())
    t, h = 6, 64
    table = torch.randn(32, h, generator=gen).to(BF16)
    _, _, weight, scale = inputs(gen, t, h, BF16, quant="fp8")
    a = torch.randn(h, t, generator=gen).to(BF16)

    def f(ids, a):
        hidden = F.embedding(ids, table)  # computed: Inductor decides where it lives
        first = torch.ops.commfuse.fused_add_rmsnorm(hidden.reshape(-1, h), None, weight, None, 1e-5, 0.0, 0)[0]
        second = torch.ops.commfuse.fused_add_rmsnorm(hidden.reshape(-1, h), first, weight, scale, 1e-5, 0.0,
                                                      code("fp8"))
        return second + [torch.ops.commfuse.quantize(a.t(), scale, code("fp8"))[0]]

    ids = torch.randint(0, 32, (1, t), generator=gen)
    torch._dynamo.reset()
    got, (wrapper, *_) = run_and_get_code(torch.compile(f, fullgraph=True, backend="inductor"), ids, a)
    for g, w in zip(got, f(ids, a)):
        assert bits_equal(g, w)
    # The embedding's kernel is the wrapper's one generated kernel call: it writes one buffer.
    calls = [line for line in map(str.strip, wrapper.splitlines()) if re.match(r"cpp_fused_\w+\(", line)]
    assert len(calls) == 1 and calls[0].count("buf") == 1, calls


# --------------------------------------------------------------------------- GPU


@needs_gpu
@pytest.mark.parametrize("quant, return_norm, sf_layout", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, h", [(1, 4096), (7, 2880), (130, 8192)])
def test_gpu_fused_route_matches_reference(gen, quant, return_norm, sf_layout, dtype, t, h):
    x, residual, weight, scale = inputs(gen, t, h, dtype, "cuda", quant)
    p = local.plan(x, residual, weight, quant=quant, scale=scale, return_norm=return_norm, sf_layout=sf_layout)
    assert p.tail == "fused", p
    runs = poisoned_runs(lambda: commfuse.fused_add_rmsnorm(x, residual, weight, 1e-5, quant=quant, scale=scale,
                                                            return_norm=return_norm, sf_layout=sf_layout))
    for a, b in zip(*runs):  # the kernel's outputs, allocated filled with two poisons: each element written
        assert bits_equal(a, b), "an output element is left unwritten"
    got = runs[0]
    want = reference.fused_tail(x, residual, weight, 1e-5, quant, scale, return_norm, sf_layout)
    assert_tail_close(got, want, quant, sf_layout, norm=reference.fused_tail(x, residual, weight, 1e-5).norm,
                      scale=scale)
    assert bits_equal(got.residual, want.residual)


@needs_gpu
def test_gpu_separated_routes_and_out(gen):
    x, residual, weight, scale = inputs(gen, 9, 1024, BF16, "cuda", "fp8")
    got = commfuse.fused_add_rmsnorm(x, residual, weight, weight_offset=1.0)  # Gemma's (1 + w), fused
    want = reference.fused_tail(x, residual, weight, 1e-6, weight_offset=1.0)
    assert_tail_close(got, want, None)
    res = residual.clone()
    got = commfuse.fused_add_rmsnorm(x, res, weight, quant="fp8", scale=scale,
                                     out=Tail(res, None, torch.full_like(x, float("nan")).to(torch.float8_e4m3fn), None))
    want = reference.fused_tail(x, residual, weight, 1e-6, "fp8", scale)
    assert got.residual is res and bits_equal(res, want.residual)
    assert_tail_close(got, want, "fp8")

    class Fields(tuple):  # a tuple subclass, not a namedtuple: read by position on every path
        pass

    res, q = residual.clone(), torch.full_like(x, float("nan")).to(torch.float8_e4m3fn)
    for _ in range(2):  # the second call takes the plan table's entry
        res.copy_(residual)
        q.fill_(float("nan"))
        got = commfuse.fused_add_rmsnorm(x, res, weight, quant="fp8", scale=scale, out=Fields((res, None, q, None)))
        assert got.residual is res and got.quant is q and bits_equal(res, want.residual)
        assert_tail_close(got, want, "fp8")
    # A refused call writes nothing, and autograd sees no write: out.quant over out.residual's memory, of
    # the metadata the table's entry was planned for (so the per-call address checks refuse it).
    alias = torch.empty(0, dtype=q.dtype, device=q.device).set_(res.untyped_storage(), 0, q.shape, q.stride())
    before = res._version, alias._version
    with pytest.raises(ValueError, match="overlap"):
        commfuse.fused_add_rmsnorm(x, res, weight, quant="fp8", scale=scale, out=Fields((res, None, alias, None)))
    assert (res._version, alias._version) == before
    g = commfuse.gated_rmsnorm(x, residual, weight, 1e-5, 128, False)
    # silu (exp) on the GPU need not give the CPU's bits: within 1 ulp of T
    assert_within_ulp(g.norm.cpu(), reference.gated_rmsnorm(x.cpu(), residual.cpu(), weight.cpu(), 1e-5, 128, False),
                      1, "gated norm")


# --------------------------------------------------------------------------- kernels' routes (CPU: guards, fakes)


def test_gated_guard_reasons(gen):
    kw = dict(op="gated", h=1024, group_size=256, quant="nvfp4")
    assert _local_plan(**kw).tail == "fused"
    assert _local_plan(**{**kw, "quant": "fp8_block", "scale": False}).tail == "fused"
    assert "multiple of 8" in _local_plan(**{**kw, "h": 1020, "group_size": 12, "quant": None}).reasons[0]
    assert "group_size 12" in _local_plan(**{**kw, "h": 1032, "group_size": 12, "quant": None}).reasons[0]
    assert "16384]" in _local_plan(**{**kw, "h": 16384 + 256}).reasons[0]
    assert "SM 7.5" in _local_plan(**kw, sm=(7, 5)).reasons[0]
    assert "float16 and bfloat16" in _local_plan(**{**kw, "dtype": torch.float32}).reasons[0]
    assert "float32 CUDA tensor" in _local_plan(**kw, scale=False).reasons[0]
    x, z, weight, _ = inputs(gen, 2, 64, BF16)
    p = local.plan_gated(x, z, weight, 1e-5, None, False)
    assert p.tail == "separated" and "cpu" in p.reasons[0]
    with pytest.raises(ValueError, match="group_size"):
        local.plan_gated(x, z, weight, 1e-5, 48, False)


COMPUTED = [("fp8_per_token", "row", False), ("fp8_block", "row", False), ("fp8_block", "mn_major", False),
            ("fp8_block", "row", True), ("fp8_block", "mn_major", True)]


@pytest.mark.parametrize("quant, scale_layout, scale_ue8m0", COMPUTED)
@pytest.mark.parametrize("with_residual", [True, False])
def test_computed_scale_kinds(gen, quant, scale_layout, scale_ue8m0, with_residual):
    x, residual, weight, _ = inputs(gen, 5, 256, BF16)
    residual = residual if with_residual else None
    got = commfuse.fused_add_rmsnorm(x, residual, weight, 1e-6, quant=quant, scale_layout=scale_layout,
                                     scale_ue8m0=scale_ue8m0)
    src = x if residual is None else reference.residual_add(x, residual)
    n = reference.rmsnorm(src, weight, 1e-6)
    q, s = (reference.quantize_fp8_per_token(n) if quant == "fp8_per_token"
            else reference.quantize_fp8_block(n, reference.FP8_BLOCK, scale_layout, scale_ue8m0))
    assert bits_equal(got.quant, q) and bits_equal(got.scales, s) and got.norm is None and got.scale_factors is None
    assert got.scales.stride() == s.stride()
    g = commfuse.gated_rmsnorm(x, residual, weight, 1e-5, 128, True, quant=quant, scale_layout=scale_layout,
                               scale_ue8m0=scale_ue8m0, return_norm=True)
    want = reference.gated_rmsnorm(x, residual, weight, 1e-5, 128, True)
    q, s = (reference.quantize_fp8_per_token(want) if quant == "fp8_per_token"
            else reference.quantize_fp8_block(want, reference.FP8_BLOCK, scale_layout, scale_ue8m0))
    assert bits_equal(g.norm, want) and bits_equal(g.quant, q) and bits_equal(g.scales, s)
    with pytest.raises(ValueError, match="computes its scales"):
        commfuse.fused_add_rmsnorm(x, residual, weight, quant=quant, scale=torch.ones(1))


def test_computed_scale_arguments_name_themselves(gen):
    x, residual, weight, _ = inputs(gen, 2, 192, BF16)
    with pytest.raises(ValueError, match="multiple of 128"):
        commfuse.fused_add_rmsnorm(x, residual, weight, quant="fp8_block")
    with pytest.raises(ValueError, match="applies to quant 'fp8_block' only"):
        commfuse.fused_add_rmsnorm(x, residual, weight, quant="fp8_per_token", scale_layout="mn_major")
    with pytest.raises(ValueError, match="scale_layout must be"):
        commfuse.gated_rmsnorm(x, None, weight, 1e-5, None, False, quant="fp8_per_token", scale_layout="col")


@pytest.mark.parametrize("quant, scale_layout, scale_ue8m0", COMPUTED[:3])
@pytest.mark.parametrize("with_residual", [True, False])
def test_opcheck_computed_kinds(gen, quant, scale_layout, scale_ue8m0, with_residual):
    x, residual, weight, _ = inputs(gen, 6, 256, BF16)
    torch.library.opcheck(torch.ops.commfuse.fused_add_rmsnorm.default,
                          (x, residual if with_residual else None, weight, None, 1e-6, 0.0,
                           code(quant, False, "swizzled", scale_layout, scale_ue8m0)))
    torch.library.opcheck(torch.ops.commfuse.gated_rmsnorm.default,
                          (x, residual, weight, None, 1e-5, 128, False, code(quant, True, "swizzled", scale_layout,
                                                                              scale_ue8m0)))


@pytest.mark.parametrize("quant, scale_layout, scale_ue8m0", [(None, "row", False), ("nvfp4", "row", False),
                                                             ("mxfp8", "row", False)] + COMPUTED)
@pytest.mark.parametrize("t", [130, 0])
def test_fakes_have_the_real_shapes(gen, quant, scale_layout, scale_ue8m0, t):
    """The fakes' shapes and strides are the real outputs', MN-major scales of no rows included (torch's
    strides of an empty transpose)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, z, weight, _ = inputs(gen, t, 256, BF16)
    scale = torch.ones(1) if quant == "nvfp4" else None
    layouts = ("swizzled", scale_layout, scale_ue8m0)
    calls = [(torch.ops.commfuse.fused_add_rmsnorm.default, (x, z, weight, scale, 1e-6, 0.0, code(quant, True, *layouts))),
             (torch.ops.commfuse.fused_add_rmsnorm.default,
              (x, None, weight, scale, 1e-6, 0.0, code(quant, False, *layouts))),
             (torch.ops.commfuse.gated_rmsnorm.default, (x, z, weight, scale, 1e-5, 64, True, code(quant, False, *layouts)))]
    if quant is not None:
        calls.append((torch.ops.commfuse.quantize.default, (x, scale, code(quant, False, *layouts))))
    for op, args in calls:
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        assert len(real) == len(fake)
        for r, f in zip(real, fake):
            assert (tuple(r.shape), r.dtype, r.stride()) == (tuple(f.shape), f.dtype, f.stride())


# --------------------------------------------------------------------------- GPU: the kernels' routes

ALL_QUANTS = [(None, False, "swizzled", "row", False), ("fp8", False, "swizzled", "row", False),
              ("fp8", True, "swizzled", "row", False), ("nvfp4", False, "swizzled", "row", False),
              ("nvfp4", True, "linear", "row", False), ("fp8_per_token", False, "swizzled", "row", False),
              ("fp8_block", True, "swizzled", "row", False), ("fp8_block", False, "swizzled", "mn_major", True),
              ("mxfp8", False, "swizzled", "row", False), ("mxfp8", True, "linear", "row", False)]


def _assert_local_close(got, want, x, quant, sf_layout, scale_layout, scale_ue8m0, norm, scale):
    """tolerance.tail_mismatch for the outputs of a call without a residual (x stands in for it); norm: the
    reference's, scale: the call's (for the codes of blocks whose scale differs)."""
    from commfuse import tolerance

    stand_in = x.reshape(-1, x.shape[-1])
    why = tolerance.tail_mismatch(got._replace(residual=stand_in), want._replace(residual=stand_in.cpu()), quant,
                                  sf_layout, scale_layout=scale_layout, scale_ue8m0=scale_ue8m0, norm=norm, scale=scale)
    assert why is None, why


def _want(norm_t, quant, scale, return_norm, sf_layout, scale_layout, scale_ue8m0):
    if quant is None:
        return Tail(None, norm_t, None, None, None)
    q, sf, s = reference.quantize(norm_t, quant, scale, sf_layout, scale_layout, scale_ue8m0)
    return Tail(None, norm_t if return_norm else None, q, sf, s)


@needs_gpu
@pytest.mark.parametrize("quant, return_norm, sf_layout, scale_layout, scale_ue8m0", ALL_QUANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, h", [(1, 4096), (7, 2944), (300, 8192), (3, 20480)])  # 20480: the looped variant
def test_gpu_plain_rmsnorm_kernel(gen, monkeypatch, quant, return_norm, sf_layout, scale_layout, scale_ue8m0, dtype,
                                  t, h):
    x, _, weight, _ = inputs(gen, t, h, dtype, "cuda")
    x[0, :64] = -0.0  # the norm of -0.0 is -0.0 (round_T(x + 0) would make it +0.0)
    scale = torch.tensor([0.02 if quant == "fp8" else 0.004], device="cuda") if quant in ("fp8", "nvfp4") else None
    kw = dict(quant=quant, scale=scale, return_norm=return_norm, sf_layout=sf_layout, scale_layout=scale_layout,
              scale_ue8m0=scale_ue8m0)
    p = local.plan(x, None, weight, 1e-5, **kw)
    assert (p.tail, p.kernel) == ("fused", "fused_tail"), p
    runs = poisoned_runs(lambda: commfuse.fused_add_rmsnorm(x, None, weight, 1e-5, **kw))
    for a, b in zip(*runs):
        assert bits_equal(a, b), "an output element is left unwritten"
    got = runs[0]
    assert got.residual is None
    n = reference.rmsnorm(x.cpu(), weight.cpu(), 1e-5)
    _assert_local_close(got, _want(n, quant, None if scale is None else scale.cpu(), return_norm, sf_layout, scale_layout,
                                   scale_ue8m0), x, quant, sf_layout, scale_layout, scale_ue8m0, n, scale)
    if got.norm is not None:
        assert bits_equal(got.norm[0, :64].cpu(), n[0, :64])  # the signed zeros


@needs_gpu
def test_gpu_kernels_alone_refuse_a_python_number_scale(gen):
    """fused_tail.run and gated_norm.run (the kernels alone) take the format's scale as a float32 CUDA tensor: a
    Python number is refused by name before any launch, by both alike."""
    from commfuse.kernels import fused_tail, gated_norm

    x, z, weight, _ = inputs(gen, 4, 256, BF16, "cuda")
    for quant in ("fp8", "nvfp4"):
        with pytest.raises(ValueError, match="^fused_tail.run: scale must be a float32 CUDA tensor$"):
            fused_tail.run(x, z, weight, 1e-6, quant, 0.5)
        with pytest.raises(ValueError, match="^gated_norm.run: scale must be a float32 CUDA tensor$"):
            gated_norm.run(x, z, weight, 1e-6, 128, False, quant, 0.5)


def test_bits_equal_reads_mn_major_scales_of_one_row_and_group():
    """The tests' byte comparison takes every layout the ops return: MN-major UE8M0 scales of one row and
    one group are [1, 1] with strides (1, 4), whose int32 a plain view cannot read as bytes."""
    q = commfuse.quantize(torch.randn(1, 128).to(BF16), "fp8_block", scale_layout="mn_major", scale_ue8m0=True)
    assert q.scales.shape == (1, 1) and q.scales.stride() == (1, 4), q.scales.stride()
    other = torch.empty(1, 1, dtype=q.scales.dtype).copy_(q.scales)
    assert bits_equal(q.scales, other)
    other.view(torch.uint8)[0, 0] += 1
    assert not bits_equal(q.scales, other)


# Below gated_norm.SPLIT_TOKENS rows of 7168 / 8192 / 16384 are split over 7 / 8 / 8 CTAs, and from
# MANY_SPLIT_TOKENS rows (groups of 1024 / 8 / 2048) over 7 / 2 / 4 (gated_norm.splits).
GATED_CASES = [(1024, 1024), (1024, 256), (1024, 128), (2880, 1440), (8192, 8), (7168, 1024), (16384, 2048)]


@needs_gpu
@pytest.mark.parametrize("quant, return_norm, sf_layout, scale_layout, scale_ue8m0", ALL_QUANTS)
@pytest.mark.parametrize("h, group_size", GATED_CASES)
@pytest.mark.parametrize("gated, norm_before_gate", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("t", [1, 5, 300, 1030])
def test_gpu_gated_rmsnorm_kernel(gen, monkeypatch, quant, return_norm, sf_layout, scale_layout, scale_ue8m0, h,
                                  group_size, gated, norm_before_gate, t):
    from commfuse.kernels import gated_norm

    if quant == "fp8_block" and h % 128:
        pytest.skip("fp8_block needs h % 128 == 0")
    if t > 300 and gated_norm.splits(h, t, group_size, TailSpec.of(quant)) == 1:
        pytest.skip("1030 rows launch as 300 do unless the row is split (rows over 4096 elements from 512 rows)")
    dtype = BF16 if h != 2880 else torch.float16
    x, z, weight, _ = inputs(gen, t, h, dtype, "cuda")
    z = z if gated else None
    scale = torch.tensor([0.02 if quant == "fp8" else 0.004], device="cuda") if quant in ("fp8", "nvfp4") else None
    kw = dict(quant=quant, scale=scale, return_norm=return_norm, sf_layout=sf_layout, scale_layout=scale_layout,
              scale_ue8m0=scale_ue8m0)
    p = local.plan_gated(x, z, weight, 1e-5, group_size, norm_before_gate, **kw)
    assert (p.tail, p.kernel) == ("fused", "gated_rmsnorm"), p
    runs = poisoned_runs(lambda: commfuse.gated_rmsnorm(x, z, weight, 1e-5, group_size, norm_before_gate, **kw))
    for a, b in zip(*runs):
        assert bits_equal(a, b), "an output element is left unwritten"
    # The reference on the same GPU: the group sums' order, rsqrt and the kernel's fast silu are within
    # the tail's tolerances (docs/semantics.md, gated RMSNorm).
    n = reference.gated_rmsnorm(x, z, weight, 1e-5, group_size, norm_before_gate).cpu()
    _assert_local_close(runs[0], _want(n, quant, None if scale is None else scale.cpu(), return_norm, sf_layout, scale_layout,
                                       scale_ue8m0), x, quant, sf_layout, scale_layout, scale_ue8m0, n, scale)


@needs_gpu
@pytest.mark.parametrize("quant, sf_layout, scale_layout, scale_ue8m0",
                         sorted({q[:1] + q[2:] for q in ALL_QUANTS if q[0]}, key=str))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, h", [(1, 4096), (7, 2944), (300, 8192), (600, 8192), (130, 7168), (3, 16384), (2, 4352)])
def test_gpu_quantize_kernel(gen, quant, sf_layout, scale_layout, scale_ue8m0, dtype, t, h):
    """The quantize kernel gives reference.quantize's bits: it runs the tail's quantization code on x
    itself, whose values are already T (no norm to differ by an ulp)."""
    if h % TailSpec.of(quant).hidden_multiple:
        pytest.skip(f"{quant} needs h % {TailSpec.of(quant).hidden_multiple} == 0")
    x = (torch.randn(t, h, generator=gen) * 3).to(dtype).to("cuda")
    x[0, :64] = -0.0
    x[-1, 128:160] = 0.0  # a block of zeros: the smallest scale
    scale = torch.tensor([0.02 if quant == "fp8" else 0.004], device="cuda") if quant in ("fp8", "nvfp4") else None
    kw = dict(sf_layout=sf_layout, scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    p = local.plan_quantize(x, quant, scale, **kw)
    assert (p.tail, p.kernel) == ("fused", "quantize"), p
    runs = poisoned_runs(lambda: commfuse.quantize(x, quant, scale, **kw))
    for a, b in zip(*runs):
        assert bits_equal(a, b), "an output element is left unwritten"
    want = reference.quantize(x.cpu(), quant, None if scale is None else scale.cpu(), **kw)
    for got, ref in zip(runs[0], want):
        assert (got is None) == (ref is None)
        if got is not None:
            assert got.shape == ref.shape and got.stride() == ref.stride() and bits_equal(got.cpu(), ref)
    op = torch.ops.commfuse.quantize(x, scale, code(quant, False, sf_layout, scale_layout, scale_ue8m0))  # C++ kernel
    assert len(op) == sum(r is not None for r in runs[0])
    for got, ref in zip(op, (r for r in runs[0] if r is not None)):
        assert bits_equal(got, ref)


@needs_gpu
def test_gpu_quantize_long_rows_take_the_separated_ops(gen):
    x = torch.randn(2, 20480, generator=gen).to(BF16).to("cuda")
    p = local.plan_quantize(x, "fp8_per_token")
    assert p.tail == "separated" and "16384" in p.reasons[0]
    q = commfuse.quantize(x, "fp8_per_token")
    want = reference.quantize_fp8_per_token(x.cpu())
    assert bits_equal(q.quant.cpu(), want[0]) and bits_equal(q.scales.cpu(), want[1])


@needs_gpu
def test_gpu_gated_kernel_against_the_cpu_reference(gen):
    """The kernel's silu (fast exp) and the CPU's differ by a few fp32 ulps: the norm within 1 ulp of T."""
    x, z, weight, _ = inputs(gen, 64, 2048, BF16, "cuda")
    g = commfuse.gated_rmsnorm(x, z, weight, 1e-5, 256, False)
    assert_within_ulp(g.norm.cpu(), reference.gated_rmsnorm(x.cpu(), z.cpu(), weight.cpu(), 1e-5, 256, False), 1,
                      "gated norm")


@needs_gpu
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_gated_silu_over_every_gate_value(gen, dtype, norm_before_gate):
    """The kernel's silu (the SFU's exp and an approximate division, torch's formula below -64) over every
    finite value of T as the gate, each next to a random x: within 1 ulp of T of the CPU reference. Gated
    after the norm each output is one element's silu; gated first, each group's sum sees its silus."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    z = bits[bits.float().isfinite()]
    z = torch.cat([z, z[: -z.numel() % 2048]])
    z = z[torch.randperm(z.numel(), generator=gen)].view(-1, 2048)  # each group mixes magnitudes, as a gate's do
    x = torch.randn(z.shape, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(2048, generator=gen)).to(dtype)
    if not norm_before_gate:  # x * silu(z) stays finite, so every group's sum is a number
        z = z.clamp(-1e4, 1e4).to(dtype)
    got = commfuse.gated_rmsnorm(x.cuda(), z.cuda(), weight.cuda(), 1e-5, 128, norm_before_gate).norm
    assert_within_ulp(got.cpu(), reference.gated_rmsnorm(x, z, weight, 1e-5, 128, norm_before_gate), 1, "gated norm")


@needs_gpu
def test_gpu_kernels_in_a_cuda_graph(gen):
    from commfuse.kernels import fused_tail, gated_norm

    x, z, weight, scale = inputs(gen, 16, 4096, BF16, "cuda", "nvfp4")
    fused_tail.warmup(BF16, "nvfp4", 4096)
    gated_norm.warmup(BF16, "fp8_block", 4096)

    def step():
        a = commfuse.fused_add_rmsnorm(x, None, weight, 1e-5, quant="nvfp4", scale=scale, return_norm=True)
        b = commfuse.gated_rmsnorm(x, z, weight, 1e-5, 512, True, quant="fp8_block")
        return a, b

    eager = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn(16, 4096, generator=gen).to(BF16))
    graph.replay()
    torch.cuda.synchronize()
    again = step()
    for c, e in zip(captured, again):
        for a, b in zip(c, e):
            assert bits_equal(a, b)
    assert not bits_equal(eager[0].quant, again[0].quant)  # the replay saw the new x


@pytest.mark.parametrize("bad", [-0.02, 0.0, float("nan"), float("inf")])
def test_a_scale_that_is_not_positive_and_finite_raises(gen, bad):
    """A CPU scale is read at every call (its value may change between calls of one signature), a Python
    number at its plan; a GPU scale is not read (docs/guards.md)."""
    x, residual, weight, scale = inputs(gen, 4, 64, BF16, quant="fp8")
    with pytest.raises(ValueError, match="scale must be positive and finite"):
        commfuse.fused_add_rmsnorm(x, residual, weight, quant="fp8", scale=bad)
    commfuse.fused_add_rmsnorm(x, residual, weight, quant="nvfp4", scale=scale)  # the signature, planned
    for call in (lambda s: commfuse.fused_add_rmsnorm(x, residual, weight, quant="nvfp4", scale=s),
                 lambda s: commfuse.quantize(x, "nvfp4", s),
                 lambda s: commfuse.gated_rmsnorm(x, residual, weight, 1e-5, 16, False, quant="fp8", scale=s)):
        call(scale)
        with pytest.raises(ValueError, match="scale must be positive and finite"):
            call(torch.tensor([bad]))


def test_numbers_are_checked_as_the_float32_they_become(gen):
    """A Python number is taken as float32, as the kernels and the reference compute: a scale that rounds
    to 0 or overflows, an eps or weight_offset that overflows, raise naming the argument (instead of every
    code at +-448, or a norm of zeros)."""
    x, residual, weight, _ = inputs(gen, 4, 64, BF16)
    for quant in ("fp8", "nvfp4"):
        for bad in (1e-50, 1e39):
            with pytest.raises(ValueError, match="scale must be positive and finite in float32"):
                commfuse.fused_add_rmsnorm(x, residual, weight, quant=quant, scale=bad)
            with pytest.raises(ValueError, match="scale must be positive and finite in float32"):
                commfuse.quantize(x, quant, bad)
    for name in ("eps", "weight_offset"):
        with pytest.raises(ValueError, match=f"{name} must be a finite float32 number"):
            commfuse.fused_add_rmsnorm(x, residual, weight, **{name: 1e39})
    smallest = 1e-45  # rounds to float32's smallest subnormal: positive, so taken
    got = commfuse.fused_add_rmsnorm(x, residual, weight, quant="fp8", scale=smallest)
    assert bits_equal(got.quant, reference.fused_tail(x, residual, weight, 1e-6, "fp8", torch.tensor([smallest])).quant)
    # A double past FLT_MAX that rounds to it (numpy prints FLT_MAX so) is FLT_MAX, not refused by torch.full.
    largest = 3.4028235e38
    as_f32 = torch.tensor([largest]).float()
    assert float(as_f32) == torch.finfo(torch.float32).max < largest
    for quant in ("fp8", "nvfp4"):
        got = commfuse.fused_add_rmsnorm(x, residual, weight, quant=quant, scale=largest)
        assert bits_equal(got.quant, reference.fused_tail(x, residual, weight, 1e-6, quant, as_f32).quant)
        assert bits_equal(commfuse.quantize(x, quant, largest).quant, commfuse.quantize(x, quant, as_f32).quant)
    got = commfuse.fused_add_rmsnorm(x, residual, weight, weight_offset=-largest)
    assert bits_equal(got.norm, reference.fused_tail(x, residual, weight, 1e-6, weight_offset=float(-as_f32)).norm)


def test_every_call_checks_where_the_caller_outputs_lie(gen):
    """The local table keys a call by its outputs' shapes, strides and dtypes, not by their addresses: a
    later call of a planned signature with a misaligned output, or with MN-major scales whose storage lacks
    room for the padding rows, raises as its first call would, before anything is written (here the
    residual, which the call would update in place)."""
    t, h = 3, 256
    x, residual, weight, _ = inputs(gen, t, h, BF16)
    kw = dict(quant="fp8_block", scale_layout="mn_major")
    want = reference.fused_tail(x, residual, weight, 1e-6, **kw)
    shape, strides = want.scales.shape, want.scales.stride()
    room = strides[1] * shape[1]

    def call(res, scales):
        q = torch.empty(t, h, dtype=torch.float8_e4m3fn)
        return commfuse.fused_add_rmsnorm(x, res, weight, **kw, out=Tail(res, None, q, None, scales))

    got = call(residual.clone(), torch.full((room,), float("nan")).as_strided(shape, strides))  # planned
    assert bits_equal(got.residual, want.residual) and bits_equal(got.scales, want.scales)
    assert bits_equal(got.quant, want.quant)
    in_place = residual.clone()
    with pytest.raises(ValueError, match="out.scales must be a view of a storage of 8 elements"):
        call(in_place, torch.empty(room - 1).as_strided(shape, strides))
    assert bits_equal(in_place, residual)
    aligned = torch.full((t, h), float("nan"), dtype=BF16)
    commfuse.fused_add_rmsnorm(x, residual, weight, out=Tail(None, aligned, None, None, None))  # planned
    assert bits_equal(aligned, reference.fused_tail(x, residual, weight, 1e-6).norm)
    shifted = torch.empty(t * h + 8, dtype=BF16)[1:1 + t * h].view(t, h)
    with pytest.raises(ValueError, match="out.norm must be 16-byte aligned"):
        commfuse.fused_add_rmsnorm(x, residual, weight, out=Tail(None, shifted, None, None, None))


def test_no_rows_with_mn_major_scales_take_their_own_outputs_back(gen):
    """A call of 0 tokens returns MN-major scales with torch's strides of an empty transpose, and takes
    those outputs (or the reference's) back as out=."""
    x, residual, weight, _ = inputs(gen, 0, 256, BF16)
    kw = dict(quant="fp8_block", scale_layout="mn_major")
    want = reference.fused_tail(x, residual, weight, 1e-6, **kw)
    got = commfuse.fused_add_rmsnorm(x, residual, weight, **kw)
    assert got.scales.shape == want.scales.shape and got.scales.stride() == want.scales.stride()
    for out in (got, want):
        again = commfuse.fused_add_rmsnorm(x, residual, weight, **kw, out=out)
        assert again.scales is out.scales


def test_caller_outputs_may_not_overlap_an_input_or_each_other(gen):
    """One rule for every call with out= (docs/guards.md): out.residual may be residual itself (updated
    in place); any other overlap with an input, or between two outputs, raises ValueError naming both."""
    x, residual, weight, scale = inputs(gen, 4, 64, BF16, quant="fp8")
    want = reference.fused_tail(x, residual, weight, 1e-6, "fp8", scale, True)
    in_place = residual.clone()
    got = commfuse.fused_add_rmsnorm(x, in_place, weight, quant="fp8", scale=scale, return_norm=True,
                                     out=Tail(in_place, None, None, None, None))
    assert got.residual is in_place and bits_equal(in_place, want.residual) and bits_equal(got.norm, want.norm)
    buf = torch.full((3, 4, 64), float("nan"), dtype=BF16)
    storage = torch.empty(5 * 64, dtype=BF16)
    shifted_residual = storage[:256].view(4, 64).copy_(residual)
    cases = [  # (residual argument, out, the error)
        (residual, Tail(None, x, None, None, None), "out.norm overlaps x"),
        (residual, Tail(x, None, None, None, None), "out.residual overlaps x"),
        (residual, Tail(buf[0], buf[0], None, None, None), "out.residual and out.norm overlap"),
        (shifted_residual, Tail(None, storage[32:288].view(4, 64), None, None, None), "out.norm overlaps residual"),
        (shifted_residual, Tail(storage[32:288].view(4, 64), None, None, None), "out.residual overlaps residual"),
    ]
    for r, out, why in cases:
        with pytest.raises(ValueError, match=why):
            commfuse.fused_add_rmsnorm(x, r, weight, return_norm=True, out=out)
    got = commfuse.fused_add_rmsnorm(x, residual, weight, out=Tail(buf[1], buf[2], None, None, None))  # separate
    assert bits_equal(buf[1], want.residual) and got.norm.data_ptr() == buf[2].data_ptr()
    assert bits_equal(buf[2], want.norm)


def test_caller_outputs_that_autograd_guards_raise_before_the_residual_is_written(gen):
    """An out field that requires grad (grad mode on) raises ValueError naming it, on the first call and on a
    planned one, before anything is written: here out.residual, the residual itself, comes first."""
    x, residual, weight, _ = inputs(gen, 4, 64, BF16)
    for _ in range(2):
        in_place = residual.clone()
        norm = torch.empty_like(residual).requires_grad_()
        with pytest.raises(ValueError, match="^out.norm requires grad"):
            commfuse.fused_add_rmsnorm(x, in_place, weight, return_norm=True, out=Tail(in_place, norm, None, None, None))
        assert bits_equal(in_place, residual)
        commfuse.fused_add_rmsnorm(x, in_place, weight, return_norm=True,
                                   out=Tail(in_place, torch.empty_like(residual), None, None, None))
