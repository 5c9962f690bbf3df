"""The cases: patterns and shapes, every rank's seeded inputs, the oracle, and the correctness gate.

A case is (pattern, dtype, tokens, hidden). `make_case` draws every rank's inputs from one seeded
generator on each rank, so each rank knows the gather of all inputs, and applies commfuse.reference
to it: the oracle. `gate` runs one call on the checked inputs and compares it with the oracle, with
the tolerances of the tests (commfuse.tolerance; docs/semantics.md; a post-norm pattern's as section 2a's,
see `check`).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from commfuse import reference, tolerance
from commfuse.reference import Tail
from commfuse.tail.formats import FORMATS
from commfuse.tail.spec import TailSpec

from .context import Ctx
from .verdict import OK, Kind, Verdict, agree, failed, short

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SF_LAYOUT = "swizzled"  # the NVFP4 GEMMs' layout; the linear one is covered by the tests


@dataclass(frozen=True)
class Pattern:
    """One benchmark pattern. tail=False: the plain sum all-reduce. weight_offset, scale_layout and
    scale_ue8m0 as in commfuse.reference.fused_tail (the last two for quant "fp8_block" only). post: a
    post-norm of the sum with its own weight before the residual add (reference.fused_tail's post_weight,
    docs/semantics.md section 2a: Gemma 2 / 3, GLM-4); dense patterns only."""

    name: str
    quant: Optional[str] = None
    return_norm: bool = False
    tail: bool = True
    weight_offset: float = 0.0
    scale_layout: str = "row"
    scale_ue8m0: bool = False
    post: bool = False
    # The MoE patterns (Communicator.moe_all_reduce, docs/semantics.md section 14): moe_k experts per
    # token (0: a dense pattern), combined in form "reduce" (y [t, k, h]) or "finalize" (permuted rows
    # [R, h] with row_index [t, k]), with a shared expert's output when moe_shared.
    moe_k: int = 0
    moe_form: str = "reduce"
    moe_shared: bool = False

    @property
    def is_moe(self) -> bool:
        return self.moe_k > 0

    @property
    def has_norm(self) -> bool:
        return self.tail and (self.quant is None or self.return_norm)

    @property
    def spec(self) -> TailSpec:
        return TailSpec.of(self.quant, return_norm=self.return_norm, sf_layout=SF_LAYOUT,
                           weight_offset=self.weight_offset, scale_layout=self.scale_layout,
                           scale_ue8m0=self.scale_ue8m0)

    @property
    def scaled(self) -> dict:
        """The keyword arguments of the computed-scale kinds and the weight offset, for the calls
        that take them by keyword (Communicator, kernels.fused_tail.run)."""
        return dict(weight_offset=self.weight_offset, scale_layout=self.scale_layout, scale_ue8m0=self.scale_ue8m0)


PATTERNS: Dict[str, Pattern] = {p.name: p for p in (
    Pattern("allreduce", tail=False),
    # residual + RMSNorm with each format's quantization (every format of the registry, in its order)
    *(Pattern("residual_rmsnorm" + (f"_{f.name}" if f.name else ""), f.name) for f in FORMATS),
    Pattern("residual_rmsnorm_fp8_out", "fp8", return_norm=True),
    Pattern("residual_rmsnorm_nvfp4_out", "nvfp4", return_norm=True),
    # DeepGEMM's layout for Blackwell's block-scaled GEMMs: MN-major, UE8M0 exponents packed 4 per int32.
    Pattern("residual_rmsnorm_fp8_block_ue8m0", "fp8_block", scale_layout="mn_major", scale_ue8m0=True),
    Pattern("residual_gemma_rmsnorm_fp8", "fp8", weight_offset=1.0),  # Gemma's RMSNorm scales by (1 + w)
    # Gemma 2 / 3's layer end: the sum normalised by post_attention_layernorm (or post_feedforward_layernorm)
    # before the residual add, then the next layer's input norm.
    Pattern("residual_gemma_post_rmsnorm", weight_offset=1.0, post=True),
    Pattern("residual_gemma_post_rmsnorm_fp8", "fp8", weight_offset=1.0, post=True),
)}


def _moe_name(k: int, form: str, quant: Optional[str], shared: bool = False) -> str:
    """moe[_finalize]_k<k>[_shared]_residual_rmsnorm[_<quant>]: what comes before the dense pattern's name."""
    return ("moe" + ("_finalize" if form == "finalize" else "") + f"_k{k}" + ("_shared" if shared else "")
            + "_residual_rmsnorm" + (f"_{quant}" if quant else ""))


