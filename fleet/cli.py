"""`specedge-fleet`: the operator's view of a SpecEdge fleet, from its MQTT broker.

specedge-fleet --mqtt mqtt://HOST:PORT             a live table of servers and edges (Ctrl-C quits)
specedge-fleet --mqtt ... --once [--json]          one snapshot, as a table or JSON
specedge-fleet drain SERVER_ID [--reason TEXT]     the server admits no new sessions; running ones
                                                   finish, or move when their edges discover elsewhere
specedge-fleet undrain SERVER_ID                   it admits sessions again
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import sys

from specedge.fleet import topics
from specedge.fleet.broker import (
    BrokerConfig,
    FleetError,
    add_broker_options,
    broker_errors,
    broker_from_args,
    run_together,
    stay_connected,
)
from specedge.fleet.messages import DRAIN, DRAINING, OFFLINE, SERVING, Command, ServerStatus
from specedge.fleet.view import FleetView, load_rank

DEFAULT_BROKER = "mqtt://127.0.0.1:1883"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv[:1] and argv[0] in ("drain", "undrain") else "show"
    parser = argparse.ArgumentParser(
        prog="specedge-fleet" if command == "show" else f"specedge-fleet {command}",
        description="Servers and edges of a SpecEdge fleet, from its MQTT broker.",
    )
    parser.add_argument("--mqtt", default=DEFAULT_BROKER, metavar="URL", help=f"the broker (default {DEFAULT_BROKER})")
    parser.add_argument("--log-level", default="error")
    add_broker_options(parser)
    if command == "show":
        parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
        parser.add_argument("--json", action="store_true", help="one snapshot as JSON (implies --once)")
        parser.add_argument("--wait", type=float, default=1.0, help="seconds to gather a snapshot")
        args = parser.parse_args(argv)
    else:
        parser.add_argument("server_id", help="the server's id, as the table shows it")
        if command == "drain":
            parser.add_argument("--reason", default="", help="shown to edges and in the table")
        parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server to confirm")
        args = parser.parse_args(argv[1:])
    args.command = command
    return args


def client_id() -> str:
    return f"specedge-fleet-{secrets.token_hex(4)}"


async def _feed(mqtt, view: FleetView) -> None:
    async for message in mqtt.messages:
        view.receive(str(message.topic), message.payload)


async def snapshot(broker: BrokerConfig, wait_s: float) -> FleetView:
    view = FleetView()
    async with broker.client(client_id()) as mqtt:
        await mqtt.subscribe(topics.SERVERS, qos=1)
        await mqtt.subscribe(topics.EDGE_STATS, qos=0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(_feed(mqtt, view), wait_s)
    return view


async def send_command(broker: BrokerConfig, server_id: str, command: Command, timeout_s: float) -> ServerStatus:
    """Publish `command` to the server and wait until its status confirms it; FleetError otherwise."""
    topics.check_id(server_id, "server id")
    want = DRAINING if command.command == DRAIN else SERVING
    view = FleetView()
    async with broker.client(client_id()) as mqtt:
        await mqtt.subscribe(topics.server_topic(server_id), qos=1)

        async def until(predicate) -> None:
            async for message in mqtt.messages:
                if view.receive(str(message.topic), message.payload) == server_id and predicate():
                    return

        with contextlib.suppress(asyncio.TimeoutError):  # its retained status, if there is such a server
            await asyncio.wait_for(until(lambda: True), 2.0)
        seen = view.servers.get(server_id)
        if seen is None:
            raise FleetError(f"no server {server_id!r} has announced itself on {broker.url}")
        if seen.message.health == OFFLINE:
            raise FleetError(f"server {server_id} is offline")
        await mqtt.publish(topics.command_topic(server_id), command.to_json(), qos=1)
        if seen.message.health != want:
            try:
                await asyncio.wait_for(until(lambda: view.servers[server_id].message.health == want), timeout_s)
            except TimeoutError:
                raise FleetError(
                    f"server {server_id} did not confirm within {timeout_s:.0f} s; is it connected to {broker.url}?"
                ) from None
    return view.servers[server_id].message


def render(view: FleetView, title: str = ""):
    from rich.console import Group
    from rich.table import Table

    now = view.clock()
    numbers = ("sessions", "free KV", "queue ms", "advised k")
    servers = Table(title=f"servers {title}".strip(), title_justify="left")
    for column in ("server", "health", "address", "model", *numbers, "version", "seen"):
        servers.add_column(column, justify="right" if column in numbers else "left")
    for server_id, seen in sorted(view.servers.items(), key=lambda item: load_rank(item[1].message)):
        status, load = seen.message, seen.message.load
        health = status.health if view.is_live(server_id) or status.health == OFFLINE else f"{status.health}, silent"
        style = {SERVING: "green", DRAINING: "yellow"}.get(status.health, "red")
        servers.add_row(
            server_id,
            f"[{style}]{health}[/]",
            status.address,
            status.model,
            f"{load.active_sessions}/{load.max_sessions}",
            str(load.free_kv_slots),
            f"{load.queue_wait_ms:.1f}",
            str(load.advised_draft_tokens),
            status.version,
            f"{now - seen.received_at:.0f} s ago",
        )
    edges = Table(title="edges (telemetry)", title_justify="left")
    edge_numbers = (
        "answers",
        "tokens",
        "acceptance",
        "draft tok/s",
        "RTT ms",
        "proactive hits",
        "fallbacks",
        "resumes",
    )
    for column in ("edge", "server", *edge_numbers):
        edges.add_column(column, justify="right" if column in edge_numbers else "left")
    for edge_id, telemetry in sorted(view.edges.items()):
        stats = telemetry.message
        edges.add_row(
            edge_id,
            stats.server_id or "(fallback)",
            str(stats.answers),
            str(stats.tokens),
            f"{stats.acceptance_rate:.0%}",
            f"{stats.draft_tokens_per_s:.1f}",
            f"{stats.rtt_ms:.1f}",
            f"{stats.proactive_hit_rate:.0%}",
            str(stats.fallbacks),
            str(stats.resumes),
        )
    return Group(servers, edges)


def as_json(view: FleetView) -> str:
    now = view.clock()

    def entry(server_id: str | None, seen) -> dict:
        extra = {"seen_s_ago": round(now - seen.received_at, 2)}
        if server_id is not None:
            extra["live"] = view.is_live(server_id)
        return {**dataclasses.asdict(seen.message), **extra}

    return json.dumps(
        {
            "servers": {key: entry(key, seen) for key, seen in sorted(view.servers.items())},
            "edges": {key: entry(None, seen) for key, seen in sorted(view.edges.items())},
        }
    )


async def live(broker: BrokerConfig) -> None:
    from rich.live import Live

    view = FleetView()
    state = {"broker": "connecting"}

    async def session(mqtt) -> None:
        state["broker"] = "connected"
        await mqtt.subscribe(topics.SERVERS, qos=1)
        await mqtt.subscribe(topics.EDGE_STATS, qos=0)
        await _feed(mqtt, view)

    def down(reason: str) -> None:
        state["broker"] = f"unreachable: {reason}"

    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    with Live(render(view), refresh_per_second=2) as screen:

        async def redraw() -> None:
            while True:
                screen.update(render(view, f"on {broker.url} ({state['broker']})"))
                await asyncio.sleep(0.5)

        work = asyncio.ensure_future(
            run_together(stay_connected(broker, client_id(), session, what="specedge-fleet", on_down=down), redraw())
        )
        ctrl_c = asyncio.ensure_future(interrupted.wait())
        await asyncio.wait({work, ctrl_c}, return_when=asyncio.FIRST_COMPLETED)
        ctrl_c.cancel()
        if work.done():
            work.result()
            return
        work.cancel()
        # A broker disconnect that does not finish must not keep a Ctrl-C'd table on screen
        # (seen on a loaded CI machine): give it a moment, then leave regardless.
        await asyncio.wait({work}, timeout=3)
    if not work.done():
        sys.stdout.flush()
        os._exit(0)


async def _main(args: argparse.Namespace) -> int:
    broker = broker_from_args(args.mqtt, args)
    try:
        if args.command == "show" and not (args.once or args.json):
            await live(broker)
            return 0
        if args.command == "show":
            view = await snapshot(broker, args.wait)
            if args.json:
                print(as_json(view))
            else:
                from rich.console import Console

                console = Console()
                if not console.is_terminal:  # a pipe: wide enough that no column is cut
                    console = Console(width=200)
                console.print(render(view, f"on {broker.url}"))
            return 0
        command = Command(args.command, getattr(args, "reason", ""))
        status = await send_command(broker, args.server_id, command, args.timeout)
    except broker_errors() as exc:
        raise FleetError(f"cannot reach the broker at {broker.url}: {exc}") from None
    if status.health == DRAINING:
        print(
            f"server {status.server_id} is draining: {status.load.active_sessions} sessions still running; "
            "new sessions go elsewhere"
        )
    else:
        print(f"server {status.server_id} is serving again")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(_main(args))
    except (FleetError, ValueError) as exc:
        print(f"specedge-fleet: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
