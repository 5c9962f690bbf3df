"""The P2P all-reduce kernels (csrc/p2p_allreduce.cu) as the host sees them: the variants built and
their launch shapes, the kernel spec plan.py routes by, the protocol's error codes and call
signatures, and the exceptions they become. See the package docstring for the algorithms.
"""
from __future__ import annotations

import functools
import os
from typing import List, Optional, Sequence, Tuple

import torch

from .. import epilogue, fused_tail, ipc, jit, params
from ..epilogue import COMPUTED_SCALES, CTYPE, QUANTS
from ..plan import FUSED_DTYPES, KernelSpec, register_kernel
from ..reference import Tail

SOURCE = "p2p_allreduce.cu"
ALGORITHMS = ("oneshot", "twoshot")
MAX_WORLD = params.MAX_WORLD  # kMaxWorld in p2p_allreduce.cu
THREADS = 256          # threads of the plain two-shot and of the looped tail
VPT_BUCKETS = (1, 2)   # the register tails' vectors of 8 elements per thread
# kP2PThreads<QUANT, VPT, ALGO> in p2p_allreduce.cu (each variant's __launch_bounds__) of the tails,
# by VPT; 0 is the looped tail. The plain one-shot's is PLAIN_ONESHOT_THREADS.
MAX_THREADS = {1: 1024, 2: 1024, 0: THREADS}
PLAIN_ONESHOT_THREADS = 1024
PLAIN_MIN_ROW_VECS = 256
PLAIN_MAX_ROW_VECS = {"oneshot": 4 * PLAIN_ONESHOT_THREADS, "twoshot": 8 * THREADS}
MAX_BLOCKS = 160       # grid cap (H100/H200: 132 SMs, B200: 148)
_TIMEOUT_CODE = 1 << 16           # kTimeoutCode
_MISMATCH_CODE = 2 << 16          # kMismatchCode
DELAY_KERNEL = "commfuse::p2p_delay"

_QUANT_ID = {**{q: int(k) for q, k in QUANTS.items()}, "plain": -1}  # kQuantPlain: no tail
_ALGO_ID = {"oneshot": 0, "twoshot": 1}

_NO_TAIL = (0,) * 7 + (0.0, 0, 0, 0) + (0, -0.0, 0, 0)



class P2PError(RuntimeError):
    """A P2P all-reduce kernel stopped a call: a peer did not arrive, or its call differed. The
    workspace is unusable afterwards: every later call on it raises the same error."""


class P2PTimeoutError(P2PError):
    """A P2P all-reduce kernel waited longer than the timeout for a peer (named in the message).

    rank: this rank; missing_rank: the peer that did not arrive; phase: the two-shot barrier (0 or 1),
    0 for the one-shot's wait for the peer's data;
    timeout_s: the limit. The workspace is unusable afterwards: create a new Communicator.
    """

    def __init__(self, rank: int, missing_rank: int, phase: int, timeout_s: float):
        super().__init__(
            f"P2P all-reduce on rank {rank}: rank {missing_rank} did not arrive (its data or barrier {phase}) within "
            f"{timeout_s:g} s (it skipped a call, is stuck or died, or the ranks' calls differ). The P2P "
            "workspace is out of step now and every later call on it raises: close this Communicator and "
            "create a new one.")
        self.rank, self.missing_rank, self.phase, self.timeout_s = rank, missing_rank, phase, timeout_s


_SIG_QUANTS = {0: "plain all-reduce", 1: "tail", 2: "tail + fp8", 3: "tail + nvfp4", 4: "tail + fp8_per_token",
               5: "tail + fp8_block"}


def describe_signature(words: Sequence[int]) -> str:
    """A call signature as the kernels write it (call_signature in csrc/p2p_allreduce.cu), in words."""
    kind, rows, row_vecs, total_vecs = (int(w) & 0xFFFFFFFF for w in words)
    dtype = "bf16" if kind & 1 else "fp16"
    what = _SIG_QUANTS.get((kind >> 1) & 0xF, f"pattern {(kind >> 1) & 0xF}")
    algo = ALGORITHMS[(kind >> 5) & 1]
    if what == "plain all-reduce":
        return f"{dtype} {what} of {8 * total_vecs} elements, {algo}"
    extras = [e for bit, e in ((7, "norm out"), (6, "swizzled scale factors"), (12, "MN-major scales"),
                               (13, "UE8M0 scales")) if kind >> bit & 1]
    return f"{dtype} {what}{' (' + ', '.join(extras) + ')' if extras else ''}, [{rows}, {8 * row_vecs}], {algo}"


