"""commfuse-bench: the all-reduce tail, commfuse against what a user would otherwise run, side by side.

Run it under mpirun (launch/bench.sh N) or torchrun, one process per GPU:

    launch/bench.sh 2 --quick --out bench/results

The data path, top-down (nccl-tests style: one small timing core, implementations in a table):

1. `main` parses the options, joins torch.distributed (NCCL with GPUs, gloo on the CPU) and measures
   the ceilings (HBM copy, P2P copy, NCCL bus bandwidth) in the same run.
2. For every case (dtype x hidden x pattern x tokens) `make_case` draws every rank's inputs from one
   seeded generator on each rank, so each rank knows what the gather of all inputs is, and computes
   `commfuse.reference` on it: the oracle.
3. Every implementation in IMPLS is *prepared* for the case (a `step(i)` function running one call on
   input set i, or Skip with the reason), then *gated*: one call on the checked inputs is compared to
   the oracle with DESIGN.md's tolerances. A wrong implementation gets no time, only a row
   "rejected: <why>" ("failed: <why>" when it raised); the exception is the torch.compile baselines
   (Impl.timed_if_wrong), timed anyway and marked as wrong, because the issues' targets name them.
   Ranks agree on every skip, rejection and failure before going on, so no rank is left waiting in a
   collective alone.
4. The survivors are timed (`time_step`): "graph" = K calls captured in one CUDA graph, replayed R
   times, GPU time per call from CUDA events; "eager" = K back-to-back calls, events around the loop
   (what an eager user sees, mostly host overhead). Ranks are aligned before every repeat, each
   repeat's time is the maximum over ranks (what the slowest rank sees); we report the median of R
   repeats with min and max.
5. Rank 0 prints the table and writes JSON and PNG (schema in README.md / `write_json`).

On a machine without GPUs the same code runs over gloo with host timers (eager mode only): a smoke
test of the harness, flagged everywhere as "CPU/gloo: not GPU numbers".
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
import types
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import commfuse
from commfuse import Communicator, init_distributed, reference, tolerance
from commfuse.reference import Tail

# ----------------------------------------------------------------------------------- patterns, shapes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SF_LAYOUT = "swizzled"  # the NVFP4 GEMMs' layout; the linear one is covered by the tests


@dataclass(frozen=True)
class Pattern:
    """One benchmark pattern. tail=False: the plain sum all-reduce."""

    name: str
    quant: Optional[str] = None
    return_norm: bool = False
    tail: bool = True

    @property
    def has_norm(self) -> bool:
        return self.tail and (self.quant is None or self.return_norm)


PATTERNS: Dict[str, Pattern] = {p.name: p for p in (
    Pattern("allreduce", tail=False),
    Pattern("residual_rmsnorm"),
    Pattern("residual_rmsnorm_fp8", "fp8"),
    Pattern("residual_rmsnorm_nvfp4", "nvfp4"),
    Pattern("residual_rmsnorm_fp8_out", "fp8", return_norm=True),
    Pattern("residual_rmsnorm_nvfp4_out", "nvfp4", return_norm=True),
)}
# The dequant scales of the checked inputs (DESIGN.md: value = code * scale); they keep every code
# of the random rows in range, like the tests' inputs.
SCALES = {"fp8": 0.02, "nvfp4": 0.004}

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 8192)
DEFAULT_HIDDEN = (4096, 7168, 8192)
# --quick: one hidden size (torch.compile specialises on it), decode / small prefill / prefill.
QUICK_SHAPES = ((1, 8192), (64, 8192), (1024, 8192))
QUICK_SHAPES_CPU = ((1, 512), (64, 512))  # the CPU smoke run: the harness, not the numbers
QUICK_PATTERNS = ("allreduce", "residual_rmsnorm", "residual_rmsnorm_fp8", "residual_rmsnorm_nvfp4")
QUICK_COMPILE_PATTERN = "residual_rmsnorm_fp8"  # --quick compiles only this one (compile time)

MAX_INPUT_SETS = 8       # rotate among up to this many input sets (cache effects, see make_case)
SLEEP_CYCLES = 200_000   # ~0.1 ms GPU spin before a timed graph replay, so the host is ahead


# ------------------------------------------------------------------------------------------ context

@dataclass
class Ctx:
    """What every implementation and the timing core share for one run."""

    args: argparse.Namespace
    rank: int
    world: int
    backend: str
    device: torch.device
    cache: dict = field(default_factory=dict)   # per-implementation state: communicators, compiled fns
    plans: list = field(default_factory=list)   # the route each commfuse row took
    flag: Optional[torch.Tensor] = None         # one element, for aligning ranks
    gen_device: Optional[torch.device] = None   # where inputs are drawn (see same_draws)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def comm(self, strategy: str) -> Communicator:
        """The Communicator of `strategy`, made once (collectively: every rank prepares the same rows)."""
        key = ("comm", strategy)
        if key not in self.cache:
            try:
                c = self.cache[key] = Communicator(strategy=strategy)
                # The cross-rank call check (COMMFUSE_CHECK=1, on in the test suite) is a host
                # collective per call: it cannot be captured and would be timed.
                c.check_calls = False
            except Exception as e:  # remembered, so every later case skips with the same reason
                self.cache[key] = f"Communicator(strategy={strategy!r}) raised {type(e).__name__}: {e}"
        c = self.cache[key]
        if isinstance(c, str):
            raise Skip(c)
        return c


class Skip(Exception):
    """An implementation does not apply to this case; the message says why."""


def agree(ctx: Ctx, reason: Optional[str]) -> Optional[str]:
    """Every rank's verdict on one step; None only when all ranks are fine. Keeps ranks in lockstep."""
    if ctx.world == 1:
        return reason
    reasons: list = [None] * ctx.world
    dist.all_gather_object(reasons, reason)
    bad = [(r, s) for r, s in enumerate(reasons) if s]
    if not bad:
        return None
    if len({s for _, s in bad}) == 1 and len(bad) == ctx.world:
        return bad[0][1]
    return "; ".join(f"rank {r}: {s}" for r, s in bad)


