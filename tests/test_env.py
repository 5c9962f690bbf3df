"""What commfuse reads from the environment: the launchers' variables (commfuse.distributed) and the
numbers and switches of COMMFUSE_* variables (commfuse.env). A value that is no number in range raises
ValueError naming the variable, before anything waits on it; a switch other than 0 / 1 warns. CPU, one process."""
import math
import subprocess
import sys
import warnings

import pytest
import torch

from commfuse import env, routes
from commfuse.distributed import _ENV_LAYOUTS, launch_env, local_world_size


@pytest.fixture
def clean(monkeypatch):
    """No launcher variable set."""
    for layout in _ENV_LAYOUTS:
        for name in layout:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    return monkeypatch


def test_launcher_variables_are_read_in_order(clean):
    assert launch_env() == (0, 1, 0, None) and local_world_size() == 1
    clean.setenv("OMPI_COMM_WORLD_RANK", "3")
    clean.setenv("OMPI_COMM_WORLD_SIZE", "8")
    assert launch_env() == (3, 8, 3, "mpi") and local_world_size() == 8  # local rank and size default
    clean.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    clean.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert launch_env() == (3, 8, 1, "mpi") and local_world_size() == 4
    clean.setenv("RANK", "3")
    clean.setenv("WORLD_SIZE", "8")
    assert launch_env() == (3, 8, 3, "torchrun")  # torchrun's layout first where both agree
    clean.setenv("RANK", "5")
    clean.setenv("WORLD_SIZE", "6")
    clean.setenv("TORCHELASTIC_RUN_ID", "job")
    assert launch_env() == (5, 6, 5, "torchrun")  # torchrun started under MPI: its own variables


def test_stale_launcher_variables_are_refused(clean):
    """RANK and WORLD_SIZE exported in a shell that then runs mpirun: each rank would be a world of one."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}.items():
        clean.setenv(k, v)
    with pytest.raises(ValueError, match="RANK=0 WORLD_SIZE=1 but OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2"):
        launch_env()
    # An MPI singleton (mpirun -n 1) that started workers of its own, which set RANK and WORLD_SIZE
    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}.items():
        clean.setenv(k, v)
    assert launch_env() == (3, 4, 3, "torchrun")


@pytest.mark.parametrize("variables, message", [
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1 must be less than WORLD_SIZE=1"),
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE must be an integer, got 'abc'"),
    ({"RANK": "", "WORLD_SIZE": "2"}, "RANK must be an integer, got ''"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1, got 0"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK must be at least 0, got -1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK must be an integer"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "0"}, "MPI_LOCALNRANKS must be at least 1"),
])
def test_a_broken_launcher_variable_is_named(clean, variables, message):
    for k, v in variables.items():
        clean.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        launch_env()


def _run(code: str, **variables) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with only these launcher variables (no group in this process)."""
    import os

    environ = {k: v for k, v in os.environ.items() if not any(k in layout for layout in _ENV_LAYOUTS)}
    environ.update(variables)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)


def test_init_distributed_and_the_probe_say_what_is_wrong():
    """A rank beyond the world would wait for peers that never come (the timeout, 600 s by default):
    init_distributed raises at once instead, and commfuse-probe prints a line rather than a traceback."""
    r = _run("import commfuse; commfuse.init_distributed()", RANK="1", WORLD_SIZE="1")
    assert r.returncode != 0 and "ValueError: RANK=1 must be less than WORLD_SIZE=1" in r.stderr, r.stderr
    r = _run("import commfuse; commfuse.init_distributed()", RANK="0", WORLD_SIZE="1", MASTER_PORT="abc")
    assert "MASTER_PORT must be an integer, got 'abc'" in r.stderr, r.stderr
    r = _run("import commfuse; commfuse.init_distributed()", RANK="0", WORLD_SIZE="1", MASTER_PORT="70000")
    assert "MASTER_PORT must be in [1, 65535], got 70000" in r.stderr, r.stderr
    for bad in ("0", "1e-4", "True", "float('nan')", "2e6"):  # 1e-4 s is a timeout of 0 ms to torch.distributed
        r = _run(f"import commfuse; commfuse.init_distributed(timeout_s={bad})")
        assert "timeout_s must be a number of seconds from 0.001 to 1000000" in r.stderr, (bad, r.stderr)
    r = _run("import sys; from commfuse.cli.probe import main; sys.exit(main([]))", RANK="0", WORLD_SIZE="abc")
    assert r.returncode == 1 and r.stderr.strip() == "commfuse-probe: WORLD_SIZE must be an integer, got 'abc'", r


