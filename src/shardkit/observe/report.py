"""Per-device run summaries as rich tables: memory, step time, communication, loss trend."""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean

from rich.console import Console
from rich.table import Table

from ..plan.text import format_bytes
from .memory import StateBytes


@dataclass(frozen=True)
class RankStats:
    """What one rank measured during a run (see ``observe.memory`` and ``observe.comm``).

    ``step_seconds``: wall time of the timed steps; ``comm``: ``{op kind: (calls, payload
    bytes)}`` of one step (``shardkit train`` counts its last step, untimed, because the
    counter slows the ops it watches); ``losses``: the loss of every step; ``comm_remote``:
    ``{all-to-all kind: bytes of that step addressed to other ranks}``.
    """

    rank: int
    coordinates: dict[str, int]
    state: StateBytes
    peak_bytes: int
    peak_method: str
    step_seconds: list[float]
    comm: dict[str, tuple[int, int]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    comm_remote: dict[str, int] = field(default_factory=dict)

    @property
    def mean_step_seconds(self) -> float:
        """Mean step time, leaving out the first step (lazy initialisation) when there are others."""
        times = self.step_seconds[1:] or self.step_seconds
        return fmean(times) if times else 0.0

    @property
    def comm_calls(self) -> int:
        return sum(calls for calls, _ in self.comm.values())

    @property
    def comm_bytes(self) -> int:
        return sum(size for _, size in self.comm.values())


@dataclass(frozen=True)
class LossTrend:
    """Mean loss of the first and last ``window`` steps."""

    first: float
    last: float
    window: int

    @property
    def went_down(self) -> bool:
        return self.last < self.first

    def __str__(self) -> str:
        verdict = "loss went down" if self.went_down else "loss did NOT go down"
        return (f"{verdict}: {self.first:.4f} -> {self.last:.4f} "
                f"(mean of the first vs the last {self.window} step{'s' if self.window > 1 else ''})")


def loss_trend(losses: list[float], window: int | None = None) -> LossTrend:
    """Compare the mean of the first and last few losses (default: a quarter of the steps, 1 to 10).

    >>> str(loss_trend([5.0, 4.0, 3.0, 2.5]))
    'loss went down: 5.0000 -> 2.5000 (mean of the first vs the last 1 step)'
    """
    if not losses:
        raise ValueError("loss_trend needs at least one loss")
    window = window or max(1, min(10, len(losses) // 4))
    window = min(window, len(losses))
    return LossTrend(fmean(losses[:window]), fmean(losses[-window:]), window)



def _coords(coordinates: dict[str, int]) -> str:
    return " ".join(f"{axis}={index}" for axis, index in coordinates.items()) or "-"


def device_table(stats: list[RankStats], title: str = "per device") -> Table:
    """One row per rank: mesh coordinates, state held, peak memory, step time, communication."""
    table = Table(title=title, caption=f"peak memory: {stats[0].peak_method}" if stats else None)
    for name in ("rank", "mesh coords", "params held", "grads + optim", "peak memory", "mean step",
                 "comm calls/step", "comm bytes/step"):
        table.add_column(name, justify="left" if name == "mesh coords" else "right")
    for s in stats:
        table.add_row(str(s.rank), _coords(s.coordinates), format_bytes(s.state.params),
                      format_bytes(s.state.grads + s.state.optimizer), format_bytes(s.peak_bytes),
                      f"{s.mean_step_seconds * 1000:.1f} ms", str(s.comm_calls), format_bytes(s.comm_bytes))
    return table


def comm_table(stats: list[RankStats], title: str = "communication per step (calls / payload bytes)") -> Table:
    """Rows: collective kinds; columns: ranks; cells: calls and payload bytes (for all-to-all, also
    the bytes addressed to other ranks)."""
    table = Table(title=title)
    table.add_column("op")
    for s in stats:
        table.add_column(f"rank {s.rank}", justify="right")
    for kind in sorted({k for s in stats for k in s.comm}):
        cells = []
        for s in stats:
            calls, size = s.comm.get(kind, (0, 0))
            remote = f" ({format_bytes(s.comm_remote[kind])} to others)" if kind in s.comm_remote else ""
            cells.append(f"{calls} / {format_bytes(size)}{remote}")
        table.add_row(kind, *cells)
    return table


def print_summary(stats: list[RankStats], console: Console | None = None, title: str = "per device") -> LossTrend | None:
    """Print the device table, the communication table and the loss trend; return the trend."""
    console = console or Console()
    console.print(device_table(stats, title))
    if any(s.comm for s in stats):
        console.print(comm_table(stats))
    losses = stats[0].losses if stats else []
    if not losses:
        return None
    trend = loss_trend(losses)
    console.print(str(trend), style="green" if trend.went_down else "bold red")
    return trend
