"""`init_distributed`: torch.distributed from whatever launched this process.

Launchers and what they leave in the environment:
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
- Open MPI (mpirun): OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK}; MPICH / Intel MPI: PMI_RANK, PMI_SIZE,
  MPI_LOCALRANKID. MPI gives no rendezvous address, so rank 0 picks a free port and broadcasts its
  host and port with mpi4py (imported only under MPI: importing it starts MPI).
- nothing: a single process (world size 1).
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

_ENV_LAYOUTS = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


def launch_env() -> tuple:
    """(rank, world_size, local_rank, launcher) from the environment; launcher is "torchrun", "mpi" or None."""
    for i, (r, w, l) in enumerate(_ENV_LAYOUTS):
        if r in os.environ and w in os.environ:
            rank, world = int(os.environ[r]), int(os.environ[w])
            return rank, world, int(os.environ.get(l, rank)), "torchrun" if i == 0 else "mpi"
    return 0, 1, 0, None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _mpi_rendezvous(rank: int) -> tuple:
    from mpi4py import MPI

    addr = None
    if rank == 0:
        addr = (os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname()),
                int(os.environ.get("MASTER_PORT") or _free_port()))
    return MPI.COMM_WORLD.bcast(addr, root=0)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple:
    """Initialise the default process group once; return (rank, world_size).

    backend: None picks "nccl" when CUDA is present, else "gloo". With CUDA, each process is bound
    to GPU `local_rank % device_count` before the group is made. Safe to call again: an existing
    group is kept.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world, local_rank, launcher = launch_env()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if launcher == "mpi":
        addr, port = _mpi_rendezvous(rank)
    else:
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT") or (_free_port() if world == 1 else 29500))
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world
