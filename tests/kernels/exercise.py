"""Launch every commfuse kernel variant a few times, for compute-sanitizer (launch/sanitize.sh).

One process: the fused-tail kernels over hidden sizes that take each variant (register tails with
1, 2, 4 vectors per thread, the looped one), both dtypes, every quantization and scale(-factor)
layout, token counts with and without swizzle padding rows; the same without a residual (a plain
RMSNorm), the POST variants (a post-norm first), the gated RMSNorm kernel, the quantize kernel, and the
MoE combine and one-kernel MoE tail (both forms, a dropped slot and padding rows in the finalize form, a
shared expert). Under mpirun with 2+ GPUs, also the P2P kernels (one-shot and two-shot, plain and fused;
and two-shot in pieces over a 1 MiB workspace) through a Communicator. The outputs are checked
against commfuse.reference as in the tests (tolerance.tail_mismatch), so a run that the sanitizer
passes but that computes garbage still fails. Prints "exercised N launches" at the end.
"""
import os
import sys

import torch

from commfuse import reference, tolerance
from commfuse.kernels import fused_tail
from commfuse.kernels.p2p_allreduce import chunk_rows
from commfuse.tail.spec import TailSpec

SHAPES = [(1, 16), (3, 40), (1, 4096), (130, 7168), (600, 4096), (7, 16384), (2, 32000)]
# (quant, static scale, scale_layout, scale_ue8m0, weight_offset)
PATTERNS = [(None, None, "row", False, 0.0), ("fp8", 0.02, "row", False, 0.0), ("nvfp4", 0.004, "row", False, 0.0),
            ("fp8_per_token", None, "row", False, 1.0), ("fp8_block", None, "row", False, 0.0),
            ("fp8_block", None, "mn_major", False, 0.0), ("fp8_block", None, "mn_major", True, 1.0),
            ("fp8_block", None, "row", True, 0.0), ("mxfp8", None, "row", False, 1.0)]


def skip(quant, h) -> bool:
    return h % TailSpec.of(quant).hidden_multiple > 0


def inputs(g, t, h, dtype):
    return [torch.randn(*s, generator=g, device="cuda").to(dtype) for s in ((t, h), (t, h), (h,))]


def check(got, a, residual, weight, quant, scale, layout, what, scaled=("row", False, 0.0)):
    scale_layout, ue8m0, offset = scaled
    want = reference.fused_tail(a, residual, weight, 1e-6, quant, scale, True, layout, offset, scale_layout, ue8m0)
    why = tolerance.tail_mismatch(got, want, quant, layout, scale_layout=scale_layout, scale_ue8m0=ue8m0, scale=scale)
    if why:
        sys.exit(f"{what}: {why}")


def fused_tails(g) -> int:
    n = 0
    for t, h in SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            a, residual, weight = inputs(g, t, h, dtype)
            for quant, s, *scaled in PATTERNS:
                if skip(quant, h):
                    continue
                scale = None if s is None else torch.tensor([s], device="cuda")
                kw = dict(scale_layout=scaled[0], scale_ue8m0=scaled[1], weight_offset=scaled[2])
                for layout in ("swizzled", "linear") if quant in ("nvfp4", "mxfp8") else ("swizzled",):
                    got = fused_tail.run(a, residual, weight, 1e-6, quant, scale, True, layout, **kw)
                    check(got, a, residual, weight, quant, scale, layout, f"fused_tail {t}x{h} {dtype} {quant} {layout}",
                          scaled)
                    n += 1
                    n += local_ops(a, residual, weight, quant, scale, layout, scaled, f"{t}x{h} {dtype} {quant} {layout}")
    return n


def post_tails(g) -> int:
    """The POST variants (a post-norm first, its weight the launcher's z), as the NCCL and one-rank routes launch
    them: the residual within ulp(a') + ulp(r) of the reference's, the rest within the tolerances of the tail of
    the kernel's own residual (tests/test_fused_tail.py's post-norm test)."""
    from commfuse.kernels import native

    n, dev = 0, torch.cuda.current_device()
    sm = torch.cuda.get_device_capability(dev)
    for t, h in SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            a, residual, weight = inputs(g, t, h, dtype)
            for quant, s, scale_layout, ue8m0, offset in PATTERNS:
                spec = TailSpec.of(quant, return_norm=True, weight_offset=offset, scale_layout=scale_layout,
                                   scale_ue8m0=ue8m0)
                if skip(quant, h) or fused_tail.FUSED_TAIL.rejects(dtype, sm, h, t, spec):
                    continue
                scale = None if s is None else torch.tensor([s], device="cuda")
                post = (1 - offset + 0.1 * torch.randn(h, generator=g, device="cuda")).to(dtype)
                plan = fused_tail.FUSED_TAIL.plan(dtype, t, h, spec, dev, post=True)
                got = reference.Tail(*native.launcher(plan)(a, residual, weight, scale, None, post))
                want = reference.fused_tail(a, residual, weight, 1e-6, quant, scale, True, "swizzled", offset,
                                            scale_layout, ue8m0, post)
                own = reference.fused_tail(got.residual, None, weight, 1e-6, quant, scale, True, "swizzled", offset,
                                           scale_layout, ue8m0)
                why = tolerance.post_residual_within(got.residual, want.residual,
                                                     reference.rmsnorm(a, post, 1e-6, offset), "residual") or \
                    tolerance.tail_mismatch(got, own._replace(residual=got.residual), quant, scale_layout=scale_layout,
                                            scale_ue8m0=ue8m0, scale=scale)
                if why:
                    sys.exit(f"fused_tail (post-norm) {t}x{h} {dtype} {quant}: {why}")
                n += 1
    return n


