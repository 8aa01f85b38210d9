"""specedge-bench: simulated edges replay a profile exactly, metrics mean what they say, the CLI runs end to end."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from harness import tiny_server
from specedge.bench import cli
from specedge.bench.config import MODES, BenchConfig, Pricing
from specedge.bench.ideal import CostCurve, ideal_cycle, ideal_ratio, schedule_rate
from specedge.bench.lifeline import dying_with_parent
from specedge.bench.metrics import (
    REQUIRED_FIELDS,
    add_ideal,
    add_ratios,
    add_schedule,
    percentile,
    steady_window,
    summarize_cell,
    window_prompt_tokens,
)
from specedge.bench.modes import Cell, CellRun, Job, RequestResult, run_cell
from specedge.bench.prompts import assignment, interleave, load_prompts
from specedge.bench.report import write_report
from specedge.bench.server import ServerCounters
from specedge.bench.simulated import AcceptanceProfile, CategoryProfile, SimulatedDrafter, make_script
from specedge.edge_client.drafting.base import DraftSampling
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.tokens import TokenizerFingerprint

FINGERPRINT = TokenizerFingerprint(
    vocab_size=100, num_tokens=100, vocab_sha256="x", bos_token_id=None, eos_token_ids=(2,)
)
PROMPT = (50, 51, 52)
REFERENCE = tuple(range(10, 40))


def test_script_follows_the_profile_by_run_length():
    profile = CategoryProfile(acceptance=(0.9, 0.6, 0.3))
    reference = [7] * 30_000
    script = make_script(PROMPT, reference, profile, seed=3)
    assert script == make_script(PROMPT, reference, profile, seed=3)  # seeded
    assert not script.correct[0]  # the prefill's token is the server's, never drafted
    by_run: dict[int, list[bool]] = {}
    run = 0
    for ok in script.correct[1:]:
        by_run.setdefault(min(run, 2), []).append(ok)
        run = run + 1 if ok else 0
    for run, expected in enumerate(profile.acceptance):
        observed = sum(by_run[run]) / len(by_run[run])
        assert abs(observed - expected) < 0.02, (run, observed)


def test_simulated_drafter_knows_the_truth_only_on_the_reference_path():
    perfect = make_script(PROMPT, REFERENCE, CategoryProfile((1.0,)), seed=0)
    drafter = SimulatedDrafter(FINGERPRINT, [perfect], s_per_call=0.001, s_per_token=0.001)
    chain = drafter.propose([*PROMPT, *REFERENCE[:3]], 4)
    assert chain.token_ids == REFERENCE[3:7]
    assert drafter.busy_s == pytest.approx(0.005)
    # After a wrong token (a missed proactive guess) nothing can be right.
    off_track = drafter.propose([*PROMPT, *REFERENCE[:2], 99], 4)
    assert all(draft != truth for draft, truth in zip(off_track.token_ids, REFERENCE[3:7], strict=True))
    with pytest.raises(ValueError, match="rejection sampling off"):
        drafter.propose([*PROMPT], 2, DraftSampling(temperature=1.0))
    with pytest.raises(ValueError, match="no reference answer"):
        drafter.propose([1, 2, 3], 2)

    hopeless = make_script(PROMPT, REFERENCE, CategoryProfile((0.0,), runner_up_hit=1.0), seed=0)
    chain = SimulatedDrafter(FINGERPRINT, [hopeless]).propose([*PROMPT, *REFERENCE[:5]], 3)
    assert chain.token_ids[0] != REFERENCE[5] and chain.runner_up_ids[0] == REFERENCE[5]  # what proactive guesses use
    assert 2 not in chain.token_ids  # never an end-of-sequence id
    # Confidence is the profile's, not the truth: here 0, so min_prob stops the chain at once.
    assert SimulatedDrafter(FINGERPRINT, [hopeless]).propose([*PROMPT, *REFERENCE[:5]], 3, min_prob=0.1).token_ids == ()


def test_a_cells_round_trip_reaches_its_edges(tiny_target_dir):
    """Each edge of a cell waits the cell's emulated RTT: the first token is at least one round trip away."""
    tokenizer = HFTokenizer(tiny_target_dir)
    config = BenchConfig(target=str(tiny_target_dir), draft=str(tiny_target_dir), modes=("ar",), max_tokens=4)
    job = Job(0, "p0", "code", tuple(tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}])))
    with tiny_server(str(tiny_target_dir), max_sessions=2) as server:

        async def ttft_ms(rtt_ms: float) -> float:
            _, [result] = await run_cell(
                Cell("ar", 1, rtt_ms), server.address, tokenizer.fingerprint, config, [[job]], []
            )
            return result.ttft_ms

        async def run():
            return await ttft_ms(0.0), await ttft_ms(400.0)

        direct, far = asyncio.run(run())
    assert far >= 400.0 > direct


