"""Routes: which way a call runs, and why. Each route is one entry that says whether it takes a call
(and why not, in words: the plan's reasons), how it is calibrated, and how it makes the call's launcher.

The collective routes, in the order they are tried (the strategy= names come from them):

| route | strategy= | collective | tail | calibrated by |
|---|---|---|---|---|
| identity | - | none: a fused call of one rank of an NCCL group (its sum is x) | the fused_tail kernel on x | - |
| p2p_oneshot | "oneshot" | the P2P one-shot kernel | fused into it | its crossover (p2p.calibration) |
| p2p_twoshot | "twoshot" | the P2P two-shot kernel (in pieces past the workspace) | fused into it | its crossover |
| nccl | "nccl" | ncclAllReduce (commfuse.nccl, else torch.distributed) | the fused_tail kernel after it | - |
| gloo | - | gloo's all-gather and the exact fp32 sum | the fused_tail kernel (CUDA tensors) | - |

and for commfuse.local's calls: local (the fused_tail kernel alone), gated (the gated RMSNorm kernel),
quantize (the quantize kernel).
Where the fused tail's guards do not hold (dtype, a Python number scale, sizes, SM, CPU tensors, fusion
disabled), the tail is `separated`: commfuse.reference's ops after the collective route's plain all-reduce
(or on the local op's input): the same results, slower.

Deciding is a pure function of tensor metadata, the tail spec and the machine's facts (`Machine`), so
every decision is tested on a CPU by simulating them (tests/test_routes.py). A guard that fails never
raises: the call takes the next route, and the plan records why.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import env, reference
from .distributed import rank_label
from .kernels import jit, native
from .kernels.family import CTYPE, Family
from .kernels.fused_tail import FUSED_TAIL
from .kernels.gated_norm import GATED_NORM
from .kernels.launch import LaunchPlan
from .kernels.p2p_allreduce import MAX_WORLD, P2P_ALLREDUCE, chunk_rows
from .kernels.quantize import QUANTIZE
from .p2p.calibration import P2PLimits
from .tail.checks import OUT_NAMES, fields_of, no_overlap, out_placed, scale_value
from .tail.spec import OutputSpec, TailSpec
from .topology import MIN_FUSED_SM

__all__ = ["TensorMeta", "Call", "Machine", "Collective", "TailRoute", "Plan", "Route", "ROUTES", "STRATEGIES",
           "CallMismatchError", "CallTimeoutError", "describe", "scale_form", "exchange_signature",
           "Resources", "plan", "tail_guard", "launcher", "FUSED_DTYPES", "MIN_FUSED_SM"]

FUSED_DTYPES = tuple(CTYPE)


@dataclass(frozen=True)
class TensorMeta:
    """What the routes need to know about a tensor, without touching its data."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: Optional[torch.Tensor]) -> Optional["TensorMeta"]:
        if not isinstance(t, torch.Tensor):
            return None
        return cls(tuple(t.shape), t.dtype, t.device)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Call:
    """One call as the routes see it. op: commfuse.kernels.table's (plain, fused, local, gated,
    quantize); spec: the tail (None: the plain all-reduce); scale None also when it is a Python
    number; z: the gated norm's gate, or a fused call's post-norm weight (post_weight); group_size,
    norm_before_gate: the gated norm's."""

    op: str
    x: TensorMeta
    residual: Optional[TensorMeta] = None
    weight: Optional[TensorMeta] = None
    scale: Optional[TensorMeta] = None
    z: Optional[TensorMeta] = None
    spec: Optional[TailSpec] = None
    group_size: int = 0
    norm_before_gate: bool = False

    @classmethod
    def of(cls, op: str, x, residual=None, weight=None, scale=None, z=None, spec=None, group_size: int = 0,
           norm_before_gate: bool = False) -> "Call":
        return cls(op, TensorMeta.of(x), TensorMeta.of(residual), TensorMeta.of(weight), TensorMeta.of(scale),
                   TensorMeta.of(z), spec, group_size, norm_before_gate)

    @property
    def hidden(self) -> int:
        return self.x.shape[-1] if self.x.shape else 1

    @property
    def tokens(self) -> int:
        return self.x.numel // max(self.hidden, 1)

    @property
    def message_bytes(self) -> int:
        return self.x.numel * self.x.dtype.itemsize

    @property
    def post(self) -> bool:
        """Whether the tail starts with a post-norm (a fused call's post_weight, docs/semantics.md section 2a)."""
        return self.op == "fused" and self.z is not None

    @property
    def pattern(self) -> str:
        """Benchmark-style pattern name, e.g. residual_rmsnorm_nvfp4_out."""
        if self.spec is None:
            return "allreduce"
        name = "residual_rmsnorm" + (f"_{self.spec.quant}" if self.spec.quant else "")
        return name + ("_out" if self.spec.quant and self.spec.return_norm else "")


