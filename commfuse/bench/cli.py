"""commfuse-bench's entry point: options, the run (`main`), and the driver over cases and rows
(`run_cases`). What is measured and how: the docstring of commfuse.bench."""
from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import platform
import re
import socket
import statistics
import sys
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from commfuse import env, init_distributed

from . import report
from .cases import (DEFAULT_HIDDEN, DEFAULT_PATTERNS, DEFAULT_TOKENS, DTYPES, MAX_INPUT_SETS, MIN_INPUT_SETS,
                    MOE_COMPILE_PATTERN, MOE_HIDDEN, MOE_QUICK_SHAPES, MOE_TOKENS, PATTERN_GROUPS, PATTERNS,
                    QUICK_COMPILE_PATTERN, QUICK_PATTERNS, QUICK_SHAPES, QUICK_SHAPES_CPU, gate, judge, make_case,
                    same_draws, shapes_of, tail_bytes)
from .context import Ctx
from .impls import DEFAULT_IMPLS, IMPLS
from .timing import MODES, measure_ceilings, time_step
from .verdict import OK, Kind, Skip, Verdict, agree, failed


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:  # the results are written at the end: a folder that cannot take them is said now, on every rank
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        print(f"commfuse-bench: --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:
        timeout = env.seconds("COMMFUSE_BENCH_TIMEOUT", 600.0)
    except ValueError as e:
        print(f"commfuse-bench: {e}", file=sys.stderr)
        return 2
    rank, world = init_distributed(timeout_s=timeout)
    # Every rank must run the same rows: options that differ would pair different collectives (a hang until the
    # timeout) or different draws (every row rejected).
    mine = {k: v for k, v in vars(args).items() if k not in ("out", "machine") and not k.endswith("_list")}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    differ = sorted("--" + k.replace("_", "-") for k in mine if any(e[k] != mine[k] for e in every))
    if differ:
        if rank == 0:
            print(f"commfuse-bench: the ranks were given different options: {', '.join(differ)}", file=sys.stderr)
        return 2
    backend = str(dist.get_backend())
    # CUDA whenever there is a GPU, whatever the backend: ranks sharing a GPU run gloo on CUDA tensors.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    note = None
    if device.type != "cuda":
        note = "CPU/gloo: not GPU numbers"
        args.mode_list = [m for m in args.mode_list if m != "graph"] or ["eager"]  # no CUDA graphs without CUDA
        if args.quick and not args.shapes:
            args.shape_list = list(QUICK_SHAPES_CPU)
            args.moe_shape_list = list(QUICK_SHAPES_CPU)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    ctx = Ctx(args, rank, world, backend, device, flag=torch.zeros(1, device=device))
    if rank == 0:
        print(f"commfuse-bench: {world} ranks over {backend}" + (f" - {note}" if note else "")
              + (f" - {report.SHARED_GPU} (host mode excepted)" if ctx.shared_gpu else ""),
              file=sys.stderr, flush=True)

    ctx.gen_device = same_draws(ctx)
    ceilings, methods = measure_ceilings(ctx)
    records, skipped, status = run_cases(ctx, ceilings)

    if rank == 0:
        gpu = (f"{torch.cuda.get_device_name(device)} (SM {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
               if ctx.cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)")
        k, r = args.calls_per_graph, args.repeats
        doc = {"machine": args.machine, "gpu": gpu, "world_size": world, "versions": report.versions(ctx),
               "ceilings": ceilings, "records": records, "skipped": skipped,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "backend": backend, "shared_gpu": ctx.shared_gpu, "methods": {
                   **methods,
                   "graph": f"{k} calls captured in one CUDA graph, GPU time per call from CUDA events around a "
                            f"replay, median (min, max) of {r} replays; each replay's time is the slowest rank's",
                   "eager": f"{k} back-to-back calls, time per call from "
                            f"{'CUDA events' if ctx.cuda else 'the host clock'} around the loop, median (min, max) "
                            f"of {r} repeats, slowest rank",
                   "host": f"{k} back-to-back calls, host wall time per call (time.perf_counter around the loop "
                           "alone, no GPU wait inside it; synchronised before the start and after the stop), "
                           f"median (min, max) of {r} repeats, slowest rank",
                   "frac_hbm": "tail rows, graph and eager: fewest bytes the tail moves / time / hbm_copy_GBps",
                   "frac_link": "collective rows on 2+ GPUs, graph and eager: bus bandwidth (2(n-1)/n x t x h x "
                                "bytes an element / time) / p2p_GBps",
                   "inputs": f"rotating among {MIN_INPUT_SETS} to {MAX_INPUT_SETS} input sets (2x the last-level "
                             "cache; two at least, for the checks)"},
               "plans": ctx.plans,
               "config": {"shapes": [f"{t}x{h}" for t, h in args.shape_list],
                          "moe_shapes": [f"{t}x{h}" for t, h in args.moe_shape_list], "dtypes": args.dtype_list,
                          "patterns": args.pattern_list, "modes": args.mode_list, "impls": args.impl_list,
                          "repeats": args.repeats, "calls_per_graph": args.calls_per_graph,
                          "warmup": args.warmup, "quick": args.quick, "eps": args.eps, "seed": args.seed}}
        if note:
            doc["note"] = note
        stem = os.path.join(args.out, "bench-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", args.machine))
        report.write_json(stem + ".json", doc)
        pngs = []
        for mode in args.mode_list:
            pngs.append(f"{stem}-{mode}.png")
            report.plot(doc, pngs[-1], mode, args.dtype_list[0])
        print(report.format_table(doc, status, args), flush=True)
        print(f"\nwrote {stem}.json, " + ", ".join(pngs), flush=True)
    if world > 1:
        dist.barrier()
    dist.destroy_process_group()
    # commfuse's own rows must be right: a wrong or failed one fails the run (the others are baselines).
    ours = [k for k, v in status.items() if IMPLS[k[0]].ours and v in (Kind.REJECTED, Kind.FAILED)]
    if ours and rank == 0:
        print(f"commfuse-bench: {len(ours)} of commfuse's own rows were wrong or failed (see 'not run')",
              file=sys.stderr, flush=True)
    return 1 if ours else 0


