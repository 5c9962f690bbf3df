"""`init_distributed`: torch.distributed from whatever launched this process.

Launchers and what they leave in the environment:
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
- Open MPI (mpirun): OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK}; MPICH / Intel MPI: PMI_RANK, PMI_SIZE,
  MPI_LOCALRANKID. MPI gives no rendezvous address, so rank 0 picks a free port and broadcasts its
  address and port with mpi4py (imported only under MPI: importing it starts MPI): MASTER_ADDR where set, else
  its host name's address, or where that is a loopback one and ranks run on other hosts, its address on the route
  to them.
- nothing: a single process (world size 1).

More ranks on a node than GPUs (e.g. `launch/test.sh 4` on a workstation with one GPU): the ranks
share GPUs, rank r on GPU local_rank % device_count, and the default backend is gloo, because NCCL
refuses two ranks on one GPU. Whether ranks share one is told by the GPUs' UUIDs and bus ids, exchanged in the
rendezvous's store before the group is made: ranks that each see a GPU of their own (CUDA_VISIBLE_DEVICES set per
rank) get NCCL. commfuse then still runs its real kernels on those GPUs (the P2P
row over same-device IPC, the fallback row as gloo's exact sum and the fused tail kernel): a mode
for testing and debugging tensor-parallel code, not for speed (see commfuse.topology).
"""
from __future__ import annotations

import atexit
import datetime
import ipaddress
import os
import socket
import weakref

import torch
import torch.distributed as dist

from . import env

_ENV_LAYOUTS = (  # rank, world size, local rank, ranks on this node
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def launch_env() -> tuple:
    """(rank, world_size, local_rank, launcher) from the environment; launcher is "torchrun", "mpi" or None."""
    rank, world, local_rank, _, launcher = _launch_env()
    return rank, world, local_rank, launcher


def local_world_size() -> int:
    """Ranks of this job on this node, as the launcher says (the world size when it does not)."""
    return _launch_env()[3]


def _launch_env() -> tuple:
    """(rank, world, local rank, local world, launcher); ValueError naming the variable where a launcher's
    value is no integer or out of range (a rank >= the world size would wait for peers that never come),
    and where two launchers' variables disagree (_one_launcher)."""
    found = []
    for i, (r, w, l, n) in enumerate(_ENV_LAYOUTS):
        if r in os.environ and w in os.environ:
            world = _int_env(w, 1)
            rank = _int_env(r, 0)
            if rank >= world:
                raise ValueError(f"{r}={rank} must be less than {w}={world}")
            local_world = _int_env(n, 1, world)
            local_rank = _int_env(l, 0, rank)
            found.append((i, (rank, world, local_rank, local_world, "torchrun" if i == 0 else "mpi")))
    return _one_launcher(found) if found else (0, 1, 0, 1, None)


def _one_launcher(found: list) -> tuple:
    """The launcher whose variables to trust among those present: the first layout's, where the others
    agree on rank and world size. Where they disagree, torchrun's wins when it says it started this process
    (TORCHELASTIC_RUN_ID) or MPI's world is one process (an MPI singleton that started its own workers);
    otherwise one set is stale (RANK and WORLD_SIZE exported in a shell that then runs mpirun -n 2): every
    rank would take a world of its own and sum nothing, so that raises, naming both."""
    first = found[0][1]
    if found[0][0] == 0 and ("TORCHELASTIC_RUN_ID" in os.environ or all(o[1] == 1 for _, o in found[1:])):
        return first
    for i, other in found[1:]:
        if other[:2] != first[:2]:
            a, b = _ENV_LAYOUTS[found[0][0]], _ENV_LAYOUTS[i]
            raise ValueError(f"launcher variables disagree: {a[0]}={first[0]} {a[1]}={first[1]} but "
                             f"{b[0]}={other[0]} {b[1]}={other[1]}; unset the stale ones")
    return first


def _int_env(name: str, minimum: int, default: int | None = None, maximum: int | None = None) -> int:
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    try:
        v = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {text!r}") from None
    if v < minimum or (maximum is not None and v > maximum):
        bound = f"at least {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {v}")
    return v


