"""shardkit: split a PyTorch model across devices from one declarative, validated Plan.

A thin facade: every name is re-exported lazily from the module that defines it, so
``import shardkit`` stays cheap (it imports no torch). The replica-variable API, the grouped
collectives and the context-parallel pieces are small namespaces: ``sk.replicas``,
``sk.collectives``, ``sk.context_parallel``.

>>> import shardkit as sk
>>> sk.Mesh(fsdp=-1, tp=2, world_size=8)
Mesh(fsdp=4, tp=2)
>>> sk.collectives.all_reduce.__module__
'shardkit.runtime.collectives'
"""

from __future__ import annotations

import warnings
from typing import Any

from ._facade import namespace, resolve

_EXPORTS = {
    # plan: pure data
    "Mesh": "shardkit.plan.mesh",
    "LayoutMap": "shardkit.plan.layout",
    "Plan": "shardkit.plan.plan",
    "FSDPOptions": "shardkit.plan.plan",
    "PlanError": "shardkit.plan.errors",
    "PlanWarning": "shardkit.plan.errors",
    "UsageError": "shardkit.plan.errors",
    "ShardkitError": "shardkit.plan.errors",
    "Pipeline": "shardkit.plan.pipeline",
    "ReplicaGrouping": "shardkit.plan.replicas",
    # runtime: torch.distributed
    "launch": "shardkit.runtime.world",
    "LocalWorld": "shardkit.runtime.world",
    "WorldError": "shardkit.runtime.world",
    "WorldTimeout": "shardkit.runtime.world",
    "Context": "shardkit.runtime.context",
    "shard": "shardkit.runtime.apply",
    "full_state_dict": "shardkit.runtime.apply",
    "verify": "shardkit.runtime.verify",
    "optimizer": "shardkit.runtime.optimizer",
    "VerifyResult": "shardkit.runtime.verify",
    "stage": "shardkit.plan.scopes",
    "recompute": "shardkit.runtime.recompute",
    "held_activations": "shardkit.runtime.recompute",
    "clip_grad_norm_": "shardkit.runtime.clipping",
    "generate": "shardkit.runtime.generate",
    # training: one job from one configuration
    "train": "shardkit.training.run",
    "TrainConfig": "shardkit.training.config",
    "dry_run": "shardkit.training.dry_run",
    # observe and io
    "CommCounter": "shardkit.observe.comm",
    "PeakMemory": "shardkit.observe.memory",
    "state_bytes": "shardkit.observe.memory",
    "TextShards": "shardkit.io.data",
    "ShardedDataset": "shardkit.io.sharded_data",
    "write_shards": "shardkit.io.shard_writer",
    "DataError": "shardkit.io.manifest",
    "WeightsError": "shardkit.io.hf_weights",
    "export_hf": "shardkit.checkpoint.export",
    "convert_to_hf": "shardkit.checkpoint.export",
    "profile": "shardkit.observe.timeline",
    "explain_stages": "shardkit.planner.explain_stages",
    # checkpoints
    "save": "shardkit.checkpoint.store",
    "load": "shardkit.checkpoint.store",
    "latest_checkpoint": "shardkit.checkpoint.store",
    "CheckpointError": "shardkit.checkpoint.manifest",
    # planner
    "meta_model": "shardkit.planner.meta",
    "validate": "shardkit.planner.validate",
    "ValidationReport": "shardkit.planner.validate",
    "explain_plan": "shardkit.planner.explain",
    "estimate_memory": "shardkit.planner.explain",
    "estimate": "shardkit.planner.estimate",
    "kv_cache_bytes": "shardkit.planner.estimate",
    "Estimate": "shardkit.planner.estimate",
    "autoshard": "shardkit.planner.autoshard",
    "Candidate": "shardkit.planner.autoshard",
    "Hardware": "shardkit.planner.hardware",
    "calibrate": "shardkit.observe.calibrate",
    "analyse": "shardkit.planner.analysis",
    "ModelAnalysis": "shardkit.planner.analysis",
    "infer_tp_rules": "shardkit.planner.tp_infer",
}

replicas = namespace("shardkit.replicas", {
    "variable": "shardkit.runtime.variables",
    "Variable": "shardkit.runtime.variables",
    "group_module": "shardkit.runtime.variables",
    "stack_states": "shardkit.runtime.variables",
    "ReplicaDisagreement": "shardkit.runtime.variables",
    "grouping_table": "shardkit.plan.replicas",
}, """Grouped variables of a :class:`~shardkit.ReplicaGrouping` (docs/replicas.md): ``variable``,
``group_module``, their read modes and checks, ``grouping_table``.""")
collectives = namespace("shardkit.collectives", {
    "all_reduce": "shardkit.runtime.collectives",
    "all_gather": "shardkit.runtime.collectives",
    "reduce_scatter": "shardkit.runtime.collectives",
    "broadcast": "shardkit.runtime.collectives",
    "average_gradients": "shardkit.runtime.collectives",
}, """Collectives within the groups of a :class:`~shardkit.ReplicaGrouping`, or of its transpose
(docs/replicas.md).""")
context_parallel = namespace("shardkit.context_parallel", {
    "enable_context_parallel": "shardkit.runtime.context_parallel",
    "ring_attention": "shardkit.runtime.ring_attention",
    "shard_sequence": "shardkit.runtime.ring_attention",
    "unshard_sequence": "shardkit.runtime.ring_attention",
    "gather_sequence": "shardkit.runtime.ring_attention",
    "sequence_positions": "shardkit.runtime.ring_attention",
    "check_sequence_length": "shardkit.plan.sequence",
}, """What ``Plan(mesh=Mesh(sp=...))`` runs on, for models that call it themselves (docs/sequence.md):
ring attention, a rank's part of a sequence and its positions.""")
_NAMESPACES = {"replicas": replicas, "collectives": collectives, "context_parallel": context_parallel}
#: A grouped name asked for at the top level (where most of them were before): found, with a warning
#: naming its place.
_MOVED = {name: group for group, made in _NAMESPACES.items() for name in made.__all__}

__all__ = sorted([*_EXPORTS, *_NAMESPACES])
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    group = _MOVED.get(name)
    if group is not None:
        warnings.warn(f"sk.{name} is now sk.{group}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(_NAMESPACES[group], name)
    value = resolve(_EXPORTS, "shardkit", name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
