"""CUDA graphs over token-count buckets: a small step's kernel launches replayed as one.

On a GPU a decode or verify step carries a few dozen tokens, and launching its
kernels (about a dozen per layer) costs more than their math. A GraphedRunner
captures one CUDA graph per bucket of token counts and replays it:

    step of n tokens -> the smallest bucket b >= n
      tokens padded to b by one extra row on the scratch KV slot (no session owns it)
      the step's layout and query groups (server/attention.py), built on the host, copied into the
      bucket's static tensors; the captured block mask reads them, its block lists the groups' own
      graph b replayed; logits[:num_logits] are the step's, in request order

    requests  A (slot 2, 3 new)  B (slot 0, 1 new)      n = 4 -> bucket 8
    packed    a0 a1 a2 b0 | p0 p1 p2 p3                  p*: the scratch slot's tokens 0..3
    logits    A's, B's | padding                        (a pad row asks for none; the rest repeat its last)

The buckets reach 512 tokens, the scheduler's max_batch_tokens (no step carries
more), so every step replays a graph; a larger step (a BatcherConfig raised in
code) runs eagerly, where the math dwarfs the launches. Capture needs flex
attention: its kernels' shapes depend only on the bucket, where the row loop's
change with every row.
Tensor-parallel servers run eagerly (their collectives go through the rank
protocol, outside any graph).

Off CUDA the same buckets, static tensors, padding and block-mask refills run
with no capture, calling the forward directly: that is how the tests check
everything here but the capture itself on a CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specedge.server import tree
from specedge.server.attention import (
    GROUP_QUERIES,
    GROUPED_MAX_ROW,
    FlexLayout,
    QueryGroups,
    flex_block_mask,
    groups_of,
    num_key_blocks,
)
from specedge.server.model import CausalLM, StepBatch
from specedge.server.runner import ForwardRequest, KVCache, KVMove, ModelRunner, PackedRows, grouped_queries

if TYPE_CHECKING:
    from torch.cuda.graphs import _POOL_HANDLE

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def graphs_unavailable(device: torch.device, attention: str, tensor_parallel: bool) -> str | None:
    """Why a server cannot replay CUDA graphs, or None when it can."""
    if device.type != "cuda":
        return f"CUDA graphs are for CUDA devices, not {device.type}"
    if attention != "flex":
        return "CUDA graphs need flex attention (--attention flex or auto); the row loop cannot be captured"
    if tensor_parallel:
        return "tensor-parallel ranks run eagerly: their collectives go through the rank protocol"
    return None


def bucket_for(num_tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding num_tokens, or None when the step is larger than every bucket."""
    return next((b for b in buckets if b >= num_tokens), None)


def padded(requests: Sequence[ForwardRequest], bucket: int, scratch_slot: int) -> list[ForwardRequest]:
    """The requests and one row of bucket - n padding tokens on the scratch slot (none when n == bucket)."""
    num_pad = bucket - sum(len(r.token_ids) for r in requests)
    if num_pad < 0:
        raise ValueError(f"a step of {bucket - num_pad} tokens does not fit a bucket of {bucket}")
    pad = ForwardRequest(scratch_slot, 0, (0,) * num_pad, all_logits=False)
    return [*requests, pad] if num_pad else list(requests)


def static_groups(bucket: int, num_slots: int) -> int:
    """The query groups a bucket holds: as many as a step of `bucket` tokens can take.

    Each row is a session's, in a slot of its own (the padding row in the scratch slot), so a step has at most
    r = min(num_slots, bucket) rows. A row of n tokens takes ceil(n / GROUP_QUERIES) = 1 + (n - 1) // 16
    groups, so r rows take at most r + (bucket - r) // 16: one row holding every token the others leave. A
    bucket of 512 on 66 slots holds 93 groups, not 512: each group costs the attention call a batch entry,
    used or not."""
    rows = min(num_slots, bucket)
    return rows + (bucket - rows) // GROUP_QUERIES


@dataclasses.dataclass
class _Bucket:
    """One bucket's static tensors (refilled in place each step), its captured graph and its output."""

    tokens: int
    meta: torch.Tensor  # [6, tokens] long: token ids, positions, KV slots, KV positions, logit indices, row bases
    flags: torch.Tensor  # [tokens, 1 + tokens] bool: is the token's row a tree, then its tree_table row
    groups: QueryGroups  # as many as any step of `tokens` can take (static_groups)
    batch: StepBatch
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the captured forward's output, overwritten by every replay


