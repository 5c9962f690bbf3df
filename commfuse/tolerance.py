"""Tolerances (docs/semantics.md): why a result differs from commfuse.reference beyond them (None when it does not).

- residual / norm: within `ulps` units in the last place of T of the reference (NaN and Inf where it
  has them, and only there).
- FP8 / NVFP4 codes and scale factors: equal, except a neighbouring code (a value within rounding of a
  code boundary) in at most `max_frac` of them; the FP8 NaN code is 0x7F (never 0xFF). NVFP4 codes are
  compared only in blocks whose scale factors agree: a neighbouring scale factor changes the whole block.
- Computed FP8 scales (quant "fp8_per_token", "fp8_block"): float32 scales equal, or off by no more
  than a neighbouring amax gives: |got - want| <= ulp_T(448 want) / 448 + ulp_fp32(want) (the norm
  element at the amax may be one ulp of T off, and s = RN(amax / 448) rounds once more); NaN and Inf
  exactly where the reference has them. UE8M0 exponent bytes: equal, except a neighbouring exponent in
  at most `max_frac` of the blocks; 0xFF exactly where the reference has it. MN-major padding must
  be 0 and the strides the reference's. The codes are compared as static FP8 codes, in the rows /
  blocks whose scales are bit-identical to the reference's.

The tests (tests/compare.py) assert these, and commfuse-bench's correctness gate rejects with them.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import reference

__all__ = ["ulp", "within_ulp", "signed_rank", "codes_close", "scales_close", "tail_mismatch"]

FP8_NAN = 0x7F


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at the magnitude of x (an fp32 tensor), subnormals included."""
    info = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(info.smallest_normal)))) * info.eps


def _shape_dtype(actual, expected, what: str) -> Optional[str]:
    if actual is None or expected is None:
        return None if actual is expected else f"{what}: {'missing' if actual is None else 'unexpected'} output"
    if tuple(actual.shape) != tuple(expected.shape) or actual.dtype != expected.dtype:
        return f"{what}: got {actual.dtype}{list(actual.shape)}, expected {expected.dtype}{list(expected.shape)}"
    return None


def within_ulp(actual: Optional[torch.Tensor], expected: Optional[torch.Tensor], ulps: int,
               what: str) -> Optional[str]:
    """Why `actual` is not within `ulps` ulp of T of `expected` elementwise (both None is fine)."""
    why = _shape_dtype(actual, expected, what)
    if why or actual is None:
        return why
    a, e = actual.float(), expected.to(actual.device).float()
    nan_a, nan_e = a.isnan(), e.isnan()
    if not torch.equal(nan_a, nan_e):
        return f"{what}: NaN at {int((nan_a ^ nan_e).sum())} places where the reference differs (unwritten?)"
    a, e = a[~nan_e], e[~nan_e]
    inf = e.isinf()
    if not torch.equal(a[inf], e[inf]):
        return f"{what}: Inf differs"
    bad = ((a - e).abs() > ulps * ulp(e, actual.dtype)) & ~inf
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        return (f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond {ulps} ulp "
                f"(e.g. {a[i].item():.6g} vs {e[i].item():.6g})")
    return None


def signed_rank(codes: torch.Tensor, sign_bit: int) -> torch.Tensor:
    """Codes of a sign-magnitude format as integers ordered like their values (+0 and -0 both 0)."""
    c = codes.to(torch.int32)
    mag = c & (sign_bit - 1)
    return torch.where(c & sign_bit != 0, -mag, mag)


