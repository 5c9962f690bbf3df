"""Reading an FX graph: what a node computes, whatever spelling traced it, and what it holds.

The same operation reaches a graph in several spellings: `x + r` is `operator.add` in dynamo's and
symbolic_trace's graphs, `x.add(r)` a call_method, `torch.add` a call_function, `aten.add.Tensor`
after make_fx or AOT. `kind(node)` maps all of them to one name ("add"), and `operand(node, i,
name)` reads the i-th operand (positional or keyword; a call_method's self is operand 0), so the
matchers in patterns.py are written once.

Metadata: dynamo stores each node's fake value in `meta["example_value"]`, make_fx / AOT / FakeTensorProp
in `meta["val"]`, ShapeProp a `TensorMetadata` in `meta["tensor_meta"]`; `value(node)` reads whichever
is there.
"""
from __future__ import annotations

import functools
import inspect
import math
import operator
from typing import Any, Collection, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

aten = torch.ops.aten
prims = torch.ops.prims


def _overloads(packet, *names):
    out = [packet]
    for n in names:
        try:
            out.append(getattr(packet, n))
        except AttributeError:  # an overload this torch does not have
            pass
    return out


def _table() -> dict:
    t: dict = {}

    def put(kind, *targets):
        for target in targets:
            if isinstance(target, (list, tuple)):
                for x in target:
                    t[x] = kind
            else:
                t[target] = kind

    put("add", operator.add, torch.add, _overloads(aten.add, "Tensor", "Scalar"))
    put("add_", _overloads(aten.add_, "Tensor", "Scalar"))  # the aten decomposition's mean.add_(eps)
    put("sub", operator.sub, torch.sub, torch.subtract, _overloads(aten.sub, "Tensor", "Scalar"))
    put("mul", operator.mul, torch.mul, torch.multiply, _overloads(aten.mul, "Tensor", "Scalar"))
    put("div", operator.truediv, torch.div, torch.true_divide, torch.divide,
        _overloads(aten.div, "Tensor", "Scalar"))
    put("pow", operator.pow, torch.pow, _overloads(aten.pow, "Tensor_Scalar"))
    put("square", torch.square, _overloads(aten.square, "default"))
    put("mean", torch.mean, _overloads(aten.mean, "dim"))
    put("rsqrt", torch.rsqrt, _overloads(aten.rsqrt, "default"))
    put("sqrt", torch.sqrt, _overloads(aten.sqrt, "default"))
    put("reciprocal", torch.reciprocal, _overloads(aten.reciprocal, "default"))
    put("silu", F.silu, torch._C._nn.silu, _overloads(aten.silu, "default"))
    put("clamp", torch.clamp, torch.clip, _overloads(aten.clamp, "default"))
    put("clamp_min", torch.clamp_min, _overloads(aten.clamp_min, "default"))
    put("clamp_max", torch.clamp_max, _overloads(aten.clamp_max, "default"))
    put("cast", _overloads(aten._to_copy, "default"), _overloads(prims.convert_element_type, "default"),
        _overloads(aten.to, "dtype"))
    put("view", torch.reshape, torch.flatten, _overloads(aten.view, "default"), _overloads(aten.reshape, "default"),
        _overloads(aten._unsafe_view, "default"))
    put("identity", _overloads(aten.clone, "default"), _overloads(aten.contiguous, "default"),
        _overloads(aten.alias, "default"))
    put("rms_norm", torch.rms_norm, F.rms_norm, _overloads(aten.rms_norm, "default"))
    put("sum", torch.sum, _overloads(aten.sum, "dim_IntList"))
    put("unsqueeze", torch.unsqueeze, _overloads(aten.unsqueeze, "default"))
    put("index_add", torch.index_add, _overloads(aten.index_add, "default"))
    put("index_add_", _overloads(aten.index_add_, "default"))
    put("getitem", operator.getitem)
    put("setitem", operator.setitem)
    put("empty_like", torch.empty_like)
    put("arange", torch.arange)
    put("argsort", torch.argsort)
    put("sort", torch.sort)
    put("copy_", _overloads(aten.copy_, "default"))
    put("funcol_all_reduce", _overloads(torch.ops._c10d_functional.all_reduce, "default"))
    put("funcol_all_reduce_", _overloads(torch.ops._c10d_functional.all_reduce_, "default"))
    # torch.fx.symbolic_trace keeps funcol's wrapper of the result (an AsyncCollectiveTensor, which waits when
    # read) in place of the wait: the same point in the program. funcol's import registers the op.
    from torch.distributed import _functional_collectives  # noqa: F401

    put("wait", _overloads(torch.ops._c10d_functional.wait_tensor, "default"),
        _overloads(torch.ops._c10d_functional._wrap_tensor_autograd, "default"))
    return t


