"""What the group's hardware allows: nodes, GPUs and SMs, P2P between GPUs, NVLink, versions.

`detect(group)` is collective (every rank of the group calls it) and cached per group; `probe(group)`
measures again without the cache. Each rank gathers facts about itself (`RankInfo`: host, GPU, SM,
PCI bus id, NVLink, versions); they are all-gathered, then for ranks that share a node (a hostname and the
kernel's boot id: machines whose containers all say "localhost" are told apart):
- p2p_driver[i][j]: cuDeviceCanAccessPeer between their GPUs, asked by rank i, which finds rank j's GPU
  by PCI bus id (ranks may see different CUDA_VISIBLE_DEVICES); None when i cannot see that GPU.
- p2p_ipc[i][j]: a real cross-process check: rank j writes a rank-specific pattern into a buffer it
  allocated and exports; rank i maps it (cuIpcOpenMemHandle) and reads the pattern back.
- p2p[i][j] = p2p_ipc[i][j] is True and p2p_driver[i][j] is not False: what the mode decision uses.
- nvlink[i][j]: active NVLink links of GPU i that reach GPU j (NVML), None where NVML does not answer.
`decide_mode` is the pure decision from those facts, `fusion_capability(sm)` the pure per-SM answer of
how each fused pattern runs, so both are tested on simulated hardware.

Ranks sharing a GPU (one GPU UUID for several ranks: commfuse.init_distributed then picks gloo,
since NCCL refuses two ranks on one GPU): `gpu_sharers` counts, per rank, the ranks of the group on
its GPU; the IPC check runs over gloo too, so such a group takes the P2P row over same-device IPC
(every rank's kernels are real, the GPU time-slices the processes unless MPS runs), and the
fallback row is gloo's exact sum followed by the fused tail kernel. A correctness mode, not a
speed mode: the reasons say so.

Overrides: COMMFUSE_PRETEND_NO_P2P=1 makes the mode "fallback" on a P2P machine (to exercise that row); read at
each detect (the cache keeps the facts, not the decision).
strategy="nccl" / COMMFUSE_STRATEGY act in the Communicator and commfuse.routes, after the mode.
A failing driver, NVML or IPC call never raises here: it becomes False/None plus a line in `notes`.
"""
from __future__ import annotations

import functools
import random
import socket
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import env, ipc, nccl
from .kernels import jit
from .tail.formats import FORMATS

MIN_FUSED_SM = (8, 0)  # the oldest SM the kernels are built for
# One fused pattern per format: residual + RMSNorm (+ the format's quantization).
PATTERNS = tuple("residual_rmsnorm" + (f"_{f.name}" if f.name else "") for f in FORMATS)
_IPC_CHECK_BYTES = 4096


@dataclass(frozen=True)
class Versions:
    """Software stack of one rank; None where it could not be read (see notes)."""

    torch: str
    cuda_runtime: Optional[str]  # CUDA torch was built with
    nccl: Optional[str]  # the NCCL commfuse's NCCL route calls (commfuse.nccl.library(); torch's at COMMFUSE_NCCL=0)
    torch_nccl: Optional[str]  # the NCCL torch was built with (its process groups'): may differ from it
    driver_cuda: Optional[str]  # newest CUDA the driver supports (cuDriverGetVersion), e.g. "13.0"
    driver: Optional[str]  # NVML driver version, e.g. "580.65.06"


@dataclass(frozen=True)
class NvLinkInfo:
    """Active NVLink links of one GPU: to other GPUs by PCI bus id, and into an NVSwitch fabric."""

    gpu_links: tuple = ()  # ((pci_bus_id, links), ...)
    switch_links: int = 0


