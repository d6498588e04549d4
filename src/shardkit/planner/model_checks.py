"""Checks of a plan against a model on the meta device (composed by :mod:`shardkit.planner.validate`).

Each check is a small function returning one line per problem; :func:`model_problems` runs
them all. They need the module tree (not only parameter shapes) and what shardkit knows
about the model's family.
"""

from __future__ import annotations

from torch import nn

from ..models.adapters import tensor_parallel_problems
from ..plan import Plan
from ..plan.layout import ParamLayout


def model_problems(plan: Plan, model: nn.Module, layouts: dict[str, ParamLayout],
                   example_inputs: tuple | None = None) -> list[str]:
    """Every problem of ``plan`` on ``model`` beyond the layouts' shapes and the pipeline stages."""
    problems: list[str] = []
    for axis in plan.mesh.model_axes:
        problems += tensor_parallel_problems(model, plan.mesh[axis])
    return problems


__all__ = ["model_problems"]
