"""Replica groups on a live world of 8 processes: grouped variables, collectives, plan meshes.

One shared world; each test runs one job that covers a feature area and returns plain
values, checked here against numpy references built from the grouping's ``groups``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardkit.plan import Mesh, Plan, PlanError, ReplicaGrouping, UsageError
from shardkit.runtime import collectives
from shardkit.runtime.collectives import (
    all_gather,
    all_reduce,
    average_gradients,
    broadcast,
    reduce_scatter,
)
from shardkit.runtime.groups import group_index, replica_index
from shardkit.runtime.meshes import meshes_for
from shardkit.runtime.variables import ReplicaDisagreement, group_module, stack_states, variable

WORLD = 8
GROUPINGS = {
    "consecutive": ReplicaGrouping(8, group_size=2),
    "strided": ReplicaGrouping(8, group_size=4, stride=2),
    "blocks": ReplicaGrouping(8, group_size=2, stride=2),  # general rule only: two blocks of strided groups
    "non_constant": ReplicaGrouping.from_assignment([0, 1, 1, 0, 2, 3, 3, 2]),
}
UNEQUAL = ReplicaGrouping.from_assignment([0, 0, 1, 2, 1, 2, 2, 0])
VAR_GROUPINGS = {**GROUPINGS, "ones": ReplicaGrouping(8, group_size=1), "all": None, "unequal": UNEQUAL}


def _input(rank: int) -> torch.Tensor:
    return torch.from_numpy(1.0 + 0.1 * np.random.default_rng(rank).standard_normal((4, 6)))


def _host(num_groups: int, offset: float = 0.0) -> np.ndarray:
    shape = [num_groups, 3, 2] if num_groups > 1 else [3, 2]
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + offset


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except (PlanError, UsageError, ReplicaDisagreement) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# -- grouped variables ---------------------------------------------------------------------------
def _variables_job(ctx) -> dict:
    out: dict = {}
    for key, grouping in VAR_GROUPINGS.items():
        n = 1 if grouping is None else grouping.num_groups
        # every rank passes different host data; rank 0's is the one used (src=0)
        one = variable(_host(n, offset=1000.0 * ctx.rank), grouping, name=key)
        every = variable(_host(n, offset=1000.0 * ctx.rank), grouping, "all_replicas", src=None)
        out[key] = {"local": one.value.numpy().copy(), "one_per_group": one.read(check=True).numpy(),
                    "all_replicas": every.read().numpy(), "own_local": every.value.numpy().copy()}
    grouping = GROUPINGS["consecutive"]
    v = variable(_host(4), grouping, name="w")
    if ctx.rank == 5:
        v.value += 1.0
    out["disagreements"] = v.disagreements()
    out["check_error"] = _error(v.read, check=True)
    out["within_atol"] = v.disagreements(atol=2.0)
    out["write_error"] = _error(v.write, np.zeros([3, 2]))
    v.write(_host(4, offset=7.0))
    out["written"] = v.read().numpy()
    out["create_error"] = _error(variable, np.zeros([3, 3, 2]), grouping)
    out["mode_error"] = _error(variable, _host(4), grouping, "some_replicas")
    out["rf_error"] = _error(variable, _host(2), ReplicaGrouping(4, group_size=2))

    # whole modules: group_size 2, each rank starts from its own seed; groups take their first replica's values
    torch.manual_seed(ctx.rank)
    grouped = group_module(torch.nn.Linear(3, 2), grouping)
    out["module_state"] = {k: t.numpy() for k, t in grouped.read_state(check=True).items()}
    out["module_local"] = {k: p.detach().numpy().copy() for k, p in grouped.module.named_parameters()}
    states = [{"weight": torch.full((2, 3), float(g)), "bias": torch.full((2,), -float(g))} for g in range(4)]
    grouped.load_state(stack_states(states))
    out["loaded_local"] = {k: p.detach().numpy().copy() for k, p in grouped.module.named_parameters()}
    out["load_error"] = _error(grouped.load_state, {"weight": torch.zeros(4, 2, 3)})
    return out


def test_grouped_variables_and_retrieval_modes(world):
    results = world(WORLD).run(_variables_job)
    for key, grouping in VAR_GROUPINGS.items():
        grouping = grouping or ReplicaGrouping(WORLD)
        n = grouping.num_groups
        host = _host(n)
        per_group = host if n > 1 else host[None]
        for rank, got in enumerate(results):
            group = grouping.group_of(rank)
            np.testing.assert_array_equal(got[key]["local"], per_group[group], err_msg=key)
            np.testing.assert_array_equal(got[key]["one_per_group"], host, err_msg=key)
            own_values = per_group[grouping.assignment] + 1000.0 * np.arange(WORLD)[:, None, None]
            np.testing.assert_array_equal(got[key]["all_replicas"], own_values, err_msg=key)
            own = _host(n, offset=1000.0 * rank)
            np.testing.assert_array_equal(got[key]["own_local"], own[group] if n > 1 else own, err_msg=key)
    first = results[0]
    assert first["disagreements"] == {2: [5]}
    assert "group 2: replicas [5]" in first["check_error"] and first["check_error"].startswith("ReplicaDisagreement")
    assert first["within_atol"] == {}
    assert "[4, 3, 2]" in first["write_error"]
    np.testing.assert_array_equal(first["written"], _host(4, offset=7.0))
    assert "has 4 groups" in first["create_error"] and "[4, ...]" in first["create_error"]
    assert "'one_per_group', 'all_replicas'" in first["mode_error"]
    assert "replication_factor=4" in first["rf_error"] and "8 replicas" in first["rf_error"]
    grouping = GROUPINGS["consecutive"]
    for rank, got in enumerate(results):
        group = grouping.group_of(rank)
        for name, value in got["module_local"].items():
            np.testing.assert_array_equal(value, first["module_state"][name][group])
        np.testing.assert_array_equal(got["loaded_local"]["weight"], np.full((2, 3), float(group)))
        np.testing.assert_array_equal(got["loaded_local"]["bias"], np.full((2,), -float(group)))
    assert not np.array_equal(first["module_state"]["weight"][0], first["module_state"]["weight"][1])
    assert "missing ['bias']" in first["load_error"]


# -- collectives ---------------------------------------------------------------------------------
def _checks(calls) -> int:
    """How many shape checks ``calls()`` runs."""
    count, check = [0], collectives._check_same

    def counted(*args):
        count[0] += 1
        return check(*args)

    collectives._check_same = counted
    try:
        calls()
    finally:
        collectives._check_same = check
    return count[0]


def _collectives_job(ctx) -> dict:
    x = _input(ctx.rank)
    out: dict = {}
    for key, grouping in GROUPINGS.items():
        for transpose in (False, True):
            res = {}
            for op in ("sum", "mean", "max", "min", "product"):
                res[f"all_reduce_{op}"] = all_reduce(x, grouping, op, transpose=transpose).numpy()
            res["all_gather_0"] = all_gather(x, grouping, transpose=transpose).numpy()
            res["all_gather_1"] = all_gather(x, grouping, dim=1, transpose=transpose).numpy()
            res["all_gather_stack"] = all_gather(x, grouping, stack=True, transpose=transpose).numpy()
            for op in ("sum", "mean", "max"):
                res[f"reduce_scatter_{op}"] = reduce_scatter(x, grouping, op, transpose=transpose).numpy()
            res["broadcast_0"] = broadcast(x, grouping, transpose=transpose).numpy()
            res["broadcast_1"] = broadcast(x, grouping, src=1, transpose=transpose).numpy()
            out[(key, transpose)] = res
    out["unequal_sum"] = all_reduce(x, UNEQUAL).numpy()
    out["unequal_broadcast"] = broadcast(x, UNEQUAL).numpy()
    out["unequal_gather"] = _error(all_gather, x, UNEQUAL)
    out["unequal_scatter"] = _error(reduce_scatter, x, UNEQUAL)
    out["bad_op"] = _error(all_reduce, x, GROUPINGS["consecutive"], "median")
    out["indivisible"] = _error(reduce_scatter, x[:3], GROUPINGS["strided"])
    out["shape_mismatch"] = _error(all_reduce, x[:3] if ctx.rank == 3 else x, GROUPINGS["consecutive"], check=True)
    # by default only the first call of a collective on a group checks (no host read on later calls)
    collectives._CHECKED.clear()  # on every rank, as a fresh process
    out["checked_once"] = _checks(lambda: [all_reduce(x, GROUPINGS["strided"], "sum", transpose=True) for _ in range(3)])
    out["not_differentiable"] = _error(all_reduce, x.clone().requires_grad_(), None, "max")

    # gradients under the tensor-parallel convention (downstream identical on every member)
    c = torch.from_numpy(np.random.default_rng(99).standard_normal((8, 6)))
    grads = {}
    for name, fn in {
        "all_reduce_sum": lambda t: (all_reduce(t, GROUPINGS["strided"]) * c[:4]).sum(),
        "all_reduce_mean": lambda t: (all_reduce(t, GROUPINGS["strided"], "mean") * c[:4]).sum(),
        "all_gather": lambda t: (all_gather(t, GROUPINGS["consecutive"]) * c).sum(),
        "reduce_scatter": lambda t: (reduce_scatter(t, GROUPINGS["consecutive"]) * c[:2]).sum(),
        "broadcast": lambda t: (broadcast(t, GROUPINGS["consecutive"], src=1) * c[:4]).sum(),
    }.items():
        t = x.clone().requires_grad_()
        fn(t).backward()
        grads[name] = t.grad.numpy()
    out["grads"] = grads

    # gradient averaging within groups, by grouping and by process group
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(ctx.rank * 10 + i))
    average_gradients(params, GROUPINGS["strided"])
    out["avg_grouping"] = [p.grad.numpy().copy() for p in params]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(ctx.rank * 10 + i))
    average_gradients(params, GROUPINGS["non_constant"], transpose=True)
    out["avg_transpose"] = [p.grad.numpy().copy() for p in params]
    return out


def _reference(op: str, xs: list[np.ndarray]) -> np.ndarray:
    stacked = np.stack(xs)
    return {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.max(0), "min": stacked.min(0),
            "product": stacked.prod(0)}[op]


@pytest.fixture(scope="module")
def collective_results(world):
    return world(WORLD).run(_collectives_job)


def test_grouped_collectives_match_numpy(collective_results):
    results = collective_results
    xs = [_input(r).numpy() for r in range(WORLD)]
    for key, base in GROUPINGS.items():
        for transpose in (False, True):
            grouping = base.transpose() if transpose else base
            for rank, got in enumerate(results):
                res = got[(key, transpose)]
                members = grouping.groups[grouping.group_of(rank)]
                index = members.index(rank)
                mine = [xs[m] for m in members]
                label = f"{key} transpose={transpose} rank {rank}"
                for op in ("sum", "mean", "max", "min", "product"):
                    np.testing.assert_allclose(res[f"all_reduce_{op}"], _reference(op, mine), rtol=1e-12, err_msg=label)
                np.testing.assert_array_equal(res["all_gather_0"], np.concatenate(mine, 0), err_msg=label)
                np.testing.assert_array_equal(res["all_gather_1"], np.concatenate(mine, 1), err_msg=label)
                np.testing.assert_array_equal(res["all_gather_stack"], np.stack(mine), err_msg=label)
                for op in ("sum", "mean", "max"):
                    np.testing.assert_allclose(res[f"reduce_scatter_{op}"],
                                               np.split(_reference(op, mine), len(members))[index], rtol=1e-12,
                                               err_msg=label)
                np.testing.assert_array_equal(res["broadcast_0"], xs[members[0]], err_msg=label)
                np.testing.assert_array_equal(res["broadcast_1"], xs[members[1]], err_msg=label)
    for rank, got in enumerate(results):
        members = UNEQUAL.groups[UNEQUAL.group_of(rank)]
        np.testing.assert_allclose(got["unequal_sum"], _reference("sum", [xs[m] for m in members]), rtol=1e-12)
        np.testing.assert_array_equal(got["unequal_broadcast"], xs[members[0]])
    first = results[0]
    assert "all_gather cannot use" in first["unequal_gather"] and "[3, 2, 3]" in first["unequal_gather"]
    assert "reduce_scatter cannot use" in first["unequal_scatter"]
    assert "'median'" in first["bad_op"] and "'product'" in first["bad_op"]
    assert "not divisible by the group size 4" in first["indivisible"]
    for rank in (2, 3):
        assert "replica 3: (3, 6)" in results[rank]["shape_mismatch"]
        assert "replica 2: (4, 6)" in results[rank]["shape_mismatch"]
    assert results[0]["shape_mismatch"] == "no error"
    assert [r["checked_once"] for r in results] == [1] * len(results)
    assert "not differentiable" in first["not_differentiable"]


def test_collective_gradients_follow_the_tensor_parallel_convention(collective_results):
    results = collective_results
    c = np.random.default_rng(99).standard_normal((8, 6))
    consecutive = GROUPINGS["consecutive"]
    for rank, got in enumerate(results):
        g = got["grads"]
        index = consecutive.index_in_group(rank)
        np.testing.assert_allclose(g["all_reduce_sum"], c[:4])
        np.testing.assert_allclose(g["all_reduce_mean"], c[:4] / 4)
        np.testing.assert_allclose(g["all_gather"], c[4 * index:4 * index + 4])
        np.testing.assert_allclose(g["reduce_scatter"], np.concatenate([c[:2], c[:2]]))
        np.testing.assert_allclose(g["broadcast"], c[:4] if index == 1 else np.zeros((4, 6)))
        strided = GROUPINGS["strided"].groups[GROUPINGS["strided"].group_of(rank)]
        for i, grad in enumerate(got["avg_grouping"]):
            np.testing.assert_allclose(grad, np.mean([m * 10 + i for m in strided]))
        transposed = GROUPINGS["non_constant"].transpose()
        members = transposed.groups[transposed.group_of(rank)]
        for i, grad in enumerate(got["avg_transpose"]):
            np.testing.assert_allclose(grad, np.mean([m * 10 + i for m in members]))


# -- plans: replica groups of the dp axis beside tp, fsdp, pp ------------------------------------
PLANS = {
    "dp_tp": Plan(mesh=Mesh(dp=4, tp=2), replicas=ReplicaGrouping(4, group_size=2)),
    "pp_dp": Plan(mesh=Mesh(pp=2, dp=4), replicas=ReplicaGrouping.from_assignment([0, 1, 1, 0])),
    "dp_fsdp": Plan(mesh=Mesh(dp=4, fsdp=2), replicas=ReplicaGrouping(4, group_size=2, stride=2)),
}


def _plan_job(ctx) -> dict:
    grouping = ctx.plan.replicas
    mesh = meshes_for(ctx.plan, ctx.device.type).root
    sub = mesh["dp_replica"]
    rank = torch.tensor([float(ctx.rank)])
    torch.distributed.all_reduce(rank, group=sub.get_group())
    v = variable(np.arange(grouping.num_groups * 2.0).reshape(grouping.num_groups, 2), grouping, "all_replicas")
    return {"replica": replica_index(), "group": group_index(grouping), "mesh_ranks": sorted(sub.mesh.tolist()),
            "mesh_sum": rank.item(), "collective_sum": all_reduce(torch.tensor([float(ctx.rank)]), grouping).item(),
            "read": v.read().numpy(), "local": v.value.numpy()}


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_replica_groups_beside_other_axes(world, name):
    plan = PLANS[name]
    results = world(WORLD).run(_plan_job, plan=plan)
    grouping = plan.replicas
    for rank, got in enumerate(results):
        coords = plan.mesh.coordinates(rank)
        assert got["replica"] == coords["dp"]
        assert got["group"] == grouping.group_of(coords["dp"])
        peers = [r for r in range(WORLD)
                 if grouping.group_of(plan.mesh.coordinates(r)["dp"]) == got["group"]
                 and all(plan.mesh.coordinates(r)[a] == coords[a] for a in plan.mesh.names if a != "dp")]
        assert got["mesh_ranks"] == peers
        assert got["mesh_sum"] == got["collective_sum"] == sum(peers)
        np.testing.assert_array_equal(got["local"], [2.0 * got["group"], 2.0 * got["group"] + 1])
        np.testing.assert_array_equal(got["read"][:, 0], [2.0 * g for g in grouping.assignment])
