"""commfuse.nccl: the ctypes table, error translation, library loading and the unique-id broadcast on
the CPU (a fake library object, and tests/nccl_stub.c compiled into a stand-in libnccl where a C
compiler exists); the all-reduce itself on GPUs with NCCL.

`mpirun -n N pytest --with-mpi`: the unique-id broadcast needs 2+ ranks (gloo); the GPU all-reduce
tests need WORLD over NCCL (one GPU per rank), except the one-rank communicator, which every rank
makes over a group of its own (NCCL refuses two ranks on one GPU, not one rank).
"""
import contextlib
import ctypes
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from commfuse import nccl
from commfuse.nccl import NcclComm, NcclError, NcclUnavailable

from compare import assert_within_ulp

mpi = pytest.mark.mpi
P = ctypes.POINTER
c_int, c_size_t, c_void_p, c_char_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
NCCL_REASON = nccl.available()
needs_nccl_gpu = pytest.mark.skipif(not torch.cuda.is_available() or NCCL_REASON is not None,
                                    reason=f"needs CUDA and NCCL ({NCCL_REASON or 'no CUDA GPU'})")


# --------------------------------------------------------------------------- the tables


def test_function_table_has_ncclh_signatures():
    # From NVIDIA/nccl src/nccl.h.in; enums (ncclResult_t, ncclDataType_t, ncclRedOp_t) are C ints.
    expect = {
        "ncclGetVersion": (c_int, [P(c_int)]),
        "ncclGetErrorString": (c_char_p, [c_int]),
        "ncclGetLastError": (c_char_p, [c_void_p]),
        "ncclGetUniqueId": (c_int, [P(nccl.UniqueId)]),
        "ncclCommInitRank": (c_int, [P(c_void_p), c_int, nccl.UniqueId, c_int]),  # the id by value
        "ncclAllReduce": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
        "ncclCommGetAsyncError": (c_int, [c_void_p, P(c_int)]),
        "ncclCommDestroy": (c_int, [c_void_p]),
        "ncclCommAbort": (c_int, [c_void_p]),
    }
    assert {name: (r, a) for name, (r, a, _) in nccl.FUNCTIONS.items()} == expect
    assert [n for n, (_, _, required) in nccl.FUNCTIONS.items() if not required] == ["ncclGetLastError"]
    assert ctypes.sizeof(nccl.UniqueId) == 128  # NCCL_UNIQUE_ID_BYTES


def test_dtype_table_matches_ncclh():
    # ncclFloat16 = 6, ncclFloat32 = 7, ncclBfloat16 = 9, ncclSum = 0 (nccl.h.in)
    assert nccl.NCCL_DTYPES == {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}
    assert nccl.NCCL_SUM == 0


@pytest.mark.parametrize("code, text", [(22809, "2.28.9"), (21903, "2.19.3"), (2708, "2.7.8")])
def test_version_string_decodes_both_version_code_layouts(code, text):
    assert nccl.version_string(code) == text


class _Fn:
    """Stands for a ctypes function: takes restype and argtypes."""


def test_bind_types_every_function_and_tolerates_a_missing_optional_one():
    lib = type("Lib", (), {})()
    for name in nccl.FUNCTIONS:
        if name != "ncclGetLastError":
            setattr(lib, name, _Fn())
    assert nccl.bind(lib) is lib
    for name, (restype, argtypes, _) in nccl.FUNCTIONS.items():
        fn = getattr(lib, name)
        if name == "ncclGetLastError":
            assert fn is None
        else:
            assert (fn.restype, fn.argtypes) == (restype, argtypes), name
    del lib.ncclAllReduce
    with pytest.raises(AttributeError, match="ncclAllReduce"):
        nccl.bind(lib)


# --------------------------------------------------------------------------- errors, with a fake library


class FakeLib:
    """NCCL's functions as Python methods; each returns `fail` (an ncclResult_t), 0 by default."""

    def __init__(self, fail=0, last=b"detail of the failure"):
        self.fail, self.last, self.calls = fail, last, []
        if last is None:
            self.ncclGetLastError = None  # what bind() leaves where the library lacks it

    def ncclGetErrorString(self, code):
        return {4: b"invalid argument", 5: b"invalid usage"}.get(code, b"unknown result")

    def ncclGetLastError(self, comm):
        return self.last

    def ncclGetVersion(self, version):
        version._obj.value = 22809
        return self.fail

    def ncclGetUniqueId(self, uid):
        return self.fail

    def ncclCommInitRank(self, handle, world, uid, rank):
        return self.fail

    def ncclCommGetAsyncError(self, handle, code):
        self.calls.append("ncclCommGetAsyncError")
        return 0

    def ncclCommDestroy(self, handle):
        self.calls.append("ncclCommDestroy")
        return self.fail

    def ncclCommAbort(self, handle):
        self.calls.append("ncclCommAbort")
        self.aborted_at = time.monotonic()
        return self.fail

    def ncclAllReduce(self, *args):
        self.calls.append(args)
        return self.fail


@pytest.mark.parametrize("call, function", [
    (lambda n: n.version(), "ncclGetVersion"),
    (lambda n: n.unique_id(), "ncclGetUniqueId"),
    (lambda n: n.init_rank(2, bytes(128), 0), "ncclCommInitRank"),
    (lambda n: n.release(1234), "ncclCommDestroy"),
])
def test_errors_name_the_function_and_nccls_error_string(call, function):
    with pytest.raises(NcclError) as info:
        call(nccl.Nccl(FakeLib(fail=5), "fake"))
    err = info.value
    assert isinstance(err, RuntimeError) and err.function == function and err.code == 5
    assert str(err) == f"{function} failed: invalid usage: detail of the failure (ncclResult_t 5)"
    # Without ncclGetLastError (NCCL before 2.13), or when it has nothing to say: the error string alone.
    for last in (None, b""):
        with pytest.raises(NcclError, match=rf"^{function} failed: invalid usage \(ncclResult_t 5\)$"):
            call(nccl.Nccl(FakeLib(fail=5, last=last), "fake"))


def test_success_returns_values():
    n = nccl.Nccl(FakeLib(), "fake")
    assert n.version() == "2.28.9"
    assert n.unique_id() == bytes(128)
    n.init_rank(2, bytes(range(128)), 1)


def attached(lib, handle=0xABC, path="fake") -> NcclComm:
    """A NcclComm over `lib` without the collective set-up, on the CPU (device index -1: CPU tensors)."""
    comm = NcclComm.__new__(NcclComm)
    comm._attach(nccl.Nccl(lib, path), handle, -1)
    return comm


def test_all_reduce_passes_pointers_count_dtype_sum_handle_and_stream():
    lib = FakeLib()
    comm = attached(lib)
    for dtype, code in nccl.NCCL_DTYPES.items():
        send, recv = torch.zeros(3, 5, dtype=dtype), torch.zeros(15, dtype=dtype)
        comm.all_reduce(send, recv, stream=77)
        assert lib.calls[-1] == (send.data_ptr(), recv.data_ptr(), 15, code, 0, 0xABC, 77)
    comm.all_reduce(send, send, stream=0)  # in place
    assert lib.calls[-1][:2] == (send.data_ptr(), send.data_ptr())


def test_all_reduce_uses_torchs_current_stream_by_default(monkeypatch):
    lib = FakeLib()
    monkeypatch.setattr(nccl, "_current_raw_stream", lambda index: 1000 + index)
    x = torch.zeros(4)
    attached(lib).all_reduce(x, x)
    assert lib.calls[-1][-1] == 1000 - 1


