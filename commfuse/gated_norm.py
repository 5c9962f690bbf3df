"""The gated RMSNorm kernel (csrc/gated_rmsnorm.cu): Mamba2 / Nemotron-H's gated RMSNorm and the
tail's optional quantization (every kind of commfuse.epilogue.QUANTS) in one kernel.

Semantics: commfuse.norm.gated_reference, then the reference quantizers on its T-rounded output; see
docs/semantics.md (gated RMSNorm). silu goes through exp, which torch's GPU kernels and the CPU
compute differently: the kernel's silu is torch's on a GPU (z / (1 + expf(-z))).

Launch configuration: one CTA per row (plus the padding rows of the scale storage, as fused_tail);
the row lives in registers, VPT vectors of 8 elements per thread, as fused_tail's register variants
choose them (fused_tail.launch_config). There is no looped variant: rows the throughput
configuration would loop over take the few-rows one (VPT 2, up to 1024 threads), so h <= MAX_HIDDEN
= 16384; longer rows take the separated ops (commfuse.norm's guard says so).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from . import epilogue, fused_tail, jit, params
from .epilogue import CTYPE, MAX_TOKENS, QUANTS
from .plan import FUSED_DTYPES, KernelSpec, register_kernel
from .reference import Tail

__all__ = ["run", "warmup", "variants", "launch_config", "SPEC", "MAX_HIDDEN", "GROUP_MULTIPLE"]

SOURCE = "gated_rmsnorm.cu"
VPT_BUCKETS = fused_tail.VPT_BUCKETS
MAX_THREADS = {v: fused_tail.MAX_THREADS[v] for v in VPT_BUCKETS}  # kMaxThreads<VPT> in gated_rmsnorm.cu
MAX_HIDDEN = 8 * max(v * MAX_THREADS[v] for v in VPT_BUCKETS)
GROUP_MULTIPLE = 8  # a group is whole 16-byte vectors

# kind "norm": a local op of commfuse.norm, never a tail after a collective (make_plan picks kinds "tail", "p2p").
SPEC = register_kernel(KernelSpec(
    name="gated_rmsnorm",
    kind="norm",
    dtypes=frozenset(FUSED_DTYPES),
    quants=frozenset(QUANTS),
    min_sm=(8, 0),
    hidden_multiple=8,
    max_hidden=MAX_HIDDEN,
    max_tokens=MAX_TOKENS,
))


def name_expression(dtype: torch.dtype, quant: Optional[str], vpt: int) -> str:
    return f"commfuse::gated_rmsnorm<{CTYPE[dtype]}, {int(QUANTS[quant])}, {vpt}>"


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    return [name_expression(d, q, v) for d in CTYPE for q in QUANTS for v in VPT_BUCKETS]


def launch_config(hidden: int, tokens: int) -> Tuple[int, int]:
    """(vpt, threads per CTA) for `tokens` rows of `hidden` <= MAX_HIDDEN elements."""
    vpt, threads = fused_tail.launch_config(hidden, tokens)
    return (vpt, threads) if vpt else fused_tail.launch_config(hidden, 1)


@functools.lru_cache(maxsize=None)
def _kernel(dtype: torch.dtype, quant: Optional[str], vpt: int, device_index: int) -> jit.Kernel:
    return jit.kernel(SOURCE, name_expression(dtype, quant, vpt), device=device_index, pdl=True)


def warmup(dtype: torch.dtype, quant: Optional[str], hidden: int, device=None) -> None:
    """Compile and load the variants `run` uses for (dtype, quant, hidden), any number of tokens, on
    `device` (default: current), so later calls can be captured in a CUDA graph."""
    if dtype not in CTYPE or quant not in QUANTS or not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"no gated RMSNorm kernel for dtype={dtype}, quant={quant!r}, hidden={hidden}")
    index = jit._device_index(device)
    for tokens in (1, fused_tail.LATENCY_TOKENS):
        _kernel(dtype, quant, launch_config(hidden, tokens)[0], index)


def run(x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, eps: float, group_size: int,
        norm_before_gate: bool, quant: Optional[str] = None, scale: Optional[torch.Tensor] = None,
        return_norm: bool = False, sf_layout: str = "swizzled", scale_layout: str = "row",
        scale_ue8m0: bool = False) -> Tail:
    """The gated RMSNorm (+ quantization) as one kernel on torch's current stream, for arguments
    commfuse.norm has checked and its guard accepted: x [..., h] fp16/bf16 CUDA, z x's shape and
    dtype or None, weight [h], group_size a multiple of 8 dividing h, h <= MAX_HIDDEN (and the
    quant's multiple); quant, scale, sf_layout, scale_layout, scale_ue8m0 as in fused_tail.run.
    Returns a Tail with residual None (norm, quant, scale_factors, scales as fused_tail.run's)."""
    epilogue.check(x, z, weight, quant, scale, sf_layout, scale_layout, scale_ue8m0)
    h = x.shape[-1]
    if group_size <= 0 or group_size % GROUP_MULTIPLE or h % group_size or h > MAX_HIDDEN:
        raise ValueError(f"gated RMSNorm kernel: group_size {group_size} must be a multiple of {GROUP_MULTIPLE} "
                         f"dividing h={h} <= {MAX_HIDDEN}")
    x2, t, out, fields, rows = epilogue.prepare(x, None, weight, eps, quant, scale, return_norm, sf_layout,
                                                scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
    if rows == 0:
        return out
    z2 = None if z is None else epilogue._operand(z)
    vpt, threads = launch_config(h, t)
    packed = params.GATED_NORM.pack(*fields, x2.data_ptr(), 0 if z2 is None else z2.data_ptr(), group_size,
                                    int(bool(norm_before_gate)))
    _kernel(x.dtype, quant, vpt, x.get_device()).launch((rows, 1, 1), (threads, 1, 1), packed)
    return out
