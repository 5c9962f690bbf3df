"""Guards: which row of the routing table (docs/design.md) a call takes, and why.

Everything here is a pure function of tensor metadata, the group's topology and the registry
of kernels, so every decision can be tested on a machine without a GPU by simulating them.

Two kinds of checks live here:
- `check_arguments` raises on requests that have no meaning (shapes that disagree, a quant
  without its scale, ...): the caller made a mistake and no fallback could fix it.
- `make_plan` applies the guards of the fused rows; a guard that fails never raises, it sends
  the call to the separated ops (same results) and records the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping, Optional, Sequence

import torch

from . import epilogue

# FP8 with scales computed per token or per 1 x 128 block (reference.py): no scale argument.
SCALED_FP8 = epilogue.COMPUTED_SCALES
QUANTS = tuple(epilogue.QUANTS)
SCALE_LAYOUTS = ("row", "mn_major")
SF_LAYOUTS = epilogue.SF_LAYOUTS
FUSED_DTYPES = (torch.float16, torch.bfloat16)
# What any route can take: sums are accumulated in fp32 (the semantics), which would round an integer
# or a float64 tensor.
DTYPES = FUSED_DTYPES + (torch.float32,)
MIN_FUSED_SM = (8, 0)


@dataclass(frozen=True)
class TensorMeta:
    """What the guards need to know about a tensor, without touching its data."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device
    contiguous: bool
    last_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(t.shape), t.dtype, t.device, t.is_contiguous(),
                   t.stride(-1) if t.dim() else 1)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Request:
    """One call: a plain all-reduce when `residual` is None, else the fused tail pattern."""

    x: TensorMeta
    residual: Optional[TensorMeta] = None
    weight: Optional[TensorMeta] = None
    scale: Optional[TensorMeta] = None  # None also when scale is a Python float
    quant: Optional[str] = None
    return_norm: bool = False
    sf_layout: str = "swizzled"
    weight_offset: float = 0.0
    scale_layout: str = "row"
    scale_ue8m0: bool = False

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
    def pattern(self) -> str:
        """Benchmark-style pattern name, e.g. residual_rmsnorm_nvfp4_out."""
        if self.residual is None:
            return "allreduce"
        name = "residual_rmsnorm" + (f"_{self.quant}" if self.quant else "")
        return name + ("_out" if self.quant and self.return_norm else "")


@dataclass(frozen=True)
class KernelSpec:
    """A compiled kernel's promise: the requests it handles. Registered by the module that launches it.

    kind: "tail" (local fused tail after a collective) or "p2p" (all-reduce with the tail fused;
    `algorithms` names the P2P algorithms it implements).
    """

    name: str
    kind: str
    dtypes: frozenset = frozenset(FUSED_DTYPES)
    quants: frozenset = frozenset(QUANTS)
    min_sm: tuple = MIN_FUSED_SM
    hidden_multiple: int = 8
    max_hidden: int = 1 << 16
    max_tokens: int = 1 << 31
    plain: bool = False  # also does a plain all-reduce (no tail)
    algorithms: tuple = ()
    world_sizes: Optional[frozenset] = None  # None: any

    def rejects(self, req: Request, sm: tuple) -> Optional[str]:
        """Why this kernel cannot take `req` (None when it can)."""
        if req.x.dtype not in self.dtypes:
            return f"{self.name}: dtype {req.x.dtype} not in {sorted(map(str, self.dtypes))}"
        if sm < self.min_sm:
            return f"{self.name}: needs SM >= {self.min_sm[0]}.{self.min_sm[1]}, device is {sm[0]}.{sm[1]}"
        if req.residual is None:
            return None if self.plain else f"{self.name}: no plain all-reduce"
        if req.quant not in self.quants:
            return f"{self.name}: quant {req.quant!r} not supported"
        multiple = max(epilogue.hidden_multiple(req.quant), self.hidden_multiple)
        if req.hidden % multiple or not 0 < req.hidden <= self.max_hidden:
            return (f"{self.name}: hidden size {req.hidden} must be a multiple of {multiple} "
                    f"in [{multiple}, {self.max_hidden}]")
        if req.tokens > self.max_tokens:
            return f"{self.name}: {req.tokens} tokens > {self.max_tokens}"
        return None


_KERNELS: dict[str, KernelSpec] = {}


