"""Where each P2P algorithm wins: the one-shot / two-shot / NCCL crossovers that strategy "auto"
uses, measured on the machine at workspace creation (before any CUDA graph capture) and cached on
disk. See the package docstring for what is measured and how the limits follow.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import jit
from ..distributed import gather_objects
from ..plan import P2PLimits
from .kernels import DELAY_KERNEL, SOURCE

DEFAULT_ONESHOT_MAX = 512 << 10   # without calibration
CALIBRATION_VERSION = 3
_CAL_REPS = 3
_CAL_DELAY_NS = 1_000_000         # covers the host's enqueueing of one timed batch


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




def cache_key(ws, topo) -> dict:
    vers = topo.versions
    return {
        "calibration": CALIBRATION_VERSION, "kernel": _source_digest(), "world": ws.world,
        "gpus": [r.gpu_name for r in topo.ranks], "p2p": topo.p2p, "nvlink": topo.nvlink,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": vers.nccl if vers else None, "driver": vers.driver if vers else None,
        "workspace_bytes": ws.max_bytes, "lamport_bytes": ws.lamport_bytes, "nblocks": ws.nblocks,
    }

def calibrate(ws, topo) -> P2PLimits:
    """Measured limits, from the disk cache when this machine and software were measured before."""
    key = cache_key(ws, topo)
    # JSON round trip: tuples become lists, so the cached key compares equal.
    key = json.loads(json.dumps(key))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = jit._cache_dir() / f"p2p-limits-{digest}.json"
    cached = _read_limits(path, key) if ws.rank == 0 else None
    cached = gather_objects(ws.group, cached)[0]
    if cached is not None:  # the buffers' size is this workspace's, never the file's
        return dataclasses.replace(cached, oneshot_bytes=ws.lamport_bytes)
    sizes, times = measure(ws)
    limits = derive_limits(sizes, times, ws.max_bytes, ws.lamport_bytes)
    if ws.rank == 0:
        _write_limits(path, {"key": key, "sizes": sizes, "times_us": times,
                             "columns": ["oneshot", "twoshot", "nccl"],
                             "limits": {"workspace_bytes": limits.workspace_bytes,
                                        "oneshot_max": limits.oneshot_max,
                                        "twoshot_max": limits.twoshot_max}})
    return limits

def measure(ws, sizes: Optional[Sequence[int]] = None) -> Tuple[List[int], List[List[float]]]:
    """(sizes, times): microseconds per plain bf16 all-reduce of each size in bytes (default
    calibration_sizes(max_bytes)) for (one-shot, two-shot, NCCL), the max over ranks.
    Collective; not allowed during CUDA graph capture."""
    sizes = list(sizes) if sizes is not None else calibration_sizes(ws.max_bytes)
    if any(s % 16 or s <= 0 for s in sizes):
        raise ValueError(f"sizes must be positive multiples of 16 B, got {sizes}")
    n_max = max(sizes) // 2
    x = torch.zeros(n_max, dtype=torch.bfloat16, device=ws.device)
    out = torch.empty_like(x)  # also NCCL's buffer: only the time is kept
    stream = torch.cuda.current_stream(ws.device)
    delay = jit.kernel(SOURCE, DELAY_KERNEL, device=ws._index)
    delay_params = struct.pack("<Q", _CAL_DELAY_NS)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for size in sizes:
        n = size // 2
        # NCCL as the Communicator's NCCL route runs it: torch's all_reduce works in place, so the
        # route copies x first (x is the caller's): 2 x 112 MiB of HBM traffic at 112 MiB, ~55 us.
        runs = (lambda: ws._launch_plain(x[:n], out[:n], "oneshot"),
                lambda: ws._launch_plain(x[:n], out[:n], "twoshot"),
                lambda: dist.all_reduce(out[:n].copy_(x[:n]), group=ws.group))
        calls = 8 if size <= 16 << 20 else 3
        row = []
        for run in runs[size > ws.lamport_bytes:]:
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
    torch.cuda.synchronize(ws.device)
    codes = gather_objects(ws.group, ws._error_code())
    if any(codes):
        ws.check_error()
        raise RuntimeError(f"P2P calibration: a kernel timed out on rank(s) "
                           f"{[i for i, c in enumerate(codes) if c]}")
    t = torch.tensor(times, dtype=torch.float64, device=ws.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ws.group)
    return sizes, t.cpu().tolist()
