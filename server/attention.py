"""How a step's packed rows attend to their KV slots: one seam, chosen per device.

- `rows` (CPU): one scaled-dot-product call per row, reading the row's slot in place
  as a view. On a CPU a call costs tens of microseconds, and the flash kernel reads
  the strided view without a copy.
- `numba` (CPU, float32 or bfloat16): every row of up to NUMBA_MAX_NEW new tokens (decode
  tokens, verify chains and trees) and NUMBA_MAX_SCORES scores attends in one
  compiled call per layer, one task per (row, KV head) (per row, its heads side by
  side, where the rows keep every thread busy on AVX-512), reading its slot in place
  (server/_forward_numba.py). Longer rows (prefill chunks, verify rounds deep
  into a long context) take `rows`' scaled-dot-product call, whose flash kernel
  reuses each key over many queries. But in a step the compiled layers take
  (server/layer_kernel.py), every row of up to NUMBA_MAX_NEW tokens and longer ones
  over up to NUMBA_MAX_ROW_KEYS keys take the kernel, 16 tokens at a time, so that
  the step runs compiled whole and a token's bits do not depend on its step. On
  the 2-core EPYC of bench/results, eight one-token rows over 200 cached keys took
  0.33 ms a layer, against 1.30 ms of calls (plus the Python around each) on `rows`.
  A bfloat16 cache is read in place as its bits, summed in float32 and rounded once:
  on a 2-core Zen 4 EPYC, 8 x 1 0.146 against 0.414 ms a layer, and whole bfloat16
  forwards 0.91-1.00x.
- `flex` (CUDA): one FlexAttention call for the whole step. The KV cache is seen as
  one long sequence of num_slots * max_len keys (a view, no copy), and a block mask
  built once per step lets each query see only its own slot's cached keys and
  whatever of its row's new tokens its chain or tree allows. Blocks outside a row's
  slot are skipped, and the rows need no loop. Two layouts of the queries:
  - grouped (every step whose rows hold at most GROUPED_MAX_ROW new tokens): each
    row's tokens in groups of GROUP_QUERIES, one group per batch entry, so a group
    visits its own slot's blocks alone;
  - packed (a step with a longer prefill chunk): all queries in one sequence, whose
    128-query blocks read each key once for many queries, but also visit every
    block any row in them needs.
  On an H200, per layer of the 1.5B at 200 cached keys, grouped against packed:
  8 x 1 0.016 against 0.162 ms in bfloat16, 0.84 against 5.9 in float32
  (bench/results/2026-11-27-h200-cuda.md).
  Compiled on CUDA; elsewhere FlexAttention runs its eager reference, which
  materialises every score (correct, slow: for checking the layout on a CPU).
- `auto`: `flex` on CUDA; `numba` for float32 and bfloat16 on a CPU where it compiles;
  else `rows`.

Both paths compute the same attention; only rounding differs. One server uses one
path for every forward, so speculative and server-only decoding on it agree.

    rows A (slot 2, cached 7, new chain [a0 a1]), B (slot 0, cached 3, new [b0]); max_len 16
    keys seen as kv_idx = slot * 16 + position
    a1 sees kv_idx 32..40 (slot 2, positions 0..8); b0 sees 0..3 (slot 0, positions 0..3)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np
import torch
from torch.nn import functional as F

from specedge.server.kernels import chosen_form, kernel_array, load_kernel

log = logging.getLogger(__name__)

ATTENTION_KINDS = ("auto", "rows", "numba", "flex")
# A row takes the numba kernel when it has at most NUMBA_MAX_NEW new tokens and at most NUMBA_MAX_SCORES
# (new tokens x keys); others take the flash kernel, which reuses each key over many queries. On the 2-core
# EPYC (`specedge-bench engine`'s attention table) the kernel costs 0.26-0.5x the SDPA calls at 200 keys, about
# 0.8x at 2,000, and at 4,000 keys it is 0.8x for one token a row but up to 1.08x for five.
NUMBA_MAX_NEW = 16
NUMBA_MAX_SCORES = 16 * 1024
# In a step the compiled layers can take, the kernel takes every row of up to NUMBA_MAX_NEW tokens and longer rows
# over up to this many keys (it walks a row 16 tokens at a time), so that the step runs compiled whole. On a 2-core
# Zen 4 EPYC, real 1.5B, whole forwards in turn with the rule above: verify rows past it 0.81-0.90x (4 x 5 at 4,000
# keys, 1 x 5 at 16,000 and 30,000), one token at 30,000 keys 0.79x, rows of 16-110 tokens at 200-8,000 keys
# 0.91-1.01x; but at 16,000 keys 32-64 tokens took 1.05-1.07x and at 30,000 64 tokens 1.09x, where flash attention
# reuses each key over more queries.
NUMBA_MAX_ROW_KEYS = 8 * 1024


def resolve_attention(kind: str, device: torch.device, dtype: torch.dtype) -> str:
    """The path a server will use: `kind` itself, or what `auto` means on this device and dtype."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention path {kind!r}; choose one of {', '.join(ATTENTION_KINDS)}")
    if kind == "auto":
        if device.type == "cuda":
            return "flex"
        reason = numba_unavailable(device, dtype)
        if reason is not None:
            log.info("attention runs one call per row: %s", reason)
        return "rows" if reason else "numba"
    if kind == "numba" and (reason := numba_unavailable(device, dtype)):
        raise ValueError(f"--attention numba cannot run: {reason}")
    if kind == "flex" and device.type != "cuda":
        log.info("flex attention on %s runs FlexAttention's eager reference: correct but slow", device.type)
    return kind