def local_ops(a, z, weight, quant, scale, layout, scaled, what) -> int:
    """The tail kernel without a residual (a plain RMSNorm), and the gated RMSNorm kernel (rows it
    takes: h <= 16384) with the gate before and after the norm, against their references."""
    from commfuse.kernels import gated_norm

    scale_layout, ue8m0, _ = scaled
    kw = dict(scale_layout=scale_layout, scale_ue8m0=ue8m0)
    stand_in = a.reshape(-1, a.shape[-1])  # tail_mismatch compares a residual: x for both
    got = fused_tail.run(a, None, weight, 1e-6, quant, scale, True, layout, **kw)
    want = reference.fused_tail(a, None, weight, 1e-6, quant, scale, True, layout, 0.0, scale_layout, ue8m0)
    runs = [(got, want._replace(residual=stand_in), "plain rmsnorm")]
    h = a.shape[-1]
    if h <= gated_norm.MAX_HIDDEN:
        group = h // 2 if h % 16 == 0 else h
        for before in (False, True):
            n_ref = reference.gated_rmsnorm(a, z, weight, 1e-5, group, before)
            got = gated_norm.run(a, z, weight, 1e-5, group, before, quant, scale, True, layout, **kw)
            want = ((None, None, None) if quant is None
                    else reference.quantize(n_ref, quant, scale, layout, scale_layout, ue8m0))
            runs.append((got, reference.Tail(stand_in, n_ref, *want), f"gated rmsnorm (before={before})"))
    for got, want, name in runs:
        why = tolerance.tail_mismatch(got._replace(residual=stand_in), want, quant, layout, scale_layout=scale_layout,
                                      scale_ue8m0=ue8m0, scale=scale)
        if why:
            sys.exit(f"{name} {what}: {why}")
    return len(runs) + quantize_alone(a, quant, scale, layout, kw, what)


def quantize_alone(a, quant, scale, layout, kw, what) -> int:
    """The quantize kernel (rows it takes: h <= 16384) against reference.quantize, bit for bit."""
    from commfuse import local
    from commfuse.kernels import quantize

    if quant is None or a.shape[-1] > quantize.MAX_HIDDEN:
        return 0
    got = local.quantize(a, quant, scale, layout, **kw)
    want = reference.quantize(a, quant, scale, layout, **kw)
    def bits(v):
        return v.contiguous().view(torch.uint8)

    for g, w in zip(got, want):
        if (g is None) != (w is None) or (g is not None and not torch.equal(bits(g), bits(w))):
            sys.exit(f"quantize {what}: differs from reference.quantize")
    return 1


def moe_kernels(g) -> int:
    """The MoE combine kernel (bit for bit against reference.moe_reduce / moe_finalize) and the one-kernel
    MoE tail (against the reference tail of the reference combine), reduction and finalize forms."""
    from commfuse.kernels import moe_combine, moe_tail

    n = 0
    # (3, 8, 40) and (16, 4, 4096) split each token over a cluster (SM 9.0+; 3 x 8: CTAs without vectors)
    for t, k, h in ((1, 2, 16), (3, 8, 40), (16, 4, 4096), (130, 8, 7168), (7, 3, 16384)):
        y = torch.randn(t, k, h, generator=g, device="cuda").to(torch.bfloat16)
        w = torch.rand(t, k, generator=g, device="cuda")
        shared = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16)
        perm = torch.randperm(t * k + 5, generator=torch.Generator().manual_seed(t))[:t * k].to("cuda")
        rows = torch.randn(t * k + 5, h, generator=g, device="cuda").to(torch.bfloat16)  # 5 padding rows
        index = perm.view(t, k).to(torch.int32)
        index[0, -1] = -1  # a slot dropped by capacity
        rows[perm] = y.reshape(t * k, h)
        _, residual, weight = inputs(g, t, h, torch.bfloat16)
        for form, (yy, idx) in (("reduction", (y, None)), ("finalize", (rows, index))):
            want = reference.moe_reduce(y, w, shared) if idx is None else reference.moe_finalize(rows, idx, w, shared)
            got = moe_combine.run(yy, w, idx, shared)
            if not torch.equal(got, want):
                sys.exit(f"moe_combine {form} {t}x{k}x{h}: differs from the reference combine")
            for quant, s, *_ in PATTERNS[:3]:
                if skip(quant, h):
                    continue
                scale = None if s is None else torch.tensor([s], device="cuda")
                got = moe_tail.run(yy, w, idx, shared, residual, weight, scale, TailSpec.of(quant, return_norm=True))
                check(reference.Tail(*got), want, residual, weight, quant, scale, "swizzled",
                      f"moe_tail {form} {t}x{k}x{h} {quant}")
                n += 1
            n += 1
        n += moe_bad_indices(rows, index, w, shared, residual, weight)
    return n


