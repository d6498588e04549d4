"""Plan data: mesh, layout rules, plan, pipeline, replica groups, errors; checked without a model.

Imports no torch: everything here runs with no processes. Checks against a model (layouts
on its parameters, stages, head counts, ties, packed projections) are
``shardkit.planner.validate``'s.
"""

from .errors import PlanError, PlanWarning, ShardkitError, UsageError
from .layout import Layout, LayoutMap, ParamLayout, resolve_layouts
from .mesh import AXIS_ROLES, DATA_AXES, Mesh
from .pipeline import Pipeline
from .plan import FSDPOptions, Plan, param_shapes
from .replicas import ReplicaGrouping

__all__ = [
    "AXIS_ROLES", "DATA_AXES", "FSDPOptions", "Layout", "LayoutMap", "Mesh", "ParamLayout", "Pipeline",
    "Plan", "PlanError", "PlanWarning", "ReplicaGrouping", "ShardkitError", "UsageError", "param_shapes", "resolve_layouts",
]