def test_all_reduce_error_is_nccl_error():
    lib = FakeLib()
    comm = attached(lib)
    lib.fail = 4
    x = torch.zeros(4)
    with pytest.raises(NcclError, match=r"^ncclAllReduce failed: invalid argument: detail of the failure"):
        comm.all_reduce(x, x, stream=0)


def test_all_reduce_refuses_what_nccl_cannot_read_safely():
    lib = FakeLib()
    comm = attached(lib)
    x = torch.zeros(8)
    with pytest.raises(TypeError, match=r"^send has dtype torch.float64"):
        comm.all_reduce(x.double(), x.double(), stream=0)
    with pytest.raises(TypeError, match=r"^send has dtype torch.int8"):
        comm.all_reduce(x.to(torch.int8), x.to(torch.int8), stream=0)
    with pytest.raises(TypeError, match=r"^recv has dtype torch.bfloat16, send torch.float32"):
        comm.all_reduce(x, x.bfloat16(), stream=0)
    with pytest.raises(ValueError, match="recv has 7 elements, send 8"):
        comm.all_reduce(x, x[:7], stream=0)
    with pytest.raises(ValueError, match="recv is not contiguous"):
        comm.all_reduce(x[:4], x[::2], stream=0)
    with pytest.raises(ValueError, match="send is not contiguous"):
        comm.all_reduce(torch.zeros(4, 2).t(), torch.zeros(8), stream=0)
    other = attached(lib)
    other.device_index = 0  # a communicator on cuda:0 given CPU tensors
    with pytest.raises(ValueError, match="send is on cpu, the communicator on cuda:0"):
        other.all_reduce(x, x, stream=0)
    assert lib.calls == []


def test_close_destroys_once_then_all_reduce_raises():
    lib = FakeLib()
    comm = attached(lib)
    comm.close()
    comm.close()
    assert lib.calls == ["ncclCommGetAsyncError", "ncclCommDestroy"]
    with pytest.raises(RuntimeError, match="after close"):
        comm.all_reduce(torch.zeros(2), torch.zeros(2), stream=0)
    comm.check()  # a closed communicator has nothing to report


class MarkKernel:
    """Records the marks a captured all-reduce enqueues, as ("mark", parameter bytes, stream), in the fake
    library's log of calls."""

    def __init__(self, calls):
        self.calls = calls

    def launch(self, grid, block, params, stream=None):
        assert grid == (1, 1, 1) and block[0] >= 1
        self.calls.append(("mark", params, stream))


def watched(lib, timeout: float, handle=0xABC, path="fake"):
    """attached(lib) with its watchdog over host words and stand-ins for the driver: `writes` gets each
    number the stream would write when the all-reduce is done; `capturing` says whether the stream is;
    the library's log of calls gets the marks of captured all-reduces (a FakeLib's)."""
    comm = attached(lib, handle, path)
    comm.rank, comm.label, comm.writes, comm.capturing = 0, "rank 0", [], False
    comm._is_capturing = lambda stream: (0, "active" if comm.capturing else "none")
    comm._not_capturing = "none"
    comm._write_value = lambda stream, address, seq, flags: comm.writes.append(seq) or (0,)
    comm._done_address = 0
    comm._mark_kernel, comm._marks = MarkKernel(getattr(lib, "calls", [])), (b"begin", b"end")
    comm._start_watchdog((ctypes.c_int64 * (nccl.STAMPS + nccl.RING))(), timeout)
    return comm


def until(condition, limit: float = 5.0) -> bool:
    """Whether `condition()` came true within `limit` seconds (polled)."""
    start = time.monotonic()
    while not condition() and time.monotonic() - start < limit:
        time.sleep(0.005)
    return condition()


def test_watchdog_aborts_an_all_reduce_unfinished_past_the_timeout_then_calls_raise():
    lib = FakeLib()
    comm = watched(lib, 0.2)
    words, x = comm._progress, torch.zeros(4)
    comm.all_reduce(x, x, stream=0)
    assert words[nccl.ISSUED] == 1 and comm.writes == [1]
    comm.capturing = True  # a captured call is not counted (its replays would write a stale number): marked
    comm.all_reduce(x, x, stream=7)
    assert words[nccl.ISSUED] == 1 and comm.writes == [1]
    begin, reduce, end = lib.calls[-3:]  # the all-reduce between its marks, on its stream
    assert begin == ("mark", b"begin", 7) and reduce[-1] == 7 and end == ("mark", b"end", 7)
    comm.capturing = False
    words[nccl.DONE] = 1  # the stream finished the first
    time.sleep(0.6)
    assert "ncclCommAbort" not in lib.calls and not words[nccl.ABORTED]
    comm.all_reduce(x, x, stream=0)  # never finishes: a peer skipped it
    start = time.monotonic()
    while not words[nccl.ABORTED] and time.monotonic() - start < 5:
        time.sleep(0.01)
    took = time.monotonic() - start
    assert words[nccl.ABORTED] and until(lambda: "ncclCommAbort" in lib.calls)
    assert lib.calls.count("ncclCommAbort") == 1
    assert 0.15 < took < 0.6, took  # the timeout, plus at most a poll (timeout / 4)
    calls = len(lib.calls)
    with pytest.raises(nccl.NcclTimeoutError, match=r"rank 0: an NCCL all-reduce did not finish within "
                                                    r"COMMFUSE_NCCL_TIMEOUT_S = 0.2 s"):
        comm.all_reduce(x, x, stream=0)
    assert len(lib.calls) == calls  # NCCL is not called again
    assert isinstance(comm.error(nccl.TIMED_OUT), nccl.NcclTimeoutError)  # a native launcher's report
    comm.close()
    assert "ncclCommDestroy" not in lib.calls  # aborted: nothing left to destroy


def test_watchdog_aborts_an_enqueue_that_waits_for_a_peer_and_the_call_raises_its_timeout(stub, stub_nccl, gen):
    """An ncclAllReduce whose enqueue itself waits in the host (the stub's stub_block_next: NCCL connecting to a peer
    that never comes) is counted when its enqueue begins: the watchdog aborts it the timeout later, which ends the
    wait, and the call raises NcclTimeoutError rather than the internal error NCCL returns then."""
    s = stub[1]
    comm = watched(stub_nccl.lib, 0.2, stub_nccl.init_rank(1, stub_nccl.unique_id(), 0), stub_nccl.path)
    words = comm._progress
    x = torch.randn(256, generator=gen)
    y = torch.full_like(x, float("nan"))
    comm.all_reduce(x, y, stream=0)  # the stub's sum of one rank: a copy
    assert torch.equal(y, x) and comm.writes == [1]
    words[nccl.DONE] = 1  # the stream got there
    aborted = s.stub_aborted()
    s.stub_block_next()
    start = time.monotonic()
    with pytest.raises(nccl.NcclTimeoutError, match="did not finish within COMMFUSE_NCCL_TIMEOUT_S = 0.2 s"):
        comm.all_reduce(x, y, stream=0)
    took = time.monotonic() - start
    assert 0.15 < took < 1.0, took  # the timeout, plus at most a poll (timeout / 4); the stub gives up at 20 s
    assert s.stub_aborted() == aborted + 1 and words[nccl.ABORTED]
    assert comm.writes == [1, 2]  # the failed call's number is written too
    comm.close()


