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
    family: str = "qwen2"  # the transformers config it is built from: qwen2, qwen3 or llama
    head_dim: int | None = None  # None: hidden_size / num_heads (Qwen3 sets its own)
    rope_scaling: Mapping | None = None  # e.g. Llama 3.1's "llama3" frequencies

    def hf_config(self, vocab_size: int):
        from transformers import LlamaConfig, Qwen2Config, Qwen3Config

        config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[self.family]
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        return config_class(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_heads,
            max_position_embeddings=32768 if self.family != "llama" else 131072,
            rope_parameters=rope,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
        )


_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Shapes from the published Qwen2 / Qwen2.5, Qwen3 and Llama 3.1 configs. Llama's 128,256 logits need its
# own tokenizer: random:llama3.1-8b@/path/to/a-llama-3-dir.
PRESETS: Mapping[str, RandomShape] = MappingProxyType(
    {
        "qwen2-0.5b": RandomShape(896, 4864, 24, 14, 2, 151936, tie_word_embeddings=True),
        "qwen2-1.5b": RandomShape(1536, 8960, 28, 12, 2, 151936, tie_word_embeddings=True),
        "qwen2-7b": RandomShape(3584, 18944, 28, 28, 4, 152064),
        "qwen2.5-14b": RandomShape(5120, 13824, 48, 40, 8, 152064),
        "qwen3-0.6b": RandomShape(
            1024, 3072, 28, 16, 8, 151936, tie_word_embeddings=True, family="qwen3", head_dim=128
        ),
        "qwen3-1.7b": RandomShape(
            2048, 6144, 28, 16, 8, 151936, tie_word_embeddings=True, family="qwen3", head_dim=128
        ),
        "qwen3-8b": RandomShape(4096, 12288, 36, 32, 8, 151936, family="qwen3", head_dim=128),
        "qwen3-14b": RandomShape(5120, 17408, 40, 40, 8, 151936, family="qwen3", head_dim=128),
        "llama3.1-8b": RandomShape(
            4096,
            14336,
            32,
            32,
            8,
            128256,
            rope_theta=500_000.0,
            rms_norm_eps=1e-5,
            family="llama",
            rope_scaling=_LLAMA31_ROPE,
        ),
        "qwen2-tiny": RandomShape(64, 128, 2, 4, 2, None),  # for tests
        "qwen3-tiny": RandomShape(64, 128, 2, 4, 2, None, family="qwen3", head_dim=32),  # for tests
    }
)


def preset_of(model: str) -> str:
    """ "random:qwen2-7b@tok" -> "qwen2-7b"; raises ValueError naming the presets."""
    preset = model[len(RANDOM_PREFIX) :].partition("@")[0]
    if preset not in PRESETS:
        raise ValueError(f"unknown random model {preset!r}; presets: {', '.join(PRESETS)}")
    return preset


def build_random(
    preset: str, fingerprint: TokenizerFingerprint, *, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> tuple[CausalLM, TokenizerFingerprint]:
    """The model, and the fingerprint widened to its logits (Qwen pads 151665 tokens to 152064)."""
    shape = PRESETS[preset]
    vocab_size = shape.vocab_size or fingerprint.vocab_size
    if vocab_size < fingerprint.num_tokens:
        raise ValueError(
            f"random:{preset} has {vocab_size} logits, fewer than its tokenizer's {fingerprint.num_tokens} tokens"
        )
    config = shape.hf_config(vocab_size)
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
