"""``shardkit calibrate``: measure the local world as it really runs (on its GPUs with NCCL, or CPU processes
on gloo, as ``shardkit train`` would run it) and save it as a hardware file::

    shardkit calibrate --world 4 --out local.yaml
    shardkit calibrate > local.yaml          # no --out: the file's text on stdout, the table on stderr

The file is what ``sk.Hardware.load`` reads and the planner's ``hardware=`` takes (docs/hardware.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..plan import Mesh, UsageError
from ..plan.dtypes import FLOATING
from ..plan.text import format_bytes, format_seconds
from ..planner.hardware import COLLECTIVES, SUFFIXES
from .options import DEFAULT_MESH, path, positive_int

if TYPE_CHECKING:
    from ..observe.calibrate import Calibration, Progress

#: The world ``shardkit train`` starts when given no flags: its default mesh's size.
DEFAULT_WORLD = Mesh.parse(DEFAULT_MESH).size


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="measure this machine's local world (matmul FLOP/s, collectives, memory bandwidth, "
             "op overhead, overlap) into a hardware file",
        description="Start a local world as 'shardkit train' does (a GPU per process with NCCL, else CPU processes "
                    "on gloo; SHARDKIT_BACKEND=gloo for the CPU) and measure it as it runs: "
                    "matrix-product FLOP/s per process with every process multiplying at once, and the backend's "
                    "all-reduce, all-gather and send/recv times over message sizes, fitted as latency + "
                    "bytes / bandwidth; memory bandwidth of a large add, the fixed cost of an operator call, and "
                    "how much an all-reduce loop overlaps a matmul loop. Saves a hardware file for the planner (docs/hardware.md).")
    parser.add_argument("--world", type=positive_int, default=DEFAULT_WORLD, metavar="N",
                        help=f"processes to measure, at least 2 (default: {DEFAULT_WORLD}, the world of "
                             f"'shardkit train' with its default mesh {DEFAULT_MESH})")
    parser.add_argument("--out", type=path, metavar="FILE",
                        help=f"hardware file to write ({', '.join(SUFFIXES)}); default: print it as YAML on stdout")
    parser.add_argument("--name", metavar="NAME", help="the hardware's name (default: local-N-BACKEND-DEVICE, e.g. local-4-gloo-cpu)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.world < 2:
        raise UsageError(f"--world {args.world}: collectives need at least 2 processes; pass --world 2 or more")
    if args.out is not None:  # before measuring: a bad path would waste the measurement
        if args.out.suffix not in SUFFIXES:
            raise UsageError(f"--out {str(args.out)!r}: a hardware file ends in {', '.join(SUFFIXES)}")
        if not args.out.parent.is_dir():
            raise UsageError(f"--out {str(args.out)!r}: folder {str(args.out.parent)!r} does not exist")
    if args.name is not None and not args.name.strip():
        raise UsageError(f"--name must be a non-empty name, got {args.name!r}")
    from ..observe.calibrate import measure

    with _progress_bar() as progress:
        calibration = measure(args.world, name=args.name, progress=progress)
    from rich.console import Console

    console = Console(stderr=args.out is None)
    if not console.is_terminal:  # a file or a pipe: rich's default of 80 columns would wrap the table
        console.width = 120
    console.print(_table(calibration))
    for note in calibration.notes:
        console.print(f"note: {note}", soft_wrap=True)
    if args.out is None:
        import yaml

        sys.stdout.write(yaml.safe_dump(calibration.hardware.to_dict(), sort_keys=False))
    else:
        calibration.hardware.save(args.out)
        console.print(f"shardkit calibrate: wrote {args.out} (hardware {calibration.hardware.name!r}); "
                      f"use it as --hardware {args.out} or sk.Hardware.load({str(args.out)!r})", soft_wrap=True)
    return 0


def _table(calibration: Calibration):
    """What was measured: FLOP/s per dtype, each collective's fit and residual, memory."""
    from rich.table import Table

    from ..observe.calibrate import bandwidth_bytes

    hw, backend = calibration.hardware, calibration.backend
    table = Table(title=f"{hw.name}: {hw.devices_per_node} {backend} processes, measured in "
                        f"{format_seconds(calibration.seconds)}", title_justify="left", title_style="bold")
    for column in ("measure", "per process", "latency per step", "fit residual", "how"):
        table.add_column(column)
    for dtype in FLOATING:
        best = calibration.matmul[dtype]
        how = f"best of the size sweep: n={best[0]}" if best else \
            f"does not run on this {calibration.device}: bfloat16's figure"
        table.add_row(f"matmul {dtype}", f"{hw.flops[dtype] / 1e9:.3g} GFLOP/s", "", "", how)
    for collective in COLLECTIVES:
        fit = calibration.fits[collective]
        table.add_row(f"{backend} {collective}", f"{format_bytes(fit.link.bandwidth)}/s", format_seconds(fit.link.latency),
                      f"{fit.residual:.0%}", f"{len(fit.sizes)} sizes, {format_bytes(min(fit.sizes))} to "
                                             f"{format_bytes(max(fit.sizes))}")
    table.add_row("memory bandwidth", f"{format_bytes(hw.memory_bandwidth)}/s", "", "",
                  f"layer norm, GeLU, add on {format_bytes(bandwidth_bytes(backend))}, forward+backward: "
                  f"bytes booked / time")
    table.add_row("attention", f"{hw.attention_efficiency:.0%}", "", "",
                  "SDPA's causal attention forward+backward, its FLOPs / time, of the matmul rate")
    table.add_row("op overhead", format_seconds(hw.op_overhead), "", "",
                  f"Linear(4, 4) forward+backward / {calibration.ops_per_step} aten ops")
    table.add_row("DTensor op overhead", format_seconds(hw.dtensor_overhead), "", "",
                  "the same step on replicated DTensors, less the plain step, per DTensor operator")
    table.add_row("DTensor collective", format_seconds(hw.dtensor_collective), "", "",
                  "a tiny sequence-parallel block on DTensors against plain tensors, per collective, "
                  "less its dispatch and the raw all-gather")
    table.add_row("skew", f"{format_seconds(hw.skew)}/√s", "", "",
                  "products, a blocking all-reduce: the wait for the last rank / √compute")
    table.add_row("sync idle", format_seconds(hw.sync_idle), "", "",
                  "a tiny all-reduce in a loop: its idle time less the all-reduce link's latency")
    overlap = calibration.overlap
    table.add_row("overlap", f"{hw.overlap:.0%}", "", "",
                  f"matmuls {format_seconds(overlap.compute)}, all-reduces {format_seconds(overlap.communication)}, "
                  f"both {format_seconds(overlap.both)}")
    table.add_row("memory", format_bytes(hw.memory), "", "",
                  "RAM shared by the processes (note below)" if calibration.device == "cpu" else "each GPU's total")
    return table


@contextmanager
def _progress_bar() -> Iterator[Progress]:
    """A rich bar of the measurements done, on stderr when it is a terminal (nothing otherwise)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("calibrate {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("", total=None)
        yield lambda done, total, what: bar.update(task, completed=done, total=total, description=what)