def codes_close(actual: torch.Tensor, expected: torch.Tensor, sign_bit: int, max_frac: float, what: str,
                nan_code: Optional[int] = None) -> Tuple[Optional[str], torch.Tensor]:
    """Sign-magnitude codes (uint8 tensors of one shape) equal, or a neighbouring code in at most
    max_frac of them. Returns (why not, mask of exact matches, on actual's device)."""
    expected = expected.to(actual.device)
    same = actual == expected
    if nan_code is not None:
        nan_a, nan_e = (actual & (sign_bit - 1)) == nan_code, (expected & (sign_bit - 1)) == nan_code
        if not torch.equal(nan_a, nan_e):
            return f"{what}: NaN codes at {int((nan_a ^ nan_e).sum())} places differ", same
    far = (signed_rank(actual, sign_bit) - signed_rank(expected, sign_bit)).abs() > 1
    if far.any():  # a NaN code of the wrong sign lands here too
        return f"{what}: {int(far.sum())} codes more than one step from the reference", same
    frac = 1.0 - same.float().mean().item() if same.numel() else 0.0
    if frac > max_frac:
        return f"{what}: {frac:.2e} of codes differ (at most {max_frac} may be neighbours)", same
    return None, same


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def scales_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 what: str) -> Tuple[Optional[str], torch.Tensor]:
    """Computed FP8 dequant scales (float32 tensors of one shape, on one device) within what a norm one
    ulp of `dtype` (T) off at the amax gives: |a - e| <= ulp_T(448 e) / 448 + ulp_fp32(e); NaN and Inf
    exactly where `expected` has them. Returns (why not, mask of bit-identical scales, NaN = NaN)."""
    a, e = actual.float(), expected.float()
    nan_a, nan_e = a.isnan(), e.isnan()
    same = (a == e) | (nan_a & nan_e)
    if not torch.equal(nan_a, nan_e):
        return f"{what}: NaN at {int((nan_a ^ nan_e).sum())} places where the reference differs", same
    inf_a, inf_e = a.isinf() & ~nan_a, e.isinf()
    if not torch.equal(inf_a, inf_e) or not torch.equal(a[inf_e], e[inf_e]):
        return f"{what}: Inf differs", same
    fin = ~(nan_e | inf_e)
    ad, ed = a[fin].double(), e[fin].double()
    tol = ulp((ed * reference.FP8_MAX).float(), dtype).double() / reference.FP8_MAX \
        + ulp(e[fin], torch.float32).double()
    bad = (ad - ed).abs() > tol
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        return (f"{what}: {int(bad.sum())} of {bad.numel()} scales beyond a neighbouring amax "
                f"(e.g. {ad[i].item():.9g} vs {ed[i].item():.9g})"), same
    return None, same


def _computed_scales(got: reference.Tail, want: reference.Tail, quant: str, scale_layout: str,
                     scale_ue8m0: bool, max_frac: float) -> Optional[str]:
    """fp8_per_token / fp8_block: scales, their layout and padding, then the codes of the rows / blocks
    whose scales agree. `want` is on the CPU or got's device; its scales are moved here."""
    dev = got.residual.device
    why = (_shape_dtype(got.quant, want.quant, f"{quant} codes")
           or _shape_dtype(got.scales, want.scales, f"{quant} scales"))
    if why:
        return why
    t, h = want.quant.shape
    block = h if quant == "fp8_per_token" else reference.FP8_BLOCK
    K = h // block
    gs, ws = got.scales, want.scales
    if quant == "fp8_block" and scale_layout == "mn_major":
        if gs.stride() != ws.stride():
            return f"{quant} scales: strides {gs.stride()}, expected {ws.stride()} (MN-major, padded rows)"
        try:
            flat = reference.mn_major_storage(gs, t, K, scale_ue8m0)
        except RuntimeError:
            return f"{quant} scales: the storage is smaller than the padded MN-major layout"
        ws = reference.mn_major_storage(ws, t, K, scale_ue8m0).to(dev)
        # Padding: the storage must be what the layout of its own values gives (0 in every padding slot).
        if scale_ue8m0:
            vals = reference.unpack_ue8m0_mn_major(flat, t, K)
            rebuilt = reference.pack_ue8m0_mn_major(vals)
        else:
            vals = reference.scales_from_mn_major(flat, t, K)
            rebuilt = reference.scales_to_mn_major(vals)
        rebuilt = reference.mn_major_storage(rebuilt, t, K, scale_ue8m0)
        if not torch.equal(flat.view(torch.int32), rebuilt.view(torch.int32)):
            return f"{quant} scales: MN-major padding not 0"
        gs = flat
    else:
        ws = ws.to(dev)
    if quant == "fp8_block":
        if scale_ue8m0:
            ge = (reference.unpack_ue8m0_mn_major(gs, t, K) if scale_layout == "mn_major" else gs).reshape(t, K)
            we = (reference.unpack_ue8m0_mn_major(ws, t, K) if scale_layout == "mn_major" else ws).reshape(t, K)
            nan_g, nan_w = ge == 0xFF, we == 0xFF
            if not torch.equal(nan_g, nan_w):
                return f"{quant} UE8M0 scales: 0xFF at {int((nan_g ^ nan_w).sum())} places where the reference differs"
            same = ge == we
            if ((ge.int() - we.int()).abs() > 1).any():
                return f"{quant} UE8M0 scales: exponents more than one from the reference"
            frac = 1.0 - same.float().mean().item() if same.numel() else 0.0
            if frac > max_frac:
                return f"{quant} UE8M0 scales: {frac:.2e} differ (at most {max_frac} may be neighbours)"
        else:
            g = reference.scales_from_mn_major(gs, t, K) if scale_layout == "mn_major" else gs
            w = reference.scales_from_mn_major(ws, t, K) if scale_layout == "mn_major" else ws
            why, same = scales_close(g.reshape(t, K), w.reshape(t, K), want.residual.dtype, f"{quant} scales")
            if why:
                return why
    else:
        why, same = scales_close(gs.reshape(t, 1), ws.reshape(t, 1), want.residual.dtype, f"{quant} scales")
        if why:
            return why
    same = same.reshape(t, K)
    codes = got.quant.view(torch.uint8).reshape(t, K, block)[same]
    codes_ref = want.quant.view(torch.uint8).to(dev).reshape(t, K, block)[same]
    return codes_close(codes, codes_ref, 0x80, max_frac, f"{quant} codes", FP8_NAN)[0]


