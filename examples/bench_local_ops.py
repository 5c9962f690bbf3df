"""Benchmark rows for the local ops (commfuse.local) against the same computation in torch eager and
torch.compile.

    python examples/bench_local_ops.py                          # GPU: CUDA-graph and eager timings
    python examples/bench_local_ops.py --shapes 16x7168,1024x8192 --json local.json

Rows, per (pattern, tokens x hidden, dtype):
- commfuse: commfuse.fused_add_rmsnorm (with a residual, or without: pattern "rmsnorm") /
  commfuse.gated_rmsnorm (pattern "gated_rmsnorm:G": groups of G) / commfuse.quantize (patterns
  "quantize_fp8", "quantize_nvfp4"; its route is printed: the kernel where the guards hold, else the
  separated ops);
- torch eager: the same tail written in torch as models write it (residual add, HF-style RMSNorm in
  float32 with the weight in float32, FP8 as (n / s).clamp(-448, 448).to(float8_e4m3fn); NVFP4 and the
  gated norm as commfuse.reference's fused_tail / gated_rmsnorm compute them);
- torch.compile: that torch function through torch.compile (inductor on CUDA, --compile-backend).

On CUDA each timed row also has its share of the run's HBM copy ceiling ("of copy": the fewest bytes the op
moves, each input read once and each output written once, per second, over a 1 GiB device copy's bytes read and
written per second, measured first in the same run).

Correct before fast: every row is first compared with commfuse.reference (commfuse.tolerance's
tolerances) on two calls (commfuse's first plans the signature, the second runs from the plan table, as
the timed calls do), and after the timing on the last timed call of each mode; a row that misses gets no
time, only the reason. Times are microseconds per call: on CUDA
the GPU time of K calls captured in one CUDA graph ("graph"; a GPU spin before each replay keeps the
graph's launch out of it) and of K back-to-back Python calls
("eager"), median of R repeats; without CUDA the host's wall time (a test of the script, not a
measurement worth reporting). With --paired N, commfuse and torch.compile are also timed against each
other in N interleaved rounds (paired_us): the median of the rounds' ratios and its 95% interval say
whether a gap of a few percent between the two columns is a difference or the run's drift.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import commfuse  # noqa: E402
from commfuse import local, reference, tolerance  # noqa: E402
from commfuse.reference import Tail  # noqa: E402
from commfuse.bench.timing import SLEEP_CYCLES, median_interval  # noqa: E402

# gated_rmsnorm:G normalises groups of G elements (gated_rmsnorm alone: 128, or h where 128 does not divide it).
PATTERNS = ("add_rmsnorm", "add_rmsnorm_fp8", "add_rmsnorm_nvfp4", "rmsnorm", "gated_rmsnorm", "quantize_fp8",
            "quantize_nvfp4")
SCALES = {"fp8": 0.02, "nvfp4": 0.004}


def _us(v: float) -> str:
    """A time in us with 3 significant digits (2.05, 18.5, 133): at decode sizes 0.1 us is 5%."""
    return f"{v:#.3g}" if v < 100 else f"{v:.0f}"


def torch_tail(x, residual, weight, eps, quant, scale):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    if residual is None:
        return (n,)
    if quant == "fp8":
        return h, (n.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    if quant == "nvfp4":
        q, sf = reference.quantize_nvfp4(n, scale)
        return h, q, sf
    return h, n


def torch_quantize(x, quant, scale):
    """The quantization alone as torch code writes it: FP8 as in torch_tail, NVFP4 as the reference."""
    if quant == "fp8":
        return ((x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn),)
    return reference.quantize_nvfp4(x, scale)


def moved_bytes(inputs, outputs) -> int:
    """The fewest bytes a kernel moves: each input read once and each output written once."""
    return sum(v.numel() * v.element_size() for v in (*inputs, *outputs) if v is not None)


def make_case(pattern, t, h, dtype, device, gen):
    """(ours, theirs, want, route, quant, inputs, tol): the calls, the reference outputs, commfuse's route, the
    format, the tensors the op reads (for moved_bytes), and check's norm and scale (a tail's reference norm and
    dequant scale: the codes of a block whose scale factor differs from the reference's are judged by them)."""
    x = torch.randn(t, h, generator=gen).to(dtype).to(device)
    r = torch.randn(t, h, generator=gen).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).to(device)
    quant = {"add_rmsnorm_fp8": "fp8", "add_rmsnorm_nvfp4": "nvfp4", "quantize_fp8": "fp8",
             "quantize_nvfp4": "nvfp4"}.get(pattern)
    scale = torch.tensor([SCALES[quant]], device=device) if quant else None
    if pattern.startswith("quantize_"):
        ours = lambda: commfuse.quantize(x, quant, scale)  # noqa: E731
        theirs = lambda: torch_quantize(x, quant, scale)  # noqa: E731
        want = tuple(v for v in reference.quantize(x, quant, scale) if v is not None)
        route = "; ".join(s.strip(" -") for s in str(local.plan_quantize(x, quant, scale)).splitlines())
        return ours, theirs, want, route, quant, (x, scale), {}
    if pattern.startswith("gated_rmsnorm"):
        group = int(pattern.split(":")[1]) if ":" in pattern else 128 if h % 128 == 0 else h
        ours = lambda: commfuse.gated_rmsnorm(x, r, w, 1e-5, group, False)  # noqa: E731
        theirs = lambda: (reference.gated_rmsnorm(x, r, w, 1e-5, group, False),)  # noqa: E731
        want = theirs()
        route = "; ".join(s.strip(" -") for s in str(local.plan_gated(x, r, w, 1e-5, group, False)).splitlines())
        return ours, theirs, want, route, None, (x, r, w), {}
    if pattern == "rmsnorm":  # no residual: the RMSNorm of x itself
        r = None
    ours = lambda: commfuse.fused_add_rmsnorm(x, r, w, 1e-5, quant=quant, scale=scale)  # noqa: E731
    route = "; ".join(s.strip(" -") for s in str(local.plan(x, r, w, 1e-5, quant=quant, scale=scale)).splitlines())
    want = reference.fused_tail(x, r, w, 1e-5, quant, scale) if r is not None else (reference.rmsnorm(x, w, 1e-5),)
    theirs = lambda: torch_tail(x, r, w, 1e-5, quant, scale)  # noqa: E731
    tol = dict(norm=reference.fused_tail(x, r, w, 1e-5).norm, scale=scale)
    return ours, theirs, tuple(v for v in want if v is not None), route, quant, (x, r, w, scale), tol


