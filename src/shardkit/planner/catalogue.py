"""Published model shapes, no weights: configs the planner analyses by name.

Each entry builds a fresh config: a transformers config (``GPT2Config``, ``LlamaConfig``), or
:class:`~shardkit.models.gpt.GPTConfig` for shardkit's reference GPT. transformers is imported
only when an entry that needs it is built.

- ``gpt-tiny``, ``gpt-small``: the reference GPT of tests and demos.
- ``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``: OpenAI's GPT-2 (124M to 1.5B).
- ``llama3-8b``, ``llama3-70b``, ``llama3-405b``: Meta's Llama 3 (grouped-query attention with 8
  key/value heads, vocabulary 128256, RoPE theta 500000, untied output). ``max_position_embeddings``
  is 8192, the pre-training length (the 405B's 128K context came from a later extension).
- ``gpt3-175b``: GPT-3 (Brown et al. 2020): 96 layers, d 12288, 96 heads, 2048 positions.
- ``megatron-1.7b`` ... ``megatron-1t``: the GPT shapes of Megatron-LM's weak-scaling table
  (:data:`MEGATRON_TABLE1`): vocabulary 51200, 2048 positions, tied embeddings.

>>> catalogue_config("llama3-8b").num_key_value_heads
8
>>> MEGATRON_TABLE1[-1].name, MEGATRON_TABLE1[-1].gpus
('megatron-1t', 3072)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..plan import UsageError


@dataclass(frozen=True)
class MegatronRow:
    """One row of Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM" (SC'21): a GPT shape, the parallel configuration it ran with on
    A100 GPUs (``dp = gpus / (tp * pp)``), the global batch in sequences of 2048 tokens, and the
    throughput achieved per GPU (``percent_peak`` of the A100's 312 TFLOP/s)."""

    name: str
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    percent_peak: float


#: Table 1 of Narayanan et al., SC'21 (arXiv 2104.04473), as published: parameters (billions),
#: attention heads, hidden size, layers, tensor- and pipeline-parallel sizes, GPUs, batch size,
#: achieved teraFLOP/s per GPU, percentage of theoretical peak. Data-parallel size is
#: GPUs / (tensor x pipeline). Aggregate petaFLOP/s in the paper: 4.4, 8.8, 18.2, 34.6, 70.8,
#: 143.8, 227.1, 297.4, 410.2, 502.0 (= GPUs x per-GPU figure, checked).
MEGATRON_TABLE1: tuple[MegatronRow, ...] = tuple(
    MegatronRow(name, params_b, heads, hidden, layers, tp, pp, gpus // (tp * pp), gpus, batch, tflops, peak)
    for name, params_b, heads, hidden, layers, tp, pp, gpus, batch, tflops, peak in (
        ("megatron-1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
        ("megatron-3.6b", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
        ("megatron-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
        ("megatron-18b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
        ("megatron-39b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
        ("megatron-76b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
        ("megatron-145b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
        ("megatron-310b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
        ("megatron-530b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
        ("megatron-1t", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
    ))

#: Megatron's sequence length and (padded) vocabulary for every Table 1 model.
MEGATRON_SEQ_LEN, MEGATRON_VOCAB = 2048, 51200


def _gpt2(**sizes: Any) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import GPT2Config

        return GPT2Config(**sizes)
    return build


def _llama3(hidden: int, intermediate: int, heads: int, layers: int) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                           num_key_value_heads=8, num_hidden_layers=layers, vocab_size=128256,
                           max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                           tie_word_embeddings=False)
    return build


def _reference_gpt(size: str) -> Callable[[], Any]:
    def build() -> Any:
        from ..models import gpt

        return getattr(gpt, f"{size}_config")()
    return build


def _megatron(row: MegatronRow) -> Callable[[], Any]:
    return _gpt2(n_embd=row.hidden, n_layer=row.layers, n_head=row.heads, vocab_size=MEGATRON_VOCAB,
                 n_positions=MEGATRON_SEQ_LEN)


#: Every catalogue name and the function that builds its config.
CATALOGUE: dict[str, Callable[[], Any]] = {
    "gpt-tiny": _reference_gpt("tiny"),
    "gpt-small": _reference_gpt("small"),
    "gpt2": _gpt2(),  # GPT2Config's defaults are the 124M model: n_embd 768, 12 layers, 12 heads
    "gpt2-medium": _gpt2(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": _gpt2(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": _gpt2(n_embd=1600, n_layer=48, n_head=25),
    "llama3-8b": _llama3(4096, 14336, 32, 32),
    "llama3-70b": _llama3(8192, 28672, 64, 80),
    "llama3-405b": _llama3(16384, 53248, 128, 126),
    "gpt3-175b": _gpt2(n_embd=12288, n_layer=96, n_head=96, n_positions=2048, vocab_size=50257),
    **{row.name: _megatron(row) for row in MEGATRON_TABLE1},
}


def catalogue_config(name: str) -> Any:
    """A fresh config of the catalogue model ``name`` (a transformers config, or a
    :class:`~shardkit.models.gpt.GPTConfig`); :class:`UsageError` listing every name when unknown.

    >>> catalogue_config("gpt2").n_embd
    768
    >>> catalogue_config("lama3-8b")
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.UsageError: unknown catalogue model 'lama3-8b' (did you mean 'llama3-8b'?); known: gpt-tiny, gpt-small, gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama3-8b, llama3-70b, llama3-405b, gpt3-175b, megatron-1.7b, megatron-3.6b, megatron-7.5b, megatron-18b, megatron-39b, megatron-76b, megatron-145b, megatron-310b, megatron-530b, megatron-1t
    """
    return CATALOGUE[catalogue_name(name)]()


def catalogue_name(name: Any) -> str:
    """``name``, checked to be a catalogue model's without building its config (which imports
    transformers); :class:`UsageError` listing every name when it is not."""
    if not isinstance(name, str) or name not in CATALOGUE:
        close = difflib.get_close_matches(str(name), list(CATALOGUE), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UsageError(f"unknown catalogue model {name!r}{hint}; known: {', '.join(CATALOGUE)}")
    return name


__all__ = ["CATALOGUE", "MEGATRON_SEQ_LEN", "MEGATRON_TABLE1", "MEGATRON_VOCAB", "MegatronRow",
           "catalogue_config", "catalogue_name"]
