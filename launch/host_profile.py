"""Where the host time of one eager commfuse call goes: each step of the data path timed alone.

Usage: python launch/host_profile.py [--tokens 16] [--hidden 4096] [--calls 20] [--json FILE] [--cprofile N]
(one process, world 1; on a GPU the NCCL route, else gloo and CPU tensors). Every row is the median
over repeats of --calls back-to-back calls timed by the host clock around the loop, no GPU wait inside
(the benchmark's host mode), in microseconds per call, and its ratio to torch.add(out=) (the yardstick
of one torch elementwise op) timed in the same repeat just before it: the median of those ratios.
`--cprofile N` also prints cProfile's top functions over N fused_all_reduce calls. The breakdown of a
run is written up in bench/journal.md.
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

import commfuse
from commfuse.fusion import lowering
from commfuse.kernels import fused_tail, jit, launch, native, params
from commfuse.kernels.fused_tail import FUSED_TAIL
from commfuse.tail.spec import OutputSpec, TailSpec, code


def per_call_us(fn, calls: int, repeats: int, floor=None) -> tuple:
    """(median us per call, median of the per-repeat ratios to `floor`'s us in the same repeat, or None):
    each repeat times the floor's loop right before fn's, so that a host whose speed drifts over the run
    (seconds apart) moves both."""
    for _ in range(20):
        fn()
    sync()
    samples, ratios = [], []
    for _ in range(repeats):
        base = None
        if floor is not None:
            t0 = time.perf_counter()
            for _ in range(calls):
                floor()
            base = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        took = time.perf_counter() - t0
        samples.append(took / calls * 1e6)
        if base:
            ratios.append(took / base)
        sync()  # the GPU catches up between repeats, never inside one
    return statistics.median(samples), (statistics.median(ratios) if ratios else None)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rows(comm, t: int, h: int):
    """(name, callable) of every step, cheapest first within each group."""
    dev, dt = comm.device, torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(t, h, generator=g).to(dev, dt)
    r = torch.randn(t, h, generator=g).to(dev, dt)
    w = torch.randn(h, generator=g).to(dev, dt)
    scale = torch.tensor([0.05], device=dev)
    buf = torch.empty_like(x)
    cuda = dev.type == "cuda"
    yield "torch.add(x, r, out=buf)", lambda: torch.add(x, r, out=buf)
    # The same op through torch.ops (the boxed call from Python that torch.ops.commfuse takes).
    yield "torch.ops.aten.add.out(x, r, out=buf)", lambda: torch.ops.aten.add.out(x, r, out=buf)
    yield "torch.empty((t, h), dtype, device)", lambda: torch.empty((t, h), dtype=dt, device=dev)
    yield "torch.empty_like(x)", lambda: torch.empty_like(x)
    yield "torch.empty_like(x, dtype=fp8)", lambda: torch.empty_like(x, dtype=torch.float8_e4m3fn)
    yield "x.new_empty((t, h))", lambda: x.new_empty((t, h))
    yield "x.clone()", lambda: x.clone()
    yield "x.reshape(-1, h)", lambda: x.reshape(-1, h)
    yield "x.contiguous()", lambda: x.contiguous()
    yield "x.data_ptr()", lambda: x.data_ptr()
    yield "x.shape / x.stride() / x.dtype / x.device", lambda: (x.shape, x.stride(), x.dtype, x.device)
    for quant in (None, "fp8"):
        sc = scale if quant else None
        yield f"comm.plan quant={quant}", lambda sc=sc, q=quant: comm.plan(x, r, w, eps=1e-6, quant=q, scale=sc)
        yield f"TailSpec.of quant={quant}", lambda q=quant: TailSpec.of(q, eps=1e-6)
    yield "dist.all_reduce(buf)", lambda: dist.all_reduce(buf)
    try:
        from commfuse import nccl
        if cuda and nccl.available() is None:
            nc = nccl.NcclComm(comm.group, dev)
            yield "commfuse.nccl all_reduce(x -> buf)", lambda: nc.all_reduce(x, buf)
    except ImportError:
        pass
    if cuda:
        yield "torch._C._cuda_getCurrentRawStream", lambda: jit._current_raw_stream(0)
        yield "torch._C._cuda_getDevice", lambda: jit._current_device()
        none = TailSpec.of(None)
        fields = launch.tail_fields(none, t, h)
        yield "params.FUSED_TAIL.pack", lambda: params.FUSED_TAIL.pack(x.data_ptr(), *fields, 0)
        # A plain RMSNorm of x into norm_buf: the plan's bytes with its pointers patched in, as a launcher does.
        (one,) = FUSED_TAIL.plan(dt, t, h, none, 0, residual=False).launches
        norm_buf = torch.empty_like(x)
        pointers = {launch.X: x.data_ptr(), launch.WEIGHT: w.data_ptr(), launch.OUT + 1: norm_buf.data_ptr()}
        blob = bytearray(one.params)
        for offset, source, delta in one.patches:
            blob[offset:offset + 8] = (pointers[source] + delta if source in pointers else 0).to_bytes(8, "little")
        blob = bytes(blob)
        k, threads = one.kernel, one.block
        yield "Kernel.launch (fused tail, packed bytes)", lambda: k.launch((t, 1, 1), (threads, 1, 1), blob)
        stream = jit._current_raw_stream(0)
        slot = jit._SLOT
        ctypes.memmove(slot.buf_addr, blob, len(blob))
        yield "cuda.bindings cuLaunchKernel (bare)", lambda: k._launch(k._function, t, 1, 1, threads, 1, 1, 0,
                                                                        stream, slot.argv_addr, 0)
        libcuda = ctypes.CDLL("libcuda.so.1")
        cu_launch = libcuda.cuLaunchKernel
        cu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        fn = k.function
        yield "ctypes libcuda cuLaunchKernel (bare)", lambda: cu_launch(fn, t, 1, 1, threads, 1, 1, 0, stream,
                                                                        slot.argv_addr, None)
        fp8_plan = FUSED_TAIL.plan(dt, t, h, TailSpec.of("fp8"), 0)
        python = launch.PyLauncher(fp8_plan)
        yield "launch.PyLauncher tail fp8 (allocating)", lambda: python(x, r, w, scale, None)
        if native.unavailable() is None:
            # The C++ launchers the plan tables keep per call signature, alone.
            tail = native.launcher(fp8_plan)
            owned = commfuse.reference.Tail(*tail(x, r, w, scale, None))
            yield "native tail launcher fp8 (allocating)", lambda: tail(x, r, w, scale, None)
            yield "native tail launcher fp8 (out=)", lambda: tail(x, r, w, scale, owned)
            if comm._nccl is not None:
                both = native.launcher(FUSED_TAIL.plan(dt, t, h, TailSpec.of("fp8"), 0, nccl=comm._nccl))
                yield "native NCCL + tail launcher fp8 (allocating)", lambda: both(x, r, w, scale, None)
                alone = native.launcher(launch.LaunchPlan("ncclAllReduce", (), (OutputSpec((t, h), dt),), 0,
                                                          comm._nccl, t * h))
                yield "native NCCL launcher (out=)", lambda: alone(x, None, None, None, buf)
        for quant in (None, "fp8", "nvfp4"):
            sc = scale if quant else None
            yield f"fused_tail.run quant={quant}", lambda sc=sc, q=quant: fused_tail.run(x, r, w, 1e-6, q, sc)
    yield "torch.compiler.is_compiling()", torch.compiler.is_compiling
    yield "comm.all_reduce(x)", lambda: comm.all_reduce(x)
    yield "comm.all_reduce(x, out=buf)", lambda: comm.all_reduce(x, out=buf)
    for quant in (None, "fp8", "nvfp4"):
        sc = scale if quant else None
        yield f"comm.fused_all_reduce quant={quant}", lambda sc=sc, q=quant: comm.fused_all_reduce(
            x, r, w, quant=q, scale=sc)
        outs = comm.fused_all_reduce(x, r, w, quant=quant, scale=sc)
        yield f"comm.fused_all_reduce quant={quant} out=", lambda sc=sc, q=quant, o=outs: comm.fused_all_reduce(
            x, r, w, quant=q, scale=sc, out=o)
        yield f"commfuse.ops.fused_all_reduce quant={quant}", lambda sc=sc, q=quant: commfuse.ops.fused_all_reduce(
            comm, x, r, w, quant=q, scale=sc)
        yield f"torch.ops.commfuse.fused_all_reduce quant={quant}", lambda sc=sc, c=code(quant): (
            torch.ops.commfuse.fused_all_reduce(x, r, w, sc, 1e-6, 0.0, c, comm.name))
    yield "torch.ops.commfuse.all_reduce", lambda: torch.ops.commfuse.all_reduce(x, comm.name)
    for quant in (None, "fp8"):
        sc = scale if quant else None
        yield f"commfuse.fused_add_rmsnorm quant={quant}", lambda sc=sc, q=quant: commfuse.fused_add_rmsnorm(
            x, r, w, quant=q, scale=sc)
        yield f"torch.ops.commfuse.fused_add_rmsnorm quant={quant}", lambda sc=sc, c=code(quant): (
            torch.ops.commfuse.fused_add_rmsnorm(x, r, w, sc, 1e-6, 0.0, c))
        yield f"native.direct.fused_add_rmsnorm quant={quant}", lambda sc=sc, c=code(quant): (
            native.direct.fused_add_rmsnorm(x, r, w, sc, 1e-6, 0.0, c))
    yield "commfuse.gated_rmsnorm group=h/4", lambda: commfuse.gated_rmsnorm(x, r, w, 1e-5, h // 4, False)
    yield "torch.ops.commfuse.gated_rmsnorm group=h/4", lambda c=code(): torch.ops.commfuse.gated_rmsnorm(
        x, r, w, None, 1e-5, h // 4, False, c)
    for quant in ("fp8", "nvfp4"):
        yield f"commfuse.quantize quant={quant}", lambda q=quant: commfuse.quantize(x, q, scale)
        yield f"torch.ops.commfuse.quantize quant={quant}", lambda c=code(quant): torch.ops.commfuse.quantize(
            x, scale, c)
    # Compiled (inductor, default mode): the local op inside a compiled function against inductor's own
    # kernel for the same tail written in torch; each call is the compiled function's whole host path. The
    # first row returns the call's Tail, which dynamo rebuilds after the graph on every call; the second is the
    # op as the fusion pass puts it in a model's graph, its outputs returned as they are, called through
    # torch's dispatcher; the last the same op with commfuse.fusion's lowerings installed (as its backend
    # does), which call it through native.direct. The lowerings stay installed: those rows come last.
    for lowered in (False, True):
        for quant in (None, "fp8"):
            sc = scale if quant else None
            if not lowered:
                yield f"torch.compile: commfuse.fused_add_rmsnorm quant={quant}", _compiled(
                    lambda x, r, w, sc, q=quant: commfuse.fused_add_rmsnorm(x, r, w, quant=q, scale=sc), x, r, w, sc)
            how = "lowered" if lowered else "torch.ops"
            yield f"torch.compile: commfuse op ({how}) quant={quant}", _compiled(
                lambda x, r, w, sc, c=code(quant): torch.ops.commfuse.fused_add_rmsnorm(x, r, w, sc, 1e-6, 0.0, c),
                x, r, w, sc, lowered=lowered)
            if not lowered:
                yield f"torch.compile: the torch tail quant={quant}", _compiled(
                    lambda x, r, w, sc, q=quant: torch_tail(x, r, w, q, sc), x, r, w, sc)


def torch_tail(x, r, w, quant, scale, eps=1e-6):
    """residual add + RMSNorm (+ static FP8) as a model writes it in torch: what inductor fuses itself."""
    h = x + r
    hf = h.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    if quant == "fp8":
        return h, (n.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return h, n


def _compiled(fn, *args, lowered=False):
    """A call of fn compiled now, afresh (no cache: a row's code is its own), with commfuse.fusion's
    lowerings installed first where `lowered`."""
    import torch._inductor.config

    if lowered:
        lowering.install()
        torch._dynamo.reset()  # dynamo keeps a frame's compiled code per code object: the rows share theirs
    compiled = torch.compile(fn, dynamic=False)
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled(*args)
    return lambda: compiled(*args)


def python_op_calls() -> dict:
    """Counts the calls of commfuse.ops' Python kernels (on CUDA the C++ kernels' misses)."""
    counts = {"_fused_all_reduce": 0, "_all_reduce": 0, "_fused_add_rmsnorm": 0, "_gated_rmsnorm": 0, "_quantize": 0}
    for name in counts:
        kernel = getattr(commfuse.ops, name)

        def counted(*args, _name=name, _kernel=kernel, **kwargs):
            counts[_name] += 1
            return _kernel(*args, **kwargs)
        setattr(commfuse.ops, name, counted)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per timed loop (as the benchmark)")
    ap.add_argument("--repeats", type=int, default=51, help="timed loops per row; the median is reported")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--cprofile", type=int, default=0, help="cProfile this many fused_all_reduce calls")
    args = ap.parse_args()
    commfuse.init_distributed()
    comm = commfuse.Communicator()
    t, h = args.tokens, args.hidden
    out = []
    misses = python_op_calls()
    floor = None
    for name, fn in rows(comm, t, h):
        try:
            us, ratio = per_call_us(fn, args.calls, args.repeats, floor)
        except Exception as exc:  # a step that cannot run here is reported, not fatal
            print(f"{name:50s} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        floor = floor or fn  # the first row, torch.add, is every later row's yardstick
        out.append({"step": name, "us": round(us, 2), "x_floor": round(ratio or 1.0, 3)})
    print(f"host time per call ({args.calls} calls a loop, median of {args.repeats}), world {comm.world_size}, "
          f"[{t}, {h}] bf16 on {comm.device} "
          f"({torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}):")
    for row in out:
        print(f"  {row['step']:50s} {row['us']:8.2f} us  {row['x_floor']:5.2f}x")
    print(f"  commfuse.ops Python kernel calls (C++ kernel misses, first calls included): {misses}")
    if args.cprofile:
        x = torch.randn(t, h, device=comm.device, dtype=torch.bfloat16)
        r, w = torch.randn_like(x), torch.randn(h, device=comm.device, dtype=torch.bfloat16)
        scale = torch.tensor([0.05], device=comm.device)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.cprofile):
            comm.fused_all_reduce(x, r, w, quant="fp8", scale=scale)
        prof.disable()
        sync()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "world": comm.world_size, "tokens": t, "hidden": h, "torch": torch.__version__,
                       "calls": args.calls, "repeats": args.repeats, "nccl_binding": getattr(comm, "nccl_binding", "torch.distributed (before commfuse.nccl)"),
                       "rows": out}, f, indent=1)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
