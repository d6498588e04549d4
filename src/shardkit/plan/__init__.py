"""Pure data and validation: mesh, layout rules, plan, pipeline, replica groups, errors.

Imports no torch.distributed: everything here runs with no processes.
"""

from .errors import PlanError, PlanWarning, ShardkitError, UsageError
from .layout import Layout, LayoutMap, ParamLayout, resolve_layouts
from .mesh import AXIS_ROLES, DATA_AXES, Mesh
from .pipeline import Pipeline
from .plan import FSDPOptions, Plan, ValidationReport, param_shapes
from .replicas import ReplicaGrouping

__all__ = [
    "AXIS_ROLES", "DATA_AXES", "FSDPOptions", "Layout", "LayoutMap", "Mesh", "ParamLayout", "Pipeline",
    "Plan", "PlanError", "PlanWarning", "ReplicaGrouping", "ShardkitError", "UsageError", "ValidationReport", "param_shapes", "resolve_layouts",
]
