"""Whatever a worker starts ends with the world: its subprocesses, a DataLoader's workers, their children.

Why our own: torch.multiprocessing (like Python's multiprocessing, which it wraps) knows only the
processes it starts itself. It sets no parent-death signal (``prctl(PR_SET_PDEATHSIG)`` is
Linux-only and tied to the spawning thread, so a portable library leaves it out), gives a
worker no process group of its own, and knows nothing of what a worker starts; it even refuses
children to a daemonic worker. So a DataLoader's workers or a ``subprocess.Popen`` outlive a
rank that raises, hangs or is killed, and a parent that is killed. torchrun's handler puts each
worker in a session of its own and kills that process group, but a process that leaves the
group (``setsid``) escapes it.

Here, each worker (:func:`lead_descendants`) leads a session of its own, marks its environment
with the world's token (``SHARDKIT_WORLD``, inherited by every program it or its children
start) and adopts the orphans of its descendants (``PR_SET_CHILD_SUBREAPER``), so a
double-forked daemon stays in its tree while it lives. A tiny :class:`Watchman` per world, a
stdlib-only Python started in a session of its own, holds the worker pids; when the world ends,
or its parent dies however it dies (it reads end-of-file on its pipe from the parent, which,
unlike a parent-death signal, does not depend on which thread started the world), it kills
every process of the world: :func:`sweep`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
import uuid

WORLD_MARK = "SHARDKIT_WORLD"  # environment variable holding the world's token in every worker and what it starts
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h: orphaned descendants are re-parented to this process, not init
SWEEP_LIMIT_S = 5.0  # how long a sweep keeps killing what it finds (a killed process may fork until it dies)
SWEEP_PAUSE_S = 0.02  # between two rounds of a sweep
END_WAIT_S = SWEEP_LIMIT_S + 5.0  # how long the parent waits for the watchman's sweep


def new_token() -> str:
    """A token naming one world, unique on this machine."""
    return f"{os.getpid()}-{uuid.uuid4().hex}"


def lead_descendants(token: str) -> None:
    """In a worker, before it starts anything: lead a session of its own, mark the environment
    of what it will start with ``token``, adopt its descendants' orphans (Linux), and allow it
    children (a DataLoader's workers), which multiprocessing refuses to a daemonic process: the
    parent still ends it as a daemon, and the watchman ends its children."""
    import multiprocessing

    os.setsid()
    os.environ[WORLD_MARK] = token
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    multiprocessing.current_process().daemon = False  # only this process's view of itself


class Watchman:
    """The process that ends every descendant of a world's workers: when :meth:`end` is called,
    or when the process that made it dies (even by SIGKILL).

    >>> watchman = Watchman(new_token())
    >>> worker = subprocess.Popen(["sleep", "60"], start_new_session=True)
    >>> watchman.watch(worker.pid)            # each worker, once started
    >>> watchman.end()                        # the world is over: nothing of it is left running
    >>> worker.wait()
    -9
    """

    def __init__(self, token: str):
        # by path and isolated (-I -S): a stdlib-only interpreter, started in milliseconds; its own
        # session, so a Ctrl-C or hang-up meant for the parent's terminal does not stop it first
        self._process = subprocess.Popen([sys.executable, "-I", "-S", __file__, token], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, start_new_session=True)

    def watch(self, pid: int) -> None:
        """Count ``pid`` (a worker, not yet reaped) and every process it starts as the world's."""
        self._send(f"{pid}\n")

    def end(self) -> None:
        """Kill every worker still running and every process of the world, and wait until done."""
        if self._process.returncode is None:
            self._send("end\n")  # not only end-of-file: a child forked from this process may hold the pipe
            with contextlib.suppress(OSError):
                self._process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(END_WAIT_S)

    def _send(self, line: str) -> None:
        with contextlib.suppress(OSError):  # a watchman that died is not made worse by a failed write
            self._process.stdin.write(line.encode())
            self._process.stdin.flush()


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """``(state, ppid, process group, start time)`` from ``/proc/<pid>/stat``; None once gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19])


def _marked(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def _processes() -> dict[int, tuple[str, int, int, int]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            table[int(name)] = stat
    return table


def _ours(table: dict[int, tuple[str, int, int, int]], known: dict[int, int], workers: dict[int, int],
          mark: bytes) -> set[int]:
    """The processes of the world in ``table``: those ``known`` (the same pid and start time),
    those in a worker's process group, those whose environment carries ``mark``, and every
    descendant of these."""
    def same(pid: int, starts: dict[int, int]) -> bool:
        return pid in table and table[pid][3] == starts[pid]

    # a group id is not reused while the group has members: a worker's group is ours unless its
    # pid now names another process
    groups = {pid for pid in workers if pid not in table or same(pid, workers)}
    ours = {pid for pid, (_, _, group, _) in table.items()
            if (pid in known and same(pid, known)) or group in groups or _marked(pid, mark)}
    children: dict[int, list[int]] = {}
    for pid, (_, parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    todo = list(ours)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in ours:
                ours.add(child)
                todo.append(child)
    return ours - {os.getpid(), os.getppid(), 1}


def sweep(workers: dict[int, int], token: str) -> None:
    """SIGKILL the ``workers`` (pid -> start time) and every process of their world, round after
    round until a round finds none alive (or :data:`SWEEP_LIMIT_S` passes). Without ``/proc``
    (not Linux) only the workers' process groups are killed."""
    if not os.path.isdir("/proc"):
        for pid in workers:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        return
    mark = f"{WORLD_MARK}={token}".encode()
    known = dict(workers)
    deadline = time.monotonic() + SWEEP_LIMIT_S
    while time.monotonic() < deadline:
        table = _processes()
        alive = [pid for pid in _ours(table, known, workers, mark) if table[pid][0] not in "ZX"]
        if not alive:
            break
        for pid in alive:
            known[pid] = table[pid][3]
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(SWEEP_PAUSE_S)


def _watch(token: str) -> None:
    """The watchman's life: record worker pids read from stdin until ``end``, end-of-file or
    SIGTERM, then sweep."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit())
    workers: dict[int, int] = {}
    try:
        for line in sys.stdin:
            if line.strip() == "end":
                break
            pid = int(line)
            stat = _stat(pid)
            workers[pid] = -1 if stat is None else stat[3]  # -1: no /proc, or already gone
    finally:
        sweep(workers, token)


if __name__ == "__main__":
    _watch(sys.argv[1])