def outputs(result) -> tuple:
    """The tensors of a call's result as the reference gives them: a Tail's residual, norm, codes and scale
    factors, or a tuple's, without the Nones. Taken here, outside the timed calls: commfuse's column returns the
    library's result as it is, so that its host time holds no harness wrapper the torch columns do not."""
    fields = (result.residual, result.norm, result.quant, result.scale_factors) if isinstance(result, Tail) else result
    return tuple(v for v in fields if v is not None)


def check(got, want, quant, pattern="", norm=None, scale=None) -> str:
    got = outputs(got)
    if len(got) != len(want):
        return f"{len(got)} outputs, the reference has {len(want)}"
    if pattern.startswith("quantize_"):  # the kernel gives the reference's bits
        for g, w in zip(got, want):
            if g.shape != w.shape or not torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)):
                return "codes or scale factors differ from reference.quantize"
        return ""
    if quant is None or len(want) == 1:
        for g, w in zip(got, want):
            why = tolerance.within_ulp(g, w, 1, "output")
            if why:
                return why
        return ""
    t = reference.Tail(got[0], None, got[1], got[2] if quant == "nvfp4" else None)
    w = reference.Tail(want[0], None, want[1], want[2] if quant == "nvfp4" else None)
    return tolerance.tail_mismatch(t, w, quant, norm=norm, scale=scale) or ""


def copy_ceiling_GBps(device, repeats: int, nbytes: int = 1 << 30) -> float:
    """The HBM copy ceiling of this run: a device-to-device copy of nbytes, bytes read + written per second
    (GB/s) from its eager time (time_us). Not the graph time: captured into a CUDA graph the copy becomes a
    memcpy node that the copy engines run (2.8 TB/s on an H200), while eager it is a kernel (4.2 TB/s)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), True, 5, repeats)["eager"]
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (us * 1e3)


def _graph(fn, calls: int):
    """(graph, outputs): `calls` calls of fn captured in one CUDA graph (after a call on a side stream, as
    capture wants), and what its last call returned (the buffers its replays write)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(calls):
            last = fn()
    return g, last


def _elapsed_us(run, cuda: bool, spin: bool = False) -> float:
    """The time of run(): CUDA events around it on a GPU, the host's wall clock without one. spin (a graph's
    replay): a GPU spin first, so that the replay is queued before the start event fires and its launch
    latency stays out of the time (as commfuse.bench.timing does)."""
    if not cuda:
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if spin:
        torch.cuda._sleep(SLEEP_CYCLES)
    s.record()
    run()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3


