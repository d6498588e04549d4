"""How long the ``shardkit`` command takes to answer: refused command lines, help, and a small
``explain``, each in a fresh process, against the named baseline measured in the same run:
``python -c "import torch"`` (what any command that runs a model pays at least).

Also measured, to say where the rest goes: the interpreter alone (``python -c pass``); torch
with ``torch._dynamo``, which torch imports on the first operation on the meta device that runs
through its Python references (``normal_`` in a model's initialisation, ``arange`` in a forward),
so every command that checks a model pays it; and the small ``explain`` called through
``main(argv)``, which returns instead of ending the process at once, so it pays the interpreter's
teardown of torch (the ``shardkit`` program skips it: ``shardkit.cli.exit_now``).

    python benchmarks/cli_startup.py [--repeats 5]

Every command runs ``--repeats`` times, the commands interleaved so that a shared machine's load
falls on all of them alike; the table gives the median and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

PYTHON = [sys.executable]
SHARDKIT = [sys.executable, "-m", "shardkit"]
THROUGH_MAIN = [sys.executable, "-c", "import sys; from shardkit.cli import main; sys.exit(main(sys.argv[1:]))"]
BASELINE = "python -c 'import torch'"
SMALL_EXPLAIN = ["explain", "--model", "gpt-tiny"]

#: name -> (command, the exit status it must end with)
COMMANDS: dict[str, tuple[list[str], int]] = {
    "python -c pass": ([*PYTHON, "-c", "pass"], 0),
    BASELINE: ([*PYTHON, "-c", "import torch"], 0),
    "python -c 'import torch, torch._dynamo'": ([*PYTHON, "-c", "import torch, torch._dynamo"], 0),
    "shardkit --help": ([*SHARDKIT, "--help"], 0),
    "shardkit plan --help": ([*SHARDKIT, "plan", "--help"], 0),
    **{f"shardkit {name} --bogus": ([*SHARDKIT, name, "--bogus"], 2)
       for name in ("train", "explain", "plan", "generate", "checkpoint", "data", "calibrate", "replicas")},
    "shardkit train --lr nan": ([*SHARDKIT, "train", "--lr", "nan"], 2),
    "shardkit explain --model gpt-tiny": ([*SHARDKIT, *SMALL_EXPLAIN], 0),
    "main(['explain', '--model', 'gpt-tiny']) (with teardown)": ([*THROUGH_MAIN, *SMALL_EXPLAIN], 0),
}


def seconds(command: list[str], status: int) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != status:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}, expected {status}: {done.stderr[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (default 5)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, (command, status) in COMMANDS.items():
            times[name].append(seconds(command, status))
    base = statistics.median(times[BASELINE])
    width = max(map(len, COMMANDS))
    print(f"median of {args.repeats} runs each; baseline: {BASELINE} = {base:.2f} s")
    print(f"{'command':<{width}}  {'median':>8}  {'min':>7}  {'x baseline':>10}")
    for name, runs in times.items():
        middle = statistics.median(runs)
        print(f"{name:<{width}}  {middle:>7.2f}s  {min(runs):>6.2f}s  {middle / base:>10.2f}")


if __name__ == "__main__":
    main()
