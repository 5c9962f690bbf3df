"""The Communicator's calls as torch.library custom ops, for models run through torch.compile.

Dynamo cannot trace into a Communicator call (it launches kernels through the CUDA driver and
decides its route in Python), so a compiled model would break its graph at every all-reduce. These
ops are opaque to the compiler: fake implementations give the output shapes, including for a
dynamic number of tokens, and the real ones call the Communicator, so CUDA graphs (also those of
`mode="reduce-overhead"`) capture the same kernels as an eager call. For CUDA tensors the ops'
kernels are C++ (csrc/host_launch.cpp): a signature the Communicator has planned is launched from
its native table without Python; the Python kernels below plan the others (and serve every other
device).

    comm = commfuse.Communicator()
    y = commfuse.ops.all_reduce(comm, x)
    r = commfuse.ops.fused_all_reduce(comm, x, residual, weight, eps=1e-6, quant="fp8", scale=scale)
    r.residual, r.norm, r.quant, r.scale_factors, r.scales  # a commfuse.reference.Tail; absent fields are None

The ops themselves are `torch.ops.commfuse.all_reduce(x, comm)` and
`torch.ops.commfuse.fused_all_reduce(x, residual, weight, scale, eps, quant, return_norm, sf_layout,
comm, weight_offset=0.0, scale_layout="row", scale_ue8m0=False)` -> (residual, norm, quant,
scale_factors, scales), where `comm` is `Communicator.name` (communicators register themselves by
name, per process), quant "" means none, and absent outputs are empty tensors. Like every collective, a call
must be made by every rank of the group, in the same order. The ops are declared pure (they modify
nothing), so a compiler may drop a call whose outputs are unused: the same on every rank.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from .epilogue import COMPUTED_SCALES, fake_outputs
from .reference import Tail

__all__ = ["all_reduce", "fused_all_reduce"]

_COMMUNICATORS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def register(comm) -> str:
    """Make `comm` reachable from the ops by a name unique in this process; returns the name."""
    name = f"commfuse-{next(_NUMBERS)}"
    _COMMUNICATORS[name] = comm
    return name


def _communicator(name: str):
    comm = _COMMUNICATORS.get(name)
    if comm is None:
        raise LookupError(f"no live commfuse.Communicator named {name!r} in this process")
    return comm


def all_reduce(comm, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`comm.all_reduce(x)` as a custom op: the sum of x over comm's group, in a new tensor, or in
    `out` (caller-owned, x's shape, dtype and device, contiguous: op all_reduce_out), returned.

    x: any shape, on comm's device (CUDA for NCCL, CPU for gloo); not modified."""
    if not torch.compiler.is_compiling():
        # Eager: the op's own body, without the dispatcher's host cost (tens of microseconds a call).
        return comm.all_reduce(x, out=out)
    if out is None:
        return torch.ops.commfuse.all_reduce(x, comm.name)
    torch.ops.commfuse.all_reduce_out(x, comm.name, out)
    return out


