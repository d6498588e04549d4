"""The one prepared check to run when a GPU machine is lent (docs/gpu.md): a table of results under $OUT.

First the versions: torch, CUDA, NCCL; a torch older than the one pinned in ``constraints.txt``
stops the run (exit 3). Then every check of ``benchmarks/gpu_check_jobs.py``, each within its
time bound, each a row ``ok`` / ``FAIL`` / ``skipped: <reason>``:

- on one device (a world of one process): meta build + verify, bfloat16 verify, float16 with
  loss scaling, ``shardkit train`` (its printed step time against CUDA events around the same
  steps), its step timer against CUDA events, ring attention against SDPA (output; memory on
  CUDA only, bounded by SDPA's measured peak), checkpoint save/load/export, generation by logits,
  the serving engine (greedy against transformers' generate, seeded temperature-1 sampling);
- on ``--world`` devices: every strategy and mix verified against one process (dp, fsdp, tp,
  Megatron tp+sp, sp, ep with uneven all_to_all splits, HSDP and fsdp x tp on 4 or more,
  pp x fsdp x tp on 8, pipelines with a tied embedding under 1f1b, gpipe, interleaved-1f1b and
  zbv, zero=1, recompute), sp=2 ring attention with a 64 MiB accumulator within 120 s,
  ``shardkit train --profile``'s step spans against CUDA events, generation under tp and pp,
  the serving engine under tp, checkpoints under fsdp, the dry run's bytes against the CUDA
  allocator's peak, a deliberately hung rank (a timeout report, not SIGABRT), ``torchrun ...
  --plan auto``.

On CUDA (NCCL) when there is a GPU per rank, at the full sizes; otherwise on a gloo world of
local CPU processes at tiny sizes, where the rows that need CUDA say ``skipped: no CUDA``.
Writes ``gpu_check.md`` and ``gpu_check.json`` to ``--out`` after every row (a killed run
keeps its rows) and exits 1 when a row failed. Run by ``benchmarks/gpu_check.sh``.

    python benchmarks/gpu_check.py [--world N] [--only NAMES] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shardkit.runtime.devices import clock

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Check:
    """One row: its name, the check (``gpu_check_jobs``), where it runs, its time bound."""

    name: str
    run: Callable
    multi: bool  # on --world processes, else on a world of one
    limit_s: float  # at the full sizes, on CUDA (the tiny sizes get at most this too)


def checks() -> list[Check]:
    """Every row, in the order they run (the cheap single-device ones first)."""
    import gpu_check_jobs as jobs

    one = [("meta verify", jobs.meta_verify, 60), ("bf16 verify", jobs.bf16_verify, 60),
           ("fp16 scaled verify", jobs.fp16_scaled_verify, 60), ("train cli", jobs.train_cli, 90),
           ("step time vs events", jobs.step_time, 60), ("ring vs sdpa output", jobs.ring_output, 90),
           ("ring vs sdpa memory", jobs.ring_memory, 90), ("checkpoint", jobs.checkpoint_one, 60),
           ("generate", jobs.generate_one, 60), ("serve", jobs.serve_one, 60)]
    strategies = ["dp", "fsdp", "tp", "tp+sp", "sp", "ep", "hsdp", "fsdp x tp", "pp x fsdp x tp", "pp 1f1b",
                  "pp gpipe", "pp interleaved", "pp zbv", "zero=1", "recompute"]
    multi = [*((f"verify {s}", partial(jobs.verify_strategy, name=s), 60) for s in strategies),
             ("sp=2 ring bf16 vs sdpa", jobs.ring_sp2_output, 90), ("sp=2 accumulator", jobs.sp_accumulator, 120), ("profile vs events", jobs.profile_events, 90),
             ("generate tp", jobs.generate_tp, 60), ("generate pp", jobs.generate_pp, 60),
             ("serve tp", jobs.serve_tp, 60), ("checkpoint fsdp", jobs.checkpoint_multi, 60),
             ("dry run vs cuda peak", jobs.dry_run_memory, 60), ("hung rank", jobs.hung_rank, 60),
             ("torchrun plan auto", jobs.torchrun_plan_auto, 150)]
    return [*(Check(f"one: {n}", f, False, t) for n, f, t in one),
            *(Check(f"world: {n}", f, True, t) for n, f, t in multi)]


# -- versions ------------------------------------------------------------------------------------------------
def pinned_torch(constraints: Path = ROOT / "constraints.txt") -> str:
    """The torch version ``constraints.txt`` pins (``torch==X``)."""
    found = re.search(r"^torch==([\w.]+)", constraints.read_text(), flags=re.M)
    if not found:
        raise SystemExit(f"{constraints} pins no torch version (torch==X)")
    return found.group(1)


def release(version: str) -> tuple[int, ...]:
    """``'2.13.0+cu128'`` -> ``(2, 13, 0)``: the release numbers, local and pre-release tags dropped.

    >>> release("2.13.0+cu128") < release("2.13.1"), release("2.14.0.dev20260101") >= release("2.13.0")
    (True, True)
    """
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


#: What shardkit and the checks import besides torch (pyproject's dependencies, transformers, safetensors).
MODULES = ("numpy", "yaml", "rich", "matplotlib", "tensorboard", "transformers", "safetensors")


def versions() -> dict[str, Any]:
    """torch's, CUDA's and NCCL's versions, the pinned torch, the GPUs, and the modules this python lacks."""
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {"torch": torch.__version__, "pinned torch": pinned_torch(), "cuda": torch.version.cuda,
            "nccl": nccl, "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "python": sys.version.split()[0],
            "missing modules": [m for m in MODULES if importlib.util.find_spec(m) is None] or None}