@dataclass(frozen=True)
class RankInfo:
    """One rank's (or one local GPU's) own facts, gathered over the group."""

    host: str
    device: Optional[int]  # CUDA ordinal in its own process, None without a GPU
    uuid: Optional[str]
    sm: Optional[tuple]
    gpu_name: Optional[str]
    pci_bus_id: Optional[str] = None  # "dddd:bb:dd.f", the key that maps GPUs across processes
    memory_bytes: Optional[int] = None
    nvlink: Optional[NvLinkInfo] = None  # None: NVML did not answer (see notes)
    versions: Optional[Versions] = None
    notes: tuple = ()
    boot_id: Optional[str] = None  # the kernel's boot id: tells machines apart whose hostnames are one ("localhost")

    @property
    def node(self) -> tuple:
        """What ranks of one machine share: its hostname and its kernel's boot id (containers of one machine share
        the boot id, machines of one hostname do not)."""
        return self.host, self.boot_id


@dataclass(frozen=True)
class Topology:
    """The group's topology as seen by this rank.

    mode: "p2p" (one node, every pair P2P-capable: the custom all-reduce row), "fallback" (NCCL then
    a local fused tail) or "cpu" (no GPU or a CPU backend: gloo and separated ops). reasons say why.
    Matrices are world_size x world_size, indexed by rank of the group (see the module docstring);
    notes say why a check failed, prefixed with the rank that saw it.
    """

    rank: int
    world_size: int
    ranks: tuple  # RankInfo per rank of the group
    p2p: tuple  # bools, diagonal True
    mode: str
    reasons: tuple = field(default_factory=tuple)
    p2p_driver: tuple = ()  # Optional[bool]
    p2p_ipc: tuple = ()  # Optional[bool], None where not measured
    nvlink: tuple = ()  # Optional[int]
    notes: tuple = ()

    @property
    def sm(self) -> Optional[tuple]:
        return self.ranks[self.rank].sm

    @property
    def local_ranks(self) -> tuple:
        me = self.ranks[self.rank].node
        return tuple(i for i, r in enumerate(self.ranks) if r.node == me)

    @property
    def nodes(self) -> tuple:
        """Node index of each rank, numbered by first appearance of its host."""
        nodes = list(dict.fromkeys(r.node for r in self.ranks))
        return tuple(nodes.index(r.node) for r in self.ranks)

    @property
    def versions(self) -> Optional[Versions]:
        return self.ranks[self.rank].versions

    @property
    def gpu_sharers(self) -> tuple:
        """Per rank, how many ranks of the group use its GPU (1 without sharing)."""
        return gpu_sharers(self.ranks)

    @property
    def shared_gpu(self) -> bool:
        """Whether some GPU serves several ranks of the group (the correctness mode of one-GPU machines)."""
        return max(self.gpu_sharers, default=1) > 1


def fusion_capability(sm: Optional[tuple]) -> dict:
    """How a GPU of this SM runs each pattern of PATTERNS (None: no GPU).

    "fused-hw": one fused kernel, conversions in hardware; "fused-sw": fused, quantization
    converted in software (below the format's hw_sm: FP8 below SM 8.9, e2m1 below 10.0); "separated":
    plain torch ops.
    """
    if sm is None or tuple(sm) < MIN_FUSED_SM or jit.cannot_target(tuple(sm)):
        return {p: "separated" for p in PATTERNS}
    return {p: "fused-hw" if tuple(sm) >= f.hw_sm else "fused-sw" for p, f in zip(PATTERNS, FORMATS)}


def gpu_sharers(ranks: Sequence[RankInfo]) -> tuple:
    """For each rank, the number of ranks on its GPU: the same node and the same GPU uuid or PCI bus id (MIG
    instances of one GPU have uuids of their own and one bus id)."""
    def same(a: RankInfo, b: RankInfo) -> bool:
        if a.device is None or b.device is None or a.node != b.node:
            return False
        return (a.uuid is not None and a.uuid == b.uuid) or (a.pci_bus_id is not None and a.pci_bus_id == b.pci_bus_id)

    return tuple(1 if r.device is None else max(1, sum(same(r, s) for s in ranks)) for r in ranks)