MOE_KS = (2, 8)  # Mixtral-style top-2; DeepSeek-V3 / Qwen3-MoE-style top-8
MOE_QUANTS = (None, "fp8", "nvfp4")
# The MoE tail (the combine, the all-reduce, residual add, RMSNorm, quantization): both forms, both k,
# each quantization; and DeepSeek-V3's layer end (top-8 with a shared expert, FP8 for the next GEMMs).
_MOE = [Pattern(_moe_name(k, form, q), q, moe_k=k, moe_form=form)
        for form in ("reduce", "finalize") for k in MOE_KS for q in MOE_QUANTS]
_MOE.append(Pattern(_moe_name(8, "reduce", "fp8", shared=True), "fp8", moe_k=8, moe_shared=True))
MOE_PATTERNS = tuple(p.name for p in _MOE)
PATTERNS.update({p.name: p for p in _MOE})
PATTERN_GROUPS = {"moe": MOE_PATTERNS}  # --patterns moe: every MoE pattern
# The default --patterns: the computed-scale and Gemma patterns (the post-norm ones too) run on request only
# (each pattern costs a full sweep of shapes x dtypes x implementations).
DEFAULT_PATTERNS = ("allreduce", "residual_rmsnorm", "residual_rmsnorm_fp8", "residual_rmsnorm_nvfp4",
                    "residual_rmsnorm_fp8_out", "residual_rmsnorm_nvfp4_out")
# The dequant scales of the checked inputs (value = code * scale); they keep every code of the
# random rows in range, like the tests' inputs. The computed-scale kinds take none (case.scale None).
SCALES = {"fp8": 0.02, "nvfp4": 0.004}

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 8192)
DEFAULT_HIDDEN = (4096, 7168, 8192)
# --quick: one hidden size (torch.compile specialises on it), decode / small prefill / prefill.
QUICK_SHAPES = ((1, 8192), (64, 8192), (1024, 8192))
QUICK_SHAPES_CPU = ((1, 512), (64, 512))  # the CPU smoke run: the harness, not the numbers
QUICK_PATTERNS = ("allreduce", "residual_rmsnorm", "residual_rmsnorm_fp8", "residual_rmsnorm_nvfp4")
QUICK_COMPILE_PATTERN = "residual_rmsnorm_fp8"  # --quick compiles only this one (compile time)
# The MoE patterns' shapes where --shapes does not say: decode to prefill of 1024 tokens (y is k times the
# size of x) at the hidden sizes of Mixtral / Qwen3-MoE (4096) and DeepSeek-V3 (7168).
MOE_TOKENS = (1, 16, 64, 256, 1024)
MOE_HIDDEN = (4096, 7168)
MOE_QUICK_SHAPES = ((1, 7168), (64, 7168), (1024, 7168))
MOE_COMPILE_PATTERN = "moe_k8_residual_rmsnorm_fp8"  # --quick compiles only this one of the MoE patterns
MOE_PADDING_ROWS = 8  # the finalize form's rows: t * k expert rows among t * k + 8 (NaN padding, never read)

MAX_INPUT_SETS = 8  # rotate among up to this many input sets (cache effects, see _input_sets)
MIN_INPUT_SETS = 2  # and at least this many: the checked calls after the first read another set (see _input_sets)


def shapes_of(args, pattern: "Pattern") -> list:
    """The (tokens, hidden) shapes a pattern runs: --shapes for every pattern where given, else the
    dense default (args.shape_list) or the MoE patterns' (args.moe_shape_list)."""
    if pattern.is_moe:
        return list(getattr(args, "moe_shape_list", None) or args.shape_list)
    return list(args.shape_list)


