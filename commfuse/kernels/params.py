"""The kernels' parameter structs, declared once.

Every commfuse kernel takes one by-value struct. Its C declaration (a header NVRTC is given as
``commfuse_params.cuh``, see jit.py) and the Python packing (`Struct.pack`) both come from the
declarations below, so the two cannot drift apart: `Struct` lays the fields out as C does and
refuses a field C would pad before (each field starts at a multiple of its own alignment), and the
header asserts each struct's size.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple, Union

from ..tail import formats

__all__ = ["Field", "Struct", "TAIL", "FUSED_TAIL", "GATED_NORM", "P2P", "MOE_COMBINE", "MOE_TAIL", "NCCL_MARK", "MAX_WORLD", "NO_TAIL", "SCALE_MN_MAJOR",
           "SCALE_UE8M0", "TIMEOUT_CODE", "MISMATCH_CODE", "CONSTANTS", "HEADER_NAME", "header"]

HEADER_NAME = "commfuse_params.cuh"
MAX_WORLD = 8          # the size of P2PParams::peers
NO_TAIL = -1           # QUANT of the P2P plain all-reduce: no tail, the sum is the output
SCALE_MN_MAJOR = 1     # TailParams.scale_layout bits: MN-major storage,
SCALE_UE8M0 = 2        # UE8M0 exponent bytes
TIMEOUT_CODE = 1 << 16   # P2P error words: | phase << 8 | missing rank
MISMATCH_CODE = 2 << 16  # | rank whose call signature differs
# Every constant of the header: (C++ name, value, comment).
CONSTANTS = tuple((f"kQuant{f.cname}", f.id, f"quant={f.name!r}") for f in formats.FORMATS) + (
    ("kQuantPlain", NO_TAIL, "the P2P plain all-reduce: no tail"),
    ("kScaleMnMajor", SCALE_MN_MAJOR, "TailParams::scale_layout bit: MN-major storage"),
    ("kScaleUe8m0", SCALE_UE8M0, "TailParams::scale_layout bit: UE8M0 exponent bytes"),
    ("kTimeoutCode", TIMEOUT_CODE, "P2P error word: | phase << 8 | missing rank"),
    ("kMismatchCode", MISMATCH_CODE, "P2P error word: | rank whose call signature differs"),
    ("kMaxWorld", MAX_WORLD, "the size of P2PParams::peers"),
)

# Scalar kinds: struct format character and size (= alignment) in bytes.
_SCALARS = {"ptr": ("Q", 8), "f32": ("f", 4), "i32": ("i", 4), "u64": ("Q", 8), "i64": ("q", 8)}


@dataclass(frozen=True)
class Field:
    """One member: `ctype` is its C type, `kind` a scalar kind of _SCALARS or a nested Struct."""

    name: str
    ctype: str
    kind: Union[str, "Struct"]
    count: int = 1
    comment: str = ""

    @property
    def align(self) -> int:
        return 8 if isinstance(self.kind, Struct) else _SCALARS[self.kind][1]

    @property
    def size(self) -> int:
        return self.count * (self.kind.size if isinstance(self.kind, Struct) else _SCALARS[self.kind][1])

    @property
    def format(self) -> str:
        inner = self.kind.format if isinstance(self.kind, Struct) else _SCALARS[self.kind][0]
        return inner * self.count


class Struct:
    """A C struct of naturally aligned fields and its little-endian packing (no implicit padding)."""

    def __init__(self, name: str, fields: Sequence[Field]):
        self.name, self.fields = name, tuple(fields)
        offset, offsets = 0, {}
        for f in self.fields:
            if offset % f.align:
                raise ValueError(f"{name}.{f.name} at offset {offset} is not {f.align}-byte aligned: C would pad")
            offsets[f.name] = offset
            offset += f.size
        if offset % 8:
            raise ValueError(f"{name} is {offset} bytes: C would pad it to a multiple of 8")
        self.offsets: Dict[str, int] = offsets
        self.size = offset
        self.format = "".join(f.format for f in self.fields)
        self._packer = struct.Struct("<" + self.format)
        assert self._packer.size == self.size

    def pack(self, *values) -> bytes:
        """The struct's bytes from its scalar values in declaration order (nested structs flattened)."""
        return self._packer.pack(*values)

    def unpack(self, raw: bytes) -> Tuple:
        return self._packer.unpack(raw)

    def c_declaration(self) -> str:
        lines = [f"struct {self.name} {{"]
        for f in self.fields:
            array = f"[{f.count}]" if f.count > 1 else ""
            comment = f"  // {f.comment}" if f.comment else ""
            lines.append(f"  {f.ctype} {f.name}{array};{comment}")
        lines.append("};")
        lines.append(f'static_assert(sizeof({self.name}) == {self.size}, "{self.name}: layout of commfuse/kernels/params.py");')
        return "\n".join(lines)


