"""Token generation on a tensor- and pipeline-parallel model (``sk.generate``), with a KV cache per rank.

Each decode step runs only the new token: the model's attention keeps the keys and values of
the tokens before it. After shardkit's tensor parallel every rank's attention computes its own
heads, so its cache holds only its own KV heads (a plan whose KV heads do not split over
``tp`` is refused by ``sk.validate`` before launch). The caches are the models' own:

- a transformers model that can generate (``model.can_generate()``): transformers'
  ``DynamicCache``, passed as its forward's ``cache`` (``past_key_values`` before v5);
- a model with ``kv_cache()`` whose forward takes ``cache=`` (the reference GPT).

When the model is one :mod:`.plain_decode` runs (the reference GPT, transformers' Llama and Qwen2)
and the plan splits over ``tp`` and ``pp`` alone, the steps run there instead (:class:`PlainSteps`: each
rank's local shards as plain tensors, one ``all_reduce`` per row-parallel layer, no DTensor dispatch per
operator; a pipeline's stages through :mod:`.plain_pipeline`, one stage per rank); virtual pipeline
stages, the data axes and other models run the model's own forward (:class:`Decoder`).

transformers' ``generate`` is not used on a sharded model because it runs its own loop of
stopping criteria, padding and logits processors per rank; ours is the loop of this module,
with the chosen token broadcast from the first ``tp`` rank so every rank feeds the same token
to its next step.

A pipeline (``pp``) runs its stages one after another for each step, the hidden states of the
new positions sent to the next stage's rank (:mod:`shardkit.runtime.p2p`; their shape and dtype
sent ahead only for the prefill and the first decode step, so a receiving stage's step makes no
host read of its own), and each stage's cache holds its own layers; the last stage chooses the token and broadcasts it back over
``pp``. That the stages decode as the model's own forward does is proven on a miniature of
the model before launch (:func:`check_generation` with the plan) and when the pipeline is built.

A row stops at an end-of-sequence token as in transformers' ``generate`` (later positions get the
pad token); every rank decides from the broadcast tokens, so all of them leave the loop at the same step.

The data axes (``dp``, ``fsdp``, ``ep``; with or without a pipeline) split the prompts: each data
rank continues its own (any batch, any length), through its own pipeline when there is one. Its
steps still need the others: FSDP gathers parameters at every forward, and ``ep`` sends every
token to the ranks holding its experts, so each rank of the world joins every collective of every
step. Under a pipeline, a stage's FSDP gathers and expert exchanges run among the ranks of that
stage (the same ``pp`` coordinate): every data rank's pipeline runs its stages in the same order. After each step the ranks agree
(one ``all_reduce``) whether any of them still has an unfinished row; a rank whose rows have all
finished keeps running its batch (the tokens discarded, its result cut where one process would
have stopped) until none has, so no rank leaves a collective the others wait in. Its checks
are agreed before the first step too: a call refused on one rank is refused on all.
"""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..families import family_of, model_layout
from ..families.hf import is_hf_model
from ..plan import Plan, PlanError, UsageError
from ..plan.mesh import DATA_AXES
from ..planner.pipeline_proof import decode_problems
from .pipeline import PipelinedModule
from .plain_decode import PlainDecoder, plain_problems
from .plain_pipeline import PlainPipeline, pipeline_problems

#: The only mesh axis generation may split (every other axis must have size 1).
GENERATION_AXIS = "tp"
#: Token id dtypes an embedding takes.
ID_DTYPES = (torch.int64, torch.int32)
#: The largest seed torch's generator takes.
MAX_SEED = 2**64 - 1


class ModelEos(enum.Enum):
    """The type of :data:`MODEL_EOS` (a sentinel, so that ``eos_token_id=None`` can mean "no stop")."""

    MODEL = "the model's generation_config.eos_token_id"


#: :func:`generate`'s default ``eos_token_id``: the model's ``generation_config.eos_token_id``
#: (transformers models), as transformers' ``generate`` takes it; no stop for other models.
MODEL_EOS = ModelEos.MODEL