@dataclass(frozen=True)
class Machine:
    """The facts a route reads besides the call: the topology's mode ("p2p", "fallback", "cpu"; "local"
    for commfuse.local's calls) and its reasons, the torch.distributed backend, this rank's SM (None
    without a GPU), the world size, the strategy, whether fusion is on (COMMFUSE_DISABLE_FUSION), the P2P
    workspace's crossovers (None: no workspace)."""

    mode: str
    backend: str = ""
    sm: Optional[tuple] = None
    world_size: int = 1
    strategy: str = "auto"
    fusion: bool = True
    limits: Optional[P2PLimits] = None
    mode_reasons: tuple = ()

    @classmethod
    def local(cls, device: torch.device, sm: Optional[tuple] = None) -> "Machine":
        """The machine of commfuse.local's calls on `device` (sm None: read from torch.cuda for CUDA)."""
        if sm is None and device.type == "cuda":
            sm = torch.cuda.get_device_capability(device)
        return cls("local", sm=sm, fusion=not env.flag("COMMFUSE_DISABLE_FUSION", False))


class Collective(str, Enum):
    """Which collective a call runs (a str: compares equal to, and prints as, its value)."""

    P2P_ONESHOT = "p2p_oneshot"  # the P2P kernels, tail fused where the tail guards hold
    P2P_TWOSHOT = "p2p_twoshot"
    NCCL = "nccl"                # NCCL's all-reduce
    GLOO = "gloo"                # gloo: every rank's x gathered and summed exactly (CPU, or ranks sharing a GPU)
    NONE = "none"                # no collective: commfuse.local's ops

    def __str__(self) -> str:
        return self.value

    @property
    def algorithm(self) -> Optional[str]:
        """"oneshot" / "twoshot" for the P2P collectives, else None."""
        return self.value[len("p2p_"):] if self.value.startswith("p2p_") else None

    @classmethod
    def of_backend(cls, backend: str) -> "Collective":
        """The collective of a torch.distributed backend; ValueError for one commfuse does not drive."""
        if backend not in (cls.NCCL.value, cls.GLOO.value):
            raise ValueError(f"commfuse runs over the nccl or gloo backend, not {backend!r}")
        return cls(backend)


class TailRoute(str, Enum):
    """How the tail runs (a str, as Collective)."""

    FUSED = "fused"          # in the P2P kernel, or one local kernel (after the collective)
    SEPARATED = "separated"  # plain torch ops of commfuse.reference
    NONE = "none"            # a plain all-reduce: no tail

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Plan:
    """The route of one call.

    collective: a Collective; tail: a TailRoute; kernel: the kernel family that runs the fused part, if
    any; reasons: why, in words: every guard that failed, and what chose the collective; route: the
    ROUTES entry that makes its launcher; combine: how a MoE call's expert combine runs before the
    collective ("fused": in the tail's kernel at world size 1, or in the P2P kernel as it reads each rank's
    rows; "kernel": commfuse.kernels.moe_combine; "separated": commfuse.reference's ops), None for the
    other calls.
    """

    collective: Collective
    tail: TailRoute
    kernel: Optional[str] = None
    reasons: tuple = field(default_factory=tuple)
    route: str = field(default="", compare=False)
    combine: Optional[str] = None

    def __str__(self) -> str:
        head = (f"{self.combine} combine + " if self.combine else "") + f"{self.collective} + {self.tail} tail" + \
            (f" [{self.kernel}]" if self.kernel else "")
        return head + "".join(f"\n  - {r}" for r in self.reasons)


@dataclass(frozen=True)
class Resources:
    """What the launchers work with: the group, the device, the P2P workspace, commfuse.nccl's
    communicator and the gloo route's check group of a Communicator (None where it has none), and whether
    the gloo route exchanges each call's signature (COMMFUSE_GLOO_CHECK, as the ranks agreed on it)."""

    group: object = None
    device: torch.device = torch.device("cpu")
    workspace: object = None
    nccl: object = None
    check_group: object = None  # the gloo route's signature exchange: a gloo group with a short timeout
    gloo_check: bool = True
    caller: str = ""  # what the exchanged texts end with: which of its group's Communicators makes the call


# --------------------------------------------------------------------------- guards


