"""Edge -> server -> edge over real gRPC on loopback, with tiny models: lossless, isolated, precise errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from harness import ServerThread, generate
from reference import greedy_decode, marginal_p_value, second_token_marginal
from specedge import wire
from specedge.edge_client import generation
from specedge.edge_client.client import EdgeClient, EdgeError
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.server.app import ServerConfig
from specedge.server.engine import EngineConfig
from specedge.server.matmul import (
    PairPanelLinear,
    PanelLinear,
    PlainLinear,
    numba_unavailable,
    pairs_unavailable,
    panels_here,
    resolve_matmul,
)
from specedge.types import FinishReason, SamplingParams
from specedge.v1 import specedge_pb2 as pb
from specedge.v1 import specedge_pb2_grpc

# With the tiny target these end early on EOS, late on EOS, and on the length limit.
PROMPTS = [
    [{"role": "user", "content": "def add(a, b):"}],
    [{"role": "user", "content": "The quick brown fox"}],
    [{"role": "user", "content": "print(i * i)"}],
    [{"role": "user", "content": "안녕하세요"}],
]


pytestmark = pytest.mark.server_options(max_sessions=6, max_draft_tokens=16)


def test_flex_attention_server_is_lossless(tiny_target_dir, tokenizer, drafter, reference_model):
    """The CUDA attention path (one FlexAttention call per step), forced on a CPU server: speculative and
    server-only answers still equal target-only decoding, token for token."""
    config = ServerConfig(
        model=str(tiny_target_dir), port=0, max_context=128, attention="flex", engine=EngineConfig(max_sessions=2)
    )
    with ServerThread(config) as flex_server:
        for messages in PROMPTS[:2]:
            prompt = tokenizer.apply_chat_template(messages)
            expected = greedy_decode(reference_model, prompt, 24, set(tokenizer.eos_token_ids))
            assert (
                generate(flex_server, tokenizer, prompt, drafter, num_draft=4, max_new_tokens=24).token_ids == expected
            )
            assert generate(flex_server, tokenizer, prompt, None, max_new_tokens=24).token_ids == expected


@pytest.mark.parametrize("matmul", ["auto", "numba", "onednn-numba"])
def test_bfloat16_server_is_lossless_against_itself(tiny_target_dir, tokenizer, drafter, matmul):
    """--dtype bfloat16 (oneDNN's bf16 kernels where the CPU has them; with `numba`, the numba products, on CPUs
    with AVX512_BF16; with `onednn-numba`, both over oneDNN's layout, without AMX) changes the target's numerics,
    so its answers are compared with its own server-only decoding: speculative equals server-only, token for
    token. Attention takes the numba kernel in all."""
    if matmul == "numba" and (reason := numba_unavailable(torch.device("cpu"), torch.bfloat16)):
        pytest.skip(reason)
    if matmul == "onednn-numba" and (reason := pairs_unavailable(torch.device("cpu"), torch.bfloat16)):
        pytest.skip(reason)
    config = ServerConfig(
        model=str(tiny_target_dir),
        port=0,
        max_context=128,
        dtype="bfloat16",
        matmul=matmul,
        engine=EngineConfig(max_sessions=2),
    )
    with ServerThread(config) as bf16_server:
        runner = bf16_server.server.engine.stepper.runner
        assert runner.kv.k[0].dtype == torch.bfloat16 and runner.model.attention == "numba"
        head = runner.model.lm_head
        resolved = resolve_matmul(matmul, torch.device("cpu"), torch.bfloat16)
        assert isinstance(head, PairPanelLinear) == (resolved == "onednn-numba")
        if resolved == "numba":  # bfloat16's panels where they run
            assert isinstance(head, PanelLinear if panels_here(torch.bfloat16) else PlainLinear)
        for messages in PROMPTS:
            prompt = tokenizer.apply_chat_template(messages)
            server_only = generate(bf16_server, tokenizer, prompt, None, max_new_tokens=32).token_ids
            for num_draft in (2, 5):
                speculative = generate(bf16_server, tokenizer, prompt, drafter, num_draft=num_draft, max_new_tokens=32)
                assert speculative.token_ids == server_only, num_draft


@pytest.mark.parametrize("num_draft", [1, 2, 4, 8])
def test_greedy_speculative_equals_target_only(server, tokenizer, drafter, reference_model, num_draft):
    rounds = accepted = generated = 0
    for messages in PROMPTS:
        prompt = tokenizer.apply_chat_template(messages)
        expected = greedy_decode(reference_model, prompt, 40, set(tokenizer.eos_token_ids))
        speculative = generate(server, tokenizer, prompt, drafter, num_draft=num_draft, max_new_tokens=40)
        server_only = generate(server, tokenizer, prompt, None, max_new_tokens=40)
        assert speculative.token_ids == expected
        assert server_only.token_ids == expected
        assert speculative.stats.draft_tokens <= num_draft * speculative.stats.rounds
        rounds, accepted = rounds + speculative.stats.rounds, accepted + speculative.stats.accepted_tokens
        generated += len(expected) - 1  # tokens after the first come from verify rounds
    assert accepted > 0
    # Each round commits its accepted drafts + one target token, except a last
    # round cut short by EOS or the length limit (at most one per prompt).
    assert rounds + accepted - len(PROMPTS) <= generated <= rounds + accepted


def test_four_edges_at_once_are_each_lossless(server, tokenizer, tiny_draft_dir, reference_model):
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"edge {i} says hi"}]) for i in range(4)]
    drafters = [TorchDrafter(tiny_draft_dir) for _ in prompts]

    async def run():
        policy = SpeculationPolicy(num_draft=4, max_new_tokens=48)
        async with EdgeClient(server.address, tokenizer.fingerprint) as client:
            return await asyncio.gather(
                *(generation.generate(client, p, d, policy=policy) for p, d in zip(prompts, drafters))
            )

    results = asyncio.run(run())
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_decode(reference_model, prompt, 48, set(tokenizer.eos_token_ids))
    assert not server.server.engine.sessions  # every slot was given back


def test_seeded_sampling_by_matching_samples_equals_seeded_server_only(server, tokenizer, drafter):
    """Without q, verification matches the target's position-keyed samples: the seeded run is the target's own."""
    prompt = tokenizer.apply_chat_template(PROMPTS[0])
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50)
    common = dict(sampling=sampling, max_new_tokens=40, rejection_sampling=False)
    runs = [generate(server, tokenizer, prompt, drafter, seed=7, **common) for _ in range(2)]
    server_only = generate(server, tokenizer, prompt, None, sampling=sampling, seed=7, max_new_tokens=40)
    other_seed = generate(server, tokenizer, prompt, drafter, seed=8, **common)
    assert runs[0].token_ids == runs[1].token_ids == server_only.token_ids
    assert other_seed.token_ids != runs[0].token_ids


def test_seeded_sampling_with_rejection_on_is_drafted_coupled_and_equals_seeded_server_only(server, tokenizer, drafter):
    """A seed overrides rejection sampling: coupled drafts, verified by matching (tests/test_seeded_coupling.py)."""
    prompt = tokenizer.apply_chat_template(PROMPTS[0])
    sampling = SamplingParams(temperature=0.9, top_k=50)
    runs = [
        generate(server, tokenizer, prompt, drafter, seed=7, sampling=sampling, max_new_tokens=40, num_draft=k)
        for k in (2, 5)
    ]
    server_only = generate(server, tokenizer, prompt, None, sampling=sampling, seed=7, max_new_tokens=40)
    assert runs[0].token_ids == runs[1].token_ids == server_only.token_ids
    assert runs[0].stats.accepted_tokens > 0


def test_max_tokens_and_finish_reason(server, tokenizer, drafter):
    prompt = tokenizer.apply_chat_template(PROMPTS[1])
    result = generate(server, tokenizer, prompt, drafter, num_draft=8, max_new_tokens=5)
    assert len(result.token_ids) <= 5
    assert result.finish in (FinishReason.LENGTH, FinishReason.STOP)
    assert result.finish is FinishReason.STOP or len(result.token_ids) == 5


def test_incompatible_draft_is_refused_on_both_sides(server, tiny_foreign_dir):
    foreign = HFTokenizer(tiny_foreign_dir)
    with pytest.raises(EdgeError, match="draft vocab 320 != target vocab 384"):
        generate(server, foreign, [5, 6, 7], None)

    # A client that skips its own check still gets FAILED_PRECONDITION from the server.
    async def raw_open():
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = specedge_pb2_grpc.SpecEdgeStub(channel)
            await stub.OpenSession(
                pb.OpenSessionRequest(
                    tokenizer=wire.fingerprint_to_proto(foreign.fingerprint), prompt_token_ids=[5], max_new_tokens=4
                )
            )

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(raw_open())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "draft vocab 320 != target vocab 384" in info.value.details()


def test_unreachable_server_gives_an_actionable_error(tokenizer):
    class Nowhere:
        address = "127.0.0.1:9"  # discard port: nothing listens

    with pytest.raises(EdgeError, match="cannot reach the server at 127.0.0.1:9"):
        generate(Nowhere, tokenizer, [5, 6], None)


def test_sampled_speculative_output_follows_the_target_distribution(
    server, tokenizer, drafter, reference_model, monkeypatch
):
    """The 2nd token (decided by a verify round, by rejection) over many unseeded runs vs the target's marginal.

    Unseeded, so the edge sends q; the random seeds both sides pick come from a seeded generator, so the
    test is deterministic (a seeded request would be drafted coupled and verified by matching instead).
    """
    import random
    import secrets

    monkeypatch.setattr(secrets, "randbits", random.Random(0).getrandbits)

    prompt = tokenizer.apply_chat_template(PROMPTS[2])
    sampling = SamplingParams(temperature=1.0, top_k=4)
    marginal = second_token_marginal(reference_model, prompt, sampling)
    num_runs = 400

    async def run():
        policy = SpeculationPolicy(num_draft=4, max_new_tokens=2, sampling=sampling)
        async with EdgeClient(server.address, tokenizer.fingerprint) as client:
            results = []
            for _ in range(num_runs):
                results.append(await generation.generate(client, prompt, drafter, policy=policy))
            return results

    results = asyncio.run(run())
    seconds = [r.token_ids[1] for r in results if len(r.token_ids) == 2]
    assert len(seconds) == num_runs  # the first token is never EOS here
    assert sum(r.stats.accepted_tokens for r in results) > 0  # some 2nd tokens came from accepted drafts
    assert marginal_p_value(seconds, marginal) > 1e-3
