"""Rejection-sampling verification: hand-built cases, seeded determinism, and distributions.

The statistical tests run a plain speculative loop (the oracle in this file)
many times with different seeds and check, by chi-square, that the first two
generated tokens follow the target's own joint distribution exactly:

    P(t1 = a, t2 = b) = p(a | prompt) * p(b | prompt, a)

once for sampled chains verified by rejection sampling, and once for trees
verified by matching the target's samples.
"""

from __future__ import annotations

import collections
import functools
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specedge import noise
from specedge.edge_client.drafting.base import DraftSampling, SparseDist, sample_top_k
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.server.rejection import acceptance_uniform, acceptance_uniforms, verify_chain_by_rejection
from specedge.server.sampling import sample, target_probs
from specedge.server.verify import verify_by_sampling
from specedge.types import SamplingParams

NUM_VOCAB = 8  # hand-built cases
NUM_TRIALS = 10_000
MIN_P_VALUE = 0.01
MIN_EXPECTED_COUNT = 5  # chi-square bins expecting fewer are merged
# Small supports, so that the joint of (t1, t2) has few bins, and a draft
# flatter than the target, so that rejections and residuals are frequent.
TARGET_PARAMS = SamplingParams(temperature=0.7, top_k=4)
DRAFT_TOP_K = 4
DRAFT_TEMPERATURE = 1.5


def one_hot(token: int) -> list[float]:
    return [1.0 if t == token else 0.0 for t in range(NUM_VOCAB)]


def dist(**probs_by_token: float) -> SparseDist:
    """dist(t3=0.5, t5=0.5) -> q over tokens 3 and 5."""
    return SparseDist(tuple(int(name[1:]) for name in probs_by_token), tuple(probs_by_token.values()))


def verify(drafts, dists, target_rows, seed=0, first_position=10):
    target = torch.tensor(target_rows, dtype=torch.float32)  # [n + 1, V]
    positions = range(first_position, first_position + len(drafts) + 1)
    return verify_chain_by_rejection(drafts, dists, target, positions, seed)


# --- hand-built cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_perfect_match_accepts_all_and_samples_bonus_from_last_row(seed):
    dists = [dist(t3=1.0), dist(t5=1.0), dist(t1=1.0)]
    result = verify([3, 5, 1], dists, [one_hot(3), one_hot(5), one_hot(1), one_hot(6)], seed)
    assert result.accepted_nodes == (1, 2, 3)
    assert result.next_token == 6
    # p == q, not one-hot: p / q = 1, so every draft is accepted whatever the seed.
    half = [0.5, 0.5, 0, 0, 0, 0, 0, 0]
    result = verify([1, 0], [dist(t0=0.5, t1=0.5)] * 2, [half, half, one_hot(4)], seed)
    assert result.accepted_nodes == (1, 2)
    assert result.next_token == 4


@pytest.mark.parametrize("seed", range(5))
def test_early_mismatch_rejects_and_resamples(seed):
    # p puts no mass on the draft: rejected at once, and the token comes from p.
    result = verify([5, 2], [dist(t5=1.0), dist(t2=1.0)], [one_hot(3), one_hot(2), one_hot(0)], seed)
    assert result.accepted_nodes == ()
    assert result.next_token == 3
    # Rejected mid-chain: the first draft stays.
    result = verify([1, 2], [dist(t1=1.0), dist(t2=1.0)], [one_hot(1), one_hot(7), one_hot(0)], seed)
    assert result.accepted_nodes == (1,)
    assert result.next_token == 7


def test_rejection_resamples_from_the_residual_not_from_p():
    """p = {3: .5, 4: .5}, q = {3: .5, 5: .5}, draft 5: the residual max(p - q, 0) is {4: .5},
    so a rejected 5 always becomes 4, although p alone would give 3 half the time."""
    target = [[0, 0, 0, 0.5, 0.5, 0, 0, 0], one_hot(0)]
    next_tokens = {verify([5], [dist(t3=0.5, t5=0.5)], target, seed).next_token for seed in range(200)}
    assert next_tokens == {4}


def test_acceptance_rate_is_min_one_p_over_q():
    """p = {0: .4, 1: .6}, q = {0: .5, 1: .5}, draft 0: accepted with probability .8, else residual 1."""
    target = [[0.4, 0.6, 0, 0, 0, 0, 0, 0], one_hot(7)]
    results = [verify([0], [dist(t0=0.5, t1=0.5)], target, seed) for seed in range(4000)]
    accepted = [r for r in results if r.accepted_nodes == (1,)]
    assert {r.next_token for r in accepted} == {7}
    assert {r.next_token for r in results if not r.accepted_nodes} == {1}
    assert len(accepted) / len(results) == pytest.approx(0.8, abs=0.02)  # 3 standard errors