def tail_guard(call: Call, m: Machine) -> Optional[str]:
    """Why the fused tail of any kernel cannot take `call` (None when it can): what every fused route
    needs before its own kernel's limits."""
    spec = call.spec
    if not m.fusion:
        return "COMMFUSE_DISABLE_FUSION=1: separated ops"
    if call.x.device.type != "cuda" or m.sm is None:
        return f"tensors on {call.x.device.type}: fused kernels need CUDA tensors"
    if tuple(m.sm) < MIN_FUSED_SM:
        return f"SM {m.sm[0]}.{m.sm[1]} < {MIN_FUSED_SM[0]}.{MIN_FUSED_SM[1]}: no fused kernels"
    why = jit.cannot_target(tuple(m.sm))
    if why:
        return why
    if call.x.dtype not in FUSED_DTYPES:
        return f"dtype {call.x.dtype}: fused kernels take float16 and bfloat16"
    # (Strided tensors are no reason: the launchers read a dense copy. Nothing here may differ between
    # ranks that make the same call, since the tail decides the P2P kernel and its limits.)
    if spec.format.takes_scale and call.scale is None:
        return "scale given as a Python float: fused kernels take a float32 CUDA tensor"
    multiple = max(8, spec.hidden_multiple)
    if call.hidden % multiple:
        block = spec.format.block
        why = f"hidden size {call.hidden} is not a multiple of {multiple}"
        if block and multiple == block:
            why += (f": quant={spec.quant!r} has one scale per {block} consecutive elements of a row (the "
                    "separated ops raise ValueError on it too)")
        return why
    return None


def _fallback(m: Machine) -> str:
    """The collective a call off P2P takes: the group's own."""
    return "gloo" if m.backend == "gloo" else "NCCL"


def _rejects(family: Family, call: Call, m: Machine, spec: Optional[TailSpec], **extra) -> Optional[str]:
    return family.rejects(call.x.dtype, m.sm or (0, 0), call.hidden, call.tokens, spec, m.world_size, **extra)


# --------------------------------------------------------------------------- the routes


class Route:
    """One way to run a call. name: its ROUTES key; strategy: the strategy= value that forces it (None:
    not forceable); collective: what it reports; kernel: the family that runs its fused part."""

    name = ""
    strategy: Optional[str] = None
    collective = Collective.NONE
    kernel: Optional[Family] = None

    def accepts(self, call: Call, m: Machine, fused: bool) -> Optional[Sequence[str]]:
        """None when the route takes the call (fused: with the tail in its kernel), else the reasons
        it does not (empty: nothing worth saying, e.g. the other backend's route)."""
        raise NotImplementedError

    def chosen(self, call: Call, m: Machine, fused: bool) -> Optional[str]:
        """Why the route took a call it accepts, where that is worth saying (None: the other routes'
        reasons say it)."""
        return None

    def launcher(self, call: Call, plan: Plan, res: Resources) -> Callable:
        """The call's launcher: launcher(x, residual, weight, scale, out, z) -> the sum (plain) or the
        five outputs (commfuse.kernels.launch)."""
        raise NotImplementedError


class P2PRoute(Route):
    """The P2P all-reduce kernels over the workspace's IPC buffers, one algorithm each. Calibrated: the
    workspace measures where each algorithm beats the next and NCCL (p2p.calibration); `auto` takes an
    algorithm up to its crossover."""

    kernel = P2P_ALLREDUCE

    def __init__(self, algorithm: str):
        self.algorithm = algorithm
        self.name = f"p2p_{algorithm}"
        self.strategy = algorithm
        self.collective = Collective(self.name)

    def accepts(self, call, m, fused):
        if m.strategy == "nccl":
            return ("strategy 'nccl': P2P all-reduce not used",)
        if m.mode != "p2p":
            return tuple(m.mode_reasons) or (f"topology mode {m.mode!r}: no P2P all-reduce",)
        limits = m.limits
        if limits is None:
            if m.world_size > MAX_WORLD:  # the Communicator makes no workspace for it
                return (f"world size {m.world_size} > {MAX_WORLD}: no P2P kernels for it, no P2P workspace",)
            return ("no P2P workspace",)
        if call.x.device.type != "cuda":
            return ()
        if fused and call.post:
            return ("post_weight: the P2P kernels have no post-norm (the NCCL route's tail kernel has)",)
        why = _rejects(self.kernel, call, m, call.spec if fused else None, numel=call.x.numel)
        if why:
            return (why,)
        size = call.message_bytes
        # A separated tail leaves the P2P kernel a plain all-reduce, cut into pieces of any 16 bytes.
        row_bytes = call.hidden * call.x.dtype.itemsize if fused else 16
        if size > limits.workspace_bytes and not chunk_rows(row_bytes, call.spec if fused else None,
                                                            limits.workspace_bytes):
            return (f"message {size} B > P2P workspace {limits.workspace_bytes} B, which holds no piece of it "
                    f"(a row, or 128 rows for swizzled scale factors)" + ("" if fused else f": {_fallback(m)}"),)
        # The one-shot's buffers bound it whatever the crossovers say: a larger message would overrun them.
        oneshot_bytes = limits.oneshot_bytes if limits.oneshot_bytes is not None else limits.workspace_bytes
        forced = m.strategy in ("oneshot", "twoshot")
        if self.algorithm == "oneshot":
            if m.strategy == "twoshot":
                return ()
            if size > oneshot_bytes:
                return (f"message {size} B > one-shot buffers {oneshot_bytes} B: two-shot",) if forced else ()
            if forced or size <= limits.crossover("oneshot"):
                return None
            return ()
        if forced or size <= limits.crossover(self.algorithm):
            return None
        source = "measured" if limits.measured else "default"
        return (f"message {size} B above the {source} P2P crossover {limits.crossover(self.algorithm)} B: "
                f"{_fallback(m)}",)

    def chosen(self, call, m, fused):
        if m.strategy in ("oneshot", "twoshot"):  # forced; a forced one-shot that went two-shot said why
            return f"strategy {m.strategy!r}" if m.strategy == self.algorithm else None
        limits, size = m.limits, call.message_bytes
        source = "measured" if limits.measured else "a default: not calibrated on this machine"
        name = self.algorithm.replace("shot", "-shot")
        within = f"<= the {name} crossover {limits.crossover(self.algorithm)} B ({source})"
        if self.algorithm == "oneshot":
            return f"message {size} B {within}"
        oneshot_bytes = limits.oneshot_bytes if limits.oneshot_bytes is not None else limits.workspace_bytes
        above = (f"> the one-shot buffers {oneshot_bytes} B" if size > oneshot_bytes else
                 f"> the one-shot crossover {limits.crossover('oneshot')} B")
        pieces = f", in pieces of the {limits.workspace_bytes} B workspace" if size > limits.workspace_bytes else ""
        return f"message {size} B {above}, {within}{pieces}"

    def launcher(self, call, plan, res):
        ws = res.workspace
        if call.spec is None:
            return native.launcher(self.kernel.plan_plain(ws, call.x.dtype, call.x.shape, self.algorithm))
        return native.launcher(self.kernel.plan_fused(ws, call.x.dtype, call.tokens, call.hidden, call.spec,
                                                      self.algorithm))


