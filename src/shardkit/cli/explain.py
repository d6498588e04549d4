"""``shardkit explain``: what every device would hold under a plan, before anything starts.

The model is built on the meta device (no memory) and no process is started::

    shardkit explain --model llama-70b --mesh fsdp=-1,tp=8 --world-size 64
    shardkit explain --model gpt-tiny --plan plan.yaml
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..models.registry import MODELS, model_entry
from ..plan import Mesh, Plan, PlanError
from ..planner.explain import explain_plan
from ..planner.meta import meta_model


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain", help="show what each device holds under a plan (no processes started)",
        description="Validate a plan against a model built on the meta device and print, per parameter, "
                    "the matched rule, layout, local shapes after tp and fsdp, and bytes per device.")
    parser.add_argument("--model", default="gpt-tiny", choices=sorted(MODELS),
                        help="a registered model (default: gpt-tiny)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--plan", type=Path, help="a plan file (.json, .yaml or .yml)")
    source.add_argument("--mesh", help="mesh axes such as 'fsdp=2,tp=2'; uses the model's built-in layout rules")
    parser.add_argument("--world-size", type=int, default=None, help="number of devices (needed for a -1 axis)")
    parser.add_argument("--width", type=int, default=160, help="text width of the tables (default: 160)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    entry = model_entry(args.model)
    if args.plan is not None:
        plan = Plan.load(args.plan)
    else:
        mesh = Mesh.parse(args.mesh)
        plan = Plan(mesh, rules=entry.rules_for(mesh))
    if not plan.mesh.is_resolved and args.world_size is None:
        raise PlanError(f"{plan.mesh!r} has an inferred (-1) axis; pass --world-size N to infer it")
    print(explain_plan(plan, meta_model(entry.build), world_size=args.world_size, width=args.width), end="")
    return 0
