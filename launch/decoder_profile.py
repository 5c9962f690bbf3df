"""Where a compiled decoder step's host time goes: examples/tp_decoder.py's 8b model (4 layers, fp8),
world 1, compiled with Inductor as written ("unfused"), through commfuse.fusion with every rewrite
("fused-all") and with the pass's own choice ("fused-auto"), and as written through a dynamo backend
function that hands the graph to Inductor ("wrapped": commfuse.fusion's way in, without the pass), each
compiled afresh in the order unfused, fused-all, wrapped, unfused, fused-all, fused-auto, wrapped (so that a
column's place in the run shows).

Per column: the decoder's own sequence (prefill + 4 decode steps, tp_decoder.run_steps) timed 5 times
after a warm-up, the per-step medians; the calls of the op kernels that fell back to Python (the
C++ op kernels call commfuse.ops' Python kernels on a plan-table miss; here they are counted); 20
decode steps back to back (the host's pace); with PROFILE=1 also torch.profiler's table of 5 decode
steps by self CPU time, and a run under torch.cuda's sync debug mode (a warning per synchronising call).

Usage (one GPU): [PMODE=reduce-overhead] [ORDER=unfused,fused-all] [PROFILE=1] python launch/decoder_profile.py
(PMODE: the mode; ORDER: the columns in order, default the seven above; one column: a fresh process's)
"""
import gc
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import commfuse  # noqa: E402
import commfuse.ops  # noqa: E402
from commfuse.fusion.backend import _inner_compiler  # noqa: E402
import tp_decoder as td  # noqa: E402

FALLBACKS = [0]
for _name in ("_fused_add_rmsnorm", "_fused_all_reduce", "_all_reduce"):
    def _counted(*a, _f=getattr(commfuse.ops, _name), **k):
        FALLBACKS[0] += 1
        return _f(*a, **k)
    setattr(commfuse.ops, _name, _counted)

commfuse.init_distributed()
comm = commfuse.Communicator()
comm.check_calls = False
dev = comm.device
cfg = td.Config(**{**td.asdict(td.SIZES["8b"]), "layers": 4})
torch.manual_seed(0)
model = td.Decoder(cfg, 0, 1, dev, torch.bfloat16, norm="hf", quant="fp8", collective="dist", comm=comm, max_len=32,
                   batch=1)
g = torch.Generator().manual_seed(1234)
prompt = torch.randint(0, cfg.vocab, (1, 16), generator=g).to(dev)
decode = torch.randint(0, cfg.vocab, (1, 4), generator=g).to(dev)
mode = os.environ.get("PMODE") or None
ORDER = (os.environ.get("ORDER") or "unfused,fused-all,wrapped,unfused,fused-all,fused-auto,wrapped").split(",")


def wrapped(gm, example_inputs):
    """A dynamo backend that only hands the graph to Inductor, as commfuse.fusion's backend does after its pass."""
    return _inner_compiler("inductor", mode, None, None)(gm, example_inputs)



make = {
    "unfused": lambda: torch.compile(model.forward, backend="inductor", mode=mode, fullgraph=True),
    "fused-all": lambda: commfuse.fusion.compile(model.forward, comm, backend="inductor", mode=mode, fullgraph=True,
                                                 rewrite="all"),
    "fused-auto": lambda: commfuse.fusion.compile(model.forward, comm, backend="inductor", mode=mode, fullgraph=True,
                                                  rewrite="auto"),
    "wrapped": lambda: torch.compile(model.forward, backend=wrapped, fullgraph=True),
}
print(f"decoder_profile: 8b, 4 layers, fp8, world 1 on {dev}, mode {mode}", flush=True)
with torch.inference_mode():
    for name in ORDER:
        torch._dynamo.reset()
        fn = make[name]()
        td.run_steps(model, fn, prompt, decode, dev)  # warm-up and compilation
        before = FALLBACKS[0]
        runs = [td.run_steps(model, fn, prompt, decode, dev)[1] for _ in range(5)]
        fell_back = (FALLBACKS[0] - before) / 5
        steps = [statistics.median(s) * 1e3 for s in zip(*runs)]
        tok = decode[:, :1]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn(tok, 18)
        pace = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize()
        print(f"== {name:10s} steps (ms) " + " ".join(f"{s:6.3f}" for s in steps) + f"  total {sum(steps):7.3f}; "
              f"back-to-back decode {pace:.3f} ms; Python fallbacks per sequence {fell_back:g}; "
              f"{len(gc.get_objects())} Python objects, {torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)
        if os.environ.get("PROFILE") == "1":
            torch.cuda.set_sync_debug_mode(1)
            fn(tok, 18)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(0)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(5):
                    fn(tok, 18)
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=70),
                  flush=True)
