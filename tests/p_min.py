"""Where `min_prob` (--draft-p-min) must cut a chain: at the first position whose largest draft
probability is below it, whatever token was drawn there (see Drafter.propose). Shared by the
drafter and proactive tests."""

from __future__ import annotations

from specedge.edge_client.drafting.base import DraftChain


def top_probs(chain: DraftChain) -> list[float]:
    """The draft's largest probability at each position. The runner-up is the likeliest token
    wherever the drawn one is not, so it is the larger of the two recorded probabilities."""
    return [max(prob, runner_up_prob) for prob, runner_up_prob in zip(chain.probs, chain.runner_up_probs)]


def confident_length(chain: DraftChain, min_prob: float) -> int:
    """How many of `chain`'s tokens a call with `min_prob` keeps (the same draws, then the cut)."""
    return next((i for i, top in enumerate(top_probs(chain)) if top < min_prob), len(chain.token_ids))


def keeps_an_unlikely_draw(chain: DraftChain, min_prob: float) -> bool:
    """Whether a kept token's own probability is below `min_prob`: a rule that looked at the draw
    (the bug) would have cut the chain there, so only such a case tells the two rules apart."""
    return any(prob < min_prob for prob in chain.probs[: confident_length(chain, min_prob)])


def min_prob_between(chain: DraftChain, quantile: float) -> float:
    """A min_prob halfway between two neighbouring top probabilities of `chain`, so that float
    rounding cannot move a position across it."""
    tops = sorted(set(top_probs(chain)))
    index = min(max(1, round(quantile * len(tops))), len(tops) - 1)
    return (tops[index - 1] + tops[index]) / 2


def min_prob_cutting_inside(chain: DraftChain) -> float:
    """A min_prob that keeps the first position and cuts at a later one: halfway between the first
    top probability and the largest later one below it (float rounding cannot cross it)."""
    tops = top_probs(chain)
    below = [top for top in tops[1:] if top < tops[0]]
    assert below, f"no position after the first is less sure than it: {tops}"
    return (tops[0] + max(below)) / 2
