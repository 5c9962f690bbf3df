"""Rewriting: `fuse(gm, comm)` replaces every match of patterns.py by one commfuse op, in place.

For each RMSNorm (in graph order): the consumers that quantize it, the residual add before it and
the all-reduce before that are collected; then one node is inserted before the add (before the
norm where there is no add):

- with a fusable all-reduce: `torch.ops.commfuse.fused_all_reduce.default(x, residual, weight, scale, eps,
  weight_offset, tail, comm)`, x being the all-reduce's input;
- with a fusable all-reduce whose input is a MoE expert combine (patterns.match_moe_combine):
  `torch.ops.commfuse.moe_all_reduce.default(y, weights, None, shared, residual, weight, scale, eps,
  weight_offset, tail, comm)`, the combine's nodes replaced too;
- without one: `torch.ops.commfuse.fused_add_rmsnorm.default(x, residual or None, weight, scale, eps,
  weight_offset, tail)`;
- a gated norm: `torch.ops.commfuse.gated_rmsnorm.default(x, z, weight, scale, eps, group_size,
  norm_before_gate, tail)`.

`tail` is the code (commfuse.tail.spec.code) of the quantization, its layouts (those of the commfuse.quantize
op the norm feeds, else the defaults) and return_norm. The ops return the outputs their call has, in
reference.Tail's order (commfuse.tail.spec.fields names them).

The users of the add (the residual used later), of the norm (return_norm when it has users other
than the quantization) and of the quantized codes are re-pointed at the op's outputs, viewed back to
the graph's shapes (the ops return [t, h]); the replaced nodes are erased. A
`commfuse::fused_add_rmsnorm` op after a fusable all-reduce becomes `commfuse::fused_all_reduce`.
"""
from __future__ import annotations

import math
import operator
from typing import List, Optional

import torch
import torch.fx as fx

from .. import routes
from . import graph as G
from . import patterns as P
from .build import Builder
from .evidence import REWRITES, local_rewrite
from .report import Fused, FusionReport, Skipped
from ..tail.spec import TailSpec, code, fields, public

OPS = {
    "all_reduce": "commfuse::fused_all_reduce",
    "moe": "commfuse::moe_all_reduce",
    "local": "commfuse::fused_add_rmsnorm",
    "gated": "commfuse::gated_rmsnorm",
}


def _targets():
    import commfuse.ops  # noqa: F401 - registers every commfuse op

    return {
        "all_reduce": torch.ops.commfuse.fused_all_reduce.default,
        "moe": torch.ops.commfuse.moe_all_reduce.default,
        "local": torch.ops.commfuse.fused_add_rmsnorm.default,
        "gated": torch.ops.commfuse.gated_rmsnorm.default,
    }


def fuse(gm: fx.GraphModule, comm=None, *, example_inputs=None, rewrite: str = "auto",
         compiler: Optional[str] = None, cuda_graphs: bool = False, aten_only: bool = False) -> FusionReport:
    """Rewrite the matches in `gm` in place; return the report.

    gm: a torch-level FX graph: dynamo's (what a torch.compile backend receives), torch.fx.symbolic_trace's,
    or make_fx's (aten level) - the matchers read every spelling. Nodes need shape/dtype metadata
    (dynamo's and make_fx's graphs have it); otherwise pass example_inputs and it is propagated with fake
    tensors first. example_inputs: gm's inputs, a sequence with one value per placeholder in order:
    tensors (real or fake) of the shapes, dtypes and devices gm is called with (the matchers and the
    rewrite read them through the metadata), other values as they are; the tensors are only converted to
    fake ones (not run on, not modified). Ignored where every placeholder and call_function node already
    has metadata. comm: the commfuse.Communicator whose group the model's torch.distributed /
    functional all-reduces use (they fuse only when their group is comm's); commfuse.ops.all_reduce
    calls name their own communicator. None: only those, and the local ops.
    rewrite: "auto" rewrites every collective tail and the local patterns where they pay given
    `compiler`, what compiles the graph after the pass ("inductor", another backend, None: nothing), and
    `cuda_graphs`, whether it replays the compiled graph from CUDA graphs; "all" rewrites every match
    (commfuse.fusion.evidence has the rule and its measurements).
    aten_only: write the nodes around the op (reshapes, a scale's reciprocal) as aten ops, for Inductor's
    post-grad graph (post_grad_pass), which Inductor lowers op by op (build.py).
    """
    if rewrite not in REWRITES:
        raise ValueError(f"rewrite must be one of {REWRITES}, got {rewrite!r}")
    if example_inputs is not None and not _has_meta(gm):
        _propagate(gm, example_inputs)
    report = FusionReport()
    why = _differentiated(gm)
    if why:
        report.skipped.append(Skipped("the graph", "graph", why, "guard"))
        return report
    G.merge_duplicate_casts(gm.graph)
    splits = _split_shared_addmm(gm.graph) if aten_only else []
    targets = _targets()
    seen_all_reduce: set = set()
    erased: set = set()
    norm_inputs: dict = {}  # each RMSNorm's input (gated ones aside): its name, for an all-reduce whose sum it is
    post_norms: dict = {}  # output -> Norm of each RMSNorm of an all-reduce's sum read only by a residual add
    for node in list(gm.graph.nodes):
        if node in erased:
            continue
        if G.kind(node) == "cf_tail":
            _fuse_commfuse_tail(gm, node, comm, targets, report, erased, seen_all_reduce, aten_only)
            continue
        match = P.match_norm(node)
        if match is None:
            continue
        norm_input = match.norm_input if isinstance(match, P.Mismatch) else None if match.gated else match.input
        if norm_input is not None:
            norm_inputs.setdefault(norm_input, match.output.name if isinstance(match, P.Norm) else node.name)
        if isinstance(match, P.Mismatch):
            report.skipped.append(Skipped(node.name, "rmsnorm", match.reason, match.kind))
            if match.norm_input is not None:
                _skip_feeding_all_reduce(match.norm_input, node.name, match.reason, match.kind, report,
                                         seen_all_reduce)
            continue
        if _is_post_norm(match):  # the next norm's match takes it (or leaves it as the graph has it)
            post_norms[match.output] = match
            continue
        _fuse_norm(gm, match, comm, targets, report, erased, seen_all_reduce, (rewrite, compiler, cuda_graphs),
                   aten_only, post_norms)
    for post in post_norms.values():  # no add's norm took it: matched alone, as any norm
        if post.output not in erased:
            _fuse_norm(gm, post, comm, targets, report, erased, seen_all_reduce, (rewrite, compiler, cuda_graphs),
                       aten_only)
    _unsplit_addmm(gm.graph, splits, erased)
    for node in gm.graph.nodes:
        if G.kind(node) in ("funcol_all_reduce", "cf_all_reduce") and node not in seen_all_reduce:
            report.skipped.append(Skipped(node.name, "all-reduce", _read_through_an_early_view(node) or
                                          _unread_sum(node, norm_inputs), "pattern"))
        elif G.kind(node) == "funcol_all_reduce_":
            report.skipped.append(Skipped(node.name, "all-reduce", "an in-place all_reduce_ "
                                          "(torch.ops._c10d_functional.all_reduce_) is not matched: the pass fuses "
                                          "the out-of-place all_reduce, which dynamo makes of torch.distributed's "
                                          "and the functional collectives' all-reduce", "pattern"))
    gm.graph.lint()
    gm.recompile()
    return report


