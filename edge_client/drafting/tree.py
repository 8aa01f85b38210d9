"""Which nodes a draft tree keeps: pure bookkeeping, no model.

The tree grows level by level (EAGLE-2 / SpecExec style). Each level expands
the `max_width` likeliest nodes of the level before (by path probability,
the product of draft probabilities from the root), `max_width` children each.
At the end the `max_nodes` likeliest nodes of everything grown are kept. A
child's path probability never exceeds its parent's, so ranking by
(path probability, depth) keeps every kept node's ancestors too.

    width 2, root children a (.6), b (.3); a's children c (.5 -> .30), d (.4 -> .24)
    max_nodes 3: a (.6), b (.3), c (.30, deeper than b) -> parents [0, 0, 1]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specedge.edge_client.drafting.base import DraftTree, TreeBudget

ROOT = 0  # node 0 is the last committed token


@dataclasses.dataclass(frozen=True)
class _Node:
    token: int
    parent: int  # node number; ROOT for the first level
    prob: float  # draft probability given the parent's path
    path_prob: float
    depth: int  # 1 for the root's children


class TreeGrower:
    def __init__(self, budget: TreeBudget, max_nodes: int, min_prob: float = 0.0):
        self.budget = budget
        self.max_nodes = max_nodes
        self.min_prob = min_prob
        self._nodes: list[_Node] = []  # node n is self._nodes[n - 1]

    def grow(
        self, frontier: Sequence[int], top_ids: Sequence[Sequence[int]], top_probs: Sequence[Sequence[float]]
    ) -> list[int]:
        """Add the children of `frontier` (top candidates of each, likeliest first); return the next frontier."""
        level: list[int] = []
        for parent, ids, probs in zip(frontier, top_ids, top_probs):
            parent_path = 1.0 if parent == ROOT else self._nodes[parent - 1].path_prob
            depth = 1 if parent == ROOT else self._nodes[parent - 1].depth + 1
            for token, prob in list(zip(ids, probs))[: self.budget.max_width]:
                if prob < self.min_prob:
                    break
                self._nodes.append(_Node(token, parent, prob, parent_path * prob, depth))
                level.append(len(self._nodes))
        level.sort(key=lambda node: -self._nodes[node - 1].path_prob)
        return level[: self.budget.max_width]

    def token(self, node: int) -> int:
        return self._nodes[node - 1].token

    def depth(self, node: int) -> int:
        return self._nodes[node - 1].depth

    def ancestors(self, node: int) -> list[int]:
        """`node` and its ancestors up to (not including) the root."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self._nodes[node - 1].parent
        return path

    def build(self) -> DraftTree:
        """The `max_nodes` likeliest nodes, renumbered so that parents come first."""
        ranked = sorted(range(1, len(self._nodes) + 1), key=lambda n: (-self._nodes[n - 1].path_prob, self.depth(n)))
        kept = sorted(ranked[: self.max_nodes], key=lambda n: (self.depth(n), n))
        number = {ROOT: ROOT} | {old: new for new, old in enumerate(kept, start=1)}
        nodes = [self._nodes[n - 1] for n in kept]
        return DraftTree(
            token_ids=tuple(n.token for n in nodes),
            parents=tuple(number[n.parent] for n in nodes),
            probs=tuple(n.prob for n in nodes),
        )
