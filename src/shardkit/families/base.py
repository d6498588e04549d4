"""The protocol every model family implements, and the records it answers with.

A *family* is what shardkit knows about a kind of model that torch cannot tell from the
module tree alone: the pieces a pipeline may be cut between and how a stage runs, what the
model takes as input and how long a sequence may be, where its attention is and how many
heads it has, what must change in a module for a tensor-parallel shard to compute its part,
and how its attention becomes ring attention. The base class answers for "any module"
(nothing known); each family module overrides what it knows.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..plan import PlanError

_POSITION_EMBEDDING = re.compile(r"pos|wpe", re.IGNORECASE)
#: A causal attention kernel ``fn(q, k, v, scale=None) -> out`` over ``[batch, heads, seq, head_dim]``
#: tensors (k/v may have fewer heads: grouped-query attention); context parallel passes ring attention.
AttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class WeightNames:
    """How a checkpoint names a model's tensors, when not as the model does.

    ``to_model(key)``: the model's name for a checkpoint's tensor; ``to_checkpoint(name)``: the
    name a checkpoint written the way the model's library writes it gives a model's tensor.
    ``merged``: patterns of checkpoint tensors the library merges into one tensor on loading in a
    way shardkit cannot read box by box. ``stacked``: ``(target, sources)`` of the experts the
    library stacks on loading (``(".experts.gate_up_proj", (".experts.*.w1.weight",
    ".experts.*.w3.weight"))``: one tensor per expert ``*`` in the files, each expert's sources
    concatenated on their dim 0), read box by box by :mod:`shardkit.io.stacked`.

    >>> WeightNames().to_model("lm_head.weight"), WeightNames().merged
    ('lm_head.weight', ())
    """

    to_model: Callable[[str], str] = field(default=str)
    to_checkpoint: Callable[[str], str] = field(default=str)
    merged: tuple[str, ...] = ()
    stacked: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class Unit:
    """A run of modules that always stay together in one pipeline stage; ``block`` marks repeated layers."""

    name: str
    modules: tuple[str, ...]
    block: bool = True


@dataclass(frozen=True, eq=False)
class ModelLayout:
    """A model cut into pipeline units in execution order.

    ``family`` runs a stage (:meth:`Family.stage_forward`); ``shared`` modules hold no
    parameters and are kept on every stage (rotary embeddings); ``example_inputs`` is one
    sample the family knows the model takes (``None`` when unknown).
    """

    family: Family
    units: tuple[Unit, ...]
    shared: tuple[str, ...] = ()
    example_inputs: tuple | None = None

    @property
    def kind(self) -> str:
        return self.family.name

    def index(self, name: str) -> int | None:
        for i, unit in enumerate(self.units):
            if unit.name == name or unit.modules[0] == name:
                return i
        return None


@dataclass(frozen=True)
class Attention:
    """One attention module: its dotted name and head counts (``kv_heads < heads``: grouped-query)."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class AttributeChange:
    """A module attribute a tensor-parallel shard must see with its local value (e.g. a head count)."""

    module: str
    attribute: str
    local: Any


