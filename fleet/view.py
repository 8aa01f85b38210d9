"""What the broker says about the fleet: the latest valid status of every server and edge.

Edges (discovery), the operator's table and tests read it. Each message is
parsed and checked against its topic (a status on servers/a claiming to be
server b is a spoof, and is dropped); a bad one is logged and ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from specedge.fleet import topics
from specedge.fleet.messages import SERVING, BadMessage, EdgeStats, ServerStatus
from specedge.tokens import IncompatibleTokenizer, TokenizerFingerprint, check_compatible

log = logging.getLogger(__name__)

MAX_ENTRIES = 10_000  # servers or edges remembered; more ids than this is a flood, not a fleet
STALE_PERIODS = 3  # a server silent for this many of its announce periods is presumed gone
STALE_SLACK_S = 2.0

M = TypeVar("M")


@dataclasses.dataclass(frozen=True)
class Seen(Generic[M]):
    message: M
    received_at: float  # clock() when it arrived


class FleetView:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.servers: dict[str, Seen[ServerStatus]] = {}
        self.edges: dict[str, Seen[EdgeStats]] = {}
        self.ignored = 0  # messages dropped as malformed or hostile

    def receive(self, topic: str, payload: bytes) -> str | None:
        """Take one message; the server or edge id it updated, or None when it was ignored (and logged)."""
        try:
            return self._apply(topic, payload)
        except BadMessage as exc:
            self.ignored += 1
            log.warning("ignored a message on %r: %s", topic[:120], exc)
            return None

    def _apply(self, topic: str, payload: bytes) -> str:
        if (server_id := topics.server_id_of(topic)) is not None:
            return self._store(self.servers, server_id, payload, ServerStatus, "server_id")
        if (edge_id := topics.edge_id_of(topic)) is not None:
            return self._store(self.edges, edge_id, payload, EdgeStats, "edge_id")
        raise BadMessage("not a status or stats topic (or an invalid id in it)")

    def _store(self, table: dict, key: str, payload: bytes, kind, id_field: str) -> str:
        if not payload:  # a cleared retained message: that server or edge is gone for good
            table.pop(key, None)
            return key
        message = kind.from_json(payload)
        if getattr(message, id_field) != key:
            raise BadMessage(f"{id_field} {getattr(message, id_field)!r} does not match its topic's id {key!r}")
        if key not in table and len(table) >= MAX_ENTRIES:
            raise BadMessage(f"more than {MAX_ENTRIES} ids announced; ignoring new ones")
        table[key] = Seen(message, self.clock())
        return key

    def is_live(self, server_id: str) -> bool:
        """Announced recently enough (a status re-sent every period_s), whatever its health."""
        seen = self.servers.get(server_id)
        if seen is None:
            return False
        return self.clock() - seen.received_at <= STALE_PERIODS * seen.message.period_s + STALE_SLACK_S

    def usable(self, fingerprint: TokenizerFingerprint) -> list[ServerStatus]:
        """Servers an edge with this tokenizer may open sessions on, least loaded first."""
        found = []
        for server_id, seen in self.servers.items():
            status = seen.message
            if status.health != SERVING or not self.is_live(server_id):
                continue
            try:
                check_compatible(fingerprint, status.tokenizer)
            except IncompatibleTokenizer:
                continue
            found.append(status)
        return sorted(found, key=load_rank)

    def by_address(self, address: str) -> ServerStatus | None:
        return next((seen.message for seen in self.servers.values() if seen.message.address == address), None)

    def describe(self, fingerprint: TokenizerFingerprint) -> str:
        """Why no server is usable, for an error message: 'a (draining), b (incompatible tokenizer)'."""
        reasons = []
        for server_id, seen in sorted(self.servers.items()):
            status = seen.message
            try:
                check_compatible(fingerprint, status.tokenizer)
                why = status.health if self.is_live(server_id) else "silent"
            except IncompatibleTokenizer:
                why = "incompatible tokenizer"
            reasons.append(f"{server_id} ({why})")
        return ", ".join(reasons) or "none announced"


def load_rank(status: ServerStatus) -> tuple:
    """Sort key, least loaded first: servers with a free KV slot, then by busy share, queue wait, id."""
    load = status.load
    busy_share = load.active_sessions / max(1, load.max_sessions)
    return (load.free_kv_slots == 0, busy_share, load.queue_wait_ms, status.server_id)
