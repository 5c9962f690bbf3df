"""When a rewrite pays: the pass's `rewrite="auto"` rule and the measurements it rests on.

A collective tail (all-reduce + residual add + RMSNorm [+ quantization]) is always rewritten: the
fused op replaces the collective and the tail's kernels, and no compiler fuses across a collective.
A local pattern (no all-reduce: add + RMSNorm, RMSNorm, the gated norm, with or without a
quantization written in torch) is one that Inductor fuses itself; the pass then replaces Inductor's
kernel by commfuse's only where commfuse's measured faster (in a compiled model, end to end), and
leaves the graph alone otherwise, saying why with the numbers; and wherever the op would not run its kernel
on the graph's device (its plan's separated route: CPU tensors, an old SM), it leaves it alone too. Without
Inductor after the pass (aot_eager, eager, an FX graph run as it is) every local pattern is rewritten: there
the alternative is torch's unfused eager kernels.
`rewrite="all"` rewrites every match regardless (for the fused ops' semantics: one rounding to T,
the formats' codes).

The measurements (one H200, torch 2.11, bf16; bench/results/2026-12-03-h200-s15-*, -s17-local-ops-matrix*,
-s18-gated-split-sweep*, -s19-*, 2026-12-04-h200-s20-local-ops-matrix*, -s20-gated-sweep*, -s20-host-profile*,
-s23-host-*, -s23-tp-decoder-*, -s24-tp-decoder-*, -s28-host-compiled-ab, -s28-tp-decoder-*, 2026-12-05-h200-s37-local-ops-behind):
- GPU time of one call, CUDA-graph replay, against Inductor's kernel for the same tail written in
  torch (local-ops benchmark, tokens 1-8192 x hidden 4096 / 7168 / 8192): add + RMSNorm 2.0-3.9 us against
  2.0-3.8 us up to 256 tokens (6% behind at 256x8192; ahead there in the latest run), 15.9 against 15.1 us at
  1024x7168 and 18.5 against 17.8 us at 1024x8192 (15.4 / 15.3 and 18.3 / 17.7 in the latest), ahead at 8192
  tokens; RMSNorm alone within 2% or ahead at most shapes, 4-7% behind
  at 256x4096, 256x8192, 8192x7168 and 8192x8192; the gated norm faster or within 2% at groups of 128 everywhere
  (2.1-146.0 us against 3.0-160.2 us), at groups of 1024 and 2048 level or ahead up to 256 tokens (below
  128 its rows are split over CTAs: 2.50 against 2.53 us at 1x8192, group 1024), and from 512 tokens,
  split again, ahead at 512 and 8192 tokens (10.6 against 12.1 us at 512x7168) and level at 1024x8192 with
  groups of 2048 but 6-7% behind at 1024 tokens with groups of 1024 (22.6 against 21.1 us at 1024x8192, -s20;
  add + RMSNorm there 16.1 / 15.1 and 18.6 / 17.6 us at 1024x7168 / 8192); NVFP4 quantization 1.7-7.4x
  faster than Inductor's compiled torch quantizer (11.9 against 29.2 us at 1024x8192).
- The host: Inductor's code calls the op straight into the C++ extension (commfuse.fusion.lowering,
  -s28): a compiled function of add + RMSNorm [16, 4096] costs 61.4 us against 76.5 us with Inductor's
  own kernel for the tail (through torch's dispatcher, as before the lowering: 73.6 us; -s28, 101
  interleaved repeats). In a compiled model the op still takes the place of a kernel that Inductor also
  fused with its neighbours: the first layer's norm with the embedding lookup, which becomes a kernel of
  its own. The 8B-shaped decoder of examples/tp_decoder.py (4 layers, FP8, world 1: every rewrite is
  local), compiled in Inductor's default mode with every local rewrite, per step the median of 40 rounds'
  paired ratios fused / unfused with 95% intervals (-s28, three runs): prefill 0.926, 0.936 and 0.965,
  decode steps 1.006, 0.993, 1.009, 1.016 [1.004, 1.036]; 1.004, 0.967, 0.989, 0.975 [0.954, 1.021]; 0.961
  [0.933, 0.988], 0.965 [0.948, 0.995], 0.992, 0.997: level, one step 1.6% slower in one run and two 3.5%
  faster in another (the same decoder with every local pattern left to Inductor reads 0.97-1.02: the
  measurement's own spread). Through the dispatcher (-s24) decode steps 2-4 were 4.7-5.8% slower (cProfile:
  ~13 us of C++ time an op call against ~11-13 us for a Triton launch, plus the output checks). With
  mode="reduce-overhead" (CUDA graphs: no host time per call) no step is slower (-s28: 0.985-1.039,
  every interval reaching below 1), while each local kernel's GPU time is commfuse's or less at decode
  sizes (above), so with CUDA graphs the local patterns are rewritten.
- The gated norm in a compiled model: the same decoder with each attention output through a grouped gated
  RMSNorm (`--gated-attn`, groups of 128), default mode (-s24, 40 paired rounds): with only the gated norms
  rewritten no step slower, fused / unfused 1.032 [0.975, 1.114] at prefill, 0.985 [0.954, 0.995] at decode
  step 1, 0.975-0.993 at steps 2-4 (each interval reaching below 1); with every local rewrite no step slower
  either (0.971-0.994). So in the default mode the gated norm is rewritten, the add + RMSNorm left to
  Inductor.
"""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["REWRITES", "local_rewrite"]

