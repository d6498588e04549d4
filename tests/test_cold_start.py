"""The first ``sk.autoshard`` in a fresh process reads what the planner measured about the model
from the disk store (``planner/stored.py``): it builds no model (torch's compiler stack, which a
meta model's initialisation imports, stays unimported) and takes well under two seconds of CPU,
``import shardkit`` and its planner modules included (torch imported before, as a training script
has it). CPU time, not wall time, so that other work on a shared machine does not decide it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import shardkit as sk
from shardkit.models.gpt import GPTConfig
from shardkit.planner.stored import CACHE_ENV

#: A config no other test plans, so this process measures it afresh and fills the store.
CONFIG = dict(vocab=384, layers=3, dim=96, heads=6, seq_len=64)
ARGS = dict(devices=4, global_batch=8, seq_len=64)

_FIRST_CALL = """
import json, resource, sys
import torch
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
start = cpu()
import shardkit as sk
from shardkit.models.gpt import GPTConfig
best = sk.autoshard(GPTConfig(**json.loads(sys.argv[1])), **json.loads(sys.argv[2]))[0]
print(json.dumps({"cpu": cpu() - start, "dynamo": "torch._dynamo" in sys.modules, "plan": best.plan.to_json()}))
"""


def test_first_autoshard_in_a_process_reads_the_store_and_takes_under_two_cpu_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    expected = sk.autoshard(GPTConfig(**CONFIG), **ARGS)[0].plan.to_json()  # measures, and fills the store
    assert list((tmp_path / "planner").glob("analysis-*.pkl")) and list((tmp_path / "planner").glob("refusal-*.pkl"))
    env = {**os.environ, CACHE_ENV: str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL, json.dumps(CONFIG), json.dumps(ARGS)], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    first = json.loads(out.splitlines()[-1])
    assert first["plan"] == expected  # the stored answers plan as the measured ones do
    assert not first["dynamo"], "the first call built a model: the store was not read"
    assert first["cpu"] < 2.0, first


def test_store_off_stores_nothing_and_an_unreadable_entry_is_measured_again(tmp_path, monkeypatch):
    from shardkit.planner.stored import stored

    monkeypatch.setenv(CACHE_ENV, "off")
    assert stored("test", "k", lambda: 1) == 1 and not any(tmp_path.iterdir())
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert stored("test", "k", lambda: 2) == 2
    assert stored("test", "k", lambda: 3) == 2  # read back, not computed
    (entry,) = (tmp_path / "planner").glob("test-*.pkl")
    entry.write_bytes(b"not a pickle")
    assert stored("test", "k", lambda: 4) == 4