_FUNCTIONS = _table()
_METHODS = {
    "add": "add", "sub": "sub", "mul": "mul", "div": "div", "true_divide": "div", "truediv": "div", "pow": "pow",
    "square": "square", "mean": "mean", "rsqrt": "rsqrt", "sqrt": "sqrt", "reciprocal": "reciprocal",
    "clamp": "clamp", "clip": "clamp", "clamp_min": "clamp_min", "clamp_max": "clamp_max",
    "to": "cast", "float": "cast", "half": "cast", "bfloat16": "cast", "type_as": "cast", "type": "cast",
    "view": "view", "reshape": "view", "view_as": "view", "reshape_as": "view", "flatten": "view",
    "contiguous": "identity", "clone": "identity", "copy_": "copy_",
    "sum": "sum", "unsqueeze": "unsqueeze", "index_add": "index_add", "index_add_": "index_add_",
    "argsort": "argsort", "sort": "sort",
}
# commfuse's own ops, resolved late (they are registered when commfuse.ops imports).
_COMMFUSE = {"all_reduce": "cf_all_reduce", "fused_add_rmsnorm": "cf_tail", "quantize": "cf_quantize",
             "fused_all_reduce": "cf_fused_all_reduce", "gated_rmsnorm": "cf_gated",
             "moe_all_reduce": "cf_moe_all_reduce"}


def _commfuse_kind(target) -> Optional[str]:
    name = getattr(target, "_qualified_op_name", None) or getattr(target, "name", None)
    if callable(name):
        name = name()
    if not isinstance(name, str):
        return None
    ns, _, op = name.partition("::")
    if ns != "commfuse":
        return None
    return _COMMFUSE.get(op.split(".")[0])


def kind(node: Any) -> Optional[str]:
    """The canonical name of what `node` computes (see the tables above), or None; None too for an add
    or a division whose extra argument changes what it computes (`alpha`, `rounding_mode`), and for a call
    given `out=` (`torch.add(x, r, out=r)` writes r too, which an op in its place would not)."""
    if not isinstance(node, fx.Node) or node.kwargs.get("out") is not None:
        return None
    k = _kind(node)
    if k in _TWO_OPERANDS and (len(node.args) > 2 or any(node.kwargs.get(a) is not None for a in _TWO_OPERANDS[k])):
        return None
    return k


# The binary kinds, and the keyword arguments that make one compute something else: torch.add(a, b,
# alpha=2) scales b, torch.div(a, b, rounding_mode="floor") rounds the quotient.
_TWO_OPERANDS = {"add": ("alpha",), "add_": ("alpha",), "sub": ("alpha",), "div": ("rounding_mode",)}


