"""Tensor-parallel sharding of a Hugging Face decoder, the usual (Megatron) way, in place: so that "any
model, unchanged" can be tried on transformers' own classes in a few lines.

    comm = commfuse.Communicator()
    torch.manual_seed(0)                                   # from_config draws the weights: alike on every rank
    model = transformers.AutoModelForCausalLM.from_config(config).to(comm.device, torch.bfloat16).eval()
    commfuse.sharding.shard_decoder(model)                 # (or from_pretrained(...), then .to(comm.device))
    compiled = commfuse.fusion.compile(model, comm)

Per decoder layer: the attention's q_proj / k_proj / v_proj and the MLP's gate_proj / up_proj (up_proj alone in an
ungated MLP, as Arcee's and Nemotron's: its activation is elementwise) become column-parallel (each rank keeps its
1 / world of the heads and of the intermediate features, biases included), o_proj and down_proj row-parallel: each
rank multiplies its slice of the input features and the partial products are summed with
`torch.distributed.all_reduce` in place, as models write it (a bias added to rank 0's partial product only, as vLLM
does, so that the sum holds it once). That all-reduce is followed by the residual add and the next RMSNorm: the tail
commfuse.fusion fuses. Embeddings, norms and the LM head stay replicated. Attention reshapes with `-1` heads
(transformers' Llama, Mistral, Qwen2, Qwen3, Gemma and the MoE ones below), so its modules run unchanged on their
share of the heads. Multi-head latent attention (DeepSeek V2 / V3) is sharded by heads too: its per-head
up-projections q_b_proj (or q_proj) and kv_b_proj column-parallel, o_proj row-parallel, and the projections to the
latents that every head shares (q_a_proj, kv_a_proj_with_mqa, with their norms) replicated. Projections in one
are column-parallel by their parts: a qkv_proj (Phi-3's, Ergo's: queries, keys and values in that order, the
attention splitting them at its config's head counts; a rank keeps its rows of each, and each attention gets a
shallow copy of the config with the rank's counts, so choose the attention implementation before sharding) and
the gate_up_proj of Phi-3's and GLM's dense MLPs (gate and up concatenated, as their chunk(2) splits them: a rank
keeps its share of each half).

A MoE block (transformers 5's layout: a router `gate` (gpt-oss: `router`) and an `experts` module holding
every expert's `gate_up_proj` [experts, 2 * intermediate, h] and `down_proj` [experts, h, intermediate], or
both transposed, gate and up concatenated or interleaved, with or without biases) is sharded the
same way inside each expert: every rank keeps its 1 / world of each expert's intermediate features, the
router stays replicated, and the block's output (the routing-weighted combine of the experts' partial
products, plus a shared expert's, whose down_proj is then a partial product too) is all-reduced in place
after the block (a forward hook): the combine + all-reduce + residual add + RMSNorm that commfuse.fusion
fuses into `commfuse::moe_all_reduce` where the combine is a sum over the top-k rows: transformers'
grouped_mm experts (its default where a model supports it: rows in expert order gathered back to token order,
the op's finalize form) and batched_mm. The eager loop over the experts breaks dynamo's graph (its loop runs
over the experts a batch selects), so neither its combine nor the tail after it fuse: choose grouped_mm or
batched_mm experts (`config._experts_implementation`).

Each attention is sharded by its own key-value heads (its k_proj's: MiMo-V2-Flash's sliding-window layers have
twice the config's); where they are fewer than the ranks (and divide them) they are replicated: each rank keeps
the one its queries read. An attention or MLP holding any other weighted part, a projection that is not a plain
nn.Linear or whose sharded features do not divide, or a head count that does not divide, is refused (ValueError)
rather than sharded wrong. The ranks must hold the same weights (each shards its part of them): they compare a
checksum of each parameter's bits (their sum, and their sum weighted by position: a reordering differs too) first,
and raise where any differs. The sharded model is for inference: its
parameters do not require grad.

Families it knows (the module names above): Llama, Mistral, Qwen2, Qwen3, Gemma, Seed-OSS, StableLM (with its
per-head qk_layernorm), HunYuan, Arcee (an ungated MLP), SmolLM3, ERNIE 4.5, Phi-3 (Phi-4's class too) and GLM
(projections in one), Gemma 2 / 3, EXAONE 4, GLM-4 and Ergo with dense MLPs (post-norms: fused_all_reduce's
post_weight where the add's norm follows, as in Gemma 2 / 3 and GLM-4), Granite (its scaled sums unfused),
Cohere 2 (parallel attention and MLP), and the MoE ones Mixtral, Qwen2-MoE (with its gated shared expert), Qwen3-MoE, GLM4-MoE and DeepSeek V2 / V3 (shared experts, dense
first layers; DeepSeek's latent attention), gpt-oss (transposed, interleaved experts with biases; attention sinks,
one per head, shared out with the heads) and Qwen3.5-MoE (every MLP a MoE block, gated queries; its gated delta
layers whole, below).
Others raise ValueError naming the model's class and what it does not know rather than leave it whole on every
rank: a decoder layer's weight matrix (each layer of the ModuleList that holds those above, whether or not it holds
one) outside the attention, MLP and MoE block above (an attention of another shape: MiniCPM5-MoE's q_gate_proj,
DeepSeek-V4's; Starcoder2's c_fc / c_proj; a Mamba mixer), or ungated experts (Nemotron-H's up_proj / down_proj;
Ergo's, with a norm each). Linear-attention layers of the gated delta rule (Qwen3-Next's, Qwen3.5's) are the one
exception, on purpose: each rank runs all of them (their results right, their work not divided); the model's full
attention and MoE blocks are sharded.
"""
from __future__ import annotations

