"""Chain drafts (greedy or sampled) from a Hugging Face model directory, in PyTorch.

For edges with a GPU and an HF checkpoint. The KV cache is a transformers
`DynamicCache` kept across calls beside the ids it holds; rolling back is
`DynamicCache.crop`, which in transformers 5 takes a negative count of
tokens to drop (a positive argument raises).
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specedge.edge_client.drafting.base import DraftChain, DraftSampling, SparseDist, sample_top_k
from specedge.edge_client.tokenizer import HFTokenizer


class TorchDrafter:
    """Drafter over one model and one cache; not safe to share between threads."""

    def __init__(
        self,
        model_dir: str | pathlib.Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self._device = torch.device(device)
        self._model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self._device).eval()
        text_config = self._model.config.get_text_config()
        self._num_vocab = text_config.vocab_size
        self._max_tokens = getattr(text_config, "max_position_embeddings", None) or sys.maxsize
        self.fingerprint = HFTokenizer(model_dir, vocab_size=self._num_vocab).fingerprint
        self._reset_cache()

    def propose(self, context: Sequence[int], num_tokens: int, sampling: DraftSampling | None = None) -> DraftChain:
        if len(context) == 0:
            raise ValueError("cannot draft from an empty context")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if self._model is None:
            raise RuntimeError("drafter is closed")
        context = list(context)
        # Context plus drafts must fit the position table; draft fewer rather than fail.
        num_tokens = min(num_tokens, self._max_tokens - len(context))
        if num_tokens <= 0:
            return DraftChain(token_ids=(), probs=(), dists=None if sampling is None else ())

        keep = self._reusable_prefix(context)
        suffix = context[keep:]
        if min(suffix) < 0 or max(suffix) >= self._num_vocab:
            raise ValueError(f"context holds token ids outside the draft vocabulary [0, {self._num_vocab})")
        try:
            with torch.inference_mode():
                return self._draft(keep, suffix, num_tokens, sampling)
        except BaseException:
            # A forward that fails half way leaves layers of different
            # lengths in the cache; start from scratch rather than trust it.
            self._reset_cache()
            raise

    def close(self) -> None:
        self._model = None
        self._reset_cache()

    def _draft(self, keep: int, suffix: list[int], num_tokens: int, sampling: DraftSampling | None) -> DraftChain:
        num_dropped = len(self._cached_ids) - keep
        if num_dropped > 0:
            self._cache.crop(-num_dropped)
            del self._cached_ids[keep:]

        token_ids: list[int] = []
        probs: list[float] = []
        dists: list[SparseDist] = []
        new_ids = suffix
        for step in range(num_tokens):
            input_ids = torch.tensor([new_ids], device=self._device)  # [1, num_new]
            output = self._model(input_ids=input_ids, past_key_values=self._cache, use_cache=True, logits_to_keep=1)
            self._cached_ids.extend(new_ids)
            logits = output.logits[0, -1].float()  # [vocab]
            next_probs = torch.softmax(logits, dim=-1)  # [vocab]
            if sampling is None:
                token = int(torch.argmax(next_probs))
            else:
                top = logits.topk(min(sampling.top_k, logits.shape[-1]))  # [top_k] values and indices
                # The cache now holds every token before this one: its length is this token's position.
                token, dist = sample_top_k(
                    top.indices.tolist(), top.values.tolist(), sampling, position=len(self._cached_ids)
                )
                dists.append(dist)
            token_ids.append(token)
            probs.append(float(next_probs[token]))
            # The last draft stays unevaluated: if it is accepted, the next
            # call evaluates it as part of that call's suffix.
            new_ids = [token]
        return DraftChain(
            token_ids=tuple(token_ids), probs=tuple(probs), dists=None if sampling is None else tuple(dists)
        )

    def _reusable_prefix(self, context: list[int]) -> int:
        """How many leading context tokens already have their KV in the cache.

        At most len(context) - 1, so that the forward always produces the
        logits after the context's last token. E.g. cache [5 8 9 4],
        context [5 8 9 4] -> keep 3; context [5 8 7] -> keep 2.
        """
        limit = min(len(self._cached_ids), len(context) - 1)
        for position in range(limit):
            if self._cached_ids[position] != context[position]:
                return position
        return limit

    def _reset_cache(self) -> None:
        # No config: every layer is a plain DynamicLayer that keeps all
        # positions, so crop works at any length (sliding-window layers
        # refuse to crop once past their window). Masks still follow the
        # model's own attention pattern.
        self._cache = DynamicCache()
        self._cached_ids: list[int] = []
