#!/usr/bin/env bash
# Usage: launch/ab.sh BASE_TREE N OUT [commfuse-bench args...]
# An A/B in one run: the benchmark of another checkout of commfuse (BASE_TREE: e.g. `git archive
# <commit> | tar -x -C base`) and then of this one, on N ranks each (launch/bench.sh), on the same
# machine back to back with the same arguments; results in OUT/base and OUT/new. Kernels both trees
# share come from one COMMFUSE_CACHE_DIR. Differences smaller than the rows' min-max spread are noise.
set -uo pipefail
base=$(cd "$1" && pwd); n=$2; out=$3; shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out/base" "$out/new"
rc=0
COMMFUSE_MACHINE=${COMMFUSE_MACHINE:-$(hostname)} bash "$base/launch/bench.sh" "$n" --out "$out/base" "$@" || rc=$?
COMMFUSE_MACHINE=${COMMFUSE_MACHINE:-$(hostname)} bash "$here/launch/bench.sh" "$n" --out "$out/new" "$@" || rc=$?
exit $rc
