"""The IPC workspace of one group's P2P all-reduce, and the launches that use it (see the package
docstring for the layout, the protocol and why it is safe).
"""
from __future__ import annotations

import ctypes
import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .. import env, ipc
from ..distributed import gather_objects, rank_label
from ..kernels import native, params
from ..kernels.p2p_allreduce import (MAX_BLOCKS, MAX_WORLD, P2P_ALLREDUCE, P2PMismatchError, P2PTimeoutError,
                                     describe_signature, resident_ctas)
from . import calibration

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
    flags_bytes = 2 * nblocks * world * 8  # 64-bit flags (p2p_allreduce.cu's barrier)
    return Layout(slot, lamport_offset, lamport, sig_offset, flags_offset,
                  flags_offset + -(-flags_bytes // ALIGN) * ALIGN)




class Workspace:
    """The IPC buffers of one group's P2P all-reduce, and the launches that use them.

    Collective: every rank of `group` (a NCCL group, 2..8 ranks, one node, P2P between every pair)
    constructs it at the same point, with this process's CUDA device `device` current.
    max_bytes: largest message of one launch (default: COMMFUSE_P2P_WORKSPACE_MB, else
    default_max_bytes(world)); larger ones run two-shot in pieces;
    timeout_s: longest wait for a peer (default: COMMFUSE_P2P_TIMEOUT_S, else 10 s); calibrate:
    measure the crossovers (else default_limits; COMMFUSE_P2P_CALIBRATE=0 also turns it off);
    topology: the group's Topology, for the calibration cache key (default: topology.detect(group));
    nccl: the NCCL route's NcclComm, which calibration times as the route runs it (None: the route's
    torch.distributed all_reduce of a copy).
    Every rank must use the same max_bytes and calibrate setting (checked: all ranks raise).
    Attributes: limits (P2PLimits, which commfuse.routes reads), max_bytes, lamport_bytes (the largest one-shot
    message), nblocks, world, rank, device.
    """

    def __init__(self, group, device, *, max_bytes: Optional[int] = None, timeout_s: Optional[float] = None,
                 calibrate: bool = True, topology=None, nccl=None):
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
        # A rank whose own settings are wrong raises after the ranks' agreement below, in which it takes part:
        # raising here would leave its peers waiting there for the group's timeout.
        error = None
        try:
            self.max_bytes, self.timeout_s = self._sizes(max_bytes, timeout_s)
        except Exception as e:  # noqa: BLE001 - raised after the agreement, as it was
            error, self.max_bytes, self.timeout_s = e, 0, DEFAULT_TIMEOUT_S
        calibrate = bool(calibrate) and env.flag("COMMFUSE_P2P_CALIBRATE", True)

        self._ptr = self._host_ptr = None
        self._peers: list = [None] * self.world
        self._state = self._fixed_params = None
        self._closed = False
        if topology is None:
            from .. import topology as topology_module

            topology = topology_module.detect(group)
        # Every rank lays its buffer out alike and launches the same grid: agree first.
        resident, how = resident_ctas(self._index, topology.gpu_sharers[self.rank])
        why = None if error is None else f"{type(error).__name__}: {error}"
        gathered = gather_objects(group, ((self.max_bytes, calibrate), resident, how, why))
        if error is not None:
            raise error
        failed = [f"{rank_label(group, i)}: {g[3]}" for i, g in enumerate(gathered) if g[3] is not None]
        if failed:
            raise ValueError(f"a rank could not make the P2P workspace ({'; '.join(failed)})")
        if len({g[0] for g in gathered}) > 1:
            detail = "; ".join(f"{rank_label(group, i)}: max_bytes={g[0][0]}, calibrate={g[0][1]}"
                               for i, g in enumerate(gathered))
            raise ValueError(f"ranks disagree on the P2P workspace ({detail})")
        if min(g[1] for g in gathered) < 1:
            raise RuntimeError("P2P workspace: a rank cannot have one CTA per SM resident next to the ranks "
                               "sharing its GPU (" + "; ".join(f"{rank_label(group, i)}: {g[2]}"
                                                              for i, g in enumerate(gathered)) + ")")
        self.nblocks = min(MAX_BLOCKS, min(g[1] for g in gathered))
        self.grid_reason = "; ".join(dict.fromkeys(g[2] for g in gathered))
        (self.slot_bytes, self.lamport_offset, self.lamport_bytes, self.sig_offset, self.flags_offset,
         self.total_bytes) = layout(self.max_bytes, self.world, self.nblocks)
        self._create()
        try:
            self.limits = (calibration.calibrate(self, topology, nccl) if calibrate
                           else calibration.default_limits(self.max_bytes, self.lamport_bytes))
        except calibration.CalibrationError:
            self._teardown()  # every rank raised it at the same point: the teardown's barriers pair
            raise

    def _sizes(self, max_bytes, timeout_s) -> tuple:
        """(max_bytes rounded up to ALIGN, timeout_s), the arguments or their environment defaults, checked."""
        if max_bytes is None:
            # At most 1 TiB: beyond any GPU's memory, and 1e308 MiB would overflow the rounding to bytes.
            max_bytes = math.ceil(env.number("COMMFUSE_P2P_WORKSPACE_MB", default_max_bytes(self.world) / 2**20,
                                             maximum=2**20) * 2**20)
        if int(max_bytes) <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        timeout = float(timeout_s) if timeout_s is not None else env.seconds("COMMFUSE_P2P_TIMEOUT_S", DEFAULT_TIMEOUT_S)
        if not (math.isfinite(timeout) and 0 < timeout <= env.MAX_SECONDS):
            raise ValueError(f"timeout_s must be a number > 0 and at most {env.MAX_SECONDS:g} s, got {timeout_s!r}")
        return -(-int(max_bytes) // ALIGN) * ALIGN, timeout

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

        # epochs[nblocks] (64-bit) then the device error word; zeroed like the flags.
        self._state = torch.zeros(2 * self.nblocks + 1, dtype=torch.int32, device=self.device)
        # P2PParams from peers[8] to lamport_bytes: the same for every launch of this workspace.
        state = self._state.data_ptr()
        self._fixed_params = (*[int(p) for p in self._peers], *[0] * (MAX_WORLD - self.world),
                              state, state + 8 * self.nblocks, self._host_dev_ptr,
                              int(self.timeout_s * 1e9), self.slot_bytes, self.flags_offset,
                              self.lamport_offset, self.lamport_bytes, self.sig_offset)
        self._barrier()  # every buffer is initialised and mapped everywhere before any kernel runs

    def _raise_if_any(self, gathered: list, error_of, what: str) -> None:
        """Raise on every rank (after releasing what this rank holds) if any rank reported an error."""
        failed = [(rank_label(self.group, i), error_of(g)) for i, g in enumerate(gathered) if error_of(g)]
        if failed:
            self._teardown()
            raise RuntimeError("; ".join(f"{label} {what}: {e}" for label, e in failed))

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

    def error_code(self) -> int:
        """The error word (0 while no kernel failed), a plain read of pinned host memory."""
        return 0 if self._host_ptr is None else ctypes.c_int32.from_address(self._host_ptr).value

    def check_error(self) -> None:
        """Raise P2PTimeoutError if a kernel timed out, P2PMismatchError if a peer's call differed; a
        read of pinned host memory, no synchronisation (an error of a kernel still running shows on a
        later check)."""
        if self._closed:
            raise RuntimeError("this P2P workspace is closed")
        code = self.error_code()
        if code:
            if code >> 16 == params.TIMEOUT_CODE >> 16:
                raise P2PTimeoutError(self.rank, code & 0xFF, (code >> 8) & 0xFF, self.timeout_s, self.group)
            if code >> 16 == params.MISMATCH_CODE >> 16:
                words = (ctypes.c_uint32 * _HOST_WORDS).from_address(self._host_ptr)
                raise P2PMismatchError(self.rank, code & 0xFF, describe_signature(words[8:12]),
                                       describe_signature(words[4:8]), self.group)
            raise RuntimeError(f"P2P workspace on {rank_label(self.group, self.rank)}: unknown error code {code:#x}")

    def check(self) -> None:
        """Wait for this device's work, then raise P2PTimeoutError if any P2P kernel timed out."""
        torch.cuda.synchronize(self.device)
        self.check_error()

    # ---------------------------------------------------------------- launches

    @property
    def device_index(self) -> int:
        return self._index

    def params(self, tail: tuple, total_vecs: int, rows: int, row_vecs: int, row_slots: int,
               combine: tuple = (0,) * len(params.MOE_COMBINE.fields)) -> bytes:
        """P2PParams of a launch on this workspace, x and out 0 (the launchers patch them, and the tail's
        pointers, per call): what commfuse.kernels.p2p_allreduce's LaunchPlans hold. combine: the MoE
        variants' MoeCombineParams fields (pointers 0, patched per call too)."""
        return params.P2P.pack(*tail, 0, 0, *self._fixed_params, total_vecs, rows, row_vecs, row_slots,
                               self.world, self.rank, 0, *combine)

    def plain_launcher(self, shape: tuple, dtype: torch.dtype, algo: str):
        """A launcher of the plain sum of tensors of `shape` and `dtype` (numel % 8 == 0) with `algo`:
        launcher(x, out=None) -> the sum (commfuse.kernels.launch)."""
        return native.launcher(P2P_ALLREDUCE.plan_plain(self, dtype, tuple(shape), algo))

    # ---------------------------------------------------------------- calibration
