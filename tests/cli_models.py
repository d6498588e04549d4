"""Builders for ``--model cli_models:...`` in the CLI tests.

``tests/`` is on the path of the test process, and so of the worker processes it spawns, so
``cli_models:build_tiny_lm`` imports everywhere, as a user's ``mypkg.models:build`` would.
"""

from __future__ import annotations

import torch
from torch import nn

NOT_CALLABLE = 3


class TinyLM(nn.Module):
    """A causal LM without attention: each position sees its token and its position only.

    ``model(idx [B, T]) -> logits [B, T, vocab]``; ``positions=None`` leaves out the position
    embedding, so nothing in the model says how long a sequence may be.
    """

    def __init__(self, vocab: int = 256, positions: int | None = 32, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos_embed = nn.Embedding(positions, dim) if positions is not None else None
        self.up_proj = nn.Linear(dim, 4 * dim)
        self.down_proj = nn.Linear(4 * dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(idx.shape[1], device=idx.device))
        x = x + self.down_proj(torch.relu(self.up_proj(x)))
        return self.lm_head(x)


class HeadOnlyLM(nn.Module):
    """Embeddings straight into the head: no two linear layers, so no tensor-parallel rules to infer."""

    def __init__(self, vocab: int = 256, positions: int = 32, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos_embed = nn.Embedding(positions, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(idx) + self.pos_embed(torch.arange(idx.shape[1], device=idx.device)))


def build_head_only_lm() -> HeadOnlyLM:
    torch.manual_seed(0)
    return HeadOnlyLM()


def build_tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def build_lm_without_positions() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(positions=None)


def build_lm_with_100_tokens() -> TinyLM:
    return TinyLM(vocab=100)


def build_reading_weights() -> TinyLM:
    """Builds on the CPU, not on the meta device: it reads a weight's value."""
    model = TinyLM()
    model.scale = float(model.embed.weight.abs().max().item())
    return model


def build_not_a_module() -> dict:
    return {"embed": TinyLM()}


def build_sized(width: int) -> TinyLM:
    return TinyLM(dim=width)