class NcclRoute(Route):
    """NCCL's all-reduce (in T, in NCCL's order: the semantics accept it on this route), through
    commfuse.nccl's own communicator where it loads (x summed straight into the residual output, which
    the fused_tail kernel then updates in place), else torch.distributed on a copy of x."""

    name = strategy = "nccl"
    collective = Collective.NCCL
    kernel = FUSED_TAIL

    def accepts(self, call, m, fused):
        return None if m.backend == "nccl" else ()

    def launcher(self, call, plan, res):
        x = call.x
        fused = call.spec is not None
        if res.nccl is not None:
            if fused:
                return native.launcher(FUSED_TAIL.plan(x.dtype, call.tokens, call.hidden, call.spec,
                                                       res.device.index, nccl=res.nccl, post=call.post))
            return native.launcher(LaunchPlan("ncclAllReduce", (), (OutputSpec(x.shape, x.dtype),), res.device.index,
                                              res.nccl, x.numel))
        first = _TorchAllReduce(res.group)
        return _Then(first, _tail_kernel(call, res), outputs_of(call)) if fused else first


class GlooRoute(Route):
    """gloo (CPU tensors, or ranks sharing a GPU): every rank's x all-gathered and summed in fp32 in rank
    order, rounded once, so every rank gets the reference's bits; then the fused_tail kernel on CUDA
    tensors. Not capturable in a CUDA graph (gloo works on the host)."""

    name = "gloo"
    collective = Collective.GLOO
    kernel = FUSED_TAIL

    def accepts(self, call, m, fused):
        return None if m.backend == "gloo" else ()

    def launcher(self, call, plan, res):
        first = _GlooSum(res, describe(call, plan))
        return _Then(first, _tail_kernel(call, res), outputs_of(call)) if call.spec is not None else first


class LocalRoute(Route):
    """commfuse.local's fused_add_rmsnorm: the fused_tail kernel on x itself (no collective; without a
    residual a plain RMSNorm + quantization)."""

    name = "local"
    kernel = FUSED_TAIL

    def accepts(self, call, m, fused):
        why = tail_guard(call, m) or _rejects(self.kernel, call, m, call.spec)
        return (why,) if why else None

    def launcher(self, call, plan, res):
        return native.launcher(self.kernel.plan(call.x.dtype, call.tokens, call.hidden, call.spec,
                                                call.x.device.index, residual=call.residual is not None,
                                                post=call.post))


