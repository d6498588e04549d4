"""Named models for the command line: builder, tensor-parallel rules, loss, input sizes.

>>> entry = MODELS["gpt-tiny"]
>>> inputs, targets = entry.sample_batch(batch_size=2)
>>> inputs.shape, entry.meta_only
(torch.Size([2, 32]), False)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..plan import LayoutMap, PlanError
from . import gpt, hf


@dataclass(frozen=True)
class ModelEntry:
    """One named model: ``build()`` makes it (seeded), ``rules`` split it over ``tp``."""

    build: Callable[[], nn.Module]
    rules: LayoutMap
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    vocab: int
    seq_len: int
    meta_only: bool = False  # too large to build for real; explain / validate only
    description: str = ""

    def rules_for(self, mesh) -> LayoutMap | None:
        """The built-in rules, or ``None`` (nothing split by layout) when ``mesh`` has none of their axes:
        ``--mesh fsdp=2`` then means plain FSDP rather than an error about a missing ``tp`` axis."""
        return self.rules if self.rules.axes() & set(mesh.names) else None

    def sample_batch(self, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Random token ids ``(inputs, targets)``, each ``[batch_size, seq_len]``; targets are inputs shifted by one."""
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (batch_size, self.seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]


MODELS: dict[str, ModelEntry] = {
    "gpt-tiny": ModelEntry(gpt.build_tiny_gpt, gpt.GPT_RULES, gpt.gpt_loss, 256, 32,
                           description="reference GPT: 2 layers, dim 64, 4 heads"),
    "gpt-small": ModelEntry(gpt.build_small_gpt, gpt.GPT_RULES, gpt.gpt_loss, 256, 128,
                            description="reference GPT: 4 layers, dim 128, 4 heads"),
    "llama-tiny": ModelEntry(hf.build_tiny_llama, hf.LLAMA_RULES, hf.hf_loss, 256, 32,
                             description="transformers Llama: 2 layers, hidden 64, 4 heads, 2 kv heads"),
    "gpt2-tiny": ModelEntry(hf.build_tiny_gpt2, hf.GPT2_RULES, hf.hf_loss, 256, 32,
                            description="transformers GPT-2: 2 layers, n_embd 64, 4 heads"),
    "llama-70b": ModelEntry(hf.build_llama_70b, hf.LLAMA_RULES, hf.hf_loss, 128256, 8192, meta_only=True,
                            description="Llama-3 70B shapes on the meta device (explain / validate only)"),
}


def model_entry(name: str) -> ModelEntry:
    """The registered model ``name``; :class:`PlanError` listing the valid names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise PlanError(f"unknown model {name!r}; valid: {sorted(MODELS)}") from None
