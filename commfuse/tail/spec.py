"""TailSpec: what a call asks of the tail, as one frozen value made at the public boundary.

The public calls keep their keyword arguments (quant, return_norm, eps, weight_offset, sf_layout,
scale_layout, scale_ue8m0); `TailSpec.of` checks them once, naming the argument, and everything below
takes the spec: the output shapes (`outputs`), the rows a kernel's grid covers (`row_slots`), the
layout the kernels are told (`layout`, `ue8m0`), and the keyword arguments back for commfuse.reference
(`reference_kwargs`).

The rule for layout options: each format says which keyword chooses its scales' layout (sf_layout for
NVFP4 and MXFP8, scale_layout and scale_ue8m0 for fp8_block); the others must keep their defaults, else a
ValueError names the option and the formats it applies to.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch

from . import formats as F
from .formats import Format, Layout

__all__ = ["TailSpec", "OutputSpec", "Outputs", "FP8_CODES", "code", "public", "codes", "spread", "fields", "present",
           "fp32", "mn_major_scales"]

FP8_CODES = torch.float8_e4m3fn
_SCALE_DTYPES = {"e4m3": torch.float8_e4m3fn, "f32": torch.float32, "ue8m0": torch.uint8}


class OutputSpec(NamedTuple):
    """One output tensor: its shape and dtype, and strides where it is a view of a larger storage
    (MN-major scales: the padding rows), None when contiguous."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    strides: Optional[Tuple[int, ...]] = None

    @property
    def storage_numel(self) -> int:
        """Elements of the storage behind it (an MN-major view's padding rows included)."""
        if self.strides is None:
            return math.prod(self.shape)
        # None for no rows (the view's strides aside), without a branch on t, which a fake may not know.
        return self.shape[1] * self.strides[1] * _sym(min, self.shape[0], 1)


def _sym(pick, a, b):
    """min or max of a and b: Python's for ints (dynamo traces no torch.sym_* of plain ints), torch.sym_min /
    sym_max for a symbolic size (an unbacked one takes no branch)."""
    if isinstance(a, int) and isinstance(b, int):
        return pick(a, b)
    return (torch.sym_min if pick is min else torch.sym_max)(a, b)


