"""Local fused ops (no collective): the all-reduce tail's epilogue on a tensor this rank already has.

    t = commfuse.fused_add_rmsnorm(x, residual, weight, 1e-6, quant="fp8", scale=scale)
    t.residual, t.norm, t.quant, t.scale_factors        # a commfuse.reference.Tail
    t = commfuse.fused_add_rmsnorm(x, None, weight, 1e-6)               # plain RMSNorm (t.residual is None)
    g = commfuse.gated_rmsnorm(x, z, weight, 1e-5, group_size=1024, norm_before_gate=False)
    q, sf = commfuse.norm.quantize(x, "nvfp4", scale)                 # quantization alone

The same numbers as the tail of `Communicator.fused_all_reduce` (docs/semantics.md, sections 2-5),
without the sum: `fused_add_rmsnorm(x, residual, ...)` is `reference.fused_tail(x, residual, ...)`.
Each is also a torch.library custom op with a fake implementation, so models compiled with
torch.compile keep it whole (no graph break, dynamic token counts, CUDA graphs):

- `torch.ops.commfuse.fused_add_rmsnorm(x, residual, weight, scale, eps, quant, return_norm, sf_layout,
  weight_offset, scale_layout="row", scale_ue8m0=False) -> (residual, norm, quant, scale_factors, scales)`;
  residual may be None;
- `torch.ops.commfuse.gated_rmsnorm(x, z, weight, scale, eps, group_size, norm_before_gate, quant,
  return_norm, sf_layout, scale_layout="row", scale_ue8m0=False) -> (norm, quant, scale_factors, scales)`;
  z may be None;
- `torch.ops.commfuse.quantize(x, scale, quant, sf_layout) -> (quant, scale_factors)`.

As in commfuse.ops, quant "" means none and absent outputs are empty tensors (the Python functions
give None instead). Outputs are flattened to [t, h] (t = x.numel() // h) like every commfuse tail.

Routes. `fused_add_rmsnorm` runs the fused tail kernel (`commfuse.fused_tail.run`, one launch; without
a residual it reads and writes none, a plain RMSNorm + quant) where its guards hold (`tail_guard`):
CUDA tensors on SM 8.0+, float16/bfloat16, h % 8 == 0 (the quant's multiple), stride 1 on the last
dims, the scale a float32 tensor on x's device, fusion not disabled (`COMMFUSE_DISABLE_FUSION=1`).
`gated_rmsnorm` runs the gated RMSNorm kernel (`commfuse.gated_norm.run`) under the same guards plus
group_size % 8 == 0 and h <= 16384 (`gated_guard`). Everything else takes the separated ops of
commfuse.reference (the same semantics). `plan(...)` / `plan_gated(...)` say which route a call
takes and why, without running it (a commfuse.Plan with collective "none"); the fusion pass shows it
in its report. `quantize` has no kernel yet: it always runs separated (the fusion pass folds it into
the fused op that produces its input).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from . import epilogue, ops, reference
from .plan import FUSED_DTYPES, SCALED_FP8, SF_LAYOUTS, Collective, Plan, TailRoute, check_quant
from .reference import Tail

__all__ = ["fused_add_rmsnorm", "gated_rmsnorm", "quantize", "plan", "plan_gated", "gated_reference", "tail_guard",
           "gated_guard", "Quantized"]

_DTYPES = FUSED_DTYPES + (torch.float32,)
_OUT_FIELDS = Tail._fields


class Quantized(NamedTuple):
    """Outputs of `quantize`: codes, and the NVFP4 scale factors (None for FP8)."""

    quant: Tensor
    scale_factors: Optional[Tensor]


# --------------------------------------------------------------------------- argument checks


def _check_tensor(name: str, t, device: Optional[torch.device] = None) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, but x is on {device}")


def _check_x(x) -> int:
    _check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape [..., h] with h > 0, got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    return x.shape[-1]


def _check_weight(weight, x: Tensor, h: int) -> None:
    _check_tensor("weight", weight, x.device)
    if weight.dim() != 1 or weight.numel() != h:
        raise ValueError(f"weight must have shape [{h}] (x's hidden size), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")


def _symbolic(v) -> bool:
    # Under torch.compile(dynamic=True) dynamo may trace Python floats as SymFloats: the wrappers do not
    # check their values while dynamo traces (a check would break the graph, float() would specialise
    # it); the op's real implementation checks them when it runs.
    return isinstance(v, (torch.SymFloat, torch.SymInt)) or torch.compiler.is_compiling()


def _number(v):
    return v if _symbolic(v) else float(v)


def _check_eps(eps) -> None:
    if _symbolic(eps):
        return
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def _check_tail(x, residual, weight, eps, quant, scale, sf_layout, weight_offset, scale_layout="row",
                scale_ue8m0=False) -> int:
    h = _check_x(x)
    if residual is not None:
        _check_tensor("residual", residual, x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual dtype {residual.dtype} must match x dtype {x.dtype}")
    _check_weight(weight, x, h)
    _check_eps(eps)
    if not _symbolic(weight_offset) and (isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float))
                                         or not math.isfinite(weight_offset)):
        raise ValueError(f"weight_offset must be a finite number, got {weight_offset!r}")
    check_quant(quant, scale, sf_layout, h, x.device, scale_layout, scale_ue8m0)
    return h


def _check_gated(x, z, weight, eps, group_size, norm_before_gate, quant, scale, sf_layout, scale_layout,
                 scale_ue8m0) -> int:
    h = _check_x(x)
    if z is not None:
        _check_tensor("z", z, x.device)
        if z.shape != x.shape or z.dtype != x.dtype:
            raise ValueError(f"z must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                             f"{tuple(z.shape)} {z.dtype}")
    _check_weight(weight, x, h)
    _check_eps(eps)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or h % group_size:
        raise ValueError(f"group_size must be a positive divisor of h={h}, got {group_size!r}")
    if not isinstance(norm_before_gate, bool):
        raise TypeError(f"norm_before_gate must be a bool, got {type(norm_before_gate).__name__}")
    check_quant(quant, scale, sf_layout, h, x.device, scale_layout, scale_ue8m0)
    return h


# --------------------------------------------------------------------------- the route


def tail_guard(*, dtype: torch.dtype, device: torch.device, hidden: int, has_residual: bool,
               quant: Optional[str], scale_ok: bool, last_strides_one: bool, sm: Optional[tuple] = None) -> Optional[str]:
    """Why `fused_add_rmsnorm` with these properties takes the separated ops (None: the fused kernel,
    with a residual or without: a plain RMSNorm).

    A pure function of metadata, so the fusion pass can ask it about a graph's fake tensors. scale_ok:
    the scale is a float32 tensor on x's device (or the quant has no scale argument). sm: the device's
    compute capability; None reads it from torch.cuda for a CUDA device. has_residual only words the
    reasons: the kernel takes both."""
    from . import fused_tail  # the kernel's limits (imports the JIT, not CUDA)

    return _kernel_guard(fused_tail.SPEC, "fused kernel", dtype=dtype, device=device, hidden=hidden, quant=quant,
                         scale_ok=scale_ok, last_strides_one=last_strides_one, sm=sm,
                         operands="x, residual or weight" if has_residual else "x or weight")


def gated_guard(*, dtype: torch.dtype, device: torch.device, hidden: int, group_size: int, quant: Optional[str],
                scale_ok: bool, last_strides_one: bool, sm: Optional[tuple] = None) -> Optional[str]:
    """Why `gated_rmsnorm` with these properties takes the separated ops (None: the gated RMSNorm
    kernel, commfuse.gated_norm). Arguments as tail_guard's; group_size: the elements normalised
    together (h for one group)."""
    from . import gated_norm

    why = _kernel_guard(gated_norm.SPEC, "gated RMSNorm kernel", dtype=dtype, device=device, hidden=hidden,
                        quant=quant, scale_ok=scale_ok, last_strides_one=last_strides_one, sm=sm,
                        operands="x, z or weight")
    if why is None and group_size % gated_norm.GROUP_MULTIPLE:
        return (f"group_size {group_size} is not a multiple of {gated_norm.GROUP_MULTIPLE}: the gated RMSNorm "
                "kernel's groups are whole 16-byte vectors")
    return why


def _kernel_guard(spec, what: str, *, dtype, device, hidden, quant, scale_ok, last_strides_one, sm,
                  operands) -> Optional[str]:
    if os.environ.get("COMMFUSE_DISABLE_FUSION") == "1":
        return "COMMFUSE_DISABLE_FUSION=1: separated ops"
    if device.type != "cuda":
        return f"tensors on {device.type}: the {what} needs CUDA tensors"
    if sm is None:
        sm = torch.cuda.get_device_capability(device)
    if tuple(sm) < spec.min_sm:
        return f"SM {sm[0]}.{sm[1]} < {spec.min_sm[0]}.{spec.min_sm[1]}: no {what}"
    if dtype not in spec.dtypes:
        return f"dtype {dtype}: the {what} takes float16 and bfloat16"
    if not last_strides_one:
        return f"{operands} has a stride other than 1 on its last dim: the {what} needs stride 1"
    if quant in ("fp8", "nvfp4") and not scale_ok:
        return f"scale is not a float32 CUDA tensor on x's device: the {what} reads it on the device"
    multiple = max(epilogue.hidden_multiple(quant), spec.hidden_multiple)
    if hidden % multiple or hidden > spec.max_hidden:
        return f"hidden size {hidden} is not a multiple of {multiple} in (0, {spec.max_hidden}]"
    return None


def _last_stride_one(*ts) -> bool:
    return all(t is None or t.dim() == 0 or t.stride(-1) == 1 for t in ts)


def plan(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6, *, quant: Optional[str] = None,
         scale: Union[Tensor, float, None] = None, return_norm: bool = False, sf_layout: str = "swizzled",
         weight_offset: float = 0.0, scale_layout: str = "row", scale_ue8m0: bool = False) -> Plan:
    """The route `fused_add_rmsnorm(...)` takes with these arguments, without running it: a
    commfuse.Plan with collective "none", tail "fused" (kernel fused_tail) or "separated" and the reason.
    Raises on the same argument errors as the call."""
    h = _check_tail(x, residual, weight, eps, quant, scale, sf_layout, weight_offset, scale_layout, scale_ue8m0)
    return _plan_of(_guard_for(x, residual, weight, quant, scale, h), "fused_tail")


def plan_gated(x: Tensor, z: Optional[Tensor], weight: Tensor, eps: float, group_size: Optional[int],
               norm_before_gate: bool, *, quant: Optional[str] = None, scale: Optional[Tensor] = None,
               return_norm: bool = False, sf_layout: str = "swizzled", scale_layout: str = "row",
               scale_ue8m0: bool = False) -> Plan:
    """The route `gated_rmsnorm(...)` takes, without running it (as `plan`; kernel gated_rmsnorm)."""
    group_size = x.shape[-1] if group_size is None and isinstance(x, Tensor) and x.dim() else group_size
    h = _check_gated(x, z, weight, eps, group_size, norm_before_gate, quant, scale, sf_layout, scale_layout,
                     scale_ue8m0)
    return _plan_of(_gated_guard_for(x, z, weight, group_size, quant, scale, h), "gated_rmsnorm")


def _plan_of(why: Optional[str], kernel: str) -> Plan:
    if why:
        return Plan(Collective.NONE, TailRoute.SEPARATED, None, (why,))
    return Plan(Collective.NONE, TailRoute.FUSED, kernel, ())


def _scale_ok(scale, x: Tensor) -> bool:
    return (isinstance(scale, Tensor) and scale.dtype == torch.float32 and scale.device == x.device
            and scale.is_contiguous())


def _guard_for(x, residual, weight, quant, scale, h) -> Optional[str]:
    return tail_guard(dtype=x.dtype, device=x.device, hidden=h, has_residual=residual is not None, quant=quant,
                      scale_ok=_scale_ok(scale, x), last_strides_one=_last_stride_one(x, residual, weight))


def _gated_guard_for(x, z, weight, group_size, quant, scale, h) -> Optional[str]:
    return gated_guard(dtype=x.dtype, device=x.device, hidden=h, group_size=group_size, quant=quant,
                       scale_ok=_scale_ok(scale, x), last_strides_one=_last_stride_one(x, z, weight))


# --------------------------------------------------------------------------- semantics (separated route)


def _separated_tail(x, residual, weight, eps, quant, scale, return_norm, sf_layout, weight_offset,
                    scale_layout="row", scale_ue8m0=False) -> Tail:
    h = x.shape[-1]
    if residual is not None and weight_offset == 0:
        return reference.fused_tail(x, residual, weight, eps, quant, scale, return_norm, sf_layout,
                                    scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    x2 = x.reshape(-1, h)
    res = None if residual is None else reference.residual_add(x2, residual.reshape(-1, h))
    src = x2 if res is None else res
    # Gemma's (1 + w): the offset is added to the weight in fp32, then the two fp32 multiplies.
    w = weight if weight_offset == 0 else weight.float() + float(weight_offset)
    norm = reference.rmsnorm(src, w, eps)
    q, sf, scales = _quantize_reference(norm, quant, scale, sf_layout, scale_layout, scale_ue8m0)
    return Tail(res, norm if quant is None or return_norm else None, q, sf, scales)


def _quantize_reference(norm: Tensor, quant, scale, sf_layout, scale_layout="row", scale_ue8m0=False):
    """(codes, scale_factors, scales) of reference.fused_tail's quantization, None where absent."""
    if quant is None:
        return None, None, None
    if quant == "fp8":
        return reference.quantize_fp8(norm, scale), None, None
    if quant == "fp8_per_token":
        q, s = reference.quantize_fp8_per_token(norm)
        return q, None, s
    if quant == "fp8_block":
        q, s = reference.quantize_fp8_block(norm, reference.FP8_BLOCK, scale_layout, scale_ue8m0)
        return q, None, s
    return (*reference.quantize_nvfp4(norm, scale, sf_layout), None)


