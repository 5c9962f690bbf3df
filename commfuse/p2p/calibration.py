"""Where each P2P algorithm wins: the one-shot / two-shot / NCCL crossovers that strategy "auto"
uses, measured on the machine at workspace creation (before any CUDA graph capture) and cached on
disk. See the package docstring for what is measured and how the limits follow.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import env
from ..distributed import gather_objects, rank_label
from ..kernels import jit
from ..kernels.p2p_allreduce import ALGORITHMS, DELAY_KERNEL, SOURCE

DEFAULT_ONESHOT_MAX = 512 << 10   # without calibration
CALIBRATION_VERSION = 6  # a change to what is measured or how the limits follow from it (derive_limits)
_CAL_REPS = 3
_CAL_DELAY_NS = 1_000_000         # covers the host's enqueueing of one timed batch


class CalibrationError(RuntimeError):
    """Calibration could not measure: raised on every rank of the group at the same point (a rank that
    raised alone would leave its peers waiting in the timed collectives), so the workspace can be
    released collectively; on the rank that failed, the cause is chained."""


def calibration_sizes(max_bytes: int) -> List[int]:
    """Message sizes calibration measures: 4 KiB, 8 KiB, ... below max_bytes, then max_bytes and
    2 x max_bytes (two pieces)."""
    sizes, s = [], 4096
    while s < max_bytes:
        sizes.append(s)
        s *= 2
    return sizes + [max_bytes, 2 * max_bytes]


@dataclasses.dataclass(frozen=True)
class P2PLimits:
    """Where each P2P algorithm wins (bytes), measured per machine by calibration.

    crossovers: (algorithm, the largest message it is the fastest route for), in ALGORITHMS' order: a
    message goes to the first algorithm whose crossover it does not exceed, past the last one to NCCL.
    Nothing larger than `oneshot_bytes` (the one-shot's own buffers; None: the workspace) goes one-shot,
    even when forced. A message larger than `workspace_bytes` runs two-shot in pieces of whole rows that
    fit it (p2p_allreduce.chunk_rows), or takes NCCL when not even one piece fits. measured: the
    crossovers come from this machine's calibration (now or cached), not default_limits.
    """

    workspace_bytes: int
    crossovers: Tuple[Tuple[str, int], ...]
    oneshot_bytes: Optional[int] = None
    measured: bool = True

    def crossover(self, algorithm: str) -> int:
        return dict(self.crossovers)[algorithm]


def derive_limits(sizes: Sequence[int], times: Sequence[Sequence[float]], workspace_bytes: int,
                  oneshot_bytes: Optional[int] = None) -> P2PLimits:
    """P2PLimits from times[i] = (each algorithm of ALGORITHMS, then NCCL) at sizes[i] (ascending, any
    unit; inf where an algorithm cannot take the size).

    A plan takes the first algorithm up to its crossover, the next one above that up to its own, and so on, NCCL
    above the last. So each algorithm's crossover, in order: the largest size (from the previous crossover on) up
    to which, at every size, it beats NCCL and is no slower than every later algorithm (0, or the previous
    crossover: never taken). Each algorithm is taken only where it was measured to win: the last one's range ends
    where it loses to NCCL itself (it ended where the fastest of them all did, so one-shot's wins, noise where
    two-shot edged it, sent sizes to a two-shot that NCCL beat).
    """
    k = len(ALGORITHMS)
    if list(sizes) != sorted(sizes) or len(times) != len(sizes) or any(len(row) != k + 1 for row in times):
        raise ValueError(f"derive_limits needs ascending sizes and a row of {k + 1} times per size")
    times = [[t if t == t else math.inf for t in row] for row in times]  # NaN: not measured, never the fastest
    limits, taken = [], 0  # sizes up to `taken` go to the algorithms before
    for i in range(k):
        limit = taken
        for size, row in zip(sizes, times):
            if size <= taken:
                continue
            if not (row[i] < row[k] and row[i] <= min(row[i + 1:k], default=math.inf)):
                break
            limit = size
        limits.append(limit)
        taken = limit
    return P2PLimits(workspace_bytes, tuple(zip(ALGORITHMS, limits)), oneshot_bytes)


def default_limits(max_bytes: int, oneshot_bytes: int) -> P2PLimits:
    return P2PLimits(max_bytes, (("oneshot", min(DEFAULT_ONESHOT_MAX, oneshot_bytes)), ("twoshot", max_bytes)),
                     oneshot_bytes, measured=False)


def _read_limits(path: Path, key: dict) -> Optional[P2PLimits]:
    """The limits cached at path for this key, or None (absent, damaged, or not what derive_limits makes for
    the key's workspace: measured again). Never raises: rank 0 alone reads the file, and an error here would
    leave the other ranks waiting for its answer."""
    try:
        if not path.is_file():  # absent, or a directory or FIFO in its place (reading a FIFO waits for good)
            return None
        entry = json.loads(path.read_text())
        if json.dumps(entry["key"], sort_keys=True) != json.dumps(key, sort_keys=True):
            return None
        lim = entry["limits"]
        limits = P2PLimits(int(lim["workspace_bytes"]), tuple((str(a), int(b)) for a, b in lim["crossovers"]))
        crossovers = [c for _, c in limits.crossovers]
        # What derive_limits makes for the key's workspace (it measures up to twice its size), or measured again.
        made = limits.workspace_bytes == key["workspace_bytes"] and \
            [a for a, _ in limits.crossovers] == list(ALGORITHMS) and crossovers == sorted(crossovers) and \
            0 <= crossovers[0] <= crossovers[-1] <= 2 * limits.workspace_bytes
    except Exception:  # noqa: BLE001 - damaged in any way (Infinity, nesting past the recursion limit, ...)
        return None
    return limits if made else None


def _write_limits(path: Path, entry: dict) -> None:
    jit.write_atomic(path, json.dumps(entry, indent=1, sort_keys=True).encode(), "the P2P calibration cache")




def nccl_route(nccl) -> str:
    """How the NCCL column is run, a part of the cache key: the NCCL route's binding (commfuse.nccl's
    ncclAllReduce out of place, or torch.distributed's all_reduce of a copy) moves its times by tens of
    microseconds at the largest sizes; commfuse.nccl's own library version, which may not be torch's."""
    return "torch.distributed" if nccl is None else f"commfuse.nccl (NCCL {nccl.version})"


def cache_key(ws, topo, nccl=None) -> dict:
    """What the measured times depend on. Besides the machine, the software and the workspace: COMMFUSE_PDL (the
    kernels' launch) and every NCCL_* variable (NCCL's algorithm, protocol, channels, transports), as rank 0 has
    them: a file measured under other settings is measured again rather than trusted."""
    vers = topo.versions
    return {
        "calibration": CALIBRATION_VERSION, "kernel": jit.sources_digest(), "world": ws.world,
        "nccl_route": nccl_route(nccl),
        "gpus": [r.gpu_name for r in topo.ranks], "p2p": topo.p2p, "nvlink": topo.nvlink,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": vers.nccl if vers else None, "driver": vers.driver if vers else None,
        "workspace_bytes": ws.max_bytes, "lamport_bytes": ws.lamport_bytes, "nblocks": ws.nblocks,
        # as the kernels launch: off by the variable, or for the whole process once ranks shared a GPU in it
        "pdl": env.flag("COMMFUSE_PDL", True) and jit.pdl_off() is None,
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
    }


def calibrate(ws, topo, nccl=None) -> P2PLimits:
    """Measured limits, from the disk cache when this machine and software were measured before.
    nccl: the NCCL route's NcclComm (None: the route runs torch.distributed's all_reduce), timed as the
    route runs it."""
    cause = key = None
    try:
        # JSON round trip: tuples become lists, so the cached key compares equal.
        key = json.loads(json.dumps(cache_key(ws, topo, nccl)))
    except Exception as e:  # noqa: BLE001 - the kernels' digest (NVRTC, the CUDA headers, the sources): every rank
        cause = e  # must hear of it, or a rank alone here leaves its peers in the gather below
    _raise_together(ws.group, cause, "could not start")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = jit.cache_dir() / f"p2p-limits-{digest}.json"
    cached = _read_limits(path, key) if ws.rank == 0 else None
    cached = gather_objects(ws.group, cached)[0]
    if cached is not None:  # the buffers' size is this workspace's, never the file's
        return dataclasses.replace(cached, oneshot_bytes=ws.lamport_bytes)
    sizes, times = measure(ws, nccl=nccl)
    limits = derive_limits(sizes, times, ws.max_bytes, ws.lamport_bytes)
    if ws.rank == 0:
        _write_limits(path, {"key": key, "sizes": sizes, "times_us": times,
                             "columns": [*ALGORITHMS, "nccl"],
                             "limits": {"workspace_bytes": limits.workspace_bytes,
                                        "crossovers": [list(c) for c in limits.crossovers]}})
    return limits


def _raise_together(group, cause: Optional[BaseException], what: str) -> None:
    """Collective: every rank reports its failure (cause, or None); where any rank has one, every rank raises
    CalibrationError naming each, this rank's cause chained."""
    failed = gather_objects(group, None if cause is None else f"{type(cause).__name__}: {cause}")
    if any(failed):
        raise CalibrationError(f"P2P calibration {what}: " + "; ".join(
            f"{rank_label(group, i)}: {f}" for i, f in enumerate(failed) if f)) from cause


def measure(ws, sizes: Optional[Sequence[int]] = None, nccl=None) -> Tuple[List[int], List[List[float]]]:
    """(sizes, times): microseconds per plain bf16 all-reduce of each size in bytes (default
    calibration_sizes(max_bytes)) for (one-shot, two-shot, NCCL), the max over ranks. NCCL as the
    route runs it: nccl (an NcclComm) out of place, or (None) torch.distributed's in-place all_reduce
    of a copy of x. Collective; not allowed during CUDA graph capture."""
    sizes = list(sizes) if sizes is not None else calibration_sizes(ws.max_bytes)
    if any(s % 16 or s <= 0 for s in sizes):
        raise ValueError(f"sizes must be positive multiples of 16 B, got {sizes}")
    # What a rank can fail at alone (memory for the buffers, compiling the kernels) comes first, and the
    # ranks agree on it before the first timed collective.
    cause = None
    try:
        n_max = max(sizes) // 2
        x = torch.zeros(n_max, dtype=torch.bfloat16, device=ws.device)
        out = torch.empty_like(x)  # also NCCL's buffer: only the time is kept
        delay = jit.kernel(SOURCE, DELAY_KERNEL, device=ws.device_index)
        launchers = {size: [ws.plain_launcher((size // 2,), torch.bfloat16, algo) for algo in ALGORITHMS]
                     for size in sizes}
    except Exception as e:  # noqa: BLE001 - whatever it is, every rank must hear of it
        cause = e
    _raise_together(ws.group, cause, "could not start")
    stream = torch.cuda.current_stream(ws.device)
    delay_params = struct.pack("<Q", _CAL_DELAY_NS)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)

    def timed(run, calls: int) -> float:
        run()  # first use: loads kernels, sets NCCL up
        best = math.inf
        for _ in range(_CAL_REPS):
            # The delay holds the stream while Python enqueues the batch; the first call then lines the
            # ranks up (it completes on all ranks together), the rest are timed.
            delay.launch((1, 1, 1), (1, 1, 1), delay_params, 0, stream.cuda_stream)
            run()
            start.record(stream)
            for _ in range(calls):
                run()
            end.record(stream)
            end.synchronize()
            ws.check_error()  # a P2P kernel failed: launch no more (a peer's late kernel returns at once)
            best = min(best, start.elapsed_time(end) * 1e3 / calls)
        return best

    times = []
    for size in sizes:
        n = size // 2
        calls = 8 if size <= 16 << 20 else 3
        # One-shot (the first) takes at most its buffers.
        p2p_runs = [lambda launch=launch: launch(x[:n], out=out[:n]) for launch in launchers[size]]
        p2p_runs = p2p_runs[size > ws.lamport_bytes:]
        # NCCL as the Communicator's NCCL route runs it. Without commfuse.nccl the route copies x first
        # (torch's all_reduce works in place, and x is the caller's): 2 x 112 MiB more HBM traffic at
        # 112 MiB, ~55 us, which would move the crossovers toward P2P where the route has no copy.
        if nccl is not None:
            nccl_run = lambda: nccl.all_reduce(x[:n], out[:n])  # noqa: E731
        else:
            nccl_run = lambda: dist.all_reduce(out[:n].copy_(x[:n]), group=ws.group)  # noqa: E731
        row = []
        # The P2P columns, then NCCL's, each ending where every rank agrees: a rank that failed (a kernel's
        # timeout, an aborted NCCL call) launches nothing more and goes there at once, its peers when their
        # waits for it end (the P2P kernels' timeout, the NCCL watchdog), and all raise together. Without
        # the agreement before NCCL's column, the failed rank's gather would meet a peer's all_reduce.
        for runs in (p2p_runs, [nccl_run]):
            try:
                row += [timed(run, calls) for run in runs]
            except Exception as e:  # noqa: BLE001 - whatever it is, every rank must hear of it
                cause = e
            _raise_together(ws.group, cause, "failed")
        times.append([math.inf] * (len(ALGORITHMS) + 1 - len(row)) + row)
    t = torch.tensor(times, dtype=torch.float64, device=ws.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ws.group)
    return sizes, t.cpu().tolist()
