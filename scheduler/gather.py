"""Gathering rounds: hold a step briefly for the rounds due back from edges, so that they share it.

A step costs about a + b * tokens (the measured cost curve): a, the weight
stream, is paid once per step however many rows ride in it. An edge's round
comes back a turnaround after its reply (the round trip plus its drafting).
Started the moment anything is queued, steps split the edges into cohorts that
alternate, each paying a on its own:

    step [A A A A]      step [B B B B]      step [A A A A]      ...   A and B: edges' rounds
         B's rounds arrive during A's step; A's come back while B's runs

Holding the next step until rounds due back within `a` have arrived merges the
cohorts: a wait of w < a buys a step that the late rounds would otherwise need
for themselves, a on its own. The hold never exceeds a, never waits for a round
that is already overdue, and never starts when nothing is queued.

Each session's turnaround is learned from its own rounds (an exponential
average of reply -> next round), so server-driven streams, which queue their
next round at once, are never waited for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

SMOOTHING = 0.3  # weight of the newest turnaround in a session's average
SLACK = 0.25  # a round is waited for until this share of its turnaround past its expected return


@dataclasses.dataclass
class Turnaround:
    """One session's time from a round's reply to its next round's arrival."""

    average_s: float | None = None
    replied_at: float | None = None  # None: a round of its is queued, or it has not been answered yet

    def replied(self, now: float) -> None:
        self.replied_at = now

    def arrived(self, now: float) -> None:
        if self.replied_at is not None:
            sample = now - self.replied_at
            self.average_s = sample if self.average_s is None else SMOOTHING * sample + (1 - SMOOTHING) * self.average_s
        self.replied_at = None

    def due_by(self) -> float | None:
        """The latest time its next round is worth waiting for, or None when it is not expected."""
        if self.replied_at is None or self.average_s is None:
            return None
        return self.replied_at + self.average_s * (1 + SLACK)


def hold_until(now: float, due: Iterable[float | None], step_fixed_s: float | None, since: float) -> float | None:
    """When to start a step that work is queued for: None now, else a time to wait until (or an arrival).

    `due`: each mid-answer session without queued work, its Turnaround.due_by(); `step_fixed_s`: the cost
    curve's intercept a (None before it is measured: no hold); `since`: when this step's hold began.
    """
    if step_fixed_s is None or step_fixed_s <= 0:
        return None
    deadline = since + step_fixed_s
    waiting = [t for t in due if t is not None and now < t <= deadline]
    return max(waiting) if waiting else None
