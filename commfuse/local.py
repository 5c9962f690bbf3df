"""Local fused ops (no collective): the all-reduce tail's epilogue on a tensor this rank already has.

    t = commfuse.fused_add_rmsnorm(x, residual, weight, 1e-6, quant="fp8", scale=scale)
    t.residual, t.norm, t.quant, t.scale_factors, t.scales   # a commfuse.reference.Tail
    t = commfuse.fused_add_rmsnorm(x, None, weight, 1e-6)               # plain RMSNorm (t.residual is None)
    g = commfuse.gated_rmsnorm(x, z, weight, 1e-5, group_size=1024, norm_before_gate=False)
    q = commfuse.quantize(x, "nvfp4", scale)                          # quantization alone: Quantized

The same numbers as the tail of `Communicator.fused_all_reduce` (docs/semantics.md, sections 2-5),
without the sum: `fused_add_rmsnorm(x, residual, ...)` is `reference.fused_tail(x, residual, ...)`.
Each is also a torch.library custom op (commfuse.ops), so models compiled with torch.compile keep it
whole (no graph break, dynamic token counts, CUDA graphs); these functions call the op while dynamo
traces, and run it directly otherwise.

Routes (commfuse.routes): `fused_add_rmsnorm` runs the fused_tail kernel (one launch; without a
residual it reads and writes none) where the fused tail's guards hold: CUDA tensors on SM 8.0+,
float16/bfloat16, h % 8 == 0 (and the format's multiple), any strides (a strided operand is copied),
the scale a float32 tensor on x's device, fusion not disabled (`COMMFUSE_DISABLE_FUSION=1`). `gated_rmsnorm` runs
the gated RMSNorm kernel under the same guards plus group_size % 8 == 0 and h <= 16384. Everything else
takes the separated ops of commfuse.reference (the same semantics). `quantize` runs the quantize kernel
under the same guards as fused_add_rmsnorm's plus h <= 16384 (the row lives in registers).
`plan(...)` / `plan_gated(...)` / `plan_quantize(...)` say which route a call takes and why, without
running it (a commfuse.Plan with collective "none"). A call signature is planned once: the process's local plan
table (commfuse.kernels.table, name "local") holds its launcher, and commfuse.ops' C++ kernels for CUDA
tensors look it up too.
"""
from __future__ import annotations

import threading
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from . import routes
from .kernels import native
from .reference import Tail
from .routes import Call, Machine, Plan, Resources
from .tail import checks, formats
from .tail.spec import TailSpec, code, flag, integer_type, number_type, spread

__all__ = ["fused_add_rmsnorm", "gated_rmsnorm", "quantize", "plan", "plan_gated", "plan_quantize", "Quantized"]

_WHERE = "x is on"
_F32_MAX = torch.finfo(torch.float32).max


class Quantized(NamedTuple):
    """Outputs of `quantize`: the codes, and the block scales in the field the format keeps them in
    (its registry entry's scale_field: scale_factors for NVFP4 and MXFP8, scales for the computed FP8
    scales), None where it has none. All on x's device; t = x.numel() // h.

    quant: float8_e4m3fn[t, h] (fp8, fp8_per_token, fp8_block, mxfp8) or uint8[t, h/2] (nvfp4, two
        e2m1 codes a byte, even index in the low nibble).
    scale_factors: nvfp4's float8_e4m3fn[t, h/16] or mxfp8's uint8[t, h/32] (UE8M0 exponents) with
        sf_layout "linear"; "swizzled": flat, roundup(t, 128) * roundup(K, 4) entries (K = h/16 or h/32,
        padding 0); None for the other formats.
    scales: fp8_per_token's float32[t]; fp8_block's (K = h/128): float32[t, K] row-major or MN-major
        (strides (1, roundup(t, 4))), or with scale_ue8m0 uint8[t, K] row-major or MN-major packed four
        to an int32[t, ceil(K/4)] (reference.quantize_fp8_block); None for the other formats."""

    quant: Tensor
    scale_factors: Optional[Tensor]
    scales: Optional[Tensor] = None


_TABLE = None
_TABLE_LOCK = threading.Lock()


def _table():
    """The local ops' plan table, made once. Under a lock: the native table registers itself by name for the
    op kernels, and of two made at once by racing threads the one kept here could be the one unregistered,
    leaving compiled code's ops on the Python path for good."""
    global _TABLE
    if _TABLE is None:
        with _TABLE_LOCK:
            if _TABLE is None:
                _TABLE = native.table("local", 0, Tail, Tail, Quantized)
    return _TABLE


def _compiling() -> bool:
    # Under torch.compile dynamo may trace Python floats as SymFloats: the functions then only call the
    # op (a check would break the graph, float() would specialise it); the op's kernel checks at run time.
    return torch.compiler.is_compiling()


