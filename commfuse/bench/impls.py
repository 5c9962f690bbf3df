"""The implementation table: every row the benchmark compares, as nccl-tests keeps its collectives.

An Impl's prepare(ctx, case) returns a Step (step(i): one call on input set i) or raises Skip with
the reason. Sections: "collective" (all-reduce + tail), "tail" (the tail alone, no collective) and
"floor" (torch-add: one torch elementwise op, the yardstick of host cost per call).
"""
from __future__ import annotations

import inspect
import math
import re
import types
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from commfuse import Communicator, moe, reference, routes, tolerance
from commfuse.tail.checks import fields_of
from commfuse.tail.formats import by_name
from commfuse.tail.spec import TailSpec, spread

from .cases import (MOE_COMPILE_PATTERN, QUICK_COMPILE_PATTERN, SF_LAYOUT, Case, MoeInputs, Result, check,
                    oracle_tail)
from .context import Ctx
from .verdict import Skip, short

SECTIONS = ("collective", "tail", "floor")
# gloo runs its collectives on the host (CUDA tensors are staged through host memory).
GLOO_NO_GRAPH = "gloo collectives cannot be captured in a CUDA graph"


@dataclass
class Step:
    """call(i): one call on input set i, with no host synchronisation so that a CUDA graph can
    capture it; no_graph: why graph mode cannot time it (None: it can); result: what the gate reads
    of call's return value, a Result (made outside the timed loops, which call `call` itself: a row's
    host time holds no wrapper of ours); expected: the oracles of a row that computes by another
    semantics than the pattern's (FlashInfer's MoE combine, in T), judged against these instead:
    expected[i] those of input set i, one list a set. checked_calls: calls the gate checks (commfuse's
    rows: 2, the first call of a signature, which plans it, and one launched from the plan table, as the
    timed calls are; FlashInfer's MoE rows: 2, on another set's oracle too); poison: fills the row's
    caller-owned outputs before each checked call and before each mode's timed calls (after the warm-up),
    so that a call that leaves them unwritten fails the gate or the check after the timing."""

    call: Callable[[int], object]
    no_graph: Optional[str] = None
    result: Callable[[object], Result] = lambda r: r
    expected: Optional[list] = None
    checked_calls: int = 1
    poison: Optional[Callable[[], None]] = None


def _poisoner(*outputs) -> Callable[[], None]:
    """A Step.poison for caller-owned `outputs` (each a tensor, a Tail or a FusedResult): every byte of the
    storage behind each set to 0xFF (NaN in every float format; NVFP4 codes -6), padding included, which
    commfuse writes too."""
    tensors = [t for o in outputs for t in ([o] if isinstance(o, torch.Tensor) else fields_of(o)) if t is not None]

    def poison() -> None:
        for t in tensors:
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).fill_(0xFF)
    return poison


@dataclass
class Impl:
    """One row of the comparison.

    timed_if_wrong: a baseline that the issues' speed targets name, timed even when the gate rejects
    its result (the record says "wrong", the table marks it *): torch.compile's quantizing tails
    multiply by a reciprocal, so they miss the exact semantics by one code step in a few places.
    Never set for commfuse's own rows.
    own_check(case, result, i): why the result of a call on input set i is wrong, for rows that are not an
    all-reduce tail (the floor): they are gated against their own definition instead of the oracle."""

    name: str
    section: str
    prepare: Callable[[Ctx, Case], Step]
    about: str = ""
    timed_if_wrong: bool = False
    own_check: Optional[Callable[[Case, Result, int], Optional[str]]] = None

    @property
    def ours(self) -> bool:
        """A row of commfuse's own (a baseline's wrong result is the baseline's; ours fails the run)."""
        return self.name.startswith("commfuse") or self.name == "tail-commfuse"

    def mismatch(self, case: Case, res: Result, i: int = 0, expected: Optional[list] = None) -> Optional[str]:
        """Why one call's result on input set i is wrong; None when it is right. expected: the step's own
        oracles of every set (Step.expected), else the case's of set i are used. commfuse's rows are held to
        the residual's exact bits (a post pattern's where that is the reference's, see cases.check)."""
        if self.own_check is not None:
            return self.own_check(case, res, i)
        if expected is not None:
            expected = expected[i % len(expected)]
        else:
            collective, tail = case.oracle(i)
            expected = [tail] if self.section == "tail" else collective
        reasons = [check(res, exp, case.pattern, case.sum_ulps, exact_residual=is_commfuse(self.name), scale=case.scale,
                         weight=case.weight, eps=case.eps) for exp in expected]
        return None if None in reasons else reasons[0]


IMPLS: Dict[str, Impl] = {}


def register(impl: Impl) -> Impl:
    """Add an implementation to the table (the default --impls list holds the built-in ones only)."""
    if impl.section not in SECTIONS:
        raise ValueError(f"section must be one of {SECTIONS}, got {impl.section!r}")
    IMPLS[impl.name] = impl
    return impl


def is_commfuse(name: str) -> bool:
    """commfuse's own rows (the host-mode table gives their ratio to torch-add)."""
    return "commfuse" in name


def _torch_all_reduce(x: torch.Tensor) -> torch.Tensor:
    # torch.distributed's all_reduce is in place; a functional all-reduce (Communicator.all_reduce,
    # torch's functional collectives) clones first, so the baselines pay the same copy.
    a = x.clone()
    dist.all_reduce(a)
    return a


