"""Measure the local world as it really runs and describe it as a :class:`~shardkit.Hardware`.

The world is ``world_size`` local processes on gloo, started as ``shardkit train`` starts them
(:class:`~shardkit.LocalWorld`: each process gets its share of the cores), so the figures are
what a training step on this machine sees:

- **matmul**: every process multiplies square matrices at once, for a fixed time per size, over a
  size sweep; a size's figure is the slowest process's FLOP/s (the slowest rank paces a
  synchronous step) and a dtype's the best size's. float16 is measured too when it runs on CPU;
  where it does not, float16 is given bfloat16's figure and a note says so.
- **collectives**: gloo all-reduce, all-gather and a send/recv ring, timed over a range of
  message sizes (the slowest rank's time; the best of three blocks), then fitted with
  :func:`fit_alpha_beta`; the fit's relative residual says how well alpha-beta describes gloo.
  Where the largest message takes less than twice the smallest's time (a loaded machine, whose
  latency and noise hide the bandwidth), larger messages are timed, up to 256 MiB.
- **memory bandwidth**: every process runs ``torch.add(a, b, out=c)`` on float32 tensors of
  64 MiB at once; bytes/s is ``3 x 64 MiB`` (read ``a`` and ``b``, write ``c``) over the best
  time, the slowest process's.
- **op overhead**: a tiny training step, ``Linear(4, 4)`` forward, ``.sum()`` and backward on a
  4 x 4 input, timed on every process at once; its seconds divided by the number of aten ops it
  dispatches (counted once with a ``TorchDispatchMode``) is the fixed cost of one operator call:
  Python, the module call, autograd and dispatch, amortised over the ops (the kernels on 16
  numbers cost next to nothing).
- **overlap**: a loop of float32 matrix products alone, a loop of 2 MiB all-reduces alone, then
  both at once (the all-reduces issued with ``async_op=True`` before the products, waited after
  them, as FSDP and DDP issue theirs), :class:`Overlap`.
- **memory**: the machine's available RAM (``MemAvailable``) divided by the world size: the
  processes share it. ``devices_per_node`` is the world size and ``inter_node`` equals
  ``intra_node`` (one node); ``matmul_efficiency`` is 1.0 (``flops`` is measured, not a peak)
  and ``reserved`` 0.

Usage (about 15 s on 4 processes; ``shardkit calibrate`` does the same and prints a table)::

    hw = sk.calibrate(4)
    hw.save("local.yaml")
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..plan.errors import UsageError
from ..planner.hardware import COLLECTIVES, DTYPES, Hardware, Link, ring_terms
from ..runtime.torchrun import in_torchrun
from ..runtime.world import LocalWorld, launch

#: Matrix sizes (n of an n x n x n product) and message sizes (bytes, the whole tensor as in
#: :mod:`shardkit.planner.hardware`) of the default sweep.
MATMUL_SIZES = (64, 128, 256, 512, 1024)
MESSAGE_SIZES = tuple(2**k for k in range(12, 23, 2))  # 4 KiB to 4 MiB
#: Where the largest message of the sweep takes less than :data:`GROWTH` times the smallest's time,
#: latency and noise hide the bandwidth (a loaded or throttled machine): the sweep goes on with
#: messages 4 times larger, up to this many bytes, until the times grow that much.
MAX_MESSAGE_BYTES = 256 * 2**20
GROWTH = 2.0
SECONDS_PER_SIZE = 0.12
#: Bytes of each tensor of the memory-bandwidth add; large enough to leave the CPU's caches.
BANDWIDTH_BYTES = 64 * 2**20
#: Bytes of each all-reduce of the overlap measurement, and the matrix size of its products.
OVERLAP_MESSAGE, OVERLAP_MATMUL = 2 * 2**20, 256
_BLOCKS = 3  # a collective's timing is the best of this many blocks
_MAX_REPEATS = 64
_MAX_STEPS = 10_000  # of the tiny step op_overhead is measured on, per block

#: ``progress(done, total, what)``: called before each measurement and once at the end.
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Fit:
    """One collective's measurement: message ``sizes`` (bytes), the ``times`` (s) measured, the
    fitted :class:`Link` and the fit's relative RMS ``residual`` (0.1: off by 10% on average)."""

    collective: str
    sizes: tuple[int, ...]
    times: tuple[float, ...]
    link: Link
    residual: float


