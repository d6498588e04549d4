"""One pipeline stage of this rank: the pruned model, what torch's ``PipelineStage`` runs, and
the stage itself, recorded.

- :func:`prune` removes from the model every unit module of the stages this rank does not
  run; the rest keep their dotted names (layout rules, checkpoints and ``sk.verify`` work by name).
- :class:`StageModule` is what a ``PipelineStage`` calls: stage ``index`` of the pruned model,
  through the model's ``__call__`` (so FSDP2's hooks run).
- :class:`RecordedStage` is torch's ``PipelineStage`` with its three per-micro-batch methods
  (forward, backward, weight backward) timed as ``F``/``B``/``I``/``W`` spans while a timeline
  records (:mod:`shardkit.runtime.spans`), and a callback before each backward, with which the
  runtime lets FSDP2 reduce gradients once, in this rank's last backward of a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from ..planner.counters import saved_storages
from ..planner.stages import StageAssignment
from . import spans as timeline


class StageModule(nn.Module):
    """Stage ``index`` of the pruned model, run through its ``__call__`` (``model(x, stage=index)``).

    It registers the stage's unit modules, so ``parameters()`` are exactly the stage's (the
    zero-bubble weight pass differentiates them); the model itself is held unregistered.
    """

    def __init__(self, model: nn.Module, index: int, unit_modules: list[nn.Module]):
        super().__init__()
        object.__setattr__(self, "model", model)
        self.index = index
        self.units = nn.ModuleList(unit_modules)

    def forward(self, *args: Any) -> Any:
        return self.model(*args, stage=self.index)


class RecordedStage(PipelineStage):
    """torch's ``PipelineStage``, timed per micro-batch while a timeline records, calling
    ``before_backward()`` ahead of every (full or input) backward.

    The stage's submodule is not the FSDP module (it calls the model through its ``__call__``),
    so torch's schedules do not switch FSDP's gradient sync; the runtime does, in
    ``before_backward`` (see :meth:`PipelineRuntime.step`).
    """

    def __init__(self, submodule: StageModule, stage_index: int, num_stages: int, device: torch.device,
                 group: dist.ProcessGroup, before_backward: Callable[[], None]):
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self._before_backward = before_backward

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if not timeline.is_recording():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        with timeline.span("F", self.stage_index, fwd_chunk_id) as record, \
                _count_saved(lambda: list(self.submod.parameters()), record):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        self._before_backward()
        with timeline.span("B" if full_backward else "I", self.stage_index, bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
        with timeline.span("W", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)


def prune(model: nn.Module, keep: set[str], assignment: StageAssignment) -> None:
    """Remove every unit module not in ``keep`` from its parent; names of the rest are unchanged."""
    for unit in assignment.layout.units:
        for path in unit.modules:
            if path in keep:
                continue
            parent_path, _, leaf = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            if isinstance(parent, (nn.ModuleList, nn.Sequential)):
                del parent._modules[leaf]  # iteration then yields the kept blocks only
            else:
                parent._modules[leaf] = None


@contextmanager
def _count_saved(params: Callable[[], list[torch.Tensor]], record: Any) -> Iterator[None]:
    """Add the bytes of the storages autograd saves for backward, parameters' excluded, to
    ``record.bytes`` (the planner's one count, :func:`~shardkit.planner.counters.saved_storages`)."""
    excluded = {getattr(p, "_local_tensor", p).untyped_storage()._cdata for p in params()}
    seen: set[int] = set()

    def on_saved(key: int, nbytes: int, _dtype: torch.dtype) -> None:
        if key not in seen:
            seen.add(key)
            record.bytes += nbytes

    with saved_storages(on_saved, excluded):
        yield


__all__ = ["RecordedStage", "StageModule", "prune"]
