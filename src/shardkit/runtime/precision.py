"""One training step in one process under a plan's mixed precision, as torch's FSDP2 runs it.

``FSDPOptions(param_dtype=..., reduce_dtype=...)`` is FSDP2's ``MixedPrecisionPolicy``: the
parameters stay in float32 for the optimizer; each forward and backward computes with a
``param_dtype`` copy of them (floating-point inputs are cast to ``param_dtype`` too, buffers
are not); the gradients are reduced in ``reduce_dtype`` (default: ``param_dtype``) and land
in the float32 parameters' ``.grad``. :func:`mixed_precision_backward` does the same on the
whole batch in one process, so ``sk.verify`` can compare a mixed-precision sharded run with a
reference in the same precision.

>>> import torch
>>> model = torch.nn.Linear(4, 1)
>>> policy = Precision.of(FSDPOptions(param_dtype="bfloat16"))
>>> loss = mixed_precision_backward(model, torch.ones(2, 4), None, lambda out, _: out.mean(), policy)
>>> loss.dtype, model.weight.dtype, model.weight.grad.dtype
(torch.bfloat16, torch.float32, torch.float32)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..families.on_meta import swapped
from ..plan import FSDPOptions
from ..plan.dtypes import torch_dtype


@dataclass(frozen=True)
class Precision:
    """The dtypes of a mixed-precision policy; ``None`` keeps the parameter's own dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, options: FSDPOptions) -> Precision:
        """The policy of a plan's ``fsdp`` options (names such as ``"bfloat16"`` -> torch dtypes)."""
        param, reduce = options.param_dtype, options.reduce_dtype
        return cls(torch_dtype(param) if param else None, torch_dtype(reduce) if reduce else None)

    def compute_dtype(self, param: torch.Tensor) -> torch.dtype:
        return self.param_dtype or param.dtype

    def gradient_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype gradients are reduced in: ``reduce_dtype``, else the compute dtype (FSDP2's default)."""
        return self.reduce_dtype or self.compute_dtype(param)


def _cast_input(value: Any, dtype: torch.dtype | None) -> Any:
    """FSDP2's ``cast_forward_inputs``: a floating-point input tensor is cast to ``param_dtype``."""
    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def mixed_precision_backward(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                             precision: Precision) -> torch.Tensor:
    """Forward and backward of ``model`` on ``inputs`` under ``precision``; returns the loss.

    The parameters of ``model`` are not changed; each gets its gradient, computed in the
    compute dtype, rounded to the reduce dtype and stored in the parameter's dtype in
    ``.grad`` (replacing what was there, as after ``zero_grad()``).
    """
    params = dict(model.named_parameters())
    compute = {name: p.detach().to(precision.compute_dtype(p)).requires_grad_(p.requires_grad)
               for name, p in params.items()}
    with swapped(model, compute):  # by identity: torch's functional_call mishandles a module used twice
        loss = loss_fn(model(_cast_input(inputs, precision.param_dtype)), targets)
    loss.backward()
    for name, param in params.items():
        grad = compute[name].grad
        param.grad = None if grad is None else grad.to(precision.gradient_dtype(param)).to(param.dtype)
    return loss
