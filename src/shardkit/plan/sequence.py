"""Sequence-length rules for sequence parallelism, checked before launch (pure, no torch).

Two forms split the sequence dim and each constrains its length:

- context parallel on an ``sp`` axis with causal load balancing cuts the sequence into
  ``2 x sp`` equal chunks (rank ``r`` holds chunks ``r`` and ``2*sp-1-r``);
- Megatron-style sequence parallel (``Plan(sequence_parallel=True)``) splits each rank's
  sequence over the ``tp`` group.

>>> from shardkit.plan import Mesh, Plan
>>> sequence_problems(Plan(mesh=Mesh(sp=2, fsdp=2)), 30)
["sequence length 30 does not split for context parallel over 'sp' (size 2): it must be a multiple of 2 x sp = 4 (load-balanced causal chunks); nearest valid lengths: 28, 32"]
>>> required_multiple(Plan(mesh=Mesh(sp=2, tp=2), sequence_parallel=True))
4
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .errors import PlanError

if TYPE_CHECKING:  # plan.py imports this module
    from .plan import Plan


def required_multiple(plan: Plan) -> int:
    """The smallest number every valid sequence length of ``plan`` is a multiple of."""
    sp, tp = plan.mesh.size_of("sp"), plan.mesh.size_of("tp")
    multiple = 2 * sp if sp > 1 else 1
    if plan.sequence_parallel and tp > 1:
        multiple = math.lcm(multiple, sp * tp)  # each sp rank's sequence splits again over tp
    return multiple


def _nearest(seq_len: int, multiple: int) -> str:
    below = seq_len // multiple * multiple
    return ", ".join(str(n) for n in (below, below + multiple) if n > 0)


def sequence_problems(plan: Plan, seq_len: int) -> list[str]:
    """One line per way ``seq_len`` does not fit ``plan``'s sequence splitting (empty: fine)."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        return [f"sequence length {seq_len!r} must be a positive integer"]
    sp, tp = plan.mesh.size_of("sp"), plan.mesh.size_of("tp")
    problems = []
    if sp > 1 and seq_len % (2 * sp):
        problems.append(
            f"sequence length {seq_len} does not split for context parallel over 'sp' (size {sp}): it must be "
            f"a multiple of 2 x sp = {2 * sp} (load-balanced causal chunks); nearest valid lengths: "
            f"{_nearest(seq_len, 2 * sp)}"
        )
    if plan.sequence_parallel and tp > 1 and seq_len % (sp * tp):
        factor = f"tp = {tp}" if sp == 1 else f"sp x tp = {sp * tp} (each sp rank's chunk splits over tp)"
        problems.append(
            f"sequence length {seq_len} does not split for sequence_parallel=True over 'tp' (size {tp}): it must "
            f"be a multiple of {factor}; valid lengths for this plan are multiples of {required_multiple(plan)}, "
            f"nearest: {_nearest(seq_len, required_multiple(plan))}"
        )
    return problems


def check_sequence_length(plan: Plan, seq_len: int) -> None:
    """Raise :class:`PlanError` listing every problem of ``seq_len`` under ``plan``.

    >>> from shardkit.plan import Mesh, Plan
    >>> check_sequence_length(Plan(mesh=Mesh(sp=4)), 64)
    """
    problems = sequence_problems(plan, seq_len)
    if problems:
        raise PlanError(problems)


__all__ = ["check_sequence_length", "required_multiple", "sequence_problems"]
