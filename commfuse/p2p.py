"""P2P all-reduce over CUDA IPC buffers, with the all-reduce tail fused into the same kernel.

This is the "one node, P2P between every pair" row of docs/design.md. The kernels are in
csrc/p2p_allreduce.cu (its header comment has the device-side details and the memory-ordering
argument); this module owns the workspace they work in, launches them, measures where each
algorithm wins (calibration) and turns a kernel's timeout into a Python exception.

Workspace (class Workspace, one per Communicator, created collectively by every rank)
- Per rank ONE device buffer (cuMemAlloc, exported as a CUDA IPC handle; handles all-gathered over
  the group; every peer's buffer mapped once with cuIpcOpenMemHandle):
      half 0 | half 1 | Lamport half 0 | Lamport half 1 | signature slots | flags
  where each half is `world` slots of `slot_bytes` (slot s receives rank s's data) followed by a
  gather region of `slot_bytes` (two-shot's reduced rows); each Lamport half is `world` slots of
  `lamport_bytes` (the one-shot's; all ones when unused); flags is uint32[2 phases][NBLOCKS][world]
  (flags[k][b][s]: the last call in which rank s's CTA b finished two-shot phase k). Calls alternate
  halves by the parity of their epoch (double buffering), so one barrier per phase suffices and a
  Lamport half is reset before it is reused (the argument is in csrc/p2p_allreduce.cu).
  Size: 2 * (world + 1) * max_bytes + 2 * world * lamport_bytes + flags. max_bytes (the largest
  message one launch takes) is the constructor's argument, else COMMFUSE_P2P_WORKSPACE_MB, else
  192 MiB / (world + 1) rounded down to whole MiB: 64 MiB for 2 ranks, 38 MiB for 4, 21 MiB for 8,
  i.e. about 384 MiB of device memory per rank whatever the world size. lamport_bytes (the largest
  one-shot message) is min(max_bytes, ONESHOT_BUDGET / (2 * world)): 8 MiB for 2 ranks, 4 MiB for
  4, 2 MiB for 8 (32 MiB more per rank); one-shot is a latency algorithm, and calibration found
  two-shot ahead from 16 MiB at 2 ranks. Both rounded up to a multiple of 4 KiB.
  A larger message runs two-shot in pieces of whole rows that fit max_bytes, one launch per piece
  (plan.chunk_rows; 128-row multiples for swizzled NVFP4 scale factors): rows are independent, so
  each piece is a complete call of its own, and every launch keeps the protocol below unchanged.
- Per rank, not shared: epochs[NBLOCKS] and a device error word (one small torch tensor), and one
  host-mapped pinned error word (cuMemHostAlloc) that a timed-out kernel writes and the host polls.
- NBLOCKS: the grid of every launch, the same on every rank: min over the ranks of the CTAs it can
  keep resident (resident_ctas: the SMs this process may use, divided among the ranks sharing its
  GPU), at most MAX_BLOCKS, so each CTA b has the same sequence of calls on every rank and all CTAs
  of all ranks are co-resident (one CTA per SM: 256 threads, or up to 1024 threads at <= 64
  registers for the 1- and 2-vector register tails).
- Signature slots: per half, sender and CTA, 16 bytes (Lamport style: all ones when unused): each
  launch's CTA b pushes its call's signature to every peer and checks theirs, so ranks making
  different calls raise P2PMismatchError instead of summing unrelated data (csrc/p2p_allreduce.cu).
- Flags, epochs and error words are zeroed at creation, followed by a barrier before first use.
- close() is collective: synchronise, barrier, unmap the peers' buffers, barrier, free. A workspace
  that is never closed is released by the driver when the process exits (nothing here runs at
  interpreter exit, so exiting cannot hang in a collective or crash in a torn-down context).

Algorithms (both for the plain all-reduce and for every fused pattern; every rank computes every
output, and the sum is fp32 in rank order, rounded to T once: bit-identical on every rank)
- one-shot (Lamport): each rank pushes its whole message into slot[rank] of every peer's Lamport
  half; each rank reads its slots as they fill (an empty word marks data not yet arrived, so there
  is no flag and no barrier), sums them with its own input, resets them to empty and runs the tail
  (csrc/epilogue.cuh) on its rows. Messages up to lamport_bytes (plan.py sends larger ones
  two-shot, also when one-shot is forced).
- two-shot: rows split into `world` contiguous segments. Phase 0 pushes each row to its segment
  owner; barrier; each rank reduces its own segment and pushes the T-rounded sums into every rank's
  gather region; barrier; every rank runs the tail on all rows from its gather region.
  This differs from the textbook "epilogue on own rows, all-gather the outputs" on purpose:
  gathering the one T row of sums moves fewer bytes over NVLink than gathering the 2-4 outputs
  (residual, norm, quant, scale factors), and the outputs stay ordinary torch tensors (no IPC output
  buffers, nothing registered per call). Each rank then runs the tail on every row, which costs HBM
  bandwidth, not NVLink bandwidth, the scarcer of the two.
- plain all-reduce: the same kernels without a tail (QUANT = kQuantPlain); the flattened tensor is cut
  into rows of up to 2048 vectors so that every CTA gets work. Needs numel % 8 == 0 (16-byte
  vectors; SPEC.rejects says so, and plan.py then takes NCCL).

Bounded waits and errors: every cross-rank wait gives up after `timeout_s` (COMMFUSE_P2P_TIMEOUT_S,
default 10 s); the kernel records the missing rank in the device and host error words and returns.
`check_error()` (a plain read of pinned host memory: no synchronisation) raises P2PTimeoutError;
the Communicator calls it at the start of every call, and `check()` synchronises first. The error is
sticky: after a timeout the flags and epochs are out of step, so every later kernel on this
workspace returns at once (it reads the device error word) and every later call raises. This also
surfaces a timeout that happened inside a CUDA graph replay.

Launches use programmatic dependent launch on SM 9.0 and newer (see jit.Kernel.launch): the kernel
is scheduled while the previous kernel of the stream finishes, and waits for it on the GPU.

CUDA graphs: the workspace is created (and calibrated) before any capture; a launch bakes in only
pointers that stay valid for the workspace's life, and the epochs live in device memory, so replays
advance them like eager calls. Kernels must be loaded before capture (call once eagerly, or
`warmup`). Calls on one workspace must be stream-ordered (one stream, or ordered by events), as for
NCCL: the double-buffering argument relies on a rank's call E finishing before its call E + 1 starts.

Calibration (strategy "auto", at creation, i.e. before any capture): times one-shot, two-shot and
NCCL plain bf16 all-reduces (NCCL with the copy of x that the NCCL route makes) for messages of 4 KiB, 8 KiB, ... up to max_bytes and at 2 x max_bytes
(two-shot in two pieces there; one-shot up to lamport_bytes). Each timing is
GPU time of back-to-back eager calls held behind a short delay kernel (so Python launch overhead
does not count, as in a CUDA graph replay), best of 3; the MAX over ranks is taken so every rank
decides the same. twoshot_max is the largest size up to which P2P (the better algorithm) beats NCCL
at every measured size; oneshot_max the largest size up to which one-shot also beats two-shot.
Between measured sizes the smaller one's decision applies (conservative), and above the largest
measured size NCCL is taken (its bandwidth still grows with the size, the pieces' does not). Results are cached as
JSON under COMMFUSE_CACHE_DIR (default ~/.cache/commfuse), keyed by GPU names, world size,
NVLink/P2P matrices, torch/CUDA/NCCL/driver versions, workspace size, grid and kernel source;
rank 0 reads and writes it, every rank takes rank 0's answer. It takes well under 2 s (plus the
first compilation of the plain kernels). COMMFUSE_P2P_CALIBRATE=0 skips it and uses
oneshot_max = 512 KiB, twoshot_max = max_bytes.

Kernel variants: T (fp16, bf16) x QUANT (plain, none, fp8, nvfp4) x algorithm, and for the tails three
row shapes (launch_config): VPT = 1 (rows of up to 8192 elements, 32..1024 threads), VPT = 2 (up to
16384, 1024 threads at most) and the looped tail (longer rows, 256 threads). This is
fused_tail.launch_config's few-rows rule, taken for every row count: the P2P grid is one CTA per SM
whatever t is, so the reason the local tail takes fewer threads for many rows (several CTAs per SM
overlapping each other) does not apply, and 4 x 256 (its throughput shape) is not built. The world
size is a run-time argument (loops over ranks unrolled to 8 with uniform predicates) rather than a
template argument: 41 variants instead of several hundred, so that the CPU build of every variant
for every arch stays quick. The tail's numerics do not depend on these choices beyond the order of
the row's sum of squares (1 ulp of the norm at most, which the tolerances allow); for t < 256 the
P2P tail runs the local tail kernel's configuration, so the two give the same bits.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import epilogue, fused_tail, ipc, jit, params
from .epilogue import CTYPE, QUANTS
from .plan import FUSED_DTYPES, KernelSpec, P2PLimits, chunk_rows, register_kernel
from .reference import Tail

__all__ = ["Workspace", "P2PError", "P2PTimeoutError", "P2PMismatchError", "describe_signature", "SPEC", "ALGORITHMS", "variants", "warmup", "launch_config",
           "derive_limits", "default_max_bytes", "name_expression"]

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
ALIGN = 4096
DEFAULT_BUDGET = 192 << 20        # default max_bytes = DEFAULT_BUDGET / (world + 1)
ONESHOT_BUDGET = 32 << 20         # lamport_bytes = ONESHOT_BUDGET / (2 * world) at most
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_ONESHOT_MAX = 512 << 10   # without calibration
CALIBRATION_VERSION = 3
_CAL_REPS = 3
_CAL_DELAY_NS = 1_000_000         # covers the host's enqueueing of one timed batch
_TIMEOUT_CODE = 1 << 16           # kTimeoutCode
_MISMATCH_CODE = 2 << 16          # kMismatchCode
_HOST_WORDS = 12                  # the host error word, padding, then two call signatures (4 words each)
DELAY_KERNEL = "commfuse::p2p_delay"

_QUANT_ID = {**{q: int(k) for q, k in QUANTS.items()}, "plain": -1}  # kQuantPlain: no tail
_ALGO_ID = {"oneshot": 0, "twoshot": 1}

_NO_TAIL = (0,) * 7 + (0.0, 0, 0, 0)


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


_SIG_QUANTS = {0: "plain all-reduce", 1: "tail", 2: "tail + fp8", 3: "tail + nvfp4"}


def describe_signature(words: Sequence[int]) -> str:
    """A call signature as the kernels write it (call_signature in csrc/p2p_allreduce.cu), in words."""
    kind, rows, row_vecs, total_vecs = (int(w) & 0xFFFFFFFF for w in words)
    dtype = "bf16" if kind & 1 else "fp16"
    what = _SIG_QUANTS.get((kind >> 1) & 0xF, f"pattern {(kind >> 1) & 0xF}")
    algo = ALGORITHMS[(kind >> 5) & 1]
    if what == "plain all-reduce":
        return f"{dtype} {what} of {8 * total_vecs} elements, {algo}"
    extras = [e for bit, e in ((7, "norm out"), (6, "swizzled scale factors")) if kind >> bit & 1]
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
    quants=frozenset((None, "fp8", "nvfp4")),
    min_sm=(8, 0),
    hidden_multiple=8,
    max_hidden=epilogue.MAX_HIDDEN,
    max_tokens=epilogue.MAX_TOKENS,
    plain=True,
    algorithms=ALGORITHMS,
    world_sizes=frozenset(range(2, MAX_WORLD + 1)),
))


# --------------------------------------------------------------------------- variants and shapes


def name_expression(dtype: torch.dtype, quant: Optional[str], vpt: int, algo: str) -> str:
    """The kernel instantiation; quant None/"fp8"/"nvfp4", or "plain" (no tail, vpt 0)."""
    return f"commfuse::p2p_allreduce<{CTYPE[dtype]}, {_QUANT_ID[quant]}, {vpt}, {_ALGO_ID[algo]}>"


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    names = []
    for dtype in CTYPE:
        for algo in ALGORITHMS:
            names.append(name_expression(dtype, "plain", 0, algo))
            names += [name_expression(dtype, q, v, algo) for q in (None, "fp8", "nvfp4")
                      for v in VPT_BUCKETS + (0,)]
    return names + [DELAY_KERNEL]


def launch_config(hidden: int) -> Tuple[int, int]:
    """(vpt, threads) of the tail for rows of `hidden` elements, any number of rows: the local tail
    kernel's few-rows rule (fused_tail), whose VPT 1 and 2 up to 1024 threads and looped tail on
    THREADS are the variants built here: each row's dependent chain spread over as many threads as
    possible."""
    return fused_tail._launch_config(hidden, True)


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


def default_max_bytes(world: int) -> int:
    """Default largest message of one P2P launch: DEFAULT_BUDGET / (world + 1), whole MiB (64 MiB for 2
    ranks)."""
    return max(ALIGN, DEFAULT_BUDGET // (world + 1) >> 20 << 20)


class Layout(NamedTuple):
    """Byte sizes and offsets of one rank's buffer (see the module docstring)."""

    slot_bytes: int
    lamport_offset: int
    lamport_bytes: int
    sig_offset: int
    flags_offset: int
    total_bytes: int


