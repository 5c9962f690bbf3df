"""The eager hot path in C++ (csrc/host_launch.cpp), built on first use with the host's C++ compiler,
and the one place that picks it or its Python stand-in.

Why: on an H200 host one torch elementwise op costs 6-10 us from Python, and a fused all-reduce
call in Python cost 3-6 times that: making output tensors (2-4 us each), reading pointers and
packing the parameter struct, the driver binding's argument conversion for cuLaunchKernel (~7 us).
A call signature is planned once (checks, route, its LaunchPlan: kernels, launch shapes, parameter
bytes but for their pointers); the extension's `Launcher` then runs a call of it in one C++ call
(outputs, pointers, ncclAllReduce and/or the kernels on torch's current stream: capturable in CUDA
graphs, nothing synchronizes), and its `Table` (commfuse.kernels.table describes the interface) finds
the signature's launcher without Python; the op kernels it registers for CUDA tensors
(commfuse::fused_all_reduce, all_reduce, moe_all_reduce, fused_add_rmsnorm, gated_rmsnorm, quantize)
look the table up too.

    launcher = native.launcher(plan)        # a C++ Launcher, or launch.PyLauncher where unavailable
    table = native.table(name, error_word, FusedResult, Tail, Quantized)   # native.Table, or table.PyTable
    native.direct.fused_add_rmsnorm(x, residual, weight, scale, eps, weight_offset, tail)  # an op kernel, no dispatcher

Where the module cannot be built (no CUDA torch, no compiler, CUDA headers missing) or
COMMFUSE_NATIVE=0, `unavailable()` says why and the stand-ins serve, with the same kernels and
parameter values. The build is cached in COMMFUSE_CACHE_DIR under a hash of the source, torch's and
Python's versions and the flags.

Environment (docs/environment.md):
- COMMFUSE_NATIVE: `0` keeps every launch in Python.
- CXX: the C++ compiler (default `c++`).
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import shutil
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from typing import Optional, Tuple

import torch

from . import jit, launch
from .. import env
from .launch import LaunchPlan, PyLauncher
from .table import PyTable
from ..tail.spec import codes as tail_codes

__all__ = ["SOURCE", "OPS", "unavailable", "module", "launcher", "table", "direct"]

SOURCE = "host_launch.cpp"
# The commfuse ops whose C++ kernels the extension also binds as plain functions (`direct`).
OPS = ("fused_all_reduce", "all_reduce", "fused_add_rmsnorm", "gated_rmsnorm", "quantize", "moe_all_reduce")


def _flags() -> Tuple[list, list]:
    """(compile flags, link flags) for an extension of this torch: its headers and libraries, the CUDA
    toolkit's where torch finds one (CUDA_HOME), and the CUDA headers NVRTC uses (jit.cuda_include_dirs:
    the NVIDIA wheels' or the toolkit's), which hold cuda.h."""
    from torch.utils import cpp_extension

    try:
        includes, libs = cpp_extension.include_paths("cuda"), cpp_extension.library_paths("cuda")
    except OSError:  # no CUDA toolkit: the wheels' headers below serve
        includes, libs = cpp_extension.include_paths("cpu"), cpp_extension.library_paths("cpu")
    includes = includes + list(jit.cuda_include_dirs()) + [sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = ["-O2", "-std=c++20", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    compile_flags += [f"-I{d}" for d in dict.fromkeys(includes)]
    link = [f"-L{d}" for d in libs] + [f"-Wl,-rpath,{d}" for d in libs]
    return compile_flags, link + ["-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch_python", "-ldl"]


def _build() -> Path:
    source = jit.CSRC_DIR / SOURCE
    cxx = os.environ.get("CXX") or "c++"
    compile_flags, link_flags = _flags()
    h = hashlib.sha256()
    for part in (source.read_bytes(), torch.__version__.encode(), sys.version.encode(), cxx.encode(),
                 "\n".join(compile_flags + link_flags).encode()):
        h.update(len(part).to_bytes(8, "little") + part)
    name = f"commfuse_host-{h.hexdigest()[:32]}{sysconfig.get_config_var('EXT_SUFFIX')}"
    target = jit.cache_dir() / name
    if _intact(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Ranks building at once each write their own file, then rename: none loads a half-written one.
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    except OSError as e:  # a cache folder that cannot be written costs the cache, not the hot path
        folder = tempfile.mkdtemp(prefix="commfuse-native-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        warnings.warn(f"commfuse: cannot write the native hot path to {target.parent} ({e}); built in {folder}, "
                      "for this process only", stacklevel=2)
        target = Path(folder) / name
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=name, suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run([cxx, *compile_flags, str(source), "-o", tmp, *link_flags], capture_output=True,
                              text=True)
        if done.returncode:
            raise OSError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        digest = _file_digest(Path(tmp))
        os.replace(tmp, target)
        jit.write_atomic(_digest_path(target), digest.encode(), "the native hot path's digest")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _digest_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(target: Path) -> bool:
    """Whether target is the library a build wrote there, whole: its digest file (written after it) agrees.
    A library cut short would not fail to load but end the process (SIGBUS), so it is rebuilt instead."""
    try:
        return target.is_file() and _digest_path(target).is_file() and \
            _digest_path(target).read_text() == _file_digest(target)
    except OSError:
        return False


@functools.cache
def _load():
    """(module, None) or (None, why not)."""
    if not env.flag("COMMFUSE_NATIVE", True):
        return None, "COMMFUSE_NATIVE=0"
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        path = _build()
        loader = importlib.machinery.ExtensionFileLoader("commfuse_host", str(path))
        spec = importlib.util.spec_from_file_location("commfuse_host", path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 (a probe: whatever stops the build or the import, say it, launch from Python)
        return None, f"{SOURCE} not built: {type(e).__name__}: {e}"
    # The pointer sources are numbered in launch.py; the C++ enum must agree, or no launch is right.
    sources = {name: getattr(launch, name) for name in ("X", "RESIDUAL", "WEIGHT", "SCALE", "Z", "ROW_INDEX",
                                                     "SHARED", "OUT", "SUM")}
    if dict(mod.SOURCES) != sources:
        return None, f"{SOURCE} numbers its pointer sources {dict(mod.SOURCES)}, launch.py {sources}"
    from .. import nccl  # the NCCL watchdog's words, which the launchers write too

    words = {name: getattr(nccl, name) for name in ("DONE", "ISSUED", "ABORTED", "BEGUN", "ENDED", "STAMPS", "RING",
                                                    "TIMED_OUT")}
    if dict(mod.PROGRESS) != words:
        return None, f"{SOURCE} lays out the NCCL watchdog's words as {dict(mod.PROGRESS)}, nccl.py {words}"
    mod.set_tails(tail_codes())  # the op kernels' `tail` codes, decoded as the Python calls spell them
    jit.on_pdl_off(mod.set_pdl)
    launch.on_poison(lambda byte: mod.set_poison(-1 if byte is None else int(byte)))
    mod.set_nccl_error(nccl.native_error)  # a launcher's NCCL failure, raised as NcclComm raises it
    return mod, None


def unavailable() -> Optional[str]:
    """Why the native hot path is off in this process, or None when it is on (builds it on first call)."""
    return _load()[1]


def module():
    """The loaded extension (see unavailable())."""
    mod, why = _load()
    if mod is None:
        raise RuntimeError(f"commfuse's native hot path is off: {why}")
    return mod


def _spec(spec):
    """An OutputSpec as the C++ Launcher takes it: (sizes, strides or None, storage elements, an empty CPU
    tensor of the dtype), or None where the output is absent."""
    if spec is None:
        return None
    return (list(spec.shape), None if spec.strides is None else list(spec.strides), spec.storage_numel,
            torch.empty(0, dtype=spec.dtype))


def launcher(plan: LaunchPlan):
    """The executor of a LaunchPlan: the C++ Launcher, or launch.PyLauncher where the extension is off.
    Both are called as launcher(x, residual, weight, scale, out, z, row_index=None, shared=None)
    (commfuse.kernels.launch)."""
    mod = _load()[0]
    if mod is None:
        return PyLauncher(plan)
    launches = [(l.kernel.function, l.kernel.pdl, l.grid, l.block, l.params, list(l.patches), l.cluster)
                for l in plan.launches]
    nccl = plan.nccl.native_args(plan.outputs[0].dtype, plan.count) if plan.nccl is not None else None
    return mod.Launcher(plan.name, launches, [_spec(s) for s in plan.outputs], plan.fused, nccl, plan.device_index,
                        plan.combine, plan.copy)


def table(name: str, error_word: int, fused_type, tail_type, quantized_type):
    """A plan table (commfuse.kernels.table): native.Table, or table.PyTable where the extension is off.
    name: the ops' name for it (a Communicator's name, or "local"); error_word: the address of a P2P
    workspace's pinned error word (0: none)."""
    mod = _load()[0]
    if mod is None:
        return PyTable(name, error_word, fused_type, tail_type, quantized_type)
    return mod.Table(name, error_word, fused_type, tail_type, quantized_type)


class _Direct:
    """The op kernels of `OPS` as plain functions, each taking its op's arguments (commfuse.ops):
    `direct.fused_add_rmsnorm(x, residual, weight, scale, eps, weight_offset, tail)`. Where the extension
    is on, its bindings of the same C++ kernels torch's dispatcher reaches (without the dispatcher's
    argument parsing and boxing: commfuse.fusion.lowering has Inductor's code call these); elsewhere the
    ops themselves (`torch.ops.commfuse.<op>.default`). Each name is looked up once."""

    def __getattr__(self, name: str):
        if name not in OPS:
            raise AttributeError(f"commfuse.kernels.native.direct has no op {name!r}")
        from .. import ops  # noqa: F401 - defines torch.ops.commfuse

        mod = _load()[0]
        fn = getattr(mod, name) if mod is not None else getattr(torch.ops.commfuse, name).default
        setattr(self, name, fn)
        return fn


direct = _Direct()
