"""Seeded sampled requests: drafted coupled to the target's noise, verified by matching, reproducible.

A seeded request's draft at sequence index i races with the very noise the
server samples index i with (edge_client/drafting/coupled.py), and no q is
sent, so the server matches its own seeded samples: the answer is the seeded
server-only answer whatever the drafts, the draft length or the advice. An
unseeded sampled request still sends q and goes by rejection sampling.
"""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys

import pytest
import torch

from harness import ServerThread
from specedge.edge_client import generation
from specedge.edge_client.client import EdgeClient
from specedge.edge_client.drafting.base import CoupledSampling
from specedge.edge_client.drafting.coupled import draw_coupled
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.server.app import ServerConfig
from specedge.server.engine import EngineConfig
from specedge.server.sampling import sample
from specedge.types import SamplingParams

SAMPLINGS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.5, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.9, top_p=0.95, top_k=50),
]


pytestmark = pytest.mark.server_options(max_sessions=4, max_draft_tokens=16)


@pytest.fixture(scope="module")
def tokenizer(tiny_draft_dir):
    return HFTokenizer(tiny_draft_dir)


@pytest.fixture(scope="module")
def drafters(tiny_draft_dir, tiny_target_dir):
    """The tiny draft model, and the target itself as one (its coupled drafts are the target's own samples)."""
    made = {"draft": TorchDrafter(tiny_draft_dir), "target": TorchDrafter(tiny_target_dir)}
    yield made
    for drafter in made.values():
        drafter.close()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}])


class RecordingClient(EdgeClient):
    """Keeps every verify round's request and reply."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    async def verify(self, session_id, draft):
        reply = await super().verify(session_id, draft)
        self.rounds.append((draft, reply))
        return reply


def generate(server, tokenizer, prompt, drafter, **config):
    async def run():
        async with RecordingClient(server.address, tokenizer.fingerprint) as client:
            return await generation.generate(client, prompt, drafter, policy=SpeculationPolicy(**config)), client.rounds

    return asyncio.run(run())


# --- the coupling lines up with the server's race ----------------------------------------------


@pytest.mark.parametrize("params", SAMPLINGS)
def test_draw_coupled_is_the_servers_race_on_the_same_logits(params):
    """Same logits, seed and position: the edge's coupled draw is the server's sample, every time."""
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(0)) * 3  # [N, V]
    positions = list(range(100, 164))
    for seed in (0, 7, 2**63 + 5):
        expected = sample(logits, positions, params, seed)
        drawn = [draw_coupled(row.numpy(), CoupledSampling(params, seed), p) for row, p in zip(logits, positions)]
        assert drawn == expected
    assert len(set(expected)) > 10  # a real race, not an argmax


@pytest.mark.parametrize("params", SAMPLINGS)
def test_torch_coupled_chain_with_the_targets_weights_is_the_targets_own_sample(reference_model, drafters, params):
    context = [5, 17, 40, 9]
    for seed in range(10):
        chain = drafters["target"].propose(context, 6, CoupledSampling(params, seed))
        assert chain.dists is None  # nothing for a rejection test: the server matches
        sequence = [*context, *chain.token_ids]
        with torch.inference_mode():
            logits = reference_model(torch.tensor([sequence])).logits[0, len(context) - 1 : -1]  # [6, V]
        # Draft token j lands at sequence index len(context) + j, where the server samples it.
        assert list(chain.token_ids) == sample(logits, range(len(context), len(sequence)), params, seed)


# --- end to end over gRPC ----------------------------------------------------------------------


@pytest.mark.parametrize("proactive", [True, False])
def test_seeded_speculative_answer_equals_seeded_server_only(server, tokenizer, prompt, drafters, proactive):
    """Rejection sampling on (the default): a seeded request is still drafted coupled, and is the target's own."""
    sampling = SamplingParams(temperature=0.8)
    answer, rounds = generate(
        server, tokenizer, prompt, drafters["draft"], sampling=sampling, seed=7, max_new_tokens=40, proactive=proactive
    )
    server_only, _ = generate(server, tokenizer, prompt, None, sampling=sampling, seed=7, max_new_tokens=40)
    assert answer.token_ids == server_only.token_ids
    assert answer.stats.accepted_tokens > 0
    assert all(not draft.dists for draft, _ in rounds)  # verified by matching


