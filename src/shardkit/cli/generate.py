"""``shardkit generate``: continue a prompt with a sharded model, streaming tokens as they come::

    shardkit generate --model gpt-small --checkpoint runs/gpt --mesh tp=2 --prompt "def " --max-new-tokens 80
    shardkit generate --model llama-tiny --hf exported --mesh pp=2,tp=2 --prompt-ids 1,15,27 --max-new-tokens 20

The weights come from a checkpoint folder written by ``sk.save`` / ``shardkit train --save``
(read with ``sk.load``, under this command's plan) or from a HuggingFace safetensors folder
(``sk.shard(..., weights=DIR)``: each process reads only its shards). ``--prompt`` is text
for a byte-level model (vocabulary 256, as ``shardkit train`` trains: token = byte), printed back
as text; ``--prompt-ids`` gives token ids, printed back as ids. Generation stops at the model's
end-of-sequence token (``generation_config.eos_token_id``), at ``--eos-token-id ID`` instead, or
never with ``--no-eos``. Everything is checked before any process starts: the plan against the
model (whole KV heads per ``tp`` rank), the plan against generation (``tp``, ``pp`` and the data axes:
with ``dp``, ``fsdp`` or ``ep`` every data rank continues the same prompt), the
weights' names and shapes, the prompt and ``--eos-token-id`` against the vocabulary, the positions.
"""

from __future__ import annotations

import argparse
import codecs
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.manifest import CheckpointError, damage_message, model_mismatch, size_problems
from ..checkpoint.steps import checkpoint_to_load, checkpoints_beside
from ..models.registry import MODELS
from ..plan import Pipeline, Plan, PlanError, UsageError
from ..runtime.limits import DEFAULT_TIMEOUT_S
from .options import (
    add_model_option,
    add_weights_options,
    meta_model_from_flag,
    model_from_flag,
    non_negative_int,
    positive_float,
    positive_int,
    seed,
)
from .plan_flags import add_rules_option, model_rules, parse_mesh_flag

if TYPE_CHECKING:
    from ..runtime.context import Context
    from ..runtime.generate import ModelEos

DEFAULT_MESH = "tp=1"
BYTE_VOCAB = 256  # shardkit's text data are bytes: token ids 0..255


@dataclass(frozen=True)
class GenerateJob:
    """What every rank needs (plain picklable data); the model is built again in each process."""

    model: str
    checkpoint: str | None
    hf: str | None
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_k: int | None
    seed: int | None
    eos_token_id: tuple[int, ...] | None | ModelEos  # MODEL_EOS: the model's own
    text: bool  # the prompt was text: print bytes as text, else ids


def register(subparsers: argparse._SubParsersAction) -> None:
    usable = MODELS.buildable()
    parser = subparsers.add_parser(
        "generate", help="continue a prompt with a sharded model, streaming the tokens",
        description="Generate tokens with a model split over 'tp', 'pp' or the data axes ('dp', 'fsdp', 'ep': "
                    "experts split over 'ep') across a local world, weights from a "
                    "checkpoint (sk.save) or a HuggingFace folder; greedy unless --temperature is given. "
                    "Everything is checked before any process starts.")
    add_model_option(parser, "gpt-tiny", usable)
    add_weights_options(parser)
    parser.add_argument("--mesh", default=DEFAULT_MESH, metavar="AXES",
                        help=f"the mesh; only 'tp', 'pp' (pipeline stages, split evenly) and the data axes "
                             f"'dp', 'fsdp', 'ep' may be larger than 1 (default: {DEFAULT_MESH})")
    add_rules_option(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT",
                        help=f"text, as UTF-8 bytes (a byte-level model: vocabulary {BYTE_VOCAB}); printed as text")
    prompt.add_argument("--prompt-ids", type=_token_ids, metavar="IDS",
                        help="comma-separated token ids, e.g. 1,15,27; printed as ids")
    parser.add_argument("--max-new-tokens", type=positive_int, required=True, metavar="N")
    parser.add_argument("--temperature", type=positive_float, metavar="X",
                        help="sample from softmax(logits / X) (default: greedy)")
    parser.add_argument("--top-k", type=positive_int, metavar="K", help="sample among the K likeliest tokens")
    parser.add_argument("--seed", type=seed, metavar="N", help="seed of the sampling (0 to 2**64 - 1)")
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--eos-token-id", type=non_negative_int, action="append", metavar="ID",
                      help="stop when this token is made (repeat the flag for several; default: the model's "
                           "generation_config.eos_token_id). The reference GPT (gpt-*, byte-level) has none, so it "
                           "always makes --max-new-tokens; there an ID is a byte: --eos-token-id 10 stops at the "
                           "first newline")
    stop.add_argument("--no-eos", action="store_true",
                      help="ignore the model's end-of-sequence token: always make --max-new-tokens tokens")
    parser.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"stop every process and exit 1 when the job runs longer (default: {DEFAULT_TIMEOUT_S:g})")
    parser.set_defaults(func=run)


