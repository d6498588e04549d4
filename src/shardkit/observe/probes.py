"""What every process of a world runs to measure it (``shardkit calibrate``,
:mod:`shardkit.observe.calibrate`): matrix products, collectives over a size sweep, a large
add, a tiny training step and the overlap of all-reduces with products, each timed as the
slowest rank sees it (the slowest rank paces a synchronous step).

Every probe runs on the rank's device (``ctx.device``: its GPU under NCCL, the CPU under gloo,
as runtime/devices.py chose) and reads the time with :func:`~shardkit.runtime.devices.clock`,
which waits for the device's queued work first: on a GPU the kernels are timed, not their launch.
The probes of compute alone (products, the memory-bound operators, the operator overheads) read
:func:`~shardkit.runtime.devices.busy_clock`: on processes sharing a CPU's cores, their CPU
seconds over their share of the cores, so that other jobs' load is not taken for the machine's speed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..planner.counters import OpCounter
from ..runtime import p2p
from ..runtime.devices import (
    busy_clock,
    clock,
    device_kind,
    launcher_ranks_on_host,
    memory_per_process,
)
from ..runtime.torchrun import in_torchrun

#: Where the largest message of the sweep takes less than :data:`GROWTH` times the smallest's time,
#: latency and noise hide the bandwidth (a loaded or throttled machine): the sweep goes on with
#: messages 4 times larger, up to this many bytes, until the times grow that much.
MAX_MESSAGE_BYTES = 256 * 2**20
GROWTH = 2.0
#: Bytes of each all-reduce of the overlap measurement, and the matrix size of its products.
OVERLAP_MESSAGE, OVERLAP_MATMUL = 2 * 2**20, 256
_BLOCKS = 3  # a collective's timing is the best of this many blocks
_MAX_REPEATS = 64
_MAX_STEPS = 10_000  # of the tiny step op_overhead is measured on, per block


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


def ready(ctx) -> None:
    """Nothing: run first, it returns once every process is up."""


def device_job(ctx, ranks_on_host: int) -> tuple[str, int, str]:
    """``(kind, bytes of memory, what was read)`` of this rank's device: a GPU's model and total memory,
    or ``cpu`` and the machine's available RAM shared by the ``ranks_on_host`` processes on it."""
    device = ctx.device
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return device_kind(device), total, f"memory: the total of each GPU ({device_kind(device)})"
    memory, note = memory_per_process(ranks_on_host)
    return device_kind(device), memory, note


def _busy(device: torch.device) -> Callable[[], float]:
    """The clock of compute alone on this rank (:func:`~shardkit.runtime.devices.busy_clock`), with
    the ranks on this machine: the launcher's count under torchrun, the whole local world otherwise."""
    return busy_clock(device, launcher_ranks_on_host() if in_torchrun() else dist.get_world_size())


