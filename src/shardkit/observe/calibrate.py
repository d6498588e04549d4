"""Measure a world as it really runs and describe it as a :class:`~shardkit.Hardware`.

The world measured is the one that will run, on the devices and backend it will run on
(runtime/devices.py chooses them: NCCL with a GPU per rank, gloo on the CPU, ``SHARDKIT_BACKEND``
to insist): outside a launcher ``world_size`` local processes started as ``shardkit train``
starts them (:class:`~shardkit.LocalWorld`: on the CPU each process gets its share of the cores);
under ``torchrun`` the torchrun world itself, every rank running the probes in it, the result
broadcast from rank 0 so that every rank holds the same :class:`Hardware`. The figures are what
a training step there sees:

- **matmul**: every process multiplies square matrices on its device at once, for a fixed time per
  size, over a size sweep (:data:`MATMUL_SIZES` on the CPU, :data:`GPU_MATMUL_SIZES` on GPUs);
  a size's figure is the slowest process's FLOP/s (the slowest rank paces a synchronous step)
  and a dtype's the best size's. float16 is measured too when it runs on the device; where it
  does not, float16 is given bfloat16's figure and a note says so.
- **collectives**: the backend's all-reduce, all-gather and a send/recv ring, timed over a range of
  message sizes (the slowest rank's time; the best of three blocks), then fitted with
  :func:`fit_alpha_beta`; the fit's relative residual says how well alpha-beta describes them.
  Where the largest message takes less than twice the smallest's time (a loaded machine, whose
  latency and noise hide the bandwidth), larger messages are timed, up to 256 MiB.
- **memory bandwidth**: every process runs a layer norm, a GeLU and a residual add on a float32
  tensor of :func:`bandwidth_bytes` (4 MiB on the CPU, 256 MiB on a GPU), forward and backward, at
  once; bytes/s is the bytes the planner books for them (:class:`~shardkit.planner.counters.OpCounter`,
  the backward at ``BACKWARD_TRAFFIC`` times the forward's) over the best time, the slowest
  process's (:func:`~shardkit.observe.probes.bandwidth_job`: on a CPU these operators are bound by
  their arithmetic, not by the memory's streaming bandwidth, 2-4x lower than a large add's).
- **attention**: every process runs SDPA's causal attention forward and backward at once
  (:data:`~shardkit.observe.probes.ATTENTION_SHAPES`); its FLOPs as the planner counts them over the
  time, over the same dtype's matmul figure, is ``attention_efficiency`` (a CPU's flash kernel and a
  GPU's reach less than a large product's rate).
- **op overhead**: a tiny training step, ``Linear(4, 4)`` forward, ``.sum()`` and backward on a
  4 x 4 input, timed on every process at once; its seconds divided by the number of aten ops it
  calls that launch a kernel (counted as the planner counts a model's, with
  :class:`~shardkit.planner.counters.OpCounter`) is the fixed cost of one operator call:
  Python, the module call, autograd and dispatch, amortised over the ops (the kernels on 16
  numbers cost next to nothing). The same step with the layer's parameters and input as
  replicated DTensors gives ``dtensor_overhead``, what each operator on a DTensor adds.
- **DTensor collective overhead**: a tiny sequence-parallel block (torch's styles) stepped on
  DTensors and on plain tensors by pairs of ranks, every pair at once: the difference, less
  ``dtensor_overhead`` per DTensor operator, per collective, less the raw all-gather's time, is
  ``dtensor_collective``, what each of tensor parallel's collectives adds to the link's alpha-beta
  time (:func:`~shardkit.observe.dtensor_probes.dtensor_collective_job`).
- **skew**: every process loops over matrix products (10 and 40 ms of them) then a tiny blocking
  all-reduce: the time no rank computed (the wall time less the world's CPU seconds over its cores on
  the CPU), per collective, beyond the all-reduce's and the products' alone (what other jobs took), is
  the wait for the last rank to arrive; ``skew`` is its median over the square root of the compute
  before it (ranks drift apart as a random walk: :func:`~shardkit.observe.probes.skew_job`,
  :func:`~shardkit.observe.fits.fit_skew`); ``sync_idle``: the tiny all-reduce's own idle time in that
  loop less the all-reduce link's latency (the typical call against the best block's).
- **overlap**: a loop of float32 matrix products alone, a loop of 2 MiB all-reduces alone, then
  both at once (the all-reduces issued with ``async_op=True`` before the products, waited after
  them, as FSDP and DDP issue theirs), :class:`Overlap`.
- **memory**: a GPU's total memory; on the CPU the machine's available RAM (``MemAvailable``)
  divided by the processes on it, which share it. ``devices_per_node`` is the processes on a
  machine and ``inter_node`` equals ``intra_node`` (the world's links as measured; on several
  machines, the slowest, a note says so); ``matmul_efficiency`` is 1.0 (``flops`` is measured,
  not a peak) and ``reserved`` 0.

Every time is read with the one timer (:func:`~shardkit.runtime.devices.clock`, which waits for a
GPU's kernels); what runs alone on each rank (products, bandwidth, the overheads) on processes that
outnumber a CPU's cores with :func:`~shardkit.runtime.devices.busy_clock` (their CPU seconds over
their share of the cores), so that other jobs' load is not measured as the machine's speed. The
hardware's name, and the key it is kept under (:func:`cached`), say where it was
measured: ``local-2-gloo-cpu``, ``torchrun-8-nccl-nvidia-h100-80gb-hbm3``; a CPU measurement is never
taken for GPUs.

The jobs every process runs are in :mod:`shardkit.observe.probes`, the fits in
:mod:`shardkit.observe.fits`. Usage (about 15 s on 4 CPU processes; ``shardkit calibrate`` does the
same and prints a table)::

    hw = sk.calibrate(4)
    hw.save("local.yaml")
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..plan.errors import UsageError
from ..planner.hardware import COLLECTIVES, DTYPES, Hardware, ring_terms
from ..runtime.devices import (
    choose_backend,
    clock,
    device_kind,
    device_of,
    launcher_ranks_on_host,
    rank_device,
)
from ..runtime.torchrun import in_torchrun
from ..runtime.world import LocalWorld, launch
from . import dtensor_probes, probes
from .fits import Fit, fit_alpha_beta, fit_residual, fit_skew
from .probes import Overlap

#: Matrix sizes (n of an n x n x n product) on the CPU and on GPUs, and message sizes (bytes, the
#: whole tensor as in :mod:`shardkit.planner.hardware`) of the default sweep.
MATMUL_SIZES = (64, 128, 256, 512, 1024)
GPU_MATMUL_SIZES = (1024, 2048, 4096, 8192)
MESSAGE_SIZES = tuple(2**k for k in range(12, 23, 2))  # 4 KiB to 4 MiB
SECONDS_PER_SIZE = 0.12
#: Bytes of the memory-bandwidth probe's tensor on the CPU: a block's activation in the models a CPU
#: world trains (:func:`bandwidth_bytes`: 256 MiB on a GPU, out of its L2 cache of up to 50 MiB).
BANDWIDTH_BYTES = 4 * 2**20
#: ``progress(done, total, what)``: called before each measurement and once at the end.
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Calibration:
    """What :func:`measure` found: the :class:`Hardware`, each dtype's best ``matmul``
    ``(n, FLOP/s per process)`` (``None`` where the dtype did not run), each collective's
    :class:`Fit`, the aten ops of the tiny step ``op_overhead`` was measured on
    (``ops_per_step``), the :class:`Overlap` measurement, ``notes`` on what was not
    measured directly, and the ``backend`` and ``device`` kind measured."""

    hardware: Hardware
    matmul: dict[str, tuple[int, float] | None]
    fits: dict[str, Fit]
    ops_per_step: int
    overlap: Overlap
    notes: tuple[str, ...]
    seconds: float
    backend: str = "gloo"
    device: str = "cpu"


def world_name(launcher: str, world_size: int, backend: str, device: str) -> str:
    """The name of a measured world, and the key its hardware is kept under: where it runs
    (``local`` or ``torchrun``), its processes, its backend and its device kind
    (:func:`~shardkit.runtime.devices.device_kind`).

    >>> world_name("local", 2, "gloo", "cpu"), world_name("torchrun", 8, "nccl", "nvidia-h200")
    ('local-2-gloo-cpu', 'torchrun-8-nccl-nvidia-h200')
    """
    return f"{launcher}-{world_size}-{backend}-{device}"


def bandwidth_bytes(backend: str) -> int:
    """Bytes of the memory-bandwidth probe's tensor: :data:`BANDWIDTH_BYTES` on the CPU, 256 MiB on
    GPUs (NCCL), out of their caches."""
    return BANDWIDTH_BYTES * (64 if backend == "nccl" else 1)


# -- measuring -----------------------------------------------------------------------------------
def calibrate(world_size: int | None = None, *, matmul_sizes: Sequence[int] | None = None,
              message_sizes: Sequence[int] = MESSAGE_SIZES, seconds_per_size: float = SECONDS_PER_SIZE,
              name: str | None = None, world: LocalWorld | None = None,
              progress: Progress | None = None) -> Hardware:
    """The :class:`Hardware` of a world of ``world_size`` processes, measured where it runs (under
    ``torchrun``: the torchrun world, every rank calling it; :func:`measure` also returns what was
    measured and how well it fits).

    >>> calibrate(4, seconds_per_size=0)
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.UsageError: calibrate(seconds_per_size=0): give a finite number of seconds > 0
    """
    return measure(world_size, matmul_sizes=matmul_sizes, message_sizes=message_sizes,
                   seconds_per_size=seconds_per_size, name=name, world=world, progress=progress).hardware


def measure(world_size: int | None = None, *, matmul_sizes: Sequence[int] | None = None,
            message_sizes: Sequence[int] = MESSAGE_SIZES, seconds_per_size: float = SECONDS_PER_SIZE,
            name: str | None = None, world: LocalWorld | None = None,
            progress: Progress | None = None) -> Calibration:
    """Measure a world of ``world_size`` processes on the backend devices.py chooses: a new local world,
    or ``world`` (a live one of that size), or under ``torchrun`` the torchrun world itself (every rank
    calls it, and every rank gets rank 0's :class:`Calibration`; ``world_size`` may be left out). Matmul
    FLOP/s per dtype over ``matmul_sizes`` (default by device), each collective over ``message_sizes``
    bytes, ``seconds_per_size`` per point.

    >>> measure(1)
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.UsageError: calibrate(world_size=1): collectives need at least 2 processes; pass 2 or more
    """
    torchrun = in_torchrun()
    if torchrun and world_size is None:
        world_size = int(os.environ["WORLD_SIZE"])
    _check_arguments(world_size, matmul_sizes, message_sizes, seconds_per_size, world)
    assert world_size is not None
    start = clock()
    report = progress or (lambda done, total, what: None)
    total = len(DTYPES) + len(COLLECTIVES) + 8
    report(0, total, "joining the torchrun world" if torchrun else f"starting {world_size} processes")
    measured = dict(matmul_sizes=matmul_sizes, message_sizes=message_sizes, seconds=seconds_per_size,
                    report=report, total=total)
    if torchrun:
        return _from_rank_0(_calibration(None, "torchrun", world_size, launcher_ranks_on_host(), name, start,
                                         **measured))
    if world is None:
        with LocalWorld(world_size, backend=choose_backend(world_size)) as local:
            return _calibration(local, "local", world_size, world_size, name, start, **measured)
    return _calibration(world, "local", world_size, world_size, name, start, **measured)


def _calibration(world: LocalWorld | None, launcher: str, world_size: int, per_node: int, name: str | None,
                 start: float, *, matmul_sizes: Sequence[int] | None, message_sizes: Sequence[int], seconds: float,
                 report: Progress, total: int) -> Calibration:
    """Measure ``world`` (``None``: the torchrun world) and make its :class:`Calibration`."""
    device, memory, memory_note, backend = _devices(world, per_node)
    sizes = tuple(matmul_sizes or (GPU_MATMUL_SIZES if backend == "nccl" else MATMUL_SIZES))
    matmul, fits, bandwidth, attention, (ops_per_step, op_overhead), overlap, dtensors, (skew, sync_idle) = _run(
        world, world_size, backend, sizes, message_sizes, seconds, report, total)
    notes = []
    if matmul["float16"] is None:
        notes.append(f"float16 matrix products do not run on this {device}: float16 is given bfloat16's figure")
    notes.append(memory_note)
    if per_node < world_size:
        notes.append(f"{world_size // per_node} machines: inter_node and intra_node are both the world's links as "
                     f"measured (the slowest, between machines)")
    flops = {d: (matmul[d] or matmul["bfloat16"])[1] for d in DTYPES}
    attention_dtype, attention_flops = attention  # the fused kernel's rate over its dtype's matrix products
    dtensor_overhead, dtensor_collective = dtensors
    cores = os.cpu_count() or 1
    shared = device == "cpu" and per_node > cores  # processes sharing the machine's cores
    links = {c: fits[c].link for c in COLLECTIVES}
    hardware = Hardware(name=name or world_name(launcher, world_size, backend, device), memory=memory, flops=flops,
                        devices_per_node=per_node, intra_node=links, inter_node=links, memory_bandwidth=bandwidth,
                        matmul_efficiency=1.0, reserved=0, op_overhead=op_overhead, overlap=overlap.fraction,
                        attention_efficiency=min(1.0, attention_flops / flops[attention_dtype]),
                        shared_compute=shared, cores_per_node=cores if shared else 0,
                        dtensor_overhead=dtensor_overhead, dtensor_collective=dtensor_collective, skew=skew,
                        sync_idle=sync_idle)
    report(total, total, "done")
    return Calibration(hardware, matmul, fits, ops_per_step, overlap, tuple(notes), clock() - start, backend, device)


def _devices(world: LocalWorld | None, per_node: int) -> tuple[str, int, str, str]:
    """``(device kind, memory per device, what was read, backend)`` of the world: asked of its ranks, so
    that a GPU is never touched by this process outside them."""
    kinds = launch(probes.device_job, world=world, ranks_on_host=per_node)
    kind = kinds[0][0]
    if any(k != kind for k, _, _ in kinds):
        raise UsageError(f"calibrate: the world's ranks run on different devices "
                         f"({sorted({k for k, _, _ in kinds})}); one Hardware describes one kind of device")
    import torch.distributed as dist

    backend = world.backend if world is not None else dist.get_backend()
    return kind, min(m for _, m, _ in kinds), kinds[0][2], backend


def _from_rank_0(calibration: Calibration) -> Calibration:
    """Rank 0's ``calibration`` on every rank of the torchrun world (each rank read its own clock and
    memory), so that every rank plans alike."""
    import torch.distributed as dist

    held = [calibration]
    dist.broadcast_object_list(held, src=0)
    return held[0]


def _run(world: LocalWorld | None, world_size: int, backend: str, matmul_sizes: Sequence[int],
         message_sizes: Sequence[int], seconds: float, report: Progress,
         total: int) -> tuple[dict[str, tuple[int, float] | None], dict[str, Fit], float, tuple[str, float],
                              tuple[int, float], Overlap, tuple[float, float], tuple[float, float]]:
    done = 1
    matmul: dict[str, tuple[int, float] | None] = {}
    for dtype in DTYPES:
        report(done, total, f"{dtype} matrix products")
        per_rank = launch(probes.matmul_job, world=world, dtype=dtype, sizes=tuple(matmul_sizes), seconds=seconds)
        matmul[dtype] = _best_matmul(per_rank)
        done += 1
    fits = {}
    for collective in COLLECTIVES:
        report(done, total, f"{backend} {collective}")
        sizes, times = launch(probes.collective_job, world=world, collective=collective, sizes=tuple(message_sizes),
                              seconds=seconds)[0]  # every rank returns the slowest rank's times
        steps, factor = ring_terms(collective, world_size)
        try:
            link = fit_alpha_beta(sizes, times, factor, steps)
        except UsageError as error:
            raise UsageError(f"calibrate: {backend} {collective} up to {max(sizes)} bytes gives no bandwidth: "
                             f"{error}. The machine is too loaded to time it: run calibrate again when it is idle, "
                             f"or with fewer processes") from error
        fits[collective] = Fit(collective, tuple(sizes), tuple(times), link,
                               fit_residual(link, sizes, times, factor, steps))
        done += 1
    report(done, total, "memory bandwidth")
    bandwidth = launch(probes.bandwidth_job, world=world, nbytes=bandwidth_bytes(backend),
                       seconds=seconds)[0]
    report(done + 1, total, "attention")
    attention = launch(probes.attention_job, world=world, seconds=seconds)[0]
    report(done + 2, total, "operator overhead")
    overhead = launch(probes.overhead_job, world=world, seconds=seconds)[0]
    report(done + 3, total, "DTensor operator overhead")
    dtensor = launch(dtensor_probes.dtensor_overhead_job, world=world, seconds=seconds)[0][1]
    report(done + 4, total, "DTensor collective overhead")
    dtensor_collective = launch(dtensor_probes.dtensor_collective_job, world=world, seconds=seconds, dtensor_overhead=dtensor)[0]
    report(done + 5, total, "overlap of all-reduce and matmul")
    overlap = launch(probes.overlap_job, world=world, seconds=2 * seconds, rounds=2)[0]
    report(done + 6, total, "skew at blocking collectives")
    waits, alone = launch(probes.skew_job, world=world, seconds=2 * seconds)[0]
    # what a blocking collective leaves idle beyond the latency its link prices (the best of the link
    # probe's blocks, where the skew probe's loop is the typical call)
    sync_idle = max(0.0, alone - fits["all_reduce"].link.latency)
    return matmul, fits, bandwidth, attention, overhead, overlap, (dtensor, dtensor_collective), (fit_skew(waits),
                                                                                                 sync_idle)


def _best_matmul(per_rank: list[list[tuple[int, float]] | None]) -> tuple[int, float] | None:
    """The best size's figure, each size's figure being its slowest rank's."""
    if per_rank[0] is None:
        return None
    by_size = [(n, min(rank[i][1] for rank in per_rank)) for i, (n, _) in enumerate(per_rank[0])]
    return max(by_size, key=lambda item: item[1])