@dataclass
class Result:
    """What one call produced: `a` for the plain all-reduce (or a floor row's output), else the
    tail's outputs (as commfuse.FusedResult; scales: the computed FP8 scales). An oracle's (oracle_tail)
    also holds the reference's norm where the pattern returns none (ref_norm): the gate judges the codes
    of a block whose scale differs from the oracle's by it; and a post-norm pattern's post-normed sum a'
    (post_normed), whose ulp bounds the residual's difference (tolerance.post_residual_within)."""

    a: Optional[torch.Tensor] = None
    residual: Optional[torch.Tensor] = None
    norm: Optional[torch.Tensor] = None
    quant: Optional[torch.Tensor] = None
    sf: Optional[torch.Tensor] = None
    scales: Optional[torch.Tensor] = None
    ref_norm: Optional[torch.Tensor] = None
    post_normed: Optional[torch.Tensor] = None

    @classmethod
    def of_tail(cls, tail) -> "Result":
        return cls(residual=tail[0], norm=tail[1], quant=tail[2], sf=tail[3], scales=tail[4])


@dataclass
class MoeInputs:
    """One input set of a MoE pattern, as Communicator.moe_all_reduce takes it: y T[t, k, h] (reduce
    form) or the permuted rows T[R, h] with row_index int32 [t, k] (finalize form); the routing weights
    float32 [t, k]; shared T[t, h] or None."""

    y: torch.Tensor
    weights: torch.Tensor
    row_index: Optional[torch.Tensor] = None
    shared: Optional[torch.Tensor] = None

    def combine(self) -> torch.Tensor:
        """The oracle's combine of these inputs (commfuse.reference.moe_reduce / moe_finalize)."""
        if self.row_index is None:
            return reference.moe_reduce(self.y, self.weights, self.shared)
        return reference.moe_finalize(self.y, self.row_index, self.weights, self.shared)


@dataclass
class Case:
    """One (pattern, dtype, tokens, hidden) with this rank's inputs and the oracle's outputs.

    sets[i] = (x, residual) of input set i; set 0 is the checked one: x = xs[rank].
    expected: the oracle for collective rows (tail of the exact sum of all ranks' x); candidates,
    any of which passes (on > 2 ranks also the tail of the backend's own sum, see make_case).
    expected_tail: the oracle for tail-only rows (tail of this rank's x, no collective).
    moe (MoE patterns): moe[i] = this rank's MoeInputs of input set i; sets[i]'s x is their combine
    (the oracle's), so the dense rows' view of a case (x, residual) holds for them too. moe_ranks[i]: every
    rank's MoeInputs of set i, for rows that combine by other semantics than the oracle's (a peer's).
    later: (expected, expected_tail) of sets 1, 2, ... (oracle(i)).
    post_weight: the post-norm's weight T[h] of a post pattern (every rank's the same), else None.
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
    post_weight: Optional[torch.Tensor] = None
    moe: Optional[list] = None
    moe_ranks: Optional[list] = None
    later: list = field(default_factory=list)

    def oracle(self, i: int) -> tuple:
        """(expected, expected_tail) of input set i: what a call on input_set(i) is judged against."""
        i %= len(self.sets)
        return (self.expected, self.expected_tail) if i == 0 else self.later[i - 1]

    def tail_args(self) -> tuple:
        """reference.fused_tail's arguments after (a, residual), positional."""
        return tail_args(self.pattern, self.weight, self.eps, self.scale, self.post_weight)

    def input_set(self, i: int) -> tuple:
        return self.sets[i % len(self.sets)]

    def moe_set(self, i: int) -> "MoeInputs":
        return self.moe[i % len(self.moe)]


def tail_args(p: Pattern, weight: torch.Tensor, eps: float, scale: Optional[torch.Tensor],
              post_weight: Optional[torch.Tensor] = None) -> tuple:
    return (weight, eps, p.quant, scale, p.return_norm, SF_LAYOUT, p.weight_offset, p.scale_layout, p.scale_ue8m0,
            post_weight)


