"""``shardkit serve``: an OpenAI-compatible HTTP server over a tensor- and pipeline-parallel model::

    shardkit serve --model gpt-small --checkpoint runs/gpt --mesh tp=2 --port 8000
    shardkit serve --model exported --hf exported --mesh tp=2 --max-batch 16
    shardkit serve --model exported --hf exported --mesh pp=2,tp=2
    shardkit serve --model exported --hf exported --mesh tp=2 --kv-cache-memory 0.9 --max-tokens 4096

Every process of the world runs the decode engine (continuous batching); rank 0 also serves HTTP
(``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``/health``, ``/metrics``,
and a page to try it at ``/``). Everything is checked before any process starts: the plan against the
model, the weights, the tokenizer (the model folder's, or bytes for a byte-level model), the sizes,
the KV cache against ``--kv-cache-memory`` (and, on the ranks before it is allocated, against the free
memory), the port. SIGTERM stops taking requests, finishes those in flight (at most ``--drain-timeout``) and
exits 0; Ctrl-C stops at once (130); a rank that dies ends every open request with a 5xx and the
command exits 1 naming it. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..models.registry import MODELS
from ..plan import Pipeline, Plan, PlanError, UsageError
from .options import (
    add_model_option,
    add_weights_options,
    meta_model_from_flag,
    model_from_flag,
    positive_float,
    positive_int,
)
from .plan_flags import add_rules_option, model_rules, parse_mesh_flag

if TYPE_CHECKING:
    from ..runtime.context import Context
    from ..serving.run import ServeOptions

DEFAULT_MESH = "tp=1"
#: The axes the engine splits a model over: heads over ``tp``, layers over ``pp`` (even stages, one per rank).
SERVE_AXES = ("tp", "pp")


@dataclass(frozen=True)
class ServeJob:
    """What every rank needs (plain picklable data); the model is built again in each process."""

    model: str
    checkpoint: str | None
    hf: str | None
    options: ServeOptions
    eos_ids: frozenset[int]


def register(subparsers: argparse._SubParsersAction) -> None:
    usable = MODELS.buildable()
    parser = subparsers.add_parser(
        "serve", help="serve a sharded model over HTTP with OpenAI's API (continuous batching)",
        description="Serve a model split over 'tp' and 'pp' across a local world (or torchrun's) with OpenAI's "
                    "completions and chat API, weights from a checkpoint (sk.save) or a HuggingFace folder "
                    "(its tokenizer and chat template too). Everything is checked before any process starts.")
    add_model_option(parser, "gpt-tiny", usable)
    add_weights_options(parser, " (byte-level models)", ": its tokenizer and generation_config too")
    parser.add_argument("--mesh", default=DEFAULT_MESH, metavar="AXES",
                        help=f"the mesh: 'tp' (heads) and 'pp' (layers, even stages) may be larger than 1, e.g. "
                             f"pp=2,tp=2 (default: {DEFAULT_MESH})")
    add_rules_option(parser)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000,
                        help="the port to listen on; 0: any free port, printed at start (default: 8000)")
    parser.add_argument("--max-batch", type=positive_int, metavar="N",
                        help="requests decoded together: the KV cache holds N sequences (default: 8, or with "
                             "--kv-cache-memory as many as it holds)")
    parser.add_argument("--kv-cache-memory", type=_cache_memory, metavar="BYTES|FRACTION",
                        help="KV cache per rank: bytes (e.g. 2GiB), or a fraction (0 to 1) of the memory free after "
                             "the weights (a GPU's; on the CPU the available RAM per process); sizes --max-batch, "
                             "or refuses one that does not fit (default: the cache --max-batch x --max-tokens asks "
                             "for, checked against the free memory)")
    parser.add_argument("--max-tokens", type=positive_int, metavar="N",
                        help="positions one request may use, prompt and completion together (default: the "
                             "model's positions); sizes the KV cache with --max-batch")
    parser.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                        help="requests that may wait for a place in the batch; beyond, 429 (default: 256)")
    parser.add_argument("--drain-timeout", type=positive_float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, how long requests in flight may take to finish before they are "
                             "cancelled (default: 30)")
    parser.set_defaults(func=run)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return int(text)


def _cache_memory(text: str) -> float:
    """``--kv-cache-memory``: a fraction in (0, 1], or a size in bytes (``2GiB``, ``500MB``, ``1048576``)."""
    from ..plan.text import parse_bytes

    with contextlib.suppress(ValueError):
        fraction = float(text)
        if 0 < fraction <= 1:
            return fraction
    try:
        size = parse_bytes(text)
    except ValueError:
        size = 0
    if size <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction of the free memory (0 < f <= 1, e.g. 0.9) or a size "
                                         f"in bytes (e.g. 2GiB), got {text!r}")
    return float(size)


def check_job(args: argparse.Namespace) -> tuple[Plan, ServeJob]:
    """Everything checked before launch; :class:`PlanError` / :class:`UsageError` naming the flag."""
    from ..families import model_layout, token_sizes
    from ..planner.pipeline_proof import decode_problems
    from ..planner.validate import validate
    from ..runtime.generate import MODEL_EOS, stop_tokens
    from ..runtime.plain_decode import plain_problems
    from ..serving.run import ServeOptions
    from ..serving.text import load_tokenizer
    from .generate import check_weights

    entry = model_from_flag(args.model)
    model = meta_model_from_flag(args.model, entry)
    mesh = parse_mesh_flag(args.mesh)
    if not mesh.is_resolved:
        raise PlanError(f"--mesh {args.mesh}: give every axis its size (no -1), e.g. --mesh tp=2")
    others = [f"{axis}={size}" for axis, size in zip(mesh.names, mesh.shape) if axis not in SERVE_AXES and size > 1]
    if others:
        raise PlanError(f"--mesh {args.mesh}: the server splits a model over {' and '.join(map(repr, SERVE_AXES))} "
                        f"only, but {', '.join(others)}; valid: e.g. --mesh tp=2 or --mesh pp=2,tp=2")
    problems = plain_problems(model)
    if problems:
        raise UsageError(f"--model {args.model}: {'; '.join(problems)}")
    pipeline = Pipeline(schedule="sequential") if mesh.size_of("pp") > 1 else None  # even stages, one per rank
    plan = Plan(mesh=mesh, rules=model_rules(args.model, entry, mesh, args.rules), pipeline=pipeline
                ).resolved(mesh.size)
    validate(plan, model, world_size=mesh.size)
    if pipeline is not None:
        problems = decode_problems(model, model_layout(model))  # validate refused stages without a layer
        if problems:
            raise PlanError([f"--mesh {args.mesh}: {p}" for p in problems])
    check_weights(args, model)
    vocab, positions = token_sizes(model)
    load_tokenizer(args.hf, vocab)
    if args.max_tokens is not None and positions is not None and args.max_tokens > positions:
        raise UsageError(f"--max-tokens {args.max_tokens}: model {args.model!r} has {positions} positions; "
                         f"valid: 1 to {positions}")
    if args.max_tokens is None and positions is None:
        raise UsageError(f"--model {args.model}: its positions are unknown; give --max-tokens N")
    max_batch = _check_cache(args, model, mesh, args.max_tokens or positions)
    _check_port(args.host, args.port)
    eos = stop_tokens(model, MODEL_EOS)
    options = ServeOptions(name=args.model, host=args.host, port=args.port, max_batch=max_batch,
                           max_len=args.max_tokens, max_queue=args.max_queue, drain_s=args.drain_timeout,
                           mesh=args.mesh, tokenizer=None if args.hf is None else str(args.hf),
                           cache_memory=args.kv_cache_memory)
    return plan, ServeJob(args.model, None if args.checkpoint is None else str(args.checkpoint),
                          options.tokenizer, options, frozenset(eos[0]) if eos else frozenset())


def _check_cache(args: argparse.Namespace, model: object, mesh: object, max_len: int) -> int | None:
    """The KV cache's plan before launch: ``--max-batch`` sequences of ``max_len`` positions against a
    ``--kv-cache-memory`` given in bytes (a fraction, and every size against the free memory, are checked
    on the ranks once the weights are loaded: :func:`shardkit.serving.run.cache_slots`). Returns the slots
    (None: as many as the memory holds); printed."""
    from ..planner.estimate import kv_cache_bytes

    dtype = next(model.parameters()).dtype
    tp, pp = mesh.size_of("tp"), mesh.size_of("pp")
    per_sequence = kv_cache_bytes(model.config, tp=tp, pp=pp, batch_size=1, seq_len=max_len, dtype=dtype)
    asked = args.kv_cache_memory
    if asked is None or asked <= 1:
        slots = args.max_batch or (None if asked is not None else 8)
        what = f"{slots} sequences" if slots else f"as many sequences as {asked:g} of the free memory holds"
        print(f"shardkit serve: KV cache plan: {what} of {max_len} positions, {per_sequence} bytes each per rank "
              f"(sk.kv_cache_bytes, tp={tp}, pp={pp}, {dtype}); checked against each rank's free memory at start",
              file=sys.stderr, flush=True)
        return slots
    fits = int(asked) // per_sequence
    slots = args.max_batch or max(fits, 1)
    if slots > fits or fits < 1:
        raise UsageError(f"--kv-cache-memory {int(asked)}: --max-batch {slots} x --max-tokens {max_len} takes "
                         f"{slots * per_sequence} bytes per rank (sk.kv_cache_bytes, tp={tp}, pp={pp}, {dtype}), "
                         f"but it holds {fits} such sequences; valid: --max-batch at most {fits}, or --max-tokens at "
                         f"most {int(asked) // (per_sequence // max_len * slots)} with --max-batch {slots}, or "
                         f"--kv-cache-memory at least {slots * per_sequence}")
    print(f"shardkit serve: KV cache plan: {slots} sequences of {max_len} positions, {slots * per_sequence} of "
          f"{int(asked)} bytes per rank (sk.kv_cache_bytes, tp={tp}, pp={pp}, {dtype})", file=sys.stderr, flush=True)
    return slots


def _check_port(host: str, port: int) -> None:
    """Refuse a port in use (or an address that is not this machine's) before any process starts."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UsageError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); choose another "
                             f"--port, or --port 0 for any free one") from None


