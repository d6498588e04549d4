"""The ``shardkit`` command: one sub-command per module in this package."""

from __future__ import annotations

import argparse
import importlib
import sys

from ..plan import PlanError, UsageError
from .options import OneLineParser

#: Sub-command modules; each defines ``register(subparsers)`` which sets ``func`` on its parser.
COMMANDS = ("train", "explain", "plan", "replicas", "data", "checkpoint", "calibrate", "generate")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="shardkit", description="Split PyTorch models across devices from one Plan.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
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
    args = build_parser().parse_args(argv)
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