def test_empty_draft_is_the_targets_own_seeded_sample():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))  # [1, V]
    params = SamplingParams(temperature=0.9, top_k=20)
    for seed in range(50):
        result = verify_chain_by_rejection([], [], target_probs(logits, params), [42], seed)
        assert result.accepted_nodes == ()
        assert result.next_token == sample(logits, [42], params, seed)[0]


def test_residual_of_zero_falls_back_to_p():
    """p <= q everywhere (a row short of 1, as float rounding can leave it): a rejection's
    residual is empty, so the token comes from p itself, never a fixed index."""
    target = [[0.5, 0.3, 0, 0, 0, 0, 0, 0], one_hot(7)]
    rejected = [verify([1], [dist(t0=0.5, t1=0.5)], target, seed) for seed in range(400)]
    next_tokens = collections.Counter(r.next_token for r in rejected if not r.accepted_nodes)
    assert set(next_tokens) == {0, 1}


@pytest.mark.parametrize(
    "drafts, dists, num_rows, match",
    [
        ([5], [dist(t3=1.0, t5=0.0)], 2, "probability 0"),
        ([5], [dist(t3=1.0)], 2, "probability 0"),
        ([9], [dist(t9=1.0)], 2, "outside the target vocabulary"),
        ([5], [dist(t5=0.5, t9=0.5)], 2, "outside the target vocabulary"),
        ([5], [], 2, "1 draft tokens"),
        ([5], [dist(t5=1.0)], 3, "target_probs must be"),
    ],
)
def test_invalid_inputs_are_value_errors(drafts, dists, num_rows, match):
    target = torch.full((num_rows, NUM_VOCAB), 1 / NUM_VOCAB)  # [num_rows, V]
    with pytest.raises(ValueError, match=match):
        verify_chain_by_rejection(drafts, dists, target, range(len(drafts) + 1), seed=0)


@pytest.mark.parametrize(
    "token_ids, probs, match",
    [
        ((1, 2), (1.0,), "2 token ids but 1 probs"),
        ((), (), "empty"),
        ((1, 1), (0.5, 0.5), "repeats"),
        ((-1,), (1.0,), "negative"),
        ((1, 2), (1.5, -0.5), "finite and >= 0"),
        ((1, 2), (0.5, float("nan")), "finite and >= 0"),
        ((1, 2), (0.5, 0.4), "sum to 1"),
    ],
)
def test_invalid_sparse_dists(token_ids, probs, match):
    with pytest.raises(ValueError, match=match):
        SparseDist(token_ids, probs)


def test_sparse_dist_takes_any_sequence_and_renormalises():
    q = SparseDist([4, 2], [0.6, 0.4 + 1e-4])  # float32 rounding on the wire leaves sums slightly off 1
    assert q.token_ids == (4, 2) and isinstance(q.probs, tuple)
    assert q.prob_of(4) + q.prob_of(2) == pytest.approx(1.0, abs=1e-12)
    assert q.prob_of(3) == 0.0


# --- seeded determinism -------------------------------------------------------------------------


def random_case(generator: torch.Generator, num_drafts: int = 3):
    """Random p rows and random sparse q's, with each draft drawn from its q."""
    target = torch.rand(num_drafts + 1, NUM_VOCAB, generator=generator).softmax(-1)  # [n + 1, V]
    drafts, dists = [], []
    for _ in range(num_drafts):
        token_ids = torch.randperm(NUM_VOCAB, generator=generator)[:3]
        probs = torch.rand(3, generator=generator).softmax(-1)
        drafts.append(int(token_ids[torch.multinomial(probs, 1, generator=generator)]))
        dists.append(SparseDist(token_ids.tolist(), probs.tolist()))
    return drafts, dists, target


