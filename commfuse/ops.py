"""Every commfuse torch.library op: the Communicator's calls and the local ops, for models run through
torch.compile.

Dynamo cannot trace into a commfuse call (it launches kernels through the CUDA driver and decides its
route in Python), so a compiled model would break its graph at every all-reduce. These ops are opaque
to the compiler: fake implementations give the output shapes, including for a dynamic number of
tokens, and the real ones run the calls, so CUDA graphs (also those of `mode="reduce-overhead"`)
capture the same kernels as an eager call. For CUDA tensors the ops' kernels are C++
(csrc/host_launch.cpp): a signature already planned is launched from its plan table (a
Communicator's, or the local one) without Python; the Python kernels below plan the others (and serve
every other device).

    comm = commfuse.Communicator()
    y = commfuse.ops.all_reduce(comm, x)
    r = commfuse.ops.fused_all_reduce(comm, x, residual, weight, eps=1e-6, quant="fp8", scale=scale)
    r.residual, r.norm, r.quant, r.scale_factors, r.scales  # a commfuse.reference.Tail; absent fields are None

The ops take a tail's options but eps and weight_offset as one int, `tail` (commfuse.tail.spec.code:
the format, its scales' layout, ue8m0 and return_norm), and return a list of the outputs the call has,
in reference.Tail's order (commfuse.tail.spec.spread puts them back in a Tail): a compiled model's call
parses and returns what it uses. Every argument is positional. The functional ops take their tensors in any
layout and return dense ones (a strided operand is copied), so they are tagged `torch.Tag.flexible_layout`:
Inductor hands them its buffers as they are.
- `all_reduce(x, comm)`, `all_reduce_out(x, comm, out)`;
- `fused_all_reduce(x, residual, weight, scale, eps, weight_offset, tail, comm) -> Tensor[]`, and
  `fused_all_reduce_out(x, residual, weight, scale, eps, weight_offset, tail, comm, residual_out, norm_out,
  quant_out, sf_out, scales_out)`;
- `fused_add_rmsnorm(x, residual, weight, scale, eps, weight_offset, tail) -> Tensor[]`, residual may be None;
- `gated_rmsnorm(x, z, weight, scale, eps, group_size, norm_before_gate, tail) -> Tensor[]`, z may be None;
- `quantize(x, scale, tail) -> Tensor[]`;
- `moe_all_reduce(y, weights, row_index, shared, residual, weight, scale, eps, weight_offset, tail, comm)
  -> Tensor[]`, row_index and shared may be None.
`comm` is `Communicator.name` (communicators register themselves by name, per process). Like every
collective, a collective op must be called by every rank of the group, in the same order. The ops are
declared pure (they modify nothing but the _out ops' outputs), so a compiler may drop a call whose
outputs are unused: the same on every rank.
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Optional

import torch

from . import local
from .reference import Tail
from .tail import checks, formats
from .tail.checks import fields_of
from .tail.spec import TailSpec, code, mn_major_scales, present, public, spread

__all__ = ["all_reduce", "fused_all_reduce", "moe_all_reduce"]

_COMMUNICATORS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def register(comm) -> str:
    """Make `comm` reachable from the ops by a name unique in this process; returns the name."""
    name = f"commfuse-{next(_NUMBERS)}"
    _COMMUNICATORS[name] = comm
    return name


def live_communicators() -> list:
    """Every Communicator of this process still alive."""
    return list(_COMMUNICATORS.values())


def communicator(name: str):
    """The live Communicator of that name (LookupError if there is none)."""
    comm = _COMMUNICATORS.get(name)
    if comm is None:
        raise LookupError(f"no live commfuse.Communicator named {name!r} in this process")
    return comm


def _tensor_scale(comm, scale) -> None:
    """The ops take scale as a tensor (or None), as their schemas do. An eager call that gives another raises
    through the Communicator's refusal (comm._planned): its peers, whose calls are good, raise naming it
    rather than wait for this rank in the call's collective."""
    if scale is None or isinstance(scale, torch.Tensor):
        return
    message = f"scale must be a float32 tensor of one element, got {type(scale).__name__}"

    def refused():  # the error made where it is raised: no frame of the call holds it (routes.refuse says why)
        raise TypeError(message)
    if torch.compiler.is_compiling():
        raise TypeError(message)
    comm._planned(refused)