def _unread_sum(ar: fx.Node, norm_inputs: dict) -> str:
    """Why no fused op takes the all-reduce `ar` that no residual add + RMSNorm reads as the fused op would: what
    reads its sum (through views and casts). Where the sum itself is a norm's input, a post-norm that the fused op
    could not take (its output not added to a residual that an RMSNorm then normalises, as in EXAONE 4's layers; or
    read by more than that add; or another eps or weight offset than that norm's); where a residual add + RMSNorm
    reads it through a view or cast that other nodes read too, that node (the fused op would not write it)."""
    positions = G.order(ar.graph)
    after = {}  # dynamo's in-place form: the tensor the sum is copied into, read as the sum after that copy

    def readers_of(n):
        return [u for u in n.users if positions[u] > after.get(n, -1) and G.kind(u) != "copy_"]

    stack = [ar] if G.kind(ar) == "cf_all_reduce" else []
    for w in (u for u in ar.users if G.kind(u) == "wait"):
        stack.append(w)
        for u in w.users:
            if G.kind(u) == "copy_" and G.operand(u, 1, "src") is w and isinstance(G.operand(u, 0, "self"), fx.Node):
                after[G.operand(u, 0, "self")] = positions[u]
                stack.append(G.operand(u, 0, "self"))
    seen, readers, via = set(), [], {}
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if not (n is ar or n in after or G.kind(n) in ("wait", "cast") or G.passthrough(n)):
            readers.append(n)  # no longer the sum itself
            continue
        if n in norm_inputs:
            return (f"its sum is the input of the RMSNorm {norm_inputs[n]} (a post-norm), which fused_all_reduce takes "
                    "only where its output alone is added to a residual that an RMSNorm then normalises with the same "
                    "eps and weight offset (Gemma 2 / 3's post_attention_layernorm)")
        for u in readers_of(n):
            via.setdefault(u, n)
            stack.append(u)
    readers.sort(key=positions.get)
    for r in readers:
        shared = via[r]
        others = [u.name for u in readers_of(shared) if u is not r]
        if (r in norm_inputs or G.kind(r) == "cf_tail") and others and shared not in (ar, *after):
            return (f"its sum reaches the residual add + RMSNorm at {r.name} through {shared.name}, which "
                    f"{', '.join(others)} read{'s' if len(others) == 1 else ''} too: the fused op does not write "
                    f"{shared.name}")
    base = "no residual add + RMSNorm (as the pass recognises one) reads its sum"
    if not readers:
        return base
    named = [f"{r.name} ({G.kind(r) or getattr(r.target, '__name__', r.target)})" for r in readers[:4]]
    return f"{base}: it is read by {', '.join(named)}" + (" and more" if len(readers) > 4 else "")


def _read_through_an_early_view(ar: fx.Node) -> Optional[str]:
    """Why an in-place all-reduce (dynamo's all_reduce(v) -> wait -> v.copy_) whose sum is read only through a view
    of v taken before it is not matched, or None: the matchers follow the sum from v and from views taken after."""
    v = ar.args[0] if ar.args else None
    copies = [u for u in getattr(v, "users", ()) if G.kind(u) == "copy_" and G.kind(G.operand(u, 1, "src")) == "wait"
              and G.operand(G.operand(u, 1, "src"), 0, "input") is ar]
    if not copies:
        return None
    positions = G.order(ar.graph)
    stack = [u for u in v.users if positions[u] < positions[ar] and G.may_alias(u)]
    while stack:
        a = stack.pop()
        for u in a.users:
            if positions[u] > positions[copies[0]]:
                return (f"its sum is read through {a.name}, a view of {v.name} taken before the in-place all-reduce "
                        f"(by {u.name}): the pass follows the sum from {v.name} itself or a view taken after it")
            if G.may_alias(u):
                stack.append(u)
    return None


# --------------------------------------------------------------------------- Inductor's post-grad graph


def _split_shared_addmm(g: fx.Graph) -> list:
    """Inductor's post-grad passes fold a shared expert's down projection and its add to the routed combine into one
    addmm(combine, a, b). Split back into combine + mm(a, b), the model's own order, for the combine's matcher;
    returns the splits for _unsplit_addmm."""
    build, splits = Builder(g, aten_level=True), []
    for n in list(g.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.addmm.default and len(n.args) == 3 and \
                not n.kwargs and P.is_routed_combine(n.args[0], G.dtype(n)):
            with g.inserting_before(n):
                mm = build.mm(*n.args[1:])
                add = build.add(n.args[0], mm)
            splits.append((add, mm, n.args, dict(n.meta)))
            n.replace_all_uses_with(add)
            g.erase_node(n)
    return splits


def _unsplit_addmm(g: fx.Graph, splits: list, erased: set) -> None:
    """The addmm back wherever its split add was not fused into a MoE op: a graph the pass leaves computes as
    Inductor had it."""
    for add, mm, args, meta in splits:
        if add in erased:
            continue
        with g.inserting_before(add):
            addmm = g.call_function(torch.ops.aten.addmm.default, args)
        addmm.meta = meta
        add.replace_all_uses_with(addmm)
        g.erase_node(add)
        if not mm.users:
            g.erase_node(mm)


# --------------------------------------------------------------------------- metadata


def _has_meta(gm: fx.GraphModule) -> bool:
    return all(G.value(n) is not None for n in gm.graph.nodes if n.op in ("placeholder", "call_function"))


def _propagate(gm: fx.GraphModule, example_inputs) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)


# --------------------------------------------------------------------------- one norm


def _differentiated(gm: fx.GraphModule) -> Optional[str]:
    """Why autograd may differentiate through gm (so it is left whole), or None: grad mode is on and an input
    requires grad (a parameter dynamo lifts, or a symbolic_trace module's). The fused ops have no gradient: in
    their place a backward pass would silently miss every gradient that flows through them. Dynamo guards on
    grad mode, so the graph it compiles for torch.no_grad() is another one, which the pass fuses."""
    if not torch.is_grad_enabled():
        return None
    needs = [n.name for n in gm.graph.nodes if n.op == "placeholder" and getattr(G.value(n), "requires_grad", False)]
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                if getattr(gm.get_parameter(n.target), "requires_grad", False):
                    needs.append(n.target)
            except AttributeError:  # a buffer or constant: no gradient
                pass
    if not needs:
        return None
    return (f"grad mode is on and {needs[0]} requires grad" + (f" ({len(needs)} inputs do)" if len(needs) > 1 else "")
            + ": the fused ops have no gradient, so a backward pass through them would miss gradients silently; "
            "the graph is left as it is (run the model under torch.no_grad() or torch.inference_mode() to fuse it)")


