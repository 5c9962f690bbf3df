#!/usr/bin/env bash
# Usage: launch/ab.sh BASE_TREE N OUT [commfuse-bench args...]
# An A/B in one run: the benchmark of another checkout of commfuse (BASE_TREE: e.g. `git archive
# <commit> | tar -x -C base`) and of this one, on N ranks each (launch/bench.sh), on the same machine
# back to back with the same arguments, in the order base, new, new, base: a machine whose speed drifts
# during the run (host times do, by tens of percent) moves both trees' rows alike, and the two runs of a
# tree show the drift. Results in OUT/base, OUT/new, OUT/new-2 and OUT/base-2. Kernels both trees share
# come from one COMMFUSE_CACHE_DIR. Differences smaller than the spread between a tree's two runs are noise.
set -uo pipefail
if (( $# < 3 )); then echo "usage: launch/ab.sh BASE_TREE N OUT [commfuse-bench args...]" >&2; exit 2; fi
# Without its tree the "base" runs would benchmark the working directory's under the base's name.
base=$(cd "$1" && pwd) || { echo "launch/ab.sh: BASE_TREE $1 is not a folder" >&2; exit 2; }
n=$2; shift 2
mkdir -p "$1" && out=$(cd "$1" && pwd) || exit 1; shift
here=$(cd "$(dirname "$0")/.." && pwd)
rc=0
# Each tree's benchmark runs from that tree's root: `python -m` puts the working directory first on
# sys.path, so run from here, the base run would import this tree's commfuse (and its kernels).
run() {  # run TREE RESULT_FOLDER
  mkdir -p "$out/$2"
  (cd "$1" && COMMFUSE_MACHINE=${COMMFUSE_MACHINE:-$(hostname)} bash launch/bench.sh "$n" --out "$out/$2" "${args[@]}") || rc=$?
}
args=("$@")
run "$base" base
run "$here" new
run "$here" new-2
run "$base" base-2
exit $rc
