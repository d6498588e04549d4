"""Router losses and balancing that depend on the whole batch, found on the model, and what a plan
must keep whole for them (:mod:`shardkit.models.routing` has the formulas).

An auxiliary loss over router logits (Mixtral's, Qwen2-MoE's) is nonlinear in the batch's means,
so a data rank computing it over its own tokens computes another function than one process. It
is found by a check on the model, not by its type: a function of the modules that define the
model's classes, named like a router loss (``load_balancing_loss_func``, ``router_z_loss_func``),
called by a forward on the meta device (or, where the model cannot run there, named by a forward).
One that computes transformers' load-balancing formula (checked on a small random input against
:func:`shardkit.models.routing.load_balancing_loss_func`, with and without an attention mask) is
*known*: the runtime sums it over the whole batch (:mod:`shardkit.runtime.router_balance`). Any
other is refused by name under a split batch. Bias-balanced routers
(:func:`shardkit.models.routing.bias_balanced`) have their load summed over the data ranks.

>>> from shardkit.models.gpt import GPT, GPTConfig
>>> model = GPT(GPTConfig(experts=4, router_aux_loss_coef=0.01))
>>> [(f.name, f.known, f.called) for f in router_losses(model)]
[('load_balancing_loss_func', True, True)]
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..families import family_of
from ..families.on_meta import meta_tensors, run_on_meta
from ..models.routing import bias_balanced, load_balancing_loss_func
from ..plan import Plan
from .batch_stats import data_ranks

#: The name of transformers' load-balancing loss (the one router loss shardkit sums over the whole batch).
AUX_LOSS = "load_balancing_loss_func"
_ROUTER_LOSS = re.compile(r"(balanc|router|aux|z_loss).*loss|loss.*(balanc|router|aux)", re.IGNORECASE)


@dataclass(frozen=True)
class RouterLoss:
    """A router-loss function in ``module`` (a Python module of the model's classes) under ``name``:
    ``known`` when it computes transformers' load-balancing formula, ``called`` when a forward of the
    model calls it."""

    module: str
    name: str
    known: bool
    called: bool

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name}"


def _candidates(model: nn.Module) -> list[tuple[ModuleType, str]]:
    """Functions named like a router loss in the Python modules that define ``model``'s classes."""
    found: dict[tuple[str, str], tuple[ModuleType, str]] = {}
    for cls in {type(m) for m in model.modules()}:
        for klass in cls.__mro__:
            module = sys.modules.get(klass.__module__)
            if module is None or klass.__module__.startswith(("torch.", "shardkit.runtime")):
                continue
            for name, value in vars(module).items():
                if inspect.isfunction(value) and _ROUTER_LOSS.search(name):
                    found.setdefault((module.__name__, name), (module, name))
    return list(found.values())


@functools.lru_cache(maxsize=64)
def computes_load_balancing(function: Any) -> bool:
    """Whether ``function(gate_logits, num_experts, top_k, attention_mask)`` is transformers'
    load-balancing loss: equal to ours on random logits of two layers, with and without a mask
    (asked once per function: each validation of a model asks it again)."""
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, 4, generator=generator) for _ in range(2))
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    try:
        for args in ((logits, 4, 2), (logits, 4, 2, mask), (logits, 4, 1)):
            theirs = function(*args)
            if not isinstance(theirs, torch.Tensor) or not torch.allclose(theirs, load_balancing_loss_func(*args),
                                                                          rtol=1e-5, atol=1e-6):
                return False
    except Exception:  # another signature or formula
        return False
    return True


def _named_by_forward(model: nn.Module, name: str) -> bool:
    for cls in {type(m) for m in model.modules()}:
        code = getattr(inspect.unwrap(cls.forward), "__code__", None)
        if code is not None and name in code.co_names:
            return True
    return False


@contextmanager
def _watched(candidates: list[tuple[ModuleType, str]], called: set[tuple[str, str]]) -> Iterator[None]:
    """Each candidate replaced in its module by a recorder (returning a zero) while open."""
    originals = {(m.__name__, n): (m, getattr(m, n)) for m, n in candidates}

    def recorder(key: tuple[str, str]) -> Any:
        def record(*args: Any, **kwargs: Any) -> torch.Tensor:
            called.add(key)
            return torch.zeros((), device="meta")
        return record

    for key, (module, _) in originals.items():
        setattr(module, key[1], recorder(key))
    try:
        yield
    finally:
        for (_, name), (module, original) in originals.items():
            setattr(module, name, original)