def _dist_no_graph(ctx: Ctx) -> Optional[str]:
    return GLOO_NO_GRAPH if ctx.backend == "gloo" else None


def torch_combine(m: MoeInputs) -> torch.Tensor:
    """The MoE combine in plain torch, as the separated MoE rows run it: the reference's bits, fast.

    p = y * w (one kernel: float32 weights promote the product to fp32, RN(w_j * y_j)), then the slot-order
    sum in fp32, one add per slot (the first out of place, from the shared expert's output where there is
    one, the rest in place), rounded to T once: k + 1 or k + 2 kernels (the finalize form gathers the k rows
    first, one more). The shorter spelling `(y.float() * w.unsqueeze(-1)).sum(1) + shared` is not the
    semantics: torch's reduction over k sums in its own order (not slot order) and adds the shared expert
    last, which changes fp32 sums and so, now and then, an element of x by one ulp of T; after the
    all-reduce and the residual add that can be many ulps of a small residual, which the gate rejects.
    Elementwise ops round as IEEE says on every device, so this spelling is exact on the GPU too (zero
    signs aside: the reference starts from +0, this from the first product; the gate's ulp test does
    not tell them apart). No dropped slots (row_index -1): the benchmark's inputs have none."""
    y = m.y if m.row_index is None else m.y[m.row_index]  # finalize: each token's k rows, [t, k, h]
    p = y * m.weights.float().unsqueeze(-1)
    k = p.shape[1]
    if m.shared is not None:
        acc, j = m.shared + p[:, 0], 1  # T + fp32: computed in fp32
    elif k > 1:
        acc, j = p[:, 0] + p[:, 1], 2
    else:
        acc, j = p[:, 0], 1
    for jj in range(j, k):
        acc += p[:, jj]
    return acc.to(y.dtype)


def _prep_nccl_eager(ctx: Ctx, case: Case) -> Step:
    p, tail = case.pattern, case.tail_args()
    if p.is_moe:
        def moe_step(i):
            # The combine's output is the caller's own tensor: all-reduced in place, no copy.
            x = torch_combine(case.moe_set(i))
            dist.all_reduce(x)
            return reference.fused_tail(x, case.input_set(i)[1], *tail)
        return Step(moe_step, _dist_no_graph(ctx), Result.of_tail)

    def step(i):
        x, residual = case.input_set(i)
        a = _torch_all_reduce(x)
        return reference.fused_tail(a, residual, *tail) if p.tail else a
    return Step(step, _dist_no_graph(ctx), Result.of_tail if p.tail else lambda a: Result(a=a))


def _fresh_function(fn, tag: str):
    """A copy of fn with its own code object: torch.compile (dynamo) keeps its compiled variants and
    the recompile limit per code object, and checks every variant's guards on each call. One code
    object per (pattern, dtype, hidden) keeps each cache small, so eager calls pay the guards of
    their own variants only and the limit is never reached across cases."""
    code = fn.__code__.replace(co_name=re.sub(r"\W", "_", f"{fn.__name__}_{tag}"))
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _compiled_tail(ctx: Ctx, case: Case):
    """reference.fused_tail through torch.compile, once per (pattern, dtype, hidden), called as
    fn(a, residual, weight, scale, post_weight) (post_weight None but for a post pattern: the post-norm is then
    the reference's rmsnorm of the sum, in the same torch ops as the tail's norm, for inductor to fuse).

    Mode: the default (inductor, no CUDA graphs of its own: we capture our own graphs; "max-autotune"
    only tunes matmuls and costs minutes). Shapes: dynamo's automatic dynamic shapes; cases run in
    increasing tokens, so the first call compiles for its size and the second size recompiles once
    with tokens dynamic (hidden stays static, as in vLLM): two compiles per key, in the gate call,
    outside every timed region. emulate_precision_casts keeps the rounding of the norm to T before
    quantising, as the semantics say (without it inductor quantises the fp32 norm).
    """
    if not ctx.args.compile_all:
        if not ctx.cuda and ctx.args.quick:
            raise Skip("CPU --quick: torch.compile skipped (its C++ build takes minutes on a CPU)")
        if ctx.args.quick and case.pattern.name not in (QUICK_COMPILE_PATTERN, MOE_COMPILE_PATTERN):
            raise Skip(f"--quick: torch.compile rows only for {QUICK_COMPILE_PATTERN} and {MOE_COMPILE_PATTERN} "
                       "(compile time)")
    p = case.pattern
    # One compiled tail per (tail, dtype, hidden): the MoE patterns share the dense patterns' tails.
    tail_key = (p.quant, p.return_norm, p.weight_offset, p.scale_layout, p.scale_ue8m0, p.post)
    key = ("compiled", tail_key, case.dname, case.hidden)
    if key not in ctx.cache:
        quant, return_norm, eps = p.quant, p.return_norm, case.eps
        offset, scale_layout, ue8m0 = p.weight_offset, p.scale_layout, p.scale_ue8m0

        def tail(a, residual, weight, scale, post_weight):
            return reference.fused_tail(a, residual, weight, eps, quant, scale, return_norm, SF_LAYOUT, offset,
                                        scale_layout, ue8m0, post_weight)

        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config
        if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
            dynamo_config.fail_on_recompile_limit_hit = True  # never fall back to eager silently
        options = {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}
        tag = "_".join(str(v) for v in (*tail_key, case.dname, case.hidden))
        ctx.cache[key] = torch.compile(_fresh_function(tail, tag),
                                       fullgraph=True, options=options)
    return ctx.cache[key]


