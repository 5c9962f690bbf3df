"""The fused MoE tail (fused_tail.cu's moe_tail): Communicator.moe_all_reduce at world size 1, where the
all-reduce of one rank is the identity: each token's expert combine (csrc/moe.cuh, as the combine kernel
computes it) read as the tail's input, then residual add, RMSNorm and the quantization of any format, in
one kernel. Semantics: reference.fused_tail(reference.moe_reduce / moe_finalize(...), residual, ...).

Launch configuration: fused_tail's (one CTA per row plus the scale storage's padding rows; VPT from
fused_tail.launch_config, the looped variant for long rows) but with fewer vectors a thread from
fused_tail.LATENCY_TOKENS to WIDE_TOKENS rows (launch_config), and for few tokens on SM 9.0+ (the VPT 1
variant, more than SPLIT_ELEMENTS expert elements a token) each token's row goes to a thread-block cluster
of `split` CTAs (up to 8, while the t * split CTAs fit the SMs), each running the tail on its slice of the
row (slice_vectors), the sum of squares added over the cluster: one SM alone does not read the k expert
rows at the HBM's pace (csrc/fused_tail.cu). The VPT 1 variants come also built for each k of SLOTS (the combine
unrolled for that k, the token's k rows loaded at once), where slot_variant_fits; in the finalize form every VPT 1
variant guesses the row index before the programmatic-launch wait (all k slots of one built for k, the first 4 of one
for any k: csrc/moe.cuh's guess_rows). The kernels read the routing weights (float32 or T, a plan field) and the row
index (int32 or int64, the variant's form) as given.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from ..tail.formats import FORMATS, Format
from ..tail.spec import TailSpec
from . import fused_tail, native, params
from .family import CTYPE, Family, Limits
from .launch import ROW_INDEX, SHARED, X, Z, Launch, LaunchPlan, slice_vectors, tail_fields, tail_patches, whole_warps
from .moe_combine import FORMS, fields, form_of

__all__ = ["MOE_TAIL", "MAX_SPLIT", "variants", "launch_config", "combine_patches", "launcher", "run", "warmup"]

SOURCE = fused_tail.SOURCE
WIDE_TOKENS = 512  # below this many rows (from fused_tail.LATENCY_TOKENS), launch_config's wide rule
WIDE_VPT1_THREADS = 512  # that rule's VPT 1 threads at most (a row of up to 4096 elements)


def launch_config(hidden: int, tokens: int) -> Tuple[int, int]:
    """(vpt, threads) of the MoE tail for `tokens` rows of `hidden`: fused_tail.launch_config's, but from
    fused_tail.LATENCY_TOKENS to WIDE_TOKENS rows VPT 1 up to WIDE_VPT1_THREADS threads, then VPT 2: a
    thread's k expert rows are a chain of loads a vector, and at 256 rows the throughput
    rule's 4 vectors a thread left the HBM idle. H200, bf16, one CTA a token, us, fused_tail's rule / this
    (reduction form; finalize): k 8, [256, 4096] 6.56 / 5.17 (VPT 1; 8.40 / 6.22), [256, 7168] 10.54 / 8.74
    (VPT 2; 13.55 / 10.61); k 2, [256, 4096] 4.60 / 3.84. At [384, 7168] it is mixed (k 2 8.68 / 7.77, finalize
    10.77 / 9.35; k 8 19.32 / 19.71, finalize 21.60 / 23.16); from 512 rows the throughput rule is level or ahead
    (k 2, [512, 7168] 9.27 against 9.74 at VPT 2; [1024, 7168] 21.50 against 24.17; k 8 43.47 / 43.29).
    VPT 1 rather than 2 at [256, 4096]: k 8 5.17 against 5.50 (finalize 6.22 / 6.56), k 2 level."""
    if fused_tail.LATENCY_TOKENS <= tokens < WIDE_TOKENS:
        vectors = hidden // 8
        vpt = 1 if vectors <= WIDE_VPT1_THREADS else 2
        if -(-vectors // vpt) <= fused_tail.MAX_THREADS[vpt]:
            return vpt, whole_warps(-(-vectors // vpt))
    return fused_tail.launch_config(hidden, tokens)


def combine_patches(base: int) -> list:
    """The patches of a MoeCombineParams at byte `base` of a struct: y is the call's source X, the weights Z,
    then its row index and shared expert (0 where the call has none); the output x is unused (0)."""
    off = params.MOE_COMBINE.offsets
    return [(base + off["y"], X, 0), (base + off["weights"], Z, 0), (base + off["row_index"], ROW_INDEX, 0),
            (base + off["shared"], SHARED, 0)]


class MoeTail(Family):
    name = "moe_tail"
    source = SOURCE
    limits = Limits(world_sizes=frozenset({1}))

    def name_expression(self, dtype: torch.dtype, form: int, fmt: Format, vpt: int, slots: int = 0) -> str:
        """slots: the k the variant is built for (one of SLOTS, VPT 1 only), 0 for any k."""
        return f"commfuse::moe_tail<{CTYPE[dtype]}, {form}, {fmt.id}, {vpt}, {slots}>"

    def variants(self) -> List[str]:
        return [self.name_expression(d, form, f, v, s) for d in CTYPE for form in FORMS.values() for f in FORMATS
                for v in fused_tail.VPT_BUCKETS + (0,) for s in variant_slots(v)]

    def configs(self, dtype, spec, hidden):
        vpts = {launch_config(hidden, t)[0] for t in (1, fused_tail.LATENCY_TOKENS, WIDE_TOKENS)}
        return [self.name_expression(dtype, form, spec.format, vpt, s) for form in FORMS.values()
                for vpt in sorted(vpts) for s in variant_slots(vpt)]

    def plan(self, dtype: torch.dtype, weights_dtype: torch.dtype, index_dtype: Optional[torch.dtype], t: int, k: int,
             h: int, rows: int, spec: TailSpec, device_index: int, split: Optional[int] = None) -> LaunchPlan:
        """The LaunchPlan of t tokens of k slots (combine_patches' sources) with routing weights of
        weights_dtype and a row index of index_dtype (None: the reduction form). split: CTAs per token
        (default ctas_per_token; more than 1 only for the VPT 1 variant on SM 9.0+)."""
        launches = ()
        if t:
            vpt, threads = launch_config(h, t)
            if split is None:
                split = self.ctas_per_token(t, k, h, vpt, device_index)
            elif split > 1 and (vpt != 1 or not clusters(device_index) or split > MAX_SPLIT):
                raise ValueError(f"split {split} needs the VPT 1 variant (got {vpt}), SM 9.0+ and <= {MAX_SPLIT}")
            per = slice_vectors(h // 8, split)
            if split > 1:  # a CTA a slice: a thread a vector of it
                threads = whole_warps(per)
            blob = params.MOE_TAIL.pack(*fields(t, k, h, rows, weights_dtype, dtype), *tail_fields(spec, t, h), per, 0)
            patches = combine_patches(params.MOE_TAIL.offsets["combine"]) + tail_patches(params.MOE_TAIL.offsets["tail"])
            fits = slot_variant_fits(k, t * split, threads, device_index)
            slots = k if k in variant_slots(vpt) and fits else 0
            kernel = self.kernel(self.name_expression(dtype, form_of(index_dtype), spec.format, vpt, slots),
                                 device_index)
            # split CTAs a token, then one a padding row, rounded up to whole clusters (the kernel maps them).
            grid = t * split + -(-(spec.row_slots(t) - t) // split) * split
            launches = (Launch(kernel, grid, threads, blob, tuple(patches), split),)
        return LaunchPlan(self.name, launches, tuple(spec.outputs(t, h, dtype, True)), device_index, combine=True)

    @staticmethod
    def ctas_per_token(t: int, k: int, h: int, vpt: int, device_index: int) -> int:
        """CTAs per token: for the VPT 1 variant on SM 9.0+ and tokens of more than SPLIT_ELEMENTS expert
        elements (k * h), the most (a power of 2 up to MAX_SPLIT) whose t * split CTAs fit the SMs at once;
        else 1. H200, the reduction form, us over 1 / 2 / 4 / 8 CTAs (launch/tail_sweep.py --moe, the sum
        exchanged by st.async): k 8, h 7168: 32 tokens 4.36 / 3.83 / 3.53 / 3.25, 64 tokens 4.50 / 3.96 / 4.40 /
        5.22, 128 tokens 4.93 / 5.24 / 6.01 / 6.36; k 8, h 4096: 1 token 3.05 / 2.71 / 2.45 / 2.45, 64 tokens
        3.38 / 3.09 / 3.28 / 3.56; k 2, h 7168: 64 tokens 3.35 / 3.08 / 3.26 / 3.90. At 32 tokens 8 CTAs (two
        an SM) beat the rule's 4 by 8%, at 64 tokens 4 lose to 2: left as it is."""
        if vpt != 1 or k * h <= SPLIT_ELEMENTS or not clusters(device_index):
            return 1
        sms = multiprocessors(device_index)
        split = 1
        while split < MAX_SPLIT and t * split * 2 <= sms:
            split *= 2
        return split


# The k of the VPT 1 variants built for one number of slots a token (csrc/moe.cuh's combine_vec, K), the top-k of
# the common MoE models (Llama 4: 1; Mixtral: 2; gpt-oss: 4; DeepSeek-V2: 6; Qwen3, DeepSeek-V3: 8): their combine
# loop unrolled, the slots past k gone at compile time, the token's k rows loaded at once, and in the finalize form
# the row index guessed before the programmatic-launch wait (moe.cuh's guess_rows). A token's row at few tokens is a
# chain of dependent instructions and memory round trips at one or two warps a scheduler, so each one left out is
# time. H100, graph us (bench/journal.md, sessions 53 and 55), any k / built for k as in session 53 (chunks of 4
# slots) / now: k 8 1 x 4096 2.52 / 2.16 / 1.89, 16 x 7168 - / 2.57 / 2.51; finalize k 8 1 x 4096 2.65 / 2.55 / 1.93,
# 16 x 4096 - / 2.65 / 2.15, 1 x 7168 - / 2.61 / 2.00; k 2 1 x 4096 2.08 / 1.76. The other k take the variants for
# any k, as do k 6 and 8 where slot_variant_fits says no.
SLOTS = (1, 2, 4, 6, 8)


def variant_slots(vpt: int) -> tuple:
    """The slots of the variants of `vpt`: 0 (any k), and SLOTS for VPT 1."""
    return (0,) + SLOTS if vpt == 1 else (0,)


# The CTA bound of the variants built for more than COMBINE_CHUNK slots (fused_tail.cu's kMoeMaxThreads): a token's k
# rows, weights and indices in flight at once take up to 116 registers a thread (k 8 spilled under the 64 of 1024
# threads). COMBINE_CHUNK: csrc/moe.cuh's kCombineChunk, the slots in flight at once for any k; the variants for at
# most that many slots keep the bound of 1024 threads.
SLOT_THREADS = 256
COMBINE_CHUNK = 4


def slot_variant_fits(k: int, ctas: int, threads: int, device_index: int) -> bool:
    """Whether a launch of `ctas` CTAs of `threads` takes the variant built for k slots (k in SLOTS): for k up to
    COMBINE_CHUNK always; for more, at most SLOT_THREADS a CTA, and CTAs that fit the SMs one each, where their
    registers cost no CTA its place. H100, graph us, bf16, the variant for any k / for 8 slots (bound 512 threads):
    64 x 7168 (split 2, 448 threads a CTA) k 8 5.28 / 5.36, finalize 5.83 / 6.14 (no guess); 256 x 4096 (256 CTAs of
    512 threads, one an SM) k 8 9.69 / 11.23, finalize 10.26 / 12.96 (bench/journal.md, session 55)."""
    if k <= COMBINE_CHUNK:
        return True
    return threads <= SLOT_THREADS and ctas <= multiprocessors(device_index)


@functools.lru_cache(maxsize=None)
def multiprocessors(device_index: int) -> int:
    """The SMs of CUDA device `device_index`."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MAX_SPLIT = 8  # CTAs per cluster that every SM 9.0+ GPU schedules (the portable cluster size)


# The most expert elements a token (k * h) left unsplit. Since the cluster's sum went from a cluster barrier to
# st.async (csrc/cluster.cuh), k 2 x h 4096 (8192) wins split too: H200, us unsplit / over ctas_per_token's
# split, 1 token 2.29 / 2.02 over 8 (the permuted-rows form 2.78 / 2.24-2.35), 16 tokens 2.44 / 2.16-2.30 over 8
# (2.11-2.20 over 4), 64 tokens 2.53 / 2.43-2.51 over 2; k 1 x h 7168 won over 8 (3.26 / 2.70). Tokens of fewer
# elements are not measured split.
SPLIT_ELEMENTS = 4096


def clusters(device_index: int) -> bool:
    """Whether the device launches thread-block clusters (SM 9.0+)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


MOE_TAIL = MoeTail()


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    return MOE_TAIL.variants()


def warmup(dtype: torch.dtype, quant: Optional[str], hidden: int, device=None) -> None:
    """Compile and load the variants world-1 moe_all_reduce calls of (dtype, quant, hidden) may launch, every
    form, any number of tokens, on `device` (default: current), so later calls can be captured."""
    MOE_TAIL.warmup(dtype, TailSpec.of(quant), hidden, device)


@functools.lru_cache(maxsize=4096)
def launcher(dtype: torch.dtype, weights_dtype: torch.dtype, index_dtype: Optional[torch.dtype], t: int, k: int,
             h: int, rows: int, spec: TailSpec, device_index: int):
    """The launcher (commfuse.kernels.native) of MOE_TAIL's plan of this signature, made once:
    launcher(y, residual, weight, scale, out, weights, row_index, shared) -> the five outputs."""
    return native.launcher(MOE_TAIL.plan(dtype, weights_dtype, index_dtype, t, k, h, rows, spec, device_index))


def run(y, weights, row_index, shared, residual, weight, scale, spec: TailSpec, out=None) -> tuple:
    """The five outputs (reference.Tail's order) of checked CUDA tensors that MOE_TAIL accepts (commfuse.moe
    plans it); out as for Communicator.fused_all_reduce."""
    t, k = weights.shape
    index_dtype = None if row_index is None else row_index.dtype
    run_ = launcher(y.dtype, weights.dtype, index_dtype, t, k, y.shape[-1], 0 if row_index is None else y.shape[0],
                    spec, y.device.index)
    return run_(y, residual, weight, scale, out, weights, row_index, shared)
