"""Module types whose parameters torch's tensor-parallel styles and FSDP need told apart.

>>> is_norm(nn.LayerNorm(4)), is_norm(nn.Linear(4, 4))
(True, False)
>>> linear_dims(nn.Linear(3, 5))
(0, 1)
"""

from __future__ import annotations

import torch
from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a Linear whose weight is stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a transformers ``Conv1D``: ``y = x W^T + b`` in some weight order."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """``(output dim, input dim)`` of a linear module's weight: ``(0, 1)`` for Linear, ``(1, 0)`` for Conv1D."""
    return (1, 0) if is_conv1d(module) else (0, 1)


def is_norm(module: nn.Module) -> bool:
    """LayerNorm / RMSNorm, torch's or a model's own (``LlamaRMSNorm``): normalises over the hidden dim."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def guess_input(module: nn.Module, seq_len: int = 16) -> tuple | None:
    """An example input for a model whose family does not say: token ids when its first
    parameterised leaf is an Embedding, a feature vector when it is a Linear, else ``None``."""
    for leaf in module.modules():
        if isinstance(leaf, nn.Embedding):
            return (torch.zeros(1, seq_len, dtype=torch.long),)
        if isinstance(leaf, nn.Linear):
            return (torch.zeros(1, leaf.in_features, dtype=leaf.weight.dtype),)
    return None


__all__ = ["guess_input", "is_conv1d", "is_linear", "is_norm", "linear_dims"]
