#!/usr/bin/env bash
# The benchmark runs whose results are committed under bench/results/ (2 x H200): six shapes from
# decode (1 token) to prefill (8192 tokens) over hidden 4096, 7168 and 8192 with every implementation,
# then the torch.compile rows in a run of their own (each compile costs tens of seconds; its FP8/NVFP4
# tails fail the gate and are timed marked *, see README), then the MoE tails against FlashInfer's MoE
# fusions (its patterns 6 and 7).
# Usage: launch/device_bench.sh OUTDIR [N]
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; n=${2:-2}; mkdir -p "$out"
rc=0  # any run's failure is the script's (the tails below are for reading)
shapes=1x4096,16x7168,64x8192,256x7168,1024x8192,8192x7168
machine=${COMMFUSE_MACHINE:-nvidia-h200-x2}
launch/bench.sh "$n" --machine "$machine" --shapes "$shapes" --dtypes bf16 --repeats 5 \
  --patterns allreduce,residual_rmsnorm,residual_rmsnorm_fp8,residual_rmsnorm_nvfp4 \
  --impls nccl+eager,commfuse-fallback,commfuse-p2p,commfuse-p2p-twoshot,commfuse-auto,flashinfer,tail-eager,tail-commfuse \
  --out "$out/main" > "$out/main.log" 2>&1 || rc=$?
launch/bench.sh "$n" --machine "$machine" --shapes "$shapes" --dtypes bf16 \
  --patterns residual_rmsnorm,residual_rmsnorm_fp8,residual_rmsnorm_nvfp4 \
  --impls nccl+compile,tail-compile --out "$out/compile" > "$out/compile.log" 2>&1 || rc=$?
launch/bench.sh "$n" --machine "$machine" --shapes 64x8192 --dtypes fp16 \
  --patterns residual_rmsnorm,residual_rmsnorm_nvfp4 --impls tail-eager,tail-compile,tail-commfuse \
  --out "$out/fp16" > "$out/fp16.log" 2>&1 || rc=$?
launch/bench.sh "$n" --machine "$machine" --shapes 1x4096,16x4096,1x7168,16x7168,64x7168,256x7168,1024x7168 \
  --dtypes bf16 --patterns moe_k2_residual_rmsnorm,moe_k8_residual_rmsnorm,moe_finalize_k8_residual_rmsnorm \
  --impls nccl+eager,commfuse-auto,flashinfer --out "$out/moe" > "$out/moe.log" 2>&1 || rc=$?
tail -n 60 "$out/main.log"; tail -n 25 "$out/compile.log"; tail -n 25 "$out/fp16.log"; tail -n 40 "$out/moe.log"
exit $rc
