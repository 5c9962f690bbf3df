"""Plot examples/tp_decoder.py's per-step latency tables: one panel per --json result, a bar per column
and step, the panel titled with the run's mode, rewrite, world and device; below it, where the result has
them, each fused column's time against its unfused one per step (the median of the rounds' ratios, its 95%
interval as the error bar).

Usage: python launch/decoder_plot.py OUT.png RESULT.json [RESULT.json ...]
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out, paths):
    runs = [json.load(open(p)) for p in paths]
    rows = 2 if any(run.get("ratios") for run in runs) else 1
    fig, axes = plt.subplots(rows, len(runs), figsize=(5.5 * len(runs), 4 * rows), squeeze=False)
    for ax, run in zip(axes[-1], runs):
        if rows == 1:
            break
        ratios = run.get("ratios", {})
        for i, name in enumerate(ratios):
            qs = ratios[name]
            xs = [s + (i - (len(ratios) - 1) / 2) * 0.2 for s in range(len(qs))]
            med = [q["median"] for q in qs]
            err = [[m - q["low"] for m, q in zip(med, qs)], [q["high"] - m for m, q in zip(med, qs)]]
            ax.errorbar(xs, med, yerr=err, fmt="o", capsize=3, label=f"{name} / unfused")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(run["steps"])), run["steps"], rotation=30)
        ax.set_ylabel("fused / unfused (median ratio, 95% interval)", fontsize=8)
        ax.legend(fontsize=7)
    for ax, run in zip(axes[0], runs):
        columns = list(run["latency_ms"])
        width = 0.8 / len(columns)
        for i, name in enumerate(columns):
            xs = [s + (i - (len(columns) - 1) / 2) * width for s in range(len(run["steps"]))]
            ax.bar(xs, run["latency_ms"][name], width, label=name)
        ax.set_xticks(range(len(run["steps"])), run["steps"], rotation=30)
        ax.set_ylabel("ms per step (median)")
        shared = ", ranks sharing the GPU" if run.get("shared_gpu") else ""
        ax.set_title(f"{run['size']} {run['config']['layers']} layers {run['quant']}: mode {run['mode'] or 'default'}, "
                     f"rewrite {run['rewrite']}\nworld {run['world']} on {run['device']}{shared}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
