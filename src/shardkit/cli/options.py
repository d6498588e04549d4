"""What the sub-commands share: a parser whose errors are one line, typed flags and the model flag
(the plan flags are in :mod:`.plan_flags`; models are resolved by :mod:`shardkit.training.model`).

A flag the user gives is checked by its type when it is parsed and never replaced by a
default; a default applies only when the flag is absent::

    shardkit train: argument --lr: must be a positive finite number, got 'nan'
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from ..models.registry import BUILDER_PATH_FORM
from ..plan import UsageError
from ..plan.loss_scale import LOSS_SCALES
from ..training.fields import SEED_MAX
from ..training.model import check_model_name, meta_model_from_flag, model_from_flag
from ..training.plans import DEFAULT_MESH, load_rules

Number = TypeVar("Number", int, float)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``shardkit train: argument --lr: ...``, exit status 2.

    (argparse's default prints the whole usage first, which buries the one line that matters.)
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


# -- typed flags: each converter returns the value or says what is valid ------------------------

def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _number(int, text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1, 2, ...), got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _number(int, text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def seed(text: str) -> int:
    """A seed: an integer in ``0 .. 2**64 - 1`` (a larger one would overflow in the worker processes).

    >>> seed("18446744073709551615")
    18446744073709551615
    """
    value = _number(int, text)
    if value is None or not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be a 64-bit seed (at most 2**64 - 1 = {SEED_MAX}), an integer >= 0, "
                                         f"got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (``nan``, ``inf``, 0 and negatives are refused)."""
    value = _number(float, text)
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def loss_scale(text: str) -> str | float:
    """``--loss-scale``: ``dynamic``, ``off`` or a positive finite number (a fixed scale)."""
    if text in LOSS_SCALES:
        return text
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be {' or '.join(LOSS_SCALES)} or a positive number such as 1024, "
                                         f"got {text!r}") from None


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _number(float, text)
    if value is None or not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number strictly between 0 and 1 (``nan``, 0, 1 and beyond are refused).

    >>> fraction("0.1")
    0.1
    """
    value = _number(float, text)
    if value is None or not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction between 0 and 1 (exclusive) such as 0.1, got {text!r}")
    return value


def _number(kind: Callable[[str], Number], text: str) -> Number | None:
    try:
        return kind(text)
    except ValueError:
        return None


def path(text: str) -> Path:
    """A non-empty path (an empty one would silently mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a path, got {text!r}")
    return Path(text)


def module_names(text: str) -> list[str]:
    """Comma-separated module names, none empty: ``layers.2,layers.4``."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"must be module names separated by commas, e.g. 'layers.2', got {text!r}")
    return names


def model_name(valid: Sequence[str]) -> Callable[[str], str]:
    """A converter accepting a name in ``valid``, a ``package.module:function`` builder path, a transformers
    config file or a model folder."""
    def convert(text: str) -> str:
        try:
            return check_model_name(text, tuple(valid))
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


# -- the model flag ---------------------------------------------------------------------------

def add_model_option(parser: argparse.ArgumentParser, default: str, valid: Sequence[str]) -> None:
    parser.add_argument("--model", default=default, type=model_name(valid), metavar="NAME",
                        help=f"a registered model ({', '.join(valid)}; default: {default}), any importable "
                             f"zero-argument builder returning an nn.Module, as {BUILDER_PATH_FORM}, a "
                             f"transformers config file (.json) of a causal LM, or a model folder holding one "
                             f"(config.json, as save_pretrained or sk.export_hf write)")


def add_weights_options(parser: argparse.ArgumentParser, checkpoint_note: str = "", hf_note: str = "") -> None:
    """``--checkpoint DIR`` or ``--hf DIR`` (one of them required): where a model's weights come from."""
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", type=path, metavar="DIR",
                         help="a folder of checkpoints written by sk.save / shardkit train --save (the latest "
                              f"complete one is read), or one checkpoint folder{checkpoint_note}")
    weights.add_argument("--hf", type=path, metavar="DIR", help=f"a HuggingFace model folder (safetensors){hf_note}")


__all__ = ["DEFAULT_MESH", "SEED_MAX", "OneLineParser", "add_model_option", "add_weights_options", "fraction", "loss_scale", "load_rules",
           "meta_model_from_flag", "model_from_flag", "model_name", "module_names", "non_negative_float",
           "non_negative_int", "path", "positive_float", "positive_int", "seed"]