class IdentityRoute(LocalRoute):
    """A call of one rank of an NCCL group, under any strategy but "nccl": the all-reduce of one rank is x
    itself, so a fused call is the local route's kernel on x, the bits of NCCL's copy then the tail, without NCCL's
    launch and the watchdog's two marks (at 1 x 4096 on an H200, bench/results/2026-12-05-h200-s31-moe-w1.txt: the
    tail kernel 1.7 us, the NCCL route 6.2), and a plain one a copy of x into a new tensor (or the caller's out), a
    device-to-device copy where NCCL would launch its kernel. strategy="nccl" (the NCCL route's tests on one GPU)
    and a gloo group of one rank (CPU tensors) keep their collective."""

    name = "identity"
    collective = Collective.NONE

    def accepts(self, call, m, fused):
        return None if m.world_size == 1 and m.backend == "nccl" and m.strategy != "nccl" else ()

    def chosen(self, call, m, fused):
        return "one rank: its all-reduce is x itself, so no collective runs (strategy 'nccl' runs NCCL's)"

    def launcher(self, call, plan, res):
        if call.spec is not None:
            return super().launcher(call, plan, res)
        return native.launcher(LaunchPlan(self.name, (), (OutputSpec(call.x.shape, call.x.dtype),), res.device.index,
                                          copy=True))


class GatedRoute(Route):
    """commfuse.local's gated_rmsnorm: the gated RMSNorm kernel (h <= 16384, whole-vector groups)."""

    name = "gated"
    kernel = GATED_NORM

    def accepts(self, call, m, fused):
        why = tail_guard(call, m) or _rejects(self.kernel, call, m, call.spec, group_size=call.group_size)
        return (why,) if why else None

    def launcher(self, call, plan, res):
        return native.launcher(self.kernel.plan(call.x.dtype, call.tokens, call.hidden, call.spec, call.group_size,
                                                call.norm_before_gate, call.x.device.index))


class QuantizeRoute(Route):
    """commfuse.local's quantize: the quantize kernel (h <= 16384)."""

    name = "quantize"
    kernel = QUANTIZE

    def accepts(self, call, m, fused):
        why = tail_guard(call, m) or _rejects(self.kernel, call, m, call.spec)
        return (why,) if why else None

    def launcher(self, call, plan, res):
        return native.launcher(self.kernel.plan(call.x.dtype, call.tokens, call.hidden, call.spec,
                                                call.x.device.index))


class SeparatedRoute(Route):
    """commfuse.reference's ops: after the collective route's plain all-reduce, or on a local op's input.
    Takes every call: it is the oracle."""

    name = "separated"

    def accepts(self, call, m, fused):
        return None

    def launcher(self, call, plan, res):
        spec = call.spec
        if call.op == "gated":
            tail = _SeparatedGated(spec, call.group_size, call.norm_before_gate)
        elif call.op == "quantize":
            tail = _SeparatedQuantize(spec)
        else:
            tail = _SeparatedTail(spec, outputs_of(call))
        if plan.collective is Collective.NONE:
            return tail
        if plan.collective is Collective.GLOO:  # its exchange checks the whole call, tail included
            return _Then(_GlooSum(res, describe(call, plan)), tail, outputs_of(call))
        plain = Call("plain", call.x)  # the collective route's plain all-reduce of x
        return _Then(ROUTES[str(plan.collective)].launcher(plain, plan, res), tail, outputs_of(call))


_P2P_ROUTES = (P2PRoute("oneshot"), P2PRoute("twoshot"))
COLLECTIVE_ROUTES: Tuple[Route, ...] = (IdentityRoute(),) + _P2P_ROUTES + (NcclRoute(), GlooRoute())
ROUTES = {r.name: r for r in COLLECTIVE_ROUTES + (LocalRoute(), GatedRoute(), QuantizeRoute(), SeparatedRoute())}
# strategy=: "auto" (the routes in order, P2P up to its crossovers), or a forceable route's name.
STRATEGIES = ("auto",) + tuple(r.strategy for r in COLLECTIVE_ROUTES if r.strategy)


def plan(call: Call, m: Machine) -> Plan:
    """The route of `call` on machine `m`, with the reasons."""
    reasons: list = []
    if call.op in ("plain", "fused"):
        return _collective_plan(call, m, reasons)
    route = ROUTES[call.op]  # a local op's route has the op's name
    why = route.accepts(call, m, True)
    if why is None:
        return Plan(Collective.NONE, TailRoute.FUSED, route.kernel.name, (), route.name)
    return Plan(Collective.NONE, TailRoute.SEPARATED, None, tuple(why), "separated")


def _first_route(call: Call, m: Machine, fused: bool, reasons: list) -> Route:
    """The first collective route that takes the call (fused: with its tail), the others' reasons added."""
    for route in COLLECTIVE_ROUTES:
        why = route.accepts(call, m, fused)
        if why is None:
            return route
        reasons.extend(why)
    raise RuntimeError(f"no route takes a call over the {m.backend!r} backend")  # the backend's route takes all


