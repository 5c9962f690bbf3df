"""The NCCL watchdog's marks for captured all-reduces (csrc/nccl_mark.cu; commfuse/nccl.py uses them).

A CUDA graph replays what was captured: an eager call's host stamp and the number the stream writes
after it (cuStreamWriteValue64 of a constant) would repeat unchanged in every replay. So around an
all-reduce being captured the launcher puts two one-thread kernels: the begin mark adds one to a count
in device memory and writes it to the watchdog's BEGUN word, the end mark writes the count to ENDED.
A replay stalled in its all-reduce leaves BEGUN ahead of ENDED, which the watchdog times.

    kernel = nccl_mark.load(device_index)
    begin, end = nccl_mark.mark_params(count_address, begun_address, ended_address)   # the launches' bytes
    kernel.launch((1, 1, 1), (nccl_mark.THREADS, 1, 1), begin, stream=s)   # before ncclAllReduce; end after
"""
from __future__ import annotations

from typing import List, Tuple

from . import jit, params

__all__ = ["SOURCE", "NAME", "THREADS", "variants", "load", "mark_params"]

SOURCE = "nccl_mark.cu"
NAME = "commfuse::nccl_mark"
THREADS = 32  # one warp; one thread writes


def variants() -> List[str]:
    """Every name expression of the source (the CPU build test compiles them all)."""
    return [NAME]


def load(device_index: int) -> jit.Kernel:
    """The mark kernel, compiled (cached on disk) and loaded on cuda:device_index."""
    return jit.kernel(SOURCE, NAME, device=device_index)


def mark_params(count: int, begun: int, ended: int) -> Tuple[bytes, bytes]:
    """The parameter bytes of the begin and the end mark: count, the device address of an 8-byte count in
    device memory; begun, ended: the device addresses of the watchdog's host-mapped words."""
    return params.NCCL_MARK.pack(count, begun, 0), params.NCCL_MARK.pack(count, begun, ended)
