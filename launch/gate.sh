#!/usr/bin/env bash
# The decoder gate (examples/tp_decoder.py, by default 8b, 4 layers, FP8; compiled): default mode and reduce-overhead,
# the pass's own choice and every rewrite, on N ranks (1: the local ops at world 1; more: ranks sharing the
# GPUs, the collective route, correctness). Writes each run's JSON and text, a plot and a table of totals.
# Usage: launch/gate.sh [N] [DIR]   (DIR default ./logs/gate; COMMFUSE_GATE_REPEATS rounds, default 40;
# COMMFUSE_GATE_MODEL the model's arguments, default "--size 8b --layers 4 --quant fp8": "--size tiny" on a CPU)
# The verdict per step is the compiled pair's ratio, fused / unfused, the median of the rounds' ratios with its
# 95% interval: "slower" where the whole interval lies above 1. Host-bound steps (the default mode) drift by
# several percent within a run, which is why the rounds are many (a round of the 8b model takes ~60 ms).
# Ranks sharing a GPU: run it under MPS (`launch/device.sh N mps gate`); time-sliced, each P2P kernel waits for
# its peers' across time slices (milliseconds a call).
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-1}; dir=${2:-logs/gate}
if ! [[ $n =~ ^[0-9]+$ ]] || (( 10#$n < 1 )); then
  echo "launch/gate.sh: N, the number of ranks, must be at least 1, got $n" >&2; exit 2
fi
n=$((10#$n))  # "08" is eight, not a bad octal
mkdir -p "$dir"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
launcher=(); (( n > 1 )) && launcher=(mpirun -n "$n" --oversubscribe --bind-to none)
status=0
# Ranks sharing a GPU exchange over gloo, which a CUDA graph cannot capture: default mode only there.
modes="default reduce-overhead"
if (( n > 1 )) && [[ $(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') -lt $n ]]; then modes=default; fi
for mode in $modes; do
  for rewrite in auto all; do
    tag=w$n-$mode-$rewrite
    read -ra args <<< "${COMMFUSE_GATE_MODEL:---size 8b --layers 4 --quant fp8}"
    args+=(--compile --rewrite "$rewrite" --repeats "${COMMFUSE_GATE_REPEATS:-40}")
    [[ $mode != default ]] && args+=(--mode "$mode")
    rm -f "$dir/$tag.json"  # a failed run must not leave an older result to the plot and table
    "${launcher[@]}" python3 examples/tp_decoder.py "${args[@]}" --json "$dir/$tag.json" > "$dir/$tag.txt" 2>&1 \
      || { echo "gate $tag: failed (rc $?), see $dir/$tag.txt"; status=1; }
  done
done
python3 launch/decoder_plot.py "$dir/gate-w$n.png" "$dir"/w$n-*.json || status=1
python3 - "$dir" "$n" <<'PY' || status=1
import glob, json, sys
print(f"{'run':30s} {'column':17s} total ms  (per step)")
for path in sorted(glob.glob(f"{sys.argv[1]}/w{sys.argv[2]}-*.json")):
    r = json.load(open(path))
    run = path.split('/')[-1][:-5]
    for name in ("compiled/unfused", "compiled/fused"):
        steps = r["latency_ms"].get(name, [])
        print(f"{run:30s} {name:17s} {sum(steps):8.3f}  ({' '.join(f'{s:.3f}' for s in steps)})"
              f"{'' if name.endswith('unfused') or r['ok'] else '  CHECK FAILED'}")
    ratios = r.get("ratios", {}).get("compiled/fused", [])
    slower = [s for s, q in zip(r["steps"], ratios) if q["low"] > 1]
    few = min((q["coverage"] for q in ratios), default=1.0) < 0.95  # under 6 rounds: the rounds' range
    print(f"{run:30s} {'fused / unfused':17s} " + " ".join(f"{q['median']:.3f} [{q['low']:.3f}, {q['high']:.3f}]"
                                                        for q in ratios)
          + ("  too few rounds for a verdict (COMMFUSE_GATE_REPEATS >= 6)" if few else
             f"  SLOWER: {', '.join(slower)}" if slower else "  no step slower"))
PY
exit $status