def sharing_reason(ranks: Sequence[RankInfo], p2p: bool = True) -> Optional[str]:
    """Which ranks share which GPU, and what that means, in words (p2p: whether the group's mode uses the
    P2P all-reduce); None without sharing."""
    counts = gpu_sharers(ranks)
    groups: dict = {}
    for i, (r, n) in enumerate(zip(ranks, counts)):
        if n > 1:
            groups.setdefault((r.node, r.pci_bus_id or r.uuid), []).append(i)  # MIG instances: one bus id
    if not groups:
        return None
    parts = []
    for members in groups.values():
        r = ranks[members[0]]
        parts.append(f"ranks {','.join(map(str, members))} share GPU {r.device} ({r.gpu_name})")
    return ("; ".join(parts) + ": gloo for host exchanges (NCCL refuses two ranks on one GPU)"
            + (", P2P over same-device IPC" if p2p else "")
            + "; the GPU time-slices the ranks unless MPS runs (a correctness mode, not a speed mode)")


def decide_mode(ranks: Sequence[RankInfo], p2p: Sequence[Sequence[bool]],
                pretend_no_p2p: bool = False, backend: Optional[str] = None) -> tuple:
    """(mode, reasons) from the gathered facts. backend: the group's torch.distributed backend, if known.
    A gloo group whose ranks share GPUs works on CUDA tensors, so it is decided like a NCCL group."""
    if any(r.device is None for r in ranks):
        return "cpu", ("a rank has no GPU: gloo and separated ops",)
    sharing = sharing_reason(ranks) is not None
    if backend is not None and backend != "nccl" and not sharing:
        return "cpu", (f"group backend {backend}: CPU tensors, separated ops",)
    # The collective off P2P: the group's own (gloo where ranks share GPUs).
    mode, reasons = _decide_gpu_mode(ranks, p2p, pretend_no_p2p, "gloo" if backend == "gloo" else "NCCL")
    return mode, reasons + ((sharing_reason(ranks, mode == "p2p"),) if sharing else ())


def _decide_gpu_mode(ranks: Sequence[RankInfo], p2p: Sequence[Sequence[bool]], pretend_no_p2p: bool,
                     fallback: str) -> tuple:
    nodes = {r.node for r in ranks}
    if len(nodes) > 1:
        return "fallback", (f"ranks span {len(nodes)} nodes: {fallback} between nodes",)
    if len(ranks) == 1:
        return "fallback", ("one rank: nothing to exchange, no P2P",)
    sms = sorted({tuple(r.sm) for r in ranks if r.sm is not None})
    if len(sms) > 1:
        # Every rank must take the same collective; per-rank kernel choices could diverge and hang.
        return "fallback", ("ranks have different SMs (" + ", ".join(f"{a}.{b}" for a, b in sms) +
                            f"): {fallback}, each rank picks its own tail",)
    if sms and sms[0] < MIN_FUSED_SM:
        return "fallback", (f"SM {sms[0][0]}.{sms[0][1]} < {MIN_FUSED_SM[0]}.{MIN_FUSED_SM[1]}: "
                            f"no P2P kernels, {fallback}",)
    newer = jit.cannot_target(sms[0]) if sms else None  # a GPU newer than the NVRTC: no kernel compiles for it
    if newer:
        return "fallback", (f"{newer.split(':')[0]}: no P2P kernels, {fallback}",)
    if pretend_no_p2p:
        return "fallback", ("COMMFUSE_PRETEND_NO_P2P=1: P2P treated as absent",)
    missing = [(i, j) for i in range(len(ranks)) for j in range(len(ranks)) if i != j and not p2p[i][j]]
    if missing:
        pairs = ", ".join(f"{i}->{j}" for i, j in missing[:8])
        return "fallback", (f"no P2P between ranks {pairs}",)
    return "p2p", (f"{len(ranks)} ranks on one node, P2P between every pair",)


def nvlink_matrix(infos: Sequence[RankInfo]) -> tuple:
    """Links of GPU i that reach GPU j: direct links, plus i's NVSwitch links when j is on a switch too.

    None on the diagonal, across hosts, for the same GPU, and where either side's NVML failed.
    """
    def links(a: RankInfo, b: RankInfo) -> Optional[int]:
        if a.node != b.node or a.nvlink is None or b.nvlink is None or a.pci_bus_id == b.pci_bus_id:
            return None
        direct = dict(a.nvlink.gpu_links).get(b.pci_bus_id, 0)
        return direct + (a.nvlink.switch_links if b.nvlink.switch_links else 0)

    return tuple(tuple(None if i == j else links(a, b) for j, b in enumerate(infos))
                 for i, a in enumerate(infos))


