"""A direct binding of NCCL's all-reduce, for the Communicator's NCCL route.

Why: on an H200 an eager `torch.distributed.all_reduce` (plus the clone that makes it out of place)
costs 60-100 us of host time, against about 8 us for a torch elementwise op; a decode step of small
all-reduces is then bound by the host. `ncclAllReduce` itself is out of place and takes a few
microseconds to enqueue, so `NcclComm.all_reduce` calls it through ctypes with everything but the
pointers, the count and the stream fixed when the communicator is made.

    comm = NcclComm(group, torch.device("cuda", torch.cuda.current_device()))  # collective
    comm.all_reduce(send, recv)  # recv = sum of every rank's send, on torch's current stream
    comm.close()

A watchdog bounds the wait for a peer that skipped a call or died (NCCL itself waits forever): each
eager all-reduce is stamped with the time its enqueue begins (the enqueue itself may wait for a peer) and
followed on the stream by a write of its sequence number into host-mapped pinned memory
(cuStreamWriteValue64); an all-reduce captured into a CUDA graph,
whose replays repeat what was captured, is put between two one-thread kernels instead
(commfuse.kernels.nccl_mark) that count the replayed all-reduces in device memory and publish the count
before (BEGUN) and after (ENDED) each one. A thread of the communicator's aborts it (ncclCommAbort, which
ends NCCL's kernels) when the oldest unfinished eager all-reduce has waited COMMFUSE_NCCL_TIMEOUT_S seconds
since its enqueue, or a replayed one as long since the thread saw it begin, and every later call (and
check()) raises NcclTimeoutError. It flags the communicator aborted first, so that the launchers call NCCL
no more, and aborts ABORT_GRACE_S later: a launcher that read the flag just before it was set is inside
ncclAllReduce by then, where the abort ends it, not about to enter it on a freed communicator, unless its
thread stalled longer than that between the two (the window is narrowed, not closed: closing it would take
NCCL's non-blocking communicators). A CUDA graph that captured the aborted communicator's all-reduces must
not be replayed again.

The library is the NCCL that torch already uses (no new dependency: ctypes only), found in this
order: the file COMMFUSE_NCCL_LIBRARY names (then nothing else is tried); cuda.pathfinder's
`load_nvidia_dynamic_lib("nccl")` (a copy the process has loaded already, else the nvidia-nccl
wheel, else the system's); the NVIDIA wheels' and torch's lib folders; `libnccl.so.2` on the
loader's path. Where none loads, `available()` says why and `NcclComm` raises NcclUnavailable (a
RuntimeError) listing what was tried; callers then keep torch.distributed.

Environment (docs/environment.md):
- COMMFUSE_NCCL_LIBRARY: the path of the NCCL library to load instead of searching.
- COMMFUSE_NCCL: `0` makes the Communicator keep torch.distributed for its NCCL route even where
  this module is available (read by the Communicator, not here).
- COMMFUSE_NCCL_TIMEOUT_S: the watchdog's bound, seconds from an all-reduce's enqueue, or from its start in
  a replay (default 10; 0: no watchdog); the communicator's initialisation gets at least 60 s (init_agreed). Read
  when a communicator is made.
- COMMFUSE_NCCL_WATCH_REPLAYS: `0` captures all-reduces without the marks (their replays unwatched, and
  without the marks' two one-thread kernels, ~1.5 us of GPU time each). Read when a communicator is made.

Facts of NCCL's C API used here (nccl.h): every function returns ncclResult_t (0 = ncclSuccess);
ncclUniqueId is a struct of 128 bytes passed by value to ncclCommInitRank; ncclComm_t and
cudaStream_t are pointers; the data types are ncclFloat16 = 6, ncclFloat32 = 7, ncclBfloat16 = 9 and
the reduction ncclSum = 0. Collectives only enqueue work on the stream, so `all_reduce` is capturable
in a CUDA graph (it neither synchronizes nor allocates).
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import itertools
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import env
from .distributed import gather_objects, rank_label
from .kernels import nccl_mark

NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7  # ncclInProgress: a non-blocking communicator still working, not an error
NCCL_SUM = 0
NCCL_DTYPES = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}  # ncclFloat16, ncclFloat32, ncclBfloat16
TIMED_OUT = -1  # the code a launcher reports for a communicator its watchdog aborted (no ncclResult_t is < 0)
ABORT_GRACE_S = 0.05  # between the watchdog's ABORTED flag and its ncclCommAbort (NcclComm._watchdog)
# The watchdog's words (int64, host-mapped pinned memory; csrc/host_launch.cpp's Progress mirrors them): the
# stream writes DONE, the sequence number of the last finished eager all-reduce; the host counts ISSUED and
# stamps each one's enqueue time (CLOCK_MONOTONIC ns) at STAMPS + seq % RING; ABORTED is set before the abort;
# the marks of captured all-reduces write BEGUN and ENDED (commfuse.kernels.nccl_mark).
DONE, ISSUED, ABORTED, BEGUN, ENDED, STAMPS, RING = 0, 1, 2, 3, 4, 8, 4096


class UniqueId(ctypes.Structure):
    """ncclUniqueId: NCCL_UNIQUE_ID_BYTES (128) opaque bytes naming a communicator being created."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


