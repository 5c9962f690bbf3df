"""The MoE combine before the all-reduce (Communicator.moe_all_reduce): each rank's top-k expert outputs
of a token, weighted by the routing weights and summed with a shared expert's output, in fp32 in slot
order, rounded once (docs/semantics.md section 14).

At world size 1 (no all-reduce) the combine and the tail are one kernel where the fused tail's guards
hold (commfuse.kernels.moe_tail; `fused_rejects` says why not). Otherwise the combine runs first: on
CUDA tensors as one kernel (commfuse.kernels.moe_combine); elsewhere, where its guards fail or with
COMMFUSE_DISABLE_FUSION=1, as commfuse.reference's ops; `plan` says which and why. Either way the combined
rows are the reference's bits, and the sum's all-reduce, residual add, RMSNorm and quantization follow as
`fused_all_reduce` (whose routes fuse them): `Launcher`. Row indices outside [-1, R) raise ValueError on
the reference's route (which reads them: on a GPU one synchronisation, which a CUDA graph capture does not
allow) and give NaN rows on the kernel's (which reads them on the device).

Ranks compare a MoE call as a whole, its combine included, where they compare calls at all (the gloo
route's exchange, COMMFUSE_CHECK's): one rank's out-of-range indices then make every rank raise, in step,
rather than one rank raising before the collective that its peers enter.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from . import reference, routes
from .routes import CallMismatchError
from .kernels import jit
from .kernels.moe_combine import MOE_COMBINE, index_limits, run
from .kernels.moe_tail import MOE_TAIL
from .tail import checks
from .tail.checks import OUT_NAMES, fields_of, no_overlap
from .tail.spec import TailSpec

__all__ = ["combine", "plan", "fused_rejects", "describe", "Launcher"]


def plan(y: Tensor, weights: Tensor, m: routes.Machine) -> Tuple[str, Optional[str]]:
    """How the combine of these (checked) tensors runs on machine `m`: ("kernel", None), or ("separated",
    the reason).

    y: T[t, k, h] (reduction form) or the permuted rows T[R, h] (finalize form), T float16, bfloat16 or
    float32; weights: [t, k] float32 or T; both on m's device (the communicator's; checks.moe). The kernel
    needs CUDA tensors: y's device decides."""
    if not m.fusion:
        return "separated", "combine: COMMFUSE_DISABLE_FUSION=1: separated ops"
    if y.device.type != "cuda" or m.sm is None:
        return "separated", f"combine: tensors on {y.device.type}: the combine kernel needs CUDA tensors"
    t, k = weights.shape
    why = jit.cannot_target(tuple(m.sm)) or MOE_COMBINE.rejects_combine(y.dtype, m.sm, y.shape[-1], t, k, y.shape[0])
    return ("separated", f"combine: {why}") if why else ("kernel", None)


def fused_rejects(y: Tensor, weights: Tensor, residual: Tensor, weight: Tensor, scale, spec: TailSpec,
                  m: routes.Machine) -> Optional[str]:
    """Why the one-kernel MoE tail cannot take this checked call on machine `m` (None when it can).

    y: T[t, k, h] or the permuted rows T[R, h] (T float16, bfloat16 or float32); weights: [t, k] float32
    or T; residual: T[t, h] (it stands for the combined rows: their shape, dtype and device); weight: T[h];
    scale: the dequant scale, a float32 tensor of one element, a Python number (which the fused tail does
    not take) or None; all tensors on m's device (the communicator's; checks.moe and checks.tail)."""
    if m.world_size != 1:
        return f"world size {m.world_size}: the combine runs before the all-reduce, the tail after it"
    if m.strategy == "nccl":  # the fallback row, as a dense call of one rank takes it (routes.IdentityRoute)
        return "strategy 'nccl': the combine, NCCL's all-reduce, then the tail"
    call = routes.Call.of("fused", residual, residual, weight, scale if isinstance(scale, Tensor) else None,
                          spec=spec)  # the combined rows: residual's shape, dtype and device
    why = routes.tail_guard(call, m) or MOE_TAIL.rejects(y.dtype, m.sm or (0, 0), y.shape[-1], weights.shape[0],
                                                          spec, m.world_size) or \
        index_limits(MOE_TAIL.name, weights.shape[0], weights.shape[1], y.shape[0])
    return f"moe_tail: {why}" if why and not why.startswith(MOE_TAIL.name) else why


# The names of a MoE launcher's arguments that are inputs, in its order: (y, residual, weight, scale, out,
# weights, row_index, shared).
LAUNCHER_INPUTS = ("y", "residual", "weight", "scale", None, "weights", "row_index", "shared")


def combine(y: Tensor, weights: Tensor, row_index: Optional[Tensor] = None, shared: Optional[Tensor] = None,
            route: str = "separated") -> Tensor:
    """x = round_T(shared + sum_j weights[:, j] * y_j) of one rank: T[t, h], by `route` (plan's).

    y: T[t, k, h] (reduction form), or the permuted expert rows T[R, h] with row_index int32/int64 [t, k]
    (finalize form: token i's j-th expert output is y[row_index[i, j]], -1 for a dropped slot); weights:
    [t, k] float32 or T; shared: T[t, h] or None; all on one device."""
    if route == "kernel":
        return run(y, weights, row_index, shared)
    with torch.no_grad():  # outside autograd, as the kernel (an inference y with weights that require grad)
        if row_index is None:
            return reference.moe_reduce(y, weights, shared)
        return reference.moe_finalize(y, row_index, weights, shared)


