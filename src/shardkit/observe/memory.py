"""Memory per device: the peak seen while running, and the exact bytes of training state held.

Two different measures, because CPU has no allocator statistics:

* **CUDA**: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at the
  start, less what was allocated at the start (devices.py): the growth of memory held by
  tensors on this device since the start, as on the CPU (the caching allocator's own reserve
  is not included).
* **CPU**: the growth of the process's peak resident set size (RSS) over its RSS at the
  start. On Linux the kernel's high-water mark (``VmHWM`` in ``/proc/self/status``) is
  reset at the start by writing ``5`` to ``/proc/self/clear_refs``, so the peak is the
  peak *since the start*. Where that is not possible, ``ru_maxrss`` is used: it is the
  lifetime peak, so its excess over the RSS at the start is an upper bound, and (without
  ``/proc``, e.g. macOS) its own growth is a lower bound; ``method`` says which. RSS counts every page the process
  holds (tensors, Python objects, communication buffers). Memory freed earlier is handed
  back to the OS at the start (glibc ``malloc_trim``) so that reusing it counts as growth;
  what the allocator still keeps (fragments of live arenas) can be reused unseen, and
  anything else the process grows by (code imported, communication buffers) is included.

The state bytes are exact on every device: the sum of ``nbytes`` over the local shards
(``DTensor.to_local()``) of parameters, gradients and optimizer state this rank holds.
"""

from __future__ import annotations

import ctypes
import gc
import re
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime.devices import memory_mark, peak_growth

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the part of ``tensor`` held by this rank (the local shard of a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def tensors_nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Sum of :func:`local_nbytes` over ``tensors`` (``None`` entries count 0)."""
    return sum(local_nbytes(t) for t in tensors if t is not None)


@dataclass(frozen=True)
class StateBytes:
    """Exact bytes of training state held by this rank."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """Local bytes of ``model``'s parameters and gradients and of ``optimizer``'s state.

    >>> model = torch.nn.Linear(4, 2)
    >>> state_bytes(model)
    StateBytes(params=40, grads=0, optimizer=0)
    """
    params = list(model.parameters())
    opt_tensors = [] if optimizer is None else [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    return StateBytes(tensors_nbytes(params), tensors_nbytes(p.grad for p in params), tensors_nbytes(opt_tensors))


def _status_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return None if match is None else int(match.group(1))


def _release_free_memory() -> None:
    """Hand memory freed earlier back to the OS (glibc ``malloc_trim``), so reuse of it shows as growth."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class PeakMemory:
    """Peak memory of this process's device from ``start()`` (or ``with``) until ``peak_bytes()``.

    ``method`` says which measure was used (see the module docstring). On CPU the mark is
    process-wide: starting another ``PeakMemory`` resets it, so measure one span at a time.

    >>> with PeakMemory(torch.device("cpu")) as mem:
    ...     block = torch.ones(2**22)     # 16 MiB
    >>> mem.peak_bytes() > 0
    True
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.method = ""
        self._baseline = 0

    def start(self) -> PeakMemory:
        if self.device.type == "cuda":  # growth since start, as on the CPU
            self._baseline = memory_mark(self.device)
            self.method = "CUDA max_memory_allocated growth (since start)"
            return self
        _release_free_memory()
        rss = _status_kib("VmRSS")
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
            reset = rss is not None
        except OSError:
            reset = False
        if reset:
            self._baseline = rss * 1024
            self.method = "CPU peak RSS growth (VmHWM since start)"
        elif rss is not None:
            self._baseline = rss * 1024
            self.method = "CPU lifetime peak RSS (ru_maxrss) minus RSS at start: an upper bound"
        else:
            self._baseline = _maxrss_bytes()
            self.method = "CPU growth of the lifetime peak RSS (ru_maxrss): a lower bound"
        return self

    def peak_bytes(self) -> int:
        """Peak bytes since ``start()`` (see ``method`` for what is measured)."""
        if self.device.type == "cuda":
            return peak_growth(self.device, self._baseline)
        hwm = _status_kib("VmHWM") if "VmHWM" in self.method else None
        peak = hwm * 1024 if hwm is not None else _maxrss_bytes()
        return max(0, peak - self._baseline)

    def __enter__(self) -> PeakMemory:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        return None


class TensorMemoryPeak:
    """Peak bytes of tensors allocated on a device while the block runs (torch's profiler).

    CPU has no allocator statistics, and RSS also counts allocator slack and communication
    buffers. torch's profiler with ``profile_memory=True`` records every allocation and free
    made through torch's allocators; the running sum of those sizes, in time order, peaks at
    the most tensor memory held at once since the block began — CPU's analogue of
    ``torch.cuda.max_memory_allocated``. It slows the block down: use it to measure, not to
    train. (Allocation events are read from the profiler's event tree,
    ``kineto_results.experimental_event_tree()``: torch has no public accessor for them.)

    >>> with TensorMemoryPeak() as mem:
    ...     block = torch.ones(2**20)     # 4 MiB
    >>> mem.peak_bytes() >= 4 * 2**20
    True
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._profiler = None
        self._peak: int | None = None

    def __enter__(self) -> TensorMemoryPeak:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._profiler = profile(activities=activities, profile_memory=True)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._C._profiler import _EventType

        self._profiler.__exit__(*exc)
        allocations: list[tuple[int, int, int]] = []
        stack = list(self._profiler.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            kind, fields = node.typed
            if kind == _EventType.Allocation and fields.device.type == self.device.type:
                allocations.append((node.start_time_ns, fields.ptr, fields.alloc_size))
            stack.extend(node.children)
        # held by address: the profiler can miss a free (seen in a worker that has children of its own);
        # a new allocation at a held address shows the old one was freed, a free of an address not
        # allocated in the block frees what was there before it
        by_address: dict[int, int] = {}
        held = peak = 0
        for _, address, size in sorted(allocations):
            held -= by_address.pop(address, 0)
            if size > 0:
                by_address[address] = size
                held += size
            peak = max(peak, held)
        self._peak = peak

    def peak_bytes(self) -> int:
        if self._peak is None:
            raise RuntimeError("TensorMemoryPeak.peak_bytes() is available after the with-block has finished")
        return self._peak
