"""The plan space the planner prices and searches, by name (no torch: the command line offers
these names before anything is imported).

>>> AXES, OPTIMIZER_STATES["adamw"]
(('dp', 'fsdp', 'tp', 'pp', 'sp', 'ep'), 2)
"""

from __future__ import annotations

#: The axes ``sk.autoshard`` searches by default (``ep`` only where the model has experts).
AXES = ("dp", "fsdp", "tp", "pp", "sp", "ep")
#: The axes the estimator prices, in the canonical mesh order (tp innermost, within a node; ``ep``
#: inside the data axes, so its all-to-all stays within a node where it can).
MESH_ORDER = ("pp", "dp", "fsdp", "ep", "sp", "tp")
#: Optimizer states per parameter, each the parameter's shape and dtype.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}

__all__ = ["AXES", "MESH_ORDER", "OPTIMIZER_STATES"]