@dataclass(frozen=True)
class Overlap:
    """The overlap measurement: seconds of a loop of matrix products alone (``compute``), of a
    loop of all-reduces alone (``communication``) and of both at once (``both``), each the
    slowest process's best round. :attr:`fraction` is the part of the shorter loop hidden.

    >>> Overlap(compute=1.0, communication=0.5, both=1.25).fraction
    0.5
    """

    compute: float
    communication: float
    both: float

    @property
    def fraction(self) -> float:
        """``(compute + communication - both) / min(compute, communication)``, clamped to [0, 1]:
        1 when both at once take as long as the longer alone, 0 when as long as the two in turn."""
        hidden = (self.compute + self.communication - self.both) / min(self.compute, self.communication)
        return min(1.0, max(0.0, hidden))


@dataclass(frozen=True)
class Calibration:
    """What :func:`measure` found: the :class:`Hardware`, each dtype's best ``matmul``
    ``(n, FLOP/s per process)`` (``None`` where the dtype did not run), each collective's
    :class:`Fit`, the aten ops of the tiny step ``op_overhead`` was measured on
    (``ops_per_step``), the :class:`Overlap` measurement, and ``notes`` on what was not
    measured directly."""

    hardware: Hardware
    matmul: dict[str, tuple[int, float] | None]
    fits: dict[str, Fit]
    ops_per_step: int
    overlap: Overlap
    notes: tuple[str, ...]
    seconds: float


# -- fitting -------------------------------------------------------------------------------------
def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], factor: float, steps: int = 1) -> Link:
    """The :class:`Link` whose ``steps * latency + factor * S / bandwidth`` best fits ``times``.

    Least squares of ``t = a + b * factor * S`` over relative errors (each point weighted by
    ``1 / t``): message sizes span decades, and plain least squares would let the largest
    messages alone decide the intercept. ``latency = a / steps`` (a negative intercept is
    clamped: the line is refitted through 0), ``bandwidth = 1 / b``.

    >>> link = fit_alpha_beta([1e3, 1e4, 1e5], [2e-5 + s / 1e9 for s in (1e3, 1e4, 1e5)], factor=1.0)
    >>> round(link.latency * 1e6, 6), round(link.bandwidth / 1e9, 6)
    (20.0, 1.0)
    """
    x, t = _check_series(sizes, times, factor, steps)
    rows = np.stack([1.0 / t, x / t], axis=1)
    scale = np.array([1.0, 1.0 / x.max()])  # columns of similar size keep lstsq well conditioned
    (a, b_scaled), *_ = np.linalg.lstsq(rows * scale, np.ones_like(t), rcond=None)
    a, b = a * scale[0], b_scaled * scale[1]
    if a < 0:  # no latency visible: the best line through the origin
        a, b = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if not b > 0:
        raise UsageError(f"fit_alpha_beta: the times do not grow with the message size (slope {b:.3g} s/byte), "
                         f"so they give no bandwidth; sizes {list(sizes)}, times {list(times)}")
    return Link(bandwidth=float(1.0 / b), latency=float(a) / steps)


def fit_residual(link: Link, sizes: Sequence[float], times: Sequence[float], factor: float,
                 steps: int = 1) -> float:
    """The relative RMS error of ``link``'s times against ``times`` (0: an exact fit).

    >>> fit_residual(Link(1e9, 0.0), [1e3, 1e6], [1e-6, 2e-3], factor=1.0)
    0.3535533905932738
    """
    x, t = _check_series(sizes, times, factor, steps)
    predicted = steps * link.latency + x / link.bandwidth
    return float(np.sqrt(np.mean(((predicted - t) / t) ** 2)))


