"""Ensemble in one world: every replica trains its own model on its own data, then they vote.

``ReplicaGrouping(8, group_size=1)`` makes eight groups of one: each replica's parameters
are its own (a grouped module), gradients are averaged within groups of one (so not at
all), and at the end the predictions are averaged over the transposed grouping, which is
one group of all replicas. The run is checked against training the eight models one after
another in this process.

    python examples/ensemble.py
"""

from __future__ import annotations

import numpy as np
import torch
from _common import sgd_step
from torch import nn

import shardkit as sk
from shardkit.runtime.collectives import all_reduce
from shardkit.runtime.groups import group_index
from shardkit.runtime.variables import group_module

MEMBERS = 8
STEPS = 40
LR = 0.05
PLAN = sk.Plan(mesh=sk.Mesh(dp=MEMBERS), replicas=sk.ReplicaGrouping(MEMBERS, group_size=1))


def build_model(member: int) -> nn.Module:
    torch.manual_seed(1000 + member)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def teacher(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x @ torch.tensor([[1.0], [-0.5], [0.3], [0.8]], dtype=x.dtype))


def member_data(member: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each member sees its own 48 noisy samples."""
    rng = np.random.default_rng(100 + member)
    x = torch.from_numpy(rng.standard_normal((48, 4)))
    return x, teacher(x) + 0.1 * torch.from_numpy(rng.standard_normal((48, 1)))


def test_inputs() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(7).standard_normal((128, 4)))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, after_backward=None) -> list[float]:
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        sgd_step(model.parameters(), LR)
        losses.append(loss.item())
    return losses


def work(ctx) -> dict:
    """One ensemble member per replica (runs in every process)."""
    grouping = ctx.plan.replicas
    member = group_index(grouping)
    grouped = group_module(build_model(member), grouping)
    losses = train(grouped.module, *member_data(member), after_backward=grouped.average_gradients)
    with torch.no_grad():
        prediction = grouped.module(test_inputs())
    ensemble = all_reduce(prediction, grouping, "mean", transpose=True)  # one group of all members
    states = grouped.read_state()  # {name: [MEMBERS, ...]}, the first replica of each group
    return {"losses": losses, "prediction": prediction, "ensemble": ensemble, "states": states}


def simulate() -> dict:
    """The same ensemble trained member by member in this process."""
    models = [build_model(m) for m in range(MEMBERS)]
    losses = [train(model, *member_data(m)) for m, model in enumerate(models)]
    with torch.no_grad():
        predictions = torch.stack([model(test_inputs()) for model in models])
    states = {name: torch.stack([dict(model.named_parameters())[name].detach() for model in models])
              for name, _ in models[0].named_parameters()}
    return {"losses": losses, "predictions": predictions, "states": states}


def main(world=None) -> dict:
    results = sk.launch(work, PLAN, world=world)
    reference = simulate()
    target = teacher(test_inputs())
    member_mse = [nn.functional.mse_loss(r["prediction"], target).item() for r in results]
    summary = {
        "max_weight_diff": max((results[0]["states"][n] - t).abs().max().item() for n, t in reference["states"].items()),
        "max_prediction_diff": max((r["prediction"] - reference["predictions"][m]).abs().max().item()
                                   for m, r in enumerate(results)),
        "max_ensemble_diff": max((r["ensemble"] - reference["predictions"].mean(0)).abs().max().item() for r in results),
        "member_test_mse": member_mse,
        "ensemble_test_mse": nn.functional.mse_loss(results[0]["ensemble"], target).item(),
        "first_and_last_loss": [(r["losses"][0], r["losses"][-1]) for r in results],
        "min_distance_between_members": min(
            (results[0]["states"]["0.weight"][a] - results[0]["states"]["0.weight"][b]).abs().max().item()
            for a in range(MEMBERS) for b in range(a)),
    }
    print(f"members' test MSE {np.round(member_mse, 4).tolist()}; ensemble {summary['ensemble_test_mse']:.4f}")
    print(f"vs training one by one: weights max |diff| {summary['max_weight_diff']:.2e}, "
          f"ensemble max |diff| {summary['max_ensemble_diff']:.2e}")
    return summary


if __name__ == "__main__":
    main()
