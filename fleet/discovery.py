"""The edge's side of the control plane: which server to use, and when to leave it.

`FleetRouter.choose_address` is what EdgeClient asks on every (re)connect:
the least-loaded serving server whose tokenizer matches the draft's, or the
`--server` fallback when the broker has none (or is down). When the server in
use starts draining or goes offline (its last will), the router tells the
client to leave it: answers in flight resume on the next choice with their
committed tokens, and new answers start there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import secrets

from specedge.edge_client.client import ConnectionLost, EdgeClient
from specedge.fleet import topics
from specedge.fleet.broker import BrokerConfig, run_together, stay_connected
from specedge.fleet.messages import SERVING
from specedge.fleet.telemetry import EdgeTelemetry
from specedge.fleet.view import FleetView, load_rank
from specedge.tokens import TokenizerFingerprint

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DiscoveryConfig:
    broker: BrokerConfig
    edge_id: str | None = None  # names this edge's telemetry; default: edge-<random>
    telemetry: bool = False  # publish this edge's stats (numbers only) to specedge/v1/edges/<id>/stats
    telemetry_period_s: float = 5.0  # at most one stats message per period
    first_wait_s: float = 3.0  # the first choice waits this long for the broker at most
    settle_s: float = 0.3  # retained statuses arrive right after subscribing: choose once they are in

    def __post_init__(self):
        if self.edge_id is not None:
            topics.check_id(self.edge_id, "edge id")
        if min(self.telemetry_period_s, self.first_wait_s, self.settle_s) < 0:
            raise ValueError("discovery periods must be >= 0")


class FleetRouter:
    def __init__(self, config: DiscoveryConfig, fingerprint: TokenizerFingerprint, fallback: str | None = None):
        self.config, self.fingerprint, self.fallback = config, fingerprint, fallback
        self.edge_id = config.edge_id or f"edge-{secrets.token_hex(4)}"
        self.view = FleetView()
        self.telemetry = EdgeTelemetry()
        self.broker_down: str | None = None  # why the broker cannot be reached, while it cannot
        self._ready = asyncio.Event()  # the broker's retained statuses are in, or it failed
        self._stats_due = asyncio.Event()
        self._client: EdgeClient | None = None
        self._mqtt = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        stats_topic = topics.edge_stats_topic(self.edge_id)
        will = (stats_topic, b"") if self.config.telemetry else None  # an edge that vanishes clears its stats
        self._task = asyncio.create_task(
            stay_connected(
                self.config.broker,
                f"specedge-edge-{self.edge_id}",
                self._session,
                what=f"edge {self.edge_id}",
                will=will,
                on_down=self._down,
            )
        )

    async def close(self) -> None:
        if self._mqtt is not None and self.config.telemetry:
            with contextlib.suppress(Exception):  # leaving: clear our retained stats
                await asyncio.wait_for(
                    self._mqtt.publish(topics.edge_stats_topic(self.edge_id), b"", qos=1, retain=True), 2.0
                )
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def follow(self, client: EdgeClient) -> None:
        """Tell `client` to leave its server when that server drains or goes offline."""
        self._client = client

    def observe(self, stats) -> None:
        """One finished answer's GenerationStats, for telemetry."""
        self.telemetry.observe(stats)
        self._stats_due.set()

    async def choose_address(self) -> str:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), self.config.first_wait_s)
        usable = self.view.usable(self.fingerprint)
        if usable:
            # Among equally loaded servers pick at random, so that edges starting together spread out.
            best = load_rank(usable[0])[:2]
            status = random.choice([s for s in usable if load_rank(s)[:2] == best])
            log.info("using server %s at %s (%d usable)", status.server_id, status.address, len(usable))
            return status.address
        url = self.config.broker.url
        if self.broker_down is not None and not self.view.servers:
            why = f"the broker at {url} is unreachable ({self.broker_down})"
        else:
            why = f"no compatible server is serving on {url} (servers: {self.view.describe(self.fingerprint)})"
        if self.fallback:
            log.warning("%s; using --server %s", why, self.fallback)
            return self.fallback
        raise ConnectionLost(f"{why}, and no --server fallback was given")

    def _down(self, reason: str) -> None:
        self.broker_down = reason
        self._ready.set()  # do not hold up the first choice: the fallback may work

    async def _session(self, mqtt) -> None:
        await mqtt.subscribe(topics.SERVERS, qos=1)
        self.broker_down, self._mqtt = None, mqtt
        asyncio.get_running_loop().call_later(self.config.settle_s, self._ready.set)
        try:
            tasks = [self._listen(mqtt)]
            if self.config.telemetry:
                tasks.append(self._publish_stats(mqtt))
            await run_together(*tasks)
        finally:
            self._mqtt = None

    async def _listen(self, mqtt) -> None:
        async for message in mqtt.messages:
            server_id = self.view.receive(str(message.topic), message.payload)
            if server_id is not None:
                self._check_current(server_id)

    def _check_current(self, server_id: str) -> None:
        seen = self.view.servers.get(server_id)
        client = self._client
        if seen is None or client is None or seen.message.address != client.address:
            return
        status = seen.message
        if status.health != SERVING:
            client.abandon(f"server {server_id} is {status.health}" + (f": {status.reason}" if status.reason else ""))

    async def _publish_stats(self, mqtt) -> None:
        topic = topics.edge_stats_topic(self.edge_id)
        while True:
            await self._stats_due.wait()
            self._stats_due.clear()
            current = self.view.by_address(self._client.address) if self._client is not None else None
            message = self.telemetry.message(self.edge_id, current.server_id if current else "")
            await mqtt.publish(topic, message.to_json(), qos=0, retain=True)
            await asyncio.sleep(self.config.telemetry_period_s)
