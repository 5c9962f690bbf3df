"""Communicator: the public entry point. Owns the group, its topology, the P2P workspace, commfuse.nccl's
communicator and the plan table.

The data path reads top-down: the plan table (a signature seen before: its launcher runs at once) ->
on a miss, the tail spec and the argument checks (commfuse.tail) -> the route (commfuse.routes) -> its
launcher (commfuse.kernels), which the table keeps -> the kernels, whose one device tail is
csrc/epilogue.cuh.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import os
import weakref
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from . import env, moe, nccl, ops, p2p, routes, topology
from .distributed import rank_label
from .kernels import jit, moe_tail, native
from .kernels.moe_combine import index_limits
from .kernels.p2p_allreduce import P2P_ALLREDUCE
from .kernels.table import MAX_ENTRIES
from .local import Quantized
from .reference import Tail
from .routes import Call, Collective, Machine, Plan, Resources
from .tail import checks
from .tail.spec import TailSpec

__all__ = ["Communicator", "FusedResult", "STRATEGIES"]

STRATEGIES = routes.STRATEGIES
GLOO_TIMEOUT_S = 10.0  # the gloo route's wait for every rank's call (COMMFUSE_GLOO_TIMEOUT_S)
# group -> {(ranks, timeout): the gloo check group its Communicators share}. Keyed on the group object, not its
# name: torch names groups by a counter that destroy_process_group() resets, so a world made again after it has
# the old one's name, maybe with other members.
_CHECK_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MADE_CHECK_GROUPS: list = []  # every check group made, held for the exit handler (the table above lets go of them)
# The last number given to a Communicator of each group (Communicator._agreed_settings: the ranks agree on it).
# Its call checks name it: the Communicators of one group share a check group, where calls made to two of them in
# different orders would otherwise pair and exchange each other's rows.
_MADE_ON: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@atexit.register
def _drop_gloo_groups() -> None:
    """A gloo group still alive when the interpreter finalizes can abort the process after a clean run
    ("terminate called without an active exception": a worker thread releasing a finished collective's
    tensors needs Python, which no longer runs). So at exit, while Python still runs, commfuse drops its
    own references to gloo groups: each group that nothing else holds is then destroyed, its threads
    joined. The check groups are destroyed too, which an NCCL world's destruction (torch's, never
    commfuse's) would not do; then a garbage collection frees what reference cycles held. The Communicators
    are unusable after that. Registered when commfuse is imported, so it runs after the caller's own exit
    handlers and after init_distributed's destruction of the group it made."""
    try:
        for comm in list(ops.live_communicators()):
            comm._drop_gloo_groups()
    finally:
        for g in _MADE_CHECK_GROUPS + routes.BROKEN_CHECK_GROUPS:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - destroyed already (with the world), or no group any more
                pass
        _CHECK_GROUPS.clear()
        _MADE_CHECK_GROUPS.clear()
        routes.BROKEN_CHECK_GROUPS.clear()
        # Groups that only reference cycles still hold (an exception kept with its traceback, whose frames hold
        # a launcher or a group) would otherwise go at the interpreter's finalization: collected now.
        gc.collect()


@dataclass(slots=True)  # slots: the plan table sets the fields of a hit's result without __init__
class FusedResult:
    """Outputs of `fused_all_reduce` (t = tokens, h = hidden; all on the communicator's device).

    residual: T[t, h], allreduce(x) + residual, rounded to T.
    norm: T[t, h], RMSNorm of `residual`; None when quant is set and return_norm is False.
    quant: the codes: float8_e4m3fn[t, h] (the e4m3 formats: fp8, fp8_per_token, fp8_block, mxfp8) or
        uint8[t, h/2] (nvfp4, two e2m1 codes a byte, even index in the low nibble); None without quant.
    scale_factors: the block scales of nvfp4 (float8_e4m3fn) and mxfp8 (uint8 UE8M0 exponents), in the
        swizzled 128x4 tiles (flat) or linear [t, h / block]; None for the other formats.
    scales: the dequant scales the FP8 formats with computed scales produce: float32[t] (fp8_per_token),
        float32[t, h/128] row-major or MN-major, or UE8M0 exponents (fp8_block: uint8[t, h/128] row-major,
        MN-major packed four to an int32[t, ceil(h/512)]; reference.quantize_fp8_block);
        None otherwise. Every format's fields are its registry entry's (commfuse.tail.formats).
    plan: the route this call took.
    """

    residual: torch.Tensor
    norm: Optional[torch.Tensor]
    quant: Optional[torch.Tensor]
    scale_factors: Optional[torch.Tensor]
    scales: Optional[torch.Tensor]
    plan: Plan