def _takes_shape(out: fx.Node, like: fx.Node, h: int) -> bool:
    """Whether `out` has `like`'s shape or the fused ops' [tokens, h] (or either is unknown): the shapes in which
    the rewrite can hand the fused ops' outputs to out's readers."""
    a, b = G.shape(out), G.shape(like)
    if a is None or b is None:
        return True
    a = tuple(map(str, a))
    return a == tuple(map(str, b)) or (len(a) == 2 and a[1] == str(h))


class _Skip(Exception):
    def __init__(self, where, what, reason, kind="guard"):
        super().__init__(reason)
        self.skipped = Skipped(where, what, reason, kind)


def _separated(kind: str, norm: P.Norm, quant, residual: bool, scale: bool, h: int) -> Optional[str]:
    """Why the local op would run commfuse's separated ops on the graph's device (None: its kernel runs, or the
    graph's metadata does not say its device), as the op's plan decides it for any token count (commfuse.routes;
    the device's SM read as the op would read it)."""
    device = G.device(norm.input)
    if device is None:
        return None
    tail = code(quant.quant if quant is not None else None, quant is not None,
                **({} if quant is None else dict(sf_layout=quant.sf_layout, scale_layout=quant.scale_layout,
                                                 scale_ue8m0=quant.scale_ue8m0)))
    row = routes.TensorMeta((1, h), G.dtype(norm.input), device)
    call = routes.Call("gated" if kind == "gated" else "local", row, row if residual else None,
                       routes.TensorMeta((h,), row.dtype, device),
                       routes.TensorMeta((1,), torch.float32, device) if scale else None,
                       row if norm.gate is not None else None, TailSpec.from_code(tail), norm.group_size or h,
                       norm.norm_before_gate)
    try:
        machine = routes.Machine.local(device)
    except (AssertionError, RuntimeError):  # CUDA tensors in the graph, no CUDA in this process: nothing to ask
        return None
    plan = routes.plan(call, machine)
    return "; ".join(plan.reasons) if plan.kernel is None else None


def _is_rows(n: Optional[fx.Node], h: int) -> bool:
    """Whether n is absent or [tokens, h] (what the ops take without a reshape)."""
    s = None if n is None else G.shape(n)
    return n is None or (s is not None and len(s) == 2 and str(s[-1]) == str(h))


