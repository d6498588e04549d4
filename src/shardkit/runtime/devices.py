"""One home for the device and the backend: nothing else in shardkit chooses a device or times a step.

- the backend (:func:`choose_backend`): NCCL only with a GPU for every rank of this machine, gloo
  where there is no GPU; fewer GPUs than ranks is refused, naming both, never run on the CPU
  silently (the CPU is asked for explicitly: ``backend="gloo"`` or ``SHARDKIT_BACKEND=gloo``);
- ``LOCAL_RANK`` (:func:`launcher_local_rank`): required under a launcher, never guessed from the
  global rank (on a second machine the global rank names no local GPU);
- the process group (:func:`open_process_group`): the rank's GPU set before it opens, and given to
  it (``device_id``); its timeout, and every group's made later (:func:`group_timeout`), is the
  job's plus :data:`GROUP_MARGIN_S`, so that shardkit's own timeout report (every stuck rank's
  stack) comes first and NCCL's watchdog never aborts a rank before it;
- inputs to the device (:func:`to_device`): pinned and asynchronous to a GPU;
- random initialisation (:data:`INIT_DEVICE`): drawn on the CPU, whose generator is the same
  everywhere, then copied, so the weights do not depend on the device type;
- time (:class:`StepTimer`, :func:`clock`): synchronised with the accelerator (CUDA events),
  since kernels run after the Python that launched them returns; a measurement's compute on
  processes sharing a CPU's cores (:func:`busy_clock`): CPU seconds, which other jobs' load leaves be;
- peak memory (:func:`memory_mark`, :func:`peak_growth`): growth since the mark, on any device.

Results go back to the parent on the CPU (``results.loads`` loads with ``map_location="cpu"``).

>>> choose_backend(1, "gloo"), device_of("gloo", 0)
('gloo', device(type='cpu'))
>>> timer = StepTimer(torch.device("cpu")).start()
>>> timer.stop() >= 0
True
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..plan import UsageError

BACKENDS = ("gloo", "nccl")
#: How much longer than the job's timeout a collective may wait before it fails on its rank (seconds):
#: enough for the parent to collect every stuck rank's stack first.
GROUP_MARGIN_S = 60.0
#: A job without a timeout (``timeout=None``): the process groups' limit, torch needing one.
NO_LIMIT = timedelta(days=7)
#: Where random initialisation draws: the CPU's generator gives the same numbers on every machine.
INIT_DEVICE = torch.device("cpu")
#: Set it to ``gloo`` to run a world on the CPU on a machine with GPUs, ``nccl`` to insist on GPUs.
BACKEND_VARIABLE = "SHARDKIT_BACKEND"

_GROUP_TIMEOUT: list[timedelta] = []  # the timeout this process's groups get (set when the world opens)


def gpu_count() -> int:
    """The GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(ranks: int, asked: str | None = None) -> str:
    """The backend for ``ranks`` processes on this machine: ``asked`` (or ``$SHARDKIT_BACKEND``) if
    given, else NCCL with a GPU per rank and gloo with no GPU. NCCL with fewer GPUs than ranks is
    refused (:class:`UsageError` naming both), whether asked or chosen.

    >>> choose_backend(4, "gloo")
    'gloo'
    """
    asked = asked or os.environ.get(BACKEND_VARIABLE) or None
    if asked is not None and asked not in BACKENDS:
        raise UsageError(f"backend {asked!r} (backend= or ${BACKEND_VARIABLE}) is not one shardkit runs on; "
                         f"choose one of {list(BACKENDS)}")
    gpus = gpu_count()
    if asked == "gloo" or (asked is None and gpus == 0):
        return "gloo"
    if gpus < ranks:
        raise UsageError(
            f"{ranks} rank(s) on this machine need one GPU each for NCCL, but {gpus} GPU(s) were found"
            f"{_gpu_names(gpus)}: ask for at most {gpus} rank(s) per machine, or run on the CPU explicitly "
            f"(backend='gloo', or {BACKEND_VARIABLE}=gloo); shardkit does not fall back to the CPU by itself")
    return "nccl"


