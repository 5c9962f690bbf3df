"""The P2P all-reduce kernels (csrc/p2p_allreduce.cu) as the host sees them: the variants built, their
launch shapes and LaunchPlans (a call cut into pieces where it is larger than the workspace), what they
take, the protocol's error codes and call signatures, and the exceptions they become. The algorithms and
the workspace are described in commfuse/p2p/__init__.py.
"""
from __future__ import annotations

import functools
import os
from typing import List, Optional, Sequence, Tuple

import torch

from .. import ipc
from ..distributed import rank_label
from ..tail import formats
from ..tail.formats import FORMATS, Format, Layout
from ..tail.spec import OutputSpec, TailSpec
from . import fused_tail, moe_combine, moe_tail, params
from .family import CTYPE, Family, Limits
from .launch import OUT, RESIDUAL, X, Launch, LaunchPlan, pieces, tail_fields, tail_patches, whole_warps

__all__ = ["P2P_ALLREDUCE", "P2PError", "P2PTimeoutError", "P2PMismatchError", "describe_signature", "ALGORITHMS",
           "variants", "warmup", "launch_config", "moe_launch_config", "plain_rows", "chunk_rows", "resident_ctas", "grid_limit",
           "SOURCE", "DELAY_KERNEL", "MAX_BLOCKS", "MAX_THREADS", "MAX_WORLD", "THREADS", "VPT_BUCKETS",
           "PLAIN_MAX_ROW_VECS", "PLAIN_MIN_ROW_VECS", "PLAIN_ONESHOT_THREADS", "MOE_THREADS"]

SOURCE = "p2p_allreduce.cu"
ALGORITHMS = ("oneshot", "twoshot")
MAX_WORLD = params.MAX_WORLD
THREADS = 256          # threads of the plain two-shot and of the looped tail
VPT_BUCKETS = (1, 2)   # the register tails' vectors of 8 elements per thread
# kP2PThreads<QUANT, VPT, ALGO> in p2p_allreduce.cu (each variant's __launch_bounds__) of the tails,
# by VPT; 0 is the looped tail. The plain one-shot's is PLAIN_ONESHOT_THREADS.
MAX_THREADS = {1: 1024, 2: 1024, 0: THREADS}
PLAIN_ONESHOT_THREADS = 1024
MOE_THREADS = 512      # kMoeThreads: the MoE variants' register tails
PLAIN_MIN_ROW_VECS = 256
PLAIN_MAX_ROW_VECS = {"oneshot": 4 * PLAIN_ONESHOT_THREADS, "twoshot": 8 * THREADS}
MAX_BLOCKS = 160       # grid cap (H100/H200: 132 SMs, B200: 148)
DELAY_KERNEL = "commfuse::p2p_delay"
_ALGO_ID = {"oneshot": 0, "twoshot": 1}


class P2PError(RuntimeError):
    """A P2P all-reduce kernel stopped a call: a peer did not arrive, or its call differed. The
    workspace is unusable afterwards: every later call on it raises the same error."""


class P2PTimeoutError(P2PError):
    """A P2P all-reduce kernel waited longer than the timeout for a peer (named in the message).

    rank: this rank; missing_rank: the peer that did not arrive (ranks of the workspace's group; the message
    gives their global ranks too where they differ); phase: the two-shot barrier (0 or 1), 0 for the one-shot's
    wait for the peer's data; timeout_s: the limit. The workspace is unusable afterwards: create a new
    Communicator.
    """

    def __init__(self, rank: int, missing_rank: int, phase: int, timeout_s: float, group=None):
        label = functools.partial(rank_label, group)  # the global ranks too, on a subgroup
        super().__init__(
            f"P2P all-reduce on {label(rank)}: {label(missing_rank)} did not arrive (its data or barrier {phase}) "
            f"within {timeout_s:g} s (it skipped a call, is stuck or died, or the ranks' calls differ). The P2P "
            "workspace is out of step now and every later call on it raises: close this Communicator and "
            "create a new one.")
        self.rank, self.missing_rank, self.phase, self.timeout_s = rank, missing_rank, phase, timeout_s


def describe_signature(words: Sequence[int]) -> str:
    """A call signature as the kernels write it (call_signature in csrc/p2p_allreduce.cu), in words."""
    kind, rows, row_vecs, total_vecs = (int(w) & 0xFFFFFFFF for w in words)
    dtype = "bf16" if kind & 1 else "fp16"
    code = (kind >> 1) & 0xF  # 0: the plain all-reduce, else a format's id + 1
    fmt = formats.by_id(code - 1)
    what = "plain all-reduce" if code == 0 else f"pattern {code}" if fmt is None else \
        "tail" if fmt.codes is None else f"tail + {fmt.name}"
    algo = ALGORITHMS[(kind >> 5) & 1]
    if what == "plain all-reduce":
        return f"{dtype} {what} of {8 * total_vecs} elements, {algo}"
    extras = [e for bit, e in ((7, "norm out"), (6, "swizzled scale factors"), (12, "MN-major scales"),
                               (13, "UE8M0 scales")) if kind >> bit & 1]
    return f"{dtype} {what}{' (' + ', '.join(extras) + ')' if extras else ''}, [{rows}, {8 * row_vecs}], {algo}"


