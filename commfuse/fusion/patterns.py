"""Matching: find RMSNorms (plain and gated), the residual add before one, the all-reduce before
that, and the quantizations after it, as models write them. Nothing here changes the graph.

Each matcher returns a small record of the nodes it found, or a `Mismatch(reason)` saying why a
candidate is not the pattern (or not one the fused ops compute); rewrite.py turns records into ops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import torch
import torch.fx as fx

from . import graph as G
from ..tail.spec import public

FP8_MAX = 448.0
T_DTYPES = (torch.float16, torch.bfloat16)
_F32 = torch.float32


@dataclass
class Mismatch:
    """Why a candidate is not fused. kind: "pattern" (not the pattern, or not as the fused op
    computes it) or "guard" (the pattern, but a condition the fused ops need fails); norm_input: a
    rejected RMSNorm's input where known (the all-reduce feeding it is reported with this reason)."""

    reason: str
    kind: str = "pattern"
    norm_input: Optional[fx.Node] = None


@dataclass
class Norm:
    """An RMSNorm found in the graph.

    input: the T tensor normalised (the residual sum, or the gated norm's x); output: the T norm the
    consumers read; weight: a Node, or ("module", "path.weight") for an nn.RMSNorm call_module; eps:
    a float, or a Node holding a SymFloat (dynamo lifts some float attributes); nodes: every node of
    the norm after `input` up to `output` (all replaced); gate: z of a gated norm (norm_before_gate
    says where silu(z) multiplies); group_size: elements normalised together (None: the row);
    weight_dtype: the weight's dtype where the graph says (the rewrite needs the activations');
    shape_queries: (user, node) where a node of the norm of `input`'s shape is read only for its sizes
    (`x.size()` under dynamic shapes): the rewrite points the user at `input`, which has those sizes."""

    input: fx.Node
    output: fx.Node
    weight: Union[fx.Node, tuple]
    eps: Union[float, fx.Node]
    nodes: List[fx.Node]
    spelling: str
    weight_offset: float = 0.0
    gate: Optional[fx.Node] = None
    norm_before_gate: bool = False
    group_size: Optional[int] = None
    notes: List[str] = field(default_factory=list)
    weight_dtype: Optional[torch.dtype] = None
    shape_queries: List[Tuple[fx.Node, fx.Node]] = field(default_factory=list)

    @property
    def gated(self) -> bool:
        return self.gate is not None or self.group_size is not None


@dataclass
class AllReduce:
    """A sum all-reduce whose result feeds the residual add.

    x: the tensor reduced (the partial sums); value: the node whose value is the sum as the add reads
    it (after `chain`, the views and no-op casts between them); nodes: the collective's own nodes
    (all_reduce, wait_tensor, and copy_ in dynamo's in-place form); comm: the Communicator's name in
    commfuse's op, or None for a torch.distributed collective (the pass's comm then)."""

    x: fx.Node
    nodes: List[fx.Node]
    chain: List[fx.Node]
    spelling: str
    group: Optional[str] = None
    comm: Optional[str] = None
    # The input of a second all-reduce over the same group whose sum the graph adds to this one's (a MoE
    # block's shared expert, all-reduced apart from the routed combine): the fused op sums the two per rank.
    added: Optional[fx.Node] = None


@dataclass
class Quant:
    """A quantization of the norm: FP8 as (n / scale).clamp(-448, 448).to(float8_e4m3fn) (or a
    multiply by 1/scale), or commfuse's quantize op. scale: the dequant scale node, or
    ("reciprocal", node) when the graph multiplies by a quant scale `node` (1/scale is inserted);
    nodes: the nodes replaced (views first); final: the node whose value is the codes (for
    commfuse.quantize: the op, read through getitem); views: the views, copies and no-op casts between norm and
    quant (the rewrite replays the views on the codes)."""

    quant: str
    scale: Union[fx.Node, tuple, None]
    sf_layout: str
    nodes: List[fx.Node]
    final: fx.Node
    views: List[fx.Node]
    spelling: str
    notes: List[str] = field(default_factory=list)
    scale_layout: str = "row"
    scale_ue8m0: bool = False

    @property
    def key(self) -> tuple:
        return (self.quant, self.scale, self.sf_layout, self.scale_layout, self.scale_ue8m0)


# --------------------------------------------------------------------------- small helpers


def _single_user(n: fx.Node) -> Optional[fx.Node]:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _binary(n: fx.Node) -> Tuple:
    return G.operand(n, 0, "input", G.operand(n, 0, "self")), G.operand(n, 1, "other")


def _other(n: fx.Node, one) -> object:
    """The operand of a binary node that is not `one` (None if `one` is not an operand)."""
    a, b = _binary(n)
    if a is one:
        return b
    if b is one:
        return a
    return None


def _is_cast_to(n, dtype) -> bool:
    return G.kind(n) == "cast" and G.cast_dtype(n) == dtype


def _f32_of(n) -> Optional[fx.Node]:
    """t when n is t cast to float32 (t of another dtype), else None."""
    if _is_cast_to(n, _F32):
        src = G.source(n)
        if src is not None and G.dtype(src) != _F32:
            return src
    return None


def _silu_input_f32(n) -> Optional[fx.Node]:
    """z when n is silu(float32(z)) (or an nn.SiLU module on it), else None."""
    if G.kind(n) != "silu":
        return None
    src = n.args[0] if n.args else n.kwargs.get("input")
    return _f32_of(src) if isinstance(src, fx.Node) else None


def _is_mean_last(n: fx.Node, rank: Optional[int]) -> bool:
    if G.kind(n) != "mean":
        return False
    dim = G.operand(n, 1, "dim")
    keepdim = G.operand(n, 2, "keepdim", False)
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    if not isinstance(dim, int) or keepdim is not True:
        return False
    return dim == -1 or (rank is not None and dim == rank - 1)


def _is_square_of(n: fx.Node) -> Optional[fx.Node]:
    """v when n is v**2 (pow, square, v*v)."""
    k = G.kind(n)
    if k == "pow" and G.number(G.operand(n, 1, "exponent")) == 2.0:
        return G.operand(n, 0, "input", G.operand(n, 0, "self"))
    if k == "square":
        return G.operand(n, 0, "input")
    if k == "mul":
        a, b = _binary(n)
        return a if a is b and isinstance(a, fx.Node) else None
    return None


def _eps_of(add: fx.Node, mean: fx.Node):
    """eps when add is mean + eps (either order): a number >= 0 or a SymFloat node; a Mismatch for a tensor, else
    None."""
    other = _other(add, mean)
    eps = G.number(other)
    if eps is not None:
        return eps if eps >= 0 else None
    if isinstance(other, fx.Node) and not G.is_tensor(other):
        return other  # dynamo's item() of a lifted float attribute: a SymFloat
    if isinstance(other, fx.Node) and G.numel_is_one(other) and other.op == "call_method" and other.target == "item":
        return other
    if isinstance(other, fx.Node) and G.is_tensor(other) and G.numel_is_one(other):
        return Mismatch(f"RMSNorm at {add.name}: eps is a one-element tensor ({other.name}; torch.compile's "
                        "dynamic=True makes a float a graph input that way in Inductor's graph): the fused ops take "
                        "eps as a number", "guard")
    return None


def _centred(v: fx.Node) -> bool:
    """Whether v is x - mean(x) over the last dim (x itself, or a cast of it, on either side)."""
    if G.kind(v) != "sub":
        return False
    a, b = _binary(v)
    for mean, x in ((b, a), (a, b)):
        if _is_mean_last(mean, _rank(x)):
            of = G.operand(mean, 0, "input", G.operand(mean, 0, "self"))
            return of is x or any(G.kind(c) == "cast" and G.source(c) is o for c, o in ((of, x), (x, of)))
    return False


def _rank(n) -> Optional[int]:
    s = G.shape(n)
    return None if s is None else len(s)


