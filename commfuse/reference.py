"""Reference semantics of the commfuse all-reduce tail, in plain vectorised torch.

This module is the oracle the GPU kernels are tested against and the library's
"separated ops" path, so every function here is exact (bit-level where the
semantics pin the bits) and works on CPU and CUDA tensors alike. Nothing the
caller passes is modified; outputs are fresh tensors on the inputs' device.

Conventions (docs/semantics.md has every formula in order):

* ``T`` is the dtype of the activations (fp16, bf16, or fp32). All arithmetic is
  done in fp32 and rounded to ``T`` once, round-to-nearest-even.
* ``scale`` is always the DEQUANT scale, as stored in checkpoints:
  ``value = code * scale`` for FP8, ``value = code * sf * scale`` for NVFP4.
  It is an fp32 tensor of one element (any device) or a python float, which is
  rounded to fp32 first. Peers such as FlashInfer / TensorRT-LLM take the
  inverse NVFP4 global scale (``448 * 6 / amax``); :func:`scale_from_inverse`
  converts it to ours. Note that ``1 / (1 / s)`` may differ from ``s`` by one
  fp32 ulp, so encoding from a converted scale can differ from a peer's by a
  code in rare boundary cases.
* FP8 is ``float8_e4m3fn``: RNE, saturating to +-448 (Inf too); NaN becomes the
  canonical NaN code 0x7F (the sign of a NaN is not kept, matching the hardware
  ``cvt.satfinite`` conversion); -0.0 stays 0x80.
* NVFP4: blocks of 16 consecutive elements of a row; one e4m3 scale factor per
  block; e2m1 codes (4 bits, sign in bit 3), two per byte, the even element in
  the low nibble. A block holding a NaN gets a NaN scale factor (0x7F) and
  codes 0, so the whole block dequantizes to NaN.
* Scale-factor layouts: ``"linear"`` is ``[t, h/16]``; ``"swizzled"`` is the
  128x4 tiled layout of the NVFP4 GEMMs, flat, ``roundup(t,128)*roundup(h/16,4)``
  entries with padding written as 0 (see :func:`swizzled_sf_index`).
* Shapes ``[..., h]`` are accepted and flattened to ``[t, h]`` where noted.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "all_reduce_sum",
    "residual_add",
    "rmsnorm",
    "quantize_fp8",
    "dequantize_fp8",
    "e2m1_encode",
    "e2m1_decode",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "swizzled_sf_index",
    "swizzle_scale_factors",
    "unswizzle_scale_factors",
    "nvfp4_scale_from_amax",
    "fp8_scale_from_amax",
    "scale_from_inverse",
    "Tail",
    "fused_tail",
    "FP8_MAX",
    "E2M1_MAX",
    "NVFP4_BLOCK",
]

Scale = Union[Tensor, float]

FP8_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
_FP8_NAN = 0x7F
_SF_LAYOUTS = ("swizzled", "linear")
_QUANTS = (None, "fp8", "nvfp4")

# e2m1 magnitudes by code 0..7; codes 8..15 are the negatives.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _check_sf_layout(sf_layout: str) -> None:
    if sf_layout not in _SF_LAYOUTS:
        raise ValueError(f"sf_layout must be one of {_SF_LAYOUTS}, got {sf_layout!r}")


def _scale_tensor(scale: Scale, device: torch.device) -> Tensor:
    """The scale as a 0-dim fp32 tensor on ``device`` (python floats rounded to fp32)."""
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must have one element, got shape {tuple(scale.shape)}")
        return scale.detach().to(device=device, dtype=torch.float32).reshape(())
    # torch.full, not torch.tensor: no host-to-device copy, so the separated path can be captured in a CUDA graph.
    return torch.full((), float(scale), dtype=torch.float32, device=device)


def _to_e4m3(v: Tensor) -> Tensor:
    """fp32 -> float8_e4m3fn, RNE, saturating, NaN -> canonical 0x7F."""
    # torch's own cast may map out-of-range to NaN; clamp keeps NaN, so saturate first.
    q = v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(torch.isnan(v), torch.full_like(q, _FP8_NAN), q)
    return q.view(torch.float8_e4m3fn)


# --------------------------------------------------------------------------- tail ops


def all_reduce_sum(xs: Sequence[Tensor]) -> Tensor:
    """Sum of the ranks' partial tensors, as the one-shot all-reduce computes it.

    xs: non-empty sequence of tensors of one shape and dtype T (fp16/bf16/fp32),
        on one device, in rank order.
    Returns a T tensor of that shape: the fp32 sum accumulated in list order,
    rounded to T once.
    """
    if len(xs) == 0:
        raise ValueError("all_reduce_sum needs at least one tensor")
    # Explicit rank-order accumulation: a stacked .sum() may reorder (pairwise/vectorised).
    acc = xs[0].to(torch.float32, copy=True)
    for x in xs[1:]:
        acc += x.to(torch.float32)
    return acc.to(xs[0].dtype)


def residual_add(a: Tensor, residual: Tensor) -> Tensor:
    """round_T(float(a) + float(residual)).

    a, residual: tensors of one shape and dtype T, on one device.
    Returns a T tensor of that shape.
    """
    return (a.float() + residual.float()).to(a.dtype)


def rmsnorm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim, computed in fp32, rounded to x's dtype once.

    x: [..., h] tensor of dtype T. weight: [h] tensor (any float dtype, usually T),
    on x's device. eps: python float.
    Returns [..., h] of dtype T: round_T(float(x) * rsqrt(mean(float(x)^2) + eps) * float(weight)).
    """
    xf = x.float()
    inv = torch.rsqrt((xf * xf).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv * weight.float()).to(x.dtype)