class GraphedRunner:
    """A Runner (server/runner.py) replaying one captured forward per token-count bucket.

    The KV cache holds one slot more than the engine hands out: the last is the scratch slot padding
    tokens write to.
    """

    def __init__(self, inner: ModelRunner, buckets: Sequence[int] = DEFAULT_BUCKETS):
        if inner.model.attention != "flex":
            raise ValueError("CUDA graphs need flex attention: the row loop's shapes change with every row")
        self.inner = inner
        self.scratch_slot = inner.kv.num_slots - 1
        # A bucket's steps take flex attention's grouped layout, whose rows hold at most GROUPED_MAX_ROW tokens.
        largest = min(inner.kv.max_len, GROUPED_MAX_ROW)
        self.buckets = tuple(sorted(b for b in set(buckets) if 0 < b <= largest))
        if not self.buckets:
            raise ValueError(f"no bucket in {tuple(buckets)} is at most {largest} tokens")
        self._captured: dict[int, _Bucket] = {}
        self._pool: _POOL_HANDLE | None = None  # one memory pool shared by every graph (largest first)

    @property
    def model(self) -> CausalLM:
        return self.inner.model

    @property
    def kv(self) -> KVCache:
        return self.inner.kv

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket's graph (on CUDA) or build its static tensors (elsewhere); seconds taken.

        In inference mode, as every step runs: a static tensor made outside it has another dispatch key set
        than the eager steps' layouts, and so cost flex attention a compile of its own (seen on an H200)."""
        started = time.perf_counter()
        for bucket in sorted(self.buckets, reverse=True):  # the largest first, so smaller ones reuse its pool
            self._captured[bucket] = self._capture(bucket)
        return time.perf_counter() - started

    @torch.inference_mode()
    def forward_packed(self, requests: Sequence[ForwardRequest]) -> torch.Tensor | None:
        num_tokens = sum(len(r.token_ids) for r in requests)
        bucket = bucket_for(num_tokens, self.buckets)
        if bucket is None or bucket not in self._captured:
            return self.inner.forward_packed(requests)
        state, step = self._captured[bucket], padded(requests, bucket, self.scratch_slot)
        if groups_of([len(r.token_ids) for r in step]) > state.groups.num_groups:  # rows sharing a slot
            return self.inner.forward_packed(requests)
        num_logits = sum(r.num_logits for r in requests)
        logits = self._replay(state, step)
        return logits[:num_logits].clone()  # the next replay overwrites the graph's output

    def forward(self, requests: Sequence[ForwardRequest]) -> list[torch.Tensor]:
        logits = self.forward_packed(requests)
        return [] if logits is None else list(logits.split([r.num_logits for r in requests]))

    def move_kv(self, moves: Sequence[KVMove]) -> None:
        self.inner.move_kv(moves)

    def _capture(self, bucket: int) -> _Bucket:
        device, kv = self.device, self.kv
        meta = torch.zeros(6, bucket, dtype=torch.long, device=device)
        flags = torch.zeros(bucket, 1 + bucket, dtype=torch.bool, device=device)
        groups = QueryGroups.zeros(
            static_groups(bucket, kv.num_slots), bucket, num_key_blocks(kv.num_slots, kv.max_len), device
        )
        mask = self._block_mask(meta, flags, groups)
        batch = StepBatch(
            token_ids=meta[0],
            positions=meta[1],
            kv_slots=meta[2],
            kv_positions=meta[3],
            logit_indices=meta[4],
            cu_num_tokens=(),  # the flex path reads none of the row-loop fields
            slots=(),
            num_keys=(),
            row_masks=(),
            flex=FlexLayout(mask, groups),
        )
        state = _Bucket(bucket, meta, flags, groups, batch)
        self._fill(state, padded([], bucket, self.scratch_slot))  # a step of padding alone
        if device.type != "cuda":
            return state
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # compiles flex attention for this shape and settles the allocator
                self.model(batch, kv.k, kv.v)
        torch.cuda.current_stream(device).wait_stream(stream)
        state.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(state.graph, pool=self._pool):
            state.logits = self.model(batch, kv.k, kv.v)
        self._pool = state.graph.pool()
        return state

    def _replay(self, state: _Bucket, requests: list[ForwardRequest]) -> torch.Tensor:
        self._fill(state, requests)
        if state.graph is None:
            logits = self.model(state.batch, self.kv.k, self.kv.v)
        else:
            state.graph.replay()
            logits = state.logits
        assert logits is not None, "graphs run without tensor parallelism: the logits are all here"
        return logits

    def _fill(self, state: _Bucket, requests: list[ForwardRequest]) -> None:
        """Copy a padded step's layout into the bucket's static tensors. The captured block mask reads them, and
        its block lists are views of the groups' tables: refilled, it is the step's mask."""
        rows = PackedRows.of(requests, self.kv.max_len)
        logit_indices = rows.logit_indices + [rows.num_tokens - 1] * (state.tokens - len(rows.logit_indices))
        host = torch.tensor(
            [rows.token_ids, rows.positions, rows.kv_slots, rows.kv_positions, logit_indices, rows.row_bases],
            dtype=torch.long,
        )
        flags = torch.zeros(state.tokens, 1 + state.tokens, dtype=torch.bool)
        for r, start in zip(requests, rows.cu_num_tokens):
            if r.tree_parents is not None:
                num_new = len(r.token_ids)
                flags[start : start + num_new, 0] = True
                flags[start : start + num_new, 1 : 1 + num_new] = tree.ancestor_mask(r.tree_parents, num_new)
        groups = grouped_queries(requests, rows, self.kv.max_len, num_groups=state.groups.num_groups)
        assert groups is not None, "a bucket's rows are never longer than the grouped layout takes"
        state.meta.copy_(host, non_blocking=True)
        state.flags.copy_(flags, non_blocking=True)
        state.groups.refill(groups)

    def _block_mask(self, meta: torch.Tensor, flags: torch.Tensor, groups: QueryGroups):
        """The block mask of a bucket's static tensors, reading them whenever a kernel evaluates it."""
        return flex_block_mask(
            kv_slots=meta[2],
            kv_positions=meta[3],
            row_bases=meta[5],
            is_tree=flags[:, 0],
            tree_table=flags[:, 1:],
            groups=groups,
            num_slots=self.kv.num_slots,
            max_len=self.kv.max_len,
        )