def _compiled_checks(x, quant, flags=(), numbers=(), quant_required: bool = False, group_size=None,
                     name: str = "x") -> None:
    """What a compiled call can check of its arguments without specialising the graph (their types), as eager
    calls check them: the op's schema would otherwise convert a wrong value silently (norm_before_gate None to
    False, eps True to 1.0), and the op's "" for None would drop a quantization. flags, numbers: (name, value)
    pairs; an int past float32's range is refused here, as eager calls refuse it: the schema's conversion would
    fail naming nothing. name: x's argument name."""
    if group_size is not None:
        integer_type("group_size", group_size)
    if isinstance(x, Tensor) and x.dim() == 0:
        raise ValueError(f"{name} must have shape [..., h] with h > 0, got {tuple(x.shape)}")
    if quant is not None or quant_required:
        checks.quant_named(quant)
        formats.by_name(quant)
    for name, v in flags:
        flag(name, v)
    for name, v in numbers:
        number_type(name, v)
        if isinstance(v, int) and abs(v) > _F32_MAX:
            raise ValueError(f"{name} must be a finite float32 number, got {'inf' if v > 0 else '-inf'}")


def _op_scale(scale, x: Tensor):
    """A scale as the ops take it in compiled code: a Python number (which eager calls take as such) as a
    float32 tensor of one element on x's device, checked as eager calls check it."""
    if scale is None or isinstance(scale, Tensor):
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError("scale must be a float32 tensor of one element or a Python number")
    if not checks.scale_in_range(scale):  # scale_value's check; its message would print a traced number
        raise ValueError("scale must be positive and finite in float32 (the dequant scale)")
    # Its float32 value: torch.full refuses a double past FLT_MAX that rounds to it. A comparison, which
    # torch.compile traces (a symbolic float included).
    return torch.full((1,), scale if scale <= _F32_MAX else _F32_MAX, dtype=torch.float32, device=x.device)


def _planned(op: str, args: tuple, call: Call, device: torch.device):
    """Plan a call, put its launcher in the local table, and return (plan, launcher)."""
    p = routes.plan(call, Machine.local(device))
    launcher = routes.launcher(call, p, Resources(device=device))
    _table().insert(op, args, p, launcher)
    return p, launcher


def _tail_spec(quant, return_norm, eps, weight_offset, sf_layout, scale_layout, scale_ue8m0) -> TailSpec:
    return TailSpec.of(quant, return_norm=return_norm, eps=eps, weight_offset=weight_offset, sf_layout=sf_layout,
                       scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)


def _local_call(x, residual, weight, scale, out, spec) -> Call:
    h = checks.tail(x, residual, weight, scale, spec, None, residual_optional=True, where=_WHERE)
    if out is not None:
        checks.out(out, spec.outputs(x.numel() // h, h, x.dtype, residual is not None), x.device,
                   (("x", x), ("residual", residual), ("weight", weight), ("scale", scale)))
    return Call.of("local", x, residual, weight, scale, spec=spec)


def fused_add_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6, *,
                      quant: Optional[str] = None, scale: Union[Tensor, float, None] = None,
                      return_norm: bool = False, sf_layout: str = "swizzled", weight_offset: float = 0.0,
                      scale_layout: str = "row", scale_ue8m0: bool = False, out=None) -> Tail:
    """residual = round_T(x + residual), then RMSNorm and an optional quantization of it.

    x: T[..., h] (T float16, bfloat16 or float32; others raise TypeError), on any device; residual: x's
    shape and dtype, or None for a plain RMSNorm of x (+ quant); weight: T[h]; residual, weight (and a
    scale tensor) on x's device (else ValueError); eps: a number >= 0. quant: None or a format of
    commfuse.tail.formats.FORMATS: "fp8" and "nvfp4" take scale, the dequant scale (a float32 tensor
    of one element on x's device; a Python float is taken and rounded to fp32, on the separated route);
    "fp8_per_token", "fp8_block" and "mxfp8" compute their scales (scale None; docs/semantics.md).
    return_norm: also return the norm when quantizing. sf_layout: the scale-factor layout of NVFP4 and
    MXFP8, "swizzled" or "linear"; scale_layout ("row" / "mn_major") and scale_ue8m0: fp8_block's.
    weight_offset: the norm multiplies by (float(weight) + weight_offset) in fp32: 1.0 for Gemma's
    (1 + w) (reference.rmsnorm).

    out: caller-owned outputs, as for Communicator.fused_all_reduce: a commfuse.reference.Tail (or a
    tuple in its order: residual, norm, quant, scale_factors, scales) of tensors or None; a tensor is
    checked (the output's exact shape, dtype, strides, device; 16-byte aligned) and written in place,
    None is allocated as usual, a tensor for an output the call does not produce raises. The outputs
    may overlap neither each other nor an input, except that out.residual may be the residual input
    itself (an in-place update: out=Tail(residual, None, None, None)), or residual.view(-1, h) of a
    contiguous residual of another shape.

    Returns a Tail of [t, h] tensors (scale factors as in Communicator.fused_all_reduce): residual
    (None without a residual), norm (None when quantizing without return_norm), quant, scale_factors
    (NVFP4's and MXFP8's), scales (the computed FP8 scales only). Semantics: docs/semantics.md
    sections 2-5, 10, 11 and 13 (the tail of fused_all_reduce on x).
    """
    if _compiling():
        if out is not None:
            raise TypeError("fused_add_rmsnorm: out= is for eager calls (a compiled model's outputs are its own)")
        _compiled_checks(x, quant, (("return_norm", return_norm), ("scale_ue8m0", scale_ue8m0)),
                         (("eps", eps), ("weight_offset", weight_offset)))
        tail = code(quant, return_norm, sf_layout, scale_layout, scale_ue8m0)
        outs = torch.ops.commfuse.fused_add_rmsnorm(x, residual, weight, _op_scale(scale, x), eps, weight_offset, tail)
        return Tail(*spread(outs, tail, residual is not None))
    args = (x, residual, weight, scale, out, eps, quant, return_norm, sf_layout, weight_offset, scale_layout,
            scale_ue8m0)
    r = _table().local(*args)
    if r is not None:
        return r
    spec = _tail_spec(quant, return_norm, eps, weight_offset, sf_layout, scale_layout, scale_ue8m0)
    _, launcher = _planned("local", args, _local_call(x, residual, weight, scale, out, spec), x.device)
    return Tail(*launcher(x, residual, weight, scale, out))