def _fuse_norm(gm, norm: P.Norm, comm, targets, report: FusionReport, erased: set, seen_all_reduce: set,
               policy: tuple, aten_only: bool = False, post_norms: Optional[dict] = None) -> None:
    """One norm's rewrite. post_norms: output -> Norm of the post-norms held back (_is_post_norm): a residual add
    of one's output becomes commfuse::fused_all_reduce with its weight as post_weight."""
    g = gm.graph
    try:
        t = G.dtype(norm.input)
        if t == torch.float32:
            src = G.source(norm.input) if G.kind(norm.input) == "cast" else None
            raise _Skip(norm.output.name, "rmsnorm", (
                f"it normalises {norm.input.name}, float32 of the {G.dtype(src)} {src.name}, with a weight of "
                f"{norm.weight_dtype}: the fused ops take float16/bfloat16 activations and weight (a norm of float32 "
                "casts is matched where its weight is a float32 cast of one too and its result is cast back)")
                if src is not None and G.dtype(src) in P.T_DTYPES else
                "float32 activations: commfuse's fused kernels take float16/bfloat16")
        if t not in P.T_DTYPES:
            raise _Skip(norm.output.name, "rmsnorm", f"activations of dtype {t}: the fused ops take float16/bfloat16")
        h = G.hidden(norm.input)
        if h is None:
            raise _Skip(norm.output.name, "rmsnorm", "the hidden size is symbolic: the fused ops need a fixed one",
                        "pattern")
        wdtype = norm.weight_dtype
        if wdtype != t:
            raise _Skip(norm.output.name, "rmsnorm", f"the weight is {wdtype}, the activations {t}: the fused ops "
                                                     "take a weight of the activations' dtype")
        if isinstance(norm.weight, fx.Node) and G.shape(norm.weight) is not None and \
                tuple(map(str, G.shape(norm.weight))) != (str(h),):
            raise _Skip(norm.output.name, "rmsnorm", f"the weight has shape {G.shape(norm.weight)}, not [{h}]")
        if isinstance(norm.eps, float) and not math.isfinite(norm.eps):
            raise _Skip(norm.output.name, "rmsnorm", f"eps {norm.eps} is not finite")
        for node, what in ((norm.input, "input"), (norm.output, "output")):
            if not G.dense_rows(node):
                raise _Skip(norm.output.name, "rmsnorm", f"the norm's {what} is not contiguous (strides "
                            f"{G.strides(node)}): the fused ops write dense rows, and its readers may "
                            "rely on its strides", "pattern")
        if not _takes_shape(norm.output, norm.input, h):
            raise _Skip(norm.output.name, "rmsnorm", f"the norm has shape {G.shape(norm.output)}, its input "
                        f"{G.shape(norm.input)}: the fused ops give the input's shape (or [tokens, {h}])", "pattern")
    except _Skip as s:
        report.skipped.append(s.skipped)
        if not norm.gated:
            _skip_feeding_all_reduce(norm.input, norm.output.name, s.skipped.reason, s.skipped.kind, report,
                                     seen_all_reduce)
        return

    quant, others = _consumers(norm, h, report)
    residual, x, ar, post = None, norm.input, None, None
    positions = G.order(g)
    if not norm.gated:
        pair = P.match_residual_add(norm.input)
        if pair is not None:
            x, residual = pair
            for xa, rb in (pair, pair[::-1]):
                pn = (post_norms or {}).get(xa)
                summed = xa if pn is None else pn.input  # a post-norm's: the sum it normalises
                found = (P.trace_all_reduce(xa, norm.input, positions) if pn is None else
                         P.trace_all_reduce(pn.input, _first_reader(pn), positions, set(pn.nodes)))
                if found is None:
                    found = P.trace_all_reduce_sum(xa, norm.input, positions)
                if found is None:
                    continue
                if isinstance(found, P.AllReduce) and P.reads_the_sum(rb, summed, found, positions):
                    found = P.Mismatch(f"the residual {rb.name} is computed from the all-reduce's sum too: the "
                                       "fused op takes the residual before the sum exists")
                why = _all_reduce_guard(found, comm, norm) if isinstance(found, P.AllReduce) else None
                if why is None and pn is not None and isinstance(found, P.AllReduce):
                    why = _post_norm_guard(pn, norm)
                if why:
                    found = P.Mismatch(why, "guard")
                # Both operands may be all-reduced sums: where one cannot fuse, the other may, this sum its residual.
                if isinstance(found, P.Mismatch):
                    _skip_all_reduce(xa, norm.input.name, found.reason + "; the add + RMSNorm are matched without it",
                                     found.kind, report, seen_all_reduce)
                elif ar is None:
                    x, residual, ar, post = xa, rb, found, pn
                    seen_all_reduce.update(n for n in ar.nodes if G.kind(n) in ("funcol_all_reduce", "cf_all_reduce"))
                else:
                    _skip_all_reduce(xa, norm.input.name, f"the add's other operand {residual.name} is an all-reduced "
                                     "sum too, tried first: a fused op takes one all-reduce, the other sum as its "
                                     "residual", "pattern", report, seen_all_reduce)
    comm_name = None
    if ar is not None:
        comm_name = ar.comm if ar.comm is not None else comm.name
    kind = "gated" if norm.gated else "all_reduce" if ar is not None else "local"
    if kind == "all_reduce" and residual is None:  # pragma: no cover - trace_all_reduce needs the add
        kind = "local"
    moe = _moe_combine(ar, norm, residual, h, report) if kind == "all_reduce" else None
    if ar is not None and ar.added is not None and moe is None:
        report.skipped.append(Skipped(ar.nodes[0].name, "all-reduce", "the sums of two all-reduces are added: fused "
                                      "only where one reduces a MoE combine and the other its shared expert's "
                                      "output; the add + RMSNorm are matched without it", "pattern"))
        kind, ar = "local", None

    scale_src = None
    if quant is not None:
        scale_src = quant.scale[1] if isinstance(quant.scale, tuple) else quant.scale
    inputs = [("x", ar.x if ar is not None else x), ("residual", residual), ("gate", norm.gate),
              ("scale", scale_src), ("eps", norm.eps if isinstance(norm.eps, fx.Node) else None)]
    if isinstance(norm.weight, fx.Node):
        inputs.append(("weight", norm.weight))
    if post is not None and isinstance(post.weight, fx.Node):
        inputs.append(("post-norm weight", post.weight))
    if moe is not None:
        inputs += [("expert outputs", moe.y), ("routing weights", moe.weights), ("shared expert output", moe.shared),
                   ("expert rows' index", moe.row_index), ("zeroed rows' mask", moe.row_mask)]
    # Where the op goes: before the add (its outputs replace it), else before the norm's first node after its
    # inputs (a weight's cast that a model hoists above the norm's input is one of the norm's nodes).
    if residual is not None:
        anchor = norm.input
    else:
        ordered = sorted(norm.nodes, key=lambda n: positions[n])
        latest = max((positions[n] for _, n in inputs if isinstance(n, fx.Node)), default=-1)
        anchor = next((n for n in ordered if positions[n] > latest), ordered[0])
    why = _written_in_place(_matched(norm, quant, residual, ar, moe, post), inputs, anchor, positions)
    if why:
        report.skipped.append(Skipped(norm.output.name, "rmsnorm", why, "pattern"))
        return

    if kind != "all_reduce":
        quant_is_op = quant is not None and any(G.kind(u.final) == "cf_quantize" for u in quant_uses(quant, norm))
        rewrite, compiler, cuda_graphs = policy
        why = local_rewrite(kind, quant.quant if quant is not None else None, quant_is_op, compiler, rewrite,
                            cuda_graphs, residual is not None,
                            lambda: _separated(kind, norm, quant, residual is not None, scale_src is not None, h))
        if why:
            report.skipped.append(Skipped(norm.output.name, "rmsnorm", why, "evidence"))
            return

    for what, n in inputs:
        if isinstance(n, fx.Node) and positions[n] >= positions[anchor]:
            if n.op == "get_attr" or (n.op == "call_method" and n.target == "item" and _early(n.args[0], positions,
                                                                                            anchor)):
                anchor.prepend(n)
                positions = G.order(g)
            else:
                report.skipped.append(Skipped(norm.output.name, "rmsnorm", f"the {what} {n.name} is computed after "
                                              f"the tail starts ({anchor.name}): nowhere to put one op", "pattern"))
                return

    # x has the sizes of the replaced node they read (a post-norm's nodes too: the sum's, the add's shape)
    for u, n in (*norm.shape_queries, *(post.shape_queries if post is not None else ())):
        u.replace_input_with(n, norm.input)

    # The op, on [tokens, h] views of its row inputs: it returns [tokens, h] outputs whatever the inputs'
    # rank, and a [b, s, h] view of a GEMM's [b * s, h] output would reach it through a view per input and
    # call in the compiled code, where this view of a view is the GEMM's output itself.
    shape_ref = residual if residual is not None else norm.input
    shape_ref_shape = G.shape(shape_ref)
    rank = len(shape_ref_shape)
    return_norm = quant is None or bool(others)

    build = Builder(g, aten_only)

    def rows(n: Optional[fx.Node]) -> Optional[fx.Node]:
        return n if _is_rows(n, h) else build.reshape(n, -1, h)

    with g.inserting_before(anchor):
        weight = g.get_attr(norm.weight[1]) if isinstance(norm.weight, tuple) else norm.weight
        scale = None
        if quant is not None:
            scale = build.reciprocal(quant.scale[1]) if isinstance(quant.scale, tuple) else quant.scale
        layouts = {} if quant is None else dict(sf_layout=quant.sf_layout, scale_layout=quant.scale_layout,
                                                scale_ue8m0=quant.scale_ue8m0)
        tail = code(quant.quant if quant is not None else None, bool(return_norm) and quant is not None, **layouts)
        offset = float(norm.weight_offset)
        if moe is not None:
            y = moe.y if not moe.y_rows else build.reshape(moe.y, -1, moe.k, h)
            w = moe.weights if not moe.w_rows else build.reshape(moe.weights, -1, moe.k)
            index = moe.row_index
            if moe.row_mask is not None:  # a zeroed row's slot dropped: row index -1
                index = build.drop_zeroed(index, moe.row_mask)
            index = None if index is None else build.reshape(index, -1, moe.k)
            args = (y, w, index, rows(moe.shared), rows(residual), weight, scale, norm.eps, offset, tail, comm_name)
        elif kind == "all_reduce":
            args = (rows(ar.x), rows(residual), weight, scale, norm.eps, offset, tail, comm_name)
            if post is not None:
                args += (g.get_attr(post.weight[1]) if isinstance(post.weight, tuple) else post.weight,)
        elif kind == "local":
            args = (rows(x), rows(residual), weight, scale, norm.eps, offset, tail)
        else:
            args = (rows(norm.input), rows(norm.gate), weight, scale, norm.eps, norm.group_size or h,
                    norm.norm_before_gate, tail)
        fused = g.call_function(targets["moe" if moe is not None else kind], args)
    out_fields = fields(tail, residual is not None and kind != "gated")

    def output(field: str, replaces: fx.Node, view: bool, own: bool = False) -> fx.Node:
        with g.inserting_before(replaces):
            out = g.call_function(operator.getitem, (fused, out_fields.index(field)))
            if own:
                out = build.clone(out)
            if view and rank != 2 and len(G.shape(replaces) or shape_ref_shape) != 2:
                out = build.reshape_as(out, shape_ref, view=True)
        out.meta = dict(replaces.meta)
        return out

    doomed: List[fx.Node] = []
    # Quantized codes (and scale factors).
    if quant is not None:
        uses = quant_uses(quant, norm)
        # Identical quantizations read the op's one output where nothing can tell them apart; else each
        # after the first reads a copy of its own.
        shared = all(_may_share(n) for use in uses for n in _codes(use))
        for i, use in enumerate(uses):
            own = i > 0 and not shared
            if use.final.op == "call_function" and G.kind(use.final) == "cf_quantize":
                quantized = fields(use.final.args[2], False)  # the quantize op's outputs
                for gi in list(use.final.users):
                    new = output(quantized[gi.args[1]], gi, view=False, own=own)
                    gi.replace_all_uses_with(new)
                    doomed.append(gi)
            else:
                new = output("quant", use.final, view=True, own=own)
                cur, mapping = new, {}
                with g.inserting_before(use.final):
                    src = norm.output
                    for vw in use.views:
                        mapping[src] = cur
                        if G.kind(vw) == "view":  # a no-op cast or copy is not replayed: on the codes it would cast
                            cur = g.node_copy(vw, lambda a: mapping.get(a, a))
                            cur.meta = dict(use.final.meta)
                        src = vw
                use.final.replace_all_uses_with(cur)
            doomed += use.nodes
    # The norm, for its other users.
    if others:
        new = output("norm", norm.output, view=True)
        keep = set(others)
        norm.output.replace_all_uses_with(new, delete_user_cb=lambda u: u in keep)
    # The residual sum, for every later reader.
    if residual is not None:
        new = output("residual", norm.input, view=True)
        norm.input.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new and u not in set(norm.nodes))
        doomed.append(norm.input)
    doomed += norm.nodes
    if post is not None:
        doomed += post.nodes
    if ar is not None:
        doomed += ar.chain + ar.nodes
    if moe is not None:
        doomed += moe.nodes
    _erase(g, doomed, erased)

    pattern = ("moe_combine + " if moe is not None else "") + ("all_reduce + " if kind == "all_reduce" else "") \
        + ("rmsnorm (post-norm) + " if post is not None else "") \
        + ("add + " if residual is not None else "") \
        + ("gated_rmsnorm" if kind == "gated" else "rmsnorm") + (f" + {quant.quant}" if quant is not None else "")
    spelling = [norm.spelling]
    if post is not None:
        spelling.insert(0, post.spelling)
    if ar is not None:
        spelling.insert(0, ar.spelling)
    if moe is not None:
        spelling.insert(0, moe.spelling)
    if quant is not None:
        spelling.append(quant.spelling)
    notes = (list(moe.notes) if moe is not None else []) + list(norm.notes) + \
        (list(quant.notes) if quant is not None else [])
    if post is not None:  # the post-normed sum is added to the residual: what differs in it reaches the residual
        notes += [f"the post-norm: {n}; the residual output (the post-normed sum plus the residual) carries it"
                  for n in post.notes]
    if ar is not None and ar.comm is None:
        notes.append("the graph's collective sums in its backend's order (NCCL: in T); commfuse sums in fp32 in rank "
                     "order, rounded once (docs/semantics.md section 1): the same bits on 2 ranks")
    report.fused.append(Fused(
        pattern=pattern, op=OPS["moe" if moe is not None else kind], node=fused.name,
        replaced=[n.name for n in _names(doomed)],
        spelling=" | ".join(spelling), quant=quant.quant if quant is not None else None,
        return_norm=bool(others) if quant is not None else True,
        eps=norm.eps.name if isinstance(norm.eps, fx.Node) else f"{norm.eps:g}", comm=comm_name,
        route=_route(kind, norm, residual, quant, comm_name, comm, t, h, return_norm, post is not None)
        + ("\n" + _MOE_COMBINE_ROUTE if moe is not None else ""),
        notes=notes))


