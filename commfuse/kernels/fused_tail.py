"""The local fused tail (csrc/fused_tail.cu): residual add + RMSNorm + the quantization of any format in
one kernel, run after the collective on the NCCL and gloo routes, and as commfuse.local's
fused_add_rmsnorm (no collective; without a residual, a plain RMSNorm + quantization).

Semantics are those of :func:`commfuse.reference.fused_tail` (the oracle); see docs/semantics.md.

Launch configuration: one CTA per row (plus, for block scales in the swizzled layout, one per padding
row of the last 128-row tile, which zeroes that row's scale factors; for MN-major FP8 block scales one
per padding row up to roundup(t, 4)). A row is split into 16-byte vectors of 8 elements and lives in
registers, VPT vectors per thread (VPT in 1, 2, 4):
- few rows (t < LATENCY_TOKENS, decode): the smallest VPT that fits the variant's thread limit
  (1024 for VPT 1 and 2), spreading each row's dependent chain over as many threads as possible
  (h <= 16384). H200, bf16: [16, 7168] -> FP8 3.4 us against 4.5 us with 4 x 224; at 256 rows the
  two configurations are within 10% either way, from 512 rows on the one below wins (e.g.
  [1024, 7168] -> NVFP4 18.4 us against 21.6 us).
- many rows: the most vectors per thread (more loads in flight per thread, fewer warps per
  reduction) that keeps at least 2 warps, at most 256 threads, so several CTAs share an SM and
  one row's loads overlap another's arithmetic (h <= 8192). H200: [8192, 4096] -> NVFP4 65.6 us
  with 4 x 128 against 70.8 us with 2 x 256.
Without quantization ("plain": little arithmetic to overlap), H200, bf16 (launch/tail_sweep.py):
- few rows: VPT 2 (up to h 16384): [16, 7168] 2.29 us with 2 x 448 against 2.66 with 1 x 896, [16, 8192]
  2.36 against 2.78, [16, 4096] 1.89-2.01 with 2 x 256 against 2.03-2.14 with 1 x 512, [128, 4096] 2.17
  against 2.37, [1, 2048] 1.65 with 2 x 128 against 1.72-1.77; without a residual [64, 8192] 2.17 against
  2.45, [16, 4096] 1.69 against 1.78. (With quantization the few-rows rule above stays: VPT 1 is level or
  ahead up to h 3072 and 5120, 2-7% behind at 4096.)
- many rows, a residual add and a norm: 2 vectors per thread where that takes at most 256 threads
  ([1024, 4096] 6.2 us against 7.3, [8192, 4096] 67.8 against 75.1), and up to 512 threads below 512
  rows ([256, 7168] 3.7 against 4.1); else the rule above: [1024, 7168] 15.95 us with 4 x 224 against
  18.11 with 2 x 448, [1024, 8192] 18.55 against 19.82, [8192, 7168] 115.2 against 125.0, [8192, 8192]
  132.8 against 138.8 (one CTA of up to 512 threads a row leaves too few rows in flight).
- many rows, a plain RMSNorm (no residual either: one row read, one written): up to 512 threads at VPT 2
  below 512 rows ([256, 7168] 3.06 us against 3.23 with 4 x 224), else the rule above ([1024, 8192]
  8.1 us with 4 x 256 against 9.6 with 2 x 512).
Longer rows take the looped variant (VPT = 0, 256 threads), which re-reads its own residual
output (from L2) instead of holding the row: on the H200 it beat 8 vectors per thread at
h = 16384 (252 us against 406 us for [8192, 16384] -> NVFP4; one 130-register CTA per SM).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from ..reference import Tail
from ..tail import checks
from ..tail.formats import FORMATS, Format
from ..tail.spec import TailSpec
from . import native, params
from .family import CTYPE, MAX_HIDDEN, MAX_TOKENS, Family, Limits
from .launch import SUM, X, Z, Launch, LaunchPlan, tail_fields, tail_patches, whole_warps

__all__ = ["FUSED_TAIL", "run", "warmup", "variants", "launch_config", "register_config", "MAX_HIDDEN",
           "MAX_TOKENS"]

SOURCE = "fused_tail.cu"
VPT_BUCKETS = (1, 2, 4)  # vectors of 8 elements per thread on the register path
# kMaxThreads<VPT> in fused_tail.cu (the __launch_bounds__ of each variant); 0 is the looped one.
MAX_THREADS = {1: 1024, 2: 1024, 4: 256, 0: 256}
THROUGHPUT_THREADS = 256  # per CTA at most, when there are enough rows to fill the GPU
LATENCY_TOKENS = 256      # below this many rows, a row gets as many threads as its variant allows
PLAIN_THREADS = 512       # per CTA at most for a tail without quantization at VPT 2, many rows
PLAIN_WIDE_TOKENS = 512   # below this many rows, such a tail takes VPT 2 up to PLAIN_THREADS at any hidden size


def launch_config(hidden: int, tokens: int, plain: bool = False, residual: bool = True) -> Tuple[int, int]:
    """(vpt, threads) for `tokens` rows of `hidden` elements; vpt 0 is the looped variant.
    plain: a tail without quantization, with a residual add or (residual False) without: the rules for
    those (above)."""
    few = tokens < LATENCY_TOKENS
    if not plain:
        return row_config(hidden, few)
    wide = -(-(hidden // 8) // 2)  # threads at VPT 2
    return plain_config(hidden, few, (residual and wide <= THROUGHPUT_THREADS) or
                        (wide > THROUGHPUT_THREADS and tokens < PLAIN_WIDE_TOKENS))


def register_config(hidden: int, tokens: int) -> Tuple[int, int]:
    """launch_config for kernels without a looped variant (the gated RMSNorm, quantize): rows the
    throughput rule would loop over take the few-rows one (VPT 2, up to 1024 threads: h <= 16384)."""
    vpt, threads = launch_config(hidden, tokens)
    return (vpt, threads) if vpt else row_config(hidden, True)


@functools.lru_cache(maxsize=None)
def row_config(hidden: int, few_rows: bool) -> Tuple[int, int]:
    """launch_config's rule for few rows (decode: each row's chain over as many threads as its variant
    allows) or many (throughput); the P2P and gated kernels take the few-rows rule for every row count."""
    vectors = hidden // 8
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
def plain_config(hidden: int, few_rows: bool, wide: bool) -> Tuple[int, int]:
    """launch_config's rule for a tail without quantization: few rows take VPT 2 where it fits the
    variant's threads; many rows VPT 2 up to PLAIN_THREADS where `wide`; else row_config's rule."""
    vectors = hidden // 8
    if few_rows and -(-vectors // 2) <= MAX_THREADS[2]:
        return 2, whole_warps(-(-vectors // 2))
    if few_rows:
        return row_config(hidden, True)
    if wide and 64 <= -(-vectors // 2) <= PLAIN_THREADS:
        return 2, whole_warps(-(-vectors // 2))
    return row_config(hidden, False)


class FusedTail(Family):
    name = "fused_tail"
    source = SOURCE
    limits = Limits()

    def name_expression(self, dtype: torch.dtype, fmt: Format, vpt: int, post: bool = False) -> str:
        """The template instantiation for (dtype, format, vpt); vpt 0 is the looped variant; post: with the
        post-norm (docs/semantics.md section 2a)."""
        return f"commfuse::fused_tail<{CTYPE[dtype]}, {fmt.id}, {vpt}, {str(post).lower()}>"

    def variants(self) -> List[str]:
        return [self.name_expression(d, f, v, post) for d in CTYPE for f in FORMATS for v in VPT_BUCKETS + (0,)
                for post in (False, True)]

    def configs(self, dtype, spec, hidden, post: bool = False):
        # The rules change only at these row counts (launch_config). post: the POST variants (a post call has a
        # residual).
        return [self.name_expression(dtype, spec.format, launch_config(hidden, t, spec.quant is None, residual)[0],
                                     post)
                for t in (1, LATENCY_TOKENS, PLAIN_WIDE_TOKENS) for residual in ((True,) if post else (True, False))]

    def plan(self, dtype: torch.dtype, t: int, h: int, spec: TailSpec, device_index: int, *, residual: bool = True,
             nccl=None, post: bool = False) -> LaunchPlan:
        """The LaunchPlan of the tail of t rows of h (residual False: none, a plain RMSNorm). nccl: the
        NcclComm of the NCCL route, whose ncclAllReduce of x (into the residual output) comes first, the
        kernel reading the sum there as its input `a` and updating it in place; else `a` is x. post: the
        post-norm first, its weight the call's source Z (a fused call has no other z)."""
        launches = ()
        if t:
            vpt, threads = launch_config(h, t, spec.quant is None, residual)
            launches = (self.launch(dtype, t, h, spec, device_index, vpt, threads, SUM if nccl is not None else X,
                                    post),)
        name = ("ncclAllReduce + " if nccl is not None else "") + self.name
        return LaunchPlan(name, launches, tuple(spec.outputs(t, h, dtype, residual)), device_index, nccl, t * h)

    def launch(self, dtype: torch.dtype, t: int, h: int, spec: TailSpec, device_index: int, vpt: int, threads: int,
               a: int = X, post: bool = False) -> Launch:
        """The kernel's launch at (vpt, threads) (plan's from launch_config; launch/tail_sweep.py tries each), its
        input `a` from source `a`, the post weight (post) from Z."""
        blob = params.FUSED_TAIL.pack(0, *tail_fields(spec, t, h), 0)
        patches = [(params.FUSED_TAIL.offsets["a"], a, 0)]
        if post:
            patches.append((params.FUSED_TAIL.offsets["post_weight"], Z, 0))
        patches += tail_patches(params.FUSED_TAIL.offsets["tail"])
        kernel = self.kernel(self.name_expression(dtype, spec.format, vpt, post), device_index)
        return Launch(kernel, spec.row_slots(t), threads, blob, tuple(patches))


