"""How much `shardkit calibrate`'s noisiest figures move between measurements on this machine.

Runs the probes behind the per-operator and compute figures (float32 products, the operator and
DTensor overheads, DTensor's collectives, the skew) ``--repeats`` times in one local world and
prints each figure's median, range and coefficient of variation, with the load average. The
baseline a change to a probe is judged against is the same command before the change, in the
same conditions: run both, one after the other.

    PYTHONPATH=src python benchmarks/calibration_spread.py [--world 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.observe import dtensor_probes, probes
from shardkit.observe.calibrate import SECONDS_PER_SIZE
from shardkit.observe.fits import fit_skew
from shardkit.runtime.world import launch

FIGURES = {"float32 products": "GFLOP/s", "op overhead": "µs", "DTensor op overhead": "µs",
           "DTensor collective": "µs", "skew": "ms/√s"}


def once(world: sk.LocalWorld, seconds: float) -> dict[str, float]:
    """One measurement of each figure, as ``shardkit calibrate`` takes it, in :data:`FIGURES`' units."""
    per_rank = launch(probes.matmul_job, world=world, dtype="float32", sizes=(128, 256, 512, 1024), seconds=seconds)
    products = max(min(rank[i][1] for rank in per_rank) for i in range(len(per_rank[0])))
    dtensor = launch(dtensor_probes.dtensor_overhead_job, world=world, seconds=seconds)[0][1]
    return {"float32 products": products / 1e9,
            "op overhead": launch(probes.overhead_job, world=world, seconds=seconds)[0][1] * 1e6,
            "DTensor op overhead": dtensor * 1e6,
            "DTensor collective": launch(dtensor_probes.dtensor_collective_job, world=world, seconds=seconds,
                                         dtensor_overhead=dtensor)[0] * 1e6,
            "skew": fit_skew(launch(probes.skew_job, world=world, seconds=2 * seconds)[0]) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    console = Console()
    with open("/proc/loadavg") as load:
        start = load.read().split()[0]
    with sk.LocalWorld(args.world) as world:
        runs = [once(world, SECONDS_PER_SIZE) for _ in range(args.repeats)]
    with open("/proc/loadavg") as load:
        end = load.read().split()[0]
    table = Table("figure", "unit", "median", "min", "max", "cv",
                  title=f"{args.repeats} calibrations' probes, {args.world} processes (load {start} -> {end})")
    for name, unit in FIGURES.items():
        values = [run[name] for run in runs]
        table.add_row(name, unit, f"{statistics.median(values):.1f}", f"{min(values):.1f}", f"{max(values):.1f}",
                      f"{statistics.pstdev(values) / statistics.mean(values):.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