class P2PMismatchError(P2PError):
    """Ranks made different P2P calls (dtype, shape, pattern or algorithm): the kernels compare a
    signature of each call that they send with the data, so the difference is found on the GPU,
    at no host cost, instead of a wrong sum or a wait for data that never comes.

    rank: this rank; peer: the rank whose call differs; mine, theirs: the two calls, in words.
    """

    def __init__(self, rank: int, peer: int, mine: str, theirs: str, group=None):
        label = functools.partial(rank_label, group)  # the global ranks too, on a subgroup
        super().__init__(
            f"P2P all-reduce on {label(rank)}: {label(peer)} made a different call: {label(peer)}: {theirs}; "
            f"{label(rank)}: {mine}. Every rank must make the same calls in the same order. The P2P workspace "
            "is out of step now and every later call on it raises: close this Communicator and create a new one.")
        self.rank, self.peer, self.mine, self.theirs = rank, peer, mine, theirs


def register_vpts(fmt: Format) -> Tuple[int, ...]:
    """The register tails built for a format (Format.p2p_register_vpts): rows past 1024 vectors of one
    built at VPT 1 only (h > 8192) take the looped tail."""
    return tuple(v for v in VPT_BUCKETS if v in fmt.p2p_register_vpts)


def launch_config(hidden: int, fmt: Format = formats.NONE) -> Tuple[int, int]:
    """(vpt, threads) of the tail for rows of `hidden` elements, any number of rows: the local tail
    kernel's few-rows rule (fused_tail.row_config), whose VPT 1 and 2 up to 1024 threads and looped tail
    on THREADS are the variants built here (register_vpts): each row's dependent chain spread over as
    many threads as possible."""
    vpt, threads = fused_tail.row_config(hidden, True)
    return (vpt, threads) if vpt == 0 or vpt in register_vpts(fmt) else (0, MAX_THREADS[0])


