"""CPU (CI): every kernel variant (fused tail, gated RMSNorm, quantize, MoE combine) compiles with NVRTC for every supported arch, NVRTC
failures become JitErrors that say which kernel and why, and the cubin cache keys and hits.

No GPU needed; skipped with a reason when NVRTC cannot be loaded.
"""
import hashlib
import itertools
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from commfuse import routes
from commfuse.kernels import fused_tail, gated_norm, jit, moe_combine, moe_tail, nccl_mark, params, quantize
from commfuse.kernels.family import CTYPE
from commfuse.kernels.moe_combine import FORMS
from commfuse.routes import Call, Machine, TensorMeta
from commfuse.tail.formats import FORMATS
from commfuse.tail.spec import TailSpec

ARCHS = ("sm_80", "sm_89", "sm_90", "sm_100a", "sm_120a")


def nvrtc_archs():
    """The archs this NVRTC targets (test_p2p.py uses it too); skips the test without NVRTC."""
    try:
        return set(jit.supported_archs())
    except jit.JitError as exc:
        pytest.skip(f"NVRTC not available: {exc}")


def build(source, names, arch):
    """jit.build of `names` as up to os.cpu_count() programs at once, one slice of the names each: NVRTC
    compiles a program's kernels one after another (the 144 MoE tail variants took 44 s for sm_100a as one
    program on a 2-core machine, 22 s as two). Asserts that every name is lowered and its kernel is in the cubin."""
    n = max(1, min(os.cpu_count() or 1, 8, len(names)))
    slices = [tuple(names[i::n]) for i in range(n)]
    # spawn: a test process may have CUDA initialised, which a forked child must not inherit.
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        builds = list(pool.map(jit.build, [source] * n, slices, [arch] * n))
    found = {}
    for built in builds:
        assert built.cubin[:4] == b"\x7fELF"
        found.update({name: symbol.encode() in built.cubin for name, symbol in built.lowered.items()})
    assert sorted(found) == sorted(names)
    assert all(found.values()), f"missing from the {arch} cubins: {[n for n, ok in found.items() if not ok]}"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("COMMFUSE_CACHE_DIR", str(path))
    monkeypatch.delenv("COMMFUSE_JIT_DEBUG", raising=False)
    return path