def oracle_tail(a: torch.Tensor, residual: Optional[torch.Tensor], p: Pattern, weight: torch.Tensor, eps: float,
                scale: Optional[torch.Tensor], post_weight: Optional[torch.Tensor] = None) -> Result:
    """reference.fused_tail's outputs of the pattern (with the post-norm of post_weight where given), with the
    norm kept as ref_norm and the post-normed sum as post_normed (see Result)."""
    full = reference.fused_tail(a, residual, weight, eps, p.quant, scale, True, SF_LAYOUT, p.weight_offset,
                                p.scale_layout, p.scale_ue8m0, post_weight)
    post_normed = None if post_weight is None else reference.rmsnorm(a, post_weight, eps, p.weight_offset)
    return Result(residual=full.residual, norm=full.norm if p.has_norm else None, quant=full.quant,
                  sf=full.scale_factors, scales=full.scales, ref_norm=full.norm, post_normed=post_normed)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _input_sets(ctx: Ctx, t: int, h: int, dtype: torch.dtype, per_set: Optional[int] = None) -> int:
    """How many input sets to rotate among so that the inputs of consecutive calls are not all in
    the last-level cache (2 x its size, docs/benchmarking.md), capped at MAX_INPUT_SETS; per_set: the
    bytes of one set (default x and residual). Decode sizes stay cache resident even so; in a model
    they are too (the GEMM that made x has just written it). Never fewer than MIN_INPUT_SETS, however
    large a set: the gate's second call and the check after the timing must read inputs other than the
    first call's, or a call that does no work (returning its first outputs again) would pass them."""
    if ctx.cuda:
        l2 = getattr(torch.cuda.get_device_properties(ctx.device), "L2_cache_size", 50 << 20)
    else:
        l2 = 32 << 20
    per_set = per_set or 2 * t * h * dtype.itemsize
    return max(MIN_INPUT_SETS, min(MAX_INPUT_SETS, math.ceil(2 * l2 / per_set)))


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

    # Every input set is drawn for every rank (the same draws on each), so that each set's oracle is the sum
    # of different inputs: a row that skipped the exchange on its later calls would fail their checks.
    moe = moe_all = None
    if pattern.is_moe:
        moe_all, draws = [], []
        for _ in range(_input_sets(ctx, t, h, dtype, _moe_set_bytes(pattern, t, h, dtype))):
            ranks, r = _moe_draws(ctx, pattern, t, h, dtype, randn, gen, gen_dev)
            moe_all.append(ranks)
            draws.append(([m.combine() for m in ranks], r))  # each rank's contribution to the all-reduce
        moe = [ranks[ctx.rank] for ranks in moe_all]
        weight = (1 + 0.1 * randn(h)).to(dtype)
    else:
        def draw():
            xs = []
            for _ in range(ctx.world):
                x = randn(t, h)
                x[0] *= 40  # one large row per rank: norms and NVFP4 scale factors span a wide range
                xs.append(x.to(dtype))
            return xs, randn(t, h).to(dtype)
        draws = [draw()]
        weight = (1 + 0.1 * randn(h)).to(dtype)
        draws += [draw() for _ in range(_input_sets(ctx, t, h, dtype) - 1)]
    # The post-norm's weight: 0.1 randn about 1 - weight_offset, so that it scales by about 1 as a checkpoint's
    # does (Gemma stores the w of 1 + w, about 0). The post-normed sum is then of the residual's order, as in a
    # model, and both terms of the residual's tolerance, ulp(a') + ulp(r), count.
    post = ((1.0 - pattern.weight_offset) + 0.1 * randn(h)).to(dtype) if pattern.post else None
    sets = [(xs[ctx.rank], r) for xs, r in draws]
    scale = (torch.tensor([SCALES[pattern.quant]], dtype=torch.float32, device=dev)
             if pattern.quant in SCALES else None)
    eps = ctx.args.eps

    # The exact semantics: fp32 sum in rank order, rounded once. NCCL (and gloo) sum in T in their
    # own order; for 2 ranks that is one addition (the same bits), beyond that the semantics accept
    # the backend's order on its path (docs/semantics.md): the tail is then also judged against the
    # oracle fed the backend's own sum (computed here, on every rank, because it is a collective) where
    # that sum is itself within world-size ulps of the exact one (a wrong backend sum would otherwise be its
    # own oracle), and the plain sum within world-size ulps.
    own_order = ctx.world > 2

    def oracle(xs, residual) -> tuple:
        exact = reference.all_reduce_sum(xs)
        sums = [exact]
        if own_order:
            a = xs[ctx.rank].clone()
            dist.all_reduce(a)
            if tolerance.within_ulp(a, exact, ctx.world, "the backend's sum") is None:
                sums.append(a)
        if not pattern.tail:
            return [Result(a=exact)], None
        return ([oracle_tail(s, residual, pattern, weight, eps, scale, post) for s in sums],
                oracle_tail(xs[ctx.rank], residual, pattern, weight, eps, scale, post))

    expected, expected_tail = oracle(*draws[0])
    later = [oracle(*d) for d in draws[1:]]
    return Case(pattern, dname, dtype, t, h, sets, weight, scale, eps, expected, expected_tail,
                sum_ulps=ctx.world if own_order else 0, post_weight=post, moe=moe, moe_ranks=moe_all, later=later)


