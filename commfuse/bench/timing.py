"""The timing core: ranks aligned before every repeat, three ways of timing K calls, the ceilings.

graph: K calls captured in one CUDA graph, replayed R times, GPU time per call from CUDA events.
eager: K back-to-back calls from Python, CUDA events around the loop (the GPU's time, which the
       host's launches pace when they are slower than the kernels).
host:  K back-to-back calls from Python, the host clock around the loop alone, no GPU wait inside:
       what an eager caller pays on the host per call. On the CPU eager is timed this way too.
Each repeat's time is the slowest rank's; the caller reports the median of R repeats, min and max.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .context import Ctx
from .impls import Step
from .verdict import OK, Kind, Verdict, agree, failed

MODES = ("graph", "eager", "host")
SLEEP_CYCLES = 200_000  # ~0.1 ms GPU spin before a timed graph replay, so the host is ahead


def _align(ctx: Ctx, sleep: bool = False) -> None:
    """Start a timed region on every rank together: an all-reduce the host waits for (gloo's on the
    CPU blocks; on a GPU the synchronize waits for it), then (sleep, graph mode) a GPU spin so the
    host has queued the whole region before the GPU reaches it, then an all-reduce on the GPU right
    before the start event (all GPUs leave it together)."""
    if ctx.world > 1:
        dist.all_reduce(ctx.flag)
    if not ctx.cuda:
        return
    torch.cuda.synchronize()
    if sleep:
        torch.cuda._sleep(SLEEP_CYCLES)
    if ctx.world > 1:
        dist.all_reduce(ctx.flag)


def _sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def first_call(ctx: Ctx, sets: int, calls: int) -> int:
    """The index of the first timed call of `calls` in a row: the rotation over the input sets goes on after the
    warm-up's calls (0 .. warmup - 1), and the last call lands on a set other than 0 where there are several, so
    that the check after the timing reads another set than the gate's first."""
    first = ctx.args.warmup
    return first + 1 if sets > 1 and (first + calls - 1) % sets == 0 else first