_ncclComm_t = ctypes.c_void_p
_cudaStream_t = ctypes.c_void_p
_result_t = ctypes.c_int  # ncclResult_t, ncclDataType_t and ncclRedOp_t are C enums: int

# name -> (restype, argtypes, required). ncclGetLastError came with NCCL 2.13; without it the
# errors carry ncclGetErrorString's text only.
FUNCTIONS = {
    "ncclGetVersion": (_result_t, [ctypes.POINTER(ctypes.c_int)], True),
    "ncclGetErrorString": (ctypes.c_char_p, [_result_t], True),
    "ncclGetLastError": (ctypes.c_char_p, [_ncclComm_t], False),
    "ncclGetUniqueId": (_result_t, [ctypes.POINTER(UniqueId)], True),
    "ncclCommInitRank": (_result_t, [ctypes.POINTER(_ncclComm_t), ctypes.c_int, UniqueId, ctypes.c_int], True),
    # sendbuff, recvbuff, count, datatype, op, comm, stream
    "ncclAllReduce": (_result_t, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                  _ncclComm_t, _cudaStream_t], True),
    "ncclCommGetAsyncError": (_result_t, [_ncclComm_t, ctypes.POINTER(_result_t)], True),
    "ncclCommDestroy": (_result_t, [_ncclComm_t], True),
    "ncclCommAbort": (_result_t, [_ncclComm_t], True),
}

# torch's C entry point for the current raw stream (what its compiled code calls): the public
# torch.cuda.current_stream() builds a Stream object, microseconds of host time. CPU builds lack it.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class NcclUnavailable(RuntimeError):
    """No NCCL library could be loaded (the message lists what was tried)."""


class NcclTimeoutError(RuntimeError):
    """An all-reduce did not finish within COMMFUSE_NCCL_TIMEOUT_S of its enqueue (of its start, replayed from
    a CUDA graph): a rank skipped the call, died, or lags that far behind (or this stream was that far
    behind). The watchdog aborted the NCCL communicator: it, and every Communicator of its group made so far, is
    unusable afterwards, and so is a CUDA graph that captured its all-reduces (a Communicator made later makes
    the group's anew)."""


class NcclError(RuntimeError):
    """An NCCL function returned an error: `function`, `code` (ncclResult_t) and NCCL's own words."""

    def __init__(self, function: str, code: int, message: str):
        super().__init__(f"{function} failed: {message} (ncclResult_t {code})")
        self.function = function
        self.code = code