def gated_reference(x: Tensor, z: Optional[Tensor], weight: Tensor, eps: float, group_size: int,
                    norm_before_gate: bool) -> Tensor:
    """The gated RMSNorm of Mamba2 / Nemotron-H, in fp32, rounded to x's dtype once.

    x: [..., h] T; z: x's shape and dtype, or None (no gate); weight: [h]; group_size divides h.
    Each row is normalised per group of group_size consecutive elements; silu(z) is computed in fp32
    and gates x before the norm (norm_before_gate False: y = norm(x * silu(z)) * w) or the weighted
    norm after it (True: y = norm(x) * w * silu(z)):

        xf = float(x); g = silu(float(z))
        v = RN(xf * g) if gated before the norm else xf                 # per group of group_size:
        inv = rsqrt(RN(mean(v^2) + eps)); y = RN(RN(v * inv) * float(w))
        y = RN(y * g) if gated after the norm
        return round_T(y)

    silu is torch.nn.functional.silu in fp32 on the tensor's device (not pinned bit for bit across
    devices: it goes through exp). Returns [t, h] of x's dtype.
    """
    h = x.shape[-1]
    xf = x.reshape(-1, h).float()
    g = None if z is None else torch.nn.functional.silu(z.reshape(-1, h).float())
    if g is not None and not norm_before_gate:
        xf = xf * g
    t = xf.shape[0]
    v = xf.reshape(t, h // group_size, group_size)
    inv = torch.rsqrt((v * v).mean(dim=-1, keepdim=True) + eps)
    y = (v * inv).reshape(t, h) * weight.float()
    if g is not None and norm_before_gate:
        y = y * g
    return y.to(x.dtype)


# --------------------------------------------------------------------------- out=


def _write_out(result: Tail, out) -> Tail:
    """Copy `result`'s outputs into the caller's tensors of `out` (a Tail, or a tuple in its order)."""
    if not isinstance(out, tuple) or len(out) != len(_OUT_FIELDS):
        raise TypeError(f"out must be a commfuse.reference.Tail (or a tuple of {len(_OUT_FIELDS)}: "
                        f"{', '.join(_OUT_FIELDS)}) of tensors or None, got {type(out).__name__}")
    written = []
    for name, want, dst in zip(_OUT_FIELDS, result, out):
        if dst is None:
            written.append(want)
            continue
        if not isinstance(dst, Tensor):
            raise TypeError(f"out.{name} must be a tensor or None, got {type(dst).__name__}")
        if want is None:
            raise ValueError(f"out.{name} was given, but this call produces no {name}")
        if dst.dtype != want.dtype:
            raise TypeError(f"out.{name} must be {want.dtype}, got {dst.dtype}")
        if dst.device != want.device:
            raise ValueError(f"out.{name} must be on {want.device}, got {dst.device}")
        if tuple(dst.shape) != tuple(want.shape):
            raise ValueError(f"out.{name} must have shape {tuple(want.shape)}, got {tuple(dst.shape)}")
        if not dst.is_contiguous():
            raise ValueError(f"out.{name} must be contiguous")
        written.append(dst)
    for want, dst in zip(result, written):
        if want is not None and dst is not want:
            dst.copy_(want)
    return Tail(*written)


# --------------------------------------------------------------------------- Python API


def fused_add_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6, *,
                      quant: Optional[str] = None, scale: Union[Tensor, float, None] = None,
                      return_norm: bool = False, sf_layout: str = "swizzled", weight_offset: float = 0.0,
                      scale_layout: str = "row", scale_ue8m0: bool = False, out=None) -> Tail:
    """residual = round_T(x + residual), then RMSNorm and an optional FP8/NVFP4 quantization of it.

    x: T[..., h] (T float16, bfloat16 or float32); residual: x's shape and dtype, or None for a plain
    RMSNorm of x (+ quant); weight: T[h]; eps: a number >= 0. quant: None, "fp8", "nvfp4" (with
    scale the dequant scale: a float32 tensor of one element on x's device; a Python float is taken
    and rounded to fp32, on the separated route), or "fp8_per_token" / "fp8_block", which compute
    their scales (scale None; reference.quantize_fp8_per_token / quantize_fp8_block, whose layout
    scale_layout "row" / "mn_major" and scale_ue8m0 choose). return_norm: also return the norm when
    quantizing. sf_layout: NVFP4 scale-factor layout, "swizzled" or "linear". weight_offset: the norm
    multiplies by (float(weight) + weight_offset) in fp32: 1.0 for Gemma's (1 + w) (reference.rmsnorm).

    out: caller-owned outputs, a commfuse.reference.Tail (or a tuple in its order: residual, norm,
    quant, scale_factors, scales) of tensors or None. A tensor is checked (the output's exact shape,
    dtype, device; contiguous) and written in place; None is allocated as usual; a tensor for an
    output the call does not produce raises. The outputs are computed first and then copied, so an
    out tensor may be x or residual themselves (an in-place residual update: out=Tail(residual,
    None, None, None)); on the fused route that copy is one extra pass over the tensor (the kernel
    takes no output pointers yet).

    Returns a Tail of [t, h] tensors (scale factors as in Communicator.fused_all_reduce): residual
    (None without a residual), norm (None when quantizing without return_norm), quant, scale_factors
    (NVFP4 only), scales (the computed FP8 scales only). Semantics: docs/semantics.md sections 2-5
    and 11 (the tail of fused_all_reduce on x).
    """
    _check_tail(x, residual, weight, eps, quant, scale, sf_layout, weight_offset, scale_layout, scale_ue8m0)
    if isinstance(scale, Tensor) or scale is None:
        res, norm, q, sf, scales = torch.ops.commfuse.fused_add_rmsnorm(
            x, residual, weight, scale, _number(eps), quant or "", bool(return_norm), sf_layout, _number(weight_offset),
            scale_layout, scale_ue8m0)
        result = Tail(None if residual is None else res, norm if quant is None or return_norm else None,
                      q if quant else None, sf if quant == "nvfp4" else None, scales if quant in SCALED_FP8 else None)
    else:  # a Python float scale: not an op argument; the separated ops take it (rounded to fp32)
        result = _separated_tail(x, residual, weight, eps, quant, scale, return_norm, sf_layout, weight_offset)
    return result if out is None else _write_out(result, out)


