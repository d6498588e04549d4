"""Run by tests/test_faults.py and tests/test_descendants.py: start a world, wait to be killed.

``python orphan_job.py thread``: start a LocalWorld of 2 (and run it once) from a thread that
then ends, print its worker pids and wait. Its workers must outlive that thread (Linux's
parent-death signal follows the thread, so they watch their parent by polling instead); the
job run after the thread ended shows they did.

``python orphan_job.py descendants FOLDER SLEEP``: launch :func:`start_descendants` on 2 ranks,
each of which records its processes in FOLDER and then hangs.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from shardkit.runtime.world import LocalWorld, launch


def pid(ctx):
    return os.getpid()


class WorkerPids(Dataset):
    """Each item is the pid of the DataLoader worker that loads it."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> int:
        return os.getpid()


def start_descendants(ctx, folder: str, sleep: str, then: str, loaders: str | None = "fork") -> list[int]:
    """Start a DataLoader with 2 workers (started by ``loaders``; None: a rank's default, spawn,
    which takes seconds), a ``sleep SLEEP``, one in a session of its own and one double-forked
    into its own session (re-parented); write their pids and this rank's to
    ``FOLDER/rank<r>.pids``; then ``raise``, ``hang``, ``kill`` this rank or ``return`` the pids."""
    batches = iter(DataLoader(WorkerPids(), batch_size=1, num_workers=2, multiprocessing_context=loaders))
    workers = sorted({int(next(batches)) for _ in range(2)})  # one item from each worker in turn
    sleeper = subprocess.Popen(["sleep", sleep])
    escaped = subprocess.Popen(["sleep", sleep], start_new_session=True)
    daemon = subprocess.run(["sh", "-c", f"setsid sleep {sleep} >/dev/null 2>&1 & echo $!"],
                            capture_output=True, text=True, check=True)
    pids = [os.getpid(), *workers, sleeper.pid, escaped.pid, int(daemon.stdout)]
    record = Path(folder, f"rank{ctx.rank}.pids")
    record.with_suffix(".tmp").write_text(" ".join(map(str, pids)))
    record.with_suffix(".tmp").replace(record)
    dist.barrier()  # every rank has recorded its processes
    if then == "raise":
        raise RuntimeError("the rank fails with its processes running")
    if then == "hang":
        time.sleep(600)
    if then == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return pids


def start_world(worlds: list) -> None:
    world = LocalWorld(2)
    world.run(pid, timeout=120)  # the workers are up, their parent watch in place
    worlds.append(world)


if __name__ == "__main__":
    if sys.argv[1:2] == ["descendants"]:
        launch(start_descendants, None, *sys.argv[2:4], "hang", world_size=2, timeout=600)
    worlds: list = []
    starter = threading.Thread(target=start_world, args=(worlds,))
    starter.start()
    starter.join()
    print("PIDS", *worlds[0].run(pid, timeout=120), flush=True)
    time.sleep(600)
