"""Tolerances (docs/semantics.md): why a result differs from commfuse.reference beyond them (None when it does not).

- residual / norm: within `ulps` units in the last place of T of the reference: at most that many representable
  values of T apart (NaN and Inf where it has them, and only there). The residual of a post-norm call (section 2a):
  within one ulp of T of the post-normed sum a' plus one of the residual (a' may be an ulp off, and the sum of the
  other a' rounds once more).
- Codes (e4m3, e2m1) and e4m3 scale factors: equal, except a neighbouring code (a value within rounding
  of a code boundary) in at most `max_frac` of them, or one; the FP8 NaN code is 0x7F (never 0xFF).
- Computed float32 scales: equal, or off by no more than a neighbouring amax gives: |got - want| <=
  ulp_T(448 want) / 448 + ulp_fp32(want) (the norm element at the amax may be one ulp of T off, and
  s = RN(amax / 448) rounds once more), in at most `max_frac` of them (or one) not equal; NaN and Inf
  exactly where the reference has them. UE8M0 exponent bytes: equal, except a neighbouring exponent in
  at most `max_frac` of the blocks (or one); 0xFF exactly where the reference has it.
- The block scales' layout: its padding (swizzled tiles, MN-major rows) must be 0, an MN-major view's
  strides the reference's. Codes are compared with the reference's in the blocks whose scales are
  bit-identical to it, elsewhere with the reference's norm quantized with the returned scale (a
  neighbouring scale changes the whole block), by the rule of the codes above over all of them.
What is compared follows from the call's TailSpec: its format's codes, block, scale encoding and layout.

The tests (tests/compare.py) assert these, and commfuse-bench's correctness gate rejects with them.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import reference
from .tail.formats import Layout
from .tail.spec import TailSpec

__all__ = ["ulp", "within_ulp", "post_residual_within", "signed_rank", "codes_close", "scales_close", "tail_mismatch",
           "spec_mismatch"]

FP8_NAN = 0x7F


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at the magnitude of x (an fp32 tensor), subnormals included: 2^floor(log2 |x|) eps, the
    exponent exact (frexp; a float32 log2 rounds values just below a power of two up to it)."""
    info = torch.finfo(dtype)
    _, e = torch.frexp(x.abs().clamp_min(info.smallest_normal))
    return torch.ldexp(torch.full_like(x, info.eps), e - 1)


_ORDINAL_VIEWS = {2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF), 8: (torch.int64, 0x7FFFFFFFFFFFFFFF)}


def _ordinal(x: torch.Tensor) -> torch.Tensor:
    """A float tensor's values as int64 numbered in value order, one apart for neighbouring values of its dtype
    (+0 and -0 both 0, subnormals included): the bits of a sign-magnitude format, the sign turned into a minus."""
    view, magnitude = _ORDINAL_VIEWS[x.element_size()]
    bits = x.contiguous().view(view).to(torch.int64)
    return torch.where(bits < 0, -(bits & magnitude), bits)


def _shape_dtype(actual, expected, what: str) -> Optional[str]:
    if actual is None or expected is None:
        return None if actual is expected else f"{what}: {'missing' if actual is None else 'unexpected'} output"
    if tuple(actual.shape) != tuple(expected.shape) or actual.dtype != expected.dtype:
        return f"{what}: got {actual.dtype}{list(actual.shape)}, expected {expected.dtype}{list(expected.shape)}"
    return None