REWRITES = ("auto", "all")

_DECODER = ("a 4-layer 8B decoder compiled in Inductor's default mode ran level with every local rewrite, not "
            "clearly faster (H200, per step the median of 40 paired rounds, three runs: 0.926-1.016 of the unfused "
            "time, within the measurement's spread)")
_ADD_RMSNORM = ("Inductor's own kernel for it measured faster at 1024 tokens (17.7 against 18.3 us at 1024x8192, "
                f"15.3 against 15.4 us at 1024x7168, bf16, H200), and {_DECODER}")


def local_rewrite(kind: str, quant: Optional[str], quant_is_op: bool, compiler: Optional[str],
                  rewrite: str, cuda_graphs: bool = False, residual: bool = True,
                  separated: Callable[[], Optional[str]] = lambda: None) -> Optional[str]:
    """None when the pass rewrites a local match, else why it leaves it to the compiler.

    kind: "local" (add + RMSNorm, or RMSNorm alone) or "gated"; quant: the format fused with it (None:
    none); quant_is_op: the quantization is a commfuse.quantize op (then the rewrite replaces two
    commfuse launches by one: it always pays); compiler: what compiles the graph after the pass
    ("inductor", another backend's name, or None); rewrite: "auto" or "all"; cuda_graphs: the compiled
    graph is replayed from CUDA graphs (Inductor's mode "reduce-overhead" / "max-autotune"), where the
    host time of a call is gone and the GPU time decides; residual: the local pattern adds a residual (else a
    plain RMSNorm, whose kernel measured level with Inductor's: the decoder's measurement decides); separated:
    asked only where it decides, why the op would run commfuse's separated ops on the graph's device (None: its
    kernel runs): torch's unfused kernels where Inductor would generate one (bf16 add + RMSNorm 1024x7168, H200:
    195 against 15.3 us, 2026-12-05-h200-s37-local-ops-behind)."""
    if rewrite not in REWRITES:
        raise ValueError(f"rewrite must be one of {REWRITES}, got {rewrite!r}")
    # A quantization other than static FP8 reaches the pass as a commfuse.quantize op (NVFP4's measured
    # 2.4-2.7x faster than Inductor's compiled torch quantizer). With CUDA graphs the kernels' GPU time
    # decides: commfuse's faster or level up to 256 tokens (the gated norm with groups of 128 at every
    # measured shape); the decoder above level with every local rewrite. In the default mode the gated
    # norm's rewrite measured no step slower in a compiled model, the add + RMSNorm's level, not faster.
    if rewrite == "all" or compiler != "inductor" or quant_is_op:
        return None
    why = separated()
    if why:
        return (f"left to Inductor: the op would run commfuse's separated ops here ({why}), torch's unfused "
                "kernels where Inductor generates one; rewrite='all' asks for the rewrite")
    if cuda_graphs or kind == "gated":
        return None
    return f"left to Inductor: {_ADD_RMSNORM if residual else _DECODER}; rewrite='all' asks for the rewrite"