def _check_series(sizes: Sequence[float], times: Sequence[float], factor: float,
                  steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``(factor * sizes, times)`` as arrays, after checking them."""
    s, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    problems = []
    if s.ndim != 1 or s.shape != t.shape:
        problems.append(f"sizes and times must be two lists of the same length, got {len(sizes)} and {len(times)}")
    elif len(set(s.tolist())) < 2:
        problems.append(f"at least two different sizes are needed to fit a line, got {list(sizes)}")
    elif not (np.all(np.isfinite(s)) and np.all(s > 0) and np.all(np.isfinite(t)) and np.all(t > 0)):
        problems.append("sizes and times must be finite and > 0")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        problems.append(f"factor must be a finite number > 0, got {factor!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        problems.append(f"steps must be an integer >= 1, got {steps!r}")
    if problems:
        raise UsageError("fit_alpha_beta: " + "; ".join(problems))
    return factor * s, t


# -- measuring -----------------------------------------------------------------------------------
def calibrate(world_size: int, *, matmul_sizes: Sequence[int] = MATMUL_SIZES,
              message_sizes: Sequence[int] = MESSAGE_SIZES, seconds_per_size: float = SECONDS_PER_SIZE,
              name: str | None = None, world: LocalWorld | None = None,
              progress: Progress | None = None) -> Hardware:
    """The :class:`Hardware` of a local world of ``world_size`` gloo processes, measured
    (:func:`measure` also returns what was measured and how well it fits).

    >>> calibrate(4, seconds_per_size=0)
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.UsageError: calibrate(seconds_per_size=0): give a finite number of seconds > 0
    """
    return measure(world_size, matmul_sizes=matmul_sizes, message_sizes=message_sizes,
                   seconds_per_size=seconds_per_size, name=name, world=world, progress=progress).hardware


def measure(world_size: int, *, matmul_sizes: Sequence[int] = MATMUL_SIZES,
            message_sizes: Sequence[int] = MESSAGE_SIZES, seconds_per_size: float = SECONDS_PER_SIZE,
            name: str | None = None, world: LocalWorld | None = None,
            progress: Progress | None = None) -> Calibration:
    """Measure a local world of ``world_size`` gloo processes (a new one, or ``world``, which
    must be a gloo world of that size): matmul FLOP/s per dtype over ``matmul_sizes``, each
    collective over ``message_sizes`` bytes, ``seconds_per_size`` per point.

    >>> measure(1)
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.UsageError: calibrate(world_size=1): collectives need at least 2 processes; pass 2 or more
    """
    _check_arguments(world_size, matmul_sizes, message_sizes, seconds_per_size, world)
    start = time.perf_counter()
    report = progress or (lambda done, total, what: None)
    total = len(DTYPES) + len(COLLECTIVES) + 4
    report(0, total, f"starting {world_size} processes")
    if world is None:
        with LocalWorld(world_size, backend="gloo") as local:
            results = _run(local, matmul_sizes, message_sizes, seconds_per_size, report, total)
    else:
        results = _run(world, matmul_sizes, message_sizes, seconds_per_size, report, total)
    matmul, fits, bandwidth, (ops_per_step, op_overhead), overlap = results
    notes = []
    if matmul["float16"] is None:
        notes.append("float16 matrix products do not run on this CPU: float16 is given bfloat16's figure")
    memory, memory_note = _memory_per_process(world_size)
    notes.append(memory_note)
    flops = {d: (matmul[d] or matmul["bfloat16"])[1] for d in DTYPES}
    links = {c: fits[c].link for c in COLLECTIVES}
    hardware = Hardware(name=name or f"local-{world_size}-gloo", memory=memory, flops=flops,
                        devices_per_node=world_size, intra_node=links, inter_node=links, memory_bandwidth=bandwidth,
                        matmul_efficiency=1.0, reserved=0, op_overhead=op_overhead, overlap=overlap.fraction,
                        shared_compute=world_size > (os.cpu_count() or 1))
    report(total, total, "done")
    return Calibration(hardware, matmul, fits, ops_per_step, overlap, tuple(notes), time.perf_counter() - start)


def _run(world: LocalWorld, matmul_sizes: Sequence[int], message_sizes: Sequence[int], seconds: float,
         report: Progress, total: int) -> tuple[dict[str, tuple[int, float] | None], dict[str, Fit], float,
                                                tuple[int, float], Overlap]:
    launch(_ready, world=world)  # the processes have started (the first job waits for them)
    done = 1
    matmul: dict[str, tuple[int, float] | None] = {}
    for dtype in DTYPES:
        report(done, total, f"{dtype} matrix products")
        per_rank = launch(_matmul_job, world=world, dtype=dtype, sizes=tuple(matmul_sizes), seconds=seconds)
        matmul[dtype] = _best_matmul(per_rank)
        done += 1
    fits = {}
    for collective in COLLECTIVES:
        report(done, total, f"gloo {collective}")
        sizes, times = launch(_collective_job, world=world, collective=collective, sizes=tuple(message_sizes),
                              seconds=seconds)[0]  # every rank returns the slowest rank's times
        steps, factor = ring_terms(collective, world.size)
        try:
            link = fit_alpha_beta(sizes, times, factor, steps)
        except UsageError as error:
            raise UsageError(f"calibrate: gloo {collective} up to {max(sizes)} bytes gives no bandwidth: {error}. "
                             f"The machine is too loaded to time it: run calibrate again when it is idle, "
                             f"or with fewer processes") from error
        fits[collective] = Fit(collective, tuple(sizes), tuple(times), link,
                               fit_residual(link, sizes, times, factor, steps))
        done += 1
    report(done, total, "memory bandwidth")
    bandwidth = launch(_bandwidth_job, world=world, nbytes=BANDWIDTH_BYTES, repeats=5)[0]
    report(done + 1, total, "operator overhead")
    overhead = launch(_overhead_job, world=world, seconds=seconds)[0]
    report(done + 2, total, "overlap of all-reduce and matmul")
    overlap = launch(_overlap_job, world=world, seconds=2 * seconds, rounds=2)[0]
    return matmul, fits, bandwidth, overhead, overlap


def _best_matmul(per_rank: list[list[tuple[int, float]] | None]) -> tuple[int, float] | None:
    """The best size's figure, each size's figure being its slowest rank's."""
    if per_rank[0] is None:
        return None
    by_size = [(n, min(rank[i][1] for rank in per_rank)) for i, (n, _) in enumerate(per_rank[0])]
    return max(by_size, key=lambda item: item[1])


def _check_arguments(world_size: int, matmul_sizes: Sequence[int], message_sizes: Sequence[int],
                     seconds_per_size: float, world: LocalWorld | None) -> None:
    problems = []
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        problems.append(f"calibrate(world_size={world_size!r}): collectives need at least 2 processes; "
                        f"pass 2 or more")
    if not matmul_sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in matmul_sizes):
        problems.append(f"calibrate(matmul_sizes={matmul_sizes!r}): give matrix sizes, integers >= 1")
    if len(set(message_sizes)) < 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 4 * 8
                                              for s in message_sizes):
        problems.append(f"calibrate(message_sizes={message_sizes!r}): give at least two different sizes in bytes, "
                        f"integers >= 32")
    if isinstance(seconds_per_size, bool) or not isinstance(seconds_per_size, (int, float)) \
            or not 0 < seconds_per_size < math.inf:
        problems.append(f"calibrate(seconds_per_size={seconds_per_size!r}): give a finite number of seconds > 0")
    if world is not None and (world.size != world_size or world.backend != "gloo"):
        problems.append(f"calibrate(world=...): the world has {world.size} {world.backend} processes; "
                        f"give a gloo world of world_size={world_size}")
    if in_torchrun():  # launch would run the jobs on torchrun's world, not on the local one measured
        problems.append("calibrate measures a local world of its own: run it outside torchrun")
    if problems:
        raise UsageError("; ".join(problems))


