"""Dropout switched off, on both sides of ``sk.verify``.

A sharded run cannot draw one process's random masks: each rank draws its own, for tensors of
other shapes (its part of the batch, its heads), so a model with dropout differs from one process
by the randomness, not by the sharding, and a gradient comparison fails for no fault of the plan.
torch has no switch for "dropout off, everything else as in training" (``eval()`` also changes
batch norms), so :class:`DropoutOff` is one: while it is open, every dropout call (``nn.Dropout``
and its kin, ``F.dropout*``, attention's ``dropout_p``) returns its input unchanged, as in eval
mode, and the calls that would have dropped something are counted, so ``sk.verify`` can say so.

>>> import torch
>>> with DropoutOff() as off:
...     out = torch.nn.Dropout(0.5)(torch.ones(3))
>>> out.tolist(), off.calls
([1.0, 1.0, 1.0], 1)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: Dropouts taking ``(input, p, training)``: the functional API and the ``torch`` ops under it.
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
             torch.dropout_, torch.alpha_dropout_, torch.feature_dropout_, torch.feature_alpha_dropout_}


class DropoutOff(TorchFunctionMode):
    """While open, dropout does nothing; ``calls`` counts the calls that would have dropped values."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
            self.calls += bool(training and p)
            return args[0] if args else kwargs["input"]
        if func is torch.native_dropout:
            p, training = args[1], args[2] if len(args) > 2 else kwargs.get("train")
            self.calls += bool((training is None or training) and p)
            return args[0].clone(), torch.ones_like(args[0], dtype=torch.bool)
        if func is F.scaled_dot_product_attention:
            if len(args) > 4 and args[4]:
                self.calls += 1
                args = (*args[:4], 0.0, *args[5:])
            elif kwargs.get("dropout_p"):
                self.calls += 1
                kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


__all__ = ["DropoutOff"]
