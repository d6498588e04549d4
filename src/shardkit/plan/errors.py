"""The error types of shardkit, one per kind of mistake, and the warning a plan can emit.

- :class:`PlanError`: a plan that cannot run as written (an axis, a layout, a size, a stage).
- :class:`UsageError`: the API or the command line was called wrongly (an argument of the
  wrong type or value, a function that cannot be sent to the workers): nothing to do with
  the plan itself.
- ``WorldError`` (in :mod:`shardkit.runtime.world`): a process failed, died or hung.

All derive from :class:`ShardkitError`, so ``except sk.ShardkitError`` catches every one.
"""

from __future__ import annotations


class ShardkitError(Exception):
    """Base of every error shardkit raises on purpose."""


class PlanError(ShardkitError, ValueError):
    """A plan that cannot run as written.

    ``problems`` holds one line per problem found; the message lists them all, so one
    ``validate`` call reports everything that is wrong, not only the first thing.

    >>> try:
    ...     raise PlanError(["axis 'tp' is unknown"])
    ... except PlanError as e:
    ...     e.problems
    ["axis 'tp' is unknown"]
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


class UsageError(ShardkitError, ValueError):
    """An API call or command line that is wrong in itself: it names the argument and what is valid.

    >>> str(UsageError("verify(steps=0): take at least 1 step"))
    'verify(steps=0): take at least 1 step'
    """


class PlanWarning(UserWarning):
    """Something in a plan that is probably a mistake but does not stop it from running."""