def layout(max_bytes: int, world: int, nblocks: int) -> Layout:
    slot = -(-max_bytes // ALIGN) * ALIGN
    lamport = min(slot, max(ALIGN, ONESHOT_BUDGET // (2 * world) // ALIGN * ALIGN))
    lamport_offset = 2 * (world + 1) * slot
    # Signature slots (16 bytes per half, sender and CTA) follow the Lamport halves: both start empty.
    sig_offset = lamport_offset + 2 * world * lamport
    flags_offset = sig_offset + -(-(2 * world * nblocks * 16) // ALIGN) * ALIGN
    flags_bytes = 2 * nblocks * world * 4
    return Layout(slot, lamport_offset, lamport, sig_offset, flags_offset,
                  flags_offset + -(-flags_bytes // ALIGN) * ALIGN)


def calibration_sizes(max_bytes: int) -> List[int]:
    """Message sizes calibration measures: 4 KiB, 8 KiB, ... below max_bytes, then max_bytes and
    2 x max_bytes (two pieces)."""
    sizes, s = [], 4096
    while s < max_bytes:
        sizes.append(s)
        s *= 2
    return sizes + [max_bytes, 2 * max_bytes]


def derive_limits(sizes: Sequence[int], times: Sequence[Sequence[float]], workspace_bytes: int,
                  oneshot_bytes: Optional[int] = None) -> P2PLimits:
    """P2PLimits from times[i] = (one-shot, two-shot, NCCL) at sizes[i] (ascending, any unit; inf
    where an algorithm cannot take the size).

    twoshot_max: the largest size up to which min(one-shot, two-shot) < NCCL at every size (0: P2P
    never); oneshot_max: the largest size <= twoshot_max up to which one-shot <= two-shot at every size.
    """
    twoshot_max = oneshot_max = 0
    for size, (one, two, nccl) in zip(sizes, times):
        if not min(one, two) < nccl:
            break
        twoshot_max = size
    for size, (one, two, _) in zip(sizes, times):
        if size > twoshot_max or not one <= two:
            break
        oneshot_max = size
    return P2PLimits(workspace_bytes, oneshot_max, twoshot_max, oneshot_bytes)


def default_limits(max_bytes: int, oneshot_bytes: int) -> P2PLimits:
    return P2PLimits(max_bytes, min(DEFAULT_ONESHOT_MAX, oneshot_bytes), max_bytes, oneshot_bytes)


def _tail_rows(fields: tuple, out: Tail, row_slots: int, begin: int, end: int) -> tuple:
    """epilogue.prepare's TailParams fields and outputs for all rows -> the fields of rows
    [begin, end). Each output advances by its own bytes per row (its size over its rows: row_slots
    for swizzled scale factors, whose 128-row tiles are contiguous; `begin` is then a multiple of
    128, see chunk_rows)."""
    residual, res_out, weight, norm, q, sf, scale, eps, h, t, swizzled = fields

    def at(ptr: int, tensor: Optional[torch.Tensor], rows: int) -> int:
        return ptr + begin * (tensor.nbytes // rows) if ptr else 0

    return (at(residual, out.residual, t), at(res_out, out.residual, t), weight, at(norm, out.norm, t),
            at(q, out.quant, t), at(sf, out.scale_factors, row_slots if swizzled else t),
            scale, eps, h, end - begin, swizzled)


# --------------------------------------------------------------------------- kernels


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
            _kernel(dtype, quant, launch_config(hidden)[0], algo, index)


# --------------------------------------------------------------------------- small helpers


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {raw!r}")
    return value


def _all_gather(group, obj) -> list:
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _source_digest() -> str:
    h = hashlib.sha256()
    for name in (SOURCE, "epilogue.cuh", "pdl.cuh"):
        h.update((jit.CSRC_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def _read_limits(path: Path, key: dict) -> Optional[P2PLimits]:
    try:
        entry = json.loads(path.read_text())
        if json.dumps(entry["key"], sort_keys=True) != json.dumps(key, sort_keys=True):
            return None
        lim = entry["limits"]
        return P2PLimits(int(lim["workspace_bytes"]), int(lim["oneshot_max"]), int(lim["twoshot_max"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: measure again


def _write_limits(path: Path, entry: dict) -> None:
    jit.write_atomic(path, json.dumps(entry, indent=1, sort_keys=True).encode(), "the P2P calibration cache")


# --------------------------------------------------------------------------- workspace


class Workspace:
    """The IPC buffers of one group's P2P all-reduce, and the launches that use them.

    Collective: every rank of `group` (a NCCL group, 2..8 ranks, one node, P2P between every pair)
    constructs it at the same point, with this process's CUDA device `device` current.
    max_bytes: largest message of one launch (default: COMMFUSE_P2P_WORKSPACE_MB, else
    default_max_bytes(world)); larger ones run two-shot in pieces;
    timeout_s: longest wait for a peer (default: COMMFUSE_P2P_TIMEOUT_S, else 10 s); calibrate:
    measure the crossovers (else default_limits; COMMFUSE_P2P_CALIBRATE=0 also turns it off);
    topology: the group's Topology, for the calibration cache key (default: topology.detect(group)).
    Every rank must use the same max_bytes and calibrate setting (checked: all ranks raise).
    Attributes: limits (P2PLimits for plan.py), max_bytes, lamport_bytes (the largest one-shot
    message), nblocks, world, rank, device.
    """

    def __init__(self, group, device, *, max_bytes: Optional[int] = None, timeout_s: Optional[float] = None,
                 calibrate: bool = True, topology=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if not 2 <= self.world <= MAX_WORLD:
            raise ValueError(f"P2P workspace needs 2..{MAX_WORLD} ranks, the group has {self.world}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"P2P workspace needs a CUDA device, got {self.device}")
        self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self._index)
        if max_bytes is None:
            max_bytes = int(_env_number("COMMFUSE_P2P_WORKSPACE_MB", default_max_bytes(self.world) / 2**20) * 2**20)
        if int(max_bytes) <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = -(-int(max_bytes) // ALIGN) * ALIGN
        self.timeout_s = float(timeout_s) if timeout_s is not None else _env_number("COMMFUSE_P2P_TIMEOUT_S",
                                                                                      DEFAULT_TIMEOUT_S)
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        calibrate = bool(calibrate) and os.environ.get("COMMFUSE_P2P_CALIBRATE") != "0"

        self._ptr = self._host_ptr = None
        self._peers: list = [None] * self.world
        self._state = self._fixed_params = None
        self._closed = False
        if topology is None:
            from . import topology as topology_module

            topology = topology_module.detect(group)
        # Every rank lays its buffer out alike and launches the same grid: agree first.
        resident, how = resident_ctas(self._index, topology.gpu_sharers[self.rank])
        gathered = _all_gather(group, ((self.max_bytes, calibrate), resident, how))
        if len({g[0] for g in gathered}) > 1:
            detail = "; ".join(f"rank {i}: max_bytes={g[0][0]}, calibrate={g[0][1]}" for i, g in enumerate(gathered))
            raise ValueError(f"ranks disagree on the P2P workspace ({detail})")
        if min(g[1] for g in gathered) < 1:
            raise RuntimeError("P2P workspace: a rank cannot have one CTA per SM resident next to the ranks "
                               "sharing its GPU (" + "; ".join(f"rank {i}: {g[2]}" for i, g in enumerate(gathered)) + ")")
        self.nblocks = min(MAX_BLOCKS, min(g[1] for g in gathered))
        self.grid_reason = "; ".join(dict.fromkeys(g[2] for g in gathered))
        (self.slot_bytes, self.lamport_offset, self.lamport_bytes, self.sig_offset, self.flags_offset,
         self.total_bytes) = layout(self.max_bytes, self.world, self.nblocks)
        self._create()
        self.limits = (self._calibrate(topology) if calibrate
                       else default_limits(self.max_bytes, self.lamport_bytes))

    # ---------------------------------------------------------------- creation and teardown

    def _create(self) -> None:
        driver = ipc.driver
        handle, err = None, None
        try:
            with ipc.device_context(self._index):
                self._ptr = ipc.alloc(self.total_bytes)
                flags_words = (self.total_bytes - self.flags_offset) // 4
                ipc.call(driver.cuMemsetD32, self._ptr + self.flags_offset, 0, flags_words)
                lamport_words = (self.flags_offset - self.lamport_offset) // 4  # the signature slots too
                ipc.call(driver.cuMemsetD32, self._ptr + self.lamport_offset, 0xFFFFFFFF, lamport_words)
                flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
                self._host_ptr = int(ipc.call(driver.cuMemHostAlloc, 4 * _HOST_WORDS, flags))
                ctypes.memset(self._host_ptr, 0, 4 * _HOST_WORDS)
                self._host_dev_ptr = int(ipc.call(driver.cuMemHostGetDevicePointer, self._host_ptr, 0))
                ipc.call(driver.cuCtxSynchronize)  # the memsets are done before any peer can write
                handle = ipc.export_handle(self._ptr)
        except ipc.CudaError as e:
            err = f"workspace of {self.total_bytes} B: {e}"
        handles = _all_gather(self.group, (handle, err))
        self._raise_if_any(handles, lambda h: h[1], "could not create its P2P workspace")

        err, q = None, None
        try:
            with ipc.device_context(self._index):
                for q, (h, _) in enumerate(handles):
                    if q != self.rank:
                        self._peers[q] = ipc.open_handle(h)
        except ipc.CudaError as e:
            err = f"mapping rank {q}'s workspace: {e}" if q is not None else str(e)
        self._raise_if_any(_all_gather(self.group, err), lambda e: e, "could not map a peer's P2P workspace")
        self._peers[self.rank] = self._ptr

        # epochs[nblocks] then the device error word; zeroed like the flags.
        self._state = torch.zeros(self.nblocks + 1, dtype=torch.int32, device=self.device)
        # P2PParams from peers[8] to lamport_bytes: the same for every launch of this workspace.
        state = self._state.data_ptr()
        self._fixed_params = (*[int(p) for p in self._peers], *[0] * (MAX_WORLD - self.world),
                              state, state + 4 * self.nblocks, self._host_dev_ptr,
                              int(self.timeout_s * 1e9), self.slot_bytes, self.flags_offset,
                              self.lamport_offset, self.lamport_bytes, self.sig_offset)
        self._barrier()  # every buffer is initialised and mapped everywhere before any kernel runs

    def _raise_if_any(self, gathered: list, error_of, what: str) -> None:
        """Raise on every rank (after releasing what this rank holds) if any rank reported an error."""
        failed = [(i, error_of(g)) for i, g in enumerate(gathered) if error_of(g)]
        if failed:
            self._teardown()
            raise RuntimeError("; ".join(f"rank {i} {what}: {e}" for i, e in failed))

    def _barrier(self) -> None:
        """Host barrier of the group that also waits for this rank's GPU work."""
        torch.cuda.synchronize(self.device)
        token = torch.zeros(1, device=self.device)
        dist.all_reduce(token, group=self.group)
        torch.cuda.synchronize(self.device)

    def _teardown(self) -> None:
        """Collective: unmap the peers' buffers, then (after a barrier) free this rank's own."""
        errors = []
        self._barrier()  # no kernel on any rank still touches any buffer
        with ipc.device_context(self._index):
            for q, ptr in enumerate(self._peers):
                if ptr is not None and q != self.rank:
                    try:
                        ipc.close_handle(ptr)
                    except ipc.CudaError as e:
                        errors.append(f"unmapping rank {q}'s workspace: {e}")
            self._peers = [None] * self.world
        self._barrier()  # no rank maps this rank's buffer any more
        with ipc.device_context(self._index):
            for free, ptr in ((ipc.free, self._ptr), (lambda p: ipc.call(ipc.driver.cuMemFreeHost, p), self._host_ptr)):
                if ptr is not None:
                    try:
                        free(ptr)
                    except ipc.CudaError as e:
                        errors.append(f"freeing the workspace: {e}")
        self._ptr = self._host_ptr = None
        self._state = self._fixed_params = None
        if errors:
            raise RuntimeError(f"rank {self.rank}: P2P workspace teardown: " + "; ".join(errors))

    def close(self) -> None:
        """Release the workspace (collective: every rank calls it). Later calls raise."""
        if self._closed:
            return
        self._closed = True
        self._teardown()

    # ---------------------------------------------------------------- errors

    def _error_code(self) -> int:
        return 0 if self._host_ptr is None else ctypes.c_int32.from_address(self._host_ptr).value

    def check_error(self) -> None:
        """Raise P2PTimeoutError if a kernel timed out, P2PMismatchError if a peer's call differed; a
        read of pinned host memory, no synchronisation (an error of a kernel still running shows on a
        later check)."""
        if self._closed:
            raise RuntimeError("this P2P workspace is closed")
        code = self._error_code()
        if code:
            if code >> 16 == _TIMEOUT_CODE >> 16:
                raise P2PTimeoutError(self.rank, code & 0xFF, (code >> 8) & 0xFF, self.timeout_s)
            if code >> 16 == _MISMATCH_CODE >> 16:
                words = (ctypes.c_uint32 * _HOST_WORDS).from_address(self._host_ptr)
                raise P2PMismatchError(self.rank, code & 0xFF, describe_signature(words[8:12]),
                                       describe_signature(words[4:8]))
            raise RuntimeError(f"P2P workspace on rank {self.rank}: unknown error code {code:#x}")

    def check(self) -> None:
        """Wait for this device's work, then raise P2PTimeoutError if any P2P kernel timed out."""
        torch.cuda.synchronize(self.device)
        self.check_error()

    # ---------------------------------------------------------------- launches

    def _check_call(self, x: torch.Tensor, algo: str) -> None:
        self.check_error()
        if algo not in _ALGO_ID:
            raise ValueError(f"algo must be one of {ALGORITHMS}, got {algo!r}")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, the P2P workspace on {self.device}")
        if x.dtype not in CTYPE:
            raise TypeError(f"P2P all-reduce takes float16/bfloat16, got {x.dtype}")
        size = x.numel() * x.element_size()
        if algo == "oneshot" and size > self.lamport_bytes:
            raise ValueError(f"message of {size} B > the one-shot buffers of {self.lamport_bytes} B: use twoshot")

    def _launch(self, kernel: jit.Kernel, threads: int, tail: tuple, x_ptr: int, out_ptr: int, total_vecs: int,
                rows: int, row_vecs: int, row_slots: int) -> None:
        kernel.launch((self.nblocks, 1, 1), (threads, 1, 1),
                      params.P2P.pack(*tail, x_ptr, out_ptr, *self._fixed_params, total_vecs, rows, row_vecs,
                                      row_slots, self.world, self.rank, 0))

    def _launch_plain(self, x_flat: torch.Tensor, out: torch.Tensor, algo: str) -> None:
        """out = the sum of x_flat (numel % 8 == 0), in pieces of max_bytes (a multiple of 4 KiB, so
        whole vectors) if larger."""
        kernel = _kernel(x_flat.dtype, "plain", 0, algo, self._index)
        n, elt = x_flat.numel(), x_flat.element_size()
        x_ptr, out_ptr, piece = x_flat.data_ptr(), out.data_ptr(), self.max_bytes // elt
        for begin in range(0, n, piece):
            vecs = min(piece, n - begin) // 8
            row_vecs, rows, threads = plain_rows(vecs, self.nblocks, algo)
            self._launch(kernel, threads, _NO_TAIL, x_ptr + begin * elt, out_ptr + begin * elt, vecs, rows, row_vecs,
                         rows)

    def all_reduce(self, x: torch.Tensor, algo: str, *, out: Optional[torch.Tensor] = None,
                   checked: bool = False) -> torch.Tensor:
        """Sum of x over the group (fp32 in rank order, rounded to T once), in a new tensor of x's
        shape. x: fp16/bf16 on this workspace's device, numel % 8 == 0; messages larger than max_bytes
        run two-shot in pieces of max_bytes (one launch each), one-shot ones take at most lamport_bytes.
        checked: the caller has validated x and algo and called check_error (the Communicator's
        cached plan has): skip those checks on this hot path."""
        n = x.numel()
        if not checked:
            self._check_call(x, algo)
            if n % 8:
                raise ValueError(f"P2P plain all-reduce needs a multiple of 8 elements, got {n}")
            if out is not None:
                epilogue.check_like(out, x)
        if out is None:
            out = epilogue._empty(tuple(x.shape), dtype=x.dtype, device=x.device)
        if n:
            self._launch_plain(epilogue.aligned(x.contiguous().view(-1)), out.view(-1), algo)
        return out

    def fused_all_reduce(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         quant: Optional[str], scale: Optional[torch.Tensor], return_norm: bool, sf_layout: str,
                         algo: str, *, out: Optional[Tail] = None, checked: bool = False) -> Tail:
        """All-reduce of x with the tail fused (reference.fused_tail's semantics and outputs).

        x, residual: T[..., h] (fp16/bf16), weight T[h], scale: float32 tensor of one element (with
        quant), all on this workspace's device; h % 8 == 0 (16 for nvfp4), h <= epilogue.MAX_HIDDEN.
        A message larger than max_bytes runs two-shot in pieces of whole rows (plan.chunk_rows), one
        launch each. Returns a Tail of fresh [t, h] tensors (see fused_tail.run). checked: as for
        `all_reduce`.
        """
        h, elt = x.shape[-1], x.element_size()
        if not checked:
            self._check_call(x, algo)
            epilogue.check(x, residual, weight, quant, scale, sf_layout)
            if out is not None:
                epilogue.check_out(out, x.numel() // h, h, x.dtype, x.device, quant, return_norm, sf_layout)
            if x.numel() * elt > self.max_bytes and not chunk_rows(h * elt, quant, sf_layout, self.max_bytes):
                raise ValueError(f"the P2P workspace of {self.max_bytes} B holds no piece of this message (a row "
                                 f"of {h} elements, 128 rows for swizzled NVFP4): use NCCL")
        x2, out, fields, row_slots = epilogue.prepare(x, residual, weight, eps, quant, scale, return_norm, sf_layout,
                                                      out)
        if not row_slots:
            return out
        t = x2.shape[0]
        vpt, threads = launch_config(h)
        kernel = _kernel(x.dtype, quant, vpt, algo, self._index)
        if t * h * elt <= self.max_bytes:
            self._launch(kernel, threads, fields, x2.data_ptr(), 0, t * h // 8, t, h // 8, row_slots)
            return out
        piece = chunk_rows(h * elt, quant, sf_layout, self.max_bytes)
        for begin in range(0, t, piece):
            end = min(t, begin + piece)
            slots = end - begin if end < t else row_slots - begin  # the last piece zeroes the padding
            self._launch(kernel, threads, _tail_rows(fields, out, row_slots, begin, end),
                         x2.data_ptr() + begin * h * elt, 0, (end - begin) * h // 8, end - begin, h // 8, slots)
        return out

    # ---------------------------------------------------------------- calibration

    def _cache_key(self, topo) -> dict:
        vers = topo.versions
        return {
            "calibration": CALIBRATION_VERSION, "kernel": _source_digest(), "world": self.world,
            "gpus": [r.gpu_name for r in topo.ranks], "p2p": topo.p2p, "nvlink": topo.nvlink,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": vers.nccl if vers else None, "driver": vers.driver if vers else None,
            "workspace_bytes": self.max_bytes, "lamport_bytes": self.lamport_bytes, "nblocks": self.nblocks,
        }

    def _calibrate(self, topo) -> P2PLimits:
        """Measured limits, from the disk cache when this machine and software were measured before."""
        key = self._cache_key(topo)
        # JSON round trip: tuples become lists, so the cached key compares equal.
        key = json.loads(json.dumps(key))
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        path = jit._cache_dir() / f"p2p-limits-{digest}.json"
        cached = _read_limits(path, key) if self.rank == 0 else None
        cached = _all_gather(self.group, cached)[0]
        if cached is not None:  # the buffers' size is this workspace's, never the file's
            return dataclasses.replace(cached, oneshot_bytes=self.lamport_bytes)
        sizes, times = self.measure()
        limits = derive_limits(sizes, times, self.max_bytes, self.lamport_bytes)
        if self.rank == 0:
            _write_limits(path, {"key": key, "sizes": sizes, "times_us": times,
                                 "columns": ["oneshot", "twoshot", "nccl"],
                                 "limits": {"workspace_bytes": limits.workspace_bytes,
                                            "oneshot_max": limits.oneshot_max,
                                            "twoshot_max": limits.twoshot_max}})
        return limits

    def measure(self, sizes: Optional[Sequence[int]] = None) -> Tuple[List[int], List[List[float]]]:
        """(sizes, times): microseconds per plain bf16 all-reduce of each size in bytes (default
        calibration_sizes(max_bytes)) for (one-shot, two-shot, NCCL), the max over ranks.
        Collective; not allowed during CUDA graph capture."""
        sizes = list(sizes) if sizes is not None else calibration_sizes(self.max_bytes)
        if any(s % 16 or s <= 0 for s in sizes):
            raise ValueError(f"sizes must be positive multiples of 16 B, got {sizes}")
        n_max = max(sizes) // 2
        x = torch.zeros(n_max, dtype=torch.bfloat16, device=self.device)
        out = torch.empty_like(x)  # also NCCL's buffer: only the time is kept
        stream = torch.cuda.current_stream(self.device)
        delay = jit.kernel(SOURCE, DELAY_KERNEL, device=self._index)
        delay_params = struct.pack("<Q", _CAL_DELAY_NS)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        times = []
        for size in sizes:
            n = size // 2
            # NCCL as the Communicator's NCCL route runs it: torch's all_reduce works in place, so the
            # route copies x first (x is the caller's): 2 x 112 MiB of HBM traffic at 112 MiB, ~55 us.
            runs = (lambda: self._launch_plain(x[:n], out[:n], "oneshot"),
                    lambda: self._launch_plain(x[:n], out[:n], "twoshot"),
                    lambda: dist.all_reduce(out[:n].copy_(x[:n]), group=self.group))
            calls = 8 if size <= 16 << 20 else 3
            row = []
            for run in runs[size > self.lamport_bytes:]:
                run()  # first use: loads kernels, sets NCCL up
                best = math.inf
                for _ in range(_CAL_REPS):
                    # The delay holds the stream while Python enqueues the batch; the first call then
                    # lines the ranks up (it completes on all ranks together), the rest are timed.
                    delay.launch((1, 1, 1), (1, 1, 1), delay_params, 0, stream.cuda_stream)
                    run()
                    start.record(stream)
                    for _ in range(calls):
                        run()
                    end.record(stream)
                    end.synchronize()
                    best = min(best, start.elapsed_time(end) * 1e3 / calls)
                row.append(best)
            times.append([math.inf] * (3 - len(row)) + row)
        # A timeout during calibration must not pass silently, and must raise on every rank together.
        torch.cuda.synchronize(self.device)
        codes = _all_gather(self.group, self._error_code())
        if any(codes):
            self.check_error()
            raise RuntimeError(f"P2P calibration: a kernel timed out on rank(s) "
                               f"{[i for i, c in enumerate(codes) if c]}")
        t = torch.tensor(times, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return sizes, t.cpu().tolist()
