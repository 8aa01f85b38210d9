"""How many draft tokens pay, for this session's acceptance and the server's load.

With per-token acceptance a, a round of k drafts commits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens. What it costs the server depends on
the hardware and the load: a GPU at small batches is memory-bound, so extra
tokens in a forward are nearly free; a saturated GPU, or a CPU, pays for
every token. We model the cost of a round as 1 + load * k, with load in
[0, 1] the marginal cost of a token relative to a one-token round (measured
by StepCostModel below), and advise the k that maximises E(k) / (1 + load * k).
When no k beats plain decoding (k = 0, one token per unit cost), the advice
is 0: drafting is off and the server decodes alone. Every `probe_every`-th
round of such a session still advises 1 token, so a session whose acceptance
recovers gets speculation back.

    a = 0.8, idle (load 0):  k = max_draft (E keeps growing, cost stays 1)
    a = 0.8, load 0.2:       k = 4 (E(4) / 1.8 = 1.87, the best)
    a = 0.8, load 1:         0     (E(k) / (1 + k) < 1 for every k >= 1)
"""

from __future__ import annotations

import collections
import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    max_draft_tokens: int = 16
    prior_acceptance: float = 0.7  # before a session has any history
    ema_weight: float = 0.25  # weight of the newest round in the acceptance average
    probe_every: int = 8  # rounds between 1-token probes while drafting is off
    min_gain: float = 1.05  # drafting must beat plain decoding by this factor

    def __post_init__(self):
        if self.max_draft_tokens < 0 or not 0 < self.ema_weight <= 1 or self.probe_every < 1:
            raise ValueError(f"invalid speculation config: {self}")


def expected_tokens(acceptance: float, num_draft: int) -> float:
    """Mean tokens committed by a round of `num_draft` drafts (the target's own token included)."""
    if acceptance >= 1.0:
        return num_draft + 1.0
    return (1.0 - acceptance ** (num_draft + 1)) / (1.0 - acceptance)


def advise(acceptance: float, load: float, config: SpeculationConfig) -> int:
    """Draft tokens to advise; 0 when speculation does not pay at this load."""
    load = min(max(load, 0.0), 1.0)
    best_k, best_gain = 0, 1.0
    for k in range(1, config.max_draft_tokens + 1):
        gain = expected_tokens(acceptance, k) / (1.0 + load * k)
        if gain > best_gain + 1e-9:
            best_k, best_gain = k, gain
    return best_k if best_gain >= config.min_gain else 0


@dataclasses.dataclass
class SessionSpeculation:
    """One session's acceptance history and the advice that follows from it."""

    config: SpeculationConfig
    acceptance: float = -1.0  # < 0: no history yet
    rounds_off: int = 0

    def __post_init__(self):
        if self.acceptance < 0:
            self.acceptance = self.config.prior_acceptance

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens:
            rate = num_accepted / num_draft_tokens
            self.acceptance += self.config.ema_weight * (rate - self.acceptance)

    def next_advice(self, load: float) -> int:
        advice = advise(self.acceptance, load, self.config)
        if advice:
            self.rounds_off = 0
            return advice
        self.rounds_off += 1
        return 1 if self.rounds_off % self.config.probe_every == 0 else 0


class StepCostModel:
    """The server's measured cost of a forward: step time ~ a + b * tokens, fitted online.

    `load()` is the marginal cost of one more token in a round, relative to
    what a round of one token costs when `rows` rounds share a step's fixed
    cost a:  load = b / (a / rows + b).  A GPU at small batches has b ~ 0
    (drafting is nearly free); a CPU whose matrix kernels slow down with every
    extra row has a large b, and speculation there must be short or off.

        a = 0.75, b = 0.25 per step unit, 1 row:   load = 0.25
        same hardware, 8 rows sharing a step:      load = 0.25 / (0.094 + 0.25) = 0.73
    """

    def __init__(self, window: int = 128, min_steps: int = 8, ema_weight: float = 0.1):
        self.min_steps = min_steps
        self.ema_weight = ema_weight
        # Steps by token count, in powers of two: bucket -> (mean tokens, mean seconds, steps seen). The fit
        # weighs buckets, not steps: once most steps sit at the budget, a fit over the last N steps alone
        # would see one token count, and its slope (hence the knee) would drift with noise.
        self._buckets: dict[int, tuple[float, float, int]] = {}
        self._num_steps = 0
        self._rows: collections.deque[int] = collections.deque(maxlen=window)

    def observe(self, *, batch_tokens: int, batch_rows: int, seconds: float) -> None:
        if batch_tokens < 1:
            return
        bucket = round(math.log2(batch_tokens))
        tokens, mean_s, count = self._buckets.get(bucket, (0.0, 0.0, 0))
        weight = max(1.0 / (count + 1), self.ema_weight)  # a plain mean at first, then recent steps count most
        tokens += weight * (batch_tokens - tokens)
        mean_s += weight * (seconds - mean_s)
        self._buckets[bucket] = (tokens, mean_s, count + 1)
        self._num_steps += 1
        self._rows.append(batch_rows)

    def points(self) -> list[tuple[float, float]]:
        """The measured curve itself: (mean tokens, mean seconds) per token-count bucket, by tokens."""
        return sorted((tokens, seconds) for tokens, seconds, _ in self._buckets.values())

    def fit(self) -> tuple[float, float] | None:
        """(a, b) by least squares over the buckets; None until the token counts vary enough."""
        points = [(tokens, seconds) for tokens, seconds, _ in self._buckets.values()]
        if self._num_steps < self.min_steps or len(points) < 2:
            return None
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in points)
        if var_x < 1e-9 * n or mean_y <= 0:
            return None
        b = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / var_x)
        a = max(0.0, mean_y - b * mean_x)
        return a, b

    def knee_tokens(self) -> int | None:
        """Tokens where a step's per-token cost b * tokens reaches its fixed cost a: up to there a
        step costs at most twice a one-token step. None while unknown, or when tokens are free (b = 0)."""
        fitted = self.fit()
        if fitted is None or fitted[1] <= 0:
            return None
        a, b = fitted
        return max(1, round(a / b))

    def load(self, fallback: float) -> float:
        fitted = self.fit()
        if fitted is None:
            return fallback
        a, b = fitted
        if a <= 0:  # every step pays something fixed: a line through the origin or below is no step cost curve
            return fallback
        rows = sum(self._rows) / len(self._rows)
        return b / (a / rows + b)