def run_cases(ctx: Ctx, ceilings: dict) -> Tuple[list, list, dict]:
    """Every case, every implementation: prepare, gate, time. Returns (records, skipped, status);
    status[(impl, pattern, dtype, tokens, hidden, mode)] is the Kind of every row left without a
    record there."""
    args = ctx.args
    records, skipped, status = [], [], {}
    impls = [IMPLS[n] for n in args.impl_list]
    shapes = {p: shapes_of(args, PATTERNS[p]) for p in args.pattern_list}  # the MoE patterns' own defaults
    hiddens = sorted({h for p in args.pattern_list for _, h in shapes[p]})
    cases = [(d, h, p, t) for d in args.dtype_list for h in hiddens for p in args.pattern_list
             for t in sorted({t for t, hh in shapes[p] if hh == h})]

    def not_run(impl, case, verdict: Verdict, modes) -> None:
        for mode in modes:
            status[(impl.name, case.pattern.name, case.dname, case.tokens, case.hidden, mode)] = verdict.kind
        why = verdict.reason
        if verdict.kind is not Kind.SKIP:
            why = f"{verdict.kind.value} ({case.dname} {case.tokens}x{case.hidden}): {why}"
        entry = {"impl": impl.name, "pattern": case.pattern.name, "reason": why}
        if entry not in skipped:
            skipped.append(entry)

    for n, (dname, h, pname, t) in enumerate(cases, 1):
        pattern = PATTERNS[pname]
        case = make_case(ctx, pattern, dname, t, h)
        # Prepare and gate every row first, keeping each gate's outputs alive until all are
        # checked: a row that leaves an output unwritten cannot pick up a correct one from memory
        # another row just freed.
        runnable, kept = [], []
        for impl in impls:
            if impl.section == "tail" and not pattern.tail:
                continue  # the plain all-reduce has no tail
            try:
                step, verdict = impl.prepare(ctx, case), OK
            except Skip as e:
                step, verdict = None, Verdict(Kind.SKIP, str(e))
            except Exception as e:
                step, verdict = None, failed("prepare", e)
            verdict = agree(ctx.world, verdict)
            if verdict.ok:
                verdict, res = gate(ctx, step, functools.partial(impl.mismatch, case, expected=step.expected))
                kept.append(res)
                verdict = agree(ctx.world, verdict)
            if verdict.ok:
                runnable.append((impl, step, None))
                continue
            not_run(impl, case, verdict, args.mode_list)
            if verdict.kind is Kind.REJECTED and impl.timed_if_wrong:
                runnable.append((impl, step, verdict.reason))
        del kept
        line = []
        for impl, step, wrong in runnable:
            mismatch = functools.partial(impl.mismatch, case, expected=step.expected)
            for mode in args.mode_list:
                times, verdict, last, index = time_step(ctx, step, mode, len(case.sets))
                if verdict.ok and wrong is None:
                    verdict = checked_after(ctx, case, step, mode, last, index, mismatch)
                del last
                if not verdict.ok:
                    not_run(impl, case, verdict, [mode])
                    continue
                us = statistics.median(times)
                frac_hbm, frac_link = None, None
                if mode != "host":  # host time is the host's launches, no measure of the memory or the link
                    frac_hbm, frac_link = fractions(impl.section, pattern, t, h, case.dtype.itemsize, ctx.world, us,
                                                    ceilings)
                records.append({"impl": impl.name, "pattern": pname, "dtype": dname, "tokens": t, "hidden": h,
                                "mode": mode, "us": round(us, 3), "us_min": round(min(times), 3),
                                "us_max": round(max(times), 3), "frac_hbm": frac_hbm, "frac_link": frac_link,
                                **({"wrong": wrong} if wrong else {})})
                if mode == args.mode_list[0]:
                    line.append(f"{impl.name} {us:.1f}{'*' if wrong else ''}")
        if ctx.rank == 0:
            print(f"[{n}/{len(cases)}] {pname} {dname} {t}x{h} ({args.mode_list[0]} us): "
                  + (", ".join(line) or "nothing ran"), file=sys.stderr, flush=True)
        del case, runnable
        if ctx.cuda and (n == len(cases) or cases[n][1] != h):
            torch.cuda.empty_cache()
    return records, skipped, status


