"""FusionReport: what the pass fused, what it skipped and why, and where the numbers change."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class Fused:
    """One rewrite.

    pattern: the pieces matched, e.g. "all_reduce + add + rmsnorm + fp8"; op: the op inserted
    (commfuse::fused_all_reduce, commfuse::moe_all_reduce, commfuse::fused_add_rmsnorm,
    commfuse::gated_rmsnorm); node: its node's name; replaced: the names of the graph's nodes it
    replaced; spelling: how the graph wrote the pieces; quant / return_norm / eps / comm: the op's
    arguments; route: what the op will run on this device (commfuse's plan for a representative call);
    notes: where the fused numbers differ from the graph's rounding order (the tolerance each note
    means: docs/fusion.md)."""

    pattern: str
    op: str
    node: str
    replaced: List[str]
    spelling: str
    quant: Optional[str] = None
    return_norm: bool = False
    eps: str = ""
    comm: Optional[str] = None
    route: str = ""
    notes: List[str] = field(default_factory=list)

    @property
    def with_all_reduce(self) -> bool:
        return self.op.endswith(("fused_all_reduce", "moe_all_reduce"))


@dataclass
class Skipped:
    """A candidate left as the graph had it (or partly: `what` says which piece).

    where: the node it was found at (an all-reduce's: its collective); what: "all-reduce", "rmsnorm",
    "quantization", ...; kind: "guard" (the pattern is there, a condition of the fused ops fails), "pattern"
    (the graph does not compute what the fused ops do) or "evidence" (it would not pay:
    commfuse.fusion.evidence; rewrite="all" fuses it); reason: in words, with the numbers for "evidence"."""

    where: str
    what: str
    reason: str
    kind: str = "pattern"


@dataclass
class FusionReport:
    fused: List[Fused] = field(default_factory=list)
    skipped: List[Skipped] = field(default_factory=list)
    level: str = ""
    compile_id: Optional[str] = None  # dynamo's frame/compile id when the report comes from the backend

    def count(self, op: Optional[str] = None) -> int:
        """Rewrites inserting `op` (e.g. "commfuse::fused_all_reduce"); all of them when None."""
        return sum(1 for f in self.fused if op is None or f.op == op)

    @property
    def numerics(self) -> List[tuple]:
        """(node, note) for every rewrite whose numbers differ from the graph's rounding order."""
        return [(f.node, n) for f in self.fused for n in f.notes]

    def reasons(self) -> List[str]:
        return [s.reason for s in self.skipped]

    def extend(self, other: "FusionReport") -> None:
        self.fused += other.fused
        self.skipped += other.skipped

    def __repr__(self) -> str:
        return str(self)

    def __str__(self) -> str:
        lines = [f"commfuse.fusion: {len(self.fused)} fused, {len(self.skipped)} skipped"
                 + (f" ({self.level}{', ' + self.compile_id if self.compile_id else ''})" if self.level else "")]
        for i, f in enumerate(self.fused, 1):
            args = [f"quant={f.quant or 'none'}"] + ([f"return_norm={f.return_norm}"] if f.quant else []) \
                + [f"eps={f.eps}"]
            if f.comm:
                args.append(f"comm={f.comm}")
            lines.append(f"  [{i}] {f.pattern} -> {f.op} ({f.node}): {', '.join(args)}")
            lines.append(f"      written as: {f.spelling}")
            lines.append(f"      replaced: {', '.join(f.replaced)}")
            if f.route:
                route = f.route.splitlines()
                lines.append(f"      route: {route[0]}")
                lines.extend(f"      {r.strip()}" for r in route[1:])
            for n in f.notes:
                lines.append(f"      numerics: {n}")
        if self.skipped:
            lines.append("  skipped:")
            for s in self.skipped:
                at = "" if s.where == "the graph" else f" at {s.where}"  # the whole graph, skipped: said once
                lines.append(f"  - {s.what}{at} ({s.kind}): {s.reason}")
        return "\n".join(lines)