def _kind(node: fx.Node) -> Optional[str]:
    if node.op == "call_method":
        k = _METHODS.get(node.target)
        if k == "view" and node.target == "view" and any(isinstance(a, torch.dtype) for a in node.args[1:]):
            return None  # x.view(torch.uint8) reinterprets bytes
        if k == "cast" and node.target in ("to", "type") and not _to_has_dtype(node):
            return None  # a device move, or type() asking for the type's name
        return k
    if node.op == "call_function":
        k = _FUNCTIONS.get(node.target)
        if node.target in _DROPOUTS:
            return "identity" if _dropout_is_identity(node) else None
        if k is None:
            try:
                k = _commfuse_kind(node.target)
            except Exception:  # noqa: BLE001 - an odd target is just not ours
                k = None
        return k
    if node.op == "call_module":
        mod = _module(node)
        if isinstance(mod, torch.nn.RMSNorm):
            return "rms_norm"
        if isinstance(mod, torch.nn.SiLU):
            return "silu"
        if type(mod) is torch.nn.Dropout and not mod.training and not mod.inplace:
            return "identity"
        return None
    return None


# Dropout outside training returns its input: models write it on the residual branch (Seed-OSS's, Phi-3's
# residual dropout), between the all-reduce and the residual add. The training flag and its default per
# spelling: F.dropout(input, p, training=True, inplace=False), torch.dropout / aten.dropout(input, p, train).
_DROPOUTS = {F.dropout: ("training", True), torch.dropout: ("train", None),
             **{t: ("train", None) for t in _overloads(aten.dropout, "default")}}
# Every dropout returns its input itself outside training (alpha, feature and 1d-3d ones too): each may alias.
_ALIASING_DROPOUTS = {*_DROPOUTS, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d,
                      torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
                      *_overloads(aten.alpha_dropout, "default"), *_overloads(aten.feature_dropout, "default"),
                      *_overloads(aten.feature_alpha_dropout, "default")}


