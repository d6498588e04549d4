"""ReplicaGrouping as pure data: PopXL's tables, assignment rules, transpose, validation, CLI."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardkit as sk
from shardkit.cli import main as cli_main
from shardkit.plan import Mesh, Plan, PlanError, ReplicaGrouping
from shardkit.plan.replicas import grouping_table
from shardkit.planner.validate import validate
from shardkit.runtime.meshes import grouped_mesh_ranks


# -- PopXL's three tables (Tables 13.1-13.3), exactly --------------------------------------------
def test_table_consecutive_groups():
    g = ReplicaGrouping(16, group_size=4, stride=1)
    assert g.groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_table_strided_groups():
    g = ReplicaGrouping(replication_factor=16, group_size=4, stride=4)
    assert g.groups == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g.num_groups == 4
    assert g.assignment == [0, 1, 2, 3] * 4
    assert grouping_table(g) == (
        "ReplicaGrouping(replication_factor=16, group_size=4, stride=4): 4 groups of 4 replicas\n"
        "Group  Replicas\n"
        "    0  0, 4, 8, 12\n"
        "    1  1, 5, 9, 13\n"
        "    2  2, 6, 10, 14\n"
        "    3  3, 7, 11, 15")


def test_table_groups_of_one():
    g = ReplicaGrouping(16, group_size=1)
    assert g.groups == [[r] for r in range(16)]
    assert g.num_groups == 16 and g.assignment == list(range(16))


def test_defaults_and_popxl_listing_examples():
    assert ReplicaGrouping(8).groups == [list(range(8))]  # default: one group of all replicas
    assert ReplicaGrouping(8, stride=4).groups == [[0, 4], [1, 5], [2, 6], [3, 7]]  # group_size = 8 // 4
    assert ReplicaGrouping(8, group_size=2).transpose() == ReplicaGrouping(8, stride=2)
    # PopXL's assignment examples for a replication factor of 8
    assert ReplicaGrouping(8, group_size=2, stride=2).assignment == [0, 1, 0, 1, 2, 3, 2, 3]
    assert ReplicaGrouping(8, group_size=4, stride=2).assignment == [0, 1, 0, 1, 0, 1, 0, 1]
    # PopXL's transpose examples
    for before, after in ([0, 0, 0, 0], [0, 1, 2, 3]), ([0, 1, 0, 1], [0, 0, 1, 1]), ([0, 0, 1, 1], [0, 1, 0, 1]):
        assert ReplicaGrouping.from_assignment(before).transpose().assignment == after
        assert ReplicaGrouping.from_assignment(after).transpose().assignment == before
    assert ReplicaGrouping.from_assignment([0, 1, 0, 1, 2, 3, 2, 3]).transpose().assignment == [0, 0, 1, 1, 0, 0, 1, 1]


# -- properties ------------------------------------------------------------------------------------
@st.composite
def strided(draw) -> tuple[int, int, int]:
    stride, size, blocks = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    return stride * size * blocks, size, stride


def popxl_fill(rf: int, size: int, stride: int) -> list[int]:
    """PopXL's own construction: each group starts at the first free replica, members stride apart."""
    assign: list[int | None] = [None] * rf
    offset = 0
    for group in range(rf // size):
        while assign[offset] is not None:
            offset += 1
        for k in range(size):
            assign[offset + k * stride] = group
    return assign  # type: ignore[return-value]


@given(strided())
def test_assignment_follows_the_formula_and_popxl(params):
    rf, size, stride = params
    g = ReplicaGrouping(rf, group_size=size, stride=stride)
    assert g.assignment == [r % stride + stride * (r // (stride * size)) for r in range(rf)]
    assert g.assignment == popxl_fill(rf, size, stride)
    assert g.num_groups == rf // size and g.group_size == size and g.is_constant
    assert sorted(r for members in g.groups for r in members) == list(range(rf))
    for members in g.groups:
        assert len(members) == size
        assert all(b - a == g.stride for a, b in zip(members, members[1:]))
    for r in range(rf):
        assert g.groups[g.group_of(r)][g.index_in_group(r)] == r
    assert (g.popxl_problems() == []) == (stride == 1 or size == 1 or stride * size == rf)


def _orthogonal(a: ReplicaGrouping, b: ReplicaGrouping) -> bool:
    return all(len(set(x) & set(y)) == 1 for x in a.groups for y in b.groups)


@given(strided())
def test_transpose_is_orthogonal_and_an_involution(params):
    g = ReplicaGrouping(params[0], group_size=params[1], stride=params[2])
    t = g.transpose()
    assert _orthogonal(g, t)
    assert t.num_groups == g.group_size and t.group_size == g.num_groups
    assert t.transpose() == g
    assert t.groups == [[members[i] for members in g.groups] for i in range(g.group_size)]


@given(strided())
def test_from_assignment_recovers_constant_groupings(params):
    g = ReplicaGrouping(params[0], group_size=params[1], stride=params[2])
    back = ReplicaGrouping.from_assignment(g.assignment)
    assert back == g and back.is_constant and repr(back) == repr(g)
    assert ReplicaGrouping.from_dict(g.to_dict()) == g
    assert pickle.loads(pickle.dumps(g)) == g


@st.composite
def any_assignment(draw) -> list[int]:
    labels = draw(st.lists(st.integers(0, 5), min_size=1, max_size=12))
    order = {label: i for i, label in enumerate(dict.fromkeys(labels))}
    return [order[label] for label in labels]


@given(any_assignment())
def test_from_assignment_keeps_arbitrary_groups(assignment):
    g = ReplicaGrouping.from_assignment(assignment)
    assert g.assignment == assignment
    assert g.groups == [[r for r, a in enumerate(assignment) if a == k] for k in range(max(assignment) + 1)]
    assert g.has_equal_groups == (len(set(g.group_sizes)) == 1)
    assert ReplicaGrouping.from_dict(g.to_dict()) == g
    assert pickle.loads(pickle.dumps(g)) == g
    if g.has_equal_groups:
        t = g.transpose()
        assert _orthogonal(g, t)
        assert t.groups == [sorted(members[i] for members in g.groups) for i in range(g.group_size)]
    else:
        with pytest.raises(PlanError, match="different sizes"):
            g.transpose()


@given(strided(), st.sampled_from([("dp",), ("dp", "tp"), ("pp", "dp"), ("pp", "dp", "fsdp")]), st.booleans())
def test_grouped_mesh_puts_each_replica_group_along_dp_replica(params, names, shuffle):
    rf, size, stride = params
    grouping = ReplicaGrouping(rf, group_size=size, stride=stride)
    if shuffle and grouping.num_groups > 1 and size > 1:  # swap two members: usually no longer constant
        groups = grouping.groups
        groups[0][-1], groups[1][-1] = groups[1][-1], groups[0][-1]
        labels = [next(i for i, m in enumerate(groups) if r in m) for r in range(rf)]
        first = {label: i for i, label in enumerate(dict.fromkeys(labels))}
        grouping = ReplicaGrouping.from_assignment([first[label] for label in labels])
    mesh = Mesh({name: rf if name == "dp" else 2 for name in names})
    dims, ranks = grouped_mesh_ranks(mesh, grouping)
    axis = dims.index("dp_replica")
    assert dims[axis - 1:axis + 2] == ("dp_outer", "dp_replica", "dp_inner")
    rows = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis]).tolist()
    assert sorted(r for row in rows for r in row) == list(range(mesh.size))
    for row in rows:
        coords = [mesh.coordinates(r) for r in row]
        assert sorted(grouping.group_of(c["dp"]) for c in coords) == [grouping.group_of(coords[0]["dp"])] * size
        assert [c["dp"] for c in coords] == grouping.groups[grouping.group_of(coords[0]["dp"])]
        assert all({a: v for a, v in c.items() if a != "dp"} == {a: v for a, v in coords[0].items() if a != "dp"}
                   for c in coords)
    if grouping.is_constant:
        assert ranks.shape[axis - 1:axis + 2] == (rf // (grouping.stride * size), size, grouping.stride)


# -- validation ------------------------------------------------------------------------------------
def test_general_rule_accepts_more_than_popxl_documents():
    g = ReplicaGrouping(16, group_size=2, stride=4)
    assert g.groups[:5] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12]]
    (problem,) = g.popxl_problems()
    assert "stride * group_size == replication_factor" in problem and "4 * 2 = 8 != 16" in problem
    assert ReplicaGrouping(16, group_size=4, stride=4).popxl_problems() == []
    assert "equal size" in ReplicaGrouping.from_assignment([0, 0, 1]).popxl_problems()[0]


