"""Tests of commfuse.reference: hand-checked vectors and independent re-derivations.

CPU, single process. The independent encoders below are written from the format
definitions (numpy, float64), not from the module's code.
"""
import math

import numpy as np
import pytest
import torch

from commfuse import reference as ref
from commfuse.reference import Tail

from compare import assert_tail_close
from conftest import needs_gpu

INF = float("inf")
NAN = float("nan")
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def u8(t):
    return t.view(torch.uint8)


def bits(t):
    """Bit-exact view for comparisons that must also hold for NaN."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# ----------------------------------------------------------------- independent encoders


def _e4m3_table():
    """Value of every e4m3fn code, from the format definition (bias 7, no Inf, S.1111.111 NaN)."""
    vals = np.empty(256)
    for c in range(256):
        e, m = (c >> 3) & 0xF, c & 7
        mag = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals[c] = -mag if c & 0x80 else mag
    vals[0x7F] = vals[0xFF] = np.nan
    return vals


E4M3_VALUES = _e4m3_table()
E4M3_POS = E4M3_VALUES[:0x7F]  # codes 0..0x7E, increasing, 0 .. 448


def e4m3_encode_indep(x):
    """fp32 array -> e4m3fn bytes: nearest value, exact ties to the even code, saturate, NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    mag = np.where(np.isnan(mag), 0.0, mag)
    hi = np.clip(np.searchsorted(E4M3_POS, mag, side="left"), 0, 0x7E)  # first value >= mag
    lo = np.maximum(hi - 1, 0)
    dlo, dhi = mag - E4M3_POS[lo], E4M3_POS[hi] - mag
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(mag == E4M3_POS[hi], hi, code).astype(np.uint8)
    code |= np.signbit(x).astype(np.uint8) << 7
    return np.where(np.isnan(x), np.uint8(0x7F), code).astype(np.uint8)


def e2m1_encode_indep(v):
    """fp32 array -> e2m1 codes: nearest of E2M1, ties to even code, saturate, sign bit -> 0x8."""
    v = np.asarray(v, dtype=np.float32)
    mag = np.minimum(np.abs(v.astype(np.float64)), 6.0)
    d = np.abs(mag[..., None] - np.array(E2M1))
    best = d.min(-1, keepdims=True)
    cand = d == best
    # Among equally near codes (at most two, adjacent) take the even one.
    even = cand & (np.arange(8) % 2 == 0)
    code = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1)).astype(np.uint8)
    code |= np.signbit(v).astype(np.uint8) << 3
    return np.where(np.isnan(v), np.uint8(0), code)


def nvfp4_indep(x, scale):
    """Independent NVFP4 of an fp32 [t, h] array with fp32 dequant scale -> (codes [t,h], sf bytes [t,K])."""
    x = np.asarray(x, dtype=np.float32)
    t, h = x.shape
    S = np.float32(1) / np.float32(scale)
    b = x.reshape(t, h // 16, 16)
    vmax = np.abs(b).max(-1)  # numpy max propagates NaN
    sf = e4m3_encode_indep((S * vmax) / np.float32(6))
    sfv = E4M3_VALUES[sf].astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        enc = np.where(sfv == 0, np.float32(0), S / sfv).astype(np.float32)
        codes = e2m1_encode_indep((b * enc[..., None]).astype(np.float32))
    codes = np.where(np.isnan(sfv)[..., None], np.uint8(0), codes)
    return codes.reshape(t, h), sf


def unpack(packed):
    return torch.stack((packed & 0xF, packed >> 4), -1).reshape(packed.shape[0], -1)


def ulp(t):
    """Spacing of dtype(t) at |t| (towards +inf), as float64."""
    a = t.abs()
    return (torch.nextafter(a, torch.full_like(a, INF)) - a).double()


# ----------------------------------------------------------------- e2m1


def test_e2m1_decode_table():
    got = ref.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    want = E2M1 + [-v for v in E2M1]
    assert got.dtype == torch.float32
    assert got.tolist() == want
    assert torch.signbit(got[8]) and not torch.signbit(got[0])  # code 8 is -0.0


def test_e2m1_encode_exact_values():
    v = torch.tensor(E2M1 + [-x for x in E2M1])
    assert ref.e2m1_encode(v).tolist() == list(range(16))


# (tie value, expected code): ties go to the even code
TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]


def test_e2m1_encode_ties():
    v = torch.tensor([t for t, _ in TIES], dtype=torch.float32)
    assert ref.e2m1_encode(v).tolist() == [c for _, c in TIES]
    assert ref.e2m1_encode(-v).tolist() == [c | 8 for _, c in TIES]


def test_e2m1_encode_around_ties():
    # Tie i lies between codes i and i+1: just below -> i, just above -> i+1.
    ties = np.array([t for t, _ in TIES], dtype=np.float32)
    below = np.nextafter(ties, np.float32(0))
    above = np.nextafter(ties, np.float32(INF))
    lo = ref.e2m1_encode(torch.from_numpy(below)).tolist()
    hi = ref.e2m1_encode(torch.from_numpy(above)).tolist()
    assert lo == list(range(7))
    assert hi == list(range(1, 8))
    assert ref.e2m1_encode(torch.from_numpy(-above)).tolist() == [c | 8 for c in range(1, 8)]


def test_e2m1_encode_saturation_sign_nan():
    v = torch.tensor([6.0, 7.0, 100.0, INF, -7.0, -INF, -0.0, -1e-30, 0.0, 1e-30, NAN])
    assert ref.e2m1_encode(v).tolist() == [7, 7, 7, 7, 15, 15, 8, 8, 0, 0, 0]


def test_e2m1_encode_vs_independent():
    g = gen(1)
    v = (torch.randn(50_000, generator=g) * 3).float()
    v[:100] = torch.arange(100) * 0.25 - 12.5  # every tie and exact value, both signs
    got = ref.e2m1_encode(v).numpy()
    np.testing.assert_array_equal(got, e2m1_encode_indep(v.numpy()))