def _collective_plan(call: Call, m: Machine, reasons: list) -> Plan:
    fused = False
    if call.spec is not None:
        why = tail_guard(call, m)
        if why:
            reasons.append(why)
        fused = why is None
    route = _first_route(call, m, fused, reasons)
    if fused and not isinstance(route, P2PRoute) and (m.strategy in ("oneshot", "twoshot") or
                                                      _rejects(route.kernel, call, m, call.spec)):
        # The P2P kernel refused the fused tail (its hidden-size limit; no 128 rows of swizzled scale factors fit
        # the workspace), not the all-reduce: where the group's own collective cannot fuse the tail either, or
        # the strategy forces P2P, the P2P all-reduce runs with the tail separated, as it would with fusion off.
        plain, skipped = None, []  # skipped: why a P2P algorithm passed over takes no plain all-reduce either
        for p2p_route in _P2P_ROUTES:
            why = p2p_route.accepts(call, m, False)
            if why is None:
                plain = p2p_route
                break
            skipped.extend(why)
        if plain is not None:
            why = (f"strategy {m.strategy!r}" if m.strategy in ("oneshot", "twoshot") else
                   f"{route.name} cannot fuse the tail either")
            reasons += [f"the P2P all-reduce with the tail separated ({why})", *skipped]
            route, fused = plain, False
    why = route.chosen(call, m, fused)
    if why:
        reasons.append(why)
    reasons = tuple(dict.fromkeys(reasons))  # the P2P routes share their first reasons
    p2p = isinstance(route, P2PRoute)
    if call.spec is None:
        return Plan(route.collective, TailRoute.NONE, route.kernel.name if p2p else None, reasons, route.name)
    if p2p:
        tail = TailRoute.FUSED if fused else TailRoute.SEPARATED
        return Plan(route.collective, tail, route.kernel.name, reasons, route.name if fused else "separated")
    why = _rejects(route.kernel, call, m, call.spec) if fused else None
    if fused and why is None:
        return Plan(route.collective, TailRoute.FUSED, route.kernel.name, reasons, route.name)
    return Plan(route.collective, TailRoute.SEPARATED, None, reasons + ((why,) if why else ()), "separated")


def launcher(call: Call, plan: Plan, res: Resources) -> Callable:
    """The launcher of a planned call (the plan's route makes it)."""
    return ROUTES[plan.route].launcher(call, plan, res)


# --------------------------------------------------------------------------- the launchers without kernels


def _tail_kernel(call: Call, res: Resources):
    """The fused_tail kernel's launcher, reading the collective's sum as x."""
    return native.launcher(FUSED_TAIL.plan(call.x.dtype, call.tokens, call.hidden, call.spec, res.device.index,
                                           post=call.post))


def outputs_of(call: Call):
    """The OutputSpecs of a tail call's outputs."""
    return call.spec.outputs(call.tokens, call.hidden, call.x.dtype, call.residual is not None)


class _Then:
    """A collective's plain all-reduce, then a tail on its sum."""

    __slots__ = ("first", "tail", "outputs")

    def __init__(self, first, tail, outputs):
        self.first, self.tail, self.outputs = first, tail, outputs  # the tail's OutputSpecs

    def __call__(self, x, residual=None, weight=None, scale=None, out=None, z=None, note: str = "",
                 inputs: tuple = ()):
        """note, inputs: a MoE call's (commfuse.moe.Launcher): more of the call for the gloo sum to compare
        (_GlooSum), and its combine's inputs ((name, tensor or None)), which out may not overlap either."""
        total = self.first(x, note=note) if note else self.first(x)
        if out is not None:  # the tail checks its own inputs; x is the collective's
            no_overlap(OUT_NAMES, fields_of(out), self.outputs, (("x", x), *inputs))
        return self.tail(total, residual, weight, scale, out, z)