def _check_arguments(world_size: int | None, matmul_sizes: Sequence[int] | None, message_sizes: Sequence[int],
                     seconds_per_size: float, world: LocalWorld | None) -> None:
    problems = []
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        problems.append(f"calibrate(world_size={world_size!r}): collectives need at least 2 processes; "
                        f"pass 2 or more")
    if matmul_sizes is not None and (not matmul_sizes or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in matmul_sizes)):
        problems.append(f"calibrate(matmul_sizes={matmul_sizes!r}): give matrix sizes, integers >= 1")
    if len(set(message_sizes)) < 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 4 * 8
                                              for s in message_sizes):
        problems.append(f"calibrate(message_sizes={message_sizes!r}): give at least two different sizes in bytes, "
                        f"integers >= 32")
    if isinstance(seconds_per_size, bool) or not isinstance(seconds_per_size, (int, float)) \
            or not 0 < seconds_per_size < math.inf:
        problems.append(f"calibrate(seconds_per_size={seconds_per_size!r}): give a finite number of seconds > 0")
    if world is not None and world.size != world_size:
        problems.append(f"calibrate(world=...): the world has {world.size} processes; give a world of "
                        f"world_size={world_size}")
    if in_torchrun():
        torchrun_size = int(os.environ["WORLD_SIZE"])
        if world is not None:
            problems.append("calibrate(world=...): under torchrun the torchrun world is measured; give no world")
        if world_size != torchrun_size:
            problems.append(f"calibrate(world_size={world_size!r}): under torchrun the torchrun world of "
                            f"{torchrun_size} processes is measured; give world_size={torchrun_size} or none")
    if problems:
        raise UsageError("; ".join(problems))