class _Checked:
    """A launcher behind COMMFUSE_CHECK's cross-rank comparison of the call, which runs first every call. What
    the launcher would refuse of the call's own facts, which the signature (the plan table's key) does not
    hold (where the caller's outputs lie, a CPU scale's value: checks.per_call), is checked first and
    compared with it, so that one rank's bad call makes every rank raise rather than leave its peers in
    the collective. outputs: the call's OutputSpecs; inputs: the name of each launcher argument that is an
    input (None for the others), in the launcher's order (x, residual, weight, scale, out, ...)."""

    __slots__ = ("comm", "signature", "inner", "outputs", "inputs")

    def __init__(self, comm: "Communicator", signature: tuple, inner, outputs: tuple, inputs: tuple):
        # A proxy: the Communicator's plan table holds this launcher, and the C++ table's references are not
        # seen by the garbage collector, so a strong one back would keep the Communicator (its workspace) for good.
        self.comm, self.signature, self.inner = weakref.proxy(comm), signature, inner
        self.outputs, self.inputs = outputs, inputs

    def __call__(self, *args):
        out, fused = args[4], len(self.outputs) > 1
        try:
            given = (None,) * len(self.outputs) if out is None else (checks.fields_of(out) if fused else (out,))
            checks.per_call(checks.OUT_NAMES if fused else ("out",), given, self.outputs,
                            tuple((n, a) for n, a in zip(self.inputs, args) if n is not None), args[3])
        except (TypeError, ValueError) as e:
            self.comm.check_same_call(self.signature, refused=e)
        self.comm.check_same_call(self.signature)
        return self.inner(*args)


def compared_settings(strategy: str) -> tuple:
    """((name, value), ...) that a Communicator's ranks compare at its construction, each as it reads them: the
    strategy (the argument, or COMMFUSE_STRATEGY) and the environment's settings that decide which collectives a
    call makes (COMMFUSE_CHECK, COMMFUSE_GLOO_CHECK, COMMFUSE_GLOO_TIMEOUT_S, COMMFUSE_DISABLE_FUSION,
    COMMFUSE_PRETEND_NO_P2P: topology.detect reads it, and a rank alone in the fallback mode would skip the workspace
    its peers make). ValueError naming a variable whose value is none; COMMFUSE_NCCL_TIMEOUT_S is checked too, not
    compared (each rank's watchdog is its own). commfuse-probe compares them as a Communicator does."""
    settings = (("strategy", strategy), ("COMMFUSE_CHECK", env.flag("COMMFUSE_CHECK", False)),
                ("COMMFUSE_GLOO_CHECK", env.flag("COMMFUSE_GLOO_CHECK", True)),
                ("COMMFUSE_GLOO_TIMEOUT_S", env.seconds("COMMFUSE_GLOO_TIMEOUT_S", GLOO_TIMEOUT_S)),
                ("COMMFUSE_DISABLE_FUSION", env.flag("COMMFUSE_DISABLE_FUSION", False)),
                ("COMMFUSE_PRETEND_NO_P2P", env.flag("COMMFUSE_PRETEND_NO_P2P", False)))
    nccl.watchdog_timeout()
    return settings