def _memory_per_process(world_size: int) -> tuple[int, str]:
    """The machine's available RAM over the world size, and a note saying what was read."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available, source = int(fields["MemAvailable"].split()[0]) * 1024, "available RAM (MemAvailable)"
    except (OSError, KeyError, ValueError):  # no /proc (macOS): the physical memory, said so in the note
        available, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM (no MemAvailable)"
    return available // world_size, f"memory: {source} / {world_size} processes"


# -- jobs, run on every rank ---------------------------------------------------------------------
def _ready(ctx) -> None:
    """Nothing: run first, it returns once every process is up."""


def _slowest(value: float) -> float:
    """The largest of every rank's ``value``."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _matmul_job(ctx, dtype: str, sizes: tuple[int, ...], seconds: float) -> list[tuple[int, float]] | None:
    """This rank's FLOP/s per size, all ranks multiplying at once for ``seconds`` per size; ``None``
    when the dtype's products do not run here. The sweep stops before a size whose single product
    would take most of ``seconds`` (every rank stops at the same size)."""
    kind = getattr(torch, dtype)
    try:
        torch.ones(2, 2, dtype=kind) @ torch.ones(2, 2, dtype=kind)
    except RuntimeError:
        return None
    rates = []
    for n in sorted(sizes):
        a, b = torch.randn(n, n).to(kind), torch.randn(n, n).to(kind)
        started = time.perf_counter()
        a @ b  # warm-up, and how long one product takes
        if _slowest(time.perf_counter() - started) * 8 > seconds and rates:
            break  # the next size would not fit in its time
        dist.barrier()
        count, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds or count < 2:
            a @ b
            count += 1
        rates.append((n, 2 * n**3 * count / elapsed))
    return rates