def mn_major_scales(t: int, blocks: int, dtype: torch.dtype, ue8m0: bool) -> OutputSpec:
    """The MN-major block scales of t rows of `blocks` blocks (docs/semantics.md section 11): a [t, blocks]
    view with strides (1, tp) of `dtype`, or with ue8m0 the exponent bytes packed four to an int32 [t,
    ceil(blocks / 4)]; tp = roundup(t, 4). Plain arithmetic, which torch.compile traces."""
    tp = _sym(max, -(-t // 4) * 4, 1)  # torch's strides of a [K, 0] tensor's transpose: (1, 1)
    if ue8m0:
        return OutputSpec((t, -(-blocks // 4)), torch.int32, (1, tp))
    return OutputSpec((t, blocks), dtype, (1, tp))


class Outputs(NamedTuple):
    """The specs of a tail's outputs, in reference.Tail's order; None where the call has no such output."""

    residual: Optional[OutputSpec]
    norm: Optional[OutputSpec]
    quant: Optional[OutputSpec]
    scale_factors: Optional[OutputSpec]
    scales: Optional[OutputSpec]


_F32 = struct.Struct("f")


def fp32(v: float) -> float:
    """v rounded to float32, as the kernels and the reference's fp32 math take a scalar (+-inf where it
    overflows): a check of a Python number must hold for this value, not for the double."""
    try:
        return _F32.unpack(_F32.pack(v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def number_type(name: str, v) -> None:
    """TypeError naming `name` unless v is a number, not a bool (a traced SymInt / SymFloat too: compiled calls
    check the type alone, as its value would specialise the graph)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")


def integer_type(name: str, v) -> None:
    """TypeError naming `name` unless v is an int, not a bool (a traced SymInt too)."""
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")


def flag(name: str, v) -> bool:
    """v, or TypeError naming `name` unless it is a bool."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


def _number(name: str, v, *, minimum: Optional[float] = None) -> float:
    number_type(name, v)
    try:
        v = float(v)
    except OverflowError:  # an int beyond any float
        v = math.inf if v > 0 else -math.inf
    if not math.isfinite(fp32(v)) or (minimum is not None and v < minimum):
        raise ValueError(f"{name} must be a finite float32 number" + (f" >= {minimum:g}" if minimum is not None else "")
                         + f", got {v!r}")
    # -0.0 as 0.0 (the same tail: semantics.md adds no offset of 0, and mean + eps >= 0): the plan table keys a
    # number by value, where -0.0 == 0.0, and the ranks compare the signature's text, where they differ.
    return v + 0.0


def _layout_options(fmt: Format, sf_layout, scale_layout, scale_ue8m0) -> Tuple[Layout, bool]:
    """(layout, ue8m0) of fmt from the three keywords; raises on a value the format cannot take."""
    given = {"sf_layout": sf_layout, "scale_layout": scale_layout}
    for arg, value in given.items():
        if not isinstance(value, str):
            raise TypeError(f"{arg} must be a str, got {type(value).__name__}")
        if value not in F.LAYOUT_ARGS[arg]:
            raise ValueError(f"{arg} must be one of {tuple(F.LAYOUT_ARGS[arg])}, got {value!r}")
    flag("scale_ue8m0", scale_ue8m0)
    for arg, value in (*given.items(), ("scale_ue8m0", scale_ue8m0)):
        applies = arg == fmt.layout_arg or (arg == "scale_ue8m0" and fmt.ue8m0 == "option")
        if not applies and value != F.DEFAULTS[arg]:
            users = [f.name for f in F.FORMATS if f.layout_arg == arg or (arg == "scale_ue8m0" and f.ue8m0 == "option")]
            raise ValueError(f"{arg}={value!r} applies to quant {' / '.join(map(repr, users))} only, got "
                             f"quant={fmt.name!r} (leave {arg} at its default {F.DEFAULTS[arg]!r})")
    layouts = dict(fmt.layouts)
    if fmt.layout_arg is not None:
        layout = layouts[given[fmt.layout_arg]] if given[fmt.layout_arg] in layouts else None
        if layout is None:
            raise ValueError(f"quant={fmt.name!r} takes {fmt.layout_arg} in {tuple(layouts)}, got {given[fmt.layout_arg]!r}")
    else:
        layout = next(iter(layouts.values()), Layout.NONE)
    ue8m0 = fmt.ue8m0 == "always" or (fmt.ue8m0 == "option" and scale_ue8m0)
    return layout, ue8m0


@dataclass(frozen=True)
class TailSpec:
    """The tail of one call: the quantization format and its layout, whether the norm is returned, eps,
    and the weight offset (Gemma's (1 + w): 1.0). Make it with `TailSpec.of(...)` from the public
    keyword arguments; compare and hash it as a value."""

    format: Format = F.NONE
    layout: Layout = Layout.NONE
    ue8m0: bool = False
    return_norm: bool = False
    eps: float = 1e-6
    weight_offset: float = 0.0

    @classmethod
    def from_code(cls, code: int, eps: float = 1e-6, weight_offset: float = 0.0) -> "TailSpec":
        """The spec of an op's `tail` number (`code`) with these eps and weight_offset; ValueError naming
        `tail` for a number that is no spec's."""
        return cls.of(**public(code), eps=eps, weight_offset=weight_offset)

    @classmethod
    def of(cls, quant: Optional[str] = None, *, return_norm: bool = False, eps: float = 1e-6,
           weight_offset: float = 0.0, sf_layout: str = "swizzled", scale_layout: str = "row",
           scale_ue8m0: bool = False) -> "TailSpec":
        """The spec of the public keyword arguments; TypeError / ValueError naming the argument."""
        fmt = F.by_name(quant)
        layout, ue8m0 = _layout_options(fmt, sf_layout, scale_layout, scale_ue8m0)
        return cls(fmt, layout, ue8m0, flag("return_norm", return_norm), _number("eps", eps, minimum=0.0),
                   _number("weight_offset", weight_offset))

    # ---------------------------------------------------------------- the public names back

    @property
    def quant(self) -> Optional[str]:
        return self.format.name

    @property
    def sf_layout(self) -> str:
        return self._public("sf_layout")

    @property
    def scale_layout(self) -> str:
        return self._public("scale_layout")

    @property
    def scale_ue8m0(self) -> bool:
        return self.ue8m0 and self.format.ue8m0 == "option"

    def _public(self, arg: str) -> str:
        if self.format.layout_arg == arg:
            return next(name for name, layout in self.format.layouts if layout == self.layout)
        return F.DEFAULTS[arg]

    def reference_kwargs(self) -> dict:
        """The keyword arguments of commfuse.reference.fused_tail (and of the public calls) for this spec."""
        return dict(quant=self.quant, return_norm=self.return_norm, sf_layout=self.sf_layout,
                    weight_offset=self.weight_offset, scale_layout=self.scale_layout, scale_ue8m0=self.scale_ue8m0)

    @property
    def code(self) -> int:
        """The tail's options but eps and weight_offset as one number, the commfuse ops' `tail` argument: a
        compiled model's op call parses one small int where it would parse five arguments (strings among
        them). The format's id, its layout, ue8m0 and return_norm; the same in every process."""
        return self.format.id | int(self.layout) << 4 | int(self.ue8m0) << 6 | int(self.return_norm) << 7

    # ---------------------------------------------------------------- what the tail produces

    @property
    def has_norm(self) -> bool:
        """Whether the norm is an output: without quantization, or asked for."""
        return self.format.codes is None or self.return_norm

    @property
    def hidden_multiple(self) -> int:
        return self.format.h_multiple

    def scales_spec(self, t: int, h: int) -> Optional[OutputSpec]:
        """The stored block scales of t rows of h (K = h / block blocks a row), None where none are stored."""
        f = self.format
        if f.block is None:
            return None
        dtype = torch.uint8 if self.ue8m0 else _SCALE_DTYPES[f.scale_code]
        if f.block == 0:
            return OutputSpec((t,), dtype)
        K = h // f.block
        if self.layout == Layout.SWIZZLED:
            return OutputSpec((-(-t // 128) * 128 * (-(-K // 4) * 4),), dtype)
        if self.layout == Layout.MN_MAJOR:
            return mn_major_scales(t, K, dtype, self.ue8m0)
        return OutputSpec((t, K), dtype)

    def outputs(self, t: int, h: int, dtype: torch.dtype, residual: bool = True) -> Outputs:
        """The outputs of a tail of t rows of h in `dtype` (residual False: no residual, a plain RMSNorm)."""
        f = self.format
        codes = None
        if f.codes == "e4m3":
            codes = OutputSpec((t, h), FP8_CODES)
        elif f.codes == "e2m1":
            codes = OutputSpec((t, h // 2), torch.uint8)
        stored = self.scales_spec(t, h)
        return Outputs(OutputSpec((t, h), dtype) if residual else None,
                       OutputSpec((t, h), dtype) if self.has_norm else None, codes,
                       stored if f.scale_field == "scale_factors" else None,
                       stored if f.scale_field == "scales" else None)

    def row_slots(self, t: int) -> int:
        """Rows a tail kernel's grid covers: t, and the padding rows whose scale storage it zeroes
        (roundup(t, 128) for the swizzled layout, roundup(t, 4) for MN-major)."""
        if t == 0:
            return 0
        if self.layout == Layout.SWIZZLED:
            return -(-t // 128) * 128
        if self.layout == Layout.MN_MAJOR:
            return -(-t // 4) * 4
        return t

    @property
    def row_tile(self) -> int:
        """Rows that must stay together when a call is cut into pieces: a swizzled tile's 128."""
        return 128 if self.layout == Layout.SWIZZLED else 1

    def _words(self, number) -> list:
        parts = [str(self.format)]
        if self.format.layout_arg or self.ue8m0:
            parts.append(self.layout.name.lower() + (" ue8m0" if self.ue8m0 else ""))
        if self.return_norm and self.format.codes:
            parts.append("norm out")
        if self.weight_offset:
            parts.append(f"weight offset {number(self.weight_offset)}")
        return parts

    def __str__(self) -> str:
        return ", ".join(self._words(lambda v: f"{v:g}"))

    @property
    def signature(self) -> str:
        """The spec as ranks compare their calls: str()'s words with eps and weight_offset to the last bit
        (1.0 and 1.000001 print alike under str)."""
        return ", ".join(self._words(repr) + [f"eps {self.eps!r}"])


# The public keyword arguments of every spec by its code, and the code of each such set of arguments, as
# plain values: what code() and spread() read, also while dynamo traces a model (it cannot trace Format or
# TailSpec objects made there, and folds these lookups into constants).
def _public_options():
    for f in F.FORMATS:
        sf = tuple(F.SF_LAYOUTS) if f.layout_arg == "sf_layout" else (F.DEFAULTS["sf_layout"],)
        sl = tuple(F.SCALE_LAYOUTS) if f.layout_arg == "scale_layout" else (F.DEFAULTS["scale_layout"],)
        ue = (False, True) if f.ue8m0 == "option" else (False,)
        for rn in (False, True):
            for a in sf:
                for b in sl:
                    for c in ue:
                        yield dict(quant=f.name, return_norm=rn, sf_layout=a, scale_layout=b, scale_ue8m0=c)


_PUBLIC = {TailSpec.of(**kw).code: kw for kw in _public_options()}
_CODES = {tuple(kw.values()): c for c, kw in _PUBLIC.items()}
assert len(_PUBLIC) == len(_CODES) == len(list(_public_options())), "tail codes must be unique"
# Which of norm, quant, scale_factors, scales a call of each code has.
_HAS = {c: (TailSpec.of(**kw).has_norm, F.by_name(kw["quant"]).codes is not None,
            F.by_name(kw["quant"]).scale_field == "scale_factors", F.by_name(kw["quant"]).scale_field == "scales")
        for c, kw in _PUBLIC.items()}


def _has(code: int, residual: bool) -> tuple:
    """Which of the five outputs a call of this code has (the residual: when it was given one)."""
    return (residual,) + _HAS[code]


def code(quant: Optional[str] = None, return_norm: bool = False, sf_layout: str = "swizzled",
         scale_layout: str = "row", scale_ue8m0: bool = False) -> int:
    """The ops' `tail` number of these public keyword arguments (TailSpec.code); TypeError / ValueError
    naming the argument where they make no spec."""
    # Only values of the right types are looked up: 1 would find True's entry, a list cannot be a key.
    typed = type(return_norm) is bool and type(scale_ue8m0) is bool and type(sf_layout) is str \
        and type(scale_layout) is str and (quant is None or type(quant) is str)
    c = _CODES.get((quant, return_norm, sf_layout, scale_layout, scale_ue8m0)) if typed else None
    if c is None:  # not a valid set: TailSpec.of says which argument is wrong
        c = TailSpec.of(quant, return_norm=return_norm, sf_layout=sf_layout, scale_layout=scale_layout,
                        scale_ue8m0=scale_ue8m0).code
    return c


def public(code: int) -> dict:
    """The public keyword arguments (quant, return_norm, sf_layout, scale_layout, scale_ue8m0) of an ops'
    `tail` number; ValueError naming `tail` for a number that is no spec's."""
    kw = _PUBLIC.get(code) if isinstance(code, int) and not isinstance(code, bool) else None
    if kw is None:
        raise ValueError(f"tail must be the code of a tail spec (commfuse.tail.spec.code), got {code!r}")
    return dict(kw)


def codes() -> dict:
    """{code: public keyword arguments} of every tail spec (what the C++ op kernels decode)."""
    return {c: dict(kw) for c, kw in _PUBLIC.items()}


def spread(outs, code: int, residual: bool = True) -> tuple:
    """An op's outputs (a list of the outputs its call has, in reference.Tail's order) as the five of a Tail
    (residual, norm, quant, scale_factors, scales), None where a call of this `tail` code (and a residual,
    or none) has no such output."""
    it = iter(outs)
    return tuple(next(it) if p else None for p in _has(code, residual))


def fields(code: int, residual: bool = True) -> tuple:
    """The names of the outputs an op of this `tail` code returns (reference.Tail's fields), in order."""
    return tuple(f for f, p in zip(Outputs._fields, _has(code, residual)) if p)


def present(outputs) -> list:
    """The outputs of a call that are there (not None), in order: what an op returns for them."""
    return [o for o in outputs if o is not None]
