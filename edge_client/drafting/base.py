"""The one small interface every drafter implements, and the sampled-draft helpers they share.

A drafter is stateless as seen from outside: each call names the whole
committed context, and the drafter reuses whatever prefix of it is already in
its KV cache. Rolling back rejected drafts is therefore not a separate call:
the next `propose` simply names a shorter (or different) context and the
drafter truncates its cache to the longest common prefix, with no re-prefill.
Proactive drafting uses the same call with a guessed context.

Sampled drafts come two ways:

- `DraftSampling` (unseeded requests, verified by rejection sampling): from a
  top-k truncated distribution q, so q is sparse and can be sent whole; its
  randomness is the draft's own stream, keyed by (seed, sequence position).
- `CoupledSampling` (seeded requests, verified by matching): the draft token
  at sequence index i is argmax(log q + G) with G the very Gumbel noise the
  server samples index i with (drafting/coupled.py). No q is sent; the server
  keeps a draft when it equals its own sample, so the answer is the seeded
  server-only answer whatever was drafted, and a draft is accepted exactly
  when the two races agree.

This module stays free of torch and numpy: a GGUF edge never imports torch,
and the server shares `SparseDist` with the edge.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from specedge import noise
from specedge.tokens import TokenizerFingerprint
from specedge.types import PROB_SUM_TOLERANCE, SamplingParams, SparseDist  # noqa: F401  (re-exported)

DEFAULT_DRAFT_TOP_K = 20


@dataclasses.dataclass(frozen=True)
class DraftSampling:
    """How to sample drafts instead of taking the argmax."""

    temperature: float  # > 0; q = softmax(logits / temperature) over the top_k logits
    top_k: int = DEFAULT_DRAFT_TOP_K  # truncation that makes q sparse, hence exact on the wire
    seed: int = 0  # with the context, fixes every draft (keyed by sequence position)

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"draft temperature must be a finite number > 0, got {self.temperature}")
        if self.top_k < 1:
            raise ValueError(f"draft top_k must be >= 1, got {self.top_k}")


@dataclasses.dataclass(frozen=True)
class CoupledSampling:
    """Draft with the target's own noise, for verification by matching (seeded requests)."""

    params: SamplingParams  # the target's temperature (> 0), top_k and top_p, applied to the draft's logits
    seed: int  # the session's seed, the one the server samples with

    def __post_init__(self):
        if self.params.greedy:
            raise ValueError("coupled drafting is for sampled requests (temperature > 0)")


@dataclasses.dataclass(frozen=True)
class DraftChain:
    token_ids: tuple[int, ...]
    # Draft probability of each proposed token (under the draft's own,
    # untempered distribution); drives confidence-based early stopping.
    probs: tuple[float, ...]
    # DraftSampling drafts only: the distribution q each token was sampled from,
    # which the server's rejection sampler needs. None for greedy and coupled drafts.
    dists: tuple[SparseDist, ...] | None = None
    # The draft's second choice at each position and its probability: the
    # likeliest target token where a draft is rejected (proactive guesses).
    runner_up_ids: tuple[int, ...] = ()
    runner_up_probs: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class TreeBudget:
    """SpecExec-style budget for a draft tree, grown best-first by path probability."""

    max_depth: int = 6  # longest root-to-leaf path
    max_width: int = 3  # children per node
    max_nodes: int = 16  # draft tokens in all (the server's max_draft_tokens caps it)

    def __post_init__(self):
        if min(self.max_depth, self.max_width, self.max_nodes) < 1:
            raise ValueError("tree depth, width and node budgets must all be >= 1")


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """Draft tokens with parent indices in the wire's numbering (0 = the last committed token)."""

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]  # parents[i] < i + 1: every node comes after its parent
    probs: tuple[float, ...]  # draft probability of each token given its parent path


