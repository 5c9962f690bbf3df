"""The local fused tail at every launch configuration its variants allow, against Inductor's kernel of the
same tail: whether commfuse.kernels.fused_tail.launch_config's choice, or another variant, is behind.

Usage (one GPU): python launch/tail_sweep.py [--shapes 1024x8192,8192x4096] [--quants none,fp8,nvfp4] [--no-residual]
(--no-residual: the plain RMSNorm of x, commfuse.fused_add_rmsnorm(x, None, ...), quant none only)
       python launch/tail_sweep.py --post [--shapes ...] [--quants ...]
(--post: the POST variants, x normalised with a post weight before the residual add (docs/semantics.md
section 2a); Inductor's kernel of the same unfused math, as Gemma 2 / 3 write it)
       python launch/tail_sweep.py --moe 8 [--shapes 1x7168,64x7168] [--quants none,nvfp4]
(--moe k: the world-1 MoE tail of k slots a token, in the reduction form and in the finalize form with a
shared expert, at every split: CTAs a token, moe_tail.MOE_TAIL.plan's split, the default one marked "*";
no Inductor column)
       python launch/tail_sweep.py --gated 128 [--shapes ...]
(--gated G: the gated RMSNorm, groups of G, gate first, at every VPT of its variants and every split of a row
into CTAs that gated_norm.splits could choose)

Per (shape, quant): each VPT (1, 2, 4 vectors per thread, with the fewest whole warps that cover the
row; 0 the looped variant, 256 threads) whose thread limit fits, its GPU time per call (20 calls in a
CUDA graph, median of 10 replays, examples/bench_local_ops.py's timing) after a check of its outputs
against commfuse.reference (commfuse.tolerance), the configuration launch_config picks marked "*";
then torch.compile (Inductor) of the tail as models write it (bench_local_ops.torch_tail).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import bench_local_ops as bench  # noqa: E402
from commfuse import reference  # noqa: E402
from commfuse.kernels import fused_tail, native, params  # noqa: E402
from commfuse.kernels.fused_tail import FUSED_TAIL  # noqa: E402
from commfuse.kernels.launch import X, Z, LaunchPlan, PyLauncher, tail_fields, tail_patches  # noqa: E402
from commfuse.tail.spec import TailSpec  # noqa: E402


def configs(h: int):
    vectors = h // 8
    for vpt in fused_tail.VPT_BUCKETS:
        need = -(-vectors // vpt)  # threads that cover the row
        threads = max(32, -(-need // 32) * 32)
        if threads <= fused_tail.MAX_THREADS[vpt]:
            yield vpt, threads
    yield 0, fused_tail.MAX_THREADS[0]


def launcher(dtype, t, h, spec, vpt, threads, post=False):
    """The tail at (vpt, threads); post: the POST variant, its weight the launcher's z."""
    dev = torch.cuda.current_device()
    launch = FUSED_TAIL.launch(dtype, t, h, spec, dev, vpt, threads, post=post)
    return PyLauncher(LaunchPlan("sweep", (launch,), tuple(spec.outputs(t, h, dtype, True)), dev))


def _fmt(us) -> str:
    return "n/a" if us is None else f"{us:.2f}"


def _timed(call, want, quant, check=None, **tol) -> str:
    """call()'s GPU time per call as text; its outputs checked against `want` (bench_local_ops.check, with tol's
    reference norm and scale for the codes of a block whose scale factor is a step off; or check(outputs) -> why)
    before the timing, and after it those of the graph's last replay and of the last eager call."""
    check = check or (lambda r: bench.check(r, want, quant, **tol))
    why = check(call())
    if why:
        return "wrong: " + why
    timed = []
    us = bench.time_us(call, True, 20, 10, timed).get("graph")
    torch.cuda.synchronize()
    why = next((w for w in (check(r) for r in timed) if w), "")
    return "wrong after the timing: " + why if why else _fmt(us)


