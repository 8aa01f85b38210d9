"""How one answer is generated: what the server is asked for (length, sampling, seed) and how the edge speculates.

An answer (edge_client/generation.py) takes a SpeculationPolicy; the connection it runs on takes a
ConnectionConfig (edge_client/client.py). A front end keeps one policy as its default and derives each
request's from it (e.g. the OpenAI API's temperature and max_tokens).
"""

from __future__ import annotations

import dataclasses

from specedge.edge_client.drafting.base import DEFAULT_DRAFT_TOP_K, TreeBudget
from specedge.types import SamplingParams


@dataclasses.dataclass(frozen=True)
class SpeculationPolicy:
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    # Sampled requests with a seed are drafted coupled to the target's noise and verified by matching: the
    # output equals the seeded server-only run, whatever the drafts, the load or the batch. Without a seed,
    # they go by rejection sampling (below): accepts more, follows the target's distribution, not reproducible.
    seed: int | None = None
    num_draft: int = 4  # draft tokens per round (chains)
    follow_advice: bool = True  # draft min(num_draft, the server's advice) tokens a round
    # Unseeded sampled requests: draft by sampling from a top-k q and send q, so the server verifies by
    # rejection sampling (accepts more than matching its samples); off: greedy drafts, verified by matching.
    rejection_sampling: bool = True
    draft_top_k: int = DEFAULT_DRAFT_TOP_K
    # Stop a chain before the first draft token whose draft probability is below this (llama.cpp's --draft-p-min).
    draft_p_min: float = 0.0
    # Draft trees instead of chains (needs a TreeDrafter, e.g. the torch drafter).
    tree: TreeBudget | None = None
    # Draft the next round while this one is verified (chains only).
    proactive: bool = True
    max_guesses: int = 3  # verify outcomes drafted ahead for, likeliest first
    # When the draft model fails, or drafting is measured slower than the server
    # alone, finish the answer server-only and say so in the stats.
    slow_draft_fallback: bool = False
    # Answers without a drafter: have the server draft this many tokens a round with
    # its own draft model (specedge-server --draft-model), the server-side baseline.
    server_draft_tokens: int = 0

    def __post_init__(self):
        if self.num_draft < 0 or self.server_draft_tokens < 0:
            raise ValueError(
                f"num_draft and server_draft_tokens must be >= 0, got {self.num_draft}, {self.server_draft_tokens}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise ValueError(f"draft_p_min must be in [0, 1], got {self.draft_p_min}")
        if self.max_guesses < 1:
            raise ValueError(f"max_guesses must be >= 1, got {self.max_guesses}")


def proactive_by_default(server: str | None, discovered: bool = False) -> bool:
    """Whether to draft ahead when the user has not said: yes, unless the server shares this machine,
    where drafting ahead takes the cores the verify it waits for runs on (README, 'One box'). A server
    found through the fleet broker, or none named, counts as remote."""
    from specedge.net import on_this_machine

    return discovered or server is None or not on_this_machine(server)