def _slowest(value: float, device: torch.device) -> float:
    """The largest of every rank's ``value`` (a tensor on ``device``: NCCL reduces GPU tensors only)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def matmul_job(ctx, dtype: str, sizes: tuple[int, ...], seconds: float) -> list[tuple[int, float]] | None:
    """This rank's FLOP/s per size, all ranks multiplying at once for ``seconds`` per size; ``None``
    when the dtype's products do not run here. The sweep stops before a size whose single product
    would take most of ``seconds`` (every rank stops at the same size)."""
    kind, device = getattr(torch, dtype), ctx.device
    try:
        torch.ones(2, 2, dtype=kind, device=device) @ torch.ones(2, 2, dtype=kind, device=device)
    except RuntimeError:
        return None
    rates, tick = [], _busy(device)
    for n in sorted(sizes):
        a, b = torch.randn(n, n).to(device, kind), torch.randn(n, n).to(device, kind)
        started = clock(device)
        a @ b  # warm-up, and how long one product takes
        if _slowest(clock(device) - started, device) * 8 > seconds and rates:
            break  # the next size would not fit in its time
        dist.barrier()
        count, started, busy_started = 0, clock(device), tick()
        while clock(device) - started < seconds or count < 2:
            a @ b
            count += 1
        rates.append((n, 2 * n**3 * count / (tick() - busy_started)))
    return rates


def collective_job(ctx, collective: str, sizes: tuple[int, ...],
                    seconds: float) -> tuple[list[int], list[float]]:
    """``(sizes, seconds)`` per ``collective`` of each size (bytes of the whole tensor), the slowest
    rank's, best of :data:`_BLOCKS` blocks of repeats sized to take about ``seconds`` in all.

    ``sizes`` go on past the last one given, each 4 times larger up to :data:`MAX_MESSAGE_BYTES`,
    while the largest takes less than :data:`GROWTH` times the smallest's time (every rank sees
    the same slowest times, so every rank stops at the same size)."""
    sizes = list(sizes)
    times: list[float] = []
    for size in sizes:
        times.append(_time_collective(collective, size, seconds, ctx.device))
    while max(times) < GROWTH * times[sizes.index(min(sizes))] and max(sizes) * 4 <= MAX_MESSAGE_BYTES:
        sizes.append(max(sizes) * 4)
        times.append(_time_collective(collective, sizes[-1], seconds, ctx.device))
    return sizes, times


def _time_collective(collective: str, size: int, seconds: float, device: torch.device) -> float:
    """Seconds per ``collective`` of ``size`` bytes in all on ``device``, the slowest rank's, best of
    :data:`_BLOCKS` blocks."""
    run = _OPS[collective]
    world, rank = dist.get_world_size(), dist.get_rank()
    elements = max(world, size // 4 // world * world)
    tensors = _tensors(collective, elements, world, device)
    run(tensors, rank, world)  # warm-up, and how long one takes
    dist.barrier()
    started = clock(device)
    run(tensors, rank, world)
    once = _slowest(clock(device) - started, device)
    repeats = max(1, min(_MAX_REPEATS, int(seconds / once / _BLOCKS)))
    best = math.inf
    for _ in range(_BLOCKS):
        dist.barrier()
        started = clock(device)
        for _ in range(repeats):
            run(tensors, rank, world)
        best = min(best, _slowest(clock(device) - started, device) / repeats)
    return best


def _timed(work: Callable[[], object], device: torch.device, tick: Callable[[], float] | None = None) -> float:
    """Seconds ``work()`` takes on ``device`` (its kernels run, not only launched), read on ``tick``
    (default: the device's :func:`~shardkit.runtime.devices.clock`)."""
    tick = tick or (lambda: clock(device))
    started = tick()
    work()
    return tick() - started


def _seconds_per_step(step: Callable[[], object], device: torch.device, seconds: float, busy: bool = False) -> float:
    """Seconds of one ``step()``: :func:`seconds_per_steps` of the one step."""
    return seconds_per_steps((step,), device, seconds, busy)[0]


def seconds_per_steps(steps: Sequence[Callable[[], object]], device: torch.device, seconds: float,
                      busy: bool = False) -> list[float]:
    """Seconds of one of each of ``steps`` after a warm-up one, every rank stepping at once: the best of
    :data:`_BLOCKS` blocks of repeats sized to take about ``seconds`` in all, the slowest rank's; the
    steps' blocks taken in turn, so that a change in the machine's load meets each step alike (their
    differences are what the DTensor probes measure); ``busy``: the steps compute alone on each rank,
    read on :func:`_busy`'s clock."""
    tick = _busy(device) if busy else None
    repeats = []
    for step in steps:
        step()  # warm-up: gradients exist, communicators are up, sharding propagation is cached
        repeats.append(max(1, min(_MAX_STEPS, int(seconds / _slowest(_timed(step, device), device) / _BLOCKS))))
    best = [math.inf] * len(steps)
    for _ in range(_BLOCKS):
        for index, (step, count) in enumerate(zip(steps, repeats)):
            dist.barrier()
            best[index] = min(best[index], _timed(lambda: [step() for _ in range(count)], device, tick) / count)  # noqa: B023
    return [_slowest(b, device) for b in best]


def bandwidth_job(ctx, nbytes: int, seconds: float) -> float:
    """Bytes/s of a transformer block's memory-bound operators as the planner counts them: a layer norm,
    a GeLU and a residual add on a float32 tensor of ``nbytes`` (1024 features), forward and backward,
    every rank at once; the forward's bytes booked by :class:`~shardkit.planner.counters.OpCounter`
    (each operator's inputs and outputs) times ``1 + BACKWARD_TRAFFIC`` (the planner's backward),
    over a step's seconds (:func:`_seconds_per_step`: blocks of about ``seconds``, so that processes
    sharing cores share them while timed; a single step's best time is one that ran on a core of its
    own, twice as fast as a step of 4 processes on 2 cores), the slowest rank's. A large
    ``torch.add`` would give the memory's streaming bandwidth, which a GPU's elementwise kernels
    reach but a CPU's do not: its GeLU and norms are bound by their arithmetic, and the planner
    prices them by these bytes."""
    from ..planner.step_time import BACKWARD_TRAFFIC

    device, features = ctx.device, 1024
    rows = max(1, nbytes // 4 // features)
    x = torch.randn(rows, features, device=device, requires_grad=True)
    weight = torch.ones(features, device=device, requires_grad=True)
    bias = torch.zeros(features, device=device, requires_grad=True)
    grad = torch.ones(rows, features, device=device)

    def forward() -> torch.Tensor:
        return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (features,), weight, bias)) + x

    booked: list[float] = []
    with OpCounter(lambda traffic, *_: booked.append(traffic)):
        forward()
    return (1 + BACKWARD_TRAFFIC) * sum(booked) / _seconds_per_step(lambda: forward().backward(grad), device, seconds,
                                                                         busy=True)


