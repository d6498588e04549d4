"""Co-distillation: two groups train two models, each also learning from the other's predictions.

``ReplicaGrouping(8, group_size=4)`` holds model A on replicas 0-3 and model B on 4-7 (a
grouped module loaded from ``[2, ...]`` host state), each data-parallel over its four
replicas. Replica ``i`` of A and replica ``i`` of B see the same batch shard; they swap
predictions over the transposed grouping ({0, 4}, {1, 5}, ...), and each adds a KL term
towards the other's (detached) predictions. Checked against both models trained together in
one process.

    python examples/codistillation.py
"""

from __future__ import annotations

import numpy as np
import torch
from _common import sgd_step
from torch import nn
from torch.nn import functional as F

import shardkit as sk
from shardkit.runtime.collectives import all_gather
from shardkit.runtime.groups import group_index, replica_group
from shardkit.runtime.variables import group_module, stack_states

REPLICAS, MODELS = 8, 2
SHARDS = REPLICAS // MODELS
STEPS, BATCH, LR, ALPHA = 25, 32, 0.2, 0.5
PLAN = sk.Plan(mesh=sk.Mesh(dp=REPLICAS), replicas=sk.ReplicaGrouping(REPLICAS, group_size=SHARDS))


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def batch(step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(step)
    x = torch.from_numpy(rng.standard_normal((size, 6)))
    logits = x @ torch.from_numpy(np.random.default_rng(42).standard_normal((6, 3)))
    return x, logits.argmax(1)


def losses(own: torch.Tensor, other: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, task) loss: cross entropy plus ALPHA * KL(other's predictions || own)."""
    task = F.cross_entropy(own, y)
    distill = F.kl_div(F.log_softmax(own, 1), F.softmax(other.detach(), 1), reduction="batchmean")
    return task + ALPHA * distill, task


def work(ctx) -> dict:
    """One replica of model A or B (runs in every process)."""
    grouping = ctx.plan.replicas
    me = group_index(grouping)  # 0: model A, 1: model B
    shard = replica_group(grouping).index
    host_state = stack_states([build_model(1).state_dict(), build_model(2).state_dict()])  # [2, ...] per name
    grouped = group_module(build_model(0), grouping, host_state)
    model = grouped.module
    task_losses = []
    for step in range(STEPS):
        x, y = batch(step)
        rows = slice(shard * BATCH // SHARDS, (shard + 1) * BATCH // SHARDS)
        logits = model(x[rows])
        both = all_gather(logits, grouping, stack=True, transpose=True)  # [A's, B's] for this shard
        loss, task = losses(logits, both[1 - me], y[rows])
        loss.backward()
        grouped.average_gradients()
        sgd_step(model.parameters(), LR)
        task_losses.append(task.item())
    x, y = batch(10_000, 256)
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).double().mean().item()
    return {"task_losses": task_losses, "accuracy": accuracy, "states": grouped.read_state(check=True)}


def simulate() -> dict[str, torch.Tensor]:
    """Both models trained together on the whole batch in one process."""
    models = [build_model(1), build_model(2)]
    for step in range(STEPS):
        x, y = batch(step)
        logits = [m(x) for m in models]
        for i, model in enumerate(models):
            losses(logits[i], logits[1 - i], y)[0].backward()
            sgd_step(model.parameters(), LR)
    return {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models])
            for name, _ in models[0].named_parameters()}


def main(world=None) -> dict:
    results = sk.launch(work, PLAN, world=world)
    reference = simulate()
    states = results[0]["states"]  # {name: [2, ...]}: model A, model B
    summary = {
        "max_weight_diff": max((states[n] - t).abs().max().item() for n, t in reference.items()),
        "accuracy": [results[0]["accuracy"], results[-1]["accuracy"]],
        "task_losses": [results[0]["task_losses"], results[-1]["task_losses"]],
    }
    print(f"co-distillation: accuracy A {summary['accuracy'][0]:.3f}, B {summary['accuracy'][1]:.3f}; "
          f"max |diff| vs single process {summary['max_weight_diff']:.2e}")
    return summary


if __name__ == "__main__":
    main()