def test_seeded_determinism():
    drafts, dists, target = random_case(torch.Generator().manual_seed(0))
    positions = [20, 21, 22, 23]
    by_seed = [verify_chain_by_rejection(drafts, dists, target, positions, seed) for seed in range(300)]
    again = [verify_chain_by_rejection(drafts, dists, target.clone(), list(positions), seed) for seed in range(300)]
    assert by_seed == again
    assert len({(r.accepted_nodes, r.next_token) for r in by_seed}) > 3  # different seeds differ
    assert acceptance_uniform(1, 20) == acceptance_uniform(1, 20) != acceptance_uniform(1, 21)
    assert 0 <= acceptance_uniform(2, 20) < 1
    # The server's vectorized uniforms are the same float64 bits.
    seeds, positions = [1, 2, 2**63 + 5, 0], [20, 20, 7, 2**40]
    seed_keys = np.array([noise.seed_key(seed) for seed in seeds], np.int64)
    vectorized = acceptance_uniforms(seed_keys, np.array(positions, np.int64)).tolist()
    assert vectorized == [acceptance_uniform(seed, position) for seed, position in zip(seeds, positions)]


# --- statistical equality with the target, on a tiny model -------------------------------------


class TinyPair:
    """Target p and draft top-k logits after short continuations of one prompt, memoised."""

    def __init__(self, target_dir, draft_dir, prompt: list[int] | None = None):
        self._target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self._draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
        chat = [{"role": "user", "content": "def add(a, b):"}]
        self.prompt = HFTokenizer(target_dir).apply_chat_template(chat) if prompt is None else prompt
        self._target_logits: dict[tuple[int, ...], torch.Tensor] = {}
        self._target_p: dict[tuple[int, ...], torch.Tensor] = {}
        self._draft_top_k: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def target_logits(self, suffix: tuple[int, ...]) -> torch.Tensor:  # [V]
        if suffix not in self._target_logits:
            self._target_logits[suffix] = self._last_logits(self._target, suffix)
        return self._target_logits[suffix]

    def target_p(self, suffix: tuple[int, ...]) -> torch.Tensor:  # [V]
        if suffix not in self._target_p:
            self._target_p[suffix] = target_probs(self.target_logits(suffix)[None], TARGET_PARAMS)[0]
        return self._target_p[suffix]

    def draft(self, suffix: tuple[int, ...], seed: int) -> tuple[int, SparseDist]:
        """The edge's sampled draft after `suffix`, exactly as the drafters compute it."""
        if suffix not in self._draft_top_k:
            top = self._last_logits(self._draft, suffix).topk(DRAFT_TOP_K)
            self._draft_top_k[suffix] = (top.indices.tolist(), top.values.tolist())
        sampling = DraftSampling(temperature=DRAFT_TEMPERATURE, top_k=DRAFT_TOP_K, seed=seed)
        return sample_top_k(*self._draft_top_k[suffix], sampling, position=len(self.prompt) + len(suffix))

    def _last_logits(self, model, suffix: tuple[int, ...]) -> torch.Tensor:  # [V]
        with torch.inference_mode():
            return model(torch.tensor([self.prompt + list(suffix)])).logits[0, -1]


@pytest.fixture(scope="module")
def tiny_pair(tiny_target_dir, tiny_draft_dir) -> TinyPair:
    return TinyPair(tiny_target_dir, tiny_draft_dir)