def checked_after(ctx: Ctx, case, step, mode: str, last, index: int, mismatch) -> Verdict:
    """The last timed call's outputs (a graph's: those its last replay wrote), judged against the oracle of
    its input set (call `index`'s: another than the gate's first, timing.first_call), agreed by all ranks: a row
    right on the gate's calls and wrong on later ones (another call count, another input set, a replay) is
    rejected too."""
    i = index % len(case.sets)

    def judged(returned, j):
        res = step.result(returned)
        if ctx.cuda:
            torch.cuda.synchronize()
        return mismatch(res, j)
    why = judge(judged, last, i)
    verdict = OK if why is None else Verdict(Kind.REJECTED, f"the last timed call ({mode}): {why}")
    return agree(ctx.world, verdict)


def fractions(section: str, pattern, t: int, h: int, itemsize: int, world: int, us: float,
              ceilings: dict) -> Tuple[Optional[float], Optional[float]]:
    """(frac_hbm, frac_link) of a row that took `us` a call, None where they do not apply: a tail row's
    fewest bytes (tail_bytes) over the HBM copy ceiling; a collective row's bus bandwidth over more than
    one rank, 2 (n - 1) / n x the all-reduced t x h elements a call (nccl-tests' count), over the P2P copy
    ceiling (one direction; measured only where rank 0 sees a peer GPU)."""
    hbm, link = ceilings.get("hbm_copy_GBps"), ceilings.get("p2p_GBps")
    if us <= 0:
        return None, None
    if section == "tail" and hbm:
        return round(tail_bytes(pattern, t, h, itemsize) / (us * 1e-6) / (hbm * 1e9), 4), None
    if section == "collective" and link and world > 1:
        return None, round(2 * (world - 1) / world * t * h * itemsize / (us * 1e-6) / (link * 1e9), 4)
    return None, None


# ------------------------------------------------------------------------------------------ options

def _csv(s: str) -> List[str]:
    return [v.strip() for v in s.split(",") if v.strip()]


