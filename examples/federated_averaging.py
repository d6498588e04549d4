"""Federated averaging: clients train locally for k steps, then their models are averaged.

Eight replicas form four clients of two (``ReplicaGrouping(8, group_size=2)``). Each client
trains on its own data distribution, data-parallel inside the client (gradients averaged
within the group); every ``LOCAL_STEPS`` steps the parameters are averaged across clients,
over the transposed grouping (one replica of every client per group). The result must
equal a single-process simulation of the same algorithm.

    python examples/federated_averaging.py
"""

from __future__ import annotations

import numpy as np
import torch
from _common import sgd_step
from torch import nn

import shardkit as sk
from shardkit.runtime.collectives import all_reduce
from shardkit.runtime.groups import group_index, replica_group
from shardkit.runtime.variables import group_module

REPLICAS, CLIENT_SIZE = 8, 2
CLIENTS = REPLICAS // CLIENT_SIZE
ROUNDS, LOCAL_STEPS, BATCH, LR = 3, 4, 16, 0.1
PLAN = sk.Plan(mesh=sk.Mesh(dp=REPLICAS), replicas=sk.ReplicaGrouping(REPLICAS, group_size=CLIENT_SIZE))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def client_batch(client: int, round_: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-identically distributed clients: each has its own input shift."""
    rng = np.random.default_rng([client, round_, step])
    x = torch.from_numpy(rng.standard_normal((BATCH, 3)) + np.array([client - 1.5, 0.5 * client, 0.0]))
    y = torch.tanh(x @ torch.tensor([[0.7], [-0.4], [0.2]], dtype=x.dtype)) + 0.05 * torch.from_numpy(
        rng.standard_normal((BATCH, 1)))
    return x, y


def local_step(model: nn.Module, x, y, after_backward=None) -> float:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if after_backward is not None:
        after_backward()
    sgd_step(model.parameters(), LR)
    return loss.item()


def work(ctx) -> dict:
    """One replica of one client (runs in every process)."""
    grouping = ctx.plan.replicas
    client = group_index(grouping)
    half = replica_group(grouping).index  # which half of the client's batch this replica takes
    grouped = group_module(build_model(), grouping)
    model = grouped.module
    losses, spread = [], []
    for round_ in range(ROUNDS):
        for step in range(LOCAL_STEPS):
            x, y = client_batch(client, round_, step)
            rows = slice(half * BATCH // CLIENT_SIZE, (half + 1) * BATCH // CLIENT_SIZE)
            losses.append(local_step(model, x[rows], y[rows], grouped.average_gradients))
        spread.append(grouped.read_state(check=True)["0.weight"].std(0).max().item())  # clients differ here
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(all_reduce(p.detach(), grouping, "mean", transpose=True))  # average across clients
    return {"losses": losses, "spread_before_averaging": spread, "states": grouped.read_state(check=True)}


def simulate() -> dict[str, torch.Tensor]:
    """FedAvg in one process: each client trains on its whole batch, then the models are averaged."""
    global_model = build_model()
    for round_ in range(ROUNDS):
        clients = []
        for client in range(CLIENTS):
            model = build_model()
            model.load_state_dict(global_model.state_dict())
            for step in range(LOCAL_STEPS):
                local_step(model, *client_batch(client, round_, step))
            clients.append(model.state_dict())
        global_model.load_state_dict({k: torch.stack([c[k] for c in clients]).mean(0) for k in clients[0]})
    return {k: v.clone() for k, v in global_model.state_dict().items()}


def main(world=None) -> dict:
    results = sk.launch(work, PLAN, world=world)
    reference = simulate()
    states = results[0]["states"]  # [CLIENTS, ...]: one model per client, equal after the last averaging
    summary = {
        "max_weight_diff": max((states[n] - t).abs().max().item() for n, t in reference.items()),
        "clients_equal_after_averaging": all(bool((s == s[0]).all()) for s in states.values()),
        "spread_before_averaging": results[0]["spread_before_averaging"],
        "losses": [r["losses"] for r in results],
    }
    print(f"FedAvg, {CLIENTS} clients x {CLIENT_SIZE} replicas, {ROUNDS} rounds of {LOCAL_STEPS} local steps: "
          f"max |diff| vs single-process simulation {summary['max_weight_diff']:.2e}")
    return summary


if __name__ == "__main__":
    main()