# --------------------------------------------------------------------------- RMSNorm


def match_norm(node: fx.Node) -> Union[Norm, Mismatch, None]:
    """A norm anchored at `node`: an rms_norm op / nn.RMSNorm module, or the rsqrt (1/sqrt) of a
    hand-written one. None when node is no such anchor."""
    k = G.kind(node)
    if k == "rms_norm":
        return _match_rms_op(node)
    if k in ("rsqrt", "reciprocal", "div"):
        return _match_manual(node)
    return None


def _match_rms_op(n: fx.Node) -> Union[Norm, Mismatch]:
    mod = G.module(n)
    if mod is not None:  # nn.RMSNorm as a leaf module (torch.fx.symbolic_trace)
        x = n.args[0] if n.args else n.kwargs.get("x", n.kwargs.get("input"))
        shape, eps = tuple(mod.normalized_shape), mod.eps
        weight = ("module", f"{n.target}.weight") if mod.weight is not None else None
        wdtype = None if mod.weight is None else mod.weight.dtype
        spelling = "nn.RMSNorm"
    else:
        x = G.operand(n, 0, "input")
        shape = G.operand(n, 1, "normalized_shape")
        weight = G.operand(n, 2, "weight")
        eps = G.operand(n, 3, "eps")
        wdtype = G.dtype(weight)
        spelling = "torch.rms_norm"
        shape = tuple(shape) if isinstance(shape, (list, tuple)) else (shape,)
    if not isinstance(x, fx.Node):
        return Mismatch(f"{spelling} of a non-tensor")
    notes = []
    h = G.hidden(x)
    if len(shape) == 1 and (h is None or isinstance(shape[0], fx.Node)) and G.shape(x):
        return Mismatch("the hidden size is symbolic: the fused ops need a fixed one", norm_input=x)
    if len(shape) != 1 or h is None or G.number(shape[0]) != h:
        return Mismatch(f"{spelling} over {shape}: the fused ops normalise the last dimension only", norm_input=x)
    if weight is None:
        return Mismatch(f"{spelling} without a weight (elementwise_affine=False): no fused op takes that yet",
                        "guard")
    if eps is None:
        eps = torch.finfo(torch.float32).eps
        notes.append(f"eps=None: torch uses finfo(float32).eps = {eps:.6g} (the fp32 math's), and so does the fused op")
    elif G.number(eps) is not None:
        eps = G.number(eps)
    elif not isinstance(eps, fx.Node):
        return Mismatch(f"{spelling}: eps {eps!r} is not a number")
    upcast = None if mod is not None else _upcast_rms_op(n, x, weight)
    if upcast is not None:  # rms_norm(x.float(), (h,), w.float(), eps).to(T): the fused op's own math
        x_t, w_t, back = upcast
        return Norm(input=x_t, output=back, weight=w_t, eps=eps, nodes=[x, weight, n, back],
                    spelling=spelling + " of float32 casts, cast back", notes=notes, weight_dtype=G.dtype(w_t))
    return Norm(input=x, output=n, weight=weight, eps=eps, nodes=[n], spelling=spelling, notes=notes,
                weight_dtype=wdtype)


def _upcast_rms_op(n: fx.Node, x: fx.Node, weight) -> Optional[Tuple[fx.Node, fx.Node, fx.Node]]:
    """(x_t, w_t, back) where rms_norm `n` normalises float32(x_t) with weight float32(w_t), both float16/bfloat16
    of one dtype, and one cast `back` to that dtype reads it: a float32 norm and weight multiply rounded once, as
    the fused ops compute. The casts must feed the norm alone (they are replaced with it)."""
    x_t, w_t, back = _f32_of(x), _f32_of(weight), _single_user(n)
    if x_t is None or w_t is None or back is None or G.dtype(x_t) not in T_DTYPES or G.dtype(w_t) != G.dtype(x_t) \
            or not _is_cast_to(back, G.dtype(x_t)) or len(x.users) != 1 or len(weight.users) != 1:
        return None
    return x_t, w_t, back


