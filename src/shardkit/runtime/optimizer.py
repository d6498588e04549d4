"""``sk.optimizer``: the optimizer of a model, built as the model's plan asks (``Plan(zero=1)``).

Under ZeRO stage 1 each data-parallel rank keeps the optimizer state of only its part of the
parameters: torch's :class:`~torch.distributed.optim.ZeroRedundancyOptimizer` wraps the
optimizer class, partitions the parameters over the ``dp`` process group (whole tensors, by
size, greedily), steps its part and broadcasts the updated parameters. Stages 2 and 3 shard
the parameters themselves (FSDP2), so the plain optimizer over them already holds only its
shards' state. One call therefore builds the right optimizer for every plan.

torch's ``ZeroRedundancyOptimizer.state_dict()`` is the whole state gathered on one rank
(``consolidate_state_dict``), which torch's distributed checkpoint cannot save, and its
``state`` is empty, so ``state_bytes`` and DCP (which then takes a zero-gradient step to
create the state it sees missing) do not find the rank's part. :class:`PartitionedOptimizer`
exposes the rank's own part as ``state`` and ``state_dict()``, under the whole model's
parameter indices: DCP saves every rank's part as its own keys, and torch's own
``load_state_dict`` already takes such a partial state.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..models.routing import bias_balanced, update_expert_biases
from ..plan import UsageError


class PartitionedOptimizer(ZeroRedundancyOptimizer):
    """torch's ``ZeroRedundancyOptimizer`` whose ``state`` and ``state_dict()`` are this rank's part
    (see the module docstring for why)."""

    @property
    def state(self) -> Any:
        """The state this rank holds: its partition's (the wrapped optimizer's)."""
        return self.optim.state if "optim" in self.__dict__ else self.__dict__["state"]

    @state.setter
    def state(self, value: Any) -> None:  # torch.optim.Optimizer.__init__ assigns it
        self.__dict__["state"] = value

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the state under the whole model's parameter indices, and every group."""
        index = {p: i for i, p in enumerate(chain.from_iterable(g["params"] for g in self.param_groups))}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": {index[p]: dict(s) for p, s in self.optim.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, with the entries renumbered first: DCP hands them under parameter names, in the
        order of ``param_groups`` (how ``torch.optim.Optimizer.load_state_dict`` matches them)."""
        groups = state_dict["param_groups"]
        index = {key: i for i, key in enumerate(chain.from_iterable(g["params"] for g in groups))}
        super().load_state_dict({"state": {index[k]: v for k, v in state_dict["state"].items()},
                                 "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in groups]})


def optimizer(model: nn.Module, optimizer_class: type[torch.optim.Optimizer], **options: Any) -> torch.optim.Optimizer:
    """``optimizer_class(model.parameters(), **options)``, or under ``Plan(zero=1)`` torch's
    ``ZeroRedundancyOptimizer`` of it over the model's ``dp`` process group
    (:class:`PartitionedOptimizer`: checkpoints with ``sk.save`` / ``sk.load``).

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
        return _balancing(model, optimizer_class(model.parameters(), **options))
    from .meshes import meshes_for

    device = next(model.parameters()).device
    data = meshes_for(plan, device.type).data()
    assert data is not None and not data.shards  # Plan.problems(): zero=1 needs dp > 1 and no fsdp
    return _balancing(model, PartitionedOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                                  process_group=data.mesh.get_group(), **options))


def _balancing(model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt``, which after each step updates the biases of ``model``'s bias-balanced routers (DeepSeek-V3's
    auxiliary-loss-free balancing: :func:`~shardkit.models.routing.update_expert_biases`)."""
    if bias_balanced(model):
        opt.register_step_post_hook(lambda *_: update_expert_biases(model))
    return opt


__all__ = ["PartitionedOptimizer", "optimizer"]
