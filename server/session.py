"""One edge's generation: its KV slot, its tokens, and the single place tokens are committed.

KV layout of a session (P prompt tokens, g generated so far):

    slot positions  0 .. P-1   prompt
                    P .. P+g-2 generated tokens, all but the newest
    pending token   the newest generated token: sampled, not yet in the KV.

A round stores the pending token plus the drafts after it, then keeps the
pending token and the accepted drafts: num_cached grows by 1 + accepted.
"""

from __future__ import annotations

import dataclasses
import time

from specedge.scheduler.gather import Turnaround
from specedge.scheduler.speculation import SessionSpeculation
from specedge.types import FinishReason, SamplingParams


@dataclasses.dataclass(eq=False)
class Session:
    id: str
    owner: str  # the identity that opened it (server/auth.py); only it may drive it
    connection: str  # the connection it was opened on; when that connection's Attach lease ends, it is closed
    slot: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    max_context: int
    sampling: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]
    speculation: SessionSpeculation
    generated: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is in the slot
    draft_cached: int = 0  # tokens whose KV is in the server draft model's slot (server-side drafting only)
    finish: FinishReason = FinishReason.NONE
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    turnaround: Turnaround = dataclasses.field(default_factory=Turnaround)  # reply -> next round (scheduler/gather.py)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def pending_token(self) -> int:
        return self.generated[-1]

    @property
    def num_context(self) -> int:
        return self.prompt_len + len(self.generated)

    @property
    def draft_room(self) -> int:
        """Draft tokens that still fit in the slot next to the pending token."""
        return self.max_context - self.num_context

    def commit(self, tokens: list[int], num_new_cached: int) -> list[int]:
        """Append the round's tokens up to the first stop condition; return those kept."""
        num_cached = self.num_cached + num_new_cached
        kept = []
        for token in tokens:
            self.generated.append(token)
            kept.append(token)
            if token in self.eos_token_ids:
                self.finish = FinishReason.STOP
            elif len(self.generated) >= self.max_new_tokens:
                self.finish = FinishReason.LENGTH
            elif self.num_context >= self.max_context:
                self.finish = FinishReason.CONTEXT
            if self.finish is not FinishReason.NONE:
                break
        # A stop can cut the round short of KV it wrote for accepted drafts;
        # what counts is the context, all but its newest (pending) token.
        self.num_cached = min(num_cached, self.num_context - 1)
        return kept
