"""The argument checks of every call, in one place: a request that has no meaning raises, naming the
argument (TypeError for a wrong type, ValueError for a wrong value). What the fused routes need beyond
that is not checked here: a call they cannot take goes to the separated ops (commfuse.routes says why).

`device` is where the call's tensors must be: the communicator's device, or None for the local ops:
x's device.
"""
from __future__ import annotations

import inspect
from typing import Optional, Sequence

import torch
from torch import Tensor

from .spec import Outputs, TailSpec, flag, integer_type

__all__ = ["DTYPES", "OUT_FIELDS", "x_hidden", "tail", "gated", "moe", "quant_named", "plain_plan", "scale", "out",
           "out_like", "out_placed", "per_call", "same_device", "fields_of", "storage_room"]

# What any route can take: sums are accumulated in fp32 (the semantics), which would round an integer
# or a float64 tensor.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_FIELDS = Outputs._fields
OUT_NAMES = tuple(f"out.{f}" for f in OUT_FIELDS)  # as the errors name them


def same_device(name: str, t: Tensor, device: torch.device, where: str = "this communicator works on") -> None:
    if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
        raise ValueError(f"{name} is on {t.device}, but {where} {device}")


_PLAIN = (Tensor, torch.nn.Parameter)  # their dispatch is torch's own: no key lookup on the hot path


def dispatched(t: Tensor) -> bool:
    """Whether torch's dispatch computes t's values rather than its memory holding them: a subclass that handles
    the dispatch itself (a FakeTensor, a FunctionalTensor, an AsyncCollectiveTensor, a DTensor), a wrapper of
    torch.func.functionalize, or of torch.func's transforms (vmap's batched tensor: one example's sizes over the
    whole batch's memory; grad's). Its memory, if it has any, is not its values."""
    return torch._is_functional_tensor(t) or torch._C._functorch.is_functorch_wrapped_tensor(t) or (
        type(t) not in _PLAIN and torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python))


def _tensor(name: str, t) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided or t.is_nested:  # no strides and pointer to compute on
        raise TypeError(f"{name} must be a dense tensor, got a {'nested' if t.is_nested else t.layout} one")
    if dispatched(t):
        cls = type(t).__name__
        kind = ("a tensor of torch.func.functionalize" if torch._is_functional_tensor(t) else
                "a tensor of a torch.func transform (vmap, grad, jvp)" if
                torch._C._functorch.is_functorch_wrapped_tensor(t) else ("an " if cls[0] in "AEIOU" else "a ") + cls)
        raise TypeError(f"{name} is {kind}, whose values only torch's ops compute, while commfuse's calls launch "
                        "kernels on memory: pass a plain tensor (an AsyncCollectiveTensor's wait_tensor(), a "
                        "DTensor's to_local()), or trace the model through commfuse.ops")
    if t.is_neg():  # its memory holds -t, which the kernels would read as t
        raise TypeError(f"{name} is a lazily negated view (its negative bit is set): pass {name}.resolve_neg()")
    if t._is_zerotensor():  # no memory: its null pointer would read as an argument not given (forward-mode AD)
        raise TypeError(f"{name} is a zero tensor without memory (torch._efficientzerotensor): pass "
                        f"torch.zeros_like({name})")
    return t


