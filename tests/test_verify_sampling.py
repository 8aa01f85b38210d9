"""The verifier and the sampler: hand-built cases, seeded determinism, and distributions."""

from __future__ import annotations

import math

import pytest
import torch

from specedge.server.sampling import sample, target_probs
from specedge.server.verify import verify_by_sampling
from specedge.types import SamplingParams

CHAIN3 = [0, 1, 2]


@pytest.mark.parametrize(
    "drafts, parents, samples, accepted, next_token",
    [
        ([5, 6, 7], CHAIN3, [5, 6, 7, 8], (1, 2, 3), 8),  # all accepted: bonus after the leaf
        ([5, 6, 7], CHAIN3, [9, 6, 7, 8], (), 9),  # first rejected: the target's own token
        ([5, 6, 7], CHAIN3, [5, 6, 9, 8], (1, 2), 9),  # rejected mid-chain
        ([], [], [4], (), 4),  # empty draft: plain decoding step
        ([5, 6, 7], [0, 0, 2], [6, 1, 7, 3], (2, 3), 3),  # tree: second branch, then its child
        ([5, 5], [0, 0], [5, 1, 2], (1,), 1),  # duplicate siblings: first match wins
        ([5, 6], [0, 1], [5, 7, 8], (1,), 7),  # a later node whose parent was rejected is never taken
    ],
)
def test_verify_hand_built(drafts, parents, samples, accepted, next_token):
    result = verify_by_sampling(drafts, parents, samples)
    assert result.accepted_nodes == accepted
    assert result.next_token == next_token


def test_greedy_sampling_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert sample(logits, [10, 11], SamplingParams(), seed=0) == [1, 0]


def test_top_p_keeps_the_most_likely_tokens():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the two most likely (0.5 alone is short of 0.7).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    tiny = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))
    torch.testing.assert_close(tiny, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_top_k_and_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = target_probs(logits, SamplingParams(temperature=0.5, top_k=2))
    expected = torch.tensor([4.0, 2.0]).softmax(0)
    torch.testing.assert_close(probs, torch.tensor([[expected[0], expected[1], 0.0, 0.0]]))


def test_same_position_same_sample_whatever_else_is_in_the_batch():
    """What makes seeded speculative runs equal seeded server-only runs."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    together = sample(logits, [5, 6, 7], params, seed=11)
    alone = [sample(logits[i : i + 1], [5 + i], params, seed=11)[0] for i in range(3)]
    assert together == alone


def test_sampled_tokens_follow_the_target_distribution():
    """Chi-square goodness of fit over many positions (each an independent draw)."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log().expand(4000, -1)
    params = SamplingParams(temperature=1.0)
    draws = torch.tensor(sample(logits, range(4000), params, seed=123))
    counts = torch.bincount(draws, minlength=len(probs)).double()
    expected = probs.double() * len(draws)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: P(chi2 > 20.5) ~= 0.001; the seed is fixed, so this cannot flake.
    assert chi2 < 20.5, (counts.tolist(), expected.tolist())
    assert math.isclose(float(counts.sum()), 4000)