def _norm_bus_id(bus_id) -> str:
    """PCI bus ids as CUDA writes them ("0000:19:00.0"); NVML pads the domain to 8 digits."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    domain, bus, rest = text.split("\x00")[0].strip().split(":")
    dev, fn = rest.split(".")
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn, 16):x}"


def _err(e: Exception) -> str:
    return str(e) if isinstance(e, ipc.CudaError) else f"{type(e).__name__}: {e}"


def _nvml(query):
    """query(pynvml) inside nvmlInit/nvmlShutdown; raises whatever NVML (or a missing pynvml) raises."""
    import pynvml as nv

    nv.nvmlInit()
    try:
        return query(nv)
    finally:
        nv.nvmlShutdown()


def _nvlink(pci_bus_id: str) -> NvLinkInfo:
    def query(nv):
        handle = nv.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
        gpus: Counter = Counter()
        switch = 0
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                active = nv.nvmlDeviceGetNvLinkState(handle, link) == nv.NVML_FEATURE_ENABLED
            except nv.NVMLError as e:
                # Links past the GPU's count, or no NVLink at all: not an error, just no link.
                if e.value in (nv.NVML_ERROR_INVALID_ARGUMENT, nv.NVML_ERROR_NOT_SUPPORTED):
                    continue
                raise
            if not active:
                continue
            kind = nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            if kind == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                switch += 1
            elif kind == nv.NVML_NVLINK_DEVICE_TYPE_GPU:
                gpus[_norm_bus_id(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)] += 1
        return NvLinkInfo(tuple(sorted(gpus.items())), switch)

    return _nvml(query)


def versions() -> tuple:
    """(Versions of this process, notes on what could not be read)."""
    notes = []
    route_nccl = torch_nccl = None
    if torch.version.cuda:  # a CPU build has neither, and no use for them
        try:
            torch_nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:
            notes.append(f"torch's NCCL version: {_err(e)}")
        if not env.flag("COMMFUSE_NCCL", True):  # the route calls torch.distributed's: the library is not loaded
            route_nccl = torch_nccl
        else:
            try:
                route_nccl = nccl.library().version()
            except (nccl.NcclUnavailable, nccl.NcclError) as e:
                notes.append(f"NCCL route's library: {_err(e)}")
    try:
        v = ipc.call(ipc.driver.cuDriverGetVersion)
        driver_cuda = f"{v // 1000}.{v % 1000 // 10}"
    except ipc.CudaError as e:
        driver_cuda = None
        notes.append(f"CUDA driver: {e}")
    try:
        driver = _nvml(lambda nv: nv.nvmlSystemGetDriverVersion())
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception as e:
        driver = None
        notes.append(f"NVML: {_err(e)}")
    return Versions(torch.__version__, torch.version.cuda, route_nccl, torch_nccl, driver_cuda, driver), tuple(notes)


def _gpu_info(ordinal: int, host: str, vers: Optional[Versions], notes: tuple = ()) -> RankInfo:
    """Facts of CUDA ordinal `ordinal` of this process: torch's view, ids from the driver, links from NVML."""
    props = torch.cuda.get_device_properties(ordinal)
    notes = list(notes)
    uuid = bus = nvlink = None
    try:
        dev = ipc.device(ordinal)
        bus = _norm_bus_id(ipc.call(ipc.driver.cuDeviceGetPCIBusId, 64, dev))
        raw = ipc.call(ipc.driver.cuDeviceGetUuid, dev).bytes.hex()
        kind = "MIG" if " MIG " in f" {props.name} " else "GPU"  # a MIG instance's is its own MIG UUID
        uuid = f"{kind}-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"
    except ipc.CudaError as e:
        notes.append(f"GPU {ordinal}: {e}")
    if bus is not None:
        try:
            nvlink = _nvlink(bus)
        except Exception as e:
            notes.append(f"NVLink of GPU {ordinal} (NVML): {_err(e)}")
    return RankInfo(host, ordinal, uuid, (props.major, props.minor), props.name, bus,
                    props.total_memory, nvlink, vers, tuple(notes), boot_id())