class P2PMismatchError(P2PError):
    """Ranks made different P2P calls (dtype, shape, pattern or algorithm): the kernels compare a
    signature of each call that they send with the data, so the difference is found on the GPU,
    at no host cost, instead of a wrong sum or a wait for data that never comes.

    rank: this rank; peer: the rank whose call differs; mine, theirs: the two calls, in words.
    """

    def __init__(self, rank: int, peer: int, mine: str, theirs: str):
        super().__init__(
            f"P2P all-reduce on rank {rank}: rank {peer} made a different call: rank {peer}: {theirs}; "
            f"rank {rank}: {mine}. Every rank must make the same calls in the same order. The P2P workspace "
            "is out of step now and every later call on it raises: close this Communicator and create a new one.")
        self.rank, self.peer, self.mine, self.theirs = rank, peer, mine, theirs


class _P2PSpec(KernelSpec):
    """KernelSpec plus the plain all-reduce's own need: whole 16-byte vectors of the flat tensor."""

    def rejects(self, req, sm):
        why = super().rejects(req, sm)
        if why is None and req.residual is None and req.x.numel % 8:
            return f"{self.name}: plain all-reduce needs a multiple of 8 elements, got {req.x.numel}"
        return why


SPEC = register_kernel(_P2PSpec(
    name="p2p_allreduce",
    kind="p2p",
    dtypes=frozenset(FUSED_DTYPES),
    quants=frozenset(QUANTS),
    min_sm=(8, 0),
    hidden_multiple=8,
    max_hidden=epilogue.MAX_HIDDEN,
    max_tokens=epilogue.MAX_TOKENS,
    plain=True,
    algorithms=ALGORITHMS,
    world_sizes=frozenset(range(2, MAX_WORLD + 1)),
))




def name_expression(dtype: torch.dtype, quant: Optional[str], vpt: int, algo: str) -> str:
    """The kernel instantiation; quant one of epilogue.QUANTS, or "plain" (no tail, vpt 0)."""
    return f"commfuse::p2p_allreduce<{CTYPE[dtype]}, {_QUANT_ID[quant]}, {vpt}, {_ALGO_ID[algo]}>"


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    names = []
    for dtype in CTYPE:
        for algo in ALGORITHMS:
            names.append(name_expression(dtype, "plain", 0, algo))
            names += [name_expression(dtype, q, v, algo) for q in QUANTS for v in register_vpts(q) + (0,)]
    return names + [DELAY_KERNEL]


def register_vpts(quant: Optional[str]) -> Tuple[int, ...]:
    """The register tails built for `quant`. The computed-scale FP8 kinds keep more live per vector
    (the row or block maximum, the scale's rescaling): at VPT 2 their 1024-thread variants spill
    (ptxas, sm_90: 8-32 bytes), so rows past 1024 vectors (h > 8192) take the looped tail instead."""
    return (1,) if quant in COMPUTED_SCALES else VPT_BUCKETS


def launch_config(hidden: int, quant: Optional[str] = None) -> Tuple[int, int]:
    """(vpt, threads) of the tail for rows of `hidden` elements, any number of rows: the local tail
    kernel's few-rows rule (fused_tail), whose VPT 1 and 2 up to 1024 threads and looped tail on
    THREADS are the variants built here (register_vpts(quant)): each row's dependent chain spread
    over as many threads as possible."""
    vpt, threads = fused_tail._launch_config(hidden, True)
    return (vpt, threads) if vpt == 0 or vpt in register_vpts(quant) else (0, MAX_THREADS[0])