def _prep_nccl_compile(ctx: Ctx, case: Case) -> Step:
    if not case.pattern.tail:
        raise Skip("no tail to compile (the plain all-reduce is nccl+eager)")
    fn = _compiled_tail(ctx, case)
    if case.pattern.is_moe:
        def moe_step(i):
            x = torch_combine(case.moe_set(i))  # eager torch, as nccl+eager's
            dist.all_reduce(x)
            return fn(x, case.input_set(i)[1], case.weight, case.scale, None)
        return Step(moe_step, _dist_no_graph(ctx), Result.of_tail)

    def step(i):
        x, residual = case.input_set(i)
        return fn(_torch_all_reduce(x), residual, case.weight, case.scale, case.post_weight)
    return Step(step, _dist_no_graph(ctx), Result.of_tail)


def _communicator(ctx: Ctx, strategy: str) -> Communicator:
    """The Communicator of `strategy`, made once (collectively: every rank prepares the same rows). One that
    works on other tensors than the inputs' does not apply here (Skip); an error in making it is commfuse's
    (the rows fail, and the run with them): both are remembered, so every later case says the same."""
    key = ("comm", strategy)
    if key not in ctx.cache:
        try:
            c = Communicator(strategy=strategy)
        except Exception as e:
            c = RuntimeError(f"Communicator(strategy={strategy!r}) raised {type(e).__name__}: {e}")
        else:
            # The cross-rank call check (COMMFUSE_CHECK=1, on in the test suite) is a host
            # collective per call: it cannot be captured and would be timed.
            c.check_calls = False
            if c.device != ctx.device:  # a commfuse whose gloo path takes CPU tensors only
                c = Skip(f"Communicator(strategy={strategy!r}) over {c.backend} works on {c.device} tensors, "
                         f"the inputs are on {ctx.device}")
        ctx.cache[key] = c
    c = ctx.cache[key]
    if isinstance(c, Exception):
        raise type(c)(*c.args)  # a fresh one each time: a raised exception's traceback keeps its frames' cases alive
    return c


def _commfuse(strategy: str, impl: str = "", out: bool = False, via_ops: bool = False):
    """A commfuse row: Communicator(strategy); out: with caller-owned outputs (made once, as a decode loop
    keeps them); via_ops: through torch.ops.commfuse (what compiled code calls: the dispatcher's cost)."""
    def prepare(ctx: Ctx, case: Case) -> Step:
        comm = _communicator(ctx, strategy)
        if case.pattern.is_moe:
            return _prep_commfuse_moe(ctx, case, comm, strategy, impl or IMPL_OF_STRATEGY[strategy], out, via_ops)
        p = case.pattern
        x, residual = case.input_set(0)
        kw = dict(eps=case.eps, quant=p.quant, scale=case.scale, return_norm=p.return_norm, sf_layout=SF_LAYOUT,
                  post_weight=case.post_weight, **p.scaled)
        plan = comm.plan(x, residual, case.weight, **kw) if p.tail else comm.plan(x)
        # A forced P2P algorithm is timed only where it runs (one-shot above its buffers runs two-shot), with the
        # tail in its kernel (a tail the P2P kernel refuses runs separated after it: a post-norm's among them, which
        # its kernels have not; the skip gives the plan's reasons).
        if strategy in ("oneshot", "twoshot") and (plan.collective != f"p2p_{strategy}" or
                                                   (p.tail and plan.tail != "fused")):
            raise Skip(f"plan is {plan.collective} + {plan.tail}: " + "; ".join(plan.reasons))
        ctx.plans.append({"impl": impl or IMPL_OF_STRATEGY[strategy], "pattern": p.name, "dtype": case.dname,
                          "tokens": case.tokens, "hidden": case.hidden, "collective": plan.collective,
                          "tail": plan.tail, "kernel": plan.kernel, "reasons": list(plan.reasons)})

        owned = None
        if out:
            owned = comm.fused_all_reduce(x, residual, case.weight, **kw) if p.tail else comm.all_reduce(x)
        if via_ops:
            scale, weight, tail, post = case.scale, case.weight, p.spec.code, case.post_weight

            def step(i):
                x, residual = case.input_set(i)
                if not p.tail:
                    return torch.ops.commfuse.all_reduce(x, comm.name)
                return torch.ops.commfuse.fused_all_reduce(x, residual, weight, scale, case.eps, p.weight_offset, tail,
                                                           comm.name, post)

            def result(r):
                if not p.tail:
                    return Result(a=r)
                return Result.of_tail(spread(r, tail))
        else:
            def step(i):
                x, residual = case.input_set(i)
                if not p.tail:
                    return comm.all_reduce(x, out=owned)
                return comm.fused_all_reduce(x, residual, case.weight, out=owned, **kw)

            def result(r):
                if not p.tail:
                    return Result(a=r)
                return Result(residual=r.residual, norm=r.norm, quant=r.quant, sf=r.scale_factors, scales=r.scales)
        return Step(step, GLOO_NO_GRAPH if plan.collective == "gloo" else None, result, checked_calls=2,
                    poison=None if owned is None else _poisoner(owned))
    return prepare


