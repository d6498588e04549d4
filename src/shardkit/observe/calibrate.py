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
  calls that launch a kernel (counted as the planner counts a model's, with
  :class:`~shardkit.planner.counters.OpCounter`) is the fixed cost of one operator call:
  Python, the module call, autograd and dispatch, amortised over the ops (the kernels on 16
  numbers cost next to nothing). The same step with the layer's parameters and input as
  replicated DTensors gives ``dtensor_overhead``, what each operator on a DTensor adds.
- **overlap**: a loop of float32 matrix products alone, a loop of 2 MiB all-reduces alone, then
  both at once (the all-reduces issued with ``async_op=True`` before the products, waited after
  them, as FSDP and DDP issue theirs), :class:`Overlap`.
- **memory**: the machine's available RAM (``MemAvailable``) divided by the world size: the
  processes share it. ``devices_per_node`` is the world size and ``inter_node`` equals
  ``intra_node`` (one node); ``matmul_efficiency`` is 1.0 (``flops`` is measured, not a peak)
  and ``reserved`` 0.

The jobs every process runs are in :mod:`shardkit.observe.probes`, the fits in
:mod:`shardkit.observe.fits`. Usage (about 15 s on 4 processes; ``shardkit calibrate`` does the
same and prints a table)::

    hw = sk.calibrate(4)
    hw.save("local.yaml")
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..plan.errors import UsageError
from ..planner.hardware import COLLECTIVES, DTYPES, Hardware, ring_terms
from ..runtime.devices import clock
from ..runtime.torchrun import in_torchrun
from ..runtime.world import LocalWorld, launch
from . import probes
from .fits import Fit, fit_alpha_beta, fit_residual
from .probes import Overlap

#: Matrix sizes (n of an n x n x n product) and message sizes (bytes, the whole tensor as in
#: :mod:`shardkit.planner.hardware`) of the default sweep.
MATMUL_SIZES = (64, 128, 256, 512, 1024)
MESSAGE_SIZES = tuple(2**k for k in range(12, 23, 2))  # 4 KiB to 4 MiB
SECONDS_PER_SIZE = 0.12
#: Bytes of each tensor of the memory-bandwidth add; large enough to leave the CPU's caches.
BANDWIDTH_BYTES = 64 * 2**20
#: ``progress(done, total, what)``: called before each measurement and once at the end.
Progress = Callable[[int, int, str], None]


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
    start = clock()
    report = progress or (lambda done, total, what: None)
    total = len(DTYPES) + len(COLLECTIVES) + 5
    report(0, total, f"starting {world_size} processes")
    if world is None:
        with LocalWorld(world_size, backend="gloo") as local:
            results = _run(local, matmul_sizes, message_sizes, seconds_per_size, report, total)
    else:
        results = _run(world, matmul_sizes, message_sizes, seconds_per_size, report, total)
    matmul, fits, bandwidth, (ops_per_step, op_overhead), overlap, dtensor_overhead = results
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
                        shared_compute=world_size > (os.cpu_count() or 1), dtensor_overhead=dtensor_overhead)
    report(total, total, "done")
    return Calibration(hardware, matmul, fits, ops_per_step, overlap, tuple(notes), clock() - start)


def _run(world: LocalWorld, matmul_sizes: Sequence[int], message_sizes: Sequence[int], seconds: float,
         report: Progress, total: int) -> tuple[dict[str, tuple[int, float] | None], dict[str, Fit], float,
                                                tuple[int, float], Overlap, float]:
    launch(probes.ready, world=world)  # the processes have started (the first job waits for them)
    done = 1
    matmul: dict[str, tuple[int, float] | None] = {}
    for dtype in DTYPES:
        report(done, total, f"{dtype} matrix products")
        per_rank = launch(probes.matmul_job, world=world, dtype=dtype, sizes=tuple(matmul_sizes), seconds=seconds)
        matmul[dtype] = _best_matmul(per_rank)
        done += 1
    fits = {}
    for collective in COLLECTIVES:
        report(done, total, f"gloo {collective}")
        sizes, times = launch(probes.collective_job, world=world, collective=collective, sizes=tuple(message_sizes),
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
    bandwidth = launch(probes.bandwidth_job, world=world, nbytes=BANDWIDTH_BYTES, repeats=5)[0]
    report(done + 1, total, "operator overhead")
    overhead = launch(probes.overhead_job, world=world, seconds=seconds)[0]
    report(done + 2, total, "DTensor operator overhead")
    dtensor = launch(probes.dtensor_overhead_job, world=world, seconds=seconds)[0][1]
    report(done + 3, total, "overlap of all-reduce and matmul")
    overlap = launch(probes.overlap_job, world=world, seconds=2 * seconds, rounds=2)[0]
    return matmul, fits, bandwidth, overhead, overlap, dtensor


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


__all__ = ["BANDWIDTH_BYTES", "MATMUL_SIZES", "MESSAGE_SIZES", "SECONDS_PER_SIZE", "Calibration", "Progress", "calibrate",
           "measure"]
