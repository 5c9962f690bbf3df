"""commfuse.reference's MXFP8 (quant="mxfp8"): hand-derived vectors, an independent re-derivation of the
scale rule in float64, the scale-factor layouts, the dequantization, and the tail's outputs. CPU."""
import math

import pytest
import torch

from commfuse import reference as ref

BF16 = torch.bfloat16


def u8(t):
    return t.view(torch.uint8)


def block_of(values, fill=0.0):
    """One row of 32 elements: `values` first, then `fill`."""
    row = torch.full((1, 32), fill, dtype=torch.float32)
    row[0, :len(values)] = torch.tensor(values, dtype=torch.float32)
    return row


@pytest.mark.parametrize("amax, E", [
    (448.0, 127),              # 448 / 448 = 1 = 2^0: exactly a power of two
    (449.0, 128),              # just above: rounded up to 2, so 449 / 2 is no code past 448
    (1.0, 119),                # 1 / 448 = 2^-8.8: rounded up to 2^-8
    (1.75 * 2 ** 8, 127),      # e4m3's largest mantissa at 2^8: 448, scale 1
    (1.875 * 2 ** 8, 128),     # OCP's rule would give 2^0 here and clamp 480 to 448; the round-up one 2^1
    (0.0, 1),                  # a block of zeros: the positive scale 2^-126
])
def test_hand_derived_scales(amax, E):
    x = block_of([amax, -amax / 3, amax / 7])
    codes, sf = ref.quantize_mxfp8(x, "linear")
    assert sf.shape == (1, 1) and sf.dtype == torch.uint8 and int(sf) == E
    s = 2.0 ** (E - 127)
    want = ref.quantize_fp8(x, s)  # the codes are those of static FP8 at the block's scale
    assert torch.equal(u8(codes), u8(want))
    if amax:
        assert (ref.dequantize_mxfp8(codes, sf, "linear")[0, 0] - amax).abs() <= amax * 2 ** -4


def test_nan_and_inf_blocks():
    x = torch.cat([block_of([1.0, float("nan")]), block_of([float("inf"), -2.0, float("-inf")])], dim=1)
    codes, sf = ref.quantize_mxfp8(x, "linear")
    assert sf.tolist() == [[0xFF, 0xFF]]  # the UE8M0 NaN: such a block dequantizes to NaN
    c = u8(codes)[0]
    assert (c[:32] == 0x7F).all()                           # NaN codes in the NaN block
    assert c[32].item() == 0x7E and c[34].item() == 0xFE    # +-Inf saturate to +-448 (as static FP8)
    assert (c[33] & 0x7F).item() == 0 and ((c[35:] & 0x7F) == 0).all()  # finite / Inf: a signed zero
    assert ref.dequantize_mxfp8(codes, sf, "linear").isnan().all()


def test_scale_rule_against_float64():
    """E = 127 + ceil(log2(amax / 448)), derived in float64 from the bf16 amax, for blocks of every
    magnitude (the fp32 rounding of amax / 448 never crosses a power of two for bf16 inputs)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 32 * 8, generator=g) * torch.logspace(-20, 20, 64).unsqueeze(1)).to(BF16)
    codes, sf = ref.quantize_mxfp8(x, "linear")
    amax = x.float().abs().reshape(64, 8, 32).amax(-1).double()
    want = [[127 + math.ceil(math.log2(a / 448)) if a > 448 * 2 ** -126 else 1 for a in row] for row in amax.tolist()]
    assert sf.tolist() == want
    # Every code is the division by its block's scale (no saturation: the scale is rounded up).
    scale = (2.0 ** (sf.double() - 127)).repeat_interleave(32, dim=1)
    assert torch.equal(u8(codes), u8(ref._to_e4m3((x.double() / scale).float())))
    assert (codes.float().abs() <= 448).all()


def test_the_same_as_fp8_block_ue8m0_in_blocks_of_32():
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(9, 256, generator=g) * 30).to(BF16)
    x[2, 40] = float("nan")
    x[3, 100] = float("inf")
    x[4, :32] = 0
    codes, sf = ref.quantize_mxfp8(x, "linear")
    block_codes, exps = ref.quantize_fp8_block(x, 32, "row", True)
    assert torch.equal(u8(codes), u8(block_codes)) and torch.equal(sf, exps)


@pytest.mark.parametrize("t, h", [(1, 32), (3, 96), (130, 256), (5, 4096)])
def test_swizzled_layout_and_padding(t, h):
    g = torch.Generator().manual_seed(t * h)
    x = torch.randn(t, h, generator=g).to(BF16)
    codes, flat = ref.quantize_mxfp8(x, "swizzled")
    _, lin = ref.quantize_mxfp8(x, "linear")
    K = h // 32
    assert flat.shape == (-(-t // 128) * 128 * (-(-K // 4) * 4),) and flat.dtype == torch.uint8
    m, k = torch.meshgrid(torch.arange(t), torch.arange(K), indexing="ij")
    index = ref.swizzled_sf_index(m, k, K)
    assert torch.equal(flat[index], lin)
    pad = torch.ones(flat.numel(), dtype=torch.bool)
    pad[index.reshape(-1)] = False
    assert (flat[pad] == 0).all()
    assert torch.equal(ref.dequantize_mxfp8(codes, flat), ref.dequantize_mxfp8(codes, lin, "linear"))


def test_tail_and_quantize_dispatch():
    g = torch.Generator().manual_seed(3)
    a, r = (torch.randn(4, 64, generator=g).to(BF16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(BF16)
    tail = ref.fused_tail(a, r, w, 1e-6, "mxfp8", None, True, "linear", 1.0)
    norm = ref.rmsnorm(ref.residual_add(a, r), w, 1e-6, 1.0)
    q, sf = ref.quantize_mxfp8(norm, "linear")
    assert torch.equal(tail.norm, norm) and torch.equal(u8(tail.quant), u8(q)) and torch.equal(tail.scale_factors, sf)
    assert tail.scales is None
    with pytest.raises(ValueError, match="computes its own scales"):
        ref.fused_tail(a, r, w, 1e-6, "mxfp8", 0.5)
    with pytest.raises(ValueError, match="h % 32"):
        ref.quantize_mxfp8(a[:, :48])
    with pytest.raises(ValueError, match="sf_layout"):
        ref.quantize_mxfp8(a, "tiled")
