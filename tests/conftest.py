"""Shared test set-up for single-process and `mpirun -n N pytest --with-mpi` runs.

Under MPI every rank collects the same tests, but only tests marked `mpi` need all ranks: the
others run on rank 0 alone (after the MPI tests, so the other ranks can exit rather than wait).
"""
import os
import zlib

import pytest
import torch
from _pytest.runner import runtestprotocol

from commfuse.distributed import launch_env

os.environ.setdefault("COMMFUSE_CHECK", "1")  # mismatched calls raise instead of hanging a collective
# Ranks reach a collective test apart by what rank 0 alone does between them (single-process tests
# come last, but fixtures and compiles differ): the gloo route waits as long as the collectives do.
os.environ.setdefault("COMMFUSE_GLOO_TIMEOUT_S", os.environ.get("COMMFUSE_TEST_COLLECTIVE_TIMEOUT", "180"))

RANK, WORLD, LOCAL_RANK, LAUNCHER = launch_env()
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU-only machine)")


def error_cycle(error: BaseException):
    """Where a frame of `error`'s traceback (the raising test's own aside) holds, in a local, an exception whose
    traceback runs through that frame: "function.local", or None. Such a cycle keeps every frame of the call (its
    tensors, a Communicator's gloo groups) alive until a garbage collection, at worst the interpreter's exit, where
    a gloo group alive can abort the process."""
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None
    while tb is not None:
        for name, value in tb.tb_frame.f_locals.items():
            inner = value.__traceback__ if isinstance(value, BaseException) else None
            while inner is not None:
                if inner.tb_frame is tb.tb_frame:
                    return f"{tb.tb_frame.f_code.co_name}.{name}"
                inner = inner.tb_next
        tb = tb.tb_next
    return None


def pytest_collection_modifyitems(config, items):
    mpi = [i for i in items if i.get_closest_marker("mpi")]
    serial = [i for i in items if not i.get_closest_marker("mpi")]
    if WORLD > 1 and RANK != 0:
        if serial:
            config.hook.pytest_deselected(items=serial)
        items[:] = mpi
    else:
        items[:] = mpi + serial


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """On rank 0, the last collective test tears down every fixture but the session's, as the other ranks do
    at their end: a module's collective fixture (a Communicator whose close() is a barrier) would otherwise
    close only after the module's single-process tests on rank 0, while the other ranks wait in that
    barrier. The session's (the world's Communicator, which the single-process tests use) stay: made again,
    they would wait for the ranks that have left."""
    if WORLD > 1 and RANK == 0 and nextitem is not None and item.get_closest_marker("mpi") \
            and not nextitem.get_closest_marker("mpi"):
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        runtestprotocol(item, nextitem=item.session)  # teardown keeps what the session node holds
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True
    return None


def pytest_report_header(config):
    return f"commfuse: rank {RANK} of {WORLD} ({LAUNCHER or 'single process'}), cuda={torch.cuda.is_available()}"


@pytest.fixture(scope="session")
def comm():
    """A Communicator over WORLD (NCCL with GPUs, else gloo); the group is made on first use."""
    import commfuse

    from commfuse import env

    commfuse.init_distributed(timeout_s=env.seconds("COMMFUSE_TEST_COLLECTIVE_TIMEOUT", 180.0))  # a bad one named
    return commfuse.Communicator()


@pytest.fixture(scope="module")
def quiet_comm(comm):
    """A Communicator of comm's group without the per-call cross-rank check: an object gather per call
    cannot be captured in a CUDA graph, and the tests that use it call alike on every rank."""
    import commfuse

    c = commfuse.Communicator(comm.group)
    c.check_calls = False
    return c


@pytest.fixture
def gen(request):
    """A generator seeded from the test's name: fresh random data per test, reproducible, same on every rank."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return torch.Generator().manual_seed(seed)