def _gpu_names(gpus: int) -> str:
    if not gpus:
        return " (CUDA is not available)" if not torch.cuda.is_available() else ""
    return " (" + ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(gpus)) + ")"


def launcher_local_rank() -> int:
    """This process's ``LOCAL_RANK`` under a launcher (torchrun sets it); :class:`UsageError` when it is
    missing or not a whole number: the global rank is no GPU index on a machine other than the first."""
    value = os.environ.get("LOCAL_RANK")
    if value is None or not value.strip().isdigit():
        got = "it is not set" if value is None else f"it is {value!r}"
        raise UsageError(f"under a launcher (RANK={os.environ.get('RANK')}, WORLD_SIZE={os.environ.get('WORLD_SIZE')}) "
                         f"shardkit needs LOCAL_RANK, this process's index on its machine, but {got}; torchrun sets "
                         f"it, another launcher must too (shardkit never guesses it from the global rank)")
    return int(value)


def launcher_ranks_on_host() -> int:
    """How many ranks share this machine under a launcher (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"])


def device_of(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its GPU under NCCL, else the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def device_kind(device: torch.device) -> str:
    """What ``device`` is, for names and cache keys: ``cpu``, or the GPU's model in lower case with
    dashes (``nvidia-h200``), so that a measurement of one kind is never taken for another's.

    >>> device_kind(torch.device("cpu"))
    'cpu'
    """
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)  # the device's properties: no tensor is made
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def rank_device() -> torch.device:
    """This rank's device in the open process group: its current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def group_timeout_for(job_timeout: float | None) -> timedelta:
    """A process group's timeout for a job of ``job_timeout`` seconds (``None``: no limit):
    the job's plus :data:`GROUP_MARGIN_S`.

    >>> group_timeout_for(60).total_seconds()
    120.0
    """
    return NO_LIMIT if job_timeout is None else timedelta(seconds=job_timeout + GROUP_MARGIN_S)


def group_timeout() -> timedelta | None:
    """The timeout every group made in this process gets (``new_group``, DeviceMesh): the world's,
    set by :func:`open_process_group` (``None`` in a process group shardkit did not open: torch's default)."""
    return _GROUP_TIMEOUT[-1] if _GROUP_TIMEOUT else None


def set_group_timeout(timeout: timedelta) -> None:
    """What :func:`group_timeout` returns from now on (meshes.py applies it to the groups already made)."""
    _GROUP_TIMEOUT[:] = [timeout]


def open_process_group(backend: str, local_rank: int, job_timeout: float | None, **init: Any) -> torch.device:
    """Open the default process group for this rank and return its device: the GPU set first and
    passed as ``device_id`` under NCCL, the timeout :func:`group_timeout_for` the job's. ``init``:
    the rest of ``init_process_group``'s arguments (store, rank, world_size)."""
    device = device_of(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = group_timeout_for(job_timeout)
    set_group_timeout(timeout)
    dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None, **init)
    return device


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; from the CPU to a GPU through pinned memory, without blocking the CPU."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def synchronize(device: torch.device | None = None) -> None:
    """Wait for the work queued on ``device`` (``None``: this process's GPU, if CUDA is in use)."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | None = None) -> float:
    """Seconds (``perf_counter``) once the work queued on ``device`` has run: differences of two
    readings time that work, not the launching of it.

    >>> start = clock(); clock() - start >= 0
    True
    """
    synchronize(device)
    return time.perf_counter()


def busy_clock(device: torch.device, ranks_on_host: int) -> Callable[[], float]:
    """A clock for work that runs alone on each rank (no collective inside what it times): :func:`clock`,
    except on CPU processes of one thread each that outnumber the machine's cores, where it reads this
    process's CPU seconds x ``ranks_on_host`` / cores, the wall time the work takes while the world's
    processes share the cores and nothing else runs. Calibration uses it so that what other jobs take
    from the cores meanwhile is not measured as the machine's speed (their load moved a wall-timed
    float32 product by 1.5-4x on 2 shared cores; a process's CPU time moves little with it).

    >>> tick = busy_clock(torch.device("cpu"), ranks_on_host=1)
    >>> tick() <= tick()
    True
    """
    cores = os.cpu_count() or 1
    if device.type != "cpu" or ranks_on_host <= cores or torch.get_num_threads() != 1:
        return lambda: clock(device)
    share = ranks_on_host / cores
    return lambda: time.process_time() * share


def wall_ns(device: torch.device | None = None) -> int:
    """Nanoseconds since the epoch (``time.time_ns``, one clock for the processes of a machine) once the
    work queued on ``device`` has run: for timeline spans."""
    synchronize(device)
    return time.time_ns()


class StepTimer:
    """Seconds one step takes on ``device``: CUDA events around it on a GPU (read once they have
    run), ``perf_counter`` on the CPU. :meth:`stop` waits for the step's work; :meth:`mark` records
    its end without waiting and :meth:`seconds` reads it later (:class:`StepTimes`: no host sync at
    steps whose time nobody reads yet).

    >>> timer = StepTimer(torch.device("cpu")).start()
    >>> seconds = timer.stop()
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._events: tuple[Any, Any] | None = None
        self._start = 0.0
        self._seconds = 0.0

    def start(self) -> StepTimer:
        if self.device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._start = time.perf_counter()
        return self

    def mark(self) -> StepTimer:
        """The step's end, without waiting for its work: an event recorded after it on a GPU, the
        clock read on the CPU (whose work is done when the call returns)."""
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._start
        return self

    def seconds(self) -> float:
        """The seconds from :meth:`start` to :meth:`mark`, once the step's work has run (on a GPU it
        waits for the end event: a host sync, immediate if a later event was waited for already)."""
        if self._events is not None:
            begin, end = self._events
            end.synchronize()
            return begin.elapsed_time(end) / 1000.0
        return self._seconds

    def stop(self) -> float:
        """The seconds since :meth:`start`, once the step's work has run."""
        return self.mark().seconds()


