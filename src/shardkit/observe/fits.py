"""Alpha-beta fits of collective timings: the :class:`~shardkit.planner.hardware.Link` whose
``steps * latency + factor * S / bandwidth`` best describes measured times, and how well it does;
and the ranks' drift (``Hardware.skew``) from the waits the skew probe measured.
``shardkit calibrate`` (:mod:`shardkit.observe.calibrate`) fits each gloo collective with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..plan.errors import UsageError
from ..planner.hardware import Link


@dataclass(frozen=True)
class Fit:
    """One collective's measurement: message ``sizes`` (bytes), the ``times`` (s) measured, the
    fitted :class:`Link` and the fit's relative RMS ``residual`` (0.1: off by 10% on average)."""

    collective: str
    sizes: tuple[int, ...]
    times: tuple[float, ...]
    link: Link
    residual: float


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], factor: float, steps: int = 1) -> Link:
    """The :class:`Link` whose ``steps * latency + factor * S / bandwidth`` best fits ``times``.

    Least squares of ``t = a + b * factor * S`` over relative errors (each point weighted by
    ``1 / t``): message sizes span decades, and plain least squares would let the largest
    messages alone decide the intercept. ``latency = a / steps`` (a negative intercept is
    clamped: the line is refitted through 0), ``bandwidth = 1 / b``.

    >>> link = fit_alpha_beta([1e3, 1e4, 1e5], [2e-5 + s / 1e9 for s in (1e3, 1e4, 1e5)], factor=1.0)
    >>> round(link.latency * 1e6, 6), round(link.bandwidth / 1e9, 6)
    (20.0, 1.0)
    """
    x, t = _check_series(sizes, times, factor, steps)
    rows = np.stack([1.0 / t, x / t], axis=1)
    scale = np.array([1.0, 1.0 / x.max()])  # columns of similar size keep lstsq well conditioned
    (a, b_scaled), *_ = np.linalg.lstsq(rows * scale, np.ones_like(t), rcond=None)
    a, b = a * scale[0], b_scaled * scale[1]
    if a < 0:  # no latency visible: the best line through the origin
        a, b = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if not b > 0:
        raise UsageError(f"fit_alpha_beta: the times do not grow with the message size (slope {b:.3g} s/byte), "
                         f"so they give no bandwidth; sizes {list(sizes)}, times {list(times)}")
    return Link(bandwidth=float(1.0 / b), latency=float(a) / steps)


def fit_residual(link: Link, sizes: Sequence[float], times: Sequence[float], factor: float,
                 steps: int = 1) -> float:
    """The relative RMS error of ``link``'s times against ``times`` (0: an exact fit).

    >>> fit_residual(Link(1e9, 0.0), [1e3, 1e6], [1e-6, 2e-3], factor=1.0)
    0.3535533905932738
    """
    x, t = _check_series(sizes, times, factor, steps)
    predicted = steps * link.latency + x / link.bandwidth
    return float(np.sqrt(np.mean(((predicted - t) / t) ** 2)))


def _check_series(sizes: Sequence[float], times: Sequence[float], factor: float,
                  steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``(factor * sizes, times)`` as arrays, after checking them."""
    s, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    problems = []
    if s.ndim != 1 or s.shape != t.shape:
        problems.append(f"sizes and times must be two lists of the same length, got {len(sizes)} and {len(times)}")
    elif len(set(s.tolist())) < 2:
        problems.append(f"at least two different sizes are needed to fit a line, got {list(sizes)}")
    elif not (np.all(np.isfinite(s)) and np.all(s > 0) and np.all(np.isfinite(t)) and np.all(t > 0)):
        problems.append("sizes and times must be finite and > 0")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        problems.append(f"factor must be a finite number > 0, got {factor!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        problems.append(f"steps must be an integer >= 1, got {steps!r}")
    if problems:
        raise UsageError("fit_alpha_beta: " + "; ".join(problems))
    return factor * s, t


def fit_skew(waits: Sequence[tuple[float, float]]) -> float:
    """``Hardware.skew`` from ``(compute seconds, seconds waited)`` pairs (:func:`~shardkit.observe.probes.skew_job`):
    the median of ``wait / sqrt(compute)`` (ranks drift apart as a random walk; the median, as a
    single pair can catch another job's burst).

    >>> round(fit_skew([(0.01, 0.002), (0.04, 0.004), (0.04, 0.02)]), 3)
    0.02
    """
    ratios = [wait / math.sqrt(compute) for compute, wait in waits if compute > 0]
    if not ratios:
        raise UsageError(f"fit_skew: no pair with compute > 0 in {list(waits)!r}")
    return float(np.median(ratios))


__all__ = ["Fit", "fit_alpha_beta", "fit_residual", "fit_skew"]