def test_profile_round_trips_and_refuses_a_profile_without_a_fallback(tmp_path):
    profile = AcceptanceProfile("d", "t", {"all": CategoryProfile((0.8, 0.5), 0.3, 10)}, 0.002, 0.04, {"k": 1})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile.to_json()))
    assert AcceptanceProfile.load(path) == profile
    assert AcceptanceProfile.load(path).category("code") == profile.categories["all"]
    path.write_text(json.dumps({**profile.to_json(), "categories": {"code": {"acceptance": [0.5]}}}))
    with pytest.raises(ValueError, match="'all' entry"):
        AcceptanceProfile.load(path)


@pytest.mark.parametrize("random_weights", [False, True], ids=["tiny-target", "random-tiny-target"])
def test_simulated_edge_has_exactly_the_profile_acceptance(tiny_target_dir, random_weights):
    """Profile [1, 1, 0], 3 drafts a round: every round accepts exactly 2, at depths 1 and 2, never 3."""
    target = f"random:qwen2-tiny@{tiny_target_dir}" if random_weights else str(tiny_target_dir)
    tokenizer = HFTokenizer(tiny_target_dir)
    rounds = 8
    config = BenchConfig(
        target=target,
        draft=str(tiny_target_dir),
        modes=("specedge",),
        num_draft=3,
        follow_advice=False,
        max_tokens=1 + 3 * rounds,
    )
    jobs = [
        Job(i, f"p{i}", "code", tuple(tokenizer.apply_chat_template([{"role": "user", "content": text}])))
        for i, text in enumerate(["def add(a, b):", "The quick brown fox", "for i in range(10):"])
    ]
    with tiny_server(target, max_sessions=4) as server:

        async def run():
            _, references = await run_cell(
                Cell("ar", 3, 0.0), server.address, tokenizer.fingerprint, config, [[job] for job in jobs], []
            )
            scripts = [
                make_script(job.token_ids, r.token_ids, CategoryProfile((1.0, 1.0, 0.0)), seed=0)
                for job, r in zip(jobs, references)
            ]
            drafter = SimulatedDrafter(tokenizer.fingerprint, scripts)
            before = server.server.stats.snapshot()
            _, results = await run_cell(
                Cell("specedge", 1, 0.0), server.address, tokenizer.fingerprint, config, [jobs], [drafter]
            )
            return references, results, before, server.server.stats.snapshot()

        references, results, before, after = asyncio.run(run())
    full = [(ref, res) for ref, res in zip(references, results) if len(ref.token_ids) == config.max_tokens]
    assert full, "every reference hit an end-of-sequence early; pick other prompts"
    for reference, result in full:
        assert result.token_ids == reference.token_ids  # lossless, whatever the drafts
        assert result.stats["rounds"] == rounds
        assert result.stats["accepted_tokens"] == 2 * rounds and result.stats["draft_tokens"] == 3 * rounds
    if len(full) == len(results):
        drafts = after["num_drafts"] - before["num_drafts"]
        per_pos = {
            p: after["num_accepted_tokens_per_pos"].get(p, 0) - before["num_accepted_tokens_per_pos"].get(p, 0)
            for p in range(3)
        }
        assert per_pos == {0: drafts, 1: drafts, 2: 0}


def _result(
    deliveries,
    accepted=0,
    drafted=0,
    category="code",
    hits=0,
    rounds=0,
    tokens=None,
    edge=0,
    start_s=0.0,
    visible_draft_ms=0.0,
    prompt_tokens=0,
) -> RequestResult:
    count = sum(n for _, n in deliveries)
    return RequestResult(
        edge=edge,
        prompt_id="p",
        category=category,
        token_ids=tokens or [1] * count,
        finish="length",
        start_s=start_s,
        deliveries=deliveries,
        stats={
            "accepted_tokens": accepted,
            "draft_tokens": drafted,
            "visible_draft_ms": visible_draft_ms,
            "fallback": None,
        },
        proactive_rounds=rounds,
        proactive_hits=hits,
        identical=True,
        prompt_tokens=prompt_tokens,
    )


def _counters(**values) -> ServerCounters:
    keys = (
        "forward_s",
        "schedule_s",
        "postprocess_s",
        "steps",
        "rows",
        "batch_tokens",
        "generated",
        "drafts",
        "draft_tokens",
        "accepted_tokens",
        "holds",
        "hold_s",
        "hold_misses",
    )
    return ServerCounters({k: float(values.get(k, 0)) for k in keys}, values.get("per_pos", {}))


def test_itl_spreads_a_round_over_its_tokens_and_percentiles_interpolate():
    result = _result([(100.0, 1), (160.0, 3), (200.0, 1)])
    assert result.ttft_ms == 100.0
    assert result.itl_samples_ms() == [20.0, 20.0, 20.0, 40.0]
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 95) == 5 and percentile([], 50) is None


