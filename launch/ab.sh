#!/usr/bin/env bash
# Usage: launch/ab.sh BASE_TREE N OUT [commfuse-bench args...]
# An A/B in one run: the benchmark of another checkout of commfuse (BASE_TREE: e.g. `git archive
# <commit> | tar -x -C base`) and then of this one, on N ranks each (launch/bench.sh), on the same
# machine back to back with the same arguments; results in OUT/base and OUT/new. Kernels both trees
# share come from one COMMFUSE_CACHE_DIR. Differences smaller than the rows' min-max spread are noise.
set -uo pipefail
base=$(cd "$1" && pwd); n=$2; shift 2
mkdir -p "$1/base" "$1/new" && out=$(cd "$1" && pwd) || exit 1; shift
here=$(cd "$(dirname "$0")/.." && pwd)
rc=0
# Each tree's benchmark runs from that tree's root: `python -m` puts the working directory first on
# sys.path, so run from here, the base run would import this tree's commfuse (and its kernels).
(cd "$base" && COMMFUSE_MACHINE=${COMMFUSE_MACHINE:-$(hostname)} bash launch/bench.sh "$n" --out "$out/base" "$@") || rc=$?
(cd "$here" && COMMFUSE_MACHINE=${COMMFUSE_MACHINE:-$(hostname)} bash launch/bench.sh "$n" --out "$out/new" "$@") || rc=$?
exit $rc