def serve_job(ctx: Context, job: ServeJob) -> None:
    """One rank: build on meta, shard, read the weights, serve until stopped."""
    from ..checkpoint.store import load
    from ..planner.meta import meta_model
    from ..runtime.apply import shard
    from ..runtime.torchrun import in_torchrun
    from ..serving.run import serve_rank
    from .generate import use_generation_config

    model = shard(meta_model(model_from_flag(job.model).build), ctx.plan, ctx, weights=job.hf)
    if job.hf is not None:
        use_generation_config(model, job.hf)
    if job.checkpoint is not None:
        load(job.checkpoint, model)
    serve_rank(model, ctx.rank, ctx.world_size, job.options, job.eos_ids, in_torchrun())


def _forward_sigterm(signum: int, frame: object) -> None:
    """SIGTERM to the command is rank 0's to handle (it drains); in a local world it is a child process."""
    for child in multiprocessing.active_children():
        if child.name == "shardkit-rank0":
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)


def run(args: argparse.Namespace) -> int:
    from ..runtime.torchrun import in_torchrun
    from ..runtime.world import WorldError, launch

    plan, job = check_job(args)
    if not in_torchrun():
        signal.signal(signal.SIGTERM, _forward_sigterm)
    try:
        launch(serve_job, plan, job, world_size=plan.mesh.size, timeout=None)
    except WorldError as exc:
        print(f"shardkit serve: {exc}", file=sys.stderr)
        return 1
    return 0
