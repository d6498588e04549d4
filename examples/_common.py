"""Shared by the replica-group examples."""

import torch


def sgd_step(params, lr: float) -> None:
    """Plain SGD, ``p -= lr * grad``, then clear the gradients.

    (torch.optim.SGD would do; its first use imports torch._dynamo, seconds in every process.)
    """
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
            p.grad = None