FUSED_TAIL = FusedTail()


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    return FUSED_TAIL.variants()


def warmup(dtype: torch.dtype, quant: Optional[str], hidden: int, device=None, post: bool = False) -> None:
    """Compile and load the variants `run` uses for (dtype, quant, hidden), any number of tokens,
    on `device` (default: current), so later calls can be captured in a CUDA graph. post: those of calls with a
    post weight (fused_all_reduce's post_weight) instead."""
    FUSED_TAIL.warmup(dtype, TailSpec.of(quant), hidden, device, post=post)


@functools.lru_cache(maxsize=4096)
def _launcher(dtype: torch.dtype, t: int, h: int, spec: TailSpec, device_index: int, residual: bool):
    return native.launcher(FUSED_TAIL.plan(dtype, t, h, spec, device_index, residual=residual))


_RUNS: dict = {}  # run()'s checked signatures (its arguments' metadata and values) -> (launcher, outputs)


def _signature(a, residual, weight, scale, args) -> tuple:
    # Scalars by type and value: True == 1 and 0.0 == False, which the checks tell apart.
    return tuple((v.shape, v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else (type(v), v)
                 for v in (a, residual, weight, scale, *args))


def run(a: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6,
        quant: Optional[str] = None, scale: Optional[torch.Tensor] = None, return_norm: bool = False,
        sf_layout: str = "swizzled", *, out=None, weight_offset: float = 0.0, scale_layout: str = "row",
        scale_ue8m0: bool = False) -> Tail:
    """The tail of an already all-reduced `a`, as one kernel on torch's current stream (the kernel
    alone: the tests and the benchmark call it; the library's routes launch the same plans).

    a: [..., h] fp16 or bf16, CUDA. residual: a's shape, dtype and device, or None (a plain RMSNorm:
    no residual output). weight: [h], a's dtype and device. eps, quant, scale, return_norm, sf_layout,
    weight_offset, scale_layout, scale_ue8m0: as for commfuse.reference.fused_tail (scale: a float32
    CUDA tensor of one element where the format takes one). h a multiple of 8 (and of the format's
    block), h <= MAX_HIDDEN. out: the caller's output tensors, as for Communicator.fused_all_reduce.
    Returns a reference.Tail of the outputs ([t, h] rows; see Communicator.fused_all_reduce). The
    checks run once per signature (what they read: the tensors' metadata, the other arguments).
    """
    key = _signature(a, residual, weight, scale, (eps, quant, return_norm, sf_layout, weight_offset, scale_layout,
                                                  scale_ue8m0))
    entry = _RUNS.get(key)
    if entry is None:
        spec = TailSpec.of(quant, return_norm=return_norm, eps=eps, weight_offset=weight_offset, sf_layout=sf_layout,
                           scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
        h = checks.tail(a, residual, weight, scale, spec, a.device, residual_optional=True, where="a is on")
        t = a.numel() // h
        why = None if a.is_cuda else "a must be a CUDA tensor"
        why = why or FUSED_TAIL.rejects(a.dtype, torch.cuda.get_device_capability(a.device), h, t, spec)
        if why is None and spec.format.takes_scale and not isinstance(scale, torch.Tensor):
            why = "scale must be a float32 CUDA tensor"
        if why:
            raise ValueError(f"fused_tail.run: {why}")
        entry = (_launcher(a.dtype, t, h, spec, a.get_device(), residual is not None),
                 spec.outputs(t, h, a.dtype, residual is not None))
        if len(_RUNS) >= 4096:
            _RUNS.clear()
        _RUNS[key] = entry
    launcher, outputs = entry
    if out is not None:
        checks.out(out, outputs, a.device, (("a", a), ("residual", residual), ("weight", weight), ("scale", scale)))
    return Tail(*launcher(a, residual, weight, scale, out))
