"""Randomly-initialised targets of real shapes, for benchmarks where real weights are not at hand.

`--model random:qwen2-7b` builds a Qwen2-7B-shaped model with random weights
directly on the device: nothing is downloaded or written to disk. Its
tokenizer (hence its fingerprint, and the edges' prompts) comes from a real
model of the same vocabulary, by default the built-in Qwen2.5-Coder-0.5B; name
another after an `@`: `random:qwen2-tiny@/path/to/hf-dir`.

A random model's text is gibberish, and what it costs per forward is all a
benchmark learns from it. Its greedy choices must still be stable under the
rounding differences between a batched verify and a single decode step (see
README, "Lossless"), or a benchmark could not replay an acceptance profile
against it (bench/simulated.py). So the output layer is drawn large, as in
tests/tiny_models.py: the top logit then leads the next one by a wide margin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import torch

from specedge.registry import RANDOM_PREFIX
from specedge.server.model import CausalLM, ModelArgs, rope_frequencies
from specedge.tokens import TokenizerFingerprint

INIT_STD = 0.02  # transformers' initializer_range for Qwen2
LM_HEAD_STD = 0.25  # peaked next-token distributions (see the module docstring)


@dataclasses.dataclass(frozen=True)
class RandomShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int | None  # logits width; None: the tokenizer's
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6


# Shapes from the published Qwen2 / Qwen2.5 configs.
PRESETS: Mapping[str, RandomShape] = MappingProxyType({
    "qwen2-0.5b": RandomShape(896, 4864, 24, 14, 2, 151936, tie_word_embeddings=True),
    "qwen2-1.5b": RandomShape(1536, 8960, 28, 12, 2, 151936, tie_word_embeddings=True),
    "qwen2-7b": RandomShape(3584, 18944, 28, 28, 4, 152064),
    "qwen2.5-14b": RandomShape(5120, 13824, 48, 40, 8, 152064),
    "qwen2-tiny": RandomShape(64, 128, 2, 4, 2, None),  # for tests
})  # fmt: skip


def preset_of(model: str) -> str:
    """"random:qwen2-7b@tok" -> "qwen2-7b"; raises ValueError naming the presets."""
    preset = model[len(RANDOM_PREFIX) :].partition("@")[0]
    if preset not in PRESETS:
        raise ValueError(f"unknown random model {preset!r}; presets: {', '.join(PRESETS)}")
    return preset


def build_random(
    preset: str, fingerprint: TokenizerFingerprint, *, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> tuple[CausalLM, TokenizerFingerprint]:
    """The model, and the fingerprint widened to its logits (Qwen pads 151665 tokens to 152064)."""
    from transformers import Qwen2Config

    shape = PRESETS[preset]
    vocab_size = shape.vocab_size or fingerprint.vocab_size
    if vocab_size < fingerprint.num_tokens:
        raise ValueError(f"random:{preset} has {vocab_size} logits, fewer than its tokenizer's {fingerprint.num_tokens} tokens")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=32768,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
    )
    args = ModelArgs.from_hf_config(config)
    inv_freq, scaling = rope_frequencies(config, args.head_dim)
    # Built on the meta device and allocated once in the target dtype: a 7B
    # model never exists in float32 first.
    with torch.device("meta"):
        model = CausalLM(args, inv_freq, scaling).to(dtype)
    model = model.to_empty(device=device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = inv_freq.to(device)  # float32, like a loaded model's
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                std = LM_HEAD_STD if name == "lm_head.weight" else INIT_STD
                param.normal_(0.0, std, generator=generator)
        if args.tie_word_embeddings:  # one matrix embeds and un-embeds: peak the logits through the final norm
            model.model.norm.weight.fill_(LM_HEAD_STD / INIT_STD)
    return model.eval(), dataclasses.replace(fingerprint, vocab_size=max(vocab_size, fingerprint.num_tokens))
