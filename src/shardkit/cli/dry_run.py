"""``shardkit train --dry-run``: one training step of one rank (or a few) of the job's world, in this
process, on fake tensors and torch's fake process group (``sk.dry_run``); prints each rank's bytes
by component beside ``sk.estimate``'s, its collectives, and which component overflows a device::

    shardkit train --dry-run --model llama-tiny --mesh fsdp=8,tp=8 --world-size 64 --ranks 0,9
    shardkit train --dry-run --model shardkit.models.hf:build_llama_70b --mesh pp=4,fsdp=16,tp=8 \\
        --world-size 512 --recompute full --batch-size 64 --seq-len 8192 --device-memory 80GiB

Exits 1 when a rank's peak does not fit the device memory.
"""

from __future__ import annotations

import argparse
import sys

from ..plan.text import parse_bytes
from ..training.config import TrainConfig


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give ranks as numbers separated by commas, e.g. 0,5") from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"{text!r}: ranks are 0 or more")
    return ranks


def _memory(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_options(parser: argparse.ArgumentParser) -> None:
    """``--dry-run``, ``--ranks`` and ``--device-memory`` on ``shardkit train``'s parser."""
    group = parser.add_argument_group("dry run (docs/dry-run.md)")
    group.add_argument("--dry-run", action="store_true",
                       help="run one step of the chosen ranks of a --world-size world in this process on fake tensors "
                            "(no memory, no communication): exact bytes per component beside the estimate, and the "
                            "collectives")
    group.add_argument("--ranks", type=_ranks, metavar="R,R",
                       help="with --dry-run: the ranks to run, on any pipeline stage (default: 0, and with a pipeline "
                            "the last stage's first rank too)")
    group.add_argument("--device-memory", type=_memory, metavar="BYTES",
                       help="with --dry-run: the memory of one device, as 80GiB (default: the H100's 80 GiB)")


def run(args: argparse.Namespace, config: TrainConfig) -> int:
    """The dry run of ``config``'s job; prints the table, returns 1 if a rank would not fit."""
    from ..plan import UsageError
    from ..training.checks import model_positions
    from ..training.dry_run import dry_run
    from ..training.model import meta_model_from_flag, model_from_flag
    from ..training.plans import job_plan

    plan, world_size = job_plan(config)
    outside = [r for r in args.ranks or () if r >= world_size]
    if outside:
        raise UsageError(f"--ranks {','.join(map(str, args.ranks))}: the world has {world_size} ranks (0 to "
                         f"{world_size - 1})")
    entry = model_from_flag(config.model)
    seq_len = config.seq_len or model_positions(config, entry, meta_model_from_flag(config.model, entry))
    # the state the run's optimizer keeps: SGD's one tensor per parameter only with momentum
    optimizer = "sgd-momentum" if config.optimizer == "sgd" and config.momentum else config.optimizer
    result = dry_run(entry.build, plan, world_size=world_size, batch=config.batch_size, seq_len=seq_len,
                     ranks=args.ranks, loss_fn=entry.loss_fn, optimizer=optimizer, device_memory=args.device_memory,
                     grad_accum=config.grad_accum)
    print(result.summary())
    if result.overflows():
        print("shardkit train --dry-run: the plan does not fit", file=sys.stderr)
        return 1
    return 0


__all__ = ["add_options", "run"]