def within_ulp(actual: Optional[torch.Tensor], expected: Optional[torch.Tensor], ulps: int,
               what: str) -> Optional[str]:
    """Why `actual` is not within `ulps` ulp of T of `expected` elementwise (both None is fine): at most `ulps`
    representable values of T apart (one ulp below a power of two is the finer spacing there)."""
    why = _shape_dtype(actual, expected, what)
    if why or actual is None:
        return why
    a, e = actual.float(), expected.to(actual.device).float()
    nan_a, nan_e = a.isnan(), e.isnan()
    if not torch.equal(nan_a, nan_e):
        return f"{what}: NaN at {int((nan_a ^ nan_e).sum())} places where the reference differs (unwritten?)"
    steps = (_ordinal(actual) - _ordinal(expected.to(actual.device)))[~nan_e].abs()
    a, e = a[~nan_e], e[~nan_e]
    inf = e.isinf()
    if not torch.equal(a[inf], e[inf]):
        return f"{what}: Inf differs"
    bad = (steps > ulps) & ~inf
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        return (f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond {ulps} ulp "
                f"(e.g. {a[i].item():.9g} vs {e[i].item():.9g})")
    return None


def post_residual_within(actual: Optional[torch.Tensor], expected: Optional[torch.Tensor],
                         post_normed: torch.Tensor, what: str) -> Optional[str]:
    """Why a post-norm call's residual (docs/semantics.md section 2a) is not within ulp_T(a') + ulp_T(r) of the
    reference's r elementwise, a' (`post_normed`) the reference's post-normed sum: the kernel's a' may be an ulp of
    T off (the order of its sum of squares), and a' + residual then rounds to T once more."""
    why = _shape_dtype(actual, expected, what)
    if why or actual is None:
        return why
    a, e, p = actual.float(), expected.to(actual.device).float(), post_normed.to(actual.device).float()
    nan_e = e.isnan()
    if not torch.equal(a.isnan(), nan_e):
        return f"{what}: NaN at {int((a.isnan() ^ nan_e).sum())} places where the reference differs (unwritten?)"
    a, e, p = a[~nan_e], e[~nan_e], p[~nan_e]
    inf = e.isinf()
    if not torch.equal(a[inf], e[inf]):
        return f"{what}: Inf differs"
    bound = ulp(p, actual.dtype) + ulp(e, actual.dtype)
    bad = ((a - e).abs() > bound) & ~inf
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        return (f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond ulp(a') + ulp(r) "
                f"(e.g. {a[i].item():.9g} vs {e[i].item():.9g}, a' {p[i].item():.9g})")
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
    return _few_differ(same, max_frac, what, "codes"), same


def _few_differ(same: torch.Tensor, max_frac: float, what: str, of: str) -> Optional[str]:
    """Why more than max_frac of `same` is False, one always allowed: a norm one ulp off at a rounding boundary
    moves one code, or one block's scale, however few there are (a decode row's 256 NVFP4 scale factors)."""
    differ = int((~same).sum())
    if differ > max(1.0, max_frac * same.numel()):
        return f"{what}: {differ} of {same.numel()} {of} differ (at most {max_frac} of them, or one, may be neighbours)"
    return None


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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor of 1-byte elements as uint8 (indexing float8 is not implemented everywhere)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def _scale_grid(stored: torch.Tensor, spec: TailSpec, t: int, K: int, what: str) -> Tuple[Optional[str], torch.Tensor]:
    """The stored block scales as a [t, K] grid of their values' codes (uint8 bytes, or float32), after
    checking the layout's padding (it must be 0) and an MN-major view's strides and storage."""
    ue8m0, layout = spec.ue8m0, spec.layout
    if layout == Layout.SWIZZLED:
        flat = stored.reshape(-1)
        pad = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
        m = torch.arange(t, device=flat.device).unsqueeze(1)
        pad[reference.swizzled_sf_index(m, torch.arange(K, device=flat.device).unsqueeze(0), K).reshape(-1)] = False
        if (_bytes(flat)[pad] != 0).any():
            return f"{what}: swizzle padding not 0", stored
        return None, reference.unswizzle_scale_factors(stored, t, K)
    if layout == Layout.MN_MAJOR:
        try:
            flat = reference.mn_major_storage(stored, t, K, ue8m0)
        except RuntimeError:
            return f"{what}: the storage is smaller than the padded MN-major layout", stored
        vals = reference.unpack_ue8m0_mn_major(flat, t, K) if ue8m0 else reference.scales_from_mn_major(flat, t, K)
        rebuilt = reference.pack_ue8m0_mn_major(vals) if ue8m0 else reference.scales_to_mn_major(vals)
        if not torch.equal(flat.view(torch.int32), reference.mn_major_storage(rebuilt, t, K, ue8m0).view(torch.int32)):
            return f"{what}: MN-major padding not 0", stored
        return None, vals
    return None, stored.reshape(t, K)


def _scales_same(g: torch.Tensor, w: torch.Tensor, spec: TailSpec, dtype: torch.dtype, max_frac: float,
                 what: str) -> Tuple[Optional[str], torch.Tensor]:
    """Block scales ([t, K] grids) within the tolerances of their encoding; the mask of identical ones."""
    code = "ue8m0" if spec.ue8m0 else spec.format.scale_code
    if code == "f32":
        why, same = scales_close(g, w, dtype, what)
        return why or _few_differ(same, max_frac, what, "scales"), same
    if code == "e4m3":
        return codes_close(_bytes(g), _bytes(w), 0x80, max_frac, what, FP8_NAN)
    ge, we = g.view(torch.uint8), w.view(torch.uint8)  # UE8M0 exponents
    nan_g, nan_w = ge == 0xFF, we == 0xFF
    same = ge == we
    if not torch.equal(nan_g, nan_w):
        return f"{what}: 0xFF at {int((nan_g ^ nan_w).sum())} places where the reference differs", same
    if ((ge.int() - we.int()).abs() > 1).any():
        return f"{what}: exponents more than one from the reference", same
    return _few_differ(same, max_frac, what, "exponents"), same


def _requantized(norm: torch.Tensor, grid: torch.Tensor, spec: TailSpec, scale, block: int) -> torch.Tensor:
    """The codes of the reference's norm under the returned block scales (grid: a [t, K] grid of their codes),
    uint8 [t, K, block] (e2m1 unpacked): what a kernel whose norm is the reference's writes with those scales."""
    t, K = grid.shape
    n = norm.float().reshape(t, K, block)
    code = "ue8m0" if spec.ue8m0 else spec.format.scale_code
    if code == "e4m3":  # NVFP4's scale factors, under the global scale S = RN(1 / scale)
        S = torch.reciprocal(torch.as_tensor(scale, dtype=torch.float32, device=n.device).reshape(()))
        return reference.nvfp4_block_codes(n, grid.view(torch.float8_e4m3fn), S)
    s = grid.float() if code == "f32" else reference.ue8m0_to_scale(grid.view(torch.uint8))
    return reference.fp8_group_codes(n, s).view(torch.uint8)


def _as_tail(r) -> reference.Tail:
    """A Tail from anything with the outputs as attributes (a Tail, a commfuse.FusedResult, a 4-field
    tuple's Tail), scales None where it has none."""
    return reference.Tail(r.residual, r.norm, r.quant, r.scale_factors, getattr(r, "scales", None))


def tail_mismatch(got: reference.Tail, want: reference.Tail, quant: Optional[str], sf_layout: str = "swizzled",
                  max_frac: float = 1e-3, scale_layout: str = "row", scale_ue8m0: bool = False,
                  norm: Optional[torch.Tensor] = None, scale=None) -> Optional[str]:
    """Why a tail's outputs `got` differ from reference.fused_tail's `want` (fed the same all-reduced
    input) beyond the tolerances; None when within. The block scales' layout padding is compared too
    (it must be 0). sf_layout / scale_layout / scale_ue8m0: those of the call. The comparison runs on
    got's device (the reference may come from the CPU).
    Where a block's scale differs from the reference's, its codes are compared with the reference's norm
    quantized with the returned scale: `norm` is that norm where `want` holds none (a call without
    return_norm), `scale` the call's dequant scale (NVFP4's global scale enters its codes). Without them
    such a block is a mismatch: its codes could not be checked."""
    spec = TailSpec.of(quant, sf_layout=sf_layout, scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    return spec_mismatch(got, want, spec, max_frac, norm, scale)


def spec_mismatch(got: reference.Tail, want: reference.Tail, spec: TailSpec, max_frac: float = 1e-3,
                  norm: Optional[torch.Tensor] = None, scale=None) -> Optional[str]:
    """tail_mismatch for a TailSpec: everything it compares follows from the spec's format (its codes, its
    block, its scales' encoding, field and layout)."""
    got, want = _as_tail(got), _as_tail(want)
    dev = (got.norm if got.norm is not None else got.residual if got.residual is not None else got.quant).device
    # The stored scales are moved by _scale_grid's caller below: .to() would not keep an MN-major view's padding.
    want = reference.Tail(*(None if v is None else v.to(dev) for v in want[:3]), want.scale_factors, want.scales)
    for name in ("residual", "norm"):
        why = within_ulp(getattr(got, name), getattr(want, name), 1, name)
        if why:
            return why
    f = spec.format
    what = str(f)
    field = f.scale_field
    for name in ("quant", "scale_factors", "scales"):
        why = _shape_dtype(getattr(got, name), getattr(want, name), f"{what} {name}")
        if why:
            return why
    if f.codes is None:
        return None
    gq, wq = got.quant, want.quant
    if f.codes == "e2m1":
        gq, wq, sign, nan = _nibbles(gq), _nibbles(wq), 0x8, None
    else:
        gq, wq, sign, nan = gq.view(torch.uint8), wq.view(torch.uint8), 0x80, FP8_NAN
    t, h = gq.shape
    if f.block is None:  # one static scale
        return codes_close(gq, wq, sign, max_frac, f"{what} codes", nan)[0]
    block = f.block or h
    K = h // block
    gs, ws = getattr(got, field), getattr(want, field)
    if spec.layout == Layout.MN_MAJOR and gs.stride() != ws.stride():
        return f"{what} {field.replace('_', ' ')}: strides {gs.stride()}, expected {ws.stride()} (MN-major, padded rows)"
    if spec.layout == Layout.MN_MAJOR:
        ws = reference.mn_major_storage(ws, t, K, spec.ue8m0).to(dev)
    else:
        ws = ws.to(dev)
    label = f"{what} {'UE8M0 ' if spec.ue8m0 else ''}{field.replace('_', ' ')}"
    why, g = _scale_grid(gs, spec, t, K, label)
    if why:
        return why
    _, w = _scale_grid(ws, spec, t, K, f"{label} (reference)")
    # T: the computed scales' tolerance follows a norm one ulp of T off (bf16's, the coarser, where no output or
    # `norm` says T).
    dtype = next((v.dtype for v in (want.residual, want.norm, norm, got.residual, got.norm) if v is not None),
                 torch.bfloat16)
    why, same = _scales_same(g, w, spec, dtype, max_frac, label)
    if why:
        return why
    same = same.reshape(t, K)
    wq = wq.reshape(t, K, block)
    if not same.all():
        # Another scale moves every code of its block: those codes are judged against what the reference's
        # norm gives with that scale, so a scale within its tolerance cannot hide its block's codes.
        norm = want.norm if want.norm is not None else norm
        missing = [n for n, v in (("norm", norm), ("scale", scale if spec.format.takes_scale else 0)) if v is None]
        if missing:
            return (f"{what} codes: {int((~same).sum())} blocks' {field.replace('_', ' ')} differ from the "
                    f"reference's, and their codes need the reference's {' and '.join(missing)} to be checked")
        wq = torch.where(same.unsqueeze(-1), wq, _requantized(norm.to(dev), g, spec, scale, block))
    return codes_close(gq.reshape(t, K, block), wq, sign, max_frac, f"{what} codes", nan)[0]
