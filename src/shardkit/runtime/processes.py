"""Keeping worker processes honest: they end with their parent, and their deaths are named.

A worker asks Linux to SIGKILL it when its parent ends (``prctl(PR_SET_PDEATHSIG)``, for worlds
started by the main thread: Linux ties it to the thread that spawned the worker); elsewhere a
daemon thread polls the parent. A rank's exit code becomes words, and a survivor's error that
only says its peer's connection closed is told apart from the cause.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PARENT_POLL_S = 1.0  # how often a worker without prctl checks that its parent is alive
PR_SET_PDEATHSIG = 1  # linux/prctl.h: signal this process when its parent thread ends
# what gloo and NCCL report on a rank whose peer died under a collective
LOST_CONNECTION = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",  # gloo
                   "ncclRemoteError", "remote process exited", "NCCL communicator was aborted")  # NCCL
# what they report on a rank whose collective waited past the group's timeout (a peer gone or stuck)
COLLECTIVE_TIMEOUT = ("Timed out waiting",  # gloo: "Timed out waiting 1800000ms for recv operation to complete"
                      "Watchdog caught collective operation timeout",  # NCCL's watchdog
                      "before timing out")  # NCCL: "... ran for 660000 milliseconds before timing out"


def exit_reason(code: int) -> str:
    """``exited with code 3`` or, for a negative code, ``was killed by SIGKILL``."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def lost_connection(details: str) -> bool:
    """Whether a rank's error says it lost a peer (its connection, or a collective that timed out
    waiting for it), in gloo's words or NCCL's: the peer is then the likelier cause."""
    return any(text in details for text in LOST_CONNECTION + COLLECTIVE_TIMEOUT)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def end_with_parent(parent_pid: int, spawned_by_main_thread: bool) -> None:
    """End this worker as soon as its parent process ends, by any signal (SIGKILL included).

    Linux sends SIGKILL when the parent *thread* that spawned us ends, so prctl is used only for
    worlds started by the main thread; otherwise (and off Linux) a daemon thread polls the parent.
    The last check closes the race of a parent that ended before either was in place."""
    if not (spawned_by_main_thread and _kill_with_parent()):
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True,
                         name="shardkit-parent-watch").start()
    if os.getppid() != parent_pid:
        os._exit(1)


def _kill_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent ends; False where prctl is missing."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:  # an orphan is adopted by another process
        time.sleep(PARENT_POLL_S)
    os._exit(1)


__all__ = ["COLLECTIVE_TIMEOUT", "LOST_CONNECTION", "end_with_parent", "exit_reason", "last_line", "lost_connection"]