def _prep_commfuse_moe(ctx: Ctx, case: Case, comm: Communicator, strategy: str, impl: str, out: bool,
                       via_ops: bool) -> Step:
    """A commfuse row of a MoE pattern: comm.moe_all_reduce (or torch.ops.commfuse.moe_all_reduce), the
    combine (its kernel on CUDA tensors) then fused_all_reduce's route for the combined rows."""
    p = case.pattern
    m0, (x, residual) = case.moe_set(0), case.input_set(0)
    kw = dict(eps=case.eps, quant=p.quant, scale=case.scale, return_norm=p.return_norm, sf_layout=SF_LAYOUT, **p.scaled)
    plan = comm.plan(x, residual, case.weight, **kw)  # the route of the combined rows (moe_all_reduce's)
    if strategy in ("oneshot", "twoshot") and (plan.collective != f"p2p_{strategy}" or plan.tail != "fused"):
        raise Skip(f"plan is {plan.collective} + {plan.tail}: " + "; ".join(plan.reasons))
    # One call before the timed ones: it compiles and loads what it runs, and its plan is the route the
    # rows take (at world size 1 the one-kernel MoE tail, which comm.plan of the combined rows cannot say).
    r0 = comm.moe_all_reduce(m0.y, m0.weights, residual, case.weight, **kw, row_index=m0.row_index, shared=m0.shared)
    mp = r0.plan
    ctx.plans.append({"impl": impl, "pattern": p.name, "dtype": case.dname, "tokens": case.tokens,
                      "hidden": case.hidden, "combine": mp.combine, "collective": mp.collective, "tail": mp.tail,
                      "kernel": mp.kernel, "reasons": list(mp.reasons)})
    no_graph = GLOO_NO_GRAPH if mp.collective == "gloo" else None
    if no_graph is None and mp.combine == "separated" and m0.row_index is not None and ctx.cuda:
        no_graph = "the separated combine checks row_index on the host (a synchronisation a capture does not allow)"
    owned = r0 if out else None
    if via_ops:
        scale, weight, tail = case.scale, case.weight, p.spec.code

        def step(i):
            m, (_, residual) = case.moe_set(i), case.input_set(i)
            return torch.ops.commfuse.moe_all_reduce(m.y, m.weights, m.row_index, m.shared, residual, weight, scale,
                                                     case.eps, p.weight_offset, tail, comm.name)

        def result(r):
            return Result.of_tail(spread(r, tail))
    else:
        def step(i):
            m, (_, residual) = case.moe_set(i), case.input_set(i)
            return comm.moe_all_reduce(m.y, m.weights, residual, case.weight, **kw, row_index=m.row_index,
                                       shared=m.shared, out=owned)

        def result(r):
            return Result(residual=r.residual, norm=r.norm, quant=r.quant, sf=r.scale_factors, scales=r.scales)
    return Step(step, no_graph, result, checked_calls=2, poison=None if owned is None else _poisoner(owned))


IMPL_OF_STRATEGY = {"nccl": "commfuse-fallback", "oneshot": "commfuse-p2p",
                    "twoshot": "commfuse-p2p-twoshot", "auto": "commfuse-auto"}


def _prep_tail_eager(ctx: Ctx, case: Case) -> Step:
    tail = case.tail_args()
    if case.pattern.is_moe:
        def moe_step(i):  # a MoE pattern's tail starts at the combine
            return reference.fused_tail(torch_combine(case.moe_set(i)), case.input_set(i)[1], *tail)
        return Step(moe_step, result=Result.of_tail)

    def step(i):
        x, residual = case.input_set(i)
        return reference.fused_tail(x, residual, *tail)
    return Step(step, result=Result.of_tail)


def _prep_tail_compile(ctx: Ctx, case: Case) -> Step:
    fn = _compiled_tail(ctx, case)
    if case.pattern.is_moe:
        def moe_step(i):
            return fn(torch_combine(case.moe_set(i)), case.input_set(i)[1], case.weight, case.scale, None)
        return Step(moe_step, result=Result.of_tail)

    def step(i):
        x, residual = case.input_set(i)
        return fn(x, residual, case.weight, case.scale, case.post_weight)
    return Step(step, result=Result.of_tail)


def _prep_tail_commfuse(ctx: Ctx, case: Case) -> Step:
    if not ctx.cuda:
        raise Skip("fused_tail.run needs CUDA tensors (no GPU)")
    from commfuse.kernels import fused_tail  # on a GPU a failed import fails the row (cli: "prepare")
    p = case.pattern
    if p.post:
        return _prep_tail_commfuse_post(ctx, case)
    fused_tail.warmup(case.dtype, p.quant, case.hidden, ctx.device)  # NVRTC compile and module load now, not in the gate call
    if p.is_moe:
        # The combine kernel, then the tail kernel: moe_all_reduce's local work without the collective.
        m0 = case.moe_set(0)
        route, why = moe.plan(m0.y, m0.weights, routes.Machine.local(ctx.device))
        if route != "kernel":
            raise Skip(why)
        from commfuse.kernels import moe_combine
        moe_combine.warmup(case.dtype, ctx.device)

        def moe_step(i):
            m = case.moe_set(i)
            x = moe_combine.run(m.y, m.weights, m.row_index, m.shared)
            return fused_tail.run(x, case.input_set(i)[1], case.weight, case.eps, p.quant, case.scale, p.return_norm,
                                  SF_LAYOUT, **p.scaled)
        return Step(moe_step, result=Result.of_tail)

    def step(i):
        x, residual = case.input_set(i)
        return fused_tail.run(x, residual, case.weight, case.eps, p.quant, case.scale, p.return_norm, SF_LAYOUT,
                              **p.scaled)
    return Step(step, result=Result.of_tail)