def _match_manual(r: fx.Node) -> Union[Norm, Mismatch, None]:
    notes: List[str] = []
    k = G.kind(r)
    if k == "rsqrt":
        e = G.operand(r, 0, "input")
    elif k == "reciprocal" and G.kind(G.operand(r, 0, "input")) == "sqrt":
        sq = G.operand(r, 0, "input")
        e = G.operand(sq, 0, "input")
        notes.append("1/sqrt(...) in the graph rounds twice, the fused op takes rsqrt: a few fp32 ulps of the "
                     "inverse RMS, within the norm's 1 ulp of T")
    elif k == "div" and G.number(_binary(r)[0]) == 1.0 and G.kind(_binary(r)[1]) == "sqrt":
        sq = _binary(r)[1]
        e = G.operand(sq, 0, "input")
        notes.append("1/sqrt(...) in the graph rounds twice, the fused op takes rsqrt: a few fp32 ulps of the "
                     "inverse RMS, within the norm's 1 ulp of T")
    else:
        return None
    inner = [r] if k == "rsqrt" else [G.operand(r, 0, "input") if k == "reciprocal" else _binary(r)[1], r]
    if not isinstance(e, fx.Node) or G.kind(e) not in ("add", "add_"):
        return None
    a, b = _binary(e)
    mean = a if G.kind(a) == "mean" else b if G.kind(b) == "mean" else None
    if mean is None:
        return None
    eps = _eps_of(e, mean)
    if eps is None:
        return None
    sq_node = G.operand(mean, 0, "input", G.operand(mean, 0, "self"))
    if not isinstance(sq_node, fx.Node):
        return None
    v = _is_square_of(sq_node)
    if not isinstance(v, fx.Node) or not _is_mean_last(mean, _rank(v)):
        return None
    if _centred(v):  # Cohere's, OLMo's LayerNorm spelt out
        return Mismatch(f"LayerNorm at {r.name}: it normalises {v.name}, its input minus the input's mean; commfuse's "
                        "fused ops take RMSNorm")
    if G.dtype(mean) not in (None, torch.float32):  # mean(..., dtype=torch.float64): the rest follows in it
        return Mismatch(f"RMSNorm at {r.name}: the mean of squares is {G.dtype(mean)} (the norm computed in it), "
                        "and the fused ops compute in float32", norm_input=G.source(v) if G.kind(v) == "cast" else v)
    if isinstance(eps, Mismatch):  # the norm's input: the T tensor v casts, whose all-reduce is reported with it
        eps.norm_input = G.source(v) if G.kind(v) == "cast" else v
        return eps
    # The multiply by the inverse RMS: a user of r that multiplies v.
    p = None
    for u in r.users:
        if G.kind(u) == "mul" and _other(u, r) is v:
            p = u
    if p is None:
        return Mismatch(f"RMSNorm core at {r.name}: no multiply of the normalised tensor by the inverse RMS")
    core = [sq_node, mean, e] + inner + [p]
    # Grouped (Nemotron-H / Mamba2 with ngroups): v is base viewed as [..., g, group_size]; p is viewed back.
    base, group_size, out = v, None, p
    if G.kind(v) == "view":
        src = G.source(v)
        hv, hs = G.hidden(v), G.hidden(src)
        if src is not None and hv is not None and hs is not None and hs % hv == 0 and G.dtype(src) == G.dtype(v):
            back = _single_user(p)
            if back is None or G.kind(back) != "view" or G.hidden(back) != hs:
                return Mismatch(f"grouped RMSNorm at {r.name}: the normalised groups are not viewed back to rows")
            base, group_size, out = src, (hv if hv != hs else None), back
            core = [v] + core + [back]
    # Interior nodes may feed nothing outside the norm but a query of their sizes (checked below).
    inside, queries = set(core), []
    for n in core[:-1]:
        for u in n.users:
            if u in inside:
                continue
            if not G.is_shape_query(u):
                return Mismatch(f"RMSNorm at {r.name}: its intermediate {n.name} is also used by {u.name}")
            queries.append((u, n))
    # What is normalised: float32(H) (plain), or float32(x) * silu(float32(z)) (gated before the norm).
    gate, norm_before_gate, prefix = None, False, []
    h_in = _f32_of(base)
    if h_in is None and G.kind(base) == "mul":
        x_, y_ = _binary(base)
        for xx, zz in ((x_, y_), (y_, x_)):
            if isinstance(zz, fx.Node) and _f32_of(xx) is not None and _silu_input_f32(zz) is not None:
                h_in, gate = _f32_of(xx), _silu_input_f32(zz)
                prefix = [xx, zz.args[0], zz, base]
                break
    if h_in is None:
        if G.dtype(base) == _F32 and not _computed_from_half(base):
            return Mismatch(f"RMSNorm at {r.name} of float32 activations: commfuse's fused ops take float16/bfloat16",
                            "guard", base)
        return Mismatch(f"RMSNorm at {r.name}: what is normalised ({base.name}) is not a float32 cast of a "
                        f"float16/bfloat16 tensor")
    cast_in = [base] if gate is None else prefix
    # The cast of the input may also feed the (plain) norm's multiply only, and queries of its sizes.
    inside |= set(cast_in)
    for n in cast_in:
        for u in n.users:
            if u in inside:
                continue
            if not G.is_shape_query(u):
                return Mismatch(f"RMSNorm at {r.name}: {n.name} is also used by {u.name}")
            queries.append((u, n))
    for u, n in queries:  # answered by x after the rewrite: only where n has x's sizes
        if not G.same_shape(n, h_in):
            return Mismatch(f"RMSNorm at {r.name}: the sizes of {n.name}, which are not x's, are read by {u.name}")
    t = G.dtype(h_in)
    nodes = cast_in + core
    spelling = "RMSNorm (hand-written)" if gate is None and group_size is None else "gated RMSNorm"
    # Weight and the cast back to T, in one of the orders models write.
    y = out
    u = _single_user(y)
    if u is None:
        return Mismatch(f"RMSNorm at {r.name}: the normalised rows {y.name} have several users")
    weight, offset, output = None, 0.0, None
    if _is_cast_to(u, t):  # ... .to(T), then weight * that (HF Llama / Qwen / Mistral / Mamba2)
        m = _single_user(u)
        wn = _other(m, u) if m is not None and G.kind(m) == "mul" else None
        if not isinstance(wn, fx.Node) or G.dtype(wn) != t or G.dtype(m) != t:
            return Mismatch(f"RMSNorm at {r.name}: after the cast back to {_dt(t)} no multiply by a {_dt(t)} weight "
                            "(no weight, or one of another dtype): no fused op computes that yet", "guard")
        weight, output = wn, m
        nodes += [u, m]
        notes.append(f"weight multiply after the cast back to {_dt(t)}: the graph rounds to {_dt(t)} twice, the fused op "
                     "once (the norm within 1 ulp of T; quantized codes are those of the fused norm)")
    elif G.kind(u) == "mul":  # (rows * weight in fp32).to(T) (exact), Gemma's rows * (1 + w.float())
        wn = _other(u, y)
        w_t = None
        extra = []
        if isinstance(wn, fx.Node) and G.dtype(wn) == t:
            w_t = wn  # promoted: float(w) * rows in fp32, whatever computed w (w + w, a merged LoRA's; 1 + w in T)
        elif _f32_of(wn) is not None:
            w_t, extra = _f32_of(wn), [wn]
        elif isinstance(wn, fx.Node) and G.kind(wn) == "add":
            a1, b1 = _binary(wn)
            for num, cf in ((a1, b1), (b1, a1)):
                if G.number(num) is not None and isinstance(cf, fx.Node) and _f32_of(cf) is not None:
                    w_t, offset, extra = _f32_of(cf), G.number(num), [cf, wn]
                    spelling = "Gemma RMSNorm (1 + w)" if gate is None else spelling
                    break
        if w_t is None or G.dtype(w_t) != t:
            return Mismatch(f"RMSNorm at {r.name}: the rows are multiplied by {getattr(wn, 'name', wn)}, not a "
                            f"{t} weight (or float32 of one, or 1 + float32 of one)")
        for n in extra:
            if len(n.users) != 1:
                return Mismatch(f"RMSNorm at {r.name}: the weight's {n.name} has other users")
        nodes += extra + [u]
        cur = u
        if gate is None:  # gated after the norm (mamba_ssm's norm_before_gate=True)?
            g = _single_user(cur)
            if g is not None and G.kind(g) == "mul":
                zz = _other(g, cur)
                if isinstance(zz, fx.Node) and _silu_input_f32(zz) is not None and len(zz.users) == 1:
                    gate, norm_before_gate = _silu_input_f32(zz), True
                    # z.float() read elsewhere too (mamba_ssm casts x and z up front) stays for those readers.
                    nodes += [zz.args[0]] if len(zz.args[0].users) == 1 else []
                    nodes += [zz, g]
                    cur = g
                    spelling = "gated RMSNorm"
        c = _single_user(cur)
        if c is None or not _is_cast_to(c, t):
            return Mismatch(f"RMSNorm at {r.name}: the weighted rows are not cast back to {t} (once, by one user)")
        weight, output = w_t, c
        nodes.append(c)
    else:
        return Mismatch(f"RMSNorm at {r.name}: no weight multiply after the normalisation "
                        f"({u.name} is {G.kind(u) or u.target})", "guard")
    if (gate is not None or group_size is not None) and offset != 0.0:
        return Mismatch(f"gated RMSNorm at {r.name}: the rows are multiplied by {offset:g} + w, and "
                        "commfuse.gated_rmsnorm takes no weight offset", "guard")
    if gate is not None and G.dtype(gate) != t:
        return Mismatch(f"gated RMSNorm at {r.name}: z is {G.dtype(gate)}, x is {t}")
    if gate is not None and not G.same_shape(gate, h_in):
        return Mismatch(f"gated RMSNorm at {r.name}: z has shape {_shape_text(gate)}, x {_shape_text(h_in)}: the "
                        "fused op takes a z of x's shape (no broadcast)")
    return Norm(input=h_in, output=output, weight=weight, eps=eps, nodes=_dedupe(nodes), spelling=spelling,
                weight_offset=offset, gate=gate, norm_before_gate=norm_before_gate, group_size=group_size,
                notes=notes, weight_dtype=G.dtype(weight), shape_queries=queries)


def _computed_from_half(n: fx.Node, depth: int = 8) -> bool:
    """Whether float32 n is computed from a float16/bfloat16 tensor within `depth` nodes (LayerNorm's
    x.float() - mean, a sigmoid gate): then its norm is not one of float32 activations."""
    seen, frontier = {n}, {n}
    for _ in range(depth):
        frontier = {a for u in frontier for a in u.all_input_nodes} - seen
        if any(G.dtype(a) in T_DTYPES for a in frontier):
            return True
        seen |= frontier
    return False


def _shape_text(n: fx.Node) -> str:
    s = G.shape(n)
    return "unknown" if s is None else str(list(s))


def _dedupe(nodes):
    seen, out = set(), []
    for n in nodes:
        if isinstance(n, fx.Node) and n not in seen:
            seen.add(n)
            out.append(n)
    return out


# --------------------------------------------------------------------------- residual add, all-reduce


def match_residual_add(h: fx.Node) -> Optional[Tuple[fx.Node, fx.Node]]:
    """(a, b) when h = a + b of two tensors of h's shape and dtype (no broadcast, no alpha)."""
    if G.kind(h) != "add":
        return None
    a, b = _binary(h)
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and G.is_tensor(a) and G.is_tensor(b)):
        return None
    if not (G.same_shape(a, h) and G.same_shape(b, h) and G.dtype(a) == G.dtype(b) == G.dtype(h)):
        return None
    return a, b