def fused_all_reduce(comm, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                     quant: Optional[str] = None, scale: Optional[torch.Tensor] = None,
                     return_norm: bool = False, sf_layout: str = "swizzled", out: Optional[Tail] = None, *,
                     weight_offset: float = 0.0, scale_layout: str = "row", scale_ue8m0: bool = False) -> Tail:
    """`comm.fused_all_reduce(...)` as a custom op (arguments and outputs as there; docs/semantics.md).

    x, residual: T[..., h]; weight: T[h]; scale: float32[1] (the dequant scale, required with quant
    "fp8" / "nvfp4"), all on comm's device. Returns a Tail (residual [t, h]; norm [t, h] or None;
    quant float8_e4m3fn [t, h] or uint8 [t, h/2] or None; scale_factors float8_e4m3fn or None; scales,
    the computed FP8 scales of "fp8_per_token" / "fp8_block", or None), without the plan:
    `comm.plan(...)` gives that. Outside torch.compile the call goes to the Communicator directly (the
op's body, without the dispatcher's cost); compiled code calls the op. out: caller-owned outputs as for Communicator.fused_all_reduce
    (op fused_all_reduce_out, which writes them), returned as the Tail; through the op, out.residual
    must be a tensor of its own (the in-place residual update is the Communicator call's)."""
    if scale is not None and not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a float32 tensor of one element, got {type(scale).__name__}")
    if quant is not None and not isinstance(quant, str):
        raise TypeError(f"quant must be None or one of 'fp8', 'nvfp4', 'fp8_per_token', 'fp8_block', got {quant!r}")
    scaled = dict(weight_offset=weight_offset, scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    if not torch.compiler.is_compiling():  # eager: the op's own body, as in all_reduce
        r = comm.fused_all_reduce(x, residual, weight, eps, quant or None, scale, return_norm, sf_layout, out=out,
                                  **scaled)
        return Tail(r.residual, r.norm, r.quant, r.scale_factors, r.scales)
    scaled = (float(weight_offset), scale_layout, bool(scale_ue8m0))
    if out is not None:
        outs = (out.residual, out.norm, out.quant, out.scale_factors, out.scales)
        torch.ops.commfuse.fused_all_reduce_out(x, residual, weight, scale, float(eps), quant or "",
                                                bool(return_norm), sf_layout, comm.name, *outs, *scaled)
        return Tail(*outs)
    res, norm, q, sf, scales = torch.ops.commfuse.fused_all_reduce(x, residual, weight, scale, float(eps),
                                                                   quant or "", bool(return_norm), sf_layout,
                                                                   comm.name, *scaled)
    return Tail(res, norm if not quant or return_norm else None, q if quant else None,
                sf if quant == "nvfp4" else None, scales if quant in COMPUTED_SCALES else None)


# The ops are declared with torch.library.Library rather than torch.library.custom_op: a custom_op call
# goes through Python autograd and aliasing wrappers (~15 us a call on an H200 host, launch/host_profile.py),
# a CompositeExplicitAutograd kernel straight to the function (~5 us). What custom_op would check at run
# time holds by construction: the functional ops return fresh tensors.
_LIB = torch.library.Library("commfuse", "FRAGMENT")


def define(schema: str, impl, fake) -> None:
    """Declare the op commfuse::<schema> with `impl` as its kernel on every device and `fake` as its
    fake (shape) implementation: commfuse.ops' and commfuse.norm's ops."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"commfuse::{name}", fake, lib=_LIB)


_SCALED_ARGS = 'float weight_offset=0.0, str scale_layout="row", bool scale_ue8m0=False'
_TAIL_ARGS = "Tensor x, Tensor residual, Tensor weight, Tensor? scale, float eps, str quant, bool return_norm, " \
             "str sf_layout, str comm"


def _all_reduce(x: torch.Tensor, comm: str) -> torch.Tensor:
    return _communicator(comm).all_reduce(x)


def _all_reduce_out(x: torch.Tensor, comm: str, out: torch.Tensor) -> None:
    _communicator(comm).all_reduce(x, out=out)


def _fused_all_reduce_out(x, residual, weight, scale, eps, quant, return_norm, sf_layout, comm, residual_out, norm_out,
                          quant_out, sf_out, scales_out=None, weight_offset=0.0, scale_layout="row",
                          scale_ue8m0=False) -> None:
    _communicator(comm).fused_all_reduce(x, residual, weight, eps, quant or None, scale, return_norm, sf_layout,
                                         weight_offset, scale_layout, scale_ue8m0,
                                         out=Tail(residual_out, norm_out, quant_out, sf_out, scales_out))


def _fused_all_reduce(x, residual, weight, scale, eps, quant, return_norm, sf_layout, comm, weight_offset=0.0,
                      scale_layout="row", scale_ue8m0=False) -> tuple:
    r = _communicator(comm).fused_all_reduce(x, residual, weight, eps, quant or None, scale, return_norm, sf_layout,
                                             weight_offset, scale_layout, scale_ue8m0)
    # An op returns tensors, never None: absent outputs are empty (fused_all_reduce maps them back),
    # each its own (outputs may not alias).
    return (r.residual, *(x.new_empty(0) if v is None else v for v in (r.norm, r.quant, r.scale_factors, r.scales)))


define("all_reduce(Tensor x, str comm) -> Tensor", _all_reduce,
       lambda x, comm: torch.empty_like(x, memory_format=torch.contiguous_format))
define("all_reduce_out(Tensor x, str comm, Tensor(a!) out) -> ()", _all_reduce_out, lambda x, comm, out: None)
define(f"fused_all_reduce({_TAIL_ARGS}, {_SCALED_ARGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
       _fused_all_reduce,
       lambda x, residual, weight, scale, eps, quant, return_norm, sf_layout, comm, weight_offset=0.0,
       scale_layout="row", scale_ue8m0=False: tuple(fake_outputs(x, quant, return_norm, sf_layout, scale_layout,
                                                                 scale_ue8m0)))
define(f"fused_all_reduce_out({_TAIL_ARGS}, Tensor(a!) residual_out, Tensor(b!)? norm_out, Tensor(c!)? quant_out, "
       f"Tensor(d!)? sf_out, Tensor(e!)? scales_out=None, {_SCALED_ARGS}) -> ()", _fused_all_reduce_out,
       lambda *args, **kwargs: None)