# ----------------------------------------------------------------- e4m3 / FP8


def test_fp8_hand_bit_patterns():
    cases = [
        (1.0, 0x38), (1.125, 0x39), (1.0625, 0x38), (1.1875, 0x3A),  # RNE ties
        (-1.1875, 0xBA), (2.0**-6, 0x08), (416.0, 0x7D), (432.0, 0x7E),  # 432: tie 416|448 -> even
        (448.0, 0x7E), (449.0, 0x7E), (1e6, 0x7E), (INF, 0x7E),
        (-449.0, 0xFE), (-1e6, 0xFE), (-INF, 0xFE),
        (2.0**-9, 0x01), (2.0**-10, 0x00), (3 * 2.0**-10, 0x02), (-(2.0**-10), 0x80),
        (0.0, 0x00), (-0.0, 0x80), (NAN, 0x7F), (-NAN, 0x7F),
    ]
    x = torch.tensor([c[0] for c in cases], dtype=torch.float32)
    q = ref.quantize_fp8(x, 1.0)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert u8(q).tolist() == [c[1] for c in cases]


def test_fp8_with_scale():
    x = torch.tensor([2.125, 2.375, -900.0, 2.0**-8, 1.0], dtype=torch.bfloat16)
    for s in (2.0, torch.tensor([2.0]), torch.tensor(2.0)):
        # 2.125/2 = 1.0625 (tie -> 1.0), 2.375/2 = 1.1875 (tie -> 1.25), -450 -> -448, 2^-9, 0.5
        assert u8(ref.quantize_fp8(x, s)).tolist() == [0x38, 0x3A, 0xFE, 0x01, 0x30]
    deq = ref.dequantize_fp8(ref.quantize_fp8(x, 2.0), torch.tensor([2.0]))
    assert deq.dtype == torch.float32
    assert deq.tolist() == [2.0, 2.5, -896.0, 2.0**-8, 1.0]


def test_fp8_divides_by_scale():
    # fp32 facts: x / s is exactly the tie 1.0625 (-> 1.0), x * (1/s) is one ulp above (-> 1.125).
    x, s = np.float32(4.044388294219971), np.float32(3.806483030319214)
    assert x / s == np.float32(1.0625)
    assert x * (np.float32(1) / s) > np.float32(1.0625)
    q = ref.quantize_fp8(torch.tensor([x, -x]), torch.tensor([s]))
    assert u8(q).tolist() == [0x38, 0xB8]
    assert u8(ref.quantize_fp8(torch.tensor([x]), float(s))).tolist() == [0x38]


def _fp8_inputs(seed, n=100_000):
    g = gen(seed)
    mag = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * 22 - 12)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = (mag * sign).float().numpy()
    fin = E4M3_POS
    mids = ((fin[:-1] + fin[1:]) / 2).astype(np.float32)  # every tie, exact in fp32
    special = np.array([0.0, -0.0, INF, -INF, NAN, 448, 449, 464, 465, 1e30, 2.0**-9, 2.0**-10,
                        2.0**-11, 1e-40], dtype=np.float32)
    extra = np.concatenate([mids, -mids, np.nextafter(mids, np.float32(0)),
                            np.nextafter(mids, np.float32(INF)), fin.astype(np.float32), special])
    return np.concatenate([x, extra]).astype(np.float32)


def test_fp8_vs_independent_encoder():
    x = _fp8_inputs(2)
    got = u8(ref.quantize_fp8(torch.from_numpy(x), 1.0)).numpy()
    np.testing.assert_array_equal(got, e4m3_encode_indep(x))


@pytest.mark.parametrize("s", [0.37, 3.0, 1 / 448])
def test_fp8_scaled_vs_independent_encoder(s):
    x = _fp8_inputs(3)
    s32 = np.float32(s)
    got = u8(ref.quantize_fp8(torch.from_numpy(x), torch.tensor([s32]))).numpy()
    np.testing.assert_array_equal(got, e4m3_encode_indep(x / s32))


def test_fp8_fp16_input_is_widened_exactly():
    g = gen(4)
    x = (torch.randn(4096, generator=g) * 50).half()
    got = u8(ref.quantize_fp8(x, 0.5)).numpy()
    np.testing.assert_array_equal(got, e4m3_encode_indep(x.float().numpy() / np.float32(0.5)))


# ----------------------------------------------------------------- NVFP4


def test_nvfp4_hand_block_scale_1():
    # Block 0: vmax 6 -> sf = 1.0 (0x38), enc 1: codes are e2m1 of the values themselves.
    b0 = [6, -4, 3, -2, 1.5, -1, 0.5, 0, 0.25, 0.75, 1.25, -1.75, 2.5, -3.5, 5, -6]
    c0 = [7, 0xE, 5, 0xC, 3, 0xA, 1, 0, 0, 2, 2, 0xC, 4, 0xE, 6, 0xF]
    # Block 1: vmax 12 -> sf 2.0 (0x40), enc 0.5: 1 -> 0.5; 4.5 -> 2.25 -> 2; 5 -> 2.5 tie -> 2;
    # 7 -> 3.5 tie -> 4; -9 -> -4.5 -> -4; 0.5 -> 0.25 tie -> 0.
    b1 = [12, 1, -1, 4.5, 5, 7, -9, 2] + [0.5] * 8
    c1 = [7, 1, 9, 4, 4, 6, 0xE, 2] + [0] * 8
    # Block 2: vmax 5 -> 5/6 = 0.8333 -> sf 0.8125 (0x35), enc = 1/0.8125 = 1.2307...
    # 5 -> 6.15 -> 6 (7); 2 -> 2.46 -> 2 (4); -2.5 -> -3.08 -> -3 (0xD); 0.3 -> 0.369 -> 0.5 (1)
    b2 = [5, 2, -2.5, 0.3] + [0.0] * 12
    c2 = [7, 4, 0xD, 1] + [0] * 12
    x = torch.tensor([b0 + b1 + b2], dtype=torch.float32)
    q, sf = ref.quantize_nvfp4(x, 1.0, sf_layout="linear")
    assert q.dtype == torch.uint8 and q.shape == (1, 24)
    assert sf.dtype == torch.float8_e4m3fn and sf.shape == (1, 3)
    assert u8(sf).tolist() == [[0x38, 0x40, 0x35]]
    assert unpack(q).tolist() == [c0 + c1 + c2]
    assert q[0, 0].item() == 0xE7 and q[0, 1].item() == 0xC5  # low nibble = even element
    deq = ref.dequantize_nvfp4(q, sf, 1.0, sf_layout="linear")
    vals = [E2M1[c & 7] * (-1 if c & 8 else 1) for c in c0 + c1 + c2]
    sfs = [1.0] * 16 + [2.0] * 16 + [0.8125] * 16
    assert deq.tolist() == [[v * s for v, s in zip(vals, sfs)]]


