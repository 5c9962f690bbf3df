"""Run-time compilation of commfuse's CUDA sources (csrc/) with NVRTC, an on-disk cubin cache,
and kernel launches on torch's current stream.

Kernels are C++ templates; a launcher names the instantiation it needs with a name expression
such as ``"commfuse::fused_tail<__nv_bfloat16, 2, 4>"``. Each is compiled for the device's own
architecture: ``sm_80``/``sm_89``/``sm_90`` as is, and ``sm_100a``/``sm_120a`` style (arch-
specific) from SM 10.0 on, so instructions such as the hardware e2m1 conversion are allowed.

Convention: every commfuse kernel takes exactly one by-value parameter, a struct, which the
launcher packs into bytes (``struct.Struct``) and hands to :meth:`Kernel.launch`.

Environment:

``COMMFUSE_CACHE_DIR``
    Where compiled cubins are kept (default ``~/.cache/commfuse``). The key is a hash of every
    csrc source, the CUDA headers kernels include, the NVRTC options, the name expressions, the
    NVRTC version and the arch, so a stale cubin is never loaded. Entries are written to a
    temporary file and renamed, so ranks compiling the same kernel at once do not collide.
``COMMFUSE_JIT_DEBUG=1``
    Compile with ``-lineinfo`` (source lines in compute-sanitizer and Nsight reports).
``COMMFUSE_PDL=0``
    Launch without programmatic dependent launch (csrc/pdl.cuh), which is on by default on SM 9.0+
    for kernels loaded with ``pdl=True``.

CUDA graphs: compiling and loading a kernel cannot happen while a stream is capturing (loading a
module is not a capturable operation), so the first call of each variant must happen eagerly,
or through a warm-up helper (e.g. :func:`commfuse.kernels.fused_tail.warmup`), before capture.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from . import params
from .. import env

__all__ = [
    "JitError",
    "Kernel",
    "kernel",
    "Build",
    "build",
    "compile_cubin",
    "cache_path",
    "compile_options",
    "device_arch",
    "arch_for_capability",
    "nvrtc_version",
    "supported_archs",
    "cannot_target",
    "CSRC_DIR",
    "disable_pdl",
    "pdl_off",
    "on_pdl_off",
    "device_index",
    "cache_dir",
    "write_atomic",
]


class JitError(RuntimeError):
    """Compiling, loading or launching a commfuse kernel failed; the message says which and why."""


def _find_csrc() -> Path:
    here = Path(__file__).resolve().parent.parent  # the commfuse package
    # Installed wheel: the package data lives in commfuse/csrc; source checkout: ../csrc.
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / "epilogue.cuh").is_file():
            return candidate
    return here.parent / "csrc"


CSRC_DIR = _find_csrc()

# Headers whose content the cubins depend on besides csrc/ (the key hashes them: a new
# nvidia-cuda-runtime wheel with the same NVRTC must not reuse old cubins).
_CUDA_HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp", "cuda_fp8.h", "cuda_fp8.hpp")
# An entry: this line, a JSON header ({"lowered": name expression -> lowered name, "sha256": _digest's}), a
# newline, the cubin. The digest covers the entry's name (its key: sources, names, arch, options), the names
# and the cubin: it catches a body cut short or damaged on disk, a header altered, an entry copied to
# another key's name.
_CACHE_MAGIC = b"commfuse-cubin-3\n"


# --------------------------------------------------------------------------- NVRTC


@functools.cache
def _nvrtc_library():
    """cuda.bindings.nvrtc with libnvrtc loaded (from the nvidia-cuda-nvrtc wheel or the toolkit), and the
    loaded library's path."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        path = load_nvidia_dynamic_lib("nvrtc").abs_path
        from cuda.bindings import nvrtc
    except Exception as exc:  # ImportError, or pathfinder's DynamicLibNotFoundError
        raise JitError(
            f"NVRTC is not available ({type(exc).__name__}: {exc}); install commfuse[jit] "
            "(nvidia-cuda-nvrtc) or a CUDA toolkit"
        ) from exc
    return nvrtc, path


def _nvrtc():
    return _nvrtc_library()[0]


