"""DESIGN.md's tolerances as assertions, shared by every test that checks a kernel against commfuse.reference.

- residual / norm: within `ulps` units in the last place of T of the reference (NaN where it has NaN).
- FP8 / NVFP4 codes and scale factors: equal, except a neighbouring code (a value within rounding of a
  code boundary) in at most `max_frac` of them. NVFP4 codes are compared only in blocks whose scale
  factors agree: a neighbouring scale factor legitimately changes the whole block.
"""
import torch

from commfuse import reference


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t (any dtype, NaN payloads included), flat, on the CPU."""
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at the magnitude of x (fp32 tensor), subnormals included."""
    info = torch.finfo(dtype)
    mag = x.abs().clamp_min(info.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def assert_within_ulp(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 1, what: str = "") -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
    a, e = actual.float().cpu(), expected.float().cpu()
    nan_e, nan_a = e.isnan(), a.isnan()
    assert torch.equal(nan_a, nan_e), f"{what}: NaN at {int((nan_a ^ nan_e).sum())} places that differ"
    fin = ~nan_e
    a, e = a[fin], e[fin]
    inf = e.isinf()
    assert torch.equal(a[inf], e[inf]), f"{what}: Inf differs"
    bad = (a - e).abs()[~inf] > ulps * ulp(e[~inf], actual.dtype)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond {ulps} ulp, "
                           f"first actual {a[~inf][bad][:4].tolist()} expected {e[~inf][bad][:4].tolist()}")


def signed_rank(codes: torch.Tensor, sign_bit: int) -> torch.Tensor:
    """Codes of a sign-magnitude format as integers ordered like their values (+0 and -0 both 0)."""
    c = codes.to(torch.int32)
    mag = c & (sign_bit - 1)
    return torch.where(c & sign_bit != 0, -mag, mag)


def _assert_neighbours(actual: torch.Tensor, expected: torch.Tensor, sign_bit: int, max_frac: float,
                       what: str, nan_code=None) -> torch.Tensor:
    """Assert codes equal or neighbours (rarely); return the mask of exact matches."""
    a, e = actual.cpu(), expected.cpu()
    assert a.shape == e.shape, (what, a.shape, e.shape)
    if nan_code is not None:
        assert torch.equal((a & 0x7F) == nan_code, (e & 0x7F) == nan_code), f"{what}: NaN codes differ"
    same = a == e
    ra, re_ = signed_rank(a, sign_bit), signed_rank(e, sign_bit)
    assert ((ra - re_).abs() <= 1).all(), f"{what}: codes more than one step apart"
    frac = 1.0 - same.float().mean().item() if same.numel() else 0.0
    assert frac <= max_frac, f"{what}: {frac:.2e} of codes differ (max {max_frac})"
    return same


def assert_fp8_close(actual: torch.Tensor, expected: torch.Tensor, max_frac: float = 1e-3, what: str = "fp8"):
    assert actual.dtype == expected.dtype == torch.float8_e4m3fn
    return _assert_neighbours(actual.view(torch.uint8), expected.view(torch.uint8), 0x80, max_frac, what, 0x7F)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    p = packed.cpu()
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def assert_nvfp4_close(q: torch.Tensor, sf: torch.Tensor, q_ref: torch.Tensor, sf_ref: torch.Tensor,
                       t: int, h: int, sf_layout: str, max_frac: float = 1e-3) -> None:
    """Compare packed e2m1 codes [t, h/2] and scale factors (either layout) to the reference."""
    assert q.dtype == torch.uint8 and q.shape == q_ref.shape == (t, h // 2)
    assert sf.shape == sf_ref.shape and sf.dtype == torch.float8_e4m3fn, (sf.shape, sf_ref.shape, sf.dtype)
    # Every scale factor is compared, swizzle padding included (it must be written as 0).
    same_sf = assert_fp8_close(sf, sf_ref, max_frac, "nvfp4 scale factors")
    k = h // 16
    if sf_layout == "swizzled":
        same_sf = reference.unswizzle_scale_factors(same_sf.to(torch.uint8), t, k).bool()
    same_sf = same_sf.reshape(t, k)
    codes, codes_ref = _nibbles(q).reshape(t, k, 16), _nibbles(q_ref).reshape(t, k, 16)
    _assert_neighbours(codes[same_sf], codes_ref[same_sf], 0x8, max_frac, "nvfp4 codes")


def assert_tail_close(tail, ref, quant, sf_layout="swizzled", exact=False) -> None:
    """A kernel's Tail against reference.fused_tail fed the same all-reduced input."""
    if exact:
        for name in ("residual", "norm", "quant", "scale_factors"):
            a, e = getattr(tail, name), getattr(ref, name)
            assert (a is None) == (e is None), name
            assert a is None or bits_equal(a, e), f"{name} differs"
        return
    assert_within_ulp(tail.residual, ref.residual, 1, "residual")
    assert (tail.norm is None) == (ref.norm is None), "norm presence"
    if ref.norm is not None:
        assert_within_ulp(tail.norm, ref.norm, 1, "norm")
    if quant == "fp8":
        assert_fp8_close(tail.quant, ref.quant)
    elif quant == "nvfp4":
        t, h = ref.residual.shape
        assert_nvfp4_close(tail.quant, tail.scale_factors, ref.quant, ref.scale_factors, t, h, sf_layout)


POISONS = (0xA5, 0x5A)


def poisoned_runs(monkeypatch, modules, fn) -> list:
    """[fn() for each of POISONS], with the `_empty` output allocator of every module in `modules`
    (commfuse.fused_tail, commfuse.p2p) swapped for one that fills the new tensor with that poison
    byte: an output element a kernel never writes then differs between the two results."""
    results = []
    for poison in POISONS:
        def empty(*shape, dtype, device, _poison=poison):
            x = torch.empty(*shape, dtype=dtype, device=device)
            x.view(torch.uint8).fill_(_poison)
            return x

        for module in modules:
            monkeypatch.setattr(module, "_empty", empty)
        results.append(fn())
    for module in modules:
        monkeypatch.setattr(module, "_empty", torch.empty)
    return results
