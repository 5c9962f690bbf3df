"""Compile every kernel variant for this machine's GPU into the kernel cache, in parallel.

Ranks that start together would each compile the same variants on first use (N times the NVRTC
work); launch/device.sh runs this once before its multi-rank stages. It builds the native hot path
(commfuse.kernels.native) too. Usage: python3 launch/prewarm.py
"""
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from commfuse.kernels import (fused_tail, gated_norm, jit, moe_combine, moe_tail, native, nccl_mark,  # noqa: E402
                              p2p_allreduce, quantize)


def build(job):
    source, name, arch = job
    jit.build(source, (name,), arch)
    return name


def main():
    arch = jit.device_arch(0)
    jobs = [(m.SOURCE, n, arch) for m in (fused_tail, gated_norm, quantize, moe_combine, moe_tail, p2p_allreduce, nccl_mark)
            for n in m.variants()]
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        done = list(pool.map(build, jobs))
    print(f"prewarm: {len(done)} kernel variants for {arch} in {jit.cache_dir()}")
    print(f"prewarm: native hot path {native.unavailable() or 'built'}")


if __name__ == "__main__":
    main()