def _two_records() -> tuple[dict, dict]:
    pricing = Pricing("srv", "edge", (("srv", 3600.0), ("edge", 360.0)))  # $1 and $0.10 per second
    ar = summarize_cell(
        Cell("ar", 2, 14.0),
        [
            CellRun(
                10.0,
                [_result([(i * 100.0, 1) for i in range(50)], edge=e, prompt_tokens=98) for e in (0, 1)],
                _counters(forward_s=8, steps=100, rows=200),
                0.0,
                1.0,
            )
        ],
        pricing,
    )
    spec = summarize_cell(
        Cell("specedge_proactive", 2, 14.0),
        [
            CellRun(
                4.0,
                [
                    _result(
                        [(i * 160.0, 2) for i in range(25)],
                        accepted=60,
                        drafted=80,
                        hits=6,
                        rounds=8,
                        category="chat",
                        visible_draft_ms=150.0,
                    ),
                    _result(
                        [(i * 160.0, 2) for i in range(25)],
                        accepted=15,
                        drafted=20,
                        hits=2,
                        rounds=8,
                        edge=1,
                        visible_draft_ms=100.0,
                    ),
                ],
                _counters(
                    forward_s=3,
                    schedule_s=0.5,
                    postprocess_s=0.5,
                    steps=25,
                    rows=50,
                    drafts=25,
                    draft_tokens=100,
                    accepted_tokens=75,
                    holds=5,
                    hold_s=0.4,
                    hold_misses=1,
                    per_pos={0: 25, 1: 20, 2: 20, 3: 10},
                ),
                2.0,
                1.0,
            )
        ],
        pricing,
    )
    return ar, spec


def test_cell_summary_throughput_cost_and_ratios():
    ar, spec = _two_records()
    # Decode: tokens after each first, over the window both edges stream in: 2 x 49 in 4.9 s; 2 x 2 x 24 in 3.84 s.
    assert ar["throughput_tok_s"] == pytest.approx(20.0) and spec["throughput_tok_s"] == pytest.approx(25.0)
    assert ar["run_throughput_tok_s"] == 10.0 and ar["acceptance_rate"] is None and ar["proactive_hit_rate"] is None
    assert ar["prompt_tokens_per_token"] == 0.0  # both prompts were prefilled before the window opened
    assert ar["cost_per_mtok_usd"] == pytest.approx(10.0 / 100 * 1e6)
    assert spec["run_throughput_tok_s"] == 25.0 and spec["server_busy_fraction"] == 1.0
    assert spec["acceptance_rate"] == 0.75 and spec["mean_accepted_length"] == 4.0
    assert spec["acceptance_per_position"] == [1.0, 0.8, 0.8, 0.4]
    assert spec["acceptance_per_category"] == {"chat": 0.75, "code": 0.75}
    assert spec["proactive_hit_rate"] == 0.5
    assert spec["visible_draft_ms_per_round"] == 10.0  # what the guesses did not hide: 250 ms over 25 rounds
    assert spec["cost_per_mtok_usd"] == pytest.approx((4.0 + 0.2) / 100 * 1e6)  # edges pay for drafting time only
    # Gathering: 5 of 25 steps held, 80 ms each on average, one awaited round missed; AR's steps never held.
    assert spec["held_steps_fraction"] == 0.2 and spec["hold_ms_per_held_step"] == pytest.approx(80.0)
    assert spec["hold_misses"] == 1 and ar["held_steps_fraction"] == 0 and ar["hold_ms_per_held_step"] is None
    records = [ar, spec]
    add_ratios(records)
    assert spec["vs_ar"]["throughput_x"] == pytest.approx(1.25) and spec["vs_ar"]["run_throughput_x"] == 2.5
    assert spec["vs_ar"]["cost_efficiency_x"] == pytest.approx(10.0 / 4.2)


def test_decode_throughput_counts_only_the_window_every_edge_streams_in():
    # Edge 0 asks twice from 0 s; edge 1 starts 1 s late (staggered). Absolute delivery times in comments.
    results = [
        _result([(250.0, 1), (500.0, 1), (750.0, 1)]),  # 0.25 (first), 0.5, 0.75
        _result([(250.0, 1), (500.0, 2), (750.0, 1)], start_s=0.75),  # 1.0 (first), 1.25, 1.5
        _result([(250.0, 1), (500.0, 1), (750.0, 1)], edge=1, start_s=1.0),  # 1.25 (first), 1.5, 1.75
    ]
    # Every edge streams from 1.25 s (edge 1's first token) until 1.5 s (edge 0's last): 2 tokens in 0.25 s.
    tokens, seconds, steady = steady_window(results)
    assert (tokens, steady) == (2, True) and seconds == pytest.approx(0.25)
    # Edge 0 is done before edge 1 streams: no steady window; from the first first token to the last token.
    apart = [_result([(250.0, 1), (500.0, 2)]), _result([(250.0, 1), (500.0, 1)], edge=1, start_s=0.5)]
    tokens, seconds, steady = steady_window(apart)
    assert (tokens, steady) == (3, False) and seconds == pytest.approx(0.75)


