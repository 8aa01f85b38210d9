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


@torch.inference_mode()
def second_token_marginal(hf_model, prompt: list[int], sampling) -> torch.Tensor:
    """[V] float64: P(the 2nd sampled token is t) = sum over t1 of p(t1 | prompt) p(t | prompt, t1), under
    `sampling` (temperature, top-k, top-p) as the server applies it."""
    from specedge.server.sampling import target_probs

    first = target_probs(hf_model(torch.tensor([prompt])).logits[0, -1:], sampling)[0]
    marginal = torch.zeros_like(first, dtype=torch.float64)
    for t1 in first.nonzero().flatten().tolist():
        after = target_probs(hf_model(torch.tensor([prompt + [t1]])).logits[0, -1:], sampling)[0]
        marginal += float(first[t1]) * after.double()
    return marginal


def marginal_p_value(tokens: list[int], marginal: torch.Tensor) -> float:
    """Chi-square p-value of the observed tokens against `marginal` (tokens expected fewer than 5 times share
    one bin, so that the approximation holds). A token outside its support fails at once."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(marginal)).double()
    assert counts[marginal == 0].sum() == 0, "a token the target could not produce"
    expected = marginal * len(tokens)
    big = expected >= 5
    observed_bins = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    expected_bins = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = expected_bins > 0
    chi2 = float(((observed_bins[keep] - expected_bins[keep]) ** 2 / expected_bins[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))
