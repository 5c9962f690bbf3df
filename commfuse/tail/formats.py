"""The quantization formats of the tail: one registry entry each, everything the library asks of a format.

A format is the `quant=` of the public calls (None: no quantization). Its entry says what the kernels
are built for (the QUANT template argument and its C++ name, generated into the kernels' header by
commfuse/kernels/params.py), what the calls take (a dequant scale, or scales the tail computes; the
multiple of h), what they return (the codes, and the block scales' element type, field, layouts) and
on which SM its conversion is in hardware. The numbers themselves are commfuse.reference's, by the
format's name; the device code is the QUANT branch of csrc/epilogue.cuh.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Dict, Optional, Tuple

__all__ = ["Layout", "Format", "FORMATS", "NONE", "by_name", "by_id", "names"]


class Layout(IntEnum):
    """How a format's block scales are stored (TailParams gets it as sf_swizzled and scale_layout bits)."""

    NONE = 0      # no stored scales (no quantization, static FP8)
    ROW = 1       # row-major [t, K] (NVFP4's "linear", fp8_block's "row"), or [t] for one scale a row
    SWIZZLED = 2  # the 128x4 tiles of the block-scaled GEMMs, flat roundup(t, 128) * roundup(K, 4), padding 0
    MN_MAJOR = 3  # column-major [t, K] with column stride roundup(t, 4) (DeepGEMM / CUTLASS); UE8M0 packed int32


# The keywords that choose a layout, their values, and their defaults.
SF_LAYOUTS: Dict[str, Layout] = {"swizzled": Layout.SWIZZLED, "linear": Layout.ROW}
SCALE_LAYOUTS: Dict[str, Layout] = {"row": Layout.ROW, "mn_major": Layout.MN_MAJOR}
LAYOUT_ARGS = {"sf_layout": SF_LAYOUTS, "scale_layout": SCALE_LAYOUTS}
DEFAULTS = {"sf_layout": "swizzled", "scale_layout": "row", "scale_ue8m0": False}


@dataclass(frozen=True, eq=False)  # each format is one registry entry: compared and hashed as that object
class Format:
    """One quantization format.

    name: the public `quant=` value (None: no quantization). id: the kernels' QUANT template argument,
    whose C++ constant is kQuant<cname>; the P2P call signature carries id + 1 (0: the plain all-reduce).
    h_multiple: what the hidden size must be a multiple of (16-byte vectors of 8 elements, or the block).
    takes_scale: the caller gives the dequant scale (a float32 tensor of one element); otherwise the tail
    computes its scales, or has none. codes: "e4m3" (float8_e4m3fn [t, h]) or "e2m1" (uint8 [t, h/2],
    two codes a byte, the even element in the low nibble), None without quantization. block: elements per
    stored scale (0: the whole row), None when no scale is stored. scale_field: the output holding them
    ("scale_factors" or "scales"). scale_code: their encoding: "e4m3", "f32", or "ue8m0" (exponent bytes);
    ue8m0 "option": scale_ue8m0 chooses between f32 and ue8m0. layout_arg: the keyword choosing their
    layout, with its values `layouts` (the first is the keyword's default); without one the layout is
    `layouts`' only entry. hw_sm: the SM from which the conversion is a hardware instruction (below it,
    software: same bits). p2p_register_vpts: the register tails the P2P kernels are built with for it
    (their 1024-thread variants have 64 registers; formats that keep more live per vector spill at 2).
    """

    name: Optional[str]
    id: int
    cname: str
    h_multiple: int = 8
    takes_scale: bool = False
    codes: Optional[str] = None
    block: Optional[int] = None
    scale_field: Optional[str] = None
    scale_code: Optional[str] = None
    ue8m0: str = "never"
    layout_arg: Optional[str] = None
    layouts: Tuple[Tuple[str, Layout], ...] = ()
    hw_sm: Tuple[int, int] = (8, 0)
    p2p_register_vpts: Tuple[int, ...] = (1, 2)

    @property
    def computes_scales(self) -> bool:
        return self.block is not None and not self.takes_scale

    def __str__(self) -> str:
        return self.name or "none"


_SF = tuple(SF_LAYOUTS.items())

FORMATS: Tuple[Format, ...] = (
    Format(None, 0, "None"),
    Format("fp8", 1, "Fp8", takes_scale=True, codes="e4m3", hw_sm=(8, 9)),
    Format("nvfp4", 2, "Nvfp4", h_multiple=16, takes_scale=True, codes="e2m1", block=16,
           scale_field="scale_factors", scale_code="e4m3", layout_arg="sf_layout", layouts=_SF, hw_sm=(10, 0)),
    Format("fp8_per_token", 3, "Fp8PerToken", codes="e4m3", block=0, scale_field="scales", scale_code="f32",
           layouts=(("row", Layout.ROW),), hw_sm=(8, 9), p2p_register_vpts=(1,)),
    Format("fp8_block", 4, "Fp8Block", h_multiple=128, codes="e4m3", block=128, scale_field="scales",
           scale_code="f32", ue8m0="option", layout_arg="scale_layout", layouts=tuple(SCALE_LAYOUTS.items()),
           hw_sm=(8, 9), p2p_register_vpts=(1,)),
    Format("mxfp8", 5, "Mxfp8", h_multiple=32, codes="e4m3", block=32, scale_field="scale_factors",
           scale_code="ue8m0", ue8m0="always", layout_arg="sf_layout", layouts=_SF, hw_sm=(8, 9)),
)
NONE = FORMATS[0]
_BY_NAME = {f.name: f for f in FORMATS}
_BY_ID = {f.id: f for f in FORMATS}
assert len(_BY_NAME) == len(_BY_ID) == len(FORMATS), "format names and ids must be unique"


def names() -> tuple:
    """The public quant= values, None first."""
    return tuple(_BY_NAME)


def by_name(name: Optional[str]) -> Format:
    """The format of a quant= value; ValueError (TypeError for a non-string) naming `quant` otherwise."""
    fmt = _BY_NAME.get(name) if name is None or isinstance(name, str) else None
    if fmt is None:
        if not isinstance(name, str):
            raise TypeError(f"quant must be None or one of {names()[1:]}, got {type(name).__name__}")
        raise ValueError(f"quant must be one of {names()}, got {name!r}")
    return fmt


def by_id(code: int) -> Optional[Format]:
    return _BY_ID.get(code)
