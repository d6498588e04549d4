"""What the sub-commands share: a parser whose errors are one line, typed flags, the model flag,
and the plan flags with the one function that turns them into a Plan.

A flag the user gives is checked by its type when it is parsed and never replaced by a
default; a default applies only when the flag is absent::

    shardkit train: argument --lr: must be a positive finite number, got 'nan'
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

from ..models.registry import BUILDER_PATH_FORM, MODELS, ModelEntry, is_builder_path, model_entry
from ..plan import FSDPOptions, LayoutMap, Mesh, Plan, PlanError, UsageError
from ..plan.files import mapping, read_file
from ..plan.pipeline import SCHEDULES, SPLITS, pipeline_from_args
from ..plan.plan import RECOMPUTE, ZERO_STAGES

if TYPE_CHECKING:
    from torch import nn

DEFAULT_MESH = "fsdp=2,tp=2"
#: ``shardkit train --plan auto``: the planner chooses the plan (``sk.autoshard`` on the calibrated local world).
AUTO_PLAN = "auto"
#: Where a model given by its builder path gets layout rules from.
RULES_HINT = "pass --rules FILE (see docs/your-model.md)"
_NO_RULE = "is used by no layout rule"  # the problem Plan.problems() reports for an unsplit model axis
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


#: The largest seed: 64 bits, what ``torch.Generator.manual_seed`` (the text data's random windows, sampling)
#: and the sharded data's epoch order take; module initialisation hashes the seed, so any integer works there.
SEED_MAX = 2**64 - 1


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
    """A converter accepting a name in ``valid`` or a ``package.module:function`` builder path."""
    def convert(text: str) -> str:
        if is_builder_path(text) or text in valid or text.endswith(".json"):
            return text
        if text in MODELS:
            raise argparse.ArgumentTypeError(f"{text!r} has shapes only (meta device): use it with "
                                             f"'shardkit explain'; valid here: {', '.join(valid)}")
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; valid: {', '.join(valid)}, "
                                         f"or your builder as {BUILDER_PATH_FORM}")
    return convert


# -- the model flag ---------------------------------------------------------------------------

def add_model_option(parser: argparse.ArgumentParser, default: str, valid: Sequence[str]) -> None:
    parser.add_argument("--model", default=default, type=model_name(valid), metavar="NAME",
                        help=f"a registered model ({', '.join(valid)}; default: {default}), any importable "
                             f"zero-argument builder returning an nn.Module, as {BUILDER_PATH_FORM}, or a "
                             f"transformers config file (.json) of a causal LM")


def model_from_flag(name: str) -> ModelEntry:
    """The model ``--model name`` means; a builder path is imported here, errors name the flag.

    The working directory is searched last, so ``--model mymodel:build`` finds ``./mymodel.py``
    as ``python -m`` would, without local files shadowing installed modules.
    """
    if is_builder_path(name) and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    with _naming_model_flag(name):
        return hf_config_entry(name) if name.endswith(".json") else model_entry(name)


def hf_config_entry(file: str) -> ModelEntry:
    """A transformers causal LM from its ``config.json`` (no weights: ``AutoModelForCausalLM.from_config``,
    seeded with 0); its vocabulary and positions are read from the config."""
    from transformers import AutoConfig

    from ..models.hf import hf_loss

    data = mapping(read_file(file, "transformers config"), f"transformers config {file!r}",
                   '{"model_type": "llama", "vocab_size": 256, ...}')
    kind = data.get("model_type")
    try:
        config = AutoConfig.for_model(kind, **{k: v for k, v in data.items() if k != "model_type"})
    except (ValueError, TypeError) as exc:
        raise UsageError(f"transformers config {file!r}: model_type {kind!r} is not one transformers knows "
                         f"({exc})") from None
    return ModelEntry(partial(_build_causal_lm, config), None, hf_loss, None, None,
                      description=f"transformers {kind} from {file}")


def _build_causal_lm(config) -> nn.Module:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def meta_model_from_flag(name: str, entry: ModelEntry) -> nn.Module:
    """The model built on the meta device; errors name the flag."""
    with _naming_model_flag(name):
        return entry.on_meta()


@contextmanager
def _naming_model_flag(name: str) -> Iterator[None]:
    try:
        yield
    except UsageError as exc:
        raise UsageError(f"--model {name!r}: {exc}") from None


# -- the plan flags ---------------------------------------------------------------------------

def add_plan_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--plan``, ``--mesh``, ``--rules``, ``--world-size``, ``--recompute``, ``--zero`` and the pipeline flags; returns the
    pipeline group."""
    parser.add_argument("--plan", type=path, metavar="FILE",
                        help="a whole plan file (.json, .yaml, .yml); replaces --mesh, --rules and the pipeline flags "
                             f"(shardkit train: '{AUTO_PLAN}' lets the planner choose)")
    parser.add_argument("--mesh", metavar="AXES",
                        help=f"mesh axes such as 'fsdp=2,tp=2' (default: {DEFAULT_MESH}); one axis may be -1")
    parser.add_argument("--rules", type=path, metavar="FILE",
                        help="JSON/YAML file: a list of [regex, layout] pairs (default: the model's rules)")
    parser.add_argument("--world-size", type=positive_int, metavar="N",
                        help="number of processes (default: the mesh size; needed for a -1 axis)")
    parser.add_argument("--recompute", choices=list(RECOMPUTE),
                        help="activation recompute per block: full, or selective (the attention core only); "
                             "default: none")
    parser.add_argument("--zero", type=int, choices=list(ZERO_STAGES),
                        help="ZeRO stage on the data axes (docs/zero.md): 1 optimizer state sharded over dp, "
                             "2 FSDP2 without resharding after forward, 3 FSDP2 (fsdp)")
    pipe = parser.add_argument_group("pipeline (with a 'pp' mesh axis)")
    pipe.add_argument("--schedule", choices=list(SCHEDULES), help="pipeline schedule (default: 1f1b)")
    pipe.add_argument("--microbatches", type=positive_int, metavar="N",
                      help="micro-batches per step (default: the pp size)")
    pipe.add_argument("--split", choices=list(SPLITS), help="how layers are split into stages (default: even)")
    pipe.add_argument("--split-points", type=module_names, metavar="NAMES",
                      help="comma-separated module names that begin a stage, e.g. layers.2")
    return pipe


