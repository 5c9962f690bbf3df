"""The MoE combine before the all-reduce (Communicator.moe_all_reduce): each rank's top-k expert outputs
of a token, weighted by the routing weights and summed with a shared expert's output, in fp32 in slot
order, rounded once (docs/semantics.md section 14).

Today the combine runs as commfuse.reference's ops (every plan says so: `combine="separated"`) and the
sum's all-reduce, residual add, RMSNorm and quantization as `fused_all_reduce` (whose routes fuse them).
The finalize form reads row_index's range first (on a GPU a synchronisation, which a CUDA graph capture
does not allow); the reduction form reads nothing back.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from . import reference

__all__ = ["combine", "COMBINE_REASON"]

COMBINE_REASON = "combine: commfuse.reference's ops, before the collective (no kernel fuses the combine)"


def combine(y: Tensor, weights: Tensor, row_index: Optional[Tensor] = None, shared: Optional[Tensor] = None) -> Tensor:
    """x = round_T(shared + sum_j weights[:, j] * y_j) of one rank: T[t, h].

    y: T[t, k, h] (reduction form), or the permuted expert rows T[R, h] with row_index int32/int64 [t, k]
    (finalize form: token i's j-th expert output is y[row_index[i, j]], -1 for a dropped slot); weights:
    [t, k] float32 or T; shared: T[t, h] or None; all on one device."""
    if row_index is None:
        return reference.moe_reduce(y, weights, shared)
    return reference.moe_finalize(y, row_index, weights, shared)