def gated_rmsnorm(x: Tensor, z: Optional[Tensor], weight: Tensor, eps: float, group_size: Optional[int],
                  norm_before_gate: bool, *, quant: Optional[str] = None, scale: Union[Tensor, float, None] = None,
                  return_norm: bool = False, sf_layout: str = "swizzled", scale_layout: str = "row",
                  scale_ue8m0: bool = False) -> Tail:
    """The gated RMSNorm of Mamba2 / Nemotron-H (reference.gated_rmsnorm has the exact formula), then
    an optional quantization of its T-rounded output (commfuse.reference's quantizers).

    x: T[..., h] (T float16, bfloat16 or float32; others raise TypeError), on any device; z: x's shape
    and dtype, or None (no gate); weight: T[h]; z, weight (and a scale tensor) on x's device (else
    ValueError); eps >= 0; group_size: the elements normalised together, dividing h (None: h, one
    group); norm_before_gate: False gates x by silu(z) before the norm (HF Mamba2), True gates the
    weighted norm after it (mamba_ssm's default).
    quant, scale, return_norm, sf_layout, scale_layout, scale_ue8m0 as in `fused_add_rmsnorm`: scale a
    float32 tensor of one element on x's device, or a Python float (rounded to fp32, on the separated route).

    Route: the gated RMSNorm kernel (one launch) where its guards hold (fused_add_rmsnorm's,
    group_size % 8 == 0, h <= 16384), else the separated ops (fp32 torch) on x's device; `plan_gated`
    says which. The kernel's silu takes the GPU's fast exp: its norm is within an ulp of T of the
    reference (docs/semantics.md). Returns a Tail with residual None, on x's device: norm T[t, h]
    (None when quantizing without return_norm), quant, scale_factors, scales (as in `Quantized`)."""
    if group_size is None and isinstance(x, Tensor) and x.dim():
        group_size = x.shape[-1]
    if _compiling():
        _compiled_checks(x, quant, (("norm_before_gate", norm_before_gate), ("return_norm", return_norm),
                                    ("scale_ue8m0", scale_ue8m0)), (("eps", eps),), group_size=group_size)
        tail = code(quant, return_norm, sf_layout, scale_layout, scale_ue8m0)
        outs = torch.ops.commfuse.gated_rmsnorm(x, z, weight, _op_scale(scale, x), eps, group_size, norm_before_gate,
                                                tail)
        return Tail(*spread(outs, tail, False))
    args = (x, z, weight, scale, eps, group_size, norm_before_gate, quant, return_norm, sf_layout, scale_layout,
            scale_ue8m0)
    r = _table().gated(*args)
    if r is not None:
        return r
    call = _gated_call(x, z, weight, eps, group_size, norm_before_gate, quant, scale, return_norm, sf_layout,
                       scale_layout, scale_ue8m0)
    _, launcher = _planned("gated", args, call, x.device)
    return Tail(*launcher(x, None, weight, scale, None, z))