def plan_from_args(args: argparse.Namespace, entry: ModelEntry) -> tuple[Plan, int]:
    """The resolved plan and world size the plan flags describe (not yet checked against the model)."""
    pipeline_flags = {"--schedule": args.schedule, "--microbatches": args.microbatches, "--split": args.split,
                      "--split-points": args.split_points}
    if args.plan is not None:
        given = [flag for flag, value in {"--mesh": args.mesh, "--rules": args.rules, "--recompute": args.recompute,
                                          "--zero": args.zero, **pipeline_flags}.items() if value is not None]
        if given:
            raise PlanError(f"--plan is a whole plan, so {', '.join(given)} cannot be combined with it; "
                            f"edit the plan file or drop --plan")
        plan = args.plan if isinstance(args.plan, Plan) else Plan.load(args.plan)
    else:
        mesh = _parse_mesh_flag(DEFAULT_MESH if args.mesh is None else args.mesh)
        rules = load_rules(args.rules) if args.rules is not None else entry.rules_for(mesh) or inferred_rules(args.model, entry, mesh)
        # --zero 2 is FSDP2 kept gathered between forward and backward: the flag asks for exactly that
        fsdp = FSDPOptions(reshard_after_forward=False) if args.zero == 2 else FSDPOptions()
        plan = Plan(mesh=mesh, rules=rules, recompute=args.recompute or "none", zero=args.zero, fsdp=fsdp)
    world_size = args.world_size
    if world_size is None:
        if not plan.mesh.is_resolved:
            raise PlanError(f"{plan.mesh!r} has an inferred (-1) axis; pass --world-size N to infer it")
        world_size = plan.mesh.size
    plan = plan.resolved(world_size)
    if args.plan is None:
        pipeline = pipeline_from_args(plan.mesh, args.schedule, args.microbatches, args.split, args.split_points)
        plan = replace(plan, pipeline=pipeline)
    return plan, world_size


def inferred_rules(name: str, entry: ModelEntry, mesh: Mesh) -> LayoutMap | None:
    """With a ``tp`` axis and no built-in or transformers rules: the rules inferred from the model's
    dataflow (:func:`shardkit.planner.tp_infer.infer_tp_rules`), said on stderr with every rule."""
    if "tp" not in mesh:
        return None
    from ..planner.tp_infer import infer_tp_rules

    try:
        rules = infer_tp_rules(meta_model_from_flag(name, entry))
    except PlanError as exc:
        raise PlanError(f"mesh axis 'tp': model {name!r} has no built-in layout rules and no transformers "
                        f"tensor-parallel plan, and none could be inferred from its dataflow: {exc}; "
                        f"{RULES_HINT}") from None
    print(f"tensor-parallel rules inferred from the model's dataflow: {len(rules)} rules", file=sys.stderr)
    for pattern, layout in rules.items():
        print(f"  {pattern}  {layout}", file=sys.stderr)
    return rules


def _parse_mesh_flag(text: str) -> Mesh:
    try:
        return Mesh.parse(text)
    except PlanError as exc:
        raise PlanError(f"--mesh: {exc}") from None


def load_rules(file: Path) -> LayoutMap:
    """A layout rule file: a JSON or YAML list of ``[regex, layout]`` pairs, first match wins (read
    strictly, as plan files are: a key given twice is an error)."""
    example = '[["lm_head\\\\.weight", ["tp", null]], [".*", null]]'
    data = read_file(file, "rules")
    if not isinstance(data, list) or not data:
        raise PlanError(f"rules file {str(file)!r} must hold a non-empty list of [regex, layout] pairs, "
                        f"e.g. {example}; got {type(data).__name__}")
    try:
        return LayoutMap.from_list(data)
    except PlanError as exc:
        raise PlanError(f"rules file {str(file)!r}: {exc}") from None


@contextmanager
def rules_hint(args: argparse.Namespace) -> Iterator[None]:
    """A model given by its builder path has no built-in rules: when a model axis is then used by no
    rule, the :class:`PlanError` says where rules come from."""
    try:
        yield
    except PlanError as exc:
        if args.plan is not None or args.rules is not None or not is_builder_path(args.model):
            raise
        hint = f"; model {args.model!r} has no built-in layout rules: {RULES_HINT}"
        raise PlanError([p + hint if _NO_RULE in p else p for p in exc.problems]) from None