def generation_problems(plan: Plan) -> list[str]:
    """Why ``plan`` cannot run :func:`generate` (empty: it can); pure data, checked before launch.

    >>> from shardkit.plan import Mesh
    >>> generation_problems(Plan(mesh=Mesh(tp=2))), generation_problems(Plan(mesh=Mesh(fsdp=2, ep=2)))
    ([], [])
    >>> print(generation_problems(Plan(mesh=Mesh(sp=2, tp=2)))[0])
    sk.generate splits a model over 'tp', 'pp' (with a pipeline) and the data axes 'dp', 'fsdp', 'ep' (each data rank its own prompts): mesh axis 'sp' has size 2, but every other axis must have size 1 (e.g. Mesh(tp=4), Mesh(pp=2, tp=2) or Mesh(fsdp=2, ep=2))
    """
    problems = []
    allowed = (GENERATION_AXIS, "pp", *DATA_AXES)
    for axis, size in zip(plan.mesh.names, plan.mesh.shape):
        if axis not in allowed and size > 1:
            problems.append(f"sk.generate splits a model over 'tp', 'pp' (with a pipeline) and the data axes "
                            f"{', '.join(map(repr, DATA_AXES))} (each data rank its own prompts): mesh axis "
                            f"{axis!r} has size {size}, but every other axis must have size 1 (e.g. Mesh(tp=4), "
                            f"Mesh(pp=2, tp=2) or Mesh(fsdp=2, ep=2))")
    if plan.sequence_parallel:
        problems.append("Plan(sequence_parallel=True) splits the sequence over 'tp', but a decode step has one "
                        "token; generate with sequence_parallel=False (the weights are the same)")
    return problems


def check_generation(model: nn.Module, prompt_len: int, max_new_tokens: int, plan: Plan | None = None) -> None:
    """Refuse, before launch (on meta is fine), a model :func:`generate` cannot decode or a length beyond its
    positions: :class:`UsageError` naming what would be valid; with a ``plan`` that has a pipeline, a model
    whose stages do not decode as its own forward does (proven on a miniature,
    :func:`~shardkit.planner.pipeline_proof.decode_problems`): :class:`PlanError`."""
    _cache_kind(model)
    if plan is not None and plan.pipeline is not None:
        problems = decode_problems(model, model_layout(model))
        if problems:
            raise PlanError(problems)
    limit = family_of(model).max_positions(model)
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise UsageError(f"a prompt of {prompt_len} tokens and max_new_tokens={max_new_tokens} need "
                         f"{prompt_len + max_new_tokens} positions, but {type(model).__name__} has {limit}; valid: "
                         f"max_new_tokens <= {limit - prompt_len}" if prompt_len < limit else
                         f"a prompt of {prompt_len} tokens does not fit {type(model).__name__}'s {limit} positions; "
                         f"valid: a prompt of at most {limit - 1} tokens")


def stop_tokens(model: nn.Module, eos_token_id: int | Sequence[int] | None | ModelEos = MODEL_EOS
                ) -> tuple[list[int], int] | None:
    """``(eos ids, pad id)`` that :func:`generate` stops with, or ``None`` (no stop), as transformers'
    ``generate`` picks them: ``eos_token_id`` as given, or for :data:`MODEL_EOS` the model's
    ``generation_config.eos_token_id`` (transformers models; the reference GPT has none); the pad is
    ``generation_config.pad_token_id``, else the first eos id.

    >>> from shardkit.models.hf import build_tiny_llama
    >>> stop_tokens(build_tiny_llama()), stop_tokens(build_tiny_llama(), [7, 9]), stop_tokens(build_tiny_llama(), None)
    (([2], 2), ([7, 9], 7), None)
    """
    config = getattr(model, "generation_config", None) if is_hf_model(model) else None
    if eos_token_id is MODEL_EOS:
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is not None and not _token_ids(eos_token_id):
            raise UsageError(f"sk.generate: the model's generation_config.eos_token_id is {eos_token_id!r}, which is no "
                             f"token id (an int >= 0) or list of them; pass eos_token_id= yourself (None: no stop)")
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not eos:
        return None
    pad = getattr(config, "pad_token_id", None)
    return eos, eos[0] if pad is None else pad


