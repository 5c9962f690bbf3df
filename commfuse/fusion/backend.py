"""torch.compile integration: a dynamo backend that runs the pass on dynamo's graph, then compiles it.

    compiled = commfuse.fusion.compile(model, comm, fullgraph=True, dynamic=True, mode="reduce-overhead")
    out = compiled(*inputs)
    for report in compiled.fusion_reports: print(report)

or, with torch.compile itself:

    reports = []
    compiled = torch.compile(model, backend=commfuse.fusion.backend(comm, reports=reports), fullgraph=True)

The pass runs at dynamo's level: the torch-level FX graph a backend receives, before AOT autograd
and Inductor decompose it. There the patterns still read as the model wrote them (x.pow(2).mean(-1),
torch.rms_norm, the all-reduce as `_c10d_functional.all_reduce -> wait_tensor -> copy_`), the
inserted custom ops are then traced by AOT with their fake implementations (any token count under
dynamic shapes), and Inductor compiles the rest around them, with CUDA graphs in mode
"reduce-overhead". After the pass, the graph goes to `inner`: "inductor" (the default on CUDA),
"aot_eager" (the default without CUDA: Inductor on a CPU compiles C++, slowly), or any dynamo backend
(a name or a callable). `mode` and `options` are Inductor's (torch.compile's own handling of them
is reproduced); another inner backend ignores a mode, with a warning.

or as Inductor's post-grad custom pass, for an engine that compiles with Inductor and its own passes:

    torch._inductor.config.post_grad_custom_post_pass = commfuse.fusion.post_grad_pass(comm, reports=reports)

There the graph is Inductor's, after AOT autograd's decomposition and functionalization (aten ops,
`_c10d_functional.all_reduce -> wait_tensor`), which the matchers read too.

Inference only: the fused ops have no autograd formula. Run compiled models under torch.no_grad() /
torch.inference_mode() (or with parameters that do not require grad): a graph compiled with grad mode on and an
input that requires grad is left whole (the report says so), since backward would miss gradients through the ops.
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Callable, List, Optional, Union

import torch
import torch.distributed as dist

from . import lowering
from .. import env
from .evidence import REWRITES
from .report import FusionReport
from .rewrite import fuse

__all__ = ["backend", "compile", "post_grad_pass"]


def _default_inner(comm) -> str:
    dev = getattr(comm, "device", None)
    if dev is not None:
        return "inductor" if torch.device(dev).type == "cuda" else "aot_eager"
    return "inductor" if torch.cuda.is_available() else "aot_eager"


def _inner_compiler(inner: Union[str, Callable], mode: Optional[str], options: Optional[dict],
                    dynamic: Optional[bool]) -> Callable:
    if inner == "inductor":
        try:
            return torch._TorchCompileInductorWrapper(mode, options, dynamic, None)
        except TypeError:  # torch before the name argument
            return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    if mode not in (None, "default") or options:
        warnings.warn(f"commfuse.fusion: mode={mode!r} / options apply to inductor; the inner backend {inner!r} "
                      "ignores them", stacklevel=3)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(inner) if isinstance(inner, str) else inner


def _cuda_graphs(mode: Optional[str], options: Optional[dict]) -> bool:
    """Whether Inductor replays what it compiles with this mode and options from CUDA graphs."""
    from torch._inductor import config, list_mode_options

    chosen = {**list_mode_options(mode or "default"), **(options or {})}
    return bool(chosen.get("triton.cudagraphs", config.triton.cudagraphs))


def _compile_context():
    """Dynamo's context of the compile under way (None outside one). Dynamo keeps one for every attempt at a
    frame's compile, restarts included; its compile id alone would not tell a restart from a new compile after
    torch._dynamo.reset(), which numbers compiles from 0/0 again."""
    try:
        from torch._guards import CompileContext

        return CompileContext.try_get()
    except Exception:  # noqa: BLE001 - only used to recognise restarts
        return None


def backend(comm=None, *, inner: Union[str, Callable, None] = None, mode: Optional[str] = None,
            options: Optional[dict] = None, dynamic: Optional[bool] = None,
            reports: Optional[List[FusionReport]] = None, verbose: bool = False, rewrite: str = "auto") -> Callable:
    """A dynamo backend: `fuse(gm, comm)` on each graph dynamo captures, then the inner backend.

    comm: the Communicator of the model's tensor-parallel group (None: only commfuse.ops all-reduces
    and the local patterns fuse). inner: the backend that compiles the rewritten graph (default:
    inductor on CUDA, aot_eager otherwise). mode, options, dynamic: as torch.compile's, for Inductor
    (pass them here, or to torch.compile, which forwards mode and options to this backend).
    reports: a list each graph's FusionReport is appended to. verbose: print each report.
    rewrite: "auto" (every collective tail; a local pattern where it beats what the inner backend does
    with it, commfuse.fusion.evidence) or "all" (every match)."""
    if rewrite not in REWRITES:
        raise ValueError(f"rewrite must be one of {REWRITES}, got {rewrite!r}")
    if mode is not None and options is not None:  # torch.compile's rule, in its words
        raise RuntimeError("Either mode or options can be specified, but both can't be specified at the same time.")
    collected = reports if reports is not None else []
    last = [None]  # the compile context of collected[-1]'s graph
    target = inner if inner is not None else _default_inner(comm)
    # Made now, as torch.compile makes its backend: a bad mode, option or backend name raises here, not at the
    # model's first call.
    compiler = _inner_compiler(target, mode, options, dynamic)

    def commfuse_fusion(gm: torch.fx.GraphModule, example_inputs, **kwargs):
        m = kwargs.get("mode", mode)
        o = kwargs.get("options", options)
        report = fuse(gm, comm, rewrite=rewrite, compiler=target if isinstance(target, str) else None,
                      cuda_graphs=target == "inductor" and _cuda_graphs(m, o))
        report.level = "dynamo graph"
        context = _compile_context()
        cid = getattr(context, "compile_id", None)
        report.compile_id = None if cid is None else str(cid)
        if target == "inductor":
            lowering.install()
        inner_compiler = compiler if (m, o) == (mode, options) else _inner_compiler(target, m, o, dynamic)
        compiled = inner_compiler(gm, example_inputs)
        # Only a graph that compiled has a report (where the inner backend raises, dynamo may run the frame
        # eagerly). Dynamo may restart its analysis of a frame after a backend call (e.g. to specialise a
        # float): the graph of the restart replaces the one before it.
        if collected and context is not None and last[0] is context:
            collected[-1] = report
        else:
            collected.append(report)
        last[0] = context
        if verbose:
            print(report)
        return compiled

    commfuse_fusion.reports = collected  # type: ignore[attr-defined]
    return commfuse_fusion


@functools.cache
def _post_grad_pass_class() -> type:
    # Made at the first post_grad_pass: importing torch._inductor costs a second, which `import commfuse` does not pay.
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class PostGradPass(CustomGraphPass):
        """`fuse` on the graph Inductor hands it, for Inductor (`rewrite="auto"` reads whether Inductor replays CUDA
        graphs from its config, which mode="reduce-overhead" sets), then the lowerings of the inserted ops; each
        graph's report goes to `reports`. uuid() keys Inductor's FX graph cache on the sources (the pass's, the
        ops', the tail's, what rewrite="auto" reads), the communicator and its group, `rewrite` and
        COMMFUSE_DISABLE_FUSION: on a hit the cached code, fused as before, is
        reused and the pass does not run (no report is added)."""

        def __init__(self, comm, reports: Optional[List[FusionReport]], rewrite: str):
            self.comm, self.reports, self.rewrite = comm, reports, rewrite

        def __deepcopy__(self, memo):
            # torch.compile without fullgraph deep-copies Inductor's config: the copy must be this pass, which holds
            # a live Communicator (its process group cannot be copied) and reports into the caller's list.
            return self

        def __call__(self, graph: torch.fx.Graph) -> None:
            report = fuse(graph.owning_module, self.comm, rewrite=self.rewrite, compiler="inductor",
                          cuda_graphs=bool(config.triton.cudagraphs), aten_only=True)
            report.level = "Inductor post-grad graph"
            lowering.install()
            if self.reports is not None:
                self.reports.append(report)

        def uuid(self):
            # What the rewritten graph holds comes from the pass (fusion/), the ops' schemas (ops.py), the tail codes
            # they take (tail/), and rewrite="auto"'s reading of which kernels run (routes.py, local.py, the
            # kernels' limits and rejections in kernels/, topology.py's SM floor, COMMFUSE_DISABLE_FUSION);
            # whether it fuses a torch.distributed all-reduce from the Communicator's group, and the code it writes
            # names the Communicator: a process whose "commfuse-0" is of another group must not reuse it.
            package = Path(__file__).parents[1]
            sources = [*package.glob("fusion/*.py"), package / "ops.py", *package.glob("tail/*.py"),
                       package / "routes.py", package / "local.py", *package.glob("kernels/*.py"),
                       package / "topology.py"]
            comm = None if self.comm is None else (
                self.comm.name, str(self.comm.group.group_name), tuple(dist.get_process_group_ranks(self.comm.group)),
                self.comm.device.type)
            return (get_hash_for_files(tuple(sorted(map(str, sources)))), comm, self.rewrite,
                    env.flag("COMMFUSE_DISABLE_FUSION", False))

    return PostGradPass


def post_grad_pass(comm=None, *, reports: Optional[List[FusionReport]] = None, rewrite: str = "auto"):
    """The pass as Inductor's post-grad custom pass, for `torch._inductor.config.post_grad_custom_post_pass`: run
    inside Inductor on its post-grad graph of every model torch.compile gives it (a CustomGraphPass). comm,
    rewrite: as for `fuse`; reports: a list that collects each graph's FusionReport."""
    if rewrite not in REWRITES:
        raise ValueError(f"rewrite must be one of {REWRITES}, got {rewrite!r}")
    return _post_grad_pass_class()(comm, reports, rewrite)