def gate(found: dict[str, Any]) -> str | None:
    """Why the run must stop (a torch older than the pinned one), or None."""
    if release(found["torch"]) < release(found["pinned torch"]):
        return (f"torch {found['torch']} is older than the pinned {found['pinned torch']} (constraints.txt): "
                f"install torch>={found['pinned torch']} or run on a machine that has it")
    return None


# -- running the rows ----------------------------------------------------------------------------------------
@dataclass
class Row:
    check: str
    status: str  # "ok", "FAIL" or "skipped: <reason>"
    seconds: float
    detail: str


class Worlds:
    """Local worlds by size, started when first asked for and again after a job that stopped one."""

    def __init__(self) -> None:
        self._worlds: dict[int, Any] = {}

    def __call__(self, size: int):
        import shardkit as sk

        world = self._worlds.get(size)
        if world is None or not world.alive:
            world = self._worlds[size] = sk.LocalWorld(size)
        return world

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()


class _OverTime(Exception):
    pass


@contextmanager
def _alarm(seconds: float):
    """Raise in this (main) thread after ``seconds``: the bound of work that has no timeout of its own."""
    if sys.platform == "win32" or seconds <= 0:
        yield
        return

    def ring(*_):
        raise _OverTime

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_check(check: Check, env) -> Row:
    """One row: the check's result, or FAIL (wrong, raised, or over its time bound), or skipped."""
    import gpu_check_jobs as jobs

    began, backstop = clock(), env.limit_s + min(15.0, env.limit_s)
    try:
        with _alarm(backstop):  # world jobs and subprocesses stop at limit_s themselves
            status, detail = "ok", check.run(env)
    except jobs.Skipped as exc:
        status, detail = f"skipped: {exc}", ""
    except jobs.Failed as exc:
        status, detail = "FAIL", str(exc)
    except _OverTime:
        status, detail = "FAIL", f"still running after {backstop:.1f} s"
    except Exception as exc:  # noqa: BLE001 - every error is a row of the table
        lines = str(exc).strip().splitlines() or [""]
        status, detail = "FAIL", f"{type(exc).__name__}: {lines[0][:300]}"
    took = clock() - began
    if status == "ok" and took > env.limit_s:
        status, detail = "FAIL", f"took {took:.0f} s, over its bound of {env.limit_s:.0f} s; {detail}"
    return Row(check.name, status, round(took, 1), detail)


