"""Tolerances (docs/semantics.md): why a result differs from commfuse.reference beyond them (None when it does not).

- residual / norm: within `ulps` units in the last place of T of the reference (NaN and Inf where it
  has them, and only there).
- FP8 / NVFP4 codes and scale factors: equal, except a neighbouring code (a value within rounding of a
  code boundary) in at most `max_frac` of them; the FP8 NaN code is 0x7F (never 0xFF). NVFP4 codes are
  compared only in blocks whose scale factors agree: a neighbouring scale factor changes the whole block.

The tests (tests/compare.py) assert these, and commfuse-bench's correctness gate rejects with them.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import reference

__all__ = ["ulp", "within_ulp", "signed_rank", "codes_close", "tail_mismatch"]

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


def tail_mismatch(got: reference.Tail, want: reference.Tail, quant: Optional[str], sf_layout: str = "swizzled",
                  max_frac: float = 1e-3) -> Optional[str]:
    """Why a tail's outputs `got` differ from reference.fused_tail's `want` (fed the same all-reduced
    input) beyond the tolerances; None when within. Swizzle padding is compared too (it must be 0).
    The comparison runs on got's device (the reference may come from the CPU)."""
    want = reference.Tail(*(None if v is None else v.to(got.residual.device) for v in want))
    for name in ("residual", "norm"):
        why = within_ulp(getattr(got, name), getattr(want, name), 1, name)
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
