"""commfuse-probe: what commfuse would do on this machine, and why.

    commfuse-probe [--json]              one process: local GPUs, driver P2P, NVLink, versions
    launch/probe.sh N [--json]           N ranks (mpirun): the group's table, IPC-confirmed P2P and
                                         the mode a Communicator would pick (also under torchrun);
                                         --timeout S bounds the ranks' waits for each other (120 s)

A single process can only ask the driver about P2P; the IPC check (a buffer written by one process
and read through an IPC mapping by another) needs two processes. On a machine without a GPU the
probe says so and exits 0; a broken driver or NVML shows up in "notes", not as a traceback.

--json prints one object (rank 0 only under a launcher) with these fields:
  launcher      null (single process), "mpi" or "torchrun"
  world_size    ranks in the group (1 for a single process)
  host          host of this process (rank 0)
  cuda          torch sees a CUDA GPU
  versions      {torch, cuda_runtime, nccl, torch_nccl, driver, driver_cuda} of this process (null: unreadable);
                nccl: the library commfuse's NCCL route calls (torch's at COMMFUSE_NCCL=0), torch_nccl: torch's
                own (its process groups')
  gpus          GPUs visible to this process: [{index, name, sm ("9.0"), uuid, pci_bus_id, memory_bytes,
                nvlink ({gpu_links: {pci_bus_id: links}, switch_links} or null), fused}] where fused maps
                each pattern of topology.PATTERNS (residual_rmsnorm, then one per quantization format)
                to "fused-hw" | "fused-sw" | "separated" ("separated" for every pattern with
                COMMFUSE_DISABLE_FUSION=1, as the routes then run)
  ranks         one entry per rank of the group: the fields of gpus (index: the rank's CUDA ordinal,
                null without a GPU) plus rank, host, node, versions
  matrix_of     "gpus" (single process) or "ranks": what rows and columns of the matrices index
  p2p_driver    cuDeviceCanAccessPeer[i][j]: true/false, null where not asked (another host, GPU not visible)
  p2p_ipc       the IPC check[i][j] (null where not measured); null for a single process
  p2p           what the mode decision used: IPC-confirmed (ranks) or the driver's answer (gpus)
  nvlink        active NVLink links of i reaching j (through NVSwitch included); null entries where unknown
  mode          the mode a Communicator over this group gets: "p2p" | "fallback" | "cpu"
  reasons       why, as a list of strings
  local_group   single process with GPUs: {mode, reasons} a group of one rank per local GPU would get
                from the driver's P2P answer (not IPC-confirmed); null without GPUs and under a launcher
                of more than one rank (one rank's report is the single process's)
  strategy      the Communicator's strategy here: COMMFUSE_STRATEGY or "auto" (a value that is no
                strategy is named in notes: a Communicator raises on it)
  overrides     {COMMFUSE_STRATEGY, COMMFUSE_PRETEND_NO_P2P, COMMFUSE_DISABLE_FUSION}: values set, or null
  notes         what could not be measured and why ("rank i: ..." under a launcher); a setting a Communicator
                would refuse, or that its ranks set differently (communicator.compared_settings)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys

import torch

from .. import env, topology
from ..distributed import gather_objects, launch_env
from ..env import MAX_SECONDS, MIN_SECONDS
from ..kernels.p2p_allreduce import MAX_WORLD
from ..routes import STRATEGIES

OVERRIDES = ("COMMFUSE_STRATEGY", "COMMFUSE_PRETEND_NO_P2P", "COMMFUSE_DISABLE_FUSION")
_SHORT = {p: "+" + p[len("residual_rmsnorm_"):] if p != "residual_rmsnorm" else "rmsnorm" for p in topology.PATTERNS}


PROBE_TIMEOUT_S = 120  # the group's rendezvous and collectives (--timeout): stale launcher variables end in a message


def _settings() -> tuple:
    """(settings, None) as a Communicator here would compare them with its peers' (communicator.compared_settings),
    or (None, its error) where one is not a value: a Communicator would raise it."""
    from ..communicator import compared_settings

    try:
        return compared_settings(os.environ.get("COMMFUSE_STRATEGY") or "auto"), None
    except ValueError as e:
        return None, str(e)


def _sm(sm):
    return None if sm is None else f"{sm[0]}.{sm[1]}"


def _gpu(info: topology.RankInfo) -> dict:
    nvlink = None if info.nvlink is None else {"gpu_links": dict(info.nvlink.gpu_links),
                                                "switch_links": info.nvlink.switch_links}
    return {"index": info.device, "name": info.gpu_name, "sm": _sm(info.sm), "uuid": info.uuid,
            "pci_bus_id": info.pci_bus_id, "memory_bytes": info.memory_bytes, "nvlink": nvlink,
            "fused": _fused(info.sm)}


def _fused(sm) -> dict:
    """topology.fusion_capability, or "separated" for every pattern where COMMFUSE_DISABLE_FUSION=1 turns the
    fused kernels off (commfuse.routes.tail_guard)."""
    fused = topology.fusion_capability(sm)
    return {p: "separated" for p in fused} if env.flag("COMMFUSE_DISABLE_FUSION", False) else fused


def _rank(i: int, node: int, info: topology.RankInfo) -> dict:
    versions = None if info.versions is None else dataclasses.asdict(info.versions)
    return {"rank": i, "host": info.host, "node": node, **_gpu(info), "versions": versions}


def _common(me: topology.RankInfo, gpus) -> dict:
    env = {k: os.environ.get(k) for k in OVERRIDES}
    return {"host": socket.gethostname(), "cuda": torch.cuda.is_available(),
            "versions": dataclasses.asdict(me.versions),
            "gpus": [_gpu(g) for g in gpus],
            "strategy": env["COMMFUSE_STRATEGY"] or "auto", "overrides": env}


def single_report() -> dict:
    """The report of one process: local GPUs and the driver's P2P answer among them."""
    pretend = env.flag("COMMFUSE_PRETEND_NO_P2P", False)
    me = topology.own_info()
    gpus = topology.local_gpus(me.versions)
    driver, driver_notes = topology.driver_p2p_matrix(gpus)
    p2p = tuple(tuple(v is True for v in row) for row in driver)
    mode, reasons = topology.decide_mode([me], ((True,),), pretend, "nccl" if me.device is not None else None)
    local = None
    if gpus:
        m, r = topology.decide_mode(gpus, p2p, pretend, "nccl")
        # The IPC check needs two processes: one a GPU, or two sharing the one GPU.
        local = {"mode": m, "reasons": list(r) + _too_large(m, len(gpus), False) + [
            f"P2P from the driver only: the IPC check needs two processes (launch/probe.sh {max(2, len(gpus))})"]}
    notes = list(dict.fromkeys([*me.notes, *(n for g in gpus for n in g.notes), *driver_notes]))
    return {"launcher": None, "world_size": 1, **_common(me, gpus), "ranks": [_rank(0, 0, me)],
            "matrix_of": "gpus", "p2p_driver": driver, "p2p_ipc": None, "p2p": p2p,
            "nvlink": topology.nvlink_matrix(gpus), "mode": mode, "reasons": list(reasons),
            "local_group": local, "notes": notes}