def test_a_failed_enqueue_is_written_done_so_the_watchdog_leaves_the_communicator_alone():
    """An ncclAllReduce that fails at once was counted when it began: the stream is told to write its number
    anyway, so that the count catches up and the watchdog does not abort a communicator that works."""
    lib = FakeLib()
    comm = watched(lib, 0.2)
    words, x = comm._progress, torch.zeros(4)
    lib.fail = 5
    with pytest.raises(NcclError, match="^ncclAllReduce failed: invalid usage"):
        comm.all_reduce(x, x, stream=0)
    assert words[nccl.ISSUED] == 1 and comm.writes == [1]
    words[nccl.DONE] = 1  # the stream's write of it
    lib.fail = 0
    comm.all_reduce(x, x, stream=0)
    words[nccl.DONE] = 2
    time.sleep(0.5)
    assert not words[nccl.ABORTED] and "ncclCommAbort" not in lib.calls
    comm.close()


def test_a_native_launchers_failure_raises_the_communicators_own_error(stub, stub_nccl):
    """nccl.native_error, which the C++ launchers call with (code, the token of native_args): the error
    NcclComm.all_reduce raises for that communicator, with its rank and timeout, also where another
    communicator has the same handle (NCCL may reuse one after a close); a token of no live communicator
    still gets the type."""
    comm, twin = watched(FakeLib(), 0.5), watched(FakeLib(), 2)  # the same handle, 0xABC
    twin.rank, twin.label = 1, "rank 1"
    plain = attached(stub_nccl.lib, stub_nccl.init_rank(1, stub_nccl.unique_id(), 0), stub_nccl.path)
    assert plain.native_args(torch.float32, 8)[-1] == plain.token  # what a launcher is made with
    token = comm.token
    assert len({token, twin.token, plain.token}) == 3
    timed_out = nccl.native_error(nccl.TIMED_OUT, token)
    assert type(timed_out) is nccl.NcclTimeoutError and str(timed_out) == str(comm.timeout_error())
    assert "rank 0:" in str(timed_out) and "= 0.5 s" in str(timed_out)
    assert "rank 1:" in str(nccl.native_error(nccl.TIMED_OUT, twin.token))
    failed = nccl.native_error(5, token)
    assert type(failed) is NcclError and (failed.function, failed.code) == ("ncclAllReduce", 5)
    assert "invalid usage: detail of the failure" in str(failed)
    gone = max(comm.token, twin.token) + 1000
    assert type(nccl.native_error(nccl.TIMED_OUT, gone)) is nccl.NcclTimeoutError
    assert type(nccl.native_error(4, gone)) is NcclError
    comm.close()
    twin.close()


def test_without_replay_marks_a_captured_call_is_neither_marked_nor_stamped():
    """COMMFUSE_NCCL_WATCH_REPLAYS=0 (no marks: _marks None): captured all-reduces run bare, eager ones are
    stamped as before."""
    lib = FakeLib()
    comm = watched(lib, 5)
    comm._marks = None
    x = torch.zeros(4)
    comm.capturing = True
    comm.all_reduce(x, x, stream=3)
    assert not any(c[0] == "mark" for c in lib.calls if isinstance(c, tuple)) and comm.writes == []
    comm.capturing = False
    comm.all_reduce(x, x, stream=3)
    assert comm.writes == [1]
    comm._progress[nccl.DONE] = 1  # the stream got there (close() waits for it)
    comm.close()


def test_watchdog_aborts_a_replayed_all_reduce_begun_and_not_ended_past_the_timeout():
    """The marks of captured all-reduces: BEGUN ahead of ENDED for the timeout (the thread sees the same begun
    all-reduce that long) aborts; replays that keep going (BEGUN advancing, or ENDED catching up) do not."""
    lib = FakeLib()
    comm = watched(lib, 0.2)
    words = comm._progress
    for n in range(1, 13):  # replays that progress: a new all-reduce begun at every look
        words[nccl.BEGUN] = n
        time.sleep(0.06)
    words[nccl.ENDED] = 12
    time.sleep(0.4)
    assert not words[nccl.ABORTED] and "ncclCommAbort" not in lib.calls
    start = time.monotonic()
    words[nccl.BEGUN] = 13  # begun, never ended: a peer skipped the replayed all-reduce
    while not words[nccl.ABORTED] and time.monotonic() - start < 5:
        time.sleep(0.01)
    took = time.monotonic() - start
    assert words[nccl.ABORTED] and until(lambda: "ncclCommAbort" in lib.calls)
    assert lib.calls.count("ncclCommAbort") == 1
    assert 0.2 < took < 0.35, took  # the timeout, plus up to two polls (timeout / 4 each)
    with pytest.raises(nccl.NcclTimeoutError, match="replayed from a CUDA graph"):
        comm.check()
    with pytest.raises(nccl.NcclTimeoutError):
        comm.all_reduce(torch.zeros(4), torch.zeros(4), stream=0)


def test_watchdog_aborts_a_stuck_all_reduce_whose_stamp_a_busy_host_overwrote(monkeypatch):
    """The stamps are a ring: a host that issues RING calls past a stuck all-reduce overwrites its stamp with a
    fresh one. The finished count standing still for the timeout then says it is stuck (a ring of 16 here: the
    host below issues far more than 16 calls a timeout)."""
    monkeypatch.setattr(nccl, "RING", 16)
    lib = FakeLib()
    comm = watched(lib, 0.2)
    words = comm._progress
    x = torch.zeros(4)
    start = time.monotonic()
    while not words[nccl.ABORTED] and time.monotonic() - start < 3:
        comm.all_reduce(x, x, stream=0)  # none ever finishes: DONE stays 0
        time.sleep(0.001)
    took = time.monotonic() - start
    assert words[nccl.ABORTED] and until(lambda: "ncclCommAbort" in lib.calls)
    assert took < 0.7, took  # the timeout, plus up to two polls (timeout / 4 each)
    comm.close()


@pytest.mark.parametrize("closed", [False, True])
def test_the_abort_comes_a_grace_after_the_launchers_are_told(closed, monkeypatch):
    """A launcher reads ABORTED before each ncclAllReduce: one that read it just before the watchdog set it is
    on its way into NCCL, where the abort ends it, so the abort waits ABORT_GRACE_S after the flag instead of
    freeing the communicator under it. A close() within that grace aborts it (it must not be destroyed: an
    all-reduce of it never finished), and the watchdog's abort does not come again."""
    grace = 0.5  # longer than the library's, so that a loaded machine cannot blur it
    monkeypatch.setattr(nccl, "ABORT_GRACE_S", grace)
    lib = FakeLib()
    comm = watched(lib, 0.1)
    words = comm._progress
    comm.all_reduce(torch.zeros(4), torch.zeros(4), stream=0)  # never finishes
    assert until(lambda: words[nccl.ABORTED])
    flagged = time.monotonic()
    assert "ncclCommAbort" not in lib.calls
    if closed:
        comm.close()
        time.sleep(1.5 * grace)
        assert lib.calls.count("ncclCommAbort") == 1 and "ncclCommDestroy" not in lib.calls
        assert lib.aborted_at - flagged < grace / 2
        return
    assert until(lambda: "ncclCommAbort" in lib.calls)
    assert lib.aborted_at - flagged > grace / 2
    comm.close()
    assert lib.calls.count("ncclCommAbort") == 1 and "ncclCommDestroy" not in lib.calls


class FailingLib(FakeLib):
    """A library whose communicator holds an asynchronous error (a peer's connection lost: ncclRemoteError)."""

    def ncclCommGetAsyncError(self, handle, code):
        code._obj.value = 6
        return 0


