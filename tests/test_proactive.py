"""Proactive drafting, draft trees and adaptive chains: hand-built cases, then end to end over gRPC.

Hand-built: the guesses' ranking, a hit (the pre-draft equals what a fresh
drafter drafts after the real outcome) and a miss (dropped; the drafter's KV
rolls back to the common prefix and only new tokens are evaluated). End to
end: proactive on and off, chains and trees, all equal target-only greedy.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from p_min import confident_length, keeps_an_unlikely_draw, min_prob_between
from reference import greedy_decode
from specedge.edge_client.client import ConnectionConfig, EdgeClient
from specedge.edge_client.drafting.base import DraftChain, DraftSampling, TreeBudget
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.drafting.tree import TreeGrower
from specedge.edge_client.generation import generate
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.proactive import DepthEstimator, DraftWorker, ProactiveRound, guess_outcomes
from specedge.edge_client.tokenizer import HFTokenizer

REPETITIVE = "for i in range(10):\n    print(i * i)\nfor i in range(10):\n    print(i * i)\n"


def test_guesses_rank_outcomes_by_draft_probability():
    chain = DraftChain((1, 2, 3), (0.9, 0.8, 0.3), None, (11, 12, 13), (0.05, 0.1, 0.5))
    guesses = guess_outcomes(chain, max_guesses=3)
    assert [(g.num_accepted, g.bonus) for g in guesses] == [(2, 13), (3, None), (1, 12)]
    assert [g.prob for g in guesses] == pytest.approx([0.9 * 0.8 * 0.5, 0.9 * 0.8 * 0.3, 0.9 * 0.1])
    assert len(guess_outcomes(chain, max_guesses=1)) == 1


def test_depth_follows_the_measured_wait():
    depth = DepthEstimator(smoothing=1.0)
    assert depth.tokens_per_wait(cap=8) == 8  # nothing measured: draft as far as allowed
    depth.observe_draft(seconds=0.040, num_tokens=4)  # 10 ms a token
    depth.observe_wait(0.025)
    assert depth.tokens_per_wait(cap=8) == 2  # the reply comes back in the time of 2
    depth.observe_wait(0.001)
    assert depth.tokens_per_wait(cap=8) == 1
    depth.observe_wait(1.0)
    assert depth.tokens_per_wait(cap=8) == 8


def test_tree_grower_keeps_the_likeliest_nodes_with_their_ancestors():
    grower = TreeGrower(TreeBudget(max_depth=3, max_width=2, max_nodes=3), max_nodes=3)
    level = grower.grow([0], [[10, 20]], [[0.6, 0.3]])  # a (.6), b (.3)
    assert level == [1, 2]
    grower.grow(level, [[30, 40], [50, 60]], [[0.5, 0.4], [0.9, 0.05]])  # a: c .30, d .24; b: e .27, f .015
    tree = grower.build()
    assert tree.token_ids == (10, 20, 30) and tree.parents == (0, 0, 1)  # a, b, then c (.30 beats e .27)


async def _settled(round_: ProactiveRound, num_guesses: int, depth: int, timeout_s: float = 30.0) -> None:
    """Wait until the worker drafted every guess to `depth` (tiny models draft in milliseconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = round_.predrafts
        if len(done) == num_guesses and all(len(p.chain.token_ids) == depth for p in done):
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("pre-drafting did not finish")


def test_proactive_hit_and_miss_leave_the_drafter_consistent(tiny_draft_dir, tiny_target_dir):
    prompt = HFTokenizer(tiny_draft_dir).apply_chat_template([{"role": "user", "content": "def add(a, b):"}])
    drafter = TorchDrafter(tiny_draft_dir)
    evaluated: list[int] = []
    drafter._model.register_forward_pre_hook(
        lambda module, args, kwargs: evaluated.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )

    async def scenario():
        worker = DraftWorker(drafter)
        chain = await worker.run(drafter.propose, prompt, 3)
        guesses = guess_outcomes(chain, max_guesses=2)

        # Hit: the server commits exactly what the first guess says.
        hit = ProactiveRound(worker, None, 0.0)
        hit.start(prompt, chain, guesses, depth=3)
        await _settled(hit, num_guesses=2, depth=3)
        first = hit.predrafts[0]
        predraft = await hit.finish(first.committed)
        assert predraft is first
        fresh = TorchDrafter(tiny_draft_dir).propose([*prompt, *first.committed], 3)
        assert predraft.chain.token_ids == fresh.token_ids  # what drafting after the reply would give

        # Miss: an outcome nobody guessed is dropped; the next draft rolls back, no re-prefill.
        miss = ProactiveRound(worker, None, 0.0)
        miss.start(prompt, chain, guesses, depth=3)
        await _settled(miss, num_guesses=2, depth=3)
        unguessed = (
            (chain.token_ids[0], 7) if (chain.token_ids[0], 7) not in [p.committed for p in miss.predrafts] else (9,)
        )
        assert await miss.finish(unguessed) is None
        evaluated.clear()
        context = [*prompt, *unguessed]
        after_miss = await worker.run(drafter.propose, context, 3)
        assert after_miss.token_ids == TorchDrafter(tiny_draft_dir).propose(context, 3).token_ids
        assert sum(evaluated) <= len(unguessed) + 1 + 2  # the new tokens (and the re-run last one), then the drafts
        assert drafter._cached_ids == [*context, *after_miss.token_ids[:-1]]
        await worker.close()

    asyncio.run(scenario())


def test_abandoned_predraft_stops_within_a_token(tiny_draft_dir):
    prompt = list(range(3, 40))
    drafter = TorchDrafter(tiny_draft_dir)

    async def scenario():
        worker = DraftWorker(drafter)
        chain = await worker.run(drafter.propose, prompt, 4)
        round_ = ProactiveRound(worker, None, 0.0)
        round_.start(prompt, chain, guess_outcomes(chain, 3), depth=500)  # far more than a reply takes
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        await round_.finish(())
        assert time.perf_counter() - started < 1.0
        assert all(len(p.chain.token_ids) < 500 for p in round_.predrafts)
        await worker.close()

    asyncio.run(scenario())


def test_draft_p_min_stops_chains_early(tiny_draft_dir):
    prompt = list(range(3, 40))
    drafter = TorchDrafter(tiny_draft_dir)
    drafter.propose(prompt, 1)  # the prompt is cached: both calls below evaluate alike, to the bit
    full = drafter.propose(prompt, 8)
    threshold = min_prob_between(full, quantile=0.5)  # halfway between two of its probabilities
    cut = drafter.propose(prompt, 8, min_prob=threshold)
    assert 0 < confident_length(full, threshold) < len(full.token_ids)
    assert cut.token_ids == full.token_ids[: confident_length(full, threshold)]
    assert drafter.propose(prompt, 8, min_prob=1.01).token_ids == ()


def test_predrafts_cut_sampled_chains_by_the_drafters_rule(tiny_draft_dir):
    """Drafting ahead one token per call stops where one call would: at the first position the draft
    is unsure of, whatever token was drawn there; and it is the chain a fresh call drafts."""
    prompt = list(range(3, 40))
    drafter = TorchDrafter(tiny_draft_dir)
    sampling = DraftSampling(temperature=1.0, top_k=4, seed=5)
    depth = 8

    async def scenario():
        worker = DraftWorker(drafter)
        chain = await worker.run(drafter.propose, prompt, 2, sampling)
        guesses = guess_outcomes(chain, max_guesses=3)
        # Where each guess leads when nothing stops it, and a min_prob that cuts some of those chains.
        uncut = [
            await worker.run(drafter.propose, [*prompt, *committed], depth, sampling)
            for committed in [(*chain.token_ids[: g.num_accepted], g.bonus) for g in guesses if g.bonus is not None]
        ]
        min_prob = min_prob_between(uncut[0], quantile=0.25)
        assert any(keeps_an_unlikely_draw(c, min_prob) for c in uncut)  # else the test could not tell the rules apart
        round_ = ProactiveRound(worker, sampling, min_prob)
        round_.start(prompt, chain, guesses, depth)
        await asyncio.sleep(0)  # the round's job is handed to the worker thread...
        await worker.run(lambda: None)  # ...so once that thread is free again, drafting ahead is done
        # Every guess of the server's token is drafted after; a guess that all drafts pass needs the drafter's
        # own next token, which it does not guess where it is unsure.
        assert {p.committed[-1] for p in round_.predrafts} >= {g.bonus for g in guesses if g.bonus is not None}
        for predraft in round_.predrafts:
            fresh = await worker.run(drafter.propose, [*prompt, *predraft.committed], depth, sampling)
            length = confident_length(fresh, min_prob)
            # The same draws; q may differ in the last bits (the two reuse different cached chunks).
            assert predraft.chain.token_ids == fresh.token_ids[:length]
            assert all(q.prob_of(token) > 0 for token, q in zip(predraft.chain.token_ids, predraft.chain.dists))
        await round_.finish(())
        await worker.close()

    asyncio.run(scenario())


pytestmark = pytest.mark.server_options(max_context=256, max_sessions=8, max_draft_tokens=24)


def run_edge(server, tokenizer, prompt, drafter, connection=ConnectionConfig(), **policy):
    async def run():
        async with EdgeClient(server.address, tokenizer.fingerprint, config=connection) as client:
            return await generate(client, prompt, drafter, policy=SpeculationPolicy(**policy))

    return asyncio.run(run())


@pytest.mark.parametrize("content", ["def add(a, b):", REPETITIVE, "안녕하세요"])
def test_proactive_on_and_off_equal_target_only(server, tiny_draft_dir, reference_model, content):
    tokenizer = HFTokenizer(tiny_draft_dir)
    drafter = TorchDrafter(tiny_draft_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}])
    expected = greedy_decode(reference_model, prompt, 48, set(tokenizer.eos_token_ids))
    # A 20 ms emulated round trip: time to draft ahead, as over a real network.
    common = dict(num_draft=4, max_new_tokens=48, follow_advice=False, connection=ConnectionConfig(simulated_rtt_ms=20))
    on = run_edge(server, tokenizer, prompt, drafter, **common)
    off = run_edge(server, tokenizer, prompt, drafter, **common, proactive=False)
    assert on.token_ids == off.token_ids == expected
    assert off.stats.proactive_rounds == 0
    if content == REPETITIVE:
        assert on.stats.proactive_rounds > 0 and on.stats.proactive_hits > 0
        assert 0 < on.stats.wait_hidden_share < 1


@pytest.mark.parametrize("budget", [TreeBudget(4, 2, 8), TreeBudget(6, 3, 16), TreeBudget(1, 4, 4)])
def test_tree_drafts_are_lossless(server, tiny_draft_dir, reference_model, budget):
    tokenizer = HFTokenizer(tiny_draft_dir)
    drafter = TorchDrafter(tiny_draft_dir)
    for content in ("def add(a, b):", REPETITIVE):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        expected = greedy_decode(reference_model, prompt, 40, set(tokenizer.eos_token_ids))
        result = run_edge(server, tokenizer, prompt, drafter, max_new_tokens=40, tree=budget, follow_advice=False)
        assert result.token_ids == expected
        assert result.stats.draft_tokens > result.stats.rounds  # trees carried several nodes a round
        assert result.stats.accepted_tokens > 0
