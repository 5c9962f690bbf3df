"""commfuse.fusion: find the all-reduce tails of any torch model's graph and fuse them into commfuse ops.

    report = commfuse.fusion.fuse(gm, comm)            # an FX GraphModule, rewritten in place
    print(report)                                      # what was fused, what was skipped and why
    compiled = commfuse.fusion.compile(model, comm, fullgraph=True, dynamic=True, mode="reduce-overhead")

What it finds (patterns.py), as models write them: a sum all-reduce (torch.distributed.all_reduce as
dynamo traces it, functional collectives, commfuse.ops.all_reduce) -> residual add (either operand
order) -> RMSNorm (HF Llama / Qwen / Mistral's hand-written one with the weight multiply before or
after the cast back, torch.nn.functional.rms_norm, nn.RMSNorm, Gemma's (1 + w)) -> optionally static
FP8 ((n / scale).clamp(-448, 448).to(float8_e4m3fn)) or NVFP4 (commfuse.quantize), with views
and no-op casts between the pieces. It becomes commfuse::fused_all_reduce, or commfuse::moe_all_reduce
where the all-reduce sums a MoE block's expert combine ((y * w.unsqueeze(-1)).sum(dim=1), HF batched_mm's
(rows * w[:, None]).view(t, k, h).sum(dim=1), optionally + a shared expert's output); without an all-reduce,
commfuse::fused_add_rmsnorm; the gated RMSNorm of Mamba2 / Nemotron-H becomes commfuse::gated_rmsnorm.
docs/fusion.md describes the pass, its level, the report and its limits.

Modules: graph.py (reading nodes in every spelling), patterns.py (matching), rewrite.py (the rewrite:
`fuse`), build.py (the nodes around an inserted op, torch-level or aten), report.py (`FusionReport`),
backend.py (torch.compile: `backend`, `compile`; Inductor's post-grad custom pass: `post_grad_pass`).
"""
from .backend import backend, compile, post_grad_pass
from .report import Fused, FusionReport, Skipped
from .rewrite import fuse

__all__ = ["fuse", "compile", "backend", "post_grad_pass", "FusionReport", "Fused", "Skipped"]