class Nccl:
    """NCCL's functions, as attributes of `lib` (a ctypes.CDLL typed by `bind`, or a fake in tests),
    with errors raised as NcclError. Not the hot path: NcclComm calls ncclAllReduce itself."""

    def __init__(self, lib, path: str):
        self.lib = lib
        self.path = path

    def error(self, function: str, code: int, comm=None) -> NcclError:
        text = self.lib.ncclGetErrorString(code)
        text = text.decode(errors="replace") if text else "unknown error"
        last = getattr(self.lib, "ncclGetLastError", None)
        detail = last(comm) if last is not None else None
        if detail:  # the last failure's specifics ("Cuda failure 'out of memory'", a bad argument's name)
            text = f"{text}: {detail.decode(errors='replace')}"
        return NcclError(function, code, text)

    def check(self, function: str, code: int, comm=None) -> None:
        if code != NCCL_SUCCESS:
            raise self.error(function, code, comm)

    def version(self) -> str:
        """The library's version, "2.28.9"."""
        code = ctypes.c_int()
        self.check("ncclGetVersion", self.lib.ncclGetVersion(ctypes.byref(code)))
        return version_string(code.value)

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.check("ncclGetUniqueId", self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid)

    def init_rank(self, world_size: int, uid: bytes, rank: int) -> int:
        """A new communicator's handle (on the current CUDA device); blocks until every rank joins."""
        handle = _ncclComm_t()
        self.check("ncclCommInitRank",
                   self.lib.ncclCommInitRank(ctypes.byref(handle), world_size, UniqueId.from_buffer_copy(uid), rank))
        return handle.value

    def async_error(self, handle: int) -> int:
        code = _result_t()
        self.check("ncclCommGetAsyncError", self.lib.ncclCommGetAsyncError(handle, ctypes.byref(code)), handle)
        return code.value

    def has_error(self, handle: int) -> bool:
        """Whether the communicator holds an asynchronous error (or NCCL cannot say)."""
        code = _result_t()
        failed = self.lib.ncclCommGetAsyncError(handle, ctypes.byref(code))
        return bool(failed) or code.value not in (NCCL_SUCCESS, NCCL_IN_PROGRESS)

    def release(self, handle: int) -> None:
        """Destroy the communicator; abort it instead when it holds an error (destroying would wait on
        operations that may never finish)."""
        if self.has_error(handle):
            self.check("ncclCommAbort", self.lib.ncclCommAbort(handle))
        else:
            self.check("ncclCommDestroy", self.lib.ncclCommDestroy(handle))