def nvrtc_identity() -> str:
    """The loaded NVRTC's version and which build of it: nvrtcVersion gives (major, minor) only, and a patch
    release changes the code it generates. The library's resolved path (a toolkit's names the patch level) and
    size (a wheel's does not) stand for the build."""
    path = _nvrtc_library()[1]
    try:
        real = os.path.realpath(path)
        build = f"{real}:{os.stat(real).st_size}"
    except (OSError, TypeError):  # pathfinder found it by the loader's search: no path to read
        build = str(path)
    return f"{nvrtc_version()} {build}"


def _nvrtc_check(result, what: str):
    err = result[0]
    nvrtc = _nvrtc()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise JitError(f"{what}: {msg.decode(errors='replace')}")
    return result[1] if len(result) == 2 else result[1:]


@functools.cache
def nvrtc_version() -> Tuple[int, int]:
    """(major, minor) of the loaded NVRTC; raises JitError when NVRTC is missing."""
    return tuple(_nvrtc_check(_nvrtc().nvrtcVersion(), "nvrtcVersion"))


@functools.cache
def supported_archs() -> Tuple[int, ...]:
    """Compute capabilities (80, 90, 100, ...) the loaded NVRTC can target."""
    return tuple(_nvrtc_check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


@functools.lru_cache(maxsize=None)
def cannot_target(capability: Tuple[int, int]) -> Optional[str]:
    """Why the loaded NVRTC cannot compile the kernels for a GPU of this compute capability (one newer than it
    knows), or None; None too where NVRTC does not load, which building the kernels then reports."""
    try:
        archs = supported_archs()
        version = nvrtc_version()
    except JitError:
        return None
    cc = 10 * capability[0] + capability[1]
    if cc in archs:
        return None
    return (f"NVRTC {version[0]}.{version[1]} cannot compile for sm_{cc} (it targets sm_{min(archs)} to "
            f"sm_{max(archs)}): no fused kernels")


@functools.cache
def cuda_include_dirs() -> Tuple[str, ...]:
    """Directories holding cuda_fp16.h & co: the NVIDIA runtime wheel, else CUDA_HOME, else /usr/local/cuda."""
    dirs = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            dirs.append(found)
    except Exception:  # an old cuda-pathfinder without the function, or nothing found
        pass
    # NVIDIA wheels without pathfinder's help: nvidia/cu13/include, nvidia/cuda_runtime/include.
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        dirs += sorted(str(p.parent) for p in Path(base).glob("*/include/cuda_fp16.h"))
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "include", "cuda_fp16.h").is_file():
            dirs.append(str(Path(root, "include")))
    dirs = [d for d in dict.fromkeys(dirs) if Path(d, "cuda_fp16.h").is_file()]
    if not dirs:
        raise JitError("CUDA headers (cuda_fp16.h) not found: install nvidia-cuda-runtime or set CUDA_HOME")
    return tuple(dirs[:1])


def arch_for_capability(capability: Tuple[int, int]) -> str:
    """NVRTC arch for a compute capability: sm_80/sm_89/sm_90 plain, sm_100a/sm_120a from 10.0 on."""
    major, minor = capability
    return f"sm_{major}{minor}" + ("a" if major >= 10 else "")


def device_arch(device=None) -> str:
    """The arch the kernels are built for on `device` (default: the current CUDA device)."""
    return arch_for_capability(torch.cuda.get_device_capability(device))


def compile_options(arch: str, source_dir: Optional[Path] = None) -> Tuple[str, ...]:
    """NVRTC options for `arch`. `source_dir`: extra include dir (the compiled file's own)."""
    includes = [str(CSRC_DIR)]
    if source_dir is not None and Path(source_dir) != CSRC_DIR:
        includes.append(str(source_dir))
    includes += cuda_include_dirs()
    opts = ["-std=c++17", f"--gpu-architecture={arch}", "-default-device"]
    opts += [f"-I{d}" for d in includes]
    if env.flag("COMMFUSE_JIT_DEBUG", False):
        opts.append("-lineinfo")
    return tuple(opts)


# --------------------------------------------------------------------------- disk cache


