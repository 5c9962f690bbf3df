"""Communicator: the public entry point. Owns the group, its topology and the P2P workspace.

The data path reads top-down: argument checks -> plan (plan.py) -> collective -> tail (a fused
kernel, or commfuse.reference's separated ops).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import epilogue, fused_tail, jit, native, nccl, ops, p2p, reference, topology
from .plan import (Collective, Plan, Request, TailRoute, TensorMeta, check_arguments, make_plan,
                   registered_kernels)

STRATEGIES = ("auto", "nccl", "oneshot", "twoshot")
_PLAIN = (0.0, "row", False)  # a plain all-reduce's (weight_offset, scale_layout, scale_ue8m0) in its key
_LATER = object()  # the launcher of a signature plan() cached: made at the signature's first call
_MAX_PLANS = 4096


def _tail_of(r) -> tuple:
    return (r.residual, r.norm, r.quant, r.scale_factors, getattr(r, "scales", None))


def _copy_out(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    """One separated-route output into the caller's tensor; an MN-major view's whole storage, as the
    fused kernels write its padding too."""
    if mine.is_contiguous() or mine.dim() != 2:
        mine.copy_(theirs)
        return
    n = mine.shape[1] * mine.stride(1)
    torch.as_strided(mine, (n,), (1,)).copy_(torch.as_strided(theirs, (n,), (1,)))


def _out_key(out) -> tuple:
    """What the checks read of caller-owned outputs (a tensor, a Tail or a FusedResult), or ()."""
    if out is None:
        return ()
    if isinstance(out, torch.Tensor):
        return _key(out)
    return tuple(_key(t) for t in _tail_of(out))


def _signature(x, residual, weight, scale, out) -> tuple:
    """What the checks and guards read of a call's tensors (the plan cache's key). The fused call's
    three tensors are spelt out flat: building and hashing nested tuples is a microsecond of every
    call's host time."""
    if isinstance(residual, torch.Tensor) and isinstance(weight, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.device, residual.shape, residual.stride(), residual.dtype,
                residual.device, weight.shape, weight.stride(), weight.dtype, weight.device, _key(scale),
                _out_key(out))
    return (_key(x), _key(residual), _key(weight), _key(scale), _out_key(out))


def _key(v) -> tuple:
    """What the checks and guards read of an argument: a tensor's metadata, else its type."""
    if isinstance(v, torch.Tensor):
        return (v.shape, v.stride(), v.dtype, v.device)
    return (type(v),)


