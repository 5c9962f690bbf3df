"""The IPC workspace of one group's P2P all-reduce, and the launches that use it (see the package
docstring for the layout, the protocol and why it is safe).
"""
from __future__ import annotations

import ctypes
import math
import os
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .. import epilogue, ipc, jit, native, params
from ..epilogue import CTYPE
from ..distributed import gather_objects
from ..plan import chunk_rows
from ..reference import Tail
from . import calibration, kernels
from .kernels import (_MISMATCH_CODE, _NO_TAIL, _TIMEOUT_CODE, ALGORITHMS, MAX_BLOCKS, MAX_WORLD,
                      P2PMismatchError, P2PTimeoutError, _ALGO_ID, _tail_rows, describe_signature, launch_config,
                      plain_rows, resident_ctas)

ALIGN = 4096
DEFAULT_BUDGET = 192 << 20        # default max_bytes = DEFAULT_BUDGET / (world + 1)
ONESHOT_BUDGET = 32 << 20         # lamport_bytes = ONESHOT_BUDGET / (2 * world) at most
DEFAULT_TIMEOUT_S = 10.0
_HOST_WORDS = 12                  # the host error word, padding, then two call signatures (4 words each)


def default_max_bytes(world: int) -> int:
    """Default largest message of one P2P launch: DEFAULT_BUDGET / (world + 1), whole MiB (64 MiB for 2
    ranks)."""
    return max(ALIGN, DEFAULT_BUDGET // (world + 1) >> 20 << 20)


class Layout(NamedTuple):
    """Byte sizes and offsets of one rank's buffer (see the module docstring)."""

    slot_bytes: int
    lamport_offset: int
    lamport_bytes: int
    sig_offset: int
    flags_offset: int
    total_bytes: int


def layout(max_bytes: int, world: int, nblocks: int) -> Layout:
    slot = -(-max_bytes // ALIGN) * ALIGN
    lamport = min(slot, max(ALIGN, ONESHOT_BUDGET // (2 * world) // ALIGN * ALIGN))
    lamport_offset = 2 * (world + 1) * slot
    # Signature slots (16 bytes per half, sender and CTA) follow the Lamport halves: both start empty.
    sig_offset = lamport_offset + 2 * world * lamport
    flags_offset = sig_offset + -(-(2 * world * nblocks * 16) // ALIGN) * ALIGN
    flags_bytes = 2 * nblocks * world * 4
    return Layout(slot, lamport_offset, lamport, sig_offset, flags_offset,
                  flags_offset + -(-flags_bytes // ALIGN) * ALIGN)




def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {raw!r}")
    return value




class Workspace:
    """The IPC buffers of one group's P2P all-reduce, and the launches that use them.

    Collective: every rank of `group` (a NCCL group, 2..8 ranks, one node, P2P between every pair)
    constructs it at the same point, with this process's CUDA device `device` current.
    max_bytes: largest message of one launch (default: COMMFUSE_P2P_WORKSPACE_MB, else
    default_max_bytes(world)); larger ones run two-shot in pieces;
    timeout_s: longest wait for a peer (default: COMMFUSE_P2P_TIMEOUT_S, else 10 s); calibrate:
    measure the crossovers (else default_limits; COMMFUSE_P2P_CALIBRATE=0 also turns it off);
    topology: the group's Topology, for the calibration cache key (default: topology.detect(group)).
    Every rank must use the same max_bytes and calibrate setting (checked: all ranks raise).
    Attributes: limits (P2PLimits for plan.py), max_bytes, lamport_bytes (the largest one-shot
    message), nblocks, world, rank, device.
    """

    def __init__(self, group, device, *, max_bytes: Optional[int] = None, timeout_s: Optional[float] = None,
                 calibrate: bool = True, topology=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if not 2 <= self.world <= MAX_WORLD:
            raise ValueError(f"P2P workspace needs 2..{MAX_WORLD} ranks, the group has {self.world}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"P2P workspace needs a CUDA device, got {self.device}")
        self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self._index)
        if max_bytes is None:
            max_bytes = int(_env_number("COMMFUSE_P2P_WORKSPACE_MB", default_max_bytes(self.world) / 2**20) * 2**20)
        if int(max_bytes) <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = -(-int(max_bytes) // ALIGN) * ALIGN
        self.timeout_s = float(timeout_s) if timeout_s is not None else _env_number("COMMFUSE_P2P_TIMEOUT_S",
                                                                                      DEFAULT_TIMEOUT_S)
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        calibrate = bool(calibrate) and os.environ.get("COMMFUSE_P2P_CALIBRATE") != "0"

        self._ptr = self._host_ptr = None
        self._peers: list = [None] * self.world
        self._state = self._fixed_params = None
        self._closed = False
        if topology is None:
            from . import topology as topology_module

            topology = topology_module.detect(group)
        # Every rank lays its buffer out alike and launches the same grid: agree first.
        resident, how = resident_ctas(self._index, topology.gpu_sharers[self.rank])
        gathered = gather_objects(group, ((self.max_bytes, calibrate), resident, how))
        if len({g[0] for g in gathered}) > 1:
            detail = "; ".join(f"rank {i}: max_bytes={g[0][0]}, calibrate={g[0][1]}" for i, g in enumerate(gathered))
            raise ValueError(f"ranks disagree on the P2P workspace ({detail})")
        if min(g[1] for g in gathered) < 1:
            raise RuntimeError("P2P workspace: a rank cannot have one CTA per SM resident next to the ranks "
                               "sharing its GPU (" + "; ".join(f"rank {i}: {g[2]}" for i, g in enumerate(gathered)) + ")")
        self.nblocks = min(MAX_BLOCKS, min(g[1] for g in gathered))
        self.grid_reason = "; ".join(dict.fromkeys(g[2] for g in gathered))
        (self.slot_bytes, self.lamport_offset, self.lamport_bytes, self.sig_offset, self.flags_offset,
         self.total_bytes) = layout(self.max_bytes, self.world, self.nblocks)
        self._create()
        self.limits = (calibration.calibrate(self, topology) if calibrate
                       else calibration.default_limits(self.max_bytes, self.lamport_bytes))

    # ---------------------------------------------------------------- creation and teardown

    def _create(self) -> None:
        driver = ipc.driver
        handle, err = None, None
        try:
            with ipc.device_context(self._index):
                self._ptr = ipc.alloc(self.total_bytes)
                flags_words = (self.total_bytes - self.flags_offset) // 4
                ipc.call(driver.cuMemsetD32, self._ptr + self.flags_offset, 0, flags_words)
                lamport_words = (self.flags_offset - self.lamport_offset) // 4  # the signature slots too
                ipc.call(driver.cuMemsetD32, self._ptr + self.lamport_offset, 0xFFFFFFFF, lamport_words)
                flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
                self._host_ptr = int(ipc.call(driver.cuMemHostAlloc, 4 * _HOST_WORDS, flags))
                ctypes.memset(self._host_ptr, 0, 4 * _HOST_WORDS)
                self._host_dev_ptr = int(ipc.call(driver.cuMemHostGetDevicePointer, self._host_ptr, 0))
                ipc.call(driver.cuCtxSynchronize)  # the memsets are done before any peer can write
                handle = ipc.export_handle(self._ptr)
        except ipc.CudaError as e:
            err = f"workspace of {self.total_bytes} B: {e}"
        handles = gather_objects(self.group, (handle, err))
        self._raise_if_any(handles, lambda h: h[1], "could not create its P2P workspace")

        err, q = None, None
        try:
            with ipc.device_context(self._index):
                for q, (h, _) in enumerate(handles):
                    if q != self.rank:
                        self._peers[q] = ipc.open_handle(h)
        except ipc.CudaError as e:
            err = f"mapping rank {q}'s workspace: {e}" if q is not None else str(e)
        self._raise_if_any(gather_objects(self.group, err), lambda e: e, "could not map a peer's P2P workspace")
        self._peers[self.rank] = self._ptr

        # epochs[nblocks] then the device error word; zeroed like the flags.
        self._state = torch.zeros(self.nblocks + 1, dtype=torch.int32, device=self.device)
        # P2PParams from peers[8] to lamport_bytes: the same for every launch of this workspace.
        state = self._state.data_ptr()
        self._fixed_params = (*[int(p) for p in self._peers], *[0] * (MAX_WORLD - self.world),
                              state, state + 4 * self.nblocks, self._host_dev_ptr,
                              int(self.timeout_s * 1e9), self.slot_bytes, self.flags_offset,
                              self.lamport_offset, self.lamport_bytes, self.sig_offset)
        self._barrier()  # every buffer is initialised and mapped everywhere before any kernel runs

    def _raise_if_any(self, gathered: list, error_of, what: str) -> None:
        """Raise on every rank (after releasing what this rank holds) if any rank reported an error."""
        failed = [(i, error_of(g)) for i, g in enumerate(gathered) if error_of(g)]
        if failed:
            self._teardown()
            raise RuntimeError("; ".join(f"rank {i} {what}: {e}" for i, e in failed))

    def _barrier(self) -> None:
        """Host barrier of the group that also waits for this rank's GPU work."""
        torch.cuda.synchronize(self.device)
        token = torch.zeros(1, device=self.device)
        dist.all_reduce(token, group=self.group)
        torch.cuda.synchronize(self.device)

    def _teardown(self) -> None:
        """Collective: unmap the peers' buffers, then (after a barrier) free this rank's own."""
        errors = []
        self._barrier()  # no kernel on any rank still touches any buffer
        with ipc.device_context(self._index):
            for q, ptr in enumerate(self._peers):
                if ptr is not None and q != self.rank:
                    try:
                        ipc.close_handle(ptr)
                    except ipc.CudaError as e:
                        errors.append(f"unmapping rank {q}'s workspace: {e}")
            self._peers = [None] * self.world
        self._barrier()  # no rank maps this rank's buffer any more
        with ipc.device_context(self._index):
            for free, ptr in ((ipc.free, self._ptr), (lambda p: ipc.call(ipc.driver.cuMemFreeHost, p), self._host_ptr)):
                if ptr is not None:
                    try:
                        free(ptr)
                    except ipc.CudaError as e:
                        errors.append(f"freeing the workspace: {e}")
        self._ptr = self._host_ptr = None
        self._state = self._fixed_params = None
        if errors:
            raise RuntimeError(f"rank {self.rank}: P2P workspace teardown: " + "; ".join(errors))

    def close(self) -> None:
        """Release the workspace (collective: every rank calls it). Later calls raise."""
        if self._closed:
            return
        self._closed = True
        self._teardown()

    # ---------------------------------------------------------------- errors

    def error_word(self) -> int:
        """The address of the pinned host word check_error reads (0 while no error), for readers in C++."""
        return self._host_ptr or 0

    def _error_code(self) -> int:
        return 0 if self._host_ptr is None else ctypes.c_int32.from_address(self._host_ptr).value

    def check_error(self) -> None:
        """Raise P2PTimeoutError if a kernel timed out, P2PMismatchError if a peer's call differed; a
        read of pinned host memory, no synchronisation (an error of a kernel still running shows on a
        later check)."""
        if self._closed:
            raise RuntimeError("this P2P workspace is closed")
        code = self._error_code()
        if code:
            if code >> 16 == _TIMEOUT_CODE >> 16:
                raise P2PTimeoutError(self.rank, code & 0xFF, (code >> 8) & 0xFF, self.timeout_s)
            if code >> 16 == _MISMATCH_CODE >> 16:
                words = (ctypes.c_uint32 * _HOST_WORDS).from_address(self._host_ptr)
                raise P2PMismatchError(self.rank, code & 0xFF, describe_signature(words[8:12]),
                                       describe_signature(words[4:8]))
            raise RuntimeError(f"P2P workspace on rank {self.rank}: unknown error code {code:#x}")

    def check(self) -> None:
        """Wait for this device's work, then raise P2PTimeoutError if any P2P kernel timed out."""
        torch.cuda.synchronize(self.device)
        self.check_error()

    # ---------------------------------------------------------------- launches

    def _check_call(self, x: torch.Tensor, algo: str) -> None:
        self.check_error()
        if algo not in _ALGO_ID:
            raise ValueError(f"algo must be one of {ALGORITHMS}, got {algo!r}")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, the P2P workspace on {self.device}")
        if x.dtype not in CTYPE:
            raise TypeError(f"P2P all-reduce takes float16/bfloat16, got {x.dtype}")
        size = x.numel() * x.element_size()
        if algo == "oneshot" and size > self.lamport_bytes:
            raise ValueError(f"message of {size} B > the one-shot buffers of {self.lamport_bytes} B: use twoshot")

    def _launch(self, kernel: jit.Kernel, threads: int, tail: tuple, x_ptr: int, out_ptr: int, total_vecs: int,
                rows: int, row_vecs: int, row_slots: int) -> None:
        kernel.launch((self.nblocks, 1, 1), (threads, 1, 1),
                      self._pack(tail, x_ptr, out_ptr, total_vecs, rows, row_vecs, row_slots))

    def _pack(self, tail: tuple, x_ptr: int, out_ptr: int, total_vecs: int, rows: int, row_vecs: int,
              row_slots: int) -> bytes:
        """P2PParams of a launch on this workspace (the native launchers patch x_ptr / out_ptr / the tail's
        pointers in per call)."""
        return params.P2P.pack(*tail, x_ptr, out_ptr, *self._fixed_params, total_vecs, rows, row_vecs, row_slots,
                               self.world, self.rank, 0)

    def _launch_plain(self, x_flat: torch.Tensor, out: torch.Tensor, algo: str) -> None:
        """out = the sum of x_flat (contiguous, any shape, numel % 8 == 0; out: contiguous, as many
        elements), in pieces of max_bytes (a multiple of 4 KiB, so
        whole vectors) if larger."""
        kernel = kernels._kernel(x_flat.dtype, "plain", 0, algo, self._index)
        n, elt = x_flat.numel(), x_flat.element_size()
        x_ptr, out_ptr, piece = x_flat.data_ptr(), out.data_ptr(), self.max_bytes // elt
        for begin in range(0, n, piece):
            vecs = min(piece, n - begin) // 8
            row_vecs, rows, threads = plain_rows(vecs, self.nblocks, algo)
            self._launch(kernel, threads, _NO_TAIL, x_ptr + begin * elt, out_ptr + begin * elt, vecs, rows, row_vecs,
                         rows)

    def all_reduce(self, x: torch.Tensor, algo: str, *, out: Optional[torch.Tensor] = None,
                   checked: bool = False) -> torch.Tensor:
        """Sum of x over the group (fp32 in rank order, rounded to T once), in a new tensor of x's
        shape. x: fp16/bf16 on this workspace's device, numel % 8 == 0; messages larger than max_bytes
        run two-shot in pieces of max_bytes (one launch each), one-shot ones take at most lamport_bytes.
        checked: the caller has validated x and algo and called check_error (the Communicator's
        cached plan has): skip those checks on this hot path."""
        n = x.numel()
        if not checked:
            self._check_call(x, algo)
            if n % 8:
                raise ValueError(f"P2P plain all-reduce needs a multiple of 8 elements, got {n}")
            if out is not None:
                epilogue.check_like(out, x)
        if out is None:
            out = epilogue._empty_like(x, memory_format=torch.contiguous_format)
        elif out.data_ptr() % 16:  # checked once per signature, which holds no address
            raise ValueError("out must be 16-byte aligned")
        if n:  # the launch reads pointers and sizes only: no flattened views (each costs microseconds)
            self._launch_plain(epilogue.aligned(x.contiguous()), out, algo)
        return out

    def plain_launcher(self, x: torch.Tensor, algo: str):
        """A native launcher (commfuse.native) of `all_reduce(x, algo)` for checked calls of x's shape
        and dtype, called as launcher(x, None, None, None, out) -> the sum; None where it takes
        pieces (or no launch)."""
        n, elt = x.numel(), x.element_size()
        if not n or n * elt > self.max_bytes:
            return None
        vecs = n // 8
        row_vecs, rows, threads = plain_rows(vecs, self.nblocks, algo)
        blob = self._pack(_NO_TAIL, 0, 0, vecs, rows, row_vecs, rows)
        patches = [(params.P2P.offsets["x"], native.X), (params.P2P.offsets["out"], native.OUT)]
        spec = native.spec_of((tuple(x.shape), x.dtype))
        return native.launcher(kernels._kernel(x.dtype, "plain", 0, algo, self._index), self.nblocks,
                               threads, blob, patches, [spec], False, self._index)

    def launcher(self, dtype: torch.dtype, t: int, h: int, eps: float, quant: Optional[str], return_norm: bool,
                 sf_layout: str, algo: str, weight_offset: float, scale_layout: str, scale_ue8m0: bool):
        """A native launcher of `fused_all_reduce` for checked calls of t rows of h, called as
        launcher(x, residual, weight, scale, out) -> the five outputs; None where it takes pieces."""
        if not t or t * h * dtype.itemsize > self.max_bytes:
            return None
        vpt, threads = launch_config(h, quant)
        slots = epilogue.row_slots(t, quant, sf_layout, scale_layout)
        fields = epilogue.tail_fields(t, h, eps, quant, sf_layout, weight_offset, scale_layout, scale_ue8m0)
        blob = self._pack(fields, 0, 0, t * h // 8, t, h // 8, slots)
        patches = native.tail_patches(params.P2P.offsets["tail"]) + [(params.P2P.offsets["x"], native.X)]
        specs = epilogue.output_specs(t, h, dtype, quant, return_norm, sf_layout, scale_layout, scale_ue8m0)
        return native.launcher(kernels._kernel(dtype, quant, vpt, algo, self._index), self.nblocks, threads,
                               blob, patches, [native.spec_of(s) for s in specs], True, self._index)

    def fused_all_reduce(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         quant: Optional[str], scale: Optional[torch.Tensor], return_norm: bool, sf_layout: str,
                         algo: str, *, out: Optional[Tail] = None, checked: bool = False, weight_offset: float = 0.0,
                         scale_layout: str = "row", scale_ue8m0: bool = False) -> Tail:
        """All-reduce of x with the tail fused (reference.fused_tail's semantics and outputs).

        x, residual: T[..., h] (fp16/bf16), weight T[h], scale: float32 tensor of one element (with
        quant "fp8" / "nvfp4"; None for the computed-scale kinds), all on this workspace's device;
        h % 8 == 0 (16 for nvfp4, 128 for fp8_block), h <= epilogue.MAX_HIDDEN. weight_offset,
        scale_layout, scale_ue8m0: as for reference.fused_tail.
        A message larger than max_bytes runs two-shot in pieces of whole rows (plan.chunk_rows), one
        launch each. Returns a Tail of fresh [t, h] tensors (see fused_tail.run). checked: as for
        `all_reduce`.
        """
        h, elt = x.shape[-1], x.element_size()
        if not checked:
            self._check_call(x, algo)
            epilogue.check(x, residual, weight, quant, scale, sf_layout, scale_layout, scale_ue8m0)
            if out is not None:
                epilogue.check_out(out, x.numel() // h, h, x.dtype, x.device, quant, return_norm, sf_layout,
                                   scale_layout, scale_ue8m0)
            if x.numel() * elt > self.max_bytes and not chunk_rows(h * elt, quant, sf_layout, self.max_bytes):
                raise ValueError(f"the P2P workspace of {self.max_bytes} B holds no piece of this message (a row "
                                 f"of {h} elements, 128 rows for swizzled NVFP4): use NCCL")
        x2, t, out, fields, row_slots = epilogue.prepare(x, residual, weight, eps, quant, scale, return_norm,
                                                         sf_layout, out, None, weight_offset, scale_layout,
                                                         scale_ue8m0)
        if not row_slots:
            return out
        vpt, threads = launch_config(h, quant)
        kernel = kernels._kernel(x.dtype, quant, vpt, algo, self._index)
        if t * h * elt <= self.max_bytes:
            self._launch(kernel, threads, fields, x2.data_ptr(), 0, t * h // 8, t, h // 8, row_slots)
            return out
        piece = chunk_rows(h * elt, quant, sf_layout, self.max_bytes)
        for begin in range(0, t, piece):
            end = min(t, begin + piece)
            slots = end - begin if end < t else row_slots - begin  # the last piece zeroes the padding
            self._launch(kernel, threads, _tail_rows(fields, out, row_slots, begin, end),
                         x2.data_ptr() + begin * h * elt, 0, (end - begin) * h // 8, end - begin, h // 8, slots)
        return out

    # ---------------------------------------------------------------- calibration