def verdict_kind(why: str) -> str:
    """"failed" if any rank raised, "skip" if every rank that objected skipped, else "rejected" (a
    wrong result), for a verdict of `agree` (which prefixes differing ranks' verdicts "rank r: ")."""
    if re.search(r"(^|rank \d+: )(prepare )?raised ", why):
        return "failed"
    if why.startswith("skip: ") or (why.startswith("rank ") and not re.search(r"rank \d+: (?!skip: )", why)):
        return "skip"
    return "rejected"


# -------------------------------------------------------------------------------------------- cases

@dataclass
class Result:
    """What one call produced: `a` for the plain all-reduce, else the tail's outputs (DESIGN.md)."""

    a: Optional[torch.Tensor] = None
    residual: Optional[torch.Tensor] = None
    norm: Optional[torch.Tensor] = None
    quant: Optional[torch.Tensor] = None
    sf: Optional[torch.Tensor] = None

    @classmethod
    def of_tail(cls, tail) -> "Result":
        return cls(residual=tail[0], norm=tail[1], quant=tail[2], sf=tail[3])


@dataclass
class Case:
    """One (pattern, dtype, tokens, hidden) with this rank's inputs and the oracle's outputs.

    sets[i] = (x, residual) of input set i; set 0 is the checked one: x = xs[rank].
    expected: the oracle for collective rows (tail of the exact sum of all ranks' x); candidates,
    any of which passes (with NCCL on > 2 ranks also the tail of NCCL's own sum, see make_case).
    expected_tail: the oracle for tail-only rows (tail of this rank's x, no collective).
    """

    pattern: Pattern
    dname: str
    dtype: torch.dtype
    tokens: int
    hidden: int
    sets: list
    weight: torch.Tensor
    scale: Optional[torch.Tensor]
    eps: float
    expected: list
    expected_tail: Optional[Result]
    sum_ulps: int

    def tail_args(self) -> tuple:
        p = self.pattern
        return (self.weight, self.eps, p.quant, self.scale, p.return_norm, SF_LAYOUT)

    def input_set(self, i: int) -> tuple:
        return self.sets[i % len(self.sets)]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _input_sets(ctx: Ctx, t: int, h: int, dtype: torch.dtype) -> int:
    """How many input sets to rotate among so that the inputs of consecutive calls are not all in
    the last-level cache (2 x its size, METHOD.md), capped at MAX_INPUT_SETS. Decode sizes stay
    cache resident even so; in a model they are too (the GEMM that made x has just written it)."""
    if ctx.cuda:
        l2 = getattr(torch.cuda.get_device_properties(ctx.device), "L2_cache_size", 50 << 20)
    else:
        l2 = 32 << 20
    per_set = 2 * t * h * dtype.itemsize
    return max(1, min(MAX_INPUT_SETS, math.ceil(2 * l2 / per_set)))


def same_draws(ctx: Ctx) -> torch.device:
    """Where to draw inputs: on the GPU (fast) when a seeded generator gives every rank the same
    numbers there (identical GPUs), else on the CPU. Checked once, bit for bit."""
    if not ctx.cuda:
        return ctx.device
    g = torch.Generator(device=ctx.device).manual_seed(12345)
    bits = torch.randn(1 << 20, generator=g, device=ctx.device).view(torch.int32).sum(dtype=torch.int64).view(1)
    lo, hi = bits.clone(), bits.clone()
    if ctx.world > 1:
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return ctx.device if torch.equal(lo, hi) else torch.device("cpu")


def make_case(ctx: Ctx, pattern: Pattern, dname: str, t: int, h: int) -> Case:
    """Fresh seeded inputs of every rank (the same draws on each rank) and the oracle's outputs."""
    dtype, dev = DTYPES[dname], ctx.device
    gen_dev = ctx.gen_device or dev
    gen = torch.Generator(device=gen_dev).manual_seed(_seed(ctx.args.seed, pattern.name, dname, t, h))

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=gen_dev, dtype=torch.float32).to(dev)

    xs = []
    for _ in range(ctx.world):
        x = randn(t, h)
        x[0] *= 40  # one large row per rank: norms and NVFP4 scale factors span a wide range
        xs.append(x.to(dtype))
    residual = randn(t, h).to(dtype)
    weight = (1 + 0.1 * randn(h)).to(dtype)
    scale = (torch.tensor([SCALES[pattern.quant]], dtype=torch.float32, device=dev)
             if pattern.quant else None)
    sets = [(xs[ctx.rank], residual)]
    for _ in range(_input_sets(ctx, t, h, dtype) - 1):
        sets.append((randn(t, h).to(dtype), randn(t, h).to(dtype)))
    eps = ctx.args.eps
    tail = (weight, eps, pattern.quant, scale, pattern.return_norm, SF_LAYOUT)

    # The exact semantics: fp32 sum in rank order, rounded once. NCCL sums in T in its own order;
    # for 2 ranks that is one addition (the same bits), beyond that DESIGN.md accepts NCCL's order:
    # the tail is then also judged against the oracle fed NCCL's own sum (computed here, on every
    # rank, because it is a collective), and the plain sum within world-size ulps.
    exact = reference.all_reduce_sum(xs)
    sums = [exact]
    nccl_order = ctx.backend == "nccl" and ctx.world > 2
    if nccl_order:
        a = xs[ctx.rank].clone()
        dist.all_reduce(a)
        sums.append(a)
    if pattern.tail:
        expected = [Result.of_tail(reference.fused_tail(s, residual, *tail)) for s in sums]
        expected_tail = Result.of_tail(reference.fused_tail(xs[ctx.rank], residual, *tail))
    else:
        expected, expected_tail = [Result(a=exact)], None
    return Case(pattern, dname, dtype, t, h, sets, weight, scale, eps, expected, expected_tail,
                sum_ulps=ctx.world if nccl_order else 0)


# ------------------------------------------------------------------- correctness gate (DESIGN.md)

