"""Reference models and ready-made layout rule sets.

Each name is imported from its module on first use: the command line reads the registry's
names without importing torch.

>>> from shardkit.models import MODELS, GPT_RULES
>>> sorted(MODELS)
['gpt-moe', 'gpt-small', 'gpt-tiny', 'gpt2-tiny', 'llama-70b', 'llama-tiny']
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "gpt": ("GPT", "GPT_RULES", "GPTConfig", "build_small_gpt", "build_tiny_gpt", "gpt_loss", "small_config",
            "tiny_config"),
    "hf": ("GPT2_RULES", "LLAMA_RULES", "build_llama_70b", "build_tiny_gpt2", "build_tiny_llama", "hf_loss",
           "llama_70b_config"),
    "registry": ("MODELS", "ModelEntry", "model_entry"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
