"""Tensor parallel from replica groups alone: split weights as grouped variables, gather outputs.

Eight replicas act as TP=2 x DP=4. The hidden layer's weight is split in two by rows; the
halves are a grouped variable with ``ReplicaGrouping(8, group_size=DP, stride=TP)``: group
``t`` = {t, t+2, t+4, t+6} holds half ``t``, and gradients are averaged within it (over
the data-parallel copies of that half). The transposed grouping {0, 1}, {2, 3}, ... pairs
the two halves of one model copy: the hidden activations are gathered over it, then a small
head (one group of all replicas) finishes. Verified against the unsplit model trained in one
process on the whole batch.

    python examples/tp_grouped_dp.py
"""

from __future__ import annotations

import numpy as np
import torch
from _common import sgd_step
from torch.nn import functional as F

import shardkit as sk
from shardkit.runtime.collectives import all_gather, average_gradients
from shardkit.runtime.groups import group_index
from shardkit.runtime.variables import variable

TP, DP = 2, 4
D_IN, HIDDEN, D_OUT = 6, 16, 2
STEPS, BATCH, LR = 20, 32, 0.1
WEIGHTS = sk.ReplicaGrouping(TP * DP, group_size=DP, stride=TP)  # group t holds shard t
PLAN = sk.Plan(mesh=sk.Mesh(dp=TP * DP), replicas=WEIGHTS)


def initial_weights() -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    return {name: torch.from_numpy(rng.standard_normal(shape) * scale) for name, shape, scale in (
        ("w1", (HIDDEN, D_IN), 0.4), ("b1", (HIDDEN,), 0.1), ("w2", (D_OUT, HIDDEN), 0.3), ("b2", (D_OUT,), 0.1))}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(100 + step)
    x = torch.from_numpy(rng.standard_normal((BATCH, D_IN)))
    return x, torch.stack([torch.sin(x[:, 0] + x[:, 1]), x[:, 2] * x[:, 3]], 1)


def forward(w1, b1, w2, b2, x, gather=None) -> torch.Tensor:
    hidden = torch.tanh(x @ w1.T + b1)
    if gather is not None:
        hidden = gather(hidden)
    return hidden @ w2.T + b2


def work(ctx) -> dict:
    """One half of one model copy (runs in every process)."""
    full = initial_weights()
    # host data [TP, ...]: row block t of w1 and b1 for group t
    w1 = variable(full["w1"].reshape(TP, HIDDEN // TP, D_IN), WEIGHTS, requires_grad=True, name="w1")
    b1 = variable(full["b1"].reshape(TP, HIDDEN // TP), WEIGHTS, requires_grad=True, name="b1")
    w2 = variable(full["w2"], requires_grad=True, name="w2")  # one group: every replica holds the whole head
    b2 = variable(full["b2"], requires_grad=True, name="b2")
    split, shared = [w1.value, b1.value], [w2.value, b2.value]
    copy = group_index(WEIGHTS.transpose())  # which model copy (data-parallel index) this replica belongs to
    rows = slice(copy * BATCH // DP, (copy + 1) * BATCH // DP)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        out = forward(*split, *shared, x[rows], gather=lambda h: all_gather(h, WEIGHTS, dim=1, transpose=True))
        loss = F.mse_loss(out, y[rows])
        loss.backward()
        average_gradients(split, WEIGHTS)  # over the DP copies of each half
        average_gradients(shared)  # over all replicas (the two halves of a copy hold equal head gradients)
        sgd_step(split + shared, LR)
        losses.append(loss.item())
    weights = {"w1": w1.read(check=True).reshape(HIDDEN, D_IN), "b1": b1.read(check=True).reshape(HIDDEN),
               "w2": w2.read(check=True), "b2": b2.read(check=True)}
    return {"losses": losses, "weights": weights}


def simulate() -> tuple[dict[str, torch.Tensor], list[float]]:
    """The unsplit model on the whole batch in one process."""
    weights = {k: v.clone().requires_grad_() for k, v in initial_weights().items()}
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(forward(weights["w1"], weights["b1"], weights["w2"], weights["b2"], x), y)
        loss.backward()
        sgd_step(weights.values(), LR)
        losses.append(loss.item())
    return {k: v.detach() for k, v in weights.items()}, losses


def main(world=None) -> dict:
    results = sk.launch(work, PLAN, world=world)
    reference, reference_losses = simulate()
    weights = results[0]["weights"]
    mean_losses = np.mean([r["losses"] for r in results[::TP]], axis=0)  # one replica per model copy
    summary = {
        "max_weight_diff": max((weights[k] - v).abs().max().item() for k, v in reference.items()),
        "max_loss_diff": float(np.abs(mean_losses - np.array(reference_losses)).max()),
        "first_and_last_loss": (reference_losses[0], reference_losses[-1]),
    }
    print(f"TP={TP} x DP={DP} from replica groups: max |diff| vs one process: weights "
          f"{summary['max_weight_diff']:.2e}, loss {summary['max_loss_diff']:.2e}")
    return summary


if __name__ == "__main__":
    main()