def cache_dir() -> Path:
    """COMMFUSE_CACHE_DIR, else ~/.cache/commfuse: where cubins, the native extension and the calibration go
    (without a home directory, one in the temporary folder per user: a cache is never a reason to fail)."""
    given = os.environ.get("COMMFUSE_CACHE_DIR")
    if given:
        return Path(given)
    try:
        if os.environ.get("HOME") != "":  # set but empty is no home (Path.home() would give "" or "/")
            return Path.home() / ".cache" / "commfuse"
    except RuntimeError:  # no HOME and no passwd entry (a container's arbitrary uid)
        pass
    return Path(tempfile.gettempdir()) / f"commfuse-cache-{os.getuid()}"


def _source_path(source_file: str) -> Path:
    path = CSRC_DIR / source_file  # an absolute source_file replaces CSRC_DIR
    if not path.is_file():
        raise JitError(f"CUDA source {source_file!r} not found (looked at {path})")
    return path


def _hasher():
    """(sha256 object, add(tag, bytes)): each part framed by its tag and length."""
    h = hashlib.sha256()

    def add(tag: str, data: bytes) -> None:
        h.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    return h, add


def _add_build_inputs(add, extra: Sequence[Path] = ()) -> None:
    """What every kernel build reads: csrc's sources and headers (and `extra` sources), the CUDA headers,
    the generated parameter header, the NVRTC version and build."""
    sources = sorted(p for p in CSRC_DIR.iterdir() if p.suffix in (".cu", ".cuh"))
    for p in sources + list(extra):
        add(f"src:{p.name}", p.read_bytes())
    for d in sorted({p.parent for p in extra} - {CSRC_DIR}):  # a source of its own folder includes its headers
        for p in sorted(q for q in d.iterdir() if q.suffix in (".cuh", ".h")):
            add(f"own:{p.name}", p.read_bytes())
    for d in cuda_include_dirs():
        for name in _CUDA_HEADERS:
            header = Path(d, name)
            if header.is_file():
                add(f"hdr:{name}", header.read_bytes())
    add(f"gen:{params.HEADER_NAME}", params.header().encode())
    add("nvrtc", nvrtc_identity().encode())


def sources_digest() -> str:
    """A digest of what every kernel build reads (the P2P calibration keys its timings by it)."""
    h, add = _hasher()
    _add_build_inputs(add)
    return h.hexdigest()[:16]


def _key(path: Path, names: Tuple[str, ...], arch: str, options: Tuple[str, ...]) -> str:
    h, add = _hasher()
    _add_build_inputs(add, [path])
    add("file", str(path.name).encode())
    add("names", "\n".join(names).encode())
    add("arch", arch.encode())
    add("options", "\n".join(options).encode())
    return h.hexdigest()[:40]


def cache_path(source_file: str, name_expressions: Sequence[str], arch: str) -> Path:
    """Where the cubin of these name expressions of `source_file` for `arch` is (or would be) cached."""
    path = _source_path(source_file)
    return _entry(path, tuple(name_expressions), arch, compile_options(arch, path.parent))


def _entry(path: Path, names: Tuple[str, ...], arch: str, options: Tuple[str, ...]) -> Path:
    return cache_dir() / f"{path.stem}-{arch}-{_key(path, names, arch, options)}.cubin"


def _digest(path: Path, lowered: dict, cubin: bytes) -> str:
    names = json.dumps(lowered, sort_keys=True).encode()
    return hashlib.sha256(path.name.encode() + b"\0" + len(names).to_bytes(8, "little") + names + cubin).hexdigest()


def _read_cache(path: Path, names: Tuple[str, ...]):
    """(cubin, lowered names) of the entry at path, or None where it is absent or is not one written for this
    path (then it is rebuilt and rewritten)."""
    try:
        if not path.is_file():  # a directory or a FIFO in its place too (reading a FIFO waits for good)
            return None
        blob = path.read_bytes()
        if not blob.startswith(_CACHE_MAGIC):
            return None
        header, sep, cubin = blob[len(_CACHE_MAGIC):].partition(b"\n")
        meta = json.loads(header)
        lowered = meta.get("lowered") if isinstance(meta, dict) else None
        if not sep or not isinstance(lowered, dict) or not all(isinstance(lowered.get(n), str) for n in names):
            return None
        if meta.get("sha256") != _digest(path, lowered, cubin):
            return None
    except (OSError, ValueError, RecursionError):  # unreadable, or a header no JSON parser takes
        return None
    return cubin, lowered