def generate(model: nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int | None = None,
             eos_token_id: int | Sequence[int] | None | ModelEos = MODEL_EOS,
             on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Continue ``input_ids`` (``[batch, prompt]`` token ids) by up to ``max_new_tokens`` tokens; returns
    ``[batch, prompt + new]`` (the prompt first, as transformers' ``generate``).

    Greedy when ``temperature`` is 0; otherwise sampled from ``softmax(logits / temperature)``,
    restricted to the ``top_k`` most likely tokens when given, with a generator seeded by
    ``seed`` (default: drawn from torch's global generator). The first ``tp`` rank chooses each
    token and broadcasts it, so every rank continues the same sequences. A row that makes one of
    ``eos_token_id`` (an id, a list of ids, or ``None``: no stop; default :data:`MODEL_EOS`, the
    model's ``generation_config.eos_token_id``) is finished: its later positions hold the pad
    token (:func:`stop_tokens`), and generation ends when every row is finished, so ``new`` may be
    less than ``max_new_tokens``. Runs in eval mode (the model's mode is restored after) without
    gradients. ``on_token([batch] ids)`` is called after each step (streaming; pad for finished
    rows). Call it on every rank of a model from ``sk.shard`` with a plan whose only split axes are
    ``tp``, ``pp`` and the data axes, or on an unsharded model in any process. The ranks of one
    data rank (its ``tp`` and ``pp`` ranks) pass the same ``input_ids``; each data rank its own,
    and every rank the same ``max_new_tokens`` (refused otherwise, on every rank).

    >>> from shardkit.models.gpt import build_tiny_gpt
    >>> generate(build_tiny_gpt(), torch.tensor([[104, 105]]), max_new_tokens=3).shape
    torch.Size([1, 5])
    """
    plan = getattr(model, "plan", None)  # a model from sk.shard, pipelined or not, has its plan
    if isinstance(plan, Plan):
        problems = generation_problems(plan)  # the same on every rank: each raises before any collective
        if problems:
            raise PlanError(problems)
    together = isinstance(plan, Plan) and plan.mesh.data_size > 1 and dist.is_initialized()
    try:
        problem, stop = None, _checked_call(model, input_ids, max_new_tokens, temperature, top_k, seed, eos_token_id)
    except (UsageError, PlanError) as exc:
        problem, stop = exc, None
    if together:  # data ranks pass their own prompts: a call refused on one is refused on all
        _agree(problem, max_new_tokens)
    if problem is not None:
        raise problem
    pipeline = model._sk_runtime if isinstance(model, PipelinedModule) else None
    group = _tp_group(plan)
    # the rank choosing each token: the first tp rank (of the last pipeline stage)
    leader = (group is None or dist.get_rank(group) == 0) and (pipeline is None or pipeline.has_last)
    device = next(model.parameters()).device
    generator = None
    if temperature > 0 and leader:
        generator = torch.Generator(device)
        generator.manual_seed(int(torch.randint(2**62, ()).item()) if seed is None else seed)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            plain = not together and _plain_axes(plan) and not plain_problems(model) and \
                (pipeline is None or not pipeline_problems(model))
            decoder = PlainSteps(model, *input_ids.shape, max_new_tokens) if plain else Decoder(model)
            tokens, new, done = input_ids.to(device), [], False
            finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
            eos = None if stop is None else torch.tensor(stop[0], device=device)
            for step in range(max_new_tokens):
                logits = decoder.step(tokens)
                token = _choose_or_flag(logits[:, -1].float(), temperature, top_k, generator) if leader else \
                    torch.empty(input_ids.shape[0], dtype=torch.long, device=device)
                if group is not None and (pipeline is None or pipeline.has_last):
                    dist.broadcast(token, group=group, group_src=0)
                if pipeline is not None:
                    dist.broadcast(token, group=pipeline.pp_group, group_src=pipeline.last_pp_rank)
                chosen = token
                bad = (token < 0).any() if not done else torch.zeros((), dtype=torch.bool, device=device)
                if not done:
                    # a finished row goes on with the token chosen for it, not the pad (which some configs set
                    # outside the vocabulary): rows do not see each other, so the other rows' tokens are transformers'
                    tokens = token[:, None]
                    if eos is not None:  # from the broadcast token: every rank finishes the same rows at one step
                        token = token.masked_fill(finished, stop[1])
                        finished = finished | torch.isin(token, eos)
                # the step's one host read: this rank's flags and (one all_reduce) whether any rank runs or failed;
                # a rank whose rows are done runs its last tokens again, its results discarded, until every rank is
                now_done, mine_bad, running, bad_rank = _flags(finished.all() if not done else None, bad, together)
                if not done and not mine_bad:
                    new.append(token)
                    if on_token is not None:
                        on_token(token)
                    done = now_done
                if bad_rank is not None:  # every rank sees the flag, so every rank stops here
                    where = f"prompt(s) {(chosen < 0).nonzero().flatten().tolist()}" if mine_bad else \
                        f"rank {bad_rank}'s prompt(s)"
                    raise UsageError(f"sk.generate: the model's logits for new token {step + 1} of {where} are nan "
                                     f"or +inf: its weights or activations are not finite (check the weights it "
                                     f"loaded); stopped after {step} new tokens")
                if not running:
                    break
    finally:
        model.train(training)
    return torch.cat([input_ids, torch.stack(new, dim=1).to(input_ids.device)], dim=1)


def _checked_call(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int | None, eos_token_id: int | Sequence[int] | None | ModelEos
                  ) -> tuple[list[int], int] | None:
    """:func:`generate`'s checks of its arguments against the model; returns :func:`stop_tokens`."""
    _check_arguments(input_ids, max_new_tokens, temperature, top_k, seed, eos_token_id)
    check_generation(model, input_ids.shape[1], max_new_tokens)
    vocab = family_of(model).vocab_size(model)
    if vocab is not None and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise UsageError(f"sk.generate: input_ids holds ids from {int(input_ids.min())} to {int(input_ids.max())}, "
                         f"but the model's vocabulary is {vocab}; valid ids: 0 to {vocab - 1}")
    if vocab is not None and top_k is not None and top_k > vocab:
        raise UsageError(f"sk.generate: top_k={top_k} is more than the model's vocabulary of {vocab}; valid: 1 to "
                         f"{vocab}, or None for every token")
    if vocab is not None and eos_token_id not in (None, MODEL_EOS):
        outside = [i for i in ([eos_token_id] if _is_int(eos_token_id) else eos_token_id) if i >= vocab]
        if outside:
            raise UsageError(f"sk.generate: eos_token_id={eos_token_id!r} holds id {outside[0]}, but the model's "
                             f"vocabulary is {vocab}; valid ids: 0 to {vocab - 1}")
    pipeline = model._sk_runtime if isinstance(model, PipelinedModule) else None
    if pipeline is not None and pipeline.decode_problems:  # proven when the pipeline was built: every rank stops
        raise PlanError(list(pipeline.decode_problems))
    return stop_tokens(model, eos_token_id)


def _agree(problem: Exception | None, max_new_tokens: object) -> None:
    """Every rank's outcome of its checks and its ``max_new_tokens`` (a collective): raises on every
    rank when one was refused (its own error where it was) or the ranks would make different numbers of steps."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (None if problem is None else str(problem), max_new_tokens))
    if problem is not None:
        raise problem
    refused = next(((r, message) for r, (message, _) in enumerate(every) if message is not None), None)
    if refused is not None:
        raise UsageError(f"sk.generate: rank {refused[0]}'s call was refused, so no rank generates: {refused[1]}")
    asked = [n for _, n in every]
    if len(set(asked)) > 1:
        raise UsageError(f"sk.generate: max_new_tokens differs between ranks ({asked}, by rank), but the ranks of a "
                         f"plan with data axes step together; pass the same max_new_tokens on every rank")


def _flags(done: torch.Tensor | None, bad: torch.Tensor, together: bool) -> tuple[bool, bool, bool, int | None]:
    """After a step, in one host read: whether this rank's rows are all done (``done``: a flag on the device;
    ``None``: done before this step), whether its logits were not finite (``bad``), and over every rank when
    ``together`` (one ``all_reduce``) or this one: whether any rank has an unfinished row, and the first rank
    whose logits were not finite (``None``: none)."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if together else (1, 0)
    done = torch.ones((), dtype=torch.bool, device=bad.device) if done is None else done
    every = torch.stack([(~done).long(), bad.long() * (world - rank)])  # MAX: any running; the first bad rank
    if together:
        dist.all_reduce(every, op=dist.ReduceOp.MAX)
    mine_done, mine_bad, running, first_bad = torch.cat([torch.stack([done, bad]).long(), every]).tolist()
    return bool(mine_done), bool(mine_bad), bool(running), (world - first_bad) if first_bad else None


def _check_arguments(input_ids: object, max_new_tokens: object, temperature: object, top_k: object,
                     seed: object, eos_token_id: object) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in ID_DTYPES \
            or 0 in input_ids.shape:
        what = type(input_ids).__name__ if not isinstance(input_ids, torch.Tensor) else \
            f"a {input_ids.dtype} tensor of shape {list(input_ids.shape)}"
        raise UsageError(f"sk.generate: input_ids must be a torch.int64 or torch.int32 tensor [batch, prompt] with "
                         f"at least one prompt of at least one token, got {what}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise UsageError(f"sk.generate: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise UsageError(f"sk.generate: temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise UsageError(f"sk.generate: top_k must be a positive integer or None, got {top_k!r}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise UsageError(f"sk.generate: seed must be an integer from 0 to 2**64 - 1 (torch's generator) or None, "
                         f"got {seed!r}")
    if eos_token_id is not None and eos_token_id is not MODEL_EOS and not _token_ids(eos_token_id):
        raise UsageError(f"sk.generate: eos_token_id must be a token id (an int >= 0), a non-empty list of them, or "
                         f"None (no stop), got {eos_token_id!r}")
    if temperature == 0 and (top_k is not None or seed is not None):
        given = ", ".join(f"{n}={v!r}" for n, v in (("top_k", top_k), ("seed", seed)) if v is not None)
        raise UsageError(f"sk.generate: {given} applies only to sampling (temperature > 0), but temperature=0 is "
                         f"greedy; pass a temperature > 0 or drop {given}")


def _token_ids(value: object) -> bool:
    """Whether ``value`` is a token id (an int >= 0) or a non-empty list or tuple of them."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_is_int(i) and i >= 0 for i in value)
    return _is_int(value) and value >= 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cache_kind(model: nn.Module) -> str:
    # a pipelined model's forward runs one stage: the model's own forward is the one after the mixin's
    forward = super(PipelinedModule, model).forward if isinstance(model, PipelinedModule) else model.forward
    if callable(getattr(model, "kv_cache", None)) and "cache" in inspect.signature(forward).parameters:
        return "own"
    can_generate = getattr(model, "can_generate", None)
    if is_hf_model(model) and callable(can_generate) and can_generate():
        return "hf"
    raise UsageError(f"sk.generate cannot decode {type(model).__name__}: it needs a transformers model that can "
                     f"generate (a *ForCausalLM / *LMHeadModel) or a model with kv_cache() whose forward takes "
                     f"cache= (as shardkit's reference GPT)")


class Decoder:
    """A model and its KV cache: ``step(new_ids)`` runs the new tokens after the cached ones and
    returns their logits ``[batch, new, vocab]`` (transformers models: the last position's only).

    A pipelined model (``sk.shard`` with a pipeline) runs every stage in turn
    (:meth:`PipelinedModule.through_stages`); ``step`` returns the logits on the ranks of the
    last stage and ``None`` on the others, and each rank's cache fills only for its own layers.
    ``cache.layers[i].keys`` / ``.values`` are ``[batch, local kv heads, positions, head_dim]``
    for both kinds of cache; :attr:`nbytes` is what this rank holds.
    """

    def __init__(self, model: nn.Module):
        self.model, self.past = model, 0
        self.kwargs: dict = {}
        self.pipelined = isinstance(model, PipelinedModule)
        if self.pipelined:  # a new decoding: its first two steps send their hidden states' headers
            model._sk_runtime.forget_layouts()
        if _cache_kind(model) == "own":
            self.cache = model.kv_cache()
            return
        from transformers import DynamicCache

        self.cache = DynamicCache(config=model.config)
        parameters = inspect.signature(model.forward).parameters
        self.kwargs = {"use_cache": True, "cache" if "cache" in parameters else "past_key_values": self.cache}
        if "logits_to_keep" in parameters:
            self.kwargs["logits_to_keep"] = 1

    def step(self, ids: torch.Tensor) -> torch.Tensor | None:
        past, self.past = self.past, self.past + ids.shape[1]
        if self.pipelined:
            return self.model.through_stages(ids, cache=self.cache, past=past)
        if not self.kwargs:
            return self.model(ids, cache=self.cache)
        return self.model(input_ids=ids, **self.kwargs).logits

    @property
    def nbytes(self) -> int:
        """Bytes of every cached key and value on this rank."""
        return sum(t.nbytes for layer in self.cache.layers for t in (layer.keys, layer.values)
                   if isinstance(t, torch.Tensor))


class PlainSteps:
    """:class:`Decoder`'s ``step`` on :class:`~shardkit.runtime.plain_decode.PlainDecoder` (plain tensors, one
    ``all_reduce`` per row-parallel layer), through the stages of a pipeline with
    :class:`~shardkit.runtime.plain_pipeline.PlainPipeline`: what :func:`generate` runs on a model it can decode
    that way (logits on the last stage's ranks, ``None`` on the others)."""

    def __init__(self, model: nn.Module, batch: int, prompt_len: int, max_new_tokens: int):
        kind = PlainPipeline if isinstance(model, PipelinedModule) else PlainDecoder
        self.decoder, self.past = kind(model, slots=batch, max_len=prompt_len + max_new_tokens), 0

    def step(self, ids: torch.Tensor) -> torch.Tensor | None:
        past, self.past = self.past, self.past + ids.shape[1]
        logits = self.decoder.step(ids, past)
        return None if logits is None else logits[:, None]


def _plain_axes(plan: object) -> bool:
    """Whether ``plan`` (or no plan: an unsharded model) splits over ``tp`` and ``pp`` alone."""
    return not isinstance(plan, Plan) or all(size == 1 or axis in (GENERATION_AXIS, "pp")
                                              for axis, size in zip(plan.mesh.names, plan.mesh.shape))


def _choose_or_flag(logits: torch.Tensor, temperature: float, top_k: int | None,
                    generator: torch.Generator | None) -> torch.Tensor:
    """:func:`_choose`, with ``-1`` for each row whose logits hold nan or +inf (no token can be chosen)."""
    bad = logits.isnan().any(dim=-1) | logits.isposinf().any(dim=-1)
    token = _choose(logits.masked_fill(bad[:, None], 0.0), temperature, top_k, generator)
    return token.masked_fill(bad, -1)


def _choose(logits: torch.Tensor, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> torch.Tensor:
    """The next token per row of ``logits [batch, vocab]``: argmax, or a sample."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    # shifted so the likeliest token scores 0: a tiny temperature sends the others to -inf (greedy), not to nan
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


def _tp_group(plan: object):
    """The process group of the ``tp`` axis, or ``None`` (unsharded, or tp of size 1)."""
    if not isinstance(plan, Plan) or plan.mesh.size_of(GENERATION_AXIS) < 2:
        return None
    from .context import current_context
    from .meshes import meshes_for

    return meshes_for(plan, current_context().device.type).axis(GENERATION_AXIS).get_group()


__all__ = ["MODEL_EOS", "Decoder", "ModelEos", "PlainSteps", "check_generation", "generate", "generation_problems", "stop_tokens"]
