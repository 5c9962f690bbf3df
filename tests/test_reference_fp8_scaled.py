"""Tests of commfuse.reference's FP8 with computed scales (quant "fp8_per_token" / "fp8_block"),
the scale layouts, RMSNorm's weight_offset, and the tolerance on computed scales.

CPU, single process, seconds. The independent quantizer below is written from docs/semantics.md
section 10 in numpy (float64 divisions rounded once to fp32, which is the correctly rounded fp32
quotient; UE8M0 through math.frexp, not through the fp32 bits), and the layouts from section 11 by
enumeration, not from the module's code.
"""
import math

import numpy as np
import pytest
import torch

from commfuse import reference as ref
from commfuse import tolerance

from test_reference import E4M3_VALUES, e4m3_encode_indep

INF = float("inf")
NAN = float("nan")
TINY = 2.0**-126


def gen(seed):
    return torch.Generator().manual_seed(seed)


def u8(t):
    return t.view(torch.uint8)


def i32(t):
    return t.contiguous().view(torch.int32)


def same_bits(a, b):
    """Same shape, dtype and bytes (NaN included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


# ----------------------------------------------------------------- independent quantizer


def ue8m0_indep(s):
    """float32 array of scales (>= 2^-126, Inf or NaN) -> (UE8M0 bytes, 2^ceil(log2 s) as float32)."""
    s = np.asarray(s, dtype=np.float32)
    E = np.empty(s.shape, dtype=np.int64)
    flat_s, flat_E = s.reshape(-1), E.reshape(-1)
    for i, v in enumerate(flat_s.astype(np.float64)):  # a few hundred scales: a loop is clearer here
        if not math.isfinite(v):
            flat_E[i] = 255
        else:
            m, e = math.frexp(v)  # v = m 2^e, m in [0.5, 1)
            flat_E[i] = (e - 1 if m == 0.5 else e) + 127
    sp = np.where(E == 255, np.float32(INF), np.ldexp(1.0, E - 127)).astype(np.float32)
    sp = np.where(np.isnan(s), np.float32(NAN), sp)
    return E.astype(np.uint8), sp


def groups_indep(g, ue8m0=False):
    """g: float32 array [t, G, n] -> (codes uint8 [t, G, n], scales float32 [t, G], bytes or None)."""
    g = np.asarray(g, dtype=np.float32)
    amax = np.abs(g).max(-1)  # NaN propagates
    s = (amax.astype(np.float64) / 448.0).astype(np.float32)
    s = np.maximum(s, np.float32(TINY))  # NaN propagates
    E, sq = (None, s)
    if ue8m0:
        E, sq = ue8m0_indep(s)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = (g.astype(np.float64) / sq.astype(np.float64)[..., None]).astype(np.float32)
    q = np.where(np.isinf(g) & np.isinf(sq)[..., None], g, q)
    return e4m3_encode_indep(q), s, E


def random_rows(dtype, t, h, seed):
    """Seeded [t, h] rows of `dtype` with magnitudes 2^-30 .. 2^30 per row, never all zeros."""
    g = gen(seed)
    x = torch.randn(t, h, generator=g) * torch.exp2(torch.randint(-30, 31, (t, 1), generator=g).float())
    if dtype == torch.float16:
        x = torch.randn(t, h, generator=g) * torch.exp2(torch.randint(-12, 8, (t, 1), generator=g).float())
    return x.to(dtype)


def with_special_rows(x):
    """x with a zero row, a NaN row, an Inf row (no NaN) and an all-negative row, where t allows."""
    x = x.clone()
    t, h = x.shape
    if t >= 4:
        x[0] = 0.0
        x[1, h // 3] = NAN
        x[2, 5] = INF
        x[2, h - 1] = -INF
        x[3] = -x[3].abs()
    return x


# ----------------------------------------------------------------- hand-derived vectors

# (value, code) with the scale exactly 1: RNE ties, subnormal e4m3 results, signed zero.
HAND = [
    (448.0, 0x7E),            # the amax: 448 / 1
    (1.0625, 0x38),           # tie 1.0 | 1.125 -> even 1.0
    (1.1875, 0x3A),           # tie 1.125 | 1.25 -> even 1.25
    (432.0, 0x7E),            # tie 416 | 448 -> even 448
    (2.0**-10, 0x00),         # tie 0 | 2^-9 -> even 0
    (3 * 2.0**-10, 0x02),     # tie 2^-9 | 2^-8 -> even code 2
    (2.0**-9, 0x01),          # smallest subnormal
    (3 * 2.0**-9, 0x03),      # subnormal
    (7 * 2.0**-9, 0x07),      # largest subnormal
    (15 * 2.0**-10, 0x08),    # tie 7 * 2^-9 | 2^-6 -> even, the smallest normal
    (2.0**-6, 0x08),
    (-1.1875, 0xBA),
    (-0.0, 0x80),
    (0.0, 0x00),
]


def hand_row(h=128, factor=1.0):
    x = torch.zeros(h)
    x[: len(HAND)] = torch.tensor([v for v, _ in HAND]) * factor
    return x


@pytest.mark.parametrize("factor,scale", [(1.0, 1.0), (2.0, 2.0), (2.0**-20, 2.0**-20)])
def test_per_token_hand_ties_and_subnormals(factor, scale):
    # amax = 448 * factor, so s = factor exactly and the codes are those of the table.
    x = hand_row(factor=factor).bfloat16().unsqueeze(0)
    q, s = ref.quantize_fp8_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1, 128)
    assert s.dtype == torch.float32 and s.shape == (1,) and s.item() == scale
    assert u8(q)[0, : len(HAND)].tolist() == [c for _, c in HAND]
    assert (u8(q)[0, len(HAND):] == 0).all()
    deq = ref.dequantize_fp8_per_token(q, s)
    assert deq[0, 0].item() == 448 * factor and deq[0, 1].item() == 1.0 * factor


def test_per_token_true_division():
    # fp32 facts (test_reference.test_fp8_divides_by_scale): x / s is the tie 1.0625 (-> 1.0) but
    # x * (1/s) is one ulp above it (-> 1.125). With the row's amax 448 s, s is computed exactly.
    x, s = np.float32(4.044388294219971), np.float32(3.806483030319214)
    amax = np.float32(448) * s
    assert np.float32(amax / np.float32(448)) == s and x / s == np.float32(1.0625)
    row = torch.tensor([[amax, x, -x]], dtype=torch.float32)
    q, sc = ref.quantize_fp8_per_token(row)
    assert sc.item() == s and u8(q).tolist() == [[0x7E, 0x38, 0xB8]]


def test_zero_nan_inf_rows_per_token():
    x = torch.ones(5, 128)
    x[0] = 0.0
    x[0, 7] = -0.0
    x[1, 3] = NAN
    x[2, :4] = torch.tensor([INF, 1.0, -INF, -2.0])
    x[3, :2] = torch.tensor([INF, NAN])  # NaN wins over Inf
    x[4, 0] = 448.0
    q, s = ref.quantize_fp8_per_token(x.bfloat16())
    b = u8(q)
    assert s[0].item() == TINY  # a row of zeros: the smallest normal fp32, not 0, not NaN
    assert (b[0] == 0).sum() == 127 and b[0, 7].item() == 0x80
    assert math.isnan(s[1].item()) and (b[1] == 0x7F).all()
    assert s[2].item() == INF
    assert b[2, :4].tolist() == [0x7E, 0x00, 0xFE, 0x80] and (b[2, 4:] == 0).all()
    assert math.isnan(s[3].item()) and (b[3] == 0x7F).all()
    assert s[4].item() == 1.0 and b[4, 0].item() == 0x7E and (b[4, 1:] == 0x38).all()
    deq = ref.dequantize_fp8_per_token(q, s)
    assert (deq[0] == 0).all()
    assert torch.isnan(deq[1]).all() and torch.isnan(deq[3]).all()
    # Inf row: +-Inf where the Inf were, NaN elsewhere: never a finite number
    assert deq[2, 0].item() == INF and deq[2, 2].item() == -INF
    assert torch.isnan(deq[2, [1, 3]]).all() and torch.isnan(deq[2, 4:]).all()


def test_tiny_rows_get_the_floor_scale():
    # fp32 rows whose amax / 448 is subnormal or underflows: s = 2^-126, an exact power-of-two scaling
    x = torch.zeros(3, 128)
    x[0, :2] = torch.tensor([2.0**-130, -(2.0**-131)])
    x[1, 0] = 2.0**-149                  # amax / 448 rounds to 0 in fp32
    x[2, 0] = 448 * 2.0**-126            # exactly at the floor: not clamped, s = 2^-126 anyway
    x[2, 1] = 2.0**-126
    assert np.float32(np.float32(2.0**-149) / np.float32(448)) == 0.0
    q, s = ref.quantize_fp8_per_token(x)
    assert s.tolist() == [TINY] * 3
    assert u8(q)[0, :3].tolist() == [0x18, 0x90, 0x00]  # 2^-4, -2^-5, 0
    assert u8(q)[1, 0].item() == 0x00                     # 2^-23: below half the smallest subnormal
    assert u8(q)[2, :2].tolist() == [0x7E, 0x38]          # 448, 1
    assert not torch.isnan(ref.dequantize_fp8_per_token(q, s)).any()


def test_block_hand_and_ue8m0_powers_of_two():
    # row 0: block 0 the hand row (amax 448), block 1 amax 56 (s = 2^-3 exactly)
    # row 1: block 0 amax 56.25 (s just above 2^-3), block 1 amax 2 (s = RN(1/224))
    x = torch.zeros(2, 256)
    x[0, :128] = hand_row()
    x[0, 128] = 56.0
    x[0, 129] = 7.0
    x[1, 0] = 56.25
    x[1, 128] = 2.0
    x[1, 129] = -1.0
    x = x.bfloat16()
    q, s = ref.quantize_fp8_block(x)
    assert s.shape == (2, 2) and s.dtype == torch.float32
    s_56_25 = np.float32(np.float32(56.25) / np.float32(448))
    s_2 = np.float32(np.float32(2) / np.float32(448))
    assert s.tolist() == [[1.0, 0.125], [float(s_56_25), float(s_2)]]
    b = u8(q)
    assert b[0, : len(HAND)].tolist() == [c for _, c in HAND]
    assert b[0, 128:130].tolist() == [0x7E, 0x66]  # 448; 7 / 0.125 = 56 = 1.75 * 2^5: e = 12, m = 6
    assert b[1, 0].item() == 0x7E and b[1, 128].item() == 0x7E  # the amax lands at 448
    assert b[1, 129].item() == 0xF6  # -1 / RN(2/448) = -223.99998 -> -224

    qu, E = ref.quantize_fp8_block(x, scale_ue8m0=True)
    assert E.dtype == torch.uint8 and E.shape == (2, 2)
    # 1 = 2^0 -> 127; 2^-3 exactly -> 124 (not bumped); 56.25/448 > 2^-3 -> 2^-2 -> 125;
    # RN(2/448) = 0.0044642859 -> 2^-7 -> 120
    assert E.tolist() == [[127, 124], [125, 120]]
    bu = u8(qu)
    assert bu[0, : len(HAND)].tolist() == [c for _, c in HAND]
    assert bu[0, 128:130].tolist() == [0x7E, 0x66]
    assert bu[1, 0].item() == 0x76        # 56.25 / 0.25 = 225 -> 224 (1.75 * 2^7), no saturation
    assert bu[1, 128].item() == 0x78      # 2 / 2^-7 = 256
    assert bu[1, 129].item() == 0xF0      # -1 / 2^-7 = -128
    deq = ref.dequantize_fp8_block(qu, E, scale_ue8m0=True)
    assert deq[1, 0].item() == 56.0 and deq[1, 128].item() == 2.0 and deq[1, 129].item() == -1.0


def test_block_special_blocks_are_local():
    x = torch.ones(3, 384).bfloat16()
    x[0, 128:256] = 0.0          # a zero block
    x[1, 300] = NAN              # a NaN block
    x[2, 5] = -INF               # an Inf block
    for ue in (False, True):
        q, sc = ref.quantize_fp8_block(x, scale_ue8m0=ue)
        b = u8(q).reshape(3, 3, 128)
        if ue:
            assert sc.tolist() == [[119, 1, 119], [119, 119, 0xFF], [0xFF, 119, 119]]  # RN(1/448) -> 2^-8
        else:
            s1 = float(np.float32(np.float32(1) / np.float32(448)))
            assert sc[0].tolist() == [s1, TINY, s1] and sc[2, 0].item() == INF
            assert math.isnan(sc[1, 2].item()) and sc[1, :2].tolist() == [s1, s1]
        ones = 0x7E if not ue else 0x78  # 1 / RN(1/448) -> 448; 1 / 2^-8 = 256
        assert (b[0, 0] == ones).all() and (b[0, 1] == 0).all() and (b[0, 2] == ones).all()
        assert (b[1, 2] == 0x7F).all() and (b[1, :2] == ones).all()
        assert b[2, 0, 5].item() == 0xFE and (b[2, 0, :5] == 0).all() and (b[2, 1:] == ones).all()
        deq = ref.dequantize_fp8_block(q, sc, scale_ue8m0=ue)
        assert torch.isnan(deq[1, 256:]).all() and not torch.isnan(deq[1, :256]).any()
        assert (deq[0, 128:256] == 0).all()
        if ue:
            assert torch.isnan(deq[2, :128]).all()  # UE8M0 has no Inf: 0xFF reads as NaN
        else:
            assert deq[2, 5].item() == -INF and torch.isnan(deq[2, :5]).all()
        assert (deq[2, 128:] == 1).all()


def test_ue8m0_never_saturates():
    # |q| <= amax / s' <= amax / s <= 448 (1 + 2^-24): the nearest e4m3 value, never a clamp;
    # the element at the amax lands in [224, 448].
    x = random_rows(torch.bfloat16, 64, 1024, seed=31)
    q, E = ref.quantize_fp8_block(x, scale_ue8m0=True)
    sp = ref.ue8m0_to_scale(E).double()
    blocks = x.double().reshape(64, 8, 128)
    ratio = (blocks.abs() / sp.unsqueeze(-1))
    assert ratio.max().item() <= 448.0
    at_amax = ratio.amax(-1)
    assert (at_amax >= 224).all() and (at_amax <= 448).all()
    vals = torch.from_numpy(E4M3_VALUES[u8(q).numpy()]).reshape(64, 8, 128).abs()
    assert (vals.amax(-1) >= 224).all()
    # the codes are the unsaturated nearest values: within half an e4m3 step (2^-4 relative) of q
    qv = (blocks / sp.unsqueeze(-1))
    assert ((vals - qv.abs()).abs() <= qv.abs() * 2.0**-4 + 2.0**-10).all()


def test_ue8m0_from_scale_by_bits_vs_frexp():
    g = gen(32)
    bits = torch.randint(0x00800000, 0x7F800000, (20000,), generator=g, dtype=torch.int32)
    s = torch.cat([bits.view(torch.float32),
                   torch.tensor([TINY, 2.0**-125, 1.0, 1.0000001, 0.9999999, 2.0**127,
                                 448.0, 3.4028234663852886e38 / 448, INF, NAN])])
    s = s[s <= 2.0**127]  # ceil above 2^127 is not a UE8M0 value (documented: 0xFF)
    s = torch.cat([s, torch.tensor([NAN, INF])])
    E = ref.ue8m0_from_scale(s)
    want, sp = ue8m0_indep(s.numpy())
    np.testing.assert_array_equal(E.numpy(), want)
    back = ref.ue8m0_to_scale(E)
    fin = E != 0xFF
    np.testing.assert_array_equal(back[fin].numpy(), sp[fin.numpy()])
    assert (back[fin] >= s[fin]).all() and (back[fin] < 2 * s[fin]).all()
    # below the floor (not produced by the quantizers): taken as 2^-126
    assert ref.ue8m0_from_scale(torch.tensor([0.0, 1e-45, -4.0])).tolist() == [1, 1, 129]


def test_ue8m0_to_scale_table():
    E = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = ref.ue8m0_to_scale(E)
    assert v.dtype == torch.float32
    want = [2.0 ** (e - 127) for e in range(255)]
    assert v[:255].double().tolist() == want  # 0x00 is 2^-127 (an fp32 subnormal), exact
    assert math.isnan(v[255].item())


# ----------------------------------------------------------------- independent re-derivation


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,h", [(1, 128), (6, 384), (37, 1024)])
def test_vs_independent(dtype, t, h):
    x = with_special_rows(random_rows(dtype, t, h, seed=33 + t))
    xf = x.float().numpy()
    q, s = ref.quantize_fp8_per_token(x)
    codes, s_ind, _ = groups_indep(xf.reshape(t, 1, h))
    np.testing.assert_array_equal(u8(q).numpy(), codes.reshape(t, h))
    np.testing.assert_array_equal(i32(s).numpy(), s_ind.reshape(t).view(np.int32))
    K = h // 128
    for ue in (False, True):
        qb, sb = ref.quantize_fp8_block(x, scale_ue8m0=ue)
        codes, s_ind, E = groups_indep(xf.reshape(t, K, 128), ue8m0=ue)
        np.testing.assert_array_equal(u8(qb).numpy(), codes.reshape(t, h))
        if ue:
            np.testing.assert_array_equal(sb.numpy(), E)
        else:
            np.testing.assert_array_equal(i32(sb).numpy(), s_ind.view(np.int32))


def test_fp32_tiny_and_huge_vs_independent():
    g = gen(34)
    x = torch.randn(8, 256, generator=g)
    x[:4] *= 2.0**-135          # amax / 448 below the floor
    x[4:6] *= 2.0**120          # near the top of fp32
    x[6] = torch.randn(256, generator=g).sign() * 2.0**-149
    x[7, :128] = 3.4028234663852886e38
    codes, s_ind, E = groups_indep(x.numpy().reshape(8, 2, 128), ue8m0=True)
    qb, sb = ref.quantize_fp8_block(x, scale_ue8m0=True)
    np.testing.assert_array_equal(u8(qb).numpy(), codes.reshape(8, 256))
    np.testing.assert_array_equal(sb.numpy(), E)
    assert (sb[:4] == 1).all() and sb[7, 0].item() == 247  # fp32 max / 448 -> 2^120
    codes, s_ind, _ = groups_indep(x.numpy().reshape(8, 2, 128))
    qb, sb = ref.quantize_fp8_block(x)
    np.testing.assert_array_equal(u8(qb).numpy(), codes.reshape(8, 256))
    np.testing.assert_array_equal(i32(sb).numpy(), s_ind.view(np.int32))


def test_roundtrip_error_bound_and_wrong_layout():
    x = random_rows(torch.bfloat16, 50, 512, seed=35).float()
    for ue in (False, True):
        for layout in ("row", "mn_major"):
            q, sc = ref.quantize_fp8_block(x, scale_layout=layout, scale_ue8m0=ue)
            deq = ref.dequantize_fp8_block(q, sc, scale_layout=layout, scale_ue8m0=ue)
            s = ref.block_scales_as_float(sc, 50, 4, layout, ue).repeat_interleave(128, dim=1)
            # e4m3: half a step is 2^-4 of the value for normals, 2^-10 s for subnormals
            bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10) * (1 + 2.0**-20)
            err = (x - deq).abs()
            assert (err <= bound).all() and (err > 0).any()
    # row-major scales read as MN-major break the bound
    q, sc = ref.quantize_fp8_block(x)
    wrong = torch.as_strided(torch.cat([sc.reshape(-1), torch.zeros(8)]), (50, 4), (1, 52))
    deq = ref.dequantize_fp8_block(q, wrong, scale_layout="mn_major")
    assert not ((x - deq).abs() <= torch.maximum(x.abs() * 2.0**-4, torch.zeros(1))).all()


def test_leading_dims_flatten():
    x = random_rows(torch.bfloat16, 6, 256, seed=36).reshape(2, 3, 256)
    q, s = ref.quantize_fp8_block(x)
    q2, s2 = ref.quantize_fp8_block(x.reshape(6, 256))
    assert q.shape == (6, 256) and torch.equal(u8(q), u8(q2)) and torch.equal(s, s2)
    q, s = ref.quantize_fp8_per_token(x)
    assert q.shape == (6, 256) and s.shape == (6,)


# ----------------------------------------------------------------- layouts


def mn_major_by_enumeration(vals, t, K):
    """float32 storage of K * roundup(t, 4), walked column by column (DeepGEMM's MN-major)."""
    tp = -(-t // 4) * 4
    out = np.zeros(K * tp, dtype=np.float32)
    for k in range(K):
        for m in range(t):
            out[k * tp + m] = vals[m, k]
    return out


def packed_by_enumeration(E, t, K):
    """int32 storage: word j * tp + m = E[m,4j] | E[m,4j+1] << 8 | E[m,4j+2] << 16 | E[m,4j+3] << 24."""
    tp, Kp = -(-t // 4) * 4, -(-K // 4)
    out = np.zeros(Kp * tp, dtype=np.int64)
    for j in range(Kp):
        for m in range(t):
            w = 0
            for b in range(4):
                if 4 * j + b < K:
                    w |= int(E[m, 4 * j + b]) << (8 * b)
            out[j * tp + m] = w
    return out.astype(np.uint32).view(np.int32)


LAYOUT_SHAPES = [(1, 1), (2, 5), (3, 4), (4, 8), (5, 7), (130, 56)]


@pytest.mark.parametrize("t,K", LAYOUT_SHAPES)
def test_mn_major_float_layout(t, K):
    g = gen(37)
    s = torch.rand(t, K, generator=g) + 0.5
    v = ref.scales_to_mn_major(s)
    tp = -(-t // 4) * 4
    assert v.shape == (t, K) and v.stride() == (1, tp) and v.dtype == torch.float32
    flat = ref.mn_major_storage(v, t, K)
    assert flat.shape == (K * tp,)
    np.testing.assert_array_equal(flat.numpy(), mn_major_by_enumeration(s.numpy(), t, K))
    assert torch.equal(v, s)  # the view reads as the values
    assert torch.equal(ref.scales_from_mn_major(v, t, K), s)
    assert torch.equal(ref.scales_from_mn_major(flat, t, K), s)
    m = torch.arange(t).unsqueeze(1)
    k = torch.arange(K).unsqueeze(0)
    assert torch.equal(flat[ref.mn_major_index(m, k, t)], s)


@pytest.mark.parametrize("t,K", LAYOUT_SHAPES)
def test_packed_ue8m0_layout(t, K):
    g = gen(38)
    E = torch.randint(1, 255, (t, K), generator=g, dtype=torch.int32).to(torch.uint8)
    p = ref.pack_ue8m0_mn_major(E)
    tp, Kp = -(-t // 4) * 4, -(-K // 4)
    assert p.dtype == torch.int32 and p.shape == (t, Kp) and p.stride() == (1, tp)
    flat = ref.mn_major_storage(p, t, K, ue8m0=True)
    np.testing.assert_array_equal(flat.numpy(), packed_by_enumeration(E.numpy(), t, K))
    assert torch.equal(ref.unpack_ue8m0_mn_major(p, t, K), E)
    assert torch.equal(ref.unpack_ue8m0_mn_major(flat, t, K), E)
    m = torch.arange(t).unsqueeze(1)
    k = torch.arange(K).unsqueeze(0)
    assert torch.equal(flat.view(torch.uint8)[ref.packed_ue8m0_byte_index(m, k, t)], E)
    assert (flat.view(torch.uint8) != 0).sum().item() == t * K  # every padding byte is 0


def test_index_helpers_take_plain_integers():
    """semantics.md's worked example, written as it is there: ints, not tensors (t = 5, h = 4096)."""
    assert ref.mn_major_index(4, 3, 5).item() == 28
    assert [ref.packed_ue8m0_byte_index(4, k, 5).item() for k in (3, 5)] == [19, 49]
    K = 4096 // 16  # the swizzled index of (m, k) is the enumeration's, for an int row and a tensor of blocks
    assert torch.equal(ref.swizzled_sf_index(130, torch.arange(K), K),
                       ref.swizzled_sf_index(torch.tensor(130), torch.arange(K), K))


def test_packed_ue8m0_hand_example():
    E = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], dtype=torch.uint8)
    flat = ref.mn_major_storage(ref.pack_ue8m0_mn_major(E), 2, 5, ue8m0=True)
    assert flat.tolist() == [0x04030201, 0x09080706, 0, 0, 5, 10, 0, 0]


def test_quantize_block_layouts_agree():
    x = with_special_rows(random_rows(torch.bfloat16, 9, 768, seed=39))
    q, s = ref.quantize_fp8_block(x)
    qm, sm = ref.quantize_fp8_block(x, scale_layout="mn_major")
    assert torch.equal(u8(q), u8(qm)) and sm.stride() == (1, 12)
    assert torch.equal(i32(ref.scales_from_mn_major(sm, 9, 6)), i32(s))
    qu, E = ref.quantize_fp8_block(x, scale_ue8m0=True)
    qp, P = ref.quantize_fp8_block(x, scale_layout="mn_major", scale_ue8m0=True)
    assert torch.equal(u8(qu), u8(qp)) and P.shape == (9, 2) and P.stride() == (1, 12)
    assert torch.equal(ref.unpack_ue8m0_mn_major(P, 9, 6), E)
    assert torch.equal(E, ref.ue8m0_from_scale(s))
    for layout, sc in (("row", E), ("mn_major", P)):
        assert torch.equal(ref.block_scales_as_float(sc, 9, 6, layout, True).isnan(), E == 0xFF)


# ----------------------------------------------------------------- weight_offset


def test_weight_offset_gemma_vs_independent():
    g = gen(40)
    x = (torch.randn(16, 512, generator=g) * 3).bfloat16()
    w = (0.1 * torch.randn(512, generator=g)).bfloat16()
    got = ref.rmsnorm(x, w, 1e-6, weight_offset=1.0)
    # the same norm with the fp32 weight 1 + w formed independently (numpy fp32 addition)
    w1 = torch.from_numpy(np.float32(1) + w.float().numpy())
    assert torch.equal(got, ref.rmsnorm(x, w1, 1e-6))
    xd = x.double()
    want = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    a = got.double().abs()
    ulp = torch.nextafter(got.float().abs().bfloat16(), torch.tensor(INF).bfloat16()).double() - a
    assert ((got.double() - want).abs() <= ulp).all()
    assert not torch.equal(got, ref.rmsnorm(x, w, 1e-6))


def test_weight_offset_in_fp32_not_in_T():
    # 1 + 2^-10 is exact in fp32 but rounds to 1 in bf16: the offset is added in fp32
    x = torch.ones(1, 4)
    w = torch.full((4,), 2.0**-10).bfloat16()
    assert ref.rmsnorm(x, w, 0.0, 1.0).tolist() == [[1 + 2.0**-10] * 4]
    assert ref.rmsnorm(x.bfloat16(), w, 0.0, 1.0).tolist() == [[1.0] * 4]  # rounded once, to T, at the end
    assert ref.rmsnorm(x, w, 0.0, 0.5).tolist() == [[0.5 + 2.0**-10] * 4]


def test_weight_offset_zero_keeps_weight_sign():
    x = torch.ones(1, 2)
    w = torch.tensor([-0.0, -1.0])
    n0 = ref.rmsnorm(x, w, 0.0)
    assert torch.signbit(n0[0, 0]) and n0[0, 1].item() == -1.0
    n1 = ref.rmsnorm(x, w, 0.0, weight_offset=1.0)
    assert n1[0, 0].item() == 1.0 and n1[0, 1].item() == 0.0 and not torch.signbit(n1[0, 1])


# ----------------------------------------------------------------- fused_tail


def _tail_inputs(dtype, t, h, seed):
    g = gen(seed)
    a = torch.randn(t, h, generator=g).to(dtype)
    r = torch.randn(t, h, generator=g).to(dtype)
    r[0] *= 40
    w = (0.1 * torch.randn(h, generator=g)).to(dtype)
    return a, r, w


CASES = [("fp8_per_token", "row", False), ("fp8_block", "row", False), ("fp8_block", "mn_major", False),
         ("fp8_block", "row", True), ("fp8_block", "mn_major", True)]


@pytest.mark.parametrize("quant,layout,ue", CASES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("return_norm", [False, True])
def test_fused_tail_is_the_composition(quant, layout, ue, offset, return_norm):
    a, r, w = _tail_inputs(torch.bfloat16, 7, 512, seed=41)
    a[2, 9] = NAN
    out = ref.fused_tail(a, r, w, 1e-5, quant=quant, return_norm=return_norm, weight_offset=offset,
                         scale_layout=layout, scale_ue8m0=ue)
    res = ref.residual_add(a, r)
    norm = ref.rmsnorm(res, w, 1e-5, offset)
    if quant == "fp8_per_token":
        q, s = ref.quantize_fp8_per_token(norm)
    else:
        q, s = ref.quantize_fp8_block(norm, 128, layout, ue)
    assert same_bits(out.residual, res) and out.scale_factors is None
    assert (out.norm is not None) == return_norm
    if return_norm:
        assert same_bits(out.norm, norm)
    assert out.quant.dtype == torch.float8_e4m3fn and torch.equal(u8(out.quant), u8(q))
    assert out.scales.dtype == s.dtype and out.scales.shape == s.shape and out.scales.stride() == s.stride()
    if layout == "mn_major":
        assert torch.equal(i32(ref.mn_major_storage(out.scales, 7, 4, ue)), i32(ref.mn_major_storage(s, 7, 4, ue)))
    else:
        assert torch.equal(out.scales.view(torch.uint8), s.view(torch.uint8))


def test_fused_tail_quantizes_the_rounded_norm():
    a, r, w = _tail_inputs(torch.bfloat16, 64, 1024, seed=42)
    w = (1 + w.float()).bfloat16()
    out = ref.fused_tail(a, r, w, quant="fp8_block")
    xf = ref.residual_add(a, r).float()
    norm32 = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6) * w.float()
    via_rounded = ref.quantize_fp8_block(norm32.bfloat16())
    via_fp32 = ref.quantize_fp8_block(norm32)
    assert torch.equal(u8(out.quant), u8(via_rounded[0])) and torch.equal(out.scales, via_rounded[1])
    assert not torch.equal(u8(out.quant), u8(via_fp32[0]))  # double rounding does show up


def test_fused_tail_old_kinds_unchanged():
    a, r, w = _tail_inputs(torch.float16, 5, 256, seed=43)
    for quant, scale in ((None, None), ("fp8", 0.01), ("nvfp4", 0.002)):
        out = ref.fused_tail(a, r, w, quant=quant, scale=scale)
        assert out.scales is None
        old = ref.Tail(*out[:4])  # 4-positional construction still works
        assert old.scales is None and old.residual is out.residual


def test_bad_arguments():
    a, r, w = _tail_inputs(torch.bfloat16, 4, 192, seed=44)
    with pytest.raises(ValueError, match=r"h % 128 == 0.*got h=192"):
        ref.fused_tail(a, r, w, quant="fp8_block")
    with pytest.raises(ValueError, match=r"h % 128 == 0"):
        ref.quantize_fp8_block(a)
    a, r, w = _tail_inputs(torch.bfloat16, 4, 256, seed=44)
    with pytest.raises(ValueError, match="computes its own scales"):
        ref.fused_tail(a, r, w, quant="fp8_per_token", scale=0.1)
    with pytest.raises(ValueError, match="needs a scale"):
        ref.fused_tail(a, r, w, quant="fp8")
    with pytest.raises(ValueError, match="only with quant='fp8_block'"):
        ref.fused_tail(a, r, w, quant="fp8_per_token", scale_ue8m0=True)
    with pytest.raises(ValueError, match="only with quant='fp8_block'"):
        ref.fused_tail(a, r, w, quant="fp8", scale=0.1, scale_layout="mn_major")
    with pytest.raises(ValueError, match="scale_layout"):
        ref.fused_tail(a, r, w, quant="fp8_block", scale_layout="col")
    with pytest.raises(ValueError, match="scale_layout"):
        ref.quantize_fp8_block(a, scale_layout="swizzled")


def test_inputs_not_modified():
    a, r, w = _tail_inputs(torch.bfloat16, 6, 256, seed=45)
    a[0, 0] = NAN
    keep = [t.clone() for t in (a, r, w)]
    for quant, layout, ue in CASES:
        ref.fused_tail(a, r, w, quant=quant, scale_layout=layout, scale_ue8m0=ue, weight_offset=1.0)
    q, P = ref.quantize_fp8_block(a, scale_layout="mn_major", scale_ue8m0=True)
    Pc = ref.mn_major_storage(P, 6, 2, True).clone()
    ref.dequantize_fp8_block(q, P, scale_layout="mn_major", scale_ue8m0=True)
    ref.unpack_ue8m0_mn_major(P, 6, 2)
    assert torch.equal(ref.mn_major_storage(P, 6, 2, True), Pc)
    for before, after in zip(keep, (a, r, w)):
        assert torch.equal(before.view(torch.int16), after.view(torch.int16))


# ----------------------------------------------------------------- tolerance on computed scales


def test_tolerance_scales_neighbouring_amax():
    a, r, w = _tail_inputs(torch.bfloat16, 6, 512, seed=46)
    want = ref.fused_tail(a, r, w, quant="fp8_per_token", return_norm=True)
    # a kernel whose norm is one bf16 ulp off at row 1's amax element
    norm = want.norm.clone()
    j = int(norm[1].float().abs().argmax())
    mag = norm[1, j].abs().reshape(1)
    norm[1, j] = (mag.view(torch.int16) + 1).view(torch.bfloat16)[0] * norm[1, j].sign()  # next bf16 up
    q, s = ref.quantize_fp8_per_token(norm)
    assert s[1] != want.scales[1]
    got = ref.Tail(want.residual, norm, q, None, s)
    assert tolerance.tail_mismatch(got, want, "fp8_per_token") is None
    # two ulps is not a neighbouring amax
    s2 = s.clone()
    s2[1] = s[1] + 2 * (s[1] - want.scales[1])
    why = tolerance.tail_mismatch(got._replace(scales=s2), want, "fp8_per_token")
    assert why and "neighbouring amax" in why
    # NaN where the reference has none; a wrong code in a row whose scale agrees
    s3 = s.clone()
    s3[0] = NAN
    assert "NaN" in tolerance.tail_mismatch(got._replace(scales=s3), want, "fp8_per_token")
    q4 = want.quant.clone()
    u8(q4)[3, :] = 0x7E
    assert "codes" in tolerance.tail_mismatch(got._replace(quant=q4, scales=want.scales), want,
                                              "fp8_per_token")
    assert "scales" in tolerance.tail_mismatch(got._replace(scales=None), want, "fp8_per_token")


def test_tolerance_block_layouts():
    a, r, w = _tail_inputs(torch.bfloat16, 5, 4096, seed=47)
    for layout, ue in (("mn_major", False), ("mn_major", True), ("row", True)):
        want = ref.fused_tail(a, r, w, quant="fp8_block", scale_layout=layout, scale_ue8m0=ue)
        assert tolerance.tail_mismatch(want, want, "fp8_block", scale_layout=layout, scale_ue8m0=ue) is None
        if layout == "mn_major":
            flat = ref.mn_major_storage(want.scales, 5, 32, ue).clone()
            flat[-1] = 1  # a padding slot (row 5 of the last column)
            bad = torch.as_strided(flat, want.scales.shape, want.scales.stride())
            why = tolerance.tail_mismatch(want._replace(scales=bad), want, "fp8_block", scale_layout=layout,
                                          scale_ue8m0=ue)
            assert why and "padding" in why
            if not ue:
                why = tolerance.tail_mismatch(want._replace(scales=want.scales.contiguous()), want, "fp8_block",
                                              scale_layout=layout)
                assert why and "strides" in why
        else:
            E = want.scales.clone()
            E[0, 0] += 1  # two neighbouring exponents in 160 blocks: more than 1e-3 of them, and more than one
            E[3, 5] += 1
            # A kernel writes the codes of the exponent it chose: its block's codes follow E.
            norm = ref.fused_tail(a, r, w).norm
            q = ref.fp8_group_codes(norm.float().view(5, 32, 128), ref.ue8m0_to_scale(E)).view(5, 4096)
            got = want._replace(quant=q, scales=E)
            why = tolerance.tail_mismatch(got, want, "fp8_block", scale_ue8m0=True, norm=norm)
            assert why and "UE8M0" in why
            assert tolerance.tail_mismatch(got, want, "fp8_block", scale_ue8m0=True, max_frac=0.02, norm=norm) is None
            E[0, 1] += 2
            assert "more than one" in tolerance.tail_mismatch(got, want, "fp8_block", scale_ue8m0=True,
                                                              max_frac=0.02, norm=norm)


# (quant, scale encoding of its block scales, elements a block): the formats whose codes follow a stored
# scale, in their row-major / linear layouts.
BLOCK_SCALED = [("fp8_per_token", "f32", 512), ("fp8_block", "f32", 128), ("fp8_block", "ue8m0", 128),
                ("mxfp8", "ue8m0", 32), ("nvfp4", "e4m3", 16)]


@pytest.mark.parametrize("quant, code, block", BLOCK_SCALED)
def test_tolerance_checks_the_codes_of_blocks_whose_scale_differs(quant, code, block):
    """Where a block's scale differs from the reference's (within its tolerance), its codes are judged against
    the reference's norm quantized with the returned scale: those a kernel writes with that scale pass, the
    block's codes zeroed do not, nor does any such block when the reference's norm (NVFP4: and the global
    scale) is not at hand to judge it."""
    t, h = 6, 512
    a, r, w = _tail_inputs(torch.bfloat16, t, h, seed=49)
    scale = torch.tensor([0.004]) if quant == "nvfp4" else None
    kw = dict(sf_layout="linear") if quant in ("nvfp4", "mxfp8") else dict(scale_ue8m0=code == "ue8m0")
    want = ref.fused_tail(a, r, w, 1e-6, quant, scale, False, kw.get("sf_layout", "swizzled"),
                          scale_ue8m0=kw.get("scale_ue8m0", False))
    norm = ref.fused_tail(a, r, w, 1e-6).norm
    field = "scales" if quant.startswith("fp8") else "scale_factors"
    stored = getattr(want, field).clone()
    grid = stored.view(t, h // block)
    n = norm.float().view(t, h // block, block)
    if code == "f32":  # the scale of the block's amax one bf16 ulp up, the codes it gives
        amax = norm[0, :block].abs().max().view(1)
        grid[0, 0] = (amax.view(torch.int16) + 1).view(torch.bfloat16).float() / torch.tensor(448.0)
        codes = u8(ref.fp8_group_codes(n, grid)).view(t, h)
    elif code == "ue8m0":  # a neighbouring exponent
        grid[0, 0] += 1
        codes = u8(ref.fp8_group_codes(n, ref.ue8m0_to_scale(grid))).view(t, h)
    else:  # a neighbouring e4m3 scale factor
        u8(grid)[0, 0] += 1
        nibbles = ref.nvfp4_block_codes(n, grid, torch.reciprocal(scale)).view(t, h)
        codes = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    assert not torch.equal(u8(codes), u8(want.quant))  # the other scale moved codes of its block
    got = want._replace(quant=codes.view(want.quant.dtype), **{field: stored})
    # One block in 6 to 192: a share of neighbours that max_frac=0.2 allows.
    check = lambda g, **k: tolerance.tail_mismatch(g, want, quant, max_frac=0.2, norm=norm, scale=scale, **kw, **k)
    assert check(got) is None
    zeroed = u8(codes.clone())
    zeroed[0, :block // (2 if quant == "nvfp4" else 1)] = 0
    why = check(got._replace(quant=zeroed.view(want.quant.dtype)))
    assert why and "codes more than one step" in why, why
    why = tolerance.tail_mismatch(got, want, quant, max_frac=0.2, **kw)
    assert why and "need the reference's norm" in why, why
    if quant == "nvfp4":
        why = tolerance.tail_mismatch(got, want, quant, max_frac=0.2, norm=norm, **kw)
        assert why and "need the reference's scale" in why, why
    else:  # the reference's norm as its own output will do
        with_norm = ref.fused_tail(a, r, w, 1e-6, quant, scale, True, kw.get("sf_layout", "swizzled"),
                                   scale_ue8m0=kw.get("scale_ue8m0", False))
        assert tolerance.tail_mismatch(got._replace(norm=norm), with_norm, quant, max_frac=0.2, **kw) is None


@pytest.mark.parametrize("quant", ["fp8_per_token", "fp8_block"])
def test_tolerance_caps_the_float32_scales_that_differ(quant):
    """Every float32 scale one fp32 ulp up (each within a neighbouring amax's tolerance) with every code 0: more
    than 1e-3 of the scales differ, which is rejected; one differing scale in any number may."""
    a, r, w = _tail_inputs(torch.bfloat16, 64, 512, seed=50)
    want = ref.fused_tail(a, r, w, 1e-6, quant)
    up = torch.nextafter(want.scales, torch.full_like(want.scales, INF))
    zeros = torch.zeros_like(u8(want.quant)).view(want.quant.dtype)
    why = tolerance.tail_mismatch(want._replace(quant=zeros, scales=up), want, quant)
    assert why and f"{want.scales.numel()} of {want.scales.numel()} scales differ" in why, why
    one = want.scales.clone()
    one.view(-1)[3] = up.view(-1)[3]
    norm = ref.fused_tail(a, r, w, 1e-6).norm
    assert tolerance.tail_mismatch(want._replace(scales=one), want, quant, norm=norm) is None


def test_tolerance_takes_t_from_the_norm_given():
    """fp16 activations and a call without residual or norm outputs: T comes from the `norm` passed, so a per-token
    scale whose amax is 6 fp16 ulps high is rejected (bf16's 8 times coarser ulp took it)."""
    a = torch.randn(4, 256, generator=torch.Generator().manual_seed(61)).to(torch.float16)
    w = torch.ones(256, dtype=torch.float16)
    want = ref.fused_tail(a, None, w, 1e-6, "fp8_per_token")
    norm = ref.fused_tail(a, None, w, 1e-6).norm
    amax = norm[0].float().abs().max().reshape(1)
    scales = want.scales.clone()
    scales[0] = (amax + 6 * tolerance.ulp(amax, torch.float16)) / 448
    codes = ref.fp8_group_codes(norm.float().reshape(4, 1, 256), scales.reshape(4, 1)).reshape(4, 256)
    why = tolerance.tail_mismatch(ref.Tail(None, None, codes, None, scales), want, "fp8_per_token", norm=norm)
    assert why and "beyond a neighbouring amax" in why, why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_within_ulp_counts_the_representable_values_between(dtype):
    """One ulp is one neighbour of T on either side: just below a power of two the neighbour below is the finer
    step, so two of those are beyond one ulp; +0 and -0 are one value; subnormals count as values."""
    tiny = torch.finfo(dtype).smallest_normal / 4
    e = torch.tensor([16.0, 1.0, -2.0, 0.0, tiny], dtype=dtype)
    down = torch.nextafter(e, torch.full_like(e, -INF))
    up = torch.nextafter(e, torch.full_like(e, INF))
    for one in (down, up):
        assert tolerance.within_ulp(one, e, 1, "norm") is None
    two = torch.nextafter(down, torch.full_like(e, -INF))
    for i in range(e.numel()):
        why = tolerance.within_ulp(two[i:i + 1], e[i:i + 1], 1, "norm")
        assert why and "beyond 1 ulp" in why, (i, why)
        assert tolerance.within_ulp(two[i:i + 1], e[i:i + 1], 2, "norm") is None
    assert tolerance.within_ulp(torch.tensor([-0.0], dtype=dtype), torch.tensor([0.0], dtype=dtype), 0, "n") is None


def _norm_one_ulp_off_at(value: float, h: int):
    """A [1, h] bf16 reference norm of 0.5s with `value` at element 0, and the same one bf16 ulp up there: a
    kernel's norm within the tolerance."""
    want = torch.full((1, h), 0.5, dtype=torch.bfloat16)
    want[0, 0] = value
    got = want.clone()
    got[0, 0] = torch.nextafter(want[0, :1], torch.full((1,), INF, dtype=torch.bfloat16))
    return got, want


@pytest.mark.parametrize("quant, value", [("mxfp8", 448.0), ("fp8_block", 448.0), ("nvfp4", 6.375), ("fp8", 1.0625)])
def test_tolerance_takes_one_neighbour_at_a_decode_row(quant, value):
    """One decode row (h 4096: 128 MXFP8 blocks, 32 UE8M0 scales, 256 NVFP4 scale factors, 4096 static FP8 codes) whose
    norm is one ulp off at a rounding boundary (an amax at a power of two, a code's tie): one scale or code moves,
    which 1e-3 of so few would not allow. The outputs are the reference's quantization of that norm."""
    got_norm, want_norm = _norm_one_ulp_off_at(value, 4096)
    kw = {"scale_ue8m0": True} if quant == "fp8_block" else {}
    scale = {"nvfp4": torch.tensor([1.0 / 64]), "fp8": torch.tensor([1.0])}.get(quant)
    want = ref.Tail(None, want_norm, *ref.quantize(want_norm, quant, scale, **kw))
    got = ref.Tail(None, got_norm, *ref.quantize(got_norm, quant, scale, **kw))
    moved = [n for n in ("quant", "scale_factors", "scales") if getattr(want, n) is not None
             and not torch.equal(getattr(got, n).contiguous().view(torch.uint8), getattr(want, n).view(torch.uint8))]
    assert moved  # the case is one at a boundary
    assert tolerance.tail_mismatch(got, want, quant, scale=scale, **kw) is None


def test_tolerance_reads_ue8m0_byte_0_as_two_to_the_minus_127():
    """An all-zero MXFP8 block whose exponent byte is 0 (TransformerEngine's and FlashInfer's, 2^-127) rather than
    the reference's 1: its codes are judged under 2^-127, all zeros, not under 0 (0 / 0: NaN codes)."""
    x = torch.randn(1, 32 * 64, generator=torch.Generator().manual_seed(62)).to(torch.bfloat16)
    x[0, :32] = 0
    q, e = ref.quantize_mxfp8(x, "swizzled")
    e0 = e.clone()
    e0.view(torch.uint8)[ref.swizzled_sf_index(torch.tensor(0), torch.tensor(0), 64)] = 0
    assert tolerance.tail_mismatch(ref.Tail(None, x, q, e0), ref.Tail(None, x, q, e), "mxfp8") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    x = with_special_rows(random_rows(torch.bfloat16, 70, 1024, seed=48))
    q, s = ref.quantize_fp8_per_token(x)
    qc, sc = ref.quantize_fp8_per_token(x.cuda())
    assert torch.equal(u8(qc).cpu(), u8(q)) and torch.equal(i32(sc.cpu()), i32(s))
    for _, layout, ue in CASES[1:]:
        q, s = ref.quantize_fp8_block(x, scale_layout=layout, scale_ue8m0=ue)
        qc, sc = ref.quantize_fp8_block(x.cuda(), scale_layout=layout, scale_ue8m0=ue)
        assert torch.equal(u8(qc).cpu(), u8(q))
        if layout == "mn_major":
            s, sc = ref.mn_major_storage(s, 70, 8, ue), ref.mn_major_storage(sc, 70, 8, ue)
        assert torch.equal(sc.cpu().contiguous().view(torch.uint8), s.contiguous().view(torch.uint8))


def test_tail_mismatch_takes_a_communicators_result():
    """The tests hand tolerance.tail_mismatch a commfuse.FusedResult (a dataclass, not a tuple)."""
    from commfuse import FusedResult, tolerance
    from commfuse.routes import Collective, Plan, TailRoute

    g = torch.Generator().manual_seed(3)
    a, r, w = (torch.randn(4, 256, generator=g).to(torch.bfloat16) for _ in range(3))
    from commfuse import reference

    ref = reference.fused_tail(a, r, w[0], 1e-6, "fp8", 0.02, True)
    got = FusedResult(*ref, plan=Plan(Collective.NCCL, TailRoute.FUSED))
    assert tolerance.tail_mismatch(got, ref, "fp8") is None
    bad = FusedResult(ref.residual, ref.norm, (ref.quant.view(torch.uint8) ^ 1).view(torch.float8_e4m3fn), None, None,
                      plan=got.plan)
    assert tolerance.tail_mismatch(bad, ref, "fp8") is not None