def _write_cache(path: Path, cubin: bytes, lowered: dict) -> None:
    header = json.dumps({"lowered": lowered, "sha256": _digest(path, lowered, cubin)})
    write_atomic(path, _CACHE_MAGIC + header.encode() + b"\n" + cubin, "the kernel cache")


def write_atomic(path: Path, data: bytes, what: str) -> None:
    """Write a cache entry (the cubin cache, the P2P calibration cache) through a temporary file
    and a rename, so ranks writing at once never leave a torn file: a reader sees the old entry or
    the whole new one. A failure only warns: the entry is recomputed next time."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the entry from others sharing the dir
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        warnings.warn(f"commfuse: could not write {what} {path}: {exc}", RuntimeWarning, stacklevel=4)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


# --------------------------------------------------------------------------- compile


def _nvrtc_compile(path: Path, names: Tuple[str, ...], options: Tuple[str, ...]):
    """Compile `path` with NVRTC: (cubin bytes, {name expression: lowered name}, the compile log)."""
    nvrtc = _nvrtc()
    what = f"NVRTC compile of {path.name} [{', '.join(names)}]"
    # The parameter structs' header is generated (commfuse/kernels/params.py), handed to NVRTC from memory. The
    # program is named by its absolute path: NVRTC looks for a quoted include in the program's folder first, which
    # for a bare file name is the working directory, whose headers the cache key does not hold.
    prog = _nvrtc_check(nvrtc.nvrtcCreateProgram(path.read_bytes(), str(path.resolve()).encode(), 1,
                                                 [params.header().encode()], [params.HEADER_NAME.encode()]), what)
    try:
        for name in names:
            _nvrtc_check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), f"{what}: adding {name}")
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _nvrtc_check(nvrtc.nvrtcGetProgramLogSize(prog), what)
        log = b" " * size
        _nvrtc_check(nvrtc.nvrtcGetProgramLog(prog, log), what)
        log = log.rstrip(b"\0 ").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, msg = nvrtc.nvrtcGetErrorString(err)
            raise JitError(f"{what} for {_arch_of(options)} failed ({msg.decode(errors='replace')}):\n" + log)
        size = _nvrtc_check(nvrtc.nvrtcGetCUBINSize(prog), what)
        cubin = b" " * size
        _nvrtc_check(nvrtc.nvrtcGetCUBIN(prog, cubin), what)
        lowered = {}
        for name in names:
            low = _nvrtc_check(nvrtc.nvrtcGetLoweredName(prog, name.encode()), f"{what}: lowered name of {name}")
            lowered[name] = low.decode() if isinstance(low, bytes) else str(low)
        return cubin, lowered, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _arch_of(options: Tuple[str, ...]) -> str:
    return next((o.split("=", 1)[1] for o in options if o.startswith("--gpu-architecture=")), "?")


class Build(NamedTuple):
    cubin: bytes
    lowered: Dict[str, str]  # name expression -> mangled symbol in the cubin


def build(source_file: str, name_expressions: Sequence[str], arch: str) -> Build:
    """One cubin holding every name expression of `source_file` for `arch`, from the disk cache,
    else compiled by NVRTC (and cached). source_file: a file name in csrc/ (or an absolute
    path). Needs NVRTC, not a GPU."""
    names = tuple(name_expressions)
    if not names:
        raise ValueError("build needs at least one name expression")
    path = _source_path(source_file)
    options = compile_options(arch, path.parent)
    entry = _entry(path, names, arch, options)
    hit = _read_cache(entry, names)
    if hit is not None:
        return Build(*hit)
    cubin, lowered, _ = _nvrtc_compile(path, names, options)
    _write_cache(entry, cubin, lowered)
    return Build(cubin, lowered)


def compile_cubin(source_file: str, name_expressions: Sequence[str], arch: str) -> bytes:
    """The cubin of :func:`build`."""
    return build(source_file, name_expressions, arch).cubin


# --------------------------------------------------------------------------- load and launch


def _driver():
    from ..ipc import driver

    return driver


def _cu_check(result, what: str):
    """The outputs of a cuda.bindings.driver call's result tuple; JitError saying `what` on failure."""
    err = result[0]
    if err != _driver().CUresult.CUDA_SUCCESS:
        from ..ipc import describe

        code, detail = describe(err)
        raise JitError(f"{what}: {code}: {detail}")
    return result[1] if len(result) == 2 else result[1:]


