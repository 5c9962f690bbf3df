"""The eager hot path in C++ (csrc/host_launch.cpp), built on first use with the host's C++ compiler.

Why: on an H200 host one torch elementwise op costs 6-10 us from Python, and a fused all-reduce
call in Python cost 3-6 times that: making output tensors (2-4 us each), reading pointers and
packing the parameter struct, the driver binding's argument conversion for cuLaunchKernel (~7 us).
The Communicator settles a call signature once (checks, plan, kernel, launch shape, the parameter
bytes but for their pointers) and keeps a `Launcher` for it; a call then costs one C++ call that
allocates the outputs, patches their pointers in, and enqueues ncclAllReduce and/or the kernel on
torch's current stream (capturable in CUDA graphs: nothing synchronizes).

    launcher = native.launcher(kernel, grid, block, blob, patches, specs, True, device_index)
    outputs = launcher(x, residual, weight, scale, out)  # 5 tensors or None

Where the module cannot be built (no CUDA torch, no compiler, CUDA headers missing) or
COMMFUSE_NATIVE=0, `unavailable()` says why and the Communicator launches from Python (the same
kernels and parameter values, epilogue.prepare + jit.Kernel.launch). The build is cached in
COMMFUSE_CACHE_DIR under a hash of the source, torch's and Python's versions and the flags.

Environment (docs/environment.md):
- COMMFUSE_NATIVE: `0` keeps every launch in Python.
- CXX: the C++ compiler (default `c++`).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

from . import epilogue, jit, params

__all__ = ["SOURCE", "unavailable", "module", "launcher", "tail_patches", "set_poison", "X", "RESIDUAL", "WEIGHT",
           "SCALE", "OUT", "SUM", "NcclFailure"]

SOURCE = "host_launch.cpp"
# Pointer sources of a patch (enum Source in host_launch.cpp): the call's arguments, its outputs
# OUT + i (residual, norm, quant, scale_factors, scales; a plain all-reduce's output is OUT), and
# the NCCL route's sum buffer.
X, RESIDUAL, WEIGHT, SCALE, OUT, SUM = 0, 1, 2, 3, 4, 9
# TailParams' pointer fields and where each comes from.
_TAIL_POINTERS = {"residual_in": RESIDUAL, "residual_out": OUT, "weight": WEIGHT, "norm_out": OUT + 1,
                  "quant_out": OUT + 2, "sf_out": OUT + 3, "scale": SCALE, "scales_out": OUT + 4}


class NcclFailure(RuntimeError):
    """ncclAllReduce returned an error inside a launcher (args[0]: the ncclResult_t as text); the
    loaded module's own class replaces this one."""


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
    target = jit._cache_dir() / f"commfuse_host-{h.hexdigest()[:32]}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Ranks building at once each write their own file, then rename: none loads a half-written one.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run([cxx, *compile_flags, str(source), "-o", tmp, *link_flags], capture_output=True,
                              text=True)
        if done.returncode:
            raise OSError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _load():
    """(module, None) or (None, why not)."""
    if os.environ.get("COMMFUSE_NATIVE") == "0":
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
    mod.set_pdl(jit.pdl_off() is None)
    global NcclFailure
    NcclFailure = mod.NcclFailure
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


def set_pdl(on: bool) -> None:
    """Programmatic dependent launch for the native launches (jit.disable_pdl turns it off)."""
    if _load.cache_info().currsize:  # not built yet: _load reads jit's state when it is
        mod = _load()[0]
        if mod is not None:
            mod.set_pdl(on)


def set_poison(byte: Optional[int]) -> None:
    """Fill every output the native launchers allocate with `byte` (the GPU tests' check that a kernel
    writes every element, tests/compare.py); None: plain uninitialised outputs."""
    mod = _load()[0]
    if mod is not None:
        mod.set_poison(-1 if byte is None else int(byte))


def tail_patches(base: int) -> list:
    """(offset, source) of each TailParams pointer, for a TailParams at byte `base` of the struct."""
    return [(base + params.TAIL.offsets[name], source) for name, source in _TAIL_POINTERS.items()]


def spec_of(spec):
    """An epilogue.output_specs entry as the launcher takes it: (sizes, strides or None, storage
    elements, an empty CPU tensor of the dtype), or None where the output is absent."""
    if spec is None:
        return None
    shape, dtype = spec[0], spec[1]
    strides = spec[2] if len(spec) > 2 else None
    return (list(shape), None if strides is None else list(strides), epilogue.storage_numel(shape, strides),
            torch.empty(0, dtype=dtype))


def launcher(kernel: Optional[jit.Kernel], grid: int, block: int, blob: bytes, patches: Sequence,
             specs: Sequence, fused: bool, device_index: int, nccl: Optional[Tuple[int, int, int, int]] = None):
    """A C++ launcher of one planned call: `kernel` (a jit.Kernel, or None for NCCL alone) on a grid of
    `grid` x `block` threads with parameter bytes `blob`, its pointers patched at `patches` ((offset,
    source) pairs); outputs by `specs` (spec_of's, five for a fused call, one otherwise); nccl:
    (ncclAllReduce's address, the communicator handle, the NCCL dtype, the element count) to enqueue
    first, summing x into the residual output. Raises RuntimeError when the native path is off."""
    name = kernel.name if kernel is not None else "ncclAllReduce"
    function = int(kernel._function) if kernel is not None else 0
    pdl = kernel is not None and kernel.pdl
    nccl_fn, comm, dtype, count = nccl if nccl is not None else (0, 0, 0, 0)
    return module().Launcher(name, function, pdl, grid, block, blob, list(patches), list(specs), fused, nccl_fn,
                             comm, dtype, count, device_index)
