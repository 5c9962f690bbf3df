"""Print a digest of every kernel variant's machine code (the ELF .text section of each instantiation),
per arch, as JSON: run it in two checkouts and compare, to show that a change left the kernels' code
alone where their inputs did not change. NVRTC only, no GPU.

    python launch/kernel_text.py sm_90 sm_100a > text.json
"""
import hashlib
import importlib
import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sections(elf: bytes) -> dict:
    """{section name: bytes} of an ELF64 little-endian image."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx]
    strtab = elf[names[4]:names[4] + names[5]]
    out = {}
    for name, _type, _flags, _addr, offset, size, *_ in heads:
        label = strtab[name:strtab.index(b"\0", name)].decode()
        out[label] = elf[offset:offset + size]
    return out


def families():
    """(source file, name expressions) of every family, whichever layout the checkout has."""
    try:
        from commfuse.kernels import fused_tail, gated_norm, p2p_allreduce
    except ImportError:  # a checkout from before commfuse/kernels/
        from commfuse import fused_tail, gated_norm
        from commfuse.p2p import kernels as p2p_allreduce
    modules = [fused_tail, gated_norm, p2p_allreduce]
    for name in ("quantize", "moe_combine", "moe_tail"):
        try:
            modules.append(importlib.import_module(f"commfuse.kernels.{name}"))
        except ImportError:  # a checkout from before that family
            pass
    return [(m.SOURCE, m.variants()) for m in modules]


def main(archs):
    try:
        from commfuse.kernels import jit
    except ImportError:
        from commfuse import jit
    digests = {}
    for arch in archs:
        for source, names in families():
            built = jit.build(source, names, arch)
            text = sections(built.cubin)
            for name in names:
                code = text.get(".text." + built.lowered[name])
                digests[f"{arch} {name}"] = hashlib.sha256(code).hexdigest()[:16] if code is not None else None
    json.dump(digests, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main(sys.argv[1:] or ["sm_90"])
