"""The host half of csrc/epilogue.cuh: what every kernel with the tail (the local fused tail, the P2P
all-reduce) needs on the host, in one place.

- the quantization kinds, by their public names, and their C++ ids (kQuantNone/Fp8/Nvfp4);
- the element types the kernels are built for (their C++ names);
- the outputs' shapes and dtypes (`output_specs`), which commfuse.ops' fake implementations use too;
- the argument checks the tail kernels need (`check`), and `prepare`: aligned inputs, fresh outputs
  and the TailParams fields (commfuse/params.py declares the struct; its C side is generated).

Semantics: commfuse.reference.fused_tail (the oracle); docs/semantics.md.
"""
from __future__ import annotations

import functools
from enum import IntEnum
from typing import Optional, Tuple

import torch

from .reference import Tail

__all__ = ["Quant", "QUANTS", "CTYPE", "SF_LAYOUTS", "hidden_multiple", "sf_numel", "output_specs", "check",
           "check_out", "check_like", "prepare", "aligned", "MAX_HIDDEN", "MAX_TOKENS"]


class Quant(IntEnum):
    """The quantization of the tail's norm: the template argument QUANT of the kernels."""

    NONE = 0   # kQuantNone
    FP8 = 1    # kQuantFp8
    NVFP4 = 2  # kQuantNvfp4


# Public names (the `quant=` argument) of the kinds the kernels fuse.
QUANTS = {None: Quant.NONE, "fp8": Quant.FP8, "nvfp4": Quant.NVFP4}
SF_LAYOUTS = ("swizzled", "linear")
CTYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
MAX_HIDDEN = 1 << 16       # what the tests cover; the looped variants have no hard limit below 2^31
# Rows are blockIdx.x (< 2^31) in the local tail, and include up to 127 padding rows of the swizzled layout.
MAX_TOKENS = (1 << 31) - 128


def hidden_multiple(quant: Optional[str]) -> int:
    """What h must be a multiple of: 16-byte vectors of 8 elements, NVFP4 blocks of 16."""
    return 16 if quant == "nvfp4" else 8


# Output allocators (empty_like is the cheaper call where an output has the input's shape); the GPU
# tests swap in ones that poison, to catch elements left unwritten.
_empty = torch.empty
_empty_like = torch.empty_like


def aligned(t: torch.Tensor) -> torch.Tensor:
    # The kernels move 16-byte vectors; a view at an odd offset gets an aligned copy.
    return t if t.data_ptr() % 16 == 0 else t.clone()


