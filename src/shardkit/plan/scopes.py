"""``sk.stage(i)``: mark the modules built inside a ``with`` block as belonging to pipeline stage ``i``.

The PyTorch analogue of Graphcore's ``ipu_shard(i)`` scopes. While a scope is open, every
module or parameter *registered* on a parent (``self.block = Block()``, ``ModuleList.append``)
is tagged with the stage; a plan with ``Pipeline(split="scopes")`` then reads the tags.
Tags are plain attributes, so they survive ``copy.deepcopy`` and the meta device.

Implemented with torch's global module/parameter registration hooks
(``torch.nn.modules.module.register_module_*_registration_hook``), installed only while a
scope is open; torch has no notion of construction-time placement for eager modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import PlanError

#: Attribute holding the stage tag on a module or parameter.
STAGE_ATTR = "_shardkit_stage"
_OPEN: list[int] = []


def _tag_module(parent: Any, name: str, module: Any) -> None:
    if _OPEN and module is not None:
        setattr(module, STAGE_ATTR, _OPEN[-1])


def _tag_parameter(parent: Any, name: str, param: Any) -> None:
    if _OPEN and param is not None:
        setattr(param, STAGE_ATTR, _OPEN[-1])


@contextmanager
def stage(index: int) -> Iterator[int]:
    """Tag modules registered inside the block with pipeline stage ``index`` (innermost scope wins).

    >>> import torch.nn as nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         with stage(0):
    ...             self.embed = nn.Embedding(16, 8)
    ...         with stage(1):
    ...             self.head = nn.Linear(8, 16)
    >>> stage_of(Net().head)
    1
    """
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise PlanError(f"sk.stage({index!r}): a stage index is an integer >= 0")
    from torch.nn.modules import module as torch_module

    handles = []
    if not _OPEN:
        handles = [torch_module.register_module_module_registration_hook(_tag_module),
                   torch_module.register_module_parameter_registration_hook(_tag_parameter)]
    _OPEN.append(index)
    try:
        yield index
    finally:
        _OPEN.pop()
        for handle in handles:
            handle.remove()


def stage_of(obj: Any) -> int | None:
    """The stage tag of a module or parameter, or ``None`` if it was registered outside any scope."""
    return getattr(obj, STAGE_ATTR, None)


__all__ = ["STAGE_ATTR", "stage", "stage_of"]
