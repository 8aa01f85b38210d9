"""The server's side of the control plane: announce status and load, obey drain commands.

    specedge/v1/servers/<id>   retained ServerStatus, re-sent every period_s and at once on a big change
                               (health, sessions, free slots or advised draft length moved); the last will
                               is the same status marked offline, so a killed server is marked at once
    .../<id>/command           drain / undrain, from `specedge-fleet`
    specedge/v1/edges/+/stats  (tune_advice) edges on this server report their acceptance: the mean
                               becomes the prior of new sessions' speculation advice

A broker that is down or refuses us is logged and retried; the server serves either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from typing import TYPE_CHECKING, Protocol

from specedge.fleet import topics
from specedge.fleet.broker import BrokerConfig, run_together, stay_connected
from specedge.fleet.messages import OFFLINE, BadMessage, Command, EdgeStats, ServerLoad, ServerStatus, is_address
from specedge.tokens import TokenizerFingerprint

if TYPE_CHECKING:
    import aiomqtt  # an optional dependency (the mqtt extra): imported where a broker is used

log = logging.getLogger(__name__)

MIN_DRAFT_TOKENS = 32  # an edge's acceptance counts once it has drafted this many tokens
EDGE_MEMORY_S = 600.0  # edges not heard from for this long no longer count
MAX_EDGES = 10_000


@dataclasses.dataclass(frozen=True)
class AnnouncerConfig:
    broker: BrokerConfig
    server_id: str | None = None  # default: HOSTNAME-PORT
    advertise_address: str | None = None  # HOST:PORT edges dial; default: the address the server bound
    period_s: float = 5.0  # the status is re-sent at least this often
    check_s: float = 0.25  # load is looked at this often, to announce a big change at once
    tune_advice: bool = True  # edges' reported acceptance seeds new sessions' advice

    def __post_init__(self):
        if self.server_id is not None:
            topics.check_id(self.server_id, "server id")
        if self.advertise_address is not None and not is_address(self.advertise_address):
            raise ValueError(f"advertise address {self.advertise_address!r} must be HOST:PORT")
        if self.period_s <= 0 or self.check_s <= 0:
            raise ValueError("announce period and check interval must be > 0")


@dataclasses.dataclass(frozen=True)
class ServerFacts:
    """What does not change while the server runs."""

    server_id: str
    address: str
    model: str
    tokenizer: TokenizerFingerprint
    version: str
    max_sessions: int


class AnnouncedServer(Protocol):
    """What the announcer reads from the server and may change (see server/fleet_link.py)."""

    def load(self) -> ServerLoad: ...
    def health(self) -> tuple[str, str]: ...  # (serving | draining, reason)
    def obey(self, command: Command) -> None: ...
    def set_fleet_acceptance(self, acceptance: float) -> None: ...


class Announcer:
    def __init__(self, config: AnnouncerConfig, facts: ServerFacts, server: AnnouncedServer):
        self.config, self.facts, self.server = config, facts, server
        self.topic = topics.server_topic(facts.server_id)
        self.command_topic = topics.command_topic(facts.server_id)
        self.published = 0  # statuses sent
        self.ignored = 0  # malformed or hostile messages dropped
        self._nudge = asyncio.Event()
        self._client: aiomqtt.Client | None = None  # while connected
        self._task: asyncio.Task | None = None
        self._acceptance: dict[str, tuple[float, float]] = {}  # edge id -> (acceptance, heard at)

    def offline_status(self) -> ServerStatus:
        return self._status(OFFLINE, "", ServerLoad(self.facts.max_sessions, 0, 0, 0.0, 0))

    def _status(self, health: str, reason: str, load: ServerLoad) -> ServerStatus:
        facts = self.facts
        return ServerStatus(
            facts.server_id,
            health,
            facts.address,
            facts.model,
            facts.tokenizer,
            facts.version,
            load,
            self.config.period_s,
            reason,
        )

    async def start(self) -> None:
        will = (self.topic, self.offline_status().to_json())
        identifier = f"specedge-server-{self.facts.server_id}-{secrets.token_hex(3)}"
        self._task = asyncio.create_task(
            stay_connected(
                self.config.broker, identifier, self._session, what=f"server {self.facts.server_id}", will=will
            )
        )

    async def stop(self) -> None:
        """Say goodbye (retained offline status), then leave the broker."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._publish(self._client, self.offline_status()), timeout=2.0)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _session(self, client) -> None:
        await client.subscribe(self.command_topic, qos=1)
        if self.config.tune_advice:
            await client.subscribe(topics.EDGE_STATS, qos=0)
        self._client = client
        try:
            await run_together(self._listen(client), self._announce(client))
        finally:
            self._client = None

    async def _publish(self, client: aiomqtt.Client, status: ServerStatus) -> None:
        await client.publish(self.topic, status.to_json(), qos=1, retain=True)
        self.published += 1

    async def _announce(self, client: aiomqtt.Client) -> None:
        last_key, last_sent = None, float("-inf")
        while True:
            self._nudge.clear()
            health, reason = self.server.health()
            status = self._status(health, reason, self.server.load())
            load = status.load
            key = (health, load.active_sessions, load.free_kv_slots, load.advised_draft_tokens)
            if key != last_key or time.monotonic() - last_sent >= self.config.period_s:
                await self._publish(client, status)
                last_key, last_sent = key, time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._nudge.wait(), self.config.check_s)

    async def _listen(self, client) -> None:
        async for message in client.messages:
            try:
                self.handle(str(message.topic), message.payload)
            except BadMessage as exc:
                self.ignored += 1
                log.warning("ignored a message on %r: %s", str(message.topic)[:120], exc)
            except Exception:  # never let one message stop the announcements
                self.ignored += 1
                log.exception("failed to handle a message on %r", str(message.topic)[:120])

    def handle(self, topic: str, payload) -> None:
        """One incoming message: a command for us, or an edge's stats."""
        if topic == self.command_topic:
            command = Command.from_json(payload)
            log.warning("operator command: %s%s", command.command, f" ({command.reason})" if command.reason else "")
            self.server.obey(command)
            self._nudge.set()  # announce the new health now
        elif (edge_id := topics.edge_id_of(topic)) is not None:
            self._observe_edge(edge_id, payload)

    def _observe_edge(self, edge_id: str, payload) -> None:
        if not payload:  # the edge left
            self._acceptance.pop(edge_id, None)
            return
        stats = EdgeStats.from_json(payload)
        if stats.edge_id != edge_id:
            raise BadMessage(f"edge_id {stats.edge_id!r} does not match its topic's id {edge_id!r}")
        if stats.server_id != self.facts.server_id or stats.draft_tokens < MIN_DRAFT_TOKENS:
            self._acceptance.pop(edge_id, None)
            return
        if edge_id not in self._acceptance and len(self._acceptance) >= MAX_EDGES:
            raise BadMessage(f"more than {MAX_EDGES} edges report to this server; ignoring new ones")
        now = time.monotonic()
        self._acceptance[edge_id] = (stats.acceptance_rate, now)
        for key in [k for k, (_, heard) in self._acceptance.items() if now - heard > EDGE_MEMORY_S]:
            del self._acceptance[key]
        # Each edge counts once however much it drafts, so no single edge sets the prior.
        mean = sum(rate for rate, _ in self._acceptance.values()) / len(self._acceptance)
        self.server.set_fleet_acceptance(mean)
