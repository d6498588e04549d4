"""Build models on the meta device: shapes and FLOPs without memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def meta_model(build: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """``build(*args, **kwargs)`` with every tensor on the meta device (no memory used).

    >>> m = meta_model(torch.nn.Linear, 70_000, 70_000)
    >>> m.weight.device.type, tuple(m.weight.shape)
    ('meta', (70000, 70000))
    """
    with torch.device("meta"):
        return build(*args, **kwargs)
