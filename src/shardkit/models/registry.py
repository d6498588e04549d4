"""Models for the command line: registered names, or any builder given as ``package.module:function``.

A registered name carries its builder, tensor-parallel rules, loss and input sizes. A builder
path is treated as a causal LM over token ids (``[batch, seq] -> logits [batch, seq, vocab]``,
or an object with ``.logits``); its vocabulary and positions are read from the model.

>>> entry = MODELS["gpt-tiny"]
>>> inputs, targets = entry.sample_batch(batch_size=2)
>>> inputs.shape, entry.meta_only
(torch.Size([2, 32]), False)
>>> model_entry("shardkit.models.gpt:build_tiny_gpt").on_meta().embed.num_embeddings
256
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..plan import LayoutMap, PlanError, UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

#: How a model is named by its builder rather than by a registered name.
BUILDER_PATH_FORM = "package.module:function"


@dataclass(frozen=True)
class ModelEntry:
    """One model: ``build()`` makes it (seeded), ``rules`` split it over ``tp``.

    A model given by its builder path has no rules, and ``vocab`` / ``seq_len`` are ``None``:
    :func:`shardkit.families.token_sizes` reads them from the model.
    """

    build: Callable[[], nn.Module]
    rules: LayoutMap | None
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    vocab: int | None
    seq_len: int | None
    meta_only: bool = False  # too large to build for real; explain / validate only
    description: str = ""

    def rules_for(self, mesh) -> LayoutMap | None:
        """The built-in rules, or ``None`` (nothing split by layout) when ``mesh`` has none of their axes:
        ``--mesh fsdp=2`` then means plain FSDP rather than an error about a missing ``tp`` axis. A model
        given by its builder path has the rules of transformers' own tensor-parallel plan when it is a
        transformers model that has one (:meth:`LayoutMap.from_hf`), else none; read only when ``tp``
        splits something (a ``tp`` axis of size 1 needs no rules)."""
        from ..plan.hf_plan import hf_tp_plan

        rules = self.rules
        if rules is None and mesh.size_of("tp") != 1:
            model = self.on_meta()
            rules = LayoutMap.from_hf(model) if hf_tp_plan(model) else None
        return rules if rules is not None and rules.axes() & set(mesh.names) else None

    def on_meta(self) -> nn.Module:
        """``build()`` on the meta device (no memory); :class:`UsageError` saying why when it cannot be."""
        import torch
        from torch import nn

        try:
            with torch.device("meta"):
                model = self.build()
        except Exception as exc:  # the builder is user code: any failure is reported, not a traceback
            raise UsageError(f"cannot be built on the meta device, where shardkit checks plans without memory: "
                             f"{type(exc).__name__}: {exc}; the builder must create the module without "
                             f"reading or loading tensor values") from None
        if not isinstance(model, nn.Module):
            raise UsageError(f"returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    def sample_batch(self, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Random token ids ``(inputs, targets)``, each ``[batch_size, seq_len]``; targets are inputs shifted by one."""
        import torch

        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (batch_size, self.seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]


@dataclass(frozen=True)
class _Registration:
    """A registered model by the names of its builder, rules and loss in one module of this package."""

    module: str
    build: str
    rules: str
    loss_fn: str
    vocab: int
    seq_len: int
    meta_only: bool = False
    description: str = ""

    def entry(self) -> ModelEntry:
        module = importlib.import_module(f"{__package__}.{self.module}")
        return ModelEntry(getattr(module, self.build), getattr(module, self.rules), getattr(module, self.loss_fn),
                          self.vocab, self.seq_len, self.meta_only, self.description)


