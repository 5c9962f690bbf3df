"""commfuse.native on the CPU: the pointer patches cover every pointer of the parameter structs, and
csrc/host_launch.cpp compiles against this torch's headers (syntax only: a CPU-only torch has no
CUDA libraries to link). The launches themselves are GPU tests (test_communicator.py)."""
import glob
import os
import subprocess

import pytest
import torch

from commfuse import jit, native, params


def test_tail_patches_cover_every_pointer_field():
    """A pointer field added to TailParams without a source in native.py would be left 0 by the C++
    launchers: every 'ptr' field has exactly one patch, at its offset."""
    base = params.P2P.offsets["tail"] + 8  # any base: the offsets move with it
    patched = dict(native.tail_patches(base))
    pointers = {base + params.TAIL.offsets[f.name] for f in params.TAIL.fields if f.kind == "ptr"}
    assert set(patched) == pointers
    sources = list(patched.values())
    assert len(set(sources)) == len(sources)
    assert set(sources) <= {native.RESIDUAL, native.WEIGHT, native.SCALE} | {native.OUT + i for i in range(5)}


def test_native_is_off_without_cuda_and_says_why(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the GPU tests use the native path")
    assert native.unavailable() == "no CUDA device"
    with pytest.raises(RuntimeError, match="no CUDA device"):
        native.module()


def test_host_launch_source_compiles(tmp_path):
    """The C++ of the hot path, compiled with the flags native.py builds it with (-fsyntax-only)."""
    cxx = os.environ.get("CXX") or "c++"
    try:
        compile_flags, _ = native._flags()
    except OSError as e:
        pytest.skip(f"no headers to compile against: {e}")
    torch_include = [f[2:] for f in compile_flags if f.startswith("-I") and f.endswith("include")]
    # A CPU-only torch ships c10/cuda's headers without the one its CUDA build generates.
    if not any(os.path.isfile(os.path.join(d, "c10/cuda/impl/cuda_cmake_macros.h")) for d in torch_include):
        stub = tmp_path / "c10/cuda/impl/cuda_cmake_macros.h"
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        compile_flags = compile_flags + [f"-I{tmp_path}"]
    dirs = [f[2:] for f in compile_flags if f.startswith("-I")]
    if not any(os.path.isfile(os.path.join(d, "crt/host_config.h")) for d in dirs):
        # cuda_runtime.h (which c10/cuda includes) needs the toolkit's crt/ headers, which the runtime
        # wheel lacks: a toolkit installed where torch does not look (no CUDA_HOME) serves.
        toolkits = sorted(glob.glob("/usr/local/cuda*/include/crt/host_config.h"))
        if not toolkits:
            pytest.skip("no CUDA toolkit headers (crt/host_config.h) to compile against")
        compile_flags = compile_flags + [f"-I{os.path.dirname(os.path.dirname(toolkits[-1]))}"]
    try:
        done = subprocess.run([cxx, "-fsyntax-only", *[f for f in compile_flags if f != "-shared"],
                               str(jit.CSRC_DIR / native.SOURCE)], capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        pytest.skip(f"no C++ compiler ({cxx})")
    assert done.returncode == 0, done.stderr[-4000:]


def test_a_failed_build_says_why_and_leaves_no_file(tmp_path, monkeypatch):
    """A compiler that fails: _build raises OSError with its output, and neither the library nor a
    half-written temporary stays in the cache (a later process must not load it)."""
    try:
        native._flags()
    except OSError as e:
        pytest.skip(f"no headers to compile against: {e}")
    monkeypatch.setenv("COMMFUSE_CACHE_DIR", str(tmp_path))
    script = tmp_path / "failing-cxx"
    script.write_text("#!/bin/sh\necho 'host_launch.cpp:1: error: this compiler always fails' >&2\nexit 3\n")
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    with pytest.raises(OSError, match=r"failed \(3\): host_launch.cpp:1: error: this compiler always fails"):
        native._build()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("commfuse_host")]
