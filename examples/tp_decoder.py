"""A tensor-parallel Llama-architecture decoder, unfused and with commfuse.fusion, eager and compiled.

    mpirun -n 2 python examples/tp_decoder.py --size tiny                 # CPU: gloo, seconds
    mpirun -n 2 python examples/tp_decoder.py --size 8b --layers 4 --compile --quant fp8 --json out.json
    python examples/tp_decoder.py --size tiny                             # world 1: the local ops only

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
float32, one rounding: what the fused ops compute by definition). On the CPU every route is exact
(gloo's fp32 rank-order sum, the separated tail = commfuse.reference), so the check is bit for bit;
on GPUs (fused kernels: the norm within 1 ulp of T) it is a relative RMS error of the logits below
--tol (docs/fusion.md, "Tolerances"). The comparison with the unfused model as written (HF's double
rounding) is printed beside it: a 1-ulp change of the norms, amplified by the random layers. The
exit status is 1 when a check fails. Prints the per-step latency table (the slowest rank's median
over --repeats) and the fusion reports; --json writes both. main(argv) returns the results as a dict (the CI test
calls it under mpirun).
"""
from __future__ import annotations

import argparse
import json
import math
import os
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
# defaults leave room for that and catch real faults (a wrong residual, scale or route: errors of order 1).
TOLERANCES = {"none": 0.05, "fp8": 0.15, "nvfp4": 0.4}  # static activation scales (dequant): the norms' outputs stay well below 8


# --------------------------------------------------------------------------- the model


def _randn(shape, seed, std, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g) * std).to(device=device, dtype=dtype)


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


class Decoder(torch.nn.Module):
    def __init__(self, cfg: Config, rank: int, world: int, device, dtype, *, norm="hf", quant=None,
                 collective="dist", comm=None, max_len=256, batch=1):
        super().__init__()
        assert cfg.heads % world == 0 and cfg.kv_heads % world == 0 and cfg.intermediate % world == 0, \
            f"heads {cfg.heads}, kv heads {cfg.kv_heads}, intermediate {cfg.intermediate} must divide by {world}"
        self.cfg, self.world, self.collective, self.comm = cfg, world, collective, comm
        self.head_dim = cfg.hidden // cfg.heads
        self.heads, self.kv_heads = cfg.heads // world, cfg.kv_heads // world
        self.inter = cfg.intermediate // world
        hd, h = self.head_dim, cfg.hidden
        self.embed = torch.nn.Parameter(_randn((cfg.vocab, h), 1, 1.0, device, dtype), requires_grad=False)
        self.layers = torch.nn.ModuleList()
        for i in range(cfg.layers):
            s = 1000 * (i + 1) + 10 * rank  # this rank's shards (column / row slices), reproducible
            layer = torch.nn.Module()
            layer.input_layernorm = RMSNorm(h, cfg.eps, norm, device, dtype, 1000 * (i + 1) + 1)
            layer.qkv = Linear(h, (self.heads + 2 * self.kv_heads) * hd, quant, device, dtype, s + 2)
            layer.o_proj = Linear(self.heads * hd, h, None, device, dtype, s + 3)
            layer.post_attention_layernorm = RMSNorm(h, cfg.eps, norm, device, dtype, 1000 * (i + 1) + 4)
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
            q, k, v = qkv.split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
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
            hidden = residual + self.all_reduce(layer.o_proj(attn))
            residual = hidden
            x = layer.post_attention_layernorm(hidden)
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


