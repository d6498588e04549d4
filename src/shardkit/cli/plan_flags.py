"""The plan flags every sub-command that takes a plan shares (``train``, ``explain``; ``generate`` and
``plan`` take ``--mesh`` / ``--rules``): declared once here, turned into a Plan once, by
:func:`shardkit.training.plans.plan_from_flags`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

from ..models.registry import ModelEntry
from ..plan import Plan, PlanError
from ..plan.pipeline import SCHEDULES, SPLITS
from ..plan.plan import RECOMPUTE, ZERO_STAGES
from ..training.plans import (
    AUTO_PLAN,
    DEFAULT_MESH,
    PlanFlags,
    load_rules,
    model_rules,
    parse_mesh_flag,
    plan_from_flags,
    with_rules_hint,
)
from .options import module_names, path, positive_int


def add_plan_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--plan``, ``--mesh``, ``--rules``, ``--world-size``, ``--recompute``, ``--zero`` and the pipeline flags;
    returns the pipeline group."""
    parser.add_argument("--plan", type=path, metavar="FILE",
                        help="a whole plan file (.json, .yaml, .yml); replaces --mesh, --rules and the pipeline flags "
                             f"(shardkit train: '{AUTO_PLAN}' lets the planner choose)")
    parser.add_argument("--mesh", metavar="AXES",
                        help=f"mesh axes such as 'fsdp=2,tp=2' (default: {DEFAULT_MESH}); one axis may be -1")
    add_rules_option(parser)
    parser.add_argument("--world-size", type=positive_int, metavar="N",
                        help="number of processes (default: the mesh size; needed for a -1 axis)")
    parser.add_argument("--recompute", choices=list(RECOMPUTE),
                        help="activation recompute per block: full, or selective (the attention core only); "
                             "default: none")
    parser.add_argument("--zero", type=int, choices=list(ZERO_STAGES),
                        help="ZeRO stage on the data axes (docs/zero.md): 1 optimizer state sharded over dp, "
                             "2 FSDP2 without resharding after forward, 3 FSDP2 (fsdp)")
    pipe = parser.add_argument_group("pipeline (with a 'pp' mesh axis)")
    pipe.add_argument("--schedule", choices=list(SCHEDULES), help="pipeline schedule (default: 1f1b)")
    pipe.add_argument("--microbatches", type=positive_int, metavar="N",
                      help="micro-batches per step (default: the pp size)")
    pipe.add_argument("--split", choices=list(SPLITS), help="how layers are split into stages (default: even)")
    pipe.add_argument("--split-points", type=module_names, metavar="NAMES",
                      help="comma-separated module names that begin a stage, e.g. layers.2")
    return pipe


def add_rules_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, note: str = "") -> None:
    """``--rules FILE``: the layout rules of the plan a mesh flag builds."""
    parser.add_argument("--rules", type=path, metavar="FILE",
                        help=f"JSON/YAML file: a list of [regex, layout] pairs (default: the model's rules){note}")


def plan_from_args(args: argparse.Namespace, entry: ModelEntry) -> tuple[Plan, int]:
    """The resolved plan and world size the plan flags of ``args`` describe (not yet checked against the model)."""
    return plan_from_flags(PlanFlags.of(args), args.model, entry, getattr(args, "world_size", None))


@contextmanager
def rules_hint(args: argparse.Namespace) -> Iterator[None]:
    """A model given by its builder path has no built-in rules: when a model axis is then used by no
    rule, the :class:`PlanError` says where rules come from."""
    try:
        yield
    except PlanError as exc:
        raise with_rules_hint(exc, PlanFlags.of(args), args.model) from None


__all__ = ["add_plan_options", "add_rules_option", "load_rules", "model_rules", "parse_mesh_flag", "plan_from_args", "rules_hint"]