def trace_all_reduce(v: fx.Node, before: fx.Node, positions: dict,
                     also=frozenset()) -> Union[AllReduce, Mismatch, None]:
    """The all-reduce whose sum `v` is, read at node `before` (through views and no-op casts that
    feed nothing else). None when v is no all-reduce's result. also: other nodes that may read the sum itself (a
    post-norm's, which reads it twice: Gemma's `type_as(x)`)."""
    chain = []
    cur = v
    while True:
        found = _all_reduce_at(cur, before, positions, also)
        if found is not None:
            if isinstance(found, AllReduce):
                found.chain = list(reversed(chain))
            return found
        if not G.passthrough(cur):
            return None
        if len(cur.users) != 1:
            return None
        chain.append(cur)
        before = cur
        cur = G.source(cur)
        if cur is None:
            return None


def trace_all_reduce_sum(v: fx.Node, before: fx.Node, positions: dict) -> Union[AllReduce, Mismatch, None]:
    """`v` as the sum of two all-reduces' sums over one group (`all_reduce(a) + all_reduce(b)`, through views
    and no-op casts that feed nothing else), read at `before`: one AllReduce of a whose `added` is b, its
    nodes both collectives' and the add. None when v is no such sum."""
    chain, cur = [], v
    while G.passthrough(cur) and len(cur.users) == 1 and G.source(cur) is not None:
        chain.append(cur)
        cur = G.source(cur)
    pair = match_residual_add(cur)
    if pair is None or len(cur.users) != 1:
        return None
    found = [trace_all_reduce(n, cur, positions) for n in pair]
    if any(f is None for f in found):
        return None
    for f in found:
        if isinstance(f, Mismatch):
            return f
    first, second = found
    if (first.group, first.comm) != (second.group, second.comm):
        return Mismatch(f"{cur.name} adds the sums of all-reduces over two groups", "guard")
    return AllReduce(x=first.x, nodes=first.nodes + second.nodes, chain=first.chain + second.chain + [cur] + chain,
                     spelling=f"{first.spelling} + {second.spelling}", group=first.group, comm=first.comm,
                     added=second.x)


def _all_reduce_at(v: fx.Node, before: fx.Node, positions: dict, also=frozenset()) -> Union[AllReduce, Mismatch, None]:
    k = G.kind(v)
    waits = [v]
    inner = G.operand(v, 0, "input") if k == "wait" else None
    if G.kind(inner) == "wait" and len(inner.users) == 1:  # fc.wait_tensor(fc.all_reduce(...)): a second wait
        waits.insert(0, inner)
    if k == "cf_all_reduce" or (k == "wait" and G.kind(G.operand(waits[0], 0, "input")) == "funcol_all_reduce"):
        others = [u.name for u in v.users if u is not before and u not in also]
        if others:
            return Mismatch(f"the all-reduced {v.name} is also read by {', '.join(others)}: the fused op does not "
                            "return the sum", "guard")
        if k == "cf_all_reduce":
            return AllReduce(x=v.args[0], nodes=[v], chain=[], spelling="commfuse.ops.all_reduce", comm=v.args[1])
        src = G.operand(waits[0], 0, "input")
        return _funcol(src, [src, *waits], "functional all_reduce")
    if k == "wait":
        return None
    # dynamo's form of torch.distributed.all_reduce(v): all_reduce(v) -> wait_tensor -> v.copy_(wait),
    # after which the graph reads v itself as the sum.
    copies = [u for u in v.users if G.kind(u) == "copy_" and G.operand(u, 0, "self") is v
              and positions.get(u, -1) < positions.get(before, -1)]
    if not copies:
        return None
    copy = max(copies, key=lambda u: positions[u])
    wait = G.operand(copy, 1, "src")
    if G.kind(wait) != "wait" or G.kind(G.operand(wait, 0, "input")) != "funcol_all_reduce":
        return None
    ar = G.operand(wait, 0, "input")
    if ar.args[0] is not v:
        return Mismatch(f"{copy.name} copies the all-reduce of {ar.args[0].name} into {v.name}")
    found = _funcol(ar, [ar, wait, copy], "torch.distributed.all_reduce (in place)")
    if isinstance(found, Mismatch):
        return found
    if v.op == "placeholder":
        return Mismatch(f"torch.distributed.all_reduce modifies the graph input {v.name} in place, which the caller "
                        "sees: the fused op would leave it unreduced", "guard")
    if G.may_alias(v) and not _private_view(v):
        return Mismatch(f"torch.distributed.all_reduce modifies {v.name}, a view of another tensor (or an in-place "
                        "op's result, that tensor itself), in place: readers of that tensor would see the sum, which "
                        "the fused op does not write", "guard")
    for u in v.users:  # readers of v after the copy read the sum: the add (through `before`) only
        if u in (copy, ar) or positions.get(u, 0) < positions[copy]:
            continue
        if u is not before and u not in also:
            return Mismatch(f"the all-reduced {v.name} is also read by {u.name}: the fused op does not return the sum",
                            "guard")
    # Views of v taken before the collective see the sum too once it is copied in.
    stack = [u for u in v.users if u not in (copy, ar) and positions.get(u, 0) < positions[copy] and G.may_alias(u)]
    while stack:
        a = stack.pop()
        for u in a.users:
            if positions.get(u, 0) > positions[copy]:
                return Mismatch(f"{a.name}, a view of the all-reduced {v.name} taken before the collective, is read "
                                f"by {u.name} after it: the fused op does not write the sum", "guard")
            if G.may_alias(u):
                stack.append(u)
    if len(wait.users) != 1 or len(copy.users) != 0:
        return Mismatch(f"the all-reduce's {wait.name} / {copy.name} have other users", "guard")
    return found


def reads_the_sum(n: fx.Node, v: fx.Node, ar: AllReduce, positions: dict) -> bool:
    """Whether n, read beside the sum v (the residual of `h = v + n`), is computed from the all-reduce's
    sum too (`v + v`, `v + 2 * v`): the fused op takes the residual as an input, before the sum exists.
    After dynamo's in-place form v is the reduced tensor itself, so any read of it after the collective
    reads the sum."""
    if n is v:
        return True
    sums = set(ar.nodes) | set(ar.chain) | {v}
    start = positions[ar.nodes[0]]
    stack, seen = [n], set()
    while stack:
        u = stack.pop()
        if u in seen or positions.get(u, -1) <= start:  # computed before the collective: not from its sum
            continue
        seen.add(u)
        for a in u.all_input_nodes:
            if a in sums:
                return True
            stack.append(a)
    return False


def _private_view(v: fx.Node) -> bool:
    """Whether v views (through views, no-op casts and in-place ops' results, each read only by the next) a
    tensor the graph computed that nothing else reads, e.g. `out.reshape(b, s, h)` of a fresh result (HF's
    MoE blocks return one), or `y += bias` of a projection's output: then no reader sees the sum written
    into it in place."""
    reshapes = ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
                "contiguous")
    cur = v
    for _ in range(16):
        if not (G.may_alias(cur) or G.passthrough(cur)):
            break
        src = G.source(cur)
        whole = G.kind(cur) in ("view", "identity", "cast", "unsqueeze") or \
            (cur.op == "call_method" and cur.target in reshapes) or (src is not None and G.writes(cur, src))
        if not whole or src is None or set(src.users) != {cur}:
            return False
        cur = src
    else:
        return False
    name = cur.target if cur.op == "call_method" else getattr(cur.target, "__name__", "")
    in_place = isinstance(name, str) and name.endswith("_") and not name.startswith("_")
    return cur.op in ("call_function", "call_method") and G.is_tensor(cur) and not in_place