def _is_dropout(node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(_module(node), torch.nn.modules.dropout._DropoutNd)
    return node.op == "call_function" and node.target in _ALIASING_DROPOUTS


def _dropout_is_identity(node: fx.Node) -> bool:
    name, default = _DROPOUTS[node.target]
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get(name, default)
    inplace = node.args[3] if len(node.args) > 3 else node.kwargs.get("inplace", False)
    return training is False and inplace is False


_SHAPE_METHODS = ("size", "dim", "numel")
_SHAPE_FUNCTIONS = tuple(_overloads(aten.sym_size, "int", "default") + _overloads(aten.sym_numel, "default"))


def is_shape_query(node: fx.Node) -> bool:
    """Whether node reads only its tensor argument's sizes, not its values or strides (`x.size()`,
    `aten.sym_size.int(x, 0)`: what dynamo and make_fx insert under dynamic shapes)."""
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    return node.op == "call_function" and node.target in _SHAPE_FUNCTIONS


def _to_has_dtype(node: fx.Node) -> bool:
    return any(isinstance(a, (torch.dtype, fx.Node)) for a in node.args[1:]) or "dtype" in node.kwargs


def _module(node: fx.Node):
    gm = node.graph.owning_module
    if gm is None:
        return None
    try:
        return gm.get_submodule(node.target)
    except AttributeError:
        return None


def module(node: fx.Node):
    """The submodule a call_module node calls (None otherwise)."""
    return _module(node) if node.op == "call_module" else None


# What a merged cast and its tensor may feed: computations that read them, never write or alias them.
_READERS = frozenset({"add", "mul", "div", "pow", "square", "mean", "rsqrt", "sqrt", "reciprocal", "silu", "clamp",
                      "clamp_min", "clamp_max", "sum"})


def merge_duplicate_casts(graph: fx.Graph) -> None:
    """Replace each cast that repeats an earlier one (same call, tensor and arguments) by that one: an RMSNorm
    written with its input cast to float32 twice (`h.float().pow(2)...`, then `h.float() * ...`) is one cast to
    the matchers, in dynamo's graph and in Inductor's post-grad graph alike. Only where nothing can tell the two
    apart: the tensor is computed in the graph (not an input, which may alias another), is no view, and feeds
    only casts, computations that read it and the graph's output; each cast feeds only such computations (not
    the output: the caller would get one tensor twice). A computation's kind says what it computes, not whether it
    writes its operand too (`F.silu(b, inplace=True)`, `torch.clamp(h, 0, 1, out=h)`): none may. And only casts
    that meet in one computation (the norm's product reads one cast and the rsqrt of the other's mean): two norms
    of one tensor, each with its cast, stay two, or each would see its cast read by the other's nodes."""
    def read_only(n: fx.Node, output: bool) -> bool:
        return all(not writes(u, n) and (kind(u) in _READERS or (output and u.op == "output")
                                         or (kind(u) == "cast" and not may_alias(u)))
                   for u in n.users)

    seen: dict = {}
    for n in list(graph.nodes):
        if kind(n) != "cast" or may_alias(n):
            continue
        src = source(n)
        if not isinstance(src, fx.Node) or src.op == "placeholder" or may_alias(src) or not read_only(src, True):
            continue
        key = (n.op, n.target, n.args, tuple(sorted(n.kwargs.items())))
        try:
            first = seen.setdefault(key, n)
        except TypeError:  # an argument that cannot be a key (a list): left as it is
            continue
        if first is not n and read_only(first, False) and read_only(n, False) and _meet(first, n):
            n.replace_all_uses_with(first)
            graph.erase_node(n)


def _meet(a: fx.Node, b: fx.Node, depth: int = 8) -> bool:
    """Whether a computation reads one of a and b and, through its other operands, the other (within `depth`
    nodes): the two casts of one norm do, those of two norms do not."""
    def reaches(n: fx.Node, target: fx.Node, left: int) -> bool:
        return n is target or (left > 0 and any(reaches(i, target, left - 1) for i in n.all_input_nodes))

    return any(reaches(i, other, depth) for one, other in ((a, b), (b, a)) for u in one.users
               for i in u.all_input_nodes if i is not one)


def operand(node: fx.Node, index: int, name: Optional[str] = None, default: Any = None) -> Any:
    """The operand at `index` (a call_method's self is 0), else the keyword `name`, else default."""
    if index < len(node.args):
        return node.args[index]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    return default


def value(node: Any) -> Any:
    """The node's (fake) value or TensorMetadata from its meta, None if there is none."""
    if not isinstance(node, fx.Node):
        return None
    for key in ("val", "example_value"):
        if key in node.meta:
            return node.meta[key]
    return node.meta.get("tensor_meta")


def is_tensor(node: Any) -> bool:
    v = value(node)
    return v is not None and hasattr(v, "dtype") and hasattr(v, "shape")


def dtype(node: Any) -> Optional[torch.dtype]:
    v = value(node)
    return getattr(v, "dtype", None)


def shape(node: Any) -> Optional[tuple]:
    v = value(node)
    s = getattr(v, "shape", None)
    return None if s is None else tuple(s)


def strides(node: Any) -> Optional[tuple]:
    """The node's strides from a fake tensor or ShapeProp's TensorMetadata, None if unknown."""
    v = value(node)
    s = v.stride() if isinstance(v, torch.Tensor) else getattr(v, "stride", None)
    return None if s is None else tuple(s)


def dense_rows(node: Any) -> bool:
    """Whether node's value is laid out as the fused ops write their outputs (contiguous rows), or unknown: a
    reader of a transposed value may rely on its strides (a .view that only they allow)."""
    v = value(node)
    if not isinstance(v, torch.Tensor):
        stride = strides(node)  # ShapeProp's TensorMetadata: its sizes and strides
        if stride is None or getattr(v, "shape", None) is None:
            return True
        try:
            expected = 1
            for size, step in reversed(tuple(zip(v.shape, stride))):
                if size != 1 and step != expected:
                    return False
                expected *= size
            return True
        except Exception:  # noqa: BLE001 - symbolic sizes that cannot be decided, as below
            return True
    try:
        return bool(v.is_contiguous())
    except Exception:  # noqa: BLE001 - symbolic strides that cannot be decided: as the graph's shapes are
        return True


def device(node: Any) -> Optional[torch.device]:
    v = value(node)
    d = getattr(v, "device", None)
    return None if d is None else torch.device(d)


def static_int(d: Any) -> Optional[int]:
    """d as an int when it is one, or a symbolic size with a known value; None otherwise. Never
    guards: int() of a SymInt would specialise the graph on it (no more dynamic token counts)."""
    if isinstance(d, bool):
        return None
    if isinstance(d, int):
        return d
    try:
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        return int(d) if is_concrete_int(d) else None
    except Exception:  # noqa: BLE001
        return None


def same_shape(a: Any, b: Any) -> bool:
    """Shapes equal as written (symbolic sizes compared by expression: no guard is added)."""
    sa, sb = shape(a), shape(b)
    return sa is not None and sb is not None and tuple(map(str, sa)) == tuple(map(str, sb))


def hidden(node: Any) -> Optional[int]:
    """The last dimension, when it is a concrete integer."""
    s = shape(node)
    return static_int(s[-1]) if s else None


def tokens(node: Any) -> Optional[int]:
    """The product of all but the last dimension, when every one is concrete."""
    s = shape(node)
    if not s:
        return None
    dims = [static_int(d) for d in s[:-1]]
    return None if any(d is None for d in dims) else math.prod(dims)


def numel_is_one(node: Any) -> bool:
    s = shape(node)
    if s is None:
        return False
    dims = [static_int(d) for d in s]
    return all(d is not None for d in dims) and math.prod(dims) == 1


def number(x: Any) -> Optional[float]:
    """A Python number operand as float (bools are not numbers here), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def hinted_number(x: Any) -> tuple:
    """(value, symbolic): a Python number's value, or the value dynamo saw for a symbolic float (a
    node holding a SymFloat: dynamo lifts float globals and attributes to graph inputs under
    dynamic=True), with symbolic True; (None, False) otherwise."""
    v = number(x)
    if v is not None:
        return v, False
    val = value(x)
    if isinstance(val, (torch.SymFloat, torch.SymInt)):
        hint = getattr(val.node, "hint", None)
        if isinstance(hint, (int, float)) and not isinstance(hint, bool):
            return float(hint), True
    return None, False


def cast_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype a cast node produces: from its metadata, else from its arguments."""
    d = dtype(node)
    if d is not None:
        return d
    if node.op == "call_method":
        simple = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
        if node.target in simple:
            return simple[node.target]
        if node.target == "type_as":
            return dtype(node.args[1])
    for a in list(node.args[1:]) + [node.kwargs.get("dtype")]:
        if isinstance(a, torch.dtype):
            return a
    return None


