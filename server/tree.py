"""Token trees given by parent indices: the only structure the wire carries.

Index 0 is the root (the last committed token); `parents[i - 1]` is the
parent of token i and is always < i, so one pass in index order suffices.
A chain is the special case parents = (0, 1, 2, ...).

    parents = (0, 0, 1)        root -> 1, root -> 2, 1 -> 3
    depths  = [0, 1, 1, 2]
    ancestors (row i may see column j):
        [1 0 0 0]
        [1 1 0 0]
        [1 0 1 0]
        [1 1 0 1]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def chain_parents(num_tokens: int) -> tuple[int, ...]:
    """Parents of a chain of `num_tokens` tokens, root included."""
    return tuple(range(num_tokens - 1))


def validate_parents(parents: Sequence[int]) -> str | None:
    """A message naming the first bad parent, or None when the tree is well formed."""
    for i, parent in enumerate(parents, start=1):
        if not 0 <= parent < i:
            return f"draft node {i} has parent {parent}; a parent must be the root (0) or an earlier node (< {i})"
    return None


def depths(parents: Sequence[int]) -> list[int]:
    result = [0]
    for parent in parents:
        result.append(result[parent] + 1)
    return result


def ancestor_mask(parents: Sequence[int] | None, num_tokens: int) -> torch.Tensor:
    """[num_tokens, num_tokens] bool: token i may attend token j (j is i or an ancestor of i)."""
    if parents is None:
        return torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    mask = torch.eye(num_tokens, dtype=torch.bool)
    for i, parent in enumerate(parents, start=1):
        mask[i] |= mask[parent]
    return mask
