"""``shardkit data``: write a sharded data folder from text, and check one (no processes started)::

    shardkit data shard corpus/ data/corpus --shards 50
    shardkit data shard notes.txt data/notes --shards 4 --overwrite
    shardkit data check data/corpus --seq-len 128

See docs/data.md for the format, the sample order and resuming across data-parallel degrees.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..plan.text import format_bytes
from .options import path, positive_int

if TYPE_CHECKING:
    from ..io.shard_writer import Progress

DEFAULT_SEQ_LEN = 128


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "data", help="write a sharded data folder from text files, or check one against its manifest",
        description="Sharded data folders: byte-token shard files (.bin, one byte per token) and a manifest "
                    "with each file's size and sha256, read by shardkit.ShardedDataset (docs/data.md).")
    actions = parser.add_subparsers(dest="action", required=True)
    shard = actions.add_parser(
        "shard", help="cut a text file or a folder of text files into N shard files plus manifest.json",
        description="Write OUT atomically: a hidden temporary folder is renamed to OUT once every shard and "
                    "the manifest are written, so a killed run never leaves a folder that looks complete.")
    shard.add_argument("src", type=path, metavar="SRC",
                       help="a UTF-8 text file, or a folder searched recursively for text files (sorted walk)")
    shard.add_argument("out", type=path, metavar="OUT", help="the folder to write; an existing non-empty one is "
                                                              "refused unless --overwrite")
    shard.add_argument("--shards", type=positive_int, required=True, metavar="N", help="number of shard files")
    shard.add_argument("--pattern", default="*", metavar="GLOB",
                       help="only a folder's files whose name matches, e.g. '*.txt' (default: every text file)")
    shard.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    shard.set_defaults(func=run_shard)
    check = actions.add_parser(
        "check", help="check every shard's size and sha256 against the manifest, and count samples",
        description="Read every shard of FOLDER and compare its size and sha256 with manifest.json; exit 2 "
                    "naming each file that is missing, truncated, altered or not in the manifest.")
    check.add_argument("folder", type=path, metavar="FOLDER", help="a folder written by 'shardkit data shard'")
    check.add_argument("--seq-len", type=positive_int, default=DEFAULT_SEQ_LEN, metavar="N",
                       help=f"count samples of N + 1 tokens (default: {DEFAULT_SEQ_LEN})")
    check.set_defaults(func=run_check)


def run_shard(args: argparse.Namespace) -> int:
    from ..io.shard_writer import write_shards

    with _progress_bar() as progress:
        manifest = write_shards(args.src, args.out, args.shards, pattern=args.pattern, overwrite=args.overwrite,
                                progress=progress)
    print(f"shardkit data shard: wrote {len(manifest.shards)} shards to {args.out}: "
          f"{format_bytes(manifest.total_bytes)} ({manifest.total_bytes:,} byte tokens) from "
          f"{manifest.source.files} text file(s) in {args.src}")
    return 0


def run_check(args: argparse.Namespace) -> int:
    from ..io.sharded_data import ShardedDataset

    dataset = ShardedDataset(args.folder, seq_len=args.seq_len)
    dataset.verify()
    manifest = dataset.manifest
    print(f"shardkit data check: {args.folder}: {len(manifest.shards)} shards, {format_bytes(manifest.total_bytes)} "
          f"({manifest.total_bytes:,} byte tokens) from {manifest.source.path}; sizes and sha256 match the "
          f"manifest; {len(dataset):,} samples of {args.seq_len} + 1 tokens")
    return 0


@contextmanager
def _progress_bar() -> Iterator[Progress]:
    """A rich bar of bytes written, on stderr when it is a terminal (nothing otherwise)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    with Progress(TextColumn("shard"), BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("shard", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)