class Family:
    """What shardkit knows about "any module": nothing beyond the module tree.

    Subclasses recognise their models in :meth:`matches` and override what they know.
    """

    name = "module"

    def matches(self, model: nn.Module) -> bool:
        return True

    # -- inputs ------------------------------------------------------------------------------------
    def example_inputs(self, model: nn.Module, seq_len: int | None = None) -> tuple | None:
        """One sample the model takes (meta-friendly shapes), or ``None`` when unknown."""
        return None

    def takes_token_ids(self, model: nn.Module) -> bool:
        """Whether the first input holds token ids (an integer tensor ``[batch, seq]``): the model's
        first parameterised module is an ``nn.Embedding``."""
        first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
        return isinstance(first, nn.Embedding)

    def max_positions(self, model: nn.Module) -> int | None:
        """The longest sequence the model accepts (the rows of an embedding named like a position
        embedding: ``pos_embed``, ``position_embeddings``, GPT-2's ``wpe``), or ``None`` when unknown."""
        return next((m.num_embeddings for name, m in model.named_modules() if isinstance(m, nn.Embedding)
                     and _POSITION_EMBEDDING.search(name.rpartition(".")[2])), None)

    def vocab_size(self, model: nn.Module) -> int | None:
        """The vocabulary of a model taking token ids: the rows of its first ``nn.Embedding``."""
        return next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)

    # -- checkpoints ---------------------------------------------------------------------------------
    def weight_names(self, model: nn.Module) -> WeightNames:
        """How the model's checkpoints name its tensors (by default: as the model does)."""
        return WeightNames()

    # -- initialisation ------------------------------------------------------------------------------
    def init_module(self, model: nn.Module, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters and buffers as the model's constructor would: torch's
        ``reset_parameters`` where the module has one, then the model's ``_init_weights(module)``
        (transformers' convention, which the reference GPT follows too; it also recomputes
        transformers' rotary frequencies)."""
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        init = getattr(model, "_init_weights", None)
        if callable(init):
            init(module)

    # -- pipelines --------------------------------------------------------------------------------
    def pipeline_layout(self, model: nn.Module, example_inputs: tuple | None = None) -> ModelLayout | None:
        """The model cut into pipeline units, or ``None`` when this family cannot pipeline it."""
        return None

    def stage_forward(self, model: nn.Module, units: Sequence[Unit], *args: Any) -> Any:
        raise PlanError(f"the {self.name!r} family has no per-stage forward; pipelines need a family that cuts "
                        f"the model into units")

    def stage_decode(self, model: nn.Module, units: Sequence[Unit], x: torch.Tensor, cache: Any,
                     past: int) -> torch.Tensor:
        """:meth:`stage_forward` for decoding: ``x`` holds the tokens (first stage) or hidden states
        after the ``past`` positions already in ``cache`` (the model's KV cache; this stage's layers
        read and extend their own entries)."""
        raise PlanError(f"the {self.name!r} family cannot decode one pipeline stage with a KV cache; sk.generate "
                        f"runs pipelines of the reference GPT and transformers causal LMs")

    # -- tensor parallel --------------------------------------------------------------------------
    def attentions(self, model: nn.Module) -> list[Attention]:
        """Every attention module with its head counts (on the meta device is fine)."""
        return []

    def tensor_parallel_changes(self, model: nn.Module, split: set[str], size: int) -> list[AttributeChange]:
        """Attributes to set on a tensor-parallel shard of ``size`` ranks, given the column-parallel
        modules whose output stays split (``split``: dotted names; each rank computes its own heads
        there): e.g. a head count the forward reshapes with."""
        return []

    def fused_projections(self, model: nn.Module) -> dict[str, int]:
        """Projections this family knows compute several outputs side by side, split as whole
        parts (``{module name: parts}``), e.g. GPT-2's ``c_attn`` = ``[q | k | v]``."""
        return {}

    # -- context parallel ---------------------------------------------------------------------------
    def context_parallel_problems(self, model: nn.Module) -> list[str]:
        """Why ring attention cannot replace this model's attention (empty: it can)."""
        if not {"positions", "position_ids"} & set(inspect.signature(model.forward).parameters):
            return [f"{type(model).__name__}.forward takes neither 'positions' nor 'position_ids', so it cannot be "
                    f"given the global positions of its sequence chunk under context parallel ('sp')"]
        return [f"{type(model).__name__} is not a model family shardkit knows attention in (the reference GPT "
                f"or a transformers model), so context parallel ('sp') cannot replace its attention with ring "
                f"attention; remove the 'sp' axis"]

    def position_argument(self, model: nn.Module) -> str | None:
        """The forward argument taking the tokens' global positions (context parallel gives its own)."""
        return None

    def install_attention(self, model: nn.Module, attention: AttentionFn) -> None:
        """Make every attention of ``model`` call ``attention`` (context parallel's ring attention)."""
        raise PlanError(self.context_parallel_problems(model))

    def check_context_parallel_inputs(self, model: nn.Module, kwargs: dict) -> None:
        """Refuse forward arguments that are wrong when the sequence is split (HF ``labels=``, padding),
        in place: a forward taking ``use_cache`` gets ``use_cache=False`` (a KV cache of one chunk's
        keys serves no later step, and a model's cached path may differ from its plain one), as does a
        forward taking any keyword whose config has ``use_cache`` (transformers passes it on)."""
        parameters = inspect.signature(model.forward).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        if "use_cache" in parameters or (takes_any and hasattr(getattr(model, "config", None), "use_cache")):
            if kwargs.get("use_cache"):
                raise PlanError(f"{type(model).__name__} was called with use_cache=True under context parallel; each "
                                f"rank holds chunks of the sequence, so a KV cache would hold only those: call it "
                                f"with use_cache=False (the default under context parallel)")
            kwargs["use_cache"] = False


__all__ = ["Attention", "AttentionFn", "AttributeChange", "Family", "ModelLayout", "Unit", "WeightNames"]
