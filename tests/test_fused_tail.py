"""GPU: the fused tail kernel (commfuse.kernels.fused_tail.run) against commfuse.reference.fused_tail fed
the same all-reduced input, to the tolerances of commfuse.tolerance (docs/semantics.md):

- residual: bit-identical (one fp32 add rounded to T, as the reference does);
- norm: within 1 ulp of T (the row's sum of squares is added in another order);
- quant codes and scale factors: equal to the reference, except where the kernel's norm differs
  from the reference's by its ulp (then one step), at most 1e-3 of them; and bit-identical to the
  reference quantizer run on CPU (the exact semantics) over the kernel's own norm.

Every output is allocated poisoned, twice with two different poisons, and the two runs must agree
byte for byte: an element the kernel never writes (swizzle padding included) fails.
Every test skips with a reason without a CUDA GPU.
"""
import os

import pytest
import torch

from commfuse.kernels import fused_tail as ft
from commfuse.kernels import jit
from commfuse.tail.formats import NONE
from commfuse.tail.spec import TailSpec
from commfuse import reference as ref
from commfuse import tolerance
from commfuse.tolerance import signed_rank

from compare import poisoned_runs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fused tail kernel)"),
]

DTYPES = (torch.float16, torch.bfloat16)
HIDDEN = (128, 2880, 4096, 5120, 7168, 8192, 16384)
TOKENS = (1, 16, 64, 256, 8192)
# (quant, return_norm, sf_layout)
PATTERNS = (
    (None, False, "swizzled"),
    ("fp8", False, "swizzled"),
    ("fp8", True, "swizzled"),
    ("nvfp4", False, "swizzled"),
    ("nvfp4", True, "swizzled"),
    ("nvfp4", False, "linear"),
    ("nvfp4", True, "linear"),
)
EPS = 1e-6
NAN_ROW, INF_ROW = 2, 3


def _dtype_id(d):
    return str(d).replace("torch.", "")


# --------------------------------------------------------------------------- inputs


def make_inputs(tokens, hidden, dtype, seed):
    """a, residual [t,h] and weight [h] of dtype on the GPU, seeded, never all zeros.

    Rows 0..4 (when t >= 5): spikes (outliers), whole zero blocks, a NaN, an Inf, all zeros.
    Column big_col has the largest finite weight, so norms there overflow to +-Inf in T.
    Returns (a, residual, weight, special_rows, big_col).
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    residual = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    weight = 1 + 0.5 * torch.randn(hidden, generator=g, device="cuda")  # some negative: signed zeros
    big_col = hidden // 5
    weight[big_col] = torch.finfo(dtype).max
    weight = weight.to(dtype)
    special = []
    if tokens >= 5:
        a[0, :: max(1, hidden // 7)] = 2000.0
        for k in range(0, hidden // 16, 3):
            a[1, 16 * k: 16 * k + 16] = 0
            residual[1, 16 * k: 16 * k + 16] = 0
        a[NAN_ROW, hidden // 3] = float("nan")
        a[INF_ROW, hidden // 2] = float("inf")
        a[4] = -residual[4]
        special = [0, 1, NAN_ROW, INF_ROW, 4]
    return a, residual, weight, special, big_col


def scale_for(quant, norm, special, big_col):
    """A dequant scale from the ordinary rows' amax (spike rows and the big column saturate)."""
    rows = torch.ones(norm.shape[0], dtype=torch.bool, device=norm.device)
    rows[special] = False
    if not rows.any():
        rows[:] = True
    cols = torch.ones(norm.shape[1], dtype=torch.bool, device=norm.device)
    cols[big_col] = False
    x = norm[rows][:, cols].float().abs()
    amax = x[torch.isfinite(x)].max().clamp(min=1e-3)
    s = ref.fp8_scale_from_amax(amax) if quant == "fp8" else ref.nvfp4_scale_from_amax(amax)
    return s.reshape(1).to(torch.float32)


# --------------------------------------------------------------------------- running


def run_kernel(monkeypatch, *args, **kwargs):
    """ft.run with outputs poisoned, twice with different poisons; the runs must agree bytewise."""
    first, second = poisoned_runs(lambda: ft.run(*args, **kwargs))
    for name, x, y in zip(first._fields, first, second):
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), \
                f"{name}: elements left unwritten (or the kernel is not deterministic)"
    return first


# --------------------------------------------------------------------------- comparisons


