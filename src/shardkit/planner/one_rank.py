"""What one tensor-parallel rank sees, simulated on stand-in tensors in one process.

Under torch's styles (:mod:`shardkit.runtime.tensor_parallel`) a rank holds a slice of each split
parameter, the family's attribute changes are set (local head counts), and at the boundaries of
split modules the rest of the model sees local shapes: a column-parallel output that stays split
is this rank's slice, a row-parallel layer fed by one takes that slice in; a gathered output and
a vocabulary-parallel embedding's output are whole. Inside a split module torch computes on
DTensors, whose shapes are global.

Two checks run a model as one rank: the validator's one-shard run
(:func:`shardkit.planner.model_checks.shard_problems`, looking for reshapes with global sizes)
keeps the whole weights inside split modules, as DTensor's global shapes do; the planner's
measurement (:func:`shardkit.planner.measure.measure`, counting FLOPs and bytes) gives them
their local slices (:func:`sliced_parameters`), so each computes exactly this rank's share.
:func:`one_rank` makes both see the same boundaries: it compares what a module computes with
(``local_weights``) against what the rest of the model sees and bridges the difference. torch
has no such simulation (DTensor needs a process group and real collectives).

>>> import torch
>>> from torch import nn
>>> from shardkit.planner.tensor_parallel import AxisPlan, ModuleSplit
>>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
>>> plan = AxisPlan("tp", 2, {"0": ModuleSplit("0", "colwise", {"weight": 0, "bias": 0}),
...                          "2": ModuleSplit("2", "rowwise", {"weight": 1})})
>>> seen = []
>>> handle = net[1].register_forward_hook(lambda _m, _a, out: seen.append(out.shape[-1]))
>>> with one_rank(net, [plan], local_weights=False):
...     net(torch.zeros(1, 4)).shape
torch.Size([1, 4])
>>> seen  # the activation between the pair: this rank's 4 of the 8 features
[4]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from ..families.modules import is_conv1d
from .tensor_parallel import (
    COLWISE,
    DTENSOR,
    EMBED_COLWISE,
    ROWWISE,
    AxisPlan,
    ModuleSplit,
    aliases,
)


def sliced_parameters(model: nn.Module, plan: AxisPlan | None) -> dict[str, int]:
    """``{canonical parameter name: dim split}`` of the parameters a rank holds a slice of (those of
    modules split by a style, and the parameters sliced with the activations they act on; a DTensor-only
    module's parameters keep their global shapes)."""
    if plan is None:
        return {}
    canonical = aliases(model)
    return {**{canonical[f"{split.name}.{p}" if split.name else p]: dim for split in plan.splits.values()
               if split.kind != DTENSOR for p, dim in split.placements.items() if dim is not None},
            **dict(plan.sliced)}


def _widths(split: ModuleSplit, local_weights: bool) -> tuple[bool, bool, bool, bool]:
    """``(input local inside, input local outside, output local inside, output local outside)``:
    whether the module computes on / makes a slice of the features, and whether the rest of the
    model hands it / takes from it a slice."""
    return (local_weights and split.kind == ROWWISE,
            split.kind == ROWWISE and not split.replicated_input,
            local_weights and split.kind in (COLWISE, EMBED_COLWISE),
            split.kind == COLWISE and not split.gather_output)


@contextmanager
def one_rank(model: nn.Module, plans: Sequence[AxisPlan], *, local_weights: bool,
             bridge: Callable[[], AbstractContextManager[Any]] = nullcontext) -> Iterator[None]:
    """While open, ``model`` (running on stand-ins: whole weights, or with ``local_weights`` the
    slices of :func:`sliced_parameters`) behaves at the boundaries of its split modules as one rank
    of ``plans`` does: attribute changes set (with local weights, GPT-2 ``Conv1D.nf`` too), and
    where a module's width differs from what the rest of the model sees, its input or output cut
    to this rank's slice (``narrow``) or made whole (``repeat``). ``bridge``: entered around those
    stand-in operations (a counter's pause: they are not the model's own)."""
    modules = dict(model.named_modules())
    changes = []
    handles = []

    def cut(tensor: torch.Tensor, n: int) -> torch.Tensor:
        with bridge():
            return tensor.narrow(-1, 0, tensor.shape[-1] // n).contiguous()

    def whole(tensor: torch.Tensor, n: int) -> torch.Tensor:
        with bridge():
            return tensor.repeat(*([1] * (tensor.dim() - 1)), n)

    for plan in plans:
        n = plan.size
        changes += [(modules[c.module], c.attribute, c.local) for c in plan.changes]
        for split in plan.splits.values():
            module = modules[split.name]
            in_inside, in_outside, out_inside, out_outside = _widths(split, local_weights)
            if local_weights and split.kind == COLWISE and is_conv1d(module):
                changes.append((module, "nf", module.nf // n))
            if in_inside != in_outside:
                adapt = cut if in_inside else whole
                handles.append(module.register_forward_pre_hook(
                    lambda _m, args, n=n, adapt=adapt: (adapt(args[0], n), *args[1:])))
            if out_inside != out_outside:
                adapt = cut if out_outside else whole
                handles.append(module.register_forward_hook(lambda _m, _a, out, n=n, adapt=adapt: adapt(out, n)))
    saved = [(module, attribute, getattr(module, attribute)) for module, attribute, _ in changes]
    for module, attribute, value in changes:
        setattr(module, attribute, value)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, attribute, value in reversed(saved):
            setattr(module, attribute, value)


__all__ = ["one_rank", "sliced_parameters"]
