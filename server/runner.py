"""The only place that touches the target's tensors: KV slots and batched forwards.

A step is a list of ForwardRequests, one per session, of any lengths. They are
padded into one [B, T] batch; each row writes its real tokens into its own KV
slot and attends to that slot's prefix plus its own chain or tree. Padding is
never stored and never attended to by real tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from specedge.server import tree
from specedge.server.model import BatchLayout, CausalLM


@dataclasses.dataclass(frozen=True)
class ForwardRequest:
    slot: int
    num_cached: int  # tokens already in the slot; new tokens are stored from here on
    token_ids: tuple[int, ...]  # new tokens; token 0 is the root of any tree
    tree_parents: tuple[int, ...] | None = None  # see server/tree.py; None means a causal chain
    all_logits: bool = True  # logits of every new token, or of the last one only (prefill)

    @property
    def positions(self) -> list[int]:
        if self.tree_parents is None:
            return list(range(self.num_cached, self.num_cached + len(self.token_ids)))
        return [self.num_cached + depth for depth in tree.depths(self.tree_parents)]


class KVCache:
    """Preallocated per-session KV slots: [num_slots, max_len, kv_heads, head_dim] per layer.

    kv_heads are the heads this process's partition holds (all of them without tensor parallelism).
    """

    def __init__(self, model: CausalLM, *, num_slots: int, max_len: int, device: torch.device, dtype: torch.dtype):
        args = model.args
        shape = (num_slots, max_len, model.partition.num_kv_heads, args.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len

    @staticmethod
    def bytes_per_token_for(model: CausalLM, dtype: torch.dtype) -> int:
        """KV bytes per token in this process."""
        args = model.args
        return 2 * args.num_layers * model.partition.num_kv_heads * args.head_dim * torch.finfo(dtype).bits // 8

    def move(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy KV rows src -> dst within one slot (tree paths made contiguous)."""
        src_index = torch.tensor(src, device=self.k[0].device)
        dst_index = torch.tensor(dst, device=self.k[0].device)
        for cache in (*self.k, *self.v):
            cache[slot, dst_index] = cache[slot, src_index]


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache):
        self.model = model
        self.kv = kv
        self.device = kv.k[0].device

    @torch.inference_mode()
    def forward(self, requests: Sequence[ForwardRequest]) -> list[torch.Tensor]:
        """Logits per request: [len(token_ids) or 1, vocab] float32, on the runner's device.

        Empty on a tensor-parallel rank other than 0, whose share of the logits went to rank 0.
        """
        layout = self._layout(requests)
        logits = self.model(layout, self.kv.k, self.kv.v)
        if logits is None:
            return []
        sizes = [len(r.token_ids) if r.all_logits else 1 for r in requests]
        return list(logits.split(sizes))

    def move_kv(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        self.kv.move(slot, src, dst)

    def _layout(self, requests: Sequence[ForwardRequest]) -> BatchLayout:
        batch = len(requests)
        seq = max(len(r.token_ids) for r in requests)
        num_keys = max(r.num_cached + len(r.token_ids) for r in requests)
        token_ids = torch.zeros(batch, seq, dtype=torch.long)
        positions = torch.zeros(batch, seq, dtype=torch.long)
        mask = torch.zeros(batch, 1, seq, num_keys, dtype=torch.bool)
        write_rows, write_cols, write_positions, logit_rows, logit_cols = [], [], [], [], []
        for row, r in enumerate(requests):
            num_new, start = len(r.token_ids), r.num_cached
            token_ids[row, :num_new] = torch.tensor(r.token_ids)
            positions[row, :num_new] = torch.tensor(r.positions)
            mask[row, 0, :num_new, :start] = True
            mask[row, 0, :num_new, start : start + num_new] = tree.ancestor_mask(r.tree_parents, num_new)
            mask[row, 0, num_new:, 0] = True  # padding queries need one key, or softmax gives NaN
            write_rows += [row] * num_new
            write_cols += range(num_new)
            write_positions += range(start, start + num_new)
            wanted = range(num_new) if r.all_logits else [num_new - 1]
            logit_rows += [row] * len(wanted)
            logit_cols += wanted

        def on_device(values) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.long).to(self.device)

        return BatchLayout(
            token_ids=token_ids.to(self.device),
            positions=positions.to(self.device),
            slots=on_device([r.slot for r in requests]),
            write_rows=on_device(write_rows),
            write_cols=on_device(write_cols),
            write_positions=on_device(write_positions),
            attn_mask=mask.to(self.device),
            logit_rows=on_device(logit_rows),
            logit_cols=on_device(logit_cols),
        )
