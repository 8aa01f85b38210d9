"""Tiny randomly-initialised models and a tiny tokenizer, built on the fly.

No hub access: the tokenizer is trained here on a few sentences, and the
models are saved as ordinary HF directories (config.json, safetensors,
tokenizer files with a chat template), so they go through exactly the same
loading code as real checkpoints.

The weights are drawn with a large init range so that next-token
distributions are peaked: a random model with near-uniform logits would make
greedy argmax hinge on float rounding, which is not what these tests probe.
"""

from __future__ import annotations

import pathlib

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens on the edge and verifies them on the server.",
    "안녕하세요, 반갑습니다. Hello, nice to meet you!",
    "for i in range(10):\n    print(i * i)\n",
    '{"name": "specedge", "tokens": [1, 2, 3]}',
]


def build_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(
    out_dir: pathlib.Path,
    *,
    seed: int,
    arch: str = "qwen2",
    vocab_size: int = 384,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    noise_from: pathlib.Path | None = None,
    noise: float = 0.0,
    tokenizer_vocab_size: int = 384,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    rope_parameters: dict | None = None,
) -> pathlib.Path:
    """Save a tiny causal LM (+ tokenizer) to `out_dir`.

    With `noise_from`, start from that model's weights and add Gaussian noise
    of relative size `noise`: a draft that agrees with its target often, but
    not always.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
    extra = {"head_dim": head_dim} if head_dim else {}
    if rope_parameters is not None:
        extra["rope_parameters"] = rope_parameters
    config = config_cls(
        **extra,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        initializer_range=0.25,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=2,  # <|im_end|>: special tokens are trained first, in order
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    if noise_from is not None:
        model = AutoModelForCausalLM.from_pretrained(noise_from, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * noise * param.std())
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # Qwen3's per-head norms start at 1: make them matter, and differ from each other
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    build_tokenizer(tokenizer_vocab_size).save_pretrained(out_dir)
    return out_dir