def test_the_prompts_prefilled_inside_the_window_are_counted_per_token_decoded_in_it():
    # Edge 0 as above; edge 1 answers from 1.25 s to 1.4 s, then asks again: the window is 1.25-1.5 s. Edge 0's
    # second prompt (first token at 1.0 s) and edge 1's first (1.25 s, the window's start) were prefilled before
    # it; edge 1's second (first token at 1.45 s) inside it.
    results = [
        _result([(250.0, 1), (500.0, 1), (750.0, 1)], prompt_tokens=100),
        _result([(250.0, 1), (500.0, 2), (750.0, 1)], start_s=0.75, prompt_tokens=40),
        _result([(250.0, 1), (400.0, 1)], edge=1, start_s=1.0, prompt_tokens=30),
        _result([(50.0, 1), (300.0, 1)], edge=1, start_s=1.4, prompt_tokens=60),
    ]
    assert window_prompt_tokens(results) == 60
    pricing = Pricing("srv", "edge", (("srv", 3600.0), ("edge", 360.0)))
    record = summarize_cell(Cell("ar", 3, 14.0), [CellRun(2.0, results, _counters(steps=10), 0.0, 1.0)], pricing)
    assert record["decode_tokens"] == 2 and record["prompt_tokens_per_token"] == 30.0


def _cohorts_crossing(curve: CostCurve, tokens: float, extra_s: float) -> float:
    """The cycle where the server's bound c * T(tokens / c) meets an edge's T(tokens / c) + extra_s, solved by
    hand for steps inside the curve's 8-40 token segment, T(t) = alpha + beta * t: (c - 1) * T(tokens / c) =
    extra_s, that is alpha * c^2 + (beta * tokens - alpha - extra_s) * c - beta * tokens = 0."""
    beta = (curve.seconds(40) - curve.seconds(8)) / 32
    alpha = curve.seconds(8) - 8 * beta
    quad_b = beta * tokens - alpha - extra_s
    c = (-quad_b + math.sqrt(quad_b**2 + 4 * alpha * beta * tokens)) / (2 * alpha)
    assert 8 <= tokens / c <= 40  # the segment the closed form assumes
    return c * curve.seconds(tokens / c)


def test_ideal_ratio_from_the_measured_cost_curve():
    curve = CostCurve([(40, 0.45), (5, 0.19), (8, 0.20)])
    assert curve.seconds(1) == 0.19  # flat below the first point
    assert curve.seconds(24) == pytest.approx(0.325)  # linear between points
    assert curve.seconds(80) == pytest.approx(0.45 + 0.25 / 32 * 40)  # the last segment's slope beyond
    # N = 8 (README's example): one merged step of 40 tokens would take 0.45 s and then idle 0.074 s while the
    # edges draft; eight steps of 5 would take 1.52 s. The best split runs 1.18 steps' worth of 33.8 tokens.
    cycle = ideal_cycle(curve, 8, 4, 0.014, 0.06)
    assert cycle == pytest.approx(_cohorts_crossing(curve, 40, 0.074), rel=1e-4) == pytest.approx(0.4754, abs=1e-4)
    assert 0.45 < cycle < 0.45 + 0.074
    assert ideal_ratio(curve, 8, 3.2, 4, 0.014, 0.06) == pytest.approx(3.2 * 0.20 / cycle) == pytest.approx(1.346, 1e-3)
    # N = 1: the edge bounds it, its draft and round trip on top of a lone verify; proactive hides the draft.
    assert ideal_ratio(curve, 1, 3.2, 4, 0.014, 0.06) == pytest.approx(3.2 * 0.19 / (0.06 + 0.014 + 0.19))
    assert ideal_ratio(curve, 1, 3.2, 4, 0.014, 0.0) == pytest.approx(3.2 * 0.19 / (0.014 + 0.19))
    ar, spec = _two_records()
    records = [ar, spec]
    add_ratios(records)
    add_ideal(records, curve)
    # spec: L = 4, k = 4, N = 2, RTT 14 ms, proactive drafting whose misses left 10 ms a round visible (d): the
    # cycle where 10 tokens' steps cross. As if every guess came true (d = 0), the ideal would be higher.
    expected = 4 * 0.19 / _cohorts_crossing(curve, 10, 0.014 + 0.010)
    assert expected < 4 * 0.19 / _cohorts_crossing(curve, 10, 0.014)
    assert spec["vs_ar"]["ideal_throughput_x"] == pytest.approx(expected, rel=1e-4)
    assert spec["vs_ar"]["of_ideal"] == pytest.approx(1.25 / expected, rel=1e-4)
    assert "ideal_throughput_x" not in ar["vs_ar"]