def _prep_tail_commfuse_post(ctx: Ctx, case: Case) -> Step:
    """tail-commfuse of a post pattern: fused_tail.run has no post-norm, so the POST variant's LaunchPlan (made
    here: its kernel compiled and loaded before the gate call), launched as the library's NCCL and one-rank routes
    launch it, the post weight as the launcher's z; refused as run refuses what the kernel cannot take."""
    from commfuse.kernels import fused_tail, native
    p = case.pattern
    spec = TailSpec.of(p.quant, return_norm=p.return_norm, eps=case.eps, sf_layout=SF_LAYOUT, **p.scaled)
    sm = torch.cuda.get_device_capability(ctx.device)
    why = fused_tail.FUSED_TAIL.rejects(case.dtype, sm, case.hidden, case.tokens, spec)
    if why:
        raise ValueError(f"fused_tail: {why}")
    launcher = native.launcher(fused_tail.FUSED_TAIL.plan(case.dtype, case.tokens, case.hidden, spec,
                                                          ctx.device.index, post=True))

    def step(i):
        x, residual = case.input_set(i)
        return launcher(x, residual, case.weight, case.scale, None, case.post_weight)
    return Step(step, result=Result.of_tail)


def _prep_torch_add(ctx: Ctx, case: Case) -> Step:
    # torch.add(x, residual, out=...): of the one-op candidates the cheapest on the host that keeps
    # no state between calls (x.add_(1) wraps its Python scalar in a tensor on every call). One
    # output per input set, so its bytes rotate through memory like the inputs'. Arguments and
    # results are made here: a floor must not carry harness work the other rows' calls may not.
    calls = [(x, residual, Result(a=torch.empty_like(x))) for x, residual in case.sets]
    n = len(calls)

    def step(i):
        x, residual, res = calls[i % n]
        torch.add(x, residual, out=res.a)
        return res
    # Its outputs are its own: poisoned like commfuse's, or a timed call that wrote nothing would pass on what
    # the gate's or the warm-up's calls left there.
    return Step(step, poison=_poisoner(*(res.a for _, _, res in calls)))


def _check_torch_add(case: Case, res: Result, i: int) -> Optional[str]:
    x, residual = case.input_set(i)
    return tolerance.within_ulp(res.a, (x.float() + residual.float()).to(case.dtype), 0, "x + residual")


# FlashInfer (TensorRT-LLM's kernels): flashinfer.comm.trtllm_allreduce_fusion with an IPC workspace
# from trtllm_create_ipc_workspace_for_all_reduce_fusion. Its conventions, read from its source:
# FP8 scale_factor is the dequant scale (the kernel multiplies by 1/scale_factor), as ours; the NVFP4
# scale_factor is the inverse global scale (448*6/amax): we pass 1/scale. Accumulation fp32, PDL on,
# one-shot vs two-shot by its own heuristic (use_oneshot=None), swizzled 128x4 scale factors.
# Its computed FP8 scales (newer versions) as ours: s = max(amax / 448, floor), codes e4m3(v / s);
# per token (kARResidualRMSNormDynamicFP8Quant) float32 [t]; per 128-element group
# (kARResidualRMSNormPerTokenGroupFP8PackedQuant, block_quant_group_size) s rounded up to a power of
# two, stored as UE8M0 exponents packed 4 per int32, MN-major over roundup(t, 4) rows: our "mn_major"
# + scale_ue8m0 layout. Its floors (2^-9 / 448 per token, 1e-10 per group, ours 2^-126) differ only
# for rows / groups of amax below 2^-9 / 4.5e-8, which the benchmark's inputs have none of. Its
# weight_bias is our weight_offset (Gemma: 1). It has no FP8 group pattern with float32 scales:
# residual_rmsnorm_fp8_block has no entry here.
_FI_PATTERN = {
    "allreduce": "kAllReduce",
    "residual_rmsnorm": "kARResidualRMSNorm",
    "residual_rmsnorm_fp8": "kARResidualRMSNormFP8Quant",
    "residual_rmsnorm_nvfp4": "kARResidualRMSNormFP4Quant",
    "residual_rmsnorm_fp8_out": "kARResidualRMSNormOutFP8Quant",
    "residual_rmsnorm_nvfp4_out": "kARResidualRMSNormOutFP4Quant",
    "residual_rmsnorm_fp8_per_token": "kARResidualRMSNormDynamicFP8Quant",
    "residual_rmsnorm_fp8_block_ue8m0": "kARResidualRMSNormPerTokenGroupFP8PackedQuant",
    "residual_gemma_rmsnorm_fp8": "kARResidualRMSNormFP8Quant",
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
        return f"not importable ({short(e)}); install with: pip install flashinfer-python"
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
            "swizzled": getattr(layout, "SWIZZLED_128x4", getattr(layout, "SWIZZLED", None)),
            "reduce": getattr(fic, "trtllm_moe_allreduce_fusion", None),
            "finalize": getattr(fic, "trtllm_moe_finalize_allreduce_fusion", None)}


