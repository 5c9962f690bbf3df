"""The host half of csrc/epilogue.cuh: what every kernel with the tail (the local fused tail, the P2P
all-reduce) needs on the host, in one place.

- the quantization kinds, by their public names, and their C++ ids (kQuantNone/Fp8/Nvfp4/Fp8PerToken/Fp8Block);
- the element types the kernels are built for (their C++ names);
- the outputs' shapes and dtypes (`output_specs`), which commfuse.ops' fake implementations use too;
- the argument checks the tail kernels need (`check`), and `prepare`: aligned inputs, fresh outputs
  and the TailParams fields (commfuse/params.py declares the struct; its C side is generated).

Semantics: commfuse.reference.fused_tail (the oracle); docs/semantics.md.
"""
from __future__ import annotations

import functools
import math
from enum import IntEnum
from typing import Optional, Tuple

import torch

from . import reference
from .reference import Tail

__all__ = ["Quant", "QUANTS", "COMPUTED_SCALES", "CTYPE", "SF_LAYOUTS", "SCALE_LAYOUTS", "hidden_multiple", "sf_numel",
           "output_specs", "check", "check_out", "check_like", "prepare", "aligned", "MAX_HIDDEN", "MAX_TOKENS"]


class Quant(IntEnum):
    """The quantization of the tail's norm: the template argument QUANT of the kernels."""

    NONE = 0           # kQuantNone
    FP8 = 1            # kQuantFp8
    NVFP4 = 2          # kQuantNvfp4
    FP8_PER_TOKEN = 3  # kQuantFp8PerToken
    FP8_BLOCK = 4      # kQuantFp8Block


# Public names (the `quant=` argument) of the kinds the kernels fuse.
QUANTS = {None: Quant.NONE, "fp8": Quant.FP8, "nvfp4": Quant.NVFP4, "fp8_per_token": Quant.FP8_PER_TOKEN,
          "fp8_block": Quant.FP8_BLOCK}
COMPUTED_SCALES = ("fp8_per_token", "fp8_block")  # FP8 whose scales the tail computes (no scale argument)
SF_LAYOUTS = ("swizzled", "linear")
SCALE_LAYOUTS = ("row", "mn_major")
_SCALE_MN_MAJOR, _SCALE_UE8M0 = 1, 2  # kScaleMnMajor, kScaleUe8m0: TailParams.scale_layout bits
CTYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
MAX_HIDDEN = 1 << 16       # what the tests cover; the looped variants have no hard limit below 2^31
# Rows are blockIdx.x (< 2^31) in the local tail, and include up to 127 padding rows of the swizzled layout.
MAX_TOKENS = (1 << 31) - 128


def hidden_multiple(quant: Optional[str]) -> int:
    """What h must be a multiple of: 16-byte vectors of 8 elements, NVFP4 blocks of 16, FP8 blocks of 128."""
    return {"nvfp4": 16, "fp8_block": reference.FP8_BLOCK}.get(quant, 8)


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