def _funcol(ar: fx.Node, nodes: list, spelling: str) -> Union[AllReduce, Mismatch]:
    op = G.operand(ar, 1, "reduceOp")
    group = G.operand(ar, 2, "group_name")
    if not isinstance(op, str) or op.lower() != "sum":
        return Mismatch(f"all-reduce {ar.name} with reduce op {op!r}: only a sum fuses", "guard")
    return AllReduce(x=ar.args[0], nodes=nodes, chain=[], spelling=spelling, group=group)


# --------------------------------------------------------------------------- quantization consumers


def match_quant(norm_out: fx.Node, user: fx.Node, h: int) -> Union[Quant, Mismatch, None]:
    """A quantization of `norm_out` starting at its user `user` (None: not a quantization)."""
    views, cur, prev = [], user, norm_out
    while G.passthrough(cur) and len(cur.users) == 1 and not _is_cast_to(cur, _F32):
        views.append(cur)
        prev, cur = cur, _single_user(cur)
    if views and G.hidden(prev) != h:
        return None
    if G.passthrough(cur) and len(cur.users) > 1 and not _is_cast_to(cur, _F32):
        # A view that a quantization and other nodes read: the fused op's codes would replace the view's
        # value for one reader only. Said, rather than passed over as "not a quantization".
        for u in cur.users:
            q = match_quant(cur, u, h)
            if isinstance(q, Quant):
                rest = ", ".join(o.name for o in cur.users if o is not u)
                return Mismatch(f"{q.final.name} quantizes the norm through {cur.name}, which {rest} also reads: "
                                "fused only where the quantization has the view (or the norm) to itself")
        return None
    k = G.kind(cur)
    if k == "cf_quantize":
        if G.operand(cur, 0, "x") is not prev:
            return None
        kw = public(G.operand(cur, 2, "tail"))
        scale = G.operand(cur, 1, "scale")
        if any(G.kind(u) != "getitem" for u in cur.users):
            return Mismatch(f"{cur.name}: its outputs are read other than by indexing")
        return Quant(quant=kw["quant"], scale=scale, sf_layout=kw["sf_layout"], nodes=views + [cur], final=cur,
                     views=views, spelling="commfuse.quantize", scale_layout=kw["scale_layout"],
                     scale_ue8m0=kw["scale_ue8m0"])
    # FP8: [float32(n)] / scale (or * 1/scale) -> clamp(-448, 448) -> .to(float8_e4m3fn)
    nodes = list(views)
    if _is_cast_to(cur, _F32) and len(cur.users) == 1:
        cur_next = _single_user(cur)
        nodes.append(cur)
        prev, cur = cur, cur_next
    k = G.kind(cur)
    notes: List[str] = []
    if k == "div":
        a, s = _binary(cur)
        if a is not prev:
            return None
        if G.number(s) is not None:
            return _fp8_tail_mismatch(cur, f"FP8 quantization at {cur.name} divides by the Python number {s}: the "
                                      "fused ops take the scale as a float32 tensor", "guard")
        if not isinstance(s, fx.Node):
            return None
        if not _one_float32(s):
            return _scale_mismatch(cur, s)
        scale = s
    elif k == "mul":
        r = _other(cur, prev)
        if not isinstance(r, fx.Node):
            return None
        if not _one_float32(r):
            return _scale_mismatch(cur, r)
        scale = ("reciprocal", r)
        # The scale itself where r is spelled 1/s of one float32 s (an integer s's reciprocal is float32 too, but
        # the op takes only a float32 scale: then it divides by 1/r).
        s = G.operand(r, 0, "input") if G.kind(r) == "reciprocal" else \
            _binary(r)[1] if G.kind(r) == "div" and G.number(_binary(r)[0]) == 1.0 else None
        if isinstance(s, fx.Node) and _one_float32(s):
            scale = s
        notes.append("the graph multiplies by 1/scale, the fused op divides by the scale (docs/semantics.md "
                     "section 4): a neighbouring FP8 code where the two round differently")
    else:
        return None
    if G.shape(cur) is not None and G.shape(prev) is not None and \
            tuple(map(str, G.shape(cur))) != tuple(map(str, G.shape(prev))):
        return _fp8_tail_mismatch(cur, f"FP8 quantization at {cur.name}: the scale broadcasts the norm's "
                                  f"{G.shape(prev)} to {G.shape(cur)}; the fused op's codes have the norm's shape",
                                  "pattern")
    if G.dtype(cur) not in (_F32,):
        notes.append(f"n / scale is computed in {G.dtype(cur)} in the graph (a 0-dim scale does not promote), so it "
                     "is rounded before e4m3; the fused op divides in float32: a neighbouring code at ties")
    nodes.append(cur)
    c = _single_user(cur)
    # Clamps in a row clamp to the intersection of their ranges (where it is not empty): the chain must
    # clamp to exactly [-448, 448], every clamp at most as tight.
    lo, hi, known = -math.inf, math.inf, True
    clamps, symbolic = [], False
    while c is not None and G.kind(c) in ("clamp", "clamp_min", "clamp_max"):
        kk = G.kind(c)
        bounds = []
        if kk in ("clamp", "clamp_min"):
            bounds.append(("lo", G.operand(c, 1, "min")))
        if kk in ("clamp", "clamp_max"):
            bounds.append(("hi", G.operand(c, 2 if kk == "clamp" else 1, "max")))
        for which, b in bounds:
            if b is None and kk == "clamp":  # clamp(max=...) or clamp(min=...): no bound on this side
                continue
            v, sym = G.hinted_number(b)
            symbolic |= sym
            if v is None:
                known = False
            elif which == "lo":
                lo = max(lo, v)
            else:
                hi = min(hi, v)
        clamps.append(c)
        c = _single_user(c)
    if c is None or not _is_cast_to(c, torch.float8_e4m3fn):
        return None
    if not clamps:
        return Mismatch(f"FP8 cast at {c.name} without a clamp to +-448: torch's cast is not saturating there, the "
                        "fused op saturates")
    if not known:
        return Mismatch(f"FP8 quantization at {c.name} clamps to a bound that is not a number")
    if lo != -FP8_MAX or hi != FP8_MAX:
        return Mismatch(f"FP8 quantization at {c.name} clamps to [{lo:g}, {hi:g}], not [-448, 448]")
    if symbolic:
        notes.append("the clamp bounds are symbolic floats (dynamo lifts float constants under dynamic=True), "
                     "+-448 when compiled: the fused op saturates at +-448 whatever they become")
    nodes += clamps + [c]
    for n in nodes[:-1]:
        if len(n.users) != 1:
            return Mismatch(f"FP8 quantization at {c.name}: {n.name} has other users")
    return Quant(quant="fp8", scale=scale, sf_layout="swizzled", nodes=nodes, final=c, views=views,
                 spelling="(n / scale).clamp(-448, 448).to(float8_e4m3fn)", notes=notes)


def _one_float32(s: fx.Node) -> bool:
    return G.dtype(s) == _F32 and G.numel_is_one(s)


def _scale_mismatch(cur: fx.Node, s: fx.Node) -> Optional[Mismatch]:
    """Why the norm scaled at cur by s (not one float32 element) is not fused, where an FP8 cast follows; None
    otherwise (not an FP8 quantization: none of ours)."""
    if not G.is_tensor(s):  # a Python number dynamo traced (a SymFloat node)
        return _fp8_tail_mismatch(cur, f"FP8 quantization at {cur.name} scales by the Python number {s.name}: the "
                                  "fused ops take the scale as a float32 tensor", "guard")
    what = f"a {_dt(G.dtype(s))} tensor" + ("" if G.numel_is_one(s) else f" of shape {G.shape(s)}")
    return _fp8_tail_mismatch(cur, f"FP8 quantization at {cur.name} scales by {what}: the fused ops take the scale "
                              "as a float32 tensor of one element", "guard")