def _flashinfer_workspace(ctx: Ctx, api: dict) -> torch.Tensor:
    """One IPC workspace for the whole run, sized for the largest tokens x hidden (collective)."""
    if "flashinfer_ws" not in ctx.cache:
        shapes = list(ctx.args.shape_list) + list(getattr(ctx.args, "moe_shape_list", None) or [])
        h = max(h for _, h in shapes)
        tokens = math.ceil(max(t * h for t, h in shapes) / h)
        kw = {}
        sig = inspect.signature(api["make_ws"]).parameters
        if "group" in sig:
            kw["group"] = dist.group.WORLD
        if "use_fp32_lamport" in sig:
            kw["use_fp32_lamport"] = False
        if ctx.shared_gpu and "use_symm_dev_mem" in sig:
            # torch's symmetric memory (its default) refuses ranks on one device; its own cuMem allocator does not.
            kw.update(use_symm_dev_mem=True, create_metadata=True)
        try:
            out = api["make_ws"](ctx.rank, ctx.world, tokens, h, **kw)
            ws = next(o for o in out if isinstance(o, torch.Tensor))
            ctx.cache["flashinfer_ws"] = (out, ws)  # `out` keeps the IPC buffers alive
        except Exception as e:
            ctx.cache["flashinfer_ws"] = f"workspace creation raised {type(e).__name__}: {short(e)}"
    ws = ctx.cache["flashinfer_ws"]
    if isinstance(ws, str):
        raise Skip(ws)
    return ws[1]


