"""Worlds of processes: an embedded local world (gloo on CPU) or an existing torchrun world.

torch.multiprocessing can spawn processes, but it has no *persistent* pool that keeps a
process group alive across jobs, and its errors do not stop the other ranks' collectives.
:class:`LocalWorld` adds both: start processes once, run many jobs on them (a process start
costs seconds), and on any failure stop every process and raise the failing rank's traceback.

Faults (see docs/faults.md): every job has a timeout (:data:`DEFAULT_TIMEOUT_S` unless told
otherwise) after which the stack of every unfinished rank is shown and the world stopped; a
rank that dies is named rather than the peer that lost its connection to it; workers end with
their parent, however it ends, and whatever a worker starts ends with the world (descendants.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import math
import numbers
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..plan import Plan
from ..plan.errors import ShardkitError, UsageError
from .context import Context, run_job
from .descendants import Watchman, lead_descendants, new_token
from .devices import choose_backend, open_process_group
from .limits import DEFAULT_TIMEOUT_S
from .meshes import release_unused, use_timeout
from .processes import end_with_parent, exit_reason, last_line, lost_connection
from .results import dumps, loads
from .torchrun import in_torchrun, run_in_torchrun

STOP_GRACE_S = 10.0  # how long a stopping world waits before killing processes
DEATH_GRACE_S = 2.0  # how long a rank that lost its connection waits for its dead peer to be seen
STACK_WAIT_S = 5.0  # how long a timed-out job waits for the unfinished ranks to write their stacks
POLL_S = 0.05  # the step of the waits above
STACK_SIGNAL = signal.SIGUSR1  # asks a worker to write its Python stack (faulthandler)


class WorldError(ShardkitError, RuntimeError):
    """A rank raised, died or hung while running a job: ``rank`` names it, ``details`` says how
    (its traceback, its exit code, or its stack)."""

    def __init__(self, rank: int, details: str, summary: str | None = None):
        self.rank = rank
        self.details = details
        super().__init__(f"{summary or f'rank {rank} failed'}:\n{details}")


class WorldTimeout(WorldError):
    """A job outlived its timeout; the world was stopped. ``stacks`` maps every unfinished rank
    to its Python stack (all threads, most recent call first); ``finished`` lists the ranks that
    had returned; ``rank`` is the lowest unfinished rank.

    >>> try:                                              # doctest: +SKIP
    ...     world.run(train, timeout=600)
    ... except WorldTimeout as e:
    ...     print(sorted(e.stacks), e.finished)
    [0] [1]
    """

    def __init__(self, timeout: float, stacks: dict[int, str], finished: list[int]):
        self.timeout = timeout
        self.stacks = stacks
        self.finished = finished
        summary = (f"the job did not finish within its timeout of {timeout:g} s: ranks {sorted(stacks)} were "
                   f"still running (finished: {finished or 'none'}); the world was stopped. Pass a larger "
                   f"timeout= (seconds) or timeout=None for no limit. Where each unfinished rank was")
        details = "\n".join(f"rank {rank}:\n{textwrap.indent(stack, '  ')}" for rank, stack in sorted(stacks.items()))
        super().__init__(min(stacks), details, summary)


def _check_timeout(timeout: Any, caller: str) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) or timeout <= 0:
        raise UsageError(f"{caller}(timeout={timeout!r}): give a positive, finite number of seconds "
                         f"(default {DEFAULT_TIMEOUT_S:g}), or timeout=None for no limit")


def _check_world_size(size: Any, caller: str) -> None:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise UsageError(f"{caller}: a world needs a whole number of processes, at least 1; got {size!r}")


def _pack_job(fn: Callable[..., Any], args: tuple, kwargs: dict, plan: Plan | None, world_size: int,
              caller: str) -> bytes:
    """The job as every worker receives it, the plan resolved to the world size (PlanError when
    its mesh does not fit). UsageError names the part that cannot be pickled."""
    plan = None if plan is None else plan.resolved(world_size)
    try:
        return pickle.dumps((fn, args, kwargs, plan))
    except Exception as exc:
        name, value, error = _unpicklable_part(fn, args, kwargs, plan, exc)
        raise UsageError(f"{caller}: {name} ({value!r:.80}) cannot be sent to the worker "
                         f"processes: {error}. Pass top-level (importable) functions and picklable arguments, "
                         f"not lambdas, local functions, locks, files or sockets") from None


def _unpicklable_part(fn: Callable[..., Any], args: tuple, kwargs: dict, plan: Plan | None,
                      error: Exception) -> tuple[str, Any, Exception]:
    """The first of fn, args[i], kwargs[k], plan that pickle refuses, with its error."""
    parts = [("fn", fn), *((f"args[{i}]", a) for i, a in enumerate(args)),
             *((f"kwargs[{k!r}]", v) for k, v in kwargs.items()), ("plan", plan)]
    for name, value in parts:
        try:
            pickle.dumps(value)
        except Exception as exc:
            return name, value, exc
    return "the job", (fn, args, kwargs), error


def _worker(rank: int, world_size: int, port: int, backend: str, threads: int, parent: tuple[int, bool],
            stack_file: str, jobs, results, token: str) -> None:
    end_with_parent(*parent)
    lead_descendants(token)  # what this worker starts ends with the world: see descendants.py
    # faulthandler keeps the file open; the parent reads it when a job times out
    faulthandler.register(STACK_SIGNAL, file=open(stack_file, "w"), all_threads=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    # FSDP2 warns on every forward whose output is a view (any Linear on 3-D input); it concerns
    # in-place ops on that output, which neither step() nor verify does.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    # DTensor logs a warning whenever a redistribute needs two all-gathers (FSDP x TP full_tensor).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    # one machine: the local rank is the rank; each job sets the groups' timeout to its own (+ a margin)
    device = open_process_group(backend, rank, DEFAULT_TIMEOUT_S, store=store, rank=rank, world_size=world_size)
    # What starting made (torch, shardkit's modules) lives as long as the process: kept out of the garbage
    # collector's scans, which roughly halves every later full collection (Python's own, and the one a
    # job's end makes to free the meshes of a plan no longer used: meshes.py)
    gc.freeze()
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, payload, timeout = job
        try:
            use_timeout(timeout)  # the process groups wait as long as the job may run, plus a margin
            fn, args, kwargs, plan = pickle.loads(payload)
            ctx = Context(rank, world_size, rank, device, plan)
            results.put((job_id, rank, True, dumps(run_job(ctx, fn, args, kwargs))))
            release_unused(device)  # the meshes and groups no longer used (meshes.py)
        except BaseException:  # report everything, including KeyboardInterrupt, then keep serving
            results.put((job_id, rank, False, traceback.format_exc()))
    dist.barrier()  # leave together: see _close_joined_world
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every result was taken by the parent before it said stop; skip the interpreter's teardown
    # (seconds of torch and transformers finalisers per process on 2 cores).
    os._exit(0)


class LocalWorld:
    """A persistent world of ``size`` local processes (gloo on CPU, NCCL with a GPU per process;
    fewer GPUs than processes is refused unless ``backend="gloo"``: see devices.py).

    Before each job every process group's timeout becomes the job's plus a margin, so a stuck
    job is reported by the job's own timeout (every unfinished rank's stack), never by a
    collective giving up first (NCCL's watchdog would abort the rank).

    The processes end with the one that started them, however it ends (even SIGKILL), and so
    does every process they start (a DataLoader's workers, a subprocess).

    >>> def hello(ctx):
    ...     return ctx.rank
    >>> with LocalWorld(2) as world:          # doctest: +SKIP
    ...     world.run(hello)
    [0, 1]
    """

    def __init__(self, size: int, backend: str | None = None, threads: int | None = None):
        _check_world_size(size, "LocalWorld(size)")
        self.size = int(size)
        self.backend = choose_backend(self.size, backend)
        self.threads = threads or max(1, (os.cpu_count() or 1) // size)
        self._procs: list = []
        self._jobs: list = []
        self._next_job = 0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, self.size + 1, is_master=True, wait_for_workers=False)
        self._stack_dir = Path(tempfile.mkdtemp(prefix="shardkit-stacks-"))
        self._remove_stack_dir = weakref.finalize(self, shutil.rmtree, self._stack_dir, ignore_errors=True)
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.size)]
        for r in range(self.size):
            self._stack_file(r).touch()
        parent = (os.getpid(), threading.current_thread() is threading.main_thread())
        token = new_token()
        self._watchman = Watchman(token)
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.size, self._store.port, self.backend, self.threads, parent,
                                              str(self._stack_file(r)), self._jobs[r], self._results, token),
                        daemon=True, name=f"shardkit-rank{r}")
            for r in range(self.size)
        ]
        for p in self._procs:
            p.start()
            self._watchman.watch(p.pid)

    def _stack_file(self, rank: int) -> Path:
        return self._stack_dir / f"rank{rank}.txt"

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, plan: Plan | None = None,
            timeout: float | None = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the values in rank order.

        If any rank raises or dies, every process is stopped and :class:`WorldError` names
        the rank and its traceback (or exit code); if the job is still running after
        ``timeout`` seconds (default :data:`DEFAULT_TIMEOUT_S`, 30 minutes; ``None``: no
        limit), :class:`WorldTimeout` shows every unfinished rank's stack. Either way the
        world is closed afterwards.

        >>> world.run(hello, timeout=60)          # doctest: +SKIP
        [0, 1]
        """
        _check_timeout(timeout, "LocalWorld.run")
        if not self._procs:  # a process that died since the last job is named by the job's run
            raise UsageError("LocalWorld.run: this world is closed (a previous job failed or close() was called); "
                             "start a new LocalWorld")
        return self._run_packed(_pack_job(fn, args, kwargs, plan, self.size, "LocalWorld.run"), timeout)

    def _run_packed(self, payload: bytes, timeout: float | None) -> list[Any]:
        job_id = self._next_job
        self._next_job += 1
        for q in self._jobs:
            q.put((job_id, payload, timeout))
        values: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(values) < self.size:
            try:
                got_id, rank, ok, data = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = self._dead_ranks()
                if dead:
                    raise self._stopped(self._death(dead[0], self._survivor_context(job_id))) from None
                if deadline is not None and time.monotonic() > deadline:
                    raise self._stopped(self._timeout(timeout, sorted(values))) from None
                continue
            if got_id != job_id:
                continue
            if not ok:
                raise self._stopped(self._failure(rank, data))
            values[rank] = loads(data)
        return [values[r] for r in range(self.size)]

    def _dead_ranks(self, wait: float = 0.0) -> list[int]:
        """The ranks whose process has ended, waiting up to ``wait`` s for a first one."""
        deadline = time.monotonic() + wait
        while True:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(POLL_S)

    def _survivor_context(self, job_id: int) -> str:
        """A survivor's report that it lost its connection, if one comes within ``DEATH_GRACE_S`` of a
        death being seen (a peer in a collective with the dead rank fails soon after it)."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while time.monotonic() < deadline:
            try:
                got_id, rank, ok, data = self._results.get(timeout=POLL_S)
            except queue.Empty:
                if not any(p.is_alive() for p in self._procs):
                    return ""  # every rank has died: no survivor is left to report
                continue
            if got_id == job_id and not ok and lost_connection(data):
                return f"\n(rank {rank} then lost its connection: {last_line(data)})"
        return ""

    def _death(self, rank: int, context: str = "") -> WorldError:
        reason = exit_reason(self._procs[rank].exitcode)
        return WorldError(rank, f"its process {reason} before finishing the job{context}", f"rank {rank} died")

    def _failure(self, rank: int, details: str) -> WorldError:
        """The error for a rank's failure report. A rank that lost its connection is most likely
        the survivor of a peer that died: the dead peer is named instead, once it is seen."""
        if lost_connection(details):
            dead = self._dead_ranks(wait=DEATH_GRACE_S)
            if dead:
                return self._death(dead[0], f"\n(rank {rank} then lost its connection: {last_line(details)})")
        return WorldError(rank, details)

    def _timeout(self, timeout: float, finished: list[int]) -> WorldTimeout:
        unfinished = [r for r in range(self.size) if r not in finished]
        return WorldTimeout(timeout, self._stacks(unfinished), finished)

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each rank's Python stack, asked for by signal and written by its faulthandler."""
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[rank].pid, STACK_SIGNAL)
        files = [self._stack_file(rank) for rank in ranks]
        deadline = time.monotonic() + STACK_WAIT_S
        sizes: list[int] = []
        while time.monotonic() < deadline:  # until every file is written and stops growing
            time.sleep(POLL_S)
            previous, sizes = sizes, [f.stat().st_size for f in files]
            # a rank that has ended or is stopped writes nothing: waiting for it would only add STACK_WAIT_S
            if sizes == previous and all(size or self._cannot_write(rank) for rank, size in zip(ranks, sizes)):
                break
        return {rank: f.read_text().rstrip() or self._no_stack(rank) for rank, f in zip(ranks, files)}

    def _state(self, rank: int) -> str:
        """The state letter of a rank's process in Linux's ``/proc/<pid>/stat`` (``?`` where unknown)."""
        try:
            return Path(f"/proc/{self._procs[rank].pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "?"

    def _cannot_write(self, rank: int) -> bool:
        """Whether a rank asked for its stack can no longer write it: its process ended, or is stopped."""
        return not self._procs[rank].is_alive() or self._state(rank) in ("T", "t", "Z")

    def _no_stack(self, rank: int) -> str:
        """What is known of a rank that wrote no stack when asked: the signal ended it (it had not yet
        installed the handler: still starting), it had ended, it is stopped (a stopped process runs
        no signal handler), or it is waiting in the kernel; from its exit code and Linux's
        ``/proc/<pid>/stat``."""
        proc = self._procs[rank]
        if proc.exitcode == -STACK_SIGNAL:
            return (f"(no stack: the process was still starting: it had not yet installed the handler that writes "
                    f"its stack, so {STACK_SIGNAL.name}, which asks for it, ended it)")
        if not proc.is_alive():
            return f"(no stack: the process {exit_reason(proc.exitcode)} before it could write one)"
        state = self._state(rank)
        known = {"T": "is stopped (SIGSTOP, SIGTSTP, SIGTTIN or SIGTTOU), and a stopped process runs no signal handler",
                 "t": "is stopped by a debugger (traced), and a stopped process runs no signal handler",
                 "D": "is waiting in the kernel (uninterruptible sleep: disk or network I/O), where it handles no signal",
                 "Z": "had ended (a zombie)"}
        what = known.get(state, f"wrote none within {STACK_WAIT_S:g} s of being asked (state {state})")
        return f"(no stack: the process {what}; the world was stopped)"

    def _stopped(self, error: WorldError) -> WorldError:
        self.close(force=True)
        return error

    def close(self, force: bool = False) -> None:
        """Stop the processes (politely unless ``force``; killed after a grace period), and every
        process they started."""
        if force:  # at once, while each worker's tree is whole
            self._watchman.end()
        else:
            for q in self._jobs:
                q.put(None)
        deadline = time.monotonic() + (0 if force else STOP_GRACE_S)
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self._watchman.end()  # what the workers left behind
        self._procs = []
        self._remove_stack_dir()  # also done if the world is never closed, at collection or exit

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)


def _launch_size(plan: Plan | None, world_size: int | None) -> int:
    if world_size is not None:
        _check_world_size(world_size, "launch(world_size=...)")
        return int(world_size)
    if plan is None or not plan.mesh.is_resolved:
        raise UsageError("launch needs world_size= when the plan is missing or its mesh has a -1 axis")
    return plan.mesh.size


def launch(fn: Callable[..., Any], plan: Plan | None = None, *args: Any, world_size: int | None = None,
           world: LocalWorld | None = None, timeout: float | None = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on every process of a world; return values in rank order.

    Under ``torchrun`` it joins that world (NCCL with a GPU per local rank, gloo without GPUs). Otherwise
    it starts ``world_size`` local processes (default: the plan's mesh size), or uses
    ``world`` if given. Any failing rank stops all processes and raises :class:`WorldError`.
    A job still running after ``timeout`` seconds (default :data:`DEFAULT_TIMEOUT_S`, 30
    minutes; ``None``: no limit) is stopped with every unfinished rank's stack
    (:class:`WorldTimeout`; under torchrun each stuck rank prints its stack and exits 1).

    Before any process starts, the job must pickle (:class:`UsageError` names the part that
    does not) and the plan's mesh must fit the world size (:class:`PlanError`).

    >>> def work(ctx):
    ...     return ctx.rank
    >>> launch(work, Plan(mesh=Mesh(dp=2)), timeout=60)   # doctest: +SKIP
    [0, 1]
    """
    if plan is not None and not isinstance(plan, Plan):
        raise UsageError(f"launch(fn, plan): plan must be a shardkit Plan or None, got {type(plan).__name__}")
    _check_timeout(timeout, "launch")
    if in_torchrun():
        return run_in_torchrun(fn, plan, args, kwargs, timeout)
    if world is not None:
        return world.run(fn, *args, plan=plan, timeout=timeout, **kwargs)
    size = _launch_size(plan, world_size)
    payload = _pack_job(fn, args, kwargs, plan, size, "launch")  # before any process starts
    with LocalWorld(size) as local:
        return local._run_packed(payload, timeout)