def _fp8_tail_mismatch(cur, reason, kind):
    # Only a mismatch when what follows really is an FP8 cast; a division by a number is otherwise none of ours.
    c = _single_user(cur)
    while c is not None and G.kind(c) in ("clamp", "clamp_min", "clamp_max"):
        c = _single_user(c)
    if c is not None and _is_cast_to(c, torch.float8_e4m3fn):
        return Mismatch(reason, kind)
    return None


def _dt(d) -> str:
    return str(d).replace("torch.", "")


# --------------------------------------------------------------------------- the MoE combine before the all-reduce


@dataclass
class MoeCombine:
    """A tensor-parallel MoE block's expert combine, the all-reduce's input (docs/semantics.md section 14).

    y: the expert outputs, T[t, k, h], or the rows T[t * k, h] of the weighted products when the graph
    multiplies before viewing them as [t, k, h] (y_rows: the rewrite reshapes them to [-1, k, h]), or the
    rows in expert order T[t * k, h] when the graph gathers the weighted rows back to token order (HF's
    grouped_mm experts: row_index, the inverse permutation, reshaped by the rewrite to [-1, k]);
    weights: the routing weights [t, k] (float32 or T), or a tensor of t * k elements in token-major
    order (w_rows: reshaped to [-1, k]); shared: a shared expert's output added to the combine, or None;
    k: the slots; nodes: the combine's nodes (the products, views, the sum, casts, the shared add, up to
    the all-reduced tensor), all replaced; notes: where the graph's rounding order is not the op's."""

    y: fx.Node
    weights: fx.Node
    shared: Optional[fx.Node]
    k: int
    nodes: List[fx.Node]
    spelling: str
    notes: List[str] = field(default_factory=list)
    y_rows: bool = False
    w_rows: bool = False
    row_index: Optional[fx.Node] = None  # the finalize form: y the rows [R, h], token (i, j) at row_index[i, j]
    row_mask: Optional[fx.Node] = None  # bool [R, 1]: rows the graph zeroes after weighting (dropped slots)


def _strip_views(n, nodes: list):
    """n's source through views and no-op casts (each appended to nodes)."""
    while isinstance(n, fx.Node) and G.passthrough(n) and G.source(n) is not None:
        nodes.append(n)
        n = G.source(n)
    return n


def _sum_dims(s: fx.Node):
    dim = G.operand(s, 1, "dim")
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    keepdim = G.operand(s, 2, "keepdim", False)
    return dim if isinstance(dim, int) and not isinstance(dim, bool) else None, keepdim


def _shape_str(n) -> str:
    s = G.shape(n)
    return "?" if s is None else "[" + ", ".join(map(str, s)) + "]"


def _same_dims(a, b) -> bool:
    return a is not None and b is not None and tuple(map(str, a)) == tuple(map(str, b))


def _weights_source(w: fx.Node, lead: tuple):
    """The [*lead] tensor that w (lead + [1]) broadcasts over h, or None: unsqueeze(-1), [..., None], a view."""
    k = G.kind(w)
    src = None
    if k == "unsqueeze":
        d = G.operand(w, 1, "dim")
        if d in (-1, len(lead)):
            src = G.operand(w, 0, "input", G.operand(w, 0, "self"))
    elif k == "view":
        src = G.source(w)
    elif k == "getitem" and w.op == "call_function" and isinstance(w.args[1], tuple) and w.args[1] \
            and w.args[1][-1] is None and all(i is Ellipsis or (isinstance(i, slice) and i == slice(None))
                                              for i in w.args[1][:-1]):
        src = w.args[0]
    if isinstance(src, fx.Node) and _same_dims(G.shape(src), lead):
        return src
    return None


def match_moe_combine(x: fx.Node, t_dtype) -> Union[MoeCombine, Mismatch, None]:
    """The expert combine whose result `x` (the all-reduce's input, T) is, or None when x is not one:
    [shared +] ((y * w.unsqueeze(-1)).sum(dim=1) | (rows * w[:, None]).view(t, k, h).sum(dim=1))[.to(T)],
    with views and no-op casts between the pieces. A Mismatch says why a weighted sum of a [t, k, h]
    tensor over one dim is not the combine the op computes. The callers check the nodes' other users."""
    nodes: List[fx.Node] = []
    cur = _strip_views(x, nodes)
    shared, shared_order, spelling_tail = None, None, ""
    # A shared expert's output added in T (Qwen2-MoE, DeepSeek: `routed + shared`, both T).
    if G.kind(cur) == "add":
        pair = match_residual_add(cur)
        if pair is None:
            return None
        for c, s in (pair, pair[::-1]):
            inner: list = []
            if c is not s and _routed_sum(_strip_views(c, inner), t_dtype) is not None:  # routed + routed: 2x
                nodes.append(cur)
                shared, shared_order, spelling_tail = s, "T", f" + shared ({s.name}, added in {_dt(t_dtype)})"
                cur = _strip_views(c, nodes)
                break
        else:
            return None
    core = _routed_sum(cur, t_dtype)
    if core is None and shared is None and _is_cast_to(cur, t_dtype) and G.kind(G.source(cur)) == "add":
        # (routed_f32 + shared).to(T): the shared output added in float32 after the routed sum.
        add = G.source(cur)
        a, b = _binary(add)
        for c, s in ((a, b), (b, a)):
            if not (isinstance(c, fx.Node) and isinstance(s, fx.Node)) or c is s or G.dtype(add) != _F32:
                continue
            s_t = _f32_of(s) if G.dtype(s) == _F32 else s
            inner = []
            c0 = _strip_views(c, inner)
            if s_t is None or G.dtype(s_t) != t_dtype or not _same_dims(G.shape(s_t), G.shape(add)):
                continue
            if G.kind(c0) == "sum" and G.dtype(c0) == _F32 and _same_dims(G.shape(c0), G.shape(add)):
                core = _routed_sum_core(c0, t_dtype)
                if core is None:
                    continue
                nodes += [cur, add] + inner
                shared, shared_order = s_t, "f32"
                spelling_tail = f" + shared ({s_t.name}, added in float32)"
                cur = c0
                break
        if core is None:
            return None
        return _finish(core, nodes, shared, shared_order, spelling_tail, t_dtype)
    if core is None:
        return None
    return _finish(core, nodes, shared, shared_order, spelling_tail, t_dtype)


def is_routed_combine(n, t_dtype) -> bool:
    """Whether n is (a view of) a routed combine in t_dtype, as match_moe_combine reads one."""
    return isinstance(_routed_sum(_strip_views(n, []), t_dtype), dict)


def _routed_sum(n, t_dtype):
    """The routed combine at n: sum(...) in T, or sum(...) in float32 cast to T; a record or Mismatch, else None."""
    if _is_cast_to(n, t_dtype):
        src = G.source(n)
        if G.kind(src) == "sum" and G.dtype(src) == _F32:
            core = _routed_sum_core(src, t_dtype)
            if isinstance(core, dict):
                core["nodes"] = [n] + core["nodes"]
            return core
        if G.kind(src) == "sum" and G.dtype(src) is not None and G.dtype(src) != t_dtype:  # float64, say: said so
            core = _routed_sum_core(src, t_dtype)
            if isinstance(core, dict):
                return Mismatch(f"the sum {src.name} is {_dt(G.dtype(src))}: commfuse::moe_all_reduce sums float32 "
                                "products in float32", "pattern")
            return core
        return None
    if G.kind(n) == "sum":
        return _routed_sum_core(n, t_dtype)
    return None