def time_us(fn, cuda: bool, calls: int, repeats: int, timed: Optional[list] = None) -> dict:
    """us per call of fn: {"graph", "eager"} on a GPU (median of `repeats` graph replays / loops of `calls`
    calls), {"host"} on the CPU. timed: gets what the last call of each timed mode returned (a graph's
    outputs, which its replays wrote), for the check after the timing."""
    timed = [] if timed is None else timed
    for _ in range(3):
        fn()
    out = {}
    last = None

    def loop():
        nonlocal last
        for _ in range(calls):
            last = fn()
    if cuda:
        torch.cuda.synchronize()
        try:
            g, graph_last = _graph(fn, calls)
            timed.append(graph_last)
            g.replay()
            out["graph"] = statistics.median(_elapsed_us(g.replay, True, True) / calls for _ in range(repeats))
        except Exception as ex:  # noqa: BLE001 - a row that cannot be captured is reported so
            out["graph_error"] = f"{type(ex).__name__}: {ex}"
    out["eager" if cuda else "host"] = statistics.median(_elapsed_us(loop, cuda) / calls for _ in range(repeats))
    timed.append(last)
    return out


def paired_us(ours, theirs, cuda: bool, calls: int, rounds: int, timed: Optional[list] = None) -> dict:
    """Both ops timed in interleaved rounds: on a GPU each op's `calls` calls captured in one CUDA graph, and
    each round replays both graphs back to back, the order alternating, so that a clock or a machine drifting
    during the run moves both alike (separate blocks of repeats, as time_us's columns are, do not); on the CPU
    each round times both ops' `calls` Python calls the same way. us per call: {"commfuse", "torch.compile"}
    (medians over the rounds); "ratio": the median of the rounds' commfuse / torch.compile, "ratio_ci95": its
    interval (median_interval: their range below 6 rounds), "coverage": the interval's; "rounds". timed: gets
    what both ops' last timed calls returned, for the check after the timing."""
    timed = [] if timed is None else timed
    runs, lasts = [], [None, None]
    for k, fn in enumerate((ours, theirs)):
        if cuda:
            g, lasts[k] = _graph(fn, calls)
            runs.append(g.replay)
        else:
            runs.append(lambda k=k, fn=fn: [lasts.__setitem__(k, fn()) for _ in range(calls)])
    for run in runs:  # a first replay outside the rounds (the graph's upload)
        run()
    times = ([], [])
    for i in range(rounds):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            times[k].append(_elapsed_us(runs[k], cuda, cuda) / calls)
    timed.extend(lasts)
    ratios = [a / b for a, b in zip(*times)]
    low, high, coverage = median_interval(ratios)
    return {"commfuse": statistics.median(times[0]), "torch.compile": statistics.median(times[1]),
            "ratio": statistics.median(ratios), "ratio_ci95": (low, high), "coverage": coverage, "rounds": rounds}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x4096,16x7168,64x8192,256x7168,1024x8192")
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile-backend", default=None, help="default: inductor on CUDA, aot_eager on CPU")
    p.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                   help="also time commfuse against torch.compile in ROUNDS interleaved rounds (paired_us)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for pattern in args.patterns.split(","):
        name, _, group = pattern.partition(":")
        if name not in PATTERNS or (group and (name != "gated_rmsnorm" or not group.isdigit() or int(group) < 1)):
            p.error(f"unknown pattern {pattern!r}: one of {', '.join(PATTERNS)}, or gated_rmsnorm:G (G >= 1)")
    for shape in args.shapes.split(","):
        t, _, h = shape.partition("x")
        if not (t.isdigit() and h.isdigit() and int(t) >= 1 and int(h) >= 8 and int(h) % 8 == 0):
            p.error(f"shape {shape!r} is not TOKENSxHIDDEN with tokens >= 1 and hidden a multiple of 8")
    if any(d not in ("bf16", "fp16") for d in args.dtypes.split(",")):
        p.error(f"--dtypes takes bf16 and fp16, got {args.dtypes!r}")
    if args.calls < 1 or args.repeats < 1 or args.paired < 0:
        p.error("--calls and --repeats must be at least 1, --paired at least 0")
    odd = [shape for shape in args.shapes.split(",") if int(shape.partition("x")[2]) % 16]
    if odd and any(pattern.endswith("nvfp4") for pattern in args.patterns.split(",")):
        p.error(f"the nvfp4 patterns need a hidden size that is a multiple of 16 (one scale per 16 elements), got "
                f"{', '.join(odd)}")
    folder = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):  # said now, not after the rows
        p.error(f"--json {args.json}: {folder} is not a folder this process can write to")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backend = args.compile_backend or ("inductor" if cuda else "aot_eager")
    gen = torch.Generator().manual_seed(0)
    rows = []
    ceiling = copy_ceiling_GBps(device, args.repeats) if cuda else None
    machine = torch.cuda.get_device_name(device) if cuda else "cpu"
    out = {"device": str(device), "machine": machine, "torch": torch.__version__, "cuda": cuda, "backend": backend,
           "hbm_copy_GBps": ceiling, "rows": rows}

    def save():  # after every row: a run cut short by its time limit keeps the rows it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    with torch.inference_mode():
        for dt in args.dtypes.split(","):
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
            for pattern in args.patterns.split(","):
                for shape in args.shapes.split(","):
                    t, h = map(int, shape.split("x"))
                    if pattern.startswith("gated_rmsnorm:") and h % int(pattern.split(":")[1]):
                        print(f"{pattern} {shape}: skipped, the group does not divide the hidden size", flush=True)
                        continue
                    ours, theirs, want, route, quant, inputs, tol = make_case(pattern, t, h, dtype, device, gen)
                    torch._dynamo.reset()
                    compiled = torch.compile(theirs, backend=backend)
                    row = {"pattern": pattern, "shape": shape, "dtype": dt, "route": route,
                           "bytes": moved_bytes(inputs, want)}
                    for name, fn in (("commfuse", ours), ("torch eager", theirs), ("torch.compile", compiled)):
                        # Two calls: commfuse's first plans the signature, the second (as every timed one) runs
                        # from the plan table. Then the last timed call of each mode.
                        why = check(fn(), want, quant, pattern, **tol) or check(fn(), want, quant, pattern, **tol)
                        timed = []
                        row[name] = {"rejected": why} if why else time_us(fn, cuda, args.calls, args.repeats, timed)
                        if cuda:
                            torch.cuda.synchronize()
                        why = next((w for w in (check(r, want, quant, pattern, **tol) for r in timed) if w), "")
                        if why:
                            row[name] = {"rejected": f"the last timed call: {why}"}
                        del timed
                        if ceiling and row[name].get("graph"):
                            row[name]["frac_hbm"] = row["bytes"] / (row[name]["graph"] * 1e3) / ceiling
                    # Rows both of whose columns were timed (on a GPU, a graph each: one whose capture failed has none).
                    timed_key = "graph" if cuda else "host"
                    if args.paired and all(timed_key in row[k] for k in ("commfuse", "torch.compile")):
                        timed = []
                        row["paired"] = paired_us(ours, compiled, cuda, args.calls, args.paired, timed)
                        if cuda:
                            torch.cuda.synchronize()
                        why = next((w for w in (check(r, want, quant, pattern, **tol) for r in timed) if w), "")
                        if why:
                            row["paired"] = {"rejected": f"the last paired call: {why}"}
                        del timed
                    rows.append(row)
                    save()
    key = "graph" if cuda else "host"
    print(f"local ops, us per call ({'GPU time, CUDA graphs' if cuda else 'host wall time: not GPU numbers'}), "
          f"torch.compile backend {backend}" + (f"; HBM copy ceiling {ceiling:.0f} GB/s" if ceiling else ""))
    paired = any("paired" in r for r in rows)
    print("| pattern | tokens x hidden | dtype | commfuse | torch eager | torch.compile | commfuse route |" +
          (" commfuse / torch.compile, paired rounds [95% interval; their range, its coverage, under 6] |"
           if paired else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if paired else ""))
    for r in rows:
        cells = []
        for name in ("commfuse", "torch eager", "torch.compile"):
            v = r[name]
            copy = f"{v['frac_hbm']:.0%} of copy; " if "frac_hbm" in v else ""  # of the graph's time
            failed = f"graph failed: {v['graph_error']}; " if "graph_error" in v else ""
            cells.append(f"rejected: {v['rejected']}" if "rejected" in v else
                         _us(v.get(key, float("nan"))) + (f" ({copy}{failed}eager {v['eager']:.1f})" if cuda else ""))
        v = r.get("paired", {})
        pair = (f" rejected: {v['rejected']} |" if "rejected" in v else
                f" {v['ratio']:.3f} [{v['ratio_ci95'][0]:.3f}, {v['ratio_ci95'][1]:.3f}"
                + ("" if v["coverage"] >= 0.95 else f": {v['coverage']:.0%}") + f"] ({_us(v['commfuse'])} / "
                f"{_us(v['torch.compile'])}, {v['rounds']} rounds) |" if v else " - |") if paired else ""
        print(f"| {r['pattern']} | {r['shape']} | {r['dtype']} | " + " | ".join(cells) + f" | {r['route']} |" + pair)
    save()
    return out


if __name__ == "__main__":
    main()