def register_kernel(spec: KernelSpec) -> KernelSpec:
    _KERNELS[spec.name] = spec
    return spec


def registered_kernels() -> Mapping[str, KernelSpec]:
    return dict(_KERNELS)


@dataclass(frozen=True)
class P2PLimits:
    """Message-size crossovers of the P2P algorithms (bytes), measured per machine by calibration.

    A message of at most `oneshot_max` goes one-shot, at most `twoshot_max` two-shot, else NCCL;
    nothing larger than `oneshot_bytes` (the one-shot's own buffers; None: the workspace) goes
    one-shot, even when forced. A message larger than `workspace_bytes` runs two-shot in pieces of
    whole rows that fit it (`chunk_rows`), or takes NCCL when not even one piece fits.
    """

    workspace_bytes: int
    oneshot_max: int
    twoshot_max: int
    oneshot_bytes: Optional[int] = None


def chunk_rows(row_bytes: int, quant: Optional[str], sf_layout: str, workspace_bytes: int) -> int:
    """Rows per two-shot launch for a message larger than the workspace: as many whole rows of
    `row_bytes` as fit (a plain all-reduce is cut into rows of one 16-byte vector), in multiples of
    128 for swizzled NVFP4 (whose scale factors are stored in tiles of 128 rows); 0 when not one
    such piece fits."""
    multiple = 128 if quant == "nvfp4" and sf_layout == "swizzled" else 1
    return workspace_bytes // row_bytes // multiple * multiple


class Collective(str, Enum):
    """Which collective a call runs (a str: compares equal to, and prints as, its value)."""

    P2P_ONESHOT = "p2p_oneshot"  # the P2P kernels (p2p.py), tail fused where the tail guards hold
    P2P_TWOSHOT = "p2p_twoshot"
    NCCL = "nccl"                # torch.distributed's NCCL all-reduce
    GLOO = "gloo"                # gloo: every rank's x gathered and summed exactly (CPU, or ranks sharing a GPU)
    NONE = "none"                # no collective: commfuse.norm's local ops

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
    """How the tail after the collective runs (a str, as Collective)."""

    FUSED = "fused"          # in the P2P kernel, or one local kernel after the collective
    SEPARATED = "separated"  # plain torch ops of commfuse.reference
    NONE = "none"            # a plain all-reduce: no tail

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Plan:
    """The route of one call.

    collective: a Collective (P2P one-shot / two-shot, NCCL, gloo); tail: a TailRoute.
    kernel: the registered kernel that runs the fused part, if any.
    reasons: why, in words: every guard that failed, and what chose the collective.
    algorithm: collective.algorithm, kept here: the Communicator reads it on every call of the hot path.
    """

    collective: Collective
    tail: TailRoute
    kernel: Optional[str] = None
    reasons: tuple = field(default_factory=tuple)
    algorithm: Optional[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "algorithm", self.collective.algorithm)

    def __str__(self) -> str:
        head = f"{self.collective} + {self.tail} tail" + (f" [{self.kernel}]" if self.kernel else "")
        return head + "".join(f"\n  - {r}" for r in self.reasons)


