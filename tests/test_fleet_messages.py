"""The control plane's messages, topics and broker settings, by hand: no broker, no model.

Every hostile payload here must be refused with BadMessage (which the
components log and ignore), never with any other exception.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from specedge.fleet import topics
from specedge.fleet.broker import BrokerConfig, FleetError
from specedge.fleet.messages import (
    DRAINING,
    MAX_PAYLOAD_BYTES,
    SERVING,
    BadMessage,
    Command,
    EdgeStats,
    ServerLoad,
    ServerStatus,
)
from specedge.fleet.telemetry import EdgeTelemetry
from specedge.fleet.view import FleetView
from specedge.tokens import TokenizerFingerprint

FINGERPRINT = TokenizerFingerprint(384, 384, "a" * 64, None, (2,))
FOREIGN = TokenizerFingerprint(320, 320, "b" * 64, None, (2,))


def status(server_id="s1", *, active=0, free=4, health=SERVING, fingerprint=FINGERPRINT, queue_ms=0.0) -> ServerStatus:
    load = ServerLoad(
        max_sessions=4, active_sessions=active, free_kv_slots=free, queue_wait_ms=queue_ms, advised_draft_tokens=4
    )
    return ServerStatus(
        server_id, health, f"127.0.0.1:{5000 + len(server_id)}", "tiny", fingerprint, "0.1.0", load, 5.0
    )


def test_topics_accept_only_safe_ids():
    assert topics.server_topic("gpu-01_a") == "specedge/v1/servers/gpu-01_a"
    assert topics.edge_stats_topic("e1") == "specedge/v1/edges/e1/stats"
    for bad in ("", "a/b", "+", "#", "a b", "é", "x" * 65, "a\x00"):
        with pytest.raises(ValueError, match="invalid server id"):
            topics.server_topic(bad)
    assert topics.server_id_of("specedge/v1/servers/s1") == "s1"
    assert topics.server_id_of("specedge/v1/servers/s1/command") is None  # a command, not a status
    assert topics.command_target("specedge/v1/servers/s1/command") == "s1"
    assert topics.server_id_of("specedge/v1/servers/bad$id") is None
    assert topics.edge_id_of("specedge/v1/edges/e1/stats") == "e1"
    assert topics.edge_id_of("specedge/v2/edges/e1/stats") is None


def test_messages_round_trip():
    original = status(active=2, free=1, health=DRAINING, queue_ms=3.5)
    assert ServerStatus.from_json(original.to_json()) == original
    stats = EdgeStats("e1", "s1", answers=2, tokens=40, draft_tokens=30, accepted_tokens=20, acceptance_rate=0.6667)
    assert EdgeStats.from_json(stats.to_json()) == stats
    assert Command.from_json(Command("drain", "kernel update").to_json()) == Command("drain", "kernel update")


def _status_dict() -> dict:
    return json.loads(status().to_json())


def _with(path: str, value) -> bytes:
    data = _status_dict()
    *parents, key = path.split(".")
    target = data
    for parent in parents:
        target = target[parent]
    target[key] = value
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    "payload, complaint",
    [
        (b"", "not UTF-8 JSON"),
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b"{not json", "not UTF-8 JSON"),
        (b"[1, 2]", "not an object"),
        (b"[" * 5000 + b"]" * 5000, "not UTF-8 JSON"),  # nesting bomb
        (b" " * (MAX_PAYLOAD_BYTES + 1), "exceeds"),
        (json.dumps({**_status_dict(), "schema": 2}).encode(), "schema"),
        (_with("server_id", "a/b"), "server_id"),
        (_with("health", "great"), "health"),
        (_with("address", "127.0.0.1"), "address"),
        (_with("address", "host:99999"), "address"),
        (_with("model", "x" * 300), "model"),
        (_with("model", "bell\x07"), "model"),
        (_with("load.active_sessions", -1), "active_sessions"),
        (_with("load.active_sessions", True), "active_sessions"),
        (_with("load.active_sessions", "3"), "active_sessions"),
        (_with("load.queue_wait_ms", float("nan")), "queue_wait_ms"),
        (_with("load", [1]), "load"),
        (_with("tokenizer.vocab_sha256", "XYZ"), "vocab_sha256"),
        (_with("tokenizer.eos_token_ids", list(range(100))), "eos_token_ids"),
        (_with("tokenizer.eos_token_ids", ["2"]), "eos"),
        (_with("period_s", 1e12), "period_s"),
    ],
)
def test_hostile_statuses_are_refused_with_a_reason(payload, complaint):
    with pytest.raises(BadMessage, match=complaint):
        ServerStatus.from_json(payload)


@pytest.mark.parametrize(
    "payload",
    [b'{"schema": 1, "command": "rm -rf"}', b'{"schema": 1, "command": "drain", "reason": 5}', b"drain", b"null"],
)
def test_hostile_commands_are_refused(payload):
    with pytest.raises(BadMessage):
        Command.from_json(payload)


def test_view_drops_spoofed_and_malformed_messages_and_ranks_by_load():
    view = FleetView()
    assert view.receive("specedge/v1/servers/s1", status("s1", active=3).to_json()) == "s1"
    assert view.receive("specedge/v1/servers/s2", status("s2", active=1).to_json()) == "s2"
    assert view.receive("specedge/v1/servers/s3", status("s3", fingerprint=FOREIGN).to_json()) == "s3"
    assert view.receive("specedge/v1/servers/s4", status("s4", health=DRAINING).to_json()) == "s4"
    assert view.receive("specedge/v1/servers/s5", status("s5", active=4, free=0).to_json()) == "s5"
    # A status on s1's topic that claims to be s9 is a spoof; junk is junk.
    assert view.receive("specedge/v1/servers/s1", status("s9").to_json()) is None
    assert view.receive("specedge/v1/servers/s6", b"\x00garbage") is None
    assert view.receive("specedge/v1/servers/s1/command", Command("drain").to_json()) is None
    assert view.ignored == 3
    assert [s.server_id for s in view.usable(FINGERPRINT)] == ["s2", "s1", "s5"]  # s3 foreign, s4 draining, s5 full
    assert "s3 (incompatible tokenizer)" in view.describe(FINGERPRINT) and "s4 (draining)" in view.describe(FINGERPRINT)
    assert view.receive("specedge/v1/servers/s2", b"") == "s2"  # a cleared retained status: gone
    assert "s2" not in view.servers


def test_a_silent_server_is_not_usable():
    now = [100.0]
    view = FleetView(clock=lambda: now[0])
    view.receive("specedge/v1/servers/s1", status("s1").to_json())
    now[0] += 3 * 5.0 + 1  # within three periods and the slack
    assert view.usable(FINGERPRINT)
    now[0] += 5.0
    assert not view.usable(FINGERPRINT) and "s1 (silent)" in view.describe(FINGERPRINT)


def test_telemetry_carries_numbers_and_ids_only():
    @dataclasses.dataclass
    class Stats:  # the fields of edge_client.generation.GenerationStats that telemetry reads
        num_tokens: int = 30
        rounds: int = 10
        draft_tokens: int = 40
        accepted_tokens: int = 20
        visible_draft_ms: float = 150.0
        hidden_draft_ms: float = 50.0
        wait_ms: float = 300.0
        proactive_rounds: int = 8
        proactive_hits: int = 6
        resumes: int = 1
        fallback: str | None = "drafting is slower than the server alone"

    telemetry = EdgeTelemetry()
    telemetry.observe(Stats())
    telemetry.observe(Stats(fallback=None))
    message = telemetry.message("e1", "s1")
    assert (message.answers, message.tokens, message.fallbacks, message.resumes) == (2, 60, 1, 2)
    assert message.acceptance_rate == 0.5 and message.rtt_ms == 30.0 and message.draft_tokens_per_s == 200.0
    assert message.proactive_hit_rate == 0.75
    data = json.loads(message.to_json())
    assert all(isinstance(value, (int, float)) for key, value in data.items() if key not in ("edge_id", "server_id"))


def test_broker_urls_and_credentials():
    plain = BrokerConfig("mqtt://broker.example")
    assert (plain.host, plain.port, plain.tls) == ("broker.example", 1883, False)
    secure = BrokerConfig("mqtts://10.0.0.5", username="edge", password="s3cret")
    assert (secure.port, secure.tls) == (8883, True)
    assert "s3cret" not in repr(secure)
    assert BrokerConfig("mqtt://h:1884", tls_ca="/ca.pem").tls
    for url, complaint in [
        ("http://h:1883", "must look like"),
        ("mqtt://", "must look like"),
        ("mqtt://user:pw@h:1883", "not in the URL"),
        ("mqtt://h:1883/topic", "path"),
        ("mqtt://h:99999", "invalid port"),
    ]:
        with pytest.raises(FleetError, match=complaint):
            BrokerConfig(url)
    with pytest.raises(FleetError, match="both"):
        BrokerConfig("mqtt://h", tls_cert="/c.pem")