# How moe_all_reduce runs the combine (commfuse.moe): the call's plan.combine says which at run time.
_MOE_COMBINE_ROUTE = ("combine: one kernel with the tail at world size 1, inside the P2P kernel as each rank's rows "
                      "are read where the group takes a P2P route, else the combine kernel before the collective on "
                      "CUDA tensors, commfuse.reference's ops elsewhere (the call's plan.combine)")


def _moe_combine(ar: P.AllReduce, norm: P.Norm, residual: fx.Node, h: int, report: FusionReport):
    """The MoE combine the all-reduce reads (patterns.match_moe_combine), or None: its skip reasons are
    reported, and the all-reduce + add + RMSNorm then become commfuse::fused_all_reduce as usual."""
    then = "; the all-reduce + add + RMSNorm become commfuse::fused_all_reduce, the combine stays in the graph"
    if ar.added is not None:
        return _moe_combine_and_shared(ar, norm, residual, h, report)
    found = P.match_moe_combine(ar.x, G.dtype(norm.input))
    if found is None:
        ia = P.index_add_combine(ar.x)
        if ia is not None:
            # Said of any index_add_ there: a MoE combine or not, the graph's add is what is not matched.
            report.skipped.append(Skipped(ia.name, "moe combine", "the all-reduced tensor is built by an index_add_ "
                                          "(as HF Mixtral's loop over experts combines expert rows): not matched as "
                                          "a combine, only a weighted sum over the top-k axis is" + then, "pattern"))
        return None
    if isinstance(found, P.Mismatch):
        report.skipped.append(Skipped(ar.x.name, "moe combine", found.reason + then, found.kind))
        return None
    if residual in found.nodes:  # the add reads the combine twice: as the sum's input and as the residual
        report.skipped.append(Skipped(residual.name, "moe combine", f"the residual {residual.name} is the combine's "
                                      "own result, not kept apart from it: commfuse::moe_all_reduce takes the "
                                      "residual as an input of its own" + then, "pattern"))
        return None
    allowed = set(found.nodes) | set(ar.nodes) | set(ar.chain) | {norm.input}
    for n in found.nodes:
        others = [u.name for u in n.users if u not in allowed]
        if others:
            report.skipped.append(Skipped(n.name, "moe combine", f"the combine's {n.name} is also read by "
                                          f"{', '.join(others)}: commfuse::moe_all_reduce does not return it" + then,
                                          "guard"))
            return None
    if G.hidden(found.y) != h:
        report.skipped.append(Skipped(found.y.name, "moe combine", f"the expert outputs {found.y.name} have hidden "
                                      f"size {G.hidden(found.y)}, the tail {h}" + then, "guard"))
        return None
    return found


