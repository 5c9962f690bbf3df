"""Host time of one add + RMSNorm call, eager and compiled, every row interleaved in one process (each repeat
times every row back to back, the order rotating, so the host's drift falls on all rows alike).

Rows: the op called eagerly through torch.ops, through commfuse.kernels.native.direct and through commfuse's
Python API; compiled by Inductor (default mode) as the fusion pass inserts it, before commfuse's lowerings are
installed (a call through torch's dispatcher) and after (through native.direct), against Inductor's own kernel
for the tail written in torch. torch.add(out=) is the yardstick.

Usage (one GPU): python launch/host_compiled_ab.py [REPEATS]   (default 101; [16, 4096] bf16)
"""
import statistics
import sys
import time

import torch
import torch._inductor.config

import commfuse
from commfuse.fusion import lowering
from commfuse.kernels import native
from commfuse.tail.spec import code
from host_profile import torch_tail  # the tail as a model writes it in torch (launch/ is the script's directory)

t, h = 16, 4096
dev, dt = "cuda", torch.bfloat16
g = torch.Generator().manual_seed(0)
x = torch.randn(t, h, generator=g).to(dev, dt)
r = torch.randn(t, h, generator=g).to(dev, dt)
w = torch.randn(h, generator=g).to(dev, dt)
scale = torch.tensor([0.05], device=dev)
buf = torch.empty_like(x)


def compiled(fn, sc):
    f = torch.compile(fn, dynamic=False)
    with torch._inductor.config.patch(force_disable_caches=True):
        f(x, r, w, sc)
    return lambda: f(x, r, w, sc)


rows = {"torch.add(out=)": lambda: torch.add(x, r, out=buf)}
for q in (None, "fp8"):
    sc, c = (scale if q else None), code(q)
    rows[f"{q} eager torch.ops...default"] = lambda sc=sc, c=c: torch.ops.commfuse.fused_add_rmsnorm.default(x, r, w, sc, 1e-6, 0.0, c)
    rows[f"{q} eager native.direct"] = lambda sc=sc, c=c: native.direct.fused_add_rmsnorm(x, r, w, sc, 1e-6, 0.0, c)
    rows[f"{q} eager commfuse.fused_add_rmsnorm"] = lambda sc=sc, q=q: commfuse.fused_add_rmsnorm(x, r, w, quant=q, scale=sc)
    rows[f"{q} compiled op (torch.ops)"] = compiled(lambda x, r, w, sc, c=c: torch.ops.commfuse.fused_add_rmsnorm(x, r, w, sc, 1e-6, 0.0, c), sc)
    rows[f"{q} compiled torch tail"] = compiled(lambda x, r, w, sc, q=q: torch_tail(x, r, w, q, sc), sc)
lowering.install()
for q in (None, "fp8"):
    sc, c = (scale if q else None), code(q)
    rows[f"{q} compiled op (lowered)"] = compiled(lambda x, r, w, sc, c=c: torch.ops.commfuse.fused_add_rmsnorm(x, r, w, sc, 1e-6, 0.0, c), sc)
names = list(rows)
for n in names:
    for _ in range(30):
        rows[n]()
torch.cuda.synchronize()
calls, repeats = 20, int(sys.argv[1]) if len(sys.argv) > 1 else 101
samples = {n: [] for n in names}
for rep in range(repeats):
    order = names[rep % len(names):] + names[:rep % len(names)]
    for n in order:
        fn = rows[n]
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples[n].append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
base = statistics.median(samples["torch.add(out=)"])
print(f"host us per call, [{t}, {h}] bf16, {calls} calls a loop, median of {repeats} interleaved repeats "
      f"({torch.cuda.get_device_name()}, torch {torch.__version__}); x = median / torch.add's median")
for n in sorted(names, key=lambda n: (n.split()[0], n)):
    s = sorted(samples[n])
    print(f"  {n:45s} {statistics.median(s):8.2f} us  {statistics.median(s) / base:5.2f}x  (p25 {s[len(s)//4]:.2f}, p75 {s[3*len(s)//4]:.2f})")
for q in (None, "fp8"):
    for a in ("compiled op (torch.ops)", "compiled op (lowered)"):
        num, den = samples[f"{q} {a}"], samples[f"{q} compiled torch tail"]
        print(f"  {q}: {a} / compiled torch tail, median of paired ratios: "
              f"{statistics.median(p / d for p, d in zip(num, den)):.3f}")
