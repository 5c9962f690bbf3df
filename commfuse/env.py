"""The numbers and switches commfuse reads from environment variables, parsed in one place: unset or empty is
the default; a number must be in range, or ValueError names the variable; a switch is 0 or 1, and any other value
warns and keeps the default (docs/environment.md lists them)."""
from __future__ import annotations

import math
import os
import warnings

__all__ = ["MIN_SECONDS", "MAX_SECONDS", "flag", "number", "seconds"]

# About 11.6 days: a longer bound on a wait is no bound, and far larger values overflow the kernels'
# nanosecond counters and datetime.timedelta.
MAX_SECONDS = 1e6
# A millisecond: torch.distributed counts its timeouts in whole milliseconds, and a shorter bound is one of 0.
MIN_SECONDS = 1e-3


def number(name: str, default: float, *, minimum: float = 0.0, maximum: float = math.inf, zero: bool = False) -> float:
    """The variable `name` as a float: `default` where it is unset or empty, else a finite number > 0 (or 0, with
    `zero`), at least `minimum` and at most `maximum`."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not (math.isfinite(value) and value <= maximum and ((zero and value == 0) or (value > 0 and value >= minimum))):
        low = f">= {minimum:.15g}" if minimum > 0 else "> 0"  # 15 digits: a bound printed as it is
        raise ValueError(f"{name} must be {'0 or ' if zero else ''}a number {low}"
                         + (f" and at most {maximum:.15g}" if maximum < math.inf else "") + f", got {raw!r}")
    return value


def seconds(name: str, default: float, *, zero: bool = False) -> float:
    """A wait's bound in seconds from `name` (see `number`), from MIN_SECONDS (a shorter one is a timeout of 0
    ms to torch.distributed) to MAX_SECONDS."""
    return number(name, default, minimum=MIN_SECONDS, maximum=MAX_SECONDS, zero=zero)


_WARNED: set = set()


def flag(name: str, default: bool) -> bool:
    """The switch `name`: on at "1", off at "0", `default` where it is unset or empty. Any other value ("true",
    "yes", " 1") warns once and is the default, as the variable's documented reading has it, rather than raising:
    a switch is read where several ranks go on together (a workspace's calibration, the NCCL watchdog), and an
    error on one rank would leave its peers waiting there."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    if raw in ("0", "1"):
        return raw == "1"
    if (name, raw) not in _WARNED:
        _WARNED.add((name, raw))
        warnings.warn(f"{name}={raw!r} is neither 0 nor 1: read as {'1' if default else '0'}, its default",
                      stacklevel=2)
    return default
