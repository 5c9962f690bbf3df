"""CPU: the computed FP8 scales' arithmetic in csrc/epilogue.cuh, checked in exact arithmetic.

fp8_group_scale divides a group's amax by 448 without a division: q = RN(amax r) with
r = RN(1/448), corrected by two FMAs, RN(RN(amax - q 448) r + q). No theorem says that this is
RN(amax / 448), but amax is a T value (the largest |norm| of the group, bf16 or fp16), so every
input can be tried: each operation below is an IEEE fp32 operation rounded once (fmul, fma), done
in rational arithmetic, and the result must be the correctly rounded quotient, bit for bit, then
the group scale max(q, 2^-126) must be reference._fp8_groups'. fp8_block_scale's UE8M0 rounding on
the bits ((bits + 2^23 - 1) & 0x7F800000) is checked against reference.ue8m0_from_scale alike.
"""
from fractions import Fraction

import numpy as np
import torch

from commfuse import reference as ref

RCP_448 = float.fromhex("0x1.24924ap-9")  # kFp8MaxReciprocal
TINY = 2.0**-126


def rn32(x: Fraction) -> Fraction:
    """x rounded to the nearest fp32, ties to even, subnormals included (finite results only)."""
    if x == 0:
        return Fraction(0)
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    ulp = Fraction(2) ** max(e - 23, -149)
    n, rem = divmod(a, ulp)
    n = int(n) + (rem > ulp / 2 or (rem == ulp / 2 and n % 2 == 1))
    assert n * ulp < 2**128, "overflow: not expected here"
    return (n * ulp) if x > 0 else -(n * ulp)


def kernel_quotient(amax: float) -> float:
    """fp8_group_scale's quotient for a finite amax, as the GPU computes it."""
    x, r = Fraction(amax), Fraction(RCP_448)
    q = rn32(x * r)
    return float(rn32(rn32(x - q * 448) * r + q))


def finite_values(dtype):
    bits = torch.arange(0, 0x8000, dtype=torch.int32).to(torch.int16).view(dtype)
    values = bits.float()
    return values[torch.isfinite(values)]


def test_reciprocal_constant():
    assert RCP_448 == float(np.float32(1) / np.float32(448))


def test_group_scale_division_is_exact_for_every_fp16_and_bf16():
    for dtype in (torch.float16, torch.bfloat16):
        values = finite_values(dtype)
        want = values / torch.full((), 448.0)  # IEEE fp32 division on the CPU: RN(amax / 448)
        got = torch.tensor([kernel_quotient(v) for v in values.tolist()], dtype=torch.float32)
        bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
        assert bad.numel() == 0, (dtype, values[bad[:5, 0]].tolist())


def test_ue8m0_rounding_on_the_bits():
    scales = torch.cat([finite_values(d) / torch.full((), 448.0) for d in (torch.float16, torch.bfloat16)])
    scales = torch.cat([scales, torch.tensor([float("inf"), 2.0**127, 2.0**127 * 1.5, 3.4e38])])
    scales = torch.maximum(scales, torch.full((), TINY))  # the group scales: normal or +Inf
    got = ((scales.view(torch.int32).long() + 0x7FFFFF) & 0x7F800000) >> 23
    assert torch.equal(got.to(torch.uint8), ref.ue8m0_from_scale(scales))
