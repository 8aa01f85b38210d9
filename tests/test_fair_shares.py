"""Fair shares of a step, end to end over real gRPC: cut rounds stay lossless, and the reply says
how many draft nodes were verified (scheduler/batcher.py, server/engine.py)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from harness import ServerThread
from raw_edge import PROMPT, Edge
from reference import greedy_decode
from specedge import wire
from specedge.edge_client import generation
from specedge.edge_client.client import EdgeClient
from specedge.edge_client.drafting.base import TreeBudget
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.scheduler import BatcherConfig
from specedge.server.app import ServerConfig
from specedge.server.engine import EngineConfig
from specedge.v1 import specedge_pb2 as pb
from test_rejection import MIN_P_VALUE, TARGET_PARAMS, TinyPair, chi_square_p_value, exact_joint

MAX_NEW = 40


def fair_server(model_dir, step_tokens: int, *, per_identity: bool = False, **engine) -> ServerThread:
    """A tiny server whose every step carries at most `step_tokens` tokens (a fixed budget, not the knee)."""
    config = EngineConfig(batcher=BatcherConfig(step_tokens=step_tokens), **engine)
    return ServerThread(
        ServerConfig(model=str(model_dir), port=0, max_context=256, engine=config, metrics_per_identity=per_identity)
    )


@pytest.fixture(scope="module")
def fingerprint(tiny_target_dir) -> pb.TokenizerFingerprint:
    return wire.fingerprint_to_proto(HFTokenizer(tiny_target_dir).fingerprint)


@pytest.fixture(scope="module")
def expected(reference_model, tiny_target_dir) -> list[int]:
    return greedy_decode(reference_model, PROMPT, MAX_NEW, set(HFTokenizer(tiny_target_dir).eos_token_ids))


async def drive(edge: Edge, expected: list[int], draft_round) -> tuple[list[int], list[tuple[int, pb.VerifyResponse]]]:
    """One greedy session: each round's draft from draft_round(the target's own next tokens); the
    tokens committed, and every round's (nodes sent, reply)."""
    opened = await edge.open(max_new_tokens=MAX_NEW)
    tokens = [opened.first_token_id]
    rounds = []
    finished = opened.finish_reason != pb.FINISH_REASON_NONE
    while not finished:
        drafts, parents = draft_round(expected[len(tokens) : len(tokens) + 8])
        reply = await edge.verify(opened.session_id, drafts, parents, num_generated=len(tokens))
        rounds.append((len(drafts), reply))
        tokens += reply.token_ids
        finished = reply.finish_reason != pb.FINISH_REASON_NONE
    await edge.close(opened.session_id)
    return tokens, rounds


def right_chain(right: list[int]) -> tuple[list[int], list[int]]:
    return right, []


def tree_with_a_wrong_first_child(right: list[int]) -> tuple[list[int], list[int]]:
    """root -> wrong, root -> right[0] -> right[1] -> ...: nodes 1 (wrong), 2, 3, ... (parents 0, 0, 2, 3, ...)."""
    if not right:
        return [], []
    wrong = (right[0] + 1) % 384
    return [wrong, *right], [0, 0, *range(2, len(right) + 1)]


@pytest.mark.parametrize("draft_round", [right_chain, tree_with_a_wrong_first_child], ids=["chain", "tree"])
def test_cut_rounds_are_greedy_identical_and_the_reply_says_what_was_verified(
    tiny_target_dir, fingerprint, expected, draft_round
):
    step = 4  # the pending token and at most 3 draft nodes
    with fair_server(tiny_target_dir, step) as server:

        async def run():  # the channel must be made on the loop that uses it
            return await drive(Edge(server.address, fingerprint), expected, draft_round)

        tokens, rounds = asyncio.run(run())
        stats = server.server.stats
    assert tokens == expected
    assert any(sent > step - 1 for sent, _ in rounds)  # rounds were cut...
    for sent, reply in rounds:
        assert reply.HasField("num_verified_nodes")
        assert reply.num_verified_nodes == min(sent, step - 1)  # ...to their first nodes
        assert reply.advised_draft_tokens <= step - 1  # and the advice says not to send more
        if draft_round is right_chain and sent >= step - 1 and reply.finish_reason == pb.FINISH_REASON_NONE:
            assert tuple(reply.accepted_nodes) == (1, 2, 3)  # all verified nodes were right
        if draft_round is tree_with_a_wrong_first_child and sent >= step - 1:
            assert tuple(reply.accepted_nodes) == (2, 3)[: len(reply.token_ids) - 1]  # the right branch, cut at 3
    assert stats.num_cut_nodes == sum(sent - reply.num_verified_nodes for sent, reply in rounds)
    assert stats.num_verified_tokens == sum(1 + reply.num_verified_nodes for _, reply in rounds)


def test_a_heavy_neighbour_is_cut_to_its_share_and_both_stay_lossless(tiny_target_dir, fingerprint, expected):
    """A: empty drafts. B: four sessions of 64 wrong draft nodes. Both get the target's greedy answer."""
    step = 16

    def empty(right):
        return [], []

    def wrong_chain(right):
        return [(t + 1) % 384 for t in right] * 8, []  # 64 nodes at most, never right

    with fair_server(tiny_target_dir, step, per_identity=True, max_sessions=5) as server:

        async def run():
            a, b = Edge(server.address, fingerprint), Edge(server.address, fingerprint)  # two connections
            return await asyncio.gather(drive(a, expected, empty), *(drive(b, expected, wrong_chain) for _ in range(4)))

        (a_tokens, a_rounds), *b_runs = asyncio.run(run())
        stats = server.server.stats
    assert a_tokens == expected and all(tokens == expected for tokens, _ in b_runs)
    assert all(reply.num_verified_nodes == 0 for _, reply in a_rounds)
    b_rounds = [r for _, rounds in b_runs for r in rounds]
    assert all(reply.num_verified_nodes <= step - 1 for _, reply in b_rounds)
    assert sum(sent - reply.num_verified_nodes for sent, reply in b_rounds) == stats.num_cut_nodes > 0
    # By identity (the operator asked): A ran 1 token a round and lost nothing; every cut node was B's.
    assert sorted(stats.verified_tokens_by_identity.values()) == sorted(
        [len(a_rounds), sum(1 + reply.num_verified_nodes for _, reply in b_rounds)]
    )
    assert sorted(stats.cut_nodes_by_identity.values()) == [0, stats.num_cut_nodes]