class _TorchAllReduce:
    """torch.distributed's all_reduce, which works in place: on a copy of x (x is the caller's)."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def __call__(self, x, residual=None, weight=None, scale=None, out=None, z=None):
        if out is None:
            out = x.clone(memory_format=torch.contiguous_format)
        else:
            out_placed(("out",), (out,), (None,))
            no_overlap(("out",), (out,), (None,), (("x", x),))
            out.copy_(x)
        dist.all_reduce(out, group=self.group)
        return out


def describe(call: Call, plan: Plan) -> str:
    """The call as every rank must make it alike: op, dtype, shape, tail spec and route, in words."""
    tail = "" if call.spec is None else f", {call.spec.signature}{scale_form(call)}{', post-norm' * call.post}"
    # Not the tail's route: ranks of different SMs each pick their own, after the exchange.
    return f"{call.op}({call.x.dtype}, {list(call.x.shape)}{tail}) on {plan.collective}"


def scale_form(call: Call) -> str:
    """How the call gives a scale its format takes, in words ("" where it takes none): ranks must give it
    alike, since a Python number keeps the tail off the fused kernels and so changes the P2P kernel."""
    if call.spec is None or not call.spec.format.takes_scale:
        return ""
    return ", scale a tensor" if call.scale is not None else ", scale a Python number"


class CallMismatchError(ValueError):
    """Ranks made different calls at the same point of a collective sequence (every rank raises it,
    with every rank's call in the message)."""


class CallTimeoutError(RuntimeError):
    """Not every rank made this call within the call check's timeout (COMMFUSE_GLOO_TIMEOUT_S: the gloo
    route's exchange, or COMMFUSE_CHECK's on any route): a rank skipped it, died, or lags that far behind.
    The communicator is unusable afterwards (docs/guards.md section 5)."""


BROKEN_CHECK_GROUPS: list = []  # check groups a call timed out on (their pairs are closed): never reused


def exchange_signature(check_group, text: str, nbytes: int, payload=None, room: int = 0) -> Optional[list]:
    """Compare one call across the ranks of `check_group` (a gloo group whose timeout bounds the wait): one
    all-gather of the same size on every rank, a 64-bit digest of the call's text and its byte size, and `room`
    bytes more that carry `payload` (x, contiguous, on any device) where it fits. Returns every rank's
    payload where it travelled, else None. Raises CallMismatchError on every rank, naming every rank's
    call, where any signature differs, and CallTimeoutError where a rank did not take part in time."""
    world = dist.get_world_size(check_group)
    inline = payload is not None and nbytes <= room
    device = payload.device if payload is not None else torch.device("cpu")
    mine = torch.zeros(16 + room, dtype=torch.uint8, device=device)
    # BLAKE2b: two different calls' texts agree by chance one time in 2^64 (a CRC's 2^32 could pair mismatched
    # calls within a long run of them); an error's text may hold any character.
    digest = hashlib.blake2b(text.encode(errors="backslashreplace"), digest_size=8).digest()
    mine[:16].copy_(torch.tensor([int.from_bytes(digest, "little", signed=True), nbytes],
                                 dtype=torch.int64).view(torch.uint8))
    if inline and nbytes:
        mine[16:16 + nbytes].copy_(payload.reshape(-1).view(torch.uint8))
    bufs = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(bufs, mine, group=check_group)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:  # gloo's timeout, or a peer's connection closed
        BROKEN_CHECK_GROUPS.append(check_group)
        me = rank_label(check_group, dist.get_rank(check_group))
        raise CallTimeoutError(f"{me}: not every rank made the call {text} within the call check's timeout "
                               f"(COMMFUSE_GLOO_TIMEOUT_S): a rank skipped it, died, or lags that far behind "
                               f"({e})") from None
    heads = torch.stack([b[:16] for b in bufs]).cpu()
    if any(not torch.equal(h, heads[0]) for h in heads):
        mine_text = f"{text}, {nbytes} bytes"
        texts: list = [None] * world
        try:
            dist.all_gather_object(texts, mine_text, group=check_group)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:  # a peer died or lagged between the two gathers: the mismatch stands
            BROKEN_CHECK_GROUPS.append(check_group)
            me = rank_label(check_group, dist.get_rank(check_group))
            raise CallMismatchError(f"ranks disagree on the call: {me}: {mine_text}; the others' calls did "
                                    f"not come within the call check's timeout ({e})") from None
        calls = "; ".join(f"{rank_label(check_group, r)}: {t}" for r, t in enumerate(texts))
        raise CallMismatchError(f"ranks disagree on the call: {calls}")
    if not inline:
        return None
    return [b[16:16 + nbytes].view(payload.dtype).view(payload.shape) for b in bufs]


def refuse(check_group, call: str, error: Exception, payload=None, room: int = 0, caller: str = "") -> None:
    """Raise `error`, this rank's for a call its peers make, after taking part in their exchange of it
    (exchange_signature's arguments payload and room as theirs), its text `call`, "<Error>: <message>", then
    `caller` (Resources.caller): its
    peers raise CallMismatchError naming it rather than pair the exchange with this rank's next call. Where
    a peer skipped the call, the error is caused by the CallTimeoutError: the check group is broken."""
    cause = None
    try:
        exchange_signature(check_group, f"{call} {type(error).__name__}: {error}{caller}", 0, payload, room)
    except CallMismatchError:
        pass  # the peers' side of it: this rank raises its own error
    except CallTimeoutError as timeout:
        cause = timeout
    try:
        if cause is not None:
            raise error from cause
        raise error
    finally:  # this frame, in the error's traceback, must not hold it: the cycle would keep every frame of the
        del error, cause  # call (its tensors, the Communicator's groups) until a garbage collection


GLOO_INLINE_BYTES = 16384  # a decode step's rows (8192 bf16 elements) travel with the gloo route's signature


class _GlooSum:
    """Every rank's x, gathered and summed in fp32 in rank order (reference.all_reduce_sum).

    The ranks first compare the call (exchange_signature: `describe`'s text and x's size): gloo would
    abort on payloads of different sizes and sum payloads of different shapes or dtypes as if they
    matched, so a mismatched call raises CallMismatchError on every rank instead. x travels with the
    signature where it fits (GLOO_INLINE_BYTES): then the exchange is the call's only collective; a larger x
    follows in a second one. COMMFUSE_GLOO_CHECK=0 (Resources.gloo_check: the Communicator's, agreed by the
    ranks when it was made) leaves the signature out (x alone, one collective). The exchange goes over the
    Communicator's check group, whose timeout (COMMFUSE_GLOO_TIMEOUT_S) bounds the wait for a rank that
    skipped the call or died."""

    __slots__ = ("group", "check_group", "text", "checked")

    def __init__(self, res: Resources, text: str):
        self.group, self.text = res.group, text + res.caller
        self.check_group = res.check_group if res.check_group is not None else res.group
        self.checked = res.gloo_check

    def __call__(self, x, residual=None, weight=None, scale=None, out=None, z=None, note: str = ""):
        """note: more of the call, compared with the rest (a MoE call's combine: commfuse.moe.Launcher)."""
        xc = x.contiguous()
        text = f"{self.text}, {note}" if note else self.text
        xs = exchange_signature(self.check_group, text, xc.numel() * xc.element_size(), xc,
                                GLOO_INLINE_BYTES) if self.checked else None
        if xs is None:
            xs = [torch.empty_like(xc) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(xs, xc, group=self.group)
        total = reference.all_reduce_sum(xs)
        if out is None:
            return total
        # After the exchange, which every rank then has made: a rank that raises stays in step.
        out_placed(("out",), (out,), (None,))
        no_overlap(("out",), (out,), (None,), (("x", x),))
        return out.copy_(total)


def _write_out(outputs: tuple, out, specs) -> tuple:
    """The outputs, copied into the caller's tensors of `out` where it gives one (computed whole first:
    out.residual may be the residual input). MN-major scales (an OutputSpec with strides) get their whole
    storage, padding rows included, as the fused kernels write it."""
    if out is None:
        return outputs
    written = []
    for mine, theirs, spec in zip(fields_of(out), outputs, specs):
        if mine is None or theirs is None:
            written.append(theirs)
            continue
        if spec.strides is not None:
            n = spec.storage_numel
            torch.as_strided(mine, (n,), (1,)).copy_(torch.as_strided(theirs, (n,), (1,)))
        else:
            mine.copy_(theirs)
        written.append(mine)
    return tuple(written)


def _dense(t):
    """A row input as the kernels read it (they copy a strided one): the separated ops then return dense
    [t, h] outputs, as the kernels and the ops' fakes do, whatever the input's strides."""
    return None if t is None else t.contiguous()


class _SeparatedTail:
    __slots__ = ("spec", "outputs")

    def __init__(self, spec: TailSpec, outputs):
        self.spec, self.outputs = spec, outputs  # the signature's OutputSpecs

    def __call__(self, x, residual=None, weight=None, scale=None, out=None, z=None):
        s = self.spec
        if scale is not None:
            scale_value(scale)  # a CPU tensor's value, which a later call of the signature may change
        if out is not None:
            given = fields_of(out)
            out_placed(OUT_NAMES, given, self.outputs)
            no_overlap(OUT_NAMES, given, self.outputs,
                       (("x", x), ("residual", residual), ("weight", weight), ("scale", scale), ("post_weight", z)))
        with torch.no_grad():  # outside autograd, as the kernels: no output (nor out= tensor) gains a history
            tail = reference.fused_tail(_dense(x), _dense(residual), weight, s.eps, scale=scale, post_weight=z,
                                        **s.reference_kwargs())
            return _write_out(tuple(tail), out, self.outputs)


class _SeparatedGated:
    __slots__ = ("spec", "group_size", "norm_before_gate")

    def __init__(self, spec: TailSpec, group_size: int, norm_before_gate: bool):
        self.spec, self.group_size, self.norm_before_gate = spec, group_size, norm_before_gate

    def __call__(self, x, residual=None, weight=None, scale=None, out=None, z=None):
        s = self.spec
        if scale is not None:
            scale_value(scale)
        with torch.no_grad():  # as _SeparatedTail
            norm = reference.gated_rmsnorm(_dense(x), _dense(z), weight, s.eps, self.group_size, self.norm_before_gate)
            if s.quant is None:
                return None, norm, None, None, None
            q, sf, scales = reference.quantize(norm, s.quant, scale, s.sf_layout, s.scale_layout, s.scale_ue8m0)
        return None, norm if s.return_norm else None, q, sf, scales


class _SeparatedQuantize:
    __slots__ = ("spec",)

    def __init__(self, spec: TailSpec):
        self.spec = spec

    def __call__(self, x, residual=None, weight=None, scale=None, out=None, z=None):
        s = self.spec
        if scale is not None:
            scale_value(scale)
        with torch.no_grad():  # as _SeparatedTail
            q, sf, scales = reference.quantize(_dense(x), s.quant, scale, s.sf_layout, s.scale_layout, s.scale_ue8m0)
        return None, None, q, sf, scales
