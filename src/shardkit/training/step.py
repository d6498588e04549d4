"""One training step's parts (``sk.train``, ``shardkit train``): the optimizer, the learning-rate schedule,
gradient accumulation, loss scaling, gradient-norm clipping, evaluation on held-out data, and the run's log.

Accumulation and clipping are shardkit's own, pipeline-aware (``model.step(..., accumulate=k)``,
``sk.clip_grad_norm_``); loss scaling (float16) is the sharded model's own ``model.step``
(:mod:`shardkit.runtime.loss_scaling`, across every rank): the step reads ``model.loss_scaler``.

The step keeps its numbers on the device: the loss and the gradient norm are read to the host only where
someone asked for them (a log, an evaluation, a save, the end of the run), and then together in one read
(:class:`HostReads`); a scaled step reads one flag, whether the gradients overflowed, which decides whether
the optimizer steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..io.batch_stream import Batch
from ..observe.metrics import MetricsWriter
from ..runtime.clipping import clip_grad_norm_, grad_norm
from ..runtime.context import Context
from ..runtime.optimizer import optimizer as sk_optimizer

#: Losses held on the device at most, between two reads to the host (then read in one, to bound the memory).
PENDING_MAX = 256


def make_optimizer(model: nn.Module, name: str, lr: float, **settings: object) -> torch.optim.Optimizer:
    """``adamw`` or ``sgd`` over ``model``'s parameters through ``sk.optimizer`` (ZeRO-1's partitioned
    optimizer under ``Plan(zero=1)``); settings given as ``None`` keep torch's defaults.

    >>> make_optimizer(nn.Linear(1, 1), "sgd", 0.1, momentum=None).defaults["momentum"]
    0
    """
    options = {key: value for key, value in settings.items() if value is not None}
    kind = torch.optim.AdamW if name == "adamw" else torch.optim.SGD
    return sk_optimizer(model, kind, lr=lr, **options)


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """The learning rate of 0-based ``step`` as a fraction of the peak: linear warmup over ``warmup``
    steps (the first step already at 1/warmup), then a cosine decay to ``min_ratio`` at the last step.

    >>> [round(lr_factor(s, 6, 2, 0.1), 3) for s in range(6)]
    [0.5, 1.0, 1.0, 0.775, 0.325, 0.1]
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_schedule(optimizer: torch.optim.Optimizer, first: int, steps: int, lr: float, warmup_steps: int | None,
                min_lr: float | None) -> torch.optim.lr_scheduler.LambdaLR | None:
    """torch's ``LambdaLR`` over :func:`lr_factor`, from step ``first`` (a resumed run carries on where it
    stood), or ``None`` for a constant learning rate (no ``warmup_steps``)."""
    if warmup_steps is None or min_lr is None:
        return None
    for group in optimizer.param_groups:
        group["initial_lr"] = lr  # the peak, whatever a loaded optimizer state holds
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(first + s, steps, warmup_steps, min_lr / lr))


def accumulate(model: nn.Module, ctx: Context, batch: Batch, loss_fn: Callable, micro_steps: int) -> torch.Tensor:
    """One step on this rank's part of the global batch in ``micro_steps`` equal parts
    (``model.step(..., accumulate=k)``: gradient sync on the last part only, pipelines too).
    Returns the loss over the whole batch."""
    inputs, targets = ctx.shard_batch(batch.inputs, batch.targets)
    return model.step(inputs, targets, loss_fn, accumulate=micro_steps)


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """The global gradient norm over every shard and pipeline stage (a scalar on the device), clipped to
    ``max_norm`` when given (``sk.clip_grad_norm_``; ``None``: measured only)."""
    return clip_grad_norm_(model, max_norm) if max_norm is not None else grad_norm(model)


