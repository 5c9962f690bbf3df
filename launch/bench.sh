#!/usr/bin/env bash
# Usage: launch/bench.sh [N] [commfuse-bench args...]
# Runs commfuse-bench on N ranks with mpirun, one process per GPU. N defaults to the number of local
# GPUs (nvidia-smi -L, else torch; CUDA_VISIBLE_DEVICES is honoured). Without a GPU it runs 2 ranks
# over gloo on the CPU: a smoke test of the harness, and it says that these are not GPU numbers.
# N > GPUs runs ranks that share GPUs over gloo: the rows are checked, their times are not speed numbers.
# Examples: launch/bench.sh 2 --quick --out /tmp/bench
#           launch/bench.sh 2 --shapes 1x4096,64x8192 --patterns residual_rmsnorm_fp8 --out bench/results
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}

n=""
if [[ ${1:-} =~ ^[0-9]+$ ]]; then n=$((10#$1)); shift; fi  # 10#: "08" is eight, not a bad octal
if [[ -n $n ]] && (( n < 1 )); then
  echo "launch/bench.sh: N, the number of ranks, must be at least 1, got $n" >&2; exit 2
fi

# GPUs this job can use.
if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
  # CUDA's rule: the list ends at its first invalid entry (-1, the usual way to hide every GPU, is one).
  gpus=0
  IFS=',' read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  for d in "${visible[@]}"; do
    d=${d// /}
    [[ $d =~ ^[0-9]+$ || $d =~ ^(GPU|MIG)- ]] || break
    gpus=$((gpus + 1))
  done
elif command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
else
  gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
fi
gpus=${gpus:-0}
if [[ -z $n ]]; then n=$(( gpus > 0 ? gpus : 2 )); fi
if (( gpus == 0 )); then
  echo "launch/bench.sh: no GPU: $n ranks over gloo on the CPU. These are NOT GPU numbers." >&2
elif (( n > gpus )); then
  echo "launch/bench.sh: $n ranks on $gpus GPUs: ranks share GPUs (gloo). Correctness mode, NOT speed numbers" \
       "(host mode excepted)." >&2
fi

# Open MPI refuses root unless told (same variables for Open MPI 4 and 5), as in launch/test.sh.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# No NVLink multicast / NVLS anywhere (NCCL, torch symmetric memory, NVSHMEM): not available on the
# lent machines, and the numbers must not depend on it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
# `python -m` would put the working directory first on sys.path (Python 3.11+ leaves it out with
# this): run from another checkout's root, this tree's benchmark would import that checkout's commfuse.
export PYTHONSAFEPATH=1

# --bind-to none: Open MPI binds each of <= 2 ranks to one core by default, which would put the
# rank's Python thread, NCCL's proxy thread and torch's threads on one core and slow the eager rows.
exec timeout --kill-after=30 "${COMMFUSE_BENCH_TIMEOUT:-3600}" \
  mpirun -n "$n" --oversubscribe --bind-to none "$py" -m commfuse.bench "$@"