@pytest.mark.parametrize("outcome", ["finishes", "fails", "stuck"])
def test_close_waits_for_unfinished_all_reduces_their_failure_or_the_watchdogs_abort(outcome):
    """NCCL's destroy waits for the communicator's unfinished all-reduces, for good where a peer never comes:
    close() lets them finish (then destroys), aborts at once where NCCL has seen them fail, or waits for the
    watchdog's abort (then does not destroy)."""
    lib = FailingLib() if outcome == "fails" else FakeLib()
    comm = watched(lib, 0.2 if outcome != "fails" else 5.0)
    words = comm._progress
    comm.all_reduce(torch.zeros(4), torch.zeros(4), stream=0)
    if outcome == "finishes":
        threading.Timer(0.1, lambda: words.__setitem__(nccl.DONE, 1)).start()  # the stream gets there
    start = time.monotonic()
    comm.close()
    took = time.monotonic() - start
    if outcome == "finishes":
        assert 0.08 < took < 0.5 and "ncclCommDestroy" in lib.calls and "ncclCommAbort" not in lib.calls, took
    elif outcome == "fails":  # not the watchdog's 5 s
        assert took < 0.5 and lib.calls.count("ncclCommAbort") == 1 and "ncclCommDestroy" not in lib.calls, took
    else:
        assert took < 1.0 and lib.calls.count("ncclCommAbort") == 1 and "ncclCommDestroy" not in lib.calls, took


def test_failed_says_whether_the_communicator_can_carry_more_all_reduces():
    """What a new Communicator of the group asks (nccl.shared_usable) before it takes the group's communicator."""
    fine = attached(FakeLib())
    assert not fine.failed
    assert attached(FailingLib()).failed  # an asynchronous error: a peer failed
    fine.close()
    assert fine.failed
    aborted = watched(FakeLib(), 0.1)
    aborted.all_reduce(torch.zeros(4), torch.zeros(4), stream=0)  # never finishes: the watchdog aborts it
    assert until(lambda: aborted.failed)


def test_watchdog_stops_at_close():
    lib = FakeLib()
    comm = watched(lib, 0.1)
    comm.close()
    comm._progress[nccl.ISSUED] = 5  # as if calls were left unfinished: a closed communicator is not aborted
    time.sleep(0.3)
    assert "ncclCommAbort" not in lib.calls


# --------------------------------------------------------------------------- loading


def test_missing_override_is_unavailable_with_the_path(monkeypatch, tmp_path):
    missing = str(tmp_path / "libnccl.so.2")
    monkeypatch.setenv("COMMFUSE_NCCL_LIBRARY", missing)
    reason = nccl.available()
    assert isinstance(reason, str) and reason.startswith("no NCCL library could be loaded")
    assert f"COMMFUSE_NCCL_LIBRARY {missing}" in reason
    with pytest.raises(NcclUnavailable, match="COMMFUSE_NCCL_LIBRARY") as info:
        NcclComm(None, torch.device("cuda", 0))  # fails before it touches the group or the device
    assert isinstance(info.value, RuntimeError)


def test_a_library_without_nccls_functions_is_unavailable(monkeypatch):
    monkeypatch.setenv("COMMFUSE_NCCL_LIBRARY", "libc.so.6")
    assert "the library has no ncclGetVersion" in nccl.available()


@pytest.mark.skipif(NCCL_REASON is None, reason="NCCL is installed here")
def test_available_says_what_was_tried_without_nccl():
    assert "cuda.pathfinder" in NCCL_REASON and "loader path libnccl.so.2" in NCCL_REASON
    with pytest.raises(NcclUnavailable, match="libnccl.so.2"):
        NcclComm(None, torch.device("cuda", 0))


# --------------------------------------------------------------------------- a stub libnccl (real ctypes calls)


