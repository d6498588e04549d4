"""Give a model built on the meta device real weights, allocating only this rank's shards.

``sk.shard`` splits a meta model with torch's own mechanisms (tensor-parallel styles and
``fully_shard`` work on meta tensors), then calls :func:`materialize`: every parameter's local
shard gets real storage (``to_empty``), and each module in turn is initialised on full-size
temporary tensors, by the model's own initialisation (``reset_parameters``, ``_init_weights``)
under a seed derived from the module's name, and this rank copies out its pieces
(:mod:`shardkit.runtime.pieces`) and frees the rest. So:

- a rank holds its shards plus one module's full tensors at a time;
- an initialisation that also writes a child's parameter (GPT-2's attention scales its
  ``c_proj``) is found on meta stand-ins and replayed on that parameter after the child's own,
  as transformers applies ``_init_weights`` children first;
- the full weights are the same whatever the plan (and the same in one process): every module
  is initialised from the same seed, on the same full shapes, in the same order; a tied
  parameter keeps its first module's values (an embedding's, as transformers ties them).

- the full weights are the same whatever the device: each module's temporaries are drawn on
  the CPU (devices.py's ``INIT_DEVICE``, whose generator is the same on every machine) and its
  pieces copied to the device; a GPU's generator gives other numbers from the same seed.

Why not DTensor's random initialisation of sharded tensors: it is offset-based for CUDA's RNG
only; on CPU each rank would draw its own numbers and the weights would depend on the plan.
Buffers built real (``sk.meta_model`` keeps them so) are kept; buffers left on meta (a model
built under ``torch.device("meta")``) are recomputed by the same initialisation, and one it
does not compute is an error naming it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ..families import family_of
from ..io.hf_weights import HFWeights
from ..plan import UsageError
from ..planner.initialisation import reaching_inits, stand_ins
from ..planner.tensor_parallel import aliases
from .devices import INIT_DEVICE
from .pieces import Permutation, pieces


def module_seed(seed: int, name: str) -> int:
    """The seed a module is initialised under: a function of ``seed`` and its dotted name only.

    >>> module_seed(0, "layers.0.attn") == module_seed(0, "layers.0.attn") != module_seed(1, "layers.0.attn")
    True
    """
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") % 2**63


@contextmanager
def _full_size(module: nn.Module, buffers: list[str], device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """While open, ``module`` holds fresh full-size plain tensors for its own parameters and for
    the ``buffers`` named (filled with a marker, to tell whether initialisation wrote them)."""
    saved: list[tuple[dict, str, torch.Tensor]] = []
    fresh: dict[str, torch.Tensor] = {}
    wanted = [(module._parameters, k) for k, v in module._parameters.items() if v is not None]
    wanted += [(module._buffers, k) for k in buffers]
    for slots, key in wanted:
        value = slots[key]
        tensor = torch.empty(value.shape, dtype=value.dtype, device=device)
        tensor.fill_(float("nan") if tensor.is_floating_point() else _unset_int(tensor.dtype))
        saved.append((slots, key, value))
        slots[key] = fresh[key] = tensor
    try:
        yield fresh
    finally:
        for slots, key, value in saved:
            slots[key] = value


def _unset_int(dtype: torch.dtype) -> int | bool:
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _is_unset(tensor: torch.Tensor, chunk: int = 2**16) -> bool:
    """Whether any element still holds the marker (checked in chunks: no full-size mask). A fake
    tensor (``sk.dry_run``) has no values: false, as ``sk.shard``'s check on meta already passed."""
    if is_fake(tensor):
        return False
    for part in tensor.reshape(-1).split(chunk):
        if part.is_floating_point():
            if bool(torch.isnan(part).any()):
                return True
        elif part.dtype != torch.bool and bool((part == _unset_int(part.dtype)).any()):
            return True
    return False