def _capture(ctx: Ctx, call: Callable[[int], object], first: int,
             poison: Optional[Callable[[], None]] = None) -> Tuple["torch.cuda.CUDAGraph", object]:
    """Warm up, then capture K calls in one CUDA graph (calls first .. first + K - 1: rotating over the input sets).
    Returns the graph and what its last call returned: its outputs, which each replay writes again (kept for the
    check after). poison: fills the row's caller-owned outputs after the warm-up (Step.poison)."""
    side = torch.cuda.Stream()  # warm-up before capture on a side stream, as torch.cuda.graphs advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(ctx.args.warmup):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    if poison is not None:  # what the gate's or the warm-up's calls wrote must not pass for the replays' outputs
        poison()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA calls of other threads (NCCL's watchdog) must not invalidate our capture.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(first, first + ctx.args.calls_per_graph):
            last = call(i)
    torch.cuda.synchronize()
    return graph, last


def _time_graph(ctx: Ctx, graph: "torch.cuda.CUDAGraph") -> List[float]:
    """GPU time per call (us) of the captured graph, replayed R times, each replay started on all
    GPUs together."""
    graph.replay()  # the first replay uploads the graph
    times = []
    for _ in range(ctx.args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _align(ctx, sleep=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / ctx.args.calls_per_graph)
    return times


def _time_loop(ctx: Ctx, call: Callable[[int], object], events: bool, first: int,
               poison: Optional[Callable[[], None]] = None) -> Tuple[List[float], object]:
    """Time per call (us) of K back-to-back calls from Python, each repeat started on all ranks
    together, and what the last call returned. The repeats' calls are first, first + 1, ...: each goes on
    with the rotation over the input sets where the last left it. events: CUDA events around the loop (eager on a GPU).
    Otherwise the host clock around the loop alone: the GPU is idle when the clock starts, and the stop
    time is read before the synchronize that keeps this repeat's queued work out of the next one.
    poison: fills the row's caller-owned outputs after the warm-up (Step.poison)."""
    k = ctx.args.calls_per_graph
    for i in range(ctx.args.warmup):
        call(i)
    if poison is not None:  # what the gate's or the warm-up's calls wrote must not pass for the timed calls' outputs
        poison()
    times, last = [], None
    for r in range(ctx.args.repeats):
        calls = range(first + r * k, first + (r + 1) * k)
        _align(ctx)
        if events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in calls:
                last = call(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / k)
        else:
            _sync(ctx)
            t0 = time.perf_counter()
            for i in calls:
                last = call(i)
            t1 = time.perf_counter()
            _sync(ctx)
            times.append((t1 - t0) * 1e6 / k)
    return times, last


def _max_over_ranks(ctx: Ctx, times: Sequence[float]) -> List[float]:
    """Each repeat's time as the slowest rank saw it."""
    t = torch.tensor(list(times), dtype=torch.float64, device=ctx.device)
    if ctx.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_step(ctx: Ctx, step: Step, mode: str, sets: int) -> Tuple[Optional[List[float]], Verdict, object, int]:
    """(per-repeat us, slowest rank's, OK, what the last timed call returned: its outputs, for the check
    after the timing, and that call's index: its input set modulo `sets`) or (None, why not, agreed by all
    ranks, None, that index). Ranks agree after the capture, before any replay: a graph holding collectives
    must be replayed on every rank or none."""
    last = None
    k = ctx.args.calls_per_graph
    calls = k if mode == "graph" else k * ctx.args.repeats
    first = first_call(ctx, sets, calls)
    index = first + calls - 1
    if mode == "graph":
        graph, verdict = None, OK
        if step.no_graph:
            verdict = Verdict(Kind.SKIP, f"graph mode: {step.no_graph}")
        else:
            try:
                graph, last = _capture(ctx, step.call, first, step.poison)
            except Exception as e:
                verdict = failed("graph capture", e)
        verdict = agree(ctx.world, verdict)
        if not verdict.ok:
            return None, verdict, None, index
        run = lambda: (_time_graph(ctx, graph), last)
    else:
        run = lambda: _time_loop(ctx, step.call, events=ctx.cuda and mode == "eager", first=first, poison=step.poison)
    times, verdict = None, OK
    try:
        times, last = run()
    except Exception as e:
        verdict = failed(f"{mode} timing", e)
    verdict = agree(ctx.world, verdict)
    return (_max_over_ranks(ctx, times), OK, last, index) if verdict.ok else (None, verdict, None, index)


# ------------------------------------------------------------------------------------- ceilings

def median_interval(values: Sequence[float], level: float = 0.95) -> Tuple[float, float, float]:
    """(low, high, coverage): a distribution-free interval for the median of `values`, the order statistics
    x_(j) and x_(n+1-j) for the largest j whose Binomial(n, 1/2) tail P(B < j) is at most (1 - level) / 2, and
    the probability that it holds the median, 1 - 2 P(B < j): at least `level`. Too few values for any such j
    (n < 6 at 95%): their whole range, whose coverage, 1 - 2^(1-n), is below `level` (75% of 3 values)."""
    v, n = sorted(values), len(values)
    if n == 0:
        raise ValueError("median_interval needs at least one value")
    below, j = 0.0, 0
    while j < n and below + math.comb(n, j) / 2 ** n <= (1 - level) / 2:
        below += math.comb(n, j) / 2 ** n
        j += 1
    if j == 0:
        j, below = 1, 1 / 2 ** n
    return v[j - 1], v[n - j], 1 - 2 * below


def _median_time(ctx: Ctx, fn: Callable, reps: int, collective: bool = False) -> float:
    """Median seconds of fn() on this rank (device events on a GPU). collective: fn is a collective,
    start it on all GPUs together (_align); otherwise no rank waits for another."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if collective:
                _align(ctx, sleep=True)
            else:
                torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_GBps(ctx: Ctx, nbytes: int, to: torch.device, reps: int = 10) -> float:
    """Bytes per second (GB/s) of copying nbytes from this rank's device to `to` (bytes once)."""
    src = torch.randn(nbytes // 4, device=ctx.device)
    dst = torch.empty(nbytes // 4, device=to)
    return nbytes / _median_time(ctx, lambda: dst.copy_(src, non_blocking=True), reps) / 1e9


def _nccl_busbw_GBps(ctx: Ctx, nbytes: int, reps: int = 5) -> float:
    """NCCL all-reduce bus bandwidth, nccl-tests convention: 2 (n-1)/n x bytes / time."""
    buf = torch.randn(nbytes // 2, device=ctx.device).to(torch.bfloat16)
    t = _max_over_ranks(ctx, [_median_time(ctx, lambda: dist.all_reduce(buf), reps, collective=True)])[0]
    return 2 * (ctx.world - 1) / ctx.world * nbytes / t / 1e9


def measure_ceilings(ctx: Ctx) -> Tuple[dict, dict]:
    """(ceilings in GB/s, how each was measured), measured in the same run as the rows.

    hbm_copy_GBps: a large copy on every rank at once (bytes read + written), the slowest rank's.
    p2p_GBps: rank 0 copies 256 MiB from its GPU into a buffer on the next GPU it can see, in one
    process (cudaMemcpy between peers through torch: the copy engines over NVLink), one direction.
    nccl_busbw_GBps: dist.all_reduce of 256 MiB, what the NCCL rows' collective can reach.
    """
    methods = {}
    nbytes = (256 << 20) if ctx.args.quick or not ctx.cuda else (1 << 30)
    # 2x: every byte is read and written; min over ranks = -max(-x): the slowest rank's bandwidth.
    hbm = -_max_over_ranks(ctx, [-2 * _copy_GBps(ctx, nbytes, ctx.device)])[0]
    methods["hbm_copy_GBps"] = (f"{'device-to-device' if ctx.cuda else 'host memory'} copy of "
                                f"{nbytes >> 20} MiB, bytes read + written / median time, slowest rank")
    busbw = None
    if ctx.shared_gpu:
        methods["nccl_busbw_GBps"] = "not measured: ranks share GPUs (gloo, no NCCL)"
    elif ctx.cuda and ctx.world > 1:
        busbw = _nccl_busbw_GBps(ctx, 256 << 20)
        methods["nccl_busbw_GBps"] = "dist.all_reduce of 256 MiB bf16, 2(n-1)/n x bytes / median time"
    p2p, methods["p2p_GBps"] = None, "no GPU"
    if ctx.cuda:
        if ctx.rank == 0:
            p2p, methods["p2p_GBps"] = _p2p_copy(ctx)
        if ctx.world > 1:
            dist.all_reduce(ctx.flag)  # the other ranks wait here, idle, while rank 0 copies
    r = lambda v: None if v is None else round(v, 1)
    return {"hbm_copy_GBps": r(hbm), "p2p_GBps": r(p2p), "nccl_busbw_GBps": r(busbw)}, methods


def _p2p_copy(ctx: Ctx) -> Tuple[Optional[float], str]:
    """(GB/s, how) of this process copying from its GPU to the next visible one; None when it cannot."""
    me, count = ctx.device.index, torch.cuda.device_count()
    if count < 2:
        return None, "rank 0 sees one GPU: P2P copy not measured"
    peer = (me + 1) % count
    if not torch.cuda.can_device_access_peer(me, peer):
        return None, f"GPU {me} cannot access GPU {peer} as a peer: not measured"
    gbps = _copy_GBps(ctx, 256 << 20, torch.device("cuda", peer))
    with torch.cuda.device(peer):
        torch.cuda.empty_cache()
    return gbps, f"GPU {me} -> GPU {peer}: copy of 256 MiB in one process (copy engines), bytes / median time"
