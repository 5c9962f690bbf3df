"""The P2P all-reduce (commfuse.p2p, csrc/p2p_allreduce.cu).

CPU part (no GPU; runs on rank 0): every kernel variant builds with NVRTC, the launcher's shapes,
parameter layout, calibration decision, plan registration and error message.

GPU part (`mpirun -n N pytest --with-mpi` on one node with P2P; skipped with a reason elsewhere,
the same decision on every rank): both algorithms x every pattern x fp16/bf16 x shapes against
commfuse.reference fed reference.all_reduce_sum of every rank's input (the exact fp32 rank-order
sum, so the sum and the residual must be bit-exact, the rest within the tolerances of commfuse.tolerance);
outputs allocated poisoned twice with different poisons and equal byte for byte (nothing left
unwritten, and repeated calls identical), also once over an allocator pre-filled with NaN;
bit-identical on every rank; CUDA-graph capture and replay with new inputs; back-to-back calls of
changing shapes and algorithms (the double buffering); a rank that skips a call makes the others
raise P2PTimeoutError within the timeout; messages at and over the workspace size (two-shot in
pieces, or NCCL when no piece fits); the NCCL row
forced on the same machine; calibration and its disk cache.

Every multi-rank test runs all its collectives before its first assertion, so a failing rank
cannot leave the others waiting.
"""
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

from commfuse import Communicator, p2p, reference, routes
from commfuse.kernels import fused_tail, jit, launch, moe_combine, native, params
from commfuse.kernels import p2p_allreduce as K
from commfuse.kernels.p2p_allreduce import P2P_ALLREDUCE, chunk_rows, register_vpts
from commfuse.p2p import P2PLimits
from commfuse.routes import Call, Machine, TensorMeta
from commfuse.tail.formats import FORMATS, by_name
from commfuse.tail.spec import TailSpec

from compare import as_bytes, assert_tail_close, bits_equal, poisoned_runs
from inputs import rank_inputs, tail_inputs
from test_jit_build import nvrtc_archs

mpi = pytest.mark.mpi(min_size=2)
DTYPES = [torch.bfloat16, torch.float16]
ALGOS = list(K.ALGORITHMS)
PATTERNS = [  # (quant, return_norm, sf_layout)
    (None, False, "swizzled"),
    ("fp8", False, "swizzled"), ("fp8", True, "swizzled"),
    ("nvfp4", False, "swizzled"), ("nvfp4", True, "swizzled"),
    ("nvfp4", False, "linear"), ("nvfp4", True, "linear"),
    ("mxfp8", False, "swizzled"), ("mxfp8", True, "linear"),
]
# Every t of (1, 7, 64, 256, 1000) and h of (128, 2880, 4096, 8192) at least once; every tail
# variant: VPT 1 (h <= 8192; 1024 threads at 8192), VPT 2 (a partly covered row: 1542 vectors on
# 800 threads, and 771 NVFP4 blocks, not a multiple of 4) and a row longer than the register tails
# take (the looped variant); several rows per CTA (1000 rows on one CTA per SM).
SHAPES = [(1, 4096), (7, 2880), (64, 8192), (256, 128), (1000, 4096), (3, 12336), (2, 20480)]
EPS = 1e-5


# =========================================================================== CPU


def p2p_name(dtype, quant, vpt, algo):
    """The P2P kernel's name expression; quant "plain" for the plain all-reduce."""
    return P2P_ALLREDUCE.name_expression(dtype, None if quant == "plain" else by_name(quant), vpt, algo)


def _subset():
    """For the other archs, one variant per pattern with dtypes, algorithms and both tail shapes
    mixed: the arch-specific code is epilogue.cuh's conversions, which every quant exercises."""
    bf, hf, (v1, v2) = torch.bfloat16, torch.float16, K.VPT_BUCKETS
    return [p2p_name(bf, "plain", 0, "oneshot"), p2p_name(hf, "plain", 0, "twoshot"),
            p2p_name(hf, None, v1, "oneshot"), p2p_name(bf, None, 0, "twoshot"),
            p2p_name(bf, "fp8", v2, "twoshot"), p2p_name(hf, "fp8", 0, "oneshot"),
            p2p_name(bf, "nvfp4", v1, "oneshot"), p2p_name(hf, "nvfp4", v2, "twoshot"),
            p2p_name(hf, "fp8_per_token", v1, "twoshot"), p2p_name(bf, "fp8_per_token", 0, "oneshot"),
            p2p_name(bf, "fp8_block", v1, "oneshot"), p2p_name(hf, "fp8_block", 0, "twoshot"),
            p2p_name(hf, "mxfp8", v1, "oneshot"), p2p_name(bf, "mxfp8", 0, "twoshot"),
            P2P_ALLREDUCE.name_expression(bf, by_name("nvfp4"), v2, "oneshot", 1),
            P2P_ALLREDUCE.name_expression(hf, by_name("fp8"), v1, "twoshot", 0),
            P2P_ALLREDUCE.name_expression(bf, by_name("mxfp8"), 0, "oneshot", 2), K.DELAY_KERNEL]


# sm_90 (the machine the P2P row targets) builds every variant; every other arch a subset, which keeps
# this test near a minute on a CI core (each variant costs ~0.8 s of NVRTC time).
@pytest.mark.parametrize("arch, names", [("sm_90", None), ("sm_80", "subset"), ("sm_89", "subset"),
                                         ("sm_100a", "subset"), ("sm_120a", "subset")])
