"""Where the broker is and how to log in, plus the reconnecting loop every fleet component runs.

Servers, edges and `specedge-fleet` all reach the broker the same way: one
`BrokerConfig` (URL, username/password, TLS), and `stay_connected`, which
keeps a session with the broker alive and never lets a broker failure reach
the caller: the server keeps serving and the edge keeps its fallback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import urllib.parse
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

PASSWORD_ENV = "SPECEDGE_MQTT_PASSWORD"
MAX_QUEUED_MESSAGES = 1000  # beyond this, a flood of incoming messages is dropped, not buffered without bound
_SCHEMES = {"mqtt": 1883, "mqtts": 8883}


class FleetError(Exception):
    """A fleet setup the user must fix (a bad broker URL, a missing extra); the message is one line."""


@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    url: str  # mqtt://HOST[:PORT], or mqtts://HOST[:PORT] for TLS (default ports 1883, 8883)
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)  # never printed or logged
    tls_ca: str | None = None  # CA file that signed the broker's certificate; implies TLS
    tls_cert: str | None = None  # client certificate, for brokers that ask for one
    tls_key: str | None = None
    keepalive_s: int = 15  # without traffic for 1.5x this, the broker sends our last will
    host: str = dataclasses.field(init=False)
    port: int = dataclasses.field(init=False)
    tls: bool = dataclasses.field(init=False)

    def __post_init__(self):
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in _SCHEMES or not parsed.hostname:
            raise FleetError(f"broker URL {self.url!r} must look like mqtt://HOST:PORT or mqtts://HOST:PORT")
        if parsed.username or parsed.password:
            raise FleetError(f"give broker credentials with --mqtt-username and ${PASSWORD_ENV}, not in the URL")
        if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
            raise FleetError(f"broker URL {self.url!r} has a path or query; use mqtt://HOST:PORT")
        try:
            port = parsed.port or _SCHEMES[parsed.scheme]
        except ValueError:
            raise FleetError(f"broker URL {self.url!r} has an invalid port") from None
        if (self.tls_cert is None) != (self.tls_key is None):
            raise FleetError("a client certificate needs both --mqtt-tls-cert and --mqtt-tls-key")
        if self.keepalive_s < 1:
            raise FleetError(f"keepalive must be >= 1 s, got {self.keepalive_s}")
        object.__setattr__(self, "host", parsed.hostname)
        object.__setattr__(self, "port", port)
        object.__setattr__(self, "tls", parsed.scheme == "mqtts" or self.tls_ca is not None)

    def client(self, identifier: str, will: tuple[str, bytes] | None = None):
        """An aiomqtt client (use as `async with`); `will`: a retained (topic, payload) sent if we vanish."""
        aiomqtt = require_aiomqtt()
        tls = None
        if self.tls:  # no CA file: the system's trusted CAs
            tls = aiomqtt.TLSParameters(ca_certs=self.tls_ca, certfile=self.tls_cert, keyfile=self.tls_key)
        return aiomqtt.Client(
            self.host,
            self.port,
            username=self.username,
            password=self.password,
            identifier=identifier,
            will=None if will is None else aiomqtt.Will(will[0], will[1], qos=1, retain=True),
            tls_params=tls,
            keepalive=self.keepalive_s,
            timeout=10,
            max_queued_incoming_messages=MAX_QUEUED_MESSAGES,
            logger=logging.getLogger("specedge.fleet.mqtt"),
        )


def require_aiomqtt():
    try:
        import aiomqtt
    except ImportError:
        raise FleetError("the fleet control plane needs aiomqtt: pip install 'specedge[mqtt]'") from None
    return aiomqtt


def broker_errors() -> tuple[type[BaseException], ...]:
    """What a lost or refused broker connection raises (TLS failures are OSErrors)."""
    return require_aiomqtt().MqttError, OSError


async def stay_connected(
    broker: BrokerConfig,
    identifier: str,
    session: Callable[[object], Awaitable[None]],
    *,
    what: str,
    will: tuple[str, bytes] | None = None,
    on_down: Callable[[str], None] = lambda reason: None,
) -> None:
    """Run `session(client)` while connected to the broker; after a failure, reconnect with backoff. Never returns."""
    backoff, last_reason = 0.5, None
    while True:
        try:
            async with broker.client(identifier, will) as client:
                backoff, last_reason = 0.5, None
                log.info("%s: connected to the broker at %s", what, broker.url)
                await session(client)
        except broker_errors() as exc:
            reason = str(exc) or type(exc).__name__
            on_down(reason)
            level = logging.WARNING if reason != last_reason else logging.DEBUG  # once per distinct failure
            log.log(level, "%s: broker %s unreachable (%s); retrying", what, broker.url, reason)
            last_reason = reason
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 30.0)


async def run_together(*coroutines: Awaitable[None]) -> None:
    """Run until the first one ends or fails; cancel the others; re-raise its error."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def add_broker_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fleet broker (MQTT)")
    group.add_argument("--mqtt-username", default=None)
    group.add_argument(
        "--mqtt-password",
        default=os.environ.get(PASSWORD_ENV),
        help=f"default: ${PASSWORD_ENV} (prefer it: a flag shows in the process list)",
    )
    group.add_argument("--mqtt-tls-ca", default=None, help="CA file of the broker's certificate (turns TLS on)")
    group.add_argument("--mqtt-tls-cert", default=None, help="client certificate, if the broker asks for one")
    group.add_argument("--mqtt-tls-key", default=None)


def broker_from_args(url: str, args: argparse.Namespace) -> BrokerConfig:
    require_aiomqtt()  # say so now, not after loading a model
    for name in ("mqtt_tls_ca", "mqtt_tls_cert", "mqtt_tls_key"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            raise FleetError(f"--{name.replace('_', '-')} {path}: no such file")
    return BrokerConfig(
        url,
        username=args.mqtt_username,
        password=args.mqtt_password,
        tls_ca=args.mqtt_tls_ca,
        tls_cert=args.mqtt_tls_cert,
        tls_key=args.mqtt_tls_key,
    )
