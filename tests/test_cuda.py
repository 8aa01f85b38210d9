"""The server on a CUDA device: what only a GPU can check. Skipped where torch sees none (as in CI).

On a GPU machine: `pytest tests/test_cuda.py tests/test_cuda_graphs.py`. The tiny target's greedy choices lead
by wide margins (tests/tiny_models.py), so a float32 server on the GPU must give the CPU reference's tokens.
"""

from __future__ import annotations

import asyncio
import random
import secrets

import pytest
import torch

from harness import ServerThread, generate
from reference import greedy_decode, marginal_p_value, second_token_marginal
from specedge import noise
from specedge.edge_client import generation
from specedge.edge_client.client import EdgeClient
from specedge.edge_client.drafting.base import TreeBudget
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.policy import SpeculationPolicy
from specedge.server.app import ServerConfig
from specedge.server.engine import EngineConfig
from specedge.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [
    [{"role": "user", "content": "def add(a, b):"}],
    [{"role": "user", "content": "The quick brown fox"}],
    [{"role": "user", "content": "print(i * i)"}],
]


def cuda_server(model_dir, **options) -> ServerThread:
    """A float32 server on the GPU. torch.compile's caches are cleared first, so that each server compiles (and
    captures) as the first one of its own process would: the servers of earlier tests share the process."""
    torch._dynamo.reset()
    config = dict(device="cuda", dtype="float32", max_context=256, port=0, engine=EngineConfig(max_sessions=8))
    return ServerThread(ServerConfig(model=str(model_dir), **{**config, **options}))


def test_noise_bits_are_the_cpus_on_cuda():
    """The noise is a hash in integer ops: the GPU must give the CPU's bits, token for token."""
    from specedge.server.sampling import gumbel, token_bits

    keys = torch.tensor([noise.row_key(s, p, noise.TARGET_STREAM) for s in (0, 7, 2**63 - 1) for p in (0, 1, 99_999)])
    tokens = torch.arange(0, 151_936, 37)
    for table in (keys[:, None], tokens[None]), (keys, tokens[: len(keys)]):  # table lookup, then direct hash
        cpu = token_bits(*table)
        assert torch.equal(token_bits(*(t.cuda() for t in table)).cpu(), cpu)
    on_cuda = gumbel(keys[:, None].cuda(), tokens[None].cuda()).cpu()
    torch.testing.assert_close(on_cuda, gumbel(keys[:, None], tokens[None]))  # log() may differ by an ulp


def test_sampling_on_cuda_draws_the_cpus_tokens():
    from specedge.server.sampling import sample

    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(1)) * 3
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=50, top_p=0.9)):
        for seed in range(3):
            positions = range(40, 56)
            assert sample(logits.cuda(), positions, params, seed) == sample(logits, positions, params, seed)


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_greedy_on_cuda_is_the_targets_own_decoding(tiny_target_dir, tokenizer, drafter, reference_model, cuda_graphs):
    """Speculative (chain and tree drafts) and server-only answers on the GPU equal target-only decoding."""
    accepted = 0
    with cuda_server(tiny_target_dir, cuda_graphs=cuda_graphs) as server:
        runner = server.server.engine.stepper.runner
        assert runner.device.type == "cuda" and runner.model.attention == "flex"
        assert (type(runner).__name__ == "GraphedRunner") == cuda_graphs
        for messages in PROMPTS:
            prompt = tokenizer.apply_chat_template(messages)
            expected = greedy_decode(reference_model, prompt, 40, set(tokenizer.eos_token_ids))
            assert generate(server, tokenizer, prompt, None, max_new_tokens=40).token_ids == expected
            chain = generate(server, tokenizer, prompt, drafter, num_draft=4, max_new_tokens=40)
            assert chain.token_ids == expected
            accepted += chain.stats.accepted_tokens
            tree = TreeBudget(max_depth=4, max_width=2, max_nodes=8)
            assert generate(server, tokenizer, prompt, drafter, tree=tree, max_new_tokens=40).token_ids == expected
    assert accepted > 0


def test_edges_batched_on_cuda_are_each_lossless(tiny_target_dir, tokenizer, tiny_draft_dir, reference_model):
    """Eight edges at once: their rounds share the GPU's steps (and graph buckets), and each stays lossless."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"edge {i} says hi"}]) for i in range(8)]
    drafters = [TorchDrafter(tiny_draft_dir) for _ in prompts]

    async def run(address):
        policy = SpeculationPolicy(num_draft=4, max_new_tokens=48)
        async with EdgeClient(address, tokenizer.fingerprint) as client:
            return await asyncio.gather(
                *(generation.generate(client, p, d, policy=policy) for p, d in zip(prompts, drafters))
            )

    with cuda_server(tiny_target_dir) as server:
        results = asyncio.run(run(server.address))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_decode(reference_model, prompt, 48, set(tokenizer.eos_token_ids))


def test_bfloat16_on_cuda_answers_and_repeats_itself(tiny_target_dir, tokenizer, drafter):
    """bfloat16 changes the target's numerics, and on a GPU its kernels round differently for different step
    shapes, so a speculative answer need not equal a server-only one (README, "Lossless"). What holds: the
    server runs in bfloat16, speculates, and the same request gives the same answer again."""
    with cuda_server(tiny_target_dir, dtype="bfloat16") as server:
        assert server.server.engine.stepper.runner.kv.k[0].dtype == torch.bfloat16
        prompt = tokenizer.apply_chat_template(PROMPTS[0])
        alone = [generate(server, tokenizer, prompt, None, max_new_tokens=40).token_ids for _ in range(2)]
        fixed = dict(num_draft=4, follow_advice=False, proactive=False, max_new_tokens=40)  # the same steps each time
        drafted = [generate(server, tokenizer, prompt, drafter, **fixed) for _ in range(2)]
    assert alone[0] == alone[1] and len(alone[0]) > 0
    assert drafted[0].token_ids == drafted[1].token_ids
    assert drafted[0].stats.rounds > 0


def test_sampling_on_cuda_follows_the_target(tiny_target_dir, tokenizer, drafter, reference_model, monkeypatch):
    """Seeded: speculative equals server-only on the GPU. Unseeded, by rejection: the second token over many
    runs follows the target's marginal (chi-square), as tests/test_end_to_end.py checks on the CPU."""
    monkeypatch.setattr(secrets, "randbits", random.Random(0).getrandbits)
    prompt = tokenizer.apply_chat_template(PROMPTS[2])
    sampling = SamplingParams(temperature=1.0, top_k=4)
    marginal = second_token_marginal(reference_model, prompt, sampling)
    num_runs = 400

    async def many(address):
        policy = SpeculationPolicy(num_draft=4, max_new_tokens=2, sampling=sampling)
        async with EdgeClient(address, tokenizer.fingerprint) as client:
            return [await generation.generate(client, prompt, drafter, policy=policy) for _ in range(num_runs)]

    with cuda_server(tiny_target_dir) as server:
        seeded = dict(sampling=SamplingParams(temperature=0.9, top_k=50), seed=7, max_new_tokens=40)
        alone = generate(server, tokenizer, prompt, None, **seeded).token_ids
        assert generate(server, tokenizer, prompt, drafter, num_draft=4, **seeded).token_ids == alone
        results = asyncio.run(many(server.address))
    seconds = [r.token_ids[1] for r in results]
    assert len(seconds) == num_runs and sum(r.stats.accepted_tokens for r in results) > 0
    assert marginal_p_value(seconds, marginal) > 1e-3
