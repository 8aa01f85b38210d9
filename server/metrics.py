"""Prometheus export of ServerStats: a thin sink, read at scrape time.

Each server gets its own CollectorRegistry holding one collector that copies
`stats.snapshot()` per scrape, so nothing here keeps state of its own and
several servers in one process never share numbers. Names follow vLLM's
(`vllm:spec_decode_*`) with the `specedge:` prefix where the meaning is the
same; prometheus_client appends `_total` to counters in the exposition.
"""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from specedge.server.stats import Histogram, ServerStats

PREFIX = "specedge:"

# (name, snapshot key, help)
_COUNTERS = (
    ("spec_decode_num_drafts", "num_drafts", "Verify rounds that carried at least one draft token."),
    ("spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens received for verification."),
    ("spec_decode_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted by verification."),
    ("generation_tokens", "num_generated_tokens", "Tokens committed to sessions (prefill's first token included)."),
    ("prompt_tokens", "num_prompt_tokens", "Prompt tokens prefilled."),
    ("verify_rounds", "num_rounds", "Verify rounds, with or without draft tokens."),
    ("engine_steps", "num_steps", "Batched forward steps run by the engine."),
    ("sessions_rejected", "sessions_rejected", "Sessions refused at admission (no free KV slot)."),
    (
        "requests_failed",
        "requests_failed",
        "Requests that failed inside the engine alone (their batch ran without them).",
    ),
    ("verified_tokens", "num_verified_tokens", "Tokens run for verify rounds: pending tokens and verified nodes."),
    ("cut_draft_nodes", "num_cut_nodes", "Draft nodes not verified because their round exceeded its share of a step."),
    ("step_holds", "num_holds", "Steps held for rounds due back from edges (at most the step's fixed cost each)."),
    ("step_hold_seconds", "hold_s", "Seconds steps were held for rounds due back from edges."),
    ("step_hold_misses", "num_hold_misses", "Identities a hold waited for in vain (then not waited for a while)."),
)
_GAUGES = (
    ("active_sessions", "active_sessions", "Open sessions."),
    ("kv_slots_used", "kv_slots_used", "KV-cache slots held by sessions."),
    ("kv_slots_free", "kv_slots_free", "KV-cache slots free for new sessions."),
    ("step_budget_tokens", "step_budget_tokens", "Most tokens one step carries (fair shares: the cost curve's knee)."),
    ("step_cost_fixed_seconds", "step_cost_fixed_s", "Measured step cost curve a + b * tokens: a, in seconds."),
    ("step_cost_per_token_seconds", "step_cost_per_token_s", "Measured step cost curve a + b * tokens: b, in seconds."),
    ("step_cost_knee_tokens", "step_cost_knee_tokens", "The curve's knee a / b in tokens (0: unknown or unbounded)."),
)
# (name, snapshot key of a dict label -> count, label, help). By identity: only on a server started
# with --metrics-per-identity (server/stats.py); otherwise those families are empty.
_LABELLED_COUNTERS = (
    ("requests_refused", "requests_refused", "reason", "Calls refused by policy, by reason."),
    ("identity_verified_tokens", "verified_tokens_by_identity", "identity", "Tokens run for an identity's rounds."),
    ("identity_cut_draft_nodes", "cut_nodes_by_identity", "identity", "Draft nodes of an identity cut to its share."),
)
_HISTOGRAMS = (
    ("queue_wait_seconds", "queue_wait_s", "Time a request waited in the queue before its batch ran."),
    ("forward_seconds", "forward_s", "Time of one batched target forward."),
    ("schedule_seconds", "schedule_s", "Time spent choosing one batch."),
    ("postprocess_seconds", "postprocess_s", "Time spent verifying and committing one batch's rows."),
    ("batch_size", "batch_size", "Requests per engine step."),
    ("batch_tokens", "batch_tokens", "Tokens per engine step."),
)


class StatsCollector(Collector):
    """Turns one ServerStats snapshot into metric families."""

    def __init__(self, stats: ServerStats):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        snapshot = self._stats.snapshot()
        for name, key, documentation in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, documentation, value=snapshot[key])

        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Rounds whose draft token at this 0-based depth was accepted.",
            labels=["position"],
        )
        for position, count in sorted(snapshot["num_accepted_tokens_per_pos"].items()):
            per_pos.add_metric([str(position)], count)
        yield per_pos

        for name, key, label, documentation in _LABELLED_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, documentation, labels=[label])
            for value, count in sorted(snapshot[key].items()):
                family.add_metric([value], count)
            yield family

        for name, key, documentation in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, documentation, value=snapshot[key])

        curve = GaugeMetricFamily(
            PREFIX + "step_cost_seconds",
            "Measured forward time of a step carrying about this many tokens (one point per token-count bucket).",
            labels=["tokens"],
        )
        for tokens, seconds in snapshot["step_cost_points"]:
            curve.add_metric([f"{tokens:.1f}"], seconds)
        yield curve

        drafts, draft_tokens = snapshot["num_drafts"], snapshot["num_draft_tokens"]
        accepted = snapshot["num_accepted_tokens"]
        yield GaugeMetricFamily(
            PREFIX + "spec_decode_acceptance_rate",
            "Accepted / draft tokens since start (0 before the first draft).",
            value=accepted / draft_tokens if draft_tokens else 0.0,
        )
        yield GaugeMetricFamily(
            PREFIX + "spec_decode_mean_acceptance_length",
            "1 + accepted tokens / drafts since start: tokens committed per drafted round (0 before the first draft).",
            value=1 + accepted / drafts if drafts else 0.0,
        )

        for name, key, documentation in _HISTOGRAMS:
            yield _histogram(PREFIX + name, documentation, snapshot[key])


def _histogram(name: str, documentation: str, histogram: Histogram) -> HistogramMetricFamily:
    # ServerStats counts per bucket; Prometheus wants running totals ending in +Inf.
    # e.g. bounds (1, 2), counts [3, 0, 1] -> le="1.0": 3, le="2.0": 3, le="+Inf": 4
    buckets, running = [], 0
    for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts):
        running += count
        buckets.append((floatToGoString(bound), running))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=histogram.total)


def make_registry(stats: ServerStats) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    return registry


def start_metrics_server(stats: ServerStats, host: str, port: int) -> tuple[WSGIServer, int]:
    """Serve /metrics for `stats` on host:port (0 picks a free port) in a daemon thread.

    Returns the HTTP server (pass it to stop_metrics_server) and the port it bound.
    Raises OSError if the address cannot be bound.
    """
    server, _thread = start_http_server(port, addr=host, registry=make_registry(stats))
    return server, server.server_port


def stop_metrics_server(server: WSGIServer) -> None:
    """Stop serving and close the socket; blocks up to one poll interval (0.5 s)."""
    server.shutdown()
    server.server_close()
