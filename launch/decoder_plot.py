"""Plot examples/tp_decoder.py's per-step latency tables: one panel per --json result, a bar per column
and step, the panel titled with the run's mode, rewrite, world and device.

Usage: python launch/decoder_plot.py OUT.png RESULT.json [RESULT.json ...]
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out, paths):
    runs = [json.load(open(p)) for p in paths]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
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
