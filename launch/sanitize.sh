#!/usr/bin/env bash
# Usage: launch/sanitize.sh [N] [tool ...]
# Runs tests/kernels/exercise.py (every kernel variant; the P2P ones when N >= 2) under
# compute-sanitizer on N ranks (default 1), once per tool (default: memcheck racecheck synccheck,
# and initcheck on one rank). Host API errors are not reported (torch probes the driver with failing calls); a
# tool that finds an error or a hazard in a kernel, or a run that does not finish, fails the command.
# Logs: $COMMFUSE_SANITIZE_LOGS (a temporary folder by default), one file per tool and rank.
set -uo pipefail
n=1
if [[ ${1:-} =~ ^[0-9]+$ ]]; then n=$((10#$1)); shift; fi  # 10#: "08" is eight, not a bad octal
if [[ -n $n ]] && (( n < 1 )); then
  echo "launch/sanitize.sh: N, the number of ranks, must be at least 1, got $n" >&2; exit 2
fi
# initcheck only on one rank: with several, the buffers that peers (ours and NCCL's) write over
# P2P are uninitialized in the reading process's view, and it reports those reads (seen on 2 x H200).
default_tools="memcheck racecheck synccheck"; (( n == 1 )) && default_tools+=" initcheck"
tools=${*:-$default_tools}
cd "$(dirname "$0")/.."
if ! command -v compute-sanitizer >/dev/null ||
   ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "launch/sanitize.sh: needs a CUDA GPU, torch with CUDA and compute-sanitizer on PATH (it checks the kernels" \
       "as they run)" >&2
  exit 2
fi
logs=${COMMFUSE_SANITIZE_LOGS:-$(mktemp -d -t commfuse-sanitize.XXXX)}
mkdir -p "$logs"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Instrumented kernels run many times slower; a peer must not time out waiting for a slow rank.
export COMMFUSE_P2P_TIMEOUT_S=${COMMFUSE_P2P_TIMEOUT_S:-300} COMMFUSE_NCCL_TIMEOUT_S=${COMMFUSE_NCCL_TIMEOUT_S:-300} COMMFUSE_P2P_CALIBRATE=0
# Fill the kernel cache first (P2P kernels too), so that no rank compiles under the sanitizer.
mpirun -n "$n" --oversubscribe --bind-to none python3 tests/kernels/exercise.py > "$logs/compile.log" 2>&1 \
  || { cat "$logs/compile.log"; exit 1; }
status=0
for tool in $tools; do
  rm -f "$logs/$tool".rank*.rc "$logs/$tool".rank*.log  # a reused log folder must not pass on old results
  timeout --kill-after=30 "${COMMFUSE_SANITIZE_TIMEOUT:-900}" mpirun -n "$n" --oversubscribe --bind-to none bash -c '
    r=${OMPI_COMM_WORLD_RANK:-0}
    # Only commfuse'"'"'s kernels are instrumented: the reference checks launch many more torch kernels
    # than there are commfuse launches, and instrumenting those too kept memcheck on one rank from
    # finishing in 170 s. initcheck must see every kernel: what an uninstrumented one writes (the
    # inputs) would read as uninitialized memory.
    filter=(--kernel-name kns=commfuse); [[ $0 == initcheck ]] && filter=()
    compute-sanitizer --tool "$0" "${filter[@]}" --error-exitcode 86 --report-api-errors no --print-limit 20 \
      python3 tests/kernels/exercise.py > "$1/$0.rank$r.log" 2>&1
    echo $? > "$1/$0.rank$r.rc"' "$tool" "$logs"
  for ((r = 0; r < n; r++)); do
    f=$logs/$tool.rank$r.log
    rc=$(cat "$logs/$tool.rank$r.rc" 2>/dev/null || echo missing)
    summary=$(grep -aE 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tail -n 1)
    # Passed: the script finished (its outputs matched the reference), the sanitizer exited 0
    # (86 when it found an error), and no summary line counts an error or a hazard.
    if [[ $rc == 0 ]] && grep -aq 'exercised [0-9]* launches' "$f" \
        && ! grep -aqE 'ERROR SUMMARY: [1-9]|SUMMARY: [1-9][0-9]* hazard' "$f"; then
      echo "$tool rank $r: ok, $(grep -ao 'exercised [0-9]* launches' "$f"), ${summary#========= }"
    else
      status=1
      echo "$tool rank $r: FAILED (exit $rc) ${summary#========= }"
      grep -a -m 20 -E '^=========  ?[A-Z]|Error|error' "$f" | head -n 20
    fi
  done
done
echo "logs: $logs"
exit $status
