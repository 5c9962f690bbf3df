"""The quantize kernel (csrc/quantize.cu): commfuse.local's quantize, x alone through the tail's
quantization (every format but None of commfuse.tail.formats, every scale layout) in one kernel.

Semantics: commfuse.reference.quantize of x (docs/semantics.md sections 4-5 and 10-13); the kernel
runs the code that quantizes the tail's T-rounded norm, so the codes and scales are the tail's bit for
bit. Launch configuration: one CTA per row (plus the padding rows of the scale storage, as
fused_tail); the row lives in registers as in the gated RMSNorm kernel (fused_tail.register_config),
so h <= MAX_HIDDEN = 16384; longer rows take the separated ops (commfuse.routes says so).
"""
from __future__ import annotations

from typing import List

import torch

from ..tail.formats import FORMATS, Format
from ..tail.spec import TailSpec
from . import fused_tail, params
from .family import CTYPE, Family, Limits
from .launch import X, LaunchPlan, tail_fields, tail_patches

__all__ = ["QUANTIZE", "variants", "warmup", "launch_config", "MAX_HIDDEN"]

SOURCE = "quantize.cu"
VPT_BUCKETS = (1, 2, 4)
MAX_THREADS = {v: fused_tail.MAX_THREADS[v] for v in VPT_BUCKETS}  # kMaxThreads<VPT> in quantize.cu
MAX_HIDDEN = 8 * max(v * MAX_THREADS[v] for v in VPT_BUCKETS)
launch_config = fused_tail.register_config


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
        return [self.name_expression(dtype, spec.format, launch_config(hidden, t)[0])
                for t in (1, fused_tail.LATENCY_TOKENS)]

    def plan(self, dtype: torch.dtype, t: int, h: int, spec: TailSpec, device_index: int) -> LaunchPlan:
        """The LaunchPlan of t rows of h: x (the call's source X) is FusedTailParams' input a; the outputs
        are the spec's without residual and norm (quant, scale_factors, scales)."""
        launches = ()
        if t:
            vpt, threads = launch_config(h, t)
            blob = params.FUSED_TAIL.pack(0, *tail_fields(spec, t, h))
            patches = [(params.FUSED_TAIL.offsets["a"], X, 0)] + tail_patches(params.FUSED_TAIL.offsets["tail"])
            launches = (self.row_launch(dtype, spec, t, vpt, threads, blob, patches, device_index),)
        return LaunchPlan(self.name, launches, tuple(spec.outputs(t, h, dtype, residual=False)), device_index)


QUANTIZE = Quantize()


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    return QUANTIZE.variants()


def warmup(dtype: torch.dtype, quant: str, hidden: int, device=None) -> None:
    """Compile and load the variants quantize calls of (dtype, quant, hidden) use, any number of tokens,
    on `device` (default: current), so later calls can be captured in a CUDA graph."""
    QUANTIZE.warmup(dtype, TailSpec.of(quant), hidden, device)