def _moe_draws(ctx: Ctx, pattern: Pattern, t: int, h: int, dtype: torch.dtype, randn, gen,
               gen_dev) -> Tuple[list, torch.Tensor]:
    """One MoE input set of every rank: ([MoeInputs of each rank], residual).

    As in tensor parallelism, the routing is the ranks' common knowledge (one weights, one row_index)
    and the expert outputs are each rank's partial sums: y (and shared) differ per rank. y is standard
    normal with token 0's expert outputs scaled by 40 (as the dense cases' first row); the weights
    are a softmax over the k slots (top-k renormalised, float32); the finalize form's row_index is a
    random injection of the t x k slots into R = t k + MOE_PADDING_ROWS rows, the other rows NaN (a
    combine that reads a padding row fails the gate)."""
    k, dev = pattern.moe_k, ctx.device
    weights = torch.softmax(randn(t, k), dim=-1)
    row_index = None
    if pattern.moe_form == "finalize":
        rows = t * k + MOE_PADDING_ROWS
        row_index = torch.randperm(rows, generator=gen, device=gen_dev)[: t * k].view(t, k).to(torch.int32).to(dev)
    out = []
    for _ in range(ctx.world):
        y = randn(t, k, h)
        y[0] *= 40
        y = y.to(dtype)
        if row_index is not None:
            rows_ = torch.full((t * k + MOE_PADDING_ROWS, h), float("nan"), dtype=dtype, device=dev)
            rows_[row_index.long().view(-1)] = y.view(t * k, h)
            y = rows_
        shared = randn(t, h).to(dtype) if pattern.moe_shared else None
        out.append(MoeInputs(y, weights, row_index, shared))
    return out, randn(t, h).to(dtype)


def _moe_set_bytes(pattern: Pattern, t: int, h: int, dtype: torch.dtype) -> int:
    """One MoE input set's bytes: the expert rows, weights, row_index, shared, residual and the combined x."""
    k = pattern.moe_k
    rows = t * k + (MOE_PADDING_ROWS if pattern.moe_form == "finalize" else 0)
    indices = 4 * t * k * (1 + (pattern.moe_form == "finalize"))  # float32 weights, int32 row_index
    return (rows * h + t * h * (2 + pattern.moe_shared)) * dtype.itemsize + indices


def tail_bytes(pattern: Pattern, t: int, h: int, itemsize: int) -> int:
    """The fewest bytes the tail moves: read a, residual, weight (and a post pattern's post weight); write
    every output once (the layouts' padding included, which is written too). A MoE pattern's tail starts at
    the combine: in place of a it reads each token's k expert rows once (t k h elements, in either form), the
    float32 weights [t, k], the int32 row_index [t, k] (finalize form) and the shared expert's output (where
    it has one)."""
    outputs = pattern.spec.outputs(t, h, torch.float16 if itemsize == 2 else torch.float32)
    written = sum(o.storage_numel * o.dtype.itemsize for o in outputs if o)
    if pattern.is_moe:
        k = pattern.moe_k
        indices = 4 * t * k * (1 + (pattern.moe_form == "finalize"))  # float32 weights, int32 row_index
        read = (t * k * h + t * h * (1 + pattern.moe_shared) + h) * itemsize + indices
        return read + written
    return (2 * t * h + h * (1 + pattern.post)) * itemsize + written


# ------------------------------------------------------------------------------- correctness gate

