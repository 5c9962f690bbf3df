"""Tensor-parallel sharding of a Hugging Face decoder, the usual (Megatron) way, in place: so that "any
model, unchanged" can be tried on transformers' own classes in a few lines.

    model = transformers.AutoModelForCausalLM.from_config(config)    # or from_pretrained(...)
    commfuse.sharding.shard_decoder(model)                            # every rank, the same weights
    compiled = commfuse.fusion.compile(model, commfuse.Communicator())

Per decoder layer: the attention's q_proj / k_proj / v_proj and the MLP's gate_proj / up_proj become
column-parallel (each rank keeps its 1 / world of the heads and of the intermediate features, biases
included), o_proj and down_proj row-parallel: each rank multiplies its slice of the input features and
the partial products are summed with `torch.distributed.all_reduce` in place, as models write it (the
bias added once, after the sum). That all-reduce is followed by the residual add and the next RMSNorm:
the tail commfuse.fusion fuses. Embeddings, norms and the LM head stay replicated. Attention reshapes
with `-1` heads (transformers' Llama, Mistral, Qwen2, Qwen3, Gemma), so its modules run unchanged
on their share of the heads.

Families it knows (the module names above): Llama, Mistral, Qwen2, Qwen3, Gemma. Others raise
ValueError naming what is missing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["shard_decoder", "RowParallelLinear"]

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + bias: one rank's slice of a row-parallel linear layer.

    weight: [out, in / world] (this rank's columns), bias: [out] or None, both replicated values of
    the unsharded layer's; group: the tensor-parallel group (None: WORLD)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def _column(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    out = linear.out_features // world
    new = nn.Linear(linear.in_features, out, bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(linear.weight[rank * out:(rank + 1) * out])
        if linear.bias is not None:
            new.bias.copy_(linear.bias[rank * out:(rank + 1) * out])
    new.requires_grad_(linear.weight.requires_grad)
    return new


def _row(linear: nn.Linear, rank: int, world: int, group) -> RowParallelLinear:
    cols = linear.in_features // world
    weight = linear.weight.detach()[:, rank * cols:(rank + 1) * cols].contiguous()
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallelLinear(weight, bias, group)


def shard_decoder(model: nn.Module, group=None) -> nn.Module:
    """Shard `model` (a transformers decoder: *ForCausalLM or its base model) over `group` (None:
    WORLD) in place and return it. Every rank must call it with the same weights. Raises ValueError
    where the heads, key-value heads or intermediate features do not divide by the world size, or
    where the model has no layer of the known shape."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call commfuse.init_distributed() first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("intermediate_size", getattr(config, "intermediate_size", None))):
        if value is None:
            raise ValueError(f"model.config has no {name}: not a decoder shard_decoder knows")
        if value % world:
            raise ValueError(f"model.config.{name} = {value} does not divide by the world size {world}")
    sharded = 0
    for parent in list(model.modules()):
        names = {n for n, _ in parent.named_children()}
        if not (names >= {"q_proj", "k_proj", "v_proj", "o_proj"} or names >= {"gate_proj", "up_proj", "down_proj"}):
            continue
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if child_name in _COLUMN:
                setattr(parent, child_name, _column(child, rank, world))
            elif child_name in _ROW:
                setattr(parent, child_name, _row(child, rank, world, group))
                sharded += 1
    if not sharded:
        raise ValueError("no attention (q/k/v/o_proj) or MLP (gate/up/down_proj) layers found: not a decoder "
                         "shard_decoder knows")
    return model