def check(res: Result, exp: Result, pattern: Pattern, sum_ulps: int = 0) -> Optional[str]:
    """Why `res` violates DESIGN.md's tolerances (commfuse.tolerance) against the oracle `exp`, None
    when it does not: the plain all-reduce within sum_ulps of T, a tail as tolerance.tail_mismatch."""
    if not pattern.tail:
        return tolerance.within_ulp(res.a, exp.a, sum_ulps, "all-reduce sum")
    return tolerance.tail_mismatch(Tail(res.residual, res.norm, res.quant, res.sf),
                                   Tail(exp.residual, exp.norm, exp.quant, exp.sf), pattern.quant)


def gate(ctx: Ctx, impl: "Impl", case: Case, step: Callable) -> Tuple[Optional[str], Optional[Result]]:
    """One call on the checked inputs (set 0), compared to the oracle. Returns (why rejected, result)."""
    try:
        res = step(0)
        if ctx.cuda:
            torch.cuda.synchronize()
    except Exception as e:
        return f"raised {type(e).__name__}: {_short(e)}", None
    expected = [case.expected_tail] if impl.section == "tail" else case.expected
    try:
        reasons = [check(res, exp, case.pattern, case.sum_ulps) for exp in expected]
    except Exception as e:  # e.g. not a Result, or tensors on the wrong device
        return f"output not comparable with the oracle ({type(e).__name__}: {_short(e)})", res
    return (None if None in reasons else reasons[0]), res


# ---------------------------------------------------------------------------------- implementations

@dataclass
class Impl:
    """One row of the comparison. prepare(ctx, case) returns step(i) -> Result, one call on input set
    i (capturable in a CUDA graph: no host synchronisation), or raises Skip with the reason.
    section: "collective" (all-reduce + tail) or "tail" (the tail alone, no collective).
    timed_if_wrong: a baseline that the issues' speed targets name, timed even when the gate rejects
    its result (the record says "wrong", the table marks it *): torch.compile's quantizing tails
    multiply by a reciprocal, so they miss the exact semantics by one code step in a few places.
    Never set for commfuse's own rows."""

    name: str
    section: str
    prepare: Callable[[Ctx, Case], Callable[[int], Result]]
    about: str = ""
    timed_if_wrong: bool = False


IMPLS: Dict[str, Impl] = {}


def register(impl: Impl) -> Impl:
    """Add an implementation to the table (the default --impls list holds the built-in ones only)."""
    if impl.section not in ("collective", "tail"):
        raise ValueError(f"section must be 'collective' or 'tail', got {impl.section!r}")
    IMPLS[impl.name] = impl
    return impl


def _torch_all_reduce(x: torch.Tensor) -> torch.Tensor:
    # torch.distributed's all_reduce is in place; a functional all-reduce (Communicator.all_reduce,
    # torch's functional collectives) clones first, so the baselines pay the same copy.
    a = x.clone()
    dist.all_reduce(a)
    return a


def _prep_nccl_eager(ctx: Ctx, case: Case):
    p, tail = case.pattern, case.tail_args()

    def step(i):
        x, residual = case.input_set(i)
        a = _torch_all_reduce(x)
        return Result.of_tail(reference.fused_tail(a, residual, *tail)) if p.tail else Result(a=a)
    return step


def _fresh_function(fn, tag: str):
    """A copy of fn with its own code object: torch.compile (dynamo) keeps its compiled variants and
    the recompile limit per code object, and checks every variant's guards on each call. One code
    object per (pattern, dtype, hidden) keeps each cache small, so eager calls pay the guards of
    their own variants only and the limit is never reached across cases."""
    code = fn.__code__.replace(co_name=re.sub(r"\W", "_", f"{fn.__name__}_{tag}"))
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _compiled_tail(ctx: Ctx, case: Case):
    """reference.fused_tail through torch.compile, once per (pattern, dtype, hidden).

    Mode: the default (inductor, no CUDA graphs of its own: we capture our own graphs; "max-autotune"
    only tunes matmuls and costs minutes). Shapes: dynamo's automatic dynamic shapes; cases run in
    increasing tokens, so the first call compiles for its size and the second size recompiles once
    with tokens dynamic (hidden stays static, as in vLLM): two compiles per key, in the gate call,
    outside every timed region. emulate_precision_casts keeps the T-rounding of the norm before
    quantising (DESIGN.md semantics; without it inductor quantises the fp32 norm, PEERS.md).
    """
    if not ctx.args.compile_all:
        if not ctx.cuda and ctx.args.quick:
            raise Skip("CPU --quick: torch.compile skipped (its C++ build takes minutes on a CPU)")
        if ctx.args.quick and case.pattern.name != QUICK_COMPILE_PATTERN:
            raise Skip(f"--quick: torch.compile rows only for {QUICK_COMPILE_PATTERN} (compile time)")
    p = case.pattern
    key = ("compiled", p.name, case.dname, case.hidden)
    if key not in ctx.cache:
        quant, return_norm, eps = p.quant, p.return_norm, case.eps

        def tail(a, residual, weight, scale):
            return reference.fused_tail(a, residual, weight, eps, quant, scale, return_norm, SF_LAYOUT)

        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config
        if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
            dynamo_config.fail_on_recompile_limit_hit = True  # never fall back to eager silently
        options = {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}
        ctx.cache[key] = torch.compile(_fresh_function(tail, f"{p.name}_{case.dname}_{case.hidden}"),
                                       fullgraph=True, options=options)
    return ctx.cache[key]


def _prep_nccl_compile(ctx: Ctx, case: Case):
    if not case.pattern.tail:
        raise Skip("no tail to compile (the plain all-reduce is nccl+eager)")
    fn = _compiled_tail(ctx, case)

    def step(i):
        x, residual = case.input_set(i)
        return Result.of_tail(fn(_torch_all_reduce(x), residual, case.weight, case.scale))
    return step