def _shapes(s: str) -> List[Tuple[int, int]]:
    out = []
    for v in _csv(s):
        m = re.fullmatch(r"(\d+)[xX](\d+)", v)
        if not m:
            raise argparse.ArgumentTypeError(f"shape {v!r} is not TOKENSxHIDDEN, e.g. 64x8192")
        t, h = int(m[1]), int(m[2])
        if t < 1 or h < 8 or h % 8:
            raise argparse.ArgumentTypeError(f"shape {v!r}: tokens >= 1 and hidden a multiple of 8 (the tail's "
                                             "16-byte rows)")
        out.append((t, h))
    return out


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="commfuse-bench",
        description="Side-by-side benchmark of the all-reduce tail: commfuse, NCCL + torch tails, FlashInfer. "
                    "Run one process per GPU under mpirun or torchrun (launch/bench.sh N).")
    ap.add_argument("--shapes", type=_shapes, default=None,
                    help="TOKENSxHIDDEN list, e.g. 1x4096,64x8192, for every pattern (default: tokens "
                         f"{','.join(map(str, DEFAULT_TOKENS))} x hidden {','.join(map(str, DEFAULT_HIDDEN))}; "
                         f"the MoE patterns tokens {','.join(map(str, MOE_TOKENS))} x hidden "
                         f"{','.join(map(str, MOE_HIDDEN))})")
    ap.add_argument("--dtypes", type=_csv, default=None, help="bf16,fp16 (default both)")
    ap.add_argument("--patterns", type=_csv, default=None,
                    help=f"of {','.join(PATTERNS)}, or a group: "
                         + "; ".join(f"{g} = {','.join(ps)}" for g, ps in PATTERN_GROUPS.items())
                         + f" (default {','.join(DEFAULT_PATTERNS)})")
    ap.add_argument("--modes", type=_csv, default=None,
                    help=f"of {','.join(MODES)} (default graph,eager; no graph on the CPU)")
    ap.add_argument("--impls", type=_csv, default=None, help=f"default all: {','.join(DEFAULT_IMPLS)}")
    ap.add_argument("--out", default="commfuse-bench-out",
                    help="folder for the JSON and PNG files (default ./commfuse-bench-out)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: shapes " + ",".join(f"{t}x{h}" for t, h in QUICK_SHAPES) + ", bf16, patterns "
                         + ",".join(QUICK_PATTERNS) + f", torch.compile only for {QUICK_COMPILE_PATTERN} and "
                         f"{MOE_COMPILE_PATTERN}, MoE shapes "
                         + ",".join(f"{t}x{h}" for t, h in MOE_QUICK_SHAPES) + ", "
                         "5 repeats of 10 calls (explicit options override)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per row (default 10, --quick 5)")
    ap.add_argument("--calls-per-graph", type=int, default=None,
                    help="calls captured in one graph, and back-to-back calls per eager or host repeat "
                         "(default 20, --quick 10)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 3, --quick 2)")
    ap.add_argument("--compile-all", action="store_true",
                    help="with --quick, still run the torch.compile rows for every pattern (on the CPU too)")
    ap.add_argument("--eps", type=float, default=1e-6, help="RMSNorm epsilon")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    ap.add_argument("--machine", default=os.environ.get("COMMFUSE_MACHINE") or socket.gethostname(),
                    help="machine name in the results (default $COMMFUSE_MACHINE or the host name)")
    args = ap.parse_args(argv)
    for name in ("shapes", "dtypes", "patterns", "modes", "impls"):
        given = getattr(args, name)
        if given is not None and not given:
            ap.error(f"--{name} lists nothing")
        if given is not None:  # each once: a repeated entry would only repeat its rows
            setattr(args, name, list(dict.fromkeys(given)))
    if not (math.isfinite(args.eps) and args.eps >= 0):
        ap.error(f"--eps must be a finite number >= 0, got {args.eps}")
    # Each commfuse row names what it runs: these would run another under its name (any strategy overrides the
    # rows' own, "auto" the forced ones'; the switches only at "1", the value they read).
    for name in ("COMMFUSE_STRATEGY", "COMMFUSE_DISABLE_FUSION", "COMMFUSE_PRETEND_NO_P2P"):
        value = os.environ.get(name)
        if value and (name == "COMMFUSE_STRATEGY" or value == "1"):
            ap.error(f"{name} is set ({value!r}): it would override what every commfuse row runs "
                     "(its strategy, its fused tail, its topology); unset it")
    if not args.machine.strip() or "/" in args.machine:
        ap.error(f"--machine must name the machine (it names the result files), got {args.machine!r}")
    q = args.quick
    args.shape_list = args.shapes or (list(QUICK_SHAPES) if q else [(t, h) for h in DEFAULT_HIDDEN for t in DEFAULT_TOKENS])
    args.moe_shape_list = args.shapes or (list(MOE_QUICK_SHAPES) if q else
                                          [(t, h) for h in MOE_HIDDEN for t in MOE_TOKENS])
    args.dtype_list = args.dtypes or (["bf16"] if q else list(DTYPES))
    patterns = [g for p in (args.patterns or []) for g in PATTERN_GROUPS.get(p, (p,))]
    args.pattern_list = list(dict.fromkeys(patterns)) or list(QUICK_PATTERNS if q else DEFAULT_PATTERNS)
    args.mode_list = args.modes or ["graph", "eager"]
    args.impl_list = args.impls or list(DEFAULT_IMPLS)
    args.repeats = args.repeats if args.repeats is not None else (5 if q else 10)
    args.calls_per_graph = args.calls_per_graph if args.calls_per_graph is not None else (10 if q else 20)
    args.warmup = args.warmup if args.warmup is not None else (2 if q else 3)
    for what, got, known in (("dtype", args.dtype_list, DTYPES), ("pattern", args.pattern_list, PATTERNS),
                             ("mode", args.mode_list, MODES), ("impl", args.impl_list, IMPLS)):
        bad = [v for v in got if v not in known]
        if bad:
            ap.error(f"unknown {what} {bad}; known: {', '.join(known)}")
    if min(args.repeats, args.calls_per_graph) < 1 or args.warmup < 0:
        ap.error("--repeats and --calls-per-graph must be >= 1, --warmup >= 0")
    for p in args.pattern_list:  # each shape must be one the pattern's format can take
        multiple = PATTERNS[p].spec.hidden_multiple
        bad = [f"{t}x{h}" for t, h in (args.moe_shape_list if PATTERNS[p].is_moe else args.shape_list) if h % multiple]
        if bad:
            ap.error(f"pattern {p} needs a hidden size that is a multiple of {multiple}, got {', '.join(bad)}")
    return args