class Communicator:
    """Sum all-reduce and fused all-reduce tails over a torch.distributed group.

    group: a torch.distributed process group; None = WORLD (init it first, e.g. with
    commfuse.init_distributed()). strategy: "auto" (P2P where the topology allows and it wins, else
    NCCL; a fused call of one rank runs no collective), "nccl" (force the fallback row),
    "oneshot"/"twoshot" (force a P2P algorithm where P2P exists): STRATEGIES. The environment variable
    COMMFUSE_STRATEGY overrides the argument; COMMFUSE_DISABLE_FUSION=1 forces separated ops;
    COMMFUSE_CHECK=1 compares every call's shapes and dtypes across ranks first (raising on all ranks
    instead of hanging).

    Construction is collective. Where the topology's mode is "p2p" (NCCL group on one node, P2P
    between every pair) and the strategy is not "nccl", it creates the P2P workspace
    (commfuse.p2p.Workspace: IPC buffers, about 416 MiB per rank by default) and, for "auto",
    calibrates the one-shot/two-shot/NCCL crossovers (cached on disk); so construct the
    Communicator before any CUDA graph capture. `check()` surfaces a P2P timeout (also one inside a
    graph replay) as commfuse.P2PTimeoutError; `close()` releases the workspace (collective).

    Attributes: group, strategy, backend, topology, device, world_size, name (commfuse.ops' name for it),
    workspace (the P2P workspace or None), table (the plan table, commfuse.kernels.table), nccl_binding
    (which NCCL the NCCL route calls, and why), check_calls.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, strategy: str = "auto"):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call commfuse.init_distributed() first")
        if type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:  # new_group's, on the ranks outside
            raise ValueError(f"this rank ({dist.get_rank()}) is not a member of the group (torch.distributed.new_group "
                             "returns GroupMember.NON_GROUP_MEMBER to the ranks outside it): only its ranks make its "
                             "Communicator")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None (WORLD), got "
                            f"{type(group).__name__}")
        settings = self._agreed_settings(group, strategy)
        self.group = group if group is not None else dist.group.WORLD
        self._caller = f" on communicator {settings['number']} of its group"  # what its call checks' texts end with
        self.strategy, self._gloo_timeout_s = settings["strategy"], settings["COMMFUSE_GLOO_TIMEOUT_S"]
        self.backend = str(dist.get_backend(self.group))
        Collective.of_backend(self.backend)  # nccl or gloo, else a clear error now rather than at a call
        self.topology = topology.detect(self.group)
        # Ranks sharing a GPU exchange over gloo but compute on their GPU (topology.py).
        on_gpu = self.backend == "nccl" or (self.topology.shared_gpu and torch.cuda.is_available())
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        if self.topology.shared_gpu:
            # A launch's successor would wait resident on the GPU under programmatic dependent launch,
            # and under MPS could take the SMs a peer's P2P kernel needs: off while ranks share GPUs.
            jit.disable_pdl("ranks share a GPU")
        self.workspace: Optional[p2p.Workspace] = None
        self._nccl: Optional[nccl.NcclComm] = None
        self.nccl_binding = "none: no NCCL group"
        self.name = ops.register(self)  # how commfuse.ops (torch.compile'd models) reach it
        if self.backend == "nccl":
            self._open_nccl()
        if (self.device.type == "cuda" and self.topology.mode == "p2p"
                and self.world_size in P2P_ALLREDUCE.limits.world_sizes):
            # Creating the workspace is collective: the ranks agreed on the strategy (_agreed_settings).
            if self.strategy != "nccl":
                # Crossovers timed on a shared GPU would say nothing about real machines: defaults.
                self.workspace = p2p.Workspace(self.group, self.device,
                                               calibrate=self.strategy == "auto" and not self.topology.shared_gpu,
                                               topology=self.topology, nccl=self._nccl)
        self._machine = Machine(self.topology.mode, self.backend, self.topology.sm, self.world_size, self.strategy,
                                not settings["COMMFUSE_DISABLE_FUSION"],
                                self.workspace.limits if self.workspace is not None else None,
                                tuple(self.topology.reasons))
        # The gloo route's exchange needs the check group at every call; an NCCL group's Communicator makes
        # it at its first COMMFUSE_CHECK comparison (no gloo connections where nothing checks).
        self._check_group = self._open_check_group() if self.backend == "gloo" else None
        self._gloo_check = settings["COMMFUSE_GLOO_CHECK"]
        self._resources = Resources(self.group, self.device, self.workspace, self._nccl, self._check_group,
                                    self._gloo_check, self._caller)
        # A hit must not skip the P2P error check: the table reads the workspace's error word itself.
        self.table = native.table(self.name, self.workspace.error_word() if self.workspace is not None else 0,
                                  FusedResult, Tail, Quantized)
        self._check_calls = settings["COMMFUSE_CHECK"]
        # moe_all_reduce's one-launch routes: by "fused" or the P2P signature ((plan, launcher) or None)
        self._moe_plans: dict = {}

    @staticmethod
    def _agreed_settings(group, strategy: str) -> dict:
        """{name: value} of compared_settings (the strategy: the argument or COMMFUSE_STRATEGY), checked, then
        compared in the construction's first collective. A rank whose own
        are wrong raises its error after taking part, and its peers raise saying so; ranks whose settings differ
        all raise naming them. Raising before that collective would leave the peers waiting in it for the group's
        timeout, then with broken connections. "number": the Communicator's number among its group's, agreed."""
        given = os.environ.get("COMMFUSE_STRATEGY")
        name = "COMMFUSE_STRATEGY" if given else "strategy"  # where the strategy comes from, sent to the peers
        try:
            # The argument is checked even where the variable overrides it: a wrong one is the caller's error.
            for source, value in (("strategy", strategy), (name, given or strategy)):
                if value not in STRATEGIES:
                    raise ValueError(f"{source} must be one of {STRATEGIES}, got {value!r}")
            settings = compared_settings(given or strategy)
            error = None
        except Exception as e:  # noqa: BLE001 - raised after the exchange, on this rank as it was
            settings, error = None, e
        group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        every: list = [None] * world
        dist.all_gather_object(every, (settings if error is None else f"{type(error).__name__}: {error}", name,
                                       _MADE_ON.get(group, 0)), group=group)
        # This Communicator's number among its group's: one more than any rank's last, so the same on every rank.
        number = _MADE_ON[group] = 1 + max(last for _, _, last in every)
        every = [(theirs, source) for theirs, source, _ in every]
        labels = [rank_label(group, r) for r in range(world)]
        del group  # not held by the frame of an error raised below (the exit handlers let go of every gloo group)
        if error is not None:
            raise error
        failed = [f"{labels[r]}: {e}" for r, (e, _) in enumerate(every) if isinstance(e, str)]
        if failed:
            raise ValueError(f"a rank could not make the Communicator ({'; '.join(failed)})")
        if any(theirs != settings for theirs, _ in every):
            differ = [n for i, (n, _) in enumerate(settings) if len({theirs[i][1] for theirs, _ in every}) > 1]
            # The strategy as each rank gave it: the argument, or COMMFUSE_STRATEGY where set.
            raise ValueError("ranks disagree on " + ", ".join(differ) + ": " + "; ".join(
                f"{labels[r]}: {dict(theirs)} (strategy from {'the argument' if source == 'strategy' else source})"
                for r, (theirs, source) in enumerate(every)))
        return dict(settings, number=number)

    def _open_check_group(self):
        """The call checks (the gloo route's signature exchange, and COMMFUSE_CHECK's on every route) run
        over a gloo group of their own whose timeout, COMMFUSE_GLOO_TIMEOUT_S (default 10 s, as the P2P
        route's), bounds how long a call waits for a rank that skipped it or died; the group's own timeout
        stays the caller's for everything else. The Communicators of one group with one timeout share it
        (each gloo group holds sockets and threads) until a call times out on it; those of another group
        over the same ranks do not: their calls, made in another order or from other threads than this
        group's, would pair with this group's in one exchange (sums of each other's rows). A Communicator whose
        call timed out stays unusable; later ones get a new check group.
        Over every rank of the world, every rank takes part in making it, as in any dist.new_group. Over a
        subgroup only its ranks do (the others do not make this Communicator): torch names such a group
        from its ranks and the number of process groups each rank holds, so the ranks of the subgroup
        must hold as many (else making it times out, and this raises saying so)."""
        timeout = self._gloo_timeout_s
        ranks = tuple(dist.get_process_group_ranks(self.group))
        shared = _CHECK_GROUPS.setdefault(self.group, {})
        group = shared.get((ranks, timeout))
        if group is not None:
            # A call that timed out closed the group's connections (on the other ranks too, whether they
            # noticed or not): the ranks agree to make a new one (making it is collective).
            votes: list = [None] * len(ranks)
            dist.all_gather_object(votes, any(g is group for g in routes.BROKEN_CHECK_GROUPS), group=self.group)
            if any(votes):
                group = None
        if group is None:
            whole = len(ranks) == dist.get_world_size()
            try:
                group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout), backend="gloo",
                                       use_local_synchronization=not whole)
            except Exception as e:  # noqa: BLE001 - torch's store timeout, said in commfuse's terms
                if whole:
                    raise
                raise RuntimeError(
                    f"the call checks' gloo group of ranks {list(ranks)} was not made within {timeout:g} s: torch "
                    "names a group that only its ranks make from the number of process groups each rank holds, and "
                    "these ranks likely hold different numbers (a subgroup some of them are in). Make this "
                    "Communicator before such groups (on an NCCL group, its first checked call too: the check group "
                    "is made there), or make the same groups on each of its ranks") from e
            shared[(ranks, timeout)] = group
            _MADE_CHECK_GROUPS.append(group)
        return group

    def _open_nccl(self) -> None:
        """The NCCL route's own NCCL communicator (commfuse.nccl): torch.distributed's all_reduce and
        the copy it needs cost tens of microseconds of host time a call, ncclAllReduce a few. Every
        rank must take the same decision (creating it is collective), so the ranks agree first: whether
        to use it, and whether to make the group's anew, where any rank's has failed (a watchdog's abort,
        a peer's error), rather than hand this Communicator one whose first call raises; and where a rank holds
        none (the first Communicator, or one whose making failed there), since making it is collective."""
        why = "COMMFUSE_NCCL=0" if not env.flag("COMMFUSE_NCCL", True) else nccl.available()
        usable = why is None and nccl.shared_usable(self.group, self.device)
        whys: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(whys, (why, usable), group=self.group)
        why = next((f"{rank_label(self.group, r)}: {w}" for r, (w, _) in enumerate(whys) if w), None)
        if why is None:
            self._nccl = nccl.shared(self.group, self.device, renew=not all(u for _, u in whys))
            self.nccl_binding = f"commfuse.nccl (NCCL {self._nccl.version})"
        else:
            self.nccl_binding = f"torch.distributed ({why})"

    @property
    def check_calls(self) -> bool:
        """Whether every call compares its signature across the ranks first (COMMFUSE_CHECK=1); it may
        be turned off (or on) for this communicator, alike on every rank. On a gloo group, ranks set apart
        raise CallMismatchError at their next call (the comparison and the gloo route's exchange are of one
        size; with COMMFUSE_GLOO_CHECK=0, no exchange, those that check raise CallTimeoutError and the others
        wait for the process group's timeout); on an NCCL group nothing compares a rank that does not check
        with one that does."""
        return self._check_calls

    @check_calls.setter
    def check_calls(self, on: bool) -> None:
        if not isinstance(on, bool):  # bool("0") is True
            raise TypeError(f"check_calls must be a bool, got {on!r}")
        self._check_calls = on
        self.table.clear()  # the launchers of the other setting: with the check, or without it

    @property
    def _check_room(self) -> int:
        """Bytes past the 16 of a signature in COMMFUSE_CHECK's comparison: on a gloo group as many as the gloo
        route's exchange carries (routes.GLOO_INLINE_BYTES), so that a rank comparing its call and a peer that
        does not meet in exchanges of one size, which raise CallMismatchError (gloo aborts the process on
        payloads of different sizes); none on an NCCL group (no gloo route there)."""
        return routes.GLOO_INLINE_BYTES if self.backend == "gloo" else 0

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    # ---------------------------------------------------------------- planning (a signature's first call)

    def _call(self, x, residual, weight, scale, out, spec: Optional[TailSpec], post_weight=None) -> Call:
        """The checked call (raises on one that has no meaning, naming the argument); post_weight: the fused
        call's post-norm weight, its z."""
        if spec is None:
            checks.x_hidden(x, self.device)
            if out is not None:
                checks.out_like(out, x)
            return Call.of("plain", x)
        h = checks.tail(x, residual, weight, scale, spec, self.device, post_weight=post_weight)
        if out is not None:
            checks.out(out, spec.outputs(x.numel() // h, h, x.dtype), self.device,
                       (("x", x), ("residual", residual), ("weight", weight), ("scale", scale),
                        ("post_weight", post_weight)))
        return Call.of("fused", x, residual, weight, scale, post_weight, spec=spec)

    @staticmethod
    def _spec(eps, quant, return_norm, sf_layout, weight_offset, scale_layout, scale_ue8m0) -> TailSpec:
        return TailSpec.of(quant, return_norm=return_norm, eps=eps, weight_offset=weight_offset, sf_layout=sf_layout,
                           scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)

    def plan(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
             weight: Optional[torch.Tensor] = None, *, eps: float = 1e-6, quant: Optional[str] = None,
             scale: Union[torch.Tensor, float, None] = None, return_norm: bool = False,
             sf_layout: str = "swizzled", weight_offset: float = 0.0, scale_layout: str = "row",
             scale_ue8m0: bool = False, out=None, post_weight: Optional[torch.Tensor] = None) -> Plan:
        """The route `fused_all_reduce` (or `all_reduce` when residual is None) would take, without
        running it. Arguments as for those (x, residual: T[..., h], weight, post_weight: T[h], scale: float32[1],
        on the communicator's device; out: the caller's output tensors, if any); raises on the same
        argument errors. Not collective."""
        if residual is None:
            checks.plain_plan(Communicator.plan, locals())
            spec = None
        else:
            spec = self._spec(eps, quant, return_norm, sf_layout, weight_offset, scale_layout, scale_ue8m0)
        return routes.plan(self._call(x, residual, weight, scale, out, spec, post_weight), self._machine)

    def _planned(self, first):
        """first(): a call's planning (its checks, its plan, its launcher in the table), which a signature's first
        call runs, and every call the table cannot key (a Python-float scale). Where it raises on this rank, the
        rank still makes the first exchange its peers make in the call, naming its error, then raises that
        error: its peers raise CallMismatchError with it rather than pair that exchange with this rank's next
        call (wrong sums on both, then a timeout). That exchange is COMMFUSE_CHECK's comparison, or the gloo
        route's. Where there is neither (the NCCL and P2P routes without COMMFUSE_CHECK, COMMFUSE_GLOO_CHECK=0),
        or a rank cannot tell which its peers make (ranks sharing a GPU with a P2P workspace, whose larger
        messages take the gloo route), nothing compares the calls: the peers' collective waits for the
        timeout or pairs with this rank's next call, as docs/guards.md says of unchecked calls."""
        try:
            return first()
        except Exception as e:
            if self.world_size > 1 and (self._check_calls or (
                    self.backend == "gloo" and self.workspace is None and self._gloo_check)):
                # On real tensors even where a dispatch mode is on (a FakeTensorMode's tracing, whose fake tensors
                # the checks refuse): the check group's making and the exchange are collectives of their own.
                with _disable_current_modes():
                    if self._check_group is None:  # an NCCL group's, made at every rank's first checked call
                        self._check_group = self._open_check_group()
                    # The buffer as the peers' exchange has it: COMMFUSE_CHECK's on the CPU, the gloo route's with
                    # room for x, on x's device.
                    payload, room = ((None, self._check_room) if self._check_calls else
                                     (torch.empty(0, dtype=torch.uint8, device=self.device), routes.GLOO_INLINE_BYTES))
                    routes.refuse(self._check_group, "a call that raised", e, payload, room, self._caller)
            raise

    def _first(self, op: str, args: tuple, call: Call):
        """Plan a call, put its launcher in the table, and return (plan, launcher). Raises a pending P2P
        error first (the table misses while one is pending)."""
        if self.workspace is not None:
            self.workspace.check_error()
        p = routes.plan(call, self._machine)
        launcher = routes.launcher(call, p, self._resources)
        if self._check_calls:
            spec = None if call.spec is None else (call.spec.signature + routes.scale_form(call) +
                                                   (", post-norm" if call.post else ""))
            signature = (op, tuple(call.x.shape), str(call.x.dtype), spec, str(p.collective))
            outputs = (None,) if call.spec is None else tuple(routes.outputs_of(call))
            launcher = _Checked(self, signature, launcher, outputs,
                                ("x", "residual", "weight", "scale", None, "post_weight"))
        self.table.insert(op, args, p, launcher)
        return p, launcher

    # ---------------------------------------------------------------- the calls

    def all_reduce(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum of `x` over the group, in a new tensor of x's shape and dtype (x is not modified).

        x: [..., h] with h > 0, fp16 / bf16 / fp32, on the communicator's device (CUDA for NCCL and for
        ranks sharing a GPU, CPU for gloo). out: a caller-owned tensor of x's shape, dtype and device
        (contiguous, not overlapping x) to write the sum into instead, and return: a decode loop then
        allocates nothing.
        """
        y = self.table.plain(x, out)
        if y is None:
            _, launcher = self._planned(lambda: self._first("plain", (x, out), self._call(x, None, None, None, out, None)))
            y = launcher(x, None, None, None, out)
        return y

    def fused_all_reduce(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float = 1e-6, quant: Optional[str] = None,
                         scale: Union[torch.Tensor, float, None] = None, return_norm: bool = False,
                         sf_layout: str = "swizzled", weight_offset: float = 0.0, scale_layout: str = "row",
                         scale_ue8m0: bool = False, out=None,
                         post_weight: Optional[torch.Tensor] = None) -> FusedResult:
        """All-reduce `x`, then residual add, RMSNorm and optional quantization (docs/semantics.md).

        x, residual: T[..., h] (T = fp16, bf16 or fp32, else TypeError; fp32 takes the separated tail), same shape;
        weight: T[h]; all on the communicator's device. scale: the dequant scale (value = code *
        scale) as a float32 tensor of one element on the device (a Python float takes the separated
        path): required for quant "fp8" (per-tensor scale) and "nvfp4" (global scale, amax / (448*6)).
        quant "fp8_per_token" / "fp8_block" compute their scales (scale None; docs/semantics.md), with
        fp8_block's scale_layout ("row" or "mn_major") and scale_ue8m0; weight_offset is added to the
        weight in fp32 (Gemma's (1 + w): 1.0). Layout options that do not apply to the format must keep
        their defaults. Outputs are flattened to [t, h]; see FusedResult.
        out: caller-owned outputs to write instead of fresh tensors (a FusedResult of an earlier call,
        or a commfuse.reference.Tail, or a tuple in its order: residual, norm, quant, scale_factors,
        scales): each a tensor of exactly that output's shape, dtype and strides (contiguous, or for
        MN-major scales the reference's strides over a storage holding the padding rows) on the device,
        16-byte aligned, validated once per call signature; or None, allocated as usual. The outputs may
        overlap neither each other nor an input (checked per call, ValueError), except that out.residual
        may be `residual` itself, or `residual.view(-1, h)` of a contiguous residual of another shape: the
        residual is updated in place (every route reads each residual element before it writes it).
        post_weight: T[h] on the device, a post-norm's weight (Gemma 2 / 3's post_attention_layernorm): the sum is
        first normalised with it, the same eps and weight_offset, then added to the residual (docs/semantics.md
        section 2a); the P2P kernels do not take it (the NCCL route's tail kernel does).
        """
        r = self.table.fused(x, residual, weight, scale, out, eps, quant, return_norm, sf_layout, weight_offset,
                             scale_layout, scale_ue8m0, post_weight)
        if r is None:
            args = (x, residual, weight, scale, out, eps, quant, return_norm, sf_layout, weight_offset,
                    scale_layout, scale_ue8m0, post_weight)

            def first():
                spec = self._spec(eps, quant, return_norm, sf_layout, weight_offset, scale_layout, scale_ue8m0)
                return self._first("fused", args, self._call(x, residual, weight, scale, out, spec, post_weight))
            p, launcher = self._planned(first)
            r = FusedResult(*launcher(x, residual, weight, scale, out, post_weight), plan=p)
        return r

    def moe_all_reduce(self, y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, quant: Optional[str] = None, scale: Union[torch.Tensor, float, None] = None,
                       return_norm: bool = False, sf_layout: str = "swizzled", weight_offset: float = 0.0,
                       scale_layout: str = "row", scale_ue8m0: bool = False, *, row_index: Optional[torch.Tensor] = None,
                       shared: Optional[torch.Tensor] = None, out=None) -> FusedResult:
        """A tensor-parallel MoE layer's end: each rank's expert combine (commfuse.moe.combine), the
        all-reduce of the combined rows, then the residual add, RMSNorm and optional quantization of
        `fused_all_reduce` (docs/semantics.md sections 14 and 1-13).

        y: the rank's expert outputs, T[t, k, h] (token i's j-th expert at y[i, j]), or with row_index the
        permuted rows T[R, h] that grouped-GEMM MoE kernels leave (row_index int32/int64 [t, k]: the row of
        token i's j-th expert, -1 for a slot dropped by capacity); weights: the routing weights [t, k],
        float32 or T; shared: a shared expert's output T[t, h] or None; residual: T[t, h]; weight: T[h];
        all on the communicator's device. The other arguments, the outputs (flattened to [t, h]) and the
        out= rules are fused_all_reduce's; out may overlap none of these inputs either. The plan says how
        the combine ran (plan.combine: "fused", one kernel for the combine and the tail at world size 1, or
        the P2P kernel combining each rank's rows as it reads them; "kernel", the combine kernel on CUDA
        tensors before the collective; "separated", commfuse.reference's ops; with the reasons);
        commfuse.moe documents how each treats a row index outside [-1, R).
        """
        args = (y, weights, row_index, shared, residual, weight, scale, out, eps, quant, return_norm, sf_layout,
                weight_offset, scale_layout, scale_ue8m0)
        r = self.table.moe(*args)
        if r is None:
            p, launcher = self._planned(lambda: self._moe_first(args))
            r = FusedResult(*launcher(y, residual, weight, scale, out, weights, row_index, shared), plan=p)
        return r

    def _moe_first(self, args: tuple):
        """Plan a MoE call (moe_all_reduce's arguments), put its launcher in the table, and return (plan,
        launcher): one launch where it combines as it reads, else a commfuse.moe.Launcher (the combine, then
        the dense call's route). Raises on a call that has no meaning, naming the argument."""
        (y, weights, row_index, shared, residual, weight, scale, out, eps, quant, return_norm, sf_layout,
         weight_offset, scale_layout, scale_ue8m0) = args
        t, _, h = checks.moe(y, weights, row_index, shared, residual, self.device)
        spec = self._spec(eps, quant, return_norm, sf_layout, weight_offset, scale_layout, scale_ue8m0)
        # residual stands for the combined rows (their shape, dtype and device) in the tail's checks
        checks.tail(residual, residual, weight, scale, spec, self.device, x_name="residual")
        if out is not None:
            checks.out(out, spec.outputs(t, h, y.dtype), self.device,
                       (("y", y), ("weights", weights), ("row_index", row_index), ("shared", shared),
                        ("residual", residual), ("weight", weight), ("scale", scale)))
        if self.workspace is not None:
            self.workspace.check_error()
        unfused = moe.fused_rejects(y, weights, residual, weight, scale, spec, self._machine)
        route, why = moe.plan(y, weights, self._machine)
        # The combined rows, which residual stands for: fused_all_reduce's call.
        call = Call.of("fused", residual, residual, weight, scale, spec=spec)
        text = moe.describe(y, weights, row_index, shared)
        one = self._moe_one_launch(y, weights, row_index, residual, weight, scale, spec, unfused is None,
                                   route == "kernel")
        if one is not None:  # one launch that combines as it reads
            p, launcher = one
            if self._check_calls:
                launcher = _Checked(self, (text, spec.signature + routes.scale_form(call), str(p.collective)),
                                    launcher, tuple(spec.outputs(t, h, y.dtype)), moe.LAUNCHER_INPUTS)
        else:  # the combine, then fused_all_reduce's route
            dense = routes.plan(call, self._machine)
            extra = tuple(w for w in (unfused if self.world_size == 1 else None, why) if w)
            p = dataclasses.replace(dense, combine=route, reasons=dense.reasons + extra)
            tail = spec.signature + routes.scale_form(call)
            me = weakref.proxy(self)  # the table's launchers must not keep their Communicator (_Checked says why)
            check = (lambda note, refused=None: me.check_same_call((note, tail, str(p.collective)), refused)) \
                if self._check_calls else None
            launcher = moe.Launcher(route, routes.launcher(call, dense, self._resources), spec.outputs(t, h, y.dtype),
                                    text, dense.collective is Collective.GLOO, check)
        self.table.insert("moe", args, p, launcher)
        return p, launcher

    def _moe_one_launch(self, y, weights, row_index, residual, weight, scale, spec: TailSpec, fused: bool,
                        kernel: bool):
        """(Plan, launcher) of a MoE call whose combine and tail are one launch: the fused MoE tail at world
        size 1 (`fused`: moe.fused_rejects passed), or the P2P kernel that combines each rank's rows as it
        reads them (the MoE variants of commfuse.kernels.p2p_allreduce), where the combine kernel could run
        (`kernel`) and the same call's combined rows would take a fused P2P kernel in one launch; else None
        (the combine, then fused_all_reduce)."""
        t, k = weights.shape
        h = y.shape[-1]
        index_dtype = None if row_index is None else row_index.dtype
        rows = 0 if row_index is None else y.shape[0]
        combine = (weights.dtype, index_dtype, t, k, h, rows)  # the kernels read weights and indices as given
        if fused:
            p = self._moe_plans.get("fused")
            if p is None:
                p = self._moe_plans["fused"] = Plan(Collective.NONE, routes.TailRoute.FUSED, moe.MOE_TAIL.name,
                                                    ("world size 1: no all-reduce; the combine is the tail's input",),
                                                    moe.MOE_TAIL.name, combine="fused")
            return p, moe_tail.launcher(y.dtype, *combine, spec, self.device.index)
        if not kernel or self.workspace is None:
            return None
        key = ("p2p", y.dtype, *combine, spec, isinstance(scale, torch.Tensor))
        if key in self._moe_plans:
            return self._moe_plans[key]
        entry = None
        # The combined rows have residual's shape, dtype and device: their call stands in for the route.
        dense = routes.plan(routes.Call.of("fused", residual, residual, weight, scale, spec=spec), self._machine)
        if (dense.collective.algorithm is not None and dense.tail == routes.TailRoute.FUSED
                and t * h * y.dtype.itemsize <= self.workspace.max_bytes and not index_limits("", t, k, rows)):
            launch_plan = P2P_ALLREDUCE.plan_moe(self.workspace, y.dtype, *combine, spec, dense.collective.algorithm)
            entry = (dataclasses.replace(dense, combine="fused", reasons=dense.reasons + (
                "the combine runs in the P2P kernel, as it reads each rank's rows",)), native.launcher(launch_plan))
        if len(self._moe_plans) >= MAX_ENTRIES:  # as the plan table: varying t and R would grow it for good
            self._moe_plans.clear()
        self._moe_plans[key] = entry
        return entry

    def check(self) -> None:
        """Wait for this rank's queued GPU work, then raise commfuse.P2PTimeoutError if a P2P
        kernel timed out waiting for a peer, commfuse.NcclTimeoutError if the NCCL route's watchdog
        aborted an all-reduce (eager or replayed in a CUDA graph: the wait is bounded by each route's
        timeout). Not collective."""
        if self.workspace is None and self._nccl is None:
            return
        torch.cuda.synchronize(self.device)
        if self.workspace is not None:
            self.workspace.check_error()
        if self._nccl is not None:
            self._nccl.check()

    def close(self) -> None:
        """Release the P2P workspace (collective: every rank calls it); later calls take the group's own
        collective through torch.distributed (NCCL, or gloo), a fused call of one rank none."""
        self.table.clear()  # its launchers may hold the workspace or commfuse.nccl's communicator
        self._moe_plans.clear()  # so may the MoE P2P launchers
        self.table = native.table(self.name, 0, FusedResult, Tail, Quantized)
        workspace, self.workspace = self.workspace, None
        # Planning forgets the workspace before it goes, so that a close() that raises (a peer gone in the
        # teardown's barrier) leaves no route planned on it. The NCCL communicator is the group's, shared with
        # its other Communicators (nccl.shared).
        self._nccl = None
        self.nccl_binding = "torch.distributed (closed)"
        self._machine = dataclasses.replace(self._machine, limits=None)
        self._resources = Resources(self.group, self.device, check_group=self._check_group,
                                    gloo_check=self._gloo_check, caller=self._caller)
        if workspace is not None:
            workspace.close()

    def _drop_gloo_groups(self) -> None:
        """At exit (_drop_gloo_groups): the references to gloo groups, the table's launchers' and the P2P
        workspace's included. An NCCL group is kept: its destruction is torch's (init_distributed's docstring
        says why). A Communicator whose construction raised has only some of its attributes."""
        self._check_group = None
        resources = getattr(self, "_resources", None)
        if resources is not None:
            self._resources = dataclasses.replace(resources, check_group=None)
        if getattr(self, "backend", None) == "gloo":
            if hasattr(self, "table"):
                self.table.clear()
                self._moe_plans.clear()
            self.group = self._resources = None
            if getattr(self, "workspace", None) is not None:  # ranks sharing a GPU: kept for its close
                self.workspace.group = None

    def check_same_call(self, signature: tuple, refused: Optional[Exception] = None) -> None:
        """Raise on every rank when ranks disagree on a call (a mismatched collective would hang or sum the
        wrong bytes): COMMFUSE_CHECK's comparison of `signature`, one all-gather over the check group
        (routes.exchange_signature; 16 bytes, and _check_room's on a gloo group): CallMismatchError naming
        every rank's call, or CallTimeoutError after COMMFUSE_GLOO_TIMEOUT_S where a rank skipped the call. An NCCL group's Communicator makes its
        check group here, at its first comparison: every rank's first checked call, a collective point.
        refused: this rank's error for its call, compared as part of it (its peers raise CallMismatchError
        naming it; where every rank has the same, none does), then raised."""
        if self._check_group is None:
            self._check_group = self._open_check_group()
        if refused is not None:
            try:
                routes.refuse(self._check_group, f"{signature}, refused", refused, None, self._check_room,
                              self._caller)
            finally:  # this frame, in the error's traceback, must not hold it (routes.refuse says why)
                del refused
        routes.exchange_signature(self._check_group, f"{signature}{self._caller}", 0, None, self._check_room)
