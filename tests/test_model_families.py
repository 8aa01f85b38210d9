"""Qwen3 and Llama 3.x end to end: served losslessly, drafted for by the torch edge, refused when mismatched."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness import ServerThread
from reference import greedy_decode
from specedge.edge_client import generation
from specedge.edge_client.client import EdgeClient, EdgeError
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.registry import resolve
from specedge.server.app import ServerConfig
from specedge.server.engine import EngineConfig
from specedge.server.loading import load_target
from specedge.server.random_model import PRESETS
from tiny_models import save_tiny_model

PROMPTS = [[{"role": "user", "content": "def add(a, b):"}], [{"role": "user", "content": "The quick brown fox"}]]


def answer(address, tokenizer, prompt, drafter, **policy):
    async def run():
        async with EdgeClient(address, tokenizer.fingerprint) as client:
            return await generation.generate(client, prompt, drafter, policy=SpeculationPolicy(**policy))

    return asyncio.run(run())


@pytest.mark.parametrize(("target", "draft"), [("tiny_qwen3_dir", "tiny_qwen3_draft_dir"), ("tiny_llama3_dir", None)])
def test_a_family_is_served_losslessly_and_drafted_for_by_the_torch_edge(request, target, draft):
    """Speculative (a torch drafter on the family's own HF directory) == server-only == transformers' greedy."""
    target_dir = request.getfixturevalue(target)
    draft_dir = request.getfixturevalue(draft) if draft else target_dir  # a Llama 3 target drafting for itself
    tokenizer = HFTokenizer(draft_dir)
    reference = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    drafter = TorchDrafter(draft_dir)
    config = ServerConfig(model=str(target_dir), port=0, max_context=256, engine=EngineConfig(max_sessions=2))
    try:
        with ServerThread(config) as server:
            accepted = 0
            for messages in PROMPTS:
                prompt = tokenizer.apply_chat_template(messages)
                expected = greedy_decode(reference, prompt, 40, set(tokenizer.eos_token_ids))
                speculative = answer(server.address, tokenizer, prompt, drafter, num_draft=4, max_new_tokens=40)
                assert speculative.token_ids == expected
                assert answer(server.address, tokenizer, prompt, None, max_new_tokens=40).token_ids == expected
                accepted += speculative.stats.accepted_tokens
            assert accepted > 0  # the drafter really drafted, and was right some of the time
    finally:
        drafter.close()


def test_a_qwen3_draft_with_another_vocabulary_is_refused(tiny_qwen3_dir, tmp_path):
    foreign_dir = save_tiny_model(
        tmp_path / "qwen3-foreign", seed=7, arch="qwen3", head_dim=32, vocab_size=320, tokenizer_vocab_size=320
    )
    foreign = HFTokenizer(foreign_dir)
    config = ServerConfig(model=str(tiny_qwen3_dir), port=0, max_context=64, engine=EngineConfig(max_sessions=1))
    with ServerThread(config) as server:
        with pytest.raises(EdgeError, match="draft vocab 320 != target vocab 384"):
            answer(server.address, foreign, [5, 6, 7], None, max_new_tokens=4)


def test_random_qwen3_builds_its_published_shape_and_serves_a_qwen_tokenizer_edge(tiny_draft_dir):
    """random:qwen3-tiny through the server's own loading path (the 0.6B/1.7B/8B/14B presets differ only in
    shape, checked against the published configs below without allocating them)."""
    target = load_target(
        resolve(f"random:qwen3-tiny@{tiny_draft_dir}"), device=torch.device("cpu"), dtype=torch.float32
    )
    args = target.model.args
    assert args.qk_norm and args.head_dim == 32 and target.model.model.layers[0].self_attn.q_norm is not None
    published = {  # hidden, intermediate, layers, heads, kv heads, head_dim, tied (Qwen3 / Llama 3.1 config.json)
        "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, True),
        "qwen3-1.7b": (2048, 6144, 28, 16, 8, 128, True),
        "qwen3-8b": (4096, 12288, 36, 32, 8, 128, False),
        "qwen3-14b": (5120, 17408, 40, 40, 8, 128, False),
        "llama3.1-8b": (4096, 14336, 32, 32, 8, 128, False),
    }
    for name, shape in published.items():
        preset = PRESETS[name]
        config = preset.hf_config(preset.vocab_size)
        assert (
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.tie_word_embeddings,
        ) == shape, name
    assert PRESETS["llama3.1-8b"].hf_config(128256).rope_parameters["rope_type"] == "llama3"

    tokenizer = HFTokenizer(tiny_draft_dir)
    config = ServerConfig(
        model=f"random:qwen3-tiny@{tiny_draft_dir}", port=0, max_context=128, engine=EngineConfig(max_sessions=2)
    )
    drafter = TorchDrafter(tiny_draft_dir)  # a Qwen-tokenizer edge whose drafts this random target mostly rejects
    try:
        with ServerThread(config) as server:
            prompt = tokenizer.apply_chat_template(PROMPTS[0])
            server_only = answer(server.address, tokenizer, prompt, None, max_new_tokens=24).token_ids
            assert (
                answer(server.address, tokenizer, prompt, drafter, num_draft=4, max_new_tokens=24).token_ids
                == server_only
            )
    finally:
        drafter.close()
