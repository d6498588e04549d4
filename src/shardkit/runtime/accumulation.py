"""Gradient accumulation: one step's batch run as ``k`` micro-batches, gradients reduced once.

``model.step(inputs, targets, loss_fn, accumulate=k)`` cuts this rank's batch into ``k``
equal micro-batches along dim 0 and runs them one after another (a ``k``-th of the
activations at a time), each loss scaled by ``1/k``, so the gradients summed in ``.grad``
equal one step on the whole batch. Data-parallel gradient reduction is switched off with
torch's own switch, ``set_requires_gradient_sync`` (FSDP2's ``fully_shard`` and
``replicate``; DDP's composable ``replicate``: its ``no_sync``), for every micro-batch but
the last, whose backward reduces the accumulated sum once; so are the sums tensor parallel leaves
``Partial`` with no data axis (:mod:`shardkit.runtime.partial_grads`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed._composable.replicate import DDP
from torch.distributed.fsdp import FSDPModule

from ..plan import UsageError


def micro_batches(inputs: Any, targets: Any, accumulate: int, multiple_of: int = 1) -> list[tuple[Any, Any]]:
    """``accumulate`` equal ``(inputs, targets)`` slices along dim 0 (tensors, or tuples/lists of tensors).

    Each slice's size must be a multiple of ``multiple_of`` (a pipeline's micro-batch count);
    :class:`UsageError` naming ``accumulate``, the batch and the values that work otherwise.

    >>> x, y = torch.arange(8).reshape(4, 2), torch.arange(4)
    >>> [(a.tolist(), b.tolist()) for a, b in micro_batches(x, y, 2)]
    [([[0, 1], [2, 3]], [0, 1]), ([[4, 5], [6, 7]], [2, 3])]
    >>> micro_batches(x, y, 3)
    Traceback (most recent call last):
    ...
    shardkit.plan.errors.UsageError: accumulate=3 does not split this rank's batch of 4 samples into equal micro-batches; values that do: 1, 2, 4
    """
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise UsageError(f"accumulate must be a positive integer (the number of micro-batches per step; 1: none), "
                         f"got {accumulate!r}")
    if accumulate == 1:
        return [(inputs, targets)]
    size = _batch_size(inputs, "inputs")
    if _batch_size(targets, "targets") != size:
        raise UsageError(f"accumulate={accumulate}: inputs hold {size} samples but targets "
                         f"{_batch_size(targets, 'targets')}; both are cut along dim 0")
    valid = [k for k in range(1, size + 1) if size % k == 0 and (size // k) % multiple_of == 0]
    if accumulate not in valid:
        need = f" of a multiple of the pipeline's {multiple_of} microbatches" if multiple_of > 1 else ""
        raise UsageError(f"accumulate={accumulate} does not split this rank's batch of {size} samples into equal "
                         f"micro-batches{need}; values that do: {', '.join(map(str, valid)) or 'none'}")
    return list(zip(_split(inputs, accumulate), _split(targets, accumulate)))


def _batch_size(value: Any, what: str) -> int:
    first = value[0] if isinstance(value, (tuple, list)) and value else value
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise UsageError(f"accumulate > 1 cuts {what} along dim 0, so {what} must be a tensor or a tuple/list of "
                         f"tensors with a batch dim, got {type(value).__name__}")
    return int(first.shape[0])


def _split(value: Any, k: int) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [type(value)(parts) for parts in zip(*(_split(v, k) for v in value))]
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        raise UsageError(f"accumulate > 1 cuts every input along dim 0, got a {type(value).__name__}")
    return list(value.chunk(k))


@contextmanager
def gradient_sync_deferred(model: nn.Module) -> Iterator[None]:
    """Data-parallel gradient reduction off inside (a no-op without a data-parallel wrapper), back on after,
    also on an error."""
    wrapped = isinstance(model, (FSDPModule, DDP))
    if wrapped:
        model.set_requires_gradient_sync(False)
    partial = getattr(model, "_sk_partial_grads", None)  # tensor parallel's pending sums (partial_grads.py)
    if partial is not None:
        partial.deferred = True
    try:
        yield
    finally:
        if wrapped:
            model.set_requires_gradient_sync(True)
        if partial is not None:
            partial.deferred = False


__all__ = ["gradient_sync_deferred", "micro_batches"]
