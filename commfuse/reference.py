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
* FP8 with computed scales: ``quant="fp8_per_token"`` (one float32 dequant scale
  per row) and ``quant="fp8_block"`` (one per 128 consecutive elements of a row),
  ``s = max(amax / 448, 2^-126)`` over the T-rounded norm, codes ``e4m3(norm / s)``;
  optionally rounded up to a power of two and stored as UE8M0 exponent bytes.
  Scale layouts: ``"row"`` and the MN-major ``"mn_major"`` (DeepGEMM / CUTLASS on
  Hopper: float32; packed UE8M0 int32 for Blackwell), see :func:`mn_major_index`
  and :func:`packed_ue8m0_byte_index`; docs/semantics.md sections 10 and 11.
* MXFP8 (``quant="mxfp8"``, the OCP MX format Blackwell's block-scaled GEMMs take): e4m3 codes
  with one computed scale per 32 consecutive elements of a row, a power of two stored as its UE8M0
  exponent byte: the fp8_block UE8M0 scale of the block (the amax scale rounded up, so no element
  saturates), in the scale-factor layouts of NVFP4 (``"swizzled"`` 128x4 tiles or ``"linear"``
  ``[t, h/32]``); see :func:`quantize_mxfp8`.
* Shapes ``[..., h]`` are accepted and flattened to ``[t, h]`` where noted.
"""
from __future__ import annotations

import math
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
    "nvfp4_block_codes",
    "dequantize_nvfp4",
    "swizzled_sf_index",
    "swizzle_scale_factors",
    "unswizzle_scale_factors",
    "nvfp4_scale_from_amax",
    "fp8_scale_from_amax",
    "scale_from_inverse",
    "quantize_fp8_per_token",
    "dequantize_fp8_per_token",
    "quantize_fp8_block",
    "fp8_group_codes",
    "dequantize_fp8_block",
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "ue8m0_from_scale",
    "ue8m0_to_scale",
    "mn_major_index",
    "packed_ue8m0_byte_index",
    "mn_major_storage",
    "scales_to_mn_major",
    "scales_from_mn_major",
    "pack_ue8m0_mn_major",
    "unpack_ue8m0_mn_major",
    "block_scales_as_float",
    "Tail",
    "quantize",
    "gated_rmsnorm",
    "fused_tail",
    "FP8_MAX",
    "E2M1_MAX",
    "NVFP4_BLOCK",
    "FP8_BLOCK",
    "MXFP8_BLOCK",
    "FP8_MIN_SCALE",
]

Scale = Union[Tensor, float]

FP8_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
_FP8_NAN = 0x7F
_SF_LAYOUTS = ("swizzled", "linear")
_QUANTS = (None, "fp8", "nvfp4", "fp8_per_token", "fp8_block", "mxfp8")
FP8_BLOCK = 128
MXFP8_BLOCK = 32
# The smallest positive normal fp32, 2^-126: the lower bound of computed FP8 scales (zero rows).
FP8_MIN_SCALE = torch.finfo(torch.float32).tiny
_SCALE_LAYOUTS = ("row", "mn_major")
_UE8M0_NAN = 0xFF

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
    return torch.full((), _f32(scale), dtype=torch.float32, device=device)  # torch.full refuses doubles past FLT_MAX


def _to_e4m3(v: Tensor) -> Tensor:
    """fp32 -> float8_e4m3fn, RNE, saturating, NaN -> canonical 0x7F."""
    # torch's own cast may map out-of-range to NaN; clamp keeps NaN, so saturate first.
    q = v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(torch.isnan(v), torch.full_like(q, _FP8_NAN), q)
    return q.view(torch.float8_e4m3fn)


# --------------------------------------------------------------------------- tail ops


def _like(name: str, t: Tensor, other: str, like: Tensor) -> None:
    """ValueError unless t has like's shape, dtype and device: torch would broadcast a [1, h] or [h] tensor, or
    promote a dtype, and give an answer to a call that the library refuses."""
    for what, a, b in (("shape", tuple(t.shape), tuple(like.shape)), ("dtype", t.dtype, like.dtype),
                       ("device", t.device, like.device)):
        if a != b:
            raise ValueError(f"{name} must have {other}'s {what} {b}, got {a}")


def _weight(weight: Tensor, x: Tensor) -> None:
    """ValueError unless weight is [h], h = x.shape[-1], on x's device (any float dtype)."""
    if tuple(weight.shape) != (x.shape[-1],) or weight.device != x.device:
        raise ValueError(f"weight must be [{x.shape[-1]}] (the hidden size) on {x.device}, got "
                         f"{list(weight.shape)} on {weight.device}")


def all_reduce_sum(xs: Sequence[Tensor]) -> Tensor:
    """Sum of the ranks' partial tensors, as the one-shot all-reduce computes it.

    xs: non-empty sequence of tensors of one shape and dtype T (fp16/bf16/fp32),
        on one device, in rank order.
    Returns a T tensor of that shape: the fp32 sum accumulated in list order,
    rounded to T once.
    """
    if len(xs) == 0:
        raise ValueError("all_reduce_sum needs at least one tensor")
    for i, x in enumerate(xs[1:], 1):
        _like(f"xs[{i}]", x, "xs[0]", xs[0])
    # Explicit rank-order accumulation: a stacked .sum() may reorder (pairwise/vectorised).
    acc = xs[0].to(torch.float32, copy=True)
    for x in xs[1:]:
        acc += x.to(torch.float32)
    return acc.to(xs[0].dtype)


def _combine(t: int, k: int, h: int, slot, weights: Tensor, shared: Optional[Tensor], dtype, device,
             kept: Optional[Tensor] = None) -> Tensor:
    # acc = float(shared) or 0; per slot j in order: acc = RN(acc + RN(float(w_j) * float(y_j))), where kept.
    acc = torch.zeros(t, h, dtype=torch.float32, device=device) if shared is None else shared.to(torch.float32,
                                                                                              copy=True)
    w = weights.to(torch.float32)
    for j in range(k):
        term = acc + w[:, j:j + 1] * slot(j).to(torch.float32)
        acc = term if kept is None else torch.where(kept[:, j:j + 1], term, acc)
    return acc.to(dtype)


def moe_reduce(y: Tensor, weights: Tensor, shared: Optional[Tensor] = None) -> Tensor:
    """The MoE combine of one rank, before the all-reduce: x = round_T(shared + sum_j w[:, j] * y[:, j, :]).

    y: T[t, k, h] (T = fp16 / bf16 / fp32), the top-k expert outputs of each token; weights: [t, k]
    routing weights, float32 or T; shared: T[t, h] or None, a shared expert's output (DeepSeek, Qwen2-MoE);
    all on y's device (any device). In fp32: acc = float(shared) (0 without), then for j = 0 .. k-1 in order
    acc = RN(acc + RN(float(w_j) * float(y_j))), rounded to T once. Returns T[t, h] on y's device
    (docs/semantics.md section 14)."""
    if y.dim() != 3 or weights.shape != y.shape[:2]:
        raise ValueError(f"y must be [t, k, h] and weights [t, k], got {tuple(y.shape)} and {tuple(weights.shape)}")
    t, k, h = y.shape
    if shared is not None and tuple(shared.shape) != (t, h):
        raise ValueError(f"shared must be [t, h] = {[t, h]}, got {tuple(shared.shape)}")
    return _combine(t, k, h, lambda j: y[:, j], weights, shared, y.dtype, y.device)


class RowIndexError(ValueError):
    """moe_finalize's row_index holds a row outside [-1, R): its ValueError, told apart from the others by the
    MoE launcher, which reports it to the peers as a call of its own (commfuse.moe.Launcher)."""


def moe_finalize(rows: Tensor, row_index: Tensor, weights: Tensor, shared: Optional[Tensor] = None) -> Tensor:
    """The combine of permuted expert rows, as the grouped-GEMM MoE kernels leave them (the layout
    TensorRT-LLM's and FlashInfer's finalize take): moe_reduce of y[i, j] = rows[row_index[i, j]].

    rows: T[R, h], the expert outputs in expert order (padding rows allowed); row_index: int32 / int64
    [t, k], the row of token i's j-th expert (its `expanded_idx_to_permuted_idx`), -1 for a slot dropped by
    capacity: that slot adds nothing (its step is left out, not added as zero); weights: [t, k] as in
    moe_reduce; shared: T[t, h] or None; all on rows' device (any device; on a GPU, the check of row_index's
    range synchronises once). Returns T[t, h] on rows' device (docs/semantics.md section 14)."""
    if rows.dim() != 2 or row_index.dim() != 2 or row_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be [R, h] and row_index an int32/int64 [t, k], got {tuple(rows.shape)} and "
                         f"{tuple(row_index.shape)} {row_index.dtype}")
    t, k = row_index.shape
    if weights.shape != row_index.shape:
        raise ValueError(f"weights must be [t, k] = {[t, k]}, got {tuple(weights.shape)}")
    if shared is not None and tuple(shared.shape) != (t, rows.shape[1]):
        raise ValueError(f"shared must be [t, h] = {[t, rows.shape[1]]}, got {tuple(shared.shape)}")
    idx = row_index.long()
    if idx.numel() and ((idx < -1) | (idx >= rows.shape[0])).any():  # on a GPU the one synchronisation
        raise RowIndexError(f"row_index must hold rows in [-1, {rows.shape[0]}), got {int(idx.min())} .. "
                            f"{int(idx.max())}")
    # A dropped slot reads row 0 and is then left out (kept); with no rows at all, a row of zeros stands in.
    src = rows if rows.shape[0] else rows.new_zeros(1, rows.shape[1])
    return _combine(t, k, rows.shape[1], lambda j: src[idx[:, j].clamp_min(0)], weights, shared, rows.dtype,
                    rows.device, kept=idx >= 0)


