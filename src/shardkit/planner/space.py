"""The plan space the planner prices and searches, by name (no torch: the command line offers
these names before anything is imported).

>>> AXES, OPTIMIZER_STATES["adamw"]
(('dp', 'fsdp', 'tp', 'pp', 'sp'), 2)
"""

from __future__ import annotations

#: The axes ``sk.autoshard`` searches by default.
AXES = ("dp", "fsdp", "tp", "pp", "sp")
#: The axes the estimator prices, in the canonical mesh order (tp innermost, within a node).
MESH_ORDER = ("pp", "dp", "fsdp", "sp", "tp")
#: Optimizer states per parameter, each the parameter's shape and dtype.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}

__all__ = ["AXES", "MESH_ORDER", "OPTIMIZER_STATES"]