class _ParamSlot(threading.local):
    """Per-thread launch state: the staging buffer for kernel parameters (cuLaunchKernel copies
    them before it returns, so one buffer per thread serves every launch without allocating), and
    the thread's PDL launch configurations (each launch sets its stream in one: per thread, so
    that threads launching on different streams cannot overwrite each other's)."""

    MAX_BYTES = 4096   # CUDA's classic kernel-parameter limit
    MAX_CONFIGS = 256  # launch shapes kept per thread (the tail's grid follows the token count)

    def __init__(self):
        self.buf = ctypes.create_string_buffer(self.MAX_BYTES)
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.buf))
        self.buf_addr = ctypes.addressof(self.buf)
        self.argv_addr = ctypes.addressof(self.argv)
        self.configs = {}

    def launch_config(self, grid: Tuple[int, int, int], block: Tuple[int, int, int], shared_mem: int, pdl: bool,
                      cluster: int):
        """A CUlaunchConfig of this shape with the programmatic-stream-serialization attribute (pdl) and
        clusters of `cluster` CTAs along x (cluster > 1)."""
        key = (grid, block, shared_mem, pdl, cluster)
        entry = self.configs.get(key)
        if entry is None:
            if len(self.configs) >= self.MAX_CONFIGS:
                self.configs.clear()
            driver = _driver()
            attrs = []
            if pdl:
                attr = driver.CUlaunchAttribute()
                attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attr.value.programmaticStreamSerializationAllowed = 1
                attrs.append(attr)
            if cluster > 1:
                attr = driver.CUlaunchAttribute()
                attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
                attrs.append(attr)
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX, config.blockDimY, config.blockDimZ = block
            config.sharedMemBytes = shared_mem
            config.attrs = attrs
            config.numAttrs = len(attrs)
            entry = self.configs[key] = (config, attrs)  # the attributes live as long as their config
        return entry[0]


_SLOT = _ParamSlot()

# torch's own C entry points for the current device and stream (what its compiled code calls):
# the public torch.cuda.current_stream() builds a Stream object, ~4 us of an eager call's host time.
# A CPU-only torch build has neither, and launches nothing.
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


_PDL_OFF: Optional[str] = None  # why programmatic dependent launch is off in this process, if it is
_PDL_LISTENERS: list = []       # other launchers' switches (commfuse.kernels.native's), told when it goes off


def disable_pdl(reason: str) -> None:
    """Launch every kernel of this process without programmatic dependent launch from now on."""
    global _PDL_OFF
    _PDL_OFF = reason
    for listener in _PDL_LISTENERS:
        listener(False)


def pdl_off() -> Optional[str]:
    """Why programmatic dependent launch is off in this whole process (disable_pdl), None where it is not."""
    return _PDL_OFF


def on_pdl_off(listener) -> None:
    """Call listener(False) when disable_pdl runs (and now, if it already has): for launchers outside
    this module."""
    _PDL_LISTENERS.append(listener)
    if _PDL_OFF is not None:
        listener(False)