def router_losses(model: nn.Module, example_inputs: tuple | None = None, *, run: bool = True) -> list[RouterLoss]:
    """The router-loss functions of ``model`` (module docstring), whether each is known and called
    (``run=False``: named by a forward, without running the model on meta)."""
    candidates = _candidates(model)
    if not candidates:
        return []
    called: set[tuple[str, str]] = set()
    inputs = (example_inputs or family_of(model).example_inputs(model)) if run else None
    ran = False
    if inputs is not None:
        try:
            with _watched(candidates, called), torch.no_grad():
                run_on_meta(model, meta_tensors(model), inputs)
            ran = True
        except Exception:  # the model's own error on meta is the dataflow checks' to report
            called.clear()
    return [RouterLoss(m.__name__, n, n == AUX_LOSS and computes_load_balancing(getattr(m, n)),
                       (m.__name__, n) in called if ran else _named_by_forward(model, n)) for m, n in candidates]


def _data_axes(plan: Plan) -> str:
    m = plan.mesh
    return ", ".join(f"{a}={m[a]}" for a in m.names if a in ("dp", "fsdp", "ep", "sp") and m[a] > 1)


def routing_problems(plan: Plan, model: nn.Module, example_inputs: tuple | None = None) -> list[str]:
    """What ``plan`` cannot keep as one process computes it: a router loss of another formula under
    a split batch, a router loss or a bias-balanced router in a pipeline, bias counting under
    full recompute."""
    split, piped = data_ranks(plan.mesh), plan.pipeline is not None
    biased = [n for n, _ in bias_balanced(model)]
    if split == 1 and not piped and not (biased and plan.recompute == "full"):
        return []
    problems = []
    losses = router_losses(model, run=False)  # named by a forward; run on meta only where it decides something
    if piped or any(loss.called and not loss.known for loss in losses):
        losses = router_losses(model, example_inputs)
    for loss in losses:
        if not loss.called:
            continue
        if not loss.known and split > 1:
            problems.append(f"{type(model).__name__}'s forward computes a router loss with {loss.where}, which is not "
                            f"transformers' load-balancing formula (the one shardkit sums over the whole batch): under "
                            f"{_data_axes(plan)} each of the {split} data ranks would compute it over its own tokens, "
                            f"unlike one process; turn it off (output_router_logits=False) or use one data rank")
        if piped:
            problems.append(f"{type(model).__name__}'s forward computes a router auxiliary loss ({loss.where}) over "
                            f"every layer, which a pipeline's stages (each holding some layers, a micro-batch at a "
                            f"time) do not compute as one process; turn it off (output_router_logits=False, "
                            f"router_aux_loss_coef=0) or use no pipeline")
    if biased and piped:
        problems.append(f"routers {biased[:4]} balance their experts with a bias updated after each step, not yet "
                        f"verified under a pipeline; use no pipeline or balance without a bias")
    if biased and plan.recompute == "full":
        problems.append(f"routers {biased[:4]} count their experts' load in each training forward, and "
                        f"recompute='full' runs every block's forward twice, counting it twice; use "
                        f"recompute='selective' or 'none'")
    return problems


def micro_batch_problems(model: nn.Module, parts: int, what: str) -> list[str]:
    """A router auxiliary loss the forward computes, under ``what`` (a step of ``parts`` > 1 micro-batches)."""
    if parts <= 1:
        return []
    return [f"{what}: {type(model).__name__}'s forward computes a router auxiliary loss ({loss.where}), nonlinear "
            f"in the means over the batch, so each of the {parts} micro-batches' would differ from one step over the "
            f"whole batch; use one micro-batch per step" for loss in router_losses(model) if loss.called]


__all__ = ["AUX_LOSS", "RouterLoss", "computes_load_balancing", "micro_batch_problems", "router_losses",
           "routing_problems"]
