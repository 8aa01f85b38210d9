"""The server's link to the fleet control plane: the engine's load for the announcer, and what it may change.

Only this module touches the engine on the fleet's behalf, through two plain
attributes: `engine.draining` (an operator's drain: new sessions are refused
with UNAVAILABLE, running ones finish) and `engine.acceptance_prior` (the
acceptance edges report, the starting point of new sessions' advice).
"""

from __future__ import annotations

import logging
import re
import socket

import specedge
from specedge.fleet.announcer import Announcer, AnnouncerConfig, ServerFacts
from specedge.fleet.messages import DRAIN, DRAINING, SERVING, Command, ServerLoad
from specedge.scheduler.speculation import advise
from specedge.server.engine import Engine

log = logging.getLogger(__name__)

QUEUE_WAIT_EMA = 0.3  # weight of the newest check interval in the announced queue wait
PRIOR_RANGE = (0.05, 0.95)  # an edge-reported prior is clamped here: no report turns drafting off or pins it on


class EngineLink:
    def __init__(self, engine: Engine, server_id: str):
        self.engine, self.server_id = engine, server_id
        self._queue_seen = (0.0, 0)  # (total seconds, rounds) of the queue-wait histogram at the last look
        self._queue_ms = 0.0
        self._reason = ""  # the operator's, for the status

    def load(self) -> ServerLoad:
        engine = self.engine
        snapshot = engine.stats.snapshot()
        waits = snapshot["queue_wait_s"]
        total, count = self._queue_seen
        recent_ms = 1e3 * (waits.total - total) / (waits.count - count) if waits.count > count else 0.0
        self._queue_seen = (waits.total, waits.count)
        self._queue_ms += QUEUE_WAIT_EMA * (recent_ms - self._queue_ms)  # idle intervals decay it toward 0
        advised = advise(engine.acceptance_prior, engine.load, engine.config.speculation)
        return ServerLoad(
            max_sessions=engine.config.max_sessions,
            active_sessions=snapshot["active_sessions"],
            free_kv_slots=snapshot["kv_slots_free"],
            queue_wait_ms=round(self._queue_ms, 3),
            advised_draft_tokens=advised,
        )

    def health(self) -> tuple[str, str]:
        return (SERVING, "") if self.engine.draining is None else (DRAINING, self._reason)

    def obey(self, command: Command) -> None:
        if command.command == DRAIN:
            self._reason = command.reason
            why = f" ({command.reason})" if command.reason else ""
            self.engine.draining = (
                f"server {self.server_id} is draining{why}: it admits no new sessions; use another server"
            )
        else:
            self.engine.draining = None

    def set_fleet_acceptance(self, acceptance: float) -> None:
        low, high = PRIOR_RANGE
        self.engine.acceptance_prior = min(high, max(low, acceptance))


def default_server_id(port: int) -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:56] or "server"
    return f"{host}-{port}"


def advertised_address(bound: str) -> str:
    """The bound HOST:PORT, with a wildcard host replaced by this machine's name."""
    host, port = bound.rsplit(":", 1)
    if host in ("0.0.0.0", "::", "[::]", ""):
        log.warning(
            "listening on %s: announcing %s:%s; set --advertise-address if edges reach it otherwise",
            host,
            socket.gethostname(),
            port,
        )
        return f"{socket.gethostname()}:{port}"
    return bound


async def start_announcer(config: AnnouncerConfig, engine: Engine, bound: str) -> Announcer:
    port = int(bound.rsplit(":", 1)[1])
    server_id = config.server_id or default_server_id(port)
    facts = ServerFacts(
        server_id=server_id,
        address=config.advertise_address or advertised_address(bound),
        model=engine.target.name,
        tokenizer=engine.target.fingerprint,
        version=specedge.__version__,
        max_sessions=engine.config.max_sessions,
    )
    announcer = Announcer(config, facts, EngineLink(engine, server_id))
    await announcer.start()
    log.info("announcing server %s (%s) on %s", server_id, facts.address, config.broker.url)
    return announcer