def same(x, y):
    """Elementwise: bit-identical, or both NaN."""
    bits = x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int16)
    ybits = y.view(torch.uint8) if y.element_size() == 1 else y.view(torch.int16)
    return (bits == ybits) | (torch.isnan(x.float()) & torch.isnan(y.float()))


def ulp_key(x):
    """fp16/bf16 -> int32 that counts ulps: neighbours differ by 1, +0 and -0 are both 0."""
    bits = x.view(torch.int16).int()
    mag = bits & 0x7FFF
    return torch.where(bits < 0, -mag, mag)


def assert_residual(k, r):
    assert k.shape == r.shape and k.dtype == r.dtype
    assert same(k, r).all(), f"residual differs at {(~same(k, r)).nonzero()[:5].tolist()}"


def assert_norm(k, r):
    assert k.shape == r.shape and k.dtype == r.dtype
    assert torch.equal(torch.isnan(k), torch.isnan(r)), "norm NaN positions differ"
    inf = torch.isinf(r) | torch.isinf(k)
    assert torch.equal(k[inf], r[inf]), "norm infinities differ"
    fin = torch.isfinite(r) & torch.isfinite(k)
    if fin.any():
        worst = (ulp_key(k) - ulp_key(r)).abs()[fin].max().item()
        assert worst <= 1, f"norm off by {worst} ulp"


def sf_linear(sf, t, h, layout):
    """Scale factors as uint8 [t, h/16], whatever the layout."""
    K = h // 16
    lin = ref.unswizzle_scale_factors(sf, t, K) if layout == "swizzled" else sf.reshape(t, K)
    return lin.view(torch.uint8)


def unpack_codes(q, t, h):
    return torch.stack((q & 0xF, q >> 4), dim=-1).reshape(t, h)


def budget(n):
    return max(1, int(1e-3 * n))


def check_fp8(k, e, kn, en):
    kq, eq = k.quant.view(torch.uint8), e.quant.view(torch.uint8)
    assert k.quant.dtype == torch.float8_e4m3fn and k.quant.shape == e.quant.shape
    nan_ref = eq == 0x7F
    assert (kq[nan_ref] == 0x7F).all(), "a NaN of the reference is not the NaN code"
    mism = kq != eq
    explained = ~same(kn, en)
    assert not (mism & ~explained).any(), "fp8 codes differ where the norms agree"
    if mism.any():
        assert (signed_rank(kq, 0x80) - signed_rank(eq, 0x80)).abs()[mism].max() <= 1
    assert mism.sum().item() <= budget(mism.numel())


