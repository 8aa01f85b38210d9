"""Prometheus export, gRPC health and reflection: scripted stats scraped over HTTP, and a live server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import prometheus_client
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from harness import ServerThread
from specedge.server.app import ServerConfig
from specedge.server.cli import parse_args
from specedge.server.engine import EngineConfig
from specedge.server.metrics import start_metrics_server, stop_metrics_server
from specedge.server.stats import ServerStats
from specedge.v1 import specedge_pb2

SERVICE = "specedge.v1.SpecEdge"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SECONDS_LE = ["0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0"]
SIZES_LE = ["1.0", "2.0", "4.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0", "4096.0"]


def scrape(port: int) -> tuple[str, dict[tuple[str, tuple], float]]:
    """The exposition text, and every specedge sample as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = sample.value
    return text, {key: value for key, value in samples.items() if key[0].startswith("specedge:")}


def histogram(name: str, les: list[str], cumulative: list[int], total: float) -> dict:
    assert len(cumulative) == len(les) + 1
    samples = {(f"{name}_bucket", (("le", le),)): count for le, count in zip([*les, "+Inf"], cumulative)}
    return {**samples, (f"{name}_sum", ()): total, (f"{name}_count", ()): cumulative[-1]}


def scripted_stats(per_identity: bool = True) -> ServerStats:
    stats = ServerStats(per_identity=per_identity)
    stats.observe_prefill(num_prompt_tokens=10)
    stats.observe_prefill(num_prompt_tokens=7)
    stats.observe_round(num_draft_tokens=4, accepted_depth=3, num_committed=4)
    stats.observe_round(num_draft_tokens=4, accepted_depth=1, num_committed=2)
    stats.observe_round(num_draft_tokens=0, accepted_depth=0, num_committed=1)  # server-only round: no draft
    stats.observe_step(batch_size=3, batch_tokens=12, forward_s=0.02, schedule_s=0.0005, postprocess_s=0.002)
    stats.observe_step(batch_size=1, batch_tokens=5000, forward_s=20.0, schedule_s=0.003)  # both past the last bound
    stats.observe_queue_wait(0.001)  # on a bound: counts in that bucket (le is inclusive)
    stats.observe_queue_wait(0.3)
    stats.observe_rejected_session()
    stats.observe_rejected_session()
    stats.observe_refused("unauthenticated")
    stats.observe_refused("rate_limited")
    stats.observe_refused("rate_limited")
    stats.observe_failed_request()
    stats.set_sessions(active=2, slots_used=2, slots_free=6)
    stats.observe_share("alice", verified_tokens=5, cut_nodes=0)
    stats.observe_share("bob", verified_tokens=8, cut_nodes=57)  # a 64-node round cut to its first 7
    stats.observe_share("bob", verified_tokens=1, cut_nodes=0)
    stats.observe_hold(0.25, misses=0)  # two steps held for rounds due back; one waited for bob in vain
    stats.observe_hold(0.5, misses=1)
    stats.set_step_cost(curve=(0.12, 0.008), knee_tokens=15, budget=15)
    return stats


