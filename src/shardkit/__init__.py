"""shardkit: split a PyTorch model across devices from one declarative, validated Plan.

A thin facade: every name is re-exported lazily from the module that defines it, so
``import shardkit`` stays cheap (the plan layer needs no torch.distributed).

>>> import shardkit as sk
>>> sk.Mesh(fsdp=-1, tp=2, world_size=8)
Mesh(fsdp=4, tp=2)
"""

from __future__ import annotations

import importlib
from typing import Any

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
    "variable": "shardkit.runtime.variables",
    "Variable": "shardkit.runtime.variables",
    "group_module": "shardkit.runtime.variables",
    "grouping_table": "shardkit.plan.replicas",
    "average_gradients": "shardkit.runtime.collectives",
    "ring_attention": "shardkit.runtime.ring_attention",
    "enable_context_parallel": "shardkit.runtime.context_parallel",
    "shard_sequence": "shardkit.runtime.ring_attention",
    "unshard_sequence": "shardkit.runtime.ring_attention",
    "sequence_positions": "shardkit.runtime.ring_attention",
    "check_sequence_length": "shardkit.plan.sequence",
    "recompute": "shardkit.runtime.recompute",
    "held_activations": "shardkit.runtime.recompute",
    "clip_grad_norm_": "shardkit.runtime.clipping",
    "generate": "shardkit.runtime.generate",
    # training: one job from one configuration
    "train": "shardkit.training.run",
    "TrainConfig": "shardkit.training.config",
    # grouped collectives (within the groups of a ReplicaGrouping, or of its transpose)
    "all_reduce": "shardkit.runtime.collectives",
    "all_gather": "shardkit.runtime.collectives",
    "reduce_scatter": "shardkit.runtime.collectives",
    "broadcast": "shardkit.runtime.collectives",
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

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