def all_reduce(comm, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`comm.all_reduce(x)` as a custom op: the sum of x over comm's group, in a new tensor, or in
    `out` (caller-owned, x's shape, dtype and device, contiguous: op all_reduce_out), returned.

    x: T[..., h] with h > 0 (T float16, bfloat16 or float32; others raise TypeError), on comm's device
    (CUDA for NCCL, CPU for gloo); not modified. Returns T[..., h] (x's shape), on comm's device."""
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
                     weight_offset: float = 0.0, scale_layout: str = "row", scale_ue8m0: bool = False,
                     post_weight: Optional[torch.Tensor] = None) -> Tail:
    """`comm.fused_all_reduce(...)` as a custom op (arguments and outputs as there; docs/semantics.md).

    x, residual: T[..., h]; weight, post_weight (or None): T[h]; scale: float32[1] (the dequant scale, where the
    format takes one), all on comm's device. Returns a Tail (residual [t, h]; norm [t, h] or None; quant; scale_factors;
    scales; None where absent), without the plan: `comm.plan(...)` gives that. Outside torch.compile the
    call goes to the Communicator directly (the op's body, without the dispatcher's cost); compiled code
    calls the op. out: caller-owned outputs as for Communicator.fused_all_reduce (op
    fused_all_reduce_out, which writes them; a field None there is allocated and not returned), returned
    as the Tail; out.residual may be the residual itself, updated in place, as there (compiled, the op writes
    a copy that torch's functionalization writes back)."""
    _tensor_scale(comm, scale)
    kw = dict(weight_offset=weight_offset, scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    if not torch.compiler.is_compiling():  # eager: the op's own body, as in all_reduce
        r = comm.fused_all_reduce(x, residual, weight, eps, quant, scale, return_norm, sf_layout, out=out,
                                  post_weight=post_weight, **kw)
        got = (r.residual, r.norm, r.quant, r.scale_factors, r.scales)
        if out is not None:  # as the out op returns: the caller's tensors, None where out has none
            got = tuple(None if o is None else g for o, g in zip(fields_of(out), got))
        return Tail(*got)
    _compiled_checks(x, quant, return_norm, scale_ue8m0, eps, weight_offset)
    tail = code(quant, return_norm, sf_layout, scale_layout, scale_ue8m0)
    if out is None:
        outs = torch.ops.commfuse.fused_all_reduce(x, residual, weight, scale, float(eps), float(weight_offset), tail,
                                                   comm.name, post_weight)
        return Tail(*spread(outs, tail))
    outs = fields_of(out)
    scales = outs[4]
    if scales is None or scale_layout != "mn_major":
        torch.ops.commfuse.fused_all_reduce_out(x, residual, weight, scale, float(eps), float(weight_offset), tail,
                                                comm.name, *outs, post_weight)
        return Tail(*outs)
    # MN-major out.scales: the op writes their padding rows too, which lie outside the [t, K] view that compiled
    # code copies and writes back (AOTAutograd's functionalization), so the op writes a buffer of the graph's own
    # and the view's elements are copied into the caller's, its padding rows left as they are (a GEMM reads them
    # only for rows past t, whose outputs it discards). The caller's view is checked here, the rest by the op.
    h = x.shape[-1]
    spec = mn_major_scales(x.numel() // h, h // formats.by_name("fp8_block").block, torch.float32, scale_ue8m0)
    if tuple(scales.shape) != tuple(spec.shape) or scales.dtype != spec.dtype or \
            tuple(scales.stride()) != tuple(spec.strides):
        raise ValueError("out.scales must have the MN-major scales' shape, dtype and strides (docs/semantics.md "
                         "section 11)")
    mine = x.new_empty((spec.storage_numel,), dtype=spec.dtype).as_strided(spec.shape, spec.strides)
    torch.ops.commfuse.fused_all_reduce_out(x, residual, weight, scale, float(eps), float(weight_offset), tail,
                                            comm.name, *outs[:4], mine, post_weight)
    scales.copy_(mine)
    return Tail(*outs)


def _compiled_checks(x, quant, return_norm, scale_ue8m0, eps, weight_offset, name: str = "x") -> None:
    """The compiled call's checks, as the local ops' (the schema would take eps=True as 1.0, "1" as 1.0); name:
    the argument that holds the tail's rows (x, or a MoE call's residual)."""
    local._compiled_checks(x, quant, (("return_norm", return_norm), ("scale_ue8m0", scale_ue8m0)),
                           (("eps", eps), ("weight_offset", weight_offset)), name=name)


def moe_all_reduce(comm, y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float = 1e-6, quant: Optional[str] = None, scale: Optional[torch.Tensor] = None,
                   return_norm: bool = False, sf_layout: str = "swizzled", *, row_index: Optional[torch.Tensor] = None,
                   shared: Optional[torch.Tensor] = None, weight_offset: float = 0.0, scale_layout: str = "row",
                   scale_ue8m0: bool = False) -> Tail:
    """`comm.moe_all_reduce(...)` as a custom op (arguments and outputs as there; docs/semantics.md section 14).

    y: T[t, k, h], or the permuted rows T[R, h] with row_index int32/int64 [t, k]; weights: [t, k] float32 or
    T; shared: T[t, h] or None; residual: T[t, h]; weight: T[h]; scale: float32[1] where the format takes one;
    all on comm's device. Returns a Tail as fused_all_reduce does (eager: the Communicator call directly)."""
    _tensor_scale(comm, scale)
    kw = dict(weight_offset=weight_offset, scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    if not torch.compiler.is_compiling():
        r = comm.moe_all_reduce(y, weights, residual, weight, eps, quant, scale, return_norm, sf_layout,
                                row_index=row_index, shared=shared, **kw)
        return Tail(r.residual, r.norm, r.quant, r.scale_factors, r.scales)
    if isinstance(y, torch.Tensor) and (row_index is None or isinstance(row_index, torch.Tensor)):
        checks.moe_ranks(y, row_index, sizes=False)
    _compiled_checks(residual, quant, return_norm, scale_ue8m0, eps, weight_offset, "residual")
    tail = code(quant, return_norm, sf_layout, scale_layout, scale_ue8m0)
    outs = torch.ops.commfuse.moe_all_reduce(y, weights, row_index, shared, residual, weight, scale, float(eps),
                                             float(weight_offset), tail, comm.name)
    return Tail(*spread(outs, tail))


# The ops are declared with torch.library.Library rather than torch.library.custom_op: a custom_op call
# goes through Python autograd and aliasing wrappers (~15 us a call on an H200 host, launch/host_profile.py),
# a CompositeExplicitAutograd kernel straight to the function (~5 us). What custom_op would check at run
# time holds by construction: the functional ops return fresh tensors.
_LIB = torch.library.Library("commfuse", "FRAGMENT")


def _define(schema: str, impl, fake) -> None:
    name = schema.split("(", 1)[0]
    # A functional op takes its inputs in any layout (the C++ kernels copy a strided or misaligned operand),
    # so Inductor may pass its buffers as they are. Under torch's default for custom ops (the traced
    # strides exactly) it writes an unrealised input once for each op that reads it: the embedding, read
    # by the first norm and as the first residual, was written twice.
    _LIB.define(schema, tags=() if "!" in schema else (torch.Tag.flexible_layout,))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    # No gradient, as for the eager calls (whose outputs are plain tensors): the dispatcher skips autograd for
    # the op, so its outputs do not require grad. Without this, torch's fallback would give outputs of inputs
    # that require grad a grad_fn whose backward passes back nothing (a silently missing gradient).
    _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"commfuse::{name}", fake, lib=_LIB)


def _fakes(x: torch.Tensor, tail: int, residual: bool = True, name: str = "x") -> list:
    """The outputs of a tail op as empty tensors of their shapes and strides (those its call has), from its
    rows x (the argument `name`). The real calls check their arguments; here only what the shapes need."""
    spec = TailSpec.from_code(tail)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have shape [..., h] with h > 0, got {tuple(x.shape)}")
    h = x.shape[-1]
    outs = []
    for s in spec.outputs(x.numel() // h, h, x.dtype, residual):
        if s is None:
            continue
        if s.strides is None:
            outs.append(x.new_empty(s.shape, dtype=s.dtype))
        else:
            outs.append(x.new_empty((s.storage_numel,), dtype=s.dtype).as_strided(s.shape, s.strides))
    return outs


# ---- the Python kernels (torch.ops' CompositeExplicitAutograd ones; for CUDA, the C++ kernels' misses)


def _all_reduce(x, comm):
    return communicator(comm).all_reduce(x)


def _all_reduce_out(x, comm, out) -> None:
    communicator(comm).all_reduce(x, out=out)


def _tail_options(comm: str, tail: int) -> tuple:
    """(the Communicator named comm, tail's keyword arguments). A code that does not decode raises through the
    Communicator's refusal, as _tensor_scale's error does: the peers raise naming it."""
    c = communicator(comm)
    return c, c._planned(functools.partial(public, tail))


def _fused_all_reduce(x, residual, weight, scale, eps, weight_offset, tail, comm, post_weight=None) -> list:
    c, kw = _tail_options(comm, tail)
    r = c.fused_all_reduce(x, residual, weight, eps, kw.pop("quant"), scale, weight_offset=weight_offset,
                           post_weight=post_weight, **kw)
    return present((r.residual, r.norm, r.quant, r.scale_factors, r.scales))


def _fused_all_reduce_out(x, residual, weight, scale, eps, weight_offset, tail, comm, residual_out, norm_out,
                          quant_out, sf_out, scales_out, post_weight=None) -> None:
    c, kw = _tail_options(comm, tail)
    c.fused_all_reduce(x, residual, weight, eps, kw.pop("quant"), scale, weight_offset=weight_offset,
                       out=Tail(residual_out, norm_out, quant_out, sf_out, scales_out), post_weight=post_weight, **kw)


def _fused_add_rmsnorm(x, residual, weight, scale, eps, weight_offset, tail) -> list:
    return present(local.fused_add_rmsnorm(x, residual, weight, eps, scale=scale, weight_offset=weight_offset,
                                           **public(tail)))


def _gated_rmsnorm(x, z, weight, scale, eps, group_size, norm_before_gate, tail) -> list:
    return present(local.gated_rmsnorm(x, z, weight, eps, group_size, norm_before_gate, scale=scale, **public(tail)))


def _quantize_options(tail) -> dict:
    """quantize's keyword arguments of its `tail` (the kernel's and the fake's one check: no norm to return)."""
    kw = public(tail)
    if kw["quant"] is None:
        raise ValueError("tail: quantize's code must name a format (quant None: nothing to quantize)")
    if kw.pop("return_norm"):
        raise ValueError("tail: quantize returns no norm (its code has return_norm set)")
    return kw


def _quantize(x, scale, tail) -> list:
    kw = _quantize_options(tail)
    return present(local.quantize(x, kw.pop("quant"), scale, **kw))


def _moe_all_reduce(y, weights, row_index, shared, residual, weight, scale, eps, weight_offset, tail, comm) -> list:
    c, kw = _tail_options(comm, tail)
    r = c.moe_all_reduce(y, weights, residual, weight, eps, kw.pop("quant"), scale, weight_offset=weight_offset,
                         row_index=row_index, shared=shared, **kw)
    return present((r.residual, r.norm, r.quant, r.scale_factors, r.scales))


_TAIL = "Tensor? scale, float eps, float weight_offset, int tail"

_define("all_reduce(Tensor x, str comm) -> Tensor", _all_reduce,
        lambda x, comm: torch.empty_like(x, memory_format=torch.contiguous_format))
_define("all_reduce_out(Tensor x, str comm, Tensor(a!) out) -> ()", _all_reduce_out, lambda x, comm, out: None)
# post_weight last, defaulted: the calls and code made before it stay valid.
_define(f"fused_all_reduce(Tensor x, Tensor residual, Tensor weight, {_TAIL}, str comm, Tensor? post_weight=None) "
        "-> Tensor[]", _fused_all_reduce,
        lambda x, residual, weight, scale, eps, weight_offset, tail, comm, post_weight=None: _fakes(x, tail))
_define(f"fused_all_reduce_out(Tensor x, Tensor residual, Tensor weight, {_TAIL}, str comm, Tensor(a!) residual_out, "
        "Tensor(b!)? norm_out, Tensor(c!)? quant_out, Tensor(d!)? sf_out, Tensor(e!)? scales_out, "
        "Tensor? post_weight=None) -> ()", _fused_all_reduce_out, lambda *args: None)
_define(f"fused_add_rmsnorm(Tensor x, Tensor? residual, Tensor weight, {_TAIL}) -> Tensor[]", _fused_add_rmsnorm,
        lambda x, residual, weight, scale, eps, weight_offset, tail: _fakes(x, tail, residual is not None))
_define("gated_rmsnorm(Tensor x, Tensor? z, Tensor weight, Tensor? scale, float eps, SymInt group_size, "
        "bool norm_before_gate, int tail) -> Tensor[]", _gated_rmsnorm,
        lambda x, z, weight, scale, eps, group_size, norm_before_gate, tail: _fakes(x, tail, False))
_define("quantize(Tensor x, Tensor? scale, int tail) -> Tensor[]", _quantize,
        lambda x, scale, tail: _quantize_options(tail) and _fakes(x, tail, False))
_define("moe_all_reduce(Tensor y, Tensor weights, Tensor? row_index, Tensor? shared, Tensor residual, Tensor weight, "
        f"{_TAIL}, str comm) -> Tensor[]", _moe_all_reduce,
        lambda y, weights, row_index, shared, residual, weight, scale, eps, weight_offset, tail, comm:
        _fakes(residual, tail, name="residual"))