def check(res: Result, exp: Result, pattern: Pattern, sum_ulps: int = 0, exact_residual: bool = False,
          scale: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
          eps: float = 0.0) -> Optional[str]:
    """Why `res` violates the tolerances (commfuse.tolerance) against the oracle `exp`, None when it
    does not: the plain all-reduce within sum_ulps of T, a tail as tolerance.tail_mismatch (scale: the
    case's, with exp.ref_norm for the codes of blocks whose scale differs); exact_residual (commfuse's
    rows): the residual's bits too, as the tests hold them (one rounded addition).
    A post pattern's row is held so only where exact_residual and its residual is on the CPU (commfuse's
    separated route there: the reference's ops, so its bits); any other to docs/semantics.md section 2a's
    tolerances (check_post, with the case's weight and eps): a post-norm kernel's a' may be an ulp off."""
    if not pattern.tail:
        return tolerance.within_ulp(res.a, exp.a, sum_ulps, "all-reduce sum")
    if pattern.post and not (exact_residual and res.residual is not None and res.residual.device.type == "cpu"):
        return check_post(res, exp, pattern, weight, eps, scale)
    if exact_residual and res.residual is not None and exp.residual is not None:
        why = tolerance.within_ulp(res.residual, exp.residual.to(res.residual.device), 0, "residual")
        if why:
            return why
    return tolerance.tail_mismatch(Tail(res.residual, res.norm, res.quant, res.sf, res.scales),
                                   Tail(exp.residual, exp.norm, exp.quant, exp.sf, exp.scales), pattern.quant,
                                   SF_LAYOUT, scale_layout=pattern.scale_layout, scale_ue8m0=pattern.scale_ue8m0,
                                   norm=exp.ref_norm, scale=scale)


def check_post(res: Result, exp: Result, pattern: Pattern, weight: torch.Tensor, eps: float,
               scale: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why a post pattern's `res` violates docs/semantics.md section 2a's tolerances (None when it does not), as
    the kernel tests hold the post-norm kernel: the residual within ulp(a') + ulp(r) of the oracle's
    (tolerance.post_residual_within, a' the oracle's post-normed sum: a post-norm an ulp off moves the sum by as
    much); the norm and quantization those of the row's own residual (the reference's tail of it without a
    residual, with weight, eps and the case's scale) within tolerance.tail_mismatch's tolerances."""
    why = tolerance.post_residual_within(res.residual, exp.residual, exp.post_normed, "residual")
    if why:
        return why
    own = oracle_tail(res.residual, None, pattern, weight, eps, scale)
    # The residual, judged above, on both sides: it passes, and gives the comparison its device.
    got = Tail(res.residual, res.norm, res.quant, res.sf, res.scales)
    want = Tail(res.residual, own.norm, own.quant, own.sf, own.scales)
    return tolerance.tail_mismatch(got, want, pattern.quant, SF_LAYOUT, scale_layout=pattern.scale_layout,
                                   scale_ue8m0=pattern.scale_ue8m0, norm=own.ref_norm, scale=scale)


def gate(ctx: Ctx, step, mismatch: Callable[[Result, int], Optional[str]]) -> Tuple[Verdict, Optional[Result]]:
    """The row's checked calls: step.checked_calls of them, the first on input set 0, the second on set 1
    (another set's inputs: a call that returned the first's outputs again, or is right on one set only,
    fails), each after step.poison() where the row owns its outputs (impls.Step); mismatch(result, i)
    says why a result on set i is wrong (None: right). Returns (verdict, the last result); the caller
    keeps it alive until every row is gated."""
    res = None
    for i in range(step.checked_calls):
        which = "the checked call" if step.checked_calls == 1 else f"checked call {i + 1}"
        try:
            if step.poison is not None:
                step.poison()
            res = step.result(step.call(i))
            if ctx.cuda:
                torch.cuda.synchronize()
        except Exception as e:
            verdict, res = failed(which, e), None
        else:
            why = judge(mismatch, res, i)
            verdict = OK if why is None else Verdict(Kind.REJECTED,
                                                     why if i == 0 else f"{which} (input set {i}): {why}")
        if i + 1 < step.checked_calls:
            # Every rank makes the next call (a collective) or none: a rank that stopped here alone would leave
            # its peers waiting in it. The caller agrees on the last.
            verdict = agree(ctx.world, verdict)
        if not verdict.ok:
            return verdict, res
    return OK, res


def judge(mismatch: Callable[[Result, int], Optional[str]], res: Result, i: int) -> Optional[str]:
    """mismatch(res, i), with an error in comparing said as the reason."""
    try:
        return mismatch(res, i)
    except Exception as e:  # e.g. not a Result, or tensors on the wrong device
        return f"output not comparable with the oracle ({type(e).__name__}: {short(e)})"
