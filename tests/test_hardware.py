"""sk.Hardware: presets, files (JSON and YAML) read strictly, every field named when missing or
wrong, links and peaks as the estimator asks for them. No processes."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

import shardkit as sk
from shardkit.models.gpt import GPT, GPT_RULES, GPTConfig
from shardkit.planner.hardware import (
    COLLECTIVES,
    DTYPES,
    PRESETS,
    Hardware,
    Link,
    hardware,
    ring_terms,
)


def _leaves(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        out += _leaves(value, path + ".") if isinstance(value, dict) else [path]
    return out


BASE = PRESETS["h100-80g"].to_dict()
LEAVES = _leaves(BASE)
# fields files written before them lack
NEWER = ("matmul_latency", "attention_efficiency", "dtensor_overhead", "dtensor_collective", "skew", "sync_idle",
         "cores_per_node")


def _edited(path: str, value=None, delete: bool = False) -> dict:
    data = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if delete:
        del node[last]
    else:
        node[last] = value
    return data


def _problems(data: dict, what: str = "hardware") -> list[str]:
    with pytest.raises(sk.PlanError) as info:
        Hardware.from_dict(data, what)
    return info.value.problems


# -- presets and files --------------------------------------------------------------------------

def test_presets_are_the_datasheet_machines():
    assert sorted(PRESETS) == ["a100-80g", "h100-80g", "h200-141g"]
    a100, h100, h200 = (Hardware.preset(n) for n in ("a100-80g", "h100-80g", "h200-141g"))
    assert a100.peak_flops("bfloat16") == a100.peak_flops(torch.float16) == 312e12
    assert a100.peak_flops(torch.float32) == 19.5e12  # plain fp32: torch does not use TF32 by default
    assert h100.flops == h200.flops and h100.intra_node == h200.intra_node
    assert h200.memory > 140 * 2**30 > h100.memory > 79 * 2**30
    for hw in (a100, h100, h200):
        assert hw.devices_per_node == 8 and 0 < hw.matmul_efficiency <= 1 and 0 < hw.reserved < hw.memory
        for collective in COLLECTIVES:
            intra, inter = hw.link(collective, False), hw.link(collective, True)
            assert inter.bandwidth < intra.bandwidth and inter.latency > intra.latency
    # NCCL-tests' all-reduce bus bandwidth is below the link's one-way peak (300 GB/s on an A100)
    assert a100.link("all_reduce", False).bandwidth < a100.link("p2p", False).bandwidth < 300e9
    # HBM: the datasheets' figures, no efficiency applied; a few microseconds per launch; NCCL overlaps
    assert [hw.memory_bandwidth for hw in (a100, h100, h200)] == [2039e9, 3350e9, 4800e9]
    assert all(hw.op_overhead == 4e-6 and hw.overlap == 1.0 and not hw.shared_compute for hw in (a100, h100, h200))


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_presets_round_trip_through_files(name, suffix, tmp_path):
    path = tmp_path / f"hw{suffix}"
    PRESETS[name].save(path)
    loaded = Hardware.load(path)
    assert loaded == PRESETS[name] and hash(loaded) == hash(PRESETS[name])
    assert hardware(path) == hardware(str(path)) == PRESETS[name]
    text = path.read_text()
    assert (json.loads(text) if suffix == ".json" else yaml.safe_load(text)) == PRESETS[name].to_dict()


def test_a_hand_written_yaml_file_loads(tmp_path):
    path = tmp_path / "mine.yaml"
    links = "\n".join(f"  {c}: {{bandwidth: 1.0e+9, latency: 0}}" for c in COLLECTIVES)
    path.write_text(f"name: mine\nmemory: 1000000\nflops: {{float32: 1.0e+9, bfloat16: 2.0e+9, float16: 2.0e+9}}\n"
                    f"devices_per_node: 2\nintra_node:\n{links}\ninter_node:\n{links}\n"
                    f"matmul_efficiency: 1\nmemory_bandwidth: 2.5e+10\nop_overhead: 0\noverlap: 0\nshared_compute: true\nreserved: 0\n")
    hw = Hardware.load(path)
    assert hw.peak_flops("bfloat16") == 2e9 and hw.link("p2p", True) == Link(1e9, 0)
    assert (hw.memory_bandwidth, hw.op_overhead, hw.overlap, hw.shared_compute) == (25e9, 0, 0, True)


# -- refusals: every field named ----------------------------------------------------------------

@pytest.mark.parametrize("leaf", [leaf for leaf in LEAVES if leaf not in NEWER])
def test_every_missing_field_is_named(leaf, tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(_edited(leaf, delete=True)))
    with pytest.raises(sk.PlanError) as info:
        Hardware.load(path)
    assert info.value.problems == [f"hardware file {str(path)!r}: missing field {leaf!r}"]


def test_a_file_written_before_the_newer_fields_loads(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in BASE.items() if k not in NEWER}))
    hw = Hardware.load(path)
    assert (hw.matmul_latency, hw.dtensor_overhead, hw.dtensor_collective, hw.skew, hw.sync_idle, hw.cores_per_node) == (
        0.0, PRESETS["h100-80g"].dtensor_overhead, PRESETS["h100-80g"].dtensor_collective, 0.0, 0.0, 0) \
        and hw.attention_efficiency == 1.0 \
        and hw.memory == BASE["memory"]


def test_a_file_without_reduce_scatter_reads_it_as_all_gathers_link():
    """Files written before reduce-scatter was measured apart: a ring's, all-gather's link."""
    data = copy.deepcopy(BASE)
    for side in ("intra_node", "inter_node"):
        data[side]["all_gather"] = {"bandwidth": 7.0e9, "latency": 3e-6}
        del data[side]["reduce_scatter"]
    hw = Hardware.from_dict(data)
    assert hw.link("reduce_scatter", across_nodes=False) == Link(bandwidth=7.0e9, latency=3e-6)
    assert hw.link("reduce_scatter", across_nodes=True) == hw.link("all_gather", across_nodes=True)
    assert Hardware.from_dict(hw.to_dict()) == hw  # written back whole


def test_a_measured_reduce_scatter_prices_fsdp_and_sequence_parallel():
    """A backend whose reduce-scatter is slower than its all-gather (gloo's) makes FSDP's and
    Megatron SP's steps slower, and only their reduce-scatter's part."""
    ring = dataclasses.replace(PRESETS["h100-80g"], overlap=0.0)  # nothing hidden: every collective shows
    slow = dataclasses.replace(ring, intra_node={**ring.intra_node, "reduce_scatter": Link(
        bandwidth=ring.intra_node["all_gather"].bandwidth / 4, latency=ring.intra_node["all_gather"].latency)})
    model = sk.meta_model(lambda: GPT(GPTConfig(vocab=512, layers=2, dim=256, heads=8, seq_len=64)))
    for plan, part in ((sk.Plan(sk.Mesh(fsdp=8)), "fsdp"), (sk.Plan(sk.Mesh(tp=8), rules=GPT_RULES,
                                                                   sequence_parallel=True), "tp")):
        fast, slowed = (sk.estimate(model, plan, batch_size=8, seq_len=64, hardware=h).step_time_parts
                        for h in (ring, slow))
        assert slowed[part] > fast[part] and slowed["compute"] == fast["compute"]


@pytest.mark.parametrize("group", ["flops", "intra_node", "inter_node", "inter_node.p2p"])
def test_a_missing_group_says_what_it_holds(group):
    (problem,) = _problems(_edited(group, delete=True))
    assert problem.startswith(f"hardware: missing field {group!r} (a mapping with keys [")


@pytest.mark.parametrize("path, key", [("", "nmae"), ("flops.", "tf32"), ("intra_node.", "all_to_all"),
                                       ("inter_node.p2p.", "jitter")])
def test_unknown_keys_are_named_with_the_valid_ones(path, key):
    data = copy.deepcopy(BASE)
    node = data
    for part in path.rstrip(".").split(".") if path else []:
        node = node[part]
    node[key] = 1
    (problem,) = _problems(data)
    assert f"unknown keys [{key!r}]; valid keys: [" in problem
    assert (f"field {path.rstrip('.')!r}" if path else "hardware has") in problem


WRONG = [
    ("memory", "80GB", "field 'memory' must be a whole number of bytes (an integer), got str '80GB'"),
    ("memory", 80.5e9, "field 'memory' must be a whole number of bytes (an integer), got float"),
    ("memory", True, "field 'memory' must be a whole number of bytes (an integer), got bool True"),
    ("devices_per_node", 8.0, "field 'devices_per_node' must be a whole number of devices (an integer)"),
    ("name", 3, "field 'name' must be a non-empty string, got int 3"),
    ("name", " ", "field 'name' must be a non-empty string"),
    ("flops.bfloat16", "989e12", "field 'flops.bfloat16' must be a number, got str '989e12' (YAML reads 25e9 as "
                                 "text"),
    ("flops.float32", None, "field 'flops.float32' must be a number, got null"),
    ("intra_node.p2p.bandwidth", False, "field 'intra_node.p2p.bandwidth' must be a number, got bool False"),
    ("inter_node.all_gather", [1, 2], "field 'inter_node.all_gather' must be a mapping with keys ['bandwidth', "
                                      "'latency'], got list"),
    ("intra_node", "nvlink", "field 'intra_node' must be a mapping with keys ['all_reduce', 'all_gather', 'reduce_scatter', 'p2p']"),
    ("matmul_efficiency", "0.8", "field 'matmul_efficiency' must be a number, got str '0.8'"),
    ("memory_bandwidth", "2039GB/s", "field 'memory_bandwidth' must be a number, got str '2039GB/s'"),
    ("memory_bandwidth", "2e12", "field 'memory_bandwidth' must be a number, got str '2e12' (YAML reads 25e9"),
    ("op_overhead", "4us", "field 'op_overhead' must be a number, got str '4us'"),
    ("op_overhead", None, "field 'op_overhead' must be a number, got null"),
    ("sync_idle", "1ms", "field 'sync_idle' must be a number, got str '1ms'"),
    ("overlap", True, "field 'overlap' must be a number, got bool True"),
    ("shared_compute", "false", "field 'shared_compute' must be true or false, got str 'false'"),
    ("shared_compute", 1, "field 'shared_compute' must be true or false, got int 1"),
    ("overlap", "false", "field 'overlap' must be a number, got str 'false'"),
]


@pytest.mark.parametrize("leaf, value, message", WRONG)
def test_wrong_types_are_named(leaf, value, message):
    (problem,) = _problems(_edited(leaf, value))
    assert problem.startswith(f"hardware: {message}"), problem


NOT_POSITIVE = [
    ("memory", 0, "field 'memory' must be >= 1, got 0"),
    ("memory", -5, "field 'memory' must be >= 1, got -5"),
    ("devices_per_node", 0, "field 'devices_per_node' must be >= 1, got 0"),
    ("flops.float16", 0, "field 'flops.float16' must be > 0, got 0"),
    ("flops.float32", -1e12, "field 'flops.float32' must be a finite number >= 0, got -1000000000000.0"),
    ("flops.bfloat16", float("inf"), "field 'flops.bfloat16' must be a finite number >= 0, got inf"),
    ("intra_node.all_reduce.bandwidth", 0.0, "field 'intra_node.all_reduce.bandwidth' must be > 0, got 0.0"),
    ("inter_node.p2p.bandwidth", float("nan"), "field 'inter_node.p2p.bandwidth' must be a finite number >= 0"),
    ("inter_node.p2p.latency", -1e-6, "field 'inter_node.p2p.latency' must be a finite number >= 0, got -1e-06"),
    ("matmul_efficiency", 0, "field 'matmul_efficiency' must be > 0, got 0"),
    ("matmul_efficiency", 1.5, "field 'matmul_efficiency' must be a fraction in (0, 1], got 1.5"),
    ("attention_efficiency", 1.5, "field 'attention_efficiency' must be a fraction in (0, 1], got 1.5"),
    ("memory_bandwidth", 0, "field 'memory_bandwidth' must be > 0, got 0"),
    ("memory_bandwidth", -2e12, "field 'memory_bandwidth' must be a finite number >= 0, got -2000000000000.0"),
    ("memory_bandwidth", float("inf"), "field 'memory_bandwidth' must be a finite number >= 0, got inf"),
    ("op_overhead", -1e-6, "field 'op_overhead' must be a finite number >= 0, got -1e-06"),
    ("op_overhead", float("nan"), "field 'op_overhead' must be a finite number >= 0, got nan"),
    ("sync_idle", -1e-3, "field 'sync_idle' must be a finite number >= 0, got -0.001"),
    ("overlap", -0.1, "field 'overlap' must be a finite number >= 0, got -0.1"),
    ("overlap", 1.01, "field 'overlap' must be a fraction in [0, 1], got 1.01"),
    ("overlap", 2, "field 'overlap' must be a fraction in [0, 1], got 2"),
    ("reserved", -1, "field 'reserved' must be >= 0, got -1"),
    ("reserved", BASE["memory"], f"field 'reserved' ({BASE['memory']}) must be less than field 'memory'"),
]


@pytest.mark.parametrize("leaf, value, message", NOT_POSITIVE)
def test_out_of_range_numbers_are_refused(leaf, value, message):
    (problem,) = _problems(_edited(leaf, value))
    assert problem.startswith(f"hardware: {message}"), problem


def test_every_problem_is_listed_at_once():
    data = _edited("memory", 0)
    del data["flops"]["float16"]
    data["intra_node"]["p2p"]["latency"] = "fast"
    data["colour"] = "green"
    problems = _problems(data)
    assert len(problems) == 4
    assert any("'colour'" in p for p in problems) and any("'flops.float16'" in p for p in problems)


def test_a_latency_of_zero_is_valid():
    assert Hardware.from_dict(_edited("intra_node.p2p.latency", 0)).link("p2p", False).latency == 0


@pytest.mark.parametrize("leaf, value", [("op_overhead", 0), ("op_overhead", 0.5), ("overlap", 0), ("overlap", 1),
                                         ("overlap", 0.25), ("memory_bandwidth", 1)])
def test_the_ends_of_the_new_ranges_are_valid(leaf, value):
    assert getattr(Hardware.from_dict(_edited(leaf, value)), leaf) == value


def test_a_key_given_twice_is_an_error(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump(BASE) + "memory: 1\n")
    with pytest.raises(sk.PlanError, match="key 'memory' is given twice"):
        Hardware.load(path)


def test_a_file_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(sk.PlanError, match=f"hardware file {str(path)!r} must be a mapping"):
        Hardware.load(path)


def test_the_constructor_checks_as_files_do():
    good = PRESETS["a100-80g"]
    fields = dict(name=good.name, memory=good.memory, flops=good.flops, devices_per_node=8,
                  intra_node=good.intra_node, inter_node=good.inter_node, memory_bandwidth=1e11)
    with pytest.raises(sk.PlanError) as info:
        Hardware(**{**fields, "flops": {"float32": 1.0}, "intra_node": {**good.intra_node, "p2p": 5}})
    assert info.value.problems == ["Hardware: missing field 'flops.bfloat16'", "Hardware: missing field 'flops.float16'",
                                   "Hardware: field 'intra_node.p2p' must be a Link, got int 5"]
    with pytest.raises(sk.PlanError, match="Link: field 'bandwidth' must be > 0, got 0"):
        Link(bandwidth=0, latency=1e-6)
    flops = dict(good.flops)
    hw = Hardware(**{**fields, "flops": flops})
    flops["float32"] = 1.0  # the caller's mapping was copied
    assert hw.peak_flops("float32") == good.peak_flops("float32") and hw.matmul_efficiency == 1.0
    assert (hw.op_overhead, hw.overlap, hw.reserved) == (0.0, 1.0, 0)  # an ideal device, in Python only
    with pytest.raises(TypeError, match="memory_bandwidth"):  # no default: devices differ by 100x
        Hardware(**{k: v for k, v in fields.items() if k != "memory_bandwidth"})
    with pytest.raises(sk.PlanError) as info:
        Hardware(**fields, op_overhead=-1.0, overlap=1.5)
    assert info.value.problems == ["Hardware: field 'op_overhead' must be a finite number >= 0, got -1.0",
                                   "Hardware: field 'overlap' must be a fraction in [0, 1], got 1.5"]


def test_unknown_preset_and_spec_list_the_known_ones(tmp_path):
    with pytest.raises(sk.UsageError, match="unknown hardware preset 'v100'; known presets: a100-80g, h100-80g, "
                                            "h200-141g"):
        Hardware.preset("v100")
    with pytest.raises(sk.UsageError, match="unknown hardware 'h100': a preset \\(a100-80g, h100-80g, h200-141g\\)"):
        hardware("h100")
    with pytest.raises(sk.UsageError, match="unknown hardware 3"):
        hardware(3)
    assert hardware("a100-80g") is PRESETS["a100-80g"] and hardware(PRESETS["a100-80g"]) is PRESETS["a100-80g"]
    with pytest.raises(sk.PlanError, match="cannot read hardware file"):
        hardware(str(tmp_path / "absent.yaml"))
    for call in (lambda: PRESETS["a100-80g"].save(tmp_path / "hw.txt"), lambda: Hardware.load(Path("hw.toml"))):
        with pytest.raises(sk.UsageError, match="a hardware file ends in .json, .yaml, .yml"):
            call()


# -- what the estimator asks ----------------------------------------------------------------------

def test_links_and_peaks():
    hw = PRESETS["a100-80g"]
    assert hw.link("reduce_scatter", True) == hw.inter_node["all_gather"]  # the presets price a ring
    assert hw.link("p2p", False) is hw.intra_node["p2p"]
    with pytest.raises(sk.UsageError, match="unknown collective 'broadcast'; valid: all_reduce, all_gather, reduce_scatter, p2p"):
        hw.link("broadcast", False)
    with pytest.raises(sk.UsageError, match="no peak for dtype torch.float64; valid: float32, bfloat16, float16"):
        hw.peak_flops(torch.float64)
    assert [hw.peak_flops(getattr(torch, d)) for d in DTYPES] == [hw.flops[d] for d in DTYPES]
    assert hw.usable_memory == hw.memory - hw.reserved


def test_ring_terms_and_link_seconds():
    assert [ring_terms("all_reduce", n) for n in (1, 2, 8)] == [(0, 0.0), (2, 1.0), (14, 1.75)]
    assert ring_terms("all_gather", 8) == ring_terms("reduce_scatter", 8) == (7, 0.875)
    assert ring_terms("p2p", 8) == (1, 1.0)
    with pytest.raises(sk.UsageError, match="n must be a number of devices >= 1"):
        ring_terms("p2p", 0)
    link = Link(bandwidth=2e9, latency=1e-5)
    assert link.seconds(4e9, factor=1.5, steps=3) == pytest.approx(3e-5 + 3.0)


def test_the_documented_file_loads(tmp_path):
    text = (Path(__file__).resolve().parents[1] / "docs" / "hardware.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "doc.yaml"
    path.write_text(block)
    assert Hardware.load(path).to_dict() == {**PRESETS["a100-80g"].to_dict(), "name": "my-cluster"}


def test_a_save_killed_half_way_leaves_the_file_before_it(tmp_path, monkeypatch):
    """Hardware.save writes a temporary file and renames it over the old one: a save that dies before the
    rename (here the rename itself) leaves the old file whole and no temporary beside it."""
    path = tmp_path / "mine.yaml"
    PRESETS["a100-80g"].save(path)
    before = path.read_text()

    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("os.replace", dies)
    with pytest.raises(KeyboardInterrupt):
        PRESETS["h100-80g"].save(path)
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]
