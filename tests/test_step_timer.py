"""One timer: nothing in src/ or benchmarks/ reads the clock to time work except devices.py's timer.

On an accelerator kernels run after the Python that launched them returns, so ``perf_counter``
around a step times its launching (devices.py: ``StepTimer``, ``clock``, ``wall_ns`` synchronise
first). Every direct read of ``time.perf_counter`` / ``time.time`` / ``time.monotonic`` (and their
``_ns`` forms) must be on :data:`ALLOWED`, each with the reason it times no device work.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from shardkit.runtime import devices

ROOT = Path(__file__).resolve().parents[1]
READS = {"perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic", "monotonic_ns"}
_DEADLINE = "a deadline or grace period (how long to wait), not a measurement of work"
#: (file, function) -> why its clock reads time no device work.
ALLOWED = {
    ("src/shardkit/runtime/devices.py", "StepTimer.start"): "the timer itself (CPU branch)",
    ("src/shardkit/runtime/devices.py", "StepTimer.mark"): "the timer itself (CPU branch)",
    ("src/shardkit/runtime/devices.py", "clock"): "the timer itself, after synchronising",
    ("src/shardkit/runtime/devices.py", "wall_ns"): "the timeline's clock, after synchronising",
    ("src/shardkit/runtime/world.py", "LocalWorld._run_packed"): "the job's timeout: " + _DEADLINE,
    ("src/shardkit/runtime/world.py", "LocalWorld._dead_ranks"): _DEADLINE,
    ("src/shardkit/runtime/world.py", "LocalWorld._survivor_context"): _DEADLINE,
    ("src/shardkit/runtime/world.py", "LocalWorld._stacks"): _DEADLINE,
    ("src/shardkit/runtime/world.py", "LocalWorld.close"): _DEADLINE,
    ("src/shardkit/runtime/descendants.py", "sweep"): _DEADLINE,
    ("src/shardkit/training/run.py", "run"): "the whole run's wall time, process start included, said as such",
    ("src/shardkit/cli/train.py", "run"): "the whole command's wall time, process start included, said as such",
    ("benchmarks/mesh_release.py", "_timed"): "a gloo world's mesh release on CPU processes: no device work queued",
    ("benchmarks/cli_startup.py", "seconds"): "a subprocess's wall time (interpreter start): no device work here",
    ("src/shardkit/serving/protocol.py", "Parsed"): "OpenAI's `created` field: the epoch second a request arrived",
    ("src/shardkit/serving/server.py", "Server.__init__"): "the server's start time for /metrics' uptime",
    ("src/shardkit/serving/server.py", "Stats.token"): "tokens/s as clients see them: wall time between events the host receives",
    ("src/shardkit/serving/server.py", "Stats.tokens_per_second"): "tokens/s as clients see them (the window's wall time)",
    ("src/shardkit/serving/run.py", "_serve_leader"): "the drain bound after SIGTERM: " + _DEADLINE,
    ("benchmarks/serve.py", "one"): "a client's latency over HTTP: what the user waits, measured from outside",
    ("benchmarks/serve.py", "level"): "a client's latency over HTTP: what the user waits, measured from outside",
    ("benchmarks/serve.py", "main"): "a client's latency over HTTP: what the user waits, measured from outside",
    ("benchmarks/serve.py", "transformers_static"): "one CPU process, no device: transformers' generate's wall time",
    ("benchmarks/serve.py", "transformers_static.Clock.__call__"): "one CPU process, no device: per-token wall time",
}


def _clock_reads(path: Path) -> list[tuple[str, int]]:
    """``(qualified function, line)`` of every direct clock read in ``path``."""
    tree = ast.parse(path.read_text())
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "time" for a in node.names if a.name in READS}
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = [*scope, node.name]
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in READS and isinstance(f.value, ast.Name)
                    and f.value.id == "time") or (isinstance(f, ast.Name) and f.id in imported):
                found.append((".".join(scope) or "<module>", node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return found


def _all_reads() -> dict[tuple[str, str], list[int]]:
    reads: dict[tuple[str, str], list[int]] = {}
    for folder in ("src", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for function, line in _clock_reads(path):
                reads.setdefault((str(path.relative_to(ROOT)), function), []).append(line)
    return reads


def test_no_clock_read_times_work_outside_the_timer():
    reads = _all_reads()
    unexplained = {f"{file}:{lines[0]} in {function}" for (file, function), lines in reads.items()
                   if (file, function) not in ALLOWED}
    assert not unexplained, (f"time device work with shardkit.runtime.devices' StepTimer / clock / wall_ns "
                             f"(they synchronise), or add the function to ALLOWED with why: {sorted(unexplained)}")
    stale = set(ALLOWED) - set(reads)
    assert not stale, f"ALLOWED names functions that no longer read the clock: {sorted(stale)}"


def test_the_scan_sees_each_way_of_reading_the_clock(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import time\nfrom time import perf_counter as pc\n"
                      "class A:\n    def f(self):\n        return time.perf_counter()\n"
                      "def g():\n    return pc() + time.monotonic_ns()\n"
                      "t = time.time()\ntime.sleep(0)\n")
    assert _clock_reads(source) == [("A.f", 5), ("g", 7), ("g", 7), ("<module>", 8)]


def test_step_timer_and_clock_on_the_cpu_measure_the_block():
    timer = devices.StepTimer("cpu").start()
    start = devices.clock(torch.device("cpu"))
    torch.ones(256, 256) @ torch.ones(256, 256)
    assert devices.clock(torch.device("cpu")) - start >= 0
    assert timer.stop() > 0 and timer._events is None  # perf_counter, no CUDA event on the CPU


class _FakeEvent:
    """A CUDA event on a fake device clock: recorded at the clock's time, waited for by ``synchronize``."""

    clock, syncs = 0.0, 0

    def __init__(self, enable_timing: bool) -> None:
        self.at = None

    def record(self) -> None:
        self.at = _FakeEvent.clock

    def synchronize(self) -> None:
        _FakeEvent.syncs += 1

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA's


