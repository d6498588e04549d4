"""The alpha-beta cost of one collective on one kind of link (:class:`Link`, :func:`ring_terms`),
what :class:`~shardkit.planner.hardware.Hardware` holds per collective within and across nodes,
and the checks of the numbers it is made of (a problem naming the field, or ``None``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..plan.errors import PlanError, UsageError

#: The collectives a :class:`Hardware` prices, each on a :class:`Link` of its own: a ring moves the
#: same bytes in the same steps in a reduce-scatter as in an all-gather, but a backend need not run it
#: as a ring (gloo's takes 1.2-1.6 times its all-gather's time on a CPU), so it is measured apart.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
#: Collectives a hardware description may leave out, and the one whose link stands in for each:
#: files and presets written before ``reduce_scatter`` was measured give all-gather's (a ring's).
STANDS_IN = {"reduce_scatter": "all_gather"}
_YAML_EXPONENT_HINT = " (YAML reads 25e9 as text: write 25.0e+9 or 25000000000)"


def ring_terms(collective: str, n: int) -> tuple[int, float]:
    """``(steps, factor)`` of the ring algorithm for ``collective`` over ``n`` devices: all-reduce
    ``2(n-1)`` steps moving ``2(n-1)/n`` of the bytes, all-gather and reduce-scatter ``n-1`` and
    ``(n-1)/n``, point-to-point one message of all of them.

    >>> ring_terms("all_reduce", 4), ring_terms("reduce_scatter", 4), ring_terms("p2p", 4)
    ((6, 1.5), (3, 0.75), (1, 1.0))
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"ring_terms(n={n!r}): n must be a number of devices >= 1")
    kind = collective_kind(collective, "ring_terms")
    if kind == "p2p":
        return 1, 1.0
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    return n - 1, (n - 1) / n


def collective_kind(name: str, caller: str) -> str:
    if name not in COLLECTIVES:
        raise UsageError(f"{caller}: unknown collective {name!r}; valid: {', '.join(COLLECTIVES)}")
    return name


@dataclass(frozen=True)
class Link:
    """One collective's cost on one kind of link, alpha-beta:
    ``time = steps * latency + factor * S / bandwidth``.

    ``bandwidth`` is in bytes/s, the bus bandwidth one device reaches (NCCL-tests convention);
    ``latency`` in seconds per message step (0 allowed: a fit can find none).

    >>> Link(bandwidth=100e9, latency=2e-6).seconds(1e9, factor=1.5, steps=6)
    0.015012
    """

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        problems = [p for p in (positive_number(self.bandwidth, "bandwidth"),
                                number(self.latency, "latency", minimum=0.0)) if p]
        if problems:
            raise PlanError([f"Link: {p}" for p in problems])

    def seconds(self, nbytes: float, *, factor: float = 1.0, steps: int = 1) -> float:
        """The time of ``steps`` message steps moving ``factor * nbytes`` bytes per device."""
        return steps * self.latency + factor * nbytes / self.bandwidth


def describe(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def number(value: Any, where: str, minimum: float) -> str | None:
    """A finite int or float (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = _YAML_EXPONENT_HINT if isinstance(value, str) and "e" in value.lower() else ""
        return f"field {where!r} must be a number, got {describe(value)}{hint}"
    if not math.isfinite(value) or value < minimum:
        return f"field {where!r} must be a finite number >= {minimum:g}, got {value!r}"
    return None


def positive_number(value: Any, where: str) -> str | None:
    problem = number(value, where, 0.0)
    if problem is None and value <= 0:
        return f"field {where!r} must be > 0, got {value!r}"
    return problem


__all__ = ["COLLECTIVES", "STANDS_IN", "Link", "collective_kind", "describe", "number", "positive_number", "ring_terms"]
