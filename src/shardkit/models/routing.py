"""Router balancing as one process computes it, written so that its sums can run over a whole batch
split across processes.

Two ways a mixture of experts keeps its experts busy:

- an **auxiliary loss** (Switch Transformer, Mixtral, Qwen2-MoE): :func:`load_balancing_loss_func`
  is transformers' formula, ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of (token, slot)
  choices of expert ``e`` (top-k of the softmax, so no gradient) and ``P_e`` its mean router
  probability, both over every layer and token of the batch (padding left out by an attention
  mask). It is nonlinear in the batch's means, so a rank's value over its own tokens is not
  one process's. With a :class:`BatchTotal` current (:func:`batch_total`), the sums run over
  the whole batch: the counts, probability sums and rows are all-reduced (detached), and the
  returned value is the whole batch's on every rank, while its gradient is this rank's share
  ``E * ranks * sum_e f_e * dP_e^rank / rows``: averaged over the data ranks, as data
  parallelism averages gradients, it is one process's gradient exactly (``f`` has none);
- a **bias** (DeepSeek-V3's auxiliary-loss-free balancing): each router adds ``expert_bias`` to
  its scores for the top-k choice only and counts the choices in ``expert_load``; after each
  optimizer step :func:`update_expert_biases` moves every bias by ``rate * sign(mean load -
  load_e)``. A router's ``load_total`` (a :class:`BatchTotal`) sums the load over the whole batch.

In one process nothing is reduced (:data:`ONE_PROCESS`); shardkit's runtime supplies the
all-reduce over the data ranks (:mod:`shardkit.runtime.router_balance`).

>>> import torch
>>> logits = (torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]]),)
>>> round(float(load_balancing_loss_func(logits, 4, top_k=1)), 4)
1.615
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from ..plan import UsageError


@dataclass(frozen=True)
class BatchTotal:
    """How a sum over this process's tokens becomes the sum over the whole batch: ``reduce`` (an
    all-reduce over the data ranks; ``None`` in one process) and ``ranks``, how many data ranks
    average their gradients. ``parts``: micro-batches of the current step (an auxiliary loss over a
    micro-batch is not the whole batch's, so :func:`load_balancing_loss_func` refuses more than one)."""

    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    ranks: int = 1
    parts: int = 1

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.reduce is None else self.reduce(tensor)


#: Nothing to reduce: one process holds the whole batch.
ONE_PROCESS = BatchTotal()
_CURRENT: ContextVar[BatchTotal] = ContextVar("shardkit_batch_total", default=ONE_PROCESS)


@contextmanager
def batch_total(total: BatchTotal) -> Iterator[None]:
    """Make ``total`` the one :func:`load_balancing_loss_func` sums with, inside the block."""
    token = _CURRENT.set(total)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_batch_total() -> BatchTotal:
    """The :class:`BatchTotal` in force (:data:`ONE_PROCESS` outside :func:`batch_total`)."""
    return _CURRENT.get()


def balance_loss(counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, num_experts: int,
                 total: BatchTotal) -> torch.Tensor:
    """``num_experts * sum_e (counts_e / rows) * (probs_e / rows)`` over the whole batch:
    ``counts [E]`` choices per expert, ``probs [E]`` router probabilities summed, ``rows`` the
    tokens (of every layer) they were summed over; see the module docstring for the gradient."""
    if total.reduce is None:
        return torch.sum((counts / rows) * (probs / rows)) * num_experts
    summed = total(torch.cat([counts.detach(), probs.detach(), rows.detach().reshape(1)]).float())
    fraction, whole_rows = summed[:num_experts] / summed[-1], summed[-1]
    value = torch.sum(fraction * (summed[num_experts:-1] / whole_rows)) * num_experts
    share = torch.sum(fraction * probs) * (num_experts * total.ranks) / whole_rows
    return share + (value - share).detach()


def load_balancing_loss_func(gate_logits: tuple[torch.Tensor, ...] | None, num_experts: int | None = None,
                             top_k: int = 2, attention_mask: torch.Tensor | None = None) -> torch.Tensor | int:
    """transformers' Switch/Mixtral load-balancing loss of the router logits of every layer
    (``[tokens, E]`` each), over the batch of the current :class:`BatchTotal` (this process's alone
    in one process: then it is transformers' own function, value for value)."""
    total = current_batch_total()
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    if total.parts > 1:
        raise UsageError(f"a step of {total.parts} micro-batches (accumulate=k): the model's router auxiliary loss "
                         f"(load_balancing_loss_func) is nonlinear in the means over the batch, so each micro-batch's "
                         f"would differ from one step over the whole batch; use accumulate=1")
    assert num_experts is not None
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in gate_logits:
        weights = torch.nn.functional.softmax(logits.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        each = torch.ones(chosen.numel(), device=device) if mask is None else mask.repeat_interleave(top_k)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), each)
        kept = weights.float() if mask is None else weights.float() * mask.unsqueeze(-1)
        probs = probs + kept.sum(dim=0)
        rows = rows + (weights.shape[0] if mask is None else mask.sum())
    return balance_loss(counts, probs, rows, num_experts, total)


class WithAuxLoss(torch.autograd.Function):
    """``out`` unchanged; in backward ``loss`` receives gradient 1, so it joins the backward of whatever
    loss ``out`` feeds (Megatron-Core's ``MoEAuxLossAutoScaler``) without changing the returned value."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def bias_balanced(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The routers of ``model`` balanced by a bias: modules with an ``expert_load`` to sum and an
    ``update_bias()`` to call after each optimizer step."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(getattr(m, "expert_load", None), torch.Tensor) and callable(getattr(m, "update_bias", None))]


def update_expert_biases(model: nn.Module) -> None:
    """After an optimizer step: every bias-balanced router moves its bias by the load of the step
    (summed over the whole batch by its ``load_total``) and starts counting again. ``sk.optimizer``
    calls it after each step; call it yourself after ``optimizer.step()`` with another optimizer."""
    for _, router in bias_balanced(model):
        router.update_bias()


__all__ = ["ONE_PROCESS", "BatchTotal", "WithAuxLoss", "balance_loss", "batch_total",
           "bias_balanced", "current_batch_total", "load_balancing_loss_func", "update_expert_biases"]