@functools.cache
def boot_id() -> Optional[str]:
    """This machine's kernel boot id (Linux), None where there is none to read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def own_info() -> RankInfo:
    """This process's facts, for the GPU torch currently uses; notes include unreadable versions."""
    host = socket.gethostname()
    vers, notes = versions()
    if not torch.cuda.is_available():
        return RankInfo(host, None, None, None, None, versions=vers,
                        notes=notes + ("torch sees no CUDA GPU",), boot_id=boot_id())
    return _gpu_info(torch.cuda.current_device(), host, vers, notes)


def local_gpus(vers: Optional[Versions] = None) -> tuple:
    """RankInfo of every GPU this process can see (device = its ordinal here); empty without CUDA."""
    if not torch.cuda.is_available():
        return ()
    host = socket.gethostname()
    return tuple(_gpu_info(i, host, vers) for i in range(torch.cuda.device_count()))


def can_access_peer(bus_id: str, peer_bus_id: str) -> tuple:
    """(cuDeviceCanAccessPeer from one GPU to another by PCI bus id, or None; a note when None)."""
    if bus_id == peer_bus_id:
        return None, None  # one GPU (ranks sharing it, MIG instances of it): no peer access to ask the driver about
    try:
        dev = ipc.device_by_pci_bus_id(bus_id)
        peer = ipc.device_by_pci_bus_id(peer_bus_id)
        return bool(ipc.call(ipc.driver.cuDeviceCanAccessPeer, dev, peer)), None
    except ipc.CudaError as e:
        return None, f"driver P2P {bus_id} -> {peer_bus_id} not asked (GPU not visible here?): {e}"


def driver_p2p_matrix(infos: Sequence[RankInfo]) -> tuple:
    """(p2p_driver matrix among GPUs of this process, notes); None for pairs on other hosts or without ids."""
    notes = []

    def ask(a: RankInfo, b: RankInfo) -> Optional[bool]:
        if a.node != b.node or a.pci_bus_id is None or b.pci_bus_id is None:
            return None
        answer, note = can_access_peer(a.pci_bus_id, b.pci_bus_id)
        if note:
            notes.append(note)
        return answer

    rows = tuple(tuple(True if i == j and a.device is not None else ask(a, b) for j, b in enumerate(infos))
                 for i, a in enumerate(infos))
    return rows, tuple(notes)


def _pattern(rank: int) -> bytes:
    return random.Random(0x5EED + rank).randbytes(_IPC_CHECK_BYTES)


def _export_own(rank: int, ordinal: int) -> tuple:
    """(device pointer, IPC handle, None) of a fresh buffer holding this rank's pattern, or (None, None, why)."""
    ptr = None
    try:
        with ipc.device_context(ordinal):
            ptr = ipc.alloc(_IPC_CHECK_BYTES)
            ipc.copy_to_device(ptr, _pattern(rank))
            return ptr, ipc.export_handle(ptr), None
    except Exception as e:
        notes = [f"IPC export: {_err(e)}", _free(ordinal, ptr) if ptr is not None else None]
        return None, None, "; ".join(n for n in notes if n)


def _free(ordinal: int, ptr: int) -> Optional[str]:
    try:
        with ipc.device_context(ordinal):
            ipc.free(ptr)
    except Exception as e:
        return f"IPC buffer free: {_err(e)}"
    return None


def _read_peer(ordinal: int, peer: int, handle: bytes) -> tuple:
    """(True, None) when peer's buffer maps here and holds peer's pattern, else (False, why)."""
    try:
        with ipc.device_context(ordinal):
            ptr = ipc.open_handle(handle)
            try:
                got = ipc.copy_to_host(ptr, _IPC_CHECK_BYTES)
            finally:
                ipc.close_handle(ptr)
    except Exception as e:
        return False, f"IPC map of rank {peer}: {_err(e)}"
    bad = sum(a != b for a, b in zip(got, _pattern(peer)))
    return (True, None) if not bad else (False, f"IPC map of rank {peer}: {bad} of {len(got)} bytes differ")