@pytest.mark.parametrize("args, rule, valid", [
    ((16, 3, 1), "replication_factor % group_size == 0", "valid group sizes with stride 1: [1, 2, 4, 8, 16]"),
    ((16, 4, 3), "replication_factor % (stride * group_size) == 0", "valid strides with group_size 4: [1, 2, 4]"),
    ((16, 4, 8), "replication_factor % (stride * group_size) == 0", "valid group sizes with stride 8: [1, 2]"),
    ((12, 5, 2), "replication_factor % (stride * group_size) == 0", "valid group sizes with stride 2: [1, 2, 3, 6]"),
])
def test_invalid_combinations_name_the_rule_and_valid_values(args, rule, valid):
    with pytest.raises(PlanError) as info:
        ReplicaGrouping(*args)
    assert rule in str(info.value) and valid in str(info.value)


def test_other_invalid_inputs():
    with pytest.raises(PlanError, match=r"valid strides: \[1, 2, 4, 8, 16\]"):
        ReplicaGrouping(16, stride=3)
    with pytest.raises(PlanError, match="group_size=0; valid: an integer >= 1"):
        ReplicaGrouping(16, group_size=0)
    with pytest.raises(PlanError, match="replication_factor=2.5"):
        ReplicaGrouping(2.5)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"numbered that way: \[0, 1, 0, 1\]"):
        ReplicaGrouping.from_assignment([1, 0, 1, 0])
    with pytest.raises(PlanError, match="one group number"):
        ReplicaGrouping.from_assignment([])
    with pytest.raises(PlanError, match="replica 9 is out of range; valid: 0..7"):
        ReplicaGrouping(8).group_of(9)
    with pytest.raises(PlanError, match="valid keys"):
        ReplicaGrouping.from_dict({"replication_factor": 8, "groups": 2})


