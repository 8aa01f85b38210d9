"""Gathering rounds: hold a step briefly for the rounds due back from edges, so that they share it.

A step costs about a + b * tokens (the measured cost curve): a, the weight
stream, is paid once per step however many rows ride in it. An edge's round
comes back a turnaround after its reply (the round trip plus its drafting).
Started the moment anything is queued, steps split the edges into cohorts that
alternate, each paying a on its own:

    step [A A A A]      step [B B B B]      step [A A A A]      ...   A and B: edges' rounds
         B's rounds arrive during A's step; A's come back while B's runs

Holding the next step until the rounds due back have arrived merges the
cohorts: a wait of w buys a step that the late rounds would otherwise need for
themselves, a on its own. But the merged step answers every row at once, and
the server then has nothing to run until the first of them comes back, a
turnaround T later, where the other cohort's step used to fill that time:

    alternating: each edge gets a round every 2a + b * tokens (T fits in the other cohort's step)
    merged:      each edge gets a round every a + b * tokens + T

So merging pays only while T < a, and a hold of w pays only while w + T < a.
The hold's budget is therefore a less the shortest learned turnaround among
the rows queued now (server-driven streams, back at once, leave the whole a).
Where edges draft for longer than a step's fixed cost (on a GPU, almost
always) that budget is nothing, and steps start the moment work is queued.
The hold never waits for a round that is already overdue, and never starts
when nothing is queued.

Each session's turnaround is learned from its own rounds (an exponential
average of reply -> next round), so server-driven streams, which queue their
next round at once, are never waited for.

A hold that ends without a round it waited for is a miss, and the identity
that missed is not waited for during the next MISS_COOLDOWN_STEPS steps. An
identity that paces its rounds to be waited for and then does not send them
idles the server at most one fixed cost per that many steps (an honest edge
that misses once merely loses gathering for a while).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

SMOOTHING = 0.3  # weight of the newest turnaround in a session's average
SLACK = 0.25  # a round is waited for until this share of its turnaround past its expected return
MISS_COOLDOWN_STEPS = 16  # steps during which an identity that missed a hold is not waited for


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


def hold_until(
    now: float, due: Iterable[float | None], step_fixed_s: float | None, since: float, returns_s: float = 0.0
) -> float | None:
    """When to start a step that work is queued for: None now, else a time to wait until (or an arrival).

    `due`: each mid-answer session without queued work, its Turnaround.due_by(); `step_fixed_s`: the cost
    curve's intercept a (None before it is measured: no hold); `since`: when this step's hold began;
    `returns_s`: how soon the queued rows come back once answered (their shortest learned turnaround), the
    time a merged step leaves the server idle. The hold ends by since + a - returns_s.
    """
    if step_fixed_s is None or step_fixed_s <= returns_s:
        return None
    deadline = since + step_fixed_s - returns_s
    waiting = [t for t in due if t is not None and now < t <= deadline]
    return max(waiting) if waiting else None


class Gatherer:
    """The holds of one engine: hold_until, less the identities cooling down from a miss."""

    def __init__(self, cooldown_steps: int = MISS_COOLDOWN_STEPS):
        self.cooldown_steps = cooldown_steps
        self.num_steps = 0
        self.num_misses = 0
        self._cooling: dict[str, int] = {}  # identity -> the step from which it is waited for again

    def hold(
        self,
        now: float,
        due: Iterable[tuple[str, str, float | None]],
        step_fixed_s: float | None,
        since: float,
        returns_s: float = 0.0,
    ) -> tuple[float, set[str]] | None:
        """hold_until over `due` ((session, identity, due_by) of each mid-answer session with nothing queued),
        the cooling identities left out: None, or the time to wait until and the sessions waited for."""
        eligible = [(key, t) for key, owner, t in due if self._cooling.get(owner, 0) <= self.num_steps]
        until = hold_until(now, (t for _, t in eligible), step_fixed_s, since, returns_s)
        if until is None:
            return None
        return until, {key for key, t in eligible if t is not None and now < t <= until}

    def step_started(self, missed: Iterable[str]) -> None:
        """A step starts; `missed`: the identities whose rounds this step's hold waited for in vain."""
        for owner in set(missed):
            self.num_misses += 1
            self._cooling[owner] = self.num_steps + 1 + self.cooldown_steps
        self.num_steps += 1