def gated_rmsnorm(x: Tensor, z: Optional[Tensor], weight: Tensor, eps: float, group_size: Optional[int],
                  norm_before_gate: bool, *, quant: Optional[str] = None, scale: Optional[Tensor] = None,
                  return_norm: bool = False, sf_layout: str = "swizzled", scale_layout: str = "row",
                  scale_ue8m0: bool = False) -> Tail:
    """The gated RMSNorm of Mamba2 / Nemotron-H (see `gated_reference` for the exact formula), then
    an optional quantization of its T-rounded output (commfuse.reference's quantizers).

    x: T[..., h]; z: x's shape and dtype, or None (no gate); weight: T[h]; eps >= 0; group_size: the
    elements normalised together, dividing h (None: h, one group); norm_before_gate: False gates x by
    silu(z) before the norm (HF Mamba2), True gates the weighted norm after it (mamba_ssm's default).
    quant, scale, return_norm, sf_layout, scale_layout, scale_ue8m0 as in `fused_add_rmsnorm`.

    Route: the gated RMSNorm kernel (commfuse.gated_norm, one launch) where `gated_guard` holds
    (fused_add_rmsnorm's guards, group_size % 8 == 0, h <= 16384), else the separated ops (fp32
    torch) on x's device; `plan_gated` says which. silu goes through exp, which the GPU and the CPU
    round differently: the kernel matches the reference run on the same GPU (docs/semantics.md).
    Returns a Tail with residual None: norm [t, h] (None when quantizing without return_norm), quant,
    scale_factors, scales."""
    h = _check_x(x)
    group_size = h if group_size is None else group_size
    _check_gated(x, z, weight, eps, group_size, norm_before_gate, quant, scale, sf_layout, scale_layout, scale_ue8m0)
    if scale is not None and not isinstance(scale, Tensor):
        scale = torch.full((1,), float(scale), dtype=torch.float32, device=x.device)
    norm, q, sf, scales = torch.ops.commfuse.gated_rmsnorm(x, z, weight, scale, _number(eps), group_size,
                                                           norm_before_gate, quant or "", bool(return_norm),
                                                           sf_layout, scale_layout, scale_ue8m0)
    return Tail(None, norm if quant is None or return_norm else None, q if quant else None,
                sf if quant == "nvfp4" else None, scales if quant in SCALED_FP8 else None)


