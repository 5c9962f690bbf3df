"""When a rewrite pays: the pass's `rewrite="auto"` rule and the measurements it rests on.

A collective tail (all-reduce + residual add + RMSNorm [+ quantization]) is always rewritten: the
fused op replaces the collective and the tail's kernels, and no compiler fuses across a collective.
A local pattern (no all-reduce: add + RMSNorm, RMSNorm, the gated norm, with or without a
quantization written in torch) is one that Inductor fuses itself; the pass then replaces Inductor's
kernel by commfuse's only where commfuse's measured faster, and leaves the graph alone otherwise,
saying why with the numbers. Without Inductor after the pass (aot_eager, eager, an FX graph run as
it is) every local pattern is rewritten: there the alternative is torch's unfused eager kernels.
`rewrite="all"` rewrites every match regardless (for the fused ops' semantics: one rounding to T,
the formats' codes).

The measurements (one H200, torch 2.11, bf16; bench/results/2026-12-01-h200-s10-*):
- GPU time of one call, CUDA-graph replay, against Inductor's kernel for the same tail written in
  torch (local-ops benchmark, tokens x hidden 1x4096 .. 8192x4096): add + RMSNorm 1.8-4.3 us against
  2.3-4.6 us up to 256 tokens but 20.5 / 74.7 us against 17.8 / 68.8 us at 1024x8192 / 8192x4096;
  RMSNorm alone level (8.0 against 7.0 us at 1024x8192); the gated norm (silu computed once) 0.84-1.48x
  Inductor's time, behind it from 256 tokens on (28.6 against 21.6 us at 1024x8192, group 128; level at
  8192x4096, group 1024); NVFP4 quantization 2.6-4.1x faster than Inductor's compiled torch quantizer
  (11.8 against 31.9 us at 1024x8192).
- The 8B-shaped decoder of examples/tp_decoder.py (4 layers, FP8, world 1: every rewrite is local):
  compiled with Inductor's default mode 13.15 ms for prefill + 4 decode steps with the local ops
  against 8.28 ms without (1.59x slower); with mode="reduce-overhead" 4.45 against 4.57 ms.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["REWRITES", "local_rewrite"]

REWRITES = ("auto", "all")

_ADD_RMSNORM = ("Inductor's own kernel for it measured as fast or faster than commfuse's fused_tail at large "
                "token counts (17.8 against 20.5 us at 1024x8192, bf16, H200), and with the local ops the 4-layer "
                "8B decoder compiled in Inductor's default mode ran 1.59x slower per step")
_GATED = ("Inductor's own kernel for the gated norm measured up to 1.48x faster from 256 tokens on (21.6 against "
          "28.6 us at 1024x8192, group 128, H200)")


def local_rewrite(kind: str, quant: Optional[str], quant_is_op: bool, compiler: Optional[str],
                  rewrite: str) -> Optional[str]:
    """None when the pass rewrites a local match, else why it leaves it to the compiler.

    kind: "local" (add + RMSNorm, or RMSNorm alone) or "gated"; quant: the format fused with it (None:
    none); quant_is_op: the quantization is a commfuse.quantize op (then the rewrite replaces two
    commfuse launches by one: it always pays); compiler: what compiles the graph after the pass
    ("inductor", another backend's name, or None); rewrite: "auto" or "all"."""
    if rewrite not in REWRITES:
        raise ValueError(f"rewrite must be one of {REWRITES}, got {rewrite!r}")
    # A quantization other than static FP8 reaches the pass as a commfuse.quantize op (NVFP4's measured
    # 2.6-4.1x faster than Inductor's compiled torch quantizer).
    if rewrite == "all" or compiler != "inductor" or quant_is_op:
        return None
    what = _GATED if kind == "gated" else _ADD_RMSNORM
    return f"left to Inductor: {what}; rewrite='all' fuses it anyway"