def _master_port() -> int:
    """MASTER_PORT, checked (a TCP port); 0 where it is unset or empty."""
    return _int_env("MASTER_PORT", 1, maximum=65535) if os.environ.get("MASTER_PORT") else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _route_source(peer: str) -> str:
    """The address of this host's interface on the route to the IPv4 address `peer`: a UDP socket's connect
    picks it from the routing table and sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def _loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


def _network_namespace() -> str:
    """This process's network namespace as "boot id:inode" (Linux), "" where it cannot be read: the processes of
    one namespace share its loopback interface, those of another (a container of its own, on this machine or
    another, whatever its host name) do not."""
    from .topology import boot_id

    try:
        return f"{boot_id() or ''}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


def _rank0_address(places: list) -> str:
    """Rank 0's address for its peers, `places` being every rank's (host name, _network_namespace()), rank 0's
    first: its host name's address, unless that is a loopback one (Debian and Ubuntu map the host name to
    127.0.1.1 in /etc/hosts) and a rank runs in another place (another host, or another network namespace under
    the same host name), which could not reach it and would wait out the rendezvous's timeout. Then the address
    of rank 0's interface on the route to such a host, else a non-loopback address of its host name; ValueError
    naming MASTER_ADDR where there is none."""
    own = places[0][0]
    addr = socket.gethostbyname(own)
    others = list(dict.fromkeys(name for name, ns in places if (name, ns) != places[0]))  # host names, once
    if not others or not _loopback(addr):
        return addr
    for peer in others:
        try:
            peer_addr = socket.gethostbyname(peer)
            source = _route_source(peer_addr)
        except OSError:  # a name that does not resolve here, or no route: the next host, or the next way
            continue
        if not _loopback(peer_addr) and not _loopback(source):
            return source
    for *_, sockaddr in socket.getaddrinfo(own, None, socket.AF_INET, socket.SOCK_STREAM):
        if not _loopback(sockaddr[0]):
            return sockaddr[0]
    where = next((f"on {h!r}" for h in others if h != own), f"in another network namespace of {own!r}")
    raise ValueError(f"rank 0's host name {own!r} resolves to the loopback address {addr}, which the ranks {where} "
                     "cannot reach, and no route to them was found: set MASTER_ADDR to an address of rank 0's host "
                     "that every rank can reach")


def _mpi_rendezvous(rank: int) -> tuple:
    """(address, port) of rank 0, sent to every rank; rank 0's error (a bad MASTER_PORT, say) is sent instead
    and raised on every rank, which would otherwise wait in the broadcast for good. The address: MASTER_ADDR,
    else _rank0_address's (every rank's host name and network namespace gathered first)."""
    from mpi4py import MPI

    addr = None
    places = MPI.COMM_WORLD.gather((socket.gethostname(), _network_namespace()), root=0)  # whatever MASTER_ADDR
    if rank == 0:
        try:
            addr = (os.environ.get("MASTER_ADDR") or _rank0_address(places), _master_port() or _free_port())
        except Exception as e:  # noqa: BLE001 - any failure here must reach the other ranks
            error = e
            addr = (type(e).__name__, str(e))  # words, not the exception: one that does not pickle would stop
            # rank 0 in the broadcast alone, and not every type is made again from its message
    addr = MPI.COMM_WORLD.bcast(addr, root=0)
    if isinstance(addr[1], str):  # rank 0's error, in words (an address's port is an int)
        if rank == 0:
            raise error
        kind = ValueError if addr[0] == "ValueError" else RuntimeError
        raise kind(f"rank 0: {addr[0]}: {addr[1]}")
    return addr


def default_backend(gpus: list) -> str:
    """NCCL when every rank has a GPU of its own: `gpus`, each rank's GPU (None without CUDA) as its UUID, or as
    "UUID|host|boot id|PCI bus id" (gpu_identity), all distinct in both the UUID and the place. gloo without CUDA
    on a rank, and where ranks share a GPU (NCCL refuses two ranks on one GPU, and two MIG instances of one, whose
    UUIDs differ: by the bus id). By identity, not by counting ranks and GPUs: ranks that each see one GPU of their
    own (CUDA_VISIBLE_DEVICES set per rank, as SLURM's --gpus-per-task and many wrappers do) own it although the node
    has more ranks than either sees."""
    if not all(gpus):
        return "gloo"
    parts = [g.split("|") for g in gpus]
    uuids = [p[0] for p in parts]
    # The machine by its boot id (containers of one machine share it, whatever their host names), else its name.
    places = [(p[2] or p[1], p[3]) for p in parts if len(p) == 4 and p[3]]
    return "nccl" if len(set(uuids)) == len(uuids) and len(set(places)) == len(places) else "gloo"


def gpu_identity() -> str:
    """This process's current GPU for default_backend: "UUID|host|boot id|PCI bus id"."""
    from .topology import boot_id

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    bus = getattr(props, "pci_bus_id", None)
    domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
    place = "" if bus is None else f"{domain:04x}:{bus:02x}:{device:02x}"
    return f"{props.uuid}|{socket.gethostname()}|{boot_id() or ''}|{place}"


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple:
    """Initialise the default process group once; return (rank, world_size).

    backend: None picks "nccl" when every rank has a GPU of its own, "gloo" without CUDA and when ranks share
    GPUs (see the module docstring): the ranks exchange their GPUs' identities in the rendezvous's store first.
    With CUDA, each process is bound to GPU `local_rank % device_count` before the group is made.
    Safe to call again: an existing group is kept. A gloo group made here is destroyed at interpreter
    exit (unless the caller destroyed it): a gloo group still alive when the interpreter finalizes can
    abort a process after a clean run ("terminate called without an active exception"); commfuse's
    Communicators let go of their gloo groups at exit too, but a caller's own references keep a group
    alive (drop them, or destroy the group, before exit). An NCCL group is not destroyed: torch's
    destroy_process_group flushes the group's collectives and waits for them, which would hang the exit
    of a rank whose peers died; torch warns at exit instead ("destroy_process_group() was not called").
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not env.MIN_SECONDS <= timeout_s <= env.MAX_SECONDS:  # a shorter bound is 0 ms to torch.distributed
        raise ValueError(f"timeout_s must be a number of seconds from {env.MIN_SECONDS:g} to {env.MAX_SECONDS:.15g}, "
                         f"got {timeout_s!r}")
    rank, world, local_rank, _, launcher = _launch_env()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if launcher == "mpi":
        addr, port = _mpi_rendezvous(rank)
    else:
        addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"  # set but empty is unset, as MASTER_PORT
        port = _master_port() or (_free_port() if world == 1 else 29500)
    timeout = datetime.timedelta(seconds=timeout_s)
    # torch's own rendezvous (it knows torchrun's agent store), whose store then serves the group.
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr  # an IPv6 address, as a URL has it
    store, rank, world = next(dist.rendezvous(f"tcp://{host}:{port}", rank=rank, world_size=world, timeout=timeout))
    store.set_timeout(timeout)
    if backend is None:
        store.set(f"commfuse/gpu/{rank}", gpu_identity() if cuda else "")
        backend = default_backend([u.decode() or None for u in store.multi_get([f"commfuse/gpu/{r}"
                                                                                for r in range(world)])])
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world,
                            timeout=timeout)
    if backend == "gloo":
        atexit.register(_destroy_at_exit, weakref.ref(dist.group.WORLD))  # weak: a strong one kept it alive
    return rank, world


def _destroy_at_exit(made) -> None:
    if dist.is_initialized() and dist.group.WORLD is made():  # not a group the caller made since
        try:
            dist.destroy_process_group()  # every group, the default one last
        except Exception:  # noqa: BLE001 - nothing may fail a process at exit after its work is done
            pass


def rank_label(group, rank: int) -> str:
    """How errors name `group`'s rank `rank`: "rank r", and its global rank where the two differ (a subgroup's
    numbering alone would name other processes)."""
    g = rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)
    return f"rank {rank}" if g == rank else f"rank {rank} (global {g})"


def gather_objects(group, obj) -> list:
    """Every rank's `obj` (picklable), in rank order: torch.distributed's all_gather_object."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