class ChainBuilder:
    """Collects a chain token by token, for the drafters' loops."""

    def __init__(self, sampling: DraftSampling | CoupledSampling | None):
        self._sampled = isinstance(sampling, DraftSampling)
        self._fields: tuple[list, ...] = ([], [], [], [], [])

    def add(self, token: int, prob: float, dist: SparseDist | None, runner_up: int, runner_up_prob: float) -> None:
        for field, value in zip(self._fields, (token, prob, dist, runner_up, runner_up_prob)):
            field.append(value)

    def build(self) -> DraftChain:
        token_ids, probs, dists, runner_up_ids, runner_up_probs = map(tuple, self._fields)
        return DraftChain(token_ids, probs, dists if self._sampled else None, runner_up_ids, runner_up_probs)


class Drafter(Protocol):
    fingerprint: TokenizerFingerprint

    def propose(
        self,
        context: Sequence[int],
        num_tokens: int,
        sampling: DraftSampling | CoupledSampling | None = None,
        min_prob: float = 0.0,
    ) -> DraftChain:
        """Draft up to `num_tokens` tokens that follow `context`: greedily, or
        sampled as `sampling` says (a DraftSampling chain carries each token's
        q; a CoupledSampling chain races with the target's noise, carries none).

        `context` is every committed token, prompt included. The drafter's
        cache afterwards holds `context` plus all but the last drafted token.
        The chain stops at the first position where the draft's largest
        probability is below `min_prob` (llama.cpp's --draft-p-min): an
        unsure draft is rarely accepted and costs verification compute.
        The stop is decided before the token is drawn, from the context
        alone, never from the drawn token's own probability: a sampled
        draft sent only when it is likely would follow q restricted to its
        likely tokens, not the q the server's rejection test assumes, and
        the output would no longer follow the target. (For greedy chains
        the two rules agree: the token drawn is the likeliest.)
        """
        ...

    def close(self) -> None:
        """Release the model (memory, threads). The drafter is unusable after."""
        ...


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
    """A drafter that also drafts trees: `isinstance(drafter, TreeDrafter)` says whether it can."""

    def propose_tree(self, context: Sequence[int], budget: TreeBudget, min_prob: float = 0.0) -> DraftTree:
        """A greedy draft tree after `context`; the cache afterwards holds `context` only."""
        ...


def sample_top_k(
    top_ids: Sequence[int],  # [k] the k largest logits' token ids, any order
    top_logits: Sequence[float],  # [k] their logits
    sampling: DraftSampling,
    position: int,  # sequence index the drafted token will occupy
) -> tuple[int, SparseDist]:
    """Sample one draft token from softmax(top_logits / temperature); return it and that q."""
    # Canonical order (largest logit first, ties by id), so the draw does not
    # depend on the order in which a backend's top-k happened to list them.
    ranked = sorted(zip(top_logits, top_ids), key=lambda pair: (-pair[0], pair[1]))
    max_logit = ranked[0][0]
    weights = [math.exp((logit - max_logit) / sampling.temperature) for logit, _ in ranked]
    # Round to float32, what the wire carries, so the edge samples from
    # exactly the q the server will see; drop tokens that underflowed to 0.
    probs = array.array("f", (w / sum(weights) for w in weights)).tolist()
    kept = [(token, prob) for (_, token), prob in zip(ranked, probs) if prob > 0]
    dist = SparseDist(token_ids=tuple(t for t, _ in kept), probs=tuple(p for _, p in kept))
    return draw(dist, sampling.seed, position), dist


def draw(dist: SparseDist, seed: int, position: int) -> int:
    """The token of `dist` that the draft's keyed uniform for (seed, position) picks.

    A pure function of the q that is sent: whoever holds a sampled draft's q
    can check that the draft was drawn from it.
    """
    # Inverse CDF: the first token whose cumulative probability exceeds u * total.
    cumulative = list(itertools.accumulate(dist.probs))
    index = bisect.bisect_right(cumulative, _keyed_uniform(seed, position) * cumulative[-1])
    return dist.token_ids[min(index, len(cumulative) - 1)]


def _keyed_uniform(seed: int, position: int) -> float:
    """U(0, 1), a pure function of (seed, position) in the draft's own stream (specedge/noise.py)."""
    return noise.uniform(seed, position, noise.DRAFT_STREAM)