# -- kept ----------------------------------------------------------------------------------------
def cached(world_size: int | None, folder: Path | None, *, recalibrate: bool = False,
           say: Callable[[str], None] = print, **kwargs) -> Hardware:
    """The hardware of the world that will run, measured once and kept in ``folder`` as
    ``<world_name>.yaml`` (:func:`world_name`: backend and device kind in the key); read from there
    when present, unless ``recalibrate``. ``folder=None``: measured, not kept. ``kwargs`` go to
    :func:`measure`; ``say`` tells what happens (measuring, and where it is kept).

    Under ``torchrun`` it is a collective: rank 0 alone reads the file or, every rank measuring the
    world together, writes it (atomically); every rank gets rank 0's :class:`Hardware`. Outside, the
    local world of ``world_size`` processes is started to measure it, and under NCCL to name its GPUs
    (asked of its ranks, as :func:`_devices` asks: this process never touches a GPU), then measured
    in that same world if no file is kept.
    """
    if in_torchrun():
        return _cached_in_torchrun(folder, recalibrate, say, kwargs)
    assert world_size is not None
    backend = choose_backend(world_size)
    if backend != "nccl":  # gloo's ranks compute on the CPU
        return _cached_local(world_size, backend, device_kind(device_of(backend, 0)), folder, recalibrate, say, kwargs)
    with LocalWorld(world_size, backend=backend) as world:
        kind = _devices(world, world_size)[0]
        return _cached_local(world_size, backend, kind, folder, recalibrate, say, {**kwargs, "world": world})


