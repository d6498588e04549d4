"""``shardkit explain``: what every device would hold under a plan, before anything starts.

The model is built on the meta device (no memory) and no process is started. It takes the
plan flags of ``shardkit train``, so a plan can be explained before it is trained::

    shardkit explain --model llama-70b --mesh fsdp=-1,tp=8 --world-size 64
    shardkit explain --model gpt-tiny --plan plan.yaml
    shardkit explain --model mypkg.models:build --mesh fsdp=2,tp=2 --rules rules.yaml
"""

from __future__ import annotations

import argparse

from ..models.registry import MODELS
from ..planner.explain import explain_plan
from .options import (
    add_model_option,
    add_plan_options,
    meta_model_from_flag,
    model_from_flag,
    plan_from_args,
    positive_int,
    rules_hint,
)

DEFAULT_MODEL = "gpt-tiny"
DEFAULT_WIDTH = 180


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain", help="show what each device holds under a plan (no processes started)",
        description="Validate a plan against a model built on the meta device and print, per parameter, "
                    "the matched rule, layout, local shapes after tp and fsdp, and bytes per device.")
    add_model_option(parser, DEFAULT_MODEL, sorted(MODELS))
    add_plan_options(parser)
    parser.add_argument("--width", type=positive_int, default=DEFAULT_WIDTH, metavar="N",
                        help=f"text width of the tables (default: {DEFAULT_WIDTH})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    entry = model_from_flag(args.model)
    plan, world_size = plan_from_args(args, entry)
    model = meta_model_from_flag(args.model, entry)
    with rules_hint(args):
        text = explain_plan(plan, model, world_size=world_size, width=args.width)
    print(text, end="")
    return 0