def _routed_sum_core(s: fx.Node, t_dtype):
    m = G.operand(s, 0, "input", G.operand(s, 0, "self"))
    if not isinstance(m, fx.Node) or _rank(m) != 3:
        return None
    dim, keepdim = _sum_dims(s)
    if dim is None or keepdim:
        return None
    cast = s.kwargs.get("dtype")  # sum(dtype=...) casts the products to it first
    if cast not in (None, _F32, t_dtype):
        return Mismatch(f"the sum {s.name} casts the products to {_dt(cast)} (dtype=): commfuse::moe_all_reduce "
                        f"sums float32 products in float32", "pattern")
    # Which layout: the products as [t, k, h] (y viewed first), or rows [t*k, h] viewed after the multiply.
    nodes = [s]
    if G.kind(m) == "mul":
        prod, rows = m, False
    elif G.kind(m) == "view" and G.kind(G.source(m)) == "mul" and _rank(G.source(m)) == 2:
        prod, rows = G.source(m), True
        nodes.append(m)
    elif G.kind(m) == "view" and G.kind(G.source(m)) == "getitem" and G.kind(G.source(m).args[0]) == "mul" and \
            _rank(G.source(m)) == 2:
        return _gathered_core(s, m, G.source(m), dim, cast, t_dtype)
    else:
        return None
    if dim % 3 != 1:
        return Mismatch(f"the sum {s.name} is over dim {dim} of the {_shape_str(m)} products {prod.name}, not the "
                        "top-k axis: commfuse::moe_all_reduce takes the expert outputs as [t, k, h], summed over dim 1")
    shape3 = G.shape(m)
    k = G.static_int(shape3[1])
    lead = tuple(G.shape(prod)[:-1])
    a, b = _binary(prod)
    y = w = None
    for yy, ww in ((a, b), (b, a)):
        if isinstance(yy, fx.Node) and isinstance(ww, fx.Node) and _same_dims(G.shape(yy), G.shape(prod)) and \
                _same_dims(G.shape(ww), lead + (1,)):
            y, w = yy, ww
            break
    if y is None:
        return Mismatch(f"the products {prod.name} multiply {getattr(a, 'name', a)} {_shape_str(a)} by "
                        f"{getattr(b, 'name', b)} {_shape_str(b)}: not expert outputs {_shape_str(prod)} times "
                        f"routing weights [{', '.join(map(str, lead + (1,)))}] (one weight per token and slot, "
                        "broadcast over h)")
    if k is None:
        return Mismatch(f"the combine {s.name} has a symbolic number of slots {shape3[1]}: the rewrite needs a fixed "
                        "top-k", "guard")
    nodes.append(prod)
    # The weights as [t, k] where the graph has them, else the rewrite reshapes w. (The broadcast view and a
    # float32 cast of y are not the combine's own nodes: the rewrite erases them when nothing else reads them.)
    src = _weights_source(w, lead)
    w_rows = rows
    if src is not None:
        w = src
        token_major = _token_major(w, shape3) if rows else None
        if token_major is not None:
            w, w_rows = token_major, False
    elif not rows:
        w_rows = True  # [t, k, 1] of another spelling: reshaped to [t, k]
    y = _f32_of(y) or y
    why = _operand_dtypes(y, w, t_dtype)
    if why is not None:
        return why
    rows_txt = "(rows * w[:, None]).view(t, k, h)" if rows else "(y * w.unsqueeze(-1))"
    sum_txt = f".sum(dim=1, dtype={_dt(cast)})" if cast is not None else ".sum(dim=1)"
    # Products computed in T are rounded to T whatever dtype= the sum then casts them to.
    products = G.dtype(prod) if G.dtype(prod) in T_DTYPES else cast or G.dtype(prod)
    return dict(y=y, w=w, k=k, nodes=nodes, y_rows=rows, w_rows=w_rows, prod=prod, products=products,
                spelling=f"{rows_txt}{sum_txt}" + (f".to({_dt(t_dtype)})" if G.dtype(s) == _F32 else ""))


def _token_major(w: fx.Node, shape3) -> Optional[fx.Node]:
    """The [t, k] tensor that w (t * k weights) flattens (`top_k_weights.reshape(-1)`), or None."""
    if G.kind(w) == "view" and _same_dims(G.shape(G.source(w)), tuple(shape3[:2])):
        return G.source(w)
    return None


def _operand_dtypes(y: fx.Node, w: fx.Node, t_dtype) -> Optional[Mismatch]:
    """Why the op cannot take these expert outputs and routing weights (their dtypes), or None."""
    if G.dtype(y) != t_dtype:
        return Mismatch(f"the expert outputs {y.name} are {_dt(G.dtype(y))}, the residual {_dt(t_dtype)}: "
                        "commfuse::moe_all_reduce combines T outputs into the T tail", "guard")
    if G.dtype(w) not in (_F32, t_dtype):
        return Mismatch(f"the routing weights {w.name} are {_dt(G.dtype(w))}: commfuse::moe_all_reduce takes float32 "
                        f"or {_dt(t_dtype)} weights", "guard")
    return None


def _inverse_of(idx: fx.Node, reader: fx.Node) -> Optional[fx.Node]:
    """perm, where idx is its inverse permutation as transformers' grouped_mm experts write it, before
    `reader`: `inv = torch.empty_like(perm); inv[perm] = torch.arange(n)` (n = perm's length), or
    `inv = torch.argsort(perm)` of a perm that is a sort's indices (the argsort of a permutation is its
    inverse; of anything else it is not); nothing else writes idx and nothing writes perm before `reader`;
    else None."""
    if G.kind(idx) == "argsort":
        perm = G.operand(idx, 0, "input")
        if not _sort_indices(perm) or not _ascending_over_dim0(idx):
            return None
        made = idx  # the node after which inv holds the inverse
    elif G.kind(idx) == "empty_like":
        perm = G.operand(idx, 0, "input")
        writes = [u for u in idx.users if G.kind(u) == "setitem"]
        if not isinstance(perm, fx.Node) or _rank(perm) != 1 or len(writes) != 1 or len(writes[0].args) != 3:
            return None
        target, where, value = writes[0].args
        if target is not idx or where is not perm or G.kind(value) != "arange" or \
                value.kwargs.get("dtype") not in (None, torch.int64):
            return None
        bounds = list(value.args)
        if len(bounds) == 2 and bounds[0] == 0:
            bounds = bounds[1:]
        if len(bounds) != 1 or not _same_dims(G.shape(value), G.shape(perm)):
            return None
        made = writes[0]
    else:
        return None
    if any(u is not made and (G.kind(u) != "getitem" or u.args[1] is not idx) for u in idx.users):
        return None  # idx read as anything but an index of the gather, or written again
    positions = G.order(idx.graph)
    if not positions[made] < positions[reader] or G.written_between(perm, perm, reader, positions) is not None:
        return None  # inv written after the gather reads it, or perm changed after the rows were permuted by it
    return perm


def _sort_indices(node: Any) -> bool:
    """Whether node is a permutation of 0 .. n - 1 by construction: the indices of a 1-D tensor's
    argsort, or of its sort (`values, perm = torch.sort(x)`), over dim 0."""
    if not isinstance(node, fx.Node) or _rank(node) != 1:
        return False
    if G.kind(node) == "argsort":
        return _ascending_over_dim0(node, descending_ok=True)
    if G.kind(node) == "getitem" and len(node.args) == 2 and node.args[1] == 1 and G.kind(node.args[0]) == "sort":
        return _ascending_over_dim0(node.args[0], descending_ok=True)
    return False


def _ascending_over_dim0(node: fx.Node, descending_ok: bool = False) -> bool:
    """A sort / argsort of a 1-D tensor over its only dim (dim -1 or 0, torch's positional order: input,
    dim, descending), ascending unless descending_ok."""
    x = G.operand(node, 0, "input")
    dim = G.operand(node, 1, "dim", -1)
    descending = G.operand(node, 2, "descending", False)
    return _rank(x) == 1 and dim in (0, -1) and (descending_ok or descending is False)


