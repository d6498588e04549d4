"""Context parallel on a model: its attention becomes ring attention over the ``sp`` group.

What to replace and how is the model family's knowledge (:mod:`shardkit.families`: the
reference GPT's ``attention_fn``, transformers' ``AttentionInterface``); this module adds
what every family shares: a forward pre-hook giving the tokens' global positions, and the
checks of the forward's arguments. The kernel is :mod:`shardkit.runtime.ring_attention`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from ..families import Family, family_of
from ..plan import PlanError, UsageError
from ..planner.sequence_checks import CausalConv, context_parallel_checks
from .halo import install_halo_convolutions
from .ring_attention import RingAttention, sequence_positions

_GROUP_ATTR = "_shardkit_sp_group"
_INPUT_NAMES = ("idx", "input_ids", "inputs_embeds")  # forward arguments whose dim 1 is the sequence


def _as_group(group_or_mesh) -> dist.ProcessGroup:
    if isinstance(group_or_mesh, dist.ProcessGroup):
        return group_or_mesh
    if hasattr(group_or_mesh, "get_group") and getattr(group_or_mesh, "ndim", 1) == 1:
        return group_or_mesh.get_group()
    raise UsageError(f"enable_context_parallel needs the sp process group or a 1-D DeviceMesh such as "
                     f"mesh['sp'], got {type(group_or_mesh).__name__}")


def _position_hook(name: str, index: int, group: dist.ProcessGroup, family: Family):
    """A forward pre-hook giving ``name`` (the ``index``-th forward argument) global positions."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)

    def fill_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        family.check_context_parallel_inputs(module, kwargs)
        if len(args) <= index and kwargs.get(name) is None:
            tokens = args[0] if args else next(kwargs[k] for k in _INPUT_NAMES if kwargs.get(k) is not None)
            positions = sequence_positions(tokens.shape[1] * size, rank, size, device=tokens.device)
            kwargs[name] = positions.unsqueeze(0) if name == "position_ids" else positions
        return args, kwargs

    return fill_positions


def enable_context_parallel(model: nn.Module, group_or_mesh, convs: Sequence[CausalConv] | None = None) -> nn.Module:
    """Make ``model`` attend over a sequence split across the sp group (in place; returns it).

    - shardkit's reference GPT (any module whose attentions call ``self.attention_fn(q, k, v)``):
      every ``attention_fn`` becomes :class:`RingAttention`;
    - a HuggingFace model: attention runs through transformers' ``AttentionInterface`` under the
      name ``"shardkit_ring"``, which also stops transformers from building a local causal mask.

    A forward pre-hook passes the global positions of this rank's tokens (``positions`` or
    ``position_ids``) unless the caller gives them, so position embeddings and rotary are right.
    Inputs and targets must be split with :func:`shard_sequence` (the same for both).

    Any other op that mixes positions is found on the meta device first
    (:func:`~shardkit.planner.sequence_checks.context_parallel_checks`): causal 1-D convolutions
    get the positions before each chunk from the neighbouring ranks (:mod:`shardkit.runtime.halo`),
    anything else is refused (:class:`PlanError`). ``convs``: the causal convolutions
    ``sk.validate`` already found (``sk.shard`` passes them), so nothing is traced again.

    >>> model = enable_context_parallel(GPT(tiny_config()), ctx.mesh["sp"])   # doctest: +SKIP
    >>> logits = model(shard_sequence(idx, sp_rank, sp_size))                  # doctest: +SKIP
    """
    group = _as_group(group_or_mesh)
    if getattr(model, _GROUP_ATTR, None) is not None:
        return model
    family = family_of(model)
    if convs is None:
        convs, problems = context_parallel_checks(model, family, dist.get_world_size(group))
    else:
        problems = family.context_parallel_problems(model)
    if problems:
        raise PlanError(problems)
    name = family.position_argument(model)
    params = list(inspect.signature(model.forward).parameters)
    if name not in params:
        raise PlanError(f"{type(model).__name__}.forward takes no {name!r}, so it cannot be given the global "
                        f"positions of its sequence chunk under context parallel")
    family.install_attention(model, RingAttention(group))
    install_halo_convolutions(model, convs or (), group)
    model.register_forward_pre_hook(_position_hook(name, params.index(name), group, family), with_kwargs=True)
    setattr(model, _GROUP_ATTR, group)
    return model


__all__ = ["enable_context_parallel"]