def source(node: fx.Node) -> Optional[fx.Node]:
    """The tensor a cast/view/identity node reads."""
    a = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    return a if isinstance(a, fx.Node) else None


def passthrough(node: Any) -> bool:
    """A node that only reshapes or copies (no arithmetic): a view, or a cast to the dtype it has."""
    k = kind(node)
    if k in ("view", "identity"):
        return True
    if k == "cast":
        src = source(node)
        return src is not None and dtype(src) is not None and cast_dtype(node) == dtype(src)
    return False


# Ops (by name, in any spelling) whose result may be an input itself or a view of one. A deny-list: an op
# missing here is taken for a new tensor, so every spelling that dynamo keeps in a graph belongs here.
_ALIASING = {"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "transpose", "t", "permute",
             "squeeze", "unsqueeze", "expand", "expand_as", "broadcast_to", "narrow", "select", "split", "chunk",
             "unbind", "hsplit", "vsplit", "dsplit", "unsafe_split", "unsafe_chunk", "unsafe_split_with_sizes",
             "as_strided", "diagonal", "detach", "alias", "contiguous", "movedim", "moveaxis", "swapaxes",
             "swapdims", "adjoint", "unfold", "view_as_real", "view_as_complex", "split_with_sizes", "tensor_split",
             "__getitem__", "ravel", "atleast_1d", "atleast_2d", "atleast_3d", "positive", "conj", "resolve_conj",
             "resolve_neg", "cpu", "cuda", "_get_data_attr"}