def plain_rows(total_vecs: int, nblocks: int, algo: str) -> Tuple[int, int, int]:
    """(row_vecs, rows, threads) cutting a plain all-reduce of `total_vecs` vectors into rows for
    `algo`: small enough that every CTA gets a row, PLAIN_MIN_ROW_VECS to PLAIN_MAX_ROW_VECS[algo]
    vectors. One-shot: whole warps of vectors, up to PLAIN_ONESHOT_THREADS threads (one vector each
    up to rows of that many: the latency case); two-shot: whole multiples of THREADS vectors."""
    per_block = -(-total_vecs // nblocks)
    unit = 32 if algo == "oneshot" else THREADS
    row_vecs = min(PLAIN_MAX_ROW_VECS[algo], max(PLAIN_MIN_ROW_VECS, -(-per_block // unit) * unit))
    threads = min(PLAIN_ONESHOT_THREADS, row_vecs) if algo == "oneshot" else THREADS
    return row_vecs, -(-total_vecs // row_vecs), threads


def resident_ctas(index: int, sharers: int = 1) -> Tuple[int, str]:
    """(CTAs of a whole SM each, the P2P kernels' largest shape, that this process can keep resident on
    GPU `index` while `sharers` ranks, itself included, keep as many, and how that was found).

    Every CTA of a launch waits for the same CTA of the peers, so all of them must be resident at once,
    on every rank: a larger grid deadlocks until the bounded wait gives up. See grid_limit.
    """
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    affinity = None
    try:
        with ipc.device_context(index):
            kind = ipc.driver.CUexecAffinityType.CU_EXEC_AFFINITY_TYPE_SM_COUNT
            affinity = int(ipc.call(ipc.driver.cuCtxGetExecAffinity, kind).param.smCount.val)
    except Exception:  # no execution affinity here: the device's SM count stands
        pass
    return grid_limit(sms, affinity, os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), sharers)


def grid_limit(sms: int, affinity_sms: Optional[int], mps_percentage: Optional[str], sharers: int) -> Tuple[int, str]:
    """resident_ctas from its facts: the SM count the process sees (an MPS client's device properties
    and its context's execution affinity, `affinity_sms`, count only what MPS lets it use), lowered by
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in case they do not, and divided among the `sharers` ranks on the
    GPU (under MPS their kernels run at the same time)."""
    limits = [(sms, f"{sms} SMs")]
    if affinity_sms is not None and 0 < affinity_sms < sms:
        limits.append((affinity_sms, f"{affinity_sms} SMs (execution affinity)"))
    try:
        pct = float(mps_percentage) if mps_percentage else 100.0
    except ValueError:
        pct = 100.0
    if 0 < pct < 100:
        n = int(sms * pct / 100)
        limits.append((n, f"{n} SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={mps_percentage})"))
    n, how = min(limits)
    if sharers > 1:
        return min(n, sms // sharers), f"{how} / {sharers} ranks sharing the GPU"
    return n, how


def _tail_rows(fields: tuple, out: Tail, row_slots: int, begin: int, end: int) -> tuple:
    """epilogue.prepare's TailParams fields and outputs for all rows -> the fields of rows
    [begin, end). Each output advances by its own bytes per row (its size over its rows: row_slots
    for swizzled scale factors, whose 128-row tiles are contiguous; `begin` is then a multiple of
    128, see chunk_rows). MN-major scales advance by one element per row and keep the whole call's
    column stride (scale_stride)."""
    (residual, res_out, weight, norm, q, sf, scale, eps, h, t, swizzled, scales, offset, scale_layout,
     scale_stride) = fields

    def at(ptr: int, tensor: Optional[torch.Tensor], rows: int) -> int:
        return ptr + begin * (tensor.nbytes // rows) if ptr else 0

    mn_major = scale_layout & epilogue._SCALE_MN_MAJOR
    return (at(residual, out.residual, t), at(res_out, out.residual, t), weight, at(norm, out.norm, t),
            at(q, out.quant, t), at(sf, out.scale_factors, row_slots if swizzled else t),
            scale, eps, h, end - begin, swizzled,
            scales + begin * out.scales.element_size() if mn_major else at(scales, out.scales, t),
            offset, scale_layout, scale_stride)




@functools.lru_cache(maxsize=None)
def _kernel(dtype: torch.dtype, quant: Optional[str], vpt: int, algo: str, device_index: int) -> jit.Kernel:
    """The all-reduce kernel (quant "plain" for none), loaded on the device; it starts with pdl_wait()."""
    return jit.kernel(SOURCE, name_expression(dtype, quant, vpt, algo), device=device_index, pdl=True)


def warmup(dtype: torch.dtype, quant: Optional[str] = None, hidden: Optional[int] = None, device=None) -> None:
    """Compile and load, on `device` (default: current), both algorithms' plain all-reduce of
    `dtype`, and with `hidden` given also the fused (quant, hidden) variants, so that later calls
    can be captured in a CUDA graph."""
    if dtype not in CTYPE or quant not in QUANTS:
        raise ValueError(f"no P2P kernel for dtype={dtype}, quant={quant!r}")
    index = jit._device_index(device)
    for algo in ALGORITHMS:
        _kernel(dtype, "plain", 0, algo, index)
        if hidden is not None:
            _kernel(dtype, quant, launch_config(hidden, quant)[0], algo, index)


