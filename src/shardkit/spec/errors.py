"""The one error type a bad plan raises, and the warnings it can emit."""

from __future__ import annotations


class PlanError(ValueError):
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


class PlanWarning(UserWarning):
    """Something in a plan that is probably a mistake but does not stop it from running."""