def numba_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the numba attention kernel cannot run here, or None when it can."""
    if device.type != "cpu":
        return f"the numba kernel is for CPUs; {device.type} uses its own kernels"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the numba kernel takes float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if numba_kernel() is None:
        return "numba is missing or could not compile its attention kernel (logged above)"
    if dtype == torch.bfloat16 and numba_bfloat16_kernel() is None:
        return "numba could not compile its attention over a bfloat16 cache (logged above)"
    return None


@functools.cache
def numba_bfloat16_kernel() -> ModuleType | None:
    """The attention kernel compiled for a bfloat16 cache too (a bfloat16 server's only), or None."""
    return load_kernel("_forward_numba", "bfloat16 attention runs one call per row", "warm_up_attention_bfloat16")


@functools.cache
def numba_kernel() -> ModuleType | None:
    """server/_forward_numba.py compiled, or None where numba is missing or fails to compile."""
    return load_kernel("_forward_numba", "attention runs one call per row", "warm_up_attention")


TILES_TIMING_HEADS = (12, 2, 128)  # query heads, KV heads, head_dim: the 1.5B's
TILES_TIMING_STEPS = ((8, 1), (8, 5))  # rows x new tokens: eight decode rows, eight verify rounds
TILE_FORMS = ("tiles", "loops")
TILES_TIMING_KEYS = 2000  # cached keys a row: 33 MB of keys and values at 8 rows, beyond the L3 once flushed


@functools.cache
def tiles_here() -> bool:
    """Whether this process's numba attention takes heads of a multiple of PANEL values through the kernel's tiles
    or its loops, where both can (AVX-512): the kernel's default (TILED_ATTENTION: the tiles, but on Zen 4, where
    they are untimed) unless the other form took at most kernels.SWITCH its time, one layer at TILES_TIMING_STEPS
    over TILES_TIMING_KEYS keys a row (once per machine: kernels.chosen_form). On a 2-core Xeon the loops took
    1.32-1.45x the tiles' time there."""
    kernel = numba_kernel()
    if kernel is None or not kernel.AVX512:
        return False
    default, other = TILE_FORMS if kernel.TILED_ATTENTION else TILE_FORMS[::-1]
    chosen = chosen_form("attention over heads of 64 values and more", default, other, kernel, _tile_timings)
    return chosen == "tiles"


def _tile_timings() -> list[dict[str, Callable[[], object]]]:
    num_heads, num_kv_heads, head_dim = TILES_TIMING_HEADS
    cases: list[dict[str, Callable[[], object]]] = []
    for num_rows, num_new in TILES_TIMING_STEPS:
        num_keys = TILES_TIMING_KEYS + num_new
        k, v = (torch.randn(num_rows, num_keys, num_kv_heads, head_dim) for _ in "kv")  # a slot a row
        q = torch.randn(num_rows * num_new, num_heads, head_dim)
        cu, slots = tuple(range(0, num_rows * num_new + 1, num_new)), tuple(range(num_rows))
        keys, chains = (num_keys,) * num_rows, (None,) * num_rows
        on = (q, k, v, cu, slots, keys, chains)
        cases.append(
            {
                form: functools.partial(
                    row_attention,
                    *on,
                    compiled_rows(cu, slots, keys, chains, compiled_step=True, tiles=form == "tiles"),
                )
                for form in TILE_FORMS
            }
        )
    return cases


@dataclasses.dataclass(frozen=True)
class CompiledRows:
    """The step's rows that the numba kernel takes, as its arrays; built once per step, shared by every layer."""

    starts: np.ndarray  # [R] int64 each row's first packed token
    num_new: np.ndarray  # [R] int64
    slots: np.ndarray  # [R] int64
    num_cached: np.ndarray  # [R] int64
    tree_offsets: np.ndarray  # [R] int64: where the row's [new, new] ancestor mask begins in tree_masks; -1: a chain
    tree_masks: np.ndarray  # [sum of trees' new**2] bool, row-major
    others: tuple[int, ...]  # the step's rows too long for the kernel: the row loop takes them
    tiles: bool  # heads of a multiple of PANEL values through the kernel's tiles, else its loops (AVX-512 only)


def compiled_rows(
    cu_num_tokens: Sequence[int],
    slots: Sequence[int],
    num_keys: Sequence[int],
    tree_masks: Sequence[torch.Tensor | None],  # per row: its new tokens' [new, new] ancestor mask; None: a chain
    *,
    compiled_step: bool = False,
    tiles: bool = False,
) -> CompiledRows:
    """The rows the numba kernel takes: those within NUMBA_MAX_NEW tokens and NUMBA_MAX_SCORES scores; in a step
    the compiled layers can take, and in every bfloat16 step (`compiled_step`: the runner decides), every row of up
    to NUMBA_MAX_NEW tokens and longer ones over up to NUMBA_MAX_ROW_KEYS keys, so that the whole step runs
    compiled (float32) and no token's bits depend on the rest of it.
    `tiles`: the attention tiles or loops (a model's attention_tiles: tiles_here() at its load)."""

    def takes(new: int, keys: int) -> bool:
        if compiled_step:
            return new <= NUMBA_MAX_NEW or keys <= NUMBA_MAX_ROW_KEYS
        return new <= NUMBA_MAX_NEW and new * keys <= NUMBA_MAX_SCORES

    rows = range(len(slots))
    short = [row for row in rows if takes(cu_num_tokens[row + 1] - cu_num_tokens[row], num_keys[row])]
    num_new = np.array([cu_num_tokens[row + 1] - cu_num_tokens[row] for row in short], np.int64)
    offsets, masks, used = np.full(len(short), -1, np.int64), [], 0
    for i, row in enumerate(short):
        mask = tree_masks[row]
        if mask is not None:
            offsets[i] = used
            masks.append(mask.numpy().ravel())
            used += mask.numel()
    return CompiledRows(
        starts=np.array([cu_num_tokens[row] for row in short], np.int64),
        num_new=num_new,
        slots=np.array([slots[row] for row in short], np.int64),
        num_cached=np.array([num_keys[row] for row in short], np.int64) - num_new,
        tree_offsets=offsets,
        tree_masks=np.concatenate(masks) if masks else np.zeros(0, np.bool_),
        others=tuple(sorted(set(rows) - set(short))),
        tiles=tiles,
    )


FLEX_BLOCK = 128  # FlexAttention's block of queries and of keys
# The grouped layout's queries per batch entry. Each group holds at most this many of one row's new tokens,
# so a group visits its own slot's key blocks alone. Sixteen keeps a decoding kernel's tile (16 queries times
# the query heads of a KV head) full enough, and on an H200 a group of 1, 8 or 16 queries cost the same.
GROUP_QUERIES = 16
# A step holding a row of more new tokens takes the packed layout, where a 128-query block reads each key
# once for all its queries; split into groups, a long prefill chunk reads its prefix once per group. 512 is
# the scheduler's default max_batch_tokens and the largest CUDA graph bucket: every step of a default server
# is grouped, and replayed where graphs run.
GROUPED_MAX_ROW = 512
_GROUP_COLUMNS = GROUP_QUERIES + 4  # QueryGroups.table: a group's tokens, a token's place, the group's key range


@dataclasses.dataclass(frozen=True)
class QueryGroups:
    """The grouped layout's queries: each row's new tokens in groups of at most GROUP_QUERIES, one group per
    batch entry of the attention call; a group never mixes rows.

        rows A (3 new), B (1 new), C (18 new): tokens a0..a2 b0 c0..c17 (N = 22), GROUP_QUERIES 16
        tokens [4, 16]: [a0 a1 a2 a2 .. a2], [b0 b0 .. b0], [c0 .. c15], [c16 c17 c17 .. c17]
        places [22]:    a_i -> 0 * 16 + i, b0 -> 16, c_i -> 32 + i (c16, c17 -> 48, 49)

    A group is padded with copies of its last token: they see what it sees, and their outputs are never read.
    Its queries share a slot, so the keys it may see are one range, computed on the host with the rest. So are
    the key blocks it visits, in the lists FlexAttention's block mask takes: the device evaluates nothing to
    build the mask. CUDA graphs hold more groups than a step uses; the others list no key block.

    The host's tables are small (a group lists at most a slot's blocks, plus one); on the device the block
    lists are as wide as the mask's key blocks, and `refill` copies a step's tables into them in place."""

    table: torch.Tensor  # [max(G, N), _GROUP_COLUMNS] long: see the properties
    block_counts: torch.Tensor  # [2, G] int32: each group's partial key blocks (visited, masked), then its full ones
    block_indices: torch.Tensor  # [2, G, W] int32: those blocks ascending, then 0s, which no kernel reads
    num_groups: int
    num_tokens: int

    @property
    def tokens(self) -> torch.Tensor:  # [G, GROUP_QUERIES] each query's packed token
        return self.table[: self.num_groups, :GROUP_QUERIES]

    @property
    def places(self) -> torch.Tensor:  # [N] each packed token's query in the flattened [G * GROUP_QUERIES]
        return self.table[: self.num_tokens, GROUP_QUERIES]

    @property
    def keys(self) -> torch.Tensor:  # [G, 3] the group's first key, the last any query sees, the last all see whole
        return self.table[: self.num_groups, GROUP_QUERIES + 1 :]

    def to(self, device: torch.device, num_key_blocks: int) -> QueryGroups:
        """On `device`, the block lists widened to the mask's num_key_blocks."""
        indices = torch.zeros(2, self.num_groups, num_key_blocks, dtype=torch.int32, device=device)
        _copy_lists(indices, self.block_indices)
        return QueryGroups(
            self.table.to(device, non_blocking=True),
            self.block_counts.to(device, non_blocking=True),
            indices,
            self.num_groups,
            self.num_tokens,
        )

    def refill(self, step: QueryGroups) -> None:
        """Copy a step's host tables into these (of the same group count), in place: three transfers."""
        self.table.copy_(step.table, non_blocking=True)
        self.block_counts.copy_(step.block_counts, non_blocking=True)
        _copy_lists(self.block_indices, step.block_indices)

    @classmethod
    def zeros(cls, num_groups: int, num_tokens: int, num_key_blocks: int, device: torch.device) -> QueryGroups:
        """Tables for steps of num_tokens in at most num_groups groups (CUDA graphs' static ones), to be refilled
        in place."""
        return cls(
            torch.zeros(max(num_groups, num_tokens), _GROUP_COLUMNS, dtype=torch.long, device=device),
            torch.zeros(2, num_groups, dtype=torch.int32, device=device),
            torch.zeros(2, num_groups, num_key_blocks, dtype=torch.int32, device=device),
            num_groups,
            num_tokens,
        )


def _copy_lists(target: torch.Tensor, lists: torch.Tensor) -> None:
    """[2, G, W] block lists into the first columns of a [2, G, KB] target (the rest stays 0)."""
    width = min(lists.shape[2], target.shape[2])  # a slot's blocks plus one may pass a one-slot cache's KB
    target[:, :, :width].copy_(lists[:, :, :width], non_blocking=True)


def groups_of(lengths: Sequence[int]) -> int:
    """The query groups rows of these new-token counts take."""
    return sum(-(-n // GROUP_QUERIES) for n in lengths)


def num_key_blocks(num_slots: int, max_len: int) -> int:
    """The block mask's key blocks: the KV cache seen as one sequence of num_slots * max_len keys."""
    return -(-num_slots * max_len // FLEX_BLOCK)


def query_groups(
    cu_num_tokens: Sequence[int],
    slots: Sequence[int],
    num_cached: Sequence[int],
    trees: Sequence[bool],  # per row: its new tokens are a tree (each sees its ancestors), else a chain
    max_len: int,
    num_groups: int | None = None,
) -> QueryGroups | None:
    """The step's query groups on the host, or None where a row is too long for them (the packed layout).

    num_groups: the groups to hold (CUDA graphs' static count; one per token covers any step); default as
    many as the step needs."""
    bounds = np.asarray(cu_num_tokens, np.int64)
    lengths = np.diff(bounds)
    if len(lengths) and lengths.max() > GROUPED_MAX_ROW:
        return None
    per_row = -(-lengths // GROUP_QUERIES)
    row_of = np.repeat(np.arange(len(lengths)), per_row)  # [G] each group's row
    nth = np.arange(len(row_of)) - np.repeat(np.cumsum(per_row) - per_row, per_row)  # [G] which of its row's groups
    starts = bounds[:-1][row_of] + nth * GROUP_QUERIES  # [G] each group's first packed token
    ends = np.minimum(starts + GROUP_QUERIES, bounds[1:][row_of])  # [G] one past its last
    used = len(starts)
    num_groups = used if num_groups is None else num_groups
    if used > num_groups:
        raise ValueError(f"a step of {used} query groups does not fit {num_groups}")
    num_tokens = int(bounds[-1])
    table = np.zeros((max(num_groups, num_tokens), _GROUP_COLUMNS), np.int64)
    table[:used, :GROUP_QUERIES] = np.minimum(starts[:, None] + np.arange(GROUP_QUERIES), ends[:, None] - 1)
    group_of = np.repeat(np.arange(used), ends - starts)
    table[:num_tokens, GROUP_QUERIES] = group_of * GROUP_QUERIES + np.arange(num_tokens) - starts[group_of]
    # Keys as kv_idx = slot * max_len + position; a token's position is its row's cached length plus its index.
    first = np.asarray(slots, np.int64)[row_of] * max_len
    cached, offset = np.asarray(num_cached, np.int64)[row_of], starts - bounds[:-1][row_of]
    table[:used, GROUP_QUERIES + 1] = first
    table[:used, GROUP_QUERIES + 2] = first + cached + offset + (ends - starts) - 1  # its last query's own key
    # A chain's first query sees its keys up to its own; a tree's queries see only the cache whole.
    table[:used, GROUP_QUERIES + 3] = first + cached + np.where(np.asarray(trees, bool)[row_of], -1, offset)
    table[used:num_groups, GROUP_QUERIES + 2 :] = -1  # an empty range: no key block
    keys = table[:num_groups, GROUP_QUERIES + 1 :]
    counts, indices = _group_blocks(keys[:, 0], keys[:, 1], keys[:, 2], max_len)
    return QueryGroups(
        torch.from_numpy(table), torch.from_numpy(counts), torch.from_numpy(indices), num_groups, num_tokens
    )


def _group_blocks(
    first: np.ndarray, last: np.ndarray, whole_to: np.ndarray, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """[G] key ranges -> [2, G] counts and [2, G, W] lists of the partial and full key blocks, as
    flex_block_mask's `ordered` would list them (ascending, first), W the most blocks one slot's range spans.

    The visited blocks hold keys first..last, a range; the full ones lie inside first..whole_to, a range inside
    it. So the partial ones are at most two ranges, either side of the full ones:

        blocks   lo ...... full_lo ...... full_hi ...... hi
                 partial   full                  partial
    """
    lo, hi = first // FLEX_BLOCK, last // FLEX_BLOCK  # an empty range (last -1) gives hi < lo: no block
    full_lo, full_hi = -(-first // FLEX_BLOCK), (whole_to + 1) // FLEX_BLOCK - 1
    num_full = np.maximum(full_hi - full_lo + 1, 0)
    before = np.where(num_full > 0, full_lo - lo, np.maximum(hi - lo + 1, 0))  # partial blocks before the full
    num_partial = before + np.where(num_full > 0, hi - full_hi, 0)
    j = np.arange(-(-max_len // FLEX_BLOCK) + 1)[None]  # [1, W]
    partial = np.where(j < before[:, None], lo[:, None] + j, full_hi[:, None] + 1 + j - before[:, None])
    partial = np.where(j < num_partial[:, None], partial, 0)
    full = np.where(j < num_full[:, None], full_lo[:, None] + j, 0)
    return np.stack([num_partial, num_full]).astype(np.int32), np.stack([partial, full]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class FlexLayout:
    """One step's block mask over the KV cache seen as [num_slots * max_len] keys; shared by every layer.

    groups: the grouped layout's queries (each group a batch entry); None: the packed layout, every query of
    the step in one sequence."""

    block_mask: object  # torch.nn.attention.flex_attention.BlockMask
    groups: QueryGroups | None = None


def flex_layout(
    *,
    kv_slots: torch.Tensor,  # [N] each query token's slot
    kv_positions: torch.Tensor,  # [N] each query token's own KV position
    row_bases: torch.Tensor,  # [N] its row's first new position (the row's cached length)
    tree_table: torch.Tensor | None,  # [N, W] bool: new token j of its row visible; None: every row a chain
    groups: QueryGroups | None,  # on the tokens' device; None: the packed layout
    num_slots: int,
    max_len: int,
) -> FlexLayout:
    """The step's block mask (see flex_block_mask)."""
    is_tree = torch.zeros_like(kv_slots, dtype=torch.bool) if tree_table is None else tree_table.any(dim=1)
    table = (
        tree_table
        if tree_table is not None
        else torch.zeros(kv_slots.shape[0], 1, dtype=torch.bool, device=kv_slots.device)
    )
    mask = flex_block_mask(
        kv_slots=kv_slots,
        kv_positions=kv_positions,
        row_bases=row_bases,
        is_tree=is_tree,
        tree_table=table,
        groups=groups,
        num_slots=num_slots,
        max_len=max_len,
    )
    return FlexLayout(mask, groups)


def flex_block_mask(
    *,
    kv_slots: torch.Tensor,  # [N]
    kv_positions: torch.Tensor,  # [N]
    row_bases: torch.Tensor,  # [N]
    is_tree: torch.Tensor,  # [N] bool: the query's row is a tree (tree_table applies), else a chain
    tree_table: torch.Tensor,  # [N, W] bool
    groups: QueryGroups | None,  # on the tokens' device, its block lists num_key_blocks wide
    num_slots: int,
    max_len: int,
):  # -> torch.nn.attention.flex_attention.BlockMask
    """Query token t sees key (slot, pos) when slot is its own and pos is cached, or pos is one of its row's
    new tokens that its chain (pos <= its own) or tree (tree_table) lets it see.

    Which key blocks a query block visits comes from the layout, not from evaluating the mask: every key a
    query sees lies in its own slot at or before its own position, one range of blocks per query. So the
    mask costs at most [query blocks, key blocks] comparisons, where create_block_mask evaluates every score
    and compiles anew for each query-block count. A block that every query of its query block sees whole (a
    chain's keys up to its own position, a tree's cached keys) is full: the kernel skips the mask there. The
    others it visits are partial: the mask below decides each score in them.

    - grouped: batch entry b is group b, its queries q_idx the group's tokens; a group's queries share a
      slot, so its blocks are one range from the slot's first key to its last query's position, listed on
      the host with the groups (QueryGroups.block_counts, block_indices).
    - packed: one batch entry, query q_idx is token q_idx; a 128-query block may hold several rows, and
      visits every block any of them needs, found here on the device.

    The mask reads the tensors passed here whenever a kernel evaluates it, so a caller that refills them in
    place (server/cuda_graphs.py) gets a mask for the new step from the same closure."""
    width = tree_table.shape[1]

    def sees(t, kv_idx):  # query token t, key kv_idx
        slot, pos = kv_idx // max_len, kv_idx % max_len
        base = row_bases[t]
        rel = pos - base
        in_tree = tree_table[t, rel.clamp(0, width - 1)] & (rel < width)
        new_ok = torch.where(is_tree[t], in_tree, pos <= kv_positions[t])
        return (slot == kv_slots[t]) & ((pos < base) | ((rel >= 0) & new_ok))

    num_keys = num_slots * max_len
    key_blocks = num_key_blocks(num_slots, max_len)

    if groups is not None:
        tokens = groups.tokens

        def grouped_mask(b, h, q_idx, kv_idx):
            return sees(tokens[b, q_idx], kv_idx)

        if groups.block_indices.shape[2] != key_blocks:
            raise ValueError(f"the groups' block lists are {groups.block_indices.shape[2]} wide, not {key_blocks}")
        counts, indices = groups.block_counts[:, :, None, None], groups.block_indices[:, :, None, None]
        return _block_mask(counts[0], indices[0], counts[1], indices[1], grouped_mask, (GROUP_QUERIES, num_keys))

    def packed_mask(b, h, q_idx, kv_idx):
        return sees(q_idx, kv_idx)

    starts = torch.arange(key_blocks, device=kv_slots.device) * FLEX_BLOCK  # [KB] each block's first key
    first = kv_slots * max_len  # [N] the query's first key, and its last: its own position
    last = first + kv_positions
    whole_to = torch.where(is_tree, first + row_bases - 1, last)  # [N] it sees every key from first to here
    num_tokens = kv_slots.shape[0]
    num_q_blocks = -(-num_tokens // FLEX_BLOCK)
    # Rows past the last query visit nothing, and keep their block from being full, as create_block_mask's do.
    padding = num_q_blocks * FLEX_BLOCK - num_tokens

    def by_query_block(per_query: torch.Tensor) -> torch.Tensor:  # [N, KB] -> [QB, FLEX_BLOCK, KB]
        return torch.nn.functional.pad(per_query, (0, 0, 0, padding)).view(num_q_blocks, FLEX_BLOCK, key_blocks)

    # [1, QB, KB]
    visits = by_query_block((starts + FLEX_BLOCK > first[:, None]) & (starts <= last[:, None])).any(dim=1)[None]
    full = by_query_block((starts >= first[:, None]) & (starts + FLEX_BLOCK - 1 <= whole_to[:, None])).all(dim=1)[None]
    # A full block is visited: every query of its block sees it, from its first key on. (Padding rows past the
    # last query see nothing: they have no full block.)
    partial = visits & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, QB, KB] bool -> each query block's count of listed key blocks, and their indices first."""
        counts = blocks.sum(dim=-1, dtype=torch.int32)[:, None]
        return counts, torch.argsort(~blocks, dim=-1, stable=True).to(torch.int32)[:, None]

    return _block_mask(*ordered(partial), *ordered(full), packed_mask, (num_tokens, num_keys))


def _block_mask(partial_counts, partial_indices, full_counts, full_indices, mask_mod, seq_lengths):
    """FlexAttention's BlockMask of these lists, without the query-side lists that only a backward reads."""
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(
        partial_counts,
        partial_indices,
        full_counts,
        full_indices,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=seq_lengths,
        **_forward_only(),
    )


@functools.cache
def _forward_only() -> dict[str, bool]:
    """from_kv_blocks' flag that skips the query-side lists, where this torch has it."""
    from torch.nn.attention.flex_attention import BlockMask

    has_it = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    return {"compute_q_blocks": False} if has_it else {}


def flex_attention(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [num_slots, max_len, KVH, D]
    v_cache: torch.Tensor,
    layout: FlexLayout,
) -> torch.Tensor:  # [N, H, D]
    num_slots, max_len, num_kv_heads, head_dim = k_cache.shape
    keys = k_cache.view(num_slots * max_len, num_kv_heads, head_dim).transpose(0, 1)[None]  # [1, KVH, S*L, D]
    values = v_cache.view(num_slots * max_len, num_kv_heads, head_dim).transpose(0, 1)[None]
    flex = _flex(q.device.type)
    if layout.groups is None:
        return flex(q.transpose(0, 1)[None], keys, values, layout.block_mask)[0].transpose(0, 1)
    # [G, H, GROUP_QUERIES, D]: every group a batch entry; the keys are one batch entry, which all share
    grouped = q[layout.groups.tokens].transpose(1, 2)
    out = flex(grouped, keys, values, layout.block_mask).transpose(1, 2)  # [G, GROUP_QUERIES, H, D]
    return out.reshape(-1, *q.shape[1:])[layout.groups.places]


# Compiled versions of flex attention a CUDA process may hold. Inductor's kernels specialize on the query-block
# count, on decoding (under 128 queries) or not, and on a single query: a server with its graph buckets and
# its prefill chunks' block counts passed dynamo's default limit of 8, past which flex attention ran its dense
# reference (every score materialized) and graph capture failed ("Cannot copy between CPU and CUDA tensors
# during CUDA graph capture"). Seen on an H200, torch 2.11. 64 leaves room for the buckets' few and a compile
# per prefill chunk's block count up to about 60 x 128 tokens.
FLEX_RECOMPILE_LIMIT = 64
GENERAL_KERNEL = {"FORCE_USE_FLEX_ATTENTION": True}  # FlexAttention's kernel_options: never the decoding kernel


class FlexCall:
    """Flex attention as compiled for one device type, falling back from the decoding kernel when inductor
    cannot build it.

    On an H200 (torch 2.11) inductor found no configuration of its decoding kernel (under 128 queries) for
    some shapes, the tiny test model's 4 rows x 17 tokens among them, and raised NoValidChoicesError at the
    first step of that shape; its general kernel built them. From that first failure on, this process takes
    the general kernel for every step: a compile that failed once would fail (and stall) again."""

    def __init__(self, flex: Callable[..., torch.Tensor], can_fall_back: bool):
        self.flex = flex
        self.can_fall_back = can_fall_back
        self.general_only = False

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask) -> torch.Tensor:
        if not self.general_only:
            try:
                return self.flex(q, keys, values, block_mask=block_mask, enable_gqa=True)
            except Exception as error:  # inductor's InductorError; its module path moves between releases
                if not self.can_fall_back or "NoValidChoicesError" not in str(error):
                    raise
                log.warning(
                    "flex attention: inductor cannot build its decoding kernel here; using its general "
                    "kernel from now on (%s)",
                    str(error).splitlines()[0][:200],
                )
                self.general_only = True
        return self.flex(q, keys, values, block_mask=block_mask, enable_gqa=True, kernel_options=GENERAL_KERNEL)


@functools.cache
def _flex(device_type: str) -> FlexCall:
    from torch.nn.attention.flex_attention import flex_attention as flex

    if device_type != "cuda":
        return FlexCall(flex, can_fall_back=False)
    config, name = torch._dynamo.config, "recompile_limit"
    name = name if hasattr(config, name) else "cache_size_limit"  # its name before torch 2.6
    setattr(config, name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))
    return FlexCall(torch.compile(flex, dynamic=True), can_fall_back=True)


def row_attention(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [num_slots, max_len, KVH, D]
    v_cache: torch.Tensor,
    cu_num_tokens: tuple[int, ...],
    slots: tuple[int, ...],
    num_keys: tuple[int, ...],
    row_masks: tuple[torch.Tensor | None, ...],
    compiled: CompiledRows | None = None,
) -> torch.Tensor:  # [N, H, D]
    """Each row's attention over a view of its own slot: the `compiled` rows in one numba call (through the
    kernel's tiles or its loops, as they say), the others one call per row."""
    out = torch.empty_like(q)
    rows: Sequence[int] = range(len(slots))
    if compiled is not None:
        rows = compiled.others
        if len(compiled.slots):
            kernel = numba_kernel()
            assert kernel is not None, "CompiledRows are built only where the kernel compiled"
            if compiled.tiles and not kernel.AVX512:
                raise ValueError("the attention tiles are AVX-512 code; this CPU runs the loops")
            kernel.set_threads(torch.get_num_threads())
            # bfloat16: the caches read in place as their int16 bits; queries and sums in float32 (a small copy).
            sums = out if q.dtype == torch.float32 else torch.empty_like(q, dtype=torch.float32)
            kernel.attend(
                q.float().contiguous().numpy(),
                kernel_array(k_cache),
                kernel_array(v_cache),
                compiled.starts,
                compiled.num_new,
                compiled.slots,
                compiled.num_cached,
                compiled.tree_offsets,
                compiled.tree_masks,
                kernel.task_heads(len(compiled.slots), k_cache.shape[2]),
                compiled.tiles,
                sums.numpy(),
            )
            if sums is not out:
                out.copy_(sums)  # the row loop below overwrites the rows the kernel left
    for row in rows:
        start, end, slot = cu_num_tokens[row], cu_num_tokens[row + 1], slots[row]
        keys, values = k_cache[slot, : num_keys[row]], v_cache[slot, : num_keys[row]]
        out[start:end] = _one_row(q[start:end], keys, values, row_masks[row])
    return out


def _one_row(
    q: torch.Tensor,  # [T, H, D]
    keys: torch.Tensor,  # [K, KVH, D], a view of the row's KV slot: read in place, never copied
    values: torch.Tensor,  # [K, KVH, D]
    mask: torch.Tensor | None,  # [T, K] bool, or None: every query sees every key
) -> torch.Tensor:  # [T, H, D]
    """One row's attention. The G = H / KVH query heads sharing a KV head are folded into the
    query length, so grouped-query attention needs no repeated copy of the keys:

        q [T, H, D] -> [KVH, G * T, D] (head h = kv * G + g),  keys [K, KVH, D] -> [KVH, K, D]
    """
    num_new, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    folded = (
        q.view(num_new, num_kv_heads, group, head_dim)
        .permute(1, 2, 0, 3)
        .reshape(num_kv_heads, group * num_new, head_dim)
    )
    if mask is not None:
        mask = mask.repeat(group, 1)  # [G * T, K], the same mask for every head of a group
    out = F.scaled_dot_product_attention(
        folded[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], attn_mask=mask
    )[0]  # [KVH, G * T, D]
    return out.view(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3).reshape(num_new, num_heads, head_dim)