class Registry(Mapping[str, ModelEntry]):
    """The registered models by name. Names and :meth:`buildable` need no import; an entry imports its
    module (torch, transformers) when it is first looked up, so the command line checks its flags
    without them."""

    def __init__(self, registrations: dict[str, _Registration]):
        self._registrations = registrations
        self._entries: dict[str, ModelEntry] = {}

    def __getitem__(self, name: str) -> ModelEntry:
        if name not in self._entries:
            self._entries[name] = self._registrations[name].entry()
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._registrations

    def __iter__(self) -> Iterator[str]:
        return iter(self._registrations)

    def __len__(self) -> int:
        return len(self._registrations)

    def buildable(self) -> list[str]:
        """The names of the models that can be built for real (not meta-only), sorted."""
        return sorted(name for name, r in self._registrations.items() if not r.meta_only)


MODELS = Registry({
    "gpt-tiny": _Registration("gpt", "build_tiny_gpt", "GPT_RULES", "gpt_loss", 256, 32,
                              description="reference GPT: 2 layers, dim 64, 4 heads"),
    "gpt-small": _Registration("gpt", "build_small_gpt", "GPT_RULES", "gpt_loss", 256, 128,
                               description="reference GPT: 4 layers, dim 128, 4 heads"),
    "gpt-moe": _Registration("gpt", "build_tiny_gpt_moe", "GPT_RULES", "gpt_loss", 256, 32,
                             description="reference GPT with 4 experts (top 2) per block: 2 layers, dim 64, 4 heads"),
    "llama-tiny": _Registration("hf", "build_tiny_llama", "LLAMA_RULES", "hf_loss", 256, 32,
                                description="transformers Llama: 2 layers, hidden 64, 4 heads, 2 kv heads"),
    "gpt2-tiny": _Registration("hf", "build_tiny_gpt2", "GPT2_RULES", "hf_loss", 256, 32,
                               description="transformers GPT-2: 2 layers, n_embd 64, 4 heads"),
    "llama-70b": _Registration("hf", "build_llama_70b", "LLAMA_RULES", "hf_loss", 128256, 8192, meta_only=True,
                               description="Llama-3 70B shapes on the meta device (explain / validate only)"),
})


def is_builder_path(name: str) -> bool:
    """Whether ``name`` names a model by its builder (``package.module:function``), not by registration."""
    return ":" in name


def model_entry(name: str) -> ModelEntry:
    """The registered model ``name``, or the model a ``package.module:function`` builder makes.

    :class:`PlanError` listing the valid names for an unknown name; :class:`UsageError` for a
    builder path that does not lead to a zero-argument callable.
    """
    if is_builder_path(name):
        from .hf import hf_loss

        return ModelEntry(import_builder(name), None, hf_loss, None, None, description=f"built by {name}")
    try:
        return MODELS[name]
    except KeyError:
        raise PlanError(f"unknown model {name!r}; valid: {sorted(MODELS)} or {BUILDER_PATH_FORM}") from None


def import_builder(path: str) -> Callable[[], Any]:
    """The callable at ``package.module:function``; :class:`UsageError` naming what is missing.

    The function may be an attribute path (``module:Class.build``). It must take no arguments.
    """
    module_name, _, attributes = path.partition(":")
    if not module_name or not attributes:
        raise UsageError(f"is not of the form {BUILDER_PATH_FORM}")
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or any error the module raises while importing
        raise UsageError(f"module {module_name!r} cannot be imported: {type(exc).__name__}: {exc}") from None
    for attribute in attributes.split("."):
        if not hasattr(found, attribute):
            raise UsageError(f"module {module_name!r} has no attribute {attributes!r}")
        found = getattr(found, attribute)
    if not callable(found):
        raise UsageError(f"is not callable (type {type(found).__name__}); give a function that takes no "
                         f"arguments and returns an nn.Module")
    required = _required_parameters(found)
    if required:
        raise UsageError(f"needs arguments ({', '.join(required)}); give a function that takes none, "
                         f"e.g. one that calls it with your sizes")
    return found


def _required_parameters(function: Callable) -> list[str]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: calling them will tell
        return []
    return [p.name for p in parameters
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