class StepTimes:
    """Steps timed and not read yet: each step's timer marked at its end (:meth:`add`), all read at
    once where a number is asked for (:meth:`read`). On a GPU the steps between two reads run with no
    host sync; the read waits for the last step's end event, and the earlier ones (the same stream,
    recorded before it) have run by then.

    >>> times = StepTimes(); times.add(0, StepTimer().start()); [step for step, _ in times.read()]
    [0]
    """

    def __init__(self) -> None:
        self._timers: list[tuple[int, StepTimer]] = []

    def add(self, step: int, timer: StepTimer) -> None:
        """``step`` ended now, timed by ``timer`` (started at its beginning)."""
        self._timers.append((step, timer.mark()))

    def read(self) -> list[tuple[int, float]]:
        """``(step, seconds)`` of every step added since the last read, in order."""
        found = [(step, timer.seconds()) for step, timer in self._timers]
        self._timers.clear()
        return found


def memory_per_process(ranks_on_host: int) -> tuple[int, str]:
    """The machine's available RAM over the processes sharing it, and a note saying what was read."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available, source = int(fields["MemAvailable"].split()[0]) * 1024, "available RAM (MemAvailable)"
    except (OSError, KeyError, ValueError):  # no /proc (macOS): the physical memory, said so in the note
        available, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM (no MemAvailable)"
    return available // ranks_on_host, f"memory: {source} / {ranks_on_host} processes"


def memory_mark(device: torch.device) -> int:
    """Start a peak-memory measurement on a GPU: its peak statistic reset; returns the bytes
    allocated now (what :func:`peak_growth` subtracts). 0 on the CPU (``observe.memory`` reads RSS)."""
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_growth(device: torch.device, mark: int) -> int:
    """The most bytes allocated on a GPU since :func:`memory_mark` returned ``mark``, above ``mark``."""
    return max(0, torch.cuda.max_memory_allocated(device) - mark)


__all__ = ["BACKENDS", "GROUP_MARGIN_S", "INIT_DEVICE", "NO_LIMIT", "StepTimer", "StepTimes", "choose_backend", "clock",
           "device_kind", "device_of", "gpu_count", "group_timeout", "group_timeout_for", "launcher_local_rank",
           "launcher_ranks_on_host", "memory_mark", "memory_per_process", "open_process_group", "peak_growth", "rank_device", "set_group_timeout",
           "synchronize", "to_device",
           "wall_ns"]