def _row_blocks(x: Tensor, block: int, what: str) -> Tensor:
    """x [..., h] as float32 [t, h / block, block]: each row's blocks of `block` consecutive elements (the
    block-scaled formats' groups); ValueError unless block divides h."""
    h = x.shape[-1]
    if block < 1 or h % block:
        raise ValueError(f"{what} needs h % {block} == 0 (one scale per {block} consecutive elements of a row), "
                         f"got h={h}")
    xf = x.reshape(-1, h).float()
    return xf.reshape(xf.shape[0], h // block, block)


def residual_add(a: Tensor, residual: Tensor) -> Tensor:
    """round_T(float(a) + float(residual)).

    a, residual: tensors of one shape and dtype T, on one device.
    Returns a T tensor of that shape.
    """
    _like("residual", residual, "a", a)
    return (a.float() + residual.float()).to(a.dtype)


def _mean_of_squares(v: torch.Tensor) -> torch.Tensor:
    """RN(sum(v^2) / n) over the last dim (n its size), keepdim: the sum, then a true fp32 division. torch's mean
    multiplies the sum by RN(1/n) on CUDA, and so does a division by a Python number there: divide by a tensor."""
    return (v * v).sum(dim=-1, keepdim=True) / torch.full((), float(v.shape[-1]), device=v.device)


def rmsnorm(x: Tensor, weight: Tensor, eps: float = 1e-6, weight_offset: float = 0.0) -> Tensor:
    """RMSNorm over the last dim, computed in fp32, rounded to x's dtype once.

    x: [..., h] tensor of dtype T (any device). weight: [h] tensor (any float dtype,
    usually T), on x's device. eps: python float. weight_offset: python float (0 by
    default; Gemma's RMSNorm uses 1), rounded to fp32.
    Returns [..., h] of dtype T:
    round_T(RN(RN(float(x) * inv) * w)) with inv = rsqrt(mean(float(x)^2) + eps) and
    w = float(weight) when weight_offset == 0 (no addition: a -0.0 weight keeps its
    sign), else w = RN(weight_offset + float(weight)), one fp32 addition.
    """
    _weight(weight, x)
    xf = x.float().contiguous()  # the mean's order of summation is a dense row's, whatever x's strides
    inv = torch.rsqrt(_mean_of_squares(xf) + eps)
    wf = weight.float()
    if _f32(weight_offset) != 0.0:
        wf = wf + torch.full((), _f32(weight_offset), dtype=torch.float32, device=wf.device)
    return (xf * inv * wf).to(x.dtype)


def _f32(v: float) -> float:
    """A python float rounded to fp32 (on the host: no device work)."""
    return torch.tensor(float(v), dtype=torch.float32).item()


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

    m, k: integers or integer tensors (broadcastable, any device). K: blocks per row (h/16).
    Returns int64 tensor of the broadcast shape.
    """
    m, k = torch.as_tensor(m).long(), torch.as_tensor(k).long()
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
    blocks = _row_blocks(x, NVFP4_BLOCK, "NVFP4")
    t, K = blocks.shape[:2]
    h = x.shape[-1]
    S = torch.reciprocal(_scale_tensor(scale, x.device))
    vmax = blocks.abs().amax(dim=-1)  # amax propagates NaN
    # Divide by a tensor: on CUDA, torch turns division by a Python number into a multiply by its
    # reciprocal, which is not the contract's division and moves scale factors at e4m3 ties.
    # A block of zeros gets 0 whatever S (Inf * 0 would be NaN where 1/scale overflows).
    scaled = torch.where(vmax == 0, torch.zeros_like(vmax), S * vmax)
    sf = _to_e4m3(scaled / torch.full((), E2M1_MAX, device=x.device))
    codes = nvfp4_block_codes(blocks, sf, S).reshape(t, h)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    if sf_layout == "swizzled":
        sf = swizzle_scale_factors(sf)
    return packed, sf


def nvfp4_block_codes(blocks: Tensor, sf: Tensor, S: Tensor) -> Tensor:
    """The e2m1 codes of fp32 blocks [..., 16] under their scale factors sf [...] (float8_e4m3fn) and
    S = RN(1 / scale): e2m1(RN(n * enc)), enc = 0 where sf is 0, else RN(S / float(sf)); a block whose
    scale factor is NaN gets codes 0. S: float32 tensor of one element (shape [] or [1]). blocks, sf, S on
    one device (any). Returns uint8 [..., 16] on blocks' device, one code an element (not packed)."""
    sff = sf.float()
    enc = torch.where(sff == 0, torch.zeros_like(sff), S / sff)
    codes = e2m1_encode(blocks * enc.unsqueeze(-1))
    # NaN enc already yields code 0; be explicit so the contract does not hinge on that.
    return codes.masked_fill(torch.isnan(sff).unsqueeze(-1), 0)


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


# --------------------------------------------------------------------------- FP8, computed scales


def _check_scale_layout(scale_layout: str) -> None:
    if scale_layout not in _SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {_SCALE_LAYOUTS}, got {scale_layout!r}")


def _tp(t: int) -> int:
    """The token count padded to 16 bytes of 4-byte elements (DeepGEMM's get_tma_aligned_size(t, 4))."""
    return (t + 3) // 4 * 4


def ue8m0_from_scale(s: Tensor) -> Tensor:
    """UE8M0 exponent bytes of 2^ceil(log2 s), computed on the fp32 bits (exact).

    s: float32 tensor, any shape/device; meant for what the quantizers produce (normal
    fp32 >= 2^-126, +Inf, NaN); other values are first taken as max(|s|, 2^-126).
    Returns uint8 of s's shape: E = e + (mantissa != 0) for the biased exponent e of s;
    0xFF (the UE8M0 NaN) for NaN, +Inf and scales above 2^127.
    """
    s = torch.maximum(s.float().abs(), torch.full((), FP8_MIN_SCALE, device=s.device))  # keeps NaN
    bits = s.contiguous().view(torch.int32)
    e = (bits >> 23) & 0xFF
    E = e + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    E = torch.where(torch.isnan(s), torch.full_like(E, _UE8M0_NAN), E.clamp_max(_UE8M0_NAN))
    return E.to(torch.uint8)


def ue8m0_to_scale(E: Tensor) -> Tensor:
    """Value of UE8M0 exponent bytes: 2^(E - 127) as float32, 0xFF -> NaN (OCP MX E8M0).

    E: uint8 tensor, any shape/device. Returns float32 of E's shape (0x00 -> 2^-127,
    an fp32 subnormal, exact)."""
    Ei = E.to(torch.int32)
    bits = torch.where(Ei == 0, torch.full_like(Ei, 0x00400000), Ei << 23)
    v = bits.view(torch.float32)
    return torch.where(Ei == _UE8M0_NAN, torch.full_like(v, float("nan")), v)


def _fp8_groups(g: Tensor, ue8m0: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Quantize fp32 groups g [t, G, n] with one computed scale per group.

    Returns (codes float8_e4m3fn [t, G, n], s float32 [t, G], UE8M0 bytes [t, G] or None)."""
    amax = g.abs().amax(dim=-1)  # amax propagates NaN
    # Divide by a tensor: on CUDA, torch turns a division by a Python number into a multiply.
    s = torch.maximum(amax / torch.full((), FP8_MAX, device=g.device),
                      torch.full((), FP8_MIN_SCALE, device=g.device))  # maximum keeps NaN
    s = torch.where(torch.isnan(s), torch.full((), float("nan"), device=g.device), s)  # canonical 0x7FC00000
    E = None
    sq = s
    if ue8m0:
        E = ue8m0_from_scale(s)
        sq = (E.to(torch.int32) << 23).view(torch.float32)  # 2^(E-127); +Inf for 0xFF
        sq = torch.where(torch.isnan(s), s, sq)
    return fp8_group_codes(g, sq), s, E


def fp8_group_codes(g: Tensor, s: Tensor) -> Tensor:
    """The e4m3 codes of fp32 groups g [..., n] under their dequant scales s [...] (float32): e4m3(RN(g / s)),
    a true division, except that +-Inf in a group of scale +Inf gives +-448 (as static FP8 saturates, not
    Inf / Inf = NaN). The codes of the computed-scale kinds and of MXFP8, whose s is the power of two
    2^(E - 127). g, s on one device (any). Returns float8_e4m3fn of g's shape, on g's device."""
    q = g / s.unsqueeze(-1)  # a true division
    q = torch.where(torch.isinf(g) & torch.isinf(s).unsqueeze(-1), g, q)
    return _to_e4m3(q)


def quantize_fp8_per_token(x: Tensor) -> Tuple[Tensor, Tensor]:
    """FP8 with one computed dequant scale per row (token).

    x: [..., h] fp16/bf16/fp32 tensor (flattened to [t, h]), any device.
    Per row: amax = max |x| (NaN if the row holds a NaN), s = max(RN(amax / 448), 2^-126),
    codes = e4m3(RN(x / s)) (true division, RNE, saturating, NaN -> 0x7F), except that
    +-Inf in a row of scale +Inf gives +-448. A row of zeros gets s = 2^-126.
    Returns (codes float8_e4m3fn [t, h], scales float32 [t]) on x's device;
    value = code * scale (:func:`dequantize_fp8_per_token`).
    """
    h = x.shape[-1]
    xf = x.reshape(-1, h).float()
    codes, s, _ = _fp8_groups(xf.unsqueeze(1), ue8m0=False)
    return codes.reshape(-1, h), s.reshape(-1)


def dequantize_fp8_per_token(codes: Tensor, scales: Tensor) -> Tensor:
    """float(code) * scale of its row, in fp32.

    codes: float8_e4m3fn [t, h]; scales: float32 [t]; one device. Returns fp32 [t, h]."""
    return codes.float() * scales.float().reshape(-1, 1)


def mn_major_index(m: Tensor, k: Tensor, t: int) -> Tensor:
    """Element index of scale (row m, block k) in the float32 MN-major storage: k * roundup(t, 4) + m.

    m, k: integers or integer tensors (broadcastable, any device). t: rows. Returns int64 tensor."""
    return torch.as_tensor(k).long() * _tp(t) + torch.as_tensor(m).long()


def packed_ue8m0_byte_index(m: Tensor, k: Tensor, t: int) -> Tensor:
    """Byte index of the UE8M0 byte of (row m, block k) in the packed MN-major int32 storage:
    4 * ((k // 4) * roundup(t, 4) + m) + k % 4 (little-endian int32, block 4j in the low byte).

    m, k: integers or integer tensors (broadcastable, any device). t: rows. Returns int64 tensor."""
    m, k = torch.as_tensor(m).long(), torch.as_tensor(k).long()
    return 4 * ((k // 4) * _tp(t) + m) + k % 4


def mn_major_storage(x: Tensor, t: int, K: int, ue8m0: bool = False) -> Tensor:
    """The flat storage behind MN-major scales, padding included.

    x: the MN-major view (or any tensor whose storage from x.storage_offset() holds the
    layout), float32 ([t, K] view, K * roundup(t, 4) elements) or, with ue8m0, int32
    ([t, ceil(K/4)] view, ceil(K/4) * roundup(t, 4) elements). Returns a 1-D tensor of x's
    dtype sharing x's storage (raises if the storage is too small)."""
    n = ((K + 3) // 4 if ue8m0 else K) * _tp(t)
    return torch.as_strided(x, (n,), (1,), x.storage_offset())


def scales_to_mn_major(s: Tensor) -> Tensor:
    """Row-major scales [t, K] -> the MN-major layout (DeepGEMM's get_mn_major_tma_aligned_tensor).

    s: [t, K] tensor of a 4-byte dtype (float32 normally), any device.
    Returns a [t, K] view with strides (1, roundup(t, 4)) of a fresh storage of
    K * roundup(t, 4) elements; (m, k) at k * roundup(t, 4) + m; padding 0."""
    t, K = s.shape
    buf = torch.zeros(K, _tp(t), dtype=s.dtype, device=s.device)
    buf[:, :t] = s.t()
    return buf.t()[:t]


def scales_from_mn_major(x: Tensor, t: int, K: int) -> Tensor:
    """MN-major scales (a view from :func:`scales_to_mn_major` or its flat storage) -> row-major
    [t, K] contiguous, x's dtype and device (padding dropped)."""
    return mn_major_storage(x, t, K).view(K, _tp(t))[:, :t].t().contiguous()


def pack_ue8m0_mn_major(E: Tensor) -> Tensor:
    """UE8M0 bytes [t, K] -> the packed MN-major int32 layout of the Blackwell block-scaled
    kernels (DeepGEMM's get_mn_major_tma_aligned_packed_ue8m0_tensor).

    E: uint8 [t, K], any device. Returns an int32 [t, ceil(K/4)] view with strides
    (1, roundup(t, 4)) of a fresh storage of ceil(K/4) * roundup(t, 4) int32: the bytes of
    blocks 4j..4j+3 of row m in int32 j * roundup(t, 4) + m, block 4j in the low byte;
    padding bytes (blocks >= K, rows >= t) 0."""
    t, K = E.shape
    Kp, tp = (K + 3) // 4, _tp(t)
    padded = torch.zeros(t, Kp * 4, dtype=torch.uint8, device=E.device)
    padded[:, :K] = E
    buf = torch.zeros(Kp, tp, 4, dtype=torch.uint8, device=E.device)
    buf[:, :t] = padded.view(t, Kp, 4).transpose(0, 1)
    return buf.view(-1).view(torch.int32).view(Kp, tp).t()[:t]


def unpack_ue8m0_mn_major(x: Tensor, t: int, K: int) -> Tensor:
    """Packed MN-major UE8M0 scales (the int32 view or its flat storage) -> uint8 [t, K]
    row-major, on x's device (padding dropped)."""
    Kp, tp = (K + 3) // 4, _tp(t)
    b = mn_major_storage(x, t, K, ue8m0=True).view(torch.uint8).view(Kp, tp, 4)
    return b[:, :t].transpose(0, 1).reshape(t, Kp * 4)[:, :K].contiguous()


def quantize_fp8_block(x: Tensor, block: int = FP8_BLOCK, scale_layout: str = "row",
                       scale_ue8m0: bool = False) -> Tuple[Tensor, Tensor]:
    """FP8 with one computed dequant scale per block of `block` consecutive elements of a row.

    x: [..., h] fp16/bf16/fp32 tensor (flattened to [t, h]), h % block == 0, any device.
    Per block: as :func:`quantize_fp8_per_token` per row. With scale_ue8m0 the scale is
    rounded up to a power of two (exactly, on the bits: :func:`ue8m0_from_scale`), the codes
    are those of the rounded scale, and the scales are stored as UE8M0 exponent bytes.
    scale_layout: "row" or "mn_major" (docs/semantics.md section 11). Returns
    (codes float8_e4m3fn [t, h], scales), scales being, K = h / block, tp = roundup(t, 4):
      row,      float32: float32 [t, K] contiguous;
      mn_major, float32: float32 [t, K] view, strides (1, tp), of K * tp elements (padding 0);
      row,      ue8m0:   uint8 [t, K] exponent bytes;
      mn_major, ue8m0:   int32 [t, ceil(K/4)] view, strides (1, tp), 4 bytes per int32.
    """
    _check_scale_layout(scale_layout)
    blocks = _row_blocks(x, block, "FP8 block quantization")
    codes, s, E = _fp8_groups(blocks, ue8m0=scale_ue8m0)
    codes = codes.reshape(blocks.shape[0], x.shape[-1])
    if scale_ue8m0:
        return codes, (pack_ue8m0_mn_major(E) if scale_layout == "mn_major" else E)
    return codes, (scales_to_mn_major(s) if scale_layout == "mn_major" else s)


def block_scales_as_float(scales: Tensor, t: int, K: int, scale_layout: str = "row",
                          scale_ue8m0: bool = False) -> Tensor:
    """Block scales in any layout of :func:`quantize_fp8_block` -> float32 [t, K] row-major
    values (UE8M0 bytes as 2^(E-127), 0xFF as NaN), on scales' device."""
    _check_scale_layout(scale_layout)
    if scale_ue8m0:
        E = unpack_ue8m0_mn_major(scales, t, K) if scale_layout == "mn_major" else scales.reshape(t, K)
        return ue8m0_to_scale(E)
    if scale_layout == "mn_major":
        return scales_from_mn_major(scales, t, K).float()
    return scales.reshape(t, K).float()


def dequantize_fp8_block(codes: Tensor, scales: Tensor, block: int = FP8_BLOCK, scale_layout: str = "row",
                         scale_ue8m0: bool = False) -> Tensor:
    """Inverse of :func:`quantize_fp8_block`: float(code) * scale of its block, in fp32.

    codes: float8_e4m3fn [t, h]; scales: as returned by quantize_fp8_block with the same
    block, scale_layout and scale_ue8m0; one device. Returns fp32 [t, h]."""
    t, h = codes.shape
    K = h // block
    s = block_scales_as_float(scales, t, K, scale_layout, scale_ue8m0)
    return (codes.float().reshape(t, K, block) * s.unsqueeze(-1)).reshape(t, h)


# --------------------------------------------------------------------------- gated RMSNorm


def gated_rmsnorm(x: Tensor, z: Optional[Tensor], weight: Tensor, eps: float, group_size: int,
                    norm_before_gate: bool) -> Tensor:
    """The gated RMSNorm of Mamba2 / Nemotron-H, in fp32, rounded to x's dtype once.

    x: [..., h] T (fp16/bf16/fp32); z: x's shape and dtype, or None (no gate); weight: [h] (any float
    dtype, usually T; read as float(weight)); x, z, weight on one device (any); group_size divides h.
    Each row is normalised per group of group_size consecutive elements; silu(z) is computed in fp32
    and gates x before the norm (norm_before_gate False: y = norm(x * silu(z)) * w) or the weighted
    norm after it (True: y = norm(x) * w * silu(z)):

        xf = float(x); g = silu(float(z))
        v = RN(xf * g) if gated before the norm else xf                 # per group of group_size:
        inv = rsqrt(RN(mean(v^2) + eps)); y = RN(RN(v * inv) * float(w))
        y = RN(y * g) if gated after the norm
        return round_T(y)

    silu is torch.nn.functional.silu in fp32 on the tensor's device (not pinned bit for bit across
    devices: it goes through exp). Returns [t, h] of x's dtype, on x's device.
    """
    h = x.shape[-1]
    _weight(weight, x)
    if z is not None:
        _like("z", z, "x", x)
    xf = x.reshape(-1, h).contiguous().float()  # the sums in row order, whatever x's strides (as rmsnorm's)
    g = None if z is None else torch.nn.functional.silu(z.reshape(-1, h).float())
    if g is not None and not norm_before_gate:
        xf = xf * g
    t = xf.shape[0]
    v = xf.reshape(t, h // group_size, group_size)
    inv = torch.rsqrt(_mean_of_squares(v) + eps)
    y = (v * inv).reshape(t, h) * weight.float()
    if g is not None and norm_before_gate:
        y = y * g
    return y.to(x.dtype)


# --------------------------------------------------------------------------- MXFP8


def quantize_mxfp8(x: Tensor, sf_layout: str = "swizzled") -> Tuple[Tensor, Tensor]:
    """MXFP8: e4m3 codes with one power-of-two scale per block of 32 consecutive elements of a row.

    x: [..., h] fp16/bf16/fp32 tensor (flattened to [t, h]), h % 32 == 0, any device.
    Per block, the scale rule of the GEMM libraries' MXFP8 quantizers (TransformerEngine, FlashInfer /
    TensorRT-LLM: amax / 448 rounded up to a power of two, so no element saturates; OCP's rule takes
    2^(floor(log2 amax) - 8) instead, which clamps blocks whose amax lies above 1.75 * 2^e): exactly
    :func:`quantize_fp8_block`'s UE8M0 scale with blocks of 32: s = max(RN(amax / 448), 2^-126), its
    UE8M0 byte E = e + (mantissa != 0) (0xFF for NaN, +Inf and above 2^127), codes =
    e4m3(RN(x / 2^(E-127))), +-Inf in a block of scale +Inf giving +-448 and a NaN block NaN codes.
    A block of zeros gets E = 1 (2^-126), where those quantizers write 0: the codes and the
    dequantized values are the same.
    sf_layout: "swizzled" (the 128x4 tiles of NVFP4's scale factors, K = h / 32 blocks a row,
    roundup(t, 128) * roundup(K, 4) bytes, padding 0) or "linear" ([t, K]).
    Returns (codes float8_e4m3fn [t, h], exponent bytes uint8 in sf_layout) on x's device;
    value = code * 2^(E - 127) (:func:`dequantize_mxfp8`).
    """
    _check_sf_layout(sf_layout)
    blocks = _row_blocks(x, MXFP8_BLOCK, "MXFP8")
    codes, _, E = _fp8_groups(blocks, ue8m0=True)
    return codes.reshape(blocks.shape[0], x.shape[-1]), swizzle_scale_factors(E) if sf_layout == "swizzled" else E


def dequantize_mxfp8(codes: Tensor, scale_factors: Tensor, sf_layout: str = "swizzled") -> Tensor:
    """Inverse of :func:`quantize_mxfp8`: float(code) * 2^(E - 127) of its block (0xFF: NaN), in fp32.

    codes: float8_e4m3fn [t, h]; scale_factors: uint8 in sf_layout; one device. Returns fp32 [t, h]."""
    _check_sf_layout(sf_layout)
    t, h = codes.shape
    K = h // MXFP8_BLOCK
    E = unswizzle_scale_factors(scale_factors, t, K) if sf_layout == "swizzled" else scale_factors.reshape(t, K)
    return (codes.float().reshape(t, K, MXFP8_BLOCK) * ue8m0_to_scale(E).unsqueeze(-1)).reshape(t, h)


# --------------------------------------------------------------------------- scale helpers


def _positive(name: str, v: Scale) -> None:
    """ValueError for a python number that is not positive and finite: its scale would be one the calls refuse (0,
    negative, Inf, NaN). A tensor's values are not read (that would synchronise with its device)."""
    if not isinstance(v, Tensor) and not (0.0 < float(v) < math.inf):
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")


def _divided(amax: Scale, d: float) -> Scale:
    """amax / d, a true division on any device: on CUDA, torch turns a tensor's division by a Python number into a
    multiply by its reciprocal (one fp32 ulp off for about half of all amax): divide by a tensor."""
    _positive("amax", amax)
    if isinstance(amax, Tensor):
        return amax / torch.full((), d, dtype=amax.dtype, device=amax.device)
    return amax / d


def nvfp4_scale_from_amax(amax: Scale) -> Scale:
    """NVFP4 global dequant scale amax / (448 * 6), a true division. Tensor in -> tensor out, float -> float.

    amax: a float tensor (float32 for the ops' scale: one element, shape [] or [1]; any shape works
    elementwise), any device; or a python float, positive and finite (else ValueError). Returns amax's shape,
    dtype and device."""
    return _divided(amax, FP8_MAX * E2M1_MAX)


def fp8_scale_from_amax(amax: Scale) -> Scale:
    """FP8 dequant scale amax / 448, a true division. Tensor in -> tensor out, float -> float.

    amax: as in :func:`nvfp4_scale_from_amax`. Returns amax's shape, dtype and device."""
    return _divided(amax, FP8_MAX)


def scale_from_inverse(inv_scale: Scale) -> Scale:
    """Dequant scale from a peer's inverse (quant) scale, e.g. FlashInfer's NVFP4
    global scale 448*6/amax: returns 1 / inv_scale (tensor -> tensor, float -> float).

    inv_scale: a float tensor (float32 for the ops' scale: one element, shape [] or [1]; any shape works
    elementwise), any device; or a python float, positive and finite (else ValueError). Returns inv_scale's shape,
    dtype and device."""
    _positive("inv_scale", inv_scale)
    return 1.0 / inv_scale


# --------------------------------------------------------------------------- whole tail


class Tail(NamedTuple):
    """Outputs of :func:`fused_tail`; absent ones are None.

    scales (5th, default None, so 4-field construction still works): the dequant scales
    the tail computed, for quant "fp8_per_token" (float32 [t]) and "fp8_block" (in
    scale_layout / scale_ue8m0, see :func:`quantize_fp8_block`); None otherwise.
    scale_factors: the block scales of "nvfp4" and "mxfp8" only."""

    residual: Tensor
    norm: Optional[Tensor]
    quant: Optional[Tensor]
    scale_factors: Optional[Tensor]
    scales: Optional[Tensor] = None


def quantize(
    x: Tensor,
    quant: str,
    scale: Optional[Scale] = None,
    sf_layout: str = "swizzled",
    scale_layout: str = "row",
    scale_ue8m0: bool = False,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """The quantization `quant` of x [..., h] (flattened to [t, h]), by the format's function above.

    x: fp16/bf16/fp32, any device. scale: the dequant scale of "fp8" and "nvfp4", a float32 tensor of
    one element (any shape, any device: moved to x's) or a python float (rounded to fp32); None for the
    kinds that compute their scales. sf_layout: the scale-factor layout of nvfp4 and mxfp8;
    scale_layout, scale_ue8m0: fp8_block's (see :func:`quantize_fp8_block`). Returns (codes,
    scale_factors, scales) on x's device, None where the format has none: codes float8_e4m3fn [t, h]
    (uint8 [t, h/2] for nvfp4); scale_factors for nvfp4 (float8_e4m3fn) and mxfp8 (uint8), [t, K] linear
    or flat swizzled (:func:`quantize_nvfp4`, :func:`quantize_mxfp8`); scales for fp8_per_token
    (float32 [t]) and fp8_block (in its layout, :func:`quantize_fp8_block`).
    """
    if quant not in _QUANTS[1:]:
        raise ValueError(f"quant must be one of {_QUANTS[1:]}, got {quant!r}")
    _check_sf_layout(sf_layout)
    _check_scale_layout(scale_layout)
    if quant in ("fp8", "nvfp4") and scale is None:
        raise ValueError(f"quant={quant!r} needs a scale")
    if quant in ("fp8_per_token", "fp8_block", "mxfp8") and scale is not None:
        raise ValueError(f"quant={quant!r} computes its own scales: scale must be None")
    if quant not in ("nvfp4", "mxfp8") and sf_layout != "swizzled":
        # as the public calls: an option the format does not take is refused, not ignored
        raise ValueError(f"sf_layout={sf_layout!r} applies to quant 'nvfp4' / 'mxfp8' only, got quant={quant!r}")
    if quant != "fp8_block" and (scale_layout != "row" or scale_ue8m0):
        raise ValueError(f"scale_layout={scale_layout!r}, scale_ue8m0={scale_ue8m0!r}: other than "
                         f"'row', False only with quant='fp8_block', got quant={quant!r}")
    h = x.shape[-1]
    x = x.reshape(-1, h)
    if quant == "fp8":
        return quantize_fp8(x, scale), None, None
    if quant == "nvfp4":
        q, sf = quantize_nvfp4(x, scale, sf_layout)
        return q, sf, None
    if quant == "fp8_per_token":
        q, s = quantize_fp8_per_token(x)
        return q, None, s
    if quant == "mxfp8":
        q, sf = quantize_mxfp8(x, sf_layout)
        return q, sf, None
    q, s = quantize_fp8_block(x, FP8_BLOCK, scale_layout, scale_ue8m0)
    return q, None, s


def fused_tail(
    a: Tensor,
    residual: Optional[Tensor],
    weight: Tensor,
    eps: float = 1e-6,
    quant: Optional[str] = None,
    scale: Optional[Scale] = None,
    return_norm: bool = False,
    sf_layout: str = "swizzled",
    weight_offset: float = 0.0,
    scale_layout: str = "row",
    scale_ue8m0: bool = False,
    post_weight: Optional[Tensor] = None,
) -> Tail:
    """The tail after the all-reduce: residual add, RMSNorm, optional quantization.

    a: [..., h] all-reduced activations, dtype T. residual: same shape/dtype/device, or None: no
    residual add (the norm's input is a itself, and there is no residual output).
    weight: [h] RMSNorm weight, on a's device. eps: python float.
    quant: None, "fp8", "nvfp4", "fp8_per_token", "fp8_block" or "mxfp8" (:func:`quantize`).
    scale: dequant scale (fp32 1-element tensor or float), needed for "fp8" and "nvfp4";
    must be None for "fp8_per_token", "fp8_block" and "mxfp8", which compute their scales.
    sf_layout: the scale-factor layout of nvfp4 and mxfp8, "swizzled" or "linear".
    weight_offset: python float added to the weight in fp32 (Gemma: 1), see :func:`rmsnorm`.
    scale_layout ("row" or "mn_major") and scale_ue8m0: the layout of the computed scales,
    "fp8_block" only (see :func:`quantize_fp8_block`); "fp8_per_token" takes "row", False.
    Returns Tail(residual [t,h] T or None, norm [t,h] T or None, quant, scale_factors, scales):
    quant is float8_e4m3fn [t,h] (the e4m3 formats) or uint8 [t,h/2] (nvfp4); norm is given
    when quant is None or return_norm; scale_factors only for nvfp4 and mxfp8; scales only for
    fp8_per_token (float32 [t]) and fp8_block. The quantized value is that of the T-rounded norm.
    post_weight: [h] weight of a post-norm (Gemma 2 / 3's post_attention_layernorm; docs/semantics.md section
    2a), or None: a is first replaced by rmsnorm(a, post_weight, eps, weight_offset), then the tail as above.
    """
    if quant is not None and quant not in _QUANTS:
        raise ValueError(f"quant must be one of {_QUANTS}, got {quant!r}")
    if residual is not None:
        _like("residual", residual, "a", a)  # as given: a reshape would pass any of the same numel
    h = a.shape[-1]
    a = a.reshape(-1, h)
    if post_weight is not None:
        a = rmsnorm(a, post_weight, eps, weight_offset)
    res = None if residual is None else residual_add(a, residual.reshape(-1, h))
    norm = rmsnorm(a if res is None else res, weight, eps, weight_offset)
    if quant is None:
        if (sf_layout, scale_layout, scale_ue8m0) != ("swizzled", "row", False):
            raise ValueError(f"sf_layout={sf_layout!r}, scale_layout={scale_layout!r}, scale_ue8m0={scale_ue8m0!r}: "
                             "the quantization's options, without quant")
        return Tail(res, norm, None, None)
    q, sf, s = quantize(norm, quant, scale, sf_layout, scale_layout, scale_ue8m0)
    return Tail(res, norm if return_norm else None, q, sf, s)
