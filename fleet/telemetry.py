"""Opt-in edge telemetry: running totals of this edge's answers, as an EdgeStats message.

Only counts and rates leave the edge: never prompt or answer text, never
token ids. The edge id is random unless the user names it.
"""

from __future__ import annotations

import dataclasses

from specedge.fleet.messages import EdgeStats


@dataclasses.dataclass
class EdgeTelemetry:
    answers: int = 0
    tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_ms: float = 0.0  # drafting the answers waited for, or used from drafting ahead
    wait_ms: float = 0.0  # verify round trips
    proactive_rounds: int = 0
    proactive_hits: int = 0
    fallbacks: int = 0
    resumes: int = 0

    def observe(self, stats) -> None:
        """Add one answer's GenerationStats (edge_client/results.py)."""
        self.answers += 1
        self.tokens += stats.num_tokens
        self.rounds += stats.rounds
        self.draft_tokens += stats.draft_tokens
        self.accepted_tokens += stats.accepted_tokens
        self.draft_ms += stats.visible_draft_ms + stats.hidden_draft_ms
        self.wait_ms += stats.wait_ms
        self.proactive_rounds += stats.proactive_rounds
        self.proactive_hits += stats.proactive_hits
        self.fallbacks += stats.fallback is not None
        self.resumes += stats.resumes

    def message(self, edge_id: str, server_id: str) -> EdgeStats:
        def ratio(num: float, den: float, scale: float = 1.0) -> float:
            return round(scale * num / den, 4) if den else 0.0

        return EdgeStats(
            edge_id=edge_id,
            server_id=server_id,
            answers=self.answers,
            tokens=self.tokens,
            rounds=self.rounds,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            acceptance_rate=ratio(self.accepted_tokens, self.draft_tokens),
            draft_tokens_per_s=ratio(self.draft_tokens, self.draft_ms, 1e3),
            rtt_ms=ratio(self.wait_ms, self.rounds),
            proactive_hit_rate=ratio(self.proactive_hits, self.proactive_rounds),
            fallbacks=self.fallbacks,
            resumes=self.resumes,
        )