def _as_tail(r) -> reference.Tail:
    """A Tail from anything with the outputs as attributes (a Tail, a commfuse.FusedResult, a 4-field
    tuple's Tail), scales None where it has none."""
    return reference.Tail(r.residual, r.norm, r.quant, r.scale_factors, getattr(r, "scales", None))


def tail_mismatch(got: reference.Tail, want: reference.Tail, quant: Optional[str], sf_layout: str = "swizzled",
                  max_frac: float = 1e-3, scale_layout: str = "row", scale_ue8m0: bool = False) -> Optional[str]:
    """Why a tail's outputs `got` differ from reference.fused_tail's `want` (fed the same all-reduced
    input) beyond the tolerances; None when within. Swizzle and MN-major padding is compared too (it
    must be 0). scale_layout / scale_ue8m0: those of the call, for quant "fp8_block".
    The comparison runs on got's device (the reference may come from the CPU)."""
    got, want = _as_tail(got), _as_tail(want)
    want_scales = want.scales  # moved by _computed_scales: .to() would not keep an MN-major view's padding
    want = reference.Tail(*(None if v is None else v.to(got.residual.device) for v in want[:4]), want_scales)
    for name in ("residual", "norm"):
        why = within_ulp(getattr(got, name), getattr(want, name), 1, name)
        if why:
            return why
    if quant in ("fp8_per_token", "fp8_block"):
        return _computed_scales(got, want, quant, scale_layout, scale_ue8m0, max_frac)
    why = _shape_dtype(got.scales, want.scales, "scales")
    if why:
        return why
    if quant == "fp8":
        why = _shape_dtype(got.quant, want.quant, "fp8 codes")
        return why or codes_close(got.quant.view(torch.uint8), want.quant.view(torch.uint8), 0x80, max_frac,
                                  "fp8 codes", FP8_NAN)[0]
    if quant == "nvfp4":
        why = (_shape_dtype(got.quant, want.quant, "nvfp4 codes")
               or _shape_dtype(got.scale_factors, want.scale_factors, "nvfp4 scale factors"))
        if why:
            return why
        why, same_sf = codes_close(got.scale_factors.view(torch.uint8), want.scale_factors.view(torch.uint8), 0x80,
                                   max_frac, "nvfp4 scale factors", FP8_NAN)
        if why:
            return why
        t, h = want.residual.shape
        k = h // reference.NVFP4_BLOCK
        if sf_layout == "swizzled":
            same_sf = reference.unswizzle_scale_factors(same_sf.to(torch.uint8), t, k).bool()
        same_sf = same_sf.reshape(t, k)
        codes = _nibbles(got.quant).reshape(t, k, reference.NVFP4_BLOCK)[same_sf]
        codes_ref = _nibbles(want.quant).reshape(t, k, reference.NVFP4_BLOCK)[same_sf]
        return codes_close(codes, codes_ref, 0x8, max_frac, "nvfp4 codes")[0]
    return None
