"""Loss scaling as data: what ``Plan(loss_scale=...)`` may hold, which plans need it, and the rule that
moves a dynamic scale from step to step (no torch; the runtime is :mod:`shardkit.runtime.loss_scaling`).

float16 keeps 10 mantissa bits but only 5 exponent bits: gradients below about ``6e-8`` become zero
(and below ``6e-5`` lose precision), so a float16 forward and backward (``param_dtype``) or float16
gradient reduction (``reduce_dtype``) multiplies the loss by a scale before the backward and divides
the gradients by it before the optimizer (Micikevicius et al. 2018, "Mixed precision training").
``Plan(loss_scale=...)``:

- ``None`` (not written): ``"dynamic"`` when the plan computes or reduces in float16, else off;
- ``"dynamic"``: start at ``2**16``; a step whose gradients hold an inf or nan on any rank is skipped
  on every rank and halves the scale; after ``2000`` steps in a row without one the scale doubles
  (torch's ``GradScaler`` defaults);
- a positive number: that scale, fixed (a step with an overflow is still skipped);
- ``"off"``: no scaling; refused with float16, whose gradients would underflow (bfloat16 has
  float32's exponent range and needs none).

>>> resolved_loss_scale(None, "float16", None), resolved_loss_scale(None, "bfloat16", None)
('dynamic', None)
>>> rule = scale_rule("dynamic")
>>> rule.next(ScaleState(1024.0, 5), overflow=True)
ScaleState(scale=512.0, good_steps=0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import PlanError

DYNAMIC, OFF = "dynamic", "off"
#: The names ``Plan(loss_scale=...)`` takes besides a positive number and ``None``.
LOSS_SCALES = (DYNAMIC, OFF)
#: The dtype whose gradients underflow without a loss scale.
NEEDS_SCALING = "float16"


@dataclass(frozen=True)
class ScaleState:
    """Where a scale stands: its value and the steps in a row without an overflow since it last changed."""

    scale: float
    good_steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScaleState:
        return cls(float(data["scale"]), int(data["good_steps"]))


@dataclass(frozen=True)
class ScaleRule:
    """How a scale moves: times ``backoff_factor`` after an overflow (the step skipped), times
    ``growth_factor`` after ``growth_interval`` good steps in a row; torch's ``GradScaler`` defaults.
    A fixed scale is the rule with both factors 1.

    >>> rule = ScaleRule(init_scale=8.0, growth_interval=2)
    >>> state = rule.start()
    >>> for overflow in (False, False, True, False):
    ...     state = rule.next(state, overflow)
    ...     print(state.scale, state.good_steps)
    8.0 1
    16.0 0
    8.0 0
    8.0 1
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def start(self) -> ScaleState:
        return ScaleState(self.init_scale)

    def next(self, state: ScaleState, overflow: bool) -> ScaleState:
        """The state after a step that did (skipped) or did not overflow."""
        if overflow:
            return ScaleState(state.scale * self.backoff_factor, 0)
        if state.good_steps + 1 >= self.growth_interval:
            return ScaleState(state.scale * self.growth_factor, 0)
        return ScaleState(state.scale, state.good_steps + 1)


def check_loss_scale(value: Any, where: str) -> str | float | None:
    """``value`` if ``Plan(loss_scale=...)`` may hold it: ``None``, ``"dynamic"``, ``"off"`` or a positive
    finite number (``True``, ``"1024"``, ``0`` are errors naming ``where``).

    >>> check_loss_scale("static", "Plan(loss_scale=...)")
    Traceback (most recent call last):
    ...
    shardkit.plan.errors.PlanError: Plan(loss_scale=...) must be null/None, 'dynamic', 'off' or a positive number (a fixed scale such as 1024), got str 'static'
    """
    if value is None or value in LOSS_SCALES and isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf:
        return float(value)
    raise PlanError(f"{where} must be null/None, {', '.join(map(repr, LOSS_SCALES))} or a positive number (a fixed "
                    f"scale such as 1024), got {type(value).__name__} {value!r}")


def resolved_loss_scale(loss_scale: str | float | None, param_dtype: str | None,
                        reduce_dtype: str | None) -> str | float | None:
    """What scaling a plan runs: ``"dynamic"``, a fixed number, or ``None`` (off)."""
    if loss_scale is None:
        return DYNAMIC if NEEDS_SCALING in (param_dtype, reduce_dtype) else None
    return None if loss_scale == OFF else loss_scale


def loss_scale_problems(loss_scale: str | float | None, param_dtype: str | None, reduce_dtype: str | None) -> list[str]:
    """``loss_scale="off"`` written with float16 compute or gradient reduction.

    >>> loss_scale_problems("off", "float16", None)
    ["loss_scale='off' with param_dtype='float16': float16 gradients below 6e-8 become zero, so training would silently lose them; use loss_scale='dynamic' (the default with float16) or a fixed scale such as 1024, or param_dtype='bfloat16', which has float32's exponent range and needs no loss scale"]
    """
    if loss_scale != OFF:
        return []
    names = [f"{name}={dtype!r}" for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype))
             if dtype == NEEDS_SCALING]
    if not names:
        return []
    which = " and ".join(names)
    bf16 = " and ".join(f"{name.split('=')[0]}='bfloat16'" for name in names)
    return [f"loss_scale='off' with {which}: float16 gradients below 6e-8 become zero, so training would silently "
            f"lose them; use loss_scale='dynamic' (the default with float16) or a fixed scale such as 1024, or "
            f"{bf16}, which has float32's exponent range and needs no loss scale"]


def scale_rule(loss_scale: str | float) -> ScaleRule:
    """The rule of a resolved, enabled loss scale: torch's dynamic defaults, or a fixed scale."""
    if loss_scale == DYNAMIC:
        return ScaleRule()
    return ScaleRule(init_scale=float(loss_scale), growth_factor=1.0, backoff_factor=1.0)


__all__ = ["DYNAMIC", "LOSS_SCALES", "OFF", "ScaleRule", "ScaleState", "check_loss_scale", "loss_scale_problems",
           "resolved_loss_scale", "scale_rule"]
