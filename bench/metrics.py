"""From raw measurements to the reported numbers, with every definition in one place.

- throughput_tok_s: decode throughput, as the paper reports it: tokens delivered
  after each request's first token, per second of the steady window, from the
  moment every edge has its first answer streaming (the ramp-up excluded) to the
  moment the first edge has sent its last request's last token (the drain
  excluded). Prefills of later requests fall inside the window, as in a steady
  stream; their first tokens do not count. Without such a window (one request
  per edge), from the first first token to the last token;
- run_throughput_tok_s: every generated token / the cell's wall time (first
  request sent to last token received), the whole-run figure;
- itl_p50_ms, itl_p95_ms: over every token after an answer's first, the gap
  before its delivery divided by the tokens delivered with it (modes.py);
- ttft_p50_ms: request sent -> first token received;
- acceptance_rate: accepted / drafted tokens, from the server's counters
  (so server-side drafts count too); None for ar;
- mean_accepted_length: 1 + accepted tokens / drafted rounds (vLLM's);
- proactive_hit_rate: rounds whose next draft was ready (a guess came true) /
  rounds drafted ahead for; None where proactive drafting is off;
- prompt_tokens_per_token: the prompt tokens prefilled inside the steady window
  (the requests whose first token arrived in it) per token counted in
  throughput_tok_s: the prefill each decoded token carries;
- visible_draft_ms_per_round: the drafting rounds waited for (the edges' visible_draft_ms)
  per drafted round: all of it without proactive drafting, what the guesses did not hide with it;
- server_busy_fraction: engine step time (forwards, server drafting, planning,
  verification) / wall time, from the server's /metrics;
- held_steps_fraction, hold_ms_per_held_step, hold_misses: how often the server held
  a step for rounds due back from edges (scheduler/gather.py), for how long, and how
  many times an identity it waited for sent nothing in time (without --auth-tokens an
  identity is a connection: one per edge here);
- cost: the server billed for the wall time, each edge for its drafting time;
  cost_per_mtok_usd = cost / tokens * 1e6.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from .config import SERVER_DRIVEN, Pricing
from .ideal import CostCurve, ideal_ratio, schedule_rate
from .modes import Cell, CellRun, RequestResult

REQUIRED_FIELDS = (
    "mode",
    "num_edges",
    "throughput_tok_s",
    "itl_p50_ms",
    "itl_p95_ms",
    "ttft_p50_ms",
    "acceptance_rate",
    "proactive_hit_rate",
    "cost_per_mtok_usd",
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def summarize_cell(cell: Cell, runs: Sequence[CellRun], pricing: Pricing) -> dict:
    """One record for (mode, N, RTT), pooling its repeats."""
    wall_s = sum(run.wall_s for run in runs)
    results = [r for run in runs for r in run.results]
    edge_busy_s = sum(run.edge_busy_s for run in runs)
    counters = {key: sum(run.counters.values[key] for run in runs) for key in runs[0].counters.values}
    per_pos: dict[int, float] = {}
    for run in runs:
        for position, count in run.counters.accepted_per_pos.items():
            per_pos[position] = per_pos.get(position, 0.0) + count
    tokens = sum(len(r.token_ids) for r in results)
    windows = [steady_window(run.results) for run in runs]
    decode_tokens = sum(w[0] for w in windows)
    decode_s = sum(w[1] for w in windows)
    itl = [sample for r in results for sample in r.itl_samples_ms()]
    ttft = [ttft_ms for r in results if (ttft_ms := r.ttft_ms) is not None]  # None: nothing delivered
    busy_s = sum(counters[k] for k in ("forward_s", "schedule_s", "postprocess_s"))
    drafted = counters["draft_tokens"] > 0
    proactive_rounds = sum(r.proactive_rounds for r in results)
    cost_usd = wall_s * pricing.usd_per_s(pricing.server_hw) + edge_busy_s * pricing.usd_per_s(pricing.edge_hw)
    checked = [r.identical for r in results if r.identical is not None]
    return {
        "mode": cell.mode,
        "num_edges": cell.num_edges,
        "rtt_ms": cell.rtt_ms,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall_s,
        "throughput_tok_s": _ratio(decode_tokens, decode_s),
        "throughput_per_repeat_tok_s": [_ratio(tokens, seconds) for tokens, seconds, _ in windows],
        "run_throughput_tok_s": _ratio(tokens, wall_s),
        "decode_window_s": decode_s,
        "decode_tokens": decode_tokens,
        # The prompts prefilled inside the window, per token decoded in it (the ideal counts their cost).
        "prompt_tokens_per_token": _ratio(sum(window_prompt_tokens(run.results) for run in runs), decode_tokens),
        "steady": all(w[2] for w in windows),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p95_ms": percentile(itl, 95),
        "itl_mean_ms": statistics.fmean(itl) if itl else None,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p95_ms": percentile(ttft, 95),
        "acceptance_rate": _ratio(counters["accepted_tokens"], counters["draft_tokens"]) if drafted else None,
        "mean_accepted_length": 1 + counters["accepted_tokens"] / counters["drafts"] if drafted else None,
        "acceptance_per_position": (
            [per_pos.get(p, 0.0) / counters["drafts"] for p in range(max(per_pos) + 1)] if drafted and per_pos else []
        ),
        "acceptance_per_category": per_category(results),
        "proactive_hit_rate": _ratio(sum(r.proactive_hits for r in results), proactive_rounds)
        if proactive_rounds
        else None,
        "server_busy_s": busy_s,
        "server_busy_fraction": _ratio(busy_s, wall_s),
        "tokens_per_server_busy_s": _ratio(tokens, busy_s),
        # Where the server's time goes: a step's cost and what it commits.
        "server_ms_per_step": _ratio(busy_s * 1e3, counters["steps"]),
        "tokens_per_step": _ratio(tokens, counters["steps"]),
        "draft_tokens_per_round": _ratio(counters["draft_tokens"], counters["drafts"]) if drafted else None,
        "drafted_rounds": counters["drafts"],
        # The drafting a round waited for, as the edges timed it (all of it, less what proactive drafting hid).
        "visible_draft_ms_per_round": (
            _ratio(sum(r.stats["visible_draft_ms"] for r in results), counters["drafts"]) if drafted else None
        ),
        "mean_batch_size": _ratio(counters["rows"], counters["steps"]),
        "mean_batch_tokens": _ratio(counters["batch_tokens"], counters["steps"]),
        "server_steps": counters["steps"],
        "held_steps_fraction": _ratio(counters["holds"], counters["steps"]),
        "hold_ms_per_held_step": _ratio(counters["hold_s"] * 1e3, counters["holds"]),
        "hold_misses": counters["hold_misses"],
        "edge_busy_s": edge_busy_s,
        "cost_usd": cost_usd,
        "cost_per_mtok_usd": _ratio(cost_usd * 1e6, tokens),
        "identical_to_reference": f"{sum(checked)}/{len(checked)}" if checked else None,
        "fallbacks": sum(1 for r in results if r.stats.get("fallback")),
        "load_average_1m": max(run.load_average for run in runs),  # the machine's, at the cell's end
    }


def steady_window(results: Sequence[RequestResult]) -> tuple[int, float, bool]:
    """(tokens after each request's first, seconds, whether a steady window existed) for one run."""
    bounds = _window_bounds(results)
    if bounds is None:
        return 0, 0.0, False
    full, drain, steady = bounds
    deliveries = [(r.start_s + at / 1e3, count, i == 0) for r in results for i, (at, count) in enumerate(r.deliveries)]
    tokens = sum(count for at, count, first in deliveries if not first and full < at <= drain)
    return tokens, max(0.0, drain - full), steady


def window_prompt_tokens(results: Sequence[RequestResult]) -> int:
    """The prompt tokens prefilled inside one run's steady window: those of the requests whose first token
    arrived in it (the first requests' prompts, in the ramp-up, are outside)."""
    bounds = _window_bounds(results)
    if bounds is None:
        return 0
    full, drain, _ = bounds
    return sum(
        r.prompt_tokens for r in results if r.deliveries and full < r.start_s + r.deliveries[0][0] / 1e3 <= drain
    )


def _window_bounds(results: Sequence[RequestResult]) -> tuple[float, float, bool] | None:
    """(start, end, steady) of steady_window's window in seconds since the cell started; None: nothing delivered."""
    by_edge: dict[int, list[RequestResult]] = {}
    for r in results:
        if r.deliveries:
            by_edge.setdefault(r.edge, []).append(r)
    if not by_edge:
        return None
    starts = [min(rs, key=lambda r: r.start_s) for rs in by_edge.values()]
    ends = [max(rs, key=lambda r: r.start_s) for rs in by_edge.values()]
    full = max(r.start_s + r.deliveries[0][0] / 1e3 for r in starts)  # every edge is streaming
    drain = min(r.start_s + r.deliveries[-1][0] / 1e3 for r in ends)  # the first edge has finished
    if drain > full:
        return full, drain, True
    delivered = [r for r in results if r.deliveries]
    first = min(r.start_s + r.deliveries[0][0] / 1e3 for r in delivered)
    last = max(r.start_s + r.deliveries[-1][0] / 1e3 for r in delivered)
    return first, last, False


def per_category(results: Sequence[RequestResult]) -> dict[str, float]:
    """Edge-side acceptance per prompt category (edge-drafted modes only)."""
    totals: dict[str, list[int]] = {}
    for r in results:
        if r.stats.get("draft_tokens"):
            entry = totals.setdefault(r.category, [0, 0])
            entry[0] += r.stats["accepted_tokens"]
            entry[1] += r.stats["draft_tokens"]
    return {category: accepted / drafted for category, (accepted, drafted) in sorted(totals.items()) if drafted}


def add_ratios(records: list[dict]) -> None:
    """Each record's throughput, ITL and cost efficiency relative to ar at the same N and RTT (in place)."""
    baseline = {(r["num_edges"], r["rtt_ms"]): r for r in records if r["mode"] == "ar"}
    for record in records:
        ar = baseline.get((record["num_edges"], record["rtt_ms"]))
        if ar is None:
            record["vs_ar"] = None
            continue
        record["vs_ar"] = {
            "throughput_x": _safe_div(record["throughput_tok_s"], ar["throughput_tok_s"]),
            # Repeat i against AR's repeat i, the two run next to each other (bench/run.py): how far one run moves it.
            "throughput_x_per_repeat": [
                _safe_div(mine, its)
                for mine, its in zip(record["throughput_per_repeat_tok_s"], ar["throughput_per_repeat_tok_s"])
            ],
            "run_throughput_x": _safe_div(record["run_throughput_tok_s"], ar["run_throughput_tok_s"]),
            "itl_p50_x": _safe_div(record["itl_p50_ms"], ar["itl_p50_ms"]),
            "itl_p95_x": _safe_div(record["itl_p95_ms"], ar["itl_p95_ms"]),
            # tokens per dollar, relative: AR's cost per token over this mode's
            "cost_efficiency_x": _safe_div(ar["cost_per_mtok_usd"], record["cost_per_mtok_usd"]),
        }


def add_ideal(records: list[dict], curve: CostCurve | None) -> None:
    """Each edge-drafted record's best ratio this machine allows (bench/ideal.py), beside its measured one.

    The draft time d of a round is the drafting it waited for, as the edges measured it, per drafted round:
    all of an edge's drafting without proactive drafting; with it, only what the guesses did not hide (a
    round whose guess came true waits for none). Taking d = 0 there, as if every guess came true, would
    count the edges' misses against the server. Prompts are prefilled in both modes, at the curve's marginal
    cost per token: prompt_tokens_per_token of them for every token decoded.
    """
    for record in records:
        x = record.get("vs_ar")
        if x is None or record["mode"] in SERVER_DRIVEN:
            continue
        x["ideal_throughput_x"] = x["of_ideal"] = None
        if curve is None or not record["drafted_rounds"]:
            continue
        draft_s = record["visible_draft_ms_per_round"] / 1e3
        k, rtt_s = record["draft_tokens_per_round"], record["rtt_ms"] / 1e3
        prompts = record["prompt_tokens_per_token"] or 0.0
        ideal = ideal_ratio(curve, record["num_edges"], record["mean_accepted_length"], k, rtt_s, draft_s, prompts)
        x["ideal_throughput_x"] = ideal
        x["of_ideal"] = _safe_div(x["throughput_x"], ideal)


def add_schedule(records: list[dict], curve: CostCurve | None) -> None:
    """Each AR and edge-drafted record's `schedule_tok_s`, the rate of the best whole-cohort schedule on the run's
    cost curve (bench/ideal.py's schedule_rate), and `of_schedule`, its decode rate against that."""
    for record in records:
        record["schedule_tok_s"] = record["of_schedule"] = None
        if curve is None or record["mode"] == "server_spec":
            continue
        prefill_s = (record["prompt_tokens_per_token"] or 0.0) * curve.marginal_s()
        rtt_s = record["rtt_ms"] / 1e3
        if record["mode"] == "ar":
            rate = schedule_rate(curve, record["num_edges"], 1, 1, rtt_s, prefill_s)
        elif record["drafted_rounds"]:
            accepted, turnaround_s = record["mean_accepted_length"], record["visible_draft_ms_per_round"] / 1e3 + rtt_s
            round_tokens = 1 + record["draft_tokens_per_round"]
            rate = schedule_rate(curve, record["num_edges"], accepted, round_tokens, turnaround_s, accepted * prefill_s)
        else:
            continue
        record["schedule_tok_s"] = rate
        record["of_schedule"] = _safe_div(record["throughput_tok_s"], rate)


def _safe_div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
