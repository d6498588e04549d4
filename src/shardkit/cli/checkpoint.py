"""``shardkit checkpoint``: look into checkpoints written by ``sk.save`` (no processes started)::

    shardkit checkpoint inspect runs/gpt                   # the latest complete checkpoint in the folder
    shardkit checkpoint inspect runs/gpt/step-00000100     # that one
    shardkit checkpoint convert runs/gpt --to hf exported  # a HuggingFace folder (safetensors + config)

``inspect`` prints the step, the plan, every tensor (name, shape, dtype, bytes) and every file
with its sha256 checked against the manifest; a damaged checkpoint exits 2 with one line naming
each damaged file and the tensors in it. See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..checkpoint.manifest import (
    CheckpointError,
    FileEntry,
    Manifest,
    checksum_problems,
    damage_message,
    size_problems,
)
from ..checkpoint.steps import checkpoint_to_load, checkpoints_beside, complete_checkpoints
from ..plan import UsageError
from ..plan.dtypes import FLOATING, torch_dtype
from ..plan.text import format_bytes
from .options import path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "checkpoint", help="look into checkpoints written by sk.save",
        description="Checkpoints written by sk.save / shardkit train: a folder of step-* folders, each with "
                    "DCP's files, every rank's RNG states and a manifest (docs/checkpoints.md).")
    actions = parser.add_subparsers(dest="action", required=True)
    inspect = actions.add_parser(
        "inspect", help="step, plan, tensors and files of a checkpoint, every file's sha256 checked",
        description="Print a checkpoint's step, plan, tensors (name, shape, dtype, bytes) and files, reading "
                    "every file to compare its size and sha256 with the manifest; exit 2 naming each damaged "
                    "file and the tensors stored in it.")
    inspect.add_argument("folder", type=path, metavar="DIR",
                         help="a checkpoint folder (step-*), or a folder of them: the latest complete one")
    inspect.set_defaults(func=run_inspect)
    convert = actions.add_parser(
        "convert", help="write a checkpoint's weights as a HuggingFace folder (no model, one process)",
        description="Write the weights of a checkpoint as a HuggingFace folder: model.safetensors, or "
                    "model-0000k-of-0000n.safetensors files with model.safetensors.index.json, and the "
                    "config.json saved with the checkpoint, so that from_pretrained reads it. Every file of the "
                    "checkpoint is checked first; tensors are read a file's worth at a time.")
    convert.add_argument("folder", type=path, metavar="DIR",
                         help="a checkpoint folder (step-*), or a folder of them: the latest complete one")
    convert.add_argument("--to", required=True, choices=("hf",), help="the format to write: hf (HuggingFace)")
    convert.add_argument("out", type=path, metavar="OUT", help="the folder to write (must not exist, or be empty)")
    convert.add_argument("--max-shard-size", default="2GB", metavar="SIZE",
                         help="the most bytes per .safetensors file, as 2GB, 500MB or 1GiB (default: 2GB)")
    convert.add_argument("--dtype", choices=sorted(FLOATING), help="cast floating tensors (default: as saved)")
    convert.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    convert.set_defaults(func=run_convert)


def run_inspect(args: argparse.Namespace) -> int:
    folder, manifest = checkpoint_to_load(args.folder)
    print(_summary(args.folder, folder, manifest))
    print(_tensor_table(folder))
    with _progress_bar(sum(entry.size for entry in manifest.files)) as advance:
        problems = {**size_problems(folder, manifest), **_checksums(folder, manifest, advance)}
    print(_file_table(manifest.files, problems))
    if problems:
        raise CheckpointError(damage_message(folder, manifest, problems, checkpoints_beside(folder)))
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from ..checkpoint.export import convert_to_hf
    from ..plan.text import parse_bytes

    try:
        parse_bytes(args.max_shard_size)
    except ValueError as error:
        raise UsageError(f"--max-shard-size: {error}") from None
    dtype = None if args.dtype is None else torch_dtype(args.dtype)
    with _tensor_bar() as advance:
        out = convert_to_hf(args.folder, args.out, max_shard_size=args.max_shard_size, dtype=dtype,
                            overwrite=args.overwrite, progress=lambda name, nbytes: advance(nbytes))
    files = sorted(p.name for p in out.iterdir())
    size = sum((out / name).stat().st_size for name in files)
    print(f"wrote {out}: {len(files)} files, {format_bytes(size)} ({', '.join(files[:4])}"
          f"{', ...' if len(files) > 4 else ''})")
    if "config.json" not in files:
        print("note: the checkpoint has no config.json (its model had no HuggingFace config): from_pretrained "
              "needs one beside the weights")
    return 0


@contextmanager
def _tensor_bar() -> Iterator[Callable[[int], None]]:
    """A rich bar of bytes written, on stderr when it is a terminal."""
    from rich.console import Console
    from rich.progress import DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("writing"), DownloadColumn(), TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task("writing", total=None)
        yield lambda done: bar.update(task, advance=done)


def _summary(asked: Path, folder: Path, manifest: Manifest) -> str:
    which = "" if folder == asked else f" (the latest of {len(complete_checkpoints(asked))} complete in {asked})"
    plan = " none (saved from a model not split by sk.shard)" if manifest.plan is None else f"\n{_plan_text(manifest.plan)}"
    return (f"checkpoint {folder}{which}\n"
            f"step: {manifest.step}\n"
            f"saved by: {manifest.world_size} process{'es' if manifest.world_size > 1 else ''}\n"
            f"model: {len(manifest.parameters)} parameters, identity {manifest.model_hash}\n"
            f"optimizer: {manifest.optimizer or 'none'}\n"
            f"extra: {json.dumps(manifest.extra)}\n"
            f"permuted (packed tensor-parallel weights): {', '.join(manifest.permutations) or 'none'}\n"
            f"plan:{plan}")


def _plan_text(plan: dict) -> str:
    """The plan as in a plan file, indented; one line per layout rule."""
    lines = []
    for key, value in plan.items():
        if key == "rules" and value:
            lines += ["rules:", *(f"- {_flow(rule)}" for rule in value)]
        else:
            lines.append(f"{key}: {_flow(value)}")
    return "\n".join(f"  {line}" for line in lines)


def _flow(value: object) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip().removesuffix("\n...").strip()


def _tensor_table(folder: Path) -> str:
    """Every tensor DCP's ``.metadata`` lists: name, full shape, dtype and bytes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        entries = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    except Exception as exc:  # a damaged .metadata: the file check below names it
        return f"tensors: .metadata cannot be read ({type(exc).__name__})"
    tensors = {key: value for key, value in entries.items() if isinstance(value, TensorStorageMetadata)}
    rows = [(key, str(list(m.size)), str(m.properties.dtype).removeprefix("torch."),
             format_bytes(m.size.numel() * m.properties.dtype.itemsize)) for key, m in tensors.items()]
    total = sum(m.size.numel() * m.properties.dtype.itemsize for m in tensors.values())
    others = len(entries) - len(tensors)
    title = (f"tensors: {len(rows)}, {format_bytes(total)}"
             + (f" (and {others} other values: optimizer settings)" if others else ""))
    return f"{title}\n{_table(('name', 'shape', 'dtype', 'bytes'), rows)}"