def _commfuse(strategy: str):
    def prepare(ctx: Ctx, case: Case):
        comm = ctx.comm(strategy)
        p = case.pattern
        x, residual = case.input_set(0)
        kw = dict(eps=case.eps, quant=p.quant, scale=case.scale, return_norm=p.return_norm, sf_layout=SF_LAYOUT)
        plan = comm.plan(x, residual, case.weight, **kw) if p.tail else comm.plan(x)
        # A forced P2P algorithm is timed only where it runs (one-shot above its buffers runs two-shot).
        if strategy in ("oneshot", "twoshot") and plan.collective != f"p2p_{strategy}":
            raise Skip(f"plan is {plan.collective} + {plan.tail}: " + "; ".join(plan.reasons))
        ctx.plans.append({"impl": IMPL_OF_STRATEGY[strategy], "pattern": p.name, "dtype": case.dname,
                          "tokens": case.tokens, "hidden": case.hidden, "collective": plan.collective,
                          "tail": plan.tail, "kernel": plan.kernel, "reasons": list(plan.reasons)})

        def step(i):
            x, residual = case.input_set(i)
            if not p.tail:
                return Result(a=comm.all_reduce(x))
            r = comm.fused_all_reduce(x, residual, case.weight, **kw)
            return Result(residual=r.residual, norm=r.norm, quant=r.quant, sf=r.scale_factors)
        return step
    return prepare


IMPL_OF_STRATEGY = {"nccl": "commfuse-fallback", "oneshot": "commfuse-p2p",
                    "twoshot": "commfuse-p2p-twoshot", "auto": "commfuse-auto"}


def _prep_tail_eager(ctx: Ctx, case: Case):
    tail = case.tail_args()

    def step(i):
        x, residual = case.input_set(i)
        return Result.of_tail(reference.fused_tail(x, residual, *tail))
    return step


def _prep_tail_compile(ctx: Ctx, case: Case):
    fn = _compiled_tail(ctx, case)

    def step(i):
        x, residual = case.input_set(i)
        return Result.of_tail(fn(x, residual, case.weight, case.scale))
    return step


def _prep_tail_commfuse(ctx: Ctx, case: Case):
    if not ctx.cuda:
        raise Skip("fused_tail.run needs CUDA tensors (no GPU)")
    try:
        from commfuse import fused_tail
    except Exception as e:
        raise Skip(f"commfuse.fused_tail not importable: {_short(e)}")
    p, tail = case.pattern, case.tail_args()
    if hasattr(fused_tail, "warmup"):  # NVRTC compile and module load now, not in the gate call
        fused_tail.warmup(case.dtype, p.quant, case.hidden, ctx.device)

    def step(i):
        x, residual = case.input_set(i)
        return Result.of_tail(fused_tail.run(x, residual, *tail))
    return step


# FlashInfer (TensorRT-LLM's kernels): flashinfer.comm.trtllm_allreduce_fusion with an IPC workspace
# from trtllm_create_ipc_workspace_for_all_reduce_fusion. Its conventions, read from its source:
# FP8 scale_factor is the dequant scale (the kernel multiplies by 1/scale_factor), as ours; the NVFP4
# scale_factor is the inverse global scale (448*6/amax): we pass 1/scale. Accumulation fp32, PDL on,
# one-shot vs two-shot by its own heuristic (use_oneshot=None), swizzled 128x4 scale factors.
_FI_PATTERN = {
    "allreduce": "kAllReduce",
    "residual_rmsnorm": "kARResidualRMSNorm",
    "residual_rmsnorm_fp8": "kARResidualRMSNormFP8Quant",
    "residual_rmsnorm_nvfp4": "kARResidualRMSNormFP4Quant",
    "residual_rmsnorm_fp8_out": "kARResidualRMSNormOutFP8Quant",
    "residual_rmsnorm_nvfp4_out": "kARResidualRMSNormOutFP4Quant",
}
_FI_ARGS = ("allreduce_in", "world_size", "world_rank", "token_num", "hidden_dim", "workspace_ptrs",
            "launch_with_pdl", "trigger_completion_at_end", "fp32_acc", "pattern_code", "allreduce_out",
            "residual_in", "residual_out", "norm_out", "quant_out", "scale_out", "rms_gamma", "rms_eps",
            "scale_factor", "layout_code")


def _load_flashinfer(ctx: Ctx):
    """FlashInfer's API as a dict, or the reason it cannot run here (a string)."""
    if not ctx.cuda:
        return "needs CUDA GPUs (no GPU)"
    if ctx.world < 2:
        return "needs 2 or more ranks"
    try:
        import flashinfer
        import flashinfer.comm as fic
    except Exception as e:
        return f"not importable ({_short(e)}); install with: pip install flashinfer-python"
    version = getattr(flashinfer, "__version__", "?")
    fuse = getattr(fic, "trtllm_allreduce_fusion", None)
    make_ws = getattr(fic, "trtllm_create_ipc_workspace_for_all_reduce_fusion", None)
    patterns = getattr(fic, "AllReduceFusionPattern", None)
    if fuse is None or make_ws is None or patterns is None:
        return (f"API mismatch: flashinfer {version} lacks trtllm_allreduce_fusion, "
                "trtllm_create_ipc_workspace_for_all_reduce_fusion or AllReduceFusionPattern")
    params = inspect.signature(fuse).parameters
    missing = [n for n in _FI_ARGS if n not in params]
    required = [n for n, v in params.items() if v.default is inspect.Parameter.empty
                and n not in _FI_ARGS and n != "use_oneshot"]
    if missing or required:
        return f"API mismatch: flashinfer {version} trtllm_allreduce_fusion lacks {missing} / needs {required}"
    sm = torch.cuda.get_device_capability(ctx.device)
    if sm[0] not in (9, 10, 12):
        return f"its all-reduce fusion kernels need SM 9.x, 10.x or 12.x; this GPU is SM {sm[0]}.{sm[1]}"
    layout = getattr(fic, "QuantizationSFLayout", None) or getattr(fic, "FP4QuantizationSFLayout", None)
    warnings.filterwarnings("ignore", message=".*unified API.*")  # its @deprecated notice, per call
    return {"fuse": fuse, "make_ws": make_ws, "patterns": patterns, "params": params, "version": version,
            "swizzled": getattr(layout, "SWIZZLED_128x4", getattr(layout, "SWIZZLED", None))}