def _too_large(mode: str, ranks: int, shared_gpu: bool) -> list:
    """The reason a P2P node's group is still not served by the P2P kernels: more ranks than they take."""
    if mode != "p2p" or ranks <= MAX_WORLD:
        return []
    return [f"{ranks} ranks > {MAX_WORLD}: no P2P kernels for it, no P2P workspace: a Communicator of this group "
            "takes " + ("gloo" if shared_gpu else "NCCL")]


def group_report(topo: topology.Topology, launcher: str) -> dict:
    """The report of a group (built on any rank; printed by rank 0)."""
    me = topo.ranks[topo.rank]
    nodes = topo.nodes
    reasons = list(topo.reasons) + _too_large(topo.mode, topo.world_size, topo.shared_gpu)
    return {"launcher": launcher, "world_size": topo.world_size, **_common(me, topology.local_gpus(me.versions)),
            "ranks": [_rank(i, nodes[i], r) for i, r in enumerate(topo.ranks)],
            "matrix_of": "ranks", "p2p_driver": topo.p2p_driver, "p2p_ipc": topo.p2p_ipc,
            "p2p": topo.p2p, "nvlink": topo.nvlink, "mode": topo.mode, "reasons": reasons,
            "local_group": None, "notes": list(topo.notes)}


def _matrix(title: str, labels, cells) -> list:
    width = max([5] + [len(c) for row in cells for c in row])
    lines = [title, "      " + "".join(f"{lab:>{width + 2}}" for lab in labels)]
    lines += [f"  {lab:<4}" + "".join(f"{c:>{width + 2}}" for c in row) for lab, row in zip(labels, cells)]
    return lines


