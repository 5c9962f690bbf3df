"""The gated RMSNorm kernel (csrc/gated_rmsnorm.cu): Mamba2 / Nemotron-H's gated RMSNorm and the
tail's optional quantization (every format of commfuse.tail.formats) in one kernel.

Semantics: commfuse.reference.gated_rmsnorm, then the reference quantizers on its T-rounded output; see
docs/semantics.md (gated RMSNorm). silu goes through exp, which no two implementations compute alike: the
kernel's comes from the SFU's exp2 and reciprocal (csrc/gated_rmsnorm.cu), within an ulp of T of the
reference's norm.

Launch configuration: one CTA per row (plus the padding rows of the scale storage, as fused_tail), or
at few rows and at many rows of more than MANY_SPLIT_SLICE elements a row split into slices of whole groups,
a CTA each (the groups are normalised independently; splits);
the slice lives in registers, VPT vectors of 8 elements per thread: for few rows fused_tail's few-rows
rule (VPT 1 up to 1024 threads), for many rows VPT 2 (up to 1024 threads; launch_config says why), so
h <= MAX_HIDDEN = 16384; longer rows take the separated ops (commfuse.routes says so): there is no
variant that loops over a row's columns (fused_tail's looped one).
"""
from __future__ import annotations

import functools
import math
from typing import List, Optional, Tuple

import torch

from ..reference import Tail
from ..tail import checks
from ..tail.formats import FORMATS, Format
from ..tail.spec import TailSpec
from . import fused_tail, native, params
from .family import CTYPE, Family, Limits
from .launch import X, Z, LaunchPlan, tail_fields, tail_patches, whole_warps

__all__ = ["GATED_NORM", "run", "warmup", "variants", "launch_config", "splits", "MAX_HIDDEN", "GROUP_MULTIPLE"]

SOURCE = "gated_rmsnorm.cu"
VPT_BUCKETS = (1, 2, 4)
MAX_THREADS = {v: fused_tail.MAX_THREADS[v] for v in VPT_BUCKETS}  # kMaxThreads<VPT> in gated_rmsnorm.cu
MAX_HIDDEN = 8 * max(v * MAX_THREADS[v] for v in VPT_BUCKETS)
GROUP_MULTIPLE = 8  # a group is whole 16-byte vectors
SPLIT_TOKENS = 128  # below this many rows, a row may be split over CTAs (splits)
MIN_SLICE = 1024    # elements of a split row's slice at least (128 threads at VPT 1)
SLICE_MULTIPLE = 128  # a slice holds whole blocks of every format (fp8_block's 128 elements the longest)
MANY_SPLIT_TOKENS = 512   # from this many rows, a long row is split again (splits)
MANY_SPLIT_SLICE = 4096   # elements of such a slice at most


