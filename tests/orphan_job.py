"""Run by tests/test_faults.py: start a LocalWorld of 2, print its worker pids, wait to be killed.

With the argument ``thread`` the world is started (and run once) by a thread that then ends:
its workers must outlive that thread (Linux's parent-death signal follows the thread, so they
watch their parent by polling instead); the job run after the thread ended shows they did."""

import os
import sys
import threading
import time

from shardkit.runtime.world import LocalWorld


def pid(ctx):
    return os.getpid()


def start_world(worlds: list) -> None:
    world = LocalWorld(2)
    world.run(pid, timeout=120)  # the workers are up, their parent watch in place
    worlds.append(world)


if __name__ == "__main__":
    worlds: list = []
    if sys.argv[1:] == ["thread"]:
        starter = threading.Thread(target=start_world, args=(worlds,))
        starter.start()
        starter.join()
    else:
        start_world(worlds)
    print("PIDS", *worlds[0].run(pid, timeout=120), flush=True)
    time.sleep(600)
