"""The oracle: plain target-only greedy decoding, as simple as it gets.

No cache, no batching, no speculation: the full sequence goes through
transformers' own model at every step. Everything fast is compared to this.
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def greedy_decode(hf_model, prompt: list[int], max_new_tokens: int, eos_token_ids: set[int]) -> list[int]:
    tokens = list(prompt)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        next_token = int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax())
        tokens.append(next_token)
        generated.append(next_token)
        if next_token in eos_token_ids:
            break
    return generated
