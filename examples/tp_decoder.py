"""A tensor-parallel Llama-architecture decoder, unfused and with commfuse.fusion, eager and compiled.

    mpirun -n 2 python examples/tp_decoder.py --size tiny                 # CPU: gloo, seconds
    mpirun -n 2 python examples/tp_decoder.py --size 8b --layers 4 --compile --quant fp8 --json out.json
    python examples/tp_decoder.py --size tiny                             # world 1: the local ops only
    mpirun -n 2 python examples/tp_decoder.py --size tiny --moe --shared-expert --quant fp8   # a MoE decoder

The model is a small, faithful Llama (HF LlamaForCausalLM's structure, random weights): token
embedding, per layer RMSNorm -> attention (fused QKV projection, RoPE, grouped-query attention over
a KV cache, output projection) -> residual add -> RMSNorm -> SwiGLU MLP -> residual add, a final
RMSNorm and the LM head. It is sharded Megatron-style over the ranks of the world: the QKV and
gate/up projections are column-parallel (each rank holds heads / world of the heads and
intermediate / world of the MLP), the output and down projections row-parallel, each followed by a
sum all-reduce (`torch.distributed.all_reduce` in place, as models write it; `--collective funcol`
or `commfuse` for the other spellings); the embedding and LM head are replicated. RMSNorm is written
as HF Llama writes it (`--norm hf`: float32 math, the weight multiply after the cast back) or as
`torch.nn.functional.rms_norm` (`--norm torch`). `--quant fp8` makes the QKV and gate/up
projections static-FP8 linears ((n / s).clamp(-448, 448).to(float8_e4m3fn) -> torch._scaled_mm);
`--quant nvfp4` quantizes their inputs with commfuse.quantize (and dequantizes for a bf16 GEMM:
no NVFP4 GEMM here).

`--moe` makes every layer's MLP a tensor-parallel MoE block (Qwen-MoE / DeepSeek style; class MoE): a
replicated router linear -> softmax in float32 -> top-k (--moe-topk, default 2) of --experts (default 4),
renormalised; every expert a SwiGLU MLP of --moe-intermediate features (default intermediate / experts)
sharded Megatron-style, gate/up column-parallel and down row-parallel, so each rank computes partial expert
outputs. The selected experts' stacked weights are gathered per (token, slot) with index_select and applied
with bmm (as HF's batched_mm experts: one graph for any token count, no data-dependent loop; it gathers
t * k weight matrices, so keep --tokens small at the large sizes), and the outputs y [t, k, h] combined as
the models write it, `(y * routing_weights.unsqueeze(-1)).sum(dim=1).to(T)`, then `+ shared` (in T) with
--shared-expert (one shared expert of the same width, also sharded), then the all-reduce, the residual add
and the next RMSNorm: with an all-reduce (world > 1) the pass makes each layer's combine + all-reduce + add +
norm (+ quant) one commfuse::moe_all_reduce. With --quant the experts' input is quantized once (one static
scale; the router reads the bf16 norm, so that tail returns the norm too) and dequantized for the bf16 bmm
(no grouped FP8 / NVFP4 GEMM here); the shared expert's gate/up is a torch._scaled_mm on the FP8 codes.

`--gated-attn` puts each attention output through a grouped gated RMSNorm before the output projection, as
the linear-attention layers of Qwen3-Next and the Mamba2 mixers of Nemotron-H do: the QKV projection also
yields a gate z (heads / world x head_dim features a rank), and y = norm(attn * silu(z)) * w per group of
head_dim elements, written as HF's MambaRMSNormGated (class GatedNorm): a local pattern, which the pass
makes commfuse::gated_rmsnorm.

Each variant runs a prefill of --tokens tokens and --decode-steps decode steps (teacher-forced: the
same tokens for every variant, so their outputs compare step by step):
- eager / unfused: the model as written;
- eager / fused: commfuse.fusion.compile(model, comm, backend="eager") - dynamo's graph, rewritten,
  run op by op without a compiler;
- compiled / unfused and compiled / fused (with --compile): torch.compile with the inner backend
  (--backend; default inductor on CUDA, aot_eager on CPU), and --mode (e.g. reduce-overhead); the
  pass's --rewrite: "auto" (its own choice: with Inductor, local patterns without a collective are
  left to Inductor where its kernels measured as fast, commfuse.fusion.evidence) or "all" (every match,
  which measures the ops themselves).

The fused columns' outputs (the logits of every step) are checked against a reference run: the unfused
model with its RMSNorms written in commfuse's rounding order (float32 math, the weight multiply in
float32, one rounding: what the fused ops compute by definition), and with --moe at world > 1 its
combines too (commfuse.reference.moe_reduce: float32 products summed in slot order from the shared
output, one rounding to T, docs/semantics.md section 14; at world 1 the model has no all-reduce, the pass
leaves the combine as written and fuses its add + norm into the local op, so the reference keeps the
model's combine); with --moe every graph must have one commfuse::moe_all_reduce per layer at world > 1.
On the CPU every route is exact (gloo's fp32 rank-order sum, the separated tail = commfuse.reference), so
the check is bit for bit (but for a compiled column with --backend inductor, whose own code for the rest of
the graph rounds otherwise); on GPUs (fused kernels: the norm within 1 ulp of T) it is a relative RMS error
of the logits below --tol (docs/fusion.md, "Tolerances"), and the first layer's tail, run once through the
call the fused op makes on the model's own activations, within the kernels' tolerances of commfuse.reference
(commfuse.tolerance): a wrong fused op can hide in the logits' error, not there. The comparison with the
unfused model as written (HF's double rounding) is printed beside it: a 1-ulp change of the norms, amplified
by the random layers. The exit status is 1 when a check fails. Prints the per-step latency table (over --repeats rounds,
each a run of every column in an order drawn afresh each round: each step's time is the slowest rank's, the
table its median over the rounds), then each fused column's time against its unfused one as the median of
the rounds' ratios (a round's runs are milliseconds apart, so the host's drift over a run cancels) with a
95% confidence interval (under 6 rounds their range, whose coverage is lower, as the table says), and the
fusion reports; --json writes them all. main(argv) returns the results as a dict (the CI test calls it under
mpirun).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import commfuse  # noqa: E402
import commfuse.fusion  # noqa: E402
from commfuse import reference, tolerance  # noqa: E402
from commfuse.bench.timing import median_interval  # noqa: E402


@dataclass
class Config:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    layers: int
    eps: float = 1e-5
    rope_theta: float = 500000.0
    experts: int = 0  # > 0: the MLP is a MoE block of this many routed experts (--moe)
    topk: int = 2
    moe_intermediate: int = 0  # each expert's intermediate size (0: intermediate / experts)
    shared_expert: bool = False  # a shared expert (of moe_intermediate) added before the all-reduce


SIZES = {  # Llama-3 shapes (vocab reduced: it does not touch the all-reduce tails)
    "tiny": Config(hidden=256, heads=8, kv_heads=4, intermediate=512, vocab=512, layers=2),
    "8b": Config(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=32768, layers=2),
    "70b": Config(hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=32768, layers=2),
}
FP8_MAX = 448.0
QUANT_SCALE = 8.0 / FP8_MAX
# Where the fused route is not bit-exact (CUDA kernels: the norm within 1 ulp, codes of that norm), the
# logits are compared by relative RMS error. A 1-ulp change of the norms moves this random-weight model's
# logits by about 1% (none), 5% (fp8), 15-20% (nvfp4) on tiny (measured on CPU, docs/fusion.md): the
# defaults leave room for that and catch faults of order 1 (a wrong residual, scale or route). Subtler
# ones fit in that room (every norm without its weight: 0.24 with nvfp4), so the first layer's tail is
# also held to the kernels' own tolerances there (first_tail_mismatch).
TOLERANCES = {"none": 0.05, "fp8": 0.15, "nvfp4": 0.4}  # static activation scales (dequant): the norms' outputs stay well below 8


# --------------------------------------------------------------------------- the model


def _randn(shape, seed, std, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g) * std).to(device=device, dtype=dtype)


class GatedNorm(torch.nn.Module):
    """y = norm(x * silu(z)) * w per group of `group` elements: HF Mamba2 / Nemotron-H's MambaRMSNormGated as
    written ("hf", "torch": float32 math, the weight multiply after the cast back), or commfuse's rounding order
    ("once": reference.gated_rmsnorm, the check's reference)."""

    def __init__(self, hidden, group, eps, device, dtype, seed):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + _randn((hidden,), seed, 0.1, device, dtype), requires_grad=False)
        self.group, self.eps, self.style = group, eps, "hf"

    def forward(self, x, z):
        if self.style == "once":
            return reference.gated_rmsnorm(x, z, self.weight, self.eps, self.group, False).view(x.shape)
        input_dtype = x.dtype
        hidden_states = x.to(torch.float32) * F.silu(z.to(torch.float32))
        shape = hidden_states.shape
        hidden_states = hidden_states.view(*shape[:-1], shape[-1] // self.group, self.group)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states * torch.rsqrt(variance + self.eps)).view(shape)
        return self.weight * hidden_states.to(input_dtype)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden, eps, style, device, dtype, seed):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + _randn((hidden,), seed, 0.1, device, dtype), requires_grad=False)
        self.eps, self.style = eps, style

    def forward(self, x):
        if self.style == "torch":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if self.style == "once":  # commfuse's rounding order (docs/semantics.md): the check's reference
            xf = x.float()
            inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (xf * inv * self.weight.float()).to(x.dtype)
        # HF LlamaRMSNorm, verbatim
        input_dtype = x.dtype
        hidden_states = x.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)


