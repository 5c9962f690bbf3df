"""The MoE combine kernel (csrc/moe_combine.cu): commfuse.moe.combine on CUDA tensors, one kernel for
x = round_T(shared + sum_j w_j * y_j), in fp32 in slot order (docs/semantics.md section 14), bit for bit
reference.moe_reduce / moe_finalize.

Launch configuration: one CTA per token, up to 256 threads looping over the row's 16-byte vectors (h a
multiple of 8). The finalize form's row indices are read by the kernel, not the host: one outside
[-1, rows) makes that token's row NaN instead of raising (no synchronisation).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import params
from .family import CTYPE, Family, Limits
from ..tail.spec import OutputSpec
from .launch import allocate, operand, whole_warps

__all__ = ["MOE_COMBINE", "SOURCE", "FORMS", "variants", "run", "warmup", "index_limits", "form_of", "fields"]

SOURCE = "moe_combine.cu"
MAX_THREADS = 256  # __launch_bounds__ of csrc/moe_combine.cu
# kCombineReduction, kCombineFinalize32 / 64 (csrc/moe.cuh): y [t, k, h], or the rows through an int32 / int64 index
FORMS = {None: 0, torch.int32: 1, torch.int64: 2}


def form_of(row_index_dtype: Optional[torch.dtype]) -> int:
    """The combine's form: the reduction without a row index, else the finalize form of its index type."""
    return FORMS[row_index_dtype]


def fields(t: int, k: int, h: int, rows: int, weights_dtype: torch.dtype, dtype: torch.dtype) -> tuple:
    """MoeCombineParams' values with its pointers 0 (every kernel that combines patches them per call): the
    kernels read float32 weights or weights of y's dtype (T) as given, the weights' dtype being a field (the
    index type is the form's). ValueError for any other weights dtype, which they would misread."""
    if weights_dtype not in (torch.float32, dtype):
        raise ValueError(f"the MoE kernels read float32 weights or y's dtype ({dtype}), not {weights_dtype}")
    return (0,) * 5 + (t, k, h, rows, int(weights_dtype == torch.float32), 0)


def index_limits(name: str, t: int, k: int, rows: int) -> Optional[str]:
    """Why the MoE kernels' int fields cannot hold t tokens of k slots over y's `rows` (None when they can)."""
    if t * k >= 1 << 31 or rows >= 1 << 31:
        return f"{name}: {t} tokens x {k} slots (or {rows} rows) exceed the kernel's int indices"
    return None


class MoeCombine(Family):
    name = "moe_combine"
    source = SOURCE
    limits = Limits()

    def name_expression(self, dtype: torch.dtype, form: int) -> str:
        return f"commfuse::moe_combine<{CTYPE[dtype]}, {form}>"

    def variants(self) -> List[str]:
        return [self.name_expression(d, f) for d in CTYPE for f in FORMS.values()]

    def configs(self, dtype, spec, hidden):
        return [self.name_expression(dtype, f) for f in FORMS.values()]

    def rejects_combine(self, dtype: torch.dtype, sm: tuple, h: int, t: int, k: int, rows: int) -> Optional[str]:
        """Why the kernel cannot take a combine of t tokens, k slots, rows of h (None when it can); rows:
        y's first dimension."""
        why = self.rejects(dtype, sm, h, t, None)
        if why:
            return why
        if h % 8:
            return f"{self.name}: hidden size {h} must be a multiple of 8"
        return index_limits(self.name, t, k, rows)


MOE_COMBINE = MoeCombine()


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    return MOE_COMBINE.variants()


def run(y: torch.Tensor, weights: torch.Tensor, row_index: Optional[torch.Tensor],
        shared: Optional[torch.Tensor]) -> torch.Tensor:
    """The combine of checked CUDA tensors (commfuse.tail.checks.moe) that MOE_COMBINE accepts: T[t, h]."""
    t, k = weights.shape
    h = y.shape[-1]
    x = allocate(OutputSpec((t, h), y.dtype), y.device)  # poisoned where the tests ask (launch.set_poison)
    if t == 0:
        return x
    y, weights = operand(y), weights.contiguous()
    row_index = None if row_index is None else row_index.contiguous()
    shared = None if shared is None else operand(shared)
    index_dtype = None if row_index is None else row_index.dtype
    kernel = MOE_COMBINE.kernel(MOE_COMBINE.name_expression(y.dtype, form_of(index_dtype)), y.device.index)
    pointers = (y.data_ptr(), weights.data_ptr(), 0 if row_index is None else row_index.data_ptr(),
                0 if shared is None else shared.data_ptr(), x.data_ptr())
    rows = 0 if row_index is None else y.shape[0]
    blob = params.MOE_COMBINE.pack(*pointers, *fields(t, k, h, rows, weights.dtype, y.dtype)[5:])
    threads = min(MAX_THREADS, whole_warps(h // 8))
    kernel.launch((t, 1, 1), (threads, 1, 1), blob)
    return x


def warmup(dtype: torch.dtype, device=None) -> None:
    """Compile and load the variants of y's dtype (every form; any weights dtype) on `device` (default:
    current), so later calls can be captured in a CUDA graph."""
    MOE_COMBINE.warmup(dtype, None, None, device)