def test_the_probe_under_stale_launcher_variables_ends_in_a_message():
    """RANK=0 WORLD_SIZE=2 left in a shell: the probe waited for a second rank 600 s; --timeout bounds the wait,
    and the message says what may be wrong. An empty MASTER_ADDR is unset, as an empty MASTER_PORT is (it crashed
    in torch's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    r = _run("import sys; from commfuse.cli.probe import main; sys.exit(main(['--timeout', '2']))", RANK="0",
             WORLD_SIZE="2", MASTER_PORT=port, MASTER_ADDR="")
    assert r.returncode == 1 and "commfuse-probe: the group of 2 ranks could not be probed" in r.stderr, r.stderr
    assert "left over in this shell" in r.stderr and "hostname cannot be None" not in r.stderr, r.stderr
    r = _run("import sys; from commfuse.cli.probe import main; sys.exit(main(['--timeout', '1e-4']))")
    assert r.returncode == 2 and "--timeout must be a number of seconds from 0.001" in r.stderr, r.stderr


def test_an_ipv6_master_addr_is_a_host_of_the_rendezvous_url():
    """MASTER_ADDR=::1 (as torch's env:// takes it) failed: the URL tcp://::1:port read ':1:port' as the port."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = str(s.getsockname()[1])
    except OSError as e:
        pytest.skip(f"no IPv6 loopback on this machine: {e}")
    r = _run("import commfuse; print(commfuse.init_distributed(timeout_s=30))", RANK="0", WORLD_SIZE="1",
             MASTER_ADDR="::1", MASTER_PORT=port)
    assert r.returncode == 0 and r.stdout.strip() == "(0, 1)", r.stderr


@pytest.mark.parametrize("raw", ["abc", "nan", "inf", "-1", "0", "1e7", "1e-9"])
def test_a_bad_number_is_named(monkeypatch, raw):
    monkeypatch.setenv("COMMFUSE_TEST_SECONDS", raw)
    with pytest.raises(ValueError, match=r"COMMFUSE_TEST_SECONDS must be a number"):
        env.seconds("COMMFUSE_TEST_SECONDS", 10.0)


def test_numbers_in_range_and_defaults(monkeypatch):
    monkeypatch.delenv("COMMFUSE_TEST_SECONDS", raising=False)
    assert env.seconds("COMMFUSE_TEST_SECONDS", 10.0) == 10.0
    for raw, want in (("", 10.0), (" ", 10.0), ("0.25", 0.25), ("1e6", 1e6)):
        monkeypatch.setenv("COMMFUSE_TEST_SECONDS", raw)
        assert env.seconds("COMMFUSE_TEST_SECONDS", 10.0) == want
    monkeypatch.setenv("COMMFUSE_TEST_SECONDS", "0")
    assert env.seconds("COMMFUSE_TEST_SECONDS", 10.0, zero=True) == 0.0  # e.g. no NCCL watchdog
    monkeypatch.setenv("COMMFUSE_TEST_SECONDS", "-0.5")
    with pytest.raises(ValueError, match="must be 0 or a number >= 0.001 and at most 1000000, got '-0.5'"):
        env.seconds("COMMFUSE_TEST_SECONDS", 10.0, zero=True)
    # Below a millisecond: torch.distributed's timeout of 0 ms, which failed without naming the variable.
    monkeypatch.setenv("COMMFUSE_TEST_SECONDS", "1e-4")
    with pytest.raises(ValueError, match="must be 0 or a number >= 0.001"):
        env.seconds("COMMFUSE_TEST_SECONDS", 10.0, zero=True)
    monkeypatch.setenv("COMMFUSE_TEST_SECONDS", "0.001")
    assert env.seconds("COMMFUSE_TEST_SECONDS", 10.0) == 0.001
    monkeypatch.setenv("COMMFUSE_TEST_SECONDS", "1048577")  # its bound printed whole: 1.04858e+06 read as above it
    with pytest.raises(ValueError, match="at most 1048576, got '1048577'"):
        env.number("COMMFUSE_TEST_SECONDS", 1.0, maximum=2.0 ** 20)
    monkeypatch.setenv("COMMFUSE_TEST_SECONDS", "1e300")
    assert env.number("COMMFUSE_TEST_SECONDS", 1.0) == 1e300  # a number with no maximum (not a wait)
    assert env.MAX_SECONDS < math.inf


@pytest.mark.mpi(min_size=2)
def test_rank_0s_rendezvous_error_reaches_every_rank(monkeypatch):
    """Under mpirun rank 0 alone reads MASTER_ADDR / MASTER_PORT, then broadcasts them: its error is
    broadcast instead and raised on every rank, which would otherwise wait in the broadcast for good."""
    from mpi4py import MPI

    from commfuse import distributed

    monkeypatch.setenv("MASTER_PORT", "abc")
    with pytest.raises(ValueError, match="MASTER_PORT must be an integer, got 'abc'"):
        distributed._mpi_rendezvous(MPI.COMM_WORLD.Get_rank())
    class Unpicklable(Exception):  # made again from its message it would not be, and pickling it fails
        def __init__(self, a, b):
            super().__init__(a, b)
            self.lock = __import__("threading").Lock()

    def fails():
        raise Unpicklable("port", "broken")

    monkeypatch.setattr(distributed, "_master_port", fails)
    rank = MPI.COMM_WORLD.Get_rank()
    with pytest.raises(Unpicklable if rank == 0 else RuntimeError, match=None if rank == 0 else "rank 0: Unpicklable"):
        distributed._mpi_rendezvous(rank)
    monkeypatch.undo()
    monkeypatch.setenv("MASTER_PORT", "29533")
    assert distributed._mpi_rendezvous(MPI.COMM_WORLD.Get_rank())[1] == 29533  # and the world goes on


def test_rank_0s_address_reaches_ranks_on_other_hosts(monkeypatch):
    """Under mpirun without MASTER_ADDR, rank 0 sent its host name's address, which on Debian and Ubuntu is
    127.0.1.1 (/etc/hosts): ranks on other hosts waited out the rendezvous's timeout (600 s) connecting to
    themselves. A loopback address is kept only where every rank shares rank 0's host."""
    from commfuse import distributed

    names = {"node-a": "127.0.1.1", "node-b": "10.1.2.3", "node-c": "127.0.0.1"}
    monkeypatch.setattr(distributed.socket, "gethostbyname", lambda host: names[host])
    routes = {"10.1.2.3": "10.1.2.1"}
    monkeypatch.setattr(distributed, "_route_source", lambda peer: routes[peer])
    monkeypatch.setattr(distributed.socket, "getaddrinfo", lambda *a: [])
    a, b, c = ("node-a", "ns-1"), ("node-b", "ns-2"), ("node-c", "ns-3")
    assert distributed._rank0_address([a, a]) == "127.0.1.1"  # one host: loopback reaches it
    assert distributed._rank0_address([a, a, b]) == "10.1.2.1"  # the route to node-b
    routes.clear()  # no route to node-b (OSError from the connect): a non-loopback address of rank 0's name
    monkeypatch.setattr(distributed, "_route_source", lambda peer: (_ for _ in ()).throw(OSError("unreachable")))
    monkeypatch.setattr(distributed.socket, "getaddrinfo",
                        lambda *a: [(0, 0, 0, "", ("127.0.1.1", 0)), (0, 0, 0, "", ("192.168.7.9", 0))])
    assert distributed._rank0_address([a, b]) == "192.168.7.9"
    # rank 1 under rank 0's host name in another network namespace (a container of its own): its loopback is
    # not rank 0's, so it takes the non-loopback address too
    assert distributed._rank0_address([a, ("node-a", "ns-9")]) == "192.168.7.9"
    monkeypatch.setattr(distributed.socket, "getaddrinfo", lambda *a: [(0, 0, 0, "", ("127.0.1.1", 0))])
    with pytest.raises(ValueError, match="'node-a' resolves to the loopback address 127.0.1.1, which the ranks on "
                                         "'node-c' cannot reach.*set MASTER_ADDR"):
        distributed._rank0_address([a, c])  # node-c's name resolves to loopback here: no route
    with pytest.raises(ValueError, match="which the ranks in another network namespace of 'node-a' cannot reach"):
        distributed._rank0_address([a, ("node-a", "ns-9")])
    monkeypatch.setattr(distributed.socket, "gethostbyname", lambda host: {"node-a": "10.9.9.9"}[host])
    assert distributed._rank0_address([a, b]) == "10.9.9.9"  # not loopback: as it was


def test_network_namespace_is_this_machines_and_this_processs():
    """Two processes of one namespace (this one and a child) name it alike; the name holds the machine's boot id,
    so the same inode on another machine is another namespace."""
    import subprocess
    import sys

    from commfuse import distributed
    from commfuse.topology import boot_id

    mine = distributed._network_namespace()
    if not mine:
        pytest.skip("no /proc/self/ns/net here")
    child = subprocess.run([sys.executable, "-c", "from commfuse import distributed; "
                            "print(distributed._network_namespace())"], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == mine and mine.startswith(f"{boot_id() or ''}:")


def test_route_source_is_this_hosts_address_towards_the_peer():
    from commfuse import distributed

    assert distributed._route_source("127.0.0.1") == "127.0.0.1"


@pytest.mark.mpi(min_size=2)
def test_rendezvous_gathers_host_names_before_rank_0_picks_its_address(monkeypatch):
    """Rank 1 on a host of its own (its name changed here): rank 0, whose name is loopback here and which finds no
    route to that host, raises, and every rank with it, in step."""
    from mpi4py import MPI

    from commfuse import distributed

    rank = MPI.COMM_WORLD.Get_rank()
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29534")
    monkeypatch.setattr(distributed.socket, "gethostname", lambda: "commfuse-test-other-host" if rank else "me")
    monkeypatch.setattr(distributed.socket, "gethostbyname",
                        lambda host: "127.0.1.1" if host == "me" else (_ for _ in ()).throw(OSError("unknown")))
    monkeypatch.setattr(distributed.socket, "getaddrinfo", lambda *a: [(0, 0, 0, "", ("127.0.1.1", 0))])
    with pytest.raises(ValueError, match="commfuse-test-other-host.*set MASTER_ADDR"):
        distributed._mpi_rendezvous(rank)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")  # the user's address is taken as given
    assert distributed._mpi_rendezvous(rank) == ("10.0.0.7", 29534)


def test_a_switch_is_0_or_1_and_anything_else_warns_and_keeps_its_default(monkeypatch):
    """A value other than 0 / 1 (COMMFUSE_DISABLE_FUSION=true, say) was read as the default without a word."""
    monkeypatch.setattr(env, "_WARNED", set())
    for default in (False, True):
        monkeypatch.delenv("COMMFUSE_TEST_SWITCH", raising=False)
        assert env.flag("COMMFUSE_TEST_SWITCH", default) is default
        for raw, want in (("", default), ("  ", default), ("1", True), ("0", False)):
            monkeypatch.setenv("COMMFUSE_TEST_SWITCH", raw)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no warning for these
                assert env.flag("COMMFUSE_TEST_SWITCH", default) is want
    for raw in ("true", "yes", " 1", "on", "2"):
        monkeypatch.setenv("COMMFUSE_TEST_SWITCH", raw)
        said = f"COMMFUSE_TEST_SWITCH={raw!r} is neither 0 nor 1: read as 1, its default"
        with pytest.warns(UserWarning, match=said):
            assert env.flag("COMMFUSE_TEST_SWITCH", True) is True
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per value
            assert env.flag("COMMFUSE_TEST_SWITCH", True) is True
    # a reader of the library: the local ops' machine keeps its fused kernels, and says why
    monkeypatch.setenv("COMMFUSE_DISABLE_FUSION", "true")
    with pytest.warns(UserWarning, match="COMMFUSE_DISABLE_FUSION='true' is neither 0 nor 1: read as 0"):
        assert routes.Machine.local(torch.device("cpu")).fusion is True
    monkeypatch.setenv("COMMFUSE_DISABLE_FUSION", "1")
    assert routes.Machine.local(torch.device("cpu")).fusion is False
