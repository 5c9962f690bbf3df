#!/usr/bin/env bash
# Session 50 GPU call: issue 24's RMSNorm h 7168 rows (every config; paired now vs the wide rule), then the
# tests changed since 795f628 at world 1 and on 2 ranks sharing the GPU (MPS).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
export COMMFUSE_CACHE_DIR=/tmp/cfcache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
log=$out/run.txt
say() { echo "== $* ($(date +%T), ${SECONDS}s)" | tee -a "$log"; }
say "tree $(git rev-parse --short HEAD 2>/dev/null)"; nvidia-smi -L | tee -a "$log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee -a "$log"
say prewarm; timeout 150 python3 launch/prewarm.py 2>&1 | tail -3 | tee -a "$log"
say sweep; timeout 120 python3 launch/tail_sweep.py --no-residual --shapes 1024x7168,4096x7168,8192x7168,8192x8192 \
  2>&1 | tee "$out/sweep.txt" | tail -30 | tee -a "$log"
B="examples/bench_local_ops.py --shapes 1024x7168,8192x7168 --patterns rmsnorm --paired 41"
say paired-now; timeout 110 python3 $B --json "$out/now.json" 2>&1 | tee "$out/now.txt" | tail -6 | tee -a "$log"
say paired-wide
timeout 110 python3 -c "
import runpy, sys
import commfuse.kernels.fused_tail as f
f.PLAIN_WIDE_TOKENS = 1 << 31
sys.argv = ['bench_local_ops.py'] + sys.argv[1:]
runpy.run_path('examples/bench_local_ops.py', run_name='__main__')
" ${B#examples/bench_local_ops.py } --json "$out/wide.json" 2>&1 | tee "$out/wide.txt" | tail -6 | tee -a "$log"
say w1-tests
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_bench_local_ops.py tests/test_local.py \
  tests/test_ops.py tests/test_topology.py > "$out/w1.txt" 2>&1; tail -8 "$out/w1.txt" | tee -a "$log"
say probe; timeout 60 python3 -m commfuse.cli.probe 2>&1 | tail -15 | tee -a "$log"
say ws2-changed
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d
COMMFUSE_TEST_TIMEOUT=200 COMMFUSE_TEST_LOGS=/tmp/ws2 bash launch/test.sh 2 -m mpi tests/test_moe.py \
  tests/test_routes.py tests/test_fusion.py tests/test_topology.py tests/test_bench.py > /tmp/ws2.out 2>&1
echo quit | nvidia-cuda-mps-control
tail -12 /tmp/ws2.out | tee -a "$log"; tar -czf "$out/ws2.tgz" -C /tmp ws2 ws2.out 2>/dev/null
say done