def test_the_ideal_counts_the_prompts_both_modes_prefill():
    curve = CostCurve([(40, 0.45), (5, 0.19), (8, 0.20)])
    b = 0.25 / 32  # the slope over the two largest steps: a prefilled token's marginal cost
    assert curve.marginal_s() == pytest.approx(b) and CostCurve([(4, 0.2)]).marginal_s() == 0.0
    # N = 1: the edge waits for its own prompt too; AR's token carries the same prefill, p = 2 b.
    p = 2 * b
    assert ideal_ratio(curve, 1, 3.2, 4, 0.014, 0.06, 2.0) == pytest.approx(
        (0.19 + p) * 3.2 / (0.19 + 0.06 + 0.014 + 3.2 * p)
    )
    assert ideal_ratio(curve, 1, 3.2, 4, 0.014, 0.06, 2.0) < ideal_ratio(curve, 1, 3.2, 4, 0.014, 0.06)
    # N = 8: the server runs every edge's prefill (8 L p a cycle), an edge waits for its own (L p), so the bounds
    # cross where (c - 1) T(40 / c) = d + RTT - 7 L p.
    p = 0.2 * b
    cycle = _cohorts_crossing(curve, 40, 0.074 - 7 * 3.2 * p) + 8 * 3.2 * p
    assert ideal_cycle(curve, 8, 4, 0.014, 0.06, 3.2 * p) == pytest.approx(cycle, rel=1e-4)
    assert ideal_ratio(curve, 8, 3.2, 4, 0.014, 0.06, 0.2) == pytest.approx((0.20 / 8 + p) * 3.2 * 8 / cycle, rel=1e-4)
    # Prefill work the server cannot hide behind the edges: one merged step, the server's bound.
    p = 1.0 * b
    cycle = curve.seconds(10) + 2 * 4 * p
    assert ideal_ratio(curve, 2, 4, 4, 0.014, 0.010, 1.0) == pytest.approx((0.19 / 2 + p) * 4 * 2 / cycle, rel=1e-4)


def test_the_schedule_is_the_best_whole_cohort_round_robin():
    curve = CostCurve([(1, 0.21), (101, 1.21)])  # T(t) = 0.2 + 0.01 t: a = 0.2 s, b = 0.01 s
    # N = 8, L = 3, rounds of 4 tokens. Back 0.15 s after its step (< a): one merged step of 32 tokens, then the
    # server idles while the edges draft (0.52 + 0.15); two cohorts would pay a twice (2 x 0.36).
    assert schedule_rate(curve, 8, 3, 4, 0.15) == pytest.approx(24 / 0.67)
    # Back 0.25 s after (> a): two cohorts alternate, each back before the other's step ends (0.36 > 0.25).
    assert schedule_rate(curve, 8, 3, 4, 0.25) == pytest.approx(24 / 0.72)
    # The bound takes the fractional c where the two cross (1.63 steps of 19.6 tokens a cycle), which no schedule
    # of whole cohorts reaches.
    assert 24 / ideal_cycle(curve, 8, 3, 0.25, 0.0) > schedule_rate(curve, 8, 3, 4, 0.25)
    # Prefill: the server runs every edge's (8 x 0.02 s a cycle); a cohort's rows wait for the 4 x 0.02 s its step
    # carries. Merged: 0.52 + 0.16 + 0.25 = 0.93; two cohorts: 0.72 + 0.16 = 0.88.
    assert schedule_rate(curve, 8, 3, 4, 0.25, 0.02) == pytest.approx(24 / 0.88)
    # AR at N = 1: a token per step, its prefill and its round trip: 1 / (0.21 + 0.005 + 0.014).
    assert schedule_rate(curve, 1, 1, 1, 0.014, 0.005) == pytest.approx(1 / 0.229)
    ar, spec = _two_records()
    server_spec = dict(spec, mode="server_spec")
    records = [ar, spec, server_spec]
    add_schedule(records, curve)
    q_ar, q_spec, b = ar["prompt_tokens_per_token"], spec["prompt_tokens_per_token"], curve.marginal_s()
    assert ar["schedule_tok_s"] == pytest.approx(schedule_rate(curve, 2, 1, 1, 0.014, q_ar * b))
    assert ar["of_schedule"] == pytest.approx(ar["throughput_tok_s"] / ar["schedule_tok_s"])
    L, k, d = spec["mean_accepted_length"], spec["draft_tokens_per_round"], spec["visible_draft_ms_per_round"] / 1e3
    assert spec["schedule_tok_s"] == pytest.approx(schedule_rate(curve, 2, L, 1 + k, d + 0.014, L * q_spec * b))
    assert server_spec["schedule_tok_s"] is None  # the server drafts itself: no edge's turnaround to model
    add_schedule(records, None)
    assert ar["schedule_tok_s"] is None and ar["of_schedule"] is None