def check_arguments(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                    eps: float, quant: Optional[str], scale, sf_layout: str,
                    device: torch.device, weight_offset: float = 0.0, scale_layout: str = "row",
                    scale_ue8m0: bool = False) -> None:
    """Raise ValueError/TypeError naming the argument when a request has no meaning."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape [..., h] with h > 0, got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    _check_device("x", x, device)
    if residual is None:
        if weight is not None or quant is not None:
            raise ValueError("residual is required when weight or quant is given")
        return
    h = x.shape[-1]
    if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__}")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual dtype {residual.dtype} must match x dtype {x.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.numel() != h or weight.dim() != 1:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must have shape [{h}] (x's hidden size), got {got}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
    _check_device("residual", residual, device)
    _check_device("weight", weight, device)
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not (isinstance(weight_offset, (int, float)) and math.isfinite(weight_offset)):
        raise ValueError(f"weight_offset must be a finite number (Gemma: 1.0), got {weight_offset!r}")
    check_quant(quant, scale, sf_layout, h, device, scale_layout, scale_ue8m0)


def check_quant(quant: Optional[str], scale, sf_layout: str, h: int, device: torch.device,
                scale_layout: str = "row", scale_ue8m0: bool = False) -> None:
    """Raise ValueError/TypeError naming the argument unless the quantization arguments of a tail on rows
    of h elements make sense (the Communicator's calls and commfuse.norm's local ops share these rules)."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if sf_layout not in SF_LAYOUTS:
        raise ValueError(f"sf_layout must be one of {SF_LAYOUTS}, got {sf_layout!r}")
    if scale_layout not in SCALE_LAYOUTS or not isinstance(scale_ue8m0, bool):
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS} and scale_ue8m0 a bool, got "
                         f"{scale_layout!r}, {scale_ue8m0!r}")
    if quant != "fp8_block" and (scale_layout != "row" or scale_ue8m0):
        raise ValueError(f"scale_layout={scale_layout!r} / scale_ue8m0={scale_ue8m0!r} apply to quant='fp8_block' "
                         f"only, got quant={quant!r}")
    if quant in SCALED_FP8:
        if scale is not None:
            raise ValueError(f"quant={quant!r} computes its scales: scale must be None")
        if quant == "fp8_block" and h % 128:
            raise ValueError(f"quant='fp8_block' needs x's hidden size to be a multiple of 128 (blocks of 1 x 128), "
                             f"got {h}")
        return
    if quant is None:
        if scale is not None:
            raise ValueError("scale is only meaningful with quant='fp8' or 'nvfp4'")
        return
    if quant == "nvfp4" and h % 16:
        raise ValueError(f"quant='nvfp4' needs x's hidden size to be a multiple of 16, got {h}")
    if scale is None:
        raise ValueError(f"quant={quant!r} needs scale (the dequant scale, fp32 tensor of one element)")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must have one element, got shape {tuple(scale.shape)}")
        if scale.dtype != torch.float32:
            raise TypeError(f"scale must be float32, got {scale.dtype}")
        if scale.device != device and not (device.index is None and scale.device.type == device.type):
            raise ValueError(f"scale is on {scale.device}, but x is on {device}")  # x: checked by the caller
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float32 tensor of one element or a float, got {type(scale).__name__}")


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
        raise ValueError(f"{name} is on {t.device}, but this communicator works on {device}")


def make_plan(req: Request, *, mode: str, backend: str, sm: Optional[tuple], world_size: int,
              kernels: Mapping[str, KernelSpec], strategy: str = "auto", fusion: bool = True,
              p2p: Optional[P2PLimits] = None, mode_reasons: Sequence[str] = ()) -> Plan:
    """Choose collective and tail for `req`.

    mode: the topology's mode ("p2p", "fallback", "cpu"); backend: torch.distributed backend name;
    sm: this rank's (major, minor) or None without a GPU; strategy: "auto" | "nccl" | "oneshot" |
    "twoshot"; fusion: False when COMMFUSE_DISABLE_FUSION=1; p2p: the workspace's crossovers, None
    when no workspace exists.
    """
    reasons: list[str] = []
    tail_guard = _tail_guard(req, sm, fusion)
    if tail_guard:
        reasons.append(tail_guard)

    collective, kernel = Collective.of_backend(backend), None
    algo = _p2p_algorithm(req, mode, strategy, p2p, reasons, mode_reasons, tail_in_p2p=not tail_guard)
    if algo:
        spec = _pick(kernels, "p2p", req, sm, world_size, algo, reasons)
        if spec:
            collective = Collective.P2P_ONESHOT if algo == "oneshot" else Collective.P2P_TWOSHOT
            fused_here = req.residual is not None and not tail_guard
            if req.residual is None or fused_here:
                return Plan(collective, TailRoute.FUSED if fused_here else TailRoute.NONE, spec.name, tuple(reasons))
            kernel = spec.name  # plain P2P all-reduce, tail separated below
    if req.residual is None:
        return Plan(collective, TailRoute.NONE, kernel, tuple(reasons))
    if tail_guard:
        return Plan(collective, TailRoute.SEPARATED, kernel, tuple(reasons))
    spec = _pick(kernels, "tail", req, sm, world_size, None, reasons)
    if spec is None:
        return Plan(collective, TailRoute.SEPARATED, None, tuple(reasons))
    return Plan(collective, TailRoute.FUSED, spec.name, tuple(reasons))