#: The attention probe's query, key and value shape (batch, heads, sequence, head dim) and dtype, by device.
ATTENTION_SHAPES = {"cpu": ((2, 8, 256, 64), "float32"), "cuda": ((4, 16, 2048, 128), "bfloat16")}


def attention_job(ctx, seconds: float) -> tuple[str, float]:
    """``(dtype, FLOP/s)`` of SDPA's causal attention (the fused kernel torch picks) forward and backward on
    :data:`ATTENTION_SHAPES`, every rank at once, on the clock of compute alone (:func:`_seconds_per_step`),
    the slowest rank's; its FLOPs as the planner counts a model's attention core: torch's counter on the
    forward (:data:`~shardkit.planner.counters.EXTRA_FLOPS` for the CPU's kernel), the backward twice it.
    Over the same dtype's matrix products, ``Hardware.attention_efficiency``."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..planner.counters import EXTRA_FLOPS

    device = ctx.device
    shape, dtype = ATTENTION_SHAPES["cuda" if device.type == "cuda" else "cpu"]
    q, k, v = (torch.randn(shape, device=device, dtype=getattr(torch, dtype), requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=q.dtype)

    def forward() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS) as counter:
        forward()
    return dtype, 3 * counter.get_total_flops() / _seconds_per_step(lambda: forward().backward(grad), device,
                                                                   seconds, busy=True)


def overhead_job(ctx, seconds: float) -> tuple[int, float]:
    """``(aten ops per step, seconds per op)`` of a tiny training step, ``Linear(4, 4)`` forward,
    ``.sum()`` and backward on a 4 x 4 input, every rank stepping at once: the best of
    :data:`_BLOCKS` blocks of about ``seconds`` in all, the slowest rank's, over its ops, counted
    as the planner counts a model's (:class:`~shardkit.planner.counters.OpCounter`: the calls
    that launch a kernel, backward's included)."""
    device = ctx.device
    layer, x = torch.nn.Linear(4, 4).to(device), torch.randn(4, 4).to(device)

    def step() -> None:
        layer(x).sum().backward()

    step()  # warm-up: the gradients exist, so every later step accumulates into them alike
    booked: list[float] = []
    with OpCounter(booked.append):  # the operator calls the estimate multiplies op_overhead by
        step()
    return len(booked), _seconds_per_step(step, device, seconds, busy=True) / len(booked)


#: Compute seconds between two blocking collectives the skew probe sets up (:func:`skew_job`), each
#: measured :data:`SKEW_PAIRS` times: longer than a CPU scheduler's slices, shorter than a step.
SKEW_CHUNKS, SKEW_PAIRS = (0.01, 0.04), 5


