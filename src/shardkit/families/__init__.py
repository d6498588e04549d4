"""What shardkit knows about model families, one module per family.

A family (:class:`~shardkit.families.base.Family`) answers what torch cannot tell from the
module tree: pipeline units and how a stage runs, inputs and positions, attention heads,
what a tensor-parallel shard must see changed, how attention becomes ring attention.
:func:`family_of` picks the first family that recognises a model; adding a family is one
new module and one entry in :data:`FAMILIES`.

>>> import torch.nn as nn
>>> family_of(nn.Sequential(nn.Linear(2, 2))).name
'chain'
"""

from __future__ import annotations

from torch import nn

from .base import Attention, AttentionFn, AttributeChange, Family, ModelLayout, Unit
from .chain import ChainFamily
from .gpt import GPTFamily
from .hf import GPT2Family, HFFamily
from .hf_pipeline import HFCausalLMFamily

#: Families in the order they are tried; the last recognises every module.
FAMILIES: tuple[Family, ...] = (GPTFamily(), GPT2Family(), HFCausalLMFamily(), HFFamily(), ChainFamily())
CHAIN = FAMILIES[-1]


def family_of(model: nn.Module) -> Family:
    """The family that recognises ``model`` (a chain, the most general, when no other does)."""
    return next(f for f in FAMILIES if f.matches(model))


def token_sizes(model: nn.Module) -> tuple[int | None, int | None]:
    """``(vocabulary, positions)`` of a model taking token ids, by its family; ``None`` where unknown.

    >>> from shardkit.models.gpt import build_tiny_gpt
    >>> token_sizes(build_tiny_gpt())
    (256, 32)
    """
    family = family_of(model)
    return family.vocab_size(model), family.max_positions(model)


def model_layout(model: nn.Module, example_inputs: tuple | None = None) -> ModelLayout:
    """``model`` cut into pipeline units in execution order: by its family, else as a chain.

    >>> layout = model_layout(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    >>> layout.kind, [u.name for u in layout.units]
    ('chain', ['0', '1', '2'])
    """
    layout = family_of(model).pipeline_layout(model, example_inputs)
    return layout if layout is not None else CHAIN.pipeline_layout(model, example_inputs)


__all__ = ["FAMILIES", "Attention", "AttentionFn", "AttributeChange", "Family", "ModelLayout", "Unit", "family_of",
           "model_layout", "token_sizes"]