def _flashinfer_outputs(case: Case, dev: torch.device) -> tuple:
    """(buffers, Result, poison) of FlashInfer's output arguments for the case: preallocated (its API writes
    into buffers) and poisoned, now and by poison() (Step.poison: before each checked call and each mode's
    timed calls), so an output the kernel does not write fails the checks. Scale-factor padding is 0
    (never written)."""
    p, t, h, dt = case.pattern, case.tokens, case.hidden, case.dtype
    k = h // reference.NVFP4_BLOCK
    sf_rows, sf_cols = -(-t // 128) * 128, -(-k // 4) * 4
    bufs = dict(allreduce_out=torch.empty((t, h), dtype=dt, device=dev),
                residual_out=torch.empty((t, h), dtype=dt, device=dev),
                norm_out=torch.empty((t, h), dtype=dt, device=dev),
                quant_out=torch.empty((t, h), dtype=torch.uint8, device=dev),
                scale_out=torch.empty(sf_rows * sf_cols, dtype=torch.uint8, device=dev))
    # What poison() writes, (tensor, value, index, rest): value throughout (index None), or value at index (the
    # scale bytes the kernel writes) and rest elsewhere (the padding it leaves as it finds it: 0).
    fills = [(bufs[n], float("nan"), None, None) for n in ("allreduce_out", "residual_out", "norm_out")]
    fills.append((bufs["quant_out"], 0xFF, None, None))
    m = torch.arange(t, device=dev).unsqueeze(1)
    if p.quant == "nvfp4":
        index = reference.swizzled_sf_index(m, torch.arange(k, device=dev), k).reshape(-1)
        fills.append((bufs["scale_out"], 0x7F, index, 0))
    elif p.quant == "fp8_per_token":
        bufs["scale_out"] = torch.empty((t,), dtype=torch.float32, device=dev)
        fills.append((bufs["scale_out"], float("nan"), None, None))
    elif p.quant == "fp8_block":
        # Our storage (ceil(K/4) x roundup(t, 4) int32, padding 0), each exponent byte poisoned with
        # the UE8M0 NaN; passed as the reference's [t, ceil(K/4)] view, strides (1, roundup(t, 4)).
        kb, tp = h // reference.FP8_BLOCK, -(-t // 4) * 4
        storage = torch.empty(-(-kb // 4) * tp, dtype=torch.int32, device=dev)
        fills.append((storage.view(torch.uint8), 0xFF,
                      reference.packed_ue8m0_byte_index(m, torch.arange(kb, device=dev), t), 0))
        bufs["scale_out"] = torch.as_strided(storage, (t, -(-kb // 4)), (1, tp))
    else:
        fills.append((bufs["scale_out"], 0, None, None))

    def poison() -> None:
        for buf, value, index, rest in fills:
            if index is None:
                buf.fill_(value)
            else:
                buf.fill_(rest)
                buf[index] = value
    poison()
    if not p.tail:
        out = Result(a=bufs["allreduce_out"])
    else:
        out = Result(residual=bufs["residual_out"], norm=bufs["norm_out"] if p.has_norm else None)
        if p.quant is not None and by_name(p.quant).codes == "e4m3":
            out.quant = bufs["quant_out"].view(torch.float8_e4m3fn)
            if by_name(p.quant).computes_scales:
                out.scales = bufs["scale_out"]
        elif p.quant == "nvfp4":
            out.quant = bufs["quant_out"].view(-1)[: t * h // 2].view(t, h // 2)  # packed, contiguous
            out.sf = bufs["scale_out"].view(torch.float8_e4m3fn)
    return bufs, out, poison


# FlashInfer's MoE fusions (TensorRT-LLM's patterns 6 and 7), read from its source (0.6.18):
# - trtllm_moe_allreduce_fusion (the reduction form) takes the experts-major layout: y as [k, t, h], the
#   weights float32 [k, t] (transposed copies of each input set, made outside the timed call), and a token
#   input [t, h] that it adds and requires: the shared expert's, zeros for the patterns without one (a
#   model without shared experts passes zeros too). It quantizes to NVFP4 only (scale_factor, our 1/scale).
# - trtllm_moe_finalize_allreduce_fusion takes our rows and row_index (int32 [t, k], -1 drops a slot) and
#   the weights in T (rounded copies: it reads them as T); it takes no global scale, so quantizes nothing.
# - Both combine in T (fi_moe_combine), not in float32 as ours: their rows are gated against the oracle fed
#   that combine, summed over the ranks in rank order in T as their one-shot all-reduce does.
# - Its NVFP4 quantizer is built for SM 10+ only: on an H200 the MoE reduction's NVFP4 variant faulted (an
#   illegal address, its first call), so it skips below SM 10.
# On ranks sharing a GPU (MPS) the MoE fusions run, on a workspace from its own cuMem allocator; its dense
# all-reduce fusion ran at 1 x 4096 there but never finished at 200 x 7168, so _prep_flashinfer skips it.
_FI_MOE = {"reduce": "trtllm_moe_allreduce_fusion", "finalize": "trtllm_moe_finalize_allreduce_fusion"}


def fi_moe_combine(m: MoeInputs, dtype: torch.dtype) -> torch.Tensor:
    """FlashInfer's MoE combine of one rank's inputs, T [t, h]: acc = 0 in T; for each kept slot in order
    acc = T(acc + T(float(y_j) * w_j)), w_j float32 (the reduction form) or rounded to T (finalize); then
    acc = T(acc + shared); -0.0 made +0.0 (its one-shot all-reduce marks unwritten words with -0.0)."""
    t, k = m.weights.shape
    if m.row_index is None:
        rows, keep, w = m.y, None, m.weights.float()
    else:
        idx = m.row_index.long()
        rows, keep, w = m.y[idx.clamp(min=0)], idx >= 0, m.weights.to(dtype).float()
    acc = torch.zeros(t, rows.shape[-1], dtype=dtype, device=rows.device)
    for j in range(k):
        step = (acc.float() + (rows[:, j].float() * w[:, j:j + 1]).to(dtype).float()).to(dtype)
        acc = step if keep is None else torch.where(keep[:, j:j + 1], step, acc)
    if m.shared is not None:
        acc = (acc.float() + m.shared.float()).to(dtype)
    return torch.where(acc == 0, torch.zeros_like(acc), acc)


def _prep_flashinfer_moe(ctx: Ctx, case: Case, api: dict) -> Step:
    p, t, h, dt, dev = case.pattern, case.tokens, case.hidden, case.dtype, ctx.device
    version, form = api["version"], "finalize" if p.moe_form == "finalize" else "reduce"
    fn = api[form]
    if fn is None:
        raise Skip(f"API mismatch: flashinfer {version} has no {_FI_MOE[form]}")
    if form == "reduce" and p.quant not in (None, "nvfp4"):
        raise Skip(f"flashinfer {version}'s {_FI_MOE[form]} quantizes to NVFP4 only")
    if form == "finalize" and p.quant is not None:
        raise Skip(f"flashinfer {version}'s {_FI_MOE[form]} takes no global scale: it quantizes nothing")
    if p.quant == "nvfp4" and ctx.cuda and torch.cuda.get_device_capability(dev)[0] < 10:
        raise Skip(f"flashinfer {version}'s {_FI_MOE[form]} quantizes to NVFP4 on SM 10+ only (on SM 9.0 it faults)")
    ws = _flashinfer_workspace(ctx, api)
    bufs, out, poison = _flashinfer_outputs(case, dev)
    outputs = dict(residual_out=bufs["residual_out"], norm_out=bufs["norm_out"] if p.has_norm else None,
                   quant_out=bufs["quant_out"] if p.quant else None, scale_out=bufs["scale_out"] if p.quant else None)
    if form == "reduce":
        zeros = torch.zeros(t, h, dtype=dt, device=dev)
        sets = [(m.y.transpose(0, 1).contiguous(), m.weights.t().contiguous(), zeros if m.shared is None else m.shared)
                for m in case.moe]
        scale = 1.0 / float(case.scale) if p.quant else 1.0
        static = dict(world_size=ctx.world, world_rank=ctx.rank, token_num=t, hidden_dim=h, workspace_ptrs=ws,
                      launch_with_pdl=True, rms_gamma=case.weight, rms_eps=case.eps, scale_factor=scale,
                      moe_reduction_device_num_experts=p.moe_k, layout_code=api["swizzled"], moe_allreduce_out=None,
                      **outputs)

        def step(i):
            y, w, token = sets[i % len(sets)]
            fn(residual_in=case.input_set(i)[1], moe_reduction_scale_input=w,
               moe_reduction_active_experts_token_input=y, moe_reduction_token_input=token, **static)
            return out
    else:
        weights = [m.weights.to(dt) for m in case.moe]
        static = dict(norm_weight=case.weight, workspace_ptrs=ws, launch_with_pdl=True, world_rank=ctx.rank,
                      world_size=ctx.world, eps=case.eps, routed_scaling_factor=None, **outputs)

        def step(i):
            m = case.moe_set(i)
            fn(allreduce_in=m.y, residual_in=case.input_set(i)[1], expanded_idx_to_permuted_idx=m.row_index,
               shared_expert_output=m.shared, expert_scale_factor=weights[i % len(weights)], **static)
            return out

    def oracle(i: int, ranks: list) -> list:
        """The oracle of input set i fed FlashInfer's combine of every rank's MoeInputs of it."""
        combined = [fi_moe_combine(m, dt).float() for m in ranks]
        total = combined[0]
        for c in combined[1:]:  # rank order, rounded to T after each addition
            total = (total.to(dt).float() + c).to(dt).float()
        return [oracle_tail(total.to(dt), case.input_set(i)[1], p, case.weight, case.eps, case.scale)]
    expected = [oracle(i, ranks) for i, ranks in enumerate(case.moe_ranks)]
    return Step(step, expected=expected, checked_calls=2, poison=poison)


def _prep_flashinfer(ctx: Ctx, case: Case) -> Step:
    if case.pattern.post:
        raise Skip("its all-reduce fusion has no post-norm (its patterns, TensorRT-LLM's kARResidualRMSNorm*, add "
                   "the residual to the sum itself)")
    if ctx.shared_gpu and not case.pattern.is_moe:
        raise Skip("its all-reduce fusion hangs on ranks sharing a GPU (it did at 200 x 7168 on an H200)")
    if "flashinfer" not in ctx.cache:
        ctx.cache["flashinfer"] = _load_flashinfer(ctx)
    api = ctx.cache["flashinfer"]
    if isinstance(api, str):
        raise Skip(api)
    p, t, h, dev = case.pattern, case.tokens, case.hidden, ctx.device
    version = api["version"]
    if p.is_moe:
        return _prep_flashinfer_moe(ctx, case, api)
    if p.quant == "fp8_block" and (p.scale_layout, p.scale_ue8m0) != ("mn_major", True):
        scales = f"{p.scale_layout} {'UE8M0' if p.scale_ue8m0 else 'float32'}"
        raise Skip(f"flashinfer {version} has no FP8 block pattern with {scales} scales (its per-token-group "
                   "FP8 pattern writes UE8M0 exponents packed MN-major only)")
    if p.name not in _FI_PATTERN:
        raise Skip(f"flashinfer fuses no {p.name} (no pattern of its all-reduce fusion computes it)")
    code = getattr(api["patterns"], _FI_PATTERN[p.name], None)
    if code is None:
        raise Skip(f"API mismatch: flashinfer {version} has no pattern {_FI_PATTERN[p.name]}")
    if p.quant == "nvfp4" and api["swizzled"] is None:
        raise Skip(f"API mismatch: flashinfer {version} has no swizzled 128x4 scale-factor layout")
    extra = {}
    if p.weight_offset:
        if "weight_bias" not in api["params"]:
            raise Skip(f"API mismatch: flashinfer {version} trtllm_allreduce_fusion has no weight_bias "
                       "(the weight offset of Gemma's RMSNorm)")
        extra["weight_bias"] = p.weight_offset
    if p.quant == "fp8_block":
        if "block_quant_group_size" not in api["params"]:
            raise Skip(f"API mismatch: flashinfer {version} trtllm_allreduce_fusion has no block_quant_group_size")
        extra["block_quant_group_size"] = reference.FP8_BLOCK
    ws = _flashinfer_workspace(ctx, api)

    # Every buffer is passed, as FlashInfer's own tests do; the pattern decides which ones the kernel writes.
    bufs, out, poison = _flashinfer_outputs(case, dev)
    if p.quant == "fp8":
        scale = case.scale
    elif p.quant == "nvfp4":
        scale = torch.reciprocal(case.scale)  # FlashInfer's NVFP4 global scale is the inverse of ours
    else:  # not read by the patterns without a static scale
        scale = torch.ones(1, dtype=torch.float32, device=dev)
    static = dict(world_size=ctx.world, world_rank=ctx.rank, token_num=t, hidden_dim=h, workspace_ptrs=ws,
                  launch_with_pdl=True, trigger_completion_at_end=True, fp32_acc=True, pattern_code=code,
                  use_oneshot=None, rms_gamma=case.weight, rms_eps=case.eps, scale_factor=scale,
                  layout_code=api["swizzled"], **bufs, **extra)
    static = {n: v for n, v in static.items() if n in api["params"]}
    fuse = api["fuse"]

    def step(i):
        x, residual = case.input_set(i)
        fuse(allreduce_in=x, residual_in=residual, **static)
        return out
    return Step(step, poison=poison)


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
    Impl("commfuse-auto-out", "collective", _commfuse("auto", "commfuse-auto-out", out=True),
         "commfuse-auto with caller-owned outputs (out=, made once): what a decode loop pays"),
    Impl("commfuse-ops", "collective", _commfuse("auto", "commfuse-ops", via_ops=True),
         "torch.ops.commfuse.{all_reduce, fused_all_reduce} called as compiled code calls them (the dispatcher)"),
    Impl("flashinfer", "collective", _prep_flashinfer,
         "flashinfer.comm.trtllm_allreduce_fusion (one-shot/two-shot by its heuristic, PDL, fp32 acc.)"),
    Impl("tail-eager", "tail", _prep_tail_eager, "the tail alone: commfuse.reference in plain torch"),
    Impl("tail-compile", "tail", _prep_tail_compile, "the tail alone through torch.compile",
         timed_if_wrong=True),
    Impl("tail-commfuse", "tail", _prep_tail_commfuse,
         "the tail alone: commfuse.kernels.fused_tail.run (a post pattern: its POST variant's plan)"),
    Impl("torch-add", "floor", _prep_torch_add,
         "torch.add(x, residual, out=buf): one torch elementwise op, the floor of host cost per call",
         own_check=_check_torch_add),
):
    register(_impl)
DEFAULT_IMPLS = tuple(IMPLS)