def _max_over_ranks(v: float, device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return v
    t = torch.tensor([v], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


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


def compare(got: List[torch.Tensor], want: List[torch.Tensor], tol: float, exact: bool) -> dict:
    worst, rms, bits = 0.0, 0.0, True
    for g, w in zip(got, want):
        bits = bits and torch.equal(g, w)
        worst = max(worst, float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)))
        rms = max(rms, float((g - w).norm() / w.norm().clamp_min(1e-30)))
    ok = bits if exact else rms <= tol
    return {"ok": ok, "exact_expected": exact, "bit_identical": bits, "max_rel_err": worst, "rel_rms_err": rms,
            "tol": 0.0 if exact else tol}


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
    p.add_argument("--collective", choices=["dist", "funcol", "commfuse"], default="dist")
    p.add_argument("--compile", action="store_true", help="also the torch.compile'd columns")
    p.add_argument("--backend", default=None, help="inner backend of the compiled columns (default: inductor on CUDA, "
                                                   "aot_eager on CPU)")
    p.add_argument("--mode", default=None, help="torch.compile mode of the compiled columns, e.g. reduce-overhead")
    p.add_argument("--rewrite", choices=["auto", "all"], default="auto",
                   help="the pass's choice (auto: local patterns only where they beat the compiler's own kernels) or "
                        "every match")
    p.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of the whole sequence (after one warm-up)")
    p.add_argument("--tol", type=float, default=None, help="largest relative RMS error of the fused logits against the "
                   "reference where the route is not bit-exact (default by --quant: %s)" % TOLERANCES)
    p.add_argument("--json", default=None, help="write the table, the checks and the reports here")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse(argv)
    commfuse.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = commfuse.Communicator()
    comm.check_calls = False  # a per-call object gather would break CUDA graphs and time nothing useful
    device = comm.device
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    cfg = SIZES[args.size]
    if args.layers:
        cfg = Config(**{**asdict(cfg), "layers": args.layers})
    quant = None if args.quant == "none" else args.quant
    say = (lambda *a: print(*a, flush=True)) if rank == 0 and not args.quiet else (lambda *a: None)
    torch.manual_seed(0)
    max_len = args.tokens + args.decode_steps + 1
    model = Decoder(cfg, rank, world, device, dtype, norm=args.norm, quant=quant, collective=args.collective,
                    comm=comm, max_len=max_len, batch=args.batch)
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, cfg.vocab, (args.batch, args.tokens), generator=g).to(device)
    decode = torch.randint(0, cfg.vocab, (args.batch, args.decode_steps), generator=g).to(device)
    say(f"tp_decoder: size {args.size} ({cfg.layers} layers, hidden {cfg.hidden}), world {world} on {device} "
        f"({comm.backend}), {args.dtype}, norm {args.norm}, quant {args.quant}, collective {args.collective}, "
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
    results, outputs, reports = {}, {}, {}
    with torch.inference_mode():
        for name, make in columns.items():
            torch._dynamo.reset()
            fn = make()
            outs, _ = run_steps(model, fn, prompt, decode, device)  # warm-up (and compilation)
            runs = [run_steps(model, fn, prompt, decode, device) for _ in range(args.repeats)]
            outputs[name] = runs[-1][0]
            steps = list(zip(*[r[1] for r in runs]))
            results[name] = [_max_over_ranks(statistics.median(s), device) * 1e3 for s in steps]
            if not all(torch.equal(a, b) for a, b in zip(outs, runs[-1][0])):
                say(f"warning: {name}: the warm-up's outputs differ from the timed run's")
            reports[name] = getattr(fn, "fusion_reports", None)
    step_names = ["prefill"] + [f"decode {i + 1}" for i in range(args.decode_steps)]

    # The reference of the checks: the unfused model with its norms in commfuse's rounding order
    # (what the fused ops compute by definition), eager. As-written comparisons are printed too.
    with torch.inference_mode():
        torch._dynamo.reset()
        model.set_norm_style("once")
        reference_out, _ = run_steps(model, model.forward, prompt, decode, device)
        model.set_norm_style(args.norm)
    tol = args.tol if args.tol is not None else TOLERANCES[args.quant]
    checks = {}
    for fused_name, base in (("eager/fused", "eager/unfused"), ("compiled/fused", "compiled/unfused")):
        if fused_name not in outputs:
            continue
        reps = reports[fused_name] or []
        # Bit for bit where every route is exact: the CPU (gloo's fp32 rank-order sum = commfuse's, the
        # separated tail = commfuse.reference) with at most 2 ranks for a torch.distributed collective.
        exact = device.type == "cpu" and (world <= 2 or args.collective == "commfuse")
        c = compare(outputs[fused_name], reference_out, tol, exact)
        c["as_written"] = compare(outputs[fused_name], outputs[base], tol, False)
        c["as_written"].pop("ok")
        c["fused_ops"] = sum(r.count() for r in reps)
        # Nothing fused is right only where the pass said why: every match left to the compiler on evidence.
        c["left_on_evidence"] = sum(s.kind == "evidence" for r in reps for s in r.skipped)
        c["ok"] = c["ok"] and (c["fused_ops"] > 0 or c["left_on_evidence"] > 0)
        checks[fused_name] = c
    ok = all(c["ok"] for c in checks.values())

    lines = ["", f"per-step latency, ms (slowest rank, median of {args.repeats})",
             "| step | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for i, s in enumerate(step_names):
        lines.append(f"| {s} | " + " | ".join(f"{results[c][i]:.3f}" for c in results) + " |")
    lines.append("| total | " + " | ".join(f"{sum(results[c]):.3f}" for c in results) + " |")
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
            + (f", {c['left_on_evidence']} left to the compiler on evidence" if c["left_on_evidence"] else ""))
        say(f"  against the unfused model as written ({name.split('/')[0]}/unfused, norm {args.norm}): "
            + ("bit-identical" if w["bit_identical"] else f"relative RMS error {w['rel_rms_err']:.3g}, "
               f"max {w['max_rel_err']:.3g} (the graph's own rounding order, amplified by the random layers)"))
    out = {"size": args.size, "config": asdict(cfg), "world": world, "device": str(device), "backend": comm.backend,
           "dtype": args.dtype, "norm": args.norm, "quant": args.quant, "collective": args.collective,
           "tokens": args.tokens, "decode_steps": args.decode_steps, "inner_backend": inner, "mode": args.mode,
           "rewrite": args.rewrite,
           "steps": step_names, "latency_ms": results, "checks": checks, "ok": ok,
           "reports": {k: [str(r) for r in (v or [])] for k, v in reports.items()},
           "shared_gpu": bool(comm.topology.shared_gpu)}
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["ok"] else 1)
