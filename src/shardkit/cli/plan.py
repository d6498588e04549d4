"""``shardkit plan``: the best plans for a language model on a number of devices, before any device is used.

::

    shardkit plan --model llama3-70b --devices 64 --hardware h100-80g --global-batch 512 --seq 8192
    shardkit plan --model gpt-small --local --out plan.yaml
    shardkit plan --model mypkg.models:build --devices 8 --global-batch 64 --seq 2048 --rules rules.yaml

The planner plans causal language models over token ids (a token embedding, repeated blocks,
a head: transformers' ``*ForCausalLM``, shardkit's GPT); any other model is refused by name
(``shardkit explain`` and ``shardkit train`` still take its plans, written by hand).

Prints the ranked candidates (degrees, memory by component, step time, tokens/s, MFU and why),
then the families of plans refused and why, and writes the best with ``--out``. ``--local``
plans for the local world as it really runs, on the devices and backend it will use (a GPU per
process with NCCL, else CPU processes on gloo: runtime/devices.py): its hardware is measured by
``shardkit calibrate`` (once, kept in ``$SHARDKIT_CACHE`` or ``~/.cache/shardkit`` under a name
that says the backend and the device, e.g. ``local-4-gloo-cpu.yaml``; ``--recalibrate`` measures again).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..plan import UsageError
from ..plan.text import format_bytes, format_seconds
from ..planner.catalogue import CATALOGUE
from ..planner.hardware import PRESETS, Hardware, hardware
from ..planner.space import AXES, OPTIMIZER_STATES
from .options import model_from_flag, path, positive_int
from .plan_flags import add_rules_option, load_rules

if TYPE_CHECKING:
    from ..planner.autoshard import Candidates

#: The local world's size when none is given (the world ``shardkit train`` starts with no flags).
DEFAULT_LOCAL_WORLD = 4


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="rank the plans of a language model on N devices by estimated step time (no processes started)",
        description="Estimate every plan of a causal language model over token ids (dp, fsdp, tp, pp, sp degrees, "
                    "and ep for a mixture of experts; "
                    "micro-batches, schedule, recompute, resharding) on N devices of a hardware and print the best, "
                    "with memory per device by component, step time, tokens/s and MFU, and the families refused and "
                    "why. Other models (encoders, vision models, other inputs) are refused by name: write their "
                    "plans by hand (shardkit explain checks them).")
    parser.add_argument("--model", required=True, metavar="NAME",
                        help=f"a catalogue name ({', '.join(sorted(CATALOGUE))}), a registered model, or a "
                             f"builder as package.module:function")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--devices", type=positive_int, metavar="N", help="number of devices")
    where.add_argument("--local", action="store_true",
                       help=f"the local world (--world-size processes, default {DEFAULT_LOCAL_WORLD}, on the GPUs or the "
                            f"CPU as shardkit train runs it), with hardware measured by shardkit calibrate")
    parser.add_argument("--world-size", type=positive_int, metavar="N", help="processes of the local world (--local)")
    parser.add_argument("--recalibrate", action="store_true", help="measure the local world again (--local)")
    parser.add_argument("--hardware", metavar="PRESET|FILE",
                        help=f"a preset ({', '.join(PRESETS)}; default h100-80g) or a hardware file")
    parser.add_argument("--global-batch", type=positive_int, required=True, metavar="N",
                        help="sequences per optimizer step, over all devices")
    parser.add_argument("--seq", type=positive_int, required=True, metavar="N", help="sequence length in tokens")
    parser.add_argument("--axes", metavar="AXES", help=f"axes to search, comma-separated (default: {','.join(AXES)})")
    add_rules_option(parser, "; read only when tp is searched")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    parser.add_argument("--top", type=positive_int, default=10, metavar="N", help="candidates shown (default 10)")
    parser.add_argument("--out", type=path, metavar="FILE", help="write the best plan (.yaml or .json)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..planner.autoshard import autoshard

    model = planner_model(args.model)
    if args.local:
        if args.hardware is not None:
            raise UsageError("--local measures the local world's hardware; drop --hardware (or use --devices)")
        devices = args.world_size or DEFAULT_LOCAL_WORLD
        hw = local_hardware(devices, recalibrate=args.recalibrate)
    else:
        for flag, given in (("--world-size", args.world_size), ("--recalibrate", args.recalibrate)):
            if given:
                raise UsageError(f"{flag} is for --local; with --devices give the hardware with --hardware")
        devices, hw = args.devices, hardware(args.hardware or "h100-80g")
    axes = None if args.axes is None else parse_axes(args.axes)
    searched = AXES if axes is None else axes
    rules = load_rules(args.rules) if args.rules is not None and "tp" in searched else None
    if args.rules is not None and rules is None:
        print(f"--rules {args.rules}: not read, tp is not searched (--axes {args.axes})")
    candidates = autoshard(model, devices=devices, hardware=hw, global_batch=args.global_batch, seq_len=args.seq,
                           axes=axes, top=args.top, optimizer=args.optimizer, rules=rules)
    print(candidates_text(candidates, args.model, devices, hw), end="")
    if args.out is not None:
        best = candidates[0]
        best.plan.save(args.out)
        steps = f" (estimated with {best.grad_accum} gradient accumulation steps: a plan file does not hold " \
                f"them, train with --grad-accum {best.grad_accum})" if best.grad_accum > 1 else ""
        print(f"wrote the best plan to {args.out}{steps}")
    return 0


def planner_model(name: str) -> Any:
    """What ``--model`` names for the planner: a catalogue name as is, else the model built on meta."""
    if name in CATALOGUE:
        return name
    return model_from_flag(name).on_meta()


def parse_axes(text: str) -> tuple[str, ...]:
    axes = tuple(a.strip() for a in text.split(","))
    if not text.strip() or any(not a for a in axes):
        raise UsageError(f"--axes {text!r}: give axis names separated by commas, e.g. dp,tp,pp")
    return axes


def local_hardware(world_size: int | None, recalibrate: bool = False) -> Hardware:
    """The hardware of the world that will run (the local world of ``world_size`` processes, or under
    ``torchrun`` the torchrun world, every rank calling this): measured once by ``shardkit calibrate`` on
    its own devices and backend and kept under :func:`local_hardware_dir`, or measured now
    (:func:`shardkit.observe.calibrate.cached`)."""
    from ..observe.calibrate import cached

    return cached(world_size, local_hardware_dir(), recalibrate=recalibrate,
                  say=lambda line: print(line, file=sys.stderr, flush=True))


def local_hardware_dir() -> Path | None:
    """Where the calibrated hardware of worlds is kept: ``$SHARDKIT_CACHE`` or ``~/.cache/shardkit``
    (``None`` with ``SHARDKIT_CACHE=off``: measured every time, kept nowhere)."""
    chosen = os.environ.get("SHARDKIT_CACHE")
    if chosen == "off":
        return None
    return Path(chosen or Path.home() / ".cache" / "shardkit")


def candidates_text(candidates: Candidates, model: str, devices: int, hw: Hardware, width: int = 200) -> str:
    """The candidates and the refused families as tables."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    style: dict[str, Any] = dict(box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, show_edge=False)
    console = Console(record=True, width=width, file=io.StringIO(), color_system=None, markup=False, highlight=False)
    console.print(f"Plans for {model} on {devices} x {hw.name} ({format_bytes(hw.memory, digits=1)} each): "
                  f"{candidates.considered:,} options estimated, best {len(candidates)} shown\n")
    table = Table("#", "mesh", "pipeline", "accum", "recompute", "reshard", "params+grads+optim", "activations", "other",
                  "memory", "step", "tokens/s", "MFU", "why", title="candidates (fastest first)", **style)
    for index, c in enumerate(candidates):
        plan, e = c.plan, c.estimate
        mem = e.memory
        state = mem["parameters"] + mem["gradients"] + mem["optimizer"]
        other = mem["total"] - state - mem["activations"]
        pipeline = (f"{plan.pipeline.schedule} m={plan.pipeline.microbatches}" if plan.pipeline else "-")
        table.add_row(str(index + 1), _mesh(plan), pipeline, str(c.grad_accum), plan.recompute,
                      str(plan.fsdp.reshard_after_forward) if plan.mesh.size_of("fsdp") > 1 else "-",
                      format_bytes(state, digits=1), format_bytes(mem["activations"], digits=1),
                      format_bytes(other, digits=1), format_bytes(mem["total"], digits=1),
                      format_seconds(e.step_time), f"{e.tokens_per_s:,.0f}", f"{100 * e.mfu:.1f}%", c.reason)
    console.print(table)
    if candidates.rejected:
        refused = Table("family", "why not", title="\nrefused", **style)
        for r in candidates.rejected:
            refused.add_row(r.family, r.reason)
        console.print(refused)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def _mesh(plan) -> str:
    return " ".join(f"{a}={s}" for a, s in plan.mesh.items())



__all__ = ["candidates_text", "local_hardware", "local_hardware_dir", "parse_axes", "planner_model"]
