"""The only place that touches the target's tensors: KV slots and batched forwards.

A step is a list of ForwardRequests, one per session, of any lengths. Their
tokens are packed into one flat batch (server/model.py's StepBatch): each row
writes its tokens into its own KV slot and attends to that slot's prefix plus
its own chain or tree. Nothing is padded, so a step costs its real tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from specedge.server import tree
from specedge.server.attention import QueryGroups, compiled_rows, flex_layout, num_key_blocks, query_groups
from specedge.server.model import CausalLM, StepBatch


@dataclasses.dataclass(frozen=True)
class ForwardRequest:
    slot: int
    num_cached: int  # tokens already in the slot; new tokens are stored from here on
    token_ids: tuple[int, ...]  # new tokens; token 0 is the root of any tree
    tree_parents: tuple[int, ...] | None = None  # see server/tree.py; None means a causal chain
    all_logits: bool = True  # logits of every new token, or of the last one only (prefill)

    @property
    def num_logits(self) -> int:
        return len(self.token_ids) if self.all_logits else 1

    @property
    def positions(self) -> list[int]:
        if self.tree_parents is None:
            return list(range(self.num_cached, self.num_cached + len(self.token_ids)))
        return [self.num_cached + depth for depth in tree.depths(self.tree_parents)]


@dataclasses.dataclass(frozen=True)
class KVMove:
    """Within one slot, KV positions src[i] -> dst[i]: an accepted tree path made contiguous."""

    slot: int
    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """A step's requests flattened on the host, one entry per packed token (logit_indices: per logit)."""

    token_ids: list[int]
    positions: list[int]
    kv_slots: list[int]
    kv_positions: list[int]
    row_bases: list[int]  # each token's row's first new position (the row's cached length)
    logit_indices: list[int]
    cu_num_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def of(cls, requests: Sequence[ForwardRequest], max_len: int) -> PackedRows:
        rows = cls([], [], [], [], [], [], [0])
        for r in requests:
            num_new, start = len(r.token_ids), r.num_cached
            if start + num_new > max_len:
                # Checked here so that no out-of-range index ever reaches a kernel (on CUDA, a
                # device-side assert would poison the context for every session).
                raise ValueError(f"{start} cached + {num_new} new tokens exceed the slot's {max_len}")
            offset = rows.cu_num_tokens[-1]
            rows.token_ids.extend(r.token_ids)
            rows.positions.extend(r.positions)
            rows.kv_slots.extend([r.slot] * num_new)
            rows.kv_positions.extend(range(start, start + num_new))
            rows.row_bases.extend([start] * num_new)
            rows.logit_indices.extend(range(offset, offset + num_new) if r.all_logits else [offset + num_new - 1])
            rows.cu_num_tokens.append(offset + num_new)
        return rows


def grouped_queries(
    requests: Sequence[ForwardRequest], rows: PackedRows, max_len: int, num_groups: int | None = None
) -> QueryGroups | None:
    """Flex attention's query groups for a step's rows (attention.QueryGroups), on the host; None where a row
    is too long for them."""
    return query_groups(
        rows.cu_num_tokens,
        [r.slot for r in requests],
        [r.num_cached for r in requests],
        [r.tree_parents is not None for r in requests],
        max_len,
        num_groups,
    )


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

    def move(self, moves: Sequence[KVMove]) -> None:
        """Copy KV rows src -> dst within each move's slot (tree paths made contiguous), all at once."""
        device = self.k[0].device
        slots = torch.tensor([m.slot for m in moves for _ in m.src], device=device)
        src = torch.tensor([i for m in moves for i in m.src], device=device)
        dst = torch.tensor([i for m in moves for i in m.dst], device=device)
        for cache in (*self.k, *self.v):
            cache[slots, dst] = cache[slots, src]  # the gather copies first, so overlapping ranges are safe


class Runner(Protocol):
    """What the engine runs steps on: a ModelRunner, or server/tp_runner.py's TensorParallelRunner."""

    @property
    def model(self) -> CausalLM: ...

    @property
    def kv(self) -> KVCache: ...

    @property
    def device(self) -> torch.device: ...

    def forward_packed(self, requests: Sequence[ForwardRequest]) -> torch.Tensor | None: ...

    def forward(self, requests: Sequence[ForwardRequest]) -> list[torch.Tensor]: ...

    def move_kv(self, moves: Sequence[KVMove]) -> None: ...


