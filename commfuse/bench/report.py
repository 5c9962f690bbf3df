"""What rank 0 writes: the table (stdout), the JSON and one PNG per mode."""
from __future__ import annotations

import json
import platform
from typing import Dict, List, Optional

import torch

import commfuse

from .cases import PATTERNS, shapes_of
from .context import Ctx
from .impls import IMPLS, is_commfuse
from .verdict import Kind

SHARED_GPU = "ranks share GPUs: correctness mode, not speed numbers"
YARDSTICK = "torch-add"  # the host-mode table gives commfuse rows' host time over this row's


def versions(ctx: Ctx) -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "commfuse": commfuse.__version__,
         "cuda": torch.version.cuda}
    if ctx.cuda:
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            v["nccl"] = None
    try:
        import flashinfer
        v["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception:
        v["flashinfer"] = None
    return v


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _cell(rec: Optional[dict], state: Optional[Kind], with_frac: bool) -> str:
    if rec is None:
        return {Kind.REJECTED: "REJ", Kind.FAILED: "FAIL", Kind.SKIP: "-"}.get(state, "")
    us = rec["us"]
    s = f"{us:.1f}" if us < 1000 else f"{us:.0f}"
    frac = rec.get("frac_hbm") if rec.get("frac_hbm") is not None else rec.get("frac_link")
    if with_frac and frac is not None:
        s += f" ({100 * frac:.0f}%)"
    return s + ("*" if rec.get("wrong") else "")


def _ratio(rec: Optional[dict], floor: Optional[dict]) -> str:
    return f"{rec['us'] / floor['us']:.2f}" if rec and floor and floor["us"] > 0 else ""


def format_table(doc: dict, status: dict, args) -> str:
    """Implementations side by side, one block per mode x pattern x dtype, shapes as rows; the floor
    (torch-add) is the first column of every block. status[(impl, pattern, dtype, tokens, hidden,
    mode)]: the Kind of a row that has no record there."""
    calls = args.calls_per_graph
    out = [f"commfuse-bench: {doc['machine']}, {doc['gpu']}, {doc['world_size']} ranks ({doc['backend']}), "
           f"{doc['date']}"]
    if doc.get("note"):
        out.append(f"NOTE: {doc['note']}")
    out.append("versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()))
    c = doc["ceilings"]
    fmt = lambda v: "n/a" if v is None else f"{v:.0f} GB/s"
    out.append(f"ceilings: HBM copy {fmt(c['hbm_copy_GBps'])} (read+write), P2P copy {fmt(c['p2p_GBps'])} "
               f"(one direction), NCCL all-reduce bus bw {fmt(c.get('nccl_busbw_GBps'))}")
    out.append(f"us per call; graph = CUDA graph of {calls} calls, eager = {calls} back-to-back calls, host = the "
               f"host's wall time of {calls} back-to-back calls (no GPU wait); median of {args.repeats} repeats, slowest rank. "
               f"x add = the row's host time / {YARDSTICK}'s (same shape). REJ = wrong result (no time), * = a "
               "torch.compile baseline's wrong result, timed for reference, FAIL = did not run, "
               "- = not applicable (see the list below)")
    by_key = {(r["impl"], r["pattern"], r["dtype"], r["tokens"], r["hidden"], r["mode"]): r for r in doc["records"]}
    floor = [n for n in args.impl_list if IMPLS[n].section == "floor"]
    sections = [s for s in ("collective", "tail") if any(IMPLS[n].section == s for n in args.impl_list)]
    for section in sections or ["floor"]:
        names = floor + ([] if section == "floor" else [n for n in args.impl_list if IMPLS[n].section == section])
        for mode in args.mode_list:
            ratios = mode == "host" and YARDSTICK in args.impl_list
            for pname in args.pattern_list:
                if section == "tail" and not PATTERNS[pname].tail:
                    continue
                shapes = sorted(shapes_of(args, PATTERNS[pname]), key=lambda s: (s[1], s[0]))
                for dname in args.dtype_list:
                    link = section == "collective" and any(r.get("frac_link") is not None and r["mode"] == mode and
                                                           r["pattern"] == pname for r in doc["records"])
                    # Host times are the host's: no share of a ceiling in host tables.
                    title = (", tail only (no collective)" + (", % of HBM copy ceiling" if mode != "host" else "")
                             if section == "tail" else ", % of the P2P copy ceiling in bus bandwidth" if link else "")
                    shared = f" -- {SHARED_GPU}" if doc.get("shared_gpu") and mode != "host" else ""
                    out.append(f"\n== {mode}: {pname} {dname}{title}{shared}")
                    columns = [["tokens x hidden"] + [f"{t} x {h}" for t, h in shapes]]
                    for n in names:
                        recs = [by_key.get((n, pname, dname, t, h, mode)) for t, h in shapes]
                        columns.append([n] + [_cell(rec, status.get((n, pname, dname, t, h, mode)), section != "floor")
                                              for rec, (t, h) in zip(recs, shapes)])
                        if ratios and is_commfuse(n):
                            cells = [_ratio(rec, by_key.get((YARDSTICK, pname, dname, t, h, mode)))
                                     for rec, (t, h) in zip(recs, shapes)]
                            if any(cells):
                                columns.append(["x add"] + cells)
                    widths = [max(map(len, c)) for c in columns]
                    out.extend("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
                               for r in zip(*columns))
    routes: Dict[tuple, List[str]] = {}
    for p in doc["plans"]:
        combine = f"{p['combine']} combine + " if p.get("combine") else ""  # the MoE rows
        key = (p["impl"], p["pattern"], p["dtype"], f"{combine}{p['collective']} + {p['tail']} tail")
        routes.setdefault(key, []).append(f"{p['tokens']}x{p['hidden']}")
    if routes:
        out.append("\ncommfuse routes (Plan):")
        out.extend(f"  {i} / {pat} {d}: {route} ({', '.join(shapes)})" for (i, pat, d, route), shapes in routes.items())
    reasons: Dict[tuple, List[str]] = {}
    for s in doc["skipped"]:
        reasons.setdefault((s["impl"], s["reason"]), []).append(s["pattern"])
    if reasons:
        out.append("\nnot run (REJ, FAIL, -):")
        out.extend(f"  {i} ({', '.join(pats)}): {why}" for (i, why), pats in reasons.items())
    return "\n".join(out)


def plot(doc: dict, path: str, mode: str, dname: str) -> None:
    """Latency against tokens, log-log: one panel per (hidden, pattern), one line per implementation
    (tail-only rows dashed, the floor dotted). A point timed though its gate rejected it ("wrong", the table's *)
    is a cross, and its implementation's label says so."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in doc["records"] if r["mode"] == mode and r["dtype"] == dname]
    patterns = [p for p in PATTERNS if any(r["pattern"] == p for r in recs)]
    hiddens = sorted({r["hidden"] for r in recs})
    if not recs:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, f"no {mode} {dname} records", ha="center", va="center")
        ax.set_axis_off()
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return
    impls = [n for n in IMPLS if any(r["impl"] == n for r in recs)]
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(impls)}
    wrong_impls = {n: any(r.get("wrong") for r in recs if r["impl"] == n) for n in impls}
    styles = {"tail": "--", "floor": ":"}
    fig, axes = plt.subplots(len(hiddens), len(patterns), squeeze=False,
                             figsize=(3.6 * len(patterns), 3.0 * len(hiddens) + 0.8))
    for i, h in enumerate(hiddens):
        for j, pname in enumerate(patterns):
            ax = axes[i][j]
            for n in impls:
                pts = sorted((r["tokens"], r["us"], bool(r.get("wrong"))) for r in recs
                             if r["impl"] == n and r["pattern"] == pname and r["hidden"] == h)
                if pts:
                    label = n + (" (x: wrong)" if wrong_impls.get(n) else "")
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=colors[n],
                            ls=styles.get(IMPLS[n].section, "-"), label=label)
                    bad = [p for p in pts if p[2]]
                    if bad:
                        ax.plot([p[0] for p in bad], [p[1] for p in bad], ls="none", marker="x", ms=8,
                                color=colors[n])
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{pname}\nhidden {h}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(hiddens) - 1:
                ax.set_xlabel("tokens", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"us per call ({mode})", fontsize=8)
    handles = {n: h for ax in axes.flat for h, n in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 6), fontsize=8)
    notes = [doc["note"]] if doc.get("note") else []
    if doc.get("shared_gpu") and mode != "host":
        notes.append(SHARED_GPU)
    fig.suptitle(f"commfuse-bench {doc['machine']}, {doc['gpu']}, {doc['world_size']} ranks, {dname}, "
                 f"{mode}" + "".join(f" - {n}" for n in notes), fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