TAIL = Struct("TailParams", [
    Field("residual_in", "const void*", "ptr", comment="T [t, h]; nullptr: no residual (the norm's input is a)"),
    Field("residual_out", "void*", "ptr", comment="T [t, h]; unused (nullptr) without a residual"),
    Field("weight", "const void*", "ptr", comment="T [h]"),
    Field("norm_out", "void*", "ptr", comment="T [t, h], or nullptr when the norm is not returned"),
    Field("quant_out", "void*", "ptr", comment="the codes: e4m3 [t, h], or e2m1 pairs uint8 [t, h/2]; unused without quant"),
    Field("sf_out", "void*", "ptr", comment="block scale factors (NVFP4 e4m3, MXFP8 UE8M0), swizzled or [t, h/block]"),
    Field("scale", "const float*", "ptr", comment="dequant scale, 1 element; unused without quant"),
    Field("eps", "float", "f32"),
    Field("h", "int", "i32"),
    Field("t", "int", "i32"),
    Field("sf_swizzled", "int", "i32", comment="1: block scales in the 128x4 swizzled layout, 0: row-major"),
    Field("scales_out", "void*", "ptr", comment="computed FP8 scales (fp8_per_token, fp8_block); else unused"),
    Field("weight_offset", "float", "f32", comment="added to the weight in fp32; -0.0 for none (see norm_round)"),
    Field("scale_layout", "int", "i32", comment="kScaleMnMajor | kScaleUe8m0 bits of the block scales"),
    Field("scale_stride", "long long", "i64", comment="MN-major column stride: roundup(t, 4) of the whole call"),
])

FUSED_TAIL = Struct("FusedTailParams", [
    Field("a", "const void*", "ptr", comment="T [t, h]: the all-reduced input"),
    Field("tail", "TailParams", TAIL),
    # Last, so that the other fields keep their offsets (and the variants without a post-norm their code).
    Field("post_weight", "const void*", "ptr", comment="T [h]: the post-norm's weight (the POST variants)"),
])

GATED_NORM = Struct("GatedNormParams", [
    Field("tail", "TailParams", TAIL, comment="outputs, weight, eps, t, h; no residual (nullptr)"),
    Field("x", "const void*", "ptr", comment="T [t, h]"),
    Field("z", "const void*", "ptr", comment="T [t, h], the gate; nullptr: none"),
    Field("group_size", "int", "i32", comment="elements normalised together: a multiple of 8 dividing h"),
    Field("norm_before_gate", "int", "i32", comment="1: y = norm(x) * w * silu(z); 0: y = norm(x * silu(z)) * w"),
    Field("splits", "int", "i32", comment="slices a row (whole groups); the grid is a multiple of it"),
    Field("pad", "int", "i32", comment="unused: the struct's size a multiple of 8"),
])

MOE_COMBINE = Struct("MoeCombineParams", [
    Field("y", "const void*", "ptr", comment="T: y [t, k, h] (reduction form) or the permuted rows [rows, h]"),
    Field("weights", "const void*", "ptr", comment="[t, k] routing weights, float or T"),
    Field("row_index", "const void*", "ptr", comment="int32 / int64 [t, k] as the form says (-1: a dropped slot); else unused"),
    Field("shared", "const void*", "ptr", comment="T [t, h], a shared expert's output; nullptr: none"),
    Field("x", "void*", "ptr", comment="T [t, h]: the combine's output"),
    Field("t", "int", "i32"),
    Field("k", "int", "i32"),
    Field("h", "int", "i32", comment="a multiple of 8"),
    Field("rows", "int", "i32", comment="rows of y in the finalize form (row_index < rows); else unused"),
    Field("weights_f32", "int", "i32", comment="1: float32 weights; 0: T weights"),
    Field("pad", "int", "i32", comment="unused: the struct's size a multiple of 8"),
])


