"""Running a model on stand-in tensors (meta, or copies in another dtype) for its parameters and buffers.

Shapes, dtypes and autograd work on meta tensors; no memory is allocated and nothing is
computed. Used to find a chain's execution order, to trace dataflow and to measure costs.

>>> import torch.nn as nn
>>> net = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
>>> run_on_meta(net, meta_tensors(net), (torch.zeros(2, 4),)).shape
torch.Size([2, 3])
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: The dtype meta stand-ins take when the model's own fails on the meta device: torch's meta kernel of
#: ``_grouped_mm`` (transformers' mixture-of-experts layers on the meta device) accepts only bfloat16
#: (torch 2.13), where its CPU and CUDA kernels also take float32.
META_FALLBACK_DTYPE = torch.bfloat16


def meta_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Meta stand-ins for every parameter (requiring grad) and buffer of ``model``, by canonical
    name (a tied parameter or a module used in two places: once, the aliases follow it); floating
    ones in ``dtype`` when given (some meta kernels take only bfloat16: torch 2.13's ``_grouped_mm``)."""
    def kind(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = torch.empty(p.shape, dtype=kind(p), device="meta", requires_grad=True)
    for name, b in model.named_buffers():
        out[name] = torch.empty(b.shape, dtype=kind(b), device="meta")
    return out


@contextmanager
def swapped(model: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Put ``tensors`` (by canonical name) in place of the parameters and buffers they stand for,
    by object identity, and restore them after. torch's ``functional_call`` swaps by name and
    leaves meta tensors behind in a module used in two places (its second name saves the first's
    stand-in as the original); swapping each (module, slot) once avoids that."""
    by_id = {id(t): tensors[n] for n, t in [*model.named_parameters(), *model.named_buffers()] if n in tensors}
    saved = []
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for key, value in list(slots.items()):
                if value is not None and id(value) in by_id:
                    saved.append((slots, key, value))
                    slots[key] = by_id[id(value)]
    try:
        yield
    finally:
        for slots, key, value in saved:
            slots[key] = value


def run_on_meta(model: nn.Module, tensors: dict[str, torch.Tensor], inputs: tuple) -> Any:
    """``model(*inputs)`` with ``tensors`` in place of its parameters and buffers, inputs on meta
    (every alias of a tied parameter or a shared module sees its canonical name's tensor)."""
    meta_inputs = tuple(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    with swapped(model, tensors):
        return model(*meta_inputs)


__all__ = ["META_FALLBACK_DTYPE", "meta_tensors", "run_on_meta", "swapped"]