def describe(y: Tensor, weights: Tensor, row_index: Optional[Tensor], shared: Optional[Tensor]) -> str:
    """The combine of a MoE call as ranks must make it alike, in words: y's and weights' dtypes and shapes,
    the form (row_index's dtype) and whether there is a shared expert.

    y: T[t, k, h], or the permuted rows T[R, h] with row_index int32/int64 [t, k] (None: reduction form);
    weights: [t, k] float32 or T; shared: T[t, h] or None; on the communicator's device (checked:
    checks.moe). Only their metadata is read."""
    rows = "reduction form" if row_index is None else f"row_index {row_index.dtype}"
    return (f"after moe_combine(y {y.dtype} {list(y.shape)}, weights {weights.dtype} {list(weights.shape)}, {rows}, "
            f"{'a shared expert' if shared is not None else 'no shared expert'})")


class Launcher:
    """moe_all_reduce's launcher where the collective does not combine as it reads: the combine (`route`,
    "kernel" or "separated"), then `dense`, the launcher of fused_all_reduce's route for the combined rows.
    `text`: describe()'s. On the gloo route (`gloo`) the sum's exchange carries the text too; `check`, where
    given (COMMFUSE_CHECK: check(note, refused=None)), compares it across the ranks first, with what the
    routes would refuse of the call's own facts (checks.per_call). Either way the reference's combine reads the
    row indices (once) and the text says whether they are in range, so that a rank whose are not makes every
    rank raise (CallMismatchError) before any rank writes an output; with COMMFUSE_GLOO_CHECK=0 (no
    signature) that rank raises ValueError and its peers' sums are NaN. A combine that raises (torch refusing
    an input no check foresaw) runs before any exchange and takes part in them as a refusal: the rank raises
    its error, its peers CallMismatchError naming it (NaN sums without a signature)."""

    __slots__ = ("route", "dense", "outputs", "text", "gloo", "check")

    def __init__(self, route: str, dense, outputs, text: str, gloo: bool, check: Optional[Callable[..., None]]):
        self.route, self.dense, self.outputs = route, dense, outputs  # outputs: the call's OutputSpecs
        self.text, self.gloo, self.check = text, gloo, check

    def __call__(self, y, residual, weight, scale, out, weights, row_index, shared):
        """The combine, then `dense` on the combined rows: Communicator.moe_all_reduce's checked arguments.

        y: T[t, k, h], or the permuted rows T[R, h] with row_index int32/int64 [t, k] (None: reduction
        form); weights: [t, k] float32 or T; shared: T[t, h] or None; residual: T[t, h]; weight: T[h]
        (T float16, bfloat16 or float32); scale: the dequant scale (a float32 tensor of one element, or a
        Python number), None without quant or for a format that computes its scales; all on the
        communicator's device. out: caller-owned outputs as for fused_all_reduce, or None. Returns
        fused_all_reduce's five outputs of the combined rows (residual T[t, h], norm, quant, scale_factors,
        scales; None where absent), in commfuse.reference.Tail's order, on the communicator's device."""
        bad = failed = None
        try:  # before any exchange: a rank whose combine raises still makes its peers' exchanges
            x = combine(y, weights, row_index, shared, self.route)
        except reference.RowIndexError as e:  # the reference's route read the indices: a call of its own
            bad = e
        except Exception as e:  # noqa: BLE001 - raised below, after the peers have heard of it
            failed = e
        try:
            note = self.text if bad is None else f"{self.text}, {bad}"
            if self.check is not None:
                try:  # what the routes would refuse of this call's own facts, compared with the call
                    given = (None,) * len(self.outputs) if out is None else fields_of(out)
                    inputs = zip(LAUNCHER_INPUTS, (y, residual, weight, scale, out, weights, row_index, shared))
                    checks.per_call(OUT_NAMES, given, self.outputs, tuple((n, a) for n, a in inputs if n), scale)
                except (TypeError, ValueError) as e:
                    self.check(note, refused=e)
                if failed is not None:
                    self.check(note, refused=failed)
                self.check(note)
            if bad is not None or failed is not None:
                if self.gloo:  # the exchange alone, in step with the peers' sums (their outputs are not written);
                    # NaN rows where it exchanges no signature (COMMFUSE_GLOO_CHECK=0), as the kernel route's
                    if failed is not None:
                        note = f"{self.text}, a combine that raised {type(failed).__name__}: {failed}"
                    try:
                        self.dense.first(residual.new_full(residual.shape, float("nan")), note=note)
                    except CallMismatchError:
                        if failed is None:
                            raise
                raise failed if failed is not None else bad
        finally:  # this frame, in the error's traceback, must not hold it (routes.refuse says why)
            bad = failed = None
        # out against the combine's inputs (the dense launcher checks it against the others): on the gloo
        # route after the exchange, as the dense route's checks, so that a rank that raises stays in step.
        inputs = (("y", y), ("weights", weights), ("row_index", row_index), ("shared", shared))
        if self.gloo:
            return self.dense(x, residual, weight, scale, out, note=note, inputs=inputs)
        if out is not None:
            no_overlap(OUT_NAMES, fields_of(out), self.outputs, inputs)
        return self.dense(x, residual, weight, scale, out)