def x_hidden(x, device: Optional[torch.device], where: str = "this communicator works on", name: str = "x") -> int:
    """h of x [..., h], checked: a tensor of fp16 / bf16 / fp32 with h > 0 on `device` (None: any); `name`
    is what the errors call it."""
    _tensor(name, x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have shape [..., h] with h > 0, got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if device is not None:
        same_device(name, x, device, where)
    return x.shape[-1]


def _like_x(name: str, t, x: Tensor, device: torch.device, where: str) -> None:
    _tensor(name, t)
    if t.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if t.dtype != x.dtype:
        raise TypeError(f"{name} dtype {t.dtype} must match x dtype {x.dtype}")
    same_device(name, t, device, where)


def _weight(weight, x: Tensor, h: int, device: torch.device, where: str, x_name: str = "x",
            name: str = "weight") -> None:
    _tensor(name, weight)
    if weight.dim() != 1 or weight.numel() != h:
        raise ValueError(f"{name} must have shape [{h}] ({x_name}'s hidden size), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{name} dtype {weight.dtype} must match {x_name} dtype {x.dtype}")
    same_device(name, weight, device, where)


def scale(spec: TailSpec, s, h: int, device: torch.device, x_name: str = "x",
          where: str = "this communicator works on") -> None:
    """The scale argument against the format: a float32 tensor of one element on `device` (or a
    Python number, which the separated ops round to fp32) where the format takes one, else None;
    and h (x_name's hidden size) a multiple of the format's block."""
    f = spec.format
    if f.block and h % f.block:
        raise ValueError(f"quant={f.name!r} needs {x_name}'s hidden size to be a multiple of {f.block} (one scale per "
                         f"{f.block} consecutive elements of a row), got {h}")
    if not f.takes_scale:
        if s is not None:
            raise ValueError(f"quant={f.name!r} computes its scales: scale must be None" if f.computes_scales
                             else "scale is only meaningful with a quant that takes one (fp8, nvfp4)")
        return
    if s is None:
        raise ValueError(f"quant={f.name!r} needs scale (the dequant scale, fp32 tensor of one element)")
    if isinstance(s, Tensor):
        _tensor("scale", s)
        if s.numel() != 1:
            raise ValueError(f"scale must have one element, got shape {tuple(s.shape)}")
        if s.dtype != torch.float32:
            raise TypeError(f"scale must be float32, got {s.dtype}")
        same_device("scale", s, device, where)
    elif isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"scale must be a float32 tensor of one element or a float, got {type(s).__name__}")
    scale_value(s)


_F32_ROUNDS_ABOVE_0 = 2.0 ** -150  # half the smallest subnormal: it and below round to 0 (ties to even)
_F32_ROUNDS_TO_INF = 2.0 ** 128 - 2.0 ** 103  # the largest float32 plus half its ulp: it and above round to inf


def scale_in_range(s: float) -> bool:
    """Whether the Python number s is a positive finite float32 once rounded to one (1e-50 would be 0), by
    plain comparisons: torch.compile traces them (and a symbolic float)."""
    return _F32_ROUNDS_ABOVE_0 < s < _F32_ROUNDS_TO_INF


def scale_value(s) -> None:
    """Raise unless a dequant scale is positive and finite, where reading it costs nothing: a Python number
    or a CPU tensor (a negative scale would flip every code's sign, zero or NaN make every code NaN or
    Inf). A GPU tensor's value is not read: that would synchronise with the GPU at every call."""
    if isinstance(s, Tensor):
        if s.device.type != "cpu":
            return
        s = float(s)
    if not scale_in_range(s):
        raise ValueError(f"scale must be positive and finite in float32 (the dequant scale), got {s}")


def tail(x, residual, weight, s, spec: TailSpec, device: Optional[torch.device], *, residual_optional: bool = False,
         where: str = "this communicator works on", x_name: str = "x", post_weight=None) -> int:
    """A tail call's tensors (fused_all_reduce, fused_add_rmsnorm): h, checked; `x_name`: what the errors
    call x (moe_all_reduce passes its residual, which stands for the combined rows); post_weight: a post-norm's
    weight (fused_all_reduce), checked as weight, or None."""
    h = x_hidden(x, device, where, x_name)
    device = x.device if device is None else device
    if residual is None:
        if not residual_optional:
            raise TypeError("residual must be a tensor of x's shape (all_reduce is the call without a tail)")
    else:
        _like_x("residual", residual, x, device, where)
    _weight(weight, x, h, device, where, x_name)
    if post_weight is not None:
        _weight(post_weight, x, h, device, where, x_name, "post_weight")
    scale(spec, s, h, device, x_name, where)
    return h