def sf_numel(tokens: int, hidden: int, sf_layout: str) -> int:
    """Entries of the NVFP4 scale-factor tensor: roundup(t,128) * roundup(h/16,4) when swizzled."""
    k = hidden // 16
    if sf_layout == "swizzled":
        return -(-tokens // 128) * 128 * (-(-k // 4) * 4)
    return tokens * k


def output_specs(tokens: int, hidden: int, dtype: torch.dtype, quant: Optional[str], return_norm: bool,
                 sf_layout: str) -> tuple:
    """(shape, dtype) of each output (residual, norm, quant, scale_factors), None where absent: what
    the tail kernels return (see fused_tail.run), and what commfuse.ops' fake implementations promise."""
    t, h = tokens, hidden
    norm = ((t, h), dtype) if quant is None or return_norm else None
    q = sf = None
    if quant == "fp8":
        q = ((t, h), torch.float8_e4m3fn)
    elif quant == "nvfp4":
        q = ((t, h // 2), torch.uint8)
        sf = ((sf_numel(t, h, sf_layout),) if sf_layout == "swizzled" else (t, h // 16), torch.float8_e4m3fn)
    return ((t, h), dtype), norm, q, sf


def fake_outputs(x: torch.Tensor, quant: str, return_norm: bool, sf_layout: str) -> list:
    """The outputs of a tail op (residual, norm, quant, scale_factors) as empty tensors of their shapes
    (an absent one: an empty tensor of x's dtype), for commfuse's torch.library fake implementations;
    quant "" means none. The real calls check their arguments; here only what the shapes need."""
    if quant not in ("", "fp8", "nvfp4") or sf_layout not in SF_LAYOUTS:
        raise ValueError(f"quant must be '', 'fp8' or 'nvfp4' and sf_layout one of {SF_LAYOUTS}, got "
                         f"{quant!r}, {sf_layout!r}")
    h = x.shape[-1]
    if h == 0:
        raise ValueError(f"x must have shape [..., h] with h > 0, got {tuple(x.shape)}")
    specs = output_specs(x.numel() // h, h, x.dtype, quant or None, return_norm, sf_layout)
    return [x.new_empty(0) if s is None else x.new_empty(s[0], dtype=s[1]) for s in specs]


# prepare's: a decode loop asks for a handful of shapes, on its hot path. (Not for the fake
# implementations: their sizes are symbolic, and unhashable.)
_output_specs_cached = functools.lru_cache(maxsize=4096)(output_specs)


def check(a: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, quant: Optional[str],
          scale: Optional[torch.Tensor], sf_layout: str) -> None:
    """Raise unless (a, residual, weight, quant, scale, sf_layout) is something the tail kernels take."""
    h = a.shape[-1]
    dtype = a.dtype
    if dtype not in CTYPE:
        raise TypeError(f"fused tail takes float16/bfloat16, got {dtype}")
    if residual.shape != a.shape or residual.dtype != dtype or weight.dtype != dtype or weight.numel() != h:
        raise ValueError(f"residual must match a {tuple(a.shape)} {dtype} and weight be [{h}] {dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype} and {tuple(weight.shape)} {weight.dtype}")
    if quant not in QUANTS or sf_layout not in SF_LAYOUTS:
        raise ValueError(f"quant must be one of {tuple(QUANTS)} and sf_layout one of {SF_LAYOUTS}, got "
                         f"{quant!r}, {sf_layout!r}")
    multiple = hidden_multiple(quant)
    if h % multiple or not 0 < h <= MAX_HIDDEN:
        raise ValueError(f"hidden size {h} must be a multiple of {multiple} in (0, {MAX_HIDDEN}]")
    device = a.device
    if device.type != "cuda" or residual.device != device or weight.device != device:
        raise ValueError(f"a, residual and weight must be on one CUDA device, got {a.device}, {residual.device}, {weight.device}")
    if quant is not None:
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32 \
                or scale.device != device:
            raise TypeError(f"quant={quant!r} needs scale as a float32 tensor of one element on {device}")
    if a.numel() // h > MAX_TOKENS:
        raise ValueError(f"{a.numel() // h} tokens > {MAX_TOKENS}")


_OUTPUTS = ("residual", "norm", "quant", "scale_factors")


def check_out(out, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device, quant: Optional[str],
              return_norm: bool, sf_layout: str) -> None:
    """Raise ValueError/TypeError naming the field unless `out` (a reference.Tail or commfuse.FusedResult
    of caller-owned tensors) holds exactly the outputs of this call: output_specs' shapes and dtypes,
    contiguous, on `device`, 16-byte aligned, and None where the call has no such output. The residual
    output may be the residual input itself (an in-place update: every kernel reads each residual
    element before it writes it, in the same thread); nothing else may alias an argument."""
    specs = output_specs(tokens, hidden, dtype, quant, return_norm, sf_layout)
    for name, spec in zip(_OUTPUTS, specs):
        t = getattr(out, name, None)
        if spec is None:
            if t is not None:
                raise ValueError(f"out.{name} must be None: this call (quant={quant!r}, return_norm={return_norm}) "
                                 "has no such output")
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"out.{name} must be a tensor of shape {list(spec[0])} and dtype {spec[1]}, "
                            f"got {type(t).__name__}")
        if tuple(t.shape) != tuple(spec[0]) or t.dtype != spec[1]:
            raise ValueError(f"out.{name} must have shape {list(spec[0])} and dtype {spec[1]}, got "
                             f"{list(t.shape)} {t.dtype}")
        if t.device != device or not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"out.{name} must be contiguous, 16-byte aligned and on {device}, got a tensor on "
                             f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}")


def check_like(out: torch.Tensor, x: torch.Tensor, name: str = "out") -> None:
    """Raise unless `out` can take a plain all-reduce of x: x's shape and dtype, on x's device,
    contiguous, 16-byte aligned."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(out).__name__}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"{name} must have x's shape {list(x.shape)}, dtype {x.dtype} and device {x.device}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")
    if not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"{name} must be contiguous and 16-byte aligned")


def prepare(a: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, quant: Optional[str],
            scale: Optional[torch.Tensor], return_norm: bool, sf_layout: str, out=None,
            residual_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, int, Tail, tuple, int]:
    """What every kernel with the tail (fused_tail's, the P2P ones) needs, for checked arguments.

    out: None, or the caller's output tensors (checked by check_out), written instead of fresh ones.
    residual_out: without out, a [t, h] tensor to take the residual output instead of a fresh one
    (the NCCL route's all-reduce result, which the tail then overwrites in place).
    Returns (a, or its aligned contiguous copy, of a's shape; t; the outputs as a Tail; the
    TailParams fields in declaration order (params.TAIL); the number of row slots: t, or
    roundup(t, 128) when the swizzled NVFP4 layout has padding rows to zero).

    This runs on every eager call: no reshape or view (a new tensor object costs microseconds),
    outputs like `a` where their shape is a's. A copy made here lives until the caller's launch,
    which comes before any other allocation, so its memory cannot be handed to an output early.
    """
    h = a.shape[-1]
    t = a.numel() // h
    a2, r2, w = _operand(a), _operand(residual), _operand(weight)
    if out is not None:
        res_out, norm, q, sf = out.residual, out.norm, out.quant, out.scale_factors
    else:
        like = a2.dim() == 2  # the decode case: outputs of a's shape are cheapest as empty_like
        if residual_out is not None:
            res_out = residual_out
        elif like:
            res_out = _empty_like(a2)
        else:
            res_out = _empty((t, h), dtype=a.dtype, device=a.device)
        norm = _empty_like(res_out) if quant is None or return_norm else None
        q = sf = None
        if quant == "fp8":
            q = _empty_like(res_out, dtype=torch.float8_e4m3fn)
        elif quant is not None:
            _, _, qs, ss = _output_specs_cached(t, h, a.dtype, quant, return_norm, sf_layout)
            q = _empty(qs[0], dtype=qs[1], device=a.device)
            sf = _empty(ss[0], dtype=ss[1], device=a.device) if ss else None
    swizzled = quant == "nvfp4" and sf_layout == "swizzled"
    fields = (r2.data_ptr(), res_out.data_ptr(), w.data_ptr(),
              norm.data_ptr() if norm is not None else 0,
              q.data_ptr() if q is not None else 0,
              sf.data_ptr() if sf is not None else 0,
              scale.data_ptr() if quant is not None else 0,
              float(eps), h, t, int(swizzled))
    rows = 0 if t == 0 else -(-t // 128) * 128 if swizzled else t
    return a2, t, Tail(res_out, norm, q, sf), fields, rows


def _operand(t: torch.Tensor) -> torch.Tensor:
    # The kernels read dense rows of 16-byte vectors: a strided or misaligned view gets a copy.
    c = t.contiguous()
    return c if not c.data_ptr() % 16 else c.clone()