class Linear(torch.nn.Module):
    """y = x @ W^T, bf16/fp16, or static FP8 (input quantized with a fixed dequant scale), or NVFP4 input."""

    def __init__(self, fan_in, fan_out, quant, device, dtype, seed):
        super().__init__()
        w = _randn((fan_out, fan_in), seed, 1 / math.sqrt(fan_in), device, torch.float32)
        self.quant = quant
        if quant == "fp8":
            w_scale = w.abs().amax().clamp_min(1e-12) / FP8_MAX
            self.register_buffer("weight", (w / w_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
            self.register_buffer("w_scale", w_scale.reshape(1).float())
        else:
            self.register_buffer("weight", w.to(dtype))
        if quant in ("fp8", "nvfp4"):
            self.register_buffer("x_scale", torch.tensor([QUANT_SCALE if quant == "fp8" else 8.0 / (FP8_MAX * 6)],
                                                         dtype=torch.float32, device=device))
        self.dtype = dtype

    def forward(self, x):
        if self.quant is None:
            return F.linear(x, self.weight)
        x2 = x.view(-1, x.shape[-1])
        if self.quant == "fp8":  # as vLLM / TensorRT-LLM's static per-tensor FP8 linears write it
            q = (x2 / self.x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(q, self.weight.t(), scale_a=self.x_scale, scale_b=self.w_scale, out_dtype=self.dtype)
        else:
            q, sf, _ = commfuse.quantize(x2, "nvfp4", self.x_scale, sf_layout="linear")
            deq = _dequant_nvfp4(q, sf, self.x_scale).to(self.dtype)
            y = F.linear(deq, self.weight)
        return y.view(*x.shape[:-1], -1)


def _dequant_nvfp4(q, sf, scale):
    lo, hi = (q & 0xF), (q >> 4)
    codes = torch.stack((lo, hi), dim=-1).reshape(q.shape[0], -1)
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                         device=q.device)
    vals = table[codes.long()].view(q.shape[0], -1, 16) * sf.float().unsqueeze(-1)
    return vals.view(q.shape[0], -1) * scale


class MoE(torch.nn.Module):
    """A tensor-parallel MoE block (Qwen-MoE / DeepSeek style), the rank's partial output before the all-reduce.

    Router (replicated linear) -> softmax in float32 -> top-k -> renormalised float32 routing weights w [n, k];
    `experts` SwiGLU experts, each sharded Megatron-style (gate/up column-parallel, down row-parallel: this rank
    holds inter / world of every expert's intermediate features), stacked as [E, 2 * inter, h] and [E, h, inter];
    the selected experts' weights gathered per (token, slot) (index_select, token-major as HF's batched_mm
    experts) and applied with bmm, so the graph is one with any token count (no data-dependent loop or
    .nonzero()); y [n, k, h] the partial expert outputs, combined as Qwen-MoE / DeepSeek write it,
    `(y * w.unsqueeze(-1)).sum(dim=1).to(T)` (+ the shared expert's partial output, added in T). With
    combine = "commfuse" the combine is commfuse.reference.moe_reduce (slot order in float32, the shared output
    first, one rounding: docs/semantics.md section 14), the checks' reference. With --quant the experts' input is
    quantized once (static FP8 or NVFP4, one scale) and dequantized for the bf16 bmm (no grouped low-precision
    GEMM here); the shared expert's gate/up runs torch._scaled_mm on the FP8 codes; the router reads the norm."""

    def __init__(self, h, cfg: Config, inter, quant, device, dtype, seed, rank_seed):
        super().__init__()
        e = cfg.experts
        self.top_k, self.quant, self.dtype, self.combine = cfg.topk, quant, dtype, "model"
        self.router = Linear(h, e, None, device, dtype, seed)  # replicated: every rank routes alike
        self.register_buffer("gate_up", _randn((e, 2 * inter, h), rank_seed + 1, 1 / math.sqrt(h), device, dtype))
        self.register_buffer("down", _randn((e, h, inter), rank_seed + 2, 1 / math.sqrt(inter), device, dtype))
        self.shared = None
        if cfg.shared_expert:
            self.shared = torch.nn.Module()
            self.shared.gate_up = Linear(h, 2 * inter, quant, device, dtype, rank_seed + 3)
            self.shared.down = Linear(inter, h, None, device, dtype, rank_seed + 4)
        if quant is not None:
            self.register_buffer("x_scale", torch.tensor([QUANT_SCALE if quant == "fp8" else 8.0 / (FP8_MAX * 6)],
                                                         dtype=torch.float32, device=device))

    def forward(self, x):
        b, t, h = x.shape
        k = self.top_k
        xf = x.view(-1, h)
        routing_weights = F.softmax(self.router(xf), dim=-1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, k, dim=-1)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)  # float32 [n, k]
        # The experts' input, quantized once with one static scale. (From its own view of the norm: the pass
        # fuses a quantization reached through views that nothing else reads, not through the router's xf.)
        codes = None
        if self.quant == "fp8":
            codes = (x.view(-1, h) / self.x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            xe = (codes.float() * self.x_scale).to(self.dtype)
        elif self.quant == "nvfp4":
            q, sf, _ = commfuse.quantize(x.view(-1, h), "nvfp4", self.x_scale, sf_layout="linear")
            xe = _dequant_nvfp4(q, sf, self.x_scale).to(self.dtype)
        else:
            xe = xf
        e = selected.reshape(-1)  # token-major: row i * k + j is token i's j-th expert
        xs = xe.repeat_interleave(k, dim=0).unsqueeze(-1)  # [n * k, h, 1]
        gate, up = torch.bmm(self.gate_up.index_select(0, e), xs).squeeze(-1).chunk(2, dim=-1)
        rows = torch.bmm(self.down.index_select(0, e), (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        y = rows.view(-1, k, h)  # [n, k, h]: this rank's partial expert outputs
        shared = None
        if self.shared is not None:
            if self.quant == "fp8":
                su = torch._scaled_mm(codes, self.shared.gate_up.weight.t(), scale_a=self.x_scale,
                                      scale_b=self.shared.gate_up.w_scale, out_dtype=self.dtype)
            else:
                su = F.linear(xe, self.shared.gate_up.weight)
            s_gate, s_up = su.chunk(2, dim=-1)
            shared = self.shared.down(F.silu(s_gate) * s_up)
        if self.combine == "commfuse":  # the reference: commfuse's order (what moe_all_reduce computes)
            out = commfuse.reference.moe_reduce(y, routing_weights, shared)
        else:  # as Qwen-MoE / DeepSeek write it
            out = (y * routing_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
            if shared is not None:
                out = out + shared
        return out.view(b, t, h)


class Decoder(torch.nn.Module):
    def __init__(self, cfg: Config, rank: int, world: int, device, dtype, *, norm="hf", quant=None,
                 collective="dist", comm=None, max_len=256, batch=1, gated_attn=False):
        super().__init__()
        if cfg.heads % world or cfg.kv_heads % world or cfg.intermediate % world:
            raise ValueError(f"heads {cfg.heads}, kv heads {cfg.kv_heads}, intermediate {cfg.intermediate} must "
                             f"divide by the world size {world}")
        self.cfg, self.world, self.collective, self.comm = cfg, world, collective, comm
        self.head_dim = cfg.hidden // cfg.heads
        self.heads, self.kv_heads = cfg.heads // world, cfg.kv_heads // world
        self.inter = cfg.intermediate // world
        moe_inter = cfg.moe_intermediate or cfg.intermediate // max(cfg.experts, 1)
        if cfg.experts:
            if moe_inter % world or not 1 <= cfg.topk <= cfg.experts:
                raise ValueError(f"expert intermediate {moe_inter} must divide by the world size {world}, top-k "
                                 f"{cfg.topk} be in 1..{cfg.experts}")
        self.moe_inter = moe_inter // world
        hd, h = self.head_dim, cfg.hidden
        self.embed = torch.nn.Parameter(_randn((cfg.vocab, h), 1, 1.0, device, dtype), requires_grad=False)
        self.layers = torch.nn.ModuleList()
        for i in range(cfg.layers):
            s = 1000 * (i + 1) + 10 * rank  # this rank's shards (column / row slices), reproducible
            layer = torch.nn.Module()
            layer.input_layernorm = RMSNorm(h, cfg.eps, norm, device, dtype, 1000 * (i + 1) + 1)
            gates = self.heads if gated_attn else 0  # the gated norm's z: one more head-sized output a head
            layer.qkv = Linear(h, (self.heads + 2 * self.kv_heads + gates) * hd, quant, device, dtype, s + 2)
            if gated_attn:
                layer.attn_norm = GatedNorm(self.heads * hd, hd, cfg.eps, device, dtype, s + 9)
            layer.o_proj = Linear(self.heads * hd, h, None, device, dtype, s + 3)
            layer.post_attention_layernorm = RMSNorm(h, cfg.eps, norm, device, dtype, 1000 * (i + 1) + 4)
            if cfg.experts:
                layer.mlp = MoE(h, cfg, self.moe_inter, quant, device, dtype, 1000 * (i + 1) + 7,
                                1000 * (i + 1) + 500 + 10 * rank)
            else:
                layer.gate_up = Linear(h, 2 * self.inter, quant, device, dtype, s + 5)
                layer.down_proj = Linear(self.inter, h, None, device, dtype, s + 6)
            self.layers.append(layer)
        self.norm = RMSNorm(h, cfg.eps, norm, device, dtype, 7)
        self.lm_head = Linear(h, cfg.vocab, None, device, dtype, 8)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device=device, dtype=dtype))
        self.register_buffer("sin", emb.sin().to(device=device, dtype=dtype))
        self.register_buffer("k_cache", torch.zeros(cfg.layers, batch, self.kv_heads, max_len, hd, device=device,
                                                    dtype=dtype))
        self.register_buffer("v_cache", torch.zeros_like(self.k_cache))

    def set_norm_style(self, style: str) -> None:
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.style = style
            elif isinstance(m, GatedNorm):
                m.style = "once" if style == "once" else "hf"

    def set_combine_style(self, style: str) -> None:
        """The MoE blocks' combine: "model" (as written) or "commfuse" (reference.moe_reduce's order)."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.combine = style

    def reset(self):
        self.k_cache.zero_()
        self.v_cache.zero_()

    def all_reduce(self, x):
        if self.world == 1:
            return x
        if self.collective == "dist":
            dist.all_reduce(x)  # in place, as Megatron / vLLM-style models write it
            return x
        if self.collective == "funcol":
            import torch.distributed._functional_collectives as fc

            return fc.all_reduce(x, "sum", dist.group.WORLD)
        return commfuse.ops.all_reduce(self.comm, x)

    def forward(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        b, t = ids.shape
        hd = self.head_dim
        hidden = F.embedding(ids, self.embed)
        cos, sin = self.cos[pos:pos + t], self.sin[pos:pos + t]
        for i, layer in enumerate(self.layers):
            residual = hidden
            x = layer.input_layernorm(hidden)
            qkv = layer.qkv(x)
            gated = hasattr(layer, "attn_norm")
            q, k, v, *z = qkv.split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd]
                                    + ([self.heads * hd] if gated else []), dim=-1)
            q = q.view(b, t, self.heads, hd).transpose(1, 2)
            k = k.view(b, t, self.kv_heads, hd).transpose(1, 2)
            v = v.view(b, t, self.kv_heads, hd).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            self.k_cache[i, :, :, pos:pos + t] = k
            self.v_cache[i, :, :, pos:pos + t] = v
            keys, values = self.k_cache[i, :, :, :pos + t], self.v_cache[i, :, :, :pos + t]
            if t > 1:  # a Python branch: dynamo guards on it (is_causal must be a plain bool)
                attn = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
            else:
                attn = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
            attn = attn.transpose(1, 2).reshape(b, t, self.heads * hd)
            if gated:
                attn = layer.attn_norm(attn, z[0])
            hidden = residual + self.all_reduce(layer.o_proj(attn))
            residual = hidden
            x = layer.post_attention_layernorm(hidden)
            if self.cfg.experts:
                hidden = residual + self.all_reduce(layer.mlp(x))
            else:
                gate, up = layer.gate_up(x).chunk(2, dim=-1)
                hidden = residual + self.all_reduce(layer.down_proj(F.silu(gate) * up))
        return self.lm_head(self.norm(hidden))


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# --------------------------------------------------------------------------- running and timing


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(times: List[List[float]], device) -> List[List[float]]:
    """times [rounds][steps] of this rank -> the slowest rank's time of each round's step."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return times
    t = torch.tensor(times, dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _ratio(values: List[float]) -> dict:
    """The median of the rounds' ratios, its interval (median_interval: at least 95% from 6 rounds, the range of
    fewer) and that interval's coverage."""
    low, high, coverage = median_interval(values)
    return {"low": low, "median": statistics.median(values), "high": high, "coverage": coverage}


def run_steps(model: Decoder, fn, prompt, decode_tokens, device):
    """Prefill, then teacher-forced decode; returns (logits of each step, seconds of each step)."""
    model.reset()
    outs, times = [], []
    inputs = [(prompt, 0)] + [(decode_tokens[:, i:i + 1], prompt.shape[1] + i) for i in range(decode_tokens.shape[1])]
    for ids, pos in inputs:
        _sync(device)
        t0 = time.perf_counter()
        y = fn(ids, pos)
        _sync(device)
        times.append(time.perf_counter() - t0)
        outs.append(y[:, -1].float().clone())
    return outs, times


def _finite_or_inf(v: float) -> float:
    return v if math.isfinite(v) else math.inf


def compare(got: List[torch.Tensor], want: List[torch.Tensor], tol: float, exact: bool) -> dict:
    worst, rms, bits = 0.0, 0.0, True
    for g, w in zip(got, want):
        bits = bits and torch.equal(g, w)
        # A NaN error is the worst there is (max() would keep the finite one before it).
        worst = max(worst, _finite_or_inf(float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))))
        rms = max(rms, _finite_or_inf(float((g - w).norm() / w.norm().clamp_min(1e-30))))
    ok = bits if exact else rms <= tol
    return {"ok": ok, "exact_expected": exact, "bit_identical": bits, "max_rel_err": worst, "rel_rms_err": rms,
            "tol": 0.0 if exact else tol}


def exact_route(device, world: int, collective: str, column: str, inner: str) -> bool:
    """Whether a fused column's logits are checked bit for bit: where every route is exact, the CPU (gloo's fp32
    rank-order sum = commfuse's, the separated tail = commfuse.reference) with at most 2 ranks for a
    torch.distributed collective, and not Inductor's code for the rest of the graph (its own roundings, e.g. in
    the SiLU and the GEMMs)."""
    return device.type == "cpu" and (world <= 2 or collective == "commfuse") and \
        (column == "eager/fused" or inner != "inductor")


def first_tail_mismatch(model: Decoder, comm, prompt, quant: Optional[str]) -> Optional[str]:
    """The first layer's post-attention tail (all-reduce, residual add, RMSNorm and the quantization its MLP
    reads) run once through the call the fused graph's op makes (Communicator.fused_all_reduce; at world 1,
    where the model has no all-reduce, commfuse.local.fused_add_rmsnorm) on the model's own activations of the
    prompt, against commfuse.reference fed the same sum, with the kernels' tolerances (commfuse.tolerance).
    Where the logits are compared by relative error, a wrong fused op can hide in it (with NVFP4 a norm without
    its weight stays within 0.4); here it cannot. Returns why the outputs differ, None when within."""
    layer, h = model.layers[0], model.cfg.hidden
    seen = []
    # o_proj's output before the all-reduce, which the model's in-place all-reduce overwrites.
    hook = layer.o_proj.register_forward_hook(lambda module, args, out: seen.append(out.clone()))
    try:
        model.reset()
        model.forward(prompt, 0)
    finally:
        hook.remove()
        model.reset()
    x, residual = seen[0].view(-1, h), F.embedding(prompt, model.embed).view(-1, h)
    weight, eps = layer.post_attention_layernorm.weight, model.cfg.eps
    scale = (layer.mlp if model.cfg.experts else layer.gate_up).x_scale if quant else None
    # The MoE router reads the norm itself: that tail returns it beside the codes.
    return_norm, sf_layout = bool(model.cfg.experts and quant), "linear" if quant == "nvfp4" else "swizzled"
    kw = dict(quant=quant, scale=scale, return_norm=return_norm, sf_layout=sf_layout)
    if model.world > 1:
        got, a = comm.fused_all_reduce(x, residual, weight, eps, **kw), comm.all_reduce(x)
    else:
        got, a = commfuse.local.fused_add_rmsnorm(x, residual, weight, eps, **kw), x
    want = reference.fused_tail(a, residual, weight, eps, quant, scale, return_norm, sf_layout)
    norm = reference.fused_tail(a, residual, weight, eps).norm
    return tolerance.tail_mismatch(got, want, quant, sf_layout, norm=norm, scale=scale)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the size's, 2)")
    p.add_argument("--tokens", type=int, default=16, help="prompt length of the prefill")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--norm", choices=["hf", "torch"], default="hf", help="RMSNorm as HF Llama writes it, or F.rms_norm")
    p.add_argument("--quant", choices=["none", "fp8", "nvfp4"], default="none")
    p.add_argument("--moe", action="store_true", help="a MoE decoder: each layer's MLP a tensor-parallel MoE block")
    p.add_argument("--experts", type=int, default=4, help="routed experts of --moe")
    p.add_argument("--moe-topk", type=int, default=2, help="experts per token of --moe")
    p.add_argument("--moe-intermediate", type=int, default=None,
                   help="each expert's intermediate size (default: the size's intermediate / --experts)")
    p.add_argument("--shared-expert", action="store_true", help="--moe: a shared expert, added before the all-reduce")
    p.add_argument("--gated-attn", action="store_true",
                   help="each attention output through a grouped gated RMSNorm (z from the QKV projection, groups "
                        "of head_dim) before the output projection")
    p.add_argument("--collective", choices=["dist", "funcol", "commfuse"], default="dist")
    p.add_argument("--compile", action="store_true", help="also the torch.compile'd columns")
    p.add_argument("--backend", default=None, help="inner backend of the compiled columns (default: inductor on CUDA, "
                                                   "aot_eager on CPU)")
    p.add_argument("--mode", default=None, help="torch.compile mode of the compiled columns, e.g. reduce-overhead")
    p.add_argument("--rewrite", choices=["auto", "all"], default="auto",
                   help="the pass's choice (auto: local patterns only where they beat the compiler's own kernels) or "
                        "every match")
    p.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed rounds: one run of the whole sequence per column each (after one warm-up)")
    p.add_argument("--tol", type=float, default=None, help="largest relative RMS error of the fused logits against the "
                   "reference where the route is not bit-exact (default by --quant: %s)" % TOLERANCES)
    p.add_argument("--json", default=None, help="write the table, the checks and the reports here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    for name, least in (("layers", 1), ("tokens", 1), ("decode_steps", 0), ("batch", 1), ("repeats", 1)):
        v = getattr(args, name)
        if v is not None and v < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}, got {v}")
    moe_options = [o for o, given in (("--experts", args.experts != 4), ("--moe-topk", args.moe_topk != 2),
                                      ("--moe-intermediate", args.moe_intermediate is not None),
                                      ("--shared-expert", args.shared_expert)) if given]
    if moe_options and not args.moe:
        p.error(f"{', '.join(moe_options)} need{'s' if len(moe_options) == 1 else ''} --moe")
    if args.moe and not 1 <= args.moe_topk <= args.experts:
        p.error(f"--moe needs 1 <= --moe-topk <= --experts, got {args.moe_topk} of {args.experts}")
    if args.moe_intermediate is not None and args.moe_intermediate < 1:
        p.error(f"--moe-intermediate must be at least 1, got {args.moe_intermediate}")
    if args.tol is not None and not (math.isfinite(args.tol) and args.tol > 0):
        p.error(f"--tol must be a finite number > 0, got {args.tol}")
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse(argv)
    commfuse.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = commfuse.Communicator()
    comm.check_calls = False  # a per-call object gather would break CUDA graphs and time nothing useful
    device = comm.device
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    cfg = SIZES[args.size]
    if args.layers is not None:
        cfg = Config(**{**asdict(cfg), "layers": args.layers})
    if args.moe:
        cfg = Config(**{**asdict(cfg), "experts": args.experts, "topk": args.moe_topk,
                        "moe_intermediate": args.moe_intermediate or 0, "shared_expert": args.shared_expert})
    quant = None if args.quant == "none" else args.quant
    say = (lambda *a: print(*a, flush=True)) if rank == 0 and not args.quiet else (lambda *a: None)
    torch.manual_seed(0)
    max_len = args.tokens + args.decode_steps + 1
    model = Decoder(cfg, rank, world, device, dtype, norm=args.norm, quant=quant, collective=args.collective,
                    comm=comm, max_len=max_len, batch=args.batch, gated_attn=args.gated_attn)
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, cfg.vocab, (args.batch, args.tokens), generator=g).to(device)
    decode = torch.randint(0, cfg.vocab, (args.batch, args.decode_steps), generator=g).to(device)
    say(f"tp_decoder: size {args.size} ({cfg.layers} layers, hidden {cfg.hidden}), world {world} on {device} "
        f"({comm.backend}), {args.dtype}, norm {args.norm}, quant {args.quant}, collective {args.collective}, "
        + (f"MoE ({cfg.experts} experts of {model.moe_inter * world}, top-{cfg.topk}"
           f"{', a shared expert' if cfg.shared_expert else ''}), " if cfg.experts else "") +
        ("gated attention norms, " if args.gated_attn else "") +
        f"{args.tokens} prompt tokens + {args.decode_steps} decode steps")

    inner = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    columns = {"eager/unfused": lambda: model.forward}
    columns["eager/fused"] = lambda: commfuse.fusion.compile(model.forward, comm, backend="eager", fullgraph=True,
                                                             dynamic=args.dynamic or None)
    if args.compile:
        columns["compiled/unfused"] = lambda: torch.compile(model.forward, backend=inner, mode=args.mode, fullgraph=True,
                                                            dynamic=args.dynamic or None) if inner == "inductor" \
            else torch.compile(model.forward, backend=inner, fullgraph=True, dynamic=args.dynamic or None)
        columns["compiled/fused"] = lambda: commfuse.fusion.compile(model.forward, comm, backend=inner, mode=args.mode,
                                                                    fullgraph=True, dynamic=args.dynamic or None,
                                                                    rewrite=args.rewrite)
    results, outputs, reports, fns = {}, {}, {}, {}
    # Every column is compiled first and stays alive, then the timed runs go round the columns: one run
    # of each in turn, --repeats rounds. A host-bound decode step drifts by tens of percent over a minute
    # (clocks, the host's other work), so columns timed one after another would measure their place in
    # the run as much as the graph; and a column's place within a round moved its steps too (two compiled
    # columns of one graph read 6% apart in one run, the later one faster; with the order rotating, each column
    # still followed the same one), so each round draws its order afresh (the same on every rank: the columns'
    # collectives pair up). Dynamo keeps each backend's cache entries apart (its backend guard);
    # the recompile limit is raised for them all and made an error (never a silent fall back to eager),
    # and between compilations only dynamo's automatic-dynamic state is reset, so that each column
    # compiles as it would first in a process.
    torch._dynamo.reset()
    config = torch._dynamo.config
    limits = {k: getattr(config, k) for k in ("recompile_limit", "fail_on_recompile_limit_hit") if hasattr(config, k)}
    try:
        if "recompile_limit" in limits:
            config.recompile_limit = max(limits["recompile_limit"], 8 * len(columns))
        if "fail_on_recompile_limit_hit" in limits:
            config.fail_on_recompile_limit_hit = True
        reset_code_state = getattr(getattr(torch._dynamo, "pgo", None), "reset_code_state", lambda: None)
        with torch.inference_mode():
            for name, make in columns.items():
                reset_code_state()
                fns[name] = fn = make()
                outputs[name], _ = run_steps(model, fn, prompt, decode, device)  # warm-up (and compilation)
                reports[name] = getattr(fn, "fusion_reports", None)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            runs = {name: [] for name in columns}
            order = list(fns.items())
            for i in range(args.repeats):  # the same orders on every rank
                for name, fn in random.Random(i).sample(order, len(order)):
                    runs[name].append(run_steps(model, fn, prompt, decode, device))
            if torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs:
                say("warning: a timed run recompiled: its column's times include a compilation")
    finally:
        for k, v in limits.items():
            setattr(config, k, v)
    rounds = {}  # column -> [round][step] ms, the slowest rank's
    for name, rs in runs.items():
        if not all(torch.equal(a, b) for a, b in zip(outputs[name], rs[-1][0])):
            say(f"warning: {name}: the warm-up's outputs differ from the timed run's")
        outputs[name] = rs[-1][0]
        rounds[name] = [[s * 1e3 for s in r] for r in _max_over_ranks([r[1] for r in rs], device)]
        results[name] = [statistics.median(s) for s in zip(*rounds[name])]
    # fused / unfused of each round's step, per pair of columns: median and its 95% interval.
    ratios = {f: [_ratio([a / b for a, b in zip(fs, us)]) for fs, us in zip(zip(*rounds[f]), zip(*rounds[u]))]
              for f, u in (("eager/fused", "eager/unfused"), ("compiled/fused", "compiled/unfused")) if f in rounds}
    del fns
    step_names = ["prefill"] + [f"decode {i + 1}" for i in range(args.decode_steps)]

    # The reference of the checks: the unfused model with its norms in commfuse's rounding order
    # (what the fused ops compute by definition), eager. As-written comparisons are printed too.
    with torch.inference_mode():
        torch._dynamo.reset()
        model.set_norm_style("once")
        # The MoE combine too where the pass puts it into commfuse::moe_all_reduce (with the all-reduce it
        # reads: world > 1); at world 1 the model has no all-reduce, the combine stays as written.
        model.set_combine_style("commfuse" if world > 1 else "model")
        reference_out, _ = run_steps(model, model.forward, prompt, decode, device)
        model.set_norm_style(args.norm)
        model.set_combine_style("model")
    tol = args.tol if args.tol is not None else TOLERANCES[args.quant]
    fused_columns = [f for f in ("eager/fused", "compiled/fused") if f in outputs]
    exact = {f: exact_route(device, world, args.collective, f, inner) for f in fused_columns}
    tail_why = None
    if not all(exact.values()):  # every rank alike: the tail's call is collective
        with torch.inference_mode():
            tail_why = first_tail_mismatch(model, comm, prompt, quant)
    checks = {}
    for fused_name, base in (("eager/fused", "eager/unfused"), ("compiled/fused", "compiled/unfused")):
        if fused_name not in outputs:
            continue
        reps = reports[fused_name] or []
        c = compare(outputs[fused_name], reference_out, tol, exact[fused_name])
        if not exact[fused_name]:
            c["first_tail"] = {"ok": tail_why is None, "why": tail_why}
            c["ok"] = c["ok"] and tail_why is None
        c["as_written"] = compare(outputs[fused_name], outputs[base], tol, False)
        c["as_written"].pop("ok")
        c["fused_ops"] = sum(r.count() for r in reps)
        # Nothing fused is right only where the pass said why: every match left to the compiler on evidence.
        c["left_on_evidence"] = sum(s.kind == "evidence" for r in reps for s in r.skipped)
        c["ok"] = c["ok"] and (c["fused_ops"] > 0 or c["left_on_evidence"] > 0)
        if cfg.experts:  # every layer's combine + all-reduce + add + norm one commfuse::moe_all_reduce
            c["moe_ops"] = [r.count("commfuse::moe_all_reduce") for r in reps]
            c["ok"] = c["ok"] and all(m == (cfg.layers if world > 1 else 0) for m in c["moe_ops"])
        checks[fused_name] = c
    ok = all(c["ok"] for c in checks.values())

    lines = ["", f"per-step latency, ms (slowest rank, median of {args.repeats})",
             "| step | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for i, s in enumerate(step_names):
        lines.append(f"| {s} | " + " | ".join(f"{results[c][i]:.3f}" for c in results) + " |")
    lines.append("| total | " + " | ".join(f"{sum(results[c]):.3f}" for c in results) + " |")
    coverage = min((q["coverage"] for qs in ratios.values() for q in qs), default=1.0)
    interval = "95% interval" if coverage >= 0.95 else f"their range: a {coverage:.0%} interval, too few rounds for 95%"
    lines += ["", f"fused / unfused, the median of the {args.repeats} rounds' ratios [{interval}]",
              "| step | " + " | ".join(ratios) + " |", "|---|" + "---|" * len(ratios)]
    for i, s in enumerate(step_names):
        lines.append(f"| {s} | " + " | ".join(
            "{median:.3f} [{low:.3f}, {high:.3f}]".format(**ratios[c][i]) for c in ratios) + " |")
    say("\n".join(lines))
    distinct: dict = {}  # the same graph fuses the same way in every column: print each report once
    for name, reps in reports.items():
        for j, r in enumerate(reps or []):
            body = str(r).split("\n", 1)
            key = body[1] if len(body) > 1 else body[0]
            distinct.setdefault(key, (body[0], []))[1].append(f"{name} graph {j + 1}")
    for key, (head, where) in distinct.items():
        say(f"\nfusion report ({', '.join(where)}):\n{head}\n{key}")
    say("")
    for name, c in checks.items():
        what = "bit-identical" if c["bit_identical"] else \
            f"relative RMS error {c['rel_rms_err']:.3g} (tol {c['tol']:g}), max {c['max_rel_err']:.3g} of max|logit|"
        w = c["as_written"]
        say(f"check {name}: {'ok' if c['ok'] else 'MISMATCH'} against the unfused model in commfuse's rounding order: "
            f"{what}{' (bit-exact expected)' if c['exact_expected'] else ''}; {c['fused_ops']} fused ops"
            + (f", {c['left_on_evidence']} left to the compiler on evidence" if c["left_on_evidence"] else "")
            + (f", commfuse::moe_all_reduce per graph: {c['moe_ops']}" if "moe_ops" in c else ""))
        if "first_tail" in c:
            tail = c["first_tail"]
            say("  the first layer's tail, once, against commfuse.reference: "
                + ("within the kernels' tolerances" if tail["ok"] else f"MISMATCH: {tail['why']}"))
        say(f"  against the unfused model as written ({name.split('/')[0]}/unfused, norm {args.norm}): "
            + ("bit-identical" if w["bit_identical"] else f"relative RMS error {w['rel_rms_err']:.3g}, "
               f"max {w['max_rel_err']:.3g} (the graph's own rounding order, amplified by the random layers)"))
    out = {"size": args.size, "config": asdict(cfg), "world": world, "device": str(device), "backend": comm.backend,
           "dtype": args.dtype, "norm": args.norm, "quant": args.quant, "collective": args.collective, "moe": args.moe,
           "gated_attn": args.gated_attn,
           "tokens": args.tokens, "decode_steps": args.decode_steps, "inner_backend": inner, "mode": args.mode,
           "rewrite": args.rewrite,
           "steps": step_names, "latency_ms": results, "rounds_ms": rounds, "ratios": ratios, "checks": checks, "ok": ok,
           "reports": {k: [str(r) for r in (v or [])] for k, v in reports.items()},
           "shared_gpu": bool(comm.topology.shared_gpu)}
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["ok"] else 1)
