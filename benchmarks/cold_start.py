"""The first ``sk.autoshard`` in a fresh process: a fresh install (the user's disk store empty,
the measurements shipped for catalogue models read, ``planner/shipped.py``), the same model by
config (not shipped: measured, and the store filled), that store read, and everything measured
(``SHARDKIT_CACHE=off``). Each in a new interpreter; CPU seconds (what a loaded machine does not
inflate much) and wall seconds of ``import torch`` and of the first call (``import shardkit`` and
the planner's modules included), and whether the call imported torch's compiler stack or
transformers.

    python benchmarks/cold_start.py [--model gpt-small] [--devices 8] [--seq-len 128]
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
from shardkit.planner.catalogue import catalogue_config
model = sys.argv[1] if sys.argv[4] == "name" else catalogue_config(sys.argv[1])
sk.autoshard(model, devices=int(sys.argv[2]), global_batch=int(sys.argv[2]), seq_len=int(sys.argv[3]))
print(json.dumps({"torch_cpu": torch_cpu, "torch_wall": torch_wall, "call_cpu": cpu() - torch_cpu,
                  "call_wall": time.perf_counter() - wall,
                  "imported": [m for m in ("torch._dynamo", "transformers") if m in sys.modules]}))
"""


def run(model: str, devices: int, seq_len: int, store: str, given: str) -> dict:
    env = {**os.environ, "SHARDKIT_CACHE": store}
    out = subprocess.run([sys.executable, "-c", _PROBE, model, str(devices), str(seq_len), given], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    shape = (args.model, args.devices, args.seq_len)
    with tempfile.TemporaryDirectory() as fresh, tempfile.TemporaryDirectory() as folder:
        rows = {"store off (measured)": run(*shape, "off", "name"),
                "fresh install (shipped)": run(*shape, fresh, "name"),
                "by config, store empty": run(*shape, folder, "config"),
                "by config, store read": run(*shape, folder, "config")}
    base = rows["store off (measured)"]["call_cpu"]
    print(f"{'':24} {'import torch cpu/wall':>22} {'first call cpu/wall':>22} {'cpu / off':>10}  imported")
    for name, r in rows.items():
        print(f"{name:24} {r['torch_cpu']:9.2f} / {r['torch_wall']:6.2f} s {r['call_cpu']:9.2f} / "
              f"{r['call_wall']:6.2f} s {r['call_cpu'] / base:10.2f}  {', '.join(r['imported']) or '-'}")


if __name__ == "__main__":
    main()
