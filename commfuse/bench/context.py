"""Ctx: what the cases, the implementations and the timing core share for one run."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class Ctx:
    args: argparse.Namespace
    rank: int
    world: int
    backend: str
    device: torch.device                        # CUDA whenever there is a GPU, whatever the backend
    cache: dict = field(default_factory=dict)   # per-implementation state: communicators, compiled fns
    plans: list = field(default_factory=list)   # the route each commfuse row took
    flag: Optional[torch.Tensor] = None         # one element, for aligning ranks
    gen_device: Optional[torch.device] = None   # where inputs are drawn (see cases.same_draws)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def shared_gpu(self) -> bool:
        """Ranks share GPUs: commfuse.init_distributed picks gloo on a node with more ranks than
        GPUs, and sets every rank's CUDA device."""
        return self.cuda and self.backend == "gloo"