def test_report_writes_json_markdown_and_png(tmp_path):
    records = list(_two_records())
    add_ratios(records)
    meta = {
        "started_utc": "2026-11-21T00:00:00+00:00",
        "prompts": [{"id": "p"}],
        "profile": None,
        "config": {
            "target": "t",
            "draft": "d",
            "edge_kind": "real",
            "max_tokens": 8,
            "temperature": 0.0,
            "num_draft": 4,
            "follow_advice": True,
            "jitter_ms": 0.0,
            "pricing": {"server_hw": "srv", "edge_hw": "edge"},
        },
        "machine": {
            "platform": "x",
            "cpus": 2,
            "torch": "2",
            "load_average_before": [1, 1, 1],
            "load_average_after": [1, 1, 1],
        },
    }
    paths = write_report({"meta": meta, "records": records, "raw": []}, tmp_path)
    saved = json.loads(paths[0].read_text())
    assert all(field in record for record in saved["records"] for field in REQUIRED_FIELDS)
    summary = paths[1].read_text()
    ratios_at = summary.index("## Against server-only decoding")
    assert ratios_at < summary.index("## Every cell")  # the ratios head the report
    assert "| specedge_proactive | 2 | 14 | 1.25x |" in summary
    assert "| 20%, 80 ms, 1 missed |" in summary and "| 0% |" in summary  # held steps, in the every-cell table
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_set_covers_every_category_and_assignment_is_round_robin():
    prompts = load_prompts()
    assert {p.category for p in prompts} == {"code", "chat", "summarization", "translation", "math", "json"}
    assert any("Korean" in p.messages[-1]["content"] for p in prompts)
    assert any("English" in p.messages[-1]["content"] for p in prompts)
    assert len({p.category for p in interleave(prompts)[:6]}) == 6
    assert assignment(6, 4, 2) == [[0, 4], [1, 5], [2, 0], [3, 1]]
    with pytest.raises(ValueError, match="no prompts in categories"):
        load_prompts(categories=["poetry"])