@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_builds(arch, cache_dir):
    if int(arch[3:].rstrip("a")) not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target {arch}")
    names = fused_tail.variants()
    build(fused_tail.SOURCE, names, arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_nccl_watchdogs_mark_kernel_builds(arch, cache_dir):
    if int(arch[3:].rstrip("a")) not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target {arch}")
    built = jit.build(nccl_mark.SOURCE, tuple(nccl_mark.variants()), arch)
    assert built.lowered[nccl_mark.NAME].encode() in built.cubin
    begin, end = nccl_mark.mark_params(0x1000, 0x2008, 0x2010)  # the struct the kernel takes: three pointers
    assert params.NCCL_MARK.unpack(begin) == (0x1000, 0x2008, 0) and params.NCCL_MARK.unpack(end)[2] == 0x2010


# The register-only families: the gated RMSNorm (every format, None included) and quantize (every format but None).
REGISTER_FAMILIES = [(gated_norm, gated_norm.GATED_NORM, FORMATS), (quantize, quantize.QUANTIZE, FORMATS[1:])]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("module, family, formats", REGISTER_FAMILIES)
def test_every_register_only_variant_builds(arch, module, family, formats, cache_dir):
    if int(arch[3:].rstrip("a")) not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target {arch}")
    names = module.variants()
    assert len(names) == 2 * len(formats) * len(module.VPT_BUCKETS)
    build(module.SOURCE, names, arch)


@pytest.mark.parametrize("module, family, formats", REGISTER_FAMILIES)
def test_register_only_launch_configs_have_variants(module, family, formats):
    names = set(module.variants())
    for hidden in (8, 128, 1024, 2880, 4096, 8192, 8200, 12336, 16384):
        for tokens in (1, 255, 256, 8192):
            for fmt in formats:
                if module is quantize:
                    vpt, threads = module.launch_config(hidden, tokens, TailSpec.of(fmt.name))
                else:
                    vpt, threads = module.launch_config(hidden, tokens)
                assert vpt in module.VPT_BUCKETS and threads % 32 == 0 and threads <= module.MAX_THREADS[vpt]
                assert 8 * vpt * threads >= hidden
                assert family.name_expression(torch.bfloat16, fmt, vpt) in names


@pytest.mark.parametrize("arch", ARCHS)
def test_every_moe_combine_variant_builds(arch, cache_dir):
    """Both element types x the three forms (reduction, int32 / int64 row indices; the weights' dtype is a
    field, not a variant)."""
    if int(arch[3:].rstrip("a")) not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target {arch}")
    names = moe_combine.variants()
    assert len(set(names)) == 2 * len(moe_combine.FORMS)
    built = jit.build(moe_combine.SOURCE, names, arch)
    assert sorted(built.lowered) == sorted(names)
    for name, symbol in built.lowered.items():
        assert symbol.encode() in built.cubin, f"{name} ({symbol}) missing from the {arch} cubin"


@pytest.mark.parametrize("arch", ["sm_80", "sm_100a"])  # the oldest SM and the hardware-E2M1 one
def test_every_moe_tail_variant_builds(arch, cache_dir):
    """fused_tail.cu's moe_tail: both element types x the three forms x every format x every VPT, and at VPT 1 the
    variants built for each of moe_tail.SLOTS."""
    if int(arch[3:].rstrip("a")) not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target {arch}")
    names = moe_tail.variants()
    per_form = len(fused_tail.VPT_BUCKETS) + 1 + len(moe_tail.SLOTS)
    assert len(set(names)) == 2 * len(moe_combine.FORMS) * len(FORMATS) * per_form
    build(moe_tail.SOURCE, names, arch)


@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_120a"])
def test_moe_tail_variant_subset_builds(arch, cache_dir):
    """The other archs build a subset of the MoE tail's variants: every format once, with the element types,
    forms and VPTs mixed (the arch-specific code is epilogue.cuh's conversions and the cluster's exchange)."""
    if int(arch[3:].rstrip("a")) not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target {arch}")
    dtypes, forms, vpts = itertools.cycle(CTYPE), itertools.cycle(FORMS.values()), \
        itertools.cycle(fused_tail.VPT_BUCKETS + (0,))
    names = [moe_tail.MOE_TAIL.name_expression(next(dtypes), next(forms), f, next(vpts)) for f in FORMATS]
    assert set(names) <= set(moe_tail.variants())
    built = jit.build(moe_tail.SOURCE, names, arch)
    for name, symbol in built.lowered.items():
        assert symbol.encode() in built.cubin, f"{name} ({symbol}) missing from the {arch} cubin"


def _spill_report(names):
    """{name: (registers, spill store bytes, spill load bytes)} of fused_tail.cu's `names` (its tails and MoE tails)
    for sm_90 (ptxas' report)."""
    _, lowered, log = jit._nvrtc_compile(jit.CSRC_DIR / fused_tail.SOURCE, tuple(names),
                                         jit.compile_options("sm_90") + ("--ptxas-options=-v",))
    entries = {e.split("'")[1]: e for e in log.split("Compiling entry function")[1:]}
    report = {}
    for name in names:
        e = entries[lowered[name]]
        spills = e.split(" bytes spill stores, ")
        report[name] = (int(e.split("Used ")[1].split(" registers")[0]), int(spills[0].rsplit(" ", 1)[1]),
                        int(spills[1].split(" bytes spill loads")[0]))
    return report


def test_vpt4_tail_variants_fit_four_ctas_without_spills():
    """csrc/fused_tail.cu builds the VPT 4 tails without quantization, fp8 and nvfp4 (the weights loaded after the
    row's sum), and the POST ones of every format (the residual loaded after the post-norm's sum too), for 4 CTAs
    of 256 threads an SM (<= 64 registers on SM 9.0) without a spill (ptxas' report)."""
    if 90 not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target sm_90")
    names = tuple(fused_tail.FUSED_TAIL.name_expression(d, f, 4) for d in (torch.bfloat16, torch.float16)
                  for f in FORMATS if f.name in (None, "fp8", "nvfp4"))
    names += tuple(fused_tail.FUSED_TAIL.name_expression(d, f, 4, True) for d in (torch.bfloat16, torch.float16)
                   for f in FORMATS)
    for name, (used, spill_st, spill_ld) in _spill_report(names).items():
        assert spill_st == spill_ld == 0, f"{name} spills {spill_st} / {spill_ld} bytes"
        assert used <= 65536 // (4 * 256), f"{name}: {used} registers do not fit 4 CTAs of 256 threads"


def test_moe_tail_slot_variants_fit_without_spills():
    """The VPT 1 MoE tails built for a k of moe_tail.SLOTS (the combine unrolled, its rows in flight at once) fit
    their bounds without a spill: 1024 threads (<= 64 registers on SM 9.0) up to moe_tail.COMBINE_CHUNK slots,
    moe_tail.SLOT_THREADS above; bf16, every form and format (ptxas' report)."""
    if 90 not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target sm_90")
    slots = {moe_tail.MOE_TAIL.name_expression(torch.bfloat16, form, f, 1, k): k for form in FORMS.values()
             for f in FORMATS for k in moe_tail.SLOTS}
    names = list(slots)
    n = max(1, min(os.cpu_count() or 1, 8))
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        reports = {}
        for part in pool.map(_spill_report, [names[i::n] for i in range(n)]):
            reports.update(part)
    for name, (regs, spill_st, spill_ld) in reports.items():
        threads = 1024 if slots[name] <= moe_tail.COMBINE_CHUNK else moe_tail.SLOT_THREADS
        assert regs <= min(255, 65536 // threads) and spill_st == spill_ld == 0, (name, regs, spill_st, spill_ld)


def test_moe_tail_configs_have_variants():
    """warmup's configs are built variants and hold launch_config's VPT at every row count, each form."""
    names = set(moe_tail.variants())
    rows = (1, fused_tail.LATENCY_TOKENS - 1, fused_tail.LATENCY_TOKENS, moe_tail.WIDE_TOKENS - 1, moe_tail.WIDE_TOKENS,
            8192)
    for hidden in (8, 2880, 4096, 7168, 16384, 32000):
        for fmt in FORMATS:
            configs = set(moe_tail.MOE_TAIL.configs(torch.bfloat16, TailSpec.of(fmt.name), hidden))
            assert configs <= names
            for t in rows:
                vpt = moe_tail.launch_config(hidden, t)[0]
                assert {moe_tail.MOE_TAIL.name_expression(torch.bfloat16, form, fmt, vpt)
                        for form in FORMS.values()} <= configs, (hidden, t)


def test_moe_tail_launch_rule():
    """From LATENCY_TOKENS to WIDE_TOKENS rows the MoE tail takes fewer vectors a thread than the dense tail's
    throughput rule (VPT 1 up to 512 threads, then 2); elsewhere the dense tail's rule."""
    lc = moe_tail.launch_config
    assert lc(4096, 256) == (1, 512) and lc(7168, 256) == (2, 448) and lc(8192, 511) == (2, 512)
    assert lc(2048, 300) == (1, 256) and lc(16384, 256) == (2, 1024) and lc(16392, 256) == (0, 256)
    assert lc(4096, 512) == fused_tail.launch_config(4096, 512) == (4, 128)
    assert lc(7168, 255) == fused_tail.launch_config(7168, 255) == (1, 896) and lc(7168, 1024) == (4, 224)


def test_variants_cover_every_launch_config():
    names = set(fused_tail.variants())
    assert len(names) == 2 * len(FORMATS) * (len(fused_tail.VPT_BUCKETS) + 1) * 2  # with and without a post-norm
    rows = (1, fused_tail.LATENCY_TOKENS - 1, fused_tail.LATENCY_TOKENS, fused_tail.PLAIN_WIDE_TOKENS - 1,
            fused_tail.PLAIN_WIDE_TOKENS, 8192)
    for hidden in (16, 24, 128, 1000, 2048, 2056, 2880, 4096, 4104, 5120, 7168, 8192, 8200, 16384, 16392, 32000,
                   65536):
        for tokens, plain, residual in itertools.product(rows, (False, True), (False, True)):
            vpt, threads = fused_tail.launch_config(hidden, tokens, plain, residual)
            assert threads % 32 == 0 and 32 <= threads <= fused_tail.MAX_THREADS[vpt]
            few = tokens < fused_tail.LATENCY_TOKENS
            vectors = hidden // 8
            need = -(-vectors // 2)  # threads that cover the row at VPT 2
            if plain and few and vectors <= 2 * fused_tail.MAX_THREADS[2]:  # VPT 2
                assert (vpt, threads) == (2, max(32, -(-need // 32) * 32)), (hidden, tokens)
                continue
            wide = (residual and need <= fused_tail.THROUGHPUT_THREADS) or (
                need > fused_tail.THROUGHPUT_THREADS and tokens < fused_tail.PLAIN_WIDE_TOKENS)
            if plain and not few and wide and 64 <= need <= fused_tail.PLAIN_THREADS:  # VPT 2, up to 512 threads
                assert (vpt, threads) == (2, -(-need // 32) * 32), (hidden, tokens)
                continue
            assert (vpt, threads) == fused_tail.row_config(hidden, few), (hidden, tokens, plain, residual)
            limit = {v: fused_tail.MAX_THREADS[v] if few else fused_tail.THROUGHPUT_THREADS
                     for v in fused_tail.VPT_BUCKETS}
            assert (vpt == 0) == (hidden > 8 * max(v * limit[v] for v in limit)), (hidden, tokens)
            if vpt:
                assert vpt * threads * 8 >= hidden and threads <= limit[vpt], (hidden, tokens)
            for dtype in (torch.float16, torch.bfloat16):
                for fmt in FORMATS:
                    assert fused_tail.FUSED_TAIL.name_expression(dtype, fmt, vpt) in names


def test_plain_launch_rule_at_measured_shapes():
    """The rule of a tail without quantization at the shapes its numbers were measured (fused_tail's docstring)."""
    lc = fused_tail.launch_config
    assert lc(7168, 16, True) == (2, 448) and lc(8192, 16, True) == (2, 512) and lc(8192, 64, True, False) == (2, 512)
    assert lc(4096, 1, True) == (2, 256) and lc(4096, 128, True, False) == (2, 256) and lc(2048, 1, True) == (2, 128)
    assert lc(4096, 1024, True) == (2, 256) and lc(4096, 8192, True) == (2, 256)
    assert lc(7168, 256, True) == (2, 448) and lc(7168, 256, True, False) == (2, 448)
    assert lc(7168, 1024, True) == (4, 224) and lc(8192, 1024, True) == (4, 256) and lc(8192, 8192, True) == (4, 256)
    assert lc(8192, 1024, True, False) == (4, 256)


def test_gated_split_rule():
    """At few rows the gated norm's row is split into slices of whole groups and whole format blocks, at least
    MIN_SLICE long; from MANY_SPLIT_TOKENS rows into the fewest slices of at most 4096, whatever the group size;
    never between, where no slicing of whole groups and blocks fits, or for a format whose scale is the whole row's."""
    none, fp8_block, per_token = (TailSpec.of(q) for q in (None, "fp8_block", "fp8_per_token"))
    s = gated_norm.splits
    assert s(8192, 1, 1024, none) == 8 and s(8192, 16, 2048, none) == 4 and s(7168, 1, 1024, none) == 7
    assert s(4096, 1, 128, none) == 4 and s(7168, 1, 128, none) == 7 and s(4096, 64, 2048, none) == 2
    assert s(8192, 127, 1024, none) == 8 and s(8192, 128, 1024, none) == 1 and s(8192, 1, 1024, per_token) == 1 and s(1024, 1, 128, none) == 1
    assert s(2880, 1, 1440, none) == 1 and s(8192, 1, 8, fp8_block) == 8 and s(7168, 1, 64, fp8_block) == 7
    assert s(8192, 1024, 1024, none) == 2 and s(8192, 8192, 2048, none) == 2 and s(7168, 1024, 1024, none) == 7
    assert s(16384, 4096, 2048, fp8_block) == 4 and s(4096, 1024, 1024, none) == 1 and s(8192, 511, 1024, none) == 1
    assert s(8192, 8192, 512, none) == 2 and s(8192, 8192, 1024, per_token) == 1 and s(2880, 2048, 1440, none) == 1
    assert s(7168, 8192, 128, none) == 2 and s(4096, 8192, 128, none) == 1 and s(8192, 511, 128, none) == 1
    for h in range(128, 16385, 128):
        for g in (8, 64, 128, 192, 256, 1024, 2048):
            for t in (1, gated_norm.MANY_SPLIT_TOKENS) if h % g == 0 else ():
                n = s(h, t, g, fp8_block)
                assert h % n == 0 and (h // n) % g == 0 and (h // n) % 128 == 0 and (n == 1 or h // n >= 1024)
                vpt = gated_norm.launch_config(h // n, t)[0]
                assert gated_norm.GATED_NORM.name_expression(torch.bfloat16, fp8_block.format, vpt) in set(
                    gated_norm.GATED_NORM.configs(torch.bfloat16, fp8_block, h)), (h, g, t, n)


def test_warmup_configs_cover_every_row_count():
    """warmup compiles what any row count may launch (a CUDA graph cannot compile): configs holds launch_config's
    variant at every row count, for each format, with a residual and without; with post, the POST variant of each
    (with a residual) and nothing else."""
    for hidden in (2048, 4096, 7168, 8192, 16384, 32000):
        for fmt in FORMATS:
            spec = TailSpec.of(fmt.name)
            names = set(fused_tail.FUSED_TAIL.configs(torch.bfloat16, spec, hidden))
            post = set(fused_tail.FUSED_TAIL.configs(torch.bfloat16, spec, hidden, post=True))
            assert all(n.endswith(", true>") for n in post) and all(n.endswith(", false>") for n in names)
            for tokens in range(1, 1100, 7):
                for residual in (True, False):
                    vpt = fused_tail.launch_config(hidden, tokens, spec.quant is None, residual)[0]
                    assert fused_tail.FUSED_TAIL.name_expression(torch.bfloat16, fmt, vpt) in names
                    if residual:
                        assert fused_tail.FUSED_TAIL.name_expression(torch.bfloat16, fmt, vpt, True) in post


def test_broken_source_raises_jit_error_with_log(tmp_path, cache_dir):
    nvrtc_archs()
    src = tmp_path / "broken.cu"
    src.write_text('#include "epilogue.cuh"\n'
                   "template <int N> __global__ void broken(int* x) { x[0] = N + undefined_symbol; }\n")
    with pytest.raises(jit.JitError) as info:
        jit.compile_cubin(str(src), ["broken<3>"], "sm_90")
    msg = str(info.value)
    assert "broken<3>" in msg and "broken.cu" in msg and "sm_90" in msg
    assert "undefined_symbol" in msg  # the NVRTC log itself
    assert not cache_dir.exists() or not any(cache_dir.iterdir())


def test_missing_source_raises_jit_error(cache_dir):
    with pytest.raises(jit.JitError, match="not_there.cu"):
        jit.compile_cubin("not_there.cu", ["k<1>"], "sm_90")


def test_the_cached_build_reads_csrc_headers_whatever_the_working_directory(tmp_path, cache_dir, monkeypatch):
    """A quoted include is looked for in the program's folder first: a rank started in a folder of its own
    pdl.cuh (another checkout's csrc/) compiled that one, under a key that holds csrc's, for every later
    process. The program is named by its absolute path, so csrc's headers are the ones compiled."""
    nvrtc_archs()
    shadow = tmp_path / "project"
    shadow.mkdir()
    (shadow / "pdl.cuh").write_text("#pragma once\n__global__ void from_the_working_directory(int* p) { *p = 1; }\n")
    monkeypatch.chdir(shadow)
    name = moe_combine.variants()[0]
    built = jit.build(moe_combine.SOURCE, (name,), "sm_90")
    assert b"from_the_working_directory" not in built.cubin
    assert built.lowered[name].encode() in built.cubin


def test_a_source_of_its_own_folder_is_keyed_by_its_headers(tmp_path, cache_dir):
    """A source outside csrc/ (an absolute source_file) includes the headers beside it: they are in its key."""
    src = tmp_path / "tiny.cu"
    src.write_text('#include "tiny.cuh"\ntemplate <int N> __global__ void tiny(int* x) { x[0] = N + K; }\n')
    header = tmp_path / "tiny.cuh"
    header.write_text("#pragma once\nconstexpr int K = 1;\n")
    before = jit.cache_path(str(src), ["tiny<1>"], "sm_90")
    header.write_text("#pragma once\nconstexpr int K = 2;\n")
    assert jit.cache_path(str(src), ["tiny<1>"], "sm_90") != before


def test_the_key_names_the_nvrtc_build_not_only_its_version(tmp_path, cache_dir, monkeypatch):
    """nvrtcVersion gives (major, minor): a patch release of NVRTC, which generates other code, must not load
    the cubins (nor reuse the calibration) of the build before it."""
    nvrtc_archs()
    src = tmp_path / "tiny.cu"
    src.write_text("template <int N> __global__ void tiny(int* x) { x[0] = N; }\n")
    old_build = tmp_path / "libnvrtc.so.13.0.48"
    old_build.write_bytes(b"x" * 10)
    nvrtc, _ = jit._nvrtc_library()
    monkeypatch.setattr(jit, "_nvrtc_library", lambda: (nvrtc, str(old_build)))
    entry, digest = jit.cache_path(str(src), ["tiny<1>"], "sm_90"), jit.sources_digest()
    patched = tmp_path / "libnvrtc.so.13.0.88"
    patched.write_bytes(b"x" * 10)
    monkeypatch.setattr(jit, "_nvrtc_library", lambda: (nvrtc, str(patched)))  # a toolkit's: the name says
    assert jit.cache_path(str(src), ["tiny<1>"], "sm_90") != entry and jit.sources_digest() != digest
    old_build.write_bytes(b"x" * 11)  # a wheel's: the same name, another library
    monkeypatch.setattr(jit, "_nvrtc_library", lambda: (nvrtc, str(old_build)))
    assert jit.cache_path(str(src), ["tiny<1>"], "sm_90") != entry and jit.sources_digest() != digest


def test_cache_key_and_hit(tmp_path, cache_dir, monkeypatch):
    nvrtc_archs()
    src = tmp_path / "tiny.cu"
    src.write_text("template <int N> __global__ void tiny(int* x) { x[threadIdx.x] = N; }\n")
    names = ["tiny<1>", "tiny<2>"]
    entry = jit.cache_path(str(src), names, "sm_90")
    assert entry.parent == cache_dir
    assert entry != jit.cache_path(str(src), names, "sm_80")
    assert entry != jit.cache_path(str(src), ["tiny<1>"], "sm_90")
    monkeypatch.setenv("COMMFUSE_JIT_DEBUG", "1")
    assert "-lineinfo" in jit.compile_options("sm_90")
    assert entry != jit.cache_path(str(src), names, "sm_90")
    monkeypatch.delenv("COMMFUSE_JIT_DEBUG")
    assert entry == jit.cache_path(str(src), names, "sm_90")

    cubin = jit.compile_cubin(str(src), names, "sm_90")
    assert entry.is_file()
    assert [p.name for p in cache_dir.iterdir()] == [entry.name]  # no temporary file left behind

    def no_nvrtc(*args):
        raise AssertionError("NVRTC called although the cubin is cached")

    with monkeypatch.context() as m:
        m.setattr(jit, "_nvrtc_compile", no_nvrtc)
        assert jit.compile_cubin(str(src), names, "sm_90") == cubin

    # A damaged entry is rebuilt, not loaded: garbage, a body cut short, a flipped byte, a header that is
    # not an object.
    whole = entry.read_bytes()
    head = whole[:len(whole) - len(cubin)]
    flipped = bytearray(whole)
    flipped[-10] ^= 0x40
    # The header is covered too: names swapped (their body digest recomputed), an entry written for another
    # key's name (another arch's cubin copied over), a header nested past the recursion limit.
    lowered = json.loads(head[len(jit._CACHE_MAGIC):].decode())["lowered"]
    swapped = dict(zip(lowered, reversed(list(lowered.values()))))  # tiny<1> would load tiny<2>'s symbol
    assert swapped != lowered
    forged = {"lowered": swapped, "sha256": hashlib.sha256(cubin).hexdigest()}
    other = entry.with_name(entry.name.replace("sm_90", "sm_80"))
    copied = {"lowered": lowered, "sha256": jit._digest(other, lowered, cubin)}
    nested = b"[" * 100000 + b"]" * 100000
    header_cases = [jit._CACHE_MAGIC + json.dumps(h).encode() + b"\n" + cubin for h in (forged, copied)]
    for damaged in (b"garbage", whole[:len(head) + len(cubin) // 2], bytes(flipped), jit._CACHE_MAGIC + b"null\n" + cubin,
                    *header_cases, jit._CACHE_MAGIC + nested + b"\n" + cubin):
        entry.write_bytes(damaged)
        calls = []
        with monkeypatch.context() as m:
            m.setattr(jit, "_nvrtc_compile", lambda *a, real=jit._nvrtc_compile: calls.append(1) or real(*a))
            assert jit.compile_cubin(str(src), names, "sm_90") == cubin
        assert calls == [1] and entry.read_bytes() == whole  # rebuilt and rewritten
    entry.unlink()
    os.mkfifo(entry)  # reading it would wait for a writer: rebuilt, the FIFO replaced
    assert jit.compile_cubin(str(src), names, "sm_90") == cubin and entry.read_bytes() == whole

    # Any change of the sources changes the key.
    src.write_text(src.read_text() + "// edited\n")
    assert jit.cache_path(str(src), names, "sm_90") != entry


def test_the_cache_goes_to_a_temporary_folder_without_a_home(monkeypatch):
    monkeypatch.delenv("COMMFUSE_CACHE_DIR", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    temporary = jit.Path(jit.tempfile.gettempdir()) / f"commfuse-cache-{os.getuid()}"
    with monkeypatch.context() as m:
        m.setattr(jit.Path, "home", staticmethod(no_home))
        assert jit.cache_dir() == temporary
    monkeypatch.setenv("HOME", "")  # set but empty: no home either (it gave /.cache/commfuse)
    assert jit.cache_dir() == temporary
    monkeypatch.setenv("COMMFUSE_CACHE_DIR", "/somewhere")
    assert jit.cache_dir() == jit.Path("/somewhere")


def test_arch_for_capability():
    assert jit.arch_for_capability((8, 0)) == "sm_80"
    assert jit.arch_for_capability((8, 9)) == "sm_89"
    assert jit.arch_for_capability((9, 0)) == "sm_90"
    assert jit.arch_for_capability((10, 0)) == "sm_100a"
    assert jit.arch_for_capability((12, 0)) == "sm_120a"


def _meta(shape, dtype=torch.bfloat16, device="cuda:0"):
    return TensorMeta(tuple(shape), dtype, torch.device(device))


def test_the_routes_use_the_familys_limits():
    assert fused_tail.FUSED_TAIL.limits.max_hidden == fused_tail.MAX_HIDDEN
    scale = _meta((1,), torch.float32)

    def plan(h, quant, sm=(9, 0)):
        c = Call("fused", _meta((64, h)), _meta((64, h)), _meta((h,)), scale if quant else None,
                 spec=TailSpec.of(quant))
        return routes.plan(c, Machine("fallback", "nccl", sm, 2))

    ok = plan(8192, "nvfp4")
    assert (ok.collective, ok.tail, ok.kernel) == ("nccl", "fused", "fused_tail")
    assert plan(8200, "fp8").tail == "fused"
    assert plan(8200, "nvfp4").tail == "separated"          # h % 16 != 0
    assert plan(1 << 17, None).tail == "separated"          # beyond max_hidden
    assert plan(8192, "nvfp4", sm=(7, 5)).tail == "separated"


def test_parameter_structs_are_declared_once():
    """The C structs come from commfuse/kernels/params.py: every field at its natural alignment (so C lays them
    out as the Python packing does), the header declares each field in order and asserts each size,
    and the kernels' sources hold no struct of their own."""
    for s in (params.TAIL, params.FUSED_TAIL, params.GATED_NORM, params.P2P):
        offset = 0
        for f in s.fields:
            assert s.offsets[f.name] == offset and offset % f.align == 0, (s.name, f.name)
            offset += f.size
        assert s.size == offset == len(s.pack(*[0] * len(s.unpack(bytes(s.size)))))
    assert (params.TAIL.size, params.FUSED_TAIL.size, params.GATED_NORM.size, params.P2P.size) == (96, 112, 128, 344)
    assert params.FUSED_TAIL.offsets["post_weight"] == 104  # last: the other fields keep their offsets
    assert params.P2P.offsets["x"] == 96 and params.P2P.offsets["sig_offset"] == 240 and params.P2P.offsets["rank"] == 272
    assert params.P2P.offsets["combine"] == 280 and params.MOE_COMBINE.size == 64
    header = params.header()
    for s in (params.TAIL, params.FUSED_TAIL, params.GATED_NORM, params.P2P):
        body = header.split(f"struct {s.name} {{", 1)[1].split("};", 1)[0]
        names = [line.split(";")[0].split()[-1].split("[")[0] for line in body.strip().splitlines()]
        assert names == [f.name for f in s.fields], s.name
        assert f"static_assert(sizeof({s.name}) == {s.size}" in header
    structs = (params.TAIL, params.FUSED_TAIL, params.GATED_NORM, params.P2P)
    for source in ("epilogue.cuh", "fused_tail.cu", "gated_rmsnorm.cu", "p2p_allreduce.cu"):
        text = (jit.CSRC_DIR / source).read_text()
        assert not any(f"struct {s.name} {{" in text for s in structs), source
    with pytest.raises(ValueError, match="aligned"):
        params.Struct("Bad", [params.Field("a", "int", "i32"), params.Field("p", "void*", "ptr")])


def test_constants_come_from_the_format_registry():
    """The kernels' QUANT ids and the host's are one list: the header declares kQuant<Name> = id for
    every format, and no kernel source defines one of its own."""
    header = params.header()
    for fmt in FORMATS:
        assert f"constexpr int kQuant{fmt.cname} = {fmt.id};" in header
    for name, value, _ in params.CONSTANTS:
        assert f"constexpr int {name} = {value};" in header
        for source in ("epilogue.cuh", "fused_tail.cu", "gated_rmsnorm.cu", "p2p_allreduce.cu"):
            assert f"constexpr int {name} =" not in (jit.CSRC_DIR / source).read_text(), (name, source)
