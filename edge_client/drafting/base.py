"""The one small interface every drafter implements.

A drafter is stateless as seen from outside: each call names the whole
committed context, and the drafter reuses whatever prefix of it is already in
its KV cache. Rolling back rejected drafts is therefore not a separate call:
the next `propose` simply names a shorter (or different) context and the
drafter truncates its cache to the longest common prefix, with no re-prefill.
Proactive drafting uses the same call with a guessed context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from specedge.tokens import TokenizerFingerprint


@dataclasses.dataclass(frozen=True)
class DraftChain:
    token_ids: tuple[int, ...]
    # Draft probability of each proposed token (under the draft's own,
    # untempered distribution); drives confidence-based early stopping.
    probs: tuple[float, ...]


class Drafter(Protocol):
    fingerprint: TokenizerFingerprint

    def propose(self, context: Sequence[int], num_tokens: int) -> DraftChain:
        """Greedily draft up to `num_tokens` tokens that follow `context`.

        `context` is every committed token, prompt included. The drafter's
        cache afterwards holds `context` plus all but the last drafted token.
        """
        ...

    def close(self) -> None:
        """Release the model (memory, threads). The drafter is unusable after."""
        ...
