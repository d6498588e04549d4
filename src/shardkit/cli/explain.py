"""``shardkit explain``: what every device would hold under a plan, before anything starts.

The model is built on the meta device (no memory) and no process is started. It takes the
plan flags of ``shardkit train``, so a plan can be explained before it is trained::

    shardkit explain --model llama-70b --mesh fsdp=-1,tp=8 --world-size 64
    shardkit explain --model gpt-tiny --plan plan.yaml
    shardkit explain --model mypkg.models:build --mesh fsdp=2,tp=2 --rules rules.yaml

With ``ep``, the tables are followed by which experts each rank holds and every MoE layer's
all-to-all (counts, rows out and back, their gradients: bytes per rank for ``--batch-size``
sequences of ``--seq-len`` tokens at balanced routing). After them comes the plan's estimate
(``sk.estimate``): memory per device by component, step time by part, tokens/s and MFU on
``--hardware``, and for a mixture of experts its experts per device, active parameters and
all-to-all per step.
"""

from __future__ import annotations

import argparse

from ..models.registry import MODELS
from ..plan import PlanError, UsageError
from ..planner.hardware import PRESETS
from .options import add_model_option, meta_model_from_flag, model_from_flag, positive_int
from .plan_flags import add_plan_options, plan_from_args, rules_hint

DEFAULT_MODEL = "gpt-tiny"
DEFAULT_WIDTH = 180
DEFAULT_HARDWARE = "h100-80g"
DEFAULT_BATCH = 8


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain", help="show what each device holds under a plan (no processes started)",
        description="Validate a plan against a model built on the meta device and print, per parameter, "
                    "the matched rule, layout, local shapes after tp and fsdp, and bytes per device.")
    add_model_option(parser, DEFAULT_MODEL, sorted(MODELS))
    add_plan_options(parser)
    parser.add_argument("--width", type=positive_int, default=DEFAULT_WIDTH, metavar="N",
                        help=f"text width of the tables (default: {DEFAULT_WIDTH})")
    cost = parser.add_argument_group("the estimate (sk.estimate)")
    cost.add_argument("--hardware", default=DEFAULT_HARDWARE, metavar="PRESET|FILE",
                      help=f"a preset ({', '.join(PRESETS)}; default {DEFAULT_HARDWARE}) or a hardware file")
    cost.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH, metavar="N",
                      help=f"global batch in sequences (default: {DEFAULT_BATCH})")
    cost.add_argument("--seq-len", type=positive_int, metavar="N", help="tokens per sequence (default: the model's)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..families import token_sizes
    from ..planner.explain import explain_plan

    entry = model_from_flag(args.model)
    plan, world_size = plan_from_args(args, entry)
    model = meta_model_from_flag(args.model, entry)
    positions = entry.seq_len if entry.seq_len is not None else token_sizes(model)[1]
    with rules_hint(args):
        text = explain_plan(plan, model, world_size=world_size, width=args.width, batch_size=args.batch_size,
                            seq_len=args.seq_len or positions)
    print(text, end="")
    print(estimate_text(args, plan, model, positions, world_size))
    return 0


def estimate_text(args: argparse.Namespace, plan, model, positions: int | None, world_size: int) -> str:
    """The estimate's lines, or why there is none (a model sk.estimate cannot analyse)."""
    from ..planner.estimate import estimate

    seq_len = args.seq_len or positions
    if seq_len is None:
        return "\nestimate: pass --seq-len N (the model's positions are not known)"
    try:
        e = estimate(model, plan, batch_size=args.batch_size, seq_len=seq_len, hardware=args.hardware,
                     world_size=world_size)
    except PlanError as exc:
        return f"\nestimate: none for --batch-size {args.batch_size} x --seq-len {seq_len}: {exc}"
    except UsageError as exc:
        if "hardware" in str(exc):
            raise
        return f"\nestimate: none ({exc})"
    return (f"\nestimate (sk.estimate) on {e.hardware.name}, {args.batch_size} sequences x {seq_len} tokens per "
            f"step:\n{e.summary()}")
