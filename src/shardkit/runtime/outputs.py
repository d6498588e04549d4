"""What leaves a sharded model is a plain, finished tensor.

torch's tensor-parallel styles return outputs that are not plain tensors: a row-parallel layer's
output is an ``AsyncCollectiveTensor`` (funcol's all-reduce still in flight; torch waits only when
an op reads it, and pickling it, as ``sk.launch`` does with a job's result, reads the buffer before
the reduction has finished: numbers off by 0.5 on a small MLP, not every time), and a layer with
``use_local_output=False`` returns a DTensor. torch has no hook that makes a module's outputs
plain, so :func:`plain_outputs` is installed on every sharded model (``runtime.parallelize``): each
tensor in the output, inside tuples, lists, dicts and transformers' ``ModelOutput``, becomes an
ordinary ``torch.Tensor`` equal to one process's output, and gradients still flow through it.

>>> import torch
>>> plain(torch.ones(2)).tolist()
[1.0, 1.0]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor


class _Finished(torch.autograd.Function):
    """An ``AsyncCollectiveTensor`` waited on, as a plain tensor; the gradient passes unchanged.
    (``AsyncCollectiveTensor.wait()`` returns its inner tensor, which autograd does not know.)"""

    @staticmethod
    def forward(ctx: Any, tensor: AsyncCollectiveTensor) -> torch.Tensor:
        return tensor.trigger_wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def plain(value: Any) -> Any:
    """``value`` with every DTensor made whole (``full_tensor()``: the one-process tensor, a collective
    every rank of its mesh makes) and every ``AsyncCollectiveTensor`` waited on, in tuples (named too),
    lists, dicts and ``ModelOutput``; other values as they are. Differentiable."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, AsyncCollectiveTensor):
        return _Finished.apply(value) if value.requires_grad else value.trigger_wait()
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(plain(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):  # transformers' ModelOutput too: set by key, its attributes follow
        for key, item in list(value.items()):
            value[key] = plain(item)
    return value


def plain_outputs(module: nn.Module, inputs: Any, output: Any) -> Any:
    """A forward hook: the module's output made :func:`plain`."""
    return plain(output)


def install_plain_outputs(module: nn.Module) -> None:
    """Make every output of ``module`` plain (once, however often it is called)."""
    if not getattr(module, "_sk_plain_outputs", False):
        module.register_forward_hook(plain_outputs)
        module._sk_plain_outputs = True


__all__ = ["install_plain_outputs", "plain", "plain_outputs"]
