"""Chain drafts (greedy or sampled) from a Hugging Face model directory, in PyTorch.

For edges with a GPU and an HF checkpoint. The KV cache is a transformers
`DynamicCache` kept across calls beside the ids it holds; rolling back is
`DynamicCache.crop`, which in transformers 5 takes a negative count of
tokens to drop (a positive argument raises).
"""

from __future__ import annotations

import contextlib
import inspect
import pathlib
import sys
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specedge.edge_client.drafting.base import (
    ChainBuilder,
    CoupledSampling,
    DraftChain,
    DraftSampling,
    DraftTree,
    TreeBudget,
    sample_top_k,
)
from specedge.edge_client.drafting.coupled import draw_coupled
from specedge.edge_client.drafting.tree import ROOT, TreeGrower
from specedge.edge_client.tokenizer import HFTokenizer


def cache_kwarg(model) -> str:
    """The name a transformers model's forward takes its KV cache by: `cache` since 5.24 (which warns on the
    old name, to be removed in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        # transformers wraps to() in a decorator whose hint takes the model where the device goes.
        self._model = model.to(self._device).eval()  # type: ignore[arg-type]
        self._cache_kwarg = cache_kwarg(self._model)
        text_config = self._model.config.get_text_config()
        self._num_vocab = text_config.vocab_size
        self._max_tokens = getattr(text_config, "max_position_embeddings", None) or sys.maxsize
        self.fingerprint = HFTokenizer(model_dir, vocab_size=self._num_vocab).fingerprint
        self._reset_cache()

    def propose(
        self,
        context: Sequence[int],
        num_tokens: int,
        sampling: DraftSampling | CoupledSampling | None = None,
        min_prob: float = 0.0,
    ) -> DraftChain:
        context = self._check(context, num_tokens)
        # Context plus drafts must fit the position table; draft fewer rather than fail.
        num_tokens = min(num_tokens, self._max_tokens - len(context))
        if num_tokens <= 0:
            return ChainBuilder(sampling).build()
        with self._cache_guard():
            return self._draft(context, num_tokens, sampling, min_prob)

    def propose_tree(self, context: Sequence[int], budget: TreeBudget, min_prob: float = 0.0) -> DraftTree:
        """Grow a greedy tree level by level; each level is one forward with a tree mask.

        See drafting/tree.py for which nodes are kept. The tree's KV is
        dropped again afterwards, so the cache holds exactly `context`.
        """
        context = self._check(context, 1)
        max_nodes = min(budget.max_nodes, self._max_tokens - len(context))
        if max_nodes <= 0:
            return DraftTree((), (), ())
        with self._cache_guard():
            tree = TreeGrower(budget, max_nodes, min_prob)
            logits = self._extend(context)  # [1, vocab] after the last context token
            frontier = [ROOT]
            cache_index: dict[int, int] = {}  # tree node -> its index in the KV cache
            for depth in range(1, budget.max_depth + 1):
                top = torch.softmax(logits.float(), dim=-1).topk(budget.max_width)  # [num_frontier, width]
                frontier = tree.grow(frontier, top.indices.tolist(), top.values.tolist())
                if not frontier or depth == budget.max_depth:
                    break
                logits = self._forward_level(len(context), tree, frontier, cache_index)
            num_tree_cached = len(self._cached_ids) - len(context)
            if num_tree_cached:
                self._cache.crop(-num_tree_cached)
                del self._cached_ids[len(context) :]
            return tree.build()

    def close(self) -> None:
        self._model = None
        self._reset_cache()

    def _check(self, context: Sequence[int], num_tokens: int) -> list[int]:
        if len(context) == 0:
            raise ValueError("cannot draft from an empty context")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if self._model is None:
            raise RuntimeError("drafter is closed")
        if min(context) < 0 or max(context) >= self._num_vocab:
            raise ValueError(f"context holds token ids outside the draft vocabulary [0, {self._num_vocab})")
        return list(context)

    @contextlib.contextmanager
    def _cache_guard(self):
        try:
            with torch.inference_mode():
                yield
        except BaseException:
            # A forward that fails half way leaves layers of different
            # lengths in the cache; start from scratch rather than trust it.
            self._reset_cache()
            raise

    def _extend(self, context: list[int]) -> torch.Tensor:
        """Roll the cache back to the longest reusable prefix, run the rest; [1, vocab] last logits."""
        keep = self._reusable_prefix(context)
        num_dropped = len(self._cached_ids) - keep
        if num_dropped > 0:
            self._cache.crop(-num_dropped)
            del self._cached_ids[keep:]
        return self._run(context[keep:])

    def _run(self, new_ids: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([new_ids], device=self._device)  # [1, num_new]
        output = self._model(input_ids=input_ids, **{self._cache_kwarg: self._cache}, use_cache=True, logits_to_keep=1)
        self._cached_ids.extend(new_ids)
        return output.logits[0, -1:]  # [1, vocab]

    def _forward_level(
        self, num_context: int, tree: TreeGrower, level: list[int], cache_index: dict[int, int]
    ) -> torch.Tensor:
        """Run one tree level's nodes at once; [len(level), vocab] logits.

        Each node attends to the context and to its own ancestors (a 4-D mask
        over the cache), at position num_context + depth - 1.
        """
        num_cached = len(self._cached_ids)
        for row, node in enumerate(level):
            cache_index[node] = num_cached + row
        mask = torch.zeros((1, 1, len(level), num_cached + len(level)), dtype=torch.bool)  # [1, 1, q, kv]
        mask[..., :num_context] = True
        for row, node in enumerate(level):
            for ancestor in tree.ancestors(node):
                mask[0, 0, row, cache_index[ancestor]] = True
        positions = [[num_context + tree.depth(node) - 1 for node in level]]  # [1, num_level]
        input_ids = [[tree.token(node) for node in level]]  # [1, num_level]
        output = self._model(
            input_ids=torch.tensor(input_ids, device=self._device),
            **{self._cache_kwarg: self._cache},
            use_cache=True,
            attention_mask=mask.to(self._device),
            position_ids=torch.tensor(positions, device=self._device),
        )
        self._cached_ids.extend(input_ids[0])
        return output.logits[0]  # [num_level, vocab]

    def _draft(
        self, context: list[int], num_tokens: int, sampling: DraftSampling | CoupledSampling | None, min_prob: float
    ) -> DraftChain:
        chain = ChainBuilder(sampling)
        logits = self._extend(context)[0].float()  # [vocab]
        for step in range(num_tokens):
            next_probs = torch.softmax(logits, dim=-1)  # [vocab]
            top_two = next_probs.topk(2)  # [2] values and indices
            # On the position's confidence, before any draw: see Drafter.propose.
            if float(top_two.values[0]) < min_prob:
                break
            first, second = top_two.indices.tolist()
            # The cache now holds every token before this one: its length is this token's sequence index.
            position = len(self._cached_ids)
            if sampling is None:
                token, dist = first, None
            elif isinstance(sampling, CoupledSampling):
                token, dist = draw_coupled(logits.cpu().numpy(), sampling, position), None
            else:
                top = logits.topk(min(sampling.top_k, logits.shape[-1]))  # [top_k] values and indices
                token, dist = sample_top_k(top.indices.tolist(), top.values.tolist(), sampling, position)
            runner_up = second if token == first else first
            chain.add(token, float(next_probs[token]), dist, runner_up, float(next_probs[runner_up]))
            # The last draft stays unevaluated: if it is accepted, the next
            # call evaluates it as part of that call's suffix.
            if step + 1 < num_tokens:
                logits = self._run([token])[0].float()
        return chain.build()

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