def _tail_guard(req: Request, sm: Optional[tuple], fusion: bool) -> Optional[str]:
    """The fused-tail guards that hold for every kernel (None when all hold)."""
    if req.residual is None:
        return None
    if not fusion:
        return "COMMFUSE_DISABLE_FUSION=1: separated ops"
    if req.x.device.type != "cuda" or sm is None:
        return f"tensors on {req.x.device.type}: fused kernels need CUDA tensors"
    if sm < MIN_FUSED_SM:
        return f"SM {sm[0]}.{sm[1]} < 8.0: no fused kernels"
    if req.x.dtype not in FUSED_DTYPES:
        return f"dtype {req.x.dtype}: fused kernels take float16 and bfloat16"
    for name, meta in (("x", req.x), ("residual", req.residual), ("weight", req.weight)):
        if meta.last_stride != 1:
            return f"{name} has stride {meta.last_stride} on its last dim: fused kernels need stride 1"
    if req.quant in ("fp8", "nvfp4") and req.scale is None:
        return "scale given as a Python float: fused kernels take a float32 CUDA tensor"
    if req.scale is not None and not req.scale.contiguous:
        return "scale is not contiguous"
    multiple = epilogue.hidden_multiple(req.quant)
    if req.quant == "fp8_block" and req.hidden % multiple:
        return (f"hidden size {req.hidden} is not a multiple of {multiple}: quant='fp8_block' has one scale per "
                f"{multiple} consecutive elements of a row (the separated ops raise ValueError on it too)")
    if req.hidden % multiple:
        return f"hidden size {req.hidden} is not a multiple of {multiple}"
    return None


def _p2p_algorithm(req: Request, mode: str, strategy: str, p2p: Optional[P2PLimits],
                   reasons: list, mode_reasons: Sequence[str], tail_in_p2p: bool) -> Optional[str]:
    if strategy == "nccl":
        reasons.append("strategy 'nccl': P2P all-reduce not used")
        return None
    if mode != "p2p":
        reasons.extend(mode_reasons or [f"topology mode {mode!r}: no P2P all-reduce"])
        return None
    if p2p is None:
        reasons.append("no P2P workspace")
        return None
    if req.x.device.type != "cuda":
        return None
    size = req.message_bytes
    # A separated tail leaves the P2P kernel a plain all-reduce, cut into pieces of any 16 bytes.
    fused = req.residual is not None and tail_in_p2p
    row_bytes = req.hidden * req.x.dtype.itemsize if fused else 16
    quant = req.quant if fused else None
    if size > p2p.workspace_bytes and not chunk_rows(row_bytes, quant, req.sf_layout, p2p.workspace_bytes):
        reasons.append(f"message {size} B > P2P workspace {p2p.workspace_bytes} B, which holds no piece of it "
                       "(a row, or 128 rows for swizzled NVFP4): NCCL")
        return None
    # The one-shot's buffers bound it whatever the crossovers say: a larger message would overrun them.
    oneshot_bytes = p2p.oneshot_bytes if p2p.oneshot_bytes is not None else p2p.workspace_bytes
    if strategy == "oneshot" and size > oneshot_bytes:
        reasons.append(f"message {size} B > one-shot buffers {oneshot_bytes} B: two-shot")
        return "twoshot"
    if strategy in ("oneshot", "twoshot"):
        return strategy
    if size <= min(p2p.oneshot_max, oneshot_bytes):
        return "oneshot"
    if size <= p2p.twoshot_max:
        return "twoshot"
    reasons.append(f"message {size} B above the measured P2P crossover {p2p.twoshot_max} B: NCCL")
    return None


def _pick(kernels: Mapping[str, KernelSpec], kind: str, req: Request, sm: Optional[tuple],
          world_size: int, algo: Optional[str], reasons: list) -> Optional[KernelSpec]:
    candidates = [k for k in kernels.values() if k.kind == kind and (algo is None or algo in k.algorithms)]
    if not candidates:
        reasons.append(f"no {kind} kernel registered" + (f" for {algo}" if algo else ""))
        return None
    for spec in candidates:
        why = spec.rejects(req, sm or (0, 0))
        if why is None and spec.world_sizes is not None and world_size not in spec.world_sizes:
            why = f"{spec.name}: world size {world_size} not supported"
        if why is None:
            return spec
        reasons.append(why)
    return None
