"""Which parameters a model's own initialisation writes, found on the meta device.

A model built on meta gets its values from its own initialisation, module by module
(:mod:`shardkit.runtime.materialize`). Two things about that initialisation are learnt here,
by running it on meta stand-ins and recording the in-place writes (``normal_``, ``zero_``,
``copy_``, ``p[...] = v``, also through ``.data`` and views):

- :func:`reaching_inits`: parameters an *ancestor*'s initialisation writes too (GPT-2 scales
  ``c_proj.weight`` when it initialises the attention around it), to be replayed after;
- :func:`uninitialised`: parameters nothing writes (a module without ``reset_parameters`` that
  the model's ``_init_weights`` does not cover): on meta their values cannot be made, which
  ``sk.shard`` and ``shardkit train`` say before any weight is allocated.

>>> import torch, shardkit as sk
>>> from torch import nn
>>> class Scale(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.gain = nn.Parameter(torch.ones(4))
>>> uninitialised(sk.meta_model(lambda: nn.Sequential(nn.Linear(4, 4), Scale())))
['1.gain']
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..families import Family, family_of
from .dataflow import is_in_place


class Writes(TorchFunctionMode):
    """Records the tensors in-place operations write to (initialisers are in-place), a write
    through ``.data`` or a view counting for the tensor it comes from."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()
        self._root: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # keeps aliases alive, so their ids are not reused

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor", kwargs.get("input"))  # nn.init passes tensor=
        if isinstance(target, torch.Tensor) and (is_in_place(func) or getattr(func, "__name__", "") == "__setitem__"):
            self.written.add(self._root.get(id(target), id(target)))
        result = func(*args, **kwargs)
        if isinstance(target, torch.Tensor) and isinstance(result, torch.Tensor) and result is not target and (
                getattr(func, "__name__", "") == "__get__" or result._is_view()):  # .data, .T, p[0], p.view(...)
            self._root[id(result)] = self._root.get(id(target), id(target))
            self._alive.append(result)
        return result


@contextmanager
def stand_ins(module: nn.Module, keep: dict[tuple[int, str], torch.Tensor]) -> Iterator[dict[int, tuple[int, str]]]:
    """While open, every parameter slot under ``module`` holds a meta stand-in, except the slots in
    ``keep`` (``(id(owner module), key)``), which hold the tensors given. Yields ``{id(stand-in): slot}``."""
    saved, slots = [], {}
    for owner in module.modules():
        for key, value in list(owner._parameters.items()):
            if value is None:
                continue
            tensor = keep.get((id(owner), key))
            if tensor is None:
                tensor = torch.empty(value.shape, dtype=value.dtype, device="meta")
            saved.append((owner, key, value))
            owner._parameters[key] = tensor
            slots[id(tensor)] = (id(owner), key)
    try:
        yield slots
    finally:
        for owner, key, value in saved:
            owner._parameters[key] = value


def reaching_inits(model: nn.Module, family: Family) -> dict[tuple[int, str], list[str]]:
    """``{(id(owner), key): [ancestor names, innermost first]}``: parameter slots an *ancestor*'s
    initialisation writes too (GPT-2 scales ``c_proj.weight`` when it initialises the attention
    around it). transformers applies ``_init_weights`` children first, so such writes win."""
    names = dict(model.named_modules())
    reached: dict[tuple[int, str], list[str]] = {}
    for name, module in sorted(names.items(), key=lambda item: -item[0].count(".")):
        if next(module.children(), None) is None:
            continue
        writes = Writes()
        with stand_ins(module, {}) as slots, writes:
            family.init_module(model, module)
        for tensor_id in writes.written & set(slots):
            owner, key = slots[tensor_id]
            if owner != id(module):
                reached.setdefault((owner, key), []).append(name)
    return reached


def uninitialised(model: nn.Module, family: Family | None = None) -> list[str]:
    """Names of the parameters no module's initialisation writes (each tied parameter once, under
    its first name, counted as written when any of its modules writes it)."""
    family = family or family_of(model)
    written: set[tuple[int, str]] = set()
    for module in model.modules():
        writes = Writes()
        with stand_ins(module, {}) as slots, writes:
            family.init_module(model, module)
        written |= {slots[i] for i in writes.written & set(slots)}
    by_param: dict[int, list[str]] = {}
    done: dict[int, bool] = {}
    for owner_name, owner in model.named_modules(remove_duplicate=False):
        for key, param in owner._parameters.items():
            if param is None:
                continue
            name = f"{owner_name}.{key}" if owner_name else key
            by_param.setdefault(id(param), []).append(name)
            done[id(param)] = done.get(id(param), False) or (id(owner), key) in written
    return [names[0] for pid, names in by_param.items() if not done[pid]]


__all__ = ["Writes", "reaching_inits", "stand_ins", "uninitialised"]