NUM_TRIALS = 3000


def test_cut_sampled_chains_follow_the_targets_joint(tiny_target_dir, tiny_draft_dir, fingerprint):
    """Chains of 3 nodes drawn from q, verified by rejection sampling on a step of 2 tokens: the
    server verifies only node 1, so t2 is node 1 accepted or the residual's draw. (t1, t2) must
    follow the target's own joint p(t1 | prompt) p(t2 | prompt, t1) (see tests/test_rejection.py)."""
    pair = TinyPair(tiny_target_dir, tiny_draft_dir, prompt=[1])  # a one-token prompt: one prefill step
    sampling = dict(temperature=TARGET_PARAMS.temperature, top_k=TARGET_PARAMS.top_k)
    with fair_server(tiny_target_dir, 2) as server:

        async def run():
            edge = Edge(server.address, fingerprint)
            counts, rejected = collections.Counter(), 0
            for seed in range(NUM_TRIALS):
                opened = await edge.open(prompt=pair.prompt, max_new_tokens=2, seed=seed, **sampling)
                first = opened.first_token_id
                drafts, dists = [], []
                for _ in range(3):
                    token, q = pair.draft((first, *drafts), seed)
                    drafts.append(token)
                    dists.append(q)
                reply = await edge.verify(opened.session_id, drafts, num_generated=1, dists=wire.dists_to_proto(dists))
                assert reply.num_verified_nodes == 1
                counts[(first, reply.token_ids[0])] += 1
                rejected += not reply.accepted_nodes
                await edge.close(opened.session_id)
            return counts, rejected

        counts, rejected = asyncio.run(run())
    assert 0.1 * NUM_TRIALS < rejected < 0.9 * NUM_TRIALS  # the residual is drawn from often enough to matter
    joint = exact_joint(pair)
    p_value = chi_square_p_value(counts, joint, NUM_TRIALS)
    worst = sorted(joint, key=lambda k: -abs(counts[k] - joint[k] * NUM_TRIALS))[:3]
    assert p_value > MIN_P_VALUE, [(k, counts[k], round(joint[k] * NUM_TRIALS)) for k in worst]


# --- the edges follow the advice, so a well-behaved edge is never cut ----------------------------


def generate_within_advice(server, tokenizer, prompt, drafter, **config):
    async def run():
        async with EdgeClient(server.address, tokenizer.fingerprint) as client:
            return await generation.generate(client, prompt, drafter, policy=SpeculationPolicy(**config))

    return asyncio.run(run())


def assert_drafted_within_advice(result, server, step: int) -> None:
    assert result.stats.rounds > 0 and result.stats.draft_tokens > 0
    assert result.stats.draft_tokens <= (step - 1) * result.stats.rounds  # the advice, not num_draft
    assert result.stats.cut_nodes == 0  # so nothing it sent was cut...
    assert server.server.stats.num_cut_nodes == 0  # ...as the server counts too


@pytest.mark.parametrize("tree", [None, TreeBudget(max_depth=6, max_width=2, max_nodes=12)], ids=["chain", "tree"])
def test_the_torch_edge_drafts_within_the_advice(tiny_target_dir, tiny_draft_dir, reference_model, tree):
    step = 4
    tokenizer = HFTokenizer(tiny_draft_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}])
    expected = greedy_decode(reference_model, prompt, MAX_NEW, set(tokenizer.eos_token_ids))
    drafter = TorchDrafter(tiny_draft_dir)
    try:
        with fair_server(tiny_target_dir, step) as server:
            result = generate_within_advice(
                server, tokenizer, prompt, drafter, num_draft=12, tree=tree, max_new_tokens=MAX_NEW
            )
            assert result.token_ids == expected
            assert_drafted_within_advice(result, server, step)
    finally:
        drafter.close()


@pytest.mark.real_model
def test_the_llama_cpp_edge_drafts_within_the_advice():
    """SmolLM2-135M serves as the target (torch) and drafts for itself (llama.cpp, the same GGUF)."""
    from specedge.edge_client.drafting import load_drafter
    from specedge.edge_client.tokenizer import load_tokenizer
    from specedge.registry import resolve

    try:
        resolved = resolve("smollm2-135m")
    except Exception as exc:  # the model ships in a package that may be missing
        pytest.skip(f"smollm2-135m not available: {exc}")
    step = 4
    tokenizer = load_tokenizer(resolved)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that adds."}])
    drafter = load_drafter(resolved, n_ctx=512)
    config = ServerConfig(
        model="smollm2-135m", port=0, max_context=512, engine=EngineConfig(batcher=BatcherConfig(step_tokens=step))
    )
    try:
        with ServerThread(config) as server:
            result = generate_within_advice(server, tokenizer, prompt, drafter, num_draft=12, max_new_tokens=24)
            assert_drafted_within_advice(result, server, step)
            # A dequantized Q4 target and llama.cpp's own evaluation of it agree often enough to accept drafts.
            assert result.stats.accepted_tokens > 0
    finally:
        drafter.close()