def _moe_combine_and_shared(ar: P.AllReduce, norm: P.Norm, residual: fx.Node, h: int, report: FusionReport):
    """Two all-reduces added (transformers' expert parallelism: the routed combine's, and the shared expert's
    row-parallel down_proj's): the combine one reduces, the other's input as the op's shared expert output.
    None where neither reduces a combine without a shared expert of its own."""
    t = G.dtype(norm.input)
    for x, shared in ((ar.x, ar.added), (ar.added, ar.x)):
        found = P.match_moe_combine(x, t)
        if not isinstance(found, P.MoeCombine) or found.shared is not None or not _same_rows(shared, x) \
                or G.dtype(shared) != t or shared is x or shared in found.nodes:  # the combine all-reduced twice
            continue
        alone = P.AllReduce(x=x, nodes=ar.nodes, chain=ar.chain, spelling=ar.spelling, group=ar.group, comm=ar.comm)
        found = _moe_combine(alone, norm, residual, h, report)
        if found is None:
            return None
        found.shared = shared
        found.spelling += f" + shared ({shared.name}, all-reduced apart)"
        found.notes.append(f"the graph all-reduces the routed combine and the shared expert's output apart and adds "
                           f"the two sums in {P._dt(t)}; the op adds the shared output to each rank's combine in "
                           f"float32 before the one all-reduce: the terms round in another order (within an ulp of "
                           f"{P._dt(t)} of the row unless they cancel)")
        return found
    return None


def _same_rows(a: fx.Node, b: fx.Node) -> bool:
    """The same [tokens, h] rows however viewed ([b, s, h] and [b * s, h]): sizes compared as written."""
    sa, sb = G.shape(a), G.shape(b)
    return sa is not None and sb is not None and len(sa) > 0 and len(sb) > 0 and str(sa[-1]) == str(sb[-1]) \
        and str(math.prod(sa[:-1])) == str(math.prod(sb[:-1]))


def _early(n, positions, anchor) -> bool:
    return not isinstance(n, fx.Node) or positions[n] < positions[anchor]


def _skip_feeding_all_reduce(norm_input: fx.Node, norm_name: str, reason: str, kind: str, report: FusionReport,
                             seen_all_reduce: set) -> None:
    """A norm rejected before its inputs were looked at: the all-reduce whose sum its residual add
    (norm_input, or a float32 cast of it) reads is skipped for the norm's reason, so that its report line
    does not say that no norm reads it."""
    add = norm_input
    if (G.passthrough(add) or G.kind(add) == "cast") and G.source(add) is not None \
            and P.match_residual_add(add) is None:
        add = G.source(add)  # the norm's float32 cast of the sum
    pair = P.match_residual_add(add)
    if pair is None:
        return
    positions = G.order(add.graph)
    for xa in pair:  # each operand may be an all-reduced sum
        if P.trace_all_reduce(xa, add, positions) is not None:
            _skip_all_reduce(xa, add.name, f"its sum feeds a residual add + RMSNorm ({norm_name}) that is not fused: "
                             f"{reason}", kind, report, seen_all_reduce)


def _skip_all_reduce(v: fx.Node, where: str, reason: str, kind: str, report: FusionReport, seen: set) -> None:
    """Report the collective behind v (a skipped candidate) at its node (at `where` if it is not found) once, and
    mark it so that it is not reported again (y + y.view(-1, h) reaches one twice) nor as one whose sum no norm
    reads."""
    behind = _collectives_behind(v)
    if not behind or not seen.issuperset(behind):
        report.skipped.append(Skipped(behind[0].name if behind else where, "all-reduce", reason, kind))
    seen.update(behind)


def _collectives_behind(v: fx.Node) -> list:
    """The collectives whose sums v is computed from (looked for within 16 nodes)."""
    found, stack, seen = [], [v], set()
    while stack and len(seen) < 16:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if G.kind(n) in ("funcol_all_reduce", "cf_all_reduce"):
            found.append(n)
            continue
        stack.extend(n.all_input_nodes)
        for u in n.users:  # dynamo's in-place form: the sum copied into n, looked at first (popped first)
            if G.kind(u) == "copy_" and G.operand(u, 0, "self") is n and isinstance(G.operand(u, 1, "src"), fx.Node):
                stack.append(G.operand(u, 1, "src"))
    return found


def _matched(norm: P.Norm, quant, residual, ar, moe, post: Optional[P.Norm] = None) -> set:
    """Every node the rewrite replaces (the residual sum's add, and a post-norm's nodes, included)."""
    nodes = set(norm.nodes) | set(post.nodes if post is not None else ())
    if residual is not None:
        nodes.add(norm.input)
    if quant is not None:
        for use in quant_uses(quant, norm):
            nodes.update(use.nodes)
    if ar is not None:
        nodes.update(ar.chain + ar.nodes)
    if moe is not None:
        nodes.update(moe.nodes)
    return nodes


def _written_in_place(matched: set, inputs: list, anchor: fx.Node, positions: dict) -> Optional[str]:
    """Why the match cannot become one op because a node outside it writes, in place, what it reads (the
    op computes from the values before the write), or None. A tensor the match computes: written after it
    and before the match's last node (`h.add_(1)` between the residual add and the norm, `n.mul_(4)`
    between the norm and its quantization). An input (name, node): written between two of its reads (the
    graph's, for the match, or the op's at the anchor). Writes after the match are the graph's: their
    tensors are then the op's outputs."""
    last = max(matched, key=lambda n: positions[n])
    for n in sorted(matched, key=lambda n: positions[n]):
        writer = G.written_between(n, n, last, positions, ignore=matched)
        if writer is not None:
            return (f"{n.name} is written in place ({writer.name}) before the pattern's last node {last.name} reads "
                    "what it computes: the fused op would compute from the values before the write")
    for what, n in inputs:
        if not isinstance(n, fx.Node):
            continue
        # The op reads the input at the anchor; the graph where the match's nodes read its memory (through
        # views: a view taken early reads it only where it is read). A write between any two changes what one reads.
        reads = _reads(n, matched, positions[last], positions) + [anchor]
        lo, hi = (f(reads, key=lambda u: positions[u]) for f in (min, max))
        writer = G.written_between(n, lo, hi, positions, ignore=matched)
        if writer is not None:
            return (f"the {what} {n.name} is written in place ({writer.name}) between {lo.name} and {hi.name}, which "
                    f"read it: the fused op reads it once, at {anchor.name}")
    return None