def _flashinfer_workspace(ctx: Ctx, api: dict) -> torch.Tensor:
    """One IPC workspace for the whole run, sized for the largest tokens x hidden (collective)."""
    if "flashinfer_ws" not in ctx.cache:
        h = max(h for _, h in ctx.args.shape_list)
        tokens = math.ceil(max(t * h for t, h in ctx.args.shape_list) / h)
        kw = {}
        sig = inspect.signature(api["make_ws"]).parameters
        if "group" in sig:
            kw["group"] = dist.group.WORLD
        if "use_fp32_lamport" in sig:
            kw["use_fp32_lamport"] = False
        try:
            out = api["make_ws"](ctx.rank, ctx.world, tokens, h, **kw)
            ws = next(o for o in out if isinstance(o, torch.Tensor))
            ctx.cache["flashinfer_ws"] = (out, ws)  # `out` keeps the IPC buffers alive
        except Exception as e:
            ctx.cache["flashinfer_ws"] = f"workspace creation raised {type(e).__name__}: {_short(e)}"
    ws = ctx.cache["flashinfer_ws"]
    if isinstance(ws, str):
        raise Skip(ws)
    return ws[1]


def _prep_flashinfer(ctx: Ctx, case: Case):
    if "flashinfer" not in ctx.cache:
        ctx.cache["flashinfer"] = _load_flashinfer(ctx)
    api = ctx.cache["flashinfer"]
    if isinstance(api, str):
        raise Skip(api)
    p, t, h, dt, dev = case.pattern, case.tokens, case.hidden, case.dtype, ctx.device
    code = getattr(api["patterns"], _FI_PATTERN[p.name], None)
    if code is None:
        raise Skip(f"API mismatch: flashinfer {api['version']} has no pattern {_FI_PATTERN[p.name]}")
    if p.quant == "nvfp4" and api["swizzled"] is None:
        raise Skip(f"API mismatch: flashinfer {api['version']} has no swizzled 128x4 scale-factor layout")
    ws = _flashinfer_workspace(ctx, api)

    # Outputs are preallocated (its API writes into buffers) and poisoned, so an output the kernel
    # does not write fails the gate. Every buffer is passed, as FlashInfer's own tests do; the
    # pattern decides which ones the kernel writes. Scale-factor padding stays 0 (never written).
    k = h // reference.NVFP4_BLOCK
    sf_rows, sf_cols = -(-t // 128) * 128, -(-k // 4) * 4
    bufs = dict(allreduce_out=torch.full((t, h), float("nan"), dtype=dt, device=dev),
                residual_out=torch.full((t, h), float("nan"), dtype=dt, device=dev),
                norm_out=torch.full((t, h), float("nan"), dtype=dt, device=dev),
                quant_out=torch.full((t, h), 0xFF, dtype=torch.uint8, device=dev),
                scale_out=torch.zeros(sf_rows * sf_cols, dtype=torch.uint8, device=dev))
    if p.quant == "nvfp4":
        m = torch.arange(t, device=dev).unsqueeze(1)
        bufs["scale_out"][reference.swizzled_sf_index(m, torch.arange(k, device=dev), k).reshape(-1)] = 0x7F
    if p.quant == "fp8":
        scale = case.scale
    elif p.quant == "nvfp4":
        scale = torch.reciprocal(case.scale)  # FlashInfer's NVFP4 global scale is the inverse of ours
    else:
        scale = torch.ones(1, dtype=torch.float32, device=dev)
    if not p.tail:
        out = Result(a=bufs["allreduce_out"])
    else:
        out = Result(residual=bufs["residual_out"], norm=bufs["norm_out"] if p.has_norm else None)
        if p.quant == "fp8":
            out.quant = bufs["quant_out"].view(torch.float8_e4m3fn)
        elif p.quant == "nvfp4":
            out.quant = bufs["quant_out"].view(-1)[: t * h // 2].view(t, h // 2)  # packed, contiguous
            out.sf = bufs["scale_out"].view(torch.float8_e4m3fn)
    static = dict(world_size=ctx.world, world_rank=ctx.rank, token_num=t, hidden_dim=h, workspace_ptrs=ws,
                  launch_with_pdl=True, trigger_completion_at_end=True, fp32_acc=True, pattern_code=code,
                  use_oneshot=None, rms_gamma=case.weight, rms_eps=case.eps, scale_factor=scale,
                  layout_code=api["swizzled"], **bufs)
    static = {n: v for n, v in static.items() if n in api["params"]}
    fuse = api["fuse"]

    def step(i):
        x, residual = case.input_set(i)
        fuse(allreduce_in=x, residual_in=residual, **static)
        return out
    return step


for _impl in (
    Impl("nccl+eager", "collective", _prep_nccl_eager,
         "torch.distributed all_reduce (NCCL), then the tail as plain torch ops (commfuse.reference)"),
    Impl("nccl+compile", "collective", _prep_nccl_compile,
         "torch.distributed all_reduce (NCCL), then the tail through torch.compile", timed_if_wrong=True),
    Impl("commfuse-fallback", "collective", _commfuse("nccl"),
         "Communicator(strategy='nccl'): NCCL + the fused local tail kernel"),
    Impl("commfuse-p2p", "collective", _commfuse("oneshot"),
         "Communicator(strategy='oneshot'): P2P one-shot all-reduce with the tail fused"),
    Impl("commfuse-p2p-twoshot", "collective", _commfuse("twoshot"),
         "Communicator(strategy='twoshot'): P2P two-shot all-reduce with the tail fused"),
    Impl("commfuse-auto", "collective", _commfuse("auto"),
         "Communicator(strategy='auto'): whatever the plan picks"),
    Impl("flashinfer", "collective", _prep_flashinfer,
         "flashinfer.comm.trtllm_allreduce_fusion (one-shot/two-shot by its heuristic, PDL, fp32 acc.)"),
    Impl("tail-eager", "tail", _prep_tail_eager, "the tail alone: commfuse.reference in plain torch"),
    Impl("tail-compile", "tail", _prep_tail_compile, "the tail alone through torch.compile",
         timed_if_wrong=True),
    Impl("tail-commfuse", "tail", _prep_tail_commfuse, "the tail alone: commfuse.fused_tail.run"),
):
    register(_impl)
DEFAULT_IMPLS = tuple(IMPLS)


# ------------------------------------------------------------------------------------- timing core

def _align(ctx: Ctx, sleep: bool) -> None:
    """Start a timed region on every GPU together: a host-blocking all-reduce, then (graph mode) a
    GPU spin so the host has queued the whole region before the GPU reaches it, then an all-reduce
    on the GPU right before the start event (both GPUs leave it together)."""
    if ctx.world > 1:
        dist.all_reduce(ctx.flag)
    torch.cuda.synchronize()
    if sleep:
        torch.cuda._sleep(SLEEP_CYCLES)
    if ctx.world > 1:
        dist.all_reduce(ctx.flag)


def _capture(ctx: Ctx, step: Callable) -> "torch.cuda.CUDAGraph":
    """Warm up, then capture K calls in one CUDA graph (rotating over the input sets)."""
    side = torch.cuda.Stream()  # warm-up before capture on a side stream, as torch.cuda.graphs advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(ctx.args.warmup):
            step(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA calls of other threads (NCCL's watchdog) must not invalidate our capture.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(ctx.args.calls_per_graph):
            step(i)
    torch.cuda.synchronize()
    return graph


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


def _time_eager(ctx: Ctx, step: Callable) -> List[float]:
    """Time per call (us) of K back-to-back calls from Python: CUDA events around the loop on a GPU,
    the host clock on the CPU (after a barrier)."""
    k, reps = ctx.args.calls_per_graph, ctx.args.repeats
    for i in range(ctx.args.warmup):
        step(i)
    times = []
    for _ in range(reps):
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _align(ctx, sleep=False)
            start.record()
            for i in range(k):
                step(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / k)
        else:
            if ctx.world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            for i in range(k):
                step(i)
            times.append((time.perf_counter() - t0) * 1e6 / k)
    return times


def _max_over_ranks(ctx: Ctx, times: Sequence[float]) -> List[float]:
    """Each repeat's time as the slowest rank saw it."""
    t = torch.tensor(list(times), dtype=torch.float64, device=ctx.device)
    if ctx.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_step(ctx: Ctx, step: Callable, mode: str) -> Tuple[Optional[List[float]], Optional[str]]:
    """(per-repeat us, max over ranks) or (None, why it failed on some rank). Ranks agree after the
    capture, before any replay: a graph holding collectives must be replayed on every rank or none."""
    run, why = None, None
    if mode == "graph":
        try:
            graph = _capture(ctx, step)
            run = lambda: _time_graph(ctx, graph)
        except Exception as e:
            why = f"graph capture raised {type(e).__name__}: {_short(e)}"
        why = agree(ctx, why)
        if why:
            return None, why
    else:
        run = lambda: _time_eager(ctx, step)
    times = None
    try:
        times = run()
    except Exception as e:
        why = f"{mode} timing raised {type(e).__name__}: {_short(e)}"
    why = agree(ctx, why)
    return (None, why) if why else (_max_over_ranks(ctx, times), None)


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
    if ctx.cuda and ctx.world > 1:
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


# ------------------------------------------------------------------------------------------- driver

def tail_bytes(pattern: Pattern, t: int, h: int, itemsize: int) -> int:
    """The fewest bytes the tail moves: read a, residual, weight; write residual, norm (if an output),
    FP8 codes, or NVFP4 codes + swizzled scale factors."""
    n = t * h
    b = 2 * n * itemsize + h * itemsize + n * itemsize
    if pattern.has_norm:
        b += n * itemsize
    if pattern.quant == "fp8":
        b += n
    elif pattern.quant == "nvfp4":
        b += n // 2 + (-(-t // 128) * 128) * (-(-(h // 16) // 4) * 4)
    return b


def run_cases(ctx: Ctx, ceilings: dict) -> Tuple[list, list, dict]:
    """Every case, every implementation: prepare, gate, time. Returns (records, skipped, status)."""
    args = ctx.args
    records, skipped, status = [], [], {}
    impls = [IMPLS[n] for n in args.impl_list]
    hiddens = sorted({h for _, h in args.shape_list})
    cases = [(d, h, p, t) for d in args.dtype_list for h in hiddens for p in args.pattern_list
             for t in sorted({t for t, hh in args.shape_list if hh == h})]

    def skip(impl, case, why, kind):
        status[(impl.name, case.pattern.name, case.dname, case.tokens, case.hidden)] = kind
        if kind != "skip":
            why = f"{kind} ({case.dname} {case.tokens}x{case.hidden}): {why}"
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
                step, why = impl.prepare(ctx, case), None
            except Skip as e:
                step, why = None, f"skip: {e}"
            except Exception as e:
                step, why = None, f"prepare raised {type(e).__name__}: {_short(e)}"
            why = agree(ctx, why)
            if why is None:
                why, res = gate(ctx, impl, case, step)
                kept.append(res)
                why = agree(ctx, why)
                if why is None:
                    runnable.append((impl, step, None))
                    continue
            kind = verdict_kind(why)
            skip(impl, case, why.replace("skip: ", "") if kind == "skip" else why, kind)
            if kind == "rejected" and impl.timed_if_wrong:
                runnable.append((impl, step, why))
        del kept
        line = []
        for impl, step, wrong in runnable:
            for mode in args.mode_list:
                times, why = time_step(ctx, step, mode)
                if why:
                    skip(impl, case, why, "failed")
                    continue
                us = statistics.median(times)
                frac = None
                if impl.section == "tail" and ceilings.get("hbm_copy_GBps") and us > 0:
                    frac = tail_bytes(pattern, t, h, case.dtype.itemsize) / (us * 1e-6) / (ceilings["hbm_copy_GBps"] * 1e9)
                records.append({"impl": impl.name, "pattern": pname, "dtype": dname, "tokens": t, "hidden": h,
                                "mode": mode, "us": round(us, 3), "us_min": round(min(times), 3),
                                "us_max": round(max(times), 3),
                                "frac_hbm": None if frac is None else round(frac, 4),
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


# ------------------------------------------------------------------------------------------- output

def versions(ctx: Ctx) -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "commfuse": commfuse.__version__,
         "cuda": torch.version.cuda}
    if ctx.cuda:
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            v["nccl"] = None
    try:
        import flashinfer
        v["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception:
        v["flashinfer"] = None
    return v


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _cell(rec: Optional[dict], state: Optional[str], with_frac: bool) -> str:
    if rec is None:
        return {"rejected": "REJ", "failed": "FAIL", "skip": "-"}.get(state or "", "")
    us = rec["us"]
    s = f"{us:.1f}" if us < 1000 else f"{us:.0f}"
    if with_frac and rec["frac_hbm"] is not None:
        s += f" ({100 * rec['frac_hbm']:.0f}%)"
    return s + ("*" if rec.get("wrong") else "")


def format_table(doc: dict, status: dict, args) -> str:
    """Implementations side by side, one block per mode x pattern x dtype, shapes as rows."""
    out = [f"commfuse-bench: {doc['machine']}, {doc['gpu']}, {doc['world_size']} ranks ({doc['backend']}), "
           f"{doc['date']}"]
    if doc.get("note"):
        out.append(f"NOTE: {doc['note']}")
    out.append("versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()))
    c = doc["ceilings"]
    fmt = lambda v: "n/a" if v is None else f"{v:.0f} GB/s"
    out.append(f"ceilings: HBM copy {fmt(c['hbm_copy_GBps'])} (read+write), P2P copy {fmt(c['p2p_GBps'])} "
               f"(one direction), NCCL all-reduce bus bw {fmt(c.get('nccl_busbw_GBps'))}")
    out.append(f"us per call; graph = CUDA graph of {args.calls_per_graph} calls, eager = {args.calls_per_graph} "
               f"back-to-back calls; median of {args.repeats} repeats, slowest rank. REJ = wrong result "
               "(no time), * = a torch.compile baseline's wrong result, timed for reference, FAIL = did not run, "
               "- = not applicable (see the list below)")
    by_key = {(r["impl"], r["pattern"], r["dtype"], r["tokens"], r["hidden"], r["mode"]): r for r in doc["records"]}
    shapes = sorted(args.shape_list, key=lambda s: (s[1], s[0]))
    for section in ("collective", "tail"):
        names = [n for n in args.impl_list if IMPLS[n].section == section]
        if not names:
            continue
        for mode in args.mode_list:
            for pname in args.pattern_list:
                if section == "tail" and not PATTERNS[pname].tail:
                    continue
                for dname in args.dtype_list:
                    title = "" if section == "collective" else ", tail only (no collective), % of HBM copy ceiling"
                    out.append(f"\n== {mode}: {pname} {dname}{title}")
                    rows = [["tokens x hidden"] + names]
                    for t, h in shapes:
                        rows.append([f"{t} x {h}"] + [
                            _cell(by_key.get((n, pname, dname, t, h, mode)),
                                  status.get((n, pname, dname, t, h)), section == "tail") for n in names])
                    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
                    out.extend("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
                               for r in rows)
    routes: Dict[tuple, List[str]] = {}
    for p in doc["plans"]:
        key = (p["impl"], p["pattern"], p["dtype"], f"{p['collective']} + {p['tail']} tail")
        routes.setdefault(key, []).append(f"{p['tokens']}x{p['hidden']}")
    if routes:
        out.append("\ncommfuse routes (Plan):")
        out.extend(f"  {i} / {pat} {d}: {route} ({', '.join(shapes)})" for (i, pat, d, route), shapes in routes.items())
    reasons: Dict[tuple, List[str]] = {}
    for s in doc["skipped"]:
        reasons.setdefault((s["impl"], s["reason"]), []).append(s["pattern"])
    if reasons:
        out.append("\nnot run (REJ, FAIL, -):")
        out.extend(f"  {i} ({', '.join(pats)}): {why}" for (i, why), pats in reasons.items())
    return "\n".join(out)


def plot(doc: dict, path: str, mode: str, dname: str) -> None:
    """Latency against tokens, log-log: one panel per (hidden, pattern), one line per implementation
    (tail-only rows dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in doc["records"] if r["mode"] == mode and r["dtype"] == dname]
    patterns = [p for p in PATTERNS if any(r["pattern"] == p for r in recs)]
    hiddens = sorted({r["hidden"] for r in recs})
    if not recs:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, f"no {mode} {dname} records", ha="center", va="center")
        ax.set_axis_off()
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return
    impls = [n for n in IMPLS if any(r["impl"] == n for r in recs)]
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(impls)}
    fig, axes = plt.subplots(len(hiddens), len(patterns), squeeze=False,
                             figsize=(3.6 * len(patterns), 3.0 * len(hiddens) + 0.8))
    for i, h in enumerate(hiddens):
        for j, pname in enumerate(patterns):
            ax = axes[i][j]
            for n in impls:
                pts = sorted((r["tokens"], r["us"]) for r in recs
                             if r["impl"] == n and r["pattern"] == pname and r["hidden"] == h)
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, color=colors[n],
                            ls="--" if IMPLS[n].section == "tail" else "-", label=n)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{pname}\nhidden {h}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(hiddens) - 1:
                ax.set_xlabel("tokens", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"us per call ({mode})", fontsize=8)
    handles = {n: h for ax in axes.flat for h, n in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 6), fontsize=8)
    note = f" - {doc['note']}" if doc.get("note") else ""
    fig.suptitle(f"commfuse-bench {doc['machine']}, {doc['gpu']}, {doc['world_size']} ranks, {dname}, "
                 f"{mode}{note}", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- main

def _short(e: BaseException, n: int = 300) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _csv(s: str) -> List[str]:
    return [v.strip() for v in s.split(",") if v.strip()]


def _shapes(s: str) -> List[Tuple[int, int]]:
    out = []
    for v in _csv(s):
        m = re.fullmatch(r"(\d+)[xX](\d+)", v)
        if not m:
            raise argparse.ArgumentTypeError(f"shape {v!r} is not TOKENSxHIDDEN, e.g. 64x8192")
        out.append((int(m[1]), int(m[2])))
    return out


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="commfuse-bench",
        description="Side-by-side benchmark of the all-reduce tail: commfuse, NCCL + torch tails, FlashInfer. "
                    "Run one process per GPU under mpirun or torchrun (launch/bench.sh N).")
    ap.add_argument("--shapes", type=_shapes, default=None,
                    help="TOKENSxHIDDEN list, e.g. 1x4096,64x8192 (default: tokens "
                         f"{','.join(map(str, DEFAULT_TOKENS))} x hidden {','.join(map(str, DEFAULT_HIDDEN))})")
    ap.add_argument("--dtypes", type=_csv, default=None, help="bf16,fp16 (default both)")
    ap.add_argument("--patterns", type=_csv, default=None, help=f"default all: {','.join(PATTERNS)}")
    ap.add_argument("--modes", type=_csv, default=None, help="graph,eager (default both; eager only on the CPU)")
    ap.add_argument("--impls", type=_csv, default=None, help=f"default all: {','.join(DEFAULT_IMPLS)}")
    ap.add_argument("--out", default="commfuse-bench-out", help="folder for the JSON and PNG files")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: shapes " + ",".join(f"{t}x{h}" for t, h in QUICK_SHAPES) + ", bf16, patterns "
                         + ",".join(QUICK_PATTERNS) + f", torch.compile only for {QUICK_COMPILE_PATTERN}, "
                         "5 repeats of 10 calls (explicit options override)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per row (default 10, --quick 5)")
    ap.add_argument("--calls-per-graph", type=int, default=None,
                    help="calls captured in one graph, and back-to-back calls per eager repeat (default 20, --quick 10)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 3, --quick 2)")
    ap.add_argument("--compile-all", action="store_true",
                    help="with --quick, still run the torch.compile rows for every pattern (on the CPU too)")
    ap.add_argument("--eps", type=float, default=1e-6, help="RMSNorm epsilon")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    ap.add_argument("--machine", default=os.environ.get("COMMFUSE_MACHINE") or socket.gethostname(),
                    help="machine name in the results (default $COMMFUSE_MACHINE or the host name)")
    args = ap.parse_args(argv)
    q = args.quick
    args.shape_list = args.shapes or (list(QUICK_SHAPES) if q else [(t, h) for h in DEFAULT_HIDDEN for t in DEFAULT_TOKENS])
    args.dtype_list = args.dtypes or (["bf16"] if q else list(DTYPES))
    args.pattern_list = args.patterns or (list(QUICK_PATTERNS) if q else list(PATTERNS))
    args.mode_list = args.modes or ["graph", "eager"]
    args.impl_list = args.impls or list(DEFAULT_IMPLS)
    args.repeats = args.repeats or (5 if q else 10)
    args.calls_per_graph = args.calls_per_graph or (10 if q else 20)
    args.warmup = args.warmup if args.warmup is not None else (2 if q else 3)
    for what, got, known in (("dtype", args.dtype_list, DTYPES), ("pattern", args.pattern_list, PATTERNS),
                             ("mode", args.mode_list, ("graph", "eager")), ("impl", args.impl_list, IMPLS)):
        bad = [v for v in got if v not in known]
        if bad:
            ap.error(f"unknown {what} {bad}; known: {', '.join(known)}")
    if min(args.repeats, args.calls_per_graph) < 1 or args.warmup < 0:
        ap.error("--repeats and --calls-per-graph must be >= 1, --warmup >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    rank, world = init_distributed(timeout_s=float(os.environ.get("COMMFUSE_BENCH_TIMEOUT", 600)))
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    note = None
    if device.type != "cuda":
        note = "CPU/gloo: not GPU numbers"
        if "graph" in args.mode_list:
            args.mode_list = ["eager"]  # no CUDA graphs without CUDA
        if args.quick and not args.shapes:
            args.shape_list = list(QUICK_SHAPES_CPU)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    ctx = Ctx(args, rank, world, backend, device, flag=torch.zeros(1, device=device))
    if rank == 0:
        print(f"commfuse-bench: {world} ranks over {backend}" + (f" - {note}" if note else ""),
              file=sys.stderr, flush=True)

    ctx.gen_device = same_draws(ctx)
    ceilings, methods = measure_ceilings(ctx)
    records, skipped, status = run_cases(ctx, ceilings)

    if rank == 0:
        gpu = (f"{torch.cuda.get_device_name(device)} (SM {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
               if ctx.cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)")
        doc = {"machine": args.machine, "gpu": gpu, "world_size": world, "versions": versions(ctx),
               "ceilings": ceilings, "records": records, "skipped": skipped,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "backend": backend, "methods": {
                   **methods,
                   "graph": f"{args.calls_per_graph} calls captured in one CUDA graph, GPU time per call from "
                            f"CUDA events around a replay, median (min, max) of {args.repeats} replays; each "
                            "replay's time is the slowest rank's",
                   "eager": f"{args.calls_per_graph} back-to-back calls, time per call from "
                            f"{'CUDA events' if ctx.cuda else 'the host clock'} around the loop, median (min, max) "
                            f"of {args.repeats} repeats, slowest rank",
                   "frac_hbm": "tail rows: fewest bytes the tail moves / time / hbm_copy_GBps",
                   "inputs": f"rotating among up to {MAX_INPUT_SETS} input sets (2x the last-level cache)"},
               "plans": ctx.plans,
               "config": {"shapes": [f"{t}x{h}" for t, h in args.shape_list], "dtypes": args.dtype_list,
                          "patterns": args.pattern_list, "modes": args.mode_list, "impls": args.impl_list,
                          "repeats": args.repeats, "calls_per_graph": args.calls_per_graph,
                          "warmup": args.warmup, "quick": args.quick, "eps": args.eps, "seed": args.seed}}
        if note:
            doc["note"] = note
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, "bench-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", args.machine))
        write_json(stem + ".json", doc)
        pngs = []
        for mode in args.mode_list:
            pngs.append(f"{stem}-{mode}.png")
            plot(doc, pngs[-1], mode, args.dtype_list[0])
        print(format_table(doc, status, args), flush=True)
        print(f"\nwrote {stem}.json, " + ", ".join(pngs), flush=True)
    if world > 1:
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