def test_nvfp4_hand_block_scale_2():
    # scale 2 -> S = 0.5; vmax 24 -> S*vmax/6 = 2 -> sf 2.0; enc = 0.5/2 = 0.25.
    b = [24, -8, 1, 3, -14, 20, 0, 6] + [2.0] * 8
    # 24->6 (7), -8->-2 (0xC), 1->0.25 tie->0, 3->0.75 tie->1.0 (2), -14->-3.5 tie->-4 (0xE),
    # 20->5 tie->4 (6), 0->0, 6->1.5 (3), 2->0.5 (1)
    c = [7, 0xC, 0, 2, 0xE, 6, 0, 3] + [1] * 8
    x = torch.tensor([b], dtype=torch.float16)
    for s in (2.0, torch.tensor([2.0])):
        q, sf = ref.quantize_nvfp4(x, s, sf_layout="linear")
        assert u8(sf).tolist() == [[0x40]]
        assert unpack(q).tolist() == [c]
    deq = ref.dequantize_nvfp4(q, sf, 2.0, sf_layout="linear")
    assert deq[0, :8].tolist() == [24.0, -8.0, 0.0, 4.0, -16.0, 16.0, 0.0, 6.0]


def test_nvfp4_sf_is_rounded_from_s_times_vmax_over_6():
    # fp32 facts: (S * vmax) / 6 is exactly the e4m3 tie 1.0625 (-> 1.0, 0x38), while
    # S * (vmax / 6) lands one ulp above it (-> 1.125, 0x39).
    vmax, scale = np.float32(8.431522369384766), np.float32(1.3225916624069214)
    S = np.float32(1) / scale
    assert (S * vmax) / np.float32(6) == np.float32(1.0625)
    assert S * (vmax / np.float32(6)) > np.float32(1.0625)
    x = torch.full((1, 16), 1.0)
    x[0, 9] = -float(vmax)
    _, sf = ref.quantize_nvfp4(x, torch.tensor([scale]), sf_layout="linear")
    assert u8(sf).tolist() == [[0x38]]


def test_nvfp4_packing_order():
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0   # element 0 -> low nibble of byte 0
    x[0, 3] = -6.0  # element 3 -> high nibble of byte 1
    q, _ = ref.quantize_nvfp4(x, 1.0, sf_layout="linear")
    assert q[0].tolist() == [0x07, 0xF0, 0, 0, 0, 0, 0, 0]


def test_nvfp4_zero_block():
    g = gen(5)
    x = torch.randn(3, 64, generator=g)
    x[1, 16:32] = 0.0
    q, sf = ref.quantize_nvfp4(x, 0.01, sf_layout="linear")
    assert u8(sf)[1, 1].item() == 0
    assert (u8(sf)[[0, 1, 1, 2], [1, 0, 2, 1]] != 0).all()
    assert (q[1, 8:16] == 0).all()
    deq = ref.dequantize_nvfp4(q, sf, 0.01, sf_layout="linear")
    assert (deq[1, 16:32] == 0).all()


@pytest.mark.parametrize("scale", [0.0, 2.0 ** -140])
def test_nvfp4_zero_block_where_the_reciprocal_of_the_scale_overflows(scale):
    """S = 1/scale is Inf for a scale of 0 (which the checks cannot read in a device tensor) or below 2^-128: a
    block of zeros still gets scale factor 0 and codes 0 (Inf * 0 made it NaN, dequantized to NaN), as
    FlashInfer's and TensorRT-LLM's quantizers give it; a block with values saturates to 448."""
    x = torch.zeros(2, 32)
    x[0, 16:] = torch.randn(16, generator=gen(7))
    q, sf = ref.quantize_nvfp4(x, scale, sf_layout="linear")
    assert u8(sf).tolist() == [[0, 0x7E], [0, 0]]
    assert (q[:, :8] == 0).all() and (q[1] == 0).all()


def test_nvfp4_nan_block():
    g = gen(6)
    x = torch.randn(4, 64, generator=g)
    clean = x.clone()
    x[2, 37] = NAN  # block 2 of row 2
    for layout in ("linear", "swizzled"):
        q, sf = ref.quantize_nvfp4(x, 0.003, sf_layout=layout)
        q0, sf0 = ref.quantize_nvfp4(clean, 0.003, sf_layout=layout)
        sfl = u8(sf if layout == "linear" else ref.unswizzle_scale_factors(sf, 4, 4))
        sfl0 = u8(sf0 if layout == "linear" else ref.unswizzle_scale_factors(sf0, 4, 4))
        assert sfl[2, 2].item() == 0x7F
        assert (q[2, 16:24] == 0).all()
        deq = ref.dequantize_nvfp4(q, sf, 0.003, sf_layout=layout)
        assert torch.isnan(deq[2, 32:48]).all()
        # everything else identical to the NaN-free input
        mask = torch.ones(4, 4, dtype=torch.bool)
        mask[2, 2] = False
        assert torch.equal(sfl[mask], sfl0[mask])
        qmask = torch.ones_like(q, dtype=torch.bool)
        qmask[2, 16:24] = False
        assert torch.equal(q[qmask], q0[qmask])
        assert not torch.isnan(deq[:, :32]).any() and not torch.isnan(deq[2, 48:]).any()
        assert not torch.isnan(deq[[0, 1, 3]]).any()


