#!/usr/bin/env bash
# Usage: launch/test.sh [N] [pytest args...]
# Runs the test suite on N ranks (default 4): mpirun -n N python -m pytest --with-mpi tests.
# Each rank logs to $COMMFUSE_TEST_LOGS/rank<i>.log (a temporary folder by default); rank 0's lines are
# printed while it runs, the other ranks' summaries after it. Fails if any rank fails or no test passed.
set -uo pipefail
n=4
if [[ ${1:-} =~ ^[0-9]+$ ]]; then n=$((10#$1)); shift; fi  # 10#: "08" is eight, not a bad octal
if [[ -n $n ]] && (( n < 1 )); then
  echo "launch/test.sh: N, the number of ranks, must be at least 1, got $n" >&2; exit 2
fi
cd "$(dirname "$0")/.."
logs=${COMMFUSE_TEST_LOGS:-$(mktemp -d -t commfuse-tests.XXXX)}
mkdir -p "$logs" && rm -f "$logs"/rank*.log "$logs"/rank*.rc

# Open MPI refuses root unless told; the same variables serve Open MPI 4 and 5.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export COMMFUSE_TEST_LOGS=$logs PYTHONUNBUFFERED=1

# Each rank runs pytest under bash so that its exit status is recorded rather than making mpirun
# tear the job down: a failing rank must not hide the other ranks' reports. Rank 0's lines are shown
# as they come (its log keeps them too); the other ranks' summaries follow at the end. --bind-to none: Open MPI
# binds each rank of a small job to one core, and the tests' compiles (NVRTC over every variant, Inductor) spread
# over the cores a rank may use.
timeout --kill-after=30 "${COMMFUSE_TEST_TIMEOUT:-1800}" \
  mpirun -n "$n" --oversubscribe --bind-to none bash -c '
    r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
    log=$COMMFUSE_TEST_LOGS/rank$r.log
    if [[ $r == 0 ]]; then
      python -m pytest --with-mpi -p no:cacheprovider -rfEs "$@" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
    else
      python -m pytest --with-mpi -p no:cacheprovider -rfEs "$@" > "$log" 2>&1; rc=$?
    fi
    echo $rc > "$COMMFUSE_TEST_LOGS/rank$r.rc"' bash "${@:-tests}"
mpirun_rc=$?

status=0
for ((r = 0; r < n; r++)); do
  rc=$(cat "$logs/rank$r.rc" 2>/dev/null || echo missing)
  summary=$(grep -aE '^=+ .*(passed|failed|error|skipped|deselected|no tests ran).* =+$' "$logs/rank$r.log" 2>/dev/null | tail -n 1)
  # Ranks other than 0 run only the MPI tests; "no tests collected" (5) is fine there.
  if [[ $rc == 0 || ($rc == 5 && $r != 0) ]]; then
    [[ $r != 0 ]] && echo "rank $r: ok ${summary}"
  else
    status=1
    echo "rank $r: FAILED (pytest exit $rc) ${summary}"
    grep -aE '^(FAILED|ERROR) ' "$logs/rank$r.log" 2>/dev/null | sed "s/^/rank $r: /"
  fi
done
if ! grep -aqE '[0-9]+ passed' "$logs/rank0.log" 2>/dev/null; then
  echo "no test passed on rank 0"; status=1
fi
if (( mpirun_rc != 0 && status == 0 )); then
  echo "mpirun exited with $mpirun_rc (timeout or a rank crashed)"; status=1
fi
echo "logs: $logs"
exit $status