def _reads(n: fx.Node, matched: set, last: int, positions: dict) -> list:
    """The nodes up to position `last` that read n's memory for the match: the users of n and of what may
    alias it whose values reach the match. Such an alias is followed to its users (a view reads where it is
    read) and counts as a read itself (it may be a copy: a gather, a cast)."""
    aliases, todo, reads = {n}, [n], []
    while todo:
        for u in todo.pop().users:
            if u in aliases or positions[u] > last or not _feeds(u, matched, last, positions):
                continue
            reads.append(u)
            if G.may_alias(u) and G.source(u) in aliases and u not in matched:
                aliases.add(u)
                todo.append(u)
    return reads


def _feeds(u: fx.Node, matched: set, last: int, positions: dict) -> bool:
    """Whether u's value reaches the match: u is in it, or a node before its last (at position `last`)
    that reads u does (the views, casts and gathers between a MoE input and the combine's own nodes)."""
    todo, seen = [u], set()
    while todo:
        v = todo.pop()
        if v in matched:
            return True
        if v in seen or positions[v] > last:
            continue
        seen.add(v)
        todo.extend(v.users)
    return False


def _codes(use: P.Quant) -> list:
    """The nodes whose values a quantization's readers read: the codes, or a quantize op's outputs."""
    return list(use.final.users) if G.kind(use.final) == "cf_quantize" else [use.final]


def _may_share(n: fx.Node) -> bool:
    """Whether n's value may be another node's too: nothing writes it in place (through any view), and the graph
    does not return it (the caller would get one tensor for two)."""
    return not any(u.op == "output" or G.writes(u, a) for a in G.aliases(n) for u in a.users)


def quant_uses(quant: P.Quant, norm: P.Norm) -> list:
    return getattr(quant, "uses", [quant])


def _consumers(norm: P.Norm, h: int, report: FusionReport):
    """(the quantization to fuse or None, the norm's other users)."""
    groups: dict = {}
    others = []
    for u in list(norm.output.users):
        q = P.match_quant(norm.output, u, h)
        if isinstance(q, P.Mismatch):
            report.skipped.append(Skipped(u.name, "quantization", q.reason + "; left unfused", q.kind))
            others.append(u)
        elif q is None:
            others.append(u)
        else:
            groups.setdefault(q.key, []).append(q)
    if not groups:
        return None, others
    if len(groups) > 1:
        desc = "; ".join(f"{k[0]} with scale {_scale_name(k[1])}" for k in groups)
        report.skipped.append(Skipped(norm.output.name, "quantization",
                                      f"the norm feeds quantizations with different scales or formats ({desc}): "
                                      "they are left unfused, reading the norm", "guard"))
        for uses in groups.values():
            others += [use.nodes[0] for use in uses]
        return None, others
    (key, uses), = groups.items()
    quant = uses[0]
    bad = None
    try:
        spec = TailSpec.of(quant.quant, sf_layout=quant.sf_layout, scale_layout=quant.scale_layout,
                           scale_ue8m0=quant.scale_ue8m0)
    except (TypeError, ValueError) as e:
        bad = f"quant {quant.quant!r} is not one the fused ops take ({e})"
    else:
        if h % spec.hidden_multiple:
            bad = f"quant={quant.quant!r} needs h % {spec.hidden_multiple} == 0, h = {h}"
        elif spec.format.takes_scale and not isinstance(quant.scale, (fx.Node, tuple)):
            bad = f"the scale {quant.scale!r} is not a tensor in the graph"
    if bad:
        report.skipped.append(Skipped(quant.final.name, "quantization", bad + "; left unfused, reading the norm",
                                      "guard"))
        others += [use.nodes[0] for use in uses]
        return None, others
    quant.uses = uses  # type: ignore[attr-defined]
    for use in uses[1:]:
        quant.notes = list(dict.fromkeys(quant.notes + use.notes))
    return quant, others


def _scale_name(s) -> str:
    if isinstance(s, tuple):
        return f"1/{s[1].name}"
    return getattr(s, "name", repr(s))


def _is_post_norm(norm: P.Norm) -> bool:
    """Whether `norm` normalises an all-reduce's sum and only a residual add reads it (Gemma 2 / 3's
    post_attention_layernorm): held back for the add's norm, which takes it as fused_all_reduce's post-norm."""
    if norm.gated or len(norm.output.users) != 1 or P.match_residual_add(next(iter(norm.output.users))) is None:
        return False
    positions = G.order(norm.output.graph)
    return isinstance(P.trace_all_reduce(norm.input, _first_reader(norm), positions, set(norm.nodes)), P.AllReduce)


def _first_reader(norm: P.Norm) -> fx.Node:
    """The norm's first node that reads its input (where trace_all_reduce reads the sum)."""
    positions = G.order(norm.output.graph)
    return min((n for n in norm.nodes if norm.input in n.all_input_nodes), key=positions.get)


def _post_norm_guard(post: P.Norm, norm: P.Norm) -> Optional[str]:
    """Why the post-norm `post` cannot be fused_all_reduce's post_weight before `norm` (None: it can): the op gives
    both norms one eps and one weight offset, and takes the post weight as it takes the weight."""
    if not (post.eps == norm.eps if isinstance(post.eps, float) and isinstance(norm.eps, float) else
            post.eps is norm.eps):
        return f"the post-norm {post.output.name}'s eps {post.eps} is not the norm's {norm.eps}: the op takes one eps"
    if float(post.weight_offset) != float(norm.weight_offset):
        return (f"the post-norm {post.output.name}'s weight offset {post.weight_offset:g} is not the norm's "
                f"{norm.weight_offset:g}: the op takes one")
    dtype = G.dtype(post.weight) if isinstance(post.weight, fx.Node) else post.weight_dtype
    if dtype is not None and dtype != G.dtype(norm.input):
        return (f"the post-norm {post.output.name}'s weight is {dtype}, the activations {G.dtype(norm.input)}: the "
                "op takes one of the activations' dtype")
    shape, h = G.shape(post.weight) if isinstance(post.weight, fx.Node) else None, G.shape(norm.input)
    if shape is not None and h is not None and tuple(map(str, shape)) != (str(h[-1]),):
        return f"the post-norm {post.output.name}'s weight has shape {tuple(shape)}, not [{h[-1]}]"
    return None


def _all_reduce_guard(ar: P.AllReduce, comm, norm: P.Norm) -> Optional[str]:
    if G.dtype(ar.x) != G.dtype(norm.input):
        return f"the all-reduce sums {G.dtype(ar.x)}, the add is {G.dtype(norm.input)}"
    return _group_guard(ar, comm)