def test_nvfp4_inf_block():
    x = torch.full((1, 32), 0.5)
    x[0, 3] = INF
    x[0, 6] = -INF
    x[0, 7] = -0.5
    q, sf = ref.quantize_nvfp4(x, 1.0, sf_layout="linear")
    assert u8(sf).tolist() == [[0x7E, 0x1B]]  # 448; 0.5/6 = 0.0833 -> 0.0859375 (0x1B)
    codes = unpack(q)[0]
    assert codes[3].item() == 0x7 and codes[6].item() == 0xF
    # enc = 1/448: 0.5 -> 0.0011 -> +0 / -0
    assert codes[[0, 1, 2, 4, 5]].tolist() == [0] * 5 and codes[7].item() == 0x8
    deq = ref.dequantize_nvfp4(q, sf, 1.0, sf_layout="linear")
    assert deq[0, 3].item() == 6 * 448 and deq[0, 6].item() == -6 * 448


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,h", [(5, 64), (130, 208)])
def test_nvfp4_vs_independent(dtype, t, h):
    g = gen(7)
    x = (torch.randn(t, h, generator=g) * torch.exp2(torch.randint(-6, 6, (t, 1), generator=g))).to(dtype)
    x[0, :16] = 0.0
    x[1, 5] = NAN
    x[2, 20] = -INF
    scale = ref.nvfp4_scale_from_amax(x.float().abs().nan_to_num(0, 0, 0).amax())
    q, sf = ref.quantize_nvfp4(x, scale, sf_layout="linear")
    codes, sfb = nvfp4_indep(x.float().numpy(), scale.item())
    np.testing.assert_array_equal(unpack(q).numpy(), codes)
    np.testing.assert_array_equal(u8(sf).numpy(), sfb)


