"""Verification by matching the target's samples: pure, lossless for any sampler.

The target samples one token after every draft node (greedy or not). A node is
accepted when its token equals the target's sample at its parent and its
parent is accepted. The deepest accepted node wins; the target's sample after
it is the round's extra token. Every committed token is therefore exactly what
the target itself sampled, so no draft probabilities are needed.

    drafts  = [a, b, c]   parents = [0, 1, 2]       (a chain)
    samples = [a, b, x, y]  (sample after root, node 1, node 2, node 3)
    -> accepted nodes (1, 2); next token x (c was rejected)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

ROOT = 0


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    accepted_nodes: tuple[int, ...]  # node numbers root->leaf; node i is draft token i-1
    next_token: int  # the target's own token after the last accepted node


def verify_by_sampling(
    draft_token_ids: Sequence[int],  # [n]
    draft_parents: Sequence[int],  # [n] parent node of each draft node (0 = root)
    target_samples: Sequence[int],  # [n + 1] target's sample after the root and after each node
) -> VerifyResult:
    assert len(draft_parents) == len(draft_token_ids) and len(target_samples) == len(draft_token_ids) + 1
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(draft_parents, start=1):
        children.setdefault(parent, []).append(node)
    accepted: list[int] = []
    node = ROOT
    while True:
        wanted = target_samples[node]
        match = next((c for c in children.get(node, ()) if draft_token_ids[c - 1] == wanted), None)
        if match is None:
            return VerifyResult(tuple(accepted), wanted)
        accepted.append(match)
        node = match