def _gated_call(x, z, weight, eps, group_size, norm_before_gate, quant, scale, return_norm, sf_layout, scale_layout,
                scale_ue8m0) -> Call:
    spec = TailSpec.of(quant, return_norm=return_norm, eps=eps, sf_layout=sf_layout, scale_layout=scale_layout,
                       scale_ue8m0=scale_ue8m0)
    checks.gated(x, z, weight, scale, spec, group_size, norm_before_gate)
    return Call.of("gated", x, None, weight, scale, z, spec, group_size, norm_before_gate)


def quantize(x: Tensor, quant: str, scale: Union[Tensor, float, None] = None, sf_layout: str = "swizzled", *,
             scale_layout: str = "row", scale_ue8m0: bool = False) -> Quantized:
    """The quantization `quant` of x alone (docs/semantics.md sections 4-5 and 10-11; commfuse.reference).

    x: T[..., h] (T float16, bfloat16 or float32; others raise TypeError), on any device; quant: any
    format of commfuse.tail.formats.FORMATS but None; scale: the dequant scale for the formats that
    take one ("fp8", "nvfp4"; None for the others), a float32 tensor of one element on x's device or a
    Python float (rounded to fp32, on the separated route); sf_layout, scale_layout, scale_ue8m0: the
    layout of the block scales, as in `fused_add_rmsnorm`. Returns Quantized(quant [t, h] float8_e4m3fn
    or [t, h/2] uint8, scale_factors, scales) on x's device, t = x.numel() // h (shapes: `Quantized`).
    Route: the quantize kernel (one launch; reference.quantize's bits) where its guards hold, else the
    separated ops; `plan_quantize` says which. The fusion pass folds this op into a fused tail that
    produces x."""
    if _compiling():
        _compiled_checks(x, quant, (("scale_ue8m0", scale_ue8m0),), quant_required=True)
        tail = code(quant, False, sf_layout, scale_layout, scale_ue8m0)
        return Quantized(*spread(torch.ops.commfuse.quantize(x, _op_scale(scale, x), tail), tail, False)[2:])
    args = (x, scale, quant, sf_layout, scale_layout, scale_ue8m0)
    r = _table().quantize(*args)
    if r is not None:
        return r
    _, launcher = _planned("quantize", args, _quantize_call(x, quant, scale, sf_layout, scale_layout, scale_ue8m0),
                           x.device)
    outs = launcher(x, None, None, scale, None)
    return Quantized(outs[2], outs[3], outs[4])


def _quantize_call(x, quant, scale, sf_layout, scale_layout, scale_ue8m0) -> Call:
    checks.quant_named(quant)
    spec = TailSpec.of(quant, sf_layout=sf_layout, scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    h = checks.x_hidden(x, None)
    checks.scale(spec, scale, h, x.device, where="x is on")
    return Call.of("quantize", x, scale=scale, spec=spec)


def plan(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6, *, quant: Optional[str] = None,
         scale: Union[Tensor, float, None] = None, return_norm: bool = False, sf_layout: str = "swizzled",
         weight_offset: float = 0.0, scale_layout: str = "row", scale_ue8m0: bool = False, out=None) -> Plan:
    """The route `fused_add_rmsnorm(...)` takes with these arguments, without running it: a
    commfuse.Plan with collective "none", tail "fused" (kernel fused_tail) or "separated" and the reason.
    Raises on the same argument errors as the call. It reads COMMFUSE_DISABLE_FUSION now, as a call's first
    plan of its signature does: a signature already called keeps the route it was planned with."""
    spec = _tail_spec(quant, return_norm, eps, weight_offset, sf_layout, scale_layout, scale_ue8m0)
    return routes.plan(_local_call(x, residual, weight, scale, out, spec), Machine.local(x.device))


def plan_gated(x: Tensor, z: Optional[Tensor], weight: Tensor, eps: float, group_size: Optional[int],
               norm_before_gate: bool, *, quant: Optional[str] = None, scale: Union[Tensor, float, None] = None,
               return_norm: bool = False, sf_layout: str = "swizzled", scale_layout: str = "row",
               scale_ue8m0: bool = False) -> Plan:
    """The route `gated_rmsnorm(...)` takes, without running it (as `plan`; kernel gated_rmsnorm)."""
    if group_size is None and isinstance(x, Tensor) and x.dim():
        group_size = x.shape[-1]
    call = _gated_call(x, z, weight, eps, group_size, norm_before_gate, quant, scale, return_norm, sf_layout,
                       scale_layout, scale_ue8m0)
    return routes.plan(call, Machine.local(x.device))


def plan_quantize(x: Tensor, quant: str, scale: Union[Tensor, float, None] = None, sf_layout: str = "swizzled", *,
                  scale_layout: str = "row", scale_ue8m0: bool = False) -> Plan:
    """The route `quantize(...)` takes, without running it (as `plan`; kernel quantize)."""
    return routes.plan(_quantize_call(x, quant, scale, sf_layout, scale_layout, scale_ue8m0), Machine.local(x.device))