def _cached_local(world_size: int, backend: str, kind: str, folder: Path | None, recalibrate: bool,
                  say: Callable[[str], None], kwargs: dict) -> Hardware:
    """:func:`cached` of a local world whose devices are of ``kind``."""
    key = world_name("local", world_size, backend, kind)
    file = None if folder is None else folder / f"{key}.yaml"
    if file is not None and file.exists() and not recalibrate:
        return Hardware.load(file)
    say(f"measuring the local world of {world_size} {backend} processes (shardkit calibrate)"
        f"{'' if file is None else f'; kept in {file}'}")
    measured = calibrate(world_size, **kwargs)
    if file is not None:
        write_atomically(measured, file)
    return measured


def _cached_in_torchrun(folder: Path | None, recalibrate: bool, say: Callable[[str], None],
                        kwargs: dict) -> Hardware:
    import torch.distributed as dist

    launch(probes.ready)  # joins the torchrun world (opens its process group on first use)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    found: list = [None, None]  # rank 0's (file, Hardware kept there)
    if rank == 0:
        key = world_name("torchrun", world_size, dist.get_backend(), device_kind(rank_device()))
        file = None if folder is None else folder / f"{key}.yaml"
        kept = file is not None and file.exists() and not recalibrate
        found = [file, Hardware.load(file) if kept else None]
    dist.broadcast_object_list(found, src=0)
    file, hardware = found
    if hardware is not None:
        return hardware
    if rank == 0:
        say(f"measuring the torchrun world of {world_size} processes, every rank at once (shardkit calibrate)"
            f"{'' if file is None else f'; kept in {file}'}")
    measured = measure(world_size, **kwargs).hardware  # rank 0's, on every rank
    if rank == 0 and file is not None:
        write_atomically(measured, file)
    return measured


def write_atomically(hardware: Hardware, file: Path) -> None:
    """Save ``hardware`` to ``file``, its folder made first: whole or not at all (:meth:`Hardware.save`
    renames a temporary file over it), so a reader never sees half a file."""
    file.parent.mkdir(parents=True, exist_ok=True)
    hardware.save(file)


__all__ = ["BANDWIDTH_BYTES", "GPU_MATMUL_SIZES", "MATMUL_SIZES", "MESSAGE_SIZES", "SECONDS_PER_SIZE", "Calibration",
           "Progress", "bandwidth_bytes", "cached", "calibrate", "measure", "world_name", "write_atomically"]
