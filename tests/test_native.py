"""commfuse.kernels.native on the CPU: csrc/host_launch.cpp compiles against this torch's headers (syntax
only: a CPU-only torch has no CUDA libraries to link) and numbers its pointer sources as launch.py does.
The launches themselves are GPU tests (test_communicator.py, test_launch.py)."""
import glob
import os
import subprocess

import pytest
import torch

import re

from commfuse.kernels import jit, launch, native


def test_pointer_sources_are_numbered_alike():
    """The C++ Launcher indexes the call's tensors by launch.py's source numbers (native.py also refuses
    to load an extension whose numbers differ)."""
    text = (jit.CSRC_DIR / native.SOURCE).read_text()
    enum = dict(re.findall(r"\bk(\w+) = (\d+)", re.search(r"enum Source : int \{([^}]*)\}", text).group(1)))
    names = {"X": "X", "Residual": "RESIDUAL", "Weight": "WEIGHT", "Scale": "SCALE", "Z": "Z", "RowIndex": "ROW_INDEX",
             "Shared": "SHARED", "Out0": "OUT", "Sum": "SUM", "Sources": "SOURCES"}
    assert {names[k]: int(v) for k, v in enum.items()} == {n: getattr(launch, n) for n in names.values()}


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


def test_a_library_cut_short_or_unwritable_is_built_again(tmp_path, monkeypatch):
    """The library is loaded only where its digest file (written after it) agrees: a library cut short would
    end the process when loaded (SIGBUS), not raise. A cache folder that cannot be written builds it in a
    temporary folder, with a warning, rather than turning the hot path off."""
    try:
        native._flags()
    except OSError as e:
        pytest.skip(f"no headers to compile against: {e}")
    monkeypatch.setenv("COMMFUSE_CACHE_DIR", str(tmp_path / "cache"))
    builds = tmp_path / "builds"
    script = tmp_path / "fake-cxx"  # "compiles" by writing a fixed library and counting its runs
    script.write_text(f"#!/bin/sh\nfor a; do case $prev in -o) out=$a;; esac; prev=$a; done\n"
                      f"printf 'a whole library' > \"$out\"; echo x >> {builds}\n")
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    target = native._build()
    assert target.read_bytes() == b"a whole library" and builds.read_text().count("x") == 1
    assert native._build() == target and builds.read_text().count("x") == 1  # intact: not built again
    target.write_bytes(b"a whole")  # cut short
    assert native._build() == target and target.read_bytes() == b"a whole library"
    assert builds.read_text().count("x") == 2
    blocked = tmp_path / "a-file"  # a cache folder under a file cannot be made, by root neither
    blocked.write_text("")
    monkeypatch.setenv("COMMFUSE_CACHE_DIR", str(blocked / "cache"))
    with pytest.warns(UserWarning, match="cannot write the native hot path"):
        other = native._build()
    assert other.parent != target.parent and other.read_bytes() == b"a whole library"
