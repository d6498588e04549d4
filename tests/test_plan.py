"""Mesh, LayoutMap and Plan: pure data and validation, no processes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardkit as sk
from shardkit.plan import PlanError, PlanWarning, resolve_layouts
from shardkit.planner.validate import validate

AXES = st.sampled_from(["dp", "fsdp", "tp", "ep", "cp2"])


# -- Mesh --------------------------------------------------------------------------------------
def test_mesh_infers_minus_one_from_world_size():
    mesh = sk.Mesh(fsdp=-1, tp=2, world_size=8)
    assert mesh.to_dict() == {"fsdp": 4, "tp": 2}
    assert sk.Mesh(fsdp=-1, tp=2).resolved(16)["fsdp"] == 8


@given(st.dictionaries(st.sampled_from(["dp", "fsdp", "tp", "pp", "sp", "ep"]), st.integers(1, 4), min_size=1))
def test_mesh_coordinates_round_trip(axes):
    mesh = sk.Mesh(axes)
    seen = set()
    for rank in range(mesh.size):
        coords = mesh.coordinates(rank)
        back = 0
        for name in mesh.names:
            back = back * mesh[name] + coords[name]
        assert back == rank
        seen.add(tuple(coords.values()))
    assert len(seen) == math.prod(mesh.shape)


def test_mesh_parse_and_json_round_trip():
    mesh = sk.Mesh.parse("dp=2, fsdp=2,tp=2")
    assert mesh.names == ("dp", "fsdp", "tp") and mesh.size == 8
    assert sk.Mesh.from_dict(mesh.to_dict()) == mesh


@pytest.mark.parametrize("kwargs, world, fragment", [
    (dict(dp=2, tp=2), 8, "has 4 devices but the world has 8"),
    (dict(dp=-1, tp=-1), None, "at most one size can be inferred"),
    (dict(dp=0), None, "valid sizes are integers >= 1"),
    (dict(fsdp=-1, tp=3), 8, "not divisible by the product 3"),
])
def test_mesh_errors_name_what_is_valid(kwargs, world, fragment):
    with pytest.raises(PlanError, match=fragment):
        mesh = sk.Mesh(**kwargs)
        mesh.resolved(world)


def test_mesh_parse_errors():
    with pytest.raises(PlanError, match="axis=size"):
        sk.Mesh.parse("fsdp2")
    with pytest.raises(PlanError, match="sizes are integers"):
        sk.Mesh.parse("fsdp=two")


# -- LayoutMap ---------------------------------------------------------------------------------
def test_first_fullmatch_wins_and_keras_style_assignment():
    rules = sk.LayoutMap([(r"a\.weight", ("tp", None)), (r".*\.weight", (None, "tp")), (r".*", None)])
    assert rules.lookup("a.weight") == (0, ("tp", None))
    assert rules.lookup("b.weight") == (1, (None, "tp"))
    assert rules.lookup("xa.weight") == (1, (None, "tp"))  # fullmatch, not search
    rules["new"] = ["tp"]
    assert list(rules)[-1] == "new" and rules["new"] == ("tp",)


def test_invalid_regex_is_reported_with_pattern():
    with pytest.raises(PlanError, match=r"rule '\(unclosed' is not a valid regex"):
        sk.LayoutMap([("(unclosed", None)])


SHAPES = {"embed.weight": (256, 64), "layers.0.q.weight": (64, 64), "layers.0.q.bias": (64,), "head.weight": (256, 64)}


FSDP2_TP2 = sk.Mesh(fsdp=2, tp=2)


def _resolve(rules, mesh=FSDP2_TP2, shapes=SHAPES):
    return resolve_layouts(shapes, sk.LayoutMap(rules), mesh)


def test_unmatched_parameters_are_all_listed():
    with pytest.raises(PlanError) as err:
        _resolve([(r"layers\..*", None)])
    text = str(err.value)
    assert "2 parameter(s) match no layout rule" in text
    assert "embed.weight" in text and "head.weight" in text and "(r'.*', None)" in text


def test_non_strict_map_replicates_unmatched():
    res = resolve_layouts(SHAPES, sk.LayoutMap([(r"head\.weight", ("tp", None))], strict=False), sk.Mesh(tp=2))
    assert res.params["embed.weight"].layout is None


@pytest.mark.parametrize("rules, fragment", [
    ([(r".*q\.weight", ("tp",)), (r".*", None)], "has 1 entries but the tensor has 2 dims"),
    ([(r".*q\.weight", ("model", None)), (r".*", None)], "axis 'model', which the mesh"),
    ([(r".*q\.weight", ("tp", "tp")), (r".*", None)], "axis 'tp' splits both dim 0 and dim 1"),
    ([(r".*q\.weight", ("dp", None)), (r".*", None)], "'dp' replicates parameters"),
])
def test_layout_errors_name_parameter_and_fix(rules, fragment):
    with pytest.raises(PlanError, match=fragment) as err:
        _resolve(rules)
    assert "layers.0.q.weight" in str(err.value)


def test_indivisible_dim_lists_valid_sizes():
    with pytest.raises(PlanError) as err:
        _resolve([(r".*q\.weight", ("tp", None)), (r".*", None)], mesh=sk.Mesh(tp=3), shapes={"layers.0.q.weight": (64, 64)})
    text = str(err.value)
    assert "dim 0 has size 64, not divisible by tp=3" in text and "[1, 2, 4, 8, 16, 32, 64]" in text


def test_tuple_of_axes_splits_by_product():
    res = _resolve([(r".*q\.weight", (("fsdp", "tp"), None)), (r".*", None)])
    assert res.params["layers.0.q.weight"].local_shape(sk.Mesh(fsdp=2, tp=2)) == (16, 64)


@given(st.lists(st.tuples(AXES, st.integers(1, 4)), min_size=1, max_size=3, unique_by=lambda t: t[0]),
       st.integers(1, 3), st.integers(0, 2))
def test_local_shape_times_split_is_global(axes, mult, dim):
    mesh = sk.Mesh(dict(axes))
    model_axes = [a for a in mesh.names if a not in ("dp", "ep")]  # axes no layout may name
    shape = [mesh.size * mult] * 3
    layout = [None, None, None]
    if model_axes:
        layout[dim] = tuple(model_axes)
    res = resolve_layouts({"w": tuple(shape)}, sk.LayoutMap([("w", layout)]), mesh)
    p = res.params["w"]
    assert tuple(a * b for a, b in zip(p.local_shape(mesh), p.split(mesh))) == tuple(shape)


# -- Plan --------------------------------------------------------------------------------------
def _plan():
    return sk.Plan(mesh=sk.Mesh(fsdp=2, tp=2),
                   rules=sk.LayoutMap([(r".*\.q\.weight", ("tp", None)), (r".*\.q\.bias", ["tp"]), (r".*", None)]),
                   fsdp=sk.FSDPOptions(reshard_after_forward=False, param_dtype="bfloat16"))


def test_plan_json_and_yaml_round_trip_exactly():
    plan = _plan()
    assert sk.Plan.from_json(plan.to_json()) == plan
    assert sk.Plan.from_yaml(plan.to_yaml()) == plan
    assert sk.Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_plan_files(tmp_path):
    plan = _plan()
    for suffix in (".json", ".yaml"):
        plan.save(tmp_path / f"p{suffix}")
        assert sk.Plan.load(tmp_path / f"p{suffix}") == plan


def test_plan_from_dict_rejects_unknown_keys():
    with pytest.raises(PlanError, match="unknown keys \\['meshes'\\]"):
        sk.Plan.from_dict({"meshes": {}})
    with pytest.raises(PlanError, match="valid: None or one of"):
        sk.Plan.from_dict({"mesh": {"dp": 2}, "fsdp": {"param_dtype": "int8"}})


def test_validate_warns_about_unused_rule():
    plan = sk.Plan(mesh=sk.Mesh(tp=2), rules=sk.LayoutMap([(r"layers\.0\.q\.weight", ("tp", None)),
                                                           (r".*\.typo_proj\.weight", ("tp", None)), (r".*", None)]))
    with pytest.warns(PlanWarning, match="typo_proj"):
        report = validate(plan, SHAPES)
    assert report.layouts.params["layers.0.q.weight"].local_shape(report.mesh) == (32, 64)


def test_validate_rejects_unused_model_axis_and_lists_every_problem():
    plan = sk.Plan(mesh=sk.Mesh(tp=2, mp=2), rules=sk.LayoutMap([(r"layers\.0\.q\.weight", ("tp", None))]))
    with pytest.raises(PlanError) as err:
        validate(plan, SHAPES)
    assert "mesh axis 'mp' (size 2) is used by no layout rule" in str(err.value)
    assert "'mp' is a user axis; shardkit's own axes are dp, fsdp, tp, pp, sp, ep: a typo?" in str(err.value)
    assert "match no layout rule" in str(err.value)
    assert len(err.value.problems) == 2
    with pytest.raises(PlanError, match=r"'FSDP' is a user axis; shardkit's own axes are dp, fsdp, tp, pp, sp"):
        validate(sk.Plan(mesh=sk.Mesh(FSDP=2)), SHAPES)


def test_validate_needs_world_size_for_inferred_axis():
    plan = sk.Plan(mesh=sk.Mesh(fsdp=-1))
    with pytest.raises(PlanError, match="pass world_size"):
        validate(plan, SHAPES)
    assert validate(plan, SHAPES, world_size=4).mesh["fsdp"] == 4


def test_sequence_parallel_needs_tp():
    with pytest.raises(PlanError, match="sequence_parallel=True needs a 'tp' axis"):
        validate(sk.Plan(mesh=sk.Mesh(fsdp=2), sequence_parallel=True), SHAPES)


def test_sequence_splits_are_refused_inside_a_pipeline():
    """Both failed inside the workers before (a stage gets no global positions; SP's DTensors meet a
    stage's plain tensors): refused before launch."""
    pipeline = sk.Pipeline(microbatches=2)
    problems = sk.Plan(mesh=sk.Mesh(pp=2, sp=2), pipeline=pipeline).problems()
    assert any("context parallel (sp=2) with a pipeline (pp=2) is not supported" in p for p in problems)
    problems = sk.Plan(mesh=sk.Mesh(pp=2, tp=2), rules=[(".*", None)], pipeline=pipeline,
                       sequence_parallel=True).problems()
    assert any("sequence_parallel=True with a pipeline (pp=2) is not supported" in p for p in problems)


def test_hsdp_needs_dp_before_fsdp():
    with pytest.raises(PlanError, match="'dp' must come before \\['fsdp'\\]"):
        validate(sk.Plan(mesh=sk.Mesh(fsdp=2, dp=2)), SHAPES)
    validate(sk.Plan(mesh=sk.Mesh(dp=2, fsdp=2)), SHAPES)