P2P = Struct("P2PParams", [
    Field("tail", "TailParams", TAIL, comment="unused for the plain all-reduce (QUANT == kQuantPlain)"),
    Field("x", "const void*", "ptr", comment="T: this rank's input, total_vecs vectors of 8 elements"),
    Field("out", "void*", "ptr", comment="T: plain all-reduce output (same size as x); unused with a tail"),
    Field("peers", "void*", "ptr", MAX_WORLD, comment="workspace base of every rank, as mapped here; own at [rank]"),
    Field("epochs", "unsigned long long*", "ptr", comment="[gridDim.x], this rank's device memory, not shared"),
    Field("dev_error", "int*", "ptr", comment="this rank's device memory: 0, or the first error's code"),
    Field("host_error", "volatile int*", "ptr", comment="host-mapped pinned memory, polled by the host"),
    Field("timeout_ns", "unsigned long long", "u64", comment="how long one wait may take"),
    Field("slot_bytes", "unsigned long long", "u64", comment="bytes of one slot (and of the gather region)"),
    Field("flags_offset", "unsigned long long", "u64", comment="bytes from a workspace base to its flags"),
    Field("lamport_offset", "unsigned long long", "u64", comment="bytes from a workspace base to its Lamport slots"),
    Field("lamport_bytes", "unsigned long long", "u64", comment="bytes of one Lamport slot"),
    Field("sig_offset", "unsigned long long", "u64", comment="bytes from a workspace base to its signature slots"),
    Field("total_vecs", "long long", "i64", comment="vectors of 8 elements in the message"),
    Field("rows", "int", "i32", comment="rows holding data (t; plain: ceil(total_vecs / row_vecs))"),
    Field("row_vecs", "int", "i32", comment="vectors per row (h / 8; plain: chosen by the launcher)"),
    Field("row_slots", "int", "i32", comment="rows incl. padding rows of swizzled scale factors / MN-major FP8 scales (zeroed)"),
    Field("world", "int", "i32", comment="2..kMaxWorld"),
    Field("rank", "int", "i32"),
    Field("pad_", "int", "i32"),
    Field("combine", "MoeCombineParams", MOE_COMBINE,
          comment="the MoE variants' inputs (x and combine.x unused); else all 0"),
])


MOE_TAIL = Struct("MoeTailParams", [
    Field("combine", "MoeCombineParams", MOE_COMBINE, comment="the combine's inputs (x unused: the tail reads the combine)"),
    Field("tail", "TailParams", TAIL),
    Field("slice", "int", "i32", comment="vectors of each CTA's slice of a row cut over a cluster (slice_vectors); else unused"),
    Field("pad", "int", "i32", comment="unused: the struct's size a multiple of 8"),
])


NCCL_MARK = Struct("NcclMarkParams", [
    Field("count", "unsigned long long*", "ptr", comment="device memory: the captured all-reduces the stream began"),
    Field("begun", "volatile unsigned long long*", "ptr", comment="host-mapped: the NCCL watchdog's BEGUN word"),
    Field("ended", "volatile unsigned long long*", "ptr", comment="host-mapped: its ENDED word; nullptr: a begin mark"),
])


def header() -> str:
    """The C header of every constant and struct above (what NVRTC includes as HEADER_NAME)."""
    constants = "\n".join(f"constexpr int {name} = {value};  // {comment}" for name, value, comment in CONSTANTS)
    body = "\n\n".join(s.c_declaration() for s in (TAIL, FUSED_TAIL, GATED_NORM, MOE_COMBINE, P2P, MOE_TAIL, NCCL_MARK))
    return ("// Generated from commfuse/kernels/params.py: the one declaration of the kernels' constants and\n"
            "// parameter structs.\n#pragma once\n\nnamespace commfuse {\n\n" + constants + "\n\n" + body
            + "\n\n}  // namespace commfuse\n")