def test_variants_build(arch, names, tmp_path, monkeypatch):
    monkeypatch.setenv("COMMFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("COMMFUSE_JIT_DEBUG", raising=False)
    if int(arch[3:].rstrip("a")) not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target {arch}")
    # The MoE variants build (for sm_90) in test_moe_variants_fit_without_spills.
    names = [n for n in K.variants() if n not in K.P2P_ALLREDUCE.moe_variants()] if names is None else _subset()
    assert set(names) <= set(K.variants())
    built = jit.build(K.SOURCE, names, arch)
    assert built.cubin[:4] == b"\x7fELF"
    for name in names:
        assert built.lowered[name].encode() in built.cubin, f"{name} missing from the {arch} cubin"


def _ptxas_resources(log):
    """{mangled kernel: (registers, stack frame bytes, spill store bytes, spill load bytes)} from
    the ptxas -v part of an NVRTC log."""
    out, entry, frame = {}, None, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            entry, frame = m.group(1), None
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and entry and frame is None:
            frame = tuple(int(g) for g in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and entry:
            out[entry] = (int(m.group(1)),) + (frame or (0, 0, 0))
            entry = None
    return out


# Run in a fresh process with CUDA_CACHE_DISABLE=1 (read once, when NVRTC first compiles): NVRTC 13
# answers a repeated compile from the driver's compute cache (~/.nv/ComputeCache) without running
# ptxas, so without its -v report (seen on the GPU machine: an empty log on the second run).
_PTXAS_PROBE = """
import json, sys
from commfuse.kernels import jit, p2p_allreduce as p2p
path = jit._source_path(p2p.SOURCE)
_, lowered, log = jit._nvrtc_compile(path, tuple(json.loads(sys.argv[1])),
                                     jit.compile_options("sm_90", path.parent) + ("--ptxas-options=-v",))
print(json.dumps({"log": log, "lowered": lowered}))
"""


def test_1024_thread_variants_fit_without_spills():
    """The register tails launched with up to 1024 threads (one CTA per SM, __launch_bounds__(1024, 1))
    get <= 64 registers; ptxas must fit them without local memory (sm_90: the P2P machine)."""
    if 90 not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target sm_90")
    plain_oneshot = [p2p_name(d, "plain", 0, "oneshot") for d in DTYPES]
    moe = set(K.P2P_ALLREDUCE.moe_variants())
    names = [n for n in K.variants() if n != K.DELAY_KERNEL and n not in moe and
             K.MAX_THREADS.get(int(n.split(",")[2]), 0) > K.THREADS] + plain_oneshot
    # each format's register tails (the computed-scale kinds: VPT 1 only), and the plain one-shot
    assert len(names) == 2 * 2 * sum(len(register_vpts(f)) for f in FORMATS) + 2
    for name, (regs, frame, spill_st, spill_ld) in _ptxas_report(names).items():
        assert regs <= 64 and frame == spill_st == spill_ld == 0, (name, regs, frame, spill_st, spill_ld)


def _ptxas_report(names):
    """{name: (registers, stack frame, spill store, spill load bytes)} of P2P variants built for sm_90. One
    compile is one thread's work for minutes (the MoE variants): the names are split over one process a core
    this process may run on (its affinity, not os.cpu_count(): a container may see a host's hundreds of cores),
    at most 16 (each process imports torch)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = max(1, min(len(names), cores, 16))
    chunks = [names[i::n] for i in range(n)]
    runs = [subprocess.Popen([sys.executable, "-c", _PTXAS_PROBE, json.dumps(chunk)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "CUDA_CACHE_DISABLE": "1"})
            for chunk in chunks]
    found, lowered = {}, {}
    try:
        for run in runs:
            stdout, stderr = run.communicate(timeout=900)
            assert run.returncode == 0, stderr
            result = json.loads(stdout.splitlines()[-1])
            found.update(_ptxas_resources(result["log"]))
            lowered.update(result["lowered"])
    finally:  # a failed or timed-out probe leaves no others running
        for run in runs:
            run.kill()
            run.wait()
    for name in names:
        assert lowered[name] in found, f"no ptxas resource line for {name}"
    return {name: found[lowered[name]] for name in names}


def test_moe_variants_fit_without_spills():
    """The MoE variants (every tail variant of every combine form) build for sm_90, the register tails within
    the registers of K.MOE_THREADS threads per SM and every one without local memory."""
    if 90 not in nvrtc_archs():
        pytest.skip(f"NVRTC {jit.nvrtc_version()} cannot target sm_90")
    names = P2P_ALLREDUCE.moe_variants()
    assert len(set(names)) == 2 * 2 * len(moe_combine.FORMS) * sum(len(register_vpts(f)) + 1 for f in FORMATS)
    for name, (regs, frame, spill_st, spill_ld) in _ptxas_report(names).items():
        threads = K.MOE_THREADS if int(name.split(",")[2]) else K.THREADS
        assert regs <= 65536 // threads and frame == spill_st == spill_ld == 0, (name, regs, frame, spill_st)


def test_moe_launch_configs_have_variants():
    names = set(P2P_ALLREDUCE.moe_variants())
    for h in (16, 128, 2048, 2880, 4096, 4104, 7168, 8192, 8200, 12288):
        for fmt in FORMATS:
            vpt, threads = K.moe_launch_config(h, fmt)
            if vpt:
                assert threads % 32 == 0 and 32 <= threads <= K.MOE_THREADS and vpt * threads * 8 >= h, (h, fmt)
                assert vpt == min(v for v in register_vpts(fmt) if 8 * v * K.MOE_THREADS >= h), (h, fmt)
            else:
                assert threads == K.THREADS and h > 8 * K.MOE_THREADS * max(register_vpts(fmt)), (h, fmt)
            for algo in ALGOS:
                for form in moe_combine.FORMS.values():
                    assert P2P_ALLREDUCE.name_expression(torch.float16, fmt, vpt, algo, form) in names


def test_launch_configs_have_variants():
    names = set(K.variants()) - set(P2P_ALLREDUCE.moe_variants())
    assert len(names) == 2 * 2 * (1 + sum(len(register_vpts(f)) + 1 for f in FORMATS)) + 1
    assert K.VPT_BUCKETS == (1, 2) and K.MAX_THREADS == {1: 1024, 2: 1024, 0: K.THREADS}
    most = 8 * max(v * K.MAX_THREADS[v] for v in K.VPT_BUCKETS)  # 16384
    for h in (16, 128, 1000, 2880, 4096, 7168, 8192, 8200, 12336, 16384, 16392, 20480, 65536):
        vpt, threads = K.launch_config(h)
        assert threads % 32 == 0 and 32 <= threads <= K.MAX_THREADS[vpt]
        if vpt:
            assert vpt * threads * 8 >= h and (threads == 32 or vpt * (threads - 32) * 8 < h), h
            # the smallest VPT that fits: as fused_tail's few-rows configuration
            assert vpt == min(v for v in K.VPT_BUCKETS if 8 * v * K.MAX_THREADS[v] >= h), h
            assert (vpt, threads) == fused_tail.launch_config(h, 1), h
        else:
            assert h > most and threads == K.THREADS
        for fmt in FORMATS:
            # formats without a VPT 2 variant (register_vpts): their longer rows loop
            qvpt, qthreads = K.launch_config(h, fmt)
            assert (qvpt, qthreads) == ((0, K.THREADS) if vpt == 2 and 2 not in register_vpts(fmt) else (vpt, threads))
            for dtype in DTYPES:
                for algo in ALGOS:
                    assert P2P_ALLREDUCE.name_expression(dtype, fmt, qvpt, algo) in names
    for dtype in DTYPES:
        for algo in ALGOS:
            assert p2p_name(dtype, "plain", 0, algo) in names


@pytest.mark.parametrize("total", [1, 255, 256, 257, 4096, 32768, 140000, 1 << 22, (64 << 20) // 16])
@pytest.mark.parametrize("nblocks", [1, 132])
@pytest.mark.parametrize("algo", ALGOS)
def test_plain_rows_cover_the_message(total, nblocks, algo):
    row_vecs, rows, threads = K.plain_rows(total, nblocks, algo)
    most = K.PLAIN_MAX_ROW_VECS[algo]
    assert K.PLAIN_MIN_ROW_VECS <= row_vecs <= most
    assert (rows - 1) * row_vecs < total <= rows * row_vecs
    if algo == "oneshot":  # whole warps; one vector per thread while rows fit the CTA
        assert row_vecs % 32 == 0 and threads == min(row_vecs, K.PLAIN_ONESHOT_THREADS)
    else:
        assert row_vecs % K.THREADS == 0 and threads == K.THREADS
    if total <= nblocks * most:
        assert rows <= nblocks  # no CTA has two rows while another has none
    if total >= nblocks * K.PLAIN_MIN_ROW_VECS:
        assert 2 * rows >= nblocks  # at least half of the CTAs have work


def test_params_layout_matches_the_kernel():
    # TailParams (96 bytes) first: its pointers, eps/h/t/sf_swizzled at 56, scales_out 72, weight_offset /
    # scale_layout 80, scale_stride 88; then x 96, peers 112, epochs 176, timeout_ns 200, sig_offset 240,
    # total_vecs 248, rows 256, rank 272; the MoE variants' MoeCombineParams at 280 (5 pointers, t, k, h,
    # rows, weights_f32, pad); size 344.
    fields = list(range(1, 8)) + [0.5, 11, 12, 13] + [14, -0.0, 3, 16] + [21, 22] + list(range(31, 39)) + \
        [41, 42, 43] + [51, 52, 53, 54, 55, 56] + [61] + [71, 72, 73, 74, 75, 0] + \
        [81, 82, 83, 84, 85, 91, 92, 93, 94, 95, 96]
    raw = params.P2P.pack(*fields)
    assert len(raw) == 344
    assert struct.unpack_from("<5Q6i", raw, 280) == (81, 82, 83, 84, 85, 91, 92, 93, 94, 95, 96)
    assert struct.unpack_from("<f3i", raw, 56) == (0.5, 11, 12, 13)
    assert struct.unpack_from("<Qfiq", raw, 72) == (14, -0.0, 3, 16)
    assert struct.unpack_from("<I", raw, 80) == (0x80000000,)  # -0.0: "no weight offset" (epilogue.cuh norm_round)
    assert struct.unpack_from("<2Q", raw, 96) == (21, 22)
    assert struct.unpack_from("<8Q", raw, 112) == tuple(range(31, 39))
    assert struct.unpack_from("<3Q", raw, 176) == (41, 42, 43)
    assert struct.unpack_from("<6Q", raw, 200) == (51, 52, 53, 54, 55, 56)
    assert struct.unpack_from("<q5i", raw, 248) == (61, 71, 72, 73, 74, 75)


def test_workspace_sizes():
    assert p2p.default_max_bytes(2) == 64 << 20
    for world in range(2, 9):
        m = p2p.default_max_bytes(world)
        lay = p2p.layout(m, world, 132)
        assert m % (1 << 20) == 0 and lay.slot_bytes == m and lay.lamport_offset == 2 * (world + 1) * m
        # The one-shot's slots: about 32 MiB in all, whatever the world size.
        assert lay.lamport_bytes == (16 << 20) // world // p2p.ALIGN * p2p.ALIGN
        # Signature slots (16 bytes per half, sender and CTA) between the Lamport halves and the flags.
        assert lay.sig_offset == lay.lamport_offset + 2 * world * lay.lamport_bytes
        assert lay.flags_offset - lay.sig_offset >= 2 * world * 132 * 16 and lay.flags_offset % p2p.ALIGN == 0
        assert lay.total_bytes % p2p.ALIGN == 0 and lay.total_bytes < 420 << 20
        for nblocks in (1, 132, 160):  # flags[2 phases][nblocks][world], 64-bit (csrc/p2p_allreduce.cu's flag())
            lay = p2p.layout(m, world, nblocks)
            assert lay.total_bytes - lay.flags_offset >= 2 * nblocks * world * 8
    small = p2p.layout(1000, 2, 132)
    assert small.slot_bytes == small.lamport_bytes == p2p.ALIGN
    assert p2p.calibration_sizes(64 << 20) == [4096 << k for k in range(16)]
    assert p2p.calibration_sizes(3 << 20)[-3:] == [2 << 20, 3 << 20, 6 << 20]


class _Recorder:
    """A jit.Kernel stand-in and a Workspace without buffers or GPU: records what each launch of a
    P2P LaunchPlan passes (CPU tensors; every output given, so nothing is allocated)."""

    def __init__(self, max_bytes):
        self.launches = []
        self.pdl = False
        ws = object.__new__(p2p.Workspace)
        ws.max_bytes, ws.nblocks, ws._index, ws.world, ws.rank = max_bytes, 132, 0, 2, 0
        ws._fixed_params = (0,) * 17
        self.ws = ws

    def launch(self, grid, block, raw, cluster=1):
        assert cluster == 1, "the P2P kernels launch no clusters"
        f = params.P2P.unpack(raw)
        n = len(params.TAIL.format)
        self.launches.append(dict(tail=f[:n], x=f[n], out=f[n + 1], total_vecs=f[n + 19], rows=f[n + 20],
                                  row_vecs=f[n + 21], row_slots=f[n + 22], combine=f[n + 26:], block=block[0]))

    def fused(self, x, residual, weight, scale, spec, algo, out=None):
        t, h = x.shape
        plan = P2P_ALLREDUCE.plan_fused(self.ws, x.dtype, t, h, spec, algo)
        if out is None:
            out = reference.Tail(*(None if o is None else launch.allocate(o, "cpu") for o in plan.outputs))
        return reference.Tail(*launch.PyLauncher(plan)(x, residual, weight, scale, out))

    def plain(self, x, algo, out):
        return launch.PyLauncher(P2P_ALLREDUCE.plan_plain(self.ws, x.dtype, x.shape, algo))(x, out=out)


@pytest.mark.parametrize("weights_dtype, index_dtype", [(torch.float32, None), (torch.float32, torch.int32),
                                                        (torch.bfloat16, torch.int64)])
def test_moe_plan_packs_the_combine(monkeypatch, weights_dtype, index_dtype):
    """plan_moe's one launch, run by launch.PyLauncher (CPU tensors, no kernel runs): the MoE variant of the
    call's form (the index type's); the combine's y, weights, row index and shared pointers, all as given
    (the kernels read either weights dtype, which a field names); t, k, h, rows; the tail's pointers; the
    MoE launch configuration."""
    rec = _Recorder(1 << 20)
    names = []
    monkeypatch.setattr(P2P_ALLREDUCE, "kernel", lambda name, index: names.append(name) or rec)
    t, k, h = 3, 4, 7168
    form = moe_combine.form_of(index_dtype)
    g = torch.Generator().manual_seed(11)
    rows = t * k + 2 if form else 0
    y = torch.randn(*((rows, h) if form else (t, k, h)), generator=g).to(torch.bfloat16)
    idx = torch.randperm(t * k, generator=g).view(t, k).to(index_dtype) if form else None
    w = torch.rand(t, k, generator=g).to(weights_dtype)
    shared, residual = (torch.randn(t, h, generator=g).to(torch.bfloat16) for _ in range(2))
    weight = torch.randn(h, generator=g).to(torch.bfloat16)
    spec = TailSpec.of("fp8", eps=1e-5)
    scale = torch.tensor([0.02])
    plan = P2P_ALLREDUCE.plan_moe(rec.ws, torch.bfloat16, weights_dtype, index_dtype, t, k, h, rows, spec, "twoshot")
    out = reference.Tail(*(None if o is None else launch.allocate(o, "cpu") for o in plan.outputs))
    launch.PyLauncher(plan)(y, residual, weight, scale, out, w, idx, shared)
    vpt, threads = K.moe_launch_config(h, spec.format)
    assert names == [P2P_ALLREDUCE.name_expression(torch.bfloat16, spec.format, vpt, "twoshot", form)]
    (one,) = rec.launches
    y_ptr, w_ptr, idx_ptr, shared_ptr, x_ptr, *sizes = one["combine"]
    assert (y_ptr, w_ptr, idx_ptr, shared_ptr, x_ptr) == (y.data_ptr(), w.data_ptr(), 0 if idx is None else
                                                          idx.data_ptr(), shared.data_ptr(), 0)
    assert sizes == [t, k, h, rows, weights_dtype == torch.float32, 0]
    assert one["block"] == threads and vpt == 2
    assert (one["rows"], one["row_vecs"], one["total_vecs"]) == (t, h // 8, t * h // 8)
    assert one["tail"][0] == residual.data_ptr() and one["tail"][1] == out.residual.data_ptr()
    assert one["tail"][2] == weight.data_ptr() and one["tail"][4] == out.quant.data_ptr()


@pytest.mark.parametrize("t, h, quant, sf_layout", [
    (300, 4096, "nvfp4", "swizzled"), (300, 3088, "nvfp4", "swizzled"), (300, 3088, "nvfp4", "linear"),
    (300, 4104, "fp8", "swizzled"), (300, 4104, None, "swizzled"), (64, 4096, "fp8", "swizzled"),
    (301, 4096, "fp8_per_token", "row"), (301, 3200, "fp8_block", "row"), (301, 3200, "fp8_block", "row_ue8m0"),
    (301, 3200, "fp8_block", "mn_major"), (301, 3200, "fp8_block", "mn_major_ue8m0")])
def test_pieces_cover_every_row_once(monkeypatch, t, h, quant, sf_layout):
    """The launches of a message over a 1 MiB workspace (CPU tensors, no kernel runs): consecutive row
    ranges of whole pieces, each output pointer at the piece's first row (computed independently of
    the plan: row slices, and the swizzled layout's index of (row, block 0)), the last piece
    zeroing the padding rows."""
    rec = _Recorder(1 << 20)
    monkeypatch.setattr(P2P_ALLREDUCE, "kernel", lambda *args: rec)
    g = torch.Generator().manual_seed(7)
    x, residual = (torch.randn(t, h, generator=g).to(torch.bfloat16) for _ in range(2))
    weight = torch.randn(h, generator=g).to(torch.bfloat16)
    scale = torch.tensor([0.02]) if quant in ("fp8", "nvfp4") else None
    scaled = {}
    if quant in ("fp8_per_token", "fp8_block"):  # sf_layout here names the scales' layout
        scaled = dict(scale_layout=sf_layout.replace("_ue8m0", ""), scale_ue8m0=sf_layout.endswith("ue8m0"))
        sf_layout = "swizzled"
    spec = TailSpec.of(quant, return_norm=True, eps=1e-5, sf_layout=sf_layout, **scaled)
    out = rec.fused(x, residual, weight, scale, spec, "twoshot")
    piece = chunk_rows(2 * h, spec, 1 << 20)
    begins = list(range(0, t, piece))
    assert len(rec.launches) == len(begins) == (1 if t * h * 2 <= 1 << 20 else -(-t // piece))
    k = h // 16
    for begin, launch_ in zip(begins, rec.launches):
        end = min(t, begin + piece)
        tail = launch_["tail"]
        assert launch_["x"] == x[begin].data_ptr() and launch_["rows"] == end - begin == tail[9]
        assert launch_["total_vecs"] == (end - begin) * h // 8 and launch_["row_vecs"] == h // 8
        assert tail[0] == residual[begin].data_ptr() and tail[1] == out.residual[begin].data_ptr()
        assert tail[3] == out.norm[begin].data_ptr() and tail[2] == weight.data_ptr()
        if quant:
            assert tail[4] == out.quant[begin].data_ptr()
        if quant == "nvfp4" and sf_layout == "swizzled":
            first = int(reference.swizzled_sf_index(torch.tensor(begin), torch.tensor(0), k))
            assert tail[5] == out.scale_factors.data_ptr() + first
            assert launch_["row_slots"] == (end - begin if end < t else -(-(t - begin) // 128) * 128)
        elif quant == "nvfp4":
            assert tail[5] == out.scale_factors[begin].data_ptr() and launch_["row_slots"] == end - begin
        elif scaled.get("scale_layout") == "mn_major":  # one element per row; the whole call's column stride
            tp = -(-t // 4) * 4
            assert tail[11] == out.scales[begin].data_ptr() and tail[14] == tp == out.scales.stride(1)
            assert launch_["row_slots"] == (end - begin if end < t else tp - begin)
        elif scaled:
            assert tail[11] == out.scales[begin].data_ptr() and launch_["row_slots"] == end - begin
    rec.launches.clear()
    y = torch.empty_like(x)
    assert rec.plain(x, "twoshot", y) is y
    n, elt = x.numel(), 2
    assert [(l["x"], l["out"], l["total_vecs"]) for l in rec.launches] == [
        (x.data_ptr() + b * elt, y.data_ptr() + b * elt, min(n - b, (1 << 20) // elt) // 8)
        for b in range(0, n, (1 << 20) // elt)]


def _limits(workspace, oneshot, twoshot, oneshot_bytes=None):
    return P2PLimits(workspace, (("oneshot", oneshot), ("twoshot", twoshot)), oneshot_bytes)


def test_derive_limits():
    sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
    # (one-shot, two-shot, NCCL) microseconds
    times = [(5, 7, 12), (6, 8, 13), (9, 8, 14), (20, 15, 14), (40, 30, 20)]
    assert p2p.derive_limits(sizes, times, 1 << 20) == _limits(1 << 20, 16 << 10, 64 << 10)
    # A win past the first loss does not count (monotone prefix), and one-shot never exceeds two-shot's range.
    times = [(5, 7, 12), (15, 16, 14), (5, 7, 12), (5, 7, 12), (5, 7, 12)]
    assert p2p.derive_limits(sizes, times, 1 << 20) == _limits(1 << 20, 4 << 10, 4 << 10)
    assert p2p.derive_limits(sizes, [(20, 20, 10)] * 5, 1 << 20) == _limits(1 << 20, 0, 0)
    assert p2p.derive_limits(sizes, [(1, 2, 10)] * 5, 1 << 20) == _limits(1 << 20, 1 << 20, 1 << 20)
    # One-shot cannot take the sizes above its buffers (inf): two-shot from there.
    inf = float("inf")
    times = [(1, 2, 10)] * 3 + [(inf, 2, 10)] * 2
    assert p2p.derive_limits(sizes, times, 1 << 20, 64 << 10) == _limits(1 << 20, 64 << 10, 1 << 20, 64 << 10)
    # A time not measured (NaN) is never the fastest, wherever it stands in its row.
    nan = float("nan")
    assert p2p.derive_limits(sizes, [(nan, 2, 10)] * 5, 1 << 20) == _limits(1 << 20, 0, 1 << 20)
    assert p2p.derive_limits(sizes, [(1, nan, 10)] * 5, 1 << 20) == _limits(1 << 20, 1 << 20, 1 << 20)
    # Two-shot edging one-shot once (noise) ends one-shot's range there, and two-shot's ends where it loses to NCCL:
    # sizes that only one-shot beat NCCL at go to NCCL, not to a two-shot slower than both (its range ran to 1 MiB).
    times = [(8, 12, 15), (10, 13, 17), (14, 13.5, 19), (18, 24, 22), (30, 36, 32)]
    assert p2p.derive_limits(sizes, times, 1 << 20) == _limits(1 << 20, 16 << 10, 64 << 10)
    # One-shot slower than NCCL where two-shot is not: two-shot from the start.
    assert p2p.derive_limits(sizes, [(12, 8, 10)] * 5, 1 << 20) == _limits(1 << 20, 0, 1 << 20)
    for bad_sizes, bad_times in ((sizes[::-1], [(1, 2, 10)] * 5), (sizes, [(1, 2)] * 5), (sizes, [(1, 2, 10)] * 4)):
        with pytest.raises(ValueError, match="ascending sizes and a row of 3 times"):
            p2p.derive_limits(bad_sizes, bad_times, 1 << 20)


@pytest.mark.parametrize("crossovers", [[["oneshot", 1024]], [["twoshot", 1], ["oneshot", 2]],
                                        [["oneshot", 4096], ["twoshot", 1024]], [["oneshot", -1], ["twoshot", 8]],
                                        [["oneshot", 1], ["twoshot", 1 << 40]]])
def test_a_cached_calibration_that_derive_limits_would_not_make_is_measured_again(tmp_path, crossovers):
    from commfuse.p2p import calibration

    key = {"k": 1, "workspace_bytes": 1 << 20}
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"key": key, "limits": {"workspace_bytes": 1 << 20,
                                                       "crossovers": [["oneshot", 4096], ["twoshot", 65536]]}}))
    assert calibration._read_limits(path, key) == _limits(1 << 20, 4096, 65536)
    # derive_limits measures up to twice the workspace: a two-shot crossover there is one it makes
    path.write_text(json.dumps({"key": key, "limits": {"workspace_bytes": 1 << 20,
                                                       "crossovers": [["oneshot", 4096], ["twoshot", 2 << 20]]}}))
    assert calibration._read_limits(path, key) == _limits(1 << 20, 4096, 2 << 20)
    path.write_text(json.dumps({"key": key, "limits": {"workspace_bytes": 1 << 20, "crossovers": crossovers}}))
    assert calibration._read_limits(path, key) is None


def test_a_damaged_calibration_file_is_measured_again_never_raised(tmp_path):
    """Rank 0 alone reads the file before the ranks exchange its answer: whatever the file holds, the read
    returns None (measure again), or the other ranks would wait for an answer that never comes. The
    workspace size is the key's, not the file's."""
    import os

    from commfuse.p2p import calibration

    key = {"k": 1, "workspace_bytes": 1 << 20}
    path = tmp_path / "limits.json"

    def limits(workspace, crossovers):
        return json.dumps({"key": key, "limits": {"workspace_bytes": workspace, "crossovers": crossovers}})

    path.write_text(limits(1 << 20, [["oneshot", 4096], ["twoshot", 65536]]))
    assert calibration._read_limits(path, key) == _limits(1 << 20, 4096, 65536)
    for text in (limits(1 << 20, [["oneshot", 4096], ["twoshot", float("inf")]]),  # JSON Infinity
                 limits(float("inf"), [["oneshot", 1], ["twoshot", 2]]),
                 "[" * 100000 + "]" * 100000,  # nested past the recursion limit
                 limits(1 << 40, [["oneshot", 4096], ["twoshot", 1 << 40]]),  # another workspace's limits
                 limits(4096, [["oneshot", 1024], ["twoshot", 4096]])):
        path.write_text(text)
        assert calibration._read_limits(path, key) is None, text[:80]
    path.unlink()
    os.mkfifo(path)  # reading it would wait for a writer
    assert calibration._read_limits(path, key) is None



def test_the_calibration_cache_key_names_how_nccl_was_timed():
    """A file measured with torch's all_reduce of a copy (tens of microseconds more at the largest sizes)
    is not reused where the NCCL route calls ncclAllReduce itself, nor the other way, nor with another
    library behind commfuse.nccl."""
    from types import SimpleNamespace

    from commfuse.p2p import calibration

    ws = SimpleNamespace(world=2, max_bytes=1 << 20, lamport_bytes=1 << 18, nblocks=132)
    topo = SimpleNamespace(versions=None, ranks=[SimpleNamespace(gpu_name="GPU")] * 2, p2p=((True,) * 2,) * 2,
                           nvlink=((0,) * 2,) * 2)
    plain = calibration.cache_key(ws, topo)
    bound = calibration.cache_key(ws, topo, nccl=SimpleNamespace(version="2.28.9"))
    other = calibration.cache_key(ws, topo, nccl=SimpleNamespace(version="2.29.1"))  # COMMFUSE_NCCL_LIBRARY's, say
    assert plain["nccl_route"] == "torch.distributed" and bound["nccl_route"] == "commfuse.nccl (NCCL 2.28.9)"
    assert other["nccl_route"] != bound["nccl_route"]
    assert {k: v for k, v in plain.items() if k != "nccl_route"} == {k: v for k, v in bound.items() if k != "nccl_route"}


def test_the_calibration_cache_key_names_the_launch_and_nccl_settings(monkeypatch):
    """Times measured with PDL off, or under other NCCL_* settings (an algorithm, a protocol, channels), are not
    reused where they differ: they move NCCL's and the kernels' times, so the crossovers."""
    from types import SimpleNamespace

    from commfuse.p2p import calibration

    ws = SimpleNamespace(world=2, max_bytes=1 << 20, lamport_bytes=1 << 18, nblocks=132)
    topo = SimpleNamespace(versions=None, ranks=[SimpleNamespace(gpu_name="GPU")] * 2, p2p=((True,) * 2,) * 2,
                           nvlink=((0,) * 2,) * 2)
    monkeypatch.delenv("COMMFUSE_PDL", raising=False)
    for k in [k for k in os.environ if k.startswith("NCCL_")]:
        monkeypatch.delenv(k)
    base = calibration.cache_key(ws, topo)
    assert base["pdl"] is True and base["nccl_env"] == {}
    monkeypatch.setenv("COMMFUSE_PDL", "0")
    assert calibration.cache_key(ws, topo)["pdl"] is False
    monkeypatch.delenv("COMMFUSE_PDL")
    monkeypatch.setenv("NCCL_PROTO", "LL")
    changed = calibration.cache_key(ws, topo)
    assert changed["nccl_env"] == {"NCCL_PROTO": "LL"}
    assert {k: v for k, v in changed.items() if k != "nccl_env"} == {k: v for k, v in base.items() if k != "nccl_env"}


def _meta(shape, dtype=torch.bfloat16):
    return TensorMeta(tuple(shape), dtype, torch.device("cuda", 0))


def test_routes_take_the_p2p_kernels_limits():
    assert P2P_ALLREDUCE.limits.world_sizes == frozenset(range(2, 9))
    limits = _limits(64 << 20, 512 << 10, 32 << 20)

    def plan(c, world=2, limits=limits, **kw):
        return routes.plan(c, Machine("p2p", "nccl", (9, 0), world, limits=limits, **kw))

    fused = Call("fused", _meta((64, 4096)), _meta((64, 4096)), _meta((4096,)), _meta((1,), torch.float32),
                 spec=TailSpec.of("nvfp4"))
    p = plan(fused)
    assert (p.collective, p.tail, p.kernel) == ("p2p_oneshot", "fused", "p2p_allreduce")
    assert plan(Call("plain", _meta((1024, 8192)))).collective == "p2p_twoshot"
    over = plan(Call("plain", _meta((4097, 8192))))  # over the workspace and the measured crossover
    assert over.collective == "nccl" and any("crossover" in r for r in over.reasons)
    assert plan(Call("plain", _meta((4097, 8192))), strategy="twoshot").collective == "p2p_twoshot"  # in pieces
    odd = plan(Call("plain", _meta((3, 5))))
    assert odd.collective == "nccl" and any("multiple of 8 elements" in r for r in odd.reasons)
    assert plan(Call("plain", _meta((64, 4096), torch.float32))).collective == "nccl"
    assert plan(fused, world=9).collective == "nccl"
    assert plan(fused, world=8).collective == "p2p_oneshot"
    # A forced one-shot above the one-shot's buffers goes two-shot, and says why.
    small = _limits(64 << 20, 512 << 10, 32 << 20, 1 << 20)
    forced = plan(Call("plain", _meta((128, 8192))), limits=small, strategy="oneshot")
    assert forced.collective == "p2p_twoshot" and any("one-shot buffers" in r for r in forced.reasons), forced
    assert plan(Call("plain", _meta((64, 8192))), limits=small, strategy="oneshot").collective == "p2p_oneshot"


def test_timeout_error_names_the_missing_rank():
    e = K.P2PTimeoutError(rank=0, missing_rank=3, phase=1, timeout_s=2.5)
    assert isinstance(e, RuntimeError)
    assert "rank 3 did not arrive" in str(e) and "2.5 s" in str(e) and "new one" in str(e)


def test_timeout_error_is_exported():
    import commfuse

    assert commfuse.P2PTimeoutError is K.P2PTimeoutError and "P2PTimeoutError" in commfuse.__all__
    assert commfuse.P2PMismatchError is K.P2PMismatchError and issubclass(K.P2PMismatchError, K.P2PError)
    assert issubclass(K.P2PTimeoutError, K.P2PError)


def _signature(bf16, quant_id, algo, swizzled, norm, world, rows, row_vecs, total_vecs, scale_layout=0):
    """The words call_signature (csrc/p2p_allreduce.cu) writes, written out independently."""
    kind = 1 << 30 | int(bf16) | (quant_id + 1) << 1 | algo << 5 | int(swizzled) << 6 | int(norm) << 7 | world << 8
    kind |= scale_layout << 12
    return (kind, rows, row_vecs, total_vecs)


def test_describe_signature_names_every_field():
    fused = K.describe_signature(_signature(True, 1, 1, False, True, 4, 16, 512, 16 * 512))
    assert fused == "bf16 tail + fp8 (norm out), [16, 4096], twoshot"
    nv = K.describe_signature(_signature(False, 2, 0, True, False, 2, 7, 360, 7 * 360))
    assert nv == "fp16 tail + nvfp4 (swizzled scale factors), [7, 2880], oneshot"
    plain = K.describe_signature(_signature(True, -1, 0, False, False, 8, 3, 256, 700))
    assert plain == "bf16 plain all-reduce of 5600 elements, oneshot"
    assert K.describe_signature(_signature(True, 0, 1, False, True, 2, 1, 1, 1)) == "bf16 tail (norm out), [1, 8], twoshot"
    block = K.describe_signature(_signature(True, 4, 0, False, False, 2, 3, 512, 3 * 512, scale_layout=3))
    assert block == "bf16 tail + fp8_block (MN-major scales, UE8M0 scales), [3, 4096], oneshot"
    assert K.describe_signature(_signature(False, 3, 1, False, True, 4, 2, 16, 32)) == \
        "fp16 tail + fp8_per_token (norm out), [2, 128], twoshot"
    # No signature word is ever the empty Lamport word (bit 31 clear in each).
    assert all(w < 1 << 31 for w in _signature(True, 2, 1, True, True, 8, (1 << 31) - 1, 1 << 30, (1 << 31) - 1))


def test_mismatch_error_names_both_calls():
    e = K.P2PMismatchError(rank=0, peer=3, mine="bf16 tail, [16, 4096], oneshot", theirs="bf16 tail, [8, 4096], oneshot")
    assert isinstance(e, K.P2PError) and e.peer == 3
    assert "rank 3 made a different call" in str(e) and "[8, 4096]" in str(e) and "[16, 4096]" in str(e)


@pytest.mark.parametrize("sms, affinity, pct, sharers, expect", [
    (132, None, None, 1, 132),   # a GPU of its own
    (132, None, None, 4, 33),    # 4 ranks share it: each grid a quarter, all resident at once
    (132, None, None, 8, 16),
    (132, 33, None, 1, 33),      # MPS limits the context (its execution affinity)
    (132, None, "25", 1, 33),    # ... or says so only in the environment
    (132, None, "50", 4, 33),    # the smaller of the limit and the share
    (132, None, "100", 2, 66),
    (132, None, "junk", 2, 66),
    (4, None, None, 8, 0),       # cannot fit: the workspace refuses (RuntimeError)
])
def test_grid_fits_every_sharing_rank(sms, affinity, pct, sharers, expect):
    n, how = K.grid_limit(sms, affinity, pct, sharers)
    assert n == expect, how
    assert n * sharers <= sms
    if sharers > 1:
        assert f"{sharers} ranks sharing" in how


# =========================================================================== GPU, several ranks


def _skip_unless_p2p(comm):
    """The same decision on every rank: the device, topology and environment are the group's."""
    if comm.device.type != "cuda":
        pytest.skip("needs CUDA GPUs (P2P all-reduce)")
    if comm.topology.mode != "p2p":
        pytest.skip(f"topology mode {comm.topology.mode!r}, no P2P: {'; '.join(comm.topology.reasons)}")
    if os.environ.get("COMMFUSE_STRATEGY", "auto") != "auto":
        pytest.skip(f"COMMFUSE_STRATEGY={os.environ['COMMFUSE_STRATEGY']} overrides the strategies tested here")
    if comm.workspace is None:
        pytest.skip(f"no P2P workspace for {comm.world_size} ranks")


def _new_comm(comm, strategy, **env):
    """A Communicator of its own (collective), with environment overrides while it is made."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        return Communicator(comm.group, strategy=strategy)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def comms(comm):
    """One Communicator per forced algorithm (default workspace), closed after the module."""
    _skip_unless_p2p(comm)
    made = {algo: _new_comm(comm, algo) for algo in ALGOS}
    yield made
    for c in made.values():
        c.close()


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(b"-" if t is None else as_bytes(t).numpy().tobytes())
    return h.hexdigest()


def gather(comm, obj):
    out = [None] * comm.world_size
    dist.all_gather_object(out, obj, group=comm.group)
    return out


def outputs(r):
    return [r] if isinstance(r, torch.Tensor) else [r.residual, r.norm, r.quant, r.scale_factors]


def run_pattern(c, x, residual, weight, scale, pattern):
    quant, return_norm, sf_layout = pattern
    return c.fused_all_reduce(x, residual, weight, eps=EPS, quant=quant, scale=scale, return_norm=return_norm,
                              sf_layout=sf_layout)


def check_fused(r, xs, residual, weight, scale, pattern):
    """r against the reference (on the CPU: the exact semantics) fed the exact sum of every rank's x."""
    quant, return_norm, sf_layout = pattern
    cpu = [v.cpu() if v is not None else None for v in (residual, weight, scale)]
    total = reference.all_reduce_sum([x.cpu() for x in xs])
    ref = reference.fused_tail(total, *cpu[:2], EPS, quant, cpu[2], return_norm, sf_layout)
    assert bits_equal(r.residual, ref.residual), "residual is not bit-exact"
    assert_tail_close(r, ref, quant, sf_layout, norm=reference.fused_tail(total, *cpu[:2], EPS).norm, scale=cpu[2])


@mpi
@pytest.mark.parametrize("t, h", SHAPES)
@pytest.mark.parametrize("quant, return_norm, sf_layout", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ALGOS)
def test_fused_matches_reference(comms, gen, monkeypatch, algo, dtype, quant, return_norm, sf_layout, t, h):
    if quant == "mxfp8" and h % 32:
        pytest.skip("mxfp8 needs h % 32 == 0")
    c, pattern = comms[algo], (quant, return_norm, sf_layout)
    x, xs = rank_inputs(c, gen, (t, h), dtype)
    residual, weight, scale = tail_inputs(c, gen, t, h, dtype, quant)
    saved = [v.clone() for v in (x, residual, weight)]
    first, second = poisoned_runs(lambda: run_pattern(c, x, residual, weight, scale, pattern))
    digests = gather(c, digest(outputs(first)))
    c.check()
    # A forced one-shot above the one-shot's buffers (a world-size-dependent size) runs two-shot.
    over = algo == "oneshot" and x.numel() * x.element_size() > c.workspace.lamport_bytes
    assert first.plan.collective == ("p2p_twoshot" if over else f"p2p_{algo}"), str(first.plan)
    assert first.plan.tail == "fused", str(first.plan)
    for before, after in zip(saved, (x, residual, weight)):
        assert bits_equal(before, after), "an input was modified"
    for name, a, b in zip(("residual", "norm", "quant", "scale_factors"), outputs(first), outputs(second)):
        assert (a is None) == (b is None), name
        assert a is None or bits_equal(a, b), f"{name}: elements left unwritten, or repeated calls differ"
    assert len(set(digests)) == 1, "ranks' outputs differ"
    check_fused(first, xs, residual, weight, scale, pattern)


# The MoE variants' tails: VPT 1 (h 2048, 256 threads; h 4096, 512), VPT 2 (7168: 448 threads) and the looped
# tail (12288; and fp8_per_token, VPT 1 only, at 7168); several rows per CTA (300 tokens).
MOE_SHAPES = [(1, 8, 2048), (5, 2, 7168), (64, 8, 4096), (3, 4, 12288), (300, 2, 2048)]
MOE_PATTERNS = [(None, False, "swizzled"), ("fp8", True, "swizzled"), ("nvfp4", False, "swizzled"),
                ("fp8_per_token", False, "swizzled"), ("mxfp8", False, "linear")]


@mpi
@pytest.mark.parametrize("t, k, h", MOE_SHAPES)
@pytest.mark.parametrize("quant, return_norm, sf_layout", MOE_PATTERNS)
@pytest.mark.parametrize("form", ["reduction", "finalize"])
@pytest.mark.parametrize("algo", ALGOS)
def test_moe_combine_in_the_p2p_kernel_matches_reference(comms, gen, algo, form, quant, return_norm, sf_layout,
                                                         t, k, h):
    """moe_all_reduce on the P2P route: one kernel combines each rank's rows as it reads them, sums and runs
    the tail; against the reference fed the exact sum of every rank's combine (bit-exact sum), outputs
    poisoned twice, equal on every rank, inputs untouched."""
    from test_moe import combined, moe_inputs

    c = comms[algo]
    dtype = torch.bfloat16 if (t + h) % 2 else torch.float16
    per_rank, rank = moe_inputs(c, gen, t, k, h, dtype, form, torch.float32 if k == 8 else dtype, with_shared=t < 64)
    residual, weight, scale = tail_inputs(c, gen, t, h, dtype, quant)
    y, w, idx, shared = per_rank[rank]
    saved = [v.clone() for v in (y, w, idx, shared, residual, weight) if v is not None]
    first, second = poisoned_runs(lambda: c.moe_all_reduce(y, w, residual, weight, EPS, quant, scale, return_norm,
                                                           sf_layout, row_index=idx, shared=shared))
    digests = gather(c, digest(outputs(first)))
    c.check()
    over = algo == "oneshot" and t * h * y.element_size() > c.workspace.lamport_bytes
    assert first.plan.combine == "fused" and first.plan.tail == "fused", str(first.plan)
    assert first.plan.collective == ("p2p_twoshot" if over else f"p2p_{algo}"), str(first.plan)
    after = [v for v in (y, w, idx, shared, residual, weight) if v is not None]
    assert all(bits_equal(b, v) for b, v in zip(saved, after)), "an input was modified"
    for name, a, b in zip(("residual", "norm", "quant", "scale_factors"), outputs(first), outputs(second)):
        assert a is None or bits_equal(a, b), f"{name}: elements left unwritten, or repeated calls differ"
    assert len(set(digests)) == 1, "ranks' outputs differ"
    check_fused(first, [combined(*p) for p in per_rank], residual, weight, scale, (quant, return_norm, sf_layout))


@mpi
@pytest.mark.parametrize("h", [128, 2880, 4096, 8192])
@pytest.mark.parametrize("t", [1, 7, 64, 256, 1000])
@pytest.mark.parametrize("algo", ALGOS)
def test_plain_matches_reference(comms, gen, monkeypatch, algo, t, h):
    c = comms[algo]
    dtype = torch.bfloat16 if (t + h) % 2 else torch.float16
    x, xs = rank_inputs(c, gen, (t, h), dtype)
    first, second = poisoned_runs(lambda: c.all_reduce(x))
    digests = gather(c, digest([first]))
    c.check()
    # A forced one-shot above the one-shot's buffers runs two-shot (commfuse.routes).
    over = algo == "oneshot" and x.numel() * x.element_size() > c.workspace.lamport_bytes
    assert c.plan(x).collective == ("p2p_twoshot" if over else f"p2p_{algo}")
    assert bits_equal(first, second), "elements left unwritten, or repeated calls differ"
    assert len(set(digests)) == 1, "ranks' outputs differ"
    assert bits_equal(first, reference.all_reduce_sum(xs)), "sum differs from the fp32 rank-order sum"


@mpi
@pytest.mark.parametrize("shape", [(8,), (3, 5, 16), (2, 64, 1000)])
def test_plain_any_shape_with_whole_vectors(comms, gen, shape):
    c = comms["twoshot"]
    x, xs = rank_inputs(c, gen, shape, torch.bfloat16)
    y = c.all_reduce(x)
    c.check()
    assert y.shape == x.shape and bits_equal(y, reference.all_reduce_sum(xs))


@mpi
def test_plain_without_whole_vectors_takes_nccl(comms, gen):
    c = comms["oneshot"]
    x, xs = rank_inputs(c, gen, (3, 5), torch.bfloat16)
    y = c.all_reduce(x)
    p = c.plan(x)
    assert p.collective == c.backend and any("multiple of 8 elements" in r for r in p.reasons), str(p)
    assert y.shape == x.shape


@mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_oneshot_inputs_holding_the_empty_word(comms, gen, dtype):
    """Two 0xFFFF elements (NaNs) in one 32-bit word are the one-shot's "not arrived" marker: inputs
    holding it must neither hang the wait nor leave the slots dirty for later calls, and the sums
    there must be NaN, bit-identical on every rank; every other element exact."""
    c = comms["oneshot"]
    t, h = 16, 4096
    _, xs = rank_inputs(c, gen, (t, h), dtype)
    for q, xq in enumerate(xs):
        bits = xq.view(torch.int16).view(-1)
        bits[64 * q: 64 * q + 2] = -1       # one empty word, at a different place on each rank
        bits[3 * h + 10 + 2 * q] = -1       # a lone 0xFFFF (half a word)
        bits[-8:] = -1                      # the last vector: empty on every rank
    x = xs[dist.get_rank(c.group)]
    residual, weight, scale = tail_inputs(c, gen, t, h, dtype, "fp8")
    y = c.all_reduce(x)
    fused = run_pattern(c, x, residual, weight, scale, ("fp8", True, "swizzled"))
    x2, xs2 = rank_inputs(c, gen, (t, h), dtype)
    later = [c.all_reduce(x2) for _ in range(3)]  # both halves of the slots again
    c.check()
    assert c.plan(x).collective == "p2p_oneshot"
    assert len(set(gather(c, digest([y, *outputs(fused)])))) == 1, "ranks' outputs differ"
    expect = reference.all_reduce_sum([v.cpu() for v in xs])
    nan = expect.isnan()
    assert int(nan.sum()) == 3 * c.world_size + 8
    assert torch.equal(y.cpu().isnan(), nan)
    assert bits_equal(y.cpu()[~nan], expect[~nan])
    ref = reference.fused_tail(expect, residual.cpu(), weight.cpu(), EPS, "fp8", scale.cpu(), True)
    assert_tail_close(fused, ref, "fp8")
    assert bits_equal(fused.residual.cpu()[~nan], ref.residual[~nan])
    for z in later:
        assert bits_equal(z, reference.all_reduce_sum(xs2))


@mpi
def test_outputs_written_over_nan_filled_allocator(comms, gen):
    """Outputs from torch.empty over memory the allocator last held as NaN: anything unwritten shows."""
    c = comms["twoshot"]
    t, h = 7, 2880  # 7 rows: 121 swizzle padding rows
    x, xs = rank_inputs(c, gen, (t, h), torch.bfloat16)
    results = []
    for pattern in (("nvfp4", True, "swizzled"), ("fp8", True, "swizzled"), (None, False, "swizzled")):
        residual, weight, scale = tail_inputs(c, gen, t, h, torch.bfloat16, pattern[0])
        junk = [torch.full((n,), 0xFF, dtype=torch.uint8, device=c.device)
                for n in (512, 4096, 65536, 1 << 20, 8 << 20) for _ in range(8)]
        del junk  # back to the caching allocator, still 0xFF (NaN in fp16/bf16/e4m3)
        results.append((pattern, residual, weight, scale, run_pattern(c, x, residual, weight, scale, pattern)))
    junk = [torch.full((n,), 0xFF, dtype=torch.uint8, device=c.device) for n in (512, 65536, 1 << 20)]
    del junk
    y = c.all_reduce(x)
    c.check()
    for pattern, residual, weight, scale, r in results:
        check_fused(r, xs, residual, weight, scale, pattern)
    assert bits_equal(y, reference.all_reduce_sum(xs))


@mpi
def test_back_to_back_calls_of_changing_shapes_and_algorithms(comms, gen):
    """Many calls without synchronisation, alternating algorithms and row layouts: exercises the
    double buffering (a fast rank writes the next call's data while a peer still reads)."""
    ws = comms["oneshot"].workspace
    shapes = [(1, 128), (300, 4096), (7, 2880), (64, 8192), (1, 8), (1000, 1024), (133, 4096), (5, 16384)]
    # Inputs first: a copy from the host would synchronise the stream between the calls.
    inputs = [(ALGOS[(i // 2) % 2], *rank_inputs(comms["oneshot"], gen, shapes[i % len(shapes)], torch.bfloat16))
              for i in range(24)]
    torch.cuda.synchronize()
    # One-shot takes what its buffers hold (2 MiB at 8 ranks): larger ones go two-shot, as commfuse.routes sends them.
    calls = [(algo, xs, ws.plain_launcher(x.shape, x.dtype, "twoshot" if x.numel() * 2 > ws.lamport_bytes else algo)(x))
             for algo, x, xs in inputs]
    ws.check()
    bad = [(i, algo) for i, (algo, xs, y) in enumerate(calls) if not bits_equal(y, reference.all_reduce_sum(xs))]
    assert not bad, f"wrong sums at calls {bad}"


@mpi
@pytest.mark.parametrize("lag", [2**31 + 1, 2**32 - 1, 2**40])
def test_two_shot_waits_for_its_peers_after_any_number_of_one_shot_calls(comm, gen, lag):
    """Every call advances the epochs, but only two-shot calls write the barrier flags: after `lag` one-shot
    calls (their state written into the epochs, as that many calls leave it) a two-shot call's barriers must
    still wait for a late peer, and the calls after it, across the 32-bit boundary, still sum right. With
    32-bit epochs a lag of 2^31 or more read as "arrived" and the late peer's rows came from an older call."""
    _skip_unless_p2p(comm)
    c = _new_comm(comm, "auto")
    ws, rank = c.workspace, dist.get_rank(c.group)
    shape = (64, 4096)
    launchers = {algo: ws.plain_launcher(shape, torch.bfloat16, algo) for algo in ALGOS}
    calls = [(algo, *rank_inputs(c, gen, shape, torch.bfloat16)) for algo in ("twoshot", "twoshot", "oneshot",
                                                                               "twoshot", "oneshot", "twoshot")]
    wrong = []
    try:
        for i, (algo, x, xs) in enumerate(calls):
            if i == 1:  # the lag: the epochs of every CTA advanced on every rank alike, the flags as they were
                torch.cuda.synchronize(c.device)
                epochs = ws._state[:2 * ws.nblocks].view(torch.int64)
                epochs.copy_(epochs + lag)
            torch.cuda.synchronize(c.device)
            dist.barrier(group=c.group)
            if i == 1 and rank == c.world_size - 1:
                time.sleep(0.5)  # the other ranks' kernels are running, at their barriers
            y = launchers[algo](x)
            ws.check()
            if not bits_equal(y, reference.all_reduce_sum(xs)):
                wrong.append((i, algo))
    finally:
        c.close()
    assert not wrong, f"wrong sums at calls {wrong} (lag {lag})"


@mpi
@pytest.mark.parametrize("algo", ALGOS)
def test_cuda_graph_capture_and_replay(comms, gen, monkeypatch, algo):
    c = comms[algo]
    monkeypatch.setattr(c, "check_calls", False)  # its all_gather_object cannot run under capture
    t, h, dtype = 24, 4096, torch.bfloat16
    patterns = [("nvfp4", True, "swizzled"), ("fp8", False, "swizzled"), (None, False, "swizzled")]
    x_s, _ = rank_inputs(c, gen, (t, h), dtype)
    res_s, weight, _ = tail_inputs(c, gen, t, h, dtype, None)
    scales = {q: tail_inputs(c, gen, t, h, dtype, q)[2] for q in ("fp8", "nvfp4")}
    for pattern in patterns:  # eager first: kernels loaded before capture
        run_pattern(c, x_s, res_s, weight, scales.get(pattern[0]), pattern)
    c.all_reduce(x_s)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [run_pattern(c, x_s, res_s, weight, scales.get(p[0]), p) for p in patterns]
        captured_sum = c.all_reduce(x_s)
    rounds = []
    for _ in range(3):
        x, xs = rank_inputs(c, gen, (t, h), dtype)
        residual, _, _ = tail_inputs(c, gen, t, h, dtype, None)
        x_s.copy_(x)
        res_s.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        rounds.append((xs, residual.clone(), [[o.clone() if o is not None else None for o in outputs(r)]
                                              for r in captured], captured_sum.clone()))
    eager = c.all_reduce(x_s)  # eager calls stay in step with the replays
    c.check()
    digests = gather(c, digest([o for _, _, outs, s in rounds for group in outs for o in group] +
                               [s for *_, s in rounds]))
    assert len(set(digests)) == 1, "ranks' outputs differ"
    for xs, residual, outs, total in rounds:
        assert bits_equal(total, reference.all_reduce_sum(xs))
        for pattern, out in zip(patterns, outs):
            r = reference.Tail(*out)
            check_fused(r, xs, residual, weight, scales.get(pattern[0]), pattern)
    assert bits_equal(eager, reference.all_reduce_sum(rounds[-1][0]))
    del graph


# Over a 1 MiB workspace (2-byte elements), 300 rows in pieces of whole rows: h = 4096 gives pieces
# of 128 rows (the last, 44, with swizzled padding rows to zero); h = 3088 (193 NVFP4 blocks, not a
# multiple of 4) 169 rows, or 128 with swizzled scale factors; h = 4104 127 rows (odd: FP8 codes of
# a piece start 8-byte aligned). h = 8192 with swizzled NVFP4: 128 rows are 2 MiB, no piece fits: NCCL.
OVER_CASES = [(4096, (None, False, "swizzled")), (4096, ("fp8", True, "swizzled")),
              (3088, ("nvfp4", True, "swizzled")), (3088, ("nvfp4", False, "linear")),
              (4104, ("fp8", False, "swizzled")), (4104, (None, False, "swizzled"))]


@mpi
@pytest.mark.parametrize("algo", ALGOS)
def test_messages_at_and_over_the_workspace(comm, gen, monkeypatch, algo):
    _skip_unless_p2p(comm)
    c = _new_comm(comm, algo, COMMFUSE_P2P_WORKSPACE_MB=1)
    bf = torch.bfloat16
    try:
        limit = c.workspace.max_bytes
        h = 4096
        x, xs = rank_inputs(c, gen, (limit // (2 * h), h), bf)  # exactly the workspace
        residual, weight, scale = tail_inputs(c, gen, x.shape[0], h, bf, "nvfp4")
        at = c.fused_all_reduce(x, residual, weight, eps=EPS, quant="nvfp4", scale=scale, return_norm=True)
        y = c.all_reduce(x)
        big, bigs = rank_inputs(c, gen, (300, h), bf)
        over_plan = c.plan(big)
        over = poisoned_runs(lambda: c.all_reduce(big))
        cases = []
        for hh, pattern in OVER_CASES:
            xo, xos = rank_inputs(c, gen, (300, hh), bf)
            res, w, sc = tail_inputs(c, gen, 300, hh, bf, pattern[0])
            runs = poisoned_runs(lambda: run_pattern(c, xo, res, w, sc, pattern))
            cases.append((pattern, xos, res, w, sc, runs, gather(c, digest(outputs(runs[0])))))
        # Pieces inside a CUDA graph: captured once, replayed with new inputs.
        res_g, w_g, sc_g = tail_inputs(c, gen, 300, 3088, bf, "nvfp4")
        x_g, _ = rank_inputs(c, gen, (300, 3088), bf)
        graph_pattern = ("nvfp4", True, "swizzled")
        run_pattern(c, x_g, res_g, w_g, sc_g, graph_pattern)  # kernels loaded before capture
        torch.cuda.synchronize()
        check_calls, c.check_calls = c.check_calls, False  # its all_gather_object cannot run under capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run_pattern(c, x_g, res_g, w_g, sc_g, graph_pattern)
        c.check_calls = check_calls
        replays = []
        for _ in range(2):
            fresh, freshs = rank_inputs(c, gen, (300, 3088), bf)
            x_g.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            replays.append((freshs, [o.clone() if o is not None else None for o in outputs(captured)]))
        wide, wides = rank_inputs(c, gen, (200, 8192), bf)
        wide_res, wide_w, wide_scale = tail_inputs(c, gen, 200, 8192, bf, "nvfp4")
        wide_out = c.fused_all_reduce(wide, wide_res, wide_w, eps=EPS, quant="nvfp4", scale=wide_scale)
        c.check()
        del graph
    finally:
        c.close()
    assert limit == 1 << 20 and x.numel() * 2 == limit
    assert at.plan.collective == f"p2p_{algo}"
    check_fused(at, xs, residual, weight, scale, ("nvfp4", True, "swizzled"))
    assert bits_equal(y, reference.all_reduce_sum(xs))
    # Over the workspace: two-shot (the one-shot's buffers are smaller still), in pieces; every
    # output element written (two poisons agree), the same on every rank.
    assert over_plan.collective == "p2p_twoshot", str(over_plan)
    assert bits_equal(over[0], over[1]) and bits_equal(over[0], reference.all_reduce_sum(bigs))
    for pattern, xos, res, w, sc, (first, second), digests in cases:
        assert (first.plan.collective, first.plan.tail) == ("p2p_twoshot", "fused"), str(first.plan)
        for name, a, b in zip(("residual", "norm", "quant", "scale_factors"), outputs(first), outputs(second)):
            assert a is None or bits_equal(a, b), f"{pattern}: {name}: elements left unwritten"
        assert len(set(digests)) == 1, f"{pattern}: ranks' outputs differ"
        check_fused(first, xos, res, w, sc, pattern)
    for freshs, outs in replays:
        check_fused(reference.Tail(*outs), freshs, res_g, w_g, sc_g, graph_pattern)
    # No piece of 128 swizzled rows of h 8192 fits the workspace: the P2P kernel cannot fuse the tail. The strategy
    # forces P2P, so the P2P all-reduce runs with the tail separated (docs/guards.md), in pieces.
    assert (wide_out.plan.collective, wide_out.plan.tail) == ("p2p_twoshot", "separated"), str(wide_out.plan)
    assert any("holds no piece" in r for r in wide_out.plan.reasons), wide_out.plan.reasons
    assert any(f"tail separated (strategy '{algo}')" in r for r in wide_out.plan.reasons), wide_out.plan.reasons
    check_fused(wide_out, wides, wide_res, wide_w, wide_scale, ("nvfp4", False, "swizzled"))


@mpi
def test_rank_skipping_a_call_makes_the_others_raise(comm, gen):
    _skip_unless_p2p(comm)
    timeout = 1.0
    c = _new_comm(comm, "oneshot", COMMFUSE_P2P_TIMEOUT_S=timeout)
    c.check_calls = False  # the signature check is a collective: the skipping rank would not answer
    rank, skipper = dist.get_rank(c.group), c.world_size - 1
    x, _ = rank_inputs(c, gen, (4, 4096), torch.bfloat16)
    residual, weight, _ = tail_inputs(c, gen, 4, 4096, torch.bfloat16, None)
    c.all_reduce(x)  # one good call first: the workspace works
    c.check()
    caught, later, elapsed = None, None, None
    if rank != skipper:
        start = time.monotonic()
        c.fused_all_reduce(x, residual, weight)
        try:
            c.check()
        except K.P2PTimeoutError as e:
            caught = e
        elapsed = time.monotonic() - start
        try:
            c.all_reduce(x)
        except K.P2PTimeoutError as e:
            later = e
    c.close()  # collective: the skipper waits here for the others
    if rank != skipper:
        assert caught is not None, "no P2PTimeoutError although a rank skipped the call"
        assert caught.missing_rank == skipper and f"rank {skipper} did not arrive" in str(caught)
        assert timeout * 0.9 <= elapsed < timeout + 10, elapsed
        assert later is not None, "a call after the timeout did not raise"


# (ranks' calls, as (shape, dtype, algo, fused)): the last rank's call differs from the others'.
MISMATCHES = {
    "rows": (((16, 4096), torch.bfloat16, "oneshot", True), ((8, 4096), torch.bfloat16, "oneshot", True)),
    "hidden": (((4, 4096), torch.bfloat16, "oneshot", True), ((4, 2048), torch.bfloat16, "oneshot", True)),
    "dtype": (((64, 1024), torch.bfloat16, "twoshot", False), ((64, 1024), torch.float16, "twoshot", False)),
    "algorithm": (((32, 1024), torch.bfloat16, "oneshot", False), ((32, 1024), torch.bfloat16, "twoshot", False)),
    "pattern": (((8, 1024), torch.bfloat16, "twoshot", True), ((8, 1024), torch.bfloat16, "twoshot", False)),
}


@mpi
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatched_calls_raise_naming_the_difference(comm, gen, case):
    """Ranks making different P2P calls (no COMMFUSE_CHECK: the kernels compare call signatures):
    every rank raises P2PMismatchError naming a rank whose call differs and both calls; the
    workspace stays broken (the next call raises too). Where a rank waits for data the other call
    never sends, the mismatch ends the wait long before the timeout, except in the plain one-shot
    (and the 2-vector tails), whose registers hold no signature watch: there the wait times out
    first and the error still names the mismatch (the "algorithm" case's one-shot ranks)."""
    _skip_unless_p2p(comm)
    timeout = 20.0 if case != "algorithm" else 3.0
    c = _new_comm(comm, "auto", COMMFUSE_P2P_TIMEOUT_S=timeout)
    c.check_calls = False
    rank, odd = dist.get_rank(c.group), c.world_size - 1
    shape, dtype, algo, fused = MISMATCHES[case][rank == odd]
    x = torch.randn(shape, generator=gen).to(dtype).to(c.device)
    c.all_reduce(torch.ones(8, dtype=torch.bfloat16, device=c.device))  # one good call: the workspace works
    c.check()
    ws, start, caught, later = c.workspace, time.monotonic(), None, None
    try:
        # The workspace's launchers themselves: a Communicator call would route the odd call elsewhere.
        if fused:
            residual, weight, _ = tail_inputs(c, gen, shape[0], shape[1], dtype, None)
            plan = P2P_ALLREDUCE.plan_fused(ws, dtype, shape[0], shape[1], TailSpec.of(None, eps=EPS), algo)
            native.launcher(plan)(x, residual, weight, None, None)
        else:
            ws.plain_launcher(x.shape, dtype, algo)(x)
        c.check()
    except K.P2PMismatchError as e:
        caught = e
    elapsed = time.monotonic() - start
    try:
        c.all_reduce(x)
    except K.P2PError as e:
        later = e
    c.close()
    assert caught is not None, f"{case}: no P2PMismatchError"
    assert caught.peer != rank and (rank == odd or caught.peer == odd), (case, caught.peer)
    assert f"rank {caught.peer} made a different call" in str(caught)
    assert caught.mine != caught.theirs, str(caught)
    if case != "algorithm":
        assert elapsed < timeout / 2, f"{case}: {elapsed:.1f} s, the mismatch was not found before the timeout"
    assert later is not None, "a call after the mismatch did not raise"


@mpi
def test_strategy_nccl_on_a_p2p_machine(comm, gen):
    _skip_unless_p2p(comm)
    c = Communicator(comm.group, strategy="nccl")
    t, h = 64, 4096
    x, xs = rank_inputs(c, gen, (t, h), torch.bfloat16)
    residual, weight, scale = tail_inputs(c, gen, t, h, torch.bfloat16, "fp8")
    r = c.fused_all_reduce(x, residual, weight, eps=EPS, quant="fp8", scale=scale)
    a = c.all_reduce(x)
    assert c.workspace is None
    assert r.plan.collective == c.backend and r.plan.tail == "fused"  # gloo where ranks share a GPU
    assert any("strategy 'nccl'" in s for s in r.plan.reasons)
    assert_tail_close(r, reference.fused_tail(a, residual, weight, EPS, "fp8", scale), "fp8")


@mpi
def test_calibration_is_sane_and_cached(comm, tmp_path, monkeypatch):
    _skip_unless_p2p(comm)
    if comm.topology.shared_gpu:
        pytest.skip("ranks share a GPU: no calibration (crossovers need a GPU per rank)")
    limits = gather(comm, comm.workspace.limits)
    assert len(set(limits)) == 1, f"ranks disagree on the limits: {limits}"
    lim = limits[0]
    one, two = lim.crossover("oneshot"), lim.crossover("twoshot")
    assert 0 <= one <= two <= 2 * lim.workspace_bytes == 2 * comm.workspace.max_bytes, lim
    assert one <= lim.oneshot_bytes == comm.workspace.lamport_bytes, lim

    monkeypatch.setenv("COMMFUSE_CACHE_DIR", str(tmp_path))  # only rank 0 reads and writes it
    monkeypatch.delenv("COMMFUSE_P2P_CALIBRATE", raising=False)
    start = time.monotonic()
    ws = p2p.Workspace(comm.group, comm.device, max_bytes=1 << 20, topology=comm.topology)
    seconds = time.monotonic() - start
    try:
        measured = ws.limits

        def no_measuring(*args, **kwargs):
            raise AssertionError("calibration measured again although rank 0 has it cached")

        monkeypatch.setattr(p2p.calibration, "measure", no_measuring)
        ws2 = p2p.Workspace(comm.group, comm.device, max_bytes=1 << 20, topology=comm.topology)
        cached = ws2.limits
        ws2.close()
    finally:
        ws.close()
    files = list(tmp_path.glob("p2p-limits-*.json"))
    assert 0 <= measured.crossover("oneshot") <= measured.crossover("twoshot") <= 2 * measured.workspace_bytes == 2 << 20
    assert cached == measured
    if dist.get_rank(comm.group) == 0:
        assert len(files) == 1
    assert seconds < 30, f"calibration took {seconds:.1f} s (first compilation included)"



@mpi
def test_calibration_times_nccl_as_the_route_runs_it(comm, monkeypatch):
    """With commfuse.nccl loaded the NCCL column is its out-of-place ncclAllReduce (the route's call), not
    torch's all_reduce of a copy, which charges NCCL two more passes over the message."""
    _skip_unless_p2p(comm)
    bound = comm._nccl
    if bound is None:
        pytest.skip(f"the NCCL route runs {comm.nccl_binding}, not commfuse.nccl (ranks sharing a GPU take gloo)")
    calls = []
    real = bound.all_reduce

    def counted(send, recv, stream=None):
        calls.append((send.data_ptr() != recv.data_ptr(), send.numel()))
        return real(send, recv, stream)

    torch_all_reduce = dist.all_reduce

    def no_torch(tensor, *args, **kwargs):  # the times' maximum over the ranks (float64) is torch's
        if tensor.dtype == torch.bfloat16:
            raise AssertionError("calibration timed torch.distributed's all_reduce although commfuse.nccl is loaded")
        return torch_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(bound, "all_reduce", counted)
    monkeypatch.setattr(p2p.calibration.dist, "all_reduce", no_torch)
    sizes, times = p2p.calibration.measure(comm.workspace, sizes=[4096, 65536], nccl=bound)
    monkeypatch.undo()
    assert sizes == [4096, 65536] and all(0 < t < 1e4 for row in times for t in row), times
    assert {c for c in calls} == {(True, 2048), (True, 32768)}, "out of place, each size's elements"


@mpi
@pytest.mark.parametrize("bad", ["max_bytes", "COMMFUSE_P2P_TIMEOUT_S", "COMMFUSE_P2P_WORKSPACE_MB"])
def test_a_workspace_argument_wrong_on_one_rank_makes_every_rank_raise_at_once(comm, monkeypatch, bad):
    """Rank 0's max_bytes (or its environment's timeout) is wrong: it raises after the ranks' agreement, in
    which it takes part, and its peers raise naming it there. Before, rank 0 raised first and its peers
    waited in the agreement for the group's timeout. CPU stand-ins for the GPU query before the agreement
    and the allocation after it."""
    rank = dist.get_rank(comm.group)
    monkeypatch.setattr(p2p.workspace, "resident_ctas", lambda index, sharers: (132, "stand-in"))

    class Agreed(Exception):
        pass

    def create(self):
        raise Agreed

    monkeypatch.setattr(p2p.Workspace, "_create", create)
    if rank == 0 and bad.startswith("COMMFUSE"):
        monkeypatch.setenv(bad, "-1" if bad == "COMMFUSE_P2P_TIMEOUT_S" else "1e308")  # 1e308 MiB overflowed
    topo = types.SimpleNamespace(gpu_sharers=(1,) * dist.get_world_size(comm.group))
    mine = 0 if rank == 0 and bad == "max_bytes" else None if bad == "COMMFUSE_P2P_WORKSPACE_MB" else 1 << 20
    want = ("max_bytes must be > 0" if bad == "max_bytes" else bad) if rank == 0 else \
        r"a rank could not make the P2P workspace \(rank 0: ValueError: "
    with pytest.raises(ValueError, match=want):
        p2p.Workspace(comm.group, "cuda:0", max_bytes=mine, calibrate=False, topology=topo)
    monkeypatch.delenv(bad, raising=False)
    with pytest.raises(Agreed):  # alike on every rank: the ranks agree and go on to allocate
        p2p.Workspace(comm.group, "cuda:0", max_bytes=1 << 20, calibrate=False, topology=topo)


@mpi
def test_a_rank_that_cannot_set_calibration_up_makes_every_rank_raise_before_any_timed_collective(comm, monkeypatch):
    """Rank 1 fails where a rank fails alone (out of memory for a launcher's kernels, stand-in): every rank
    raises CalibrationError naming it, before any timed launch; a rank raising alone would leave its peers in
    the timed collectives. CPU (gloo) works: nothing is launched."""
    if dist.get_world_size(comm.group) < 2:
        pytest.skip("needs 2+ ranks")
    rank = dist.get_rank(comm.group)
    monkeypatch.setattr(p2p.calibration.jit, "kernel", lambda *args, **kwargs: object())

    def plain_launcher(shape, dtype, algo):
        if rank == 1 and algo == "twoshot" and shape == (32768,):
            raise RuntimeError("out of memory (stand-in)")

        def launch(x, out=None):
            raise AssertionError("calibration timed a launch although a rank could not set up")
        return launch

    ws = types.SimpleNamespace(group=comm.group, device=torch.device("cpu"), device_index=0, max_bytes=1 << 20,
                               lamport_bytes=1 << 16, plain_launcher=plain_launcher)
    with pytest.raises(p2p.CalibrationError,
                       match=r"^P2P calibration could not start: rank 1: RuntimeError: out of memory \(stand-in\)$") as e:
        p2p.calibration.measure(ws, sizes=[4096, 65536])
    assert (e.value.__cause__ is not None) == (rank == 1)


def test_the_cache_key_says_whether_the_kernels_launch_with_pdl(monkeypatch):
    """PDL goes off for the whole process once ranks share a GPU in it (jit.disable_pdl): a later calibration there
    measures without it, and its file must not be keyed as measured with it (the key read COMMFUSE_PDL alone)."""
    from commfuse.p2p import calibration

    monkeypatch.setattr(calibration.jit, "sources_digest", lambda: "digest")
    monkeypatch.delenv("COMMFUSE_PDL", raising=False)
    ws = types.SimpleNamespace(world=2, max_bytes=1 << 20, lamport_bytes=1 << 16, nblocks=132)
    topo = types.SimpleNamespace(versions=None, ranks=[types.SimpleNamespace(gpu_name="GPU")] * 2,
                                 p2p=((True,) * 2,) * 2, nvlink=((0,) * 2,) * 2)
    assert calibration.cache_key(ws, topo)["pdl"] is True
    monkeypatch.setattr(calibration.jit, "_PDL_OFF", "ranks share a GPU")
    assert calibration.cache_key(ws, topo)["pdl"] is False
    monkeypatch.setattr(calibration.jit, "_PDL_OFF", None)
    monkeypatch.setenv("COMMFUSE_PDL", "0")
    assert calibration.cache_key(ws, topo)["pdl"] is False


@mpi
def test_a_rank_that_cannot_make_the_cache_key_makes_every_rank_raise(comm, monkeypatch, tmp_path):
    """The key's kernel digest needs NVRTC and the CUDA headers (JitError where a rank has none, stand-in): that rank
    raised alone, before the cache's gather, and its peers waited there for the group's timeout; and the error was
    no CalibrationError, so the workspace was not torn down. Now every rank raises CalibrationError naming it."""
    if dist.get_world_size(comm.group) < 2:
        pytest.skip("needs 2+ ranks")
    rank = dist.get_rank(comm.group)
    monkeypatch.setenv("COMMFUSE_CACHE_DIR", str(tmp_path))

    def digest():
        if rank == 1:
            raise p2p.calibration.jit.JitError("CUDA headers (cuda_fp16.h) not found (stand-in)")
        return "digest"
    monkeypatch.setattr(p2p.calibration.jit, "sources_digest", digest)
    monkeypatch.setattr(p2p.calibration, "measure", lambda ws, nccl=None: pytest.fail("measured after the failure"))
    world = dist.get_world_size(comm.group)
    ws = types.SimpleNamespace(group=comm.group, rank=rank, world=world, max_bytes=1 << 20, lamport_bytes=1 << 16,
                               nblocks=132)
    topo = types.SimpleNamespace(versions=None, ranks=[types.SimpleNamespace(gpu_name="GPU")] * world,
                                 p2p=((True,) * world,) * world, nvlink=((0,) * world,) * world)
    with pytest.raises(p2p.CalibrationError,
                       match=r"^P2P calibration could not start: rank 1: JitError: CUDA headers") as e:
        p2p.calibration.calibrate(ws, topo)
    assert (e.value.__cause__ is not None) == (rank == 1)


@mpi
@pytest.mark.parametrize("failing", ["an NCCL call", "a P2P kernel, NCCL through torch.distributed"])
def test_a_rank_whose_timed_calls_fail_makes_every_rank_raise_in_step(comm, monkeypatch, failing):
    """Rank 1 fails in the timed calls (its NCCL call finds the communicator aborted; or one of its P2P kernels
    timed out where its peer's finished, which one-shot allows): it launches nothing more, and every rank
    raises CalibrationError naming it at the agreement that ends that column, so that the workspace's
    teardown pairs; rank 0 makes no collective the other does not (with NCCL through torch.distributed, a
    P2P failure left alone would have met rank 0's all_reduce with rank 1's gather). CPU stand-ins for the
    stream, the events and the kernels; torch.distributed's column runs over gloo."""
    if dist.get_world_size(comm.group) < 2:
        pytest.skip("needs 2+ ranks")
    from commfuse import nccl

    rank = dist.get_rank(comm.group)

    class Event:
        def record(self, stream):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: Event())
    monkeypatch.setattr(p2p.calibration.jit, "kernel",
                        lambda *args, **kwargs: types.SimpleNamespace(launch=lambda *args: None))
    nccl_calls, checks = [], []

    class Nccl:
        def all_reduce(self, send, recv):
            nccl_calls.append(send.numel())
            if rank == 1 and len(nccl_calls) == 3:
                raise nccl.NcclTimeoutError("rank 1: an NCCL all-reduce did not finish (stand-in)")

    def check_error():
        checks.append(1)
        if rank == 1 and failing.startswith("a P2P") and len(checks) == 2:
            raise RuntimeError("rank 1: a P2P kernel timed out waiting for rank 0 (stand-in)")

    ws = types.SimpleNamespace(group=comm.group, device=torch.device("cpu"), device_index=0, max_bytes=1 << 20,
                               lamport_bytes=1 << 16, error_code=lambda: 0, check_error=check_error,
                               plain_launcher=lambda shape, dtype, algo: (lambda x, out=None: None))
    what = "NcclTimeoutError: rank 1: an NCCL all-reduce" if failing == "an NCCL call" else \
        "RuntimeError: rank 1: a P2P kernel timed out"
    with pytest.raises(p2p.CalibrationError, match=f"^P2P calibration failed: rank 1: {what}") as e:
        p2p.calibration.measure(ws, sizes=[4096, 8192], nccl=Nccl() if failing == "an NCCL call" else None)
    assert (e.value.__cause__ is not None) == (rank == 1)
    if failing == "an NCCL call":  # rank 0: the first size's NCCL column whole (first use, reps x (1 + calls))
        assert len(nccl_calls) == (3 if rank == 1 else 1 + 3 * (1 + 8))
    assert gather(comm, "past it") == ["past it"] * comm.world_size  # no rank is left in a collective


@mpi
def test_a_workspace_whose_calibration_fails_is_released_on_every_rank(comm, monkeypatch):
    """CalibrationError comes on every rank together, so the workspace tears itself down (collectively) before
    it propagates: the peers' mappings closed and the buffers freed, nothing held by a workspace never made."""
    _skip_unless_p2p(comm)
    monkeypatch.delenv("COMMFUSE_P2P_CALIBRATE", raising=False)
    made = []
    real = p2p.Workspace._teardown

    def teardown(ws):
        made.append(ws)
        real(ws)

    def calibrate(ws, topology, nccl=None):
        raise p2p.CalibrationError("stand-in")

    monkeypatch.setattr(p2p.Workspace, "_teardown", teardown)
    monkeypatch.setattr(p2p.calibration, "calibrate", calibrate)
    with pytest.raises(p2p.CalibrationError, match="stand-in"):
        p2p.Workspace(comm.group, comm.device, max_bytes=1 << 20, topology=comm.topology)
    assert len(made) == 1
    ws = made[0]
    assert ws._ptr is None and ws._host_ptr is None and ws._peers == [None] * ws.world and ws._state is None
    assert gather(comm, "past it") == ["past it"] * comm.world_size  # no rank is left in a collective


def test_caller_owned_outputs_reach_the_launch(monkeypatch):
    """out=: the P2P launches write the caller's tensors (pointers in P2PParams), nothing is allocated."""
    rec = _Recorder(1 << 20)
    monkeypatch.setattr(P2P_ALLREDUCE, "kernel", lambda *args: rec)
    monkeypatch.setattr(launch, "allocate", lambda *a, **k: pytest.fail("allocated although out= was given"))
    g = torch.Generator().manual_seed(11)
    t, h = 16, 4096
    x, residual = (torch.randn(t, h, generator=g).to(torch.bfloat16) for _ in range(2))
    weight = torch.randn(h, generator=g).to(torch.bfloat16)
    out = reference.Tail(torch.empty_like(x), torch.empty_like(x), torch.empty(t, h, dtype=torch.float8_e4m3fn), None)
    got = rec.fused(x, residual, weight, torch.tensor([0.02]), TailSpec.of("fp8", return_norm=True), "oneshot", out)
    (launch_,) = rec.launches
    assert got.residual is out.residual and got.quant is out.quant
    assert launch_["tail"][1] == out.residual.data_ptr() and launch_["tail"][3] == out.norm.data_ptr()
    assert launch_["tail"][4] == out.quant.data_ptr()
    rec.launches.clear()
    y = torch.empty_like(x)
    assert rec.plain(x, "twoshot", y) is y
    assert [l["out"] for l in rec.launches] == [y.data_ptr()]
