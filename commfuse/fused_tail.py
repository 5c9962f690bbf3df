"""The local fused tail (csrc/fused_tail.cu): residual add + RMSNorm + optional FP8/NVFP4
quantization (static or computed FP8 scales) in one kernel, run after NCCL's all-reduce on the no-P2P path.

Semantics are those of :func:`commfuse.reference.fused_tail` (the oracle); see docs/semantics.md.

Launch configuration: one CTA per row (plus, for NVFP4 in the swizzled layout, one per padding
row of the last 128-row tile, which zeroes that row's scale factors; for MN-major FP8 block scales
one per padding row up to roundup(t, 4)). A row is split into
16-byte vectors of 8 elements and lives in registers, VPT vectors per thread (VPT in 1, 2, 4):
- few rows (t < LATENCY_TOKENS, decode): the smallest VPT that fits the variant's thread limit
  (1024 for VPT 1 and 2), spreading each row's dependent chain over as many threads as possible
  (h <= 16384). H200, bf16: [16, 7168] -> FP8 3.4 us against 4.5 us with 4 x 224; at 256 rows the
  two configurations are within 10% either way, from 512 rows on the one below wins (e.g.
  [1024, 7168] -> NVFP4 18.4 us against 21.6 us).
- many rows: the most vectors per thread (more loads in flight per thread, fewer warps per
  reduction) that keeps at least 2 warps, at most 256 threads, so several CTAs share an SM and
  one row's loads overlap another's arithmetic (h <= 8192). H200: [8192, 4096] -> NVFP4 65.6 us
  with 4 x 128 against 70.8 us with 2 x 256.
Longer rows take the looped variant (VPT = 0, 256 threads), which re-reads its own residual
output (from L2) instead of holding the row: on the H200 it beat 8 vectors per thread at
h = 16384 (252 us against 406 us for [8192, 16384] -> NVFP4; one 130-register CTA per SM).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from . import epilogue, jit, native, params
from .epilogue import CTYPE, MAX_HIDDEN, MAX_TOKENS, QUANTS
from .plan import FUSED_DTYPES, KernelSpec, register_kernel
from .reference import Tail

__all__ = ["run", "launcher", "warmup", "variants", "launch_config", "SPEC", "MAX_HIDDEN", "MAX_TOKENS"]

SOURCE = "fused_tail.cu"
VPT_BUCKETS = (1, 2, 4)  # vectors of 8 elements per thread on the register path
# kMaxThreads<VPT> in fused_tail.cu (the __launch_bounds__ of each variant); 0 is the looped one.
MAX_THREADS = {1: 1024, 2: 1024, 4: 256, 0: 256}
THROUGHPUT_THREADS = 256  # per CTA at most, when there are enough rows to fill the GPU
LATENCY_TOKENS = 256      # below this many rows, a row gets as many threads as its variant allows

SPEC = register_kernel(KernelSpec(
    name="fused_tail",
    kind="tail",
    dtypes=frozenset(FUSED_DTYPES),
    quants=frozenset(QUANTS),
    min_sm=(8, 0),
    hidden_multiple=8,
    max_hidden=MAX_HIDDEN,
    max_tokens=MAX_TOKENS,
))


def name_expression(dtype: torch.dtype, quant: Optional[str], vpt: int) -> str:
    """The template instantiation for (dtype, quant, vpt); vpt 0 is the looped variant."""
    return f"commfuse::fused_tail<{CTYPE[dtype]}, {int(QUANTS[quant])}, {vpt}>"


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    return [name_expression(d, q, v) for d in CTYPE for q in QUANTS for v in VPT_BUCKETS + (0,)]


def launch_config(hidden: int, tokens: int) -> Tuple[int, int]:
    """(vpt, threads per CTA) for `tokens` rows of `hidden` elements; vpt 0 is the looped variant."""
    return _launch_config(hidden, tokens < LATENCY_TOKENS)


@functools.lru_cache(maxsize=None)
def _launch_config(hidden: int, few_rows: bool) -> Tuple[int, int]:
    vectors = hidden // 8

    def whole_warps(threads: int) -> int:
        return max(32, -(-threads // 32) * 32)

    if few_rows:
        for vpt in VPT_BUCKETS:
            threads = -(-vectors // vpt)
            if threads <= MAX_THREADS[vpt]:
                return vpt, whole_warps(threads)
        return 0, MAX_THREADS[0]
    if vectors > max(VPT_BUCKETS) * THROUGHPUT_THREADS:
        return 0, MAX_THREADS[0]
    for vpt in sorted(VPT_BUCKETS, reverse=True):
        threads = -(-vectors // vpt)
        if threads >= 64 or vpt == min(VPT_BUCKETS):
            return vpt, whole_warps(threads)
    raise AssertionError("unreachable: VPT 1 always fits")


@functools.lru_cache(maxsize=None)
def _kernel(dtype: torch.dtype, quant: Optional[str], vpt: int, device_index: int) -> jit.Kernel:
    return jit.kernel(SOURCE, name_expression(dtype, quant, vpt), device=device_index, pdl=True)


def warmup(dtype: torch.dtype, quant: Optional[str], hidden: int, device=None) -> None:
    """Compile and load the variants `run` uses for (dtype, quant, hidden), any number of tokens,
    on `device` (default: current), so later calls can be captured in a CUDA graph."""
    if dtype not in CTYPE or quant not in QUANTS:
        raise ValueError(f"no fused tail for dtype={dtype}, quant={quant!r}")
    index = jit._device_index(device)
    for few_rows in (True, False):
        _kernel(dtype, quant, _launch_config(hidden, few_rows)[0], index)


def run(a: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
        quant: Optional[str] = None, scale: Optional[torch.Tensor] = None, return_norm: bool = False,
        sf_layout: str = "swizzled", *, out: Optional[Tail] = None, residual_out: Optional[torch.Tensor] = None,
        checked: bool = False, weight_offset: float = 0.0, scale_layout: str = "row",
        scale_ue8m0: bool = False) -> Tail:
    """The tail after the all-reduce, as one kernel on torch's current stream.

    a: [..., h] all-reduced activations, fp16 or bf16, CUDA, stride 1 on the last dim.
    residual: same shape, dtype and device as a. weight: [h], a's dtype and device.
    eps: python float. quant: None, "fp8", "nvfp4", "fp8_per_token" or "fp8_block".
    scale: dequant scale, float32 CUDA tensor of one element on a's device (needed with "fp8" and
    "nvfp4"; None for the kinds that compute their scales).
    return_norm: also return the T norm when quantizing. sf_layout: "swizzled" or "linear".
    weight_offset: added to the weight in fp32 (Gemma: 1.0). scale_layout ("row" / "mn_major") and
    scale_ue8m0: the fp8_block scales' layout (reference.quantize_fp8_block).
    h % 8 == 0 (h % 16 == 0 for nvfp4, h % 128 == 0 for fp8_block), h <= MAX_HIDDEN.
    Returns reference.Tail with fresh tensors on a's device: residual [t,h] T; norm [t,h] T or
    None; quant float8_e4m3fn [t,h] (the FP8 kinds) or uint8 [t,h/2] (nvfp4) or None; scale_factors
    float8_e4m3fn, flat roundup(t,128)*roundup(h/16,4) (swizzled) or [t,h/16] (linear), nvfp4 only;
    scales: the computed FP8 scales (reference.fused_tail's), None for the other kinds.
    out: the caller's output tensors instead (a Tail of those shapes, None where absent; see
    epilogue.check_out: out.residual may be `residual` itself, an in-place update).
    residual_out: without out, a contiguous [t, h] tensor of a's dtype to take the residual output,
    which may be `a` itself (the NCCL route writes the sum there, and the tail updates it in place:
    every element is read before it is written, by the same thread).
    checked: the caller has validated these arguments already (the Communicator's plan does, once
    per call signature), so the checks are skipped on this hot path.
    """
    if not checked:
        epilogue.check(a, residual, weight, quant, scale, sf_layout, scale_layout, scale_ue8m0)
        if out is not None:
            epilogue.check_out(out, a.numel() // a.shape[-1], a.shape[-1], a.dtype, a.device, quant, return_norm,
                               sf_layout, scale_layout, scale_ue8m0)
    a2, t, out, fields, rows = epilogue.prepare(a, residual, weight, eps, quant, scale, return_norm, sf_layout, out,
                                                residual_out, weight_offset, scale_layout, scale_ue8m0)
    if rows == 0:
        return out
    vpt, threads = launch_config(a.shape[-1], t)
    _kernel(a.dtype, quant, vpt, a.get_device()).launch((rows, 1, 1), (threads, 1, 1),
                                                        params.FUSED_TAIL.pack(a2.data_ptr(), *fields))
    return out


def launcher(dtype: torch.dtype, t: int, h: int, eps: float, quant: Optional[str], return_norm: bool, sf_layout: str,
             weight_offset: float, scale_layout: str, scale_ue8m0: bool, device_index: int, nccl=None):
    """A native launcher (commfuse.native) of `run` for one checked call signature of t > 0 rows of h,
    called as launcher(a, residual, weight, scale, out) -> the five outputs. nccl: native.launcher's,
    for the NCCL route: ncclAllReduce(x) into the residual output first, which the tail reads as `a`
    and updates in place (launcher(x, ...))."""
    vpt, threads = launch_config(h, t)
    blob = params.FUSED_TAIL.pack(0, *epilogue.tail_fields(t, h, eps, quant, sf_layout, weight_offset, scale_layout,
                                                           scale_ue8m0))
    patches = [(params.FUSED_TAIL.offsets["a"], native.SUM if nccl else native.X)]
    patches += native.tail_patches(params.FUSED_TAIL.offsets["tail"])
    specs = epilogue.output_specs(t, h, dtype, quant, return_norm, sf_layout, scale_layout, scale_ue8m0)
    return native.launcher(_kernel(dtype, quant, vpt, device_index), epilogue.row_slots(t, quant, sf_layout,
                                                                                                  scale_layout),
                           threads, blob, patches, [native.spec_of(s) for s in specs], True, device_index, nccl)
