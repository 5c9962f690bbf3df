"""What the group's hardware allows: ranks per node, SM versions, P2P between GPUs.

`detect(group)` runs once per group (collective: every rank must call it) and is cached.
`decide_mode` is the pure decision from gathered facts, so simulated topologies can be tested.
"""
from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    """One rank's own facts, gathered over the group."""

    host: str
    device: Optional[int]  # CUDA ordinal, None without a GPU
    uuid: Optional[str]
    sm: Optional[tuple]
    gpu_name: Optional[str]


@dataclass(frozen=True)
class Topology:
    """The group's topology as seen by this rank.

    mode: "p2p" (one node, every pair P2P-capable: the custom all-reduce row), "fallback" (NCCL then
    a local fused tail) or "cpu" (no GPU: gloo and separated ops). reasons say why.
    p2p[i][j]: rank i can map rank j's memory (confirmed by a real IPC map where measured).
    """

    rank: int
    world_size: int
    ranks: tuple  # RankInfo per rank of the group
    p2p: tuple  # world_size x world_size bools (diagonal True)
    mode: str
    reasons: tuple = field(default_factory=tuple)

    @property
    def sm(self) -> Optional[tuple]:
        return self.ranks[self.rank].sm

    @property
    def local_ranks(self) -> tuple:
        me = self.ranks[self.rank].host
        return tuple(i for i, r in enumerate(self.ranks) if r.host == me)


def decide_mode(ranks: Sequence[RankInfo], p2p: Sequence[Sequence[bool]],
                pretend_no_p2p: bool = False) -> tuple:
    """(mode, reasons) from the gathered facts."""
    if any(r.device is None for r in ranks):
        return "cpu", ("a rank has no GPU: gloo and separated ops",)
    hosts = {r.host for r in ranks}
    if len(hosts) > 1:
        return "fallback", (f"ranks span {len(hosts)} nodes: NCCL between nodes",)
    if len(ranks) == 1:
        return "fallback", ("one rank: nothing to exchange, NCCL path",)
    if pretend_no_p2p:
        return "fallback", ("COMMFUSE_PRETEND_NO_P2P=1: P2P treated as absent",)
    missing = [(i, j) for i in range(len(ranks)) for j in range(len(ranks)) if i != j and not p2p[i][j]]
    if missing:
        pairs = ", ".join(f"{i}->{j}" for i, j in missing[:8])
        return "fallback", (f"no P2P between ranks {pairs}",)
    return "p2p", (f"{len(ranks)} ranks on one node, P2P between every pair",)


def _own_info() -> RankInfo:
    host = socket.gethostname()
    if not torch.cuda.is_available():
        return RankInfo(host, None, None, None, None)
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    return RankInfo(host, dev, str(getattr(props, "uuid", "")), (props.major, props.minor), props.name)


@functools.lru_cache(maxsize=None)
def _detect_cached(group) -> Topology:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    infos: list = [None] * world
    dist.all_gather_object(infos, _own_info(), group=group)
    # Without a measured check, assume no P2P: the fallback row is always correct.
    p2p = tuple(tuple(i == j for j in range(world)) for i in range(world))
    mode, reasons = decide_mode(infos, p2p, os.environ.get("COMMFUSE_PRETEND_NO_P2P") == "1")
    return Topology(rank, world, tuple(infos), p2p, mode, reasons)


def detect(group=None) -> Topology:
    """The topology of `group` (None: WORLD). Collective on first call per group; cached after."""
    return _detect_cached(group if group is not None else dist.group.WORLD)