def _inductor(fn, want, quant, check=None, **tol) -> str:
    """Inductor's GPU time of fn, compiled static for this shape (a recompile for a second shape would
    otherwise make its kernel dynamic), checked as _timed checks ours."""
    torch._dynamo.reset()
    return _timed(torch.compile(fn, dynamic=False), want, quant, check, **tol)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="256x7168,1024x4096,1024x8192,8192x4096")
    p.add_argument("--quants", default="none,fp8,nvfp4")
    p.add_argument("--no-residual", action="store_true", help="the plain RMSNorm of x (quant none)")
    p.add_argument("--moe", type=int, default=0, help="the MoE tail of this many slots a token, at every split")
    p.add_argument("--gated", type=int, default=0, help="the gated RMSNorm of groups of this size, at every VPT")
    p.add_argument("--post", action="store_true", help="the POST variants: a post-norm before the residual add")
    args = p.parse_args(argv)
    if args.moe:
        return moe_sweep(args)
    if args.post:
        return post_sweep(args)
    if args.gated:
        return gated_sweep(args)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    print("| shape | quant | config (vpt x threads) | us | Inductor us |\n|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        t, h = map(int, shape.split("x"))
        x = torch.randn(t, h, generator=gen).to(dtype).cuda()
        r = None if args.no_residual else torch.randn(t, h, generator=gen).to(dtype).cuda()
        w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).cuda()
        for q in ("none",) if args.no_residual else args.quants.split(","):
            quant = None if q == "none" else q
            scale = torch.tensor([bench.SCALES[quant]], device="cuda") if quant else None
            spec = TailSpec.of(quant, eps=1e-5, return_norm=quant is None)
            want = reference.fused_tail(x, r, w, 1e-5, quant, scale)
            want = tuple(v for v in (want.residual, want.norm, want.quant, want.scale_factors) if v is not None)
            if r is None:
                want = want[-1:]  # the norm; the kernel's residual output is x's copy, which it does not write
            tol = dict(norm=reference.fused_tail(x, r, w, 1e-5).norm, scale=scale)
            ind = _inductor(lambda: bench.torch_tail(x, r, w, 1e-5, quant, scale), want, quant, **tol)
            chosen = fused_tail.launch_config(h, t, quant is None, r is not None)
            for vpt, threads in configs(h):
                run = launcher(dtype, t, h, spec, vpt, threads)

                def call(run=run):
                    out = tuple(v for v in run(x, r, w, scale) if v is not None)
                    return out[-1:] if r is None else out  # no residual: the norm only, as `want`

                mark = " *" if (vpt, threads) == chosen else ""
                print(f"| {shape} | {q} | {vpt} x {threads}{mark} | {_timed(call, want, quant, **tol)} | {ind} |",
                      flush=True)


def post_check(x, r, w, post, quant, scale):
    """check(outputs) for a post-norm tail (residual, then the norm or the codes and scale factors): the residual
    within tolerance.post_residual_within of the reference's, the rest that of the outputs' own residual."""
    from commfuse import tolerance

    want = reference.fused_tail(x, r, w, 1e-5, quant, scale, post_weight=post)
    post_normed = reference.rmsnorm(x, post, 1e-5)

    def check(got):
        got = bench.outputs(got)
        why = tolerance.post_residual_within(got[0], want.residual, post_normed, "residual")
        if why:
            return why
        own = reference.fused_tail(got[0], None, w, 1e-5, quant, scale)
        if quant is None:
            return tolerance.within_ulp(got[1], own.norm, 1, "norm") or ""
        sf = got[2] if quant == "nvfp4" else None
        return tolerance.tail_mismatch(reference.Tail(got[0], None, got[1], sf),
                                       reference.Tail(got[0], None, own.quant, own.scale_factors), quant,
                                       norm=reference.fused_tail(got[0], None, w, 1e-5).norm, scale=scale) or ""
    return check


