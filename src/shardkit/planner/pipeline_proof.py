"""Proof, before launch, that a pipeline's stages compute what the model's own forward computes.

A pipeline stage does not run the model's forward: it re-runs the piece of it the stage
holds (:meth:`Family.stage_forward`), positions, masks and rotary embeddings recomputed on
every stage. For a transformers causal LM that is shardkit's reading of a forward it did not
write, so rather than trusting a list of model types, :func:`stage_problems` proves it for
the model at hand: it builds a miniature of the model's own class from its config
(:mod:`shardkit.planner.miniature`), and in one process compares

- the logits of the stages run one after another with the model's own forward, for two
  cuts (every unit a stage of its own, so every boundary is crossed; and two halves, so
  stages hold several layers), on random token ids;
- the gradient of every parameter of a loss on those logits;
- decoding with a KV cache (a prompt, then one token at a time) through the stages, as
  ``sk.generate`` runs a pipeline, with the model's forward over the same cache:
  :func:`decode_problems`, asked only by generation.

It refuses only where they differ, saying what differs (the largest difference and where),
and is cached per model class and config. A few milliseconds for a small config.

>>> from shardkit.families import model_layout
>>> from shardkit.models.hf import build_tiny_llama
>>> model = build_tiny_llama()
>>> stage_problems(model, model_layout(model))
[]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..families import ModelLayout, Unit, model_layout
from ..families.hf import is_hf_model
from .miniature import CANDIDATES, Miniature, build_miniature, model_name

#: Sequences of the proof: 2 rows of 12 tokens (longer than the miniature's sliding window).
BATCH, SEQ = 2, 12
#: Prompt and decode steps of the decoding proof.
PROMPT, DECODE_STEPS = 6, 3
#: Relative tolerance: both ways run the same operations in float32, so they agree to rounding.
RTOL = 1e-4


def stage_problems(model: nn.Module, layout: ModelLayout) -> list[str]:
    """Why ``layout``'s stages would not compute ``model``'s forward (empty: proven equal, or
    nothing to prove: the family runs no forward of a library's model). On meta is fine."""
    return list(_proof(model, layout)[0])


def decode_problems(model: nn.Module, layout: ModelLayout) -> list[str]:
    """Why decoding with a KV cache through ``layout``'s stages (``sk.generate`` on a pipeline)
    would not give the model's own tokens (empty: proven equal, or nothing to prove)."""
    forward, decode = _proof(model, layout)
    return list(forward) or list(decode)


#: Proofs made in this process, by model class and config: ``(forward problems, decode problems)``.
_PROOFS: dict[tuple[type, str], tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _proof(model: nn.Module, layout: ModelLayout) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if not (is_hf_model(model) and layout.kind == "hf-causal-lm"):
        return (), ()
    key = (type(model), model.config.to_json_string())
    if key not in _PROOFS:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a miniature's operations are too small to gain from threads, and lose with them
        try:
            _PROOFS[key] = _prove(model)
        finally:
            torch.set_num_threads(threads)
    return _PROOFS[key]


def _prove(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    built = _miniature(model)
    if isinstance(built, str):
        return (built,), ()
    mini, ids = built
    layout = model_layout(mini.model)
    units = layout.units
    cuts = {"every unit a stage of its own": [[u] for u in units], "two halves": _halves(units)}
    forward = _compare_forward(mini, layout, cuts, ids)
    if forward:
        return (forward,), ()
    decode = _compare_decode(mini, layout, cuts, ids[:, :PROMPT + DECODE_STEPS])
    return (), (decode,) if decode else ()


def _miniature(model: nn.Module) -> tuple[Miniature, torch.Tensor] | str:
    """The first miniature of :data:`~shardkit.planner.miniature.CANDIDATES` that builds and whose
    own forward runs, with the proof's token ids; else why none does."""
    error: Exception | None = None
    for widths in CANDIDATES:
        try:
            mini = build_miniature(model, widths)
            ids = torch.randint(mini.model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                mini.model(ids)
            return mini, ids
        except Exception as exc:  # any failure is a reason this miniature cannot be made
            error = error or exc
    assert error is not None
    return (f"{model_name(model)} cannot be cut into pipeline stages: shardkit proves a pipeline's stages on a "
            f"miniature of the model's own class built from its config, and could not build one that runs "
            f"({_error(error)}); use a plan without 'pp' for this model")


def _halves(units: Sequence[Unit]) -> list[list[Unit]]:
    blocks = [i for i, u in enumerate(units) if u.block]
    cut = blocks[len(blocks) // 2]
    return [list(units[:cut]), list(units[cut:])]


def _through(layout: ModelLayout, model: nn.Module, stages: list[list[Unit]], x: torch.Tensor) -> torch.Tensor:
    for units in stages:
        x = layout.family.stage_forward(model, units, x)
    return x


def _logits(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def _compare_forward(mini: Miniature, layout: ModelLayout, cuts: dict[str, list[list[Unit]]],
                     ids: torch.Tensor) -> str | None:
    model = mini.model
    expected = _logits(model(ids))
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    expected_grads = torch.autograd.grad((expected * weights).sum(), [p for _, p in params], allow_unused=True)
    for cut, stages in cuts.items():
        try:
            got = _through(layout, model, stages, ids)
        except Exception as exc:
            return _cannot_run(mini, f"the stages ({cut})", exc)
        where = _difference(got, expected)
        if where:
            return _differs(mini, f"the logits of the stages ({cut}) differ from the model's forward's {where}")
        grads = torch.autograd.grad((got * weights).sum(), [p for _, p in params], allow_unused=True)
        for (name, _), a, b in zip(params, grads, expected_grads):
            where = _difference(a, b) if a is not None and b is not None else \
                None if a is None and b is None else "(one of them has none)"
            if where:
                return _differs(mini, f"the gradient of {name!r} through the stages ({cut}) differs from the one "
                                      f"through the model's forward {where}")
    return None


def _compare_decode(mini: Miniature, layout: ModelLayout, cuts: dict[str, list[list[Unit]]],
                    ids: torch.Tensor) -> str | None:
    from transformers import DynamicCache

    model = mini.model
    cache_argument = "cache" if "cache" in _parameters(model.forward) else "past_key_values"
    steps = [ids[:, :PROMPT]] + [ids[:, i:i + 1] for i in range(PROMPT, ids.shape[1])]
    with torch.no_grad():
        try:
            cache, past, expected = DynamicCache(config=model.config), 0, []
            for step in steps:
                expected.append(_logits(model(step, use_cache=True, **{cache_argument: cache}))[:, -1])
        except Exception as exc:
            return _cannot_run(mini, "the model's own forward with a KV cache", exc, "generate")
        for cut, stages in cuts.items():
            cache, past = DynamicCache(config=model.config), 0
            for index, step in enumerate(steps):
                x = step
                try:
                    for units in stages:
                        x = layout.family.stage_decode(model, units, x, cache, past)
                except Exception as exc:
                    return _cannot_run(mini, f"the stages ({cut}) with a KV cache", exc, "generate")
                past += step.shape[1]
                where = _difference(x[:, -1], expected[index])
                if where:
                    what = "the prompt" if index == 0 else f"decode step {index}"
                    return _differs(mini, f"decoding through the stages ({cut}) with a KV cache gives logits for "
                                          f"{what} that differ from the model's forward's {where}", "generate")
    return None


@functools.cache
def _parameters(fn: Callable) -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(fn).parameters)


def _difference(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """``None`` when ``got`` equals ``expected`` to :data:`RTOL` of its largest value; else by how much and where."""
    if got.shape != expected.shape:
        return f"in shape ({list(got.shape)} against {list(expected.shape)})"
    if expected.numel() == 0:
        return None
    diff = (got.detach().float() - expected.detach().float()).abs().nan_to_num(float("inf"))
    scale = float(expected.detach().float().abs().max())
    bound = RTOL * max(scale, 1e-6)
    if float(diff.max()) <= bound:
        return None
    first = [int(i) for i in (diff > bound).nonzero()[0]]
    return (f"by up to {float(diff.max()):.3g} (the largest value is {scale:.3g}; the first difference at index "
            f"{first} of shape {list(expected.shape)})")


def _differs(mini: Miniature, what: str, use: str = "pp") -> str:
    advice = "use a plan without 'pp' for this model" if use == "pp" else \
        "generate with a plan without 'pp' (tp alone) for this model"
    return (f"{mini.source} cannot be cut into pipeline stages{' for generation' if use != 'pp' else ''}: on "
            f"{mini.describe()}, {what}; shardkit's stages re-run its embedding, each decoder layer with the mask "
            f"of its kind and its rotary embedding, the final norm and lm_head (with the logit scalings it knows), "
            f"and this model's forward does something else; {advice}")


def _cannot_run(mini: Miniature, what: str, exc: Exception, use: str = "pp") -> str:
    return _differs(mini, f"{what} failed ({_error(exc)})", use)


def _error(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


__all__ = ["BATCH", "DECODE_STEPS", "PROMPT", "RTOL", "SEQ", "decode_problems", "stage_problems"]
