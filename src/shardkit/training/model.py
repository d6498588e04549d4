"""The model of a training job by its name: a registered model, a builder ``package.module:function``, a
transformers ``config.json``, or a model folder holding one (written by ``save_pretrained`` or
``sk.export_hf``: the model is built from its config; ``init_from`` reads its weights).

Every process resolves the name again (a job sends names, not modules); errors name the ``--model`` flag.

>>> model_from_flag("gpt-tiny").seq_len
32
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.registry import BUILDER_PATH_FORM, MODELS, ModelEntry, is_builder_path, model_entry
from ..plan import UsageError
from ..plan.files import mapping, read_file

if TYPE_CHECKING:
    from torch import nn

#: The file a model folder describes its model with (transformers' ``save_pretrained``, ``sk.export_hf``).
CONFIG_FILE = "config.json"


#: The registered models a job can train (the others have shapes only, for explain and the planner).
TRAINABLE = tuple(MODELS.buildable())


def check_model_name(text: str, valid: tuple[str, ...] | list[str] = TRAINABLE) -> str:
    """``text`` if it names a model among ``valid``, a builder path, a config file or a folder; else a
    :class:`UsageError` with the valid names.

    >>> check_model_name("gpt-huge")
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.UsageError: unknown model 'gpt-huge'; valid: gpt-moe, gpt-small, gpt-tiny, gpt2-tiny, llama-tiny, or your builder as package.module:function, a transformers config.json, or a model folder holding one
    """
    if is_builder_path(text) or text in valid or text.endswith(".json") or is_model_folder(text):
        return text
    if text in MODELS:
        raise UsageError(f"{text!r} has shapes only (meta device): use it with 'shardkit explain'; valid here: "
                         f"{', '.join(valid)}")
    raise UsageError(f"unknown model {text!r}; valid: {', '.join(valid)}, or your builder as {BUILDER_PATH_FORM}, "
                     f"a transformers {CONFIG_FILE}, or a model folder holding one")


def is_model_folder(name: str | os.PathLike) -> bool:
    """Whether ``name`` is a folder (a model folder needs its ``config.json``, checked when it is read)."""
    return Path(name).is_dir()


def model_from_flag(name: str) -> ModelEntry:
    """The model ``--model name`` means; a builder path is imported here, errors name the flag.

    The working directory is searched last, so ``--model mymodel:build`` finds ``./mymodel.py``
    as ``python -m`` would, without local files shadowing installed modules.
    """
    if is_builder_path(name) and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    with _naming_model_flag(name):
        if is_model_folder(name):
            return hf_folder_entry(name)
        return hf_config_entry(name) if name.endswith(".json") else model_entry(name)


def hf_folder_entry(folder: str | os.PathLike) -> ModelEntry:
    """A transformers causal LM built from the ``config.json`` of a model folder (no weights read here)."""
    config = Path(folder) / CONFIG_FILE
    if not config.is_file():
        raise UsageError(f"folder {str(folder)!r} has no {CONFIG_FILE} to build the model from (a model folder is "
                         f"one written by transformers' save_pretrained or sk.export_hf); give a registered model, "
                         f"a builder as package.module:function, or a config file")
    return hf_config_entry(str(config))


def hf_config_entry(file: str) -> ModelEntry:
    """A transformers causal LM from its ``config.json`` (no weights: ``AutoModelForCausalLM.from_config``,
    seeded with 0); its vocabulary and positions are read from the config."""
    from transformers import AutoConfig

    from ..models.hf import hf_loss

    data = mapping(read_file(file, "transformers config"), f"transformers config {file!r}",
                   '{"model_type": "llama", "vocab_size": 256, ...}')
    kind = data.get("model_type")
    try:
        config = AutoConfig.for_model(kind, **{k: v for k, v in data.items() if k != "model_type"})
    except (ValueError, TypeError) as exc:
        raise UsageError(f"transformers config {file!r}: model_type {kind!r} is not one transformers knows "
                         f"({exc})") from None
    return ModelEntry(partial(_build_causal_lm, config), None, hf_loss, None, None,
                      description=f"transformers {kind} from {file}")


def _build_causal_lm(config) -> nn.Module:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def meta_model_from_flag(name: str, entry: ModelEntry) -> nn.Module:
    """The model built on the meta device; errors name the flag."""
    with _naming_model_flag(name):
        return entry.on_meta()


def model_builder(name: str, build: str) -> Callable[[], nn.Module]:
    """The model's builder as ``build`` says: ``'meta'`` (only each process's shards are allocated) or
    ``'full'`` (every process builds the whole model first)."""
    from ..planner.meta import meta_model

    entry = model_from_flag(name)
    return partial(meta_model, entry.build) if build == "meta" else entry.build


@contextmanager
def _naming_model_flag(name: str) -> Iterator[None]:
    try:
        yield
    except UsageError as exc:
        raise UsageError(f"--model {name!r}: {exc}") from None


__all__ = ["CONFIG_FILE", "TRAINABLE", "check_model_name", "hf_config_entry", "hf_folder_entry", "is_model_folder", "meta_model_from_flag",
           "model_builder", "model_from_flag"]