def post_sweep(args) -> None:
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    print("| shape | quant | post config (vpt x threads) | us | Inductor us (unfused post-norm) |\n"
          "|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        t, h = map(int, shape.split("x"))
        x, r = (torch.randn(t, h, generator=gen).to(dtype).cuda() for _ in range(2))
        w, post = ((1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).cuda() for _ in range(2))
        for q in args.quants.split(","):
            quant = None if q == "none" else q
            scale = torch.tensor([bench.SCALES[quant]], device="cuda") if quant else None
            spec = TailSpec.of(quant, eps=1e-5, return_norm=quant is None)
            check = post_check(x, r, w, post, quant, scale)
            ind = _inductor(lambda: bench.torch_tail(bench.torch_tail(x, None, post, 1e-5, None, None)[0], r, w, 1e-5,
                                                     quant, scale), None, quant, check)
            chosen = fused_tail.launch_config(h, t, quant is None, True)
            for vpt, threads in configs(h):
                run = launcher(dtype, t, h, spec, vpt, threads, post=True)

                def call(run=run):
                    return tuple(v for v in run(x, r, w, scale, None, post) if v is not None)

                mark = " *" if (vpt, threads) == chosen else ""
                print(f"| {shape} | {q} | {vpt} x {threads}{mark} | {_timed(call, None, quant, check)} | {ind} |",
                      flush=True)


def gated_sweep(args) -> None:
    from commfuse.kernels import gated_norm
    from commfuse.kernels.gated_norm import GATED_NORM

    gen = torch.Generator().manual_seed(0)
    g, dev = args.gated, torch.cuda.current_device()
    print("| shape | group | config (splits x vpt x threads) | us | Inductor us |\n|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        t, h = map(int, shape.split("x"))
        x, z = (torch.randn(t, h, generator=gen).bfloat16().cuda() for _ in range(2))
        w = (1 + 0.1 * torch.randn(h, generator=gen)).bfloat16().cuda()
        want = (reference.gated_rmsnorm(x, z, w, 1e-5, g, False),)
        ind = _inductor(lambda: (reference.gated_rmsnorm(x, z, w, 1e-5, g, False),), want, None)
        spec = TailSpec.of(None, eps=1e-5, return_norm=True)
        split = gated_norm.splits(h, t, g, spec)
        chosen = (split, *gated_norm.launch_config(h // split, t))
        unit = math.lcm(g, gated_norm.SLICE_MULTIPLE)
        for s in (s for s in range(1, 9) if h % (s * unit) == 0):
            for vpt in gated_norm.VPT_BUCKETS:
                need = -(-(h // s // 8) // vpt)  # threads that cover the slice
                threads = max(32, -(-need // 32) * 32)
                if threads > gated_norm.MAX_THREADS[vpt]:
                    continue
                blob = params.GATED_NORM.pack(*tail_fields(spec, t, h), 0, 0, g, 0, s, 0)
                patches = tail_patches(params.GATED_NORM.offsets["tail"])
                patches += [(params.GATED_NORM.offsets["x"], X, 0), (params.GATED_NORM.offsets["z"], Z, 0)]
                launch = GATED_NORM.row_launch(torch.bfloat16, spec, t, vpt, threads, blob, patches, dev, s)
                run = PyLauncher(LaunchPlan("sweep", (launch,), tuple(spec.outputs(t, h, torch.bfloat16, False)), dev))

                def call(run=run):
                    return (run(x, None, w, None, None, z)[1],)

                mark = " *" if (s, vpt, threads) == chosen else ""
                print(f"| {shape} | {g} | {s} x {vpt} x {threads}{mark} | {_timed(call, want, None)} | {ind} |",
                      flush=True)


def moe_sweep(args) -> None:
    from commfuse.kernels import moe_tail

    gen = torch.Generator().manual_seed(0)
    k, dev = args.moe, torch.cuda.current_device()
    print("| shape | k | form | quant | split (CTAs a token) | us |\n|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        t, h = map(int, shape.split("x"))
        rows = torch.randn(t * k, h, generator=gen).bfloat16().cuda()
        idx = torch.randperm(t * k, generator=gen).view(t, k).to(torch.int32).cuda()
        w = torch.rand(t, k, generator=gen).cuda()
        shared, residual = (torch.randn(t, h, generator=gen).bfloat16().cuda() for _ in range(2))
        weight = (1 + 0.1 * torch.randn(h, generator=gen)).bfloat16().cuda()
        # The reduction form reads y [t, k, h] (here the rows in order), the finalize form the rows through
        # the index, plus the shared expert.
        forms = {"reduction": (rows.view(t, k, h), None, None, reference.moe_reduce(rows.view(t, k, h), w)),
                 "finalize": (rows, idx, shared, reference.moe_finalize(rows, idx, w, shared))}
        for q in args.quants.split(","):
            quant = None if q == "none" else q
            scale = torch.tensor([bench.SCALES[quant]], device="cuda") if quant else None
            spec = TailSpec.of(quant, return_norm=quant is None)
            vpt, _ = moe_tail.launch_config(h, t)
            chosen = moe_tail.MOE_TAIL.ctas_per_token(t, k, h, vpt, dev)
            for form_name, (y, row_index, shared_in, combined) in forms.items():
                want = reference.fused_tail(combined, residual, weight, 1e-6, quant, scale, quant is None)
                want = tuple(v for v in (want.residual, want.norm, want.quant, want.scale_factors) if v is not None)
                tol = dict(norm=reference.fused_tail(combined, residual, weight, 1e-6).norm, scale=scale)
                for split in (1, 2, 4, 8) if vpt == 1 and moe_tail.clusters(dev) else (1,):
                    index_dtype, y_rows = (None, 0) if row_index is None else (row_index.dtype, y.shape[0])
                    plan = moe_tail.MOE_TAIL.plan(torch.bfloat16, w.dtype, index_dtype, t, k, h, y_rows, spec, dev,
                                                  split=split)

                    def call(plan=plan, y=y, row_index=row_index, shared_in=shared_in):
                        out = native.launcher(plan)(y, residual, weight, scale, None, w, row_index, shared_in)
                        return tuple(v for v in out if v is not None)

                    mark = " *" if split == chosen else ""
                    print(f"| {shape} | {k} | {form_name} | {q} | {split}{mark} | {_timed(call, want, quant, **tol)} |",
                          flush=True)


if __name__ == "__main__":
    main()
