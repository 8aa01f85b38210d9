"""The compact model against transformers' own, on the same tiny weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specedge.registry import ResolvedModel
from specedge.server.loading import load_target
from specedge.server.runner import ForwardRequest, KVCache, ModelRunner

ATOL = 1e-4


def _runner(model_dir, num_slots=4, max_len=128, matmul="eager", attention="auto"):
    resolved = ResolvedModel("tiny", "hf", model_dir)
    target = load_target(resolved, device=torch.device("cpu"), dtype=torch.float32, matmul=matmul, attention=attention)
    assert target.matmul == matmul
    kv = KVCache(target.model, num_slots=num_slots, max_len=max_len, device=torch.device("cpu"), dtype=torch.float32)
    return ModelRunner(target.model, kv)


def _hf_logits(model_dir, token_ids):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]


# Qwen2, Llama 2-style, Qwen3 (q/k norms, decoupled head_dim) and Llama 3.x (llama3 RoPE, tied embeddings).
FAMILIES = ["tiny_target_dir", "tiny_llama_dir", "tiny_qwen3_dir", "tiny_llama3_dir"]


# Every matrix path (server/matmul.py). numba's kernel takes products of up to 48 rows and oneDNN's GEMM larger
# ones: the 67-token prefill below runs the latter, the steps after it the former.
MATMULS = ["eager", "numba", "onednn"]
# Both CPU attention paths (server/attention.py): numba takes rows of up to 16 new tokens, the row loop the rest.
ATTENTIONS = ["rows", "numba"]


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("fixture", FAMILIES)
def test_prefill_logits_match_transformers(request, fixture, matmul):
    model_dir = request.getfixturevalue(fixture)
    tokens = list(range(3, 70))  # past the Llama 3 fixture's original context of 32
    runner = _runner(model_dir, matmul=matmul)
    [ours] = runner.forward([ForwardRequest(slot=1, num_cached=0, token_ids=tuple(tokens))])
    torch.testing.assert_close(ours, _hf_logits(model_dir, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("fixture", FAMILIES)
def test_sessions_of_different_lengths_in_one_batch(request, fixture, matmul, attention):
    """Each row sees only its own slot: batching must not change any row's logits."""
    tiny_target_dir = request.getfixturevalue(fixture)
    a, b = list(range(5, 50)), list(range(100, 108))
    runner = _runner(tiny_target_dir, matmul=matmul, attention=attention)
    # Prefill both, then one step each in a single mixed batch (a decode + a 4-token chain).
    runner.forward([ForwardRequest(0, 0, tuple(a[:-1]), all_logits=False), ForwardRequest(2, 0, tuple(b[:-4]))])
    step_a, step_b = runner.forward(
        [ForwardRequest(0, len(a) - 1, (a[-1],)), ForwardRequest(2, len(b) - 4, tuple(b[-4:]))]
    )
    torch.testing.assert_close(step_a, _hf_logits(tiny_target_dir, a)[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(step_b, _hf_logits(tiny_target_dir, b)[-4:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("fixture", FAMILIES)
def test_tree_nodes_see_only_their_ancestors(request, fixture, attention):
    tiny_target_dir = request.getfixturevalue(fixture)
    prompt = list(range(10, 50))
    # root=29 -> 50 -> 51, root -> 60: node 3 (60) must not see nodes 1-2.
    runner = _runner(tiny_target_dir, attention=attention)
    runner.forward([ForwardRequest(0, 0, tuple(prompt[:-1]))])
    [logits] = runner.forward([ForwardRequest(0, len(prompt) - 1, (prompt[-1], 50, 51, 60), tree_parents=(0, 1, 0))])
    path_one = _hf_logits(tiny_target_dir, prompt + [50, 51])
    path_two = _hf_logits(tiny_target_dir, prompt + [60])
    torch.testing.assert_close(logits[:3], path_one[-3:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[3], path_two[-1], atol=ATOL, rtol=0)


def test_qwen3_and_llama3_shapes_are_read_from_their_configs(tiny_qwen3_dir, tiny_llama3_dir):
    from transformers import AutoConfig

    from specedge.server.model import ModelArgs

    qwen3 = ModelArgs.from_hf_config(AutoConfig.from_pretrained(tiny_qwen3_dir))
    assert qwen3.qk_norm and qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads and not qwen3.qkv_bias
    llama3 = ModelArgs.from_hf_config(AutoConfig.from_pretrained(tiny_llama3_dir))
    assert llama3.tie_word_embeddings and not llama3.qk_norm