class Kernel:
    """A compiled kernel loaded into one device's primary context (torch's context)."""

    __slots__ = ("name", "lowered_name", "arch", "device_index", "pdl", "_module", "_function", "_ok", "_launch",
                 "_launch_ex")

    def __init__(self, name: str, lowered_name: str, arch: str, cubin: bytes, device_index: int, pdl: bool = False):
        self.name = name
        self.lowered_name = lowered_name
        self.arch = arch
        self.device_index = device_index
        # Programmatic dependent launch needs SM 9.0+ and a kernel that calls pdl_wait() first;
        # COMMFUSE_PDL=0 turns it off (to measure what it gives, or to rule it out).
        self.pdl = (bool(pdl) and env.flag("COMMFUSE_PDL", True)
                    and torch.cuda.get_device_capability(device_index) >= (9, 0))
        driver = _driver()
        where = f"loading {name} ({arch}) on cuda:{device_index}"
        _cu_check(driver.cuInit(0), where)
        dev = _cu_check(driver.cuDeviceGet(device_index), where)
        # torch uses the primary context; retaining it here makes it exist and keeps it alive.
        ctx = _cu_check(driver.cuDevicePrimaryCtxRetain(dev), where)
        _cu_check(driver.cuCtxPushCurrent(ctx), where)
        try:
            image = ctypes.create_string_buffer(cubin, len(cubin))
            self._module = _cu_check(driver.cuModuleLoadData(ctypes.addressof(image)), where)
            self._function = _cu_check(driver.cuModuleGetFunction(self._module, lowered_name.encode()), where)
        finally:
            _cu_check(driver.cuCtxPopCurrent(), where)
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._launch = driver.cuLaunchKernel
        self._launch_ex = driver.cuLaunchKernelEx

    @property
    def function(self) -> int:
        """The CUfunction handle, for launchers outside Python (commfuse.kernels.native)."""
        return int(self._function)

    def launch(self, grid: Tuple[int, int, int], block: Tuple[int, int, int], params: bytes = b"",
               shared_mem: int = 0, stream: Optional[int] = None, cluster: int = 1) -> None:
        """Launch on `stream` (a raw cudaStream_t as int; default: torch's current stream of the
        kernel's device), with the kernel's device made current for the launch if it is not.
        grid, block: tuples of 3 ints. params: the bytes of the kernel's by-value parameter struct.
        With `pdl`, as a programmatic dependent launch (csrc/pdl.cuh says what the kernel must do);
        cluster > 1: in thread-block clusters of that many CTAs along x (SM 9.0+; csrc/cluster.cuh)."""
        if self.device_index != _current_device():
            with torch.cuda.device(self.device_index):
                return self.launch(grid, block, params, shared_mem, stream, cluster)
        if stream is None:
            stream = _current_raw_stream(self.device_index)
        slot = _SLOT
        n = len(params)
        if n > _ParamSlot.MAX_BYTES:
            raise JitError(f"{self.name}: {n} bytes of parameters > {_ParamSlot.MAX_BYTES}")
        ctypes.memmove(slot.buf_addr, params, n)
        pdl = self.pdl and _PDL_OFF is None
        if pdl or cluster > 1:
            config = slot.launch_config(grid, block, shared_mem, pdl, cluster)
            config.hStream = stream
            (err,) = self._launch_ex(config, self._function, slot.argv_addr, 0)
        else:
            (err,) = self._launch(self._function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                  shared_mem, stream, slot.argv_addr, 0)
        if err != self._ok:
            where = f"launch of {self.name} grid={tuple(grid)} block={tuple(block)}"
            _cu_check((err,), where + (f" cluster={cluster}" if cluster > 1 else "") + f" on cuda:{self.device_index}")

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, arch={self.arch!r}, device={self.device_index})"


def device_index(device) -> int:
    """The CUDA device index of `device` (an int, a torch.device or a string; None: the current device)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def kernel(source_file: str, name_expression: str, arch: Optional[str] = None, device=None,
           pdl: bool = False) -> Kernel:
    """The kernel `name_expression` of `source_file`, compiled for `arch` (default: the device's)
    and loaded on `device` (default: the current CUDA device). Cached: compiled once per process
    and arch (and once per machine through the disk cache), loaded once per device.
    pdl: the kernel calls pdl_wait() (csrc/pdl.cuh) before touching memory, so it is launched as a
    programmatic dependent launch where the device has it (SM 9.0+)."""
    index = device_index(device)
    return _kernel(source_file, name_expression, arch or device_arch(index), index, pdl)


@functools.cache
def _kernel(source_file: str, name_expression: str, arch: str, device_index: int, pdl: bool) -> Kernel:
    if torch.cuda.is_current_stream_capturing():
        raise JitError(
            f"{name_expression} is not compiled/loaded yet and the current CUDA stream is capturing a "
            "graph, where loading a module is not allowed: call the op once eagerly (or its warmup "
            "helper, e.g. commfuse.kernels.fused_tail.warmup) before capture"
        )
    cubin, lowered = build(source_file, (name_expression,), arch)
    return Kernel(name_expression, lowered[name_expression], arch, cubin, device_index, pdl)
