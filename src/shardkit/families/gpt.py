"""The reference GPT (:mod:`shardkit.models.gpt`) and models built like it.

Recognised by its modules: ``embed``, ``pos_embed``, a ``layers`` ModuleList, ``norm_f``,
``lm_head``. Attention modules call ``self.attention_fn(q, k, v)`` and reshape heads with
``-1``, so a tensor-parallel rank runs its local heads with no change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .base import Attention, AttentionFn, Family, ModelLayout, Unit


class GPTFamily(Family):
    name = "gpt"

    def matches(self, model: nn.Module) -> bool:
        return all(isinstance(getattr(model, a, None), nn.Module) for a in ("embed", "pos_embed", "norm_f", "lm_head")) \
            and isinstance(getattr(model, "layers", None), nn.ModuleList)

    def max_positions(self, model: nn.Module) -> int | None:
        return model.pos_embed.num_embeddings

    def vocab_size(self, model: nn.Module) -> int | None:
        return model.embed.num_embeddings

    def takes_token_ids(self, model: nn.Module) -> bool:
        return True

    def example_inputs(self, model: nn.Module, seq_len: int | None = None) -> tuple:
        return (torch.zeros(1, seq_len or self.max_positions(model), dtype=torch.long),)

    def pipeline_layout(self, model: nn.Module, example_inputs: tuple | None = None) -> ModelLayout:
        units = [Unit("embed", ("embed", "pos_embed"), block=False)]
        units += [Unit(f"layers.{i}", (f"layers.{i}",)) for i in range(len(model.layers))]
        units += [Unit("norm_f", ("norm_f",), block=False), Unit("lm_head", ("lm_head",), block=False)]
        return ModelLayout(self, tuple(units), (), example_inputs or self.example_inputs(model))

    def stage_forward(self, model: nn.Module, units: Sequence[Unit], x: torch.Tensor) -> torch.Tensor:
        """The forward restricted to ``units`` (the first stage takes token ids)."""
        return self.stage_decode(model, units, x, None, 0)

    def stage_decode(self, model: nn.Module, units: Sequence[Unit], x: torch.Tensor, cache: Any,
                     past: int) -> torch.Tensor:
        for unit in units:
            if unit.name == "embed":
                positions = torch.arange(past, past + x.shape[1], device=x.device)
                x = model.embed(x) + model.pos_embed(positions)
            elif unit.block and cache is not None:
                x = model.get_submodule(unit.name)(x, cache.layers[int(unit.name.rpartition(".")[2])])
            else:
                x = model.get_submodule(unit.name)(x)
        return x

    def attentions(self, model: nn.Module) -> list[Attention]:
        found = []
        for name, module in model.named_modules():
            head_dim = getattr(module, "head_dim", None)
            q_proj, k_proj = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
            if hasattr(module, "attention_fn") and isinstance(head_dim, int) and isinstance(q_proj, nn.Linear) \
                    and isinstance(k_proj, nn.Linear):
                found.append(Attention(name, q_proj.out_features // head_dim, k_proj.out_features // head_dim,
                                       head_dim))
        return found

    def context_parallel_problems(self, model: nn.Module) -> list[str]:
        if not any(hasattr(m, "attention_fn") for m in model.modules()):
            return [f"{type(model).__name__} has no attention to make context-parallel (modules with an "
                    f"attention_fn(q, k, v) attribute); remove the 'sp' axis"]
        return []

    def position_argument(self, model: nn.Module) -> str:
        return "positions"

    def install_attention(self, model: nn.Module, attention: AttentionFn) -> None:
        for module in model.modules():
            if hasattr(module, "attention_fn"):
                module.attention_fn = attention


__all__ = ["GPTFamily"]