def splits(hidden: int, tokens: int, group_size: int, spec: TailSpec) -> int:
    """CTAs per row, each a slice of whole groups and whole format blocks; 1 for a format whose scale is the
    whole row's (block 0: fp8_per_token). H200, bf16, gate first (launch/tail_sweep.py --gated; us, one CTA a
    row / the split / Inductor, which gives each group a CTA):
    - below SPLIT_TOKENS rows, the most (up to 8) with slices of at least MIN_SLICE elements: groups of
      1024, [1, 8192] 4.10 / 2.50 (8 CTAs) / 2.53, [64, 8192] 4.49 / 3.27 / 4.31, [1, 7168] 3.78 / 2.55 (7) /
      2.86; groups of 128, [1, 8192] 3.45 / 2.22 / 4.13; but [128, 8192] 4.77 / 5.58 (8);
    - from MANY_SPLIT_TOKENS rows, the fewest with slices of MIN_SLICE to MANY_SPLIT_SLICE elements (shorter
      slices, more CTAs of fewer threads: more rows' loads in flight while others' silu runs): groups of 128,
      [8192, 7168] 126.98 / 111.10 (2) / 140.74, [8192, 8192] 142.19 / 130.53 (2) / 160.51, [1024, 7168]
      17.76 / 16.18 (2) / 18.95, [512, 8192] 10.09 / 9.70 (2) / 13.71, [8192, 4096] 67.68 (1, the fastest
      of all splits) / 84.29; groups of 1024, [8192, 7168] 150.59 / 135.51 (7) / 139.83, [1024, 8192]
      23.48 / 21.73 (2) / 20.94; groups of 2048, [8192, 8192] 161.27 / 151.26 (2) / 173.74. A variant whose
      CTAs instead looped over rows, each prefetching its next row into L2, lost to the split at every such
      shape (groups of 128, [8192, 7168]: 121.4-135.3 us, by build);
    - else 1."""
    if spec.format.block == 0:
        return 1
    unit = math.lcm(group_size, SLICE_MULTIPLE)
    if tokens < SPLIT_TOKENS:
        return next(s for s in range(8, 0, -1) if s == 1 or (hidden % (s * unit) == 0 and hidden // s >= MIN_SLICE))
    if tokens >= MANY_SPLIT_TOKENS:
        return next((s for s in range(1, 9) if hidden % (s * unit) == 0 and hidden // s <= MANY_SPLIT_SLICE and
                     (s == 1 or hidden // s >= MIN_SLICE)), 1)
    return 1


def launch_config(hidden: int, tokens: int) -> Tuple[int, int]:
    """(vpt, threads per CTA) for `tokens` rows (of a split row: slices) of `hidden` <= MAX_HIDDEN elements.
    Many rows take VPT 2, not the residual tail's throughput rule (VPT 4, at most 256 threads): the gate's
    exp and IEEE division per element want more threads a row. H200, bf16, groups of 128 summed by shuffles
    (launch/tail_sweep.py --gated): [256, 7168] 5.1 us against 5.6 (VPT 1) and 7.9 (VPT 4), [1024, 8192] 19.1 against 24.0 / 21.1,
    [8192, 4096] 63.7 against 64.9 / 72.8, [1024, 4096] 9.1 against 8.9 / 11.5."""
    if tokens < fused_tail.LATENCY_TOKENS:
        return fused_tail.row_config(hidden, True)
    threads = -(-hidden // 16)  # 2 vectors of 8 a thread
    return 2, whole_warps(threads)


class GatedNorm(Family):
    name = "gated_rmsnorm"
    source = SOURCE
    limits = Limits(max_hidden=MAX_HIDDEN)

    def name_expression(self, dtype: torch.dtype, fmt: Format, vpt: int) -> str:
        return f"commfuse::gated_rmsnorm<{CTYPE[dtype]}, {fmt.id}, {vpt}>"

    def variants(self) -> List[str]:
        return [self.name_expression(d, f, v) for d in CTYPE for f in FORMATS for v in VPT_BUCKETS]

    def configs(self, dtype, spec, hidden):
        if not 0 < hidden <= MAX_HIDDEN:
            raise ValueError(f"no gated RMSNorm kernel for hidden={hidden} (at most {MAX_HIDDEN})")
        vpts = {launch_config(hidden, t)[0] for t in (1, fused_tail.LATENCY_TOKENS)}
        vpts |= {launch_config(hidden // s, 1)[0] for s in range(2, 9) if hidden // s >= MIN_SLICE}  # split rows
        return [self.name_expression(dtype, spec.format, vpt) for vpt in sorted(vpts)]

    def rejects(self, dtype, sm, hidden, tokens, spec, world_size=1, group_size: Optional[int] = None):
        why = super().rejects(dtype, sm, hidden, tokens, spec, world_size)
        if why is None and group_size is not None and group_size % GROUP_MULTIPLE:
            return (f"group_size {group_size} is not a multiple of {GROUP_MULTIPLE}: the gated RMSNorm kernel's "
                    "groups are whole 16-byte vectors")
        return why

    def plan(self, dtype: torch.dtype, t: int, h: int, spec: TailSpec, group_size: int, norm_before_gate: bool,
             device_index: int) -> LaunchPlan:
        """The LaunchPlan of t rows of h: x and z (or no gate) as the call's sources X and Z."""
        launches = ()
        if t:
            s = splits(h, t, group_size, spec)
            vpt, threads = launch_config(h // s, t)
            blob = params.GATED_NORM.pack(*tail_fields(spec, t, h), 0, 0, group_size, int(norm_before_gate), s, 0)
            patches = tail_patches(params.GATED_NORM.offsets["tail"])
            patches += [(params.GATED_NORM.offsets["x"], X, 0), (params.GATED_NORM.offsets["z"], Z, 0)]
            launches = (self.row_launch(dtype, spec, t, vpt, threads, blob, patches, device_index, s),)
        return LaunchPlan(self.name, launches, tuple(spec.outputs(t, h, dtype, residual=False)), device_index)


GATED_NORM = GatedNorm()


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    return GATED_NORM.variants()


def warmup(dtype: torch.dtype, quant: Optional[str], hidden: int, device=None) -> None:
    """Compile and load the variants `run` uses for (dtype, quant, hidden), any number of tokens, on
    `device` (default: current), so later calls can be captured in a CUDA graph."""
    GATED_NORM.warmup(dtype, TailSpec.of(quant), hidden, device)


@functools.lru_cache(maxsize=4096)
def _launcher(dtype, t, h, spec, group_size, norm_before_gate, device_index):
    return native.launcher(GATED_NORM.plan(dtype, t, h, spec, group_size, norm_before_gate, device_index))


def run(x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, eps: float, group_size: int,
        norm_before_gate: bool, quant: Optional[str] = None, scale: Optional[torch.Tensor] = None,
        return_norm: bool = False, sf_layout: str = "swizzled", scale_layout: str = "row",
        scale_ue8m0: bool = False) -> Tail:
    """The gated RMSNorm (+ quantization) as one kernel on torch's current stream (the kernel alone, as
    fused_tail.run): x [..., h] fp16/bf16 CUDA, z x's shape and dtype or None, weight [h], group_size a
    multiple of 8 dividing h, h <= MAX_HIDDEN (and the format's multiple); quant, scale, sf_layout,
    scale_layout, scale_ue8m0 as in fused_tail.run. Returns a Tail with residual None (norm, quant,
    scale_factors, scales as fused_tail.run's)."""
    spec = TailSpec.of(quant, return_norm=return_norm, eps=eps, sf_layout=sf_layout, scale_layout=scale_layout,
                       scale_ue8m0=scale_ue8m0)
    h = checks.gated(x, z, weight, scale, spec, group_size, norm_before_gate)
    t = x.numel() // h
    why = None if x.is_cuda else "x must be a CUDA tensor"
    why = why or GATED_NORM.rejects(x.dtype, torch.cuda.get_device_capability(x.device), h, t, spec,
                                    group_size=group_size)
    if why is None and spec.format.takes_scale and not isinstance(scale, torch.Tensor):
        why = "scale must be a float32 CUDA tensor"
    if why:
        raise ValueError(f"gated_norm.run: {why}")
    launcher = _launcher(x.dtype, t, h, spec, group_size, norm_before_gate, x.get_device())
    return Tail(*launcher(x, None, weight, scale, None, z))
