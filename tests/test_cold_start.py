"""The first ``sk.autoshard`` in a fresh process takes under two seconds of CPU, ``import
shardkit`` and its planner modules included (torch imported before, as a training script has
it): on a fresh install for a catalogue model, whose measurements ship with shardkit
(``planner/shipped.py``), and for any model given by config once the disk store holds what the
planner measured (``planner/stored.py``). Either way it builds no model: torch's compiler stack,
which the first meta or fake operator imports, and transformers stay unimported. CPU time, not
wall time, so that other work on a shared machine does not decide it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import shardkit as sk
from shardkit.models.gpt import GPTConfig, small_config
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
from shardkit.models.gpt import GPTConfig, small_config
model = json.loads(sys.argv[1])
best = sk.autoshard(model if isinstance(model, str) else GPTConfig(**model), **json.loads(sys.argv[2]))[0]
first = cpu() - start
out = {"cpu": first, "plan": best.plan.to_json(), "built": sorted({"torch._dynamo", "transformers"} & set(sys.modules))}
if len(sys.argv) > 3:  # a transformers model by name next: its config is not built either
    start = cpu()
    sk.autoshard(sys.argv[3], **json.loads(sys.argv[4]))
    out.update(second_cpu=cpu() - start, second_built=sorted({"torch._dynamo", "transformers"} & set(sys.modules)))
print(json.dumps(out))
"""


def _first_call(store, *args: str) -> dict:
    env = {**os.environ, CACHE_ENV: str(store)}
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL, *args], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_first_autoshard_on_a_fresh_install_reads_the_shipped_measurements_in_under_two_cpu_seconds(tmp_path,
                                                                                                   monkeypatch):
    args = dict(devices=8, global_batch=8, seq_len=128)
    first = _first_call(tmp_path, json.dumps("gpt-small"), json.dumps(args), "llama3-70b",
                        json.dumps(dict(devices=64, global_batch=512, seq_len=8192)))
    assert not any(tmp_path.iterdir()), "the store was written: something was measured"
    assert first["built"] == [] and first["second_built"] == [], first
    assert first["cpu"] < 2.0 and first["second_cpu"] < 1.0, first
    monkeypatch.setenv(CACHE_ENV, "off")  # the same model by config: measured here
    assert first["plan"] == sk.autoshard(small_config(), **args)[0].plan.to_json()


def test_first_autoshard_in_a_process_reads_the_store_and_takes_under_two_cpu_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    expected = sk.autoshard(GPTConfig(**CONFIG), **ARGS)[0].plan.to_json()  # measures, and fills the store
    assert list((tmp_path / "planner").glob("analysis-*.pkl")) and list((tmp_path / "planner").glob("refusal-*.pkl"))
    first = _first_call(tmp_path, json.dumps(CONFIG), json.dumps(ARGS))
    assert first["plan"] == expected  # the stored answers plan as the measured ones do
    assert first["built"] == [], "the first call built a model: the store was not read"
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