def moe_launch_config(hidden: int, fmt: Format = formats.NONE) -> Tuple[int, int]:
    """(vpt, threads) of the MoE variants' tail (plan_moe): launch_config's rule with at most MOE_THREADS
    threads for the register tails (kMoeThreads: the combine's loads need more than 64 registers)."""
    nv = hidden // 8
    for vpt in register_vpts(fmt):
        need = -(-nv // vpt)
        if need <= MOE_THREADS:
            return vpt, whole_warps(need)
    return 0, MAX_THREADS[0]


def chunk_rows(row_bytes: int, spec: Optional[TailSpec], workspace_bytes: int) -> int:
    """Rows per two-shot launch for a message larger than the workspace: as many whole rows of
    `row_bytes` as fit (a plain all-reduce, spec None, is cut into rows of one 16-byte vector), in
    multiples of the spec's row tile (128 for swizzled block scales, whose tiles are 128 rows); 0 when not
    one such piece fits."""
    multiple = spec.row_tile if spec is not None else 1
    return workspace_bytes // row_bytes // multiple * multiple


class P2PAllReduce(Family):
    name = "p2p_allreduce"
    source = SOURCE
    limits = Limits(world_sizes=frozenset(range(2, MAX_WORLD + 1)))

    def name_expression(self, dtype: torch.dtype, fmt: Optional[Format], vpt: int, algo: str,
                        form: Optional[int] = None) -> str:
        """The kernel instantiation; fmt None: the plain all-reduce (no tail, vpt 0); form: the MoE
        variants' combine form (moe_combine.FORMS, as the fused MoE tail's), None for x as the input."""
        quant = params.NO_TAIL if fmt is None else fmt.id
        combine = "" if form is None else f", {form}"
        return f"commfuse::p2p_allreduce<{CTYPE[dtype]}, {quant}, {vpt}, {_ALGO_ID[algo]}{combine}>"

    def variants(self) -> List[str]:
        names = []
        for dtype in CTYPE:
            for algo in ALGORITHMS:
                names.append(self.name_expression(dtype, None, 0, algo))
                names += [self.name_expression(dtype, f, v, algo) for f in FORMATS for v in register_vpts(f) + (0,)]
        return names + [DELAY_KERNEL] + self.moe_variants()

    def moe_variants(self) -> List[str]:
        """The MoE variants (Communicator.moe_all_reduce): every tail variant of each combine form
        (moe_combine.FORMS)."""
        return [self.name_expression(dtype, f, v, algo, form) for dtype in CTYPE for algo in ALGORITHMS
                for form in moe_combine.FORMS.values() for f in FORMATS for v in register_vpts(f) + (0,)]

    def configs(self, dtype, spec, hidden):
        names = [self.name_expression(dtype, None, 0, algo) for algo in ALGORITHMS]
        if hidden is not None:
            names += [self.name_expression(dtype, spec.format, launch_config(hidden, spec.format)[0], algo)
                      for algo in ALGORITHMS]
        return names

    def rejects(self, dtype, sm, hidden, tokens, spec, world_size=1, numel: int = 0):
        why = super().rejects(dtype, sm, hidden, tokens, spec, world_size)
        if why is None and spec is None and numel % 8:
            return f"{self.name}: the plain all-reduce needs a multiple of 8 elements, got {numel}"
        return why

    # ---------------------------------------------------------------- LaunchPlans on a workspace

    def plan_plain(self, ws, dtype: torch.dtype, shape: tuple, algo: str) -> LaunchPlan:
        """The LaunchPlan of the sum of a tensor of `shape`, in pieces of ws.max_bytes (whole vectors)
        where larger: one launch per piece, x and the sum advancing by the piece's bytes."""
        n, elt = 1, dtype.itemsize
        for d in shape:
            n *= d
        kernel = self.kernel(self.name_expression(dtype, None, 0, algo), ws.device_index)
        launches = []
        for begin, end in pieces(n, ws.max_bytes // elt) if n else ():
            vecs = (end - begin) // 8
            row_vecs, rows, threads = plain_rows(vecs, ws.nblocks, algo)
            blob = ws.params(_NO_TAIL, vecs, rows, row_vecs, rows)
            patches = ((_OFF["x"], X, begin * elt), (_OFF["out"], OUT, begin * elt))
            launches.append(Launch(kernel, ws.nblocks, threads, blob, patches))
        return LaunchPlan(f"{self.name} {algo}", tuple(launches), (OutputSpec(tuple(shape), dtype),), ws.device_index)

    def plan_fused(self, ws, dtype: torch.dtype, t: int, h: int, spec: TailSpec, algo: str) -> LaunchPlan:
        """The LaunchPlan of the all-reduce of t rows of h with the tail fused. A message larger than
        ws.max_bytes runs two-shot in pieces of whole rows (chunk_rows), one launch each: every output
        advances by its own bytes per row (its size over its rows: row_slots for swizzled scale factors,
        whose 128-row tiles are contiguous, so a piece starts at a multiple of 128), MN-major scales by
        one element per row, keeping the whole call's column stride; the last piece zeroes the padding."""
        elt = dtype.itemsize
        outputs = spec.outputs(t, h, dtype)
        if not t:
            return LaunchPlan(f"{self.name} {algo}", (), tuple(outputs), ws.device_index)
        slots = spec.row_slots(t)
        vpt, threads = launch_config(h, spec.format)
        kernel = self.kernel(self.name_expression(dtype, spec.format, vpt, algo), ws.device_index)
        piece = t if t * h * elt <= ws.max_bytes else chunk_rows(h * elt, spec, ws.max_bytes)
        per_row = {RESIDUAL: h * elt}  # bytes a piece's pointers advance by, per row
        for i, (name, o) in enumerate(zip(outputs._fields, outputs)):
            if o is None:
                continue
            tiled = name == spec.format.scale_field and spec.layout == Layout.SWIZZLED
            nbytes = o.storage_numel * o.dtype.itemsize
            per_row[OUT + i] = o.dtype.itemsize if o.strides is not None else nbytes // (slots if tiled else t)
        launches = []
        for begin, end in pieces(t, piece):
            deltas = {source: begin * b for source, b in per_row.items()}
            fields = tail_fields(spec, t, h, rows=end - begin)
            blob = ws.params(fields, (end - begin) * h // 8, end - begin, h // 8, (end - begin) if end < t else slots - begin)
            patches = tuple(tail_patches(_OFF["tail"], deltas)) + ((_OFF["x"], X, begin * h * elt),)
            launches.append(Launch(kernel, ws.nblocks, threads, blob, patches))
        return LaunchPlan(f"{self.name} {algo}", tuple(launches), tuple(outputs), ws.device_index)

    def plan_moe(self, ws, dtype: torch.dtype, weights_dtype: torch.dtype, index_dtype: Optional[torch.dtype], t: int,
                 k: int, h: int, rows: int, spec: TailSpec, algo: str) -> LaunchPlan:
        """The LaunchPlan of moe_all_reduce's t tokens of k slots (y [t, k, h], or `rows` permuted rows with a
        row index of index_dtype; routing weights of weights_dtype) with the combine done as the kernel reads
        its input and the tail fused: one launch, so the message (t rows of h) must fit ws.max_bytes
        (Communicator._moe_p2p checks). y is the call's source X, the weights Z, the row index and shared
        expert (moe_tail.combine_patches)."""
        outputs = spec.outputs(t, h, dtype)
        if not t:
            return LaunchPlan(f"{self.name} {algo}", (), tuple(outputs), ws.device_index, combine=True)
        vpt, threads = moe_launch_config(h, spec.format)
        form = moe_combine.form_of(index_dtype)
        kernel = self.kernel(self.name_expression(dtype, spec.format, vpt, algo, form), ws.device_index)
        blob = ws.params(tail_fields(spec, t, h), t * h // 8, t, h // 8, spec.row_slots(t),
                         moe_combine.fields(t, k, h, rows, weights_dtype, dtype))
        patches = tuple(tail_patches(_OFF["tail"]) + moe_tail.combine_patches(_OFF["combine"]))
        return LaunchPlan(f"{self.name} {algo}", (Launch(kernel, ws.nblocks, threads, blob, patches),),
                          tuple(outputs), ws.device_index, combine=True)


P2P_ALLREDUCE = P2PAllReduce()
_OFF = params.P2P.offsets
_NO_TAIL = (0,) * 7 + (0.0, 0, 0, 0) + (0, -0.0, 0, 0)  # TailParams of the plain all-reduce: unused


def variants() -> List[str]:
    """Every name expression the library may launch (the CPU build test compiles them all)."""
    return P2P_ALLREDUCE.variants()


def warmup(dtype: torch.dtype, quant: Optional[str] = None, hidden: Optional[int] = None, device=None) -> None:
    """Compile and load, on `device` (default: current), both algorithms' plain all-reduce of
    `dtype`, and with `hidden` given also the fused (quant, hidden) variants, so that later calls
    can be captured in a CUDA graph."""
    P2P_ALLREDUCE.warmup(dtype, TailSpec.of(quant), hidden, device)


def plain_rows(total_vecs: int, nblocks: int, algo: str) -> Tuple[int, int, int]:
    """(row_vecs, rows, threads) cutting a plain all-reduce of `total_vecs` vectors into rows for
    `algo`: small enough that every CTA gets a row, PLAIN_MIN_ROW_VECS to PLAIN_MAX_ROW_VECS[algo]
    vectors. One-shot: whole warps of vectors, up to PLAIN_ONESHOT_THREADS threads (one vector each
    up to rows of that many: the latency case); two-shot: whole multiples of THREADS vectors."""
    per_block = -(-total_vecs // nblocks)
    unit = 32 if algo == "oneshot" else THREADS
    row_vecs = min(PLAIN_MAX_ROW_VECS[algo], max(PLAIN_MIN_ROW_VECS, -(-per_block // unit) * unit))
    threads = min(PLAIN_ONESHOT_THREADS, row_vecs) if algo == "oneshot" else THREADS
    return row_vecs, -(-total_vecs // row_vecs), threads


def resident_ctas(index: int, sharers: int = 1) -> Tuple[int, str]:
    """(CTAs of a whole SM each, the P2P kernels' largest shape, that this process can keep resident on
    GPU `index` while `sharers` ranks, itself included, keep as many, and how that was found).

    Every CTA of a launch waits for the same CTA of the peers, so all of them must be resident at once,
    on every rank: a larger grid deadlocks until the bounded wait gives up. See grid_limit.
    """
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    affinity = None
    try:
        with ipc.device_context(index):
            kind = ipc.driver.CUexecAffinityType.CU_EXEC_AFFINITY_TYPE_SM_COUNT
            affinity = int(ipc.call(ipc.driver.cuCtxGetExecAffinity, kind).param.smCount.val)
    except Exception:  # no execution affinity here: the device's SM count stands
        pass
    return grid_limit(sms, affinity, os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), sharers)


def grid_limit(sms: int, affinity_sms: Optional[int], mps_percentage: Optional[str], sharers: int) -> Tuple[int, str]:
    """resident_ctas from its facts: the SM count the process sees (an MPS client's device properties
    and its context's execution affinity, `affinity_sms`, count only what MPS lets it use), lowered by
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in case they do not, and divided among the `sharers` ranks on the
    GPU (under MPS their kernels run at the same time)."""
    limits = [(sms, f"{sms} SMs")]
    if affinity_sms is not None and 0 < affinity_sms < sms:
        limits.append((affinity_sms, f"{affinity_sms} SMs (execution affinity)"))
    try:
        pct = float(mps_percentage) if mps_percentage else 100.0
    except ValueError:
        pct = 100.0
    if 0 < pct < 100:
        n = int(sms * pct / 100)
        limits.append((n, f"{n} SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={mps_percentage})"))
    n, how = min(limits)
    if sharers > 1:
        return min(n, sms // sharers), f"{how} / {sharers} ranks sharing the GPU"
    return n, how