def _dash(v) -> str:
    return "-" if v is None else str(v)


def _yn(v) -> str:
    return "?" if v is None else "yes" if v else "no"


def render(rep: dict) -> str:
    """The report as text for people."""
    v = rep["versions"]
    ranks = f"{rep['world_size']} rank{'s' if rep['world_size'] != 1 else ''}"
    out = [f"commfuse-probe on {rep['host']}: " + ("single process" if rep["launcher"] is None else
                                                  f"{ranks} ({rep['launcher']})"),
           f"versions: torch {v['torch']}, CUDA runtime {v['cuda_runtime']}, NCCL {v['nccl']}"
           + (f" (torch's: {v['torch_nccl']})" if v["torch_nccl"] != v["nccl"] else "")
           + f", driver {v['driver']} (CUDA {v['driver_cuda']})", ""]
    fused = "  ".join(f"{s:<9}" for s in _SHORT.values())
    if not rep["cuda"]:
        out += ["no CUDA GPU: torch sees none. commfuse runs on CPU (gloo), tails as separated ops.", ""]
    else:
        out.append("GPUs visible to this process:")
        out.append(f"  {'gpu':<4}{'name':<24}{'SM':<6}{'memory':>10}  {'PCI bus id':<14}{'UUID':<42}{fused}")
        for g in rep["gpus"]:
            mem = f"{g['memory_bytes'] / 2**30:.1f} GiB"
            out.append(f"  {g['index']:<4}{g['name'][:23]:<24}{g['sm']:<6}{mem:>10}  {g['pci_bus_id'] or '?':<14}"
                       f"{g['uuid'] or '?':<42}" + "  ".join(f"{g['fused'][p]:<9}" for p in _SHORT))
        out.append("")
    if rep["matrix_of"] == "ranks":
        out.append("ranks:")
        out.append(f"  {'rank':<6}{'host':<20}{'node':<6}{'gpu':<5}{'name':<24}{'SM':<6}{'PCI bus id':<14}{fused}")
        for r in rep["ranks"]:
            out.append(f"  {r['rank']:<6}{r['host'][:19]:<20}{r['node']:<6}{_dash(r['index']):<5}"
                       f"{(r['name'] or '-')[:23]:<24}{r['sm'] or '-':<6}{r['pci_bus_id'] or '-':<14}"
                       + "  ".join(f"{r['fused'][p]:<9}" for p in _SHORT))
        out.append("")
    labels = [str(i) for i in range(len(rep["p2p"]))]
    if len(labels) > 1 and any(u["index"] is not None for u in rep[rep["matrix_of"]]):
        if rep["p2p_ipc"] is None:
            cells = [["-" if i == j else _yn(x) for j, x in enumerate(row)]
                     for i, row in enumerate(rep["p2p_driver"])]
            out += _matrix("P2P between GPUs (driver, cuDeviceCanAccessPeer; the IPC check needs two "
                           f"processes: launch/probe.sh {len(labels)}):", labels, cells)
        else:
            cells = [["-" if i == j else f"{_yn(d)}/{_yn(c)}" for j, (d, c) in enumerate(zip(dr, cr))]
                     for i, (dr, cr) in enumerate(zip(rep["p2p_driver"], rep["p2p_ipc"]))]
            out += _matrix("P2P between ranks (driver / IPC check):", labels, cells)
        cells = [["-" if i == j else "?" if x is None else str(x) for j, x in enumerate(row)]
                 for i, row in enumerate(rep["nvlink"])]
        out += _matrix("NVLink links (of i reaching j, NVSwitch included; ? = unknown):", labels, cells)
        out.append("")
    scope = "a Communicator in this process" if rep["launcher"] is None else "a Communicator over this group"
    out.append(f"mode of {scope}: {rep['mode']}")
    out += [f"  - {r}" for r in rep["reasons"]]
    if rep["local_group"]:
        out.append(f"mode of a group of one rank per local GPU: {rep['local_group']['mode']}")
        out += [f"  - {r}" for r in rep["local_group"]["reasons"]]
    # A switch reads only "1": any other value is said to do nothing, not listed as if it did.
    set_now = ", ".join(f"{k}={v}" + (" (no effect: only 1 switches it on)" if k != "COMMFUSE_STRATEGY" and v != "1"
                                      else "") for k, v in rep["overrides"].items() if v) or "none set"
    out += [f"strategy: {rep['strategy']}. Overrides ({set_now}): COMMFUSE_STRATEGY=nccl or "
            "Communicator(strategy=\"nccl\") forces NCCL; COMMFUSE_PRETEND_NO_P2P=1 makes the mode "
            "\"fallback\"; COMMFUSE_DISABLE_FUSION=1 forces separated ops."]
    if rep["notes"]:
        out += ["notes:"] + [f"  - {n}" for n in rep["notes"]]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="commfuse-probe", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON (fields: see the module docstring)")
    parser.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S, metavar="SECONDS",
                        help=f"how long the ranks of a launcher wait for each other (default {PROBE_TIMEOUT_S})")
    args = parser.parse_args(argv)
    if not MIN_SECONDS <= args.timeout <= MAX_SECONDS:  # init_distributed's range
        parser.error(f"--timeout must be a number of seconds from {MIN_SECONDS:g} to {MAX_SECONDS:.15g}, "
                     f"got {args.timeout}")
    try:
        _, world, _, launcher = launch_env()
    except ValueError as e:  # a broken launcher is a message, not a traceback
        print(f"commfuse-probe: {e}", file=sys.stderr)
        return 1
    if launcher is None or world == 1:
        rep = single_report()
        if launcher is not None:
            rep["launcher"] = launcher
        _, error = _settings()
        if error:
            rep["notes"].append(f"{error}: a Communicator raises it")
    else:
        import torch.distributed as dist

        from ..distributed import init_distributed

        try:
            init_distributed(timeout_s=args.timeout)
            topo = topology.detect()
            every = gather_objects(None, _settings())
        except Exception as e:  # a broken launcher or backend is a message, not a traceback
            stale = " (are RANK / WORLD_SIZE left over in this shell from a launcher?)" if "timed out" in \
                str(e).lower() else ""
            print(f"commfuse-probe: the group of {world} ranks could not be probed: {type(e).__name__}: {e}{stale}",
                  file=sys.stderr)
            return 1
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        if topo.rank != 0:
            return 0
        rep = group_report(topo, launcher)
        ok = [dict(settings) for settings, error in every if error is None]
        rep["notes"] += [f"rank {r}: {error}: a Communicator raises it" for r, (_, error) in enumerate(every) if error]
        differ = sorted({k for one in ok for k in one if one[k] != ok[0][k]})
        if differ:
            values = "; ".join(f"{k}: " + ", ".join(f"rank {r} {dict(settings)[k]!r}" for r, (settings, _)
                                                    in enumerate(every) if settings is not None) for k in differ)
            rep["notes"].append(f"ranks' settings differ ({values}): a Communicator raises ValueError; this report is "
                                "rank 0's")
    strategy = os.environ.get("COMMFUSE_STRATEGY")
    if strategy and strategy not in STRATEGIES:
        rep["notes"].append(f"COMMFUSE_STRATEGY={strategy!r} is not a strategy (one of {', '.join(STRATEGIES)}): a "
                            "Communicator raises ValueError")
    print(json.dumps(rep, indent=2) if args.json else render(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