def test_bad_options_end_in_one_line(capsys, tmp_path):
    assert cli.main(["--price", "cpu=cheap", "--out", str(tmp_path)]) == 2
    assert cli.main(["--server-hw", "tpu", "--out", str(tmp_path)]) == 2
    assert cli.main(["--edge-kind", "simulated", "--tree", "4,2,8", "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("specedge-bench: ") for line in lines)
    assert "no price for 'tpu'" in lines[1]


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "out"
    assert cli.main([*args, "--rtt-ms", "5", "--max-tokens", "8", "--out", str(out), "--no-progress"]) == 0
    assert (out / "summary.md").exists() and (out / "plots.png").exists()
    return json.loads((out / "results.json").read_text())


def test_bench_runs_every_mode_end_to_end_with_simulated_edges(tiny_target_dir, tiny_draft_dir, tmp_path):
    profile = tmp_path / "profile.json"
    categories = {"all": CategoryProfile((0.9, 0.7, 0.5), 0.5, 1)}
    profile.write_text(json.dumps(AcceptanceProfile("d", "t", categories, 0.001, 0.002).to_json()))
    results = _bench(
        tmp_path,
        "--target",
        str(tiny_target_dir),
        "--draft",
        str(tiny_draft_dir),
        "--profile",
        str(profile),
        "--num-edges",
        "1",
        "2",
        "--max-prompts",
        "3",
    )
    records = {(r["mode"], r["num_edges"]): r for r in results["records"]}
    assert set(records) == {(mode, n) for mode in MODES for n in (1, 2)}
    for (mode, _num_edges), record in records.items():
        assert all(field in record for field in REQUIRED_FIELDS)
        assert record["tokens"] > 0 and record["throughput_tok_s"] > 0
        assert record["identical_to_reference"] == f"{record['requests']}/{record['requests']}"  # lossless everywhere
        assert (record["acceptance_rate"] is None) == (mode == "ar")
        assert (record["proactive_hit_rate"] is not None) == (mode == "specedge_proactive")
        assert (record["vs_ar"]["throughput_x"] == 1.0) if mode == "ar" else record["vs_ar"]["throughput_x"] > 0
        assert record["edge_busy_s"] > 0 if mode.startswith("specedge") else record["edge_busy_s"] == 0
        assert record["run_throughput_tok_s"] > 0 and record["decode_window_s"] > 0
        if mode.startswith("specedge"):  # the best ratio this machine allows, from the server's measured curve
            assert record["vs_ar"]["ideal_throughput_x"] > 0 and record["vs_ar"]["of_ideal"] > 0
        assert record["prompt_tokens_per_token"] > 0  # every answer's prompt, counted for the ideal
        if mode != "server_spec":  # AR's and the edges' reachable rates, from the same curve
            assert record["schedule_tok_s"] > 0 and record["of_schedule"] > 0
        if mode == "specedge":  # every draft is waited for: the rounds' visible drafting is all of the edges'
            assert record["visible_draft_ms_per_round"] * record["drafted_rounds"] >= 0.99e3 * record["edge_busy_s"]
        # Holds, scraped from the server: a share of the steps, never more than all of them.
        assert 0 <= record["held_steps_fraction"] <= 1 and record["hold_misses"] >= 0
    # The server's cost curve, scraped from its /metrics: calibration's sizes and the run's steps, by tokens.
    curve = results["meta"]["cost_curve"]
    assert len(curve) >= 3 and all(seconds > 0 for _, seconds in curve) and curve == sorted(curve)
    assert len(results["references"]) == 3 and results["meta"]["profile"]["draft_s_per_token"] == 0.002


def test_bench_runs_real_draft_models_as_edges(tiny_target_dir, tiny_draft_dir, tmp_path):
    results = _bench(
        tmp_path,
        "--target",
        str(tiny_target_dir),
        "--draft",
        str(tiny_draft_dir),
        "--edge-kind",
        "real",
        "--modes",
        "specedge",
        "specedge_proactive",
        "--num-edges",
        "2",
        "--max-prompts",
        "2",
        "--warmup",
        "0",
    )
    for record in results["records"]:
        assert record["requests"] == 2 * 4  # a stream of 4 requests per edge, by default
        assert record["identical_to_reference"] == "8/8" and record["acceptance_rate"] > 0
        assert record["edge_busy_s"] > 0 and record["vs_ar"] is None  # no ar cell to compare with
    assert results["meta"]["profile"] is None


def test_repeats_run_every_cell_in_turn_and_each_pairs_with_ars_beside_it(tiny_target_dir, tiny_draft_dir, tmp_path):
    profile = tmp_path / "profile.json"
    categories = {"all": CategoryProfile((0.9, 0.7, 0.5), 0.5, 1)}
    profile.write_text(json.dumps(AcceptanceProfile("d", "t", categories, 0.001, 0.002).to_json()))
    args = ("--modes", "ar", "specedge", "--num-edges", "1", "--max-prompts", "2", "--repeats", "2", "--warmup", "0")
    results = _bench(
        tmp_path, "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--profile", str(profile), *args
    )
    # AR, SpecEdge, AR, SpecEdge: each repeat of every cell before the next repeat of any, so drift hits both sides.
    starts = {cell["mode"]: [run["started_s"] for run in cell["runs"]] for cell in results["raw"]}
    assert starts["ar"][0] < starts["specedge"][0] < starts["ar"][1] < starts["specedge"][1]
    ar, spec = (next(r for r in results["records"] if r["mode"] == mode) for mode in ("ar", "specedge"))
    per_repeat = spec["vs_ar"]["throughput_x_per_repeat"]
    assert len(per_repeat) == 2 and per_repeat == [
        pytest.approx(a / b) for a, b in zip(spec["throughput_per_repeat_tok_s"], ar["throughput_per_repeat_tok_s"])
    ]
    low, high = min(per_repeat), max(per_repeat)
    assert f"| specedge | 1 | 5 | {spec['vs_ar']['throughput_x']:.2f}x ({low:.2f}-{high:.2f}) |" in (
        (tmp_path / "out" / "summary.md").read_text()
    )


def test_random_target_presets_are_named_when_unknown(tiny_target_dir, capsys, tmp_path):
    status = cli.main(
        [
            "--target",
            f"random:qwen9-huge@{tiny_target_dir}",
            "--draft",
            str(tiny_target_dir),
            "--modes",
            "ar",
            "--num-edges",
            "1",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert "unknown random model 'qwen9-huge'; presets: qwen2-0.5b" in err


def test_more_server_options_reach_the_servers_command_line():
    from specedge.bench.run import server_args

    config = cli.bench_config(cli.parse_args(["--modes", "ar", "--server-args=--no-fair-shares --step-tokens 32"]))
    assert server_args(config)[-3:] == ["--no-fair-shares", "--step-tokens", "32"]


def test_quick_preset_keeps_at_least_n1_and_n4_and_every_mode():
    from specedge.bench.config import quick

    config = quick(BenchConfig(num_edges=(8,), modes=("ar",), max_tokens=500))
    assert config.num_edges == (1, 4) and config.modes == MODES and config.max_tokens <= 24 and config.rtt_ms == (14.0,)
    assert config.requests_per_edge == 2  # the default stream of 4 is cut to 2


def test_quick_preset_can_be_made_smaller_never_larger():
    from specedge.bench.config import quick

    assert quick(BenchConfig(requests_per_edge=1)).requests_per_edge == 1
    assert quick(BenchConfig(requests_per_edge=None)).requests_per_edge == 2  # 0 on the command line: prompts / N
    assert quick(BenchConfig(requests_per_edge=9, max_prompts=9)).requests_per_edge == 2
    assert quick(BenchConfig(max_prompts=2, max_tokens=16)).max_prompts == 2


def test_tensor_parallel_bench_compares_tp1_and_tp2_with_the_same_answers(tiny_target_dir, tmp_path, capsys):
    from specedge.bench import tensor_parallel

    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(AcceptanceProfile("d", "t", {"all": CategoryProfile((0.8, 0.6), 0.5, 1)}, 0.001, 0.001).to_json())
    )
    status = tensor_parallel.main(
        [
            "--tp",
            "1",
            "2",
            "--target",
            str(tiny_target_dir),
            "--draft",
            str(tiny_target_dir),
            "--profile",
            str(profile),
            "--device",
            "cpu",
            "--num-edges",
            "2",
            "--max-prompts",
            "2",
            "--max-tokens",
            "8",
            "--warmup",
            "0",
            "--out",
            str(tmp_path / "tp"),
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    table = captured.out
    assert status == 0, table + captured.err  # stderr: guarded's one line, a failed server's last log lines
    assert "every --tp gave the answers --tp 1 gave: True" in table
    rows = [line for line in table.splitlines() if line.startswith(("| ar |", "| specedge |"))]
    assert len(rows) == 4 and {row.split("|")[3].strip() for row in rows} == {"1", "2"}
    tp2 = json.loads((tmp_path / "tp" / "tp2" / "results.json").read_text())
    assert tp2["meta"]["config"]["tp"] == 2 and all(r["tokens"] > 0 for r in tp2["records"])


# A parent that starts `sleep` as the harness starts a server, prints its pid, then dies by SIGKILL.
_PARENT = """
import os, signal, subprocess, sys
from specedge.bench.lifeline import dying_with_parent
quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # so that run() sees the parent's pipes close
child = subprocess.Popen(dying_with_parent(["sleep", "300"]), **quiet)
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_started_server_dies_with_its_parent_even_when_the_parent_is_killed():
    """A crashed pytest or benchmark once left its 1.5B test server running (7.8 GB) for 40 minutes."""
    parent = subprocess.run([sys.executable, "-c", _PARENT], capture_output=True, text=True, timeout=60)
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    child = int(parent.stdout)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    outlived = _alive(child)
    if outlived:
        os.kill(child, signal.SIGKILL)
    assert not outlived, f"sleep {child} outlived its killed parent"


def _alive(pid: int) -> bool:
    """Running (not gone, and not a zombie waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_off_the_main_thread_a_server_gets_no_parent_death_signal_but_keeps_its_cpus():
    """Linux sends it when the starting thread ends: a server started from a worker thread must outlive it."""
    got = []
    worker = threading.Thread(
        target=lambda: got.extend([dying_with_parent(["x"]), dying_with_parent(["x"], cpus={1, 0})])
    )
    worker.start()
    worker.join()
    assert got[0] == ["x"]
    assert "--parent" not in got[1] and got[1][-4:] == ["--cpus", "0,1", "--", "x"]
    assert "--parent" in dying_with_parent(["x"])  # on the main thread: set


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_pinned_child_runs_on_its_cpus_and_a_missing_command_is_named():
    allowed = subprocess.run(
        dying_with_parent(["grep", "Cpus_allowed_list", "/proc/self/status"], cpus={0}),
        capture_output=True,
        text=True,
        check=True,
    )
    assert allowed.stdout.split() == ["Cpus_allowed_list:", "0"]
    launcher = dying_with_parent(["true"])[:-2]  # everything before "-- true"
    missing = subprocess.run([*launcher, "--"], capture_output=True, text=True)
    assert missing.returncode == 1 and "usage: lifeline.py" in missing.stderr
    nowhere = subprocess.run(dying_with_parent(["/nonexistent/specedge-server"]), capture_output=True, text=True)
    assert nowhere.returncode == 127
    assert nowhere.stderr == "lifeline.py: cannot run /nonexistent/specedge-server: No such file or directory\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_children_start_while_this_process_holds_a_grpc_channel():
    """grpc/grpc#43055: a child forked (Popen's preexec_fn) while gRPC lives here restarts gRPC's poller, and
    close_fds closes the poller's epoll descriptor before exec: the child aborts. A CI run lost its benchmark
    server so. A `true` forked so died in 0.7-3.3% of starts on a 2-core Zen 4; a PATH of 20,000 missing
    directories before the real one holds the child between the close and the exec, and then about 40% died."""
    assert not os.path.exists("/n"), "the PATH below must miss"
    env = {**os.environ, "PATH": ":".join(["/n"] * 20_000 + [os.environ["PATH"]])}
    server = grpc.server(futures.ThreadPoolExecutor(1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())  # then idle, as a test's
            codes = [subprocess.run(dying_with_parent(["true"]), env=env).returncode for _ in range(40)]
    finally:
        server.stop(0)
    assert codes == [0] * 40, f"{sum(code != 0 for code in codes)} of 40 children died: {set(codes)}"
