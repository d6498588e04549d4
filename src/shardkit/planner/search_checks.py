"""What ``sk.validate`` says of the kinds of plan autoshard searches, per model: checked once,
on the model (or the one :func:`~shardkit.planner.analysis.probe_model` builds from a config),
and for a model given by config or catalogue name stored on disk between processes
(:mod:`shardkit.planner.stored`), so that a first search in a process builds no model when the
answers are known."""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

from torch import nn

from ..plan import Plan, PlanError, PlanWarning
from .analysis import model_key, probe_model
from .costs import Setting
from .dataflow import Dataflow
from .expert_search import expert_degrees
from .experts import ExpertsLayer, ModelExperts, model_experts
from .model_checks import shared_traces
from .stored import stored

#: What sk.validate said of each probe plan, per module (a model's kinds of plan do not change while it lives).
_REFUSALS: weakref.WeakKeyDictionary[nn.Module, dict[str, str | None]] = weakref.WeakKeyDictionary()


class ModelChecks:
    """``sk.validate``'s answers about one model, cached in the process and, for a config, on disk.

    >>> from shardkit.plan import Mesh
    >>> ModelChecks("gpt-tiny").refusal(Plan(Mesh(dp=1), recompute="full")) is None
    True
    """

    def __init__(self, model: Any):
        self.model = model
        self.key = model_key(model)  # None for a module: what validate says of it is kept in the process only
        self.name = model if isinstance(model, str) else None  # a catalogue name: shipped answers may hold it
        self._traces: weakref.WeakKeyDictionary[nn.Module, Dataflow] = weakref.WeakKeyDictionary()

    @functools.cached_property
    def probe(self) -> nn.Module:
        """The model plans are validated on, built only when an answer is not stored."""
        return probe_model(self.model)

    def refusal(self, plan: Plan) -> str | None:
        """Why ``sk.validate`` refuses ``plan`` on the model (``None``: it accepts it)."""
        key = plan.to_json(indent=None)
        if self.key is not None:
            return stored("refusal", f"{self.key}|{key}", lambda: self._validated(plan), self.name)
        known = _REFUSALS.setdefault(self.probe, {})
        if key not in known:
            known[key] = self._validated(plan)
        return known[key]

    def expert_degrees(self, axes: tuple[str, ...], data: int, base: Setting) -> tuple[list[int], list[tuple[str, str]]]:
        """:func:`~shardkit.planner.expert_search.expert_degrees` of the model and the families it refused."""
        if "ep" not in axes:
            return [1], []  # no ep searched: nothing of the model needed
        refused: list[tuple[str, str]] = []
        return expert_degrees(self.experts, axes, data, base, lambda *r: refused.append(r)), refused

    @functools.cached_property
    def experts(self) -> ModelExperts:
        """What the ``ep`` checks read of the model, whatever the degrees (stored for a config)."""
        if self.key is None:
            return model_experts(self.probe)
        return stored("experts", self.key, lambda: model_experts(self.probe), self.name, (ModelExperts, ExpertsLayer))

    def _validated(self, plan: Plan) -> str | None:
        from .validate import validate

        try:
            with warnings.catch_warnings(), shared_traces(self._traces):  # one meta forward for every plan
                warnings.simplefilter("ignore", PlanWarning)
                validate(plan, self.probe)
            return None
        except PlanError as exc:
            return exc.problems[0] if exc.problems else str(exc)


__all__ = ["ModelChecks"]