def skew_job(ctx, seconds: float) -> tuple[list[tuple[float, float]], float]:
    """``([(compute seconds before a collective, seconds the collective waited)], idle seconds of one
    collective alone)``, :data:`SKEW_PAIRS` pairs per chunk of :data:`SKEW_CHUNKS`: every rank loops
    over matrix products then a tiny blocking
    all-reduce, over the products alone and over the all-reduce alone; what the loop of both leaves
    idle, per collective, beyond the two apart, is the wait for the last rank to arrive (each rank's
    compute ran at its own pace: processes sharing cores drift apart by the scheduler's slices, a
    GPU's by its clocks and kernels). Idle is the wall time less the world's CPU seconds over its
    cores on the CPU (so that the products alone leave only what other jobs took from the cores), the
    wall time on a GPU. Each loop runs for about ``seconds``; its mean per iteration, the slowest
    rank's (the typical wait, not a lucky block's)."""
    import time

    device = ctx.device
    n = 2048 if device.type == "cuda" else 256
    a, b, tiny = torch.randn(n, n, device=device), torch.randn(n, n, device=device), torch.zeros(256, device=device)
    product = _slowest(_timed(lambda: [a @ b for _ in range(8)], device) / 8, device)
    cores = os.cpu_count() or 1  # as calibrate counts them for shared_compute

    def idle(work: Callable[[], object], once: float) -> float:
        """Seconds per ``work()`` no rank computed: on the CPU, wall less CPU seconds over the cores."""
        work()
        repeats = max(3, round(seconds / max(once, 1e-6)))
        dist.barrier()
        cpu = time.process_time()
        wall = _timed(lambda: [work() for _ in range(repeats)], device)
        busy = torch.tensor([time.process_time() - cpu], dtype=torch.float64, device=device)
        dist.all_reduce(busy)
        return (_slowest(wall, device) - (float(busy.item()) / cores if device.type == "cpu" else 0.0)) / repeats

    alone = idle(lambda: dist.all_reduce(tiny), 1e-3)
    waits = []
    for chunk in SKEW_CHUNKS:
        products = max(1, round(chunk / product))

        def compute(count: int = products) -> None:
            for _ in range(count):
                a @ b

        for _ in range(SKEW_PAIRS):
            computing = idle(compute, chunk)  # on the CPU: what other jobs took from the cores meanwhile
            both = idle(lambda: (compute(), dist.all_reduce(tiny)), chunk + alone)  # noqa: B023 (used at once)
            waits.append((products * product, max(0.0, both - computing - alone)))
    return waits, alone


def overlap_job(ctx, seconds: float, rounds: int) -> Overlap:
    """:class:`Overlap` of float32 products of :data:`OVERLAP_MATMUL` square matrices and
    all-reduces of :data:`OVERLAP_MESSAGE` bytes, each loop sized to take about ``seconds``
    alone; the best of ``rounds`` rounds of (products, all-reduces, both), the slowest rank's."""
    device = ctx.device
    a, b = (torch.randn(OVERLAP_MATMUL, OVERLAP_MATMUL).to(device) for _ in range(2))
    probe = torch.zeros(OVERLAP_MESSAGE // 4, device=device)
    a @ b  # warm-up
    dist.all_reduce(probe)
    products = max(1, round(seconds / _slowest(_timed(lambda: [a @ b for _ in range(4)], device) / 4, device)))
    messages = max(1, min(_MAX_REPEATS, round(seconds / _slowest(_timed(lambda: dist.all_reduce(probe), device),
                                                                  device))))
    buffers = [torch.zeros(OVERLAP_MESSAGE // 4, device=device) for _ in range(messages)]

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
            best[i] = min(best[i], _slowest(_timed(work, device), device))
    return Overlap(*best)


def _tensors(collective: str, elements: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) float32 tensors on ``device`` for ``elements`` elements in all."""
    if collective == "reduce_scatter":  # the whole tensor in, this rank's share out
        return torch.zeros(elements, device=device), torch.empty(elements // world, device=device)
    given = elements // world if collective == "all_gather" else elements
    return torch.zeros(given, device=device), torch.empty(elements, device=device)


def _all_reduce(tensors: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> None:
    dist.all_reduce(tensors[0])


def _all_gather(tensors: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> None:
    dist.all_gather_single(tensors[1], tensors[0])


def _reduce_scatter(tensors: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> None:
    dist.reduce_scatter_tensor(tensors[1], tensors[0])


def _p2p(tensors: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> None:
    """Every rank sends to the next and receives from the previous at once (a ring step)."""
    p2p.exchange_and_wait(None, sends=[((rank + 1) % world, tensors[0])], receives=[((rank - 1) % world, tensors[1])])


_OPS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter, "p2p": _p2p}


__all__ = ["GROWTH", "MAX_MESSAGE_BYTES", "OVERLAP_MATMUL", "OVERLAP_MESSAGE", "ATTENTION_SHAPES", "Overlap", "attention_job", "bandwidth_job",
           "collective_job", "device_job", "matmul_job", "overhead_job", "overlap_job", "ready",
           "SKEW_CHUNKS", "seconds_per_steps", "skew_job"]
