"""What a job sends back to the parent (``sk.launch``, ``LocalWorld.run``): plain, finished tensors.

A job's result is pickled where it is (``torch.save``). A tensor still being written by a
collective (funcol's ``AsyncCollectiveTensor``, what a row-parallel layer returns) would be
pickled before the collective finished, and the parent would get numbers from before the
reduction. :func:`dumps` therefore pickles every tensor anywhere in the result (in containers,
dataclasses, any object) as a plain, finished copy on the CPU: an ``AsyncCollectiveTensor`` is
waited on and copied; a DTensor becomes this rank's part (``to_local()``: the parent gets one value
per rank), except one holding an unreduced sum (``Partial``), which is refused naming it, since
its local part is no number the job computed; a tensor on an accelerator is copied to the CPU.

>>> loads(dumps({"x": torch.ones(2)}))["x"].tolist()
[1.0, 1.0]
"""

from __future__ import annotations

import io
import pickle
import types
from typing import Any

import torch

from ..plan import UsageError


def finished(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain CPU tensor whose value is final (see the module docstring)."""
    # imported here: only a tensor subclass comes this way, and every world's worker imports this module
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        if any(p.is_partial() for p in tensor.placements):
            raise UsageError(f"the job returned a DTensor of shape {list(tensor.shape)} with placements "
                             f"{tensor.placements}: a sum not yet reduced over its mesh; return "
                             f"tensor.full_tensor() (the whole value) or tensor.redistribute(...) first")
        tensor = tensor.to_local()
    if isinstance(tensor, AsyncCollectiveTensor):
        return tensor.trigger_wait().detach().clone().cpu()
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        return tensor.detach().clone().cpu()  # another subclass: its values, as a plain tensor
    return tensor if tensor.device.type == "cpu" else tensor.detach().cpu()


class _FinishingPickler(pickle.Pickler):
    """Pickles every tensor that is not a plain, final CPU tensor as :func:`finished` makes it."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and not (type(obj) in (torch.Tensor, torch.nn.Parameter)
                                                  and obj.device.type == "cpu"):
            return finished(obj).__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        return NotImplemented


_PICKLE = types.ModuleType("shardkit_results_pickle")
_PICKLE.Pickler = _FinishingPickler  # torch.save subclasses pickle_module.Pickler


def dumps(value: Any) -> bytes:
    """``value`` as bytes for the parent, every tensor plain, final and on the CPU."""
    buffer = io.BytesIO()
    torch.save(value, buffer, pickle_module=_PICKLE)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """What :func:`dumps` wrote, every tensor on the CPU (``map_location``): a result never
    initialises an accelerator in the process that reads it."""
    return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")


__all__ = ["dumps", "finished", "loads"]