def _token_ids(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"must be comma-separated non-negative integers such as 1,15,27, got {text!r}")
    return tuple(int(p) for p in parts)


def check_job(args: argparse.Namespace) -> tuple[Plan, GenerateJob]:
    """Everything checked before launch; :class:`PlanError` / :class:`UsageError` naming the flag."""
    from ..families import token_sizes
    from ..planner.validate import validate
    from ..runtime.generate import MODEL_EOS, check_generation, generation_problems, stop_tokens

    if args.temperature is None and (args.top_k is not None or args.seed is not None):
        given = " and ".join(f for f, v in (("--top-k", args.top_k), ("--seed", args.seed)) if v is not None)
        raise UsageError(f"{given} apply only to sampling, but without --temperature generation is greedy; "
                         f"add --temperature X or drop {given}")
    entry = model_from_flag(args.model)
    model = meta_model_from_flag(args.model, entry)
    mesh = parse_mesh_flag(args.mesh)
    if not mesh.is_resolved:
        raise PlanError(f"--mesh {args.mesh}: give every axis its size (no -1): generation starts one process per "
                        f"device of the mesh, e.g. --mesh tp=2")
    rules = model_rules(args.model, entry, mesh, args.rules)
    pipeline = Pipeline(schedule="sequential") if mesh.size_of("pp") > 1 else None  # even stages, one batch
    plan = Plan(mesh=mesh, rules=rules, pipeline=pipeline).resolved(mesh.size)
    problems = generation_problems(plan)
    if problems:
        raise PlanError([f"--mesh {args.mesh}: {p}" for p in problems])
    validate(plan, model, world_size=mesh.size)
    check_weights(args, model)
    vocab, _ = token_sizes(model)
    if args.prompt is not None:
        if vocab != BYTE_VOCAB:
            raise UsageError(f"--prompt is text read as UTF-8 bytes (ids 0-255), but model {args.model!r} has a "
                             f"vocabulary of {vocab}; give token ids with --prompt-ids")
        ids = tuple(args.prompt.encode("utf-8"))
        if not ids:
            raise UsageError("--prompt is empty; give at least one character")
    else:
        ids = args.prompt_ids
        if vocab is not None and max(ids) >= vocab:
            raise UsageError(f"--prompt-ids holds id {max(ids)}, but model {args.model!r} has a vocabulary of "
                             f"{vocab}; valid ids: 0 to {vocab - 1}")
    if args.top_k is not None and vocab is not None and args.top_k > vocab:
        raise UsageError(f"--top-k {args.top_k}: model {args.model!r} has a vocabulary of {vocab}; valid: 1 to "
                         f"{vocab}")
    if args.eos_token_id is not None and vocab is not None and max(args.eos_token_id) >= vocab:
        raise UsageError(f"--eos-token-id {max(args.eos_token_id)}: model {args.model!r} has a vocabulary of "
                         f"{vocab}; valid ids: 0 to {vocab - 1}")
    eos = None if args.no_eos else MODEL_EOS if args.eos_token_id is None else tuple(args.eos_token_id)
    stop_tokens(model, eos)  # the model's own eos, checked before any process starts
    try:
        check_generation(model, len(ids), args.max_new_tokens, plan)
    except UsageError as exc:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: {exc}") from None
    return plan, GenerateJob(args.model, _text(args.checkpoint), _text(args.hf), ids, args.max_new_tokens,
                             args.temperature or 0.0, args.top_k, args.seed, eos, args.prompt is not None)


