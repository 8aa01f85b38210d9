"""Server-side drafting: the baseline SpecEdge is measured against.

Here the draft model runs on the server too (as in vLLM's draft-model
speculation): a second compact model with its own KV slots, the same slot
index as the session's target slot. Drafting is batched across sessions: one
draft forward per draft position, all rows at once.

A session's draft cache lags its committed tokens by what the last round
committed; each round first catches up on those tokens, then drafts greedily.

    committed: p0 p1 p2 | t0 t1            draft_cached = 3 (p0..p2)
    round:     forward [t0 t1] -> d1, forward [d1] -> d2, ... -> d_k
    after the round with a accepted: draft_cached = 5 + min(a, k - 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specedge.server.runner import ForwardRequest, ModelRunner


@dataclasses.dataclass(frozen=True)
class DraftRow:
    slot: int
    num_cached: int  # tokens of the context already in the draft's slot
    catch_up: tuple[int, ...]  # committed tokens not yet in it (at least the newest one)
    num_tokens: int  # drafts wanted; each row drafts only its own, so none writes past its slot


class ServerDrafter:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        """Greedy drafts of each row's `num_tokens`, batched across the rows still drafting."""
        drafts: list[list[int]] = [[] for _ in rows]
        requests = {
            i: ForwardRequest(r.slot, r.num_cached, r.catch_up, all_logits=False)
            for i, r in enumerate(rows)
            if r.num_tokens > 0
        }
        while requests:
            logits = self.runner.forward(list(requests.values()))
            next_tokens = [int(row_logits[-1].argmax()) for row_logits in logits]
            following = {}
            for (i, request), token in zip(requests.items(), next_tokens):
                drafts[i].append(token)
                if len(drafts[i]) < rows[i].num_tokens:
                    following[i] = ForwardRequest(
                        request.slot, request.num_cached + len(request.token_ids), (token,), all_logits=False
                    )
            requests = following
        return drafts