def _gathered_core(s: fx.Node, m: fx.Node, gi: fx.Node, dim: int, cast, t_dtype):
    """HF grouped_mm's combine, `(rows * w[perm][:, None])[inv_perm].view(t, k, h).sum(dim=1)`: rows in
    expert order, each weighted by its token's routing weight, gathered back to token order and summed over
    the top-k axis. The finalize form: token (i, j)'s row is inv_perm[i * k + j] and its weight w[i * k + j]
    (perm[inv_perm[s]] = s), so y = rows, row_index = inv_perm viewed [t, k], weights = w viewed [t, k]. cast:
    the sum's dtype= (None, float32 or T), as _routed_sum_core reads it."""
    prod, idx = gi.args
    what = f"the weighted rows {prod.name} gathered by {getattr(idx, 'name', idx)} ({gi.name})"
    perm = _inverse_of(idx, gi) if isinstance(idx, fx.Node) else None
    if perm is None:
        return Mismatch(f"{what} before the sum over the top-k axis: the index is not the inverse of a "
                        "permutation written as HF grouped_mm writes it (inv = empty_like(perm); inv[perm] = "
                        "arange(n), or inv = argsort(perm) of a sort's indices perm, neither written before "
                        "the gather), so which row holds which token is unknown")
    if dim % 3 != 1:
        return Mismatch(f"the sum {s.name} is over dim {dim} of the {_shape_str(m)} gathered rows, not the top-k "
                        "axis: commfuse::moe_all_reduce sums each token's k rows")
    k = G.static_int(G.shape(m)[1])
    if k is None:
        return Mismatch(f"the combine {s.name} has a symbolic number of slots {G.shape(m)[1]}: the rewrite needs a "
                        "fixed top-k", "guard")
    rows_shape = tuple(G.shape(prod))
    a, b = _binary(prod)
    y = w = None
    for yy, ww in ((a, b), (b, a)):
        one_per_row = isinstance(ww, fx.Node) and _same_dims(G.shape(ww), rows_shape[:-1] + (1,))
        src = _weights_source(ww, rows_shape[:-1]) if one_per_row else None
        if isinstance(yy, fx.Node) and _same_dims(G.shape(yy), rows_shape) and G.kind(src) == "getitem" and \
                src.args[1] is perm and G.shape(src.args[0]) is not None and \
                _same_dims(tuple(G.shape(src.args[0])), rows_shape[:1]):  # w[perm] of exactly one weight a row
            y, w = yy, src.args[0]
            break
    if y is None:
        return Mismatch(f"{what}: not rows times the routing weights permuted like them (w[perm][:, None], "
                        f"perm = {perm.name})")
    y = _f32_of(y) or y
    why = _operand_dtypes(y, w, t_dtype)
    if why is not None:
        return why
    token_major = _token_major(w, G.shape(m))
    w_rows, w = token_major is None, token_major or w  # w [t * k] (w[perm] matched it to the rows), or [t, k]
    fill = _zeroed_rows(prod, gi)
    mask = None if fill is None else G.operand(fill, 1, "mask")
    sum_txt = f".sum(dim=1, dtype={_dt(cast)})" if cast is not None else ".sum(dim=1)"
    # As in _routed_sum_core: products computed in T are rounded to T whatever dtype= the sum casts them to.
    products = G.dtype(prod) if G.dtype(prod) in T_DTYPES else cast or G.dtype(prod)
    return dict(y=y, w=w, k=k, nodes=[s, m, gi, prod] + ([fill] if fill is not None else []), y_rows=False,
                w_rows=w_rows, prod=prod, products=products, row_index=idx, row_mask=mask,
                spelling="(rows * w[perm][:, None])" + (".masked_fill_(mask, 0)" if fill is not None else "")
                         + f"[inv_perm].view(t, k, h){sum_txt}" + (f".to({_dt(t_dtype)})" if G.dtype(s) == _F32 else ""))


def _zeroed_rows(prod: fx.Node, gather: fx.Node) -> Optional[fx.Node]:
    """The one `prod.masked_fill_(mask, 0)` before `gather` that zeroes whole weighted rows (mask bool [R, 1];
    transformers 5.8-5.9's grouped_mm experts zero the expert-parallel sentinels' rows so on every call), or
    None: a zeroed row adds nothing, as a dropped slot (row index -1) does. (A mask [R] would broadcast over
    the columns, where R = h.)"""
    positions = G.order(prod.graph)
    rows = G.shape(prod)
    fills = [u for u in prod.users if u.op == "call_method" and u.target == "masked_fill_" and u.args[:1] == (prod,)]
    if len(fills) != 1 or rows is None or not positions[fills[0]] < positions[gather]:
        return None
    fill = fills[0]
    mask, fill_value = G.operand(fill, 1, "mask"), G.operand(fill, 2, "value")
    shape = G.shape(mask) if isinstance(mask, fx.Node) else None
    if isinstance(fill_value, bool) or not isinstance(fill_value, (int, float)) or fill_value != 0 or \
            G.dtype(mask) != torch.bool or shape is None or not _same_dims(shape, tuple(rows[:1]) + (1,)):
        return None
    return fill


def _finish(core, nodes, shared, shared_order, spelling_tail, t_dtype):
    if isinstance(core, Mismatch):
        return core
    t = _dt(t_dtype)
    notes = []
    prod, k = core["prod"], core["k"]
    if core.get("products", G.dtype(prod)) != _F32:
        how = f"multiplies the expert outputs by the routing weights in {t}" if G.dtype(prod) != _F32 else \
            f"casts the float32 products of the expert outputs and routing weights to {t} (the sum's dtype=)"
        notes.append(f"the graph {how}, rounding each product "
                     f"to {t} (torch then sums them in float32 and rounds once); the op multiplies in float32 and "
                     f"rounds the combined row once (docs/semantics.md section 14): the combined rows differ by up to "
                     f"about k/2 = {k / 2:g} ulps of {t} of the largest product plus the final rounding (more ulps of "
                     "the row where the products cancel), and the tail carries that on")
    if k > 2:
        notes.append(f"the graph's .sum(dim=1) over k = {k} slots runs in the order torch's reduction kernel picks "
                     "(vectorised / tree orders on CPU and GPU), not necessarily slot order; the op sums in slot "
                     "order j = 0..k-1 in float32: a few float32 ulps apart before the one rounding to "
                     f"{t}, so the combined rows within 1 ulp of {t} except where the products cancel")
    if shared is not None and shared_order == "T":
        notes.append(f"the graph rounds the routed sum to {t}, then adds the shared expert's output in {t} (two "
                     f"roundings); the op starts the float32 sum from the shared output and rounds once: the "
                     f"combined rows differ where the two roundings do, by half an ulp of {t} of the routed sum "
                     "plus the final rounding (1 ulp of the row unless the two cancel)")
    elif shared is not None:
        notes.append("the graph adds the shared expert's output after the routed sum (in float32); the op starts "
                     "the float32 sum from it (slot order: shared, then j = 0..k-1): a few float32 ulps apart "
                     f"before the one rounding to {t}, so the combined rows within 1 ulp of {t} except where the "
                     "terms cancel")
    return MoeCombine(y=core["y"], weights=core["w"], shared=shared, k=k, nodes=_dedupe(nodes + core["nodes"]),
                      spelling=core["spelling"] + spelling_tail, notes=notes, y_rows=core["y_rows"],
                      w_rows=core["w_rows"], row_index=core.get("row_index"), row_mask=core.get("row_mask"))


def index_add_combine(x: fx.Node) -> Optional[fx.Node]:
    """The first index_add / index_add_ that writes the all-reduced tensor x (HF Mixtral's per-expert loop:
    `final.index_add_(0, token_idx, expert_out * routing_weights[token_idx, slot, None])`), or None."""
    nodes: list = []
    base = _strip_views(x, nodes)
    if G.kind(base) == "index_add":
        return base
    for n in [x, base] + nodes:
        for u in n.users:
            if G.kind(u) == "index_add_" and G.operand(u, 0, "self", G.operand(u, 0, "input")) is n:
                return u
    return None