class WeightSource(Protocol):
    """Where a parameter's values come from instead of the model's initialisation (a checkpoint,
    like :class:`shardkit.io.hf_weights.HFWeights`)."""

    def read(self, name: str, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        """The values of box ``box`` of the full parameter (or buffer) ``name``, as ``dtype``."""

    def holds(self, name: str) -> bool:
        """Whether the source has values for ``name`` (buffers are optional; parameters are checked
        before anything is read)."""


def materialize(model: nn.Module, device: torch.device | str = "cpu", *, seed: int = 0,
                source: WeightSource | None = None) -> nn.Module:
    """Allocate ``model``'s meta parameters (their local shards) on ``device`` and give them values.

    Values come from the model's own initialisation under :func:`module_seed`, or, with
    ``source``, from a checkpoint read box by box (only the boxes this rank holds). Buffers
    built on meta are recomputed by the initialisation. In place; returns the model.

    >>> import shardkit as sk
    >>> a = materialize(sk.meta_model(torch.nn.Linear, 4, 3))
    >>> b = materialize(sk.meta_model(torch.nn.Linear, 4, 3))
    >>> bool(torch.equal(a.weight, b.weight)), a.weight.device.type
    (True, 'cpu')
    """
    device = torch.device(device)
    family = family_of(model)
    permutations: dict[str, Permutation] = getattr(model, "_sk_permutations", {})
    kept = {name: b.detach().clone() for name, b in model.named_buffers() if b.device.type != "meta"}
    unset = {name for name, b in model.named_buffers() if b.device.type == "meta"}
    ties = [(alias, first) for alias, first in aliases(model).items() if alias != first]
    done: set[str] = set()
    with torch.no_grad():
        model.to_empty(device=device)
        for alias, first in ties:  # to_empty gives each name a new tensor: one parameter again
            owner, _, key = alias.rpartition(".")
            (model.get_submodule(owner) if owner else model)._parameters[key] = model.get_parameter(first)
        for name, buffer in model.named_buffers():
            if name in kept:
                buffer.copy_(kept[name])
        names = {id(p): name for name, p in model.named_parameters()}  # the new tensors' (ids of freed ones recur)
        ancestors = reaching_inits(model, family) if source is None else {}
        modules = dict(model.named_modules())
        for module_name, module in modules.items():
            prefix = f"{module_name}." if module_name else ""
            buffers = [b for b in module._buffers if prefix + b in unset]
            params = {k: p for k, p in module._parameters.items() if p is not None}
            if buffers or (params and source is None):
                with _full_size(module, buffers, INIT_DEVICE) as fresh:  # drawn on the CPU, then copied
                    torch.manual_seed(module_seed(seed, module_name))
                    family.init_module(model, module)
                _keep_buffers(module, prefix, buffers, fresh)
                for key in params:
                    for ancestor in ancestors.get((id(module), key), ()):
                        with stand_ins(modules[ancestor], {(id(module), key): fresh[key]}):
                            torch.manual_seed(module_seed(seed, f"{ancestor}/{module_name}.{key}"))
                            family.init_module(model, modules[ancestor])
            for key, param in params.items():
                name = names.get(id(param), prefix + key)
                if name in done:
                    continue  # a tied parameter keeps its first module's initialisation (the embedding's)
                done.add(name)
                if source is None and _is_unset(fresh[key]):
                    raise UsageError(
                        f"parameter {name!r} ({type(module).__name__}) is not initialised by the model's own "
                        f"initialisation (no reset_parameters() on its module, and the model's _init_weights, if "
                        f"any, does not write it), so its values cannot be made on the meta device: give "
                        f"{type(module).__name__} a reset_parameters(), load weights (weights=...), or build the "
                        f"model in full (shardkit train --build full)")
                for piece in pieces(param, permutations.get(name)):
                    value = fresh[key][piece.box] if source is None else source.read(name, piece.box, param.dtype)
                    piece.local.copy_(value)
        if source is not None:
            _load_buffers(model, source)
    return model


def load_weights(model: nn.Module, source: WeightSource) -> nn.Module:
    """Copy ``source``'s values into ``model``: every parameter's pieces this rank holds (sharded
    or not, permuted or not), and the buffers the source holds. In place; returns the model."""
    permutations: dict[str, Permutation] = getattr(model, "_sk_permutations", {})
    with torch.no_grad():
        for name, param in model.named_parameters():
            for piece in pieces(param, permutations.get(name)):
                piece.local.copy_(source.read(name, piece.box, param.dtype))
        _load_buffers(model, source)
    return model


def _load_buffers(model: nn.Module, source: WeightSource) -> None:
    for name, buffer in model.named_buffers():
        if source.holds(name):
            buffer.copy_(source.read(name, tuple(slice(0, n) for n in buffer.shape), buffer.dtype))


def open_weights(weights: str | Path | WeightSource, model: nn.Module) -> WeightSource:
    """``weights`` (a HuggingFace safetensors folder or file, or a source already open) checked
    against ``model`` (on meta or not, before it is split): every parameter found with its shape,
    under its own name, the model's ``base_model_prefix`` taken off or put on, or a tied name;
    raises :class:`~shardkit.io.hf_weights.WeightsError` naming every problem."""
    if not isinstance(weights, (str, Path)):
        return weights
    source = HFWeights(weights)
    names = family_of(model).weight_names(model)
    groups: dict[str, list[str]] = {}
    for alias, first in aliases(model).items():
        groups.setdefault(first, []).append(alias)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    persistent = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items() if n not in params}
    source.check({name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()},
                 ties=[g for g in groups.values() if len(g) > 1],
                 ignore=getattr(model, "_keys_to_ignore_on_load_unexpected", None) or (),
                 prefix=getattr(model, "base_model_prefix", "") or "",
                 buffers=persistent, rename=names.to_model, merged=names.merged, stacked=names.stacked)
    return source


def _keep_buffers(module: nn.Module, prefix: str, buffers: list[str], fresh: dict[str, torch.Tensor]) -> None:
    for key in buffers:
        if _is_unset(fresh[key]):
            raise UsageError(f"buffer {prefix + key!r} was built on the meta device and the model's initialisation does "
                             f"not compute it; build the model with sk.meta_model(build), which keeps buffers real, or "
                             f"compute it in the module's reset_parameters()")
        module._buffers[key].copy_(fresh[key])


__all__ = ["WeightSource", "load_weights", "materialize", "module_seed", "open_weights"]