# Tensor attributes that are views of the tensor (dynamo keeps `x.T` as getattr(x, "T")).
_ALIASING_ATTRIBUTES = {"T", "mT", "H", "mH", "real", "imag", "data"}


def may_alias(node: Any) -> bool:
    """Whether node's value may share memory with one of its inputs (a view, a slice, an in-place op's result:
    `z = y.add_(b)` is y itself)."""
    if not isinstance(node, fx.Node):
        return False
    if node.args and isinstance(node.args[0], fx.Node) and writes(node, node.args[0]):
        return True
    if node.kwargs.get("out") is not None:
        return True  # a call given out= returns that tensor
    if _is_dropout(node):
        return True  # outside training it returns its input itself
    if kind(node) == "cast" or (node.op == "call_method" and node.target in _DTYPE_METHODS):
        src = source(node)
        if dtype(node) is not None and dtype(node) == dtype(src):
            return True  # a cast to the dtype it has returns its input itself (x.bool() of a bool x, x.to(x.dtype))
    if node.op == "call_method":
        # x.to(device), x.to(memory_format=...) (no dtype: not a cast) return x itself where nothing changes
        return node.target in _ALIASING or (node.target in ("to", "type") and kind(node) != "cast")
    if node.op == "call_module":
        return not _fresh_module(_module(node))
    if node.op != "call_function":
        return False
    t = node.target
    if t is getattr:
        return len(node.args) > 1 and (node.args[1] in _ALIASING_ATTRIBUTES or isinstance(value(node), torch.Tensor))
    if t is operator.getitem:
        # An item of sort's, topk's, ... result is a tensor of its own (a write to the values leaves the
        # indices alone); any other container's items may be views (split, vsplit, unsafe_chunk, a module's tuple).
        container = node.args[0] if node.args else None
        if isinstance(value(container), torch.Tensor) and len(node.args) > 1 and _advanced_index(node.args[1]):
            return False  # rows[perm]: indexing by a tensor or a list gathers a copy
        return not (isinstance(value(container), (tuple, list)) and _name(container) in _FRESH_TUPLES)
    schema = getattr(t, "_schema", None)
    if schema is not None:
        return any(r.alias_info is not None for r in schema.returns)
    return getattr(t, "__name__", None) in _ALIASING


def _advanced_index(index: Any) -> bool:
    """Whether a tensor's [index] is advanced indexing, which copies: a tensor (known to be one), a list, or a tuple
    holding either. Ints, slices, None and Ellipsis alone index a view."""
    if isinstance(index, tuple):
        return any(_advanced_index(i) for i in index)
    return isinstance(index, list) or (isinstance(index, fx.Node) and is_tensor(index))


# Leaf modules (symbolic_trace keeps torch.nn's as call_module nodes) that return a new tensor: any other may return
# its input or a view of it (nn.Identity, nn.Flatten, nn.Unflatten, a dropout). Exact types: a subclass may not.
_FRESH_MODULES = {torch.nn.Linear, torch.nn.Bilinear, torch.nn.Embedding, torch.nn.EmbeddingBag}
_FRESH_MODULE_FILES = {"torch.nn.modules.activation", "torch.nn.modules.normalization", "torch.nn.modules.batchnorm",
                       "torch.nn.modules.conv"}


def _fresh_module(mod) -> bool:
    """Whether a module's call returns a tensor of its own (writing its input in place aside: `writes` says)."""
    return type(mod) in _FRESH_MODULES or type(mod).__module__ in _FRESH_MODULE_FILES


# Tensor methods that cast to a dtype (those graph.kind does not name "cast" too).
_DTYPE_METHODS = {"bool", "int", "long", "short", "byte", "char", "double"}
# Ops whose tuple results are new tensors, none a view of an input or of another.
_FRESH_TUPLES = {"sort", "topk", "kthvalue", "mode", "median", "max", "min", "aminmax", "var_mean", "std_mean"}