def _group_guard(ar: P.AllReduce, comm) -> Optional[str]:
    """Why the all-reduce cannot run as commfuse's (None: it can)."""
    if ar.comm is not None:
        from commfuse import ops

        try:
            ops.communicator(ar.comm)
        except LookupError as e:
            return str(e)
        return None
    if comm is None:
        return "no Communicator given to the pass (fuse(gm, comm)) for a torch.distributed all-reduce"
    name = comm.group.group_name
    if str(ar.group) != str(name):
        return f"the all-reduce's group {ar.group!r} is not the Communicator's ({name!r})"
    return None


def _erase(g: fx.Graph, nodes: List[fx.Node], erased: set) -> None:
    """Erase the replaced nodes, then whatever only they read (e.g. the item() of a lifted float), if pure."""
    positions = G.order(g)
    inputs = set()
    for n in sorted(set(nodes), key=lambda n: positions.get(n, -1), reverse=True):
        if n in erased:
            continue
        if n.users:
            raise AssertionError(f"commfuse.fusion: {n.name} still has users {list(n.users)} (a bug in the pass)")
        inputs.update(n.all_input_nodes)
        g.erase_node(n)
        erased.add(n)
    stack = [n for n in inputs if n not in erased]
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method") or n.is_impure():
            continue
        stack.extend(n.all_input_nodes)
        g.erase_node(n)
        erased.add(n)


def _names(nodes):
    seen = []
    for n in nodes:
        if n not in seen:
            seen.append(n)
    return seen


# --------------------------------------------------------------------------- commfuse::fused_add_rmsnorm after an all-reduce


def _fuse_commfuse_tail(gm, node, comm, targets, report, erased, seen_all_reduce, aten_only=False) -> None:
    # The op's arguments by its schema's names: a graph may pass any of them by keyword.
    x, residual, weight, scale, eps, offset, tail = (G.operand(node, i, name) for i, name in enumerate(
        ("x", "residual", "weight", "scale", "eps", "weight_offset", "tail")))
    options = public(tail)
    positions = G.order(gm.graph)
    if not isinstance(x, fx.Node):
        return
    ar = P.trace_all_reduce(x, node, positions)
    if ar is None:
        return
    if isinstance(ar, P.Mismatch):
        _skip_all_reduce(x, node.name, ar.reason, ar.kind, report, seen_all_reduce)
        return
    seen_all_reduce.update(n for n in ar.nodes if G.kind(n) in ("funcol_all_reduce", "cf_all_reduce"))
    if residual is None:
        why = "commfuse::fused_add_rmsnorm without a residual: commfuse::fused_all_reduce needs one"
    elif isinstance(residual, fx.Node) and P.reads_the_sum(residual, x, ar, positions):
        why = (f"the residual {residual.name} is computed from the all-reduce's sum too: commfuse::fused_all_reduce "
               "takes the residual before the sum exists")
    elif G.dtype(ar.x) != G.dtype(x):
        why = f"the all-reduce sums {G.dtype(ar.x)}, the op reads {G.dtype(x)}"
    else:
        why = _group_guard(ar, comm)
    if why:
        report.skipped.append(Skipped(ar.nodes[0].name, "all-reduce", why, "guard"))
        return
    # The fused op reads the all-reduce's input at the local op, where the collective read it.
    why = _written_in_place({node, *ar.chain, *ar.nodes}, [("x", ar.x)], node, positions)
    if why:
        report.skipped.append(Skipped(ar.nodes[0].name, "all-reduce", why, "pattern"))
        return
    comm_name = ar.comm if ar.comm is not None else comm.name
    g = gm.graph
    with g.inserting_before(node):
        xin = ar.x if G.same_shape(ar.x, residual) else Builder(g, aten_only).reshape_as(ar.x, residual)
        new = g.call_function(targets["all_reduce"], (xin, residual, weight, scale, eps, offset, tail, comm_name))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    doomed = [node] + ar.chain + ar.nodes
    _erase(g, doomed, erased)
    report.fused.append(Fused(pattern="all_reduce + commfuse::fused_add_rmsnorm", op=OPS["all_reduce"], node=new.name,
                              replaced=[n.name for n in doomed], spelling=f"{ar.spelling} | commfuse.fused_add_rmsnorm",
                              quant=options["quant"], return_norm=options["return_norm"], eps=str(eps),
                              comm=comm_name))


# --------------------------------------------------------------------------- the route, for the report


def _route(kind, norm, residual, quant, comm_name, comm, t, h, return_norm, post: bool = False) -> str:
    """What the inserted op will run, from commfuse's plan for a call of the graph's shapes (one
    token when the token count is symbolic)."""
    try:
        tokens, note = _tokens(norm.input, h)
        eps = norm.eps if isinstance(norm.eps, float) else 1e-6
        q = quant.quant if quant is not None else None
        layouts = {} if quant is None else dict(sf_layout=quant.sf_layout, scale_layout=quant.scale_layout,
                                                scale_ue8m0=quant.scale_ue8m0)
        takes_scale = q is not None and TailSpec.of(q, **layouts).format.takes_scale
        if kind == "all_reduce":
            from commfuse import ops

            try:
                c = ops.communicator(comm_name)
            except LookupError:
                return "unknown (no live Communicator)"
            dev = c.device
        else:
            dev = G.device(norm.input) or torch.device("cpu")
        x = torch.empty(tokens, h, dtype=t, device=dev)
        w = torch.empty(h, dtype=t, device=dev)
        scale = torch.ones(1, dtype=torch.float32, device=dev) if takes_scale else None
        if kind == "gated":
            from commfuse import local

            plan = local.plan_gated(x, x if norm.gate is not None else None, w, eps, norm.group_size or h,
                                    bool(norm.norm_before_gate), quant=q, scale=scale, **layouts)
        elif kind == "all_reduce":
            plan = c.plan(x, torch.empty_like(x), w, eps=eps, quant=q, scale=scale,
                          return_norm=bool(return_norm) and q is not None, weight_offset=norm.weight_offset,
                          post_weight=torch.empty_like(w) if post else None, **layouts)
        else:
            from commfuse import local

            plan = local.plan(x, torch.empty_like(x) if residual is not None else None, w, eps, quant=q, scale=scale,
                              weight_offset=norm.weight_offset, **layouts)
        return str(plan) + note
    except Exception as e:  # noqa: BLE001 - the report must not break the pass
        return f"unknown ({type(e).__name__}: {e})"


def _tokens(n, h):
    t = G.tokens(n)
    if t is None:
        return 1, "\n(planned for 1 token: the graph's token count is symbolic)"
    return max(1, t), ""