@pytest.fixture(scope="session")
def stub():
    """(the stub libnccl's path, its ctypes handle for the stub_* functions)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler for the stub libnccl")
    # A folder of this process's own: pytest's numbered temporary folders are shared by the MPI ranks.
    folder = tempfile.TemporaryDirectory(prefix="commfuse-nccl-stub-")
    path = Path(folder.name) / "libnccl_stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(path), str(Path(__file__).with_name("nccl_stub.c"))],
                   check=True)
    lib = ctypes.CDLL(str(path))
    for name in ("stub_last_send", "stub_last_recv", "stub_last_stream"):
        getattr(lib, name).restype = c_void_p
    lib.stub_last_count.restype = c_size_t
    yield str(path), lib
    folder.cleanup()


@pytest.fixture
def stub_nccl(stub, monkeypatch):
    monkeypatch.setenv("COMMFUSE_NCCL_LIBRARY", stub[0])
    assert nccl.available() is None
    return nccl.library()


def test_stub_round_trips_the_unique_id_by_value(stub, stub_nccl):
    assert stub_nccl.path == stub[0] and stub_nccl.version() == "2.28.9"
    uid = stub_nccl.unique_id()
    assert uid == bytes((i * 7 + 3) & 0xFF for i in range(128))
    handle = stub_nccl.init_rank(5, uid[::-1], 3)
    got = nccl.UniqueId()
    stub[1].stub_last_id(ctypes.byref(got))
    assert bytes(got) == uid[::-1] and (stub[1].stub_last_nranks(), stub[1].stub_last_rank()) == (5, 3)
    assert handle


@pytest.mark.parametrize("dtype", list(nccl.NCCL_DTYPES))
def test_stub_all_reduce_sees_64_bit_pointers_and_the_count(stub, stub_nccl, dtype):
    s = stub[1]
    comm = attached(stub_nccl.lib, stub_nccl.init_rank(1, stub_nccl.unique_id(), 0), stub_nccl.path)
    send = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    before = send.clone()
    recv = torch.full((1000,), float("nan"), dtype=dtype)
    comm.all_reduce(send, recv, stream=0x7F0000001234)
    assert (s.stub_last_send(), s.stub_last_recv()) == (send.data_ptr(), recv.data_ptr())
    assert (s.stub_last_count(), s.stub_last_datatype(), s.stub_last_op()) == (1000, nccl.NCCL_DTYPES[dtype], 0)
    assert s.stub_last_stream() == 0x7F0000001234
    assert torch.equal(recv, send) and torch.equal(send, before)  # the stub's one-rank sum: a copy


def test_stub_errors_carry_nccls_strings(stub, stub_nccl):
    s = stub[1]
    comm = attached(stub_nccl.lib, stub_nccl.init_rank(1, stub_nccl.unique_id(), 0), stub_nccl.path)
    x = torch.zeros(4)
    s.stub_fail_next(5)
    with pytest.raises(NcclError, match=r"^ncclAllReduce failed: invalid usage \(run with NCCL_DEBUG=WARN for "
                                        r"details\): stub: the last error \(ncclResult_t 5\)$"):
        comm.all_reduce(x, x, stream=0)
    s.stub_fail_next(4)
    with pytest.raises(NcclError, match="ncclCommInitRank failed: invalid argument"):
        stub_nccl.init_rank(1, bytes(128), 0)
    s.stub_set_async_error(6)  # ncclRemoteError: a peer failed
    with pytest.raises(NcclError, match="^ncclCommGetAsyncError failed: unknown result code"):
        comm.check()
    destroyed, aborted = s.stub_destroyed(), s.stub_aborted()
    comm.close()  # an errored communicator is aborted, not destroyed (which could wait forever)
    assert (s.stub_destroyed(), s.stub_aborted()) == (destroyed, aborted + 1)
    s.stub_set_async_error(0)
    comm = attached(stub_nccl.lib, stub_nccl.init_rank(1, stub_nccl.unique_id(), 0), stub_nccl.path)
    comm.check()
    comm.close()
    comm.close()
    assert (s.stub_destroyed(), s.stub_aborted()) == (destroyed + 1, aborted + 1)


# --------------------------------------------------------------------------- the unique id over a group (MPI)


@pytest.fixture(scope="module")
def gloo_group(comm):
    """WORLD when it is gloo, else a gloo group over the same ranks (so this runs on GPU machines too)."""
    world = dist.group.WORLD
    return world if dist.get_backend(world) == "gloo" else dist.new_group(backend="gloo")


@mpi(min_size=2)
def test_unique_id_is_made_on_rank_0_and_reaches_every_rank(gloo_group):
    rank, world = dist.get_rank(gloo_group), dist.get_world_size(gloo_group)
    made = []

    def make_id():
        made.append(rank)
        return bytes(torch.randint(0, 256, (128,), dtype=torch.uint8).tolist())

    uid = nccl.broadcast_unique_id(gloo_group, make_id)
    ids: list = [None] * world
    dist.all_gather_object(ids, (uid, made), group=gloo_group)
    assert [m for _, m in ids] == [[0]] + [[]] * (world - 1)  # made once, on rank 0
    assert len(uid) == 128 and all(u == uid for u, _ in ids)


@mpi(min_size=2)
def test_a_unique_id_that_rank_0_cannot_make_raises_on_every_rank(gloo_group):
    """ncclGetUniqueId failing on rank 0 (NCCL's bootstrap finds no interface, say): every rank raises, rank 0
    its own error, rather than the others waiting for the id until the group's timeout."""
    def make_id():
        raise nccl.NcclError("ncclGetUniqueId", 2, "no socket interface found")

    with pytest.raises(Exception, match="no socket interface found"):
        nccl.broadcast_unique_id(gloo_group, make_id)
    if dist.get_rank(gloo_group) == 0:
        with pytest.raises(nccl.NcclError):
            nccl.broadcast_unique_id(gloo_group, make_id)
    else:
        with pytest.raises(RuntimeError, match="rank 0 could not make the NCCL unique id: NcclError"):
            nccl.broadcast_unique_id(gloo_group, make_id)


@mpi(min_size=2)
def test_unique_id_over_a_subgroup_comes_from_its_first_rank(gloo_group):
    world = dist.get_world_size(gloo_group)
    ranks = list(range(1, world))  # not WORLD's rank 0: the broadcast's source is a group rank
    sub = dist.new_group(ranks, backend="gloo")
    me = dist.get_rank()
    uid = nccl.broadcast_unique_id(sub, lambda: bytes([me]) * 128) if me in ranks else None
    ids: list = [None] * world
    dist.all_gather_object(ids, uid, group=gloo_group)
    assert ids == [None] + [bytes([1]) * 128] * (world - 1)


@mpi(min_size=2)
def test_every_rank_inits_the_stub_with_rank_0s_id(gloo_group, stub, stub_nccl):
    rank, world = dist.get_rank(gloo_group), dist.get_world_size(gloo_group)
    made = stub_nccl.unique_id() if rank == 0 else None
    uid = nccl.broadcast_unique_id(gloo_group, stub_nccl.unique_id)
    stub_nccl.init_rank(world, uid, rank)
    seen = nccl.UniqueId()
    stub[1].stub_last_id(ctypes.byref(seen))
    ids: list = [None] * world
    dist.all_gather_object(ids, bytes(seen), group=gloo_group)
    assert all(i == ids[0] for i in ids)
    assert rank != 0 or ids[0] == made
    assert (stub[1].stub_last_nranks(), stub[1].stub_last_rank()) == (world, rank)


class InitLib(FakeLib):
    """A fake NCCL whose ncclCommInitRank does what `plan` says: "ok" (a handle at once), "fail" (ncclUnhandledCudaError,
    1) or "wait" (a handle once `release` is set, as NCCL's init waits for a rank that never comes); it records the
    handles it aborts and destroys."""

    HANDLE = 0x5EED

    def __init__(self, plan):
        super().__init__()
        self.plan, self.release, self.aborted = plan, threading.Event(), []

    def ncclGetErrorString(self, code):
        return b"unhandled cuda error" if code == 1 else super().ncclGetErrorString(code)

    def ncclCommInitRank(self, handle, world, uid, rank):
        if self.plan == "fail":
            return 1
        if self.plan == "wait":
            self.release.wait()
        handle._obj.value = self.HANDLE
        return 0

    def ncclCommAbort(self, handle):
        self.aborted.append(handle)
        return 0


def agree_on_init(group, plan, timeout=10.0):
    """init_agreed over `group` with this rank's InitLib(plan) (or `plan`, a fake library) and a key of this attempt:
    (lib, handle or the error, seconds taken)."""
    lib = InitLib(plan) if isinstance(plan, str) else plan
    made = nccl.broadcast_unique_id(group, lambda: bytes(128) + torch.randint(0, 256, (16,)).byte().numpy().tobytes())
    start = time.monotonic()
    try:
        got = nccl.init_agreed(nccl.Nccl(lib, "fake"), group, made[:128], "test/" + made[128:].hex(), -1, timeout)
    except Exception as e:  # noqa: BLE001 - what the test looks at
        got = e
    return lib, got, time.monotonic() - start


def abandoned_handle_is_aborted(lib):
    """Let a waiting fake init finish: the thread that init_agreed gave up on aborts the handle it gets."""
    lib.release.set()
    for _ in range(200):
        if lib.aborted:
            break
        time.sleep(0.01)
    return lib.aborted == [InitLib.HANDLE]


@mpi(min_size=2)
def test_every_rank_gets_its_nccl_handle_when_every_init_succeeds(gloo_group):
    lib, got, _ = agree_on_init(gloo_group, "ok")
    assert got == InitLib.HANDLE and lib.aborted == []


@mpi(min_size=2)
def test_a_failed_nccl_init_on_one_rank_raises_on_every_rank_without_waiting_for_it(gloo_group):
    """The last rank's init fails; the others' wait in NCCL for it for good (a bound of 10 s that must not be
    needed): every rank raises at once, the others naming the failed rank's error, and no rank keeps a
    communicator."""
    rank, last = dist.get_rank(gloo_group), dist.get_world_size(gloo_group) - 1
    lib, got, took = agree_on_init(gloo_group, "fail" if rank == last else "wait")
    assert isinstance(got, NcclError) and got.code == 1 and took < 5, (got, took)
    if rank == last:
        assert str(got).startswith("ncclCommInitRank failed: unhandled cuda error")
    else:
        assert f"rank {last}: ncclCommInitRank failed: unhandled cuda error" in str(got)
        assert "was not made on every rank" in str(got)
        assert abandoned_handle_is_aborted(lib)


@mpi(min_size=2)
@pytest.mark.parametrize("late", ["first", "last"])
def test_an_nccl_init_that_never_finishes_raises_its_timeout_on_every_rank(gloo_group, late, monkeypatch):
    """One rank's init never returns: after the bound every rank raises NcclTimeoutError saying so, and the ranks
    whose init finished abort their communicators."""
    monkeypatch.setattr(nccl, "INIT_FLOOR_S", 0.3)
    rank, world = dist.get_rank(gloo_group), dist.get_world_size(gloo_group)
    stuck = 0 if late == "first" else world - 1
    lib, got, took = agree_on_init(gloo_group, "wait" if rank == stuck else "ok", timeout=0.3)
    dist.barrier(group=gloo_group)
    # Each rank counts its 0.3 s from its own start; the first rank to reach the bound tells the others.
    assert isinstance(got, nccl.NcclTimeoutError) and 0.1 < took < 5, (got, took)
    assert "was not made on every rank" in str(got) and "within 0.3 s" in str(got)
    assert (f"{world - 1} of {world} ranks' ncclCommInitRank finished" in str(got)
            or f"rank {stuck}: its ncclCommInitRank did not finish" in str(got))
    if rank == stuck:
        assert abandoned_handle_is_aborted(lib)
    else:
        assert lib.aborted == [InitLib.HANDLE]


class SlowStore:
    """A store whose compare_set takes `delay` s more: a rank's write of the outcome lands late."""

    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    def compare_set(self, *args):
        time.sleep(self.delay)
        return self.inner.compare_set(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@mpi(min_size=2)
def test_one_outcome_for_every_rank_where_a_deadline_passes_as_the_last_init_finishes(gloo_group, monkeypatch):
    """Rank 0's bound (0.3 s) passes with 1 init of 2 finished; the last finishes at 0.5 s, while rank 0's write of
    its timeout is still on its way: either every rank keeps the communicator or none does."""
    rank, world = dist.get_rank(gloo_group), dist.get_world_size(gloo_group)
    monkeypatch.setattr(nccl, "INIT_FLOOR_S", 0.3)
    real = dist.distributed_c10d._get_default_store
    if rank == 0:
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: SlowStore(real(), 1.0))
    lib = InitLib("ok" if rank == 0 else "wait")
    if rank != 0:
        threading.Timer(0.5, lib.release.set).start()
    _, got, _ = agree_on_init(gloo_group, lib, timeout=0.3 if rank == 0 else 5.0)
    every: list = [None] * world
    dist.all_gather_object(every, isinstance(got, int), group=gloo_group)
    assert len(set(every)) == 1, (rank, got, every)


class _FailsLate(InitLib):
    def ncclCommInitRank(self, handle, world, uid, rank):
        time.sleep(0.1)  # past init_agreed's first look
        return 1


class _EndsBeforeIsAlive:
    """threading for init_agreed whose threads end just before is_alive() answers: the init thread fails between
    the waiting thread's look at its error and its look at whether it is still running."""

    class Thread(threading.Thread):
        def is_alive(self):
            super().join()
            return super().is_alive()

    Lock = threading.Lock


@mpi(min_size=2)
def test_an_init_failing_between_the_looks_is_not_counted_finished(gloo_group, monkeypatch):
    """Rank 0's init fails just as it looks: it must raise its NcclError, not count itself finished and leave the
    others a communicator (nor raise KeyError)."""
    rank, world = dist.get_rank(gloo_group), dist.get_world_size(gloo_group)
    if rank == 0:
        monkeypatch.setattr(nccl, "threading", _EndsBeforeIsAlive)
    _, got, _ = agree_on_init(gloo_group, _FailsLate("fail") if rank == 0 else "ok")
    every: list = [None] * world
    dist.all_gather_object(every, type(got).__name__, group=gloo_group)
    assert every == ["NcclError"] * world, every


# --------------------------------------------------------------------------- NCCL on GPUs


@pytest.fixture(scope="module")
def solo(comm):
    """A one-rank NcclComm per rank, over a gloo group of its own (every rank makes every group)."""
    if not torch.cuda.is_available() or NCCL_REASON is not None:
        pytest.skip(f"needs CUDA and NCCL ({NCCL_REASON or 'no CUDA GPU'})")
    groups = [dist.new_group([r], backend="gloo") for r in range(dist.get_world_size())]
    c = NcclComm(groups[dist.get_rank()], torch.device("cuda", torch.cuda.current_device()))
    yield c
    c.close()


@pytest.fixture(scope="module")
def pair(comm):
    """A NcclComm over WORLD, where WORLD is NCCL over 2+ ranks (one GPU each)."""
    world = dist.group.WORLD
    if NCCL_REASON is not None or dist.get_world_size() < 2 or dist.get_backend(world) != "nccl":
        pytest.skip("needs NCCL over 2+ ranks, one GPU per rank (mpirun -n 2 on a GPU machine)")
    c = NcclComm(world, torch.device("cuda"))
    yield c
    c.close()


def _poisoned_like(x):
    out = torch.empty_like(x)
    out.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype here: an element left unwritten stays NaN
    return out


@mpi
@needs_nccl_gpu
@pytest.mark.parametrize("dtype", list(nccl.NCCL_DTYPES))
def test_one_rank_all_reduce_is_a_copy(solo, gen, dtype):
    assert solo.version == ".".join(map(str, torch.cuda.nccl.version()[:3]))  # the NCCL torch uses
    x = torch.randn(4097, generator=gen).to(dtype).cuda()
    before, recv = x.clone(), _poisoned_like(x)
    solo.all_reduce(x, recv)
    torch.cuda.synchronize()
    assert torch.equal(recv, x) and torch.equal(x, before)


@mpi
@needs_nccl_gpu
def test_the_stream_reports_each_eager_all_reduce_and_each_replayed_one(solo, gen):
    """The watchdog's words: every eager all-reduce is counted and its number written by the stream when it is
    done; one captured in a CUDA graph is not counted at capture, and each replay's marks count it in BEGUN and
    ENDED (commfuse.kernels.nccl_mark)."""
    words = solo._progress
    x = torch.randn(4096, generator=gen).cuda()
    y = torch.empty_like(x)
    issued, begun = words[nccl.ISSUED], words[nccl.BEGUN]
    for _ in range(3):
        solo.all_reduce(x, y)
    torch.cuda.synchronize()
    assert words[nccl.ISSUED] == issued + 3 and words[nccl.DONE] == issued + 3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        solo.all_reduce(x, y)
        solo.all_reduce(y, y)
    assert words[nccl.BEGUN] == words[nccl.ENDED] == begun  # capturing runs nothing
    y.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert words[nccl.ISSUED] == words[nccl.DONE] == issued + 3
    assert words[nccl.BEGUN] == words[nccl.ENDED] == begun + 6
    assert torch.equal(y, x)


@mpi
@needs_nccl_gpu
def test_a_communicators_native_launchers_report_their_all_reduces(comm, gen):
    """The C++ launchers of the NCCL route (a plain all-reduce, and one with the fused tail) count each call
    and have the stream write its number, as NcclComm.all_reduce does."""
    import commfuse
    from commfuse.kernels import native

    c = commfuse.Communicator(comm.group, strategy="nccl")  # the route, also for one rank
    c.check_calls = False  # the check's gather would not be captured
    if c._nccl is None or native.unavailable() is not None:
        pytest.skip(f"needs the NCCL route's native launchers ({native.unavailable() or 'no commfuse.nccl here'})")
    words = c._nccl._progress
    x, r = (torch.randn(8, 4096, generator=gen).bfloat16().cuda() for _ in range(2))
    w = torch.randn(4096, generator=gen).bfloat16().cuda()
    issued = words[nccl.ISSUED]
    c.all_reduce(x)
    c.fused_all_reduce(x, r, w)
    torch.cuda.synchronize()
    assert words[nccl.ISSUED] == words[nccl.DONE] == issued + 2
    # Captured, the same launchers put each all-reduce between the marks that its replays count.
    begun = words[nccl.BEGUN]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        c.all_reduce(x)
        c.fused_all_reduce(x, r, w)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert words[nccl.BEGUN] == words[nccl.ENDED] == begun + 4
    assert words[nccl.ISSUED] == words[nccl.DONE] == issued + 2
    c.close()


@mpi
@needs_nccl_gpu
def test_the_watchdog_aborts_a_stalled_all_reduce_and_later_calls_raise(comm, gen, monkeypatch):
    """A one-rank communicator with a 1 s watchdog: an all-reduce queued behind 3 s of GPU spin (standing for
    a peer that never comes) is aborted about 1 s after its enqueue, the stream then drains (no hang), and
    the next call raises NcclTimeoutError."""
    groups = [dist.new_group([r], backend="gloo") for r in range(dist.get_world_size())]
    monkeypatch.setenv("COMMFUSE_NCCL_TIMEOUT_S", "1")
    c = NcclComm(groups[dist.get_rank()], torch.device("cuda", torch.cuda.current_device()))
    words = c._progress
    x = torch.randn(4096, generator=gen).cuda()
    y = torch.empty_like(x)
    c.all_reduce(x, y)
    torch.cuda.synchronize()
    assert words[nccl.DONE] == words[nccl.ISSUED] == 1
    torch.cuda._sleep(6 * 10 ** 9)  # cycles: 3 s at the H200's 1.98 GHz, longer at a lower clock
    start = time.monotonic()
    c.all_reduce(x, y)
    while not words[nccl.ABORTED] and time.monotonic() - start < 10:
        time.sleep(0.01)
    took = time.monotonic() - start
    assert words[nccl.ABORTED] and 0.9 < took < 2.0, took
    torch.cuda.synchronize()
    with pytest.raises(nccl.NcclTimeoutError, match="did not finish within COMMFUSE_NCCL_TIMEOUT_S = 1 s"):
        c.all_reduce(x, y)
    c.close()


@mpi
@needs_nccl_gpu
def test_an_aborted_route_raises_nccl_timeout_error_eager_through_torch_ops_and_compiled(comm, gen, monkeypatch):
    """A Communicator on a one-rank NCCL group of each rank's own, with a 1 s watchdog: after the watchdog aborted
    an all-reduce (queued behind 3 s of GPU spin), every later call raises NcclTimeoutError, naming the rank and
    the timeout, on every path to the native launchers: the eager call (the C++ table), torch.ops (the op's C++
    kernel) and a compiled graph, where a RuntimeError of the C++ kernel's would escape an `except
    NcclTimeoutError`. A Communicator made later on the group makes the group's NCCL communicator anew, and works."""
    import commfuse

    if dist.get_backend(comm.group) != "nccl":
        pytest.skip("needs NCCL groups (ranks sharing a GPU run gloo)")
    from commfuse.kernels import native

    if native.unavailable():
        pytest.skip(f"the native launchers are off: {native.unavailable()}")
    monkeypatch.setenv("COMMFUSE_NCCL_TIMEOUT_S", "1")
    groups = [dist.new_group([r], backend="nccl") for r in range(dist.get_world_size())]
    c = commfuse.Communicator(groups[dist.get_rank()], strategy="nccl")  # one rank runs NCCL only where forced
    c.check_calls = False  # COMMFUSE_CHECK's comparison is a Python launcher: the op kernels would not run C++
    x = torch.randn(16, 4096, generator=gen).to(torch.bfloat16).cuda()
    r, w = torch.randn_like(x), torch.randn(4096, generator=gen).to(torch.bfloat16).cuda()
    torch.testing.assert_close(c.all_reduce(x), x, rtol=0, atol=0)  # the route works, and its launcher is cached
    c.fused_all_reduce(x, r.clone(), w)
    words = c._nccl._progress
    torch.cuda._sleep(6 * 10 ** 9)  # cycles: 3 s at the H200's 1.98 GHz, longer at a lower clock
    c.all_reduce(x)
    start = time.monotonic()
    while not words[nccl.ABORTED] and time.monotonic() - start < 10:
        time.sleep(0.01)
    assert words[nccl.ABORTED]
    torch.cuda.synchronize()
    expected = "rank 0: an NCCL all-reduce did not finish within COMMFUSE_NCCL_TIMEOUT_S = 1 s"  # of its group
    with pytest.raises(nccl.NcclTimeoutError, match=expected):
        c.all_reduce(x)
    with pytest.raises(nccl.NcclTimeoutError, match=expected):
        c.fused_all_reduce(x, r.clone(), w)
    with pytest.raises(nccl.NcclTimeoutError, match=expected):
        torch.ops.commfuse.all_reduce(x, c.name)
    compiled = torch.compile(lambda a: commfuse.ops.all_reduce(c, a * 2) + 1, fullgraph=True)
    with pytest.raises(nccl.NcclTimeoutError, match=expected):
        compiled(x)
    # the group's communicator made anew, and working
    fresh = commfuse.Communicator(groups[dist.get_rank()], strategy="nccl")
    assert fresh._nccl is not c._nccl and not fresh._nccl.failed
    torch.testing.assert_close(fresh.all_reduce(x), x, rtol=0, atol=0)
    c.close()
    fresh.close()


@mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the native launchers)")
def test_an_nccl_error_in_a_native_launcher_raises_nccl_error_eager_through_torch_ops_and_compiled(comm, stub,
                                                                                                   stub_nccl, gen):
    """The stub on the GPU behind a Communicator of a one-rank NCCL group: an ncclAllReduce that returns an error
    (stub_fail_next) inside a native launcher raises NcclError with NCCL's words on every path, and the next
    call works (the error was the call's, not the communicator's)."""
    import commfuse

    with _stub_communicator(comm, stub) as c:
        x = torch.randn(16, 4096, generator=gen).to(torch.bfloat16).cuda()
        assert torch.equal(c.all_reduce(x), x)  # the stub's sum of one rank: a copy; the launcher is cached
        compiled = torch.compile(lambda a: commfuse.ops.all_reduce(c, a * 2) + 1, fullgraph=True)
        assert torch.equal(compiled(x), x * 2 + 1)
        calls = ((lambda: c.all_reduce(x), x), (lambda: torch.ops.commfuse.all_reduce(x, c.name), x),
                 (lambda: compiled(x), x * 2 + 1))
        for call, want in calls:
            stub[1].stub_fail_next(5)
            with pytest.raises(NcclError, match="^ncclAllReduce failed: invalid usage"):
                call()
            assert torch.equal(call(), want)


