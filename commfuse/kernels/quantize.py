"""The quantize kernel (csrc/quantize.cu): commfuse.local's quantize, x alone through the tail's
quantization (every format but None of commfuse.tail.formats, every scale layout) in one kernel.

Semantics: commfuse.reference.quantize of x (docs/semantics.md sections 4-5 and 10-13); the kernel
runs the code that quantizes the tail's T-rounded norm, so the codes and scales are the tail's bit for
bit. Launch configuration: one CTA per row (plus the padding rows of the scale storage, as
fused_tail); the row lives in registers as in the gated RMSNorm kernel (launch_config: fused_tail's
register_config, with more threads a row for many rows of FP8), so h <= MAX_HIDDEN = 16384; longer rows take
the separated ops (commfuse.routes says so). At few rows (splits) a row longer than WHOLE_HIDDEN is cut into slices of up to SLICE elements, a CTA each, VPT 1: one
SM alone issues a row's loads and stores one after another.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..tail.formats import FORMATS, Format
from ..tail.spec import TailSpec
from . import fused_tail, params
from .family import CTYPE, Family, Limits
from .launch import X, LaunchPlan, slice_vectors, tail_fields, tail_patches, whole_warps

__all__ = ["QUANTIZE", "variants", "warmup", "launch_config", "splits", "MAX_HIDDEN"]

SOURCE = "quantize.cu"
VPT_BUCKETS = (1, 2, 4)
MAX_THREADS = {v: fused_tail.MAX_THREADS[v] for v in VPT_BUCKETS}  # kMaxThreads<VPT> in quantize.cu
MAX_HIDDEN = 8 * max(v * MAX_THREADS[v] for v in VPT_BUCKETS)
VPT2_ELEMENTS = {"fp8": None, "nvfp4": 1 << 22}  # formats whose many-row calls take VPT 2, up to these elements
SLICE = 1024        # elements a CTA at most where splits cuts rows
MAX_SPLIT = 8       # CTAs a row at most
SPLIT_CTAS = 128    # the most CTAs a call's rows take when cut (about an H100's or H200's multiprocessors)
WHOLE_HIDDEN = 4096  # rows of at most this many elements stay whole
MANY_TOKENS = 1 << 16  # a token count past every size rule (configs: the variants warmup loads)


def launch_config(hidden: int, tokens: int, spec: TailSpec) -> Tuple[int, int]:
    """(vpt, threads) of `tokens` whole rows of `hidden`: fused_tail.register_config, except that from
    fused_tail.LATENCY_TOKENS rows static FP8 (and NVFP4 up to 2^22 elements) take VPT 2, twice register_config's
    threads a row: more warps in flight for a kernel that only loads, converts and stores. H100, bf16, graph us,
    VPT 4 (register_config) / 2: FP8 256 x 4096 2.16-2.26 / 1.95, 1024 x 4096 5.00-5.12 / 3.77, 1024 x 8192
    6.28-6.44 / 5.90, 8192 x 8192 68.1-68.7 / 67.7; NVFP4 256 x 4096 3.32 / 2.91, 1024 x 4096 8.11-8.24 / 6.84,
    but 1024 x 8192 11.75-11.93 / 12.11 and 8192 x 8192 81.9-82.7 / 89.9 (its software e2m1 keeps the ALUs
    busy: more elements a thread amortise the block scales' work). Other formats: not measured, register_config."""
    vpt, threads = fused_tail.register_config(hidden, tokens)
    if spec.quant not in VPT2_ELEMENTS or tokens < fused_tail.LATENCY_TOKENS:
        return vpt, threads
    most = VPT2_ELEMENTS[spec.quant]
    if most is not None and tokens * hidden > most:
        return vpt, threads
    return 2, whole_warps(-(-hidden // 16))



def splits(hidden: int, tokens: int, spec: TailSpec) -> int:
    """CTAs per row: for rows longer than WHOLE_HIDDEN, ceil(hidden / SLICE), at most MAX_SPLIT, where the
    tokens' rows cut so take at most SPLIT_CTAS CTAs; else 1. Never for a format whose one scale spans the row
    (its amax is the row's: block 0). H200, bf16, us, one CTA a row / cut: FP8 1 x 8192 1.46 / 1.30-1.39
    (Inductor 1.34-1.38), 1 x 7168 1.42 / 1.32-1.35, 16 x 8192 1.54 / 1.42-1.45; NVFP4 1 x 8192 2.54 / 1.88,
    16 x 8192 2.68 / 1.87; at 64 x 7168 one CTA a row stays ahead (FP8 1.54 against 1.67 over 4), hence
    SPLIT_CTAS; at h 4096 and below cut rows were level or slower (MXFP8 1 x 4096 1.49 / 1.70; 3 x 2944 FP8
    1.21 / 1.32), hence WHOLE_HIDDEN."""
    if spec.format.block == 0 or hidden <= WHOLE_HIDDEN:
        return 1
    split = min(MAX_SPLIT, -(-hidden // SLICE))
    return split if split > 1 and tokens * split <= SPLIT_CTAS else 1


def cut_config(hidden: int, tokens: int, spec: TailSpec) -> Tuple[int, int, int]:
    """(vpt, threads, split) of `tokens` rows of `hidden`: a cut row's slice at VPT 1, else launch_config."""
    split = splits(hidden, tokens, spec)
    if split == 1:
        return (*launch_config(hidden, tokens, spec), 1)
    return 1, whole_warps(slice_vectors(hidden // 8, split)), split


class Quantize(Family):
    name = "quantize"
    source = SOURCE
    limits = Limits(max_hidden=MAX_HIDDEN)

    def name_expression(self, dtype: torch.dtype, fmt: Format, vpt: int) -> str:
        return f"commfuse::quantize<{CTYPE[dtype]}, {fmt.id}, {vpt}>"

    def variants(self) -> List[str]:
        return [self.name_expression(d, f, v) for d in CTYPE for f in FORMATS if f.name for v in VPT_BUCKETS]

    def configs(self, dtype, spec, hidden):
        if not 0 < hidden <= MAX_HIDDEN:
            raise ValueError(f"no quantize kernel for hidden={hidden} (at most {MAX_HIDDEN})")
        # Rows cut (VPT 1), rows too many to cut but few, many rows (VPT 2 for FP8), more (NVFP4's VPT 4).
        return [self.name_expression(dtype, spec.format, cut_config(hidden, t, spec)[0])
                for t in (1, SPLIT_CTAS, fused_tail.LATENCY_TOKENS, MANY_TOKENS)]

    def plan(self, dtype: torch.dtype, t: int, h: int, spec: TailSpec, device_index: int) -> LaunchPlan:
        """The LaunchPlan of t rows of h: x (the call's source X) is FusedTailParams' input a; the outputs
        are the spec's without residual and norm (quant, scale_factors, scales)."""
        launches = ()
        if t:
            vpt, threads, split = cut_config(h, t, spec)
            blob = params.FUSED_TAIL.pack(0, *tail_fields(spec, t, h), 0)
            patches = [(params.FUSED_TAIL.offsets["a"], X, 0)] + tail_patches(params.FUSED_TAIL.offsets["tail"])
            launches = (self.row_launch(dtype, spec, t, vpt, threads, blob, patches, device_index, split),)
        return LaunchPlan(self.name, launches, tuple(spec.outputs(t, h, dtype, residual=False)), device_index)


QUANTIZE = Quantize()


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    return QUANTIZE.variants()


def warmup(dtype: torch.dtype, quant: str, hidden: int, device=None) -> None:
    """Compile and load the variants quantize calls of (dtype, quant, hidden) use, any number of tokens,
    on `device` (default: current), so later calls can be captured in a CUDA graph."""
    QUANTIZE.warmup(dtype, TailSpec.of(quant), hidden, device)