def write_table(out: Path, found: dict[str, Any], where: str, rows: list[Row]) -> None:
    lines = [f"# shardkit GPU check: {where}", "",
             "versions: " + ", ".join(f"{k} {v}" for k, v in found.items()), "",
             "| check | result | seconds | detail |", "| --- | --- | --- | --- |",
             *(f"| {r.check} | {r.status} | {r.seconds:.1f} | {r.detail.replace('|', '/')} |" for r in rows)]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_check.json").write_text(json.dumps({"where": where, "versions": found,
                                                    "rows": [asdict(r) for r in rows]}, indent=1))


def selected(all_checks: list[Check], only: str | None) -> list[Check]:
    """The checks ``--only`` names (each name a whole check name or its beginning); all without it."""
    if not only:
        return all_checks
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if not any(c.name.startswith(n) for c in all_checks)]
    if unknown:
        raise SystemExit(f"--only {unknown}: no such check; the checks are: {[c.name for c in all_checks]}")
    return [c for c in all_checks if any(c.name.startswith(n) for n in names)]


def run_checks(args: argparse.Namespace, worlds: Callable[[int], Any]) -> list[Row]:
    """Every selected check on ``worlds`` (``size -> live LocalWorld``); the table is written after each row."""
    import gpu_check_jobs as jobs

    found = versions()
    gpus = found["gpus"]
    sizes = jobs.FULL if (args.size or ("full" if gpus >= args.world else "tiny")) == "full" else jobs.TINY
    where = (f"{args.world} CUDA GPU(s), NCCL" if gpus >= args.world else
             f"{args.world} CPU processes, gloo ({gpus} GPU(s) seen)") + f", {sizes.name} sizes"
    args.out.mkdir(parents=True, exist_ok=True)
    budget = args.budget or (420.0 if args.world <= 1 else 540.0) * sizes.slack
    deadline = clock() + budget
    rows: list[Row] = []
    for check in selected(checks(), args.only):
        cuda = gpus >= (args.world if check.multi else 1)
        left = deadline - clock()  # no row runs past the budget: its bound is what is left
        env = jobs.Env(sizes=sizes, world=args.world, cuda=cuda, worlds=worlds, out=args.out.resolve(),
                       limit_s=min(check.limit_s * sizes.slack, left))
        if left < 5:
            rows.append(Row(check.name, "FAIL", 0.0, f"not run: the budget of {budget:.0f} s is spent"))
        elif check.multi and args.world < 2:
            rows.append(Row(check.name, "skipped: --world 1", 0.0, ""))
        else:
            rows.append(run_check(check, env))
        print(f"  {rows[-1].check}: {rows[-1].status} ({rows[-1].seconds:.1f} s) {rows[-1].detail}", flush=True)
        write_table(args.out, found, where, rows)
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser.add_argument("--world", type=int, default=gpus or 2,
                        help="processes of the multi-device rows (default: every GPU, else 2 CPU processes)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"),
                        help="where gpu_check.md and gpu_check.json go (default: $OUT)")
    parser.add_argument("--only", help="comma-separated check names or prefixes, e.g. 'one: meta,world: verify'")
    parser.add_argument("--size", choices=("full", "tiny"), help="default: full on CUDA, tiny on CPU")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for every row together; a row is cut at it, the rows after it are FAIL, "
                             "not run (default: 420 on one device, 540 on more; 3x that at the tiny sizes)")
    parser.add_argument("--gate", action="store_true", help="print the versions, stop on an old torch, run nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, worlds: Callable[[int], Any] | None = None) -> int:
    args = parse(argv)
    found = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    problem = gate(found)
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 3
    if args.gate:
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check_jobs, in this and the world's processes
    own = worlds is None
    worlds = Worlds() if own else worlds
    try:
        rows = run_checks(args, worlds)
    finally:
        if own:
            worlds.close()
    print((args.out / "gpu_check.md").read_text(), end="")
    failed = [r.check for r in rows if r.status == "FAIL"]
    print(f"{len(rows) - len(failed)} of {len(rows)} rows passed or skipped; table in {args.out}/gpu_check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