@contextlib.contextmanager
def _stub_communicator(comm, stub):
    """A Communicator of a one-rank NCCL group of each rank's own, over the stub on the GPU (its all-reduces
    through the native launchers); closed after. Skips where the ranks share a GPU or the launchers are off."""
    import commfuse
    from commfuse.kernels import native

    if dist.get_backend(comm.group) != "nccl":
        pytest.skip("needs NCCL groups (ranks sharing a GPU run gloo)")
    if native.unavailable():
        pytest.skip(f"the native launchers are off: {native.unavailable()}")
    assert stub[1].stub_on_device(1) == 0, "libcuda's functions for the stub"
    try:
        groups = [dist.new_group([r], backend="nccl") for r in range(dist.get_world_size())]
        c = commfuse.Communicator(groups[dist.get_rank()], strategy="nccl")  # one rank runs NCCL only where forced
        c.check_calls = False  # COMMFUSE_CHECK's comparison is a Python launcher: the op kernels would not run C++
        assert c._nccl is not None and c._nccl.nccl.path == stub[0], c.nccl_binding
        yield c
        c.close()
    finally:
        stub[1].stub_on_device(0)


@mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the native launchers)")
@pytest.mark.parametrize("path", ["eager", "eager fused", "torch.ops", "compiled"])
def test_the_watchdog_ends_an_enqueue_that_waits_for_a_peer_inside_a_native_launcher(comm, stub, stub_nccl, gen,
                                                                                     monkeypatch, path):
    """The stub on the GPU behind a Communicator of a one-rank NCCL group with a 1 s watchdog: an ncclAllReduce
    whose enqueue waits in the host (stub_block_next) inside a native launcher is aborted by the watchdog's thread
    about 1 s later, and the call raises NcclTimeoutError, on every path to the launchers. The eager calls run them
    from the plan table's binding, which lets go of the GIL for the launch as torch's ops do: holding it there,
    the watchdog's thread could not run, and the process froze (here until the stub gives up after 20 s)."""
    import commfuse

    monkeypatch.setenv("COMMFUSE_NCCL_TIMEOUT_S", "1")
    with _stub_communicator(comm, stub) as c:
        x = torch.randn(16, 4096, generator=gen).to(torch.bfloat16).cuda()
        r, w = torch.randn_like(x), torch.randn(4096, generator=gen).to(torch.bfloat16).cuda()
        compiled = torch.compile(lambda a: commfuse.ops.all_reduce(c, a * 2) + 1, fullgraph=True)
        call, want = {
            "eager": (lambda: c.all_reduce(x), x),
            "eager fused": (lambda: c.fused_all_reduce(x, r, w, quant=None).residual, x + r),
            "torch.ops": (lambda: torch.ops.commfuse.all_reduce(x, c.name), x),
            "compiled": (lambda: compiled(x), x * 2 + 1),
        }[path]
        assert torch.equal(call(), want)  # the launcher is cached
        torch.cuda.synchronize()
        stub[1].stub_block_next()
        start = time.monotonic()
        with pytest.raises(nccl.NcclTimeoutError, match="did not finish within COMMFUSE_NCCL_TIMEOUT_S = 1 s"):
            call()
        took = time.monotonic() - start
        assert 0.9 < took < 3.0, took  # the timeout plus a poll (0.25 s), not the stub's 20 s
        torch.cuda.synchronize()


@mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the stub's hung all-reduce is a stream wait)")
def test_the_watchdog_aborts_a_hung_all_reduce_replayed_from_a_cuda_graph(comm, stub, stub_nccl, monkeypatch, gen):
    """The stub on the GPU, a one-rank communicator with a 1 s watchdog: an all-reduce captured in a CUDA graph
    whose replay never finishes (a stream wait that only ncclCommAbort ends, standing for a peer that skipped
    the call) is aborted the timeout after the watchdog saw it begin; the replay then drains (no hang), and
    check() and the next call raise NcclTimeoutError."""
    s = stub[1]
    assert s.stub_on_device(1) == 0, "libcuda's functions for the stub"
    try:
        groups = [dist.new_group([r], backend="gloo") for r in range(dist.get_world_size())]
        monkeypatch.setenv("COMMFUSE_NCCL_TIMEOUT_S", "1")
        c = NcclComm(groups[dist.get_rank()], torch.device("cuda", torch.cuda.current_device()))
        words = c._progress
        x = torch.randn(4096, generator=gen).cuda()
        y = _poisoned_like(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
        for hang, graph in enumerate(graphs):
            s.stub_hang_next(hang)  # what the stub enqueues is fixed at capture: the second graph's all-reduce hangs
            with torch.cuda.stream(side), torch.cuda.graph(graph):
                c.all_reduce(x, y)
        graphs[0].replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x) and words[nccl.BEGUN] == words[nccl.ENDED] == 1 and not words[nccl.ABORTED]
        start = time.monotonic()
        graphs[1].replay()
        while not words[nccl.ABORTED] and time.monotonic() - start < 10:
            time.sleep(0.01)
        took = time.monotonic() - start
        assert words[nccl.ABORTED] and until(lambda: s.stub_aborted() >= 1)
        assert 0.9 < took < 2.0, took  # the timeout, plus up to two polls (0.25 s each)
        torch.cuda.synchronize()  # the abort ended the wait: the stream drains
        assert words[nccl.BEGUN] == words[nccl.ENDED] == 2
        with pytest.raises(nccl.NcclTimeoutError, match="replayed from a CUDA graph"):
            c.check()
        with pytest.raises(nccl.NcclTimeoutError):
            c.all_reduce(x, y)
        c.close()
    finally:
        s.stub_on_device(0)