def version_string(code: int) -> str:
    """NCCL_VERSION_CODE as "major.minor.patch": X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z after."""
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give lib's functions the types of FUNCTIONS (without them ctypes would pass 64-bit pointers
    as C ints); raises AttributeError naming a required function the library lacks."""
    for name, (restype, argtypes, required) in FUNCTIONS.items():
        fn = getattr(lib, name, None)
        if fn is None:
            if required:
                raise AttributeError(f"the library has no {name}")
            setattr(lib, name, None)
            continue
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _candidates() -> list:
    """(how it was found, what to dlopen) for each place NCCL may be, in the order they are tried."""
    found = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        loaded = load_nvidia_dynamic_lib("nccl")
        found.append(("cuda.pathfinder", loaded.abs_path or "libnccl.so.2"))
    except Exception as exc:  # an old cuda-pathfinder that does not know NCCL, or nothing found
        found.append(("cuda.pathfinder", exc))
    folders = []
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        folders += sorted(Path(base).glob("*/lib"))  # nvidia/nccl/lib (nvidia-nccl-cu12, -cu13)
    folders.append(Path(torch.__file__).parent / "lib")  # wheels that bundle NCCL with torch
    for folder in folders:
        found += [("wheel folder", str(p)) for p in sorted(folder.glob("libnccl.so*"))]
    found.append(("loader path", "libnccl.so.2"))
    return found


@functools.cache
def _load_from(path: Optional[str]) -> Nccl:
    tried = []
    candidates = [("COMMFUSE_NCCL_LIBRARY", path)] if path else _candidates()
    for how, target in candidates:
        if isinstance(target, Exception):
            tried.append(f"{how}: {type(target).__name__}: {str(target).strip()}")
            continue
        try:
            lib = bind(ctypes.CDLL(target))
        except (OSError, AttributeError) as exc:
            tried.append(f"{how} {target}: {str(exc).strip()}")
            continue
        return Nccl(lib, target)
    raise NcclUnavailable("no NCCL library could be loaded; tried " + "; ".join(tried))


def library() -> Nccl:
    """The loaded NCCL (COMMFUSE_NCCL_LIBRARY's, else the first found); raises NcclUnavailable."""
    return _load_from(os.environ.get("COMMFUSE_NCCL_LIBRARY") or None)


def available() -> Optional[str]:
    """None where NCCL loads, else why not (NcclUnavailable's message)."""
    try:
        library()
    except NcclUnavailable as exc:
        return str(exc)
    return None


def watchdog_timeout() -> float:
    """COMMFUSE_NCCL_TIMEOUT_S, checked (ValueError naming it); 0: no watchdog. The Communicator checks it when
    it is made, before its ranks' first collective, so that a bad value raises there on every rank rather
    than on one rank here while its peers wait in the communicator's initialisation."""
    return env.seconds("COMMFUSE_NCCL_TIMEOUT_S", 10.0, zero=True)


def broadcast_unique_id(group, make_id: Callable[[], bytes]) -> bytes:
    """make_id() on the group's rank 0, broadcast to every rank of the group (any backend). Where it raises,
    its message travels instead and every rank raises (rank 0 its own error): the others would wait for an
    id that never comes."""
    error = None
    obj: list = [None]
    if dist.get_rank(group) == 0:
        try:
            obj[0] = make_id()
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error, obj[0] = e, f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(obj, src=dist.get_global_rank(group, 0), group=group)
    if error is not None:
        raise error
    if isinstance(obj[0], str):
        raise RuntimeError(f"rank 0 could not make the NCCL unique id: {obj[0]}")
    return obj[0]


INIT_FLOOR_S = 60.0  # the least time init_agreed gives NCCL's initialisation (many nodes take tens of seconds)
INIT_POLL_S = 0.02  # how often a rank waiting in init_agreed looks at its own init and at the store


def init_agreed(nccl: Nccl, group, uid: bytes, key: str, index: int, timeout: float) -> int:
    """ncclCommInitRank of this rank of `group` (on CUDA device `index`; -1: none, for tests), agreed by every rank:
    each gets its handle, or each raises. NCCL's blocking initialisation waits for every rank, so a rank whose init
    fails (out of memory, say) or that died would leave its peers waiting in it for good. Each rank runs it on a
    thread of its own and meets the others in torch.distributed's default store under `key` (one per attempt, the
    same on every rank): the ranks count their finished inits there, and one outcome is decided, by the first rank
    to write it: "ok" once every init has finished, else why not, from a rank whose init failed or that has waited
    max(`timeout`, INIT_FLOOR_S) s (`timeout` 0: no bound). On failure every rank raises it (NcclError;
    NcclTimeoutError for an init that did not finish), the failed rank its own error, and aborts its communicator,
    made or made later by the abandoned thread (which NCCL may keep waiting for good)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    label = rank_label(group, rank)
    store = dist.distributed_c10d._get_default_store()
    lock = threading.Lock()
    outcome: dict = {}  # "handle" or "error", set by the thread; "abandoned", set here when this rank gives up

    def init() -> None:
        try:
            if index >= 0:
                torch.cuda.set_device(index)
            handle = nccl.init_rank(world, uid, rank)
        except BaseException as e:  # noqa: BLE001 - raised by the waiting thread
            outcome["error"] = e
            return
        with lock:
            outcome["handle"] = handle
            if not outcome.get("abandoned"):
                return
        nccl.lib.ncclCommAbort(handle)

    def decide(value: str) -> str:  # the outcome: `value` where none was written before, else the one that was
        return store.compare_set(key + "/outcome", "", value).decode(errors="replace")

    thread = threading.Thread(target=init, name=f"commfuse-nccl-init-{rank}", daemon=True)
    thread.start()
    bound = max(timeout, INIT_FLOOR_S) if timeout > 0 else float("inf")
    deadline, counted = time.monotonic() + bound, False
    while True:
        thread.join(INIT_POLL_S)
        finished = not thread.is_alive()  # before the error: a failure after it must not be counted as finished
        error = outcome.get("error")
        if error is not None:
            decide(f"{error.code if isinstance(error, NcclError) else ''}|{label}: {error}")
            raise error
        if finished and not counted:
            counted = True
            store.add(key + "/done", 1)
        if store.check([key + "/outcome"]):
            decided = store.get(key + "/outcome").decode(errors="replace")
        elif counted and store.add(key + "/done", 0) == world:
            decided = decide("ok")
        elif time.monotonic() >= deadline:
            late = (f"{store.add(key + '/done', 0)} of {world} ranks' ncclCommInitRank finished" if counted
                    else "its ncclCommInitRank did not finish")
            decided = decide(f"{TIMED_OUT}|{label}: {late} within {bound:g} s")
        else:
            continue
        if decided == "ok":  # every init finished, this rank's among them
            return outcome["handle"]
        with lock:
            outcome["abandoned"] = True
            handle = outcome.get("handle")
        if handle is not None:
            nccl.lib.ncclCommAbort(handle)
        code, why = decided.split("|", 1)
        message = f"{label}: the group's NCCL communicator was not made on every rank ({why}); no rank keeps it"
        if code == str(TIMED_OUT):
            raise NcclTimeoutError(message)
        raise NcclError("ncclCommInitRank", int(code), message) if code else RuntimeError(message)


class NcclComm:
    """An NCCL communicator over the ranks of a torch.distributed group, on one CUDA device.

    group: any torch.distributed group (gloo too: it only carries the unique id); device: this
    rank's CUDA device (no index: the current one). NCCL refuses two ranks of one communicator on
    one GPU; a group of one rank is fine. Construction is collective over the group and raises
    NcclUnavailable without an NCCL library; every rank gets the communicator or every rank raises (init_agreed).
    `close()` destroys the communicator (not collective; destroy the CUDA graphs that captured its all-reduces first); garbage collection does not, as
    NCCL or CUDA may already be torn down when it runs at exit. With COMMFUSE_NCCL_TIMEOUT_S > 0 (default
    10) its watchdog aborts it when an all-reduce has not finished that long after its enqueue, or after
    its start in a CUDA graph's replay (the module docstring); every later all_reduce raises NcclTimeoutError.
    """

    def __init__(self, group, device: torch.device):
        nccl = library()
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"NcclComm needs a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.label = rank_label(group, self.rank)  # how errors name this rank
        timeout = watchdog_timeout()
        # The store key of this attempt's agreement: a nonce of rank 0's, since a stand-in library's ids repeat.
        made = broadcast_unique_id(group, lambda: nccl.unique_id() + os.urandom(16))
        uid, key = made[:128], "commfuse/nccl-init/" + made[128:].hex()
        handle = init_agreed(nccl, group, uid, key, index, timeout)
        self._attach(nccl, handle, index)
        error = None
        if timeout > 0:
            try:
                self._watch(timeout, env.flag("COMMFUSE_NCCL_WATCH_REPLAYS", True))
            except BaseException as e:  # noqa: BLE001 - raised below, once the ranks know
                error = e
        # Every rank keeps the communicator or none does: a peer of a rank whose watchdog did not start would
        # wait for it in their first all-reduce, and a later Communicator of the group would find it on some
        # ranks only. No one else holds it yet, so nothing else would destroy it.
        failed = [rank_label(group, r) for r, bad in enumerate(gather_objects(group, error is not None)) if bad]
        if failed:
            self._handle = None  # a watchdog that started stops
            try:
                nccl.check("ncclCommAbort", nccl.lib.ncclCommAbort(handle))
            except Exception:  # noqa: BLE001 - the watchdog's error is the one to raise
                pass
            if error is not None:
                raise error
            raise RuntimeError(f"{self.label}: the NCCL communicator's watchdog did not start on "
                               f"{', '.join(failed)}; no rank keeps the communicator")

    def _attach(self, nccl: Nccl, handle: int, index: int) -> None:
        self.nccl = nccl
        self.device_index = index
        self.version = nccl.version()
        self._handle = handle
        self.token = next(_TOKENS)  # how a native launcher names it (a handle may be reused after a close)
        _BY_TOKEN[self.token] = self
        self._all_reduce = nccl.lib.ncclAllReduce
        self._progress = None  # the watchdog's words (ctypes int64 array), None without a watchdog
        self._marks = None  # the begin and end marks' parameters, None where captured all-reduces get none
        self.timeout_s = 0.0
        self._lock = threading.Lock()  # the watchdog's abort against close()
        self._watchdog_aborted = False

    def _watch(self, timeout: float, replays: bool) -> None:
        """Start the watchdog: its words in host-mapped pinned memory, the marks of captured all-reduces
        (replays: their kernel and their count in device memory), and its thread."""
        from . import ipc

        words = STAMPS + RING
        with ipc.device_context(self.device_index):
            flags = ipc.driver.CU_MEMHOSTALLOC_DEVICEMAP | ipc.driver.CU_MEMHOSTALLOC_PORTABLE
            host = int(ipc.call(ipc.driver.cuMemHostAlloc, 8 * words, flags))
            ctypes.memset(host, 0, 8 * words)
            mapped = int(ipc.call(ipc.driver.cuMemHostGetDevicePointer, host, 0))
        self._done_address = mapped + 8 * DONE
        self._progress_address = host
        self._write_value = ipc.driver.cuStreamWriteValue64
        self._is_capturing = ipc.driver.cuStreamIsCapturing
        self._not_capturing = ipc.driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        if replays:
            self._count = torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", self.device_index))
            self._mark_kernel = nccl_mark.load(self.device_index)
            self._marks = nccl_mark.mark_params(self._count.data_ptr(), mapped + 8 * BEGUN, mapped + 8 * ENDED)
        self._start_watchdog((ctypes.c_int64 * words).from_address(host), timeout)

    def _start_watchdog(self, words, timeout: float) -> None:
        """Watch `words` (STAMPS + RING int64: the launchers' stamps and the stream's DONE) from a thread
        of its own, a daemon: it must not keep a process alive, and it only reads the words and may abort."""
        self._progress, self.timeout_s = words, timeout
        threading.Thread(target=self._watchdog, name=f"commfuse-nccl-watchdog-{self.rank}", daemon=True).start()

    def _watchdog(self) -> None:
        p, limit = self._progress, int(self.timeout_s * 1e9)
        replayed, since = 0, 0  # the replayed all-reduce seen begun and not ended, and since when
        stalled, stalled_since = -1, 0  # the count of finished eager all-reduces seen short of the issued, since when
        while self._handle is not None:
            time.sleep(min(1.0, self.timeout_s / 4))
            now = time.monotonic_ns()
            done, issued = p[DONE], p[ISSUED]
            late = issued > done and now - p[STAMPS + (done + 1) % RING] > limit
            # The oldest unfinished all-reduce's stamp is overwritten once RING more are issued after it (a host
            # far ahead of a stuck stream): then the count standing still that long says it.
            if issued > done and done != stalled:
                stalled, stalled_since = done, now
            late = late or (issued > done and now - stalled_since > limit)
            begun = p[BEGUN]
            if begun == p[ENDED]:
                replayed = 0
            elif begun != replayed:
                replayed, since = begun, now
            else:
                late = late or now - since > limit
            if late:
                p[ABORTED] = 1  # the launchers stop calling NCCL before the communicator goes
                # A launcher that read the flag just before it was set is a few instructions from ncclAllReduce:
                # give it the time to get there, where the abort ends it, rather than meet a freed communicator.
                time.sleep(ABORT_GRACE_S)
                with self._lock:
                    if self._handle is not None:
                        self.nccl.lib.ncclCommAbort(self._handle)
                        self._watchdog_aborted = True
                return

    def _captured(self, stream: int) -> Optional[bool]:
        """Whether `stream` is capturing a CUDA graph (None where the driver cannot say)."""
        err, status = self._is_capturing(stream)
        return None if err else status != self._not_capturing

    def _mark(self, stream: int, end: bool) -> None:
        """A captured all-reduce's begin or end mark (commfuse.kernels.nccl_mark), enqueued on `stream`."""
        self._mark_kernel.launch((1, 1, 1), (nccl_mark.THREADS, 1, 1), self._marks[end], stream=stream)

    def _issue(self) -> int:
        """An eager all-reduce's number, counted with the time its enqueue begins: NCCL's enqueue itself may wait
        for a peer (connecting to it at first use, or a queue full behind a stalled kernel), and the watchdog
        bounds that wait too."""
        p = self._progress
        seq = p[ISSUED] + 1
        p[STAMPS + seq % RING] = time.monotonic_ns()
        p[ISSUED] = seq
        return seq

    def _done_when_reached(self, stream: int, seq: int) -> None:
        """The stream writes `seq` when it gets there: after the all-reduce, or at once after a failed enqueue
        (so that the count catches up and the watchdog does not abort a communicator that is fine)."""
        (err,) = self._write_value(stream, self._done_address, seq, 0)
        if err:
            raise RuntimeError(f"cuStreamWriteValue64 after ncclAllReduce failed: {err}")

    def timeout_error(self) -> NcclTimeoutError:
        return NcclTimeoutError(
            f"{self.label}: an NCCL all-reduce did not finish within COMMFUSE_NCCL_TIMEOUT_S = "
            f"{self.timeout_s:g} s of its enqueue (of its start, replayed from a CUDA graph): a rank skipped the "
            "call, died, or lags that far behind. The communicator was aborted: it, every Communicator of its "
            "group made so far and every CUDA graph that captured its all-reduces are unusable (a Communicator "
            "made later makes the group's anew)")

    def all_reduce(self, send: torch.Tensor, recv: torch.Tensor, stream: Optional[int] = None) -> None:
        """recv = the sum of every rank's `send`, enqueued on `stream` (a raw cudaStream_t; None:
        torch's current stream on the device). send, recv: contiguous fp16 / bf16 / fp32 tensors of
        one dtype and element count on the communicator's device; recv may be send (in place)."""
        dtype = send.dtype
        code = NCCL_DTYPES.get(dtype)
        if code is None or recv.dtype != dtype:
            raise TypeError(self._dtype_error(send, recv))
        index = self.device_index
        count = send.numel()
        # The pointer and count are all NCCL sees: another device's, or a smaller or strided recv,
        # would have it read or write memory outside the tensors.
        if (recv.numel() != count or send.get_device() != index or recv.get_device() != index
                or not send.is_contiguous() or not recv.is_contiguous()):
            raise ValueError(self._layout_error(send, recv))
        handle = self._handle
        if handle is None:
            raise RuntimeError("NcclComm.all_reduce after close()")
        if self._progress is not None and self._progress[ABORTED]:
            raise self.timeout_error()
        stream = _current_raw_stream(index) if stream is None else stream
        captured = self._captured(stream) if self._progress is not None else None
        marked = captured and self._marks is not None
        if marked:
            self._mark(stream, False)
        seq = self._issue() if captured is False else 0
        try:
            rc = self._all_reduce(send.data_ptr(), recv.data_ptr(), count, code, NCCL_SUM, handle, stream)
        finally:
            if seq:
                self._done_when_reached(stream, seq)
        if rc:
            raise self.error(rc)
        if marked:
            self._mark(stream, True)

    def error(self, code: int):
        """The error of an ncclResult_t this communicator's all-reduce returned (a native launcher's):
        NcclError; NcclTimeoutError for TIMED_OUT, and for any code once the watchdog aborted the communicator
        (an enqueue that the abort ended fails with whatever NCCL returns then: the timeout is the cause)."""
        if code == TIMED_OUT or (self._progress is not None and self._progress[ABORTED]):
            return self.timeout_error()
        return self.nccl.error("ncclAllReduce", code, self._handle)

    def native_args(self, dtype: torch.dtype, count: int) -> tuple:
        """What a native launcher (commfuse.kernels.native) needs to enqueue all_reduce of `count` elements of
        `dtype` itself: (ncclAllReduce's address, the communicator handle, NCCL's dtype, count, then the
        watchdog's: its words' host address and DONE's device address, 0 and 0 without a watchdog; the mark
        kernel's CUfunction and the begin and end marks' parameter bytes, 0, b"", b"" without marks; its token,
        which the launcher passes to native_error)."""
        if self._handle is None:
            raise RuntimeError("NcclComm.native_args after close()")
        watch = (0, 0) if self._progress is None else (self._progress_address, self._done_address)
        marks = (0, b"", b"") if self._marks is None else (self._mark_kernel.function, *self._marks)
        return (ctypes.cast(self._all_reduce, ctypes.c_void_p).value, int(self._handle), NCCL_DTYPES[dtype], count,
                *watch, *marks, self.token)

    def _dtype_error(self, send, recv) -> str:
        kinds = "float16, bfloat16 or float32"
        if send.dtype not in NCCL_DTYPES:
            return f"send has dtype {send.dtype}; NcclComm.all_reduce takes {kinds}"
        return f"recv has dtype {recv.dtype}, send {send.dtype}: they must match"

    def _layout_error(self, send, recv) -> str:
        # get_device() is -1 on the CPU: where the tests attach a communicator over a stand-in library.
        device = torch.device("cuda", self.device_index) if self.device_index >= 0 else torch.device("cpu")
        for name, t in (("send", send), ("recv", recv)):
            if t.device != device:
                return f"{name} is on {t.device}, the communicator on {device}"
            if not t.is_contiguous():
                return f"{name} is not contiguous (strides {t.stride()})"
        return f"recv has {recv.numel()} elements, send {send.numel()}: they must match"

    def check(self) -> None:
        """Raise NcclTimeoutError if the watchdog aborted the communicator, NcclError if it met an asynchronous
        error (a peer failed, a network error)."""
        if self._progress is not None and self._progress[ABORTED]:
            raise self.timeout_error()
        if self._handle is not None:
            code = self.nccl.async_error(self._handle)
            if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                raise self.nccl.error("ncclCommGetAsyncError", code, self._handle)

    @property
    def failed(self) -> bool:
        """Whether it can carry no more all-reduces: closed, aborted by the watchdog, or holding an asynchronous
        error (a peer failed)."""
        if self._progress is not None and self._progress[ABORTED]:
            return True
        return self._handle is None or self.nccl.has_error(self._handle)

    def close(self) -> None:
        """Destroy the communicator (abort it if it holds an error); later calls do nothing. The watchdog's
        words stay (a launcher may still hold their address). With a watchdog, its unfinished all-reduces
        finish first, or fail (NCCL's asynchronous error), or the watchdog aborts them: NCCL's destroy waits for
        them, for good where a peer never comes."""
        p = self._progress
        while (p is not None and self._handle is not None and not p[ABORTED]
               and (p[ISSUED] > p[DONE] or p[BEGUN] != p[ENDED])):
            if self.nccl.has_error(self._handle):
                break  # NCCL has seen it fail: release() below aborts it now
            time.sleep(0.002)
        with self._lock:
            handle, self._handle = self._handle, None
            if handle is None:
                return
            if self._progress is not None and self._progress[ABORTED]:
                if not self._watchdog_aborted:  # closed within the watchdog's grace: its abort is this one
                    self.nccl.lib.ncclCommAbort(handle)
            else:
                self.nccl.release(handle)


_SHARED: dict = {}
# The live communicators by token, for the errors of the native launchers (native_args hands them the token).
_TOKENS = itertools.count(1)
_BY_TOKEN: "weakref.WeakValueDictionary[int, NcclComm]" = weakref.WeakValueDictionary()


def native_error(code: int, token: int) -> Exception:
    """The error a native launcher (commfuse.kernels.native) raises for an all-reduce of the communicator whose
    `token` it holds that failed with `code` (an ncclResult_t, or TIMED_OUT where the watchdog had aborted it):
    what NcclComm.all_reduce raises, so that eager calls, torch.ops calls and compiled graphs raise alike."""
    comm = _BY_TOKEN.get(token)
    if comm is not None:
        return comm.error(code)
    if code == TIMED_OUT:
        return NcclTimeoutError("an NCCL all-reduce did not finish within COMMFUSE_NCCL_TIMEOUT_S: the communicator "
                                "was aborted (and is gone)")
    return NcclError("ncclAllReduce", code, "a communicator that is gone")


def _key(group, device) -> tuple:
    device = torch.device(device)
    return group, device.index if device.index is not None else torch.cuda.current_device()


def shared(group, device: torch.device, renew: bool = False) -> NcclComm:
    """The process's one NcclComm over `group` on `device`, made on the first call, or anew with `renew`
    (collective then: every rank of the group calls it, in the same order as its other collectives).
    Communicators of one group share it: each NCCL communicator holds its own buffers (tens to hundreds of MB
    a GPU) and takes a rendezvous to create. It lives as long as the process: its Communicators' native
    launchers hold its handle, so it must not be closed while they may run (a renewed one's included: it
    stays, failed, for the Communicators that hold it)."""
    key = _key(group, device)
    comm = _SHARED.get(key)
    if comm is None or renew:
        comm = _SHARED[key] = NcclComm(group, device)
    return comm


def shared_usable(group, device: torch.device) -> bool:
    """Whether this rank holds the group's shared NcclComm on `device` and it has not failed (NcclComm.failed): a
    new Communicator of the group has every rank make it anew unless every rank's is usable, rather than hand it
    one that raises at its first call, or have some ranks make one (collective) while the others do not."""
    comm = _SHARED.get(_key(group, device))
    return comm is not None and not comm.failed