def _fresh_rows(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous [t, h] tensor of x's dtype and device (empty_like is the cheap call)."""
    if x.dim() == 2 and x.is_contiguous():
        return epilogue._empty_like(x)
    return epilogue._empty((x.numel() // x.shape[-1], x.shape[-1]), dtype=x.dtype, device=x.device)


@dataclass(slots=True)  # slots: the native table sets the fields of a hit's result without __init__
class FusedResult:
    """Outputs of `fused_all_reduce` (t = tokens, h = hidden; all on the communicator's device).

    residual: T[t, h], allreduce(x) + residual, rounded to T.
    norm: T[t, h], RMSNorm of `residual`; None when quant is set and return_norm is False.
    quant: float8_e4m3fn[t, h] (fp8) or uint8[t, h/2] (nvfp4, even index in the low nibble).
    scale_factors: float8_e4m3fn (nvfp4 only): swizzled 128x4 flat, or linear [t, h/16].
    scales: the dequant scales the FP8 kinds with computed scales produce: float32[t] (fp8_per_token),
        float32[t, h/128] row-major or MN-major, or UE8M0 bytes (fp8_block; reference.quantize_fp8_block);
        None otherwise.
    plan: the route this call took.
    """

    residual: torch.Tensor
    norm: Optional[torch.Tensor]
    quant: Optional[torch.Tensor]
    scale_factors: Optional[torch.Tensor]
    scales: Optional[torch.Tensor]
    plan: Plan


class Communicator:
    """Sum all-reduce and fused all-reduce tails over a torch.distributed group.

    group: a torch.distributed process group; None = WORLD (init it first, e.g. with
    commfuse.init_distributed()). strategy: "auto" (P2P where the topology allows and it wins, else
    NCCL), "nccl" (force the fallback row), "oneshot"/"twoshot" (force a P2P algorithm where P2P
    exists). The environment variable COMMFUSE_STRATEGY overrides the argument;
    COMMFUSE_DISABLE_FUSION=1 forces separated ops; COMMFUSE_CHECK=1 compares every call's shapes
    and dtypes across ranks first (raising on all ranks instead of hanging).

    Construction is collective. Where the topology's mode is "p2p" (NCCL group on one node, P2P
    between every pair) and the strategy is not "nccl", it creates the P2P workspace
    (commfuse.p2p.Workspace: IPC buffers, about 384 MiB per rank by default) and, for "auto",
    calibrates the one-shot/two-shot/NCCL crossovers (cached on disk); so construct the
    Communicator before any CUDA graph capture. `check()` surfaces a P2P timeout (also one inside a
    graph replay) as commfuse.P2PTimeoutError; `close()` releases the workspace (collective).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, strategy: str = "auto"):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call commfuse.init_distributed() first")
        strategy = os.environ.get("COMMFUSE_STRATEGY") or strategy
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.strategy = strategy
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
        self.fusion = os.environ.get("COMMFUSE_DISABLE_FUSION") != "1"
        self._hot = None  # the cache's C++ half (native.Table), made once the P2P workspace exists
        self.check_calls = os.environ.get("COMMFUSE_CHECK") == "1"
        self._plans: dict = {}
        self._p2p: Optional[p2p.Workspace] = None
        self._nccl: Optional[nccl.NcclComm] = None
        self.nccl_binding = "none: no NCCL group"
        self.name = ops.register(self)  # how commfuse.ops (torch.compile'd models) reach it
        if self.backend == "nccl":
            self._open_nccl()
        if (self.device.type == "cuda" and self.topology.mode == "p2p"
                and self.world_size in p2p.SPEC.world_sizes):
            # Creating the workspace is collective: every rank must take the same decision.
            strategies: list = [None] * self.world_size
            dist.all_gather_object(strategies, self.strategy, group=self.group)
            if len(set(strategies)) > 1:
                raise ValueError(f"ranks disagree on the strategy: {strategies}")
            if self.strategy != "nccl":
                # Crossovers timed on a shared GPU would say nothing about real machines: defaults.
                self._p2p = p2p.Workspace(self.group, self.device,
                                          calibrate=self.strategy == "auto" and not self.topology.shared_gpu,
                                          topology=self.topology)
        if self.device.type == "cuda" and native.unavailable() is None:
            # A hit must not skip check_error: the table reads the P2P error word itself.
            error_word = self._p2p.error_word() if self._p2p is not None else 0
            self._hot = native.module().Table(FusedResult, error_word, self.name)
            self._hot.set_check_calls(self._check_calls)

    def _open_nccl(self) -> None:
        """The NCCL route's own NCCL communicator (commfuse.nccl): torch.distributed's all_reduce and
        the copy it needs cost tens of microseconds of host time a call, ncclAllReduce a few. Every
        rank must take the same decision (creating it is collective), so the ranks agree first."""
        why = "COMMFUSE_NCCL=0" if os.environ.get("COMMFUSE_NCCL") == "0" else nccl.available()
        whys: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(whys, why, group=self.group)
        why = next((f"rank {r}: {w}" for r, w in enumerate(whys) if w), None)
        if why is None:
            self._nccl = nccl.shared(self.group, self.device)
            self.nccl_binding = f"commfuse.nccl (NCCL {self._nccl.version})"
        else:
            self.nccl_binding = f"torch.distributed ({why})"

    @property
    def check_calls(self) -> bool:
        """Whether every call compares its signature across the ranks first (COMMFUSE_CHECK=1); it may
        be turned off (or on) for this communicator."""
        return self._check_calls

    @check_calls.setter
    def check_calls(self, on: bool) -> None:
        self._check_calls = bool(on)
        if self._hot is not None:  # commfuse.ops' C++ kernels hand checked calls to Python
            self._hot.set_check_calls(self._check_calls)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def plan(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
             weight: Optional[torch.Tensor] = None, *, eps: float = 1e-6, quant: Optional[str] = None,
             scale: Union[torch.Tensor, float, None] = None, return_norm: bool = False,
             sf_layout: str = "swizzled", weight_offset: float = 0.0, scale_layout: str = "row",
             scale_ue8m0: bool = False, out=None) -> Plan:
        """The route `fused_all_reduce` (or `all_reduce` when residual is None) would take, without
        running it. Arguments as for those (x, residual: T[..., h], weight: T[h], scale: float32[1],
        on the communicator's device; out: the caller's output tensors, if any); raises on the same
        argument errors. Not collective."""
        return self._planned(x, residual, weight, eps, quant, scale, return_norm, sf_layout,
                             (weight_offset, scale_layout, scale_ue8m0), out, launch=False)[0]

    def _planned(self, x, residual, weight, eps, quant, scale, return_norm, sf_layout, scaled, out,
                 launch: bool = True) -> tuple:
        """(plan, its native launcher or None) of a call, from the cache. Decode layers repeat a handful
        of call signatures: the checks, guards and launch preparation run once per signature
        (everything they read is in the key), not on every call of the hot path. launch False (plan()):
        the launcher, which loads kernels, is left _LATER, for the signature's first call."""
        try:
            key = (_signature(x, residual, weight, scale, out), eps, quant, return_norm, sf_layout, scaled)
            entry = self._plans.get(key)
        except (AttributeError, TypeError):  # not a tensor, or an unhashable argument: the checks name it
            plan = self._make_plan(x, residual, weight, eps, quant, scale, return_norm, sf_layout, scaled, out)
            return plan, None
        if entry is None or (launch and entry[1] is _LATER):
            plan = entry[0] if entry is not None else self._make_plan(x, residual, weight, eps, quant, scale,
                                                                      return_norm, sf_layout, scaled, out)
            launch = self._launcher(plan, x, residual, eps, quant, return_norm, sf_layout, scaled) if launch else _LATER
            entry = (plan, launch)
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
                if self._hot is not None:
                    self._hot.clear()
            self._plans[key] = entry
            if launch is not None and launch is not _LATER and self._hot is not None:
                if residual is None:
                    self._hot.insert_plain(x, out, plan, launch)
                else:
                    self._hot.insert_fused(x, residual, weight, scale, out, eps, quant, return_norm, sf_layout,
                                           *scaled, plan, launch)
        return entry

    def _launcher(self, plan: Plan, x, residual, eps, quant, return_norm, sf_layout, scaled):
        """The native launcher (commfuse.native) of a checked call's route, or None where it has none:
        the native path off, the separated tail, gloo, torch.distributed's NCCL, P2P in pieces, no rows."""
        if self.device.type != "cuda" or native.unavailable() is not None or not x.numel():
            return None
        nccl = self._nccl is not None and plan.collective is Collective.NCCL
        if residual is None:
            if plan.algorithm:
                return self._p2p.plain_launcher(x, plan.algorithm)
            return native.launcher(None, 0, 0, b"", [], [native.spec_of((tuple(x.shape), x.dtype))], False,
                                   self.device.index, self._nccl.native_args(x.dtype, x.numel())) if nccl else None
        if plan.tail is not TailRoute.FUSED:
            return None
        h = x.shape[-1]
        t = x.numel() // h
        if plan.algorithm:
            return self._p2p.launcher(x.dtype, t, h, eps, quant, return_norm, sf_layout, plan.algorithm, *scaled)
        if nccl:
            return fused_tail.launcher(x.dtype, t, h, eps, quant, return_norm, sf_layout, *scaled, self.device.index,
                                       self._nccl.native_args(x.dtype, x.numel()))
        return None

    def _make_plan(self, x, residual, weight, eps, quant, scale, return_norm, sf_layout, scaled, out) -> Plan:
        weight_offset, scale_layout, scale_ue8m0 = scaled
        check_arguments(x, residual, weight, eps, quant, scale, sf_layout, self.device, weight_offset, scale_layout,
                        scale_ue8m0)
        if out is not None and residual is None:
            epilogue.check_like(out, x)
        elif out is not None:
            h = x.shape[-1]
            epilogue.check_out(out, x.numel() // h, h, x.dtype, self.device, quant, return_norm, sf_layout,
                               scale_layout, scale_ue8m0)
        req = Request(
            x=TensorMeta.of(x),
            residual=None if residual is None else TensorMeta.of(residual),
            weight=None if weight is None else TensorMeta.of(weight),
            scale=TensorMeta.of(scale) if isinstance(scale, torch.Tensor) else None,
            quant=quant, return_norm=return_norm, sf_layout=sf_layout, weight_offset=float(weight_offset),
            scale_layout=scale_layout, scale_ue8m0=bool(scale_ue8m0))
        return make_plan(req, mode=self.topology.mode, backend=self.backend, sm=self.topology.sm,
                         world_size=self.world_size, kernels=registered_kernels(),
                         strategy=self.strategy, fusion=self.fusion,
                         p2p=self._p2p.limits if self._p2p is not None else None,
                         mode_reasons=self.topology.reasons)

    def all_reduce(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum of `x` over the group, in a new tensor of x's shape and dtype (x is not modified).

        x: any shape, fp16 / bf16 / fp32, on the communicator's device (CUDA for NCCL and for ranks
        sharing a GPU, CPU for gloo). out: a caller-owned tensor of x's shape, dtype and device
        (contiguous) to write the sum into instead, and return: a decode loop then allocates nothing.
        """
        hot = None if self._check_calls else self._hot
        if hot is not None:  # a signature seen before: the C++ table plans and launches it
            try:
                y = hot.plain(x, out)
            except native.NcclFailure as e:
                raise self._nccl_error(e) from None
            if y is not None:
                return y
        self._check_p2p_error()
        plan, launch = self._planned(x, None, None, 1e-6, None, None, False, "swizzled", _PLAIN, out)
        if self.check_calls:
            self._check_same_call(("all_reduce", tuple(x.shape), str(x.dtype), str(plan.collective)))
        if launch is not None:
            return self._native(launch, x, None, None, None, out)
        return self._collective(x, plan, out)

    def fused_all_reduce(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float = 1e-6, quant: Optional[str] = None,
                         scale: Union[torch.Tensor, float, None] = None, return_norm: bool = False,
                         sf_layout: str = "swizzled", weight_offset: float = 0.0, scale_layout: str = "row",
                         scale_ue8m0: bool = False, out=None) -> FusedResult:
        """All-reduce `x`, then residual add, RMSNorm and optional quantization (docs/semantics.md).

        x, residual: T[..., h] (T = fp16 or bf16 for the fused rows; others go separated), same shape;
        weight: T[h]; all on the communicator's device. scale: the dequant scale (value = code *
        scale) as a float32 tensor of one element on the device (a Python float takes the separated
        path): required for quant "fp8" (per-tensor scale) and "nvfp4" (global scale, amax / (448*6)).
        quant "fp8_per_token" / "fp8_block" compute their scales (scale None; docs/semantics.md), with
        fp8_block's scale_layout ("row" or "mn_major") and scale_ue8m0; weight_offset is added to the
        weight in fp32 (Gemma's (1 + w): 1.0). Outputs are flattened to [t, h]; see FusedResult.
        out: caller-owned outputs to write instead of fresh tensors (a FusedResult of an earlier call,
        or a commfuse.reference.Tail: residual, norm, quant, scale_factors, scales with the shapes and
        dtypes of this call's outputs, None where the call has none; contiguous, or for MN-major scales
        the reference's strides over a storage holding the padding rows; on the device), validated
        once per call signature. out.residual may be `residual` itself: the residual is updated in
        place (every route reads each residual element before it writes it).
        """
        if residual is None:  # its key would be a plain all-reduce's
            raise TypeError("residual must be a tensor of x's shape (all_reduce is the call without a tail)")
        hot = None if self._check_calls else self._hot
        if hot is not None:  # a signature seen before: the C++ table plans and launches it
            try:
                r = hot.fused(x, residual, weight, scale, out, eps, quant, return_norm, sf_layout, weight_offset,
                              scale_layout, scale_ue8m0)
            except native.NcclFailure as e:
                raise self._nccl_error(e) from None
            if r is not None:
                return r
        self._check_p2p_error()
        plan, launch = self._planned(x, residual, weight, eps, quant, scale, return_norm, sf_layout,
                                     (weight_offset, scale_layout, scale_ue8m0), out)
        if self.check_calls:
            self._check_same_call(("fused_all_reduce", tuple(x.shape), str(x.dtype), quant, return_norm, sf_layout,
                                   weight_offset, scale_layout, scale_ue8m0, str(plan.collective)))
        if launch is not None:
            return FusedResult(*self._native(launch, x, residual, weight, scale, out), plan=plan)
        algo = plan.algorithm
        fused = plan.tail is TailRoute.FUSED
        if algo and fused:  # the tail inside the P2P kernel
            tail = self._p2p.fused_all_reduce(x, residual, weight, eps, quant, scale, return_norm, sf_layout,
                                              algo, out=out, checked=True, weight_offset=weight_offset,
                                              scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
            return FusedResult(*tail, plan=plan)
        if fused and self._nccl is not None and plan.collective is Collective.NCCL:
            # NCCL writes the sum into the residual output, which the tail then updates in place;
            # a scratch tensor only where the caller's residual output is the residual input.
            res_out = None if out is None else out.residual
            if res_out is None or res_out.data_ptr() == residual.data_ptr():
                a = _fresh_rows(x)
            else:
                a = res_out
            self._nccl.all_reduce(x.contiguous(), a)
            tail = fused_tail.run(a, residual, weight, eps, quant, scale, return_norm, sf_layout, out=out,
                                  residual_out=a, checked=True, weight_offset=weight_offset,
                                  scale_layout=scale_layout, scale_ue8m0=scale_ue8m0)
            return FusedResult(*tail, plan=plan)
        a = self._collective(x, plan)
        if fused:
            tail = fused_tail.run(a, residual, weight, eps, quant, scale, return_norm, sf_layout, out=out,
                                  checked=True, weight_offset=weight_offset, scale_layout=scale_layout,
                                  scale_ue8m0=scale_ue8m0)
        else:
            h = x.shape[-1]
            a, residual = a.view(-1, h), residual.reshape(-1, h)
            tail = reference.fused_tail(a, residual, weight, eps, quant, scale, return_norm, sf_layout,
                                        weight_offset, scale_layout, scale_ue8m0)
            if out is not None:  # computed whole first: out.residual may be the residual input
                for mine, theirs in zip(_tail_of(out), tail):
                    if mine is not None:
                        _copy_out(mine, theirs)
                tail = reference.Tail(*_tail_of(out))
        return FusedResult(*tail, plan=plan)

    def _native(self, call, *args):
        try:
            return call(*args)
        except native.NcclFailure as e:
            raise self._nccl_error(e) from None

    def _nccl_error(self, e: Exception) -> Exception:
        """commfuse.nccl's exception for the ncclResult_t a native launch raised (NcclFailure)."""
        return self._nccl.nccl.error("ncclAllReduce", int(e.args[0]), self._nccl._handle)

    def check(self) -> None:
        """Wait for this rank's queued GPU work, then raise commfuse.P2PTimeoutError if a P2P
        kernel timed out waiting for a peer (eager or replayed in a CUDA graph). Not collective."""
        if self._p2p is not None:
            self._p2p.check()

    def close(self) -> None:
        """Release the P2P workspace (collective: every rank calls it); later calls take
        torch.distributed's NCCL."""
        self._hot = None  # its entries may route to the workspace, and it reads the workspace's error word
        self._plans.clear()  # cached plans may route to the workspace, their launchers to commfuse.nccl
        if self._p2p is not None:
            workspace, self._p2p = self._p2p, None
            workspace.close()
        # The NCCL communicator is the group's, shared with its other Communicators (nccl.shared).
        self._nccl = None
        self.nccl_binding = "torch.distributed (closed)"

    def _check_p2p_error(self) -> None:
        # A read of pinned host memory, no synchronisation: raises once a P2P kernel timed out.
        if self._p2p is not None:
            self._p2p.check_error()

    def _collective(self, x: torch.Tensor, plan: Plan, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if plan.algorithm:
            return self._p2p.all_reduce(x, plan.algorithm, out=out, checked=True)
        if plan.collective is Collective.NCCL:
            # NCCL reduces in T, in its own order (the semantics accept it on this path).
            if self._nccl is not None:
                if out is None:
                    out = epilogue._empty_like(x, memory_format=torch.contiguous_format)
                self._nccl.all_reduce(x.contiguous(), out)
                return out
            # torch's all_reduce works in place and x is the caller's: one copy (also for a strided x).
            out = x.clone(memory_format=torch.contiguous_format) if out is None else out.copy_(x)
            dist.all_reduce(out, group=self.group)
            return out
        # Elsewhere (gloo: CPU tensors, or CUDA tensors of ranks sharing a GPU) we can afford the exact
        # semantics: every rank's x, summed in fp32 in rank order and rounded once, so all ranks agree
        # bit for bit with the reference. Not capturable in a CUDA graph (gloo works on the host).
        xs = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(self.world_size)]
        dist.all_gather(xs, x.contiguous(), group=self.group)
        total = reference.all_reduce_sum(xs)
        return total if out is None else out.copy_(total)

    def _check_same_call(self, signature: tuple) -> None:
        """Raise on every rank when ranks disagree on a call (a mismatched collective would hang)."""
        sigs: list = [None] * self.world_size
        dist.all_gather_object(sigs, signature, group=self.group)
        if any(s != sigs[0] for s in sigs):
            detail = "; ".join(f"rank {i}: {s}" for i, s in enumerate(sigs))
            raise ValueError(f"ranks disagree on the call ({detail})")