def test_plan_checks_replicas_against_the_mesh():
    assert ReplicaGrouping(8, group_size=2).check_mesh(Mesh(dp=8, tp=2)) == []
    assert ReplicaGrouping.from_assignment([0, 1, 1, 0]).check_mesh(Mesh(dp=4)) == []  # non-constant: supported
    (problem,) = ReplicaGrouping(8, group_size=2).check_mesh(Mesh(dp=4, tp=2))
    assert "replication_factor=8" in problem and "dp' has size 4" in problem
    (problem,) = ReplicaGrouping.from_assignment([0, 0, 1, 2]).check_mesh(Mesh(dp=4))
    assert "different sizes [2, 1, 1]" in problem and "average_gradients" in problem
    assert "reserved" in ReplicaGrouping(2).check_mesh(Mesh(dp=2, dp_inner=1))[0]
    plan = Plan(mesh=Mesh(dp=4), replicas=ReplicaGrouping(8, group_size=2))
    with pytest.raises(PlanError, match="replication_factor=8"):
        validate(plan, {"w": (4, 4)})


@pytest.mark.parametrize("replicas", [ReplicaGrouping(8, group_size=2, stride=2),
                                      ReplicaGrouping.from_assignment([0, 1, 1, 0, 2, 3, 3, 2])])
def test_plan_round_trips_replicas(replicas):
    plan = sk.Plan(mesh=sk.Mesh(dp=8), replicas=replicas)
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_yaml(plan.to_yaml()) == plan


# -- CLI -------------------------------------------------------------------------------------------
def test_cli_prints_the_group_table(capsys):
    assert cli_main(["replicas", "--replication-factor", "16", "--group-size", "4", "--stride", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(grouping_table(ReplicaGrouping(16, group_size=4, stride=4)) + "\n")
    assert "assignment (replica -> group): 0, 1, 2, 3, 0, 1, 2, 3" in out
    assert "PopXL's documented rules: satisfied" in out
    assert cli_main(["replicas", "--replication-factor", "16", "--group-size", "4", "--transpose"]) == 0
    assert "    0  0, 4, 8, 12" in capsys.readouterr().out
    assert cli_main(["replicas", "--assignment", "0,1,1,0"]) == 0
    out = capsys.readouterr().out
    assert "    0  0, 3" in out and "not constant" in out


def test_cli_reports_invalid_groupings(capsys):
    assert cli_main(["replicas", "--replication-factor", "16", "--group-size", "3"]) == 2
    assert "replication_factor % group_size == 0" in capsys.readouterr().err
    assert cli_main(["replicas", "--replication-factor", "16", "--group-size", "2", "--stride", "4"]) == 0
    assert "not satisfied" in capsys.readouterr().out
