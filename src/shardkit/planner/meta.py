"""Build models on the meta device: shapes and FLOPs without memory.

Parameters go to the meta device as each is registered (a transient real allocation of one
tensor at a time, never touched, so the operating system lends no pages; a tensor of at least
:data:`LARGE_BYTES` is made on meta at once, since an operating system refuses to lend more than
its memory even untouched: DeepSeek-V3's stacked experts are 30 GB a layer); buffers stay real,
so values a constructor computes into them (rotary frequencies, causal masks) are right when
the model is later materialised. This is accelerate's ``init_empty_weights(include_buffers=False)``
idea; torch's ``torch.device("meta")`` context puts buffers on meta too (shardkit accepts such
models and recomputes their buffers where the model's initialisation can).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: Bytes from which a tensor a constructor makes is made on the meta device directly (a parameter
#: would be moved there when registered; a buffer that large could not be held anyway).
LARGE_BYTES = 2**30
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn}


class _LargeOnMeta(TorchFunctionMode):
    """Factory calls of at least :data:`LARGE_BYTES` on the CPU (or no device) made on meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and torch.device(kwargs.get("device") or "cpu").type == "cpu":
            size = kwargs.get("size", args[0] if args else ())
            dims = tuple(size) if isinstance(size, (tuple, list, torch.Size)) else args  # torch.empty(3, 4)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            if all(isinstance(d, int) for d in dims) and math.prod(dims) * dtype.itemsize >= LARGE_BYTES:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While open, every parameter registered on any module is moved to the meta device
    (its class and attributes kept: ``sk.stage`` tags, ``requires_grad``); buffers are not."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        with _LargeOnMeta():
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def meta_model(build: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """``build(*args, **kwargs)`` with every parameter on the meta device (no memory used) and
    buffers real; ``sk.shard`` materialises only the shards each rank holds.

    >>> m = meta_model(nn.Linear, 70_000, 70_000)
    >>> m.weight.device.type, tuple(m.weight.shape)
    ('meta', (70000, 70000))
    """
    with parameters_on_meta():
        return build(*args, **kwargs)


__all__ = ["LARGE_BYTES", "meta_model", "parameters_on_meta"]
