#!/usr/bin/env bash
# Usage: launch/probe.sh [N] [--json]
# N > 1: mpirun -n N of the probe (the group's table, IPC-confirmed P2P, the mode a Communicator
# would pick; rank 0 prints). Otherwise one process (local GPUs, driver P2P, NVLink, versions).
set -euo pipefail
n=1
if [[ ${1:-} =~ ^[0-9]+$ ]]; then n=$((10#$1)); shift; fi  # 10#: "08" is eight, not a bad octal
if [[ -n $n ]] && (( n < 1 )); then
  echo "launch/probe.sh: N, the number of ranks, must be at least 1, got $n" >&2; exit 2
fi
cd "$(dirname "$0")/.."
if (( n <= 1 )); then
  exec python -m commfuse.cli.probe "$@"
fi
flags=(--oversubscribe --bind-to none)  # more ranks than cores or slots is fine for a probe (Open MPI 4 and 5)
if (( EUID == 0 )); then
  flags+=(--allow-run-as-root)
  # Open MPI 5 wants the confirmation too (Open MPI 4 reads the flag); harmless elsewhere.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
exec mpirun "${flags[@]}" -n "$n" python -m commfuse.cli.probe "$@"