@pytest.fixture
def one_thread():
    """Tensors here are tiny: extra threads only add overhead, and on a busy
    machine a parallel op can wait milliseconds for a descheduled thread."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def chain_round(pair: TinyPair, committed: tuple[int, ...], seed: int, num_drafts: int) -> tuple[int, ...]:
    """One round of chain speculation verified by rejection sampling; the tokens it commits.
    The edge and the server use the same seed: their streams must not interfere."""
    drafts: list[int] = []
    dists: list[SparseDist] = []
    for _ in range(num_drafts):
        token, q = pair.draft(committed + tuple(drafts), seed)
        drafts.append(token)
        dists.append(q)
    target = torch.stack([pair.target_p(committed + tuple(drafts[:i])) for i in range(len(drafts) + 1)])  # [n + 1, V]
    first = len(pair.prompt) + len(committed)
    result = verify_chain_by_rejection(drafts, dists, target, range(first, first + len(drafts) + 1), seed)
    return tuple(drafts[: len(result.accepted_nodes)]) + (result.next_token,)


def tree_round(pair: TinyPair, committed: tuple[int, ...], seed: int) -> tuple[int, ...]:
    """One round of tree speculation verified by matching the target's samples.

    The tree: two children of the root drawn from q, each with one child drawn
    from q after it (nodes 1, 2 under the root; 3 under 1; 4 under 2).
    """
    rng = random.Random(seed)

    def draw(suffix: tuple[int, ...]) -> int:
        _, q = pair.draft(suffix, seed)
        return rng.choices(q.token_ids, weights=q.probs)[0]

    children = [draw(committed) for _ in range(2)]
    grandchildren = [draw(committed + (child,)) for child in children]
    tokens = children + grandchildren
    parents = [0, 0, 1, 2]
    # Rows: after the root, after each node.
    prefixes = [committed, *(committed + (c,) for c in children)]
    prefixes += [committed + (c, g) for c, g in zip(children, grandchildren)]
    logits = torch.stack([pair.target_logits(prefix) for prefix in prefixes])  # [5, V]
    positions = [len(pair.prompt) + len(prefix) for prefix in prefixes]  # of the token sampled after each row
    result = verify_by_sampling(tokens, parents, sample(logits, positions, TARGET_PARAMS, seed))
    return tuple(tokens[node - 1] for node in result.accepted_nodes) + (result.next_token,)


def first_two_tokens(pair: TinyPair, round_fn: Callable, seed: int) -> tuple[int, int]:
    """Plain speculative loop: rounds until two tokens are committed."""
    committed: tuple[int, ...] = ()
    while len(committed) < 2:
        committed += round_fn(pair, committed, seed)
    return committed[0], committed[1]


def exact_joint(pair: TinyPair) -> dict[tuple[int, int], float]:
    """P(t1 = a, t2 = b) = p(a | prompt) p(b | prompt, a) over the target's support."""
    first = pair.target_p(())
    joint = {}
    for a in first.nonzero().flatten().tolist():
        second = pair.target_p((a,))
        for b in second.nonzero().flatten().tolist():
            joint[(a, b)] = float(first[a]) * float(second[b])
    return joint


def chi_square_p_value(counts: collections.Counter, probs: dict, num_samples: int) -> float:
    """Goodness of fit; the smallest bins are merged until each expects MIN_EXPECTED_COUNT or more."""
    assert set(counts) <= set(probs), f"impossible outcomes: {set(counts) - set(probs)}"
    bins = sorted(((probs[k] * num_samples, counts[k]) for k in probs), reverse=True)  # (expected, observed)
    while len(bins) > 1 and bins[-1][0] < MIN_EXPECTED_COUNT:
        (expected_a, observed_a), (expected_b, observed_b) = bins.pop(), bins.pop()
        bins.append((expected_a + expected_b, observed_a + observed_b))
        bins.sort(reverse=True)
    chi2 = sum((observed - expected) ** 2 / expected for expected, observed in bins)
    num_dof = len(bins) - 1
    half_dof, half_chi2 = torch.tensor([num_dof / 2, chi2 / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half_dof, half_chi2))  # P(chi-square with num_dof > chi2)


def test_chi_square_helper_rejects_a_wrong_distribution():
    probs = {0: 0.5, 1: 0.3, 2: 0.2}
    assert chi_square_p_value(collections.Counter({0: 500, 1: 300, 2: 200}), probs, 1000) > 0.99
    assert chi_square_p_value(collections.Counter({0: 560, 1: 270, 2: 170}), probs, 1000) < MIN_P_VALUE


@pytest.mark.parametrize(
    "round_fn",
    [functools.partial(chain_round, num_drafts=1), functools.partial(chain_round, num_drafts=2), tree_round],
    # One draft: t2 is the bonus or the next round's; two drafts: t2 is accepted or from the residual.
    ids=["chain1_by_rejection", "chain2_by_rejection", "tree_by_matching"],
)
def test_speculation_samples_the_targets_joint(tiny_pair, round_fn, one_thread):
    joint = exact_joint(tiny_pair)
    counts = collections.Counter(first_two_tokens(tiny_pair, round_fn, seed) for seed in range(NUM_TRIALS))
    p_value = chi_square_p_value(counts, joint, NUM_TRIALS)
    worst = sorted(joint, key=lambda k: -abs(counts[k] - joint[k] * NUM_TRIALS))[:3]
    assert p_value > MIN_P_VALUE, [(k, counts[k], round(joint[k] * NUM_TRIALS)) for k in worst]


def test_chain_rounds_reject_often_enough_to_matter(tiny_pair):
    """The statistical test above only probes the residual if drafts are often rejected."""
    num_rejected = sum(len(chain_round(tiny_pair, (), seed, num_drafts=2)) <= 2 for seed in range(1000))
    assert 100 < num_rejected < 900
