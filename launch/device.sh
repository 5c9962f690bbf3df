#!/usr/bin/env bash
# One full GPU session on a machine without package registries (the device machine): install the
# carried wheels, probe, run the suite on N GPUs (P2P/auto, then the forced fallback row), benchmark.
# Usage: launch/device.sh [N] [stage ...]   stages: probe test fallback sanitize bench (default: these), gate,
# and two switches: `mps` starts the MPS daemon for the stages after it, `nomps` stops it. Every stage runs; the
# exit status is the first failed stage's (0 when all pass), an unknown stage an error (2) before any runs.
# N may exceed the GPUs: the ranks then share them (commfuse.init_distributed picks gloo; a correctness
# mode), time-sliced by the GPU, or run at once under MPS. Logs go to $OUT (or ./logs) as one tarball
# plus a summary; several calls in one command (world sizes 2, 4, 8) share $OUT: set COMMFUSE_RUN_TAG.
# Bound a test stage with COMMFUSE_TEST_TIMEOUT (seconds; test.sh's timeout kills its mpirun): a timeout
# around device.sh itself cannot, since bash waits for the running stage before it handles the signal.
set -uo pipefail
cd "$(dirname "$0")/.."
n=2
if [[ ${1:-} =~ ^[0-9]+$ ]]; then n=$((10#$1)); shift; fi  # 10#: "08" is eight, not a bad octal
if [[ -n $n ]] && (( n < 1 )); then
  echo "launch/device.sh: N, the number of ranks, must be at least 1, got $n" >&2; exit 2
fi
stages=${*:-probe test fallback sanitize bench}
for s in $stages; do  # a misspelt stage would be skipped in silence, and the call would pass
  case $s in
    mps|nomps|probe|test|fallback|sanitize|bench|gate) ;;
    *) echo "launch/device.sh: unknown stage '$s' (stages: probe test fallback sanitize bench gate mps nomps)" >&2
       exit 2 ;;
  esac
done
out=${OUT:-$PWD/logs}; mkdir -p "$out"
logs=$(mktemp -d -t commfuse-device.XXXX)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 COMMFUSE_CACHE_DIR=${COMMFUSE_CACHE_DIR:-$logs/cache}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  # The benchmark's peer: FlashInfer's all-reduce fusion module, built off the machine (README), goes
  # where FlashInfer looks for ahead-of-time modules, so the machine does not spend minutes compiling it.
  if [[ -f .whl/flashinfer-aot/trtllm_comm.so && -d /tmp/site/flashinfer ]]; then
    mkdir -p /tmp/site/flashinfer/data/aot/trtllm_comm && cp .whl/flashinfer-aot/trtllm_comm.so /tmp/site/flashinfer/data/aot/trtllm_comm/
  fi
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
tag=${COMMFUSE_RUN_TAG:-ws$n}
summary=$out/summary-$tag.txt; : > "$summary"
mps_stop() {
  if [[ -n ${CUDA_MPS_PIPE_DIRECTORY:-} ]]; then
    echo quit | nvidia-cuda-mps-control; sleep 1
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
}
trap mps_stop EXIT
# Every rank would compile the same kernels at once on first use: compile them once, in parallel.
python3 launch/prewarm.py | tee -a "$summary"
status=0  # the first failed stage's rc, the command's exit status (each stage runs regardless)
run() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$logs/$name.log" 2>&1; local rc=$?
  (( status == 0 )) && status=$rc
  printf '%-10s rc=%-3s %4ss  %s\n' "$name" "$rc" $((SECONDS - t0)) \
    "$(grep -aE '[0-9]+ (passed|failed)' "$logs/$name.log" | tail -n 1)" | tee -a "$summary"
  tail -n 25 "$logs/$name.log" | sed "s/^/[$name] /"
}
nvidia-smi -L | tee -a "$summary"
for s in $stages; do
  case $s in
    mps)
      export CUDA_MPS_PIPE_DIRECTORY=$logs/mps-pipe CUDA_MPS_LOG_DIRECTORY=$logs/mps-log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d && echo "MPS daemon started" | tee -a "$summary" ;;
    nomps) mps_stop; echo "MPS daemon stopped" | tee -a "$summary" ;;
    probe) run probe launch/probe.sh "$n" ;;
    test) COMMFUSE_TEST_LOGS=$logs/test run test launch/test.sh "$n" ${COMMFUSE_TEST_FILES:-} ;;
    fallback) COMMFUSE_STRATEGY=nccl COMMFUSE_TEST_LOGS=$logs/fallback run fallback launch/test.sh "$n" tests/test_communicator.py ;;
    sanitize) COMMFUSE_SANITIZE_LOGS=$logs/sanitize run sanitize launch/sanitize.sh "$n" ;;
    bench) run bench launch/bench.sh "$n" --out "$logs/bench" ${COMMFUSE_BENCH_ARGS:-} ;;
    gate) run gate launch/gate.sh "$n" "$logs/gate"; cp "$logs"/gate/*.png "$out"/ 2>/dev/null ;;
  esac
done
cp "$logs"/cache/p2p-limits-*.json "$logs"/ 2>/dev/null  # the calibration's measured times
rm -rf "$logs/cache"
mps_stop
rm -rf "$logs/mps-pipe"
tar -czf "$out/logs-$tag.tgz" -C "$logs" . 2>/dev/null
cp "$logs"/bench/*.json "$logs"/bench/*.png "$out"/ 2>/dev/null
echo "== summary"; cat "$summary"
exit $status