def _checksums(folder: Path, manifest: Manifest, advance: Callable[[int], None]) -> dict[str, str]:
    problems: dict[str, str] = {}
    for entry in manifest.files:
        if (folder / entry.name).is_file():
            problems.update(checksum_problems(folder, [entry]))
        advance(entry.size)
    return problems


def _file_table(files: tuple[FileEntry, ...], problems: dict[str, str]) -> str:
    rows = [(entry.name, format_bytes(entry.size), entry.sha256[:16],
             "OK" if entry.name not in problems else f"FAILED: {problems[entry.name]}") for entry in files]
    rows += [(name, "", "", f"FAILED: {what}") for name, what in sorted(problems.items())
             if name not in {entry.name for entry in files}]
    total = format_bytes(sum(entry.size for entry in files))
    verdict = "every file matches the manifest" if not problems else f"{len(problems)} damaged"
    return f"files: {len(files)}, {total}, sizes and sha256 checked: {verdict}\n" \
           f"{_table(('file', 'bytes', 'sha256', 'check'), rows)}"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  " + "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]) for row in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


@contextmanager
def _progress_bar(total: int) -> Iterator[Callable[[int], None]]:
    """A rich bar of bytes checked, on stderr when it is a terminal (nothing otherwise)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    with Progress(TextColumn("sha256"), BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("sha256", total=total)
        yield lambda done: bar.update(task, advance=done)
