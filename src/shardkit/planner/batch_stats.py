"""Modules that normalise with statistics of the batch, found on the meta device.

A batch norm in training mode normalises each channel with the mean and variance of the batch it
sees. Split the batch over data ranks (``dp``, ``fsdp``, and ``sp``'s positions) and each rank
normalises with its own part: another function than one process over the whole batch (a tiny
BatchNorm MLP under ``fsdp=2``: step-2 loss 1.250 against 1.305), and the ranks' running
statistics drift apart. Cut the batch into micro-batches (a pipeline's ``microbatches``, gradient
accumulation) and each micro-batch has statistics of its own, whatever the data ranks do.

:func:`batch_statistics` runs the model's forward on meta and records every ``batch_norm`` call
in training mode, with the module that made it, so a model of any family is covered, not only
the module types it happens to use. torch's own batch norms (``nn.BatchNorm1d/2d/3d``, any
``_BatchNorm`` subclass that keeps torch's forward, ``nn.SyncBatchNorm``) are synchronised by the
runtime (:mod:`shardkit.runtime.batch_stats`); :func:`batch_stats_problems` refuses, naming the
module, the rest under a split batch, and every one under micro-batches.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
>>> batch_statistics(net, (torch.zeros(1, 4),)).synchronised
('1',)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from ..families import family_of
from ..families.on_meta import meta_tensors, module_stack, run_on_meta
from ..plan import Mesh, Plan

#: torch's batch-norm forwards: a ``_BatchNorm`` that keeps one of them is what the runtime synchronises.
TORCH_FORWARDS = (_BatchNorm.forward, nn.SyncBatchNorm.forward)
_BATCH_NORMS = (F.batch_norm, torch.batch_norm, torch.native_batch_norm)
_TRAINING = 5  # the position of ``training`` in each of _BATCH_NORMS
_NAMED = 8  # modules named in one message before "and N more"


def synchronisable(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's batch norms, whose forward the runtime replaces by a synchronised one."""
    return isinstance(module, _BatchNorm) and type(module).forward in TORCH_FORWARDS


@dataclass(frozen=True)
class BatchStats:
    """Modules whose forward normalises with statistics of the batch: ``synchronised``, torch's batch
    norms (the runtime all-reduces their statistics); ``own``, any other (a ``batch_norm`` call in a
    forward of its own). ``traced``: found on a meta forward (else by module type alone)."""

    synchronised: tuple[str, ...] = ()
    own: tuple[str, ...] = ()
    traced: bool = False

    @property
    def all(self) -> tuple[str, ...]:
        return self.synchronised + self.own


class BatchNormWatch(TorchFunctionMode):
    """Records the innermost running module (the top of ``stack``: :func:`~shardkit.families.on_meta.module_stack`)
    of every ``batch_norm`` call in training mode. ``lenient``: skip ``F.batch_norm``'s check of more than one
    value per channel (a sample is enough to find the calls); otherwise every call runs as it is (the
    dataflow trace records them on its own forward, :mod:`shardkit.planner.dataflow`)."""

    def __init__(self, stack: list[str], lenient: bool = True):
        super().__init__()
        self.stack, self.lenient, self.found = stack, lenient, dict[str, None]()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _BATCH_NORMS:
            if kwargs.get("training", args[_TRAINING] if len(args) > _TRAINING else False):
                self.found.setdefault(self.stack[-1] if self.stack else "", None)
            if func is F.batch_norm and self.lenient:
                x, mean, var, weight, bias, training, momentum, eps = (list(args) + [None] * 8)[:8]
                return torch.batch_norm(x, kwargs.get("weight", weight), kwargs.get("bias", bias), mean, var,
                                        bool(kwargs.get("training", training)), kwargs.get("momentum", momentum) or 0.0,
                                        kwargs.get("eps", eps or 1e-5), False)
        return func(*args, **kwargs)


def classified(model: nn.Module, found: Iterable[str], traced: bool = True) -> BatchStats:
    """The modules ``found`` normalising with batch statistics, told apart: torch's batch norms and the rest."""
    modules = dict(model.named_modules())
    found = list(found)
    return BatchStats(tuple(n for n in found if synchronisable(modules[n])),
                      tuple(n for n in found if not synchronisable(modules[n])), traced)