def _collective_job(ctx, collective: str, sizes: tuple[int, ...],
                    seconds: float) -> tuple[list[int], list[float]]:
    """``(sizes, seconds)`` per ``collective`` of each size (bytes of the whole tensor), the slowest
    rank's, best of :data:`_BLOCKS` blocks of repeats sized to take about ``seconds`` in all.

    ``sizes`` go on past the last one given, each 4 times larger up to :data:`MAX_MESSAGE_BYTES`,
    while the largest takes less than :data:`GROWTH` times the smallest's time (every rank sees
    the same slowest times, so every rank stops at the same size)."""
    sizes = list(sizes)
    times: list[float] = []
    for size in sizes:
        times.append(_time_collective(collective, size, seconds))
    while max(times) < GROWTH * times[sizes.index(min(sizes))] and max(sizes) * 4 <= MAX_MESSAGE_BYTES:
        sizes.append(max(sizes) * 4)
        times.append(_time_collective(collective, sizes[-1], seconds))
    return sizes, times


def _time_collective(collective: str, size: int, seconds: float) -> float:
    """Seconds per ``collective`` of ``size`` bytes in all, the slowest rank's, best of
    :data:`_BLOCKS` blocks."""
    run = _OPS[collective]
    world, rank = dist.get_world_size(), dist.get_rank()
    elements = max(world, size // 4 // world * world)
    tensors = _tensors(collective, elements, world)
    run(tensors, rank, world)  # warm-up, and how long one takes
    dist.barrier()
    started = time.perf_counter()
    run(tensors, rank, world)
    once = _slowest(time.perf_counter() - started)
    repeats = max(1, min(_MAX_REPEATS, int(seconds / once / _BLOCKS)))
    best = math.inf
    for _ in range(_BLOCKS):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(repeats):
            run(tensors, rank, world)
        best = min(best, _slowest(time.perf_counter() - started) / repeats)
    return best


def _timed(work: Callable[[], object]) -> float:
    """Seconds ``work()`` takes here."""
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _bandwidth_job(ctx, nbytes: int, repeats: int) -> float:
    """Bytes/s of ``torch.add(a, b, out=c)`` on float32 tensors of ``nbytes`` each, every rank
    adding at once: ``3 * nbytes`` (read a and b, write c) over the best of ``repeats`` adds,
    the slowest rank's."""
    a, b, c = torch.ones(nbytes // 4), torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    torch.add(a, b, out=c)  # warm-up: every page of c is touched
    best = math.inf
    for _ in range(repeats):
        dist.barrier()
        best = min(best, _timed(lambda: torch.add(a, b, out=c)))
    return 3 * nbytes / _slowest(best)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, backward's included (torch's hook that sees
    every op below autograd, as :class:`~shardkit.observe.comm.CommCounter` uses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _overhead_job(ctx, seconds: float) -> tuple[int, float]:
    """``(aten ops per step, seconds per op)`` of a tiny training step, ``Linear(4, 4)`` forward,
    ``.sum()`` and backward on a 4 x 4 input, every rank stepping at once: the best of
    :data:`_BLOCKS` blocks of about ``seconds`` in all, the slowest rank's, over its ops."""
    layer, x = torch.nn.Linear(4, 4), torch.randn(4, 4)

    def step() -> None:
        layer(x).sum().backward()

    step()  # warm-up: the gradients exist, so every later step accumulates into them alike
    with _OpCounter() as counter:
        step()
    once = _slowest(_timed(step))
    repeats = max(1, min(_MAX_STEPS, int(seconds / once / _BLOCKS)))
    best = math.inf
    for _ in range(_BLOCKS):
        dist.barrier()
        best = min(best, _timed(lambda: [step() for _ in range(repeats)]) / repeats)
    return counter.count, _slowest(best) / counter.count


def _overlap_job(ctx, seconds: float, rounds: int) -> Overlap:
    """:class:`Overlap` of float32 products of :data:`OVERLAP_MATMUL` square matrices and
    all-reduces of :data:`OVERLAP_MESSAGE` bytes, each loop sized to take about ``seconds``
    alone; the best of ``rounds`` rounds of (products, all-reduces, both), the slowest rank's."""
    a, b = torch.randn(OVERLAP_MATMUL, OVERLAP_MATMUL), torch.randn(OVERLAP_MATMUL, OVERLAP_MATMUL)
    probe = torch.zeros(OVERLAP_MESSAGE // 4)
    a @ b  # warm-up
    dist.all_reduce(probe)
    products = max(1, round(seconds / _slowest(_timed(lambda: [a @ b for _ in range(4)]) / 4)))
    messages = max(1, min(_MAX_REPEATS, round(seconds / _slowest(_timed(lambda: dist.all_reduce(probe))))))
    buffers = [torch.zeros(OVERLAP_MESSAGE // 4) for _ in range(messages)]

    def compute() -> None:
        for _ in range(products):
            a @ b

    def communicate() -> None:
        for buffer in buffers:
            dist.all_reduce(buffer)

    def both() -> None:
        handles = [dist.all_reduce(buffer, async_op=True) for buffer in buffers]
        compute()
        for handle in handles:
            handle.wait()

    best = [math.inf] * 3
    for _ in range(rounds):
        for i, work in enumerate((compute, communicate, both)):
            dist.barrier()
            best[i] = min(best[i], _slowest(_timed(work)))
    return Overlap(*best)


def _tensors(collective: str, elements: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) float32 tensors for ``elements`` elements in all."""
    if collective == "all_gather":
        return torch.zeros(elements // world), torch.empty(elements)
    return torch.zeros(elements), torch.empty(elements)


def _all_reduce(tensors: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> None:
    dist.all_reduce(tensors[0])


def _all_gather(tensors: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> None:
    dist.all_gather_single(tensors[1], tensors[0])


def _p2p(tensors: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> None:
    """Every rank sends to the next and receives from the previous at once (a ring step)."""
    received = dist.irecv(tensors[1], (rank - 1) % world)
    sent = dist.isend(tensors[0], (rank + 1) % world)
    sent.wait()
    received.wait()


_OPS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "p2p": _p2p}

__all__ = ["BANDWIDTH_BYTES", "GROWTH", "MATMUL_SIZES", "MAX_MESSAGE_BYTES", "MESSAGE_SIZES", "OVERLAP_MATMUL",
           "OVERLAP_MESSAGE", "Calibration", "Fit", "Overlap", "calibrate", "fit_alpha_beta", "fit_residual",
           "measure"]
