"""Running a model on stand-in tensors (meta, or fake) for its parameters and buffers.

Shapes, dtypes and autograd work on meta tensors; no memory is allocated and nothing is
computed. Used to find a chain's execution order, to trace dataflow and to measure costs.

Some torch meta kernels take fewer dtypes than the CPU and CUDA kernels do: torch 2.13's
``_grouped_mm`` (transformers' mixture-of-experts layers) takes only bfloat16 on meta, where a
float32 model runs on CPU. :func:`meta_call` is the one place that works around it (the product
runs in bfloat16 and its output returns in the inputs' dtype: same shapes), used by
:func:`run_on_meta`, :func:`meta_kernels` and shardkit's own dispatch modes.

>>> import torch.nn as nn
>>> net = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
>>> run_on_meta(net, meta_tensors(net), (torch.zeros(2, 4),)).shape
torch.Size([2, 3])
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode

#: Operators whose meta kernel takes only bfloat16 (torch 2.13), where CPU and CUDA take float32 too.
BFLOAT16_ONLY_ON_META = (torch.ops.aten._grouped_mm,)


def meta_call(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` for an ATen operator; one in :data:`BFLOAT16_ONLY_ON_META` with
    floating inputs of another dtype runs in bfloat16, its output cast back to their dtype.

    torch has no switch for this: its meta kernel of ``_grouped_mm`` checks the dtype, so a
    float32 mixture of experts fails on meta ("Expected inputs of BF16 type") while it runs on CPU.

    >>> a, b = torch.empty(8, 16, device="meta"), torch.empty(2, 16, 8, device="meta")
    >>> offsets = torch.empty(2, dtype=torch.int32, device="meta")
    >>> meta_call(torch.ops.aten._grouped_mm.default, (a, b), {"offs": offsets}).dtype
    torch.float32
    """
    packet = getattr(func, "_overloadpacket", func)
    first = args[0] if args else None
    if packet not in BFLOAT16_ONLY_ON_META or not isinstance(first, torch.Tensor) or first.dtype == torch.bfloat16:
        return func(*args, **kwargs)

    def low(value: Any) -> Any:
        return value.to(torch.bfloat16) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    out = func(*map(low, args), **{k: low(v) for k, v in kwargs.items()})
    return out.to(first.dtype)


class _MetaKernels(TorchDispatchMode):
    """Routes every ATen operator through :func:`meta_call`."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return meta_call(func, args, kwargs or {})


@contextmanager
def meta_kernels() -> Iterator[None]:
    """While open, operators whose meta kernel takes fewer dtypes than the model's run as
    :func:`meta_call` says (a float32 mixture of experts runs on meta)."""
    with _MetaKernels():
        yield

#: The dtype meta stand-ins take when the model's own fails on the meta device: torch's meta kernel of
#: ``_grouped_mm`` (transformers' mixture-of-experts layers on the meta device) accepts only bfloat16
#: (torch 2.13), where its CPU and CUDA kernels also take float32.
META_FALLBACK_DTYPE = torch.bfloat16


def meta_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Meta stand-ins for every parameter (requiring grad) and buffer of ``model``, by canonical
    name (a tied parameter or a module used in two places: once, the aliases follow it); floating
    ones in ``dtype`` when given."""
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


@contextmanager
def plain_batch_norms(model: nn.Module) -> Iterator[None]:
    """While open, every ``SyncBatchNorm`` of ``model`` runs as a plain ``_BatchNorm``: torch's refuses
    any tensor but a GPU one (meta too) once a process group is open, as it is in ``sk.shard``."""
    syncs = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)]
    for module in syncs:
        module.forward = types.MethodType(_BatchNorm.forward, module)
    try:
        yield
    finally:
        for module in syncs:
            del module.forward


@contextmanager
def module_stack(model: nn.Module, stack: list[str]) -> Iterator[None]:
    """While open, ``stack`` holds the names of ``model``'s modules running, innermost last; a module
    that raises stays on it, so after a failed run its last name says where it failed.

    >>> net, stack = nn.Sequential(nn.Linear(2, 2)), []
    >>> with module_stack(net, stack):
    ...     _ = net[0].register_forward_pre_hook(lambda *_: print(stack)), net(torch.zeros(1, 2))
    ['', '0']
    """
    def leave(_m: nn.Module, _a: tuple, _o: Any) -> None:  # returns None: the module's output stays its own
        stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda _m, _a, n=name: stack.append(n)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_on_meta(model: nn.Module, tensors: dict[str, torch.Tensor], inputs: tuple) -> Any:
    """``model(*inputs)`` with ``tensors`` in place of its parameters and buffers, inputs on meta
    (every alias of a tied parameter or a shared module sees its canonical name's tensor), under
    :func:`meta_kernels`."""
    meta_inputs = tuple(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    with swapped(model, tensors), plain_batch_norms(model), meta_kernels():
        return model(*meta_inputs)


__all__ = ["BFLOAT16_ONLY_ON_META", "META_FALLBACK_DTYPE", "meta_call", "meta_kernels", "meta_tensors",
           "module_stack", "plain_batch_norms", "run_on_meta", "swapped"]
