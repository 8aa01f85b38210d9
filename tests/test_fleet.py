"""The fleet control plane against a real mosquitto broker: discovery, moving answers, drain, hostile messages.

Servers are tiny models (server threads, and one real `specedge-server`
process that gets killed); every answer is compared with target-only greedy
decoding, so a move between servers that lost, repeated or changed a token fails.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from harness import ServerThread, free_port, start_server_process
from mqtt_broker import Broker, make_certificate
from reference import greedy_decode
from specedge.edge_client.client import ConnectionConfig, ConnectionLost, EdgeClient
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.runtime import EdgeRuntime, RuntimeConfig
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.fleet.announcer import AnnouncerConfig
from specedge.fleet.broker import BrokerConfig
from specedge.fleet.cli import send_command, snapshot
from specedge.fleet.discovery import DiscoveryConfig, FleetRouter
from specedge.fleet.messages import DRAINING, OFFLINE, Command
from specedge.server.app import ServerConfig
from specedge.server.engine import EngineConfig
from specedge.types import SamplingParams

BIN = os.path.dirname(sys.executable)
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with Broker(tmp_path_factory.mktemp("mqtt")) as running:
        yield running


def fleet_server(model_dir, broker_config: BrokerConfig, server_id: str, **engine) -> ServerThread:
    fleet = AnnouncerConfig(broker_config, server_id=server_id, period_s=1.0, check_s=0.05)
    engine_config = EngineConfig(**{"max_sessions": 4, **engine})
    return ServerThread(ServerConfig(model=str(model_dir), port=0, max_context=512, engine=engine_config, fleet=fleet))


@pytest.fixture(scope="module")
def servers(broker, tiny_target_dir):
    """Two replicas of the tiny target on the broker: alpha and beta."""
    with fleet_server(tiny_target_dir, BrokerConfig(broker.url), "alpha") as alpha:
        with fleet_server(tiny_target_dir, BrokerConfig(broker.url), "beta") as beta:
            yield {"alpha": alpha, "beta": beta}


@pytest.fixture(scope="module")
def tokenizer(tiny_draft_dir):
    return HFTokenizer(tiny_draft_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "print(i * i)"}])


async def wait_until(predicate, timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def load_of(router: FleetRouter, server_id: str):
    seen = router.view.servers.get(server_id)
    return seen.message.load.active_sessions if seen else None


def edge_runtime(draft_dir, fallback: str | None, discovery: DiscoveryConfig, **policy) -> EdgeRuntime:
    return EdgeRuntime(RuntimeConfig(fallback, str(draft_dir), SpeculationPolicy(**policy), discovery=discovery))


async def hold_session(address: str, tokenizer) -> EdgeClient:
    """An open session on `address` (the load discovery sees); closing the client frees it."""
    client = EdgeClient(address, tokenizer.fingerprint)
    await client.connect()
    await client.open_session([1, 2, 3], 50, SamplingParams(), None)
    return client


def test_discovery_picks_the_compatible_least_loaded_server(broker, servers, tiny_foreign_dir, tokenizer):
    alpha, beta = servers["alpha"], servers["beta"]

    async def run():
        with fleet_server(tiny_foreign_dir, BrokerConfig(broker.url), "foreign") as foreign:
            router = FleetRouter(DiscoveryConfig(BrokerConfig(broker.url)), tokenizer.fingerprint)
            await router.start()
            held = [await hold_session(beta.address, tokenizer)]
            try:
                await wait_until(lambda: load_of(router, "beta") == 1 and "foreign" in router.view.servers)
                # The idle foreign server would be the least loaded, but its tokenizer differs.
                assert await router.choose_address() == alpha.address
                held += [await hold_session(alpha.address, tokenizer) for _ in range(2)]
                await wait_until(lambda: load_of(router, "alpha") == 2, what="alpha's new load")  # announced at once
                assert await router.choose_address() == beta.address
                assert "foreign (incompatible tokenizer)" in router.view.describe(tokenizer.fingerprint)
                assert foreign.address not in {s.address for s in router.view.usable(tokenizer.fingerprint)}
            finally:
                for client in held:
                    await client.__aexit__(None, None, None)
                await router.close()

    asyncio.run(run())


def test_a_killed_server_last_will_moves_the_next_session(
    broker, servers, tiny_target_dir, tiny_draft_dir, tokenizer, prompt, reference_model
):
    process, proc_address = start_server_process(
        "--model",
        str(tiny_target_dir),
        "--max-context",
        "512",
        "--log-level",
        "warning",
        "--mqtt",
        broker.url,
        "--server-id",
        "proc",
        "--announce-period",
        "1",
    )
    expected = greedy_decode(reference_model, prompt, MAX_TOKENS, set(tokenizer.eos_token_ids))

    async def run():
        discovery = DiscoveryConfig(BrokerConfig(broker.url))
        runtime = edge_runtime(tiny_draft_dir, None, discovery, max_new_tokens=MAX_TOKENS)
        # Busy replicas: the first session goes to the idle process.
        held = [await hold_session(servers[name].address, tokenizer) for name in ("alpha", "beta")]
        try:
            router = FleetRouter(discovery, tokenizer.fingerprint)  # for watching only
            await router.start()
            await wait_until(
                lambda: "proc" in router.view.servers and load_of(router, "alpha") == load_of(router, "beta") == 1
            )
            await runtime.start()
            first = await runtime.generate(prompt)
            assert runtime.client.address == proc_address
            process.send_signal(signal.SIGKILL)  # no goodbye: the broker sends its last will
            process.wait()
            await wait_until(lambda: router.view.servers["proc"].message.health == OFFLINE, what="the last will")
            assert router.view.servers["proc"].message.address == proc_address  # the will names what went away
            second = await runtime.generate(prompt)
            assert runtime.client.address in (servers["alpha"].address, servers["beta"].address)
            await router.close()
            return first, second
        finally:
            for client in held:
                await client.__aexit__(None, None, None)
            await runtime.close()

    try:
        first, second = asyncio.run(run())
    finally:
        process.kill()
    assert first.token_ids == expected and second.token_ids == expected
    assert second.stats.resumes == 0  # a new session on the new server, not a rescue


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "server-only"])
def test_draining_mid_answer_moves_the_answer_intact(
    broker, servers, tiny_draft_dir, tokenizer, prompt, reference_model, speculative
):
    expected = greedy_decode(reference_model, prompt, MAX_TOKENS, set(tokenizer.eos_token_ids))
    by_address = {server.address: name for name, server in servers.items()}
    before = {name: s.server.stats.snapshot() for name, s in servers.items()}
    broker_config = BrokerConfig(broker.url)
    edge_id = f"edge-{'spec' if speculative else 'alone'}"

    async def run():
        discovery = DiscoveryConfig(broker_config, edge_id=edge_id, telemetry=True, telemetry_period_s=0.05)
        # A 40 ms emulated round trip (and, server-only, a slow reader) keeps the answer going while the drain travels.
        runtime = EdgeRuntime(
            RuntimeConfig(
                None,
                str(tiny_draft_dir),
                SpeculationPolicy(max_new_tokens=MAX_TOKENS),
                ConnectionConfig(simulated_rtt_ms=40),
                server_only=not speculative,
                discovery=discovery,
            )
        )
        await runtime.start()
        first_name = by_address[runtime.client.address]
        received: list[int] = []
        drains: list[asyncio.Task] = []

        def on_tokens(token_ids) -> None:
            received.extend(token_ids)
            if len(received) >= 8 and not drains:
                drains.append(
                    asyncio.ensure_future(send_command(broker_config, first_name, Command("drain", "test"), 10))
                )
            if not speculative:
                time.sleep(0.01)

        try:
            result = await runtime.generate(prompt, on_tokens)
            drained = await drains[0]
            second_name = by_address[runtime.client.address]
            drained_engine = servers[first_name].server.engine  # its running session moved: nothing left there
            await wait_until(lambda: not drained_engine.sessions, what="the drained server's sessions to close")

            async def published() -> bool:  # the edge's telemetry, after this answer, is on the broker
                seen = (await snapshot(broker_config, 0.2)).edges.get(edge_id)
                return seen is not None and seen.message.answers == 1

            deadline = time.monotonic() + 10
            while not await published() and time.monotonic() < deadline:
                pass
            table = await asyncio.to_thread(fleet_cli, "--mqtt", broker.url, "--json")
        finally:
            await runtime.close()
        return result, received, first_name, second_name, drained, table

    result, received, first_name, second_name, drained, table = asyncio.run(run())
    assert result.token_ids == received == expected
    assert first_name != second_name and result.stats.resumes >= 1
    assert drained.health == DRAINING and drained.reason == "test"
    after = {name: s.server.stats.snapshot() for name, s in servers.items()}
    for name in (first_name, second_name):  # both servers generated part of the answer
        assert after[name]["num_generated_tokens"] > before[name]["num_generated_tokens"]
    # The second server was handed the prompt plus every token committed before the move.
    assert after[second_name]["num_prompt_tokens"] - before[second_name]["num_prompt_tokens"] > len(prompt)
    fleet = json.loads(table.stdout)
    assert fleet["servers"][first_name]["health"] == DRAINING
    edge = fleet["edges"][edge_id]
    assert edge["server_id"] == second_name and edge["answers"] == 1 and edge["resumes"] >= 1
    assert set(edge) == {
        "edge_id",
        "server_id",
        "answers",
        "tokens",
        "rounds",
        "draft_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "draft_tokens_per_s",
        "rtt_ms",
        "proactive_hit_rate",
        "fallbacks",
        "resumes",
        "seen_s_ago",
    }
    if speculative:  # the server it uses took the edge's acceptance as its advice prior
        assert servers[second_name].server.engine.acceptance_prior == min(0.95, max(0.05, edge["acceptance_rate"]))

    # The drained server refuses new sessions, saying why; `undrain` brings it back.
    async def open_on_drained():
        async with EdgeClient(servers[first_name].address, tokenizer.fingerprint) as client:
            await client.open_session(prompt, 4, SamplingParams(), None)

    with pytest.raises(ConnectionLost, match=f"server {first_name} is draining \\(test\\)"):
        asyncio.run(open_on_drained())
    undrain = fleet_cli("undrain", first_name, "--mqtt", broker.url)
    assert undrain.returncode == 0 and f"server {first_name} is serving again" in undrain.stdout, undrain.stderr
    assert servers[first_name].server.engine.draining is None


def fleet_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([f"{BIN}/specedge-fleet", *args], capture_output=True, text=True, timeout=120)


def test_malformed_and_hostile_messages_are_ignored(
    broker, servers, tiny_draft_dir, tokenizer, prompt, reference_model, caplog
):
    import aiomqtt

    alpha = servers["alpha"]
    announcer = alpha.server.announcer
    imposter = json.dumps(
        {
            "schema": 1,
            "server_id": "imposter",
            "health": "serving",
            "address": "127.0.0.1:9",
            "model": "evil",
            "tokenizer": {
                "vocab_size": 384,
                "num_tokens": 384,
                "vocab_sha256": "0" * 64,
                "bos_token_id": None,
                "eos_token_ids": [2],
            },
            "version": "0",
            "period_s": 1.0,
            "reason": "",
            "load": {
                "max_sessions": 1000,
                "active_sessions": 0,
                "free_kv_slots": 1000,
                "queue_wait_ms": 0,
                "advised_draft_tokens": 8,
            },
        }
    )
    junk = [
        ("specedge/v1/servers/alpha", b"{not json"),
        ("specedge/v1/servers/ghost", b'{"schema": 1, "server_id": "ghost", "health": 7}'),
        ("specedge/v1/servers/alpha", json.dumps({"schema": 1, "server_id": "beta"}).encode()),  # spoofed id
        ("specedge/v1/servers/huge", b"[" + b"0," * 100_000 + b"0]"),
        ("specedge/v1/servers/imposter", imposter.encode()),  # well formed, wrong tokenizer: never chosen
        ("specedge/v1/servers/alpha/command", b"rm -rf /"),
        ("specedge/v1/servers/alpha/command", b'{"schema": 1, "command": "drain", "reason": 5}'),
        ("specedge/v1/servers/alpha/command", b'{"schema": 1, "command": "explode"}'),
        ("specedge/v1/edges/e1/stats", b'{"schema": 1, "edge_id": "e1", "server_id": "alpha", "acceptance_rate": 50}'),
        ("specedge/v1/edges/e1/stats", b"\xff\xfe\x00"),
    ]

    async def run():
        router = FleetRouter(DiscoveryConfig(BrokerConfig(broker.url)), tokenizer.fingerprint)
        await router.start()
        await wait_until(lambda: {"alpha", "beta"} <= set(router.view.servers))
        published_before, ignored_before = announcer.published, announcer.ignored
        async with aiomqtt.Client("127.0.0.1", broker.port) as mqtt:
            for topic, payload in junk:
                await mqtt.publish(topic, payload, qos=1)
        await wait_until(lambda: router.view.ignored >= 4 and announcer.ignored - ignored_before >= 4, what="the junk")
        await wait_until(lambda: announcer.published > published_before + 1, what="announcements after the junk")
        chosen = {await router.choose_address() for _ in range(10)}
        await router.close()
        runtime = edge_runtime(tiny_draft_dir, None, router.config, max_new_tokens=12)
        await runtime.start()
        try:
            return chosen, await runtime.generate(prompt), router
        finally:
            await runtime.close()

    with caplog.at_level(logging.WARNING):
        chosen, result, router = asyncio.run(run())
    assert chosen <= {servers["alpha"].address, servers["beta"].address}
    assert router.view.servers["alpha"].message.health == "serving" and alpha.server.engine.draining is None
    assert "imposter" in router.view.servers and "127.0.0.1:9" not in chosen
    assert alpha.server.engine.acceptance_prior <= 0.95
    assert result.token_ids == greedy_decode(reference_model, prompt, 12, set(tokenizer.eos_token_ids))
    assert any("ignored a message" in record.getMessage() for record in caplog.records)
    assert fleet_cli("--mqtt", broker.url, "--once").returncode == 0  # the table survives the junk too


def test_without_a_broker_the_edge_falls_back_or_says_why(
    tiny_target_dir, tiny_draft_dir, tokenizer, prompt, reference_model
):
    dead = BrokerConfig(f"mqtt://127.0.0.1:{free_port()}")
    expected = greedy_decode(reference_model, prompt, 12, set(tokenizer.eos_token_ids))

    async def run(server_address):
        runtime = edge_runtime(tiny_draft_dir, server_address, DiscoveryConfig(dead), max_new_tokens=12)
        await runtime.start()
        try:
            return await runtime.generate(prompt), runtime.router.broker_down
        finally:
            await runtime.close()

    # The server's own announcer cannot reach the broker either: it serves regardless.
    with fleet_server(tiny_target_dir, dead, "lonely") as server:
        result, broker_down = asyncio.run(run(server.address))
    assert result.token_ids == expected and "refused" in broker_down.lower()
    failed = subprocess.run(
        [f"{BIN}/specedge-edge", "--discover", dead.url, "--draft", str(tiny_draft_dir), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines() == [
        f"specedge-edge: the broker at {dead.url} is unreachable ([Errno 111] Connection refused), "
        "and no --server fallback was given"
    ]


def test_broker_password_and_tls(tmp_path, tiny_target_dir, tokenizer):
    cert, key = make_certificate(tmp_path)
    with Broker(tmp_path, users={"server": "pw-server", "edge": "pw-edge"}, tls=(cert, key)) as secure:
        server_broker = BrokerConfig(secure.url, username="server", password="pw-server", tls_ca=cert)

        async def choose(broker_config: BrokerConfig) -> tuple[str | None, str | None]:
            router = FleetRouter(DiscoveryConfig(broker_config, first_wait_s=5), tokenizer.fingerprint)
            await router.start()
            try:
                await wait_until(lambda: "guarded" in router.view.servers or router.broker_down, what="the broker")
                return await router.choose_address(), router.broker_down
            except ConnectionLost as exc:
                return None, str(exc)
            finally:
                await router.close()

        with fleet_server(tiny_target_dir, server_broker, "guarded") as server:
            chosen, _ = asyncio.run(choose(BrokerConfig(secure.url, username="edge", password="pw-edge", tls_ca=cert)))
            assert chosen == server.address
            _, wrong_password = asyncio.run(
                choose(BrokerConfig(secure.url, username="edge", password="nope", tls_ca=cert))
            )
            assert "unreachable" in wrong_password and "authori" in wrong_password.lower()
            # TLS verifies the broker: without its CA, the self-signed certificate is refused.
            _, untrusted = asyncio.run(choose(BrokerConfig(secure.url, username="edge", password="pw-edge")))
            assert "unreachable" in untrusted and "certificate verify failed" in untrusted


def test_the_live_table_shows_the_fleet_and_quits_on_ctrl_c(broker, servers):
    # rich draws a live table only on a terminal; TTY_COMPATIBLE/TTY_INTERACTIVE make it draw into the pipe
    # too, so the test can see the servers appear (without them it only prints the last frame, at exit).
    table = subprocess.Popen(
        [f"{BIN}/specedge-fleet", "--mqtt", broker.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"},
    )
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: table.stdout.read(1), "")), daemon=True)
    reader.start()
    try:
        # Ctrl-C once the table shows every server (not after a fixed sleep: a loaded machine starts slowly).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(s.address in "".join(chunks) for s in servers.values()):
            time.sleep(0.1)
        table.send_signal(signal.SIGINT)
        table.wait(timeout=60)
        reader.join(timeout=10)
        out, err = "".join(chunks), table.stderr.read()
    finally:
        table.kill()
    assert table.returncode == 0, err
    assert f"servers on {broker.url} (connected)" in out
    for name, server in servers.items():
        assert any(name in line and "serving" in line and server.address in line for line in out.splitlines())
