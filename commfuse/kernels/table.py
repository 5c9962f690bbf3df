"""The plan table's interface, and the Python table that stands in for the C++ one
(commfuse.kernels.native.Table) where the extension cannot be built.

The table is the one plan cache: per call signature it holds the call's Plan and its launcher (a
LaunchPlan's executor, or any callable with the same call for the routes without kernels), and a call
whose signature is in it is launched without planning. One table per Communicator serves its calls and
commfuse.ops' collective ops; the process's local table (name "local") serves commfuse.local's ops.

The signature (the key) is everything the checks and routes read of a call: the op, each tensor
argument's dtype, device, shape and strides (None where absent), the caller's outputs' too, and the
scalar arguments by value and type (a float, an int, a bool or a str; None; the C++ table reads an int
eps or weight_offset as the float it equals, which the checks take alike). A call the key cannot
hold (a Python float scale, an argument of another type) is a miss every time: the caller then checks
and plans it, and its insert returns False. While the table's error word (a P2P workspace's pinned host
word) is not 0 every lookup misses, so that the caller raises the workspace's error.

Lookups, one method per op (the C++ table's hot path): plain(x, out), fused(x, residual, weight, scale,
out, eps, quant, return_norm, sf_layout, weight_offset, scale_layout, scale_ue8m0, post_weight), local(the
same but post_weight; residual may be None), gated(x, z, weight, scale, eps, group_size, norm_before_gate,
quant, return_norm, sf_layout, scale_layout, scale_ue8m0), quantize(x, scale, quant, sf_layout, scale_layout, scale_ue8m0),
moe(y, weights, row_index, shared, residual, weight, scale, out, eps, quant, return_norm, sf_layout,
weight_offset, scale_layout, scale_ue8m0): the result, or None on a miss. insert(op, args, plan,
launcher): args the tuple of the op's lookup arguments. A hit calls launcher(x, residual, weight, scale,
out, z) (a MoE call: launcher(y, residual, weight, scale, out, weights, row_index, shared)) and returns
its sum (plain) or the five outputs as the op's result type: fused and moe -> fused_type (its fields
set, plan included), local and gated -> tail_type(*outputs), quantize -> quantized_type(quant,
scale_factors, scales).
"""
from __future__ import annotations

import ctypes

import torch

from ..tail.checks import dispatched, fields_of

__all__ = ["OPS", "PyTable", "MAX_ENTRIES"]

OPS = ("plain", "fused", "local", "gated", "quantize", "moe")
MAX_ENTRIES = 4096  # then the table is cleared: a decode loop repeats a handful of signatures


class _Unkeyable(Exception):
    pass


def _tensor(t):
    if t is None:
        return None
    # planning says why it takes none of these
    if (not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.is_nested or t.is_neg()
            or t._is_zerotensor() or dispatched(t)):
        raise _Unkeyable
    return (t.dtype, t.device, t.shape, t.stride())


def _scalar(v):
    if v is None or type(v) in (float, int, bool, str):
        return (type(v), v)
    raise _Unkeyable


def _out(op: str, out):
    if out is None:
        return None
    if op == "plain":
        return _tensor(out)
    try:  # only what the checks take has a key: anything else misses, and the checks raise
        fields = fields_of(out)
    except TypeError:
        raise _Unkeyable from None
    return tuple(_tensor(f) for f in fields)


def key(op: str, x, residual=None, weight=None, scale=None, z=None, out=None, eps=None, quant=None, return_norm=None,
        sf_layout=None, weight_offset=None, scale_layout=None, scale_ue8m0=None, group_size=None,
        norm_before_gate=None, row_index=None, shared=None) -> tuple:
    """The signature of a call (see the module docstring); raises _Unkeyable where it cannot be one."""
    return (op, _tensor(x), _tensor(residual), _tensor(weight), _tensor(scale), _tensor(z), _tensor(row_index),
            _tensor(shared), _out(op, out),
            *(_scalar(v) for v in (eps, quant, return_norm, sf_layout, weight_offset, scale_layout, scale_ue8m0,
                                   group_size, norm_before_gate)))


def _key_of(op: str, args: tuple) -> tuple:
    """key() of an op's lookup arguments, in the order of its lookup method."""
    if op == "plain":
        x, out = args
        return key(op, x, out=out)
    if op in ("fused", "local"):  # fused's last argument is its post_weight, the call's z
        x, residual, weight, scale, out, eps, quant, return_norm, sf_layout, weight_offset, scale_layout, ue8m0 = \
            args[:12]
        return key(op, x, residual, weight, scale, args[12] if op == "fused" else None, out, eps, quant, return_norm,
                   sf_layout, weight_offset, scale_layout, ue8m0)
    if op == "gated":
        x, z, weight, scale, eps, group_size, before, quant, return_norm, sf_layout, scale_layout, ue8m0 = args
        return key(op, x, None, weight, scale, z, None, eps, quant, return_norm, sf_layout, None, scale_layout, ue8m0,
                   group_size, before)
    if op == "quantize":
        x, scale, quant, sf_layout, scale_layout, ue8m0 = args
        return key(op, x, scale=scale, quant=quant, sf_layout=sf_layout, scale_layout=scale_layout, scale_ue8m0=ue8m0)
    if op == "moe":
        y, weights, row_index, shared, residual, weight, scale, out, eps, quant, return_norm, sf_layout, \
            weight_offset, scale_layout, ue8m0 = args
        return key(op, y, residual, weight, scale, weights, out, eps, quant, return_norm, sf_layout, weight_offset,
                   scale_layout, ue8m0, row_index=row_index, shared=shared)
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


class PyTable:
    """The Python plan table (see the module docstring): the same interface as native.Table."""

    def __init__(self, name: str, error_word: int, fused_type, tail_type, quantized_type):
        self.name = name
        self._error = ctypes.c_int32.from_address(error_word) if error_word else None
        self._types = fused_type, tail_type, quantized_type
        self._entries: dict = {}

    def _hit(self, op: str, args: tuple):
        if self._error is not None and self._error.value:
            return None
        try:
            entry = self._entries.get(_key_of(op, args))
        except _Unkeyable:
            return None
        if entry is None:
            return None
        plan, launcher = entry
        fused_type, tail_type, quantized_type = self._types
        if op == "plain":
            return launcher(args[0], None, None, None, args[1])
        if op == "gated":
            outs = launcher(args[0], None, args[2], args[3], None, args[1])
        elif op == "moe":
            y, weights, row_index, shared, residual, weight, scale, out = args[:8]
            return fused_type(*launcher(y, residual, weight, scale, out, weights, row_index, shared), plan=plan)
        elif op == "quantize":
            outs = launcher(args[0], None, None, args[1], None)
            return quantized_type(outs[2], outs[3], outs[4])
        elif op == "fused":
            outs = launcher(*args[:5], args[12])
        else:
            outs = launcher(*args[:5])
        if op == "fused":
            return fused_type(*outs, plan=plan)
        return tail_type(*outs)

    def plain(self, x, out):
        return self._hit("plain", (x, out))

    def fused(self, *args):
        return self._hit("fused", args)

    def local(self, *args):
        return self._hit("local", args)

    def gated(self, *args):
        return self._hit("gated", args)

    def quantize(self, *args):
        return self._hit("quantize", args)

    def moe(self, *args):
        return self._hit("moe", args)

    def insert(self, op: str, args: tuple, plan, launcher) -> bool:
        try:
            k = _key_of(op, args)
        except _Unkeyable:
            return False
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
        self._entries[k] = (plan, launcher)
        return True

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
