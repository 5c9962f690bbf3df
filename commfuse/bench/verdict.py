"""What a row's prepare, gate or timing concluded, typed, and the rank agreement that makes one
verdict of every rank's (so that no rank is left waiting in a collective alone)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist


class Kind(enum.Enum):
    OK = "ok"
    SKIP = "skip"          # does not apply here (no GPU, no FlashInfer, another route ran): "-"
    REJECTED = "rejected"  # ran and gave a wrong result: no time (REJ)
    FAILED = "failed"      # raised: did not run (FAIL)


# The kind of a verdict joined across ranks is the worst rank's: a raise is not a wrong result, a
# wrong result is not a skip.
_SEVERITY = (Kind.OK, Kind.SKIP, Kind.REJECTED, Kind.FAILED)


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.kind is Kind.OK


OK = Verdict(Kind.OK)


class Skip(Exception):
    """An implementation does not apply to this case; the message says why."""


def short(e: BaseException, n: int = 300) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def failed(what: str, e: BaseException) -> Verdict:
    """The verdict on `what` ("prepare", "graph capture", ...) raising e."""
    return Verdict(Kind.FAILED, f"{what} raised {type(e).__name__}: {short(e)}")


def combine(verdicts: Sequence[Verdict]) -> Verdict:
    """One verdict of every rank's (verdicts[r] is rank r's): OK only when every rank's is. Otherwise
    the worst kind among the ranks that objected, with the reason they share when every rank objected
    alike, else each objecting rank's reason ("rank r: ..."), prefixed by its kind where that is not
    the joined verdict's kind."""
    bad = [(r, v) for r, v in enumerate(verdicts) if not v.ok]
    if not bad:
        return OK
    if len(bad) == len(verdicts) and len(set(v for _, v in bad)) == 1:
        return bad[0][1]
    kind = max((v.kind for _, v in bad), key=_SEVERITY.index)
    return Verdict(kind, "; ".join(f"rank {r}: " + (v.reason if v.kind is kind else f"{v.kind.value}: {v.reason}")
                                   for r, v in bad))


def agree(world: int, verdict: Verdict) -> Verdict:
    """Every rank's verdict on one step, combined (collective on world > 1)."""
    if world == 1:
        return verdict
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, verdict)
    return combine(verdicts)