def _p2p_rows(group, rank: int, infos: Sequence[RankInfo]) -> tuple:
    """(driver matrix, ipc matrix, notes of every rank). Collective: the same calls on every rank."""
    me, world = infos[rank], len(infos)
    ptr = handle = None
    notes = []
    if me.device is not None:
        ptr, handle, note = _export_own(rank, me.device)
        notes += [note] if note else []
    handles: list = [None] * world
    dist.all_gather_object(handles, handle, group=group)
    driver_row: list = [None] * world
    ipc_row: list = [None] * world
    if me.device is not None:
        driver_row[rank] = ipc_row[rank] = True
        for j, peer in enumerate(infos):
            if j == rank or peer.node != me.node or peer.device is None:
                continue
            if me.pci_bus_id and peer.pci_bus_id:
                driver_row[j], note = can_access_peer(me.pci_bus_id, peer.pci_bus_id)
            else:
                note = f"driver P2P to rank {j} not asked: a PCI bus id is unknown"
            if handles[j] is None:
                ipc_row[j], note2 = False, f"IPC map of rank {j}: it exported no buffer"
            else:
                ipc_row[j], note2 = _read_peer(me.device, j, handles[j])
            notes += [n for n in (note, note2) if n]
    rows: list = [None] * world
    dist.all_gather_object(rows, (tuple(driver_row), tuple(ipc_row), tuple(notes)), group=group)
    notes = [f"rank {i}: {n}" for i, r in enumerate(rows) for n in r[2]]
    # Free only now: the gather above is the barrier after which no peer reads our buffer.
    note = _free(me.device, ptr) if ptr is not None else None
    notes += [f"rank {rank}: {note}"] if note else []
    return tuple(r[0] for r in rows), tuple(r[1] for r in rows), notes


def probe(group=None) -> Topology:
    """Measure `group`'s topology now (collective; not cached). None: WORLD."""
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    backend = str(dist.get_backend(group))
    infos: list = [None] * world
    dist.all_gather_object(infos, own_info(), group=group)
    notes = [f"rank {i}: {n}" for i, r in enumerate(infos) for n in r.notes]
    shared = any(a.node == b.node for i, a in enumerate(infos) for b in infos[i + 1:])
    if (backend == "nccl" or sharing_reason(infos)) and shared:
        p2p_driver, p2p_ipc, p2p_notes = _p2p_rows(group, rank, infos)
        notes += p2p_notes
    else:
        # Nothing measured between ranks; a rank's own GPU reaches itself, a rank without one has nothing to reach.
        p2p_driver = p2p_ipc = tuple(tuple(True if i == j and infos[i].device is not None else None
                                           for j in range(world)) for i in range(world))
    # A rank's GPU reaches itself; a rank without one reaches nothing.
    p2p = tuple(tuple((i == j and infos[i].device is not None)
                      or (p2p_ipc[i][j] is True and p2p_driver[i][j] is not False) for j in range(world))
                for i in range(world))
    mode, reasons = decide_mode(infos, p2p, env.flag("COMMFUSE_PRETEND_NO_P2P", False), backend)
    return Topology(rank, world, tuple(infos), p2p, mode, reasons, p2p_driver, p2p_ipc,
                    nvlink_matrix(infos), tuple(notes))


# Weak keys: a destroyed process group takes its topology with it, and a new group is probed anew.
_DETECTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def detect(group=None) -> Topology:
    """The topology of `group` (None: WORLD). Collective on first call per group; cached after."""
    group = group if group is not None else dist.group.WORLD
    topo = _DETECTED.get(group)
    if topo is None:
        return _DETECTED.setdefault(group, probe(group))
    # The facts are cached, the decision is not: COMMFUSE_PRETEND_NO_P2P is read anew for each Communicator.
    mode, reasons = decide_mode(topo.ranks, topo.p2p, env.flag("COMMFUSE_PRETEND_NO_P2P", False),
                                str(dist.get_backend(group)))
    return topo if (mode, reasons) == (topo.mode, topo.reasons) else replace(topo, mode=mode, reasons=reasons)
