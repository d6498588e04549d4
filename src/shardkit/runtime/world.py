"""Worlds of processes: an embedded local world (gloo on CPU) or an existing torchrun world.

torch.multiprocessing can spawn processes, but it has no *persistent* pool that keeps a
process group alive across jobs, and its errors do not stop the other ranks' collectives.
:class:`LocalWorld` adds both: start processes once, run many jobs on them (a process start
costs seconds), and on any failure stop every process and raise the failing rank's traceback.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import pickle
import queue
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..plan import Plan, PlanError

STOP_GRACE_S = 10.0  # how long a stopping world waits before killing processes


class WorldError(RuntimeError):
    """A rank raised (or died) while running a job; carries the rank and its traceback."""

    def __init__(self, rank: int, details: str):
        self.rank = rank
        self.details = details
        super().__init__(f"rank {rank} failed:\n{details}")


@dataclass
class Context:
    """What a job sees in every process: its rank, device, plan and (lazily) the DeviceMesh.

    ``data_rank`` / ``data_world`` place this process among the data-parallel replicas (the
    ``dp`` x ``fsdp`` coordinates); ranks that differ only on model axes (and ``sp``) share a
    data rank.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    plan: Plan | None = None

    @property
    def mesh(self):
        """The plan's mesh as a torch ``DeviceMesh`` (created once per shape in a process)."""
        if self.plan is None:
            raise PlanError("this job was started without a plan, so it has no mesh; pass a Plan to launch/run")
        from .meshes import meshes_for

        return meshes_for(self.plan, self.device.type).device_mesh

    def coordinates(self) -> dict[str, int]:
        return {} if self.plan is None else self.plan.mesh.coordinates(self.rank)

    @property
    def data_rank(self) -> int:
        return self.rank if self.plan is None else self.plan.mesh.data_index(self.rank)

    @property
    def data_world(self) -> int:
        return self.world_size if self.plan is None else self.plan.mesh.data_size

    def shard_batch(self, *tensors: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """This rank's part of each tensor: an equal slice of the batch (``dim``) per data rank,
        and, on a mesh with ``sp`` > 1, this sp rank's load-balanced chunks of the sequence
        (``dim + 1``) — inputs and targets are split identically."""
        sp = 1 if self.plan is None else self.plan.mesh.size_of("sp")
        out = []
        for t in tensors:
            if t.shape[dim] % self.data_world:
                raise PlanError(self.plan.batch_problems(t.shape[dim]) if self.plan else
                                f"batch of {t.shape[dim]} samples does not split over {self.data_world} ranks")
            part = t.chunk(self.data_world, dim=dim)[self.data_rank]
            if sp > 1:
                from .ring_attention import shard_sequence

                part = shard_sequence(part, self.coordinates()["sp"], sp, dim=dim + 1)
            out.append(part.to(self.device))
        return out[0] if len(out) == 1 else tuple(out)


_CURRENT: list[Context] = []


def current_context() -> Context:
    """The Context of the job running in this process (inside ``launch`` / ``LocalWorld.run``)."""
    if not _CURRENT:
        raise RuntimeError("no shardkit job is running in this process; call this inside a function passed to "
                           "sk.launch(...) or LocalWorld.run(...)")
    return _CURRENT[-1]


def _run_job(ctx: Context, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    _CURRENT.append(ctx)
    try:
        return fn(ctx, *args, **kwargs)
    finally:
        _CURRENT.pop()


def _default_backend(world_size: int) -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank: int, world_size: int, port: int, backend: str, threads: int, jobs, results) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    # FSDP2 warns on every forward whose output is a view (any Linear on 3-D input); it concerns
    # in-place ops on that output, which neither step() nor verify does.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    # DTensor logs a warning whenever a redistribute needs two all-gathers (FSDP x TP full_tensor).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    device = _device_for(backend, rank)
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, payload = job
        try:
            fn, args, kwargs, plan = pickle.loads(payload)
            ctx = Context(rank, world_size, rank, device, plan)
            results.put((job_id, rank, True, _dumps(_run_job(ctx, fn, args, kwargs))))
        except BaseException:  # report everything, including KeyboardInterrupt, then keep serving
            results.put((job_id, rank, False, traceback.format_exc()))
    dist.barrier()  # leave together: see _close_joined_world
    dist.destroy_process_group()


class LocalWorld:
    """A persistent world of ``size`` local processes (gloo on CPU, NCCL with enough GPUs).

    >>> def hello(ctx):
    ...     return ctx.rank
    >>> with LocalWorld(2) as world:          # doctest: +SKIP
    ...     world.run(hello)
    [0, 1]
    """

    def __init__(self, size: int, backend: str | None = None, threads: int | None = None):
        if size < 1:
            raise PlanError(f"a world needs at least 1 process, got {size}")
        self.size = size
        self.backend = backend or _default_backend(size)
        self.threads = threads or max(1, (os.cpu_count() or 1) // size)
        self._procs: list = []
        self._jobs: list = []
        self._next_job = 0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, self.size + 1, is_master=True, wait_for_workers=False)
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.size, self._store.port, self.backend, self.threads, self._jobs[r], self._results),
                        daemon=True, name=f"shardkit-rank{r}")
            for r in range(self.size)
        ]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, plan: Plan | None = None, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the values in rank order.

        If any rank raises or dies, every process is stopped and :class:`WorldError` names
        the rank and its traceback; the world is closed afterwards.
        """
        if not self.alive:
            raise RuntimeError("this LocalWorld is closed (a previous job failed or close() was called)")
        if plan is not None:
            plan = plan.resolved(self.size)
        try:
            payload = pickle.dumps((fn, args, kwargs, plan))
        except Exception as exc:
            raise PlanError(f"cannot send the job to the worker processes: {exc}. Pass top-level (importable) "
                            f"functions and picklable arguments, not lambdas or local functions") from None
        job_id = self._next_job
        self._next_job += 1
        for q in self._jobs:
            q.put((job_id, payload))
        values: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(values) < self.size:
            try:
                got_id, rank, ok, data = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    code = self._procs[dead[0]].exitcode
                    self.close(force=True)
                    raise WorldError(dead[0], f"process exited with code {code} without finishing the job") from None
                if deadline is not None and time.monotonic() > deadline:
                    self.close(force=True)
                    raise WorldError(-1, f"job did not finish within {timeout} s; ranks done: {sorted(values)}") from None
                continue
            if got_id != job_id:
                continue
            if not ok:
                self.close(force=True)
                raise WorldError(rank, data)
            values[rank] = _loads(data)
        return [values[r] for r in range(self.size)]

    def close(self, force: bool = False) -> None:
        """Stop the processes (politely unless ``force``; killed after a grace period)."""
        if not force:
            for q in self._jobs:
                q.put(None)
        deadline = time.monotonic() + (0 if force else STOP_GRACE_S)
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self._procs = []

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)


def in_torchrun() -> bool:
    """True inside a world started by ``torchrun`` (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_LEAVING_ON_ERROR: list[BaseException] = []


def _watch_uncaught_exceptions() -> None:
    """Note an uncaught exception (then report it as before), for _close_joined_world."""
    previous = sys.excepthook

    def note_then_report(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        _LEAVING_ON_ERROR.append(exc)
        previous(exc_type, exc, tb)

    sys.excepthook = note_then_report


def _close_joined_world() -> None:
    """Close the torchrun world we joined, all ranks together: one rank tearing gloo down while
    its peer still holds the connection can abort the peer at exit ("terminate called without
    an active exception"). A rank leaving on an uncaught exception skips the barrier (its peers
    may never reach it); torchrun then stops the rest."""
    if not dist.is_initialized():
        return
    if not _LEAVING_ON_ERROR:
        dist.barrier()
    dist.destroy_process_group()


def _run_in_torchrun(fn: Callable[..., Any], plan: Plan | None, args: tuple, kwargs: dict) -> list[Any]:
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
        _watch_uncaught_exceptions()
        atexit.register(_close_joined_world)
    device = _device_for(dist.get_backend(), local_rank)
    ctx = Context(rank, world_size, local_rank, device, None if plan is None else plan.resolved(world_size))
    value = _run_job(ctx, fn, args, kwargs)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def launch(fn: Callable[..., Any], plan: Plan | None = None, *args: Any, world_size: int | None = None,
           world: LocalWorld | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on every process of a world; return values in rank order.

    Under ``torchrun`` it joins that world (NCCL when CUDA is present, else gloo). Otherwise
    it starts ``world_size`` local processes (default: the plan's mesh size), or uses
    ``world`` if given. Any failing rank stops all processes and raises :class:`WorldError`.

    >>> def work(ctx):
    ...     return ctx.rank
    >>> launch(work, Plan(mesh=Mesh(dp=2)))   # doctest: +SKIP
    [0, 1]
    """
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(f"launch(fn, plan): plan must be a shardkit Plan, got {type(plan).__name__}")
    if in_torchrun():
        return _run_in_torchrun(fn, plan, args, kwargs)
    if world is not None:
        return world.run(fn, *args, plan=plan, **kwargs)
    size = world_size
    if size is None:
        if plan is None or not plan.mesh.is_resolved:
            raise PlanError("launch needs world_size= when the plan is missing or its mesh has a -1 axis")
        size = plan.mesh.size
    with LocalWorld(size) as local:
        return local.run(fn, *args, plan=plan, **kwargs)