def moe_bad_indices(rows, index, w, shared, residual, weight) -> int:
    """Row indices outside [-1, R) (-2; R, or 2^33 as int64): the kernels must not read those rows (what
    memcheck watches) and make those tokens NaN, the others the reference's."""
    from commfuse.kernels import moe_combine, moe_tail

    t = index.shape[0]
    bad = [t - 1] + ([t - 2] if t > 2 else [])
    good = [i for i in range(t) if i not in bad]
    n = 0
    for dtype, far in ((torch.int32, rows.shape[0]), (torch.int64, 2 ** 33)):
        idx = index.to(dtype, copy=True)
        idx[t - 1, 0] = far
        if t > 2:
            idx[t - 2, -1] = -2
        want = reference.moe_finalize(rows, idx[good], w[good], shared[good]) if good else None
        got = moe_combine.run(rows, w, idx, shared)
        tail = moe_tail.run(rows, w, idx, shared, residual, weight, None, TailSpec.of(None, return_norm=True))
        for what, out in (("moe_combine", got), ("moe_tail residual", tail[0]), ("moe_tail norm", tail[1])):
            if not torch.isnan(out[bad].float()).all():
                sys.exit(f"{what} {dtype} {tuple(rows.shape)}: a bad row index did not make its token NaN")
        if good and not torch.equal(got[good], want):
            sys.exit(f"moe_combine {dtype}: the tokens with good indices differ from the reference")
        n += 2
    return n


def p2p_kernels(g) -> int:
    import commfuse
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    n = 0
    for strategy, workspace_mb, shapes in (("oneshot", None, ((1, 4096), (130, 7168), (7, 16384), (2, 32000))),
                                           ("twoshot", None, ((1, 4096), (130, 7168), (7, 16384), (2, 32000))),
                                           ("twoshot", 1, ((300, 3088), (300, 3072)))):  # pieces of 169 / 128 rows
        if workspace_mb:
            os.environ["COMMFUSE_P2P_WORKSPACE_MB"] = str(workspace_mb)
        comm = commfuse.Communicator(strategy=strategy)
        os.environ.pop("COMMFUSE_P2P_WORKSPACE_MB", None)
        limit = comm.workspace.max_bytes

        def launches(row_bytes, quant, t, scaled=("row", False)):
            spec = TailSpec.of(quant, scale_layout=scaled[0], scale_ue8m0=scaled[1]) if row_bytes > 16 else None
            return 1 if t * row_bytes <= limit else -(-t // chunk_rows(row_bytes, spec, limit))

        for t, h in shapes:
            # Every rank makes every rank's x (same generator state) and keeps its own, so the sum
            # can be checked; a kernel that read the wrong peer would fail here.
            xs = [torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16) for _ in range(world)]
            _, residual, weight = inputs(g, t, h, torch.bfloat16)
            total = comm.all_reduce(xs[rank])
            n += launches(16, None, t * h // 8)
            why = tolerance.within_ulp(total, reference.all_reduce_sum(xs), 0, f"{strategy} sum {t}x{h}")
            if why:
                sys.exit(why)
            for quant, s, *scaled in PATTERNS:
                if skip(quant, h):
                    continue
                scale = None if s is None else torch.tensor([s], device="cuda")
                r = comm.fused_all_reduce(xs[rank], residual, weight, 1e-6, quant, scale, True, "swizzled",
                                          scale_layout=scaled[0], scale_ue8m0=scaled[1], weight_offset=scaled[2])
                n += launches(2 * h, quant, t, scaled)
                if not r.plan.collective.startswith("p2p") or r.plan.tail != "fused":
                    sys.exit(f"{strategy} {t}x{h} {quant}: took {r.plan}, not a fused P2P kernel")
                check(r, total, residual, weight, quant, scale, "swizzled", f"{strategy} {t}x{h} {quant} {scaled}",
                      scaled)
        comm.check()
        comm.close()
    return n


def main():
    import commfuse

    commfuse.init_distributed()
    g = torch.Generator(device="cuda").manual_seed(0)
    n = fused_tails(g) + post_tails(g) + moe_kernels(g)
    if torch.distributed.get_world_size() > 1:
        n += p2p_kernels(g)
    torch.cuda.synchronize()
    print(f"rank {torch.distributed.get_rank()}: exercised {n} launches", flush=True)


if __name__ == "__main__":
    main()