def _name(node: fx.Node) -> Optional[str]:
    """The name of what a call node runs: a method's, a function's, or an aten overload's packet."""
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet if packet is not None else node.target, "__name__", None)


_IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand,
                       operator.ior, operator.ixor, operator.ilshift, operator.irshift}


def writes(node: fx.Node, target: fx.Node) -> bool:
    """Whether node writes `target` in place: `target.add_(...)`, `target[i] = v`, `target /= s`, an op
    whose schema marks that argument written (aten's copy_, a functional collective's in-place form), a
    call that takes it as `out=` (dynamo keeps those in the graph), or one told `inplace=True`
    (F.relu(target, inplace=True), an nn.ReLU(inplace=True) module)."""
    out = node.kwargs.get("out")
    if out is target or (isinstance(out, (tuple, list)) and any(o is target for o in out)):
        return True
    if node.op in ("call_function", "call_module") and node.args and node.args[0] is target and _inplace(node):
        return True
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.startswith("_") and bool(node.args) and node.args[0] is target
    if node.op != "call_function":
        return False
    if node.target in _IN_PLACE_OPERATORS:
        return bool(node.args) and node.args[0] is target
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return any(a.alias_info is not None and a.alias_info.is_write and i < len(node.args)
                   and _holds(node.args[i], target) for i, a in enumerate(schema.arguments))
    name = getattr(node.target, "__name__", "")
    # torch._foreach_mul_([a, b], s) writes every tensor of its first list.
    return (name.endswith("_") and (not name.startswith("_") or name.startswith("_foreach_")) and bool(node.args)
            and _holds(node.args[0], target))


def _holds(arg, target: fx.Node) -> bool:
    """Whether an argument is target, or a list or tuple that holds it (a foreach op's tensors)."""
    return arg is target or (isinstance(arg, (tuple, list)) and any(a is target for a in arg))


def _inplace(node: fx.Node) -> bool:
    """Whether a call_function or call_module node is told to write its first operand (`inplace=True`, by
    keyword or position, as torch.nn.functional's activations take it; a module's `inplace` attribute)."""
    if node.op == "call_module":
        return getattr(_module(node), "inplace", False) is True
    if "inplace" in node.kwargs:
        return node.kwargs["inplace"] is True
    try:
        params = _parameters(node.target)
    except TypeError:  # an unhashable callable
        return False
    if "inplace" not in params:
        return False
    i = params.index("inplace")
    return i < len(node.args) and node.args[i] is True


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> tuple:
    """The names of fn's parameters in order, () where Python cannot tell (a builtin, an OpOverload)."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def written_between(node: fx.Node, lo: fx.Node, hi: fx.Node, positions: dict,
                    ignore: Collection[fx.Node] = ()) -> Optional[fx.Node]:
    """A node strictly between lo and hi (graph order), not in `ignore`, that writes node's memory in place
    (node itself, a tensor it views or one that views it), or None."""
    for a in aliases(node):
        for u in a.users:
            if positions[lo] < positions.get(u, -1) < positions[hi] and u not in ignore and writes(u, a):
                return u
    return None


def aliases(node: fx.Node) -> set:
    """The nodes that may hold node's memory: the tensor it views (through views and in-place ops' results), and
    every view of that."""
    root = node
    while may_alias(root) and _aliased(root) is not None:
        root = _aliased(root)
    found, stack = {root}, [root]
    while stack:
        for u in stack.pop().users:
            if u not in found and may_alias(u) and _aliased(u) in found:
                found.add(u)
                stack.append(u)
    return found


def _aliased(node: fx.Node) -> Optional[fx.Node]:
    """The tensor whose memory an aliasing node's value may be: the out= tensor of a call given one, else its
    source."""
    out = node.kwargs.get("out")
    return out if isinstance(out, fx.Node) else source(node)


def order(graph: fx.Graph) -> dict:
    """Each node's position in the graph."""
    return {n: i for i, n in enumerate(graph.nodes)}
