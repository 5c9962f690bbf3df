"""CUDA IPC primitives (cuda.bindings.driver): device buffers that other processes can map.

The recipe every user follows (the topology probe's IPC check, the P2P all-reduce workspace):

    with ipc.device_context(torch.cuda.current_device()):
        ptr = ipc.alloc(nbytes)               # device memory owned by this process
        handle = ipc.export_handle(ptr)       # HANDLE_BYTES bytes: picklable, all-gather it
    ... exchange handles over the group ...
    with ipc.device_context(ordinal):
        peer = ipc.open_handle(peer_handle)   # the peer's buffer, mapped here
        ... read/write through `peer` ...
        ipc.close_handle(peer)
    ... barrier: no peer still maps `ptr` ...
    with ipc.device_context(ordinal):
        ipc.free(ptr)

Device addresses are plain ints, ready to pass to a kernel. Every call needs a current context:
`device_context` makes the device's primary context current, the one torch uses, so buffers
and torch tensors live in one address space. A process cannot open its own handle (CUDA
refuses): it uses its local pointer. Every failure, including a missing driver library, raises
`CudaError` naming the driver call.
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator

from cuda.bindings import driver

HANDLE_BYTES = driver.CU_IPC_HANDLE_SIZE  # 64


class CudaError(RuntimeError):
    """A CUDA driver call failed. `call` is its name, `code` the CUresult name (None if it never ran)."""

    def __init__(self, call: str, code: str | None, detail: str):
        super().__init__(f"{call} failed: {code + ': ' if code else ''}{detail}")
        self.call, self.code = call, code


def call(fn, *args):
    """Run a cuda.bindings.driver function; return its outputs (None, one value, or a tuple).

    Raises CudaError on a non-success CUresult, and on any exception from the binding itself
    (e.g. libcuda not found), so callers catch one type.
    """
    name = getattr(fn, "__name__", str(fn))
    try:
        err, *out = fn(*args)
    except Exception as e:  # the binding raises its own types when the driver cannot be loaded
        raise CudaError(name, None, f"{type(e).__name__}: {e}") from e
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaError(name, *describe(err))
    return None if not out else out[0] if len(out) == 1 else tuple(out)


def describe(err) -> tuple:
    """(name, description) of a failed CUresult, e.g. ("CUDA_ERROR_INVALID_VALUE", "invalid argument")."""
    code = getattr(err, "name", str(err))
    try:
        ok, text = driver.cuGetErrorString(err)
        detail = text.decode() if ok == driver.CUresult.CUDA_SUCCESS and text else "no description"
    except Exception:  # describing the error must not hide it
        detail = "no description"
    return code, detail


def device(ordinal: int):
    """The CUdevice of a CUDA ordinal of this process (initialises the driver)."""
    call(driver.cuInit, 0)
    return call(driver.cuDeviceGet, ordinal)


def device_by_pci_bus_id(pci_bus_id: str):
    """The CUdevice with this PCI bus id, if this process can see it (CUDA_VISIBLE_DEVICES)."""
    call(driver.cuInit, 0)
    return call(driver.cuDeviceGetByPCIBusId, pci_bus_id.encode())


@contextlib.contextmanager
def device_context(ordinal: int) -> Iterator[object]:
    """Make the primary context of CUDA ordinal `ordinal` current on this thread; yields the CUdevice."""
    dev = device(ordinal)
    ctx = call(driver.cuDevicePrimaryCtxRetain, dev)
    try:
        call(driver.cuCtxPushCurrent, ctx)
        try:
            yield dev
        finally:
            call(driver.cuCtxPopCurrent)
    finally:
        call(driver.cuDevicePrimaryCtxRelease, dev)


def alloc(nbytes: int) -> int:
    """Device memory (cuMemAlloc, not cleared) that can be exported; release it with `free`."""
    return int(call(driver.cuMemAlloc, nbytes))


def free(ptr: int) -> None:
    call(driver.cuMemFree, ptr)


def export_handle(ptr: int) -> bytes:
    """The IPC handle of an allocation made by `alloc` (ptr must be its base address)."""
    handle = call(driver.cuIpcGetMemHandle, ptr)
    # The struct's bytes are not exposed as a Python attribute in every cuda-bindings release.
    return ctypes.string_at(handle.getPtr(), HANDLE_BYTES)


def open_handle(handle: bytes) -> int:
    """Map another process's buffer into this one; peer access is enabled on demand. Undo with `close_handle`."""
    if len(handle) != HANDLE_BYTES:
        raise ValueError(f"an IPC handle has {HANDLE_BYTES} bytes, got {len(handle)}")
    h = driver.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), handle, HANDLE_BYTES)
    flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    return int(call(driver.cuIpcOpenMemHandle, h, flags))


def close_handle(ptr: int) -> None:
    call(driver.cuIpcCloseMemHandle, ptr)


def copy_to_device(ptr: int, data: bytes) -> None:
    """Write `data` at `ptr`; complete on return (visible to peers that read after a barrier)."""
    buf = ctypes.create_string_buffer(bytes(data), len(data))
    call(driver.cuMemcpyHtoD, ptr, ctypes.addressof(buf), len(data))
    # From pageable memory the copy may still be in flight when cuMemcpyHtoD returns.
    call(driver.cuCtxSynchronize)


def copy_to_host(ptr: int, nbytes: int) -> bytes:
    """Read `nbytes` at `ptr` (synchronous)."""
    buf = ctypes.create_string_buffer(nbytes)
    call(driver.cuMemcpyDtoH, ctypes.addressof(buf), ptr, nbytes)
    return buf.raw
