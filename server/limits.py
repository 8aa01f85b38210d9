"""The per-identity rate limit on rounds: one token bucket per identity.

A round is an OpenSession, a ContinueSession, a Verify, or one step of a
Generate stream. Edge calls past the bucket are refused with
RESOURCE_EXHAUSTED and a `retry-after-ms` trailer; Generate streams, which
the server drives, are paced instead. The rate and burst are reported in the handshake, and the edge
paces itself with a bucket of the same shape.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from specedge.ratelimit import TokenBucket
from specedge.server import errors

# Buckets of identities that went quiet are dropped once this many exist
# (without tokens an identity is a connection, so their number is unbounded).
_PRUNE_ABOVE = 1024


@dataclasses.dataclass(frozen=True)
class RateLimitConfig:
    rounds_per_s: float | None = None  # per identity, on average; None: no limit
    burst: int = 32  # rounds an identity may send at once after idling

    def __post_init__(self):
        if self.rounds_per_s is not None and not self.rounds_per_s > 0:
            raise ValueError(f"rounds per second must be > 0, got {self.rounds_per_s}")
        if self.burst < 1:
            raise ValueError(f"round burst must be >= 1, got {self.burst}")


class RoundRateLimiter:
    def __init__(self, config: RateLimitConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def _bucket(self, identity: str) -> TokenBucket | None:
        if self.config.rounds_per_s is None:
            return None
        bucket = self._buckets.get(identity)
        if bucket is None:
            if len(self._buckets) >= _PRUNE_ABOVE:  # a full bucket is the same as no bucket
                self._buckets = {key: b for key, b in self._buckets.items() if not b.is_full}
            bucket = self._buckets[identity] = TokenBucket(self.config.rounds_per_s, self.config.burst, self._clock)
        return bucket

    def admit(self, identity: str) -> None:
        """Count one round, or raise ResourceExhausted when the identity is over its rate."""
        bucket = self._bucket(identity)
        if bucket is None:
            return
        wait_s = bucket.try_take()
        if wait_s > 0:
            raise errors.ResourceExhausted(
                f"rate limit: at most {self.config.rounds_per_s:g} rounds per second per identity "
                f"(bursts of {self.config.burst}); retry in {math.ceil(wait_s * 1000)} ms",
                retry_after_s=wait_s,
            )

    def delay(self, identity: str) -> float:
        """Count one round that will happen anyway: the seconds to wait before it (paced streams)."""
        bucket = self._bucket(identity)
        return 0.0 if bucket is None else bucket.reserve()