def _scales_spec(t: int, h: int, quant: Optional[str], scale_layout: str, scale_ue8m0: bool):
    """(shape, dtype, strides) of the computed FP8 scales (reference.quantize_fp8_per_token / _block);
    strides None: contiguous. MN-major: a [t, K] view with strides (1, roundup(t, 4)) of a storage of
    K * roundup(t, 4) elements (float32, or int32 of 4 UE8M0 bytes with K -> ceil(K / 4))."""
    if quant == "fp8_per_token":
        return (t,), torch.float32, None
    if quant != "fp8_block":
        return None
    K = h // reference.FP8_BLOCK
    if scale_layout == "mn_major":
        cols = -(-K // 4) if scale_ue8m0 else K
        return (t, cols), torch.int32 if scale_ue8m0 else torch.float32, (1, -(-t // 4) * 4)
    return (t, K), torch.uint8 if scale_ue8m0 else torch.float32, None


def output_specs(tokens: int, hidden: int, dtype: torch.dtype, quant: Optional[str], return_norm: bool,
                 sf_layout: str, scale_layout: str = "row", scale_ue8m0: bool = False) -> tuple:
    """(shape, dtype) of each output (residual, norm, quant, scale_factors), then the scales as (shape,
    dtype, strides or None when contiguous), None where absent: what the tail kernels return (see
    fused_tail.run), and what commfuse.ops' fake implementations promise."""
    t, h = tokens, hidden
    norm = ((t, h), dtype) if quant is None or return_norm else None
    q = sf = None
    if quant in ("fp8",) + COMPUTED_SCALES:
        q = ((t, h), torch.float8_e4m3fn)
    elif quant == "nvfp4":
        q = ((t, h // 2), torch.uint8)
        sf = ((sf_numel(t, h, sf_layout),) if sf_layout == "swizzled" else (t, h // 16), torch.float8_e4m3fn)
    return ((t, h), dtype), norm, q, sf, _scales_spec(t, h, quant, scale_layout, scale_ue8m0)


def storage_numel(shape: tuple, strides: Optional[tuple]) -> int:
    """Elements of the storage behind a tensor of `shape` (strides None: contiguous); an MN-major view's
    includes its padding rows."""
    return math.prod(shape) if strides is None else shape[1] * strides[1]


def _room(t: torch.Tensor) -> int:
    """Elements of t's storage from t's first element on."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()


def allocate(spec, device, empty=None) -> torch.Tensor:
    """A tensor of an output spec (shape, dtype[, strides]) from `empty` (default: the output allocator,
    which the GPU tests poison): a strided spec gets a view of a storage holding its padding too."""
    empty = _empty if empty is None else empty
    shape, dtype = spec[0], spec[1]
    strides = spec[2] if len(spec) > 2 else None
    if strides is None:
        return empty(shape, dtype=dtype, device=device)
    return empty((storage_numel(shape, strides),), dtype=dtype, device=device).as_strided(shape, strides)


def fake_outputs(x: torch.Tensor, quant: str, return_norm: bool, sf_layout: str, scale_layout: str = "row",
                 scale_ue8m0: bool = False) -> list:
    """The outputs of a tail op (residual, norm, quant, scale_factors, scales) as empty tensors of their
    shapes and strides (an absent one: an empty tensor of x's dtype), for commfuse's torch.library fake
    implementations; quant "" means none. The real calls check their arguments; here only what the
    shapes need."""
    if quant not in [q or "" for q in QUANTS] or sf_layout not in SF_LAYOUTS or scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"quant must be one of {tuple(q or '' for q in QUANTS)}, sf_layout one of {SF_LAYOUTS} and "
                         f"scale_layout one of {SCALE_LAYOUTS}, got {quant!r}, {sf_layout!r}, {scale_layout!r}")
    h = x.shape[-1]
    if h == 0:
        raise ValueError(f"x must have shape [..., h] with h > 0, got {tuple(x.shape)}")
    specs = output_specs(x.numel() // h, h, x.dtype, quant or None, return_norm, sf_layout, scale_layout,
                         bool(scale_ue8m0))
    return [x.new_empty(0) if s is None else allocate(s, x.device, lambda shape, dtype, device: x.new_empty(shape, dtype=dtype))
            for s in specs]


# prepare's: a decode loop asks for a handful of shapes, on its hot path. (Not for the fake
# implementations: their sizes are symbolic, and unhashable.)
_output_specs_cached = functools.lru_cache(maxsize=4096)(output_specs)


def check(a: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, quant: Optional[str],
          scale: Optional[torch.Tensor], sf_layout: str, scale_layout: str = "row", scale_ue8m0: bool = False) -> None:
    """Raise unless (a, residual, weight, quant, scale, sf_layout, scale_layout, scale_ue8m0) is something
    the tail kernels take; residual None: a plain RMSNorm of a (the local tail kernel, the gated norm)."""
    h = a.shape[-1]
    dtype = a.dtype
    if dtype not in CTYPE:
        raise TypeError(f"fused tail takes float16/bfloat16, got {dtype}")
    res = a if residual is None else residual
    if res.shape != a.shape or res.dtype != dtype or weight.dtype != dtype or weight.numel() != h:
        raise ValueError(f"residual must match a {tuple(a.shape)} {dtype} and weight be [{h}] {dtype}, got "
                         f"{tuple(res.shape)} {res.dtype} and {tuple(weight.shape)} {weight.dtype}")
    if quant not in QUANTS or sf_layout not in SF_LAYOUTS:
        raise ValueError(f"quant must be one of {tuple(QUANTS)} and sf_layout one of {SF_LAYOUTS}, got "
                         f"{quant!r}, {sf_layout!r}")
    multiple = hidden_multiple(quant)
    if h % multiple or not 0 < h <= MAX_HIDDEN:
        raise ValueError(f"hidden size {h} must be a multiple of {multiple} in (0, {MAX_HIDDEN}]")
    device = a.device
    if device.type != "cuda" or res.device != device or weight.device != device:
        raise ValueError(f"a, residual and weight must be on one CUDA device, got {a.device}, {res.device}, {weight.device}")
    if scale_layout not in SCALE_LAYOUTS or (quant != "fp8_block" and (scale_layout != "row" or scale_ue8m0)):
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, other than 'row' (or scale_ue8m0) only with "
                         f"quant='fp8_block'; got {scale_layout!r}, scale_ue8m0={scale_ue8m0!r}, quant={quant!r}")
    if quant in COMPUTED_SCALES:
        if scale is not None:
            raise ValueError(f"quant={quant!r} computes its scales: scale must be None")
    elif quant is not None:
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32 \
                or scale.device != device:
            raise TypeError(f"quant={quant!r} needs scale as a float32 tensor of one element on {device}")
    if a.numel() // h > MAX_TOKENS:
        raise ValueError(f"{a.numel() // h} tokens > {MAX_TOKENS}")


_OUTPUTS = ("residual", "norm", "quant", "scale_factors", "scales")


def check_out(out, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device, quant: Optional[str],
              return_norm: bool, sf_layout: str, scale_layout: str = "row", scale_ue8m0: bool = False) -> None:
    """Raise ValueError/TypeError naming the field unless `out` (a reference.Tail or commfuse.FusedResult
    of caller-owned tensors) holds exactly the outputs of this call: output_specs' shapes and dtypes,
    contiguous (MN-major scales: output_specs' strides, over a storage that holds the padding rows), on
    `device`, 16-byte aligned, and None where the call has no such output. The residual output may be
    the residual input itself (an in-place update: every kernel reads each residual element before it
    writes it, in the same thread); nothing else may alias an argument."""
    specs = output_specs(tokens, hidden, dtype, quant, return_norm, sf_layout, scale_layout, scale_ue8m0)
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
        strides = spec[2] if len(spec) > 2 else None
        if strides is not None:
            if tuple(t.stride()) != strides or _room(t) < storage_numel(spec[0], strides):
                raise ValueError(f"out.{name} must be an MN-major view with strides {strides} of a storage of "
                                 f"{storage_numel(spec[0], strides)} elements (padding rows included), got strides "
                                 f"{tuple(t.stride())} and room for {_room(t)}")
        if t.device != device or not (strides is not None or t.is_contiguous()) or t.data_ptr() % 16:
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


def _offset_field(weight_offset: float) -> float:
    """TailParams.weight_offset: the offset rounded to fp32, and -0.0 for one that rounds to 0 (the
    kernel adds it unconditionally; w + -0.0 is w, bit for bit)."""
    if weight_offset == 0:
        return -0.0
    return _f32_offset(float(weight_offset))


@functools.lru_cache(maxsize=64)
def _f32_offset(weight_offset: float) -> float:
    v = torch.tensor(weight_offset, dtype=torch.float32).item()
    return v if v != 0 else -0.0


def prepare(a: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, quant: Optional[str],
            scale: Optional[torch.Tensor], return_norm: bool, sf_layout: str, out=None,
            residual_out: Optional[torch.Tensor] = None, weight_offset: float = 0.0, scale_layout: str = "row",
            scale_ue8m0: bool = False) -> Tuple[torch.Tensor, int, Tail, tuple, int]:
    """What every kernel with the tail (fused_tail's, the P2P ones) needs, for checked arguments.

    out: None, or the caller's output tensors (checked by check_out), written instead of fresh ones.
    residual_out: without out, a [t, h] tensor to take the residual output instead of a fresh one
    (the NCCL route's all-reduce result, which the tail then overwrites in place).
    residual None: no residual input or output (both pointers 0; the Tail's residual is None).
    Returns (a, or its aligned contiguous copy, of a's shape; t; the outputs as a Tail; the
    TailParams fields in declaration order (params.TAIL); the number of row slots: t, or
    roundup(t, 128) when the swizzled NVFP4 layout has padding rows to zero, roundup(t, 4) for
    MN-major FP8 block scales).

    This runs on every eager call: no reshape or view (a new tensor object costs microseconds),
    outputs like `a` where their shape is a's. A copy made here lives until the caller's launch,
    which comes before any other allocation, so its memory cannot be handed to an output early.
    """
    h = a.shape[-1]
    t = a.numel() // h
    a2, w = _operand(a), _operand(weight)
    r2 = None if residual is None else _operand(residual)
    if out is not None:
        res_out, norm, q, sf = out.residual, out.norm, out.quant, out.scale_factors
        scales = getattr(out, "scales", None)
        # check_out ran once per call signature, which holds no addresses: a misaligned output of the
        # same shape later would fault in the kernel.
        for name, o in zip(_OUTPUTS, (res_out, norm, q, sf, scales)):
            if o is not None and o.data_ptr() % 16:
                raise ValueError(f"out.{name} must be 16-byte aligned")
        if scales is not None and scale_layout == "mn_major":  # nor the room for its padding rows
            need = storage_numel(scales.shape, scales.stride())
            if _room(scales) < need:
                raise ValueError(f"out.scales must be a view of a storage of {need} elements (padding rows included)")
    else:
        # like: a [t, h] tensor the outputs of a's shape are made like (empty_like is the cheaper call)
        if residual_out is not None:
            like = residual_out
        elif residual is None:  # no residual output to allocate
            like = a2 if a2.dim() == 2 else a2.view(t, h)
        elif a2.dim() == 2:  # the decode case
            like = _empty_like(a2)
        else:
            like = _empty((t, h), dtype=a.dtype, device=a.device)
        res_out = None if residual is None else like
        norm = _empty_like(like) if quant is None or return_norm else None
        q = sf = scales = None
        if quant == "fp8":
            q = _empty_like(like, dtype=torch.float8_e4m3fn)
        elif quant is not None:
            _, _, qs, ss, cs = _output_specs_cached(t, h, a.dtype, quant, return_norm, sf_layout, scale_layout,
                                                    scale_ue8m0)
            q = _empty_like(like, dtype=qs[1]) if qs[0] == (t, h) else _empty(qs[0], dtype=qs[1], device=a.device)
            sf = _empty(ss[0], dtype=ss[1], device=a.device) if ss else None
            scales = allocate(cs, a.device) if cs else None
    pointers = (0 if r2 is None else r2.data_ptr(), 0 if res_out is None else res_out.data_ptr(), w.data_ptr(),
                norm.data_ptr() if norm is not None else 0, q.data_ptr() if q is not None else 0,
                sf.data_ptr() if sf is not None else 0, scale.data_ptr() if scale is not None else 0,
                scales.data_ptr() if scales is not None else 0)
    fields = tail_fields(t, h, eps, quant, sf_layout, weight_offset, scale_layout, scale_ue8m0, pointers)
    return a2, t, Tail(res_out, norm, q, sf, scales), fields, row_slots(t, quant, sf_layout, scale_layout)


_NO_POINTERS = (0,) * 8


def tail_fields(t: int, h: int, eps: float, quant: Optional[str], sf_layout: str, weight_offset: float,
                scale_layout: str, scale_ue8m0: bool, pointers: tuple = _NO_POINTERS) -> tuple:
    """The TailParams fields in declaration order (params.TAIL) of a call of t rows of h; pointers:
    (residual_in, residual_out, weight, norm_out, quant_out, sf_out, scale, scales_out), 0 where
    absent (the native launchers patch them per call: native.tail_patches)."""
    swizzled = quant == "nvfp4" and sf_layout == "swizzled"
    mn_major = quant == "fp8_block" and scale_layout == "mn_major"
    layout_bits = (_SCALE_MN_MAJOR if mn_major else 0) | (_SCALE_UE8M0 if scale_ue8m0 else 0)
    return (*pointers[:7], float(eps), h, t, int(swizzled), pointers[7], _offset_field(weight_offset), layout_bits,
            -(-t // 4) * 4)


def row_slots(t: int, quant: Optional[str], sf_layout: str, scale_layout: str) -> int:
    """Rows a tail kernel's grid covers: t, or roundup(t, 128) when the swizzled NVFP4 layout has padding
    rows to zero, roundup(t, 4) for MN-major FP8 block scales."""
    if t == 0:
        return 0
    if quant == "nvfp4" and sf_layout == "swizzled":
        return -(-t // 128) * 128
    if quant == "fp8_block" and scale_layout == "mn_major":
        return -(-t // 4) * 4
    return t


def _operand(t: torch.Tensor) -> torch.Tensor:
    # The kernels read dense rows of 16-byte vectors: a strided or misaligned view gets a copy.
    c = t.contiguous()
    return c if not c.data_ptr() % 16 else c.clone()