def quantize(x: Tensor, quant: str, scale: Tensor, sf_layout: str = "swizzled") -> Quantized:
    """FP8 or NVFP4 quantization of x alone (docs/semantics.md sections 4-5; commfuse.reference).

    x: T[..., h]; quant: "fp8" or "nvfp4" (h % 16 == 0); scale: the dequant scale, a float32 tensor of
    one element on x's device; sf_layout: NVFP4 scale-factor layout. Returns Quantized(quant [t, h]
    float8_e4m3fn or [t, h/2] uint8, scale_factors or None). No kernel yet (separated ops). The fusion
    pass folds this op into a fused tail that produces x."""
    h = _check_x(x)
    if quant not in ("fp8", "nvfp4"):
        raise ValueError(f"quant must be 'fp8' or 'nvfp4', got {quant!r}")
    if not isinstance(scale, Tensor):
        raise TypeError(f"scale must be a float32 tensor of one element, got {type(scale).__name__}")
    check_quant(quant, scale, sf_layout, h, x.device)
    q, sf = torch.ops.commfuse.quantize(x, scale, quant, sf_layout)
    return Quantized(q, sf if quant == "nvfp4" else None)


# --------------------------------------------------------------------------- custom ops


def _empty(x: Tensor) -> Tensor:
    return x.new_empty(0)


