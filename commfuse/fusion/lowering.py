"""How Inductor's generated code calls commfuse's ops: straight into their C++ kernels.

Inductor runs an op it cannot compile as a fallback: its Python wrapper calls
`torch.ops.commfuse.<op>.default(...)` through torch's dispatcher (the schema's argument parsing, the
boxed call), then checks each output's sizes and strides (`assert_size_stride`). In a compiled step of
Inductor's default mode the host's pace is the step's time, and that path costs each op more than a
Triton kernel's launch: through it, replacing Inductor's own tail kernels with commfuse's makes a decode
step slower (measured in bench/journal.md).

`install()` registers a lowering for each op of commfuse.kernels.native.OPS that builds Inductor's own
fallback node (the same buffers, scheduling and layout rules) and changes two things in the Python
wrapper's code:
- the call goes to `commfuse.kernels.native.direct.<op>`: the extension's binding of the same C++
  kernel the dispatcher reaches (the op itself where the extension is off);
- the outputs are not re-checked. They are fresh dense tensors made by the kernel from the call's
  shapes, as the op's fake implementation makes them (the tests run torch.library.opcheck on every
  op, which compares the two, sizes and strides).
The C++ wrapper (AOTInductor) keeps Inductor's own code. commfuse.fusion's backend installs it before
Inductor compiles a graph; the lowerings are process-wide, so later graphs with the ops get it too.
"""
from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree

from ..kernels.native import OPS

__all__ = ["install"]

# The name Inductor's wrapper module imports commfuse.kernels.native.direct as.
_NAME = "commfuse_direct"


@functools.cache
def _direct_kernel_class():
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    class DirectKernel(ir.FallbackKernel):
        """Inductor's fallback node of a commfuse op, called through commfuse.kernels.native.direct."""

        def codegen(self, wrapper) -> None:
            if not V.graph.cpp_wrapper and not getattr(V.graph, "fx_wrapper", False):
                wrapper.add_import_once(f"from commfuse.kernels.native import direct as {_NAME}")
                self.python_kernel_name = f"{_NAME}.{self.op_overload._opname}"
            super().codegen(wrapper)

    return DirectKernel


def _lower(op, *args, **kwargs):
    from torch._inductor import ir

    outputs = _direct_kernel_class().create(op, *args, **kwargs)
    for node in pytree.tree_leaves(outputs):
        if isinstance(node, ir.MultiOutput):
            node.skip_size_stride_alignment_checks = True

    def wrap(node):
        if not isinstance(node, ir.IRNode):
            return node
        return node.wrap_for_lowering() if hasattr(node, "wrap_for_lowering") else ir.TensorBox.create(node)

    return pytree.tree_map(wrap, outputs)


@functools.cache
def install() -> None:
    """Register the lowerings of commfuse's ops with Inductor (once a process)."""
    from torch._inductor import lowering

    from .. import ops  # noqa: F401 - defines torch.ops.commfuse

    for name in OPS:
        op = getattr(torch.ops.commfuse, name).default
        lowering.register_lowering(op, type_promotion_kind=None)(functools.partial(_lower, op))