def test_seeded_request_is_the_same_whatever_the_draft_length_or_advice(server, tokenizer, prompt, drafters):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50)
    common = dict(sampling=sampling, max_new_tokens=40)
    runs = [
        generate(server, tokenizer, prompt, drafters["draft"], seed=11, **common, **options)[0]
        for options in (
            dict(num_draft=1, follow_advice=False),
            dict(num_draft=3, follow_advice=False, proactive=False),
            dict(num_draft=8, follow_advice=True),
        )
    ]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert len({run.stats.draft_tokens for run in runs}) > 1  # the drafts really differed
    other_seed, _ = generate(server, tokenizer, prompt, drafters["draft"], seed=12, **common)
    assert other_seed.token_ids != runs[0].token_ids


def test_a_draft_model_equal_to_the_target_has_every_coupled_draft_accepted(server, tokenizer, prompt, drafters):
    """The coupling's positions line up: with the target's own weights, a coupled draft is its sample."""
    answer, rounds = generate(
        server,
        tokenizer,
        prompt,
        drafters["target"],
        sampling=SamplingParams(temperature=0.8),
        seed=3,
        max_new_tokens=60,
        num_draft=4,
        follow_advice=False,
        proactive=False,
    )
    assert len(rounds) > 3
    # Every round but the last (a stop or the length limit may cut it) accepts every draft.
    for draft, reply in rounds[:-1]:
        assert len(reply.accepted_nodes) == len(draft.token_ids) > 0
    assert answer.stats.accepted_tokens >= answer.stats.draft_tokens - 4


def test_a_seeded_answer_resumed_after_a_lost_session_equals_server_only(server, tokenizer, prompt, drafters):
    """The re-opened session (prompt + committed tokens) samples with the same seed at the same positions."""

    class LosingClient(EdgeClient):
        lost = False

        async def verify(self, session_id, draft):
            if self.rounds_seen == 3 and not self.lost:
                self.lost = True
                await self.close_session(session_id)  # the next call meets NOT_FOUND: resume
            self.rounds_seen += 1
            return await super().verify(session_id, draft)

    sampling = SamplingParams(temperature=0.8, top_k=40)

    async def run():
        policy = SpeculationPolicy(sampling=sampling, seed=21, max_new_tokens=40)
        async with LosingClient(server.address, tokenizer.fingerprint) as client:
            client.rounds_seen = 0
            return await generation.generate(client, prompt, drafters["draft"], policy=policy)

    answer = asyncio.run(run())
    server_only, _ = generate(server, tokenizer, prompt, None, sampling=sampling, seed=21, max_new_tokens=40)
    assert answer.stats.resumes == 1
    assert answer.token_ids == server_only.token_ids


def test_unseeded_sampled_chains_still_go_by_rejection(server, tokenizer, prompt, drafters):
    answer, rounds = generate(
        server, tokenizer, prompt, drafters["draft"], sampling=SamplingParams(temperature=0.8), max_new_tokens=24
    )
    drafted = [draft for draft, _ in rounds if draft.token_ids]
    assert drafted and all(len(draft.dists) == len(draft.token_ids) for draft in drafted)  # q sent with each draft


# --- the llama.cpp drafter ---------------------------------------------------------------------


@pytest.mark.real_model
def test_llama_cpp_seeded_speculative_answer_equals_seeded_server_only():
    """SmolLM2-135M as the target (dequantized on the server) and as the llama.cpp draft."""
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter
    from specedge.edge_client.tokenizer import GGUFTokenizer
    from specedge.registry import resolve

    path = pathlib.Path(resolve("smollm2-135m").path)
    config = ServerConfig(model=str(path), port=0, max_context=512, engine=EngineConfig(max_sessions=2))
    tokenizer = GGUFTokenizer(path)
    prompt = tokenizer.encode("def fibonacci(n):")
    drafter = LlamaCppDrafter(path, n_ctx=512)
    try:
        with ServerThread(config) as running:
            sampling = SamplingParams(temperature=0.8)
            answer, rounds = generate(running, tokenizer, prompt, drafter, sampling=sampling, seed=5, max_new_tokens=32)
            server_only, _ = generate(running, tokenizer, prompt, None, sampling=sampling, seed=5, max_new_tokens=32)
    finally:
        drafter.close()
    assert answer.token_ids == server_only.token_ids
    assert all(not draft.dists for draft, _ in rounds)
    assert answer.stats.accepted_tokens > answer.stats.draft_tokens / 2  # the same weights: the races mostly agree


def test_the_coupling_needs_no_torch():
    """The llama.cpp edge drafts coupled with numpy and noise.py alone."""
    code = "import sys; sys.modules['torch'] = None; from specedge.edge_client.drafting import coupled, llama_cpp"
    subprocess.run([sys.executable, "-c", code], check=True)
