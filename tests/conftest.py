"""Shared local worlds: starting processes costs seconds on 2 cores, so tests reuse them.

Use the ``world`` fixture: ``world(4).run(fn, plan=...)`` returns a live LocalWorld of 4
processes, started once per test session (restarted if a previous job failed).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

import shardkit.runtime.world as world_module
from shardkit.runtime.world import LocalWorld

# CI runs on 2 shared cores: no per-example deadline (a slow example is not a failure), and a
# fixed derandomised profile so a run is reproducible.
settings.register_profile("shardkit", deadline=None, derandomize=True)
settings.load_profile("shardkit")

# The tests compare with one CPU process: their worlds run on the CPU on a machine with GPUs too
# (shardkit refuses fewer GPUs than ranks rather than falling back; runtime/devices.py).
os.environ.setdefault("SHARDKIT_BACKEND", "gloo")

# The pytest process runs the single-process references of sk.verify; on 2 shared cores one
# intra-op thread is faster than two fighting with the worker processes.
torch.set_num_threads(1)

# The planner's disk store (planner/stored.py) stays off: a test measures, and one test's stored
# analysis never answers for another's patched code (tests/test_cold_start.py turns it on in its own folder).
os.environ.setdefault("SHARDKIT_CACHE", "off")


class _Worlds:
    def __init__(self) -> None:
        self._worlds: dict[int, LocalWorld] = {}

    def __call__(self, size: int) -> LocalWorld:
        world = self._worlds.get(size)
        if world is None or not world.alive:
            world = self._worlds[size] = LocalWorld(size)
        return world

    def run_cases(self, cases_by_size: dict, job) -> dict:
        """``job(cases)`` run once on a world of each size of ``cases_by_size`` (``{size: [case, ...]}``,
        one job for all of a size's cases): ``{case: [each rank's result for it]}``."""
        found = {}
        for size, cases in cases_by_size.items():
            runs = self(size).run(job, cases)
            for i, case in enumerate(cases):
                found[case] = [run[i] for run in runs]
        return found

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()


@pytest.fixture(scope="session")
def world():
    worlds = _Worlds()
    yield worlds
    worlds.close()


class _Lent:
    """A shared world lent to a command that would start its own (and close it at the end)."""

    def __init__(self, world):
        self.world = world

    def __enter__(self):
        return self.world

    def __exit__(self, *exc):
        return None


@pytest.fixture
def lend_world(world, monkeypatch):
    """``shardkit train`` and ``sk.train`` run on the session's shared worlds instead of starting their own."""
    monkeypatch.setattr("shardkit.runtime.world.LocalWorld", lambda size: _Lent(world(size)))


@pytest.fixture
def no_processes(monkeypatch):
    """Fail the test if anything tries to start a world."""
    def refuse(*args, **kwargs):
        raise AssertionError("a world was started although the input is invalid")

    monkeypatch.setattr(world_module, "LocalWorld", refuse)  # where every command finds it when it runs
