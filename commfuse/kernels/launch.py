"""Launch plans: what one call of a planned signature launches, as data, and its Python executor.

A LaunchPlan is made once per call signature (by the route's kernel family): the kernels with their
launch shapes and parameter bytes (every pointer field 0), where each pointer comes from (a patch: the
field's byte offset, a source, a byte delta), the outputs to allocate, and an optional NCCL all-reduce
before the kernels. Two executors take the same plan with the same call, `launcher(x, residual, weight,
scale, out, z, row_index=None, shared=None)`: the C++ Launcher of commfuse.kernels.native (the hot
path) and `PyLauncher` here, which stands in where the extension cannot be built. Both return the five
outputs of a tail (reference.Tail's order, None where absent), or the sum of a plain all-reduce.

Per call, either executor: copies strided or misaligned operands (the kernels read dense rows of 16-byte
vectors; a MoE plan's weights and row index are made dense too, in their own dtypes, the plan's), allocates
the outputs the caller did not give (out: None, a tensor for a plain all-reduce, or the five fields; a field
None is allocated), checks the caller's outputs' alignment and an MN-major view's room (the plan's key holds
no addresses), runs ncclAllReduce of x into the residual output (a scratch buffer where that output is the
residual input itself), or copies x into the output (a plain all-reduce of one rank), then each kernel with its
pointers patched in: source address + delta, or 0 where the source is absent.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ..tail.checks import OUT_NAMES, fields_of, no_overlap, out_placed
from ..tail.formats import Layout
from ..tail.spec import OutputSpec, TailSpec
from . import params

__all__ = ["X", "RESIDUAL", "WEIGHT", "SCALE", "Z", "ROW_INDEX", "SHARED", "OUT", "SUM", "SOURCES", "INPUTS", "Launch",
           "LaunchPlan", "PyLauncher", "tail_fields", "tail_patches", "operand", "allocate", "set_poison",
           "on_poison", "pieces", "slice_vectors", "whole_warps"]

# Where a patched pointer comes from: the call's arguments (a MoE call's y is X, its routing weights Z),
# its outputs OUT + i (residual, norm, quant, scale_factors, scales; a plain all-reduce's sum is OUT), and
# the NCCL route's sum buffer.
X, RESIDUAL, WEIGHT, SCALE, Z, ROW_INDEX, SHARED, OUT, SUM = 0, 1, 2, 3, 4, 5, 6, 7, 12
INPUTS = ("x", "residual", "weight", "scale", "z", "row_index", "shared")  # the names of sources X..SHARED
MOE_INPUTS = ("y", "residual", "weight", "scale", "weights", "row_index", "shared")  # the same, a MoE call's
SOURCES = SUM + 1
# TailParams' pointer fields and where each comes from.
_TAIL_POINTERS = {"residual_in": RESIDUAL, "residual_out": OUT, "weight": WEIGHT, "norm_out": OUT + 1,
                  "quant_out": OUT + 2, "sf_out": OUT + 3, "scale": SCALE, "scales_out": OUT + 4}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: a jit.Kernel on `grid` x `block` threads, its parameter bytes with every
    pointer 0, and the patches ((offset, source, delta) triples) that fill the pointers in; cluster:
    CTAs per thread-block cluster (SM 9.0+, dividing grid; 1: no clusters)."""

    kernel: object
    grid: int
    block: int
    params: bytes
    patches: Tuple[Tuple[int, int, int], ...]
    cluster: int = 1


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one call of a signature launches. outputs: five OutputSpecs (None where absent) for a
    tail, one for a plain all-reduce; nccl: the NcclComm whose ncclAllReduce sums x (count elements)
    into the residual output first, or None; device_index: the CUDA device; combine: the kernels combine
    MoE expert rows (z: the routing weights; the call's sources are named as a MoE call's arguments); copy:
    the output is x copied, the whole work of a plain all-reduce of one rank (whose sum is x itself)."""

    name: str
    launches: Tuple[Launch, ...]
    outputs: Tuple[Optional[OutputSpec], ...]
    device_index: int
    nccl: Optional[object] = None
    count: int = 0
    combine: bool = False
    copy: bool = False

    @property
    def fused(self) -> bool:
        return len(self.outputs) == 5


def _offset_field(weight_offset: float) -> float:
    """TailParams.weight_offset: the offset rounded to fp32, and -0.0 for one that rounds to 0 (the
    kernel adds it unconditionally; w + -0.0 is w, bit for bit)."""
    return -0.0 if weight_offset == 0 else _f32(float(weight_offset))


@functools.lru_cache(maxsize=64)
def _f32(v: float) -> float:
    v = torch.tensor(v, dtype=torch.float32).item()
    return v if v != 0 else -0.0


def tail_fields(spec: TailSpec, t: int, h: int, rows: Optional[int] = None) -> tuple:
    """TailParams' fields in declaration order (params.TAIL) for a call of t rows of h, every pointer 0;
    rows: those of this launch (a piece of the call), default t. MN-major scales keep the whole call's
    column stride, roundup(t, 4)."""
    bits = (params.SCALE_MN_MAJOR if spec.layout == Layout.MN_MAJOR else 0) | (params.SCALE_UE8M0 if spec.ue8m0 else 0)
    return ((0,) * 7 + (float(spec.eps), h, t if rows is None else rows, int(spec.layout == Layout.SWIZZLED), 0,
                        _offset_field(spec.weight_offset), bits, -(-t // 4) * 4))


def tail_patches(base: int, deltas: Optional[dict] = None) -> list:
    """The patches of a TailParams at byte `base` of a struct; deltas: a byte delta per source."""
    deltas = deltas or {}
    return [(base + params.TAIL.offsets[name], source, deltas.get(source, 0)) for name, source in _TAIL_POINTERS.items()]


# ---------------------------------------------------------------- per call

_POISON: Optional[int] = None
_POISON_LISTENERS: list = []


def set_poison(byte: Optional[int]) -> None:
    """Fill every output a launcher allocates with `byte` from now on (the GPU tests' check that a
    kernel writes every element); None: plain uninitialised outputs."""
    global _POISON
    _POISON = byte
    for listener in _POISON_LISTENERS:
        listener(byte)


def on_poison(listener) -> None:
    """Call listener(byte) now and whenever set_poison runs (commfuse.kernels.native's launchers, which
    may load after the poison was set)."""
    _POISON_LISTENERS.append(listener)
    listener(_POISON)


def allocate(spec: OutputSpec, device) -> torch.Tensor:
    """A tensor of `spec` on `device`: a strided spec gets a view of a storage holding its padding too."""
    if spec.strides is None:
        out = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    else:
        out = torch.empty((spec.storage_numel,), dtype=spec.dtype, device=device)
    if _POISON is not None:
        out.view(torch.uint8).fill_(_POISON)
    return out if spec.strides is None else out.as_strided(spec.shape, spec.strides)


def operand(t: torch.Tensor) -> torch.Tensor:
    # The kernels read dense rows of 16-byte vectors: a strided or misaligned view gets a copy.
    c = t.contiguous()
    return c if not c.data_ptr() % 16 else c.clone()


_POINTER = struct.Struct("<Q")


class PyLauncher:
    """The Python executor of a LaunchPlan (see the module docstring); the C++ Launcher's stand-in."""

    __slots__ = ("plan", "_device")

    def __init__(self, plan: LaunchPlan):
        self.plan = plan
        self._device = torch.device("cuda", plan.device_index)

    def __call__(self, x, residual=None, weight=None, scale=None, out=None, z=None, row_index=None, shared=None):
        plan = self.plan
        inputs = (x, residual, weight, scale, z, row_index, shared)
        t = [None] * SOURCES
        for i, a in enumerate(inputs):
            t[i] = a if a is None or i == SCALE else operand(a)
        given = (None,) * len(plan.outputs) if out is None else (fields_of(out) if plan.fused else (out,))
        if out is not None:
            names = OUT_NAMES if plan.fused else ("out",)
            out_placed(names, given, plan.outputs)
            no_overlap(names, given, plan.outputs, tuple(zip(MOE_INPUTS if plan.combine else INPUTS, inputs)))
        for i, spec in enumerate(plan.outputs):
            if spec is not None:
                t[OUT + i] = allocate(spec, self._device) if given[i] is None else given[i]
        if plan.nccl is not None:
            # The sum goes into the residual output, which the tail then updates in place (each element
            # read before it is written, by the same thread); a scratch buffer where that output is the
            # residual input itself.
            aliased = plan.fused and residual is not None and t[OUT].data_ptr() == residual.data_ptr()
            t[SUM] = allocate(plan.outputs[0], self._device) if aliased else t[OUT]
            plan.nccl.all_reduce(t[X], t[SUM])
        if plan.copy:
            t[OUT].copy_(t[X])
        for launch in plan.launches:
            buf = bytearray(launch.params)
            for offset, source, delta in launch.patches:
                p = t[source]
                _POINTER.pack_into(buf, offset, p.data_ptr() + delta if p is not None else 0)
            launch.kernel.launch((launch.grid, 1, 1), (launch.block, 1, 1), bytes(buf), cluster=launch.cluster)
        for o in given:
            if o is not None:
                torch.autograd.graph.increment_version(o)  # as torch's out= does: autograd sees the write
        return tuple(t[OUT:OUT + 5]) if plan.fused else t[OUT]


def pieces(total: int, piece: int) -> Sequence[Tuple[int, int]]:
    """[begin, end) ranges of `piece` (the last one shorter) covering range(total)."""
    return [(b, min(total, b + piece)) for b in range(0, total, piece)]


def slice_vectors(nv: int, split: int) -> int:
    """The 16-byte vectors of each CTA's slice of a row of nv vectors cut over `split` CTAs: an equal share
    rounded up to whole 16-vector blocks, so that every slice holds whole scale blocks of every format
    (csrc/epilogue.cuh's slice_vectors)."""
    return -(-nv // (16 * split)) * 16


def whole_warps(threads: int) -> int:
    """`threads` rounded up to whole warps of 32, at least one warp: a CTA's block size."""
    return max(32, -(-threads // 32) * 32)