class ModelRunner:
    """A Runner on one device: the model, its KV cache, the packed layout of each step."""

    def __init__(self, model: CausalLM, kv: KVCache):
        self.model = model
        self.kv = kv
        self.device = kv.k[0].device

    @torch.inference_mode()
    def forward_packed(self, requests: Sequence[ForwardRequest]) -> torch.Tensor | None:
        """Every request's logits, packed in request order: [sum of num_logits(r), vocab] float32.

        None on a tensor-parallel rank other than 0, whose share of the logits went to rank 0.
        """
        return self.model(self._layout(requests), self.kv.k, self.kv.v)

    def forward(self, requests: Sequence[ForwardRequest]) -> list[torch.Tensor]:
        """Logits per request: [num_logits(r), vocab] float32 (empty on a rank other than 0)."""
        logits = self.forward_packed(requests)
        return [] if logits is None else list(logits.split([r.num_logits for r in requests]))

    def move_kv(self, moves: Sequence[KVMove]) -> None:
        self.kv.move(moves)

    def _layout(self, requests: Sequence[ForwardRequest]) -> StepBatch:
        """Pack the requests' tokens into one flat batch (see StepBatch)."""
        rows = PackedRows.of(requests, self.kv.max_len)

        def on_device(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

        row_masks: list[torch.Tensor | None] = [None] * len(requests)
        flex = None
        if self.model.attention == "flex":
            groups = grouped_queries(requests, rows, self.kv.max_len)
            key_blocks = num_key_blocks(self.kv.num_slots, self.kv.max_len)
            flex = flex_layout(
                kv_slots=on_device(rows.kv_slots),
                kv_positions=on_device(rows.kv_positions),
                row_bases=on_device(rows.row_bases),
                tree_table=self._tree_table(requests, rows.num_tokens),
                groups=None if groups is None else groups.to(self.device, key_blocks),
                num_slots=self.kv.num_slots,
                max_len=self.kv.max_len,
            )
        compiled = None
        if self.model.attention == "numba":
            layers = self.model.compiled_layers
            # A step the compiled layers can take (float32, few enough tokens) takes them whole where its rows allow:
            # every row attends in the kernel, so that no token's bits depend on the rest of its step. So does every
            # bfloat16 step (no compiled layers: each runs the modules), so that a prompt's tokens have the same
            # bits however its prefill was chunked (a long row took SDPA, a short one the kernel: the real 1.5B's
            # next-token logits differed by up to 0.125 between a 200-token prefill and 120 + 80).
            whole = layers.fits(rows.num_tokens) if layers is not None else self.kv.k[0].dtype == torch.bfloat16
            compiled = compiled_rows(
                rows.cu_num_tokens,
                [r.slot for r in requests],
                [r.num_cached + len(r.token_ids) for r in requests],
                [
                    None if r.tree_parents is None else tree.ancestor_mask(r.tree_parents, len(r.token_ids))
                    for r in requests
                ],
                compiled_step=whole,
                tiles=self.model.attention_tiles,
            )
            for row in compiled.others:  # rows too long for the kernel take the row loop, with their masks
                row_masks[row] = self._row_mask(requests[row])
        elif self.model.attention == "rows":
            row_masks = [None if len(r.token_ids) == 1 else self._row_mask(r) for r in requests]
        return StepBatch(
            token_ids=on_device(rows.token_ids),
            positions=on_device(rows.positions),
            kv_slots=on_device(rows.kv_slots),
            kv_positions=on_device(rows.kv_positions),
            logit_indices=on_device(rows.logit_indices),
            cu_num_tokens=tuple(rows.cu_num_tokens),
            slots=tuple(r.slot for r in requests),
            num_keys=tuple(r.num_cached + len(r.token_ids) for r in requests),
            row_masks=tuple(row_masks),
            flex=flex,
            compiled=compiled,
        )

    def _tree_table(self, requests: Sequence[ForwardRequest], num_tokens: int) -> torch.Tensor | None:
        """[num_tokens, widest tree] bool: which of its row's new tokens a tree node sees; None without trees."""
        trees = [r for r in requests if r.tree_parents is not None]
        if not trees:
            return None
        table = torch.zeros(num_tokens, max(len(r.token_ids) for r in trees), dtype=torch.bool)
        offset = 0
        for r in requests:
            num_new = len(r.token_ids)
            if r.tree_parents is not None:
                table[offset : offset + num_new, :num_new] = tree.ancestor_mask(r.tree_parents, num_new)
            offset += num_new
        return table.to(self.device, non_blocking=True)

    def _row_mask(self, request: ForwardRequest) -> torch.Tensor:
        """[new, cached + new] bool: every cached key, then the chain's or tree's own mask."""
        num_new, start = len(request.token_ids), request.num_cached
        mask = torch.ones(num_new, start + num_new, dtype=torch.bool)
        mask[:, start:] = tree.ancestor_mask(request.tree_parents, num_new)
        return mask.to(self.device, non_blocking=True)