# --------------------------------------------------------------------------- FP8


def quantize_fp8(x: Tensor, scale: Scale) -> Tensor:
    """e4m3(float(x) / scale): RNE, saturating to +-448, NaN -> NaN code 0x7F.

    x: tensor of any shape, fp16/bf16/fp32, any device.
    scale: dequant scale, fp32 tensor of 1 element or python float.
    Returns float8_e4m3fn of x's shape on x's device.
    """
    # A true division (not a multiplication by 1/scale) is the contract kernels match.
    return _to_e4m3(x.float() / _scale_tensor(scale, x.device))


def dequantize_fp8(q: Tensor, scale: Scale) -> Tensor:
    """float(q) * scale in fp32.

    q: float8_e4m3fn tensor, any shape/device. scale: as in :func:`quantize_fp8`.
    Returns fp32 of q's shape.
    """
    return q.float() * _scale_tensor(scale, q.device)


# --------------------------------------------------------------------------- e2m1


def e2m1_encode(v: Tensor) -> Tensor:
    """fp32 -> e2m1 codes (one uint8 code 0..15 per element, not packed).

    v: fp32 tensor, any shape/device.
    Magnitude RNE onto {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6 (Inf too),
    ties to the even code; bit 0x8 is the sign bit of v (so -0.0 -> 0x8).
    NaN -> 0 (callers handle NaN blocks through the scale factor).
    Returns uint8 of v's shape.
    """
    m = v.abs()
    # Thresholds between neighbouring magnitudes; ">=" where the tie goes up to the even code.
    code = (
        (m > 0.25).to(torch.uint8)
        + (m >= 0.75)
        + (m > 1.25)
        + (m >= 1.75)
        + (m > 2.5)
        + (m >= 3.5)
        + (m > 5.0)
    )
    neg = torch.signbit(v) & ~torch.isnan(v)
    return code | (neg.to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """e2m1 codes (uint8 0..15, any shape/device) -> fp32 values of the same shape."""
    table = torch.tensor(
        _E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32, device=codes.device
    )
    return table[(codes & 0xF).long()]


# --------------------------------------------------------------------------- SF layouts


def swizzled_sf_index(m: Tensor, k: Tensor, K: int) -> Tensor:
    """Flat index of scale factor (row m, block k) in the swizzled 128x4 layout.

    m, k: integer tensors (broadcastable, any device). K: blocks per row (h/16).
    Returns int64 tensor of the broadcast shape.
    """
    m = m.long()
    k = k.long()
    k_tiles = (K + 3) // 4
    return (
        (m // 128) * (k_tiles * 512)
        + (k // 4) * 512
        + (m % 32) * 16
        + ((m % 128) // 32) * 4
        + (k % 4)
    )


def _sf_grid(t: int, K: int, device: torch.device) -> Tensor:
    m = torch.arange(t, device=device).unsqueeze(1)
    k = torch.arange(K, device=device).unsqueeze(0)
    return swizzled_sf_index(m, k, K).reshape(-1)


def _as_bytes(x: Tensor) -> Tensor:
    # Index-put of float8 is not implemented everywhere; move 1-byte types as uint8.
    return x.view(torch.uint8) if x.element_size() == 1 and x.dtype != torch.uint8 else x


def swizzle_scale_factors(sf: Tensor) -> Tensor:
    """Linear [t, K] scale factors -> flat swizzled 128x4 layout.

    sf: [t, K] tensor of any dtype (float8_e4m3fn normally), any device.
    Returns a 1-D tensor of sf's dtype, roundup(t,128)*roundup(K,4) entries, padding 0.
    """
    t, K = sf.shape
    src = _as_bytes(sf.contiguous())
    out = torch.zeros(((t + 127) // 128 * 128) * ((K + 3) // 4 * 4), dtype=src.dtype, device=sf.device)
    out[_sf_grid(t, K, sf.device)] = src.reshape(-1)
    return out.view(sf.dtype)


def unswizzle_scale_factors(flat: Tensor, t: int, K: int) -> Tensor:
    """Flat swizzled scale factors -> linear [t, K] (padding dropped).

    flat: 1-D tensor (any dtype/device) of at least roundup(t,128)*roundup(K,4) entries.
    Returns [t, K] of flat's dtype.
    """
    src = _as_bytes(flat.reshape(-1))
    return src[_sf_grid(t, K, flat.device)].reshape(t, K).view(flat.dtype)


# --------------------------------------------------------------------------- NVFP4


def quantize_nvfp4(x: Tensor, scale: Scale, sf_layout: str = "swizzled") -> Tuple[Tensor, Tensor]:
    """NVFP4 quantization of x with the global DEQUANT scale ``scale``.

    x: [..., h] fp16/bf16/fp32 tensor (flattened to [t, h]), h % 16 == 0, any device.
    scale: global dequant scale (amax / (448*6)), fp32 tensor of 1 element or python float.
    sf_layout: "swizzled" (flat 128x4 tiles) or "linear" ([t, h/16]).
    Returns (packed uint8 [t, h/2], scale factors float8_e4m3fn in sf_layout).
    """
    _check_sf_layout(sf_layout)
    h = x.shape[-1]
    if h % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs h % {NVFP4_BLOCK} == 0, got h={h}")
    xf = x.reshape(-1, h).float()
    t, K = xf.shape[0], h // NVFP4_BLOCK
    blocks = xf.reshape(t, K, NVFP4_BLOCK)
    S = torch.reciprocal(_scale_tensor(scale, x.device))
    vmax = blocks.abs().amax(dim=-1)  # amax propagates NaN
    # Divide by a tensor: on CUDA, torch turns division by a Python number into a multiply by its
    # reciprocal, which is not the contract's division and moves scale factors at e4m3 ties.
    sf = _to_e4m3((S * vmax) / torch.full((), E2M1_MAX, device=x.device))
    sff = sf.float()
    enc = torch.where(sff == 0, torch.zeros_like(sff), S / sff)
    codes = e2m1_encode(blocks * enc.unsqueeze(-1))
    # NaN enc already yields code 0; be explicit so the contract does not hinge on that.
    codes = codes.masked_fill(torch.isnan(sff).unsqueeze(-1), 0).reshape(t, h)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    if sf_layout == "swizzled":
        sf = swizzle_scale_factors(sf)
    return packed, sf


def dequantize_nvfp4(
    packed: Tensor, scale_factors: Tensor, scale: Scale, sf_layout: str = "swizzled"
) -> Tensor:
    """Inverse of :func:`quantize_nvfp4`: code value * float(sf) * scale, in fp32.

    packed: uint8 [t, h/2]. scale_factors: float8_e4m3fn, flat swizzled or [t, h/16]
    per sf_layout. scale: global dequant scale (fp32 1-element tensor or float).
    All on one device. Returns fp32 [t, h]; a NaN scale factor makes its block NaN.
    """
    _check_sf_layout(sf_layout)
    t, h = packed.shape[0], packed.shape[1] * 2
    K = h // NVFP4_BLOCK
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(t, h)
    sf = (
        unswizzle_scale_factors(scale_factors, t, K)
        if sf_layout == "swizzled"
        else scale_factors.reshape(t, K)
    )
    vals = e2m1_decode(codes).reshape(t, K, NVFP4_BLOCK) * sf.float().unsqueeze(-1)
    return (vals * _scale_tensor(scale, packed.device)).reshape(t, h)


# --------------------------------------------------------------------------- scale helpers


def nvfp4_scale_from_amax(amax: Scale) -> Scale:
    """NVFP4 global dequant scale amax / (448 * 6). Tensor in -> tensor out, float -> float."""
    return amax / (FP8_MAX * E2M1_MAX)


def fp8_scale_from_amax(amax: Scale) -> Scale:
    """FP8 dequant scale amax / 448. Tensor in -> tensor out, float -> float."""
    return amax / FP8_MAX


def scale_from_inverse(inv_scale: Scale) -> Scale:
    """Dequant scale from a peer's inverse (quant) scale, e.g. FlashInfer's NVFP4
    global scale 448*6/amax: returns 1 / inv_scale (tensor -> tensor, float -> float)."""
    return 1.0 / inv_scale


# --------------------------------------------------------------------------- whole tail


class Tail(NamedTuple):
    """Outputs of :func:`fused_tail`; absent ones are None."""

    residual: Tensor
    norm: Optional[Tensor]
    quant: Optional[Tensor]
    scale_factors: Optional[Tensor]


def fused_tail(
    a: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    quant: Optional[str] = None,
    scale: Optional[Scale] = None,
    return_norm: bool = False,
    sf_layout: str = "swizzled",
) -> Tail:
    """The tail after the all-reduce: residual add, RMSNorm, optional quantization.

    a: [..., h] all-reduced activations, dtype T. residual: same shape/dtype/device.
    weight: [h] RMSNorm weight. eps: python float. quant: None, "fp8" or "nvfp4".
    scale: dequant scale (fp32 1-element tensor or float), needed when quant is set.
    sf_layout: NVFP4 scale-factor layout, "swizzled" or "linear".
    Returns Tail(residual [t,h] T, norm [t,h] T or None, quant, scale_factors):
    quant is float8_e4m3fn [t,h] (fp8) or uint8 [t,h/2] (nvfp4); norm is given when
    quant is None or return_norm; scale_factors only for nvfp4. The quantized value
    is that of the T-rounded norm.
    """
    if quant not in _QUANTS:
        raise ValueError(f"quant must be one of {_QUANTS}, got {quant!r}")
    _check_sf_layout(sf_layout)
    if quant is not None and scale is None:
        raise ValueError(f"quant={quant!r} needs a scale")
    h = a.shape[-1]
    res = residual_add(a.reshape(-1, h), residual.reshape(-1, h))
    norm = rmsnorm(res, weight, eps)
    if quant is None:
        return Tail(res, norm, None, None)
    keep = norm if return_norm else None
    if quant == "fp8":
        return Tail(res, keep, quantize_fp8(norm, scale), None)
    q, sf = quantize_nvfp4(norm, scale, sf_layout)
    return Tail(res, keep, q, sf)
