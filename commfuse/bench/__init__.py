"""commfuse-bench: the all-reduce tail, commfuse against what a user would otherwise run, side by side.

Run it under mpirun (launch/bench.sh N) or torchrun, one process per GPU:

    launch/bench.sh 2 --quick --out bench/results
    python -m commfuse.bench --help            # the same program (console script: commfuse-bench)

Modules, in the order of the data path (nccl-tests style: one small timing core, implementations
in a table):

1. cli.main parses the options, joins torch.distributed (NCCL with GPUs, gloo on the CPU or where
   ranks share GPUs) and measures the ceilings (timing.measure_ceilings: HBM copy, P2P copy, NCCL
   bus bandwidth) in the same run.
2. For every case (dtype x hidden x pattern x tokens) cases.make_case draws every rank's inputs from
   one seeded generator on each rank, so each rank knows what the gather of all inputs is, and
   computes `commfuse.reference` on it: the oracle.
3. Every implementation in impls.IMPLS is *prepared* for the case (a Step: one call on input set i,
   or Skip with the reason), then *gated* (cases.gate): one call on the checked inputs is compared
   with the oracle, with the tests' tolerances (commfuse.tolerance, docs/semantics.md). A wrong
   implementation gets no time, only a row "rejected: <why>" ("failed: <why>" when it raised); the
   exception is the torch.compile baselines (Impl.timed_if_wrong), timed anyway and marked as
   wrong, because the issues' targets name them.
4. The survivors are timed (timing.time_step) in each mode of --modes (below).
5. Rank 0 prints the table and writes JSON and PNG (report).

Verdicts (verdict.py) are typed: Kind OK, SKIP (does not apply: "-" in the table), REJECTED (a wrong
result: "REJ"), FAILED (raised: "FAIL"), each with its reason. Ranks agree on every verdict before
going on (verdict.agree: each rank's verdict gathered and combined into one, the worst kind winning),
so no rank is left waiting in a collective alone.

Rows (--impls), by section:
- collective: nccl+eager, nccl+compile (dist.all_reduce, then the tail in torch, eager or through
  torch.compile), commfuse-fallback / -p2p / -p2p-twoshot / -auto (Communicator with strategy nccl,
  oneshot, twoshot, auto), flashinfer (flashinfer.comm.trtllm_allreduce_fusion).
- tail: tail-eager, tail-compile, tail-commfuse: the tail alone, no collective, with the fraction of
  the HBM copy ceiling it reaches (graph and eager modes).
- MoE patterns (cases.MOE_PATTERNS, `--patterns moe`): the same rows with the expert combine first
  (Communicator.moe_all_reduce for commfuse's, impls.torch_combine + dist.all_reduce for the torch
  sequence, the combine kernel + fused_tail.run for tail-commfuse); flashinfer's MoE fusions
  (trtllm_moe_allreduce_fusion for the reduction form, trtllm_moe_finalize_allreduce_fusion for the
  finalize form), gated against the oracle fed their combine (in T, impls.fi_moe_combine).
- Post-norm patterns (residual_gemma_post_rmsnorm[_fp8], on request): Gemma 2 / 3's layer end, the sum
  normalised with its own weight before the residual add (post_weight, docs/semantics.md section 2a). The
  torch tails compute that norm first (eager and compiled), commfuse's rows pass post_weight, tail-commfuse
  launches the fused tail's POST variant; flashinfer skips (its fusion has no post-norm). Gated as the
  tests hold the post-norm kernel (cases.check_post): the residual within ulp(a') + ulp(r), the norm and
  codes those of the row's own residual.
- floor: torch-add, `torch.add(x, residual, out=buf)`: one torch elementwise op on the case's
  inputs, the yardstick of host cost per call (the target: fused_all_reduce at most 2x its host time,
  measured in the same run). Gated against its own definition (x + residual rounded once, exactly),
  not the oracle; timed in every mode like the others; the first column of every table block.

Timing modes (--modes; default graph,eager; the CPU drops graph). In every mode ranks are aligned
before each repeat, each repeat's time is the slowest rank's, and a record holds the median of R
repeats (--repeats) with min and max, per call of K calls (--calls-per-graph):
- graph: K calls captured in one CUDA graph, replayed R times; GPU time per call from CUDA events
  around the replay. What the kernels cost with no host in the way.
- eager: K back-to-back calls from Python, CUDA events around the loop (the host clock on the CPU):
  the GPU's time, paced by the host's launches where those are slower than the kernels.
- host: K back-to-back calls from Python, time.perf_counter around the loop alone, with no GPU wait
  inside it (the GPU is synchronised before the clock starts and after it stops; the stop time is
  read before that synchronize). What an eager caller pays on the host per call; it works on the
  CPU too. The host-mode table gives every commfuse row's ratio to torch-add of the same shape
  (column "x add").

Ranks sharing GPUs (more ranks than GPUs on a node): commfuse.init_distributed picks gloo and sets
every rank's CUDA device, so the inputs are CUDA tensors and collectives run over gloo. The nccl+*
rows then run dist.all_reduce over gloo in eager and host modes and skip graph mode (gloo
collectives cannot be captured in a CUDA graph); so do commfuse rows whose plan runs over gloo;
flashinfer's dense rows skip (its all-reduce fusion hung there at 200 x 7168; its MoE fusions run, on a
workspace from its own allocator); commfuse rows skip if this commfuse's Communicator does not take
the inputs' device. The JSON says "shared_gpu": true and the table's graph and eager blocks say
"ranks share GPUs: correctness mode, not speed numbers".

On a machine without GPUs the same code runs over gloo with host timers (eager and host modes): a
smoke test of the harness, flagged everywhere as "CPU/gloo: not GPU numbers".

JSON (bench-<machine>.json): {"machine", "gpu", "world_size", "backend", "shared_gpu", "date",
"versions", "ceilings": {"hbm_copy_GBps", "p2p_GBps", "nccl_busbw_GBps"}, "methods" (how each
number was measured), "records": [{"impl", "pattern", "dtype", "tokens", "hidden", "mode" (graph |
eager | host), "us", "us_min", "us_max", "frac_hbm" (tail rows), "frac_link" (collective rows on 2+
GPUs), both graph and eager records only, and "wrong" for a baseline timed despite the gate}],
"skipped": [{"impl", "pattern", "reason"}] (a reason starting "rejected (" or "failed (" for REJ and FAIL
rows, else why the row does not apply), "plans" (the route of each commfuse row), "config", and "note" on
the CPU}. One PNG per mode: bench-<machine>-<mode>.png.
"""
