"""What an answer reports: its tokens, why it finished, its speculative stats; and a chat's session."""

from __future__ import annotations

import dataclasses

from specedge.types import FinishReason


@dataclasses.dataclass
class GenerationStats:
    rounds: int = 0  # verify rounds (each one target forward)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    cut_nodes: int = 0  # draft nodes the server did not verify: past the round's share of its step
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    num_tokens: int = 0
    proactive_rounds: int = 0  # rounds that were drafted ahead for
    proactive_hits: int = 0  # ... whose outcome matched a guess, so the next draft was ready
    hidden_draft_ms: float = 0.0  # drafting done while waiting for the server, and used
    visible_draft_ms: float = 0.0  # drafting the answer waited for
    wait_ms: float = 0.0  # verify round trips
    resumes: int = 0  # sessions re-opened after a lost connection
    fallback: str | None = None  # why (part of) the answer was generated server-only

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens committed per verify round (accepted drafts + the server's own), after the first token."""
        return (self.num_tokens - 1) / self.rounds if self.rounds else 0.0

    @property
    def itl_ms(self) -> float:
        """Mean time between tokens after the first."""
        return (self.total_ms - self.ttft_ms) / (self.num_tokens - 1) if self.num_tokens > 1 else 0.0

    @property
    def proactive_hit_rate(self) -> float:
        return self.proactive_hits / self.proactive_rounds if self.proactive_rounds else 0.0

    @property
    def wait_hidden_share(self) -> float:
        """Share of the per-round wait (drafting + round trip) that drafting ahead took off the critical path."""
        total = self.hidden_draft_ms + self.visible_draft_ms + self.wait_ms
        return self.hidden_draft_ms / total if total else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_round": round(self.tokens_per_round, 4),
            "ttft_ms": round(self.ttft_ms, 2),
            "itl_ms": round(self.itl_ms, 2),
            "proactive_hit_rate": round(self.proactive_hit_rate, 4),
            "wait_hidden_share": round(self.wait_hidden_share, 4),
            "visible_draft_ms": round(self.visible_draft_ms, 2),
            "hidden_draft_ms": round(self.hidden_draft_ms, 2),
            "wait_ms": round(self.wait_ms, 2),
            "resumes": self.resumes,
            "fallback": self.fallback,
        }


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    finish: FinishReason
    stats: GenerationStats


@dataclasses.dataclass
class Conversation:
    """A server session kept open across turns: each new turn prefills only the new message."""

    session_id: str | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)  # the session's, as the server holds them

    def reset(self) -> None:
        self.session_id, self.tokens = None, []