def test_steps_timed_on_a_gpu_are_read_only_where_asked_with_no_sync_before(monkeypatch):
    # the training loop marks each step's end and reads the steps at a logged one: no host sync per step
    monkeypatch.setattr(devices.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "syncs", 0)
    times = devices.StepTimes()
    for step, took in enumerate((0.5, 0.25, 0.125)):
        timer = devices.StepTimer("cuda").start()
        _FakeEvent.clock += took
        times.add(step, timer)
    assert _FakeEvent.syncs == 0
    assert times.read() == [(0, 0.5), (1, 0.25), (2, 0.125)] and _FakeEvent.syncs == 3
    assert times.read() == []
    timer = devices.StepTimer("cuda").start()
    _FakeEvent.clock += 2.0
    assert timer.stop() == 2.0 and _FakeEvent.syncs == 4  # stop: marked and read at once


def test_the_busy_clock_reads_cpu_seconds_only_where_processes_share_the_cores(monkeypatch):
    """4 one-thread processes on 2 cores: a sleep (what another job takes from the cores) does not
    move the busy clock; a second of this process's CPU reads as 2 (its share of the cores). With no
    more processes than cores it is the plain clock, a sleep included."""
    import time

    monkeypatch.setattr(devices.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(devices.torch, "get_num_threads", lambda: 1)
    cpu = torch.device("cpu")
    shared, alone = devices.busy_clock(cpu, ranks_on_host=4), devices.busy_clock(cpu, ranks_on_host=2)
    start_shared, start_alone = shared(), alone()
    time.sleep(0.2)
    assert shared() - start_shared < 0.05 and alone() - start_alone >= 0.2
    start_shared, process_start = shared(), time.process_time()
    while time.process_time() - process_start < 0.1:
        pass
    assert 0.19 < shared() - start_shared < 0.3
    monkeypatch.setattr(devices.torch, "get_num_threads", lambda: 2)  # threads of its own: CPU seconds overlap
    threaded = devices.busy_clock(cpu, ranks_on_host=4)
    start = threaded()
    time.sleep(0.1)
    assert threaded() - start >= 0.1