def test_nvfp4_roundtrip_error_bound():
    g = gen(8)
    t, h = 200, 512
    x = torch.randn(t, h, generator=g) * torch.exp2(torch.randint(-3, 4, (t, 1), generator=g))
    scale = ref.nvfp4_scale_from_amax(x.abs().amax())
    q, sf = ref.quantize_nvfp4(x, scale)  # swizzled
    deq = ref.dequantize_nvfp4(q, sf, scale)
    # Bound from independently computed scale factors (no layout involved): in code units the
    # e2m1 rounding error is <= half a step (0.25 below 2, 0.5 below 4, 1 above, incl. the
    # saturation overshoot of at most 6/16 caused by sf rounding down).
    _, sfb = nvfp4_indep(x.numpy(), scale.item())
    sfv = torch.from_numpy(E4M3_VALUES[sfb]).float().repeat_interleave(16, dim=1)
    S = 1 / scale
    xs = (x * S / sfv).abs()
    half_step = torch.where(xs <= 2, 0.25, torch.where(xs <= 4, 0.5, 1.0))
    bound = half_step * sfv * scale * (1 + 1e-5)
    err = (x - deq).abs()
    assert (err <= bound).all()
    assert (err > 0).any()
    rel = (err.norm() / x.norm()).item()
    assert 0.02 < rel < 0.15, rel
    # The same bound with a wrong layout (linear read as swizzled) fails.
    ql, sfl = ref.quantize_nvfp4(x, scale, sf_layout="linear")
    wrong = torch.zeros_like(sf)
    wrong.view(torch.uint8)[: t * h // 16] = u8(sfl).reshape(-1)
    assert not ((x - ref.dequantize_nvfp4(ql, wrong, scale)).abs() <= bound).all()


def test_nvfp4_flattens_leading_dims():
    g = gen(9)
    x = torch.randn(2, 3, 32, generator=g).bfloat16()
    q, sf = ref.quantize_nvfp4(x, 0.01)
    q2, sf2 = ref.quantize_nvfp4(x.reshape(6, 32), 0.01)
    assert q.shape == (6, 16) and torch.equal(q, q2) and torch.equal(u8(sf), u8(sf2))
    assert sf.shape == (128 * 4,)


# ----------------------------------------------------------------- scale-factor layout


def swizzle_map_by_enumeration(t, K):
    """Storage order of the 128x4 layout, walked in order: tile rows, tile cols, then within a
    tile 32 row-groups of (4 sub-rows x 4 cols). Returns {(m, k): flat index}."""
    mt, kt = -(-t // 128), -(-K // 4)
    pos, idx = {}, 0
    for a in range(mt):
        for b in range(kt):
            for r32 in range(32):
                for r4 in range(4):
                    for c in range(4):
                        pos[(a * 128 + r4 * 32 + r32, b * 4 + c)] = idx
                        idx += 1
    return pos, idx


SHAPES = [(1, 1), (5, 3), (128, 4), (130, 6), (257, 9), (300, 16)]


@pytest.mark.parametrize("t,K", SHAPES)
def test_swizzled_index_vs_enumeration(t, K):
    pos, total = swizzle_map_by_enumeration(t, K)
    assert total == (-(-t // 128) * 128) * (-(-K // 4) * 4)
    m = torch.arange(t).unsqueeze(1).expand(t, K)
    k = torch.arange(K).unsqueeze(0).expand(t, K)
    got = ref.swizzled_sf_index(m, k, K)
    want = torch.tensor([[pos[(i, j)] for j in range(K)] for i in range(t)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("t,K", SHAPES)
def test_swizzle_roundtrip_and_padding(t, K):
    g = gen(10)
    sf = torch.randint(1, 0x7F, (t, K), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    flat = ref.swizzle_scale_factors(sf)
    _, total = swizzle_map_by_enumeration(t, K)
    assert flat.dtype == torch.float8_e4m3fn and flat.shape == (total,)
    assert (u8(flat) != 0).sum().item() == t * K  # every padding entry is 0
    back = ref.unswizzle_scale_factors(flat, t, K)
    assert back.dtype == torch.float8_e4m3fn and torch.equal(u8(back), u8(sf))
    pos, _ = swizzle_map_by_enumeration(t, K)
    i, j = t - 1, K - 1
    assert u8(flat)[pos[(i, j)]].item() == u8(sf)[i, j].item()
    f32 = torch.randn(t, K, generator=g)
    assert torch.equal(ref.unswizzle_scale_factors(ref.swizzle_scale_factors(f32), t, K), f32)


@pytest.mark.parametrize("t,h", [(3, 48), (129, 80), (256, 64)])
def test_linear_vs_swizzled_quantize(t, h):
    g = gen(11)
    x = torch.randn(t, h, generator=g).half()
    ql, sfl = ref.quantize_nvfp4(x, 0.002, sf_layout="linear")
    qs, sfs = ref.quantize_nvfp4(x, 0.002, sf_layout="swizzled")
    assert torch.equal(ql, qs)
    assert sfs.shape == (-(-t // 128) * 128 * (-(-(h // 16) // 4) * 4),)
    assert torch.equal(u8(ref.unswizzle_scale_factors(sfs, t, h // 16)), u8(sfl))
    assert torch.equal(ref.dequantize_nvfp4(ql, sfl, 0.002, "linear"),
                       ref.dequantize_nvfp4(qs, sfs, 0.002, "swizzled"))


# ----------------------------------------------------------------- norm, residual, all-reduce


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_all_reduce_sum(dtype):
    g = gen(12)
    xs = [torch.randn(64, 256, generator=g).to(dtype) for _ in range(4)]
    got = ref.all_reduce_sum(xs)
    exact = sum(x.double() for x in xs)
    assert got.dtype == dtype and got.shape == (64, 256)
    assert ((got.double() - exact).abs() <= ulp(got)).all()
    # accumulation in list order in fp32: big + small rounds back to big, so the order shows
    big, small = (2048.0, 2.0**-14) if dtype == torch.float16 else (2.0**24, 1.0)
    b, s, nb = (torch.tensor([v], dtype=dtype) for v in (big, small, -big))
    assert ref.all_reduce_sum([b, s, nb]).item() == 0.0
    assert ref.all_reduce_sum([b, nb, s]).item() == small


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_residual_add(dtype):
    g = gen(13)
    a = torch.randn(32, 128, generator=g).to(dtype)
    r = (torch.randn(32, 128, generator=g) * 4).to(dtype)
    got = ref.residual_add(a, r)
    assert got.dtype == dtype
    assert torch.equal(got, (a.double() + r.double()).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm(dtype):
    g = gen(14)
    x = (torch.randn(2, 40, 512, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(512, generator=g)).to(dtype)
    got = ref.rmsnorm(x, w, 1e-5)
    xd = x.double()
    want = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert got.dtype == dtype and got.shape == x.shape
    assert ((got.double() - want).abs() <= ulp(got)).all()
    # hand values: [3, 4] -> rms = sqrt(12.5); with eps 0.5, sqrt(13); a zero row stays 0
    hv = ref.rmsnorm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0]), 0.0)
    assert torch.allclose(hv, torch.tensor([[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]]), rtol=1e-6)
    hv = ref.rmsnorm(torch.tensor([[3.0, 4.0], [0.0, 0.0]]), torch.tensor([1.0, 2.0]), 0.5)
    assert torch.allclose(hv, torch.tensor([[3 / math.sqrt(13), 8 / math.sqrt(13)], [0.0, 0.0]]), rtol=1e-6)
    # rows whose mean square is of eps's order: eps itself shows in every element
    small = (torch.randn(64, 512, generator=g) * 1e-3).to(dtype)
    for eps in (1e-6, 4e-6):
        got = ref.rmsnorm(small, w, eps).double()
        sd = small.double()
        want = sd / torch.sqrt((sd * sd).mean(-1, keepdim=True) + eps) * w.double()
        assert ((got - want).abs() <= ulp(got.to(dtype))).all(), eps


def test_the_oracle_does_not_depend_on_strides():
    """A transposed view (its rows strided) gives the bits of its dense copy: the mean of squares is summed
    in a dense row's order. Over many small row counts, where torch's reduction of a strided last dim would
    sum in another order."""
    g = gen(16)
    for t in range(1, 9):
        for _ in range(5):
            a = torch.randn(256, t, generator=g).to(torch.bfloat16).t()
            r = torch.randn(t, 256, generator=g).to(torch.bfloat16)
            w = torch.randn(256, generator=g).to(torch.bfloat16)
            strided, dense = ref.fused_tail(a, r, w), ref.fused_tail(a.contiguous(), r, w)
            assert torch.equal(strided.norm.view(torch.int16), dense.norm.view(torch.int16)), t
            assert torch.equal(ref.rmsnorm(a, w).view(torch.int16), ref.rmsnorm(a.contiguous(), w).view(torch.int16))


# ----------------------------------------------------------------- fused_tail


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_a_post_weight_normalises_the_sum_before_the_residual_add(dtype, weight_offset):
    """post_weight (docs/semantics.md section 2a): the sum a is replaced by its RMSNorm with the post weight, the
    tail's eps and weight offset, rounded to T, before the residual add. Checked against a float64 computation of
    the same steps, each rounded to T where the semantics round (the post-norm, the residual): within 1 ulp of T
    for the post-norm and the norm; the residual then within the ulp of a' plus its own rounding."""
    g = gen(17)
    a = (torch.randn(8, 256, generator=g) * 3).to(dtype)
    r = torch.randn(8, 256, generator=g).to(dtype)
    w = (0.1 * torch.randn(256, generator=g) + (0.0 if weight_offset else 1.0)).to(dtype)
    post = (0.1 * torch.randn(256, generator=g) + (0.0 if weight_offset else 1.0)).to(dtype)
    eps = 1e-6

    def norm64(x, weight):
        xd = x.double()
        return xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * (weight.double() + weight_offset)

    got = ref.fused_tail(a, r, w, eps, weight_offset=weight_offset, post_weight=post)
    a_post = norm64(a, post)
    assert ((ref.rmsnorm(a, post, eps, weight_offset).double() - a_post).abs() <= ulp(a_post.to(dtype))).all()
    residual = a_post + r.double()
    assert ((got.residual.double() - residual).abs() <= 2 * ulp(residual.to(dtype)) + ulp(a_post.to(dtype))).all()
    want = norm64(got.residual, w)
    assert ((got.norm.double() - want).abs() <= ulp(want.to(dtype))).all()
    # the same as the tail of the post-norm, and not the tail of a itself
    composed = ref.fused_tail(ref.rmsnorm(a, post, eps, weight_offset), r, w, eps, weight_offset=weight_offset)
    assert torch.equal(got.residual, composed.residual) and torch.equal(got.norm, composed.norm)
    assert not torch.equal(got.residual, ref.fused_tail(a, r, w, eps, weight_offset=weight_offset).residual)


def test_a_post_weight_matches_gemma3_decoder_layer_math():
    """Gemma 3's decoder layer as transformers writes it (post_attention_layernorm of the sum, + residual,
    pre_feedforward_layernorm; Gemma3RMSNorm: float32, (1 + w)) against fused_tail(..., weight_offset=1.0,
    post_weight=): the residual and the norm within 1 ulp of bf16 (the mean's order of summation aside, the same
    operations)."""
    modeling = pytest.importorskip("transformers.models.gemma3.modeling_gemma3",
                                   reason="the Gemma 3 comparison needs transformers")
    g = gen(18)
    h, eps = 256, 1e-6
    post_norm, pre_norm = modeling.Gemma3RMSNorm(h, eps), modeling.Gemma3RMSNorm(h, eps)
    with torch.no_grad():
        post_norm.weight.copy_(0.1 * torch.randn(h, generator=g))
        pre_norm.weight.copy_(0.1 * torch.randn(h, generator=g))
    post_norm, pre_norm = post_norm.bfloat16(), pre_norm.bfloat16()  # a bf16 model's
    a = (torch.randn(8, h, generator=g) * 3).bfloat16()
    r = torch.randn(8, h, generator=g).bfloat16()
    with torch.no_grad():
        residual = r + post_norm(a)
        norm = pre_norm(residual)
    got = ref.fused_tail(a, r, pre_norm.weight, eps, weight_offset=1.0, post_weight=post_norm.weight)
    assert ((got.residual.double() - residual.double()).abs() <= 2 * ulp(residual)).all()
    assert ((got.norm.double() - norm.double()).abs() <= 2 * ulp(norm)).all()


def test_a_post_norm_residual_may_be_off_by_an_ulp_of_the_post_normed_sum():
    """tolerance.post_residual_within (section 2a): a post-norm an ulp of bf16 off (a' 2 -> 2 + 2^-6) moves
    r = a' + residual by that ulp, 8 of r's own (-0.46875 -> -0.453125): within the bound, where 2 ulps of r are
    not; a' two ulps off, or r an ulp of a' and two of its own off, is beyond it."""
    from commfuse import tolerance

    bf = dict(dtype=torch.bfloat16)
    post_normed, residual = torch.tensor([2.0, 0.5], **bf), torch.tensor([-2.46875, 0.25], **bf)
    want = post_normed + residual
    up = torch.nextafter(post_normed, torch.full_like(post_normed, INF))
    got = up + residual
    assert got[0].item() == -0.453125 and tolerance.within_ulp(got, want, 2, "residual") is not None
    assert tolerance.post_residual_within(got, want, post_normed, "residual") is None
    beyond = torch.nextafter(up, torch.full_like(up, INF)) + residual
    assert "beyond ulp(a') + ulp(r)" in tolerance.post_residual_within(beyond, want, post_normed, "residual")
    off = torch.nextafter(torch.nextafter(got, torch.full_like(got, INF)), torch.full_like(got, INF))
    assert tolerance.post_residual_within(off, want, post_normed, "residual") is not None
    assert "NaN" in tolerance.post_residual_within(torch.full_like(want, float("nan")), want, post_normed, "r")


def _tail_inputs(dtype=torch.bfloat16, shape=(2, 3, 128), seed=15):
    g = gen(seed)
    a = torch.randn(*shape, generator=g).to(dtype)
    r = torch.randn(*shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    return a, r, w


@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4"])
@pytest.mark.parametrize("return_norm", [False, True])
@pytest.mark.parametrize("layout", ["swizzled", "linear"])
def test_fused_tail_structure(quant, return_norm, layout):
    a, r, w = _tail_inputs()
    scale = torch.tensor([0.004])
    if layout == "linear" and quant != "nvfp4":  # the layout of NVFP4's (and MXFP8's) scale factors only
        with pytest.raises(ValueError, match="sf_layout='linear'"):
            ref.fused_tail(a, r, w, 1e-6, quant=quant, scale=scale, return_norm=return_norm, sf_layout=layout)
        return
    out = ref.fused_tail(a, r, w, 1e-6, quant=quant, scale=scale, return_norm=return_norm,
                         sf_layout=layout)
    assert isinstance(out, ref.Tail) and out._fields == ("residual", "norm", "quant", "scale_factors", "scales")
    assert out.scales is None  # only the FP8 kinds with computed scales fill it
    res = ref.residual_add(a.reshape(6, 128), r.reshape(6, 128))
    norm = ref.rmsnorm(res, w, 1e-6)
    assert out.residual.shape == (6, 128) and torch.equal(out.residual, res)
    if quant is None or return_norm:
        assert out.norm.shape == (6, 128) and torch.equal(out.norm, norm)
    else:
        assert out.norm is None
    if quant is None:
        assert out.quant is None and out.scale_factors is None
    elif quant == "fp8":
        assert out.quant.dtype == torch.float8_e4m3fn and out.quant.shape == (6, 128)
        assert torch.equal(u8(out.quant), u8(ref.quantize_fp8(norm, scale)))
        assert out.scale_factors is None
    else:
        q, sf = ref.quantize_nvfp4(norm, scale, layout)
        assert out.quant.dtype == torch.uint8 and out.quant.shape == (6, 64)
        assert torch.equal(out.quant, q) and torch.equal(u8(out.scale_factors), u8(sf))
        assert out.scale_factors.shape == ((128 * 8,) if layout == "swizzled" else (6, 8))


def test_fused_tail_quantizes_the_rounded_norm():
    a, r, w = _tail_inputs(shape=(64, 256), seed=16)
    res = ref.residual_add(a, r)
    xf = res.float()
    norm32 = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6) * w.float()
    out = ref.fused_tail(a, r, w, quant="fp8", scale=0.01)
    via_rounded = ref.quantize_fp8(norm32.to(torch.bfloat16), 0.01)
    via_fp32 = ref.quantize_fp8(norm32, 0.01)
    assert torch.equal(u8(out.quant), u8(via_rounded))
    assert not torch.equal(u8(out.quant), u8(via_fp32))  # double rounding does show up


def test_nan_propagates_through_tail():
    a, r, w = _tail_inputs(shape=(4, 64), seed=17)
    a[1, 10] = NAN
    out = ref.fused_tail(a, r, w, quant="fp8", scale=0.01, return_norm=True)
    assert torch.isnan(out.residual[1, 10]) and torch.isnan(out.norm[1]).all()
    assert (u8(out.quant)[1] == 0x7F).all() and not torch.isnan(out.norm[[0, 2, 3]]).any()
    out = ref.fused_tail(a, r, w, quant="nvfp4", scale=0.001, sf_layout="linear")
    assert (u8(out.scale_factors)[1] == 0x7F).all() and (out.quant[1] == 0).all()
    assert not (u8(out.scale_factors)[[0, 2, 3]] == 0x7F).any()


def test_inputs_not_modified():
    a, r, w = _tail_inputs(dtype=torch.float16, shape=(8, 64), seed=18)
    a[0, 0] = NAN
    s = torch.tensor([0.01])
    xs = [a, r, a.clone()]
    keep = [t.clone() for t in (a, r, w, s)]
    ref.all_reduce_sum(xs)
    ref.all_reduce_sum([a.float()])
    ref.residual_add(a, r)
    ref.rmsnorm(a, w, 1e-6)
    ref.quantize_fp8(a, s)
    q, sf = ref.quantize_nvfp4(a, s)
    qc, sfc = q.clone(), u8(sf).clone()
    ref.dequantize_nvfp4(q, sf, s)
    ref.unswizzle_scale_factors(sf, 8, 4)
    for quant in (None, "fp8", "nvfp4"):
        ref.fused_tail(a, r, w, quant=quant, scale=s, return_norm=True)
    for before, after in zip(keep, (a, r, w, s)):
        assert torch.equal(bits(before), bits(after))
    assert torch.equal(q, qc) and torch.equal(u8(sf), sfc)
    # fp32 single-rank all-reduce returns a fresh tensor, not an alias
    x = torch.randn(4, 16, generator=gen(19))
    y = ref.all_reduce_sum([x])
    assert torch.equal(x, y) and y.data_ptr() != x.data_ptr()


def test_bad_arguments():
    a, r, w = _tail_inputs(shape=(4, 64))
    with pytest.raises(ValueError, match="quant"):
        ref.fused_tail(a, r, w, quant="int8", scale=1.0)
    with pytest.raises(ValueError, match="sf_layout"):
        ref.fused_tail(a, r, w, quant="nvfp4", scale=1.0, sf_layout="tiled")
    with pytest.raises(ValueError, match="sf_layout"):
        ref.quantize_nvfp4(a, 1.0, sf_layout="row")
    q, sf = ref.quantize_nvfp4(a, 1.0)
    with pytest.raises(ValueError, match="sf_layout"):
        ref.dequantize_nvfp4(q, sf, 1.0, sf_layout="row")
    # an option the format does not take is refused, as by the public calls, not ignored
    for quant, scale in (("fp8", 1.0), ("fp8_per_token", None), ("fp8_block", None)):
        with pytest.raises(ValueError, match="sf_layout='linear' applies to quant 'nvfp4' / 'mxfp8' only"):
            ref.fused_tail(a, r, w, quant=quant, scale=scale, sf_layout="linear")
    for options in (dict(sf_layout="linear"), dict(scale_layout="mn_major"), dict(scale_ue8m0=True)):
        with pytest.raises(ValueError, match="without quant"):
            ref.fused_tail(a, r, w, **options)


def test_operands_that_torch_would_broadcast_or_promote_are_refused():
    """The oracle answers no call that the library refuses: a [1, h] residual, a [1] or per-row weight, a
    partial of another dtype would each give a result through torch's broadcasting or promotion."""
    a, r, w = _tail_inputs(shape=(4, 64))
    for bad, match in ((dict(residual=r[:1]), r"residual must have a's shape \(4, 64\), got \(1, 64\)"),
                       (dict(residual=r.reshape(8, 32)), r"residual must have a's shape \(4, 64\), got \(8, 32\)"),
                       (dict(residual=r.half()), "residual must have a's dtype torch.bfloat16, got torch.float16"),
                       (dict(weight=w[:1]), r"weight must be \[64\] \(the hidden size\) on cpu, got \[1\]"),
                       (dict(weight=a), r"weight must be \[64\] .* got \[4, 64\]")):
        with pytest.raises(ValueError, match=match):
            ref.fused_tail(**{"a": a, "residual": r, "weight": w, **bad})
    with pytest.raises(ValueError, match=r"weight must be \[64\]"):
        ref.rmsnorm(a, w[:32])
    with pytest.raises(ValueError, match=r"weight must be \[64\]"):
        ref.gated_rmsnorm(a, None, w[:1], 1e-6, 16, False)
    with pytest.raises(ValueError, match=r"z must have x's shape"):
        ref.gated_rmsnorm(a, a[:1], w, 1e-6, 16, False)
    for other, match in ((a.half(), "xs\\[1\\] must have xs\\[0\\]'s dtype"),
                         (a[:1], "xs\\[1\\] must have xs\\[0\\]'s shape")):
        with pytest.raises(ValueError, match=match):
            ref.all_reduce_sum([a, other])


# ----------------------------------------------------------------- scale helpers


def test_scale_helpers_values_and_kinds():
    assert ref.nvfp4_scale_from_amax(2688.0) == 1.0 and isinstance(ref.nvfp4_scale_from_amax(2688.0), float)
    assert ref.fp8_scale_from_amax(448.0) == 1.0 and isinstance(ref.fp8_scale_from_amax(448.0), float)
    assert ref.scale_from_inverse(4.0) == 0.25
    t = torch.tensor([896.0])
    assert isinstance(ref.fp8_scale_from_amax(t), torch.Tensor) and ref.fp8_scale_from_amax(t).item() == 2.0
    assert isinstance(ref.scale_from_inverse(t), torch.Tensor)
    assert ref.scale_from_inverse(t).item() == torch.tensor(1 / 896).item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_scales_from_amax_are_true_divisions_on_every_device(device):
    """amax / 448 and amax / 2688 rounded once, as docs/semantics.md says, on CUDA too: there torch turns a division
    by a Python number into a multiply by its rounded reciprocal, one ulp off for about half of all amax. Checked
    against the float64 quotient rounded to float32 (exact: a float32 quotient rounds once either way)."""
    g = torch.Generator().manual_seed(7)
    amax = torch.cat([torch.rand(4096, generator=g) * 1000, 1 + torch.arange(4096) / 4096])  # every kind of mantissa
    for helper, d in ((ref.fp8_scale_from_amax, 448.0), (ref.nvfp4_scale_from_amax, 2688.0)):
        got = helper(amax.to(device)).cpu()
        want = (amax.double() / d).float()
        assert torch.equal(got, want), (helper.__name__, int((got != want).sum()))


def test_scale_helpers_refuse_a_number_that_gives_no_scale():
    """A python amax or inverse scale of 0, below 0, Inf or NaN would give a scale the calls refuse (or a bare
    ZeroDivisionError): the helpers say which argument."""
    for bad in (0.0, -1.0, INF, NAN, 0):
        for helper in (ref.fp8_scale_from_amax, ref.nvfp4_scale_from_amax):
            with pytest.raises(ValueError, match="amax must be a positive finite number"):
                helper(bad)
        with pytest.raises(ValueError, match="inv_scale must be a positive finite number"):
            ref.scale_from_inverse(bad)
    assert ref.fp8_scale_from_amax(448) == 1.0  # an int is a number too


def test_scale_from_inverse_matches_amax_convention():
    g = gen(20)
    x = torch.randn(64, 256, generator=g)
    # exactly representable conversions: bit-identical quantization
    for amax in (torch.tensor([2688.0 * 4]), torch.tensor([2688.0 / 64]), 5376.0):
        inv = 2688.0 / amax
        a = ref.quantize_nvfp4(x, ref.scale_from_inverse(inv))
        b = ref.quantize_nvfp4(x, ref.nvfp4_scale_from_amax(amax))
        assert torch.equal(a[0], b[0]) and torch.equal(u8(a[1]), u8(b[1]))
    # general amax: the two scales agree to within one fp32 ulp, and so do the results
    for amax in (x.abs().amax(), torch.tensor(3.7)):
        s1 = ref.scale_from_inverse(2688.0 / amax)
        s2 = ref.nvfp4_scale_from_amax(amax)
        assert abs(s1.item() - s2.item()) <= ulp(s2).item()
        a = ref.quantize_nvfp4(x, s1, "linear")
        b = ref.quantize_nvfp4(x, s2, "linear")
        assert (unpack(a[0]) != unpack(b[0])).float().mean().item() <= 1e-3
        assert (u8(a[1]) != u8(b[1])).float().mean().item() <= 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    a, r, w = _tail_inputs(shape=(300, 256), seed=21)
    a[3, 7] = NAN
    for quant in ("fp8", "nvfp4"):
        cpu = ref.fused_tail(a, r, w, quant=quant, scale=torch.tensor([0.002]), return_norm=True)
        gpu = ref.fused_tail(a.cuda(), r.cuda(), w.cuda(), quant=quant,
                             scale=torch.tensor([0.002], device="cuda"), return_norm=True)
        # The norm's mean and rsqrt round differently on the two devices (1 ulp of T at most);
        # quantization of the same values is exact on both (true divisions).
        assert_tail_close(Tail(*(None if d is None else d.cpu() for d in gpu)), cpu, quant, scale=torch.tensor([0.002]))
        quantize = ref.quantize_nvfp4 if quant == "nvfp4" else lambda n, s: (ref.quantize_fp8(n, s),)
        for c, d in zip(quantize(gpu.norm, 0.002), quantize(gpu.norm.cpu(), 0.002)):
            assert torch.equal(u8(c).cpu(), u8(d))
    x = torch.from_numpy(_fp8_inputs(22))
    assert torch.equal(u8(ref.quantize_fp8(x.cuda(), 1.0)).cpu(), u8(ref.quantize_fp8(x, 1.0)))
