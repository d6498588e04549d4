"""The ``shardkit`` command: one sub-command per module in this package.

Only the module of the sub-command asked for is imported, and each imports torch and the rest
only when it runs, so a command line that is refused answers at once, without torch
(``tests/test_startup.py``; ``benchmarks/cli_startup.py`` measures it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..plan import PlanError, UsageError
from .options import OneLineParser

#: Sub-command modules; each defines ``register(subparsers)`` which sets ``func`` on its parser.
COMMANDS = ("train", "explain", "plan", "replicas", "data", "checkpoint", "calibrate", "generate", "serve")
#: Sub-commands that leave no process running and no file open when they return: as the program,
#: they end without the interpreter's teardown (:func:`exit_now`).
EXIT_AT_ONCE = ("explain", "plan")


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
    Called as the program (no ``argv``: the ``shardkit`` script, ``python -m shardkit``), a command of
    :data:`EXIT_AT_ONCE` ends the process when it is done (:func:`exit_now`).
    """
    program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    status = _run(args)
    if program and args.command in EXIT_AT_ONCE:
        exit_now(status)
    return status


def exit_now(status: int) -> NoReturn:
    """End the process with ``status`` now, its output flushed: the interpreter's teardown is skipped,
    which takes seconds once torch is imported (finalising its thousands of modules and objects) and
    does nothing a command of :data:`EXIT_AT_ONCE` needs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run(args: argparse.Namespace) -> int:
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