import copy
import sys
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["shard_decoder", "RowParallelLinear"]

# q_b_proj and kv_b_proj: multi-head latent attention's per-head up-projections (DeepSeek V2 / V3); its
# down-projections to the shared latents (q_a_proj, kv_a_proj_with_mqa) and their norms stay replicated.
# Projections in one: q, k and v in that order (Phi-3's and Ergo's qkv_proj, split by the config's head counts),
# gate and up concatenated (Phi-3's and GLM's gate_up_proj, split by chunk(2)); a rank keeps its share of each part.
_QKV, _GATE_UP = "qkv_proj", "gate_up_proj"
_COLUMN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", _QKV, _GATE_UP)
_ROW = ("o_proj", "down_proj")
_ATTENTION = ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}, {_QKV, "o_proj"})
_MLP = {"gate_proj", "up_proj", "down_proj"}
# A dense MLP: gated (_MLP, or gate and up in one), or not (Arcee's, Nemotron's: down_proj(act(up_proj(x))), its
# activation elementwise).
_DENSE_MLPS = ({"up_proj", "down_proj"}, {_GATE_UP, "down_proj"})


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T + bias): one rank's slice of a row-parallel linear layer.

    weight: [out, in / world] (this rank's columns of the unsharded layer's), of the model's float dtype
    (not checked here), on a device the group's backend takes (CUDA for NCCL); bias: [out] or None, the
    unsharded layer's (the same on every rank), of weight's dtype and on its device; group: the
    tensor-parallel group (None: WORLD). Both are kept, not copied, as parameters that do not require
    grad. The group's first rank adds the bias to its partial product (as vLLM does) rather than every
    rank after the sum, so that what reads the all-reduce's sum (the residual add and norm) reads it
    directly: the tail commfuse.fusion fuses."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group
        self.adds_bias = dist.get_rank(group) == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in / world], this rank's slice of the input features, weight's dtype and device.
        Returns [..., out] of weight's dtype on x's device: the sum over the group of every rank's partial
        product (torch.distributed.all_reduce in place; every rank of the group must call it), the bias
        added once."""
        y = F.linear(x, self.weight, self.bias if self.adds_bias else None)
        dist.all_reduce(y, group=self.group)
        return y


def _column(linear: nn.Linear, part: int, parts: int) -> nn.Linear:
    """Output features part * out / parts up to (part + 1) * out / parts: a rank's share (part rank of world), or
    where key-value heads are replicated, the one head's rows a rank keeps (_kv_share)."""
    out = linear.out_features // parts
    new = nn.Linear(linear.in_features, out, bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(linear.weight[part * out:(part + 1) * out])
        if linear.bias is not None:
            new.bias.copy_(linear.bias[part * out:(part + 1) * out])
    return new


def _parts_column(linear: nn.Linear, parts: list) -> nn.Linear:
    """The rows (start, count) of `parts` of `linear`, concatenated in that order: a rank's share of each projection
    of a fused one."""
    out = sum(n for _, n in parts)
    new = nn.Linear(linear.in_features, out, bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(torch.cat([linear.weight[a:a + n] for a, n in parts]))
        if linear.bias is not None:
            new.bias.copy_(torch.cat([linear.bias[a:a + n] for a, n in parts]))
    return new


def _fused_parts(name: str, linear: nn.Linear, layer: nn.Module, rank: int, world: int, heads: int, kv: int) -> list:
    """(start, count) of this rank's rows of a fused projection: its query heads', then its key-value heads' (their
    share, or the one replicated, _kv_share) of qkv_proj; its gate features', then its up features' of
    gate_up_proj."""
    if name == _GATE_UP:
        n = linear.out_features // 2 // world
        return [(rank * n, n), (linear.out_features // 2 + rank * n, n)]
    d = _head_dim(layer, heads)
    q, (part, parts) = heads // world * d, _kv_share(kv, rank, world)
    k = kv // parts * d
    return [(rank * q, q), (heads * d + part * k, k), ((heads + kv) * d + part * k, k)]


def _row(linear: nn.Linear, rank: int, world: int, group) -> RowParallelLinear:
    cols = linear.in_features // world
    weight = linear.weight.detach()[:, rank * cols:(rank + 1) * cols].contiguous()
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallelLinear(weight, bias, group)


def _slice_linear(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    """This rank's input columns of `linear`, without an all-reduce: a partial product that a later
    all-reduce sums (a MoE block's shared expert); the bias is kept on rank 0 only, so the sum adds it once."""
    cols = linear.in_features // world
    new = nn.Linear(cols, linear.out_features, bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(linear.weight[:, rank * cols:(rank + 1) * cols])
        if linear.bias is not None:
            new.bias.copy_(linear.bias if rank == 0 else torch.zeros_like(linear.bias))
    return new


_ROUTERS = ("gate", "router")  # gpt-oss names it router
_SHARDED = "_commfuse_sharded"  # set on a MoE block once sharded (a dense layer's RowParallelLinear says so)


def _is_moe_block(module: nn.Module) -> bool:
    """A router and experts of stacked weights: gated (gate_up_proj, down_proj) or not (up_proj, down_proj:
    Nemotron-H's), which _check_moe_block refuses rather than leave whole."""
    experts = getattr(module, "experts", None)
    return any(hasattr(module, n) for n in _ROUTERS) and any(
        all(isinstance(getattr(experts, n, None), torch.Tensor) for n in (up, "down_proj"))
        for up in ("gate_up_proj", "up_proj"))


_SHARED = ("shared_expert", "shared_experts")  # Qwen2-MoE's; DeepSeek's and GLM4-MoE's
_MOE_CHILDREN = {*_ROUTERS, "experts", "shared_expert_gate", *_SHARED}


def _shared_expert(block: nn.Module) -> Optional[nn.Module]:
    return next((getattr(block, n) for n in _SHARED if getattr(block, n, None) is not None), None)


def _intermediate_axes(experts: nn.Module) -> tuple[int, int]:
    """The axes of gate_up_proj and down_proj that run over the intermediate features: transformers stores
    them [experts, 2 * intermediate, h] and [experts, h, intermediate], or transposed (gpt-oss)."""
    return (2, 1) if getattr(experts, "is_transposed", False) else (1, 2)


def _gate_up_share(t: torch.Tensor, axis: int, inter: int, rank: int, n: int, concatenated: bool) -> torch.Tensor:
    """This rank's n gate and n up features of `t` along its 2 * inter `axis`: a share of each half where
    gate and up are concatenated, one run of (gate, up) pairs where they are interleaved (gpt-oss)."""
    if concatenated:
        return torch.cat([t.narrow(axis, rank * n, n), t.narrow(axis, inter + rank * n, n)], dim=axis).contiguous()
    return t.narrow(axis, 2 * rank * n, 2 * n).contiguous()


def _check_moe_block(path: str, block: nn.Module, world: int) -> None:
    """ValueError where shard_decoder cannot shard this MoE block over `world` ranks (before any is)."""
    experts = block.experts
    gated = isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) and getattr(experts, "has_gate", True)
    layout = {"has_gate": gated, "has_post_expert_norm": bool(getattr(experts, "has_post_expert_norm", False))
              or getattr(experts, "post_expert_norm", None) is not None}  # Ergo's says it by its module alone
    if layout != {"has_gate": True, "has_post_expert_norm": False}:
        raise ValueError(f"{path}.experts ({type(experts).__name__}) store their weights as {layout}: "
                         "shard_decoder knows gated experts (gate_up_proj) without a norm per expert")
    if getattr(block, "zero_expert_num", 0):  # LongcatFlash's
        raise ValueError(f"{path} ({type(block).__name__}) has {block.zero_expert_num} zero experts, which add "
                         "the block's input itself: the all-reduce would sum it once per rank")
    # A part of the block that the hook's all-reduce would sum once per rank unless it is sharded.
    other = [n for n, m in block.named_children() if n not in _MOE_CHILDREN and any(True for _ in m.parameters())]
    # The block's own weights: one value per expert steers the routing (afmoe's expert_bias), which every rank
    # repeats; any other (an output bias) would be summed once per rank.
    up, down = experts.gate_up_proj, experts.down_proj
    up_axis, down_axis = _intermediate_axes(experts)
    h = down.shape[3 - down_axis] if down.dim() == 3 else None  # where h equals the experts' count, no telling
    other += [n for n, p in block.named_parameters(recurse=False) if tuple(p.shape) != (up.shape[0],)
              or up.shape[0] == h]
    if other:
        raise ValueError(f"MoE block {type(block).__name__} has {other} beside its router, experts and shared "
                         "expert: shard_decoder does not know how to shard them")
    inter = down.shape[down_axis] if down.dim() == 3 else 0
    if up.dim() != 3 or down.dim() != 3 or up.shape[up_axis] != 2 * inter:
        want = ("[experts, h, 2 * intermediate] and [experts, intermediate, h]" if up_axis == 2 else
                "[experts, 2 * intermediate, h] and [experts, h, intermediate]")
        raise ValueError(f"{path}.experts hold gate_up_proj {tuple(up.shape)} and down_proj {tuple(down.shape)}: "
                         f"not the layout {want}" + ("" if getattr(experts, "is_transposed", None) is not None else
                                                     " (the experts say nothing of is_transposed)"))
    if inter % world:
        raise ValueError(f"{path}.experts' intermediate size {inter} does not divide by the world size {world}")
    if getattr(experts, "has_bias", False):
        h = up.shape[3 - up_axis]
        shapes = {n: tuple(b.shape) if isinstance(b := getattr(experts, n, None), torch.Tensor) else None
                  for n in ("gate_up_proj_bias", "down_proj_bias")}
        if shapes != {"gate_up_proj_bias": (up.shape[0], 2 * inter), "down_proj_bias": (up.shape[0], h)}:
            raise ValueError(f"MoE experts with biases {shapes}: expected gate_up_proj_bias [experts, "
                             "2 * intermediate] and down_proj_bias [experts, h]")
    # Other expert weights (a quantized checkpoint's scales) would stay whole on every rank.
    weights = {"gate_up_proj", "down_proj", *(("gate_up_proj_bias", "down_proj_bias")
                                              if getattr(experts, "has_bias", False) else ())}
    other = [n for n, _ in experts.named_parameters() if n not in weights]
    if other:
        raise ValueError(f"{path}.experts has {other} beside {sorted(weights)}: shard_decoder does not know how to "
                         "shard them")
    shared = _shared_expert(block)
    if shared is not None and not _MLP <= {n for n, _ in shared.named_children()}:
        raise ValueError(f"MoE block {type(block).__name__}'s shared expert {type(shared).__name__} is not an MLP "
                         "of gate_proj, up_proj and down_proj")
    if shared is not None:
        _check_layer(f"{path}'s shared expert", shared, False, 0, 0, world)


def _shard_moe_block(block: nn.Module, rank: int, world: int, group) -> None:
    """Each expert's (and the shared expert's) intermediate features over the ranks; the block's output
    all-reduced in place by a forward hook. The experts' down_proj biases are kept on rank 0 only, so that
    the sum adds each once."""
    experts = block.experts
    up_axis, down_axis = _intermediate_axes(experts)
    inter = experts.down_proj.shape[down_axis]
    n = inter // world
    concatenated = getattr(experts, "is_concatenated", True)
    shares = {"gate_up_proj": lambda t: _gate_up_share(t, up_axis, inter, rank, n, concatenated),
              "down_proj": lambda t: t.narrow(down_axis, rank * n, n).contiguous()}
    if getattr(experts, "has_bias", False):
        shares["gate_up_proj_bias"] = lambda t: _gate_up_share(t, 1, inter, rank, n, concatenated)
        shares["down_proj_bias"] = lambda t: t.clone() if rank == 0 else torch.zeros_like(t)
    with torch.no_grad():
        for name, share in shares.items():
            old = getattr(experts, name)
            setattr(experts, name, nn.Parameter(share(old.detach())))
    for name in ("intermediate_dim", "intermediate_size"):
        if isinstance(getattr(experts, name, None), int):
            setattr(experts, name, n)
    shared = _shared_expert(block)
    if shared is not None:
        shared.gate_proj = _column(shared.gate_proj, rank, world)
        shared.up_proj = _column(shared.up_proj, rank, world)
        shared.down_proj = _slice_linear(shared.down_proj, rank, world)

    def all_reduce(module, args, output):
        # gpt-oss's block returns (output, router scores)
        dist.all_reduce(output[0] if isinstance(output, tuple) else output, group=group)

    block.register_forward_hook(all_reduce)
    setattr(block, _SHARDED, True)


# What an attention may hold beside the projections it shards: per-head q/k norms (checked), and latent
# attention's replicated down-projections with their norms. Its head counts are set to a rank's share.
_HEAD_NORMS = ("q_norm", "k_norm", "query_layernorm", "key_layernorm")  # the latter two HunYuan's
_PER_HEAD_NORMS = ("q_layernorm", "k_layernorm")  # StableLM's qk_layernorm: one LayerNorm a head, in a list
_ATTENTION_KEEPS = {*_HEAD_NORMS, *_PER_HEAD_NORMS, "q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa",
                    "kv_a_layernorm"}
_HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
_KV_COUNTS = ("num_key_value_heads", "num_kv_heads")
_KV_PROJ = ("k_proj", "v_proj")  # a key-value head's rows, replicated where there are fewer heads than ranks


def _layers(model: nn.Module, blocks: list) -> list:
    """(path, module, is_attention) of each attention and each dense MLP outside the MoE blocks."""
    in_moe = {m for b in blocks for m in b.modules()}
    found = []
    for path, layer in model.named_modules():
        if layer in in_moe:
            continue
        names = {n for n, _ in layer.named_children()}
        if any(names >= a for a in _ATTENTION):
            found.append((path, layer, True))
        elif any(names >= m for m in _DENSE_MLPS):
            found.append((path, layer, False))
    return found


# Left whole on every rank on purpose: linear attention of the gated delta rule (transformers' *GatedDeltaNet:
# Qwen3-Next's, Qwen3.5's and its MoE's), whose fused projections, convolution and gated norm shard_decoder does not
# share out. Each rank runs all of it (no all-reduce follows it), so the model's results stay right; that layer's
# weights and work are not divided, its full attention's and MoE blocks' are.
_KEPT_WHOLE = "GatedDeltaNet"


def _first_stacked_matrix(model: nn.Module) -> Optional[str]:
    """The path of the first weight matrix of a ModuleList of layers (a decoder's stack) whose module has no name
    that shard_decoder knows, or None."""
    for path, stack in model.named_modules():
        if isinstance(stack, nn.ModuleList):
            for name, p in stack.named_parameters():
                if p.dim() >= 2 and name.rsplit(".", 2)[-2] not in (*_COLUMN, *_ROW):
                    return f"{path}.{name}"
    return None


def _check_covered(model: nn.Module, layers: list, blocks: list) -> None:
    """Raise where a decoder layer (each child of a ModuleList that holds an attention, MLP or MoE block found,
    whether or not the layer itself holds one) has a weight matrix in none of its attention, MLP or MoE block: an
    attention of another shape (MiniCPM5-MoE's q_gate_proj, DeepSeek-V4's), an MLP of another shape (Starcoder2's
    c_fc / c_proj) or a mixer of another kind would
    stay whole on every rank, the model sharded only in part (its results right, that part's weights and work not
    divided). Linear attention of the gated delta rule (_KEPT_WHOLE) stays whole on purpose."""
    found = {*(layer for _, layer, _ in layers), *blocks}
    covered = {id(p) for m in model.modules() if m in found or type(m).__name__.endswith(_KEPT_WHOLE)
               for p in m.parameters()}
    for path, stack in model.named_modules():
        if not (isinstance(stack, nn.ModuleList) and any(m in found for m in stack.modules())):
            continue
        for name, p in stack.named_parameters():
            if p.dim() >= 2 and id(p) not in covered:
                raise ValueError(f"{path}.{name} is in no attention, MLP (up/down_proj or gate_up/down_proj) or MoE "
                                 "block that shard_decoder knows: every rank would keep all of it")


def _check_layer(path: str, layer: nn.Module, attention: bool, heads: int, kv: int, world: int) -> None:
    """Raise where shard_decoder cannot shard this attention or MLP over `world` ranks: a weighted part it
    does not know (each rank would keep all of it, or the wrong share: DiffLlama's lambdas, BitNet's norm
    of the whole projection), a projection that is not an nn.Linear or whose sharded features do not
    divide, an MLP that picks among its intermediate features (Gemma 3n's activation sparsity), a head
    count that does not divide, a q_norm / k_norm over more than one head's features (Olmo2 norms the
    whole projection: a rank's share of the heads would change it), or sinks that are not one per head."""
    known = {*_COLUMN, *_ROW, *(_ATTENTION_KEEPS if attention else ())}
    other = [n for n, m in layer.named_children() if n not in known and any(True for _ in m.parameters())]
    other += [n for n, _ in layer.named_parameters(recurse=False) if not (attention and n == "sinks")]
    if other:
        raise ValueError(f"{path} ({type(layer).__name__}) has {other} beside its projections: shard_decoder "
                         "does not know how to shard them")
    for name, child in layer.named_children():
        if name in (*_COLUMN, *_ROW) and type(child) is not nn.Linear:
            raise ValueError(f"{path}.{name} is a {type(child).__name__}, not an nn.Linear: shard_decoder "
                             "shards plain linear layers")
    if attention:
        kv = _check_kv_heads(path, layer, heads, kv, world)
    for name, child in layer.named_children():
        if name == _QKV and child.out_features != (heads + 2 * kv) * _head_dim(layer, heads):
            raise ValueError(f"{path}.{name} has {child.out_features} output features, not the queries, keys and "
                             f"values of {heads} + 2 x {kv} heads of {_head_dim(layer, heads)}")
        features = child.out_features if name in _COLUMN else child.in_features if name in _ROW else 0
        parts = _kv_share(kv, 0, world)[1] if attention and name in _KV_PROJ else world
        if name in (_QKV, _GATE_UP):  # its parts' shares: heads and key-value heads are checked apart
            features, parts = (child.out_features, 2 * world) if name == _GATE_UP else (0, 1)
        if features % parts:
            by = f"the world size {world}" if parts == world else f"its {parts} key-value heads"
            raise ValueError(f"{path}.{name} has {features} {'output' if name in _COLUMN else 'input'} features, "
                             f"which do not divide by {by}")
    if not attention:
        if getattr(layer, "activation_sparsity", 0):
            raise ValueError(f"{path} ({type(layer).__name__}) keeps a top share of its intermediate features "
                             "(activation sparsity), chosen over all of them: a rank sees only its share")
        return
    for name in _HEAD_COUNTS:
        count = getattr(layer, name, None)
        if type(count) is int and count % (_kv_share(kv, 0, world)[1] if name in _KV_COUNTS else world):
            raise ValueError(f"{path}.{name} = {count} does not divide by the world size {world}")
    for name, count in zip(_PER_HEAD_NORMS, (heads, kv)):
        norm = getattr(layer, name, None)
        norms = getattr(norm, "norms", None)
        if norm is not None and not (isinstance(norms, nn.ModuleList) and len(norms) == count):
            raise ValueError(f"{path}.{name} ({type(norm).__name__}) is not a list of {count} norms, one a head: "
                             "shard_decoder cannot share it out by heads")
    sinks = getattr(layer, "sinks", None)
    if isinstance(sinks, torch.Tensor) and tuple(sinks.shape) != (heads,):
        raise ValueError(f"{path}.sinks has shape {tuple(sinks.shape)}, not one logit per head ({heads},): "
                         "shard_decoder cannot share it out by heads")
    q_proj = getattr(layer, "q_proj", None)
    if not isinstance(q_proj, nn.Linear) and not hasattr(layer, _QKV):
        return
    head_dim = _head_dim(layer, heads)
    queries = q_proj.out_features if isinstance(q_proj, nn.Linear) else heads * head_dim
    for name in _HEAD_NORMS:
        norm = getattr(layer, name, None)
        params = [] if norm is None else list(norm.parameters())
        if not params:
            continue
        # One head's weight (and bias) that every head shares; not one per head, nor one over the projection.
        w = getattr(norm, "weight", None)
        if not (isinstance(w, torch.Tensor) and len(params) <= 2 and all(p.numel() == head_dim for p in params)):
            if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[-1] == head_dim:
                raise ValueError(f"{path}.{name} has a weight of its own for each head {tuple(w.shape)} (Cohere's): "
                                 "shard_decoder shares out only norms whose one head's weight every head shares; "
                                 "not a decoder shard_decoder knows")
            what = f"{w.numel()} features" if isinstance(w, torch.Tensor) else f"with {len(params)} weights"
            whole = isinstance(w, torch.Tensor) and w.numel() == queries
            raise ValueError(f"{path}.{name} normalises {what}, not one head's {head_dim}: sharding the heads "
                             "would change it" + (" (a norm over the whole projection, as Olmo2's)" if whole else "")
                             + "; not a decoder shard_decoder knows")


def _head_dim(layer: nn.Module, heads: int) -> int:
    """The attention's own head_dim where it keeps one: a q_proj may project more than the queries (Qwen3-Next's
    output gate doubles it)."""
    head_dim = getattr(layer, "head_dim", None)
    if type(head_dim) is int:
        return head_dim
    return layer.q_proj.out_features // heads if hasattr(layer, "q_proj") else layer.o_proj.in_features // heads


def _kv_heads(layer: nn.Module, heads: int, kv: int) -> int:
    """The key-value heads of this attention: its k_proj's, which may differ from the config's by layer
    (MiMo-V2-Flash's sliding-window layers have twice as many), or the config's kv where it has no k_proj
    (latent attention: kv_b_proj expands each query head's own)."""
    k_proj = getattr(layer, "k_proj", None)
    return k_proj.out_features // _head_dim(layer, heads) if isinstance(k_proj, nn.Linear) else kv


def _check_kv_heads(path: str, layer: nn.Module, heads: int, kv: int, world: int) -> int:
    """This attention's key-value heads (_kv_heads), where they divide by the world size or divide it."""
    k_proj = getattr(layer, "k_proj", None)
    if isinstance(k_proj, nn.Linear) and k_proj.out_features % _head_dim(layer, heads):
        raise ValueError(f"{path}.k_proj has {k_proj.out_features} output features, not a whole number of heads "
                         f"of {_head_dim(layer, heads)}")
    kv = _kv_heads(layer, heads, kv)
    if kv % world and world % kv:
        raise ValueError(f"{path} has {kv} key-value heads, which do not divide by the world size {world}, nor "
                         "the world size by them")
    return kv


def _kv_share(kv: int, rank: int, world: int) -> tuple:
    """(part, parts): this rank's share of kv key-value heads, 1 / world of them, or where there are fewer heads
    than ranks (world divides by kv), the one head its queries read (rank r's queries are heads r * q / world to
    (r + 1) * q / world, in key-value head r * kv // world's group), replicated over world / kv ranks."""
    return (rank, world) if kv % world == 0 else (rank * kv // world, kv)


def _shard_attention(layer: nn.Module, rank: int, world: int, heads: int, kv: int) -> None:
    """An attention's sinks (gpt-oss's per-head logits), per-head norm lists (StableLM's qk_layernorm) and the
    head counts it keeps (StableLM views its projections with its own num_heads, the query groups each key-value
    head serves): a rank's share."""
    sinks = getattr(layer, "sinks", None)
    if isinstance(sinks, torch.Tensor):
        n = sinks.shape[0] // world
        layer.sinks = nn.Parameter(sinks.detach()[rank * n:(rank + 1) * n].clone())
    kv_part, kv_parts = _kv_share(kv, rank, world)
    for name, (part, parts) in (("q_layernorm", (rank, world)), ("k_layernorm", (kv_part, kv_parts))):
        norms = getattr(getattr(layer, name, None), "norms", None)
        if isinstance(norms, nn.ModuleList):
            n = len(norms) // parts
            getattr(layer, name).norms = nn.ModuleList(list(norms)[part * n:(part + 1) * n])
            getattr(layer, name).num_heads = n
    for name in _HEAD_COUNTS:
        count = getattr(layer, name, None)
        if type(count) is int:
            setattr(layer, name, count // world if name not in _KV_COUNTS else count // kv_parts)
    if type(getattr(layer, "num_key_value_groups", None)) is int:
        layer.num_key_value_groups = heads // world // (kv // kv_parts)  # kv_parts divides kv (_kv_share)
    if hasattr(layer, _QKV) and getattr(layer, "config", None) is not None:
        # Phi-3's attention splits qkv_proj's output at its config's query count: a config of its own with the
        # rank's head counts (a shallow copy: every other setting the model's).
        layer.config = copy.copy(layer.config)
        layer.config.num_attention_heads, layer.config.num_key_value_heads = heads // world, kv // kv_parts


_SUM_CHUNK = 1 << 22  # elements a step: each of a step's few int64 temporaries is 32 MiB
_PRIME = 2 ** 31 - 1  # residues below 2^31: a product of two fits int64, and a step's sum of them too


def _bits_sum(t: torch.Tensor) -> torch.Tensor:
    """A checksum of t's bits, an int64 tensor [2] on t's device: their integers summed, and summed weighted by
    their position (1, 2, ...) modulo a prime, so that a reordering (swapped rows, a transposed square matrix, Meta's
    q / k row order against the HF one) differs too. Integer arithmetic without overflow, in chunks: exact, so the
    same on every device."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size(), torch.uint8)
    flat = t.detach().contiguous().view(-1)
    flat = flat.view(torch.uint8).view(ints) if flat.dtype != ints else flat
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    placed = torch.zeros((), dtype=torch.int64, device=flat.device)
    for i in range(0, flat.numel(), _SUM_CHUNK):
        chunk = flat[i:i + _SUM_CHUNK]
        total += chunk.sum(dtype=torch.int64)
        position = torch.arange(i + 1, i + 1 + chunk.numel(), dtype=torch.int64, device=flat.device)
        weighted = chunk.to(torch.int64).remainder(_PRIME) * position.remainder(_PRIME)
        placed = (placed + weighted.remainder(_PRIME).sum()).remainder(_PRIME)
    return torch.stack([total, placed])


def _check_same_weights(model: nn.Module, group, kind: str) -> None:
    """Raise ValueError on every rank where the ranks' parameters differ (a checksum of each one's bits,
    all-gathered): each rank would shard weights of its own, and the sharded model sum garbage. A parameter on the
    meta device (no values yet) counts by its name alone. A rank whose checksums fail (out of memory) sends its
    error, and every rank raises."""
    if dist.get_world_size(group) == 1:
        return
    try:
        named = list(model.named_parameters())
        sums = {path: _bits_sum(p) for path, p in named if not p.is_meta}
        on: dict = {}  # the sums by device, read back once a device (not one host sync a parameter)
        for path, total in sums.items():
            on.setdefault(total.device, []).append(path)
        values = {}
        for paths in on.values():
            values.update(zip(paths, torch.stack([sums[q] for q in paths]).tolist()))
        mine = [(path, values.get(path)) for path, _ in named]
    except Exception as e:  # noqa: BLE001 - raised on every rank after the exchange
        mine = f"{type(e).__name__}: {e}"
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    for r, theirs in enumerate(every):
        if isinstance(theirs, str):
            raise ValueError(f"{kind}: group rank {r} could not checksum its weights ({theirs})")
    for r, theirs in enumerate(every):
        if theirs != every[0]:
            paths = [a[0] for a, b in zip(every[0], theirs) if a != b] or ["the parameters' names"]
            raise ValueError(f"{kind}: the ranks hold different weights ({paths[0]} differs between group ranks 0 "
                             f"and {r}): shard_decoder needs the same weights on every rank (seed from_config alike "
                             "on each, or load them with from_pretrained)")


def shard_decoder(model: nn.Module, group=None) -> nn.Module:
    """Shard `model` (a transformers decoder: *ForCausalLM or its base model) over `group` (None:
    WORLD) in place, for inference (no parameter requires grad), and return it. Every rank must call it with the
    same weights. Raises ValueError (naming the model's class), before it changes anything, where the
    heads or intermediate features (an expert's too) do not divide by the world size, the key-value heads (the
    config's, or an attention's own) neither divide it nor divide by it, where a MoE block's experts store their
    weights in another layout, where an attention or MLP holds a weighted part it does not know, a projection
    that is not an nn.Linear or whose sharded features do not divide, or a head count that does not divide, where
    an attention's q/k norm spans more than one head or its sinks are not one per head, where a decoder layer
    holds a weight matrix outside its attention, MLP and MoE block (an attention or MLP of another shape, a Mamba
    mixer; Qwen3-Next's linear attention excepted, left whole), where a config size is not one int, where the
    model has no layer of the known shape, where it is sharded already (by this function, or by transformers'
    tp_plan: DTensor weights), or, on every rank, where the ranks' weights differ (_check_same_weights: a model
    made by from_config on each rank without one seed)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call commfuse.init_distributed() first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    kind = type(model).__name__
    if rank < 0:
        raise ValueError(f"{kind}: this rank ({dist.get_rank()}) is not a member of group: only its ranks hold its "
                         "shards")
    # No DTensor exists until torch.distributed.tensor is imported (transformers' tp_plan imports it).
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for path, p in model.named_parameters():
        if dtensor is not None and isinstance(p, dtensor):
            raise ValueError(f"{kind}: {path} is a DTensor: the model is parallelised already (transformers' "
                             "tp_plan?); shard_decoder takes the unsharded model")
    done = [path for path, m in model.named_modules()
            if isinstance(m, RowParallelLinear) or getattr(m, _SHARDED, False)]
    if done:
        raise ValueError(f"{kind}: {done[0]} is sharded already: shard_decoder shards a model once")
    config = getattr(model, "config", None)
    sizes = {}
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        try:
            sizes[name] = getattr(config, name, None)
        except Exception as e:  # noqa: BLE001 - a config whose layers differ (Gemma 4) raises its own error
            raise ValueError(f"{kind}: model.config.{name} cannot be read as one value ({e}): not a decoder "
                             "shard_decoder knows") from e
    sizes["num_key_value_heads"] = sizes["num_key_value_heads"] or sizes["num_attention_heads"]
    heads = sizes["num_attention_heads"]
    for name, value in sizes.items():
        if value is None and name == "intermediate_size":
            continue  # every MLP a MoE block (Qwen3.5-MoE's config has none); a dense MLP's checked in _check_layer
        if value is None:
            raise ValueError(f"{kind}: model.config has no {name}: not a decoder shard_decoder knows")
        if type(value) is not int:
            raise ValueError(f"{kind}: model.config.{name} = {value!r} is not one int (sizes per layer?): not a "
                             "decoder shard_decoder knows")
        if name == "num_key_value_heads" and value and value < world and world % value == 0:
            continue  # a key-value head replicated over world / value ranks (_kv_share)
        if value % world:
            raise ValueError(f"{kind}: model.config.{name} = {value} does not divide by the world size {world}"
                             + (", nor the world size by it" if name == "num_key_value_heads" else ""))
    blocks = [(path, m) for path, m in model.named_modules() if _is_moe_block(m)]
    layers = _layers(model, [m for _, m in blocks])
    if not blocks and not any(n in _ROW for _, layer, _ in layers for n, _ in layer.named_children()):
        unknown = _first_stacked_matrix(model)  # named, as _check_covered names one
        raise ValueError(f"{kind}: no attention (q/k/v/o_proj, qkv/o_proj or kv_a/kv_b/o_proj), MLP (up/down_proj or "
                         "gate_up/down_proj) or MoE (gate, experts) layers found"
                         + (f" ({unknown} is in none)" if unknown else "") + ": not a decoder shard_decoder knows")
    try:
        _check_covered(model, layers, [m for _, m in blocks])
        for path, block in blocks:
            _check_moe_block(path, block, world)
        for path, layer, attention in layers:
            _check_layer(path, layer, attention, heads, sizes["num_key_value_heads"], world)
    except ValueError as e:
        raise ValueError(f"{kind}: {e}") from None
    _check_same_weights(model, group, kind)
    for _, block in blocks:
        _shard_moe_block(block, rank, world, group)
    for _, layer, attention in layers:
        kv = _kv_heads(layer, heads, sizes["num_key_value_heads"]) if attention else 0  # read before k_proj changes
        # A fused projection's rows, read before its siblings change (Phi-3's o_proj comes first, and its head_dim
        # may be read from it).
        fused = {name: _fused_parts(name, child, layer, rank, world, heads, kv)
                 for name, child in layer.named_children() if name in (_QKV, _GATE_UP)}
        if attention:
            _shard_attention(layer, rank, world, heads, kv)
        for name, child in list(layer.named_children()):
            if name in fused:
                setattr(layer, name, _parts_column(child, fused[name]))
            elif name in _COLUMN:
                part, parts = _kv_share(kv, rank, world) if attention and name in _KV_PROJ else (rank, world)
                setattr(layer, name, _column(child, part, parts))
            elif name in _ROW:
                setattr(layer, name, _row(child, rank, world, group))
    # Inference only: a sharded model's backward would need the all-reduces of the column-parallel layers'
    # input gradients (Megatron's), which it does not have.
    model.requires_grad_(False)
    return model
