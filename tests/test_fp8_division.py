"""GPU: the FP8 quantizer's division (csrc/epilogue.cuh, fp8_divide) against __fdiv_rn.

The contract quantizes e4m3(x / scale) with a true, correctly rounded fp32 division. The kernels
divide by one reciprocal plus an FMA correction (Markstein's), and outside a band of quotients
keep the uncorrected one, which e4m3 turns into the same saturated or zero code. No theorem
covers the correction here (its first quotient can be more than an ulp off), so these checks are
the proof. tests/kernels/fp8_division.cu runs both divisions on the GPU and counts:
- e4m3 codes that differ, over every fp32 bit pattern x (NaN, Inf, subnormals included);
- fp32 quotients that differ inside the band (the correction must give RN(x / scale) itself).

Inside the band every operation is a correctly rounded one on normal numbers, so the result for
(x * 2^i, scale * 2^j) is the result for (x, scale) times 2^(i-j): pairs of mantissas in [1, 2)
cover it. test_every_mantissa_pair takes 8201 scale mantissas against all 2^23 x mantissas;
COMMFUSE_TEST_EXHAUSTIVE=1 takes all 2^23 x 2^23 pairs (about two minutes on an H200; run it when
fp8_divide or the compile options change).
"""
import os
import struct
from pathlib import Path

import pytest
import torch

from commfuse.kernels import jit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs the division on the device)"),
]

KERNEL = str(Path(__file__).parent / "kernels" / "fp8_division.cu")
ONE = 0x3F800000  # 1.0f: the mantissa pairs below are (1 + m 2^-23) / (1 + k 2^-23)


def _bits(*values):
    return [struct.unpack("<f", struct.pack("<I", v))[0] for v in values]


def run_check(scales, x_first, x_count, blocks=1024):
    """(code mismatches, in-band bit mismatches, in-band count, first mismatch or None) of
    fp8_divide against __fdiv_rn for every scale and the fp32 bit patterns x_first .. + x_count."""
    k = jit.kernel(KERNEL, "commfuse_test::check_fp8_division")
    scales = torch.as_tensor(scales, dtype=torch.float32).cuda()
    counts = torch.zeros(3, dtype=torch.int64, device="cuda")
    first = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    for begin in range(0, scales.numel(), 65535):  # gridDim.y
        chunk = scales[begin:begin + 65535]
        params = struct.pack("<4QI4x", chunk.data_ptr(), x_count, counts.data_ptr(), first.data_ptr(), x_first)
        k.launch((blocks, chunk.numel(), 1), (256, 1, 1), params)
        if first.item() != -1:
            first += begin << 32  # the chunk's scale index -> the list's
            break
    f = first.item()
    where = None if f == -1 else (scales[(f >> 32) & 0xFFFFFFFF].item(), f & 0xFFFFFFFF)
    return (*counts.tolist(), where)


def test_every_float_for_chosen_scales():
    """Every fp32 x, for scales at the edges of the fast range, of awkward mantissas, a checkpoint's
    typical ones, random ones, and ones outside the range (which must divide truly)."""
    g = torch.Generator().manual_seed(20261130)
    randoms = torch.exp2(torch.empty(12).uniform_(-64, 64, generator=g)).tolist()
    fast = [1.0, 20.0 / 448, 1 / 448, 0.0123, 3.7, -0.37, 2.0 ** -64, 2.0 ** 64, 1.5 * 2.0 ** -64,
            *_bits(0x3FFFFFFF, 0x3F800001, 0x5F7FFFFF), *randoms]  # 1.99999988, 1 + 2^-23, just below 2^64
    code_diff, bits_diff, in_band, where = run_check(fast, 0, 1 << 32)
    assert code_diff == 0 and bits_diff == 0, f"fp8_divide differs from __fdiv_rn at (scale, x bits) {where}"
    # Each scale's band holds about 2^20 / 2^-20 of the floats (40 binades of 2^23, both signs).
    assert in_band >= len(fast) * 2 * 39 * (1 << 23), in_band
    # Some x put each of these quotients in the band: none may take the reciprocal path.
    slow = [2.0 ** -65, 2.0 ** 65, 1e-40, -(2.0 ** -70)]
    assert run_check(slow, 0, 1 << 32)[2] == 0, "a scale outside [2^-64, 2^64] took the reciprocal path"


def test_every_mantissa_pair():
    """All x mantissas against scale mantissas at the edges, evenly spaced and random (all 2^23
    with COMMFUSE_TEST_EXHAUSTIVE=1): the corrected quotient is RN(x / scale), bit for bit."""
    if os.environ.get("COMMFUSE_TEST_EXHAUSTIVE") == "1":
        ks = torch.arange(1 << 23, dtype=torch.int64)
    else:
        g = torch.Generator().manual_seed(7)
        edges = torch.tensor([0, 1, 2, 3, (1 << 22) - 1, 1 << 22, (1 << 22) + 1, (1 << 23) - 2, (1 << 23) - 1])
        ks = torch.cat([edges, torch.arange(0, 1 << 23, 1 << 11), torch.randint(0, 1 << 23, (4096,), generator=g)])
    scales = (ks.to(torch.int32) + ONE).view(torch.float32)
    code_diff, bits_diff, in_band, where = run_check(scales, ONE, 1 << 23, blocks=16)
    assert in_band == scales.numel() << 23, "a quotient in (0.5, 2) fell outside the band"
    assert code_diff == 0 and bits_diff == 0, f"fp8_divide differs from __fdiv_rn at (scale, x bits) {where}"
