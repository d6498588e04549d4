"""The first ``sk.autoshard`` in a fresh process: without the planner's disk store, filling it,
and reading it (``planner/stored.py``). Each in a new interpreter; CPU seconds (what a loaded
machine does not inflate much) and wall seconds of ``import torch`` and of the first call
(``import shardkit`` and the planner's modules included). Baseline: the store off, same run.

    python benchmarks/cold_start.py [--model gpt-small] [--devices 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_PROBE = """
import json, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
wall = time.perf_counter()
import torch
torch_cpu, torch_wall = cpu(), time.perf_counter() - wall
wall = time.perf_counter()
import shardkit as sk
sk.autoshard(sys.argv[1], devices=int(sys.argv[2]), global_batch=8, seq_len=128)
print(json.dumps({"torch_cpu": torch_cpu, "torch_wall": torch_wall, "call_cpu": cpu() - torch_cpu,
                  "call_wall": time.perf_counter() - wall}))
"""


def run(model: str, devices: int, store: str) -> dict:
    env = {**os.environ, "SHARDKIT_CACHE": store}
    out = subprocess.run([sys.executable, "-c", _PROBE, model, str(devices)], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = {"store off (baseline)": run(args.model, args.devices, "off"),
                "store empty (filled)": run(args.model, args.devices, folder),
                "store read": run(args.model, args.devices, folder)}
    base = rows["store off (baseline)"]["call_cpu"]
    print(f"{'':22} {'import torch cpu/wall':>22} {'first call cpu/wall':>22} {'call cpu / baseline':>20}")
    for name, r in rows.items():
        print(f"{name:22} {r['torch_cpu']:9.2f} / {r['torch_wall']:6.2f} s {r['call_cpu']:9.2f} / "
              f"{r['call_wall']:6.2f} s {r['call_cpu'] / base:20.2f}")


if __name__ == "__main__":
    main()
