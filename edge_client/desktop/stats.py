"""Speculative figures for one answer and for all of them, as plain dicts (stored as JSON with each answer).

    tokens_per_s        tokens shown / wall time of the answer (first token included)
    acceptance_rate     accepted draft tokens / draft tokens sent
    proactive_hit_rate  rounds whose next draft was ready when the reply came / rounds drafted ahead for
    fallback            why (part of) the answer was the server's alone, or None

Overall figures weigh answers by their size: total tokens over total time,
total accepted over total drafted, never a mean of per-answer rates.
"""

from __future__ import annotations

from collections.abc import Sequence

SERIES_POINTS = 40  # tokens/s chart resolution; bounded so a stored answer stays small


def live(stats, num_tokens: int, elapsed_s: float) -> dict:
    """Figures while the answer streams: `stats` is the GenerationStats being filled in."""
    return {
        "num_tokens": num_tokens,
        "elapsed_s": elapsed_s,
        "tokens_per_s": num_tokens / elapsed_s if elapsed_s > 0 else 0.0,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "proactive_rounds": stats.proactive_rounds,
        "proactive_hits": stats.proactive_hits,
        "proactive_hit_rate": stats.proactive_hit_rate,
        "fallback": stats.fallback,
    }


def final(stats, num_tokens: int, elapsed_s: float, samples: Sequence[tuple[float, int]]) -> dict:
    """An answer's figures as stored: the live ones at its end, plus timings and its tokens/s series."""
    figures = live(stats, num_tokens, elapsed_s)
    figures.update(
        rounds=stats.rounds,
        ttft_ms=round(stats.ttft_ms, 1),
        resumes=stats.resumes,
        series=[round(rate, 2) for rate in rate_series(samples, elapsed_s)],
    )
    return figures


def rate_series(samples: Sequence[tuple[float, int]], end_s: float, num_points: int = SERIES_POINTS) -> list[float]:
    """Tokens/s at `num_points` even times over (0, end_s], each over the trailing eighth of the answer.

    `samples` are (seconds, tokens so far). Tokens arrive in bursts (accepted
    drafts + 1 per round), so a rate over a window, not per burst, is what a
    person can read. With 2 points over 1 s and samples (0.2, 3), (0.9, 5):
    at 0.5 s the window (0.375, 0.5] saw no token: 0.0; at 1.0 s the window
    (0.875, 1.0] saw 2 tokens in 0.125 s: 16.0.
    """
    if not samples or end_s <= 0:
        return []
    window = end_s / 8

    def arrived_by(at: float) -> int:
        return max((count for when, count in samples if when <= at), default=0)

    times = [end_s * (i + 1) / num_points for i in range(num_points)]
    return [(arrived_by(t) - arrived_by(t - window)) / min(window, t) for t in times]


def overall(answers: Sequence[dict]) -> dict:
    """All answers' figures together (see the module docstring for the weighting)."""
    tokens = sum(a.get("num_tokens", 0) for a in answers)
    seconds = sum(a.get("elapsed_s", 0.0) for a in answers)
    drafted = sum(a.get("draft_tokens", 0) for a in answers)
    accepted = sum(a.get("accepted_tokens", 0) for a in answers)
    rounds = sum(a.get("proactive_rounds", 0) for a in answers)
    hits = sum(a.get("proactive_hits", 0) for a in answers)
    return {
        "answers": len(answers),
        "num_tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "proactive_hit_rate": hits / rounds if rounds else 0.0,
        "draft_tokens": drafted,
        "proactive_rounds": rounds,
        "fallbacks": sum(1 for a in answers if a.get("fallback")),
    }


def describe(figures: dict) -> list[tuple[str, str]]:
    """(label, value) rows a person reads; rates without their denominators say "-"."""

    def share(rate_key: str, count_key: str) -> str:
        return f"{figures.get(rate_key, 0.0):.0%}" if figures.get(count_key) else "-"

    rows = [
        ("tokens/s", f"{figures.get('tokens_per_s', 0.0):.1f}"),
        ("tokens", str(figures.get("num_tokens", 0))),
        ("acceptance", share("acceptance_rate", "draft_tokens")),
        ("proactive hits", share("proactive_hit_rate", "proactive_rounds")),
    ]
    if "fallbacks" in figures:
        rows.append(("fell back to server-only", f"{figures['fallbacks']} of {figures['answers']} answers"))
    else:
        if "num_tokens" not in figures:
            drafting = "-"  # no answer yet
        elif figures.get("fallback"):
            drafting = f"fell back to server-only: {figures['fallback']}"
        else:
            drafting = "speculative" if figures.get("draft_tokens") else "server only"
        rows.append(("drafting", drafting))
    return rows