@mpi
@needs_nccl_gpu
def test_wrong_dtype_raises_type_error_naming_the_argument(solo):
    x = torch.zeros(16, device="cuda")
    with pytest.raises(TypeError, match="^send has dtype torch.float64"):
        solo.all_reduce(x.double(), x.double())
    with pytest.raises(TypeError, match="^recv has dtype torch.float16"):
        solo.all_reduce(x, x.half())


def _rank_inputs(gen, world, shape, dtype, integers=0):
    """Every rank's input (the same on every rank): integers in [-integers, integers] where given, else normal."""
    xs = [torch.randint(-integers, integers + 1, shape, generator=gen).float() if integers
          else torch.randn(shape, generator=gen) for _ in range(world)]
    return [x.to(dtype).cuda() for x in xs]


@mpi(min_size=2)
@needs_nccl_gpu
@pytest.mark.parametrize("shape", [(1,), (7, 4096), (3, 2880), (1 << 20,)])
def test_all_reduce_equals_the_sum_exactly_in_fp32(pair, gen, shape):
    xs = _rank_inputs(gen, pair.world_size, shape, torch.float32, integers=1000)
    x = xs[pair.rank]
    before, recv = x.clone(), _poisoned_like(x)
    pair.all_reduce(x, recv)
    torch.cuda.synchronize()
    assert torch.equal(x, before), "all_reduce modified send"
    assert torch.equal(recv, sum(xs))  # integers below 2^24: every order of summation is exact


@mpi(min_size=2)
@needs_nccl_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 256), (64, 4096), (3, 2880)])
def test_all_reduce_matches_torch_distributed(pair, gen, dtype, shape):
    x = _rank_inputs(gen, pair.world_size, shape, dtype)[pair.rank]
    before, recv, inplace = x.clone(), _poisoned_like(x), x.clone()
    expect = x.clone()
    dist.all_reduce(expect)
    pair.all_reduce(x, recv)
    pair.all_reduce(inplace, inplace)
    torch.cuda.synchronize()
    assert torch.equal(x, before), "all_reduce modified send"
    if pair.world_size == 2:  # one addition, whatever the algorithm: bit for bit
        assert torch.equal(recv, expect) and torch.equal(inplace, expect)
    else:
        assert_within_ulp(recv, expect, pair.world_size, "NcclComm vs torch.distributed")
        assert_within_ulp(inplace, expect, pair.world_size, "NcclComm in place vs torch.distributed")


@mpi(min_size=2)
@needs_nccl_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_all_reduce_in_a_cuda_graph_replays_the_same_sums(pair, gen, dtype):
    # |sum| <= 8 * 16: integers that bf16's 8-bit significand holds, so every summation order is exact.
    inputs = [_rank_inputs(gen, pair.world_size, (8, 4096), dtype, integers=16) for _ in range(2)]
    send = inputs[0][pair.rank].clone()
    recv = _poisoned_like(send)
    eager = torch.empty_like(send)
    pair.all_reduce(send, eager)  # NCCL connects its peers on the first call: not inside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on a side stream: torch's current stream in here
        pair.all_reduce(send, recv)
    results = []
    for xs in inputs:
        send.copy_(xs[pair.rank])
        recv.view(torch.uint8).fill_(0xFF)
        graph.replay()
        results.append(recv.clone())
    torch.cuda.synchronize()
    for xs, got in zip(inputs, results):
        assert torch.equal(got, sum(x.float() for x in xs).to(dtype))
    assert torch.equal(results[0], eager)
    del graph
