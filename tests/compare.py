"""Comparisons shared by the tests: bytes, the tolerances of commfuse.tolerance (docs/semantics.md) as
assertions, and outputs poisoned before a kernel writes them.
"""
from typing import Optional

import torch

from commfuse import tolerance
from commfuse.kernels import launch


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t (any dtype, NaN payloads included), flat, on the CPU. Copied into a fresh tensor first:
    contiguous() keeps a stride that a size-1 dim has (MN-major scales of one row and group), and a view of
    int32 as bytes needs the last stride 1."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t.detach()).view(-1).view(torch.uint8).cpu()


def bits_equal(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Same shape, dtype and bytes; two absent outputs (None) are equal too."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def assert_within_ulp(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 1, what: str = "") -> None:
    why = tolerance.within_ulp(actual, expected, ulps, what)
    assert why is None, why


def assert_post_residual_close(actual: torch.Tensor, expected: torch.Tensor, post_normed: torch.Tensor) -> None:
    why = tolerance.post_residual_within(actual, expected, post_normed, "residual")
    assert why is None, why


def assert_tail_close(tail, ref, quant, sf_layout="swizzled", exact=False, norm=None, scale=None) -> None:
    """A kernel's Tail against reference.fused_tail fed the same all-reduced input: within the
    tolerances, or (exact) bit for bit. norm, scale: the reference's norm where ref holds none, and the
    call's dequant scale, for the codes of blocks whose scale differs (tolerance.tail_mismatch)."""
    if exact:
        for name in ("residual", "norm", "quant", "scale_factors"):
            a, e = getattr(tail, name), getattr(ref, name)
            assert (a is None) == (e is None), name
            assert a is None or bits_equal(a, e), f"{name} differs"
        return
    why = tolerance.tail_mismatch(tail, ref, quant, sf_layout, norm=norm, scale=scale)
    assert why is None, why


POISONS = (0xA5, 0x5A)


def poisoned_runs(fn) -> list:
    """[fn() for each of POISONS], with every output a launcher allocates (the C++ ones and
    commfuse.kernels.launch's Python ones) filled with that poison byte first: an output element a
    kernel never writes then differs between the two results."""
    results = []
    for poison in POISONS:
        launch.set_poison(poison)
        try:
            results.append(fn())
        finally:
            launch.set_poison(None)
    return results
