"""What a user wrote is never coerced or silently replaced: plan files, Plan(...), LayoutMap, Mesh.

One test per class of bad input, each naming what the user sees; and a property: whatever JSON
value stands in any field of a plan, reading it gives a Plan or a PlanError, never another
exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardkit as sk
from shardkit.plan import FSDPOptions, LayoutMap, Mesh, Pipeline, Plan, PlanError, ReplicaGrouping

GOOD = {"mesh": {"fsdp": 2, "tp": 2}, "rules": [["w", ["tp", None]], [".*", None]], "strict": True,
        "fsdp": {"reshard_after_forward": True, "param_dtype": None, "reduce_dtype": None},
        "pipeline": None, "replicas": None, "sequence_parallel": False}


def _refused(data, *expected: str) -> str:
    with pytest.raises(PlanError) as err:
        Plan.from_dict(data)
    for text in expected:
        assert text in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("field, value", [
    ("sequence_parallel", "false"), ("sequence_parallel", 0), ("strict", "no"), ("strict", None),
])
def test_booleans_must_be_booleans(field, value):
    _refused({**GOOD, field: value}, f"plan field {field!r} must be true or false", repr(value) if value else "")


@pytest.mark.parametrize("value", ["false", "no", 1, None])
def test_an_fsdp_option_is_checked(value):
    _refused({**GOOD, "fsdp": {"reshard_after_forward": value}}, "reshard_after_forward", "must be true or false")
    _refused({**GOOD, "fsdp": {"param_dtype": "bf16"}}, "param_dtype='bf16'", "bfloat16")


@pytest.mark.parametrize("field", ["mesh", "fsdp", "pipeline", "replicas"])
@pytest.mark.parametrize("value", [["dp", 2], "dp=2", 4])
def test_a_list_or_scalar_where_a_mapping_belongs_names_the_field(field, value):
    text = _refused({**GOOD, field: value}, f"plan field {field!r} must be a mapping such as")
    assert "unknown keys" not in text  # a string is not read letter by letter


@pytest.mark.parametrize("field", ["mesh", "fsdp"])
def test_null_where_a_mapping_belongs_names_the_field(field):
    _refused({**GOOD, field: None}, f"plan field {field!r} must be a mapping", "got null")


def test_rules_must_be_a_list_of_pairs():
    _refused({**GOOD, "rules": {"w": ["tp", None]}}, "plan field 'rules' must be a list of [regex, layout] pairs")
    _refused({**GOOD, "rules": [["w"]]}, "layout rule #0 ['w'] must be a (regex, layout) pair")


def test_the_top_level_must_be_a_mapping_with_a_mesh():
    _refused(["mesh"], "a plan must be a mapping")
    _refused({"rules": None}, "missing required keys ['mesh']")
    _refused({**GOOD, "meshes": {}}, "unknown keys ['meshes']")


@pytest.mark.parametrize("text, where", [
    ("mesh: {dp: 2}\nmesh: {tp: 2}\n", "key 'mesh' is given twice (line 2)"),
    ("mesh: {dp: 2, dp: 4}\n", "key 'dp' is given twice"),
    ("mesh: {dp: 2}\nfsdp:\n  param_dtype: bfloat16\n  param_dtype: float16\n", "key 'param_dtype' is given twice"),
])
def test_a_yaml_key_given_twice_is_an_error(text, where):
    with pytest.raises(PlanError, match=where.replace("(", r"\(").replace(")", r"\)")):
        Plan.from_yaml(text)


def test_a_json_key_given_twice_is_an_error(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"mesh": {"dp": 2}, "sequence_parallel": false, "sequence_parallel": true}')
    with pytest.raises(PlanError, match="key 'sequence_parallel' is given twice"):
        Plan.load(path)


def test_plan_constructor_types_are_checked():
    for kwargs, text in [({"mesh": {"dp": 2}}, "must be a shardkit Mesh"),
                         ({"mesh": Mesh(dp=2), "fsdp": {"param_dtype": "bfloat16"}}, "Plan(fsdp=...) must be a FSDPOptions"),
                         ({"mesh": Mesh(dp=2), "sequence_parallel": "false"}, "Plan(sequence_parallel=...) must be true"),
                         ({"mesh": Mesh(dp=2), "pipeline": "gpipe"}, "Plan(pipeline=...) must be a Pipeline or None"),
                         ({"mesh": Mesh(dp=2), "rules": "w"}, "Plan(rules=...) must be a LayoutMap")]:
        with pytest.raises(PlanError, match=text.replace("(", r"\(").replace(")", r"\)")):
            Plan(**kwargs)


def test_a_layout_pattern_given_twice_is_an_error():
    with pytest.raises(PlanError, match=r"pattern 'w' is given twice \(first as rule #0"):
        LayoutMap([("w", ("tp", None)), ("w", None)])
    rules = LayoutMap([("w", ("tp", None))])
    with pytest.raises(PlanError, match="given twice"):
        rules["w"] = None  # Keras style append: replacing would change what matches first
    del rules["w"]
    rules["w"] = None
    assert rules["w"] is None


@pytest.mark.parametrize("layout, text", [
    ("tp", "is not a layout"), ({"tp": 0}, "is not a layout"), ({"tp"}, "is not a layout"),
    ((3, None), "dim 0 entry 3"), (((), None), "dim 0 entry ()"), ((("tp", "tp"), None), "distinct axis names"),
])
def test_a_layout_that_is_not_none_an_axis_or_per_dim_entries_is_an_error(layout, text):
    with pytest.raises(PlanError, match=text.replace("(", r"\(").replace(")", r"\)")):
        LayoutMap([("w", layout)])


@pytest.mark.parametrize("text, expected", [
    ("", "is empty"), ("  ", "is empty"), ("fsdp=2,fsdp=4", "gives axis 'fsdp' twice"), ("fsdp=2,", "not of the form"),
    ("=2", "not of the form"), ("tp=two", "has size 'two'"),
])
def test_a_mesh_text_is_never_replaced_by_a_default(text, expected):
    with pytest.raises(PlanError, match=expected):
        Mesh.parse(text)


def test_option_values_are_checked_in_every_part():
    with pytest.raises(PlanError, match="Pipeline\\(schedule=\\['1f1b'\\]\\) is unknown"):
        Pipeline(schedule=["1f1b"])
    with pytest.raises(PlanError, match="microbatches='4'"):
        Pipeline.from_dict({"microbatches": "4"})
    with pytest.raises(PlanError, match="replication_factor='4'"):
        ReplicaGrouping.from_dict({"replication_factor": "4"})
    with pytest.raises(PlanError, match="must be true or false"):
        FSDPOptions(reshard_after_forward="no")


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 5) | st.floats(allow_nan=False) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


@given(field=st.sampled_from(sorted(GOOD)), value=JSON, nested=st.booleans())
def test_any_value_in_any_field_gives_a_plan_or_a_plan_error(field, value, nested):
    data = json.loads(json.dumps(GOOD))
    if nested and isinstance(data[field], dict) and data[field]:
        data[field][next(iter(data[field]))] = value
    else:
        data[field] = value
    try:
        plan = Plan.from_dict(data)
    except PlanError:
        return
    assert Plan.from_dict(plan.to_dict()) == plan  # what was accepted round-trips as it was read
    assert isinstance(plan.sequence_parallel, bool) and isinstance(plan.fsdp.reshard_after_forward, bool)


def test_the_facade_names_the_error_types():
    assert issubclass(sk.PlanError, sk.ShardkitError) and issubclass(sk.UsageError, sk.ShardkitError)
    assert not issubclass(sk.UsageError, sk.PlanError) and issubclass(sk.WorldError, sk.ShardkitError)
