"""Where a compiled decoder step's host time goes: examples/tp_decoder.py's 8b model (4 layers, fp8),
world 1, compiled with Inductor unfused, through commfuse.fusion with every rewrite, and with the
pass's own choice. For each: the median of 20 decode steps timed with a GPU sync around each, 20
back-to-back steps (the host's pace), a run under torch.cuda's sync debug mode (a warning per
synchronizing call) and torch.profiler's table of 5 steps by self CPU time.

Usage (one GPU): PMODE=reduce-overhead python launch/decoder_profile.py   (PMODE: torch.compile's mode)
"""
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import commfuse  # noqa: E402
import tp_decoder as td  # noqa: E402

commfuse.init_distributed()
comm = commfuse.Communicator(); comm.check_calls = False
dev = comm.device
cfg = td.Config(**{**td.asdict(td.SIZES["8b"]), "layers": 4})
torch.manual_seed(0)
model = td.Decoder(cfg, 0, 1, dev, torch.bfloat16, norm="hf", quant="fp8", collective="dist", comm=comm, max_len=32, batch=1)
prompt = torch.randint(0, cfg.vocab, (1, 16), device=dev)
tok = torch.randint(0, cfg.vocab, (1, 1), device=dev)
mode = os.environ.get("PMODE") or None
cols = {
  "unfused": lambda: torch.compile(model.forward, backend="inductor", mode=mode, fullgraph=True),
  "fused-all": lambda: commfuse.fusion.compile(model.forward, comm, backend="inductor", mode=mode, fullgraph=True, rewrite="all"),
  "fused-auto": lambda: commfuse.fusion.compile(model.forward, comm, backend="inductor", mode=mode, fullgraph=True, rewrite="auto"),
}
with torch.inference_mode():
  for name, make in cols.items():
    torch._dynamo.reset(); fn = make()
    for _ in range(3):
      model.reset(); fn(prompt, 0); fn(tok, 16); fn(tok, 17)
    ts = []
    for _ in range(20):
      torch.cuda.synchronize(); t0 = time.perf_counter(); fn(tok, 18); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    # host-only pace: no sync between calls
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(20): fn(tok, 18)
    th = (time.perf_counter() - t0) / 20; torch.cuda.synchronize()
    print(f"== {name}: decode step synced median {statistics.median(ts)*1e3:.3f} ms, back-to-back {th*1e3:.3f} ms", flush=True)
    torch.cuda.set_sync_debug_mode(1)
    fn(tok, 18); torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
      for _ in range(5): fn(tok, 18)
      torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=70), flush=True)
