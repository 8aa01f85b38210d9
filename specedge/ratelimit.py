"""A token bucket: `rate` events a second on average, bursts of up to `burst` (torch-free, shared).

The server refuses rounds past an identity's bucket (server/limits.py); the
edge keeps a bucket of the same shape to pace itself, so it never gets refused,
unless the network holds its calls and delivers them at once: then the server
says when to come back, and the edge's bucket holds until then (`hold`).

    rate 2/s, burst 3: three calls at t=0 pass, the fourth waits 0.5 s;
    after 1.5 s idle the bucket is full again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_EPSILON = 1e-9  # refill arithmetic in floats: 0.1 s at 10/s must make a whole token


class TokenBucket:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        if not rate > 0 or burst < 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1, got rate {rate}, burst {burst}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._updated = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
        self._updated = now

    def try_take(self) -> float:
        """Take a token: 0.0 when one was there, else the seconds until one will be (nothing taken)."""
        self._refill()
        if self._tokens >= 1 - _EPSILON:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate

    def reserve(self) -> float:
        """Take a token even if that means waiting for it: the seconds to wait before acting (0.0: now)."""
        self._refill()
        self._tokens -= 1
        return max(0.0, -self._tokens / self.rate)

    def hold(self, seconds: float) -> None:
        """No token for `seconds` from now, whatever this bucket counted (the server's own bucket ran dry and said
        when to come back): reservations from now on queue behind that, one 1 / rate apart."""
        self._refill()
        self._tokens = min(self._tokens, 1 - seconds * self.rate)

    @property
    def is_full(self) -> bool:
        self._refill()
        return self._tokens >= self.burst - _EPSILON