def train_step(model: nn.Module, ctx: Context, batch: Batch, loss_fn: Callable, optimizer: torch.optim.Optimizer,
               *, micro_steps: int = 1, max_norm: float | None = None,
               measure_norm: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step on a global batch: forward and backward in ``micro_steps`` parts (under the plan's loss
    scale, float16, the loss scaled and the gradients unscaled by ``model.step``, overflow found over the whole
    world), then clipped to ``max_norm`` (or only measured with ``measure_norm``), then the optimizer step. A step
    that overflowed on some rank is skipped on every rank, neither clipped nor measured (its norm ``None``).
    Returns the loss and the norm (``None`` when neither clipped nor measured) as device scalars: nothing is
    read to the host but, under a loss scale, the overflow flag."""
    loss = accumulate(model, ctx, batch, loss_fn, micro_steps)
    scaler = model.loss_scaler
    if scaler is not None and scaler.last_skipped:
        return loss, None  # every gradient is None on every rank: nothing to clip or step
    norm = clip_grad_norm(model, max_norm) if max_norm is not None or measure_norm else None
    optimizer.step()
    return loss, norm


class HostReads:
    """A run's losses, kept on the device until a number is needed, then read with the step's other
    numbers in one transfer (one sync instead of one per step).

    >>> reads = HostReads()
    >>> reads.add(torch.tensor(2.0)); reads.add(torch.tensor(1.5))
    >>> reads.read(torch.tensor(0.25), None), reads.losses
    ([0.25, None], [2.0, 1.5])
    """

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.pending: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor) -> None:
        """A step's loss (a device scalar); read now only when :data:`PENDING_MAX` are waiting."""
        self.pending.append(loss.detach().float().reshape(()))
        if len(self.pending) >= PENDING_MAX:
            self.read()

    def read(self, *extra: torch.Tensor | None) -> list[float | None]:
        """Every waiting loss and ``extra`` (device scalars, or ``None``) read to the host in one transfer;
        returns ``extra``'s values (the losses go to :attr:`losses`)."""
        present = [t.detach().float().reshape(()) for t in extra if t is not None]
        together = self.pending + present
        if not together:
            return [None] * len(extra)
        values = torch.stack([t.to(together[0].device) for t in together]).tolist()
        self.losses += values[:len(self.pending)]
        self.pending = []
        read = iter(values[len(values) - len(present):])
        return [None if t is None else next(read) for t in extra]

    @property
    def last(self) -> float:
        """The latest loss read."""
        return self.losses[-1]


def evaluate(model: nn.Module, ctx: Context, batches: list, loss_fn: Callable) -> float:
    """The mean loss over held-out global batches (no gradients), averaged over every rank
    (``model.evaluate``: a pipeline runs each batch through its stages)."""

    losses = []
    model.eval()
    with torch.no_grad():
        for batch in batches:
            inputs, targets = ctx.shard_batch(batch.inputs, batch.targets)
            losses.append(model.evaluate(inputs, targets, loss_fn).float().reshape(()))
    model.train()
    return sum(torch.stack(losses).tolist()) / len(batches)  # one read for every batch


class RunLog:
    """Rank 0's metrics (:class:`MetricsWriter`) every ``every`` steps and at the last (nothing without
    ``log_dir``); every rank takes part in gathering memory and communication per rank."""

    def __init__(self, log_dir: str | None, every: int, rank: int):
        self.every = every if log_dir is not None else None
        self.writer = MetricsWriter(log_dir) if log_dir is not None and rank == 0 else None
        self.tokens, self.seconds = 0, 0.0

    def due(self, done: int, steps: int) -> bool:
        return self.every is not None and (done % self.every == 0 or done == steps)

    def step_done(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def write(self, done: int, loss: float, lr: float, norm: float | None, memory: int, comm: tuple[int, int]) -> None:
        """Tokens/s over the steps since the last line; memory (peak) and communication (this step) per rank."""
        mine = (memory, comm[1])
        every = [mine] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(every, mine)
        if self.writer is not None:
            scalars = {"loss": loss, "lr": lr, **({} if norm is None else {"grad_norm": norm}),
                       "tokens_per_s": self.tokens / self.seconds,
                       "memory_bytes": {f"rank{r}": m for r, (m, _) in enumerate(every)},
                       "comm_bytes": {f"rank{r}": c for r, (_, c) in enumerate(every)}}
            self.writer.write(done, scalars)
        self.tokens, self.seconds = 0, 0.0

    def eval(self, done: int, loss: float) -> None:
        if self.writer is not None:
            self.writer.write(done, {"eval": {"loss": loss, "perplexity": math.exp(loss)}})

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()


__all__ = ["PENDING_MAX", "HostReads", "RunLog", "accumulate", "clip_grad_norm", "evaluate", "lr_factor", "lr_schedule",
           "make_optimizer", "train_step"]