def gated(x, z, weight, s, spec: TailSpec, group_size, norm_before_gate) -> int:
    """gated_rmsnorm's tensors and its group (on x's device): h, checked."""
    where = "x is on"
    h = x_hidden(x, None)
    device = x.device
    if z is not None:
        _like_x("z", z, x, device, where)
    _weight(weight, x, h, device, where)
    integer_type("group_size", group_size)
    if group_size <= 0 or h % group_size:
        raise ValueError(f"group_size must be a positive divisor of h={h}, got {group_size!r}")
    flag("norm_before_gate", norm_before_gate)
    scale(spec, s, h, device)
    return h


def moe_ranks(y, row_index, sizes: bool = True) -> None:
    """y's (and row_index's) rank for the MoE form, which a compiled call checks too (ranks are static); sizes:
    also that k and h are > 0 (eager calls: under torch.compile a size check would specialise the graph)."""
    if row_index is None:
        if y.dim() != 3 or (sizes and 0 in y.shape[1:]):
            raise ValueError(f"y must be [t, k, h] with k, h > 0 (or the rows [R, h] with row_index), got "
                             f"{tuple(y.shape)}")
    elif y.dim() != 2 or row_index.dim() != 2 or (sizes and (y.shape[1] == 0 or row_index.shape[1] == 0)):
        raise ValueError(f"with row_index, y must be the rows [R, h] and row_index [t, k] (k, h > 0), got "
                         f"{tuple(y.shape)} and {tuple(row_index.shape)}")


def moe(y, weights, row_index, shared, residual, device: torch.device) -> tuple:
    """A MoE call's tensors (moe_all_reduce): (t, k, h), checked. y: T[t, k, h] (the reduction form) or,
    with row_index int32/int64 [t, k], the permuted rows T[R, h] (the finalize form); weights: [t, k]
    float32 or T; shared: T[t, h] or None; residual: T[t, h] (the combined rows' shape); all on `device`.
    row_index's values are not read here (on a GPU that would synchronise): the combine checks them
    (docs/semantics.md section 14). The tail's other arguments are `tail`'s, with residual in x's place."""
    _tensor("y", y)
    if y.dtype not in DTYPES:
        raise TypeError(f"y must be float16, bfloat16 or float32, got {y.dtype}")
    same_device("y", y, device)
    if row_index is not None:
        _tensor("row_index", row_index)
        if row_index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"row_index must be int32 or int64, got {row_index.dtype}")
    moe_ranks(y, row_index)
    if row_index is None:
        t, k, h = y.shape
    else:
        same_device("row_index", row_index, device)
        (t, k), h = row_index.shape, y.shape[1]
    _tensor("weights", weights)
    if tuple(weights.shape) != (t, k):
        raise ValueError(f"weights must have shape [t, k] = {[t, k]}, got {tuple(weights.shape)}")
    if weights.dtype not in (torch.float32, y.dtype):
        raise TypeError(f"weights must be float32 or y's dtype {y.dtype}, got {weights.dtype}")
    same_device("weights", weights, device)
    if shared is not None:
        _tensor("shared", shared)
        if tuple(shared.shape) != (t, h):
            raise ValueError(f"shared must have shape [t, h] = {[t, h]}, got {tuple(shared.shape)}")
        if shared.dtype != y.dtype:
            raise TypeError(f"shared dtype {shared.dtype} must match y dtype {y.dtype}")
        same_device("shared", shared, device)
    x_hidden(residual, device, name="residual")
    if tuple(residual.shape) != (t, h):
        raise ValueError(f"residual must have shape [t, h] = {[t, h]}, got {tuple(residual.shape)}")
    if residual.dtype != y.dtype:
        raise TypeError(f"residual dtype {residual.dtype} must match y dtype {y.dtype}")
    return t, k, h


def quant_named(quant) -> None:
    """quantize's format: a name (TailSpec.of checks which), not None."""
    if quant is None:
        raise ValueError("quant must name a format, got None")