def check_nvfp4(k, e, kn, en, scale, t, h, layout):
    assert k.quant.dtype == torch.uint8 and k.quant.shape == (t, h // 2)
    assert k.scale_factors.dtype == torch.float8_e4m3fn and k.scale_factors.shape == e.scale_factors.shape
    K = h // 16
    ksf, esf = sf_linear(k.scale_factors, t, h, layout), sf_linear(e.scale_factors, t, h, layout)
    kc, ec = unpack_codes(k.quant, t, h), unpack_codes(e.quant, t, h)
    nan_blocks = esf == 0x7F
    assert (ksf[nan_blocks] == 0x7F).all(), "a NaN block of the reference lost its NaN scale factor"
    assert (kc.view(t, K, 16)[nan_blocks] == 0).all(), "codes of a NaN block must be 0"
    norm_diff = (~same(kn, en)).view(t, K, 16).any(-1)
    sf_mism = ksf != esf
    if sf_mism.any():
        assert (signed_rank(ksf, 0x80) - signed_rank(esf, 0x80)).abs()[sf_mism].max() <= 1
    assert not (sf_mism & ~norm_diff).any(), "scale factors differ where the norms agree"
    assert sf_mism.sum().item() <= budget(sf_mism.numel())
    code_mism = kc != ec
    explained = (norm_diff | sf_mism).repeat_interleave(16, dim=1)
    assert not (code_mism & ~explained).any(), "e2m1 codes differ in a block whose norm and sf agree"
    assert code_mism.sum().item() <= max(16, int(1e-3 * code_mism.numel()))
    if layout == "swizzled":
        flat = k.scale_factors.view(torch.uint8)
        assert flat.numel() == TailSpec.of("nvfp4").scales_spec(t, h).storage_numel
        pad = torch.ones_like(flat, dtype=torch.bool)
        m = torch.arange(t, device=flat.device).unsqueeze(1)
        kk = torch.arange(K, device=flat.device).unsqueeze(0)
        pad[ref.swizzled_sf_index(m, kk, K).reshape(-1)] = False
        assert (flat[pad] == 0).all(), "swizzle padding not zeroed"


def check_exact_quant(k, kn, quant, scale, layout, rows, t, h):
    """The kernel's codes and scale factors are exactly the CPU reference quantizer's (the exact
    semantics: true divisions) applied to the kernel's own norm."""
    x = kn[rows].cpu()
    s = scale.cpu()
    if quant == "fp8":
        want = ref.quantize_fp8(x, s).view(torch.uint8)
        got = k.quant[rows].cpu().view(torch.uint8)
        assert torch.equal(got, want), f"fp8 codes differ at {(got != want).nonzero()[:5].tolist()}"
        return
    q, sf = ref.quantize_nvfp4(x, s, "linear")
    got_sf = sf_linear(k.scale_factors, t, h, layout)[rows].cpu()
    assert torch.equal(got_sf, sf.view(torch.uint8)), \
        f"scale factors differ at {(got_sf != sf.view(torch.uint8)).nonzero()[:5].tolist()}"
    got_q = k.quant[rows].cpu()
    assert torch.equal(got_q, q), f"e2m1 codes differ at {(got_q != q).nonzero()[:5].tolist()}"


def check_rows(t, special, seed):
    if t <= 64:
        return torch.arange(t)
    g = torch.Generator().manual_seed(seed)
    picks = torch.randperm(t, generator=g)[:59]
    return torch.unique(torch.cat([picks, torch.tensor(special, dtype=torch.long)]))


def check_patterns(monkeypatch, a, residual, weight, special, big_col, patterns, seed):
    t, h = a.reshape(-1, a.shape[-1]).shape
    base = ref.fused_tail(a, residual, weight, EPS)
    rows = check_rows(t, special, seed)
    for quant, return_norm, layout in patterns:
        if quant == "nvfp4" and h % 16:
            continue
        where = f"quant={quant} return_norm={return_norm} sf_layout={layout}"
        scale = scale_for(quant, base.norm, special, big_col) if quant else None
        k = run_kernel(monkeypatch, a, residual, weight, EPS, quant, scale, return_norm, layout)
        e = ref.fused_tail(a, residual, weight, EPS, quant, scale, return_norm, layout)
        for name, x, y in zip(k._fields, k, e):
            assert (x is None) == (y is None), f"{where}: {name}"
        assert_residual(k.residual, e.residual)
        if e.norm is not None:
            assert_norm(k.norm, e.norm)
        if quant is None:
            continue
        kn = k.norm if return_norm else ft.run(a, residual, weight, EPS, quant, scale, True, layout).norm
        if quant == "fp8":
            check_fp8(k, e, kn, base.norm)
        else:
            check_nvfp4(k, e, kn, base.norm, scale, t, h, layout)
        check_exact_quant(k, kn, quant, scale, layout, rows, t, h)
        if special:
            check_special_rows(k, quant, t, h, layout)


def check_special_rows(k, quant, t, h, layout):
    """NaN stays visible: a NaN in a row makes its whole norm NaN, so every code of the row is the
    FP8 NaN code, or every NVFP4 block has a NaN scale factor and zero codes."""
    if quant == "fp8":
        assert (k.quant[NAN_ROW].view(torch.uint8) == 0x7F).all()
        # Inf row: rms = Inf, so the Inf element's norm is Inf * 0 = NaN and the rest is +-0.
        inf_row = k.quant[INF_ROW].view(torch.uint8)
        assert (inf_row[h // 2] == 0x7F).item() and ((inf_row & 0x7F) == 0).sum().item() == h - 1
    else:
        sf = sf_linear(k.scale_factors, t, h, layout)
        assert (sf[NAN_ROW] == 0x7F).all() and (k.quant[NAN_ROW] == 0).all()
        assert sf[INF_ROW, h // 2 // 16].item() == 0x7F


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_matches_reference(dtype, hidden, tokens, monkeypatch):
    seed = hidden * 100003 + tokens
    a, residual, weight, special, big_col = make_inputs(tokens, hidden, dtype, seed)
    check_patterns(monkeypatch, a, residual, weight, special, big_col, PATTERNS, seed)


@pytest.mark.parametrize("hidden", (16, 24, 40, 48, 80, 1000, 32000, 65536))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_odd_and_long_rows(dtype, hidden, monkeypatch):
    # 16..80: K = h/16 not a multiple of 4 (swizzle padding columns); 130 tokens: padding rows of
    # a second 128-row tile; 600 tokens: the many-rows launch configuration; 32000 and 65536 take
    # the looped (non-register) variant.
    for tokens in (1, 7, 130, 600):
        seed = hidden * 7919 + tokens
        a, residual, weight, special, big_col = make_inputs(tokens, hidden, dtype, seed)
        check_patterns(monkeypatch, a, residual, weight, special, big_col, PATTERNS, seed)


def test_saturation_and_signed_zero(monkeypatch):
    # A tiny scale saturates every FP8 code to +-448 and every NVFP4 scale factor to 448.
    a, residual, weight, _, _ = make_inputs(4, 256, torch.bfloat16, 5)  # no special rows
    scale = torch.tensor([1e-6], dtype=torch.float32, device="cuda")
    k = run_kernel(monkeypatch, a, residual, weight, EPS, "fp8", scale, True, "swizzled")
    codes = k.quant.view(torch.uint8)
    big = k.norm.float().abs() > 448 * 1e-6
    assert ((codes[big] & 0x7F) == 0x7E).all()
    k = run_kernel(monkeypatch, a, residual, weight, EPS, "nvfp4", scale, True, "linear")
    assert (k.scale_factors.view(torch.uint8) == 0x7E).all()
    # Zero rows with negative weights give -0 norms: e2m1 code 0x8 (sign of -0.0 kept).
    a = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    a[:, 0] = 1  # not all zeros: one block stays live
    residual = torch.zeros_like(a)
    weight = -torch.ones(64, dtype=torch.bfloat16, device="cuda")
    scale = torch.tensor([0.01], dtype=torch.float32, device="cuda")
    k = run_kernel(monkeypatch, a, residual, weight, EPS, "nvfp4", scale, True, "linear")
    e = ref.fused_tail(a, residual, weight, EPS, "nvfp4", scale, True, "linear")
    assert torch.equal(k.quant, e.quant) and torch.equal(k.scale_factors.view(torch.uint8), e.scale_factors.view(torch.uint8))
    assert (unpack_codes(k.quant, 4, 64)[:, 16:] == 0x8).all()


def test_nvfp4_zero_blocks_under_a_zero_scale(monkeypatch):
    """A scale of 0 in a device tensor (the host cannot read it): S = 1/scale is Inf, and the blocks of zeros get
    scale factor 0 and codes 0, as the reference gives them, not NaN (Inf * 0)."""
    a, residual, weight, _, _ = make_inputs(4, 256, torch.bfloat16, 6)
    residual = -a  # the residual sum is 0: every block of the norm is a block of zeros ...
    residual[1, :16] += 1  # ... but one
    scale = torch.zeros(1, dtype=torch.float32, device="cuda")
    k = run_kernel(monkeypatch, a, residual, weight, EPS, "nvfp4", scale, True, "linear")
    e = ref.fused_tail(a, residual, weight, EPS, "nvfp4", scale, True, "linear")
    sf = k.scale_factors.view(torch.uint8)
    assert torch.equal(sf, e.scale_factors.view(torch.uint8)) and torch.equal(k.quant, e.quant)
    assert (sf == 0).sum() == sf.numel() - 1 and sf[1, 0] == 0x7E


@pytest.mark.parametrize("scale", (2.0 ** -70, 2.0 ** -64, 1.5e-3, 3.0, -0.05, 2.0 ** 64, 2.0 ** 70))
def test_fp8_scales_of_every_magnitude(scale, monkeypatch):
    """FP8 codes equal the true division's at scales inside and outside the kernel's reciprocal range
    (csrc/epilogue.cuh, fp8_divide); the weight is scaled along, so the quotients span the e4m3 codes."""
    t, h = 64, 4096
    a, residual, weight, _, _ = make_inputs(t, h, torch.bfloat16, 31)
    weight = (weight.float() * abs(scale) * 100).to(torch.bfloat16)
    s = torch.tensor([scale], dtype=torch.float32, device="cuda")
    k = run_kernel(monkeypatch, a, residual, weight, EPS, "fp8", s, True, "swizzled")
    check_exact_quant(k, k.norm, "fp8", s, "swizzled", torch.arange(t), t, h)
    codes = k.quant.view(torch.uint8) & 0x7F
    assert (codes == 0x7E).any() and ((codes > 0) & (codes < 0x7E)).float().mean() > 0.5


def test_batched_shape_and_misaligned_views(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(11)
    h = 512
    base = torch.randn(6 * h + 4, generator=g, device="cuda").to(torch.float16)
    a = base[4:].view(2, 3, h)  # 8-byte offset: not 16-byte aligned
    residual = torch.randn(2, 3, h, generator=g, device="cuda").to(torch.float16)
    weight = torch.randn(h, generator=g, device="cuda").to(torch.float16)
    scale = torch.tensor([0.01], dtype=torch.float32, device="cuda")
    a_before = a.clone()
    k = run_kernel(monkeypatch, a, residual, weight, EPS, "nvfp4", scale, True, "swizzled")
    e = ref.fused_tail(a, residual, weight, EPS, "nvfp4", scale, True, "swizzled")
    assert torch.equal(a, a_before)
    assert k.residual.shape == (6, h)
    assert_residual(k.residual, e.residual)
    assert_norm(k.norm, e.norm)
    check_exact_quant(k, k.norm, "nvfp4", scale, "swizzled", torch.arange(6), 6, h)


def _graph_inputs():
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(64, 4096, generator=g, device="cuda").to(torch.bfloat16)
    residual = torch.randn(64, 4096, generator=g, device="cuda").to(torch.bfloat16)
    weight = torch.randn(4096, generator=g, device="cuda").to(torch.bfloat16)
    scale = torch.tensor([0.002], dtype=torch.float32, device="cuda")
    return a, residual, weight, scale


def test_cuda_graph_capture_after_warmup():
    a, residual, weight, scale = _graph_inputs()
    ft.warmup(torch.bfloat16, "nvfp4", 4096)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ft.run(a, residual, weight, EPS, "nvfp4", scale, True, "swizzled")
    fresh = torch.randn_like(a, dtype=torch.float32).to(torch.bfloat16)
    a.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    e = ref.fused_tail(fresh, residual, weight, EPS, "nvfp4", scale, True, "swizzled")
    assert_residual(out.residual, e.residual)
    assert_norm(out.norm, e.norm)
    check_exact_quant(out, out.norm, "nvfp4", scale, "swizzled", torch.arange(64), 64, 4096)


def test_first_use_inside_capture_raises():
    a, residual, weight, scale = _graph_inputs()
    ft._RUNS.clear()  # run()'s per-signature entries hold loaded launchers too
    ft._launcher.cache_clear()
    jit._kernel.cache_clear()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(jit.JitError, match="eagerly"):
        with torch.cuda.graph(graph):
            ft.run(a, residual, weight, EPS, "fp8", scale)
    # Eager use afterwards works, and then capture does.
    k = ft.run(a, residual, weight, EPS, "fp8", scale)
    assert_residual(k.residual, ref.fused_tail(a, residual, weight, EPS, "fp8", scale).residual)


def test_chained_launches_see_the_previous_kernels_outputs():
    """Each call's input is the previous call's residual output, launched back to back: with
    programmatic dependent launch (SM 9.0+) a kernel starts while its producer still runs, so a
    missing pdl_wait() would read rows the producer has not written yet."""
    g = torch.Generator(device="cuda").manual_seed(5)
    t, h, calls = 256, 8192, 24
    weight = (1 + 0.1 * torch.randn(h, generator=g, device="cuda")).to(torch.bfloat16)
    residuals = [torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16) for _ in range(calls)]
    a = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16)
    ft.warmup(torch.bfloat16, None, h)
    kernel = ft.FUSED_TAIL.kernel(ft.FUSED_TAIL.name_expression(torch.bfloat16, NONE, ft.launch_config(h, t, True)[0]),
                                  torch.cuda.current_device())
    assert kernel.pdl == (torch.cuda.get_device_capability() >= (9, 0) and os.environ.get("COMMFUSE_PDL") != "0")
    outs, x = [], a
    for r in residuals:
        x = ft.run(x, r, weight, EPS).residual
        outs.append(x)
    torch.cuda.synchronize()
    x = a
    for r, out in zip(residuals, outs):
        x = ref.fused_tail(x, r, weight, EPS).residual
        assert_residual(out, x)


# --------------------------------------------------------------------------- computed FP8 scales, weight offset

# (quant, scale_layout, scale_ue8m0)
SCALED = (("fp8_per_token", "row", False), ("fp8_block", "row", False), ("fp8_block", "mn_major", False),
          ("fp8_block", "row", True), ("fp8_block", "mn_major", True))


def storage_bytes(x):
    """Every byte of x's storage from its first element on: an MN-major view's padding included."""
    n = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
    return torch.as_strided(x, (n,), (1,)).view(torch.uint8)


def run_scaled(monkeypatch, *args, **kwargs):
    """run_kernel for outputs that may be strided views: whole storages compared across the poisons."""
    first, second = poisoned_runs(lambda: ft.run(*args, **kwargs))
    for name, x, y in zip(first._fields, first, second):
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(storage_bytes(x), storage_bytes(y)), \
                f"{name}: elements left unwritten (or the kernel is not deterministic)"
    return first


def check_scaled(monkeypatch, a, residual, weight, quant, scale_layout, scale_ue8m0, weight_offset, return_norm):
    """Against reference.fused_tail (within the tolerances: the norm's sum of squares runs in another
    order), and bit for bit against the CPU reference quantizer over the kernel's own norm."""
    t, h = a.shape
    kw = dict(weight_offset=weight_offset, scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    k = run_scaled(monkeypatch, a, residual, weight, EPS, quant, None, return_norm, "swizzled", **kw)
    e = ref.fused_tail(a, residual, weight, EPS, quant, None, return_norm, "swizzled", weight_offset, scale_layout,
                       scale_ue8m0)
    for name, x, y in zip(k._fields, k, e):
        assert (x is None) == (y is None), name
    assert_residual(k.residual, e.residual)
    norm = ref.fused_tail(a, residual, weight, EPS, weight_offset=weight_offset).norm
    why = tolerance.tail_mismatch(k, e, quant, scale_layout=scale_layout, scale_ue8m0=scale_ue8m0, norm=norm)
    assert why is None, why
    kn = k.norm if return_norm else ft.run(a, residual, weight, EPS, quant, None, True, "swizzled", **kw).norm
    x = kn.cpu()
    q, s = (ref.quantize_fp8_per_token(x) if quant == "fp8_per_token"
            else ref.quantize_fp8_block(x, ref.FP8_BLOCK, scale_layout, scale_ue8m0))
    got = k.quant.cpu().view(torch.uint8)
    assert torch.equal(got, q.view(torch.uint8)), f"codes differ at {(got != q.view(torch.uint8)).nonzero()[:5].tolist()}"
    assert (k.scales.shape, k.scales.dtype, k.scales.stride()) == (s.shape, s.dtype, s.stride())
    assert torch.equal(storage_bytes(k.scales).cpu(), storage_bytes(s)), "scales (or their padding) differ"
    if t > NAN_ROW:  # a NaN makes the whole row's norm NaN: every scale of it is NaN, every code the NaN code
        assert (k.quant[NAN_ROW].view(torch.uint8) == 0x7F).all()
    return k


@pytest.mark.parametrize("weight_offset", (0.0, 1.0))
@pytest.mark.parametrize("quant, scale_layout, scale_ue8m0", SCALED)
@pytest.mark.parametrize("hidden", (128, 384, 4096, 7168, 16384, 32768))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_computed_scales_match_reference(dtype, hidden, quant, scale_layout, scale_ue8m0, weight_offset, monkeypatch):
    # 1, 7 and 130 rows: MN-major padding rows (roundup(t, 4)); 600: the many-rows configuration;
    # 32768 takes the looped variant (fp8_per_token's extra amax pass). Spike, zero-block, NaN, Inf,
    # zero rows (make_inputs) and the big column, whose norms overflow to +-Inf (a scale of +Inf).
    for tokens in (1, 7, 130, 600):
        seed = hidden * 31 + tokens
        a, residual, weight, _, _ = make_inputs(tokens, hidden, dtype, seed)
        check_scaled(monkeypatch, a, residual, weight, quant, scale_layout, scale_ue8m0, weight_offset,
                     return_norm=tokens % 2 == 1)


@pytest.mark.parametrize("quant", (None, "fp8", "nvfp4"))
@pytest.mark.parametrize("hidden", (128, 4096, 32768))
def test_weight_offset_of_static_kinds(quant, hidden, monkeypatch):
    """Gemma's (1 + w) on the kinds with a given scale, and an offset of 0 keeping a -0.0 weight's sign."""
    for tokens in (1, 130):
        a, residual, weight, special, big_col = make_inputs(tokens, hidden, torch.bfloat16, hidden + tokens)
        weight[::7] = -0.0
        base = ref.fused_tail(a, residual, weight, EPS, weight_offset=1.0)
        scale = scale_for(quant, base.norm, special, big_col) if quant else None
        for offset in (0.0, 1.0):
            k = run_kernel(monkeypatch, a, residual, weight, EPS, quant, scale, True, "swizzled", weight_offset=offset)
            e = ref.fused_tail(a, residual, weight, EPS, quant, scale, True, "swizzled", offset)
            assert_residual(k.residual, e.residual)
            assert_norm(k.norm, e.norm)
            if quant:
                check_exact_quant(k, k.norm, quant, scale, "swizzled", torch.arange(tokens), tokens, hidden)
        # -0.0 weights: zero rows keep the -0.0 of x * inv * w without an offset
        zero = torch.zeros_like(a)
        k = run_kernel(monkeypatch, zero, zero, weight, EPS, None, None, False, "swizzled")
        assert same(k.norm, ref.fused_tail(zero, zero, weight, EPS).norm).all()


def test_computed_scales_in_a_cuda_graph():
    a, residual, weight, _ = _graph_inputs()
    kw = dict(scale_layout="mn_major", scale_ue8m0=True, weight_offset=1.0)
    ft.warmup(torch.bfloat16, "fp8_block", 4096)
    ft.warmup(torch.bfloat16, "fp8_per_token", 4096)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block = ft.run(a, residual, weight, EPS, "fp8_block", None, True, **kw)
        token = ft.run(a, residual, weight, EPS, "fp8_per_token", None, True, weight_offset=1.0)
    fresh = torch.randn_like(a, dtype=torch.float32).to(torch.bfloat16)
    a.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    e = ref.fused_tail(fresh, residual, weight, EPS, "fp8_block", None, True, "swizzled", 1.0, "mn_major", True)
    assert tolerance.tail_mismatch(block, e, "fp8_block", scale_layout="mn_major", scale_ue8m0=True) is None
    q, s = ref.quantize_fp8_block(block.norm.cpu(), ref.FP8_BLOCK, "mn_major", True)
    assert torch.equal(block.quant.cpu().view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(storage_bytes(block.scales).cpu(), storage_bytes(s))
    q, s = ref.quantize_fp8_per_token(token.norm.cpu())
    assert torch.equal(token.quant.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(token.scales.cpu(), s)


# --------------------------------------------------------------------------- MXFP8


@pytest.mark.parametrize("weight_offset", (0.0, 1.0))
@pytest.mark.parametrize("sf_layout", ("swizzled", "linear"))
@pytest.mark.parametrize("hidden", (32, 96, 2880, 4096, 7168, 16384, 32768))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_mxfp8_matches_reference(dtype, hidden, sf_layout, weight_offset, monkeypatch):
    """MXFP8 (a power-of-two scale per 32 elements as UE8M0 bytes, in NVFP4's scale-factor layouts): within
    the tolerances of the reference tail, and bit for bit the CPU reference quantizer over the kernel's
    own norm, every output byte written (two poisons), the swizzled padding 0. 96 and 2880: K = h/32 not a
    multiple of 4 (padding columns); 130 rows: a second 128-row tile; 600: the many-rows configuration;
    32768: the looped variant. The special rows: NaN (a NaN block), Inf, zeros, and the big column."""
    for tokens in (1, 7, 130, 600):
        a, residual, weight, _, _ = make_inputs(tokens, hidden, dtype, hidden * 13 + tokens)
        kw = dict(weight_offset=weight_offset)
        return_norm = tokens % 2 == 1
        k = run_scaled(monkeypatch, a, residual, weight, EPS, "mxfp8", None, return_norm, sf_layout, **kw)
        e = ref.fused_tail(a, residual, weight, EPS, "mxfp8", None, return_norm, sf_layout, weight_offset)
        for name, x, y in zip(k._fields, k, e):
            assert (x is None) == (y is None), name
        assert_residual(k.residual, e.residual)
        norm = ref.fused_tail(a, residual, weight, EPS, weight_offset=weight_offset).norm
        why = tolerance.tail_mismatch(k, e, "mxfp8", sf_layout, norm=norm)
        assert why is None, why
        kn = k.norm if return_norm else ft.run(a, residual, weight, EPS, "mxfp8", None, True, sf_layout, **kw).norm
        q, sf = ref.quantize_mxfp8(kn.cpu(), sf_layout)
        assert torch.equal(k.quant.cpu().view(torch.uint8), q.view(torch.uint8)), "codes differ"
        assert k.scale_factors.dtype == torch.uint8 and torch.equal(k.scale_factors.cpu(), sf), "scale factors differ"
        if tokens > NAN_ROW:  # a NaN makes the row's norm NaN: UE8M0 0xFF (NaN) for every block, NaN codes
            K = hidden // 32
            row_sf = ref.unswizzle_scale_factors(k.scale_factors, tokens, K) if sf_layout == "swizzled" \
                else k.scale_factors
            assert (row_sf[NAN_ROW] == 0xFF).all() and (k.quant[NAN_ROW].view(torch.uint8) == 0x7F).all()


def test_a_post_norm_call_captures_after_its_warmup():
    """fused_tail.warmup(post=True) compiles and loads the POST variants of every row count, so that a post call of
    a row count not run before is captured into a CUDA graph (compiling or loading there would raise), and its
    replay gives an eager call's bits on new inputs."""
    from commfuse.kernels import native

    from compare import bits_equal

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(5)
    t, h = 300, 3072  # a hidden size no other test here runs with a post-norm: its variants are first loaded here
    a, residual = ((torch.randn(t, h, generator=g) * 3).bfloat16().cuda() for _ in range(2))
    weight, post = ((1 + 0.1 * torch.randn(h, generator=g)).bfloat16().cuda() for _ in range(2))
    ft.warmup(torch.bfloat16, "nvfp4", h, post=True)
    scale = torch.tensor([0.05]).cuda()
    spec = TailSpec.of("nvfp4", return_norm=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the plan too: it takes the kernel then
        run = native.launcher(ft.FUSED_TAIL.plan(torch.bfloat16, t, h, spec, torch.cuda.current_device(), post=True))
        captured = run(a, residual, weight, scale, None, post)
    a.copy_(torch.randn(t, h, generator=g).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    eager = run(a, residual, weight, scale, None, post)
    assert all(bits_equal(c, e) for c, e in zip(captured, eager) if e is not None)


@pytest.mark.parametrize("quant", (None, "fp8", "nvfp4", "fp8_per_token", "fp8_block", "mxfp8"))
@pytest.mark.parametrize("weight_offset", (0.0, 1.0))
# VPT 1 (decode), VPT 2 / 1 at 256-511 rows, VPT 4 (many rows), the looped variant (h 32768); fp16; a row whose
# vectors end inside a warp (h 2056: 257 vectors)
@pytest.mark.parametrize("t, h, dtype", [(t, h, torch.bfloat16) for t, h in ((1, 4096), (16, 7168), (300, 4096),
                                                                         (600, 7168), (3, 32768), (5, 2056))]
                         + [(16, 7168, torch.float16), (600, 4096, torch.float16)])
def test_a_post_norm_variant_matches_the_reference(t, h, dtype, weight_offset, quant):
    """The POST variants (docs/semantics.md section 2a; the post weight from the launcher's z): the sum is
    normalised with the post weight before the residual add. The residual within an ulp of the post-normed sum
    plus one of its own of the reference's (the kernel's post-norm may be an ulp off: the order of the sum of
    squares), every output written (poisoned runs agree), and the norm and the quantization those of the kernel's
    own residual (reference.fused_tail of it without a residual) within the tolerances."""
    from commfuse.kernels import native

    from compare import assert_post_residual_close, assert_tail_close, bits_equal

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = TailSpec.of(quant, return_norm=True, weight_offset=weight_offset)
    if h % spec.hidden_multiple:
        pytest.skip(f"{quant} needs h a multiple of {spec.hidden_multiple}")
    g = torch.Generator().manual_seed(t * 7 + h)
    a = (torch.randn(t, h, generator=g) * 3).to(dtype).cuda()
    residual = torch.randn(t, h, generator=g).to(dtype).cuda()
    base = 0.0 if weight_offset else 1.0
    weight = (base + 0.1 * torch.randn(h, generator=g)).to(dtype).cuda()
    post = (base + 0.1 * torch.randn(h, generator=g)).to(dtype).cuda()
    scale = torch.tensor([0.05]).cuda() if quant in ("fp8", "nvfp4") else None
    plan = ft.FUSED_TAIL.plan(dtype, t, h, spec, torch.cuda.current_device(), post=True)
    first, second = poisoned_runs(lambda: ref.Tail(*native.launcher(plan)(a, residual, weight, scale, None, post)))
    for name in ("residual", "norm", "quant", "scale_factors", "scales"):
        assert bits_equal(getattr(first, name), getattr(second, name)), f"{name} not written everywhere"
    want = ref.fused_tail(a, residual, weight, 1e-6, quant, scale, True, weight_offset=weight_offset,
                          post_weight=post)
    assert_post_residual_close(first.residual, want.residual, ref.rmsnorm(a, post, 1e-6, weight_offset))
    assert not bits_equal(first.residual, ref.fused_tail(a, residual, weight, weight_offset=weight_offset).residual)
    own = ref.fused_tail(first.residual, None, weight, 1e-6, quant, scale, True, weight_offset=weight_offset)
    assert_tail_close(ref.Tail(None, *first[1:]), own, quant, scale=scale)
