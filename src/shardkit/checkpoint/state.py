"""A sharded model's and optimizer's state in and out of torch's distributed checkpoint (DCP).

Stands on torch: ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict`` give the model's parameters and the optimizer's state under the
parameters' names as DTensors (tensor parallel, FSDP2) or tensors, flattened per parameter
(``flatten_optimizer_state_dict``, so pipeline stages holding different parameters never
write the same key); ``dcp.save`` has each rank write only its shards, and ``dcp.load``
reshards into whatever plan the model now has.

What DCP cannot know: a packed projection under tensor parallel is *permuted* rank-major
(:mod:`shardkit.runtime.tensor_parallel`), so its DTensor is a tensor whose rows are in the
saving plan's order. It is saved as it is, and the permutation is recorded (:func:`permutations`);
a load into a model permuted the same way reads it as any tensor, and a load into one
permuted differently (or not at all) reads that tensor whole, one at a time, and puts the
rows in place (:func:`load_state`). Memory stays at the shards plus one such tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..runtime.pieces import pieces

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
#: The two parts of a checkpoint's state, as DCP keys' first component.
MODEL, OPTIMIZER = "model", "optimizer"


def _optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    return [] if optimizer is None else [optimizer]


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, dict[str, Any]]:
    """``{"model": {name: tensor}, "optimizer": {"state.name.exp_avg": tensor, ...}}`` on this rank.

    The optimizer state of a parameter tied across pipeline stages is under its first name on
    every stage holding a copy, as torch keys it in one process (the model state of a tied
    model holds every name already), so a checkpoint reads back whatever the plan."""
    model_state, optimizer_state = get_state_dict(model, _optimizers(optimizer), options=OPTIONS)
    optimizer_state = _renamed(optimizer_state, getattr(model, "tied_copies", {})) if optimizer is not None else {}
    return {MODEL: model_state, OPTIMIZER: optimizer_state}


def _renamed(optimizer_state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``optimizer_state`` (flattened: ``state.<name>.<key>``, ``param_groups.<name>.<key>``) with
    each parameter in ``names`` under its new name."""
    if not names:
        return optimizer_state
    renamed = {}
    for key, value in optimizer_state.items():
        part, _, rest = key.partition(".")
        for old, new in names.items():
            if rest.startswith(old + "."):
                key = f"{part}.{new}{rest[len(old):]}"
                break
        renamed[key] = value
    return renamed


def permutations(model: nn.Module) -> dict[str, list]:
    """Every rank's permutations, JSON-able: ``{parameter name: [dim, [row order]]}`` (a collective)."""
    local = {name: [dim, perm.tolist()] for name, (dim, perm) in getattr(model, "_sk_permutations", {}).items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    every: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(every, local)
    return {name: value for found in every for name, value in found.items()}


def save_state(checkpoint_id: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write the model's and optimizer's state with DCP (every rank its own shards; a collective)."""
    dcp.save(state_dicts(model, optimizer), checkpoint_id=str(checkpoint_id))


def _parameter_of(key: str) -> str:
    """The parameter a flattened state key belongs to: ``state.w.exp_avg`` -> ``w``."""
    if key.startswith("state."):
        return key[len("state."):].rpartition(".")[0]
    return key


def load_state(checkpoint_id: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               saved: dict[str, list]) -> None:
    """Read a checkpoint written by :func:`save_state` into ``model`` (and ``optimizer``), resharding.

    ``saved``: the permutations recorded when it was written (:func:`permutations`).
    """
    state = state_dicts(model, optimizer)
    here = {name: (dim, perm) for name, (dim, perm) in getattr(model, "_sk_permutations", {}).items()}
    moved: dict[str, tuple[str, str, torch.Tensor]] = {}
    for part, values in state.items():
        for key, value in list(values.items()):
            name = _parameter_of(key) if part == OPTIMIZER else key
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if _order(saved.get(name)) != _order(here.get(name)):
                moved[f"{part}.{key}"] = (part, key, values.pop(key))
    dcp.load(state, checkpoint_id=str(checkpoint_id))
    for full_key in _everyones(sorted(moved)):
        _load_reordered(checkpoint_id, full_key, moved.get(full_key), saved, here)
    for part, key, target in moved.values():  # filled in place; back for set_state_dict
        state[part][key] = target
    copies = {first: name for name, first in getattr(model, "tied_copies", {}).items()}
    set_state_dict(model, _optimizers(optimizer), model_state_dict=state[MODEL],
                   optim_state_dict=_renamed(state[OPTIMIZER], copies), options=OPTIONS)


def load_model_tensors(checkpoint_id: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill plain full-size ``tensors`` (``{parameter name: tensor}``) from a checkpoint's model
    state, in this process alone (DCP reads only those tensors' bytes)."""
    import warnings

    with warnings.catch_warnings():  # DCP warns that it runs without a process group: intended here
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        dcp.load({MODEL: tensors}, checkpoint_id=str(checkpoint_id), no_dist=True)


def _order(permutation: Any) -> tuple | None:
    if permutation is None:
        return None
    dim, perm = permutation
    return (dim, tuple(perm.tolist() if isinstance(perm, torch.Tensor) else perm))


def _everyones(keys: list[str]) -> list[str]:
    """The union of every rank's ``keys``, in one order: each needs one collective ``dcp.load``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return keys
    every: list[list[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(every, keys)
    return sorted({k for found in every for k in found})


def _load_reordered(checkpoint_id: str | Path, full_key: str, entry: tuple[str, str, torch.Tensor] | None,
                    saved: dict[str, list], here: dict[str, tuple[int, torch.Tensor]]) -> None:
    """Read one tensor whose row order differs between the checkpoint and this model: whole,
    then put its rows in canonical order and copy this rank's pieces (every rank calls it)."""
    if entry is None:
        dcp.load({}, checkpoint_id=str(checkpoint_id))
        return
    part, key, target = entry
    whole = torch.empty(target.shape, dtype=target.dtype)
    dcp.load({part: {key: whole}}, checkpoint_id=str(checkpoint_id))
    name = _parameter_of(key) if part == OPTIMIZER else key
    if saved.get(name) is not None:
        dim, perm = saved[name]
        whole = whole.index_select(dim, torch.argsort(torch.tensor(perm)))
    with torch.no_grad():
        for piece in pieces(target, here.get(name)):
            piece.local.copy_(whole[piece.box].to(piece.local.device))


__all__ = ["MODEL", "OPTIMIZER", "load_model_tensors", "load_state", "permutations", "save_state", "state_dicts"]