def plain_plan(fn, values: dict) -> None:
    """comm.plan of a plain all-reduce (residual None) takes no tail argument: each argument of `fn` (comm.plan) with
    a default, out aside, must be at it in `values` (its locals), or the plan would describe a call that ignores
    it."""
    defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()
                if p.default is not inspect.Parameter.empty and k != "out"}
    given = [k for k, d in defaults.items() if (values[k] is not None if d is None else values[k] != d)]
    if given:
        raise ValueError(f"residual is required when {', '.join(given)} {'is' if len(given) == 1 else 'are'} given")


def storage_room(t: Tensor) -> int:
    """Elements of t's storage from t's first element on."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()


def fields_of(out) -> tuple:
    """The five output fields of `out`: a reference.Tail, a commfuse.FusedResult, or a tuple in Tail's
    order (4 fields: no scales); a tuple that answers _fields (a namedtuple) by its fields' names, as the native
    table reads it (csrc/host_launch.cpp, positional)."""
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        if len(out) not in (4, 5):
            raise TypeError(f"out must be a commfuse.reference.Tail (or a tuple of its {len(OUT_FIELDS)} fields: "
                            f"{', '.join(OUT_FIELDS)}; or of the first 4), got a tuple of {len(out)}")
        return tuple(out) + (None,) * (5 - len(out))
    if not all(hasattr(out, f) for f in OUT_FIELDS[:4]):
        raise TypeError(f"out must be a commfuse.reference.Tail or commfuse.FusedResult (fields "
                        f"{', '.join(OUT_FIELDS)}), got {type(out).__name__}")
    return tuple(getattr(out, f, None) for f in OUT_FIELDS)


def out(o, outputs: Outputs, device: torch.device, inputs: Sequence[tuple]) -> None:
    """Raise unless `o` (see fields_of) fits the call's outputs: each field a caller-owned tensor of
    exactly the output's shape, dtype and strides (contiguous, or for MN-major scales the reference's
    strides over a storage holding the padding rows), on `device`, 16-byte aligned, written in place; or
    None, which is allocated as usual. A tensor for an output the call does not produce raises, and so do
    outputs that overlap each other or one of `inputs` ((name, tensor or None), see no_overlap).
    out.residual may be the residual input itself (an in-place update: every kernel reads each residual
    element before it writes it, in the same thread)."""
    given = fields_of(o)
    for name, spec, t in zip(OUT_FIELDS, outputs, given):
        if t is None:
            continue
        if spec is None:
            raise ValueError(f"out.{name} must be None: this call has no such output")
        if not isinstance(t, Tensor):
            raise TypeError(f"out.{name} must be a tensor or None, got {type(t).__name__}")
        _tensor(f"out.{name}", t)
        if tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
            raise ValueError(f"out.{name} must have shape {list(spec.shape)} and dtype {spec.dtype}, got "
                             f"{list(t.shape)} {t.dtype}")
        if spec.strides is not None and tuple(t.stride()) != spec.strides:  # its storage's room: out_placed
            raise ValueError(f"out.{name} must be an MN-major view with strides {spec.strides} (of a storage of "
                             f"{spec.storage_numel} elements, padding rows included), got strides {tuple(t.stride())}")
        if t.device != device or not (spec.strides is not None or t.is_contiguous()):
            raise ValueError(f"out.{name} must be contiguous and on {device}, got a tensor on "
                             f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}")
    out_placed(OUT_NAMES, given, outputs)
    no_overlap(OUT_NAMES, given, outputs, inputs)


def out_placed(names: Sequence[str], outputs: Sequence, specs: Sequence) -> None:
    """What every call checks of the caller's outputs, because a call's signature (the plan table's key:
    shapes, strides, dtypes) does not hold it: each output 16-byte aligned (the kernels store 16-byte
    vectors), an MN-major one (its OutputSpec has strides) a view of a storage with room for the padding
    rows; none that autograd or inference mode keeps from being written in place, which a copy into it
    (the separated routes) would find only after writing the fields before it (out.residual may be the
    residual input), and a kernel not at all. names, outputs, specs as for no_overlap; a spec may be None
    for a contiguous output."""
    for name, t, spec in zip(names, outputs, specs):
        if t is None:
            continue
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad: commfuse writes it outside autograd, which torch's out= refuses "
                             "too; pass one that does not, or call under torch.no_grad()")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"{name} is an inference tensor: it may be written only under torch.inference_mode()")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned, got an address {t.data_ptr() % 16} bytes past it")
        if spec is not None and spec.strides is not None and storage_room(t) < spec.storage_numel:
            raise ValueError(f"{name} must be a view of a storage of {spec.storage_numel} elements (padding rows "
                             f"included), got room for {storage_room(t)}")


def per_call(names: Sequence[str], outputs: Sequence, specs: Sequence, inputs: Sequence[tuple], scale) -> None:
    """What a planned call's launcher checks of the call's own facts, which the plan's key does not hold: where
    the caller's outputs lie (out_placed, no_overlap: names, outputs, specs, inputs as there) and a CPU scale
    tensor's value (scale_value). For COMMFUSE_CHECK's comparison, which runs it before the collective."""
    if any(t is not None for t in outputs):
        out_placed(names, outputs, specs)
        no_overlap(names, outputs, specs, inputs)
    if scale is not None:
        scale_value(scale)


def _span(t: Tensor, storage_numel: Optional[int] = None) -> tuple:
    """[first byte, past the last byte) that t's elements (or storage_numel elements from its start: an
    MN-major output, whose padding rows the kernels write too) occupy."""
    if storage_numel is None:
        storage_numel = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + storage_numel * t.element_size()


def no_overlap(names: Sequence[str], outputs: Sequence, specs: Sequence, inputs: Sequence[tuple]) -> None:
    """Raise unless the caller's outputs overlap neither each other nor an input; out.residual may be the
    residual input's own memory (an in-place update): the residual itself, or, for a residual of another
    shape ([..., h]), a [t, h] view of it, both contiguous. names, outputs, specs: each output's
    name ("out.norm"), the caller's tensor or None, its OutputSpec or None (an MN-major one spans its
    storage, padding rows included); inputs: (name, tensor or None). Per call: the plan's key holds no
    addresses. The rule is every route's: the kernels read an input while they write the outputs."""
    spans = [(name, _span(t, s.storage_numel if s is not None and s.strides is not None else None), t)
             for name, t, s in zip(names, outputs, specs) if t is not None]
    for i, (name, (b, e), t) in enumerate(spans):
        if b == e:
            continue
        for other, (b2, e2), _ in spans[i + 1:]:
            if b < e2 and b2 < e:
                raise ValueError(f"{name} and {other} overlap: the caller's outputs must be separate tensors")
        for arg, x in inputs:
            if x is None or not isinstance(x, Tensor) or x.numel() == 0:
                continue
            b2, e2 = _span(x)
            if b < e2 and b2 < e:
                if name == "out.residual" and arg == "residual" and x.data_ptr() == t.data_ptr() and \
                        x.numel() == t.numel() and x.is_contiguous() and t.is_contiguous():
                    continue
                why = (" (out.residual may be residual itself, or a [t, h] view of a contiguous residual, for an "
                       "in-place update)") if "out.residual" in names else ""
                raise ValueError(f"{name} overlaps {arg}: the caller's outputs may not overlap an input{why}")


def out_like(o, x: Tensor) -> None:
    """Raise unless `o` can take a plain all-reduce of x: x's shape and dtype, on x's device,
    contiguous, 16-byte aligned, not overlapping x."""
    if not isinstance(o, Tensor):
        raise TypeError(f"out must be a tensor, got {type(o).__name__}")
    _tensor("out", o)
    if o.shape != x.shape or o.dtype != x.dtype or o.device != x.device:
        raise ValueError(f"out must have x's shape {list(x.shape)}, dtype {x.dtype} and device {x.device}, got "
                         f"{list(o.shape)} {o.dtype} on {o.device}")
    if not o.is_contiguous():
        raise ValueError("out must be contiguous")
    out_placed(("out",), (o,), (None,))
    no_overlap(("out",), (o,), (None,), (("x", x),))