def compile(model, comm=None, *, backend: Union[str, Callable, None] = None, mode: Optional[str] = None,
            options: Optional[dict] = None, dynamic: Optional[bool] = None, fullgraph: bool = False,
            verbose: bool = False, rewrite: str = "auto", **torch_compile_kwargs):
    """torch.compile(model, ...) with commfuse's fusion pass on every graph dynamo captures.

    comm: the model's Communicator (see `backend`). backend: the inner backend compiling the rewritten
    graph ("inductor", "aot_eager", ... or a callable; default: inductor on CUDA, aot_eager without).
    mode ("reduce-overhead", "max-autotune", ...), options, dynamic, fullgraph and any other keyword:
    as torch.compile's. rewrite: "auto" or "all", as for `backend`. Returns the compiled model; its `fusion_reports` attribute is the list of
    FusionReports, one per graph compiled (a recompilation adds one)."""
    reports: List[FusionReport] = []
    fn = globals()["backend"](comm, inner=backend, mode=mode, options=options, dynamic=dynamic, reports=reports,
                              verbose=verbose, rewrite=rewrite)
    compiled = torch.compile(model, backend=fn, dynamic=dynamic, fullgraph=fullgraph, **torch_compile_kwargs)
    try:
        object.__setattr__(compiled, "fusion_reports", reports)
    except (AttributeError, TypeError):
        pass
    return compiled
