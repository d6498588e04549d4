"""``sk.optimizer``: the optimizer of a model, built as the model's plan asks (``Plan(zero=1)``).

Under ZeRO stage 1 each data-parallel rank keeps the optimizer state of only its part of the
parameters: torch's :class:`~torch.distributed.optim.ZeroRedundancyOptimizer` wraps the
optimizer class, partitions the parameters over the ``dp`` process group (whole tensors, by
size, greedily), steps its part and broadcasts the updated parameters. Stages 2 and 3 shard
the parameters themselves (FSDP2), so the plain optimizer over them already holds only its
shards' state. One call therefore builds the right optimizer for every plan.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..plan import UsageError


def optimizer(model: nn.Module, optimizer_class: type[torch.optim.Optimizer], **options: Any) -> torch.optim.Optimizer:
    """``optimizer_class(model.parameters(), **options)``, or under ``Plan(zero=1)`` torch's
    ``ZeroRedundancyOptimizer`` of it over the model's ``dp`` process group.

    A model that ``sk.shard`` did not split has no plan and gets the plain optimizer.

    >>> opt = optimizer(nn.Linear(2, 2), torch.optim.SGD, lr=0.1)
    >>> type(opt).__name__, opt.defaults["lr"]
    ('SGD', 0.1)
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"sk.optimizer(model, ...): model must be an nn.Module, got {type(model).__name__}")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise UsageError(f"sk.optimizer(model, optimizer_class, ...): optimizer_class must be a torch.optim.Optimizer "
                         f"class such as torch.optim.AdamW, got {optimizer_class!r}")
    plan = getattr(model, "_sk_plan", None)
    if plan is None or plan.zero != 1:
        return optimizer_class(model.parameters(), **options)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from .meshes import meshes_for

    device = next(model.parameters()).device
    data = meshes_for(plan, device.type).data()
    assert data is not None and not data.shards  # Plan.problems(): zero=1 needs dp > 1 and no fsdp
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                   process_group=data.mesh.get_group(), **options)


__all__ = ["optimizer"]
