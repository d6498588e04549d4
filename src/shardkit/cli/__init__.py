"""The ``shardkit`` command: one sub-command per module in this package.

Only the module of the sub-command asked for is imported, and each imports torch and the rest
only when it runs, so a command line that is refused answers at once, without torch
(``tests/test_startup.py``; ``benchmarks/cli_startup.py`` measures it).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ..plan import PlanError, UsageError
from .options import OneLineParser

#: Sub-command modules; each defines ``register(subparsers)`` which sets ``func`` on its parser.
COMMANDS = ("train", "explain", "plan", "replicas", "data", "checkpoint", "calibrate", "generate")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every sub-command, or only of the one ``argv`` starts with (the others' modules
    are then not imported)."""
    parser = OneLineParser(prog="shardkit", description="Split PyTorch models across devices from one Plan.")
    sub = parser.add_subparsers(dest="command", required=True)
    asked = argv[0] if argv else None
    for name in (asked,) if asked in COMMANDS else COMMANDS:
        try:
            module = importlib.import_module(f"shardkit.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"shardkit.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a sub-command; its exit status: 0 done, 1 a job failed, 2 an invalid plan or command line,
    130 interrupted (Ctrl-C).

    A command-line error exits with status 2 while parsing (one line on stderr, see :class:`OneLineParser`).
    """
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PlanError as exc:
        print(f"shardkit: invalid plan: {exc}", file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"shardkit {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (a local world's processes end with it)
        print(f"shardkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
