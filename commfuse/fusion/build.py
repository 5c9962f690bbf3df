"""Writing the few nodes a rewrite needs around its op, in the graph's own level.

A rewrite gives the op [tokens, h] rows and the outputs back in the model's shape (reshapes), the reciprocal of a
scale, a MoE combine's expert rows and weights in [t, k] form, and its row index with dropped slots marked. Dynamo's
graphs (and symbolic_trace's, make_fx's that run as Python) take torch-level calls; Inductor's post-grad graph
(`post_grad_pass`) is lowered op by op and takes aten overloads only, with symbolic sizes read through
`aten.sym_size.int` nodes. `Builder(graph, aten_level)` writes either; each aten node carries its fake value, as the
graph's own nodes do.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from . import graph as G

aten = torch.ops.aten


class Builder:
    """Inserts nodes at the graph's insertion point (use it inside `graph.inserting_before(...)`)."""

    def __init__(self, graph: fx.Graph, aten_level: bool):
        self.graph, self.aten_level = graph, aten_level

    def reshape(self, n: fx.Node, *sizes: int) -> fx.Node:
        """n.reshape(*sizes): static sizes, at most one of them -1."""
        if self.aten_level:
            return self._call(aten.reshape.default, (n, list(sizes)), lambda v, s: v.reshape(s))
        return self._method("reshape", (n, *sizes))

    def reshape_as(self, n: fx.Node, like: fx.Node, view: bool = False) -> fx.Node:
        """n in like's shape (a view when `view`: n is dense), symbolic sizes included."""
        if not self.aten_level:
            return self._method("view_as" if view else "reshape_as", (n, like))
        sizes = [G.static_int(d) if G.static_int(d) is not None else
                 self._call(aten.sym_size.int, (like, i), lambda w, j: w.shape[j]) for i, d in enumerate(G.shape(like))]
        return self._call(aten.view.default if view else aten.reshape.default, (n, sizes), lambda v, s: v.reshape(s))

    def mm(self, a: fx.Node, b: fx.Node) -> fx.Node:  # aten only (split_shared_addmm)
        return self._call(aten.mm.default, (a, b), torch.mm)

    def add(self, a: fx.Node, b: fx.Node) -> fx.Node:  # aten only
        return self._call(aten.add.Tensor, (a, b), torch.add)

    def clone(self, n: fx.Node) -> fx.Node:
        if self.aten_level:
            return self._call(aten.clone.default, (n,), torch.clone)
        return self._method("clone", (n,))

    def reciprocal(self, n: fx.Node) -> fx.Node:
        if self.aten_level:
            return self._call(aten.reciprocal.default, (n,), torch.reciprocal)
        return self._call(torch.reciprocal, (n,), torch.reciprocal)

    def drop_zeroed(self, index: fx.Node, mask: fx.Node) -> fx.Node:
        """index with -1 where mask (one flag a row, any shape) flags the row it names: a dropped slot. Torch-level
        only: the matchers find the finalize form's gather and masked_fill_ as dynamo writes them."""
        assert not self.aten_level, "the finalize form is matched in torch-level graphs only"
        zeroed = self.graph.call_function(operator.getitem, (self.reshape(mask, -1), index))
        return self.graph.call_function(torch.where, (zeroed, -1, index))

    def _method(self, name: str, args: tuple) -> fx.Node:
        return self.graph.call_method(name, args)

    def _call(self, target, args: tuple, fake: Callable) -> fx.Node:
        node = self.graph.call_function(target, args)
        if self.aten_level:  # Inductor's passes after this one read the nodes' values, as make_fx wrote them
            values = _values(args)
            if all(isinstance(v, (torch.Tensor, torch.SymInt, int, float, bool)) for v in _leaves(values)):
                node.meta["val"] = fake(*values)
        return node


def _values(x):
    if isinstance(x, (list, tuple)):
        return type(x)(_values(y) for y in x)
    return G.value(x) if isinstance(x, fx.Node) else x


def _leaves(x) -> list:
    if isinstance(x, (list, tuple)):
        return [leaf for y in x for leaf in _leaves(y)]
    return [x]