def use_generation_config(model, folder: Path | str) -> None:
    """Give a transformers ``model`` the ``generation_config.json`` of a HuggingFace ``folder``, where
    one is, as ``from_pretrained`` does (instruct models list their extra end-of-sequence ids there)."""
    if (Path(folder) / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(folder)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--hf {folder}: generation_config.json cannot be read: {exc}") from None


def check_weights(args: argparse.Namespace, model) -> None:
    """``--hf``'s every name and shape (and its generation config read), or ``--checkpoint``'s files and
    parameters, against ``model``: before any process starts."""
    from ..runtime.materialize import open_weights

    if args.hf is not None:
        open_weights(args.hf, model)
        use_generation_config(model, args.hf)
    else:
        _check_checkpoint(args.checkpoint, model)


def _check_checkpoint(folder: Path, model) -> None:
    """The checkpoint's parameters against the model's, and every file's size (a truncated or missing file);
    each process checks the sha256 of its share of the files when it loads."""
    from ..checkpoint.store import model_parameters

    found, manifest = checkpoint_to_load(folder)
    damaged = size_problems(found, manifest)
    if damaged:
        raise CheckpointError(f"--checkpoint {folder}: "
                              f"{damage_message(found, manifest, damaged, checkpoints_beside(found))}")
    problems = model_mismatch(manifest.parameters, model_parameters(model))
    if problems:
        raise CheckpointError(f"--checkpoint {found}: holds another model's parameters: {'; '.join(problems)}; "
                              f"pass the --model it was saved from")


def _text(value: Path | None) -> str | None:
    return None if value is None else str(value)


class _Stream:
    """Prints the prompt, then each new token as it comes (rank 0 only): bytes as UTF-8 text, or ids."""

    def __init__(self, show: bool, text: bool, prompt: tuple[int, ...]):
        self.show, self.text, self.first = show, text, True
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._write(prompt)

    def __call__(self, token) -> None:
        self._write(tuple(token.tolist()))

    def _write(self, ids: tuple[int, ...]) -> None:
        if self.show:
            sys.stdout.write(self.decoder.decode(bytes(ids)) if self.text else
                             " ".join(map(str, ids)) if self.first else "".join(f" {i}" for i in ids))
            sys.stdout.flush()
            self.first = False

    def end(self) -> None:
        if self.show:
            sys.stdout.write((self.decoder.decode(b"", final=True) if self.text else "") + "\n")
            sys.stdout.flush()


def generate_job(ctx: Context, job: GenerateJob) -> list[int]:
    """One rank: build on meta, shard, read the weights, generate; returns the new token ids (fewer than
    ``max_new_tokens`` when an end-of-sequence token stopped it)."""
    import torch

    from ..checkpoint.store import load
    from ..planner.meta import meta_model
    from ..runtime.apply import shard
    from ..runtime.generate import generate

    model = shard(meta_model(model_from_flag(job.model).build), ctx.plan, ctx, weights=job.hf)
    if job.hf is not None:
        use_generation_config(model, job.hf)
    if job.checkpoint is not None:
        load(job.checkpoint, model)
    stream = _Stream(ctx.rank == 0, job.text, job.prompt)
    out = generate(model, torch.tensor([job.prompt]), max_new_tokens=job.max_new_tokens, temperature=job.temperature,
                   top_k=job.top_k, seed=job.seed, eos_token_id=job.eos_token_id, on_token=stream)
    stream.end()
    return out[0, len(job.prompt):].tolist()


def run(args: argparse.Namespace) -> int:
    from ..runtime.world import WorldError, launch

    plan, job = check_job(args)
    try:
        launch(generate_job, plan, job, world_size=plan.mesh.size, timeout=args.timeout)
    except WorldError as exc:
        print(f"shardkit generate: {exc}", file=sys.stderr)
        return 1
    return 0