def _fresh(t: Optional[Tensor], x: Tensor) -> Tensor:
    return _empty(x) if t is None else t


def _fused_add_rmsnorm_op(x: Tensor, residual: Optional[Tensor], weight: Tensor, scale: Optional[Tensor], eps: float,
                          quant: str, return_norm: bool, sf_layout: str, weight_offset: float,
                          scale_layout: str = "row",
                          scale_ue8m0: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    q = quant or None
    h = _check_tail(x, residual, weight, eps, q, scale, sf_layout, weight_offset, scale_layout, scale_ue8m0)
    if _guard_for(x, residual, weight, q, scale, h) is None:
        from . import fused_tail

        tail = fused_tail.run(x, residual, weight, eps, q, scale, return_norm, sf_layout, weight_offset=weight_offset,
                              scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    else:
        tail = _separated_tail(x, residual, weight, eps, q, scale, return_norm, sf_layout, weight_offset,
                               scale_layout, scale_ue8m0)
    res = tail.residual
    if res is None:
        res = _empty(x)
    elif residual is not None and (res.data_ptr() == residual.data_ptr() or res.data_ptr() == x.data_ptr()):
        res = res.clone()  # outputs may not alias inputs
    return res, _fresh(tail.norm, x), _fresh(tail.quant, x), _fresh(tail.scale_factors, x), _fresh(tail.scales, x)


def _fused_add_rmsnorm_fake(x, residual, weight, scale, eps, quant, return_norm, sf_layout, weight_offset,
                            scale_layout="row", scale_ue8m0=False):
    from .epilogue import fake_outputs

    outs = fake_outputs(x, quant, return_norm, sf_layout, scale_layout, scale_ue8m0)
    if residual is None:
        outs[0] = x.new_empty(0)
    return tuple(outs)


def _gated_rmsnorm_op(x: Tensor, z: Optional[Tensor], weight: Tensor, scale: Optional[Tensor], eps: float,
                      group_size: int, norm_before_gate: bool, quant: str, return_norm: bool,
                      sf_layout: str, scale_layout: str = "row",
                      scale_ue8m0: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    q = quant or None
    h = _check_gated(x, z, weight, eps, group_size, norm_before_gate, q, scale, sf_layout, scale_layout, scale_ue8m0)
    if _gated_guard_for(x, z, weight, group_size, q, scale, h) is None:
        from . import gated_norm

        tail = gated_norm.run(x, z, weight, eps, group_size, norm_before_gate, q, scale, return_norm, sf_layout,
                              scale_layout, scale_ue8m0)
        norm, codes, sf, scales = tail.norm, tail.quant, tail.scale_factors, tail.scales
    else:
        norm = gated_reference(x, z, weight, eps, group_size, norm_before_gate)
        codes, sf, scales = _quantize_reference(norm, q, scale, sf_layout, scale_layout, scale_ue8m0)
        norm = norm if q is None or return_norm else None
    return _fresh(norm, x), _fresh(codes, x), _fresh(sf, x), _fresh(scales, x)


def _gated_rmsnorm_fake(x, z, weight, scale, eps, group_size, norm_before_gate, quant, return_norm, sf_layout,
                        scale_layout="row", scale_ue8m0=False):
    from .epilogue import fake_outputs

    return tuple(fake_outputs(x, quant, return_norm, sf_layout, scale_layout, scale_ue8m0)[1:])


def _quantize_op(x: Tensor, scale: Tensor, quant: str, sf_layout: str) -> Tuple[Tensor, Tensor]:
    h = _check_x(x)
    if quant not in ("fp8", "nvfp4"):
        raise ValueError(f"quant must be 'fp8' or 'nvfp4', got {quant!r}")
    check_quant(quant, scale, sf_layout, h, x.device)
    q, sf, _ = _quantize_reference(x.reshape(-1, h), quant, scale, sf_layout)
    return q, _fresh(sf, x)


def _quantize_fake(x, scale, quant, sf_layout):
    from .epilogue import output_specs

    if quant not in ("fp8", "nvfp4") or sf_layout not in SF_LAYOUTS:
        raise ValueError(f"quant must be 'fp8' or 'nvfp4' and sf_layout 'swizzled' or 'linear', "
                         f"got {quant!r}, {sf_layout!r}")
    h = x.shape[-1]
    _, _, q, sf, _ = output_specs(x.numel() // h, h, x.dtype, quant, False, sf_layout)
    return x.new_empty(q[0], dtype=q[1]), (x.new_empty(0) if sf is None else x.new_empty(sf[0], dtype=sf[1]))


# torch.library definitions (commfuse.ops.define: no custom_op wrappers on the eager path).
_SCALED = 'str scale_layout="row", bool scale_ue8m0=False'
ops.define("fused_add_rmsnorm(Tensor x, Tensor? residual, Tensor weight, Tensor? scale, float eps, str quant, "
           f"bool return_norm, str sf_layout, float weight_offset, {_SCALED}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
           _fused_add_rmsnorm_op, _fused_add_rmsnorm_fake)
ops.define("gated_rmsnorm(Tensor x, Tensor? z, Tensor weight, Tensor? scale, float eps, int group_size, "
           f"bool norm_before_gate, str quant, bool return_norm, str sf_layout, {_SCALED}) -> (Tensor, Tensor, Tensor, "
           "Tensor)", _gated_rmsnorm_op, _gated_rmsnorm_fake)
ops.define("quantize(Tensor x, Tensor scale, str quant, str sf_layout) -> (Tensor, Tensor)", _quantize_op,
           _quantize_fake)

