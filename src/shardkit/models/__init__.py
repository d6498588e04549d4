"""Reference models and ready-made layout rule sets.

>>> from shardkit.models import MODELS, GPT_RULES
>>> sorted(MODELS)
['gpt-small', 'gpt-tiny', 'gpt2-tiny', 'llama-70b', 'llama-tiny']
"""

from .gpt import (
    GPT,
    GPT_RULES,
    GPTConfig,
    build_small_gpt,
    build_tiny_gpt,
    gpt_loss,
    small_config,
    tiny_config,
)
from .hf import (
    GPT2_RULES,
    LLAMA_RULES,
    build_llama_70b,
    build_tiny_gpt2,
    build_tiny_llama,
    hf_loss,
    llama_70b_config,
)
from .registry import MODELS, ModelEntry, model_entry

__all__ = [
    "GPT", "GPT2_RULES", "GPTConfig", "GPT_RULES", "LLAMA_RULES", "MODELS", "ModelEntry",
    "build_llama_70b", "build_small_gpt", "build_tiny_gpt", "build_tiny_gpt2", "build_tiny_llama", "gpt_loss",
    "hf_loss", "llama_70b_config", "model_entry", "small_config", "tiny_config",
]
