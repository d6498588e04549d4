"""The measurements shipped for the catalogue's models (``planner/shipped/*.json``) are what the
planner measures now: every entry measured again and compared, so a change of the code that
measures, or of torch or transformers, cannot leave them stale (``make shipped`` writes them
again); they are read only for the versions they were measured with, after the user's store."""

from __future__ import annotations

import json

import pytest

from shardkit.planner import shipped
from shardkit.planner.analysis import STORED_TYPES, ModelAnalysis
from shardkit.planner.catalogue import CATALOGUE
from shardkit.planner.ship import measured
from shardkit.planner.stored import CACHE_ENV, stored


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_the_shipped_entries_are_what_the_planner_measures_now(name):
    path = shipped.path_of(name)
    assert path.exists(), f"no shipped measurements for {name!r}: run `make shipped`"
    data = json.loads(path.read_text())
    assert {k: data[k] for k in shipped.versions()} == shipped.versions(), \
        f"{path.name} was measured with other versions than these: run `make shipped`"
    fresh = json.loads(json.dumps(measured(name)))
    differ = sorted(f"{kind}: {key}" for kind in fresh.keys() | data["entries"].keys()
                    for key in fresh.get(kind, {}).keys() | data["entries"].get(kind, {}).keys()
                    if fresh.get(kind, {}).get(key) != data["entries"].get(kind, {}).get(key))
    assert not differ, (f"{path.name}: {len(differ)} entries differ from a fresh measurement (run `make shipped`, and "
                        f"bump shipped.MEASUREMENT when the measurement changed):\n" + "\n".join(differ[:10]))


def test_shipped_entries_are_read_after_the_store_and_only_for_their_versions(tmp_path, monkeypatch):
    key = "catalogue=gpt-tiny|seq_len=32|tp=1|dtype=None|rules="
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    read = stored("analysis", key, lambda: pytest.fail("measured, though shipped"), "gpt-tiny", STORED_TYPES)
    entry = json.loads(shipped.path_of("gpt-tiny").read_text())["entries"]["analysis"][key]
    assert isinstance(read, ModelAnalysis) and json.loads(json.dumps(shipped.encode(read))) == entry
    assert not any(tmp_path.iterdir())  # a shipped entry is not copied into the user's store
    assert stored("refusal", "own", lambda: "mine", "gpt-tiny") == "mine"  # not shipped: measured and stored
    assert stored("refusal", "own", lambda: "again", "gpt-tiny") == "mine"  # the user's store first
    monkeypatch.setattr(shipped, "versions", lambda: {"measurement": shipped.MEASUREMENT, "torch": "0.0",
                                                       "transformers": None})
    shipped._entries.cache_clear()
    try:
        assert stored("analysis", key, lambda: "measured", "gpt-tiny", STORED_TYPES) == "measured"  # another torch
    finally:
        shipped._entries.cache_clear()
    monkeypatch.setenv(CACHE_ENV, "off")
    assert stored("analysis", key, lambda: "measured", "gpt-tiny", STORED_TYPES) == "measured"


def test_the_codec_refuses_what_it_could_not_read_back():
    with pytest.raises(TypeError, match="list"):
        shipped.encode([1, 2])
    with pytest.raises(ValueError, match="not one of the types"):
        shipped.decode({"@": "Path", "x": 1}, [])