def batch_statistics(model: nn.Module, example_inputs: tuple | None = None) -> BatchStats:
    """The modules of ``model`` that normalise with batch statistics in its current mode (training or
    eval), found on a meta forward of ``example_inputs`` (or its family's example); by module type
    when there is no input to run or the forward fails on meta. (``sk.validate`` reads them from its
    dataflow trace's forward where that ran: :attr:`~shardkit.planner.dataflow.Dataflow.batch_norms`.)"""
    inputs = example_inputs or family_of(model).example_inputs(model)
    if inputs is not None:
        stack: list[str] = []
        watch = BatchNormWatch(stack)
        try:
            with module_stack(model, stack), watch, torch.no_grad():
                run_on_meta(model, meta_tensors(model), inputs)
        except Exception:  # the model's own error on meta is the dataflow checks' to report
            watch.found.clear()
        else:
            return classified(model, watch.found)
    by_type = [n for n, m in model.named_modules() if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)]
    return classified(model, by_type, traced=False)


def data_ranks(mesh: Mesh) -> int:
    """How many ranks one batch is split over: the data axes, and ``sp``'s positions."""
    return mesh.data_size * mesh.size_of("sp")


def _data_axes(mesh: Mesh) -> str:
    return ", ".join(f"{a}={mesh[a]}" for a in mesh.names if a in ("dp", "fsdp", "sp") and mesh[a] > 1)


def _named(model: nn.Module, names: tuple[str, ...]) -> str:
    modules = dict(model.named_modules())
    shown = [f"{n!r} ({type(modules[n]).__name__})" for n in names[:_NAMED]]
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return f"module{'s' if len(names) > 1 else ''} {', '.join(shown)}{more}"


def batch_stats_problems(plan: Plan, model: nn.Module, example_inputs: tuple | None = None,
                         stats: BatchStats | None = None) -> list[str]:
    """What ``plan`` would compute differently from one process because of batch statistics: a module
    that computes them in its own forward under a split batch, any batch norm under micro-batches."""
    split, micro = data_ranks(plan.mesh), plan.pipeline.microbatches if plan.pipeline is not None else 1
    if split == 1 and micro == 1:
        return []
    stats = stats or batch_statistics(model, example_inputs)
    problems = []
    if split > 1 and stats.own:
        problems.append(f"{_named(model, stats.own)} normalise{'s' if len(stats.own) == 1 else ''} with statistics "
                        f"of the batch in a forward of their own (batch_norm in training mode): under "
                        f"{_data_axes(plan.mesh)} each of the {split} data ranks would use its own part of the "
                        f"batch, unlike one process; shardkit synchronises torch's batch norms (nn.BatchNorm1d/2d/3d, "
                        f"nn.SyncBatchNorm): use one of those, eval mode (running statistics), or a norm per "
                        f"sample (LayerNorm, GroupNorm)")
    if micro > 1 and stats.all:
        problems.append(f"{_named(model, stats.all)} normalise{'s' if len(stats.all) == 1 else ''} with statistics "
                        f"of the batch it sees: with the pipeline's microbatches={micro} each micro-batch has its "
                        f"own, unlike one process over the whole batch (on every stage); use microbatches=1, eval "
                        f"mode for these modules (running statistics), or a norm per sample (LayerNorm, GroupNorm)")
    return problems


def batch_stats_lines(plan: Plan, model: nn.Module, example_inputs: tuple | None = None,
                      stats: BatchStats | None = None) -> list[str]:
    """What ``shardkit explain`` says about batch statistics (nothing when the batch is not split);
    ``stats``: what a meta forward of the same inputs found already (``sk.validate``'s report)."""
    split = data_ranks(plan.mesh)
    stats = (stats or batch_statistics(model, example_inputs)) if split > 1 else BatchStats()
    if not stats.synchronised:
        return []
    return [f"batch statistics: {_named(model, stats.synchronised)} normalise over the whole batch: mean, variance "
            f"and count all-reduced over {_data_axes(plan.mesh)} ({split} ranks) in forward and backward, running "
            f"statistics as one process's (shardkit's synchronised batch norm)"]


__all__ = ["TORCH_FORWARDS", "BatchNormWatch", "BatchStats", "batch_statistics", "batch_stats_lines",
           "batch_stats_problems", "classified", "data_ranks", "synchronisable"]