EXPECTED = {
    ("specedge:spec_decode_num_drafts_total", ()): 2,
    ("specedge:spec_decode_num_draft_tokens_total", ()): 8,
    ("specedge:spec_decode_num_accepted_tokens_total", ()): 4,
    ("specedge:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),)): 2,
    ("specedge:spec_decode_num_accepted_tokens_per_pos_total", (("position", "1"),)): 1,
    ("specedge:spec_decode_num_accepted_tokens_per_pos_total", (("position", "2"),)): 1,
    ("specedge:generation_tokens_total", ()): 2 + 4 + 2 + 1,
    ("specedge:prompt_tokens_total", ()): 17,
    ("specedge:verify_rounds_total", ()): 3,
    ("specedge:engine_steps_total", ()): 2,
    ("specedge:sessions_rejected_total", ()): 2,
    ("specedge:requests_failed_total", ()): 1,
    ("specedge:requests_refused_total", (("reason", "rate_limited"),)): 2,
    ("specedge:requests_refused_total", (("reason", "unauthenticated"),)): 1,
    ("specedge:active_sessions", ()): 2,
    ("specedge:kv_slots_used", ()): 2,
    ("specedge:kv_slots_free", ()): 6,
    ("specedge:verified_tokens_total", ()): 14,
    ("specedge:cut_draft_nodes_total", ()): 57,
    ("specedge:step_holds_total", ()): 2,
    ("specedge:step_hold_seconds_total", ()): 0.75,
    ("specedge:step_hold_misses_total", ()): 1,
    ("specedge:identity_verified_tokens_total", (("identity", "alice"),)): 5,
    ("specedge:identity_verified_tokens_total", (("identity", "bob"),)): 9,
    ("specedge:identity_cut_draft_nodes_total", (("identity", "alice"),)): 0,
    ("specedge:identity_cut_draft_nodes_total", (("identity", "bob"),)): 57,
    ("specedge:step_budget_tokens", ()): 15,
    ("specedge:step_cost_fixed_seconds", ()): 0.12,
    ("specedge:step_cost_per_token_seconds", ()): 0.008,
    ("specedge:step_cost_knee_tokens", ()): 15,
    ("specedge:spec_decode_acceptance_rate", ()): 0.5,  # 4 accepted / 8 drafted
    ("specedge:spec_decode_mean_acceptance_length", ()): 3.0,  # 1 + 4 accepted / 2 drafts
    **histogram("specedge:queue_wait_seconds", SECONDS_LE, [1] * 8 + [2] * 6, 0.301),
    **histogram("specedge:forward_seconds", SECONDS_LE, [0] * 4 + [1] * 9 + [2], 20.02),
    **histogram("specedge:schedule_seconds", SECONDS_LE, [1, 1] + [2] * 12, 0.0035),
    **histogram("specedge:postprocess_seconds", SECONDS_LE, [1] + [2] * 13, 0.002),
    **histogram("specedge:batch_size", SIZES_LE, [1, 1] + [2] * 12, 4),
    **histogram("specedge:batch_tokens", SIZES_LE, [0] * 4 + [1] * 9 + [2], 5012),
}


@pytest.fixture
def metrics():
    """start(stats) -> port; every server started is stopped at the end."""
    servers = []

    def start(stats: ServerStats) -> int:
        server, port = start_metrics_server(stats, "127.0.0.1", 0)
        servers.append(server)
        return port

    yield start
    for server in servers:
        stop_metrics_server(server)


def test_scripted_stats_export_exactly(metrics):
    text, samples = scrape(metrics(scripted_stats()))
    assert samples.keys() == EXPECTED.keys()
    for key, value in EXPECTED.items():
        assert samples[key] == pytest.approx(value), key
    for name, kind in [
        ("specedge:spec_decode_num_drafts_total", "counter"),  # text format 0.0.4 types the _total name
        ("specedge:spec_decode_num_accepted_tokens_per_pos_total", "counter"),
        ("specedge:kv_slots_free", "gauge"),
        ("specedge:spec_decode_acceptance_rate", "gauge"),
        ("specedge:forward_seconds", "histogram"),
        ("specedge:batch_tokens", "histogram"),
    ]:
        assert f"# TYPE {name} {kind}\n" in text


def test_identities_are_labelled_only_when_the_operator_asks(metrics):
    _, samples = scrape(metrics(scripted_stats(per_identity=False)))
    assert not [key for key in samples if key[0].startswith("specedge:identity_")]
    assert samples[("specedge:verified_tokens_total", ())] == 14  # the totals are always there
    assert samples[("specedge:cut_draft_nodes_total", ())] == 57


def test_values_are_read_at_scrape_time(metrics):
    stats = scripted_stats()
    port = metrics(stats)
    scrape(port)
    stats.observe_round(num_draft_tokens=2, accepted_depth=2, num_committed=3)
    stats.set_sessions(active=1, slots_used=1, slots_free=7)
    _, samples = scrape(port)
    assert samples[("specedge:spec_decode_num_drafts_total", ())] == 3
    assert samples[("specedge:spec_decode_num_accepted_tokens_per_pos_total", (("position", "1"),))] == 2
    assert samples[("specedge:spec_decode_acceptance_rate", ())] == pytest.approx(6 / 10)
    assert samples[("specedge:spec_decode_mean_acceptance_length", ())] == pytest.approx(1 + 6 / 3)
    assert samples[("specedge:active_sessions", ())] == 1


def test_empty_stats_export_zeros_without_positions(metrics):
    _, samples = scrape(metrics(ServerStats()))
    assert not any(name.endswith("_per_pos_total") for name, _ in samples)
    assert samples[("specedge:spec_decode_acceptance_rate", ())] == 0
    assert samples[("specedge:spec_decode_mean_acceptance_length", ())] == 0
    assert samples[("specedge:verify_rounds_total", ())] == 0
    assert samples[("specedge:batch_size_bucket", (("le", "+Inf"),))] == 0
    assert samples[("specedge:forward_seconds_count", ())] == 0


def test_each_server_has_its_own_registry(metrics):
    busy = scripted_stats()
    quiet_port, busy_port = metrics(ServerStats()), metrics(busy)
    assert quiet_port != busy_port
    assert scrape(busy_port)[1][("specedge:verify_rounds_total", ())] == 3
    assert scrape(quiet_port)[1][("specedge:verify_rounds_total", ())] == 0
    assert b"specedge:" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


def test_stopped_metrics_server_refuses_connections():
    server, port = start_metrics_server(ServerStats(), "127.0.0.1", 0)
    assert port > 0 and scrape(port)[1]
    stop_metrics_server(server)
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_config_and_cli_flags():
    with pytest.raises(ValueError, match="metrics port"):
        ServerConfig(model="x", metrics_port=65536)
    assert ServerConfig(model="x").metrics_port is None
    args = parse_args(["--model", "x", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"])
    assert (args.metrics_port, args.metrics_host) == (9400, "0.0.0.0")
    assert parse_args(["--model", "x"]).metrics_port is None
    assert not parse_args(["--model", "x"]).metrics_per_identity
    assert parse_args(["--model", "x", "--metrics-per-identity"]).metrics_per_identity


def test_live_server_health_reflection_metrics(tiny_target_dir):
    config = ServerConfig(
        model=str(tiny_target_dir), port=0, max_context=128, engine=EngineConfig(max_sessions=3), metrics_port=0
    )
    watched: list[int] = []
    with ServerThread(config) as running:
        channel = grpc.insecure_channel(running.address)
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        database = ProtoReflectionDescriptorDatabase(channel)
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
            database.get_services()
        )
        reflected = DescriptorPool(database).FindServiceByName(SERVICE)
        compiled = specedge_pb2.DESCRIPTOR.services_by_name["SpecEdge"]
        assert [m.name for m in reflected.methods] == [m.name for m in compiled.methods]

        metrics_port = running.server.metrics_port
        _, samples = scrape(metrics_port)
        assert samples[("specedge:kv_slots_free", ())] == 3
        assert samples[("specedge:kv_slots_used", ())] == 0
        assert samples[("specedge:active_sessions", ())] == 0
        running.server.stats.observe_round(num_draft_tokens=3, accepted_depth=2, num_committed=3)
        assert scrape(metrics_port)[1][("specedge:spec_decode_num_accepted_tokens_total", ())] == 2

        # A watcher that is connected when stop() begins must hear NOT_SERVING before the stream ends.
        stream = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        first = threading.Event()

        def watch():
            try:
                for response in stream:
                    watched.append(response.status)
                    first.set()
            except grpc.RpcError:
                pass

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert first.wait(10)
    watcher.join(timeout=30)
    assert not watcher.is_alive()
    assert watched == [SERVING, NOT_SERVING]
    with pytest.raises(grpc.RpcError) as after:
        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert after.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(urllib.error.URLError):
        scrape(metrics_port)
    channel.close()


def test_cli_logs_metrics_address_and_keeps_stdout_clean(tiny_target_dir):
    command = [os.path.join(os.path.dirname(sys.executable), "specedge-server"), "--model", str(tiny_target_dir)]
    command += ["--port", "0", "--max-context", "128", "--metrics-port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stderr_lines: list[str] = []
        reader = threading.Thread(target=lambda: stderr_lines.extend(iter(process.stderr.readline, "")), daemon=True)
        reader.start()
        first_line = process.stdout.readline()
        assert re.fullmatch(r"specedge-server ready on 127\.0\.0\.1:\d+\n", first_line), first_line + "".join(
            stderr_lines
        )
        deadline = time.monotonic() + 10
        while not (found := re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", "".join(stderr_lines))):
            assert time.monotonic() < deadline, "".join(stderr_lines)
            time.sleep(0.05)
        samples = scrape(int(found.group(1)))[1]
        assert samples[("specedge:kv_slots_free", ())] == 8  # --max-sessions default
        # The step budget and the cost curve it came from, timed at start: in the log and in /metrics.
        logged = re.search(
            r"step budget: (\d+) tokens, shared across identities; cost curve: ([0-9.]+) ms \+ ([0-9.]+) ms per token",
            "".join(stderr_lines),
        )
        assert logged, "".join(stderr_lines)
        assert samples[("specedge:step_budget_tokens", ())] == int(logged.group(1)) >= 8  # never under the floor
        # The fit's intercept may be 0 (a tiny model's cost grows with tokens from the first), never its whole line.
        fixed, per_token = (
            samples[("specedge:step_cost_fixed_seconds", ())],
            samples[("specedge:step_cost_per_token_seconds", ())],
        )
        assert fixed * 1e3 == pytest.approx(float(logged.group(2)), abs=0.05)
        assert per_token * 1e3 == pytest.approx(float(logged.group(3)), abs=0.0005)
        assert fixed + per_token > 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert process.stdout.read() == ""
    finally:
        if process.poll() is None:
            process.kill()
