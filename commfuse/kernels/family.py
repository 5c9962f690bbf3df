"""A kernel family: one kernel template of csrc/ with its instantiations, what it takes, its kernels'
cache, and the warm-up that loads them before CUDA graph capture. Each family module
(fused_tail.py, gated_norm.py, quantize.py, p2p_allreduce.py) is one subclass: its name expressions, launch
configuration and LaunchPlans.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional

import torch

from ..tail.spec import TailSpec
from . import jit
from .launch import Launch

__all__ = ["Limits", "Family", "CTYPE", "MAX_HIDDEN", "MAX_TOKENS"]

CTYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}  # the element types the kernels are built for
MAX_HIDDEN = 1 << 16       # what the tests cover; the looped variants have no hard limit below 2^31
# Rows are blockIdx.x (< 2^31) in the local tail, and include up to 127 padding rows of the swizzled layout.
MAX_TOKENS = (1 << 31) - 128


@dataclass(frozen=True)
class Limits:
    """What a family's kernels take: element types, the oldest SM, the longest rows, the most rows, the
    world sizes (None: any)."""

    dtypes: frozenset = frozenset(CTYPE)
    min_sm: tuple = (8, 0)
    max_hidden: int = MAX_HIDDEN
    max_tokens: int = MAX_TOKENS
    world_sizes: Optional[frozenset] = None


class Family:
    """One kernel template (`source` in csrc/) and its instantiations; see the module docstring.

    Subclasses define `name_expression(...)`, `variants()` and `configs(dtype, spec, hidden)` (the
    name expressions a (dtype, spec, hidden) may launch, for warmup)."""

    name: str = ""
    source: str = ""
    limits: Limits = Limits()

    def rejects(self, dtype: torch.dtype, sm: tuple, hidden: int, tokens: int, spec: Optional[TailSpec],
                world_size: int = 1) -> Optional[str]:
        """Why this family's kernels cannot take a call (None when they can); spec None: no tail."""
        lim = self.limits
        if dtype not in lim.dtypes:
            return f"{self.name}: dtype {dtype} not in {sorted(map(str, lim.dtypes))}"
        if tuple(sm) < lim.min_sm:
            return f"{self.name}: needs SM >= {lim.min_sm[0]}.{lim.min_sm[1]}, device is {sm[0]}.{sm[1]}"
        if lim.world_sizes is not None and world_size not in lim.world_sizes:
            return f"{self.name}: world size {world_size} not supported"
        if spec is None:
            return None
        multiple = max(spec.hidden_multiple, 8)
        if hidden % multiple or not 0 < hidden <= lim.max_hidden:
            return f"{self.name}: hidden size {hidden} must be a multiple of {multiple} in [{multiple}, {lim.max_hidden}]"
        if tokens > lim.max_tokens:
            return f"{self.name}: {tokens} tokens > {lim.max_tokens}"
        return None

    def kernel(self, name_expression: str, device_index: int) -> jit.Kernel:
        """The instantiation, compiled (once per machine: the disk cache) and loaded on the device; every
        commfuse kernel starts with pdl_wait(), so it is launched as a programmatic dependent launch."""
        return jit.kernel(self.source, name_expression, device=device_index, pdl=True)

    def row_launch(self, dtype: torch.dtype, spec: TailSpec, t: int, vpt: int, threads: int, blob: bytes,
                   patches, device_index: int, splits: int = 1) -> Launch:
        """The launch of a tail kernel with `splits` CTAs per row: the (dtype, format, vpt) variant over t
        rows and their scale storage's padding rows (spec.row_slots)."""
        return Launch(self.kernel(self.name_expression(dtype, spec.format, vpt), device_index),
                      spec.row_slots(t) * splits, threads, blob, tuple(patches))

    def variants(self) -> List[str]:
        raise NotImplementedError

    def configs(self, dtype: torch.dtype, spec: TailSpec, hidden: int) -> Iterable[str]:
        raise NotImplementedError

    def warmup(self, dtype: torch.dtype, spec: TailSpec, hidden: int, device=None, **options) -> None:
        """Compile and load every kernel calls of (dtype, spec, hidden) may launch, any number of tokens,
        on `device` (default: current), so that later calls can be captured in a CUDA graph. options: the
        family's configs' own (fused_tail's post)."""
        if dtype not in CTYPE:
            raise ValueError(f"no {self.name} kernel for dtype={dtype}")
        index = jit.device_index(device)
        for name in self.configs(dtype, spec, hidden, **options):
            self.kernel(name, index)
