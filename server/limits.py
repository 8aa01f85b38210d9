"""Per-identity limits: the rate of rounds (one token bucket per identity), and open Attach streams.

A round is an OpenSession, a ContinueSession, a Verify, or one step of a
Generate stream. Edge calls past the bucket are refused with
RESOURCE_EXHAUSTED and a `retry-after-ms` trailer; Generate streams, which
the server drives, are paced instead. The rate and burst are reported in the handshake, and the edge
paces itself with a bucket of the same shape.

Attach streams live as long as their connection and are not rounds, so the
rate does not bound them; without a cap of their own, one identity could hold
every one of the server's `max_concurrent_rpcs` calls, and every other edge
would be refused. An edge holds one per connection.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from specedge import wire
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
                limit=wire.LIMIT_ROUND_RATE,
            )

    def delay(self, identity: str) -> float:
        """Count one round that will happen anyway: the seconds to wait before it (paced streams)."""
        bucket = self._bucket(identity)
        return 0.0 if bucket is None else bucket.reserve()


# An edge holds one Attach stream per connection; a few connections per identity (an app and a
# command line, a reconnect whose old stream keepalive has not yet closed) fit well within this.
DEFAULT_MAX_ATTACH_PER_IDENTITY = 16


class AttachLimiter:
    """At most `max_per_identity` Attach streams open at once per identity (without tokens, per
    connection); the ones past it are refused with RESOURCE_EXHAUSTED."""

    def __init__(self, max_per_identity: int = DEFAULT_MAX_ATTACH_PER_IDENTITY):
        self.max_per_identity = max_per_identity
        self._held: dict[str, int] = {}  # identity -> open streams; identities holding none are dropped

    def acquire(self, identity: str) -> None:
        """Count one more stream of `identity`, or raise ResourceExhausted (nothing counted)."""
        held = self._held.get(identity, 0)
        if held >= self.max_per_identity:
            raise errors.ResourceExhausted(
                f"attach limit: this identity already holds {held} Attach streams, the server's "
                f"max_attach_streams_per_identity; an edge needs one per connection"
            )
        self._held[identity] = held + 1

    def release(self, identity: str) -> None:
        """One stream of `identity` ended (it was acquired)."""
        held = self._held.pop(identity) - 1
        if held:
            self._held[identity] = held

    def held(self, identity: str) -> int:
        return self._held.get(identity, 0)

    @property
    def num_held(self) -> int:
        """Streams open over all identities."""
        return sum(self._held.values())
