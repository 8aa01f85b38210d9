"""Property: a batched forward gives every session the logits it would get alone.

Random mixes of sessions (cache lengths, chains, trees, prefill chunks) go
through one forward; each row must match the same request run by itself on a
fresh cache, within float tolerance. A mask leaking across rows (the research
baseline's bug) or padding reaching a real token would break it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specedge.registry import ResolvedModel
from specedge.server import attention
from specedge.server.attention import FLEX_BLOCK, GENERAL_KERNEL, GROUP_QUERIES, NUMBA_MAX_NEW, FlexCall, query_groups
from specedge.server.loading import load_target
from specedge.server.runner import ForwardRequest, KVCache, ModelRunner

NUM_SLOTS, MAX_LEN, VOCAB = 6, 96, 384
MASK_SLOTS = 3  # and slots of 384 keys (whole key blocks: where a block can be full) or 320 (blocks straddle slots)


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    target = load_target(ResolvedModel("tiny", "hf", tiny_target_dir), device=torch.device("cpu"), dtype=torch.float32)
    return target.model


def _runner(model) -> ModelRunner:
    kv = KVCache(model, num_slots=NUM_SLOTS, max_len=MAX_LEN, device=torch.device("cpu"), dtype=torch.float32)
    return ModelRunner(model, kv)


@st.composite
def session_rounds(draw, max_new=12, max_prefix=40, num_slots=NUM_SLOTS):
    """A batch of (prefix tokens already cached, the round's request) for distinct slots."""
    num_rows = draw(st.integers(1, num_slots))
    slots = draw(st.permutations(range(num_slots)))[:num_rows]
    rows = []
    for slot in slots:
        prefix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_prefix))
        num_new = draw(st.integers(1, max_new))
        new = tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=num_new, max_size=num_new)))
        parents = None
        if num_new > 1 and draw(st.booleans()):
            parents = tuple(draw(st.integers(0, i - 1)) for i in range(1, num_new))
        all_logits = parents is not None or draw(st.booleans())
        rows.append((prefix, ForwardRequest(slot, len(prefix), new, tree_parents=parents, all_logits=all_logits)))
    return rows


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=session_rounds())
def test_batched_rows_equal_each_row_alone(model, rows):
    batched = _runner(model)
    batched.forward([ForwardRequest(r.slot, 0, tuple(prefix)) for prefix, r in rows])  # fill the prefixes
    together = batched.forward([r for _, r in rows])
    for (prefix, request), logits in zip(rows, together):
        alone = _runner(model)
        alone.forward([ForwardRequest(request.slot, 0, tuple(prefix))])
        [expected] = alone.forward([request])
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)


def test_rows_do_not_disturb_other_slots(model):
    """A forward writes only its own rows' positions: every other KV entry is untouched."""
    runner = _runner(model)
    runner.forward([ForwardRequest(slot, 0, tuple(range(5 + slot, 30 + slot))) for slot in range(NUM_SLOTS)])
    before = [k.clone() for k in runner.kv.k]
    runner.forward([ForwardRequest(2, 25, (7, 8, 9, 10), tree_parents=(0, 0, 2)), ForwardRequest(4, 29, (11,))])
    for layer_before, layer_after in zip(before, runner.kv.k):
        changed = (layer_before != layer_after).any(dim=-1).any(dim=-1)  # [slots, positions]
        assert set(map(tuple, changed.nonzero().tolist())) <= {(2, 25), (2, 26), (2, 27), (2, 28), (4, 29)}
        assert changed[2, 25:29].all() and changed[4, 29]


def test_a_row_past_its_slot_is_refused_before_any_kernel(model):
    """On CUDA an out-of-range index is a device-side assert that poisons every session: it never gets there."""
    runner = _runner(model)
    with pytest.raises(ValueError, match="exceed the slot"):
        runner.forward([ForwardRequest(0, 0, (1, 2)), ForwardRequest(1, MAX_LEN - 2, (3, 4, 5))])


def test_server_drafting_drafts_each_row_only_its_own_count(model):
    """A stream near the end of its slot, beside a stream drafting 6: each row drafts its own count, so
    nothing is forwarded past a slot and no isolation retry is needed (it once drafted the longest for all)."""
    from specedge.server.server_draft import DraftRow, ServerDrafter

    runner = _runner(model)
    runner.forward([ForwardRequest(0, 0, tuple(range(10))), ForwardRequest(1, 0, tuple(range(MAX_LEN - 3)))])
    forwards = []
    counting = type(
        "Counting", (), {"forward": lambda self, requests: forwards.append(requests) or runner.forward(requests)}
    )()
    drafts = ServerDrafter(counting).propose(
        [DraftRow(0, 10, (11,), num_tokens=6), DraftRow(1, MAX_LEN - 3, (7,), num_tokens=2)]
    )
    assert [len(d) for d in drafts] == [6, 2]
    assert len(forwards) == 6 and [len(requests) for requests in forwards] == [2, 2, 1, 1, 1, 1]
    assert max(r.num_cached + len(r.token_ids) for requests in forwards for r in requests if r.slot == 1) == MAX_LEN - 1


def _on_path(model, attention: str, rows) -> tuple[list[torch.Tensor], ModelRunner]:
    """Each round's logits with every prefix cached first, on one attention path; and the runner."""
    default = model.attention
    model.attention = attention
    try:
        runner = _runner(model)
        runner.forward([ForwardRequest(r.slot, 0, tuple(prefix)) for prefix, r in rows])
        return runner.forward([r for _, r in rows]), runner
    finally:
        model.attention = default


@pytest.fixture(params=["grouped", "packed"])
def flex_queries(request, monkeypatch):
    """Flex attention's two layouts of the queries: grouped (any step of short rows) and packed (forced here)."""
    if request.param == "packed":
        monkeypatch.setattr(attention, "GROUPED_MAX_ROW", 0)
    return request.param


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=session_rounds(max_new=2 * GROUP_QUERIES + 4))  # rows of up to three query groups
def test_flex_attention_gives_every_row_what_the_row_loop_gives(model, rows, flex_queries):
    """CUDA's path (one FlexAttention call, a block mask over every slot) against the CPU's row loop, on the same
    random mixes of prefixes, chains, trees and chunks, in both layouts. On a CPU FlexAttention runs its eager
    reference, so this checks the mask and layout; the compiled kernel's speed is for a GPU to measure."""
    want, expected = _on_path(model, "rows", rows)
    got, flex = _on_path(model, "flex", rows)
    for logits, reference in zip(got, want):
        torch.testing.assert_close(logits, reference, atol=2e-4, rtol=0)
    kv_written = [(k - k_want).abs().max() for k, k_want in zip(flex.kv.k, expected.kv.k)]
    assert max(kv_written) < 1e-4  # the same keys landed in the same places


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=session_rounds(max_new=2 * GROUP_QUERIES + 4, max_prefix=300, num_slots=MASK_SLOTS))
@example(rows=[((1,) * 200, ForwardRequest(1, 200, (5, 6, 7, 8)))])  # keys 384..583: block 3 full, 4 partial
# Three query groups of one row (the last ends past key block 1 when a slot is 384 keys), beside a short row.
@example(rows=[((1,) * 90, ForwardRequest(0, 90, (5,) * 40)), ((1,) * 10, ForwardRequest(2, 10, (6, 7)))])
# Grouped: a 20-node tree whose second group's nodes do not see node 1, in key block 0; a chain whose last
# query's own key opens key block 1.
@example(rows=[((1,) * 120, ForwardRequest(0, 120, (5,) * 20, tree_parents=(0, *range(0, 18))))])
@example(rows=[((1,) * 100, ForwardRequest(0, 100, (5,) * 29))])
@example(rows=[((1,) * 30, ForwardRequest(1, 30, (5,) * 12, tree_parents=(0,) * 11))])  # a tree
@example(rows=[((1,), ForwardRequest(1, 1, tuple(range(300))))])  # a prefill chunk: 3 query blocks, in slot 1
@example(rows=[((1,) * 150, ForwardRequest(2, 150, (5,) * 9, tree_parents=(0, 1, 1, 0, 4, 5, 5, 2)))])
# A 256-node tree: node 1 a leaf beside node 2, whose chain fills query block 1, which never sees node 1.
@example(rows=[((1,), ForwardRequest(0, 1, (5,) * 256, tree_parents=(0, 0, *range(2, 255))))])
@pytest.mark.parametrize("max_len", [384, 320])
def test_the_flex_block_mask_visits_every_block_a_query_sees(model, rows, max_len, flex_queries):
    """The block mask is built from the layout, not by evaluating the mask. A compiled kernel never looks at a
    block the mask leaves out (a CPU's reference does, so the test above cannot see this): every key a query
    sees must lie in a visited block, and a block listed as full (no mask applied) must be visible whole. For
    chains the partial and full blocks are exactly create_block_mask's. Each group of the grouped layout is a
    batch entry with blocks of its own, and its queries fill their block (the kernel masks the rest of the 128
    rows by Q_LEN: on an H200 the grouped layout gave the packed one's outputs); the examples' long rows take
    the packed layout in either case."""
    from torch.nn.attention.flex_attention import create_block_mask

    default = model.attention
    model.attention = "flex"
    try:
        kv = KVCache(model, num_slots=MASK_SLOTS, max_len=max_len, device=torch.device("cpu"), dtype=torch.float32)
        flex = ModelRunner(model, kv)._layout([r for _, r in rows]).flex
    finally:
        model.attention = default
    assert flex is not None
    mask = flex.block_mask
    num_queries, num_keys = mask.seq_lengths
    num_batches = mask.kv_num_blocks.shape[0]
    assert num_batches == (1 if flex.groups is None else len(flex.groups.tokens))
    block = FLEX_BLOCK
    for b in range(num_batches):
        sees = mask.mask_mod(b, 0, torch.arange(num_queries)[:, None], torch.arange(num_keys)[None])  # [Q, keys]
        needed = {(int(q) // block, int(k) // block) for q, k in sees.nonzero()}
        partial = _listed(mask.kv_num_blocks, mask.kv_indices, b)
        full = _listed(mask.full_kv_num_blocks, mask.full_kv_indices, b)
        assert needed <= partial | full and not partial & full
        for qb, kb in full:  # the kernel skips the mask in a full block: every score there must be visible
            assert sees[qb * block : (qb + 1) * block, kb * block : (kb + 1) * block].all(), (qb, kb)
    if all(r.tree_parents is None for _, r in rows):
        # A group's GROUP_QUERIES queries are its whole query block: a block all of them see whole is full.
        blocks = FLEX_BLOCK if flex.groups is None else (GROUP_QUERIES, FLEX_BLOCK)
        reference = create_block_mask(
            mask.mask_mod, num_batches, None, num_queries, num_keys, device="cpu", BLOCK_SIZE=blocks
        )
        for b in range(num_batches):
            assert _listed(mask.kv_num_blocks, mask.kv_indices, b) == _listed(
                reference.kv_num_blocks, reference.kv_indices, b
            )
            assert _listed(mask.full_kv_num_blocks, mask.full_kv_indices, b) == _listed(
                reference.full_kv_num_blocks, reference.full_kv_indices, b
            )


def test_query_groups_hold_one_rows_tokens_each():
    """Rows of 3, 1 and 18 tokens: four groups, each padded with its last token; places undo the grouping; each
    group's keys are one range in its own slot (kv_idx = slot * max_len + position)."""
    groups = query_groups([0, 3, 4, 22], slots=[2, 0, 1], num_cached=[7, 3, 5], trees=[False, False, True], max_len=100)
    assert groups is not None
    tokens, q = groups.tokens.tolist(), GROUP_QUERIES
    assert tokens[0] == [0, 1] + [2] * (q - 2) and tokens[1] == [3] * q
    assert tokens[2] == list(range(4, 4 + q)) and tokens[3] == [20] + [21] * (q - 1)
    assert torch.equal(groups.tokens.reshape(-1)[groups.places], torch.arange(22))  # each token finds itself
    # first key, last key any query sees (its last query's own), last key every query sees whole
    assert groups.keys.tolist() == [
        [200, 209, 207],  # chain at 7 cached: its first query sees up to its own position, 207
        [0, 3, 3],
        [100, 120, 104],  # tree at 5 cached: every node sees the cache whole, its own branch only in part
        [100, 122, 104],
    ]
    held = query_groups([0, 3, 4], slots=[0, 1], num_cached=[5, 5], trees=[False, False], max_len=100, num_groups=5)
    assert held is not None and held.tokens.shape == (5, q)
    assert [last for _, last, _ in held.keys.tolist()] == [7, 105, -1, -1, -1]  # unused groups see no key
    assert query_groups([0, attention.GROUPED_MAX_ROW + 1], [0], [0], [False], max_len=1000) is None  # packed
    with pytest.raises(ValueError, match="3 query groups does not fit 2"):
        query_groups([0, 1, 2, 3], [0, 1, 2], [0, 0, 0], [False] * 3, max_len=100, num_groups=2)


def test_query_groups_list_their_key_blocks_on_the_host():
    """A group's partial key blocks lie either side of its full ones, both listed ascending first, then 0s.

    max_len 320, slot 1: keys 320..639, blocks of 128 (block 2: keys 256..383, 3: 384..511, 4: 512..639)."""
    groups = query_groups(
        [0, 5, 10, 11], slots=[1, 0, 2], num_cached=[250, 250, 0], trees=[False, True, False], max_len=320, num_groups=4
    )
    assert groups is not None
    counts, indices = groups.block_counts.tolist(), groups.block_indices.tolist()
    # chain at 250 cached in slot 1: keys 320..574, seen whole by all 5 queries up to 570: block 3 alone is full
    # tree at 250 cached in slot 0: keys 0..254, the cache (0..249) seen whole: block 0 full, block 1 partial
    # one token at 0 cached in slot 2: key 640 alone, block 5, which it does not see whole (641..767 unseen)
    # an unused group: nothing
    assert [counts[0], counts[1]] == [[2, 1, 1, 0], [1, 1, 0, 0]]
    width = -(-320 // 128) + 1  # the most blocks one slot's keys span (unaligned, one more)
    assert indices[0] == [[2, 4] + [0] * (width - 2), [1] + [0] * (width - 1), [5] + [0] * (width - 1), [0] * width]
    assert indices[1] == [[3] + [0] * (width - 1), [0] * width, [0] * width, [0] * width]
    on_device = groups.to(torch.device("cpu"), num_key_blocks=8)
    assert on_device.block_indices.shape == (2, 4, 8) and on_device.block_indices[:, :, width:].eq(0).all()
    assert torch.equal(on_device.block_indices[:, :, :width], groups.block_indices)


def test_flex_falls_back_to_the_general_kernel_once_the_decoding_kernel_cannot_be_built():
    """Inductor raised NoValidChoicesError for some decoding-kernel shapes on an H200 (the test model's 4 x 17
    queries); its general kernel built them. After the first failure every call takes the general kernel, and
    any other error still reaches the caller."""
    calls = []

    def flex(q, keys, values, *, block_mask, enable_gqa, kernel_options=None):
        calls.append(kernel_options)
        if kernel_options is None and q.shape[2] == 68:
            raise RuntimeError("LoweringException: NoValidChoicesError: No choices to select.")
        if q.shape[2] == 0:
            raise RuntimeError("some other compile error")
        return q + 1

    call = FlexCall(flex, can_fall_back=True)
    x = torch.zeros(1, 4, 3, 16)
    assert torch.equal(call(x, x, x, None), x + 1) and calls == [None]
    y = torch.zeros(1, 4, 68, 16)
    assert torch.equal(call(y, y, y, None), y + 1) and calls[1:] == [None, GENERAL_KERNEL]
    call(x, x, x, None)
    assert calls[3:] == [GENERAL_KERNEL]  # the decoding kernel is not tried again
    with pytest.raises(RuntimeError, match="NoValidChoicesError"):
        FlexCall(flex, can_fall_back=False)(y, y, y, None)  # the CPU's reference has no kernels to choose
    with pytest.raises(RuntimeError, match="other compile error"):
        empty = torch.zeros(1, 4, 0, 16)
        FlexCall(flex, can_fall_back=True)(empty, empty, empty, None)


def _listed(counts: torch.Tensor | None, indices: torch.Tensor | None, batch: int = 0) -> set[tuple[int, int]]:
    """(query block, key block) pairs a BlockMask lists for one batch entry."""
    if counts is None or indices is None:
        return set()
    return {(qb, int(kb)) for qb, count in enumerate(counts[batch, 0].tolist()) for kb in indices[batch, 0, qb, :count]}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=session_rounds(max_new=NUMBA_MAX_NEW + 8))
def test_numba_attention_gives_every_row_what_the_row_loop_gives(model, rows):
    """The CPU default (short rows in one compiled call, longer ones through the row loop in the same step)
    against the row loop alone, on random mixes of prefixes, chains, trees and chunks on both sides of the
    kernel's limit."""
    want, _ = _on_path(model, "rows", rows)
    got, _ = _on_path(model, "numba", rows)
    for logits, reference in zip(got, want):
        torch.testing.assert_close(logits, reference, atol=2e-4, rtol=0)


def test_a_tree_node_gets_nothing_from_keys_it_cannot_see():
    """Keys outside a node's ancestors, and keys after its own, weigh exactly zero, however high they would
    score and whatever their values."""
    from specedge.server import tree
    from specedge.server.attention import compiled_rows, numba_kernel, row_attention

    assert numba_kernel() is not None
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, cached, parents = 6, 2, 16, 9, (0, 0, 1, 2)  # root -> 1 -> 3, root -> 2 -> 4
    new = len(parents) + 1
    k_cache = torch.randn(2, 32, kv_heads, dim, generator=generator)
    v_cache = torch.randn(2, 32, kv_heads, dim, generator=generator)
    q = torch.randn(new, heads, dim, generator=generator)
    mask = tree.ancestor_mask(parents, new)
    layout = compiled_rows((0, new), (1,), (cached + new,), (mask,))
    before = row_attention(q, k_cache, v_cache, (0, new), (1,), (cached + new,), (None,), layout)
    hidden = ~mask  # [new, new]: node t does not see new key j
    for t in range(new):
        unseen = cached + hidden[t].nonzero()[:, 0]
        keys, values = k_cache.clone(), v_cache.clone()
        keys[1, unseen] = 1e3 * q[t, :: heads // kv_heads]  # each KV head's first query head would score ~1e3
        values[1, unseen] = 1e30
        values[1, cached + new :] = float("nan")  # past the row's keys: never read
        after = row_attention(q, keys, values, (0, new), (1,), (cached + new,), (None,), layout)
        torch.testing.assert_close(after[t], before[t], atol=0, rtol=0)  # one path, one input: bit for bit


def _wide_head_step(head_dim: int, generator: torch.Generator):
    """A step of five rows over heads of head_dim values (12 heads, 2 KV heads, as the 1.5B): 1-16 new tokens over
    0-300 cached keys, chains and a tree. Returns (q, k_cache, v_cache, cu, slots, num_keys, tree masks)."""
    from specedge.server import tree

    lengths, cached = (1, 5, NUMBA_MAX_NEW, 5, 3), (0, 37, 300, 200, 1)
    masks = (None, None, None, tree.ancestor_mask((0, 0, 1, 2), 5), None)
    k_cache, v_cache = (torch.randn(5, 320, 2, head_dim, generator=generator) for _ in range(2))
    cu = (0, *itertools.accumulate(lengths))
    q = torch.randn(cu[-1], 12, head_dim, generator=generator)
    num_keys = tuple(c + n for c, n in zip(cached, lengths))
    return q, k_cache, v_cache, cu, (4, 0, 2, 1, 3), num_keys, masks


def _tiles_or_skip(tiles: bool) -> bool:
    """attend's choice of the attention tiles (True) or loops (False); the tiles run on AVX-512 only."""
    kernel = attention.numba_kernel()
    assert kernel is not None
    if tiles and not kernel.AVX512:
        pytest.skip("the attention tiles are AVX-512 IR")
    return tiles


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_numba_attention_over_wide_heads_gives_what_exact_attention_gives(head_dim, tiles):
    """Heads of 64 and 128 values, through the score and value tiles (AVX-512 only) and through the loops: every
    row within float32 rounding of the row loop in float64, in a step of five rows and alone."""
    from specedge.server import tree
    from specedge.server.attention import compiled_rows, row_attention

    tiles = _tiles_or_skip(tiles)
    q, k_cache, v_cache, cu, slots, num_keys, masks = _wide_head_step(head_dim, torch.Generator().manual_seed(3))
    layout = compiled_rows(cu, slots, num_keys, masks, tiles=tiles)
    assert layout.others == ()
    got = row_attention(q, k_cache, v_cache, cu, slots, num_keys, masks, layout)

    def full_mask(row: int) -> torch.Tensor:  # [new, cached + new]
        new = cu[row + 1] - cu[row]
        own = masks[row] if masks[row] is not None else tree.ancestor_mask(None, new)
        return torch.cat((torch.ones(new, num_keys[row] - new, dtype=torch.bool), own), dim=1)

    full_masks = tuple(full_mask(row) for row in range(len(slots)))
    exact = row_attention(q.double(), k_cache.double(), v_cache.double(), cu, slots, num_keys, full_masks)
    torch.testing.assert_close(got, exact.float(), atol=1e-5, rtol=1e-4)
    for row in range(len(slots)):  # alone, a KV head a task: the same code for every query, so the same bits
        one = ((0, cu[row + 1] - cu[row]), (slots[row],), (num_keys[row],), (masks[row],))
        tokens = slice(cu[row], cu[row + 1])
        alone = row_attention(q[tokens], k_cache, v_cache, *one, compiled_rows(*one, tiles=tiles))
        assert torch.equal(alone, got[tokens])


def test_the_tiles_are_refused_on_a_cpu_without_avx512(monkeypatch):
    """Asked for the attention tiles where they cannot run, row_attention says so before the kernel runs."""
    from specedge.server.attention import compiled_rows, row_attention

    q, k_cache, v_cache, cu, slots, num_keys, masks = _wide_head_step(128, torch.Generator().manual_seed(5))
    monkeypatch.setattr(attention.numba_kernel(), "AVX512", False)
    with pytest.raises(ValueError, match="AVX-512"):
        row_attention(
            q, k_cache, v_cache, cu, slots, num_keys, masks, compiled_rows(cu, slots, num_keys, masks, tiles=True)
        )
    loops = row_attention(q, k_cache, v_cache, cu, slots, num_keys, masks, compiled_rows(cu, slots, num_keys, masks))
    assert torch.isfinite(loops).all()


@pytest.mark.parametrize(("head_dim", "tiles"), [(16, False), (128, False), (128, True)])
def test_a_tokens_attention_has_the_same_bits_whatever_follows_it_in_its_row(head_dim, tiles):
    """A verify round's first k tokens give the same bits whether the round holds k tokens or all of them, so a
    token's attention does not depend on its round's length (heads of 16 through the loops, 128 through either)."""
    from specedge.server.attention import compiled_rows, row_attention

    tiles = _tiles_or_skip(tiles)
    q, k_cache, v_cache, *_ = _wide_head_step(head_dim, torch.Generator().manual_seed(4))
    cached, slot = 200, 1

    def first(k: int) -> torch.Tensor:
        layout = compiled_rows((0, k), (slot,), (cached + k,), (None,), tiles=tiles)
        return row_attention(q[:k], k_cache, v_cache, (0, k), (slot,), (cached + k,), (None,), layout)

    whole = first(NUMBA_MAX_NEW)
    for k in (1, 2, 5, 7):
        assert torch.equal(first(k), whole[:k])


def test_numba_attention_reads_a_bfloat16_cache_in_place_and_rounds_once():
    """A bfloat16 server's rows: the kernel reads the cache's bits where they lie and sums in float32, so each
    output is the float32 attention over the same bfloat16 values, rounded to bfloat16 once. Chains, a tree and
    a row too long for the kernel, in one call."""
    from specedge.server import tree
    from specedge.server.attention import compiled_rows, numba_unavailable, row_attention

    assert numba_unavailable(torch.device("cpu"), torch.bfloat16) is None  # its bfloat16 warm-up passed
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 12, 2, 128  # the 1.5B's heads: a row of keys is four 64-byte lines of bfloat16
    lengths, cached = (1, 5, 5, NUMBA_MAX_NEW + 3), (37, 200, 3, 20)
    mask = tree.ancestor_mask((0, 0, 1, 2), 5)
    row_masks = (None, None, mask, None)
    k_cache = torch.randn(4, 256, kv_heads, dim, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(4, 256, kv_heads, dim, generator=generator).to(torch.bfloat16)
    cu = (0, *itertools.accumulate(lengths))
    q = torch.randn(cu[-1], heads, dim, generator=generator).to(torch.bfloat16)
    num_keys = tuple(c + n for c, n in zip(cached, lengths))
    slots = (2, 0, 3, 1)
    layout = compiled_rows(cu, slots, num_keys, row_masks)
    assert layout.others == (3,)

    def full_mask(row: int) -> torch.Tensor:  # [new, cached + new]: every cached key, then the chain or tree
        own = tree.ancestor_mask(None if row_masks[row] is None else (0, 0, 1, 2), lengths[row])
        return torch.cat((torch.ones(lengths[row], cached[row], dtype=torch.bool), own), dim=1)

    full_masks = tuple(full_mask(row) for row in range(4))
    got = row_attention(q, k_cache, v_cache, cu, slots, num_keys, (None, None, None, full_masks[3]), layout)
    assert got.dtype == torch.bfloat16
    exact = row_attention(q.float(), k_cache.float(), v_cache.float(), cu, slots, num_keys, full_masks)
    for row in range(3):  # the kernel's rows: float32 sums of the same values, one rounding
        rows = slice(cu[row], cu[row + 1])
        torch.testing.assert_close(got[rows].float(), exact[rows].to(torch.bfloat16).float(), atol=1e-5, rtol=2**-7)


def test_the_kernel_takes_short_rows_and_leaves_long_ones_to_the_row_loop():
    """Up to 16 new tokens and 16k scores a row: a prefill chunk, or a verify round deep in a long context,
    goes to the flash kernel, which is faster there."""
    from specedge.server.attention import NUMBA_MAX_SCORES, compiled_rows

    lengths = [1, NUMBA_MAX_NEW, NUMBA_MAX_NEW + 1, 1, 5, 5]
    keys = [10, 40, 40, NUMBA_MAX_SCORES, NUMBA_MAX_SCORES // 5, NUMBA_MAX_SCORES // 5 + 1]
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    layout = compiled_rows(tuple(cu), tuple(range(6)), tuple(keys), (None,) * 6)
    assert layout.others == (2, 5)
    assert layout.starts.tolist() == [cu[row] for row in (0, 1, 3, 4)]
    assert layout.num_cached.tolist() == [9, 40 - NUMBA_MAX_NEW, NUMBA_MAX_SCORES - 1, NUMBA_MAX_SCORES // 5 - 5]


def test_attention_path_is_chosen_by_device_and_dtype():
    from specedge.server.attention import resolve_attention

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_attention("auto", cuda, torch.float32) == "flex"
    assert resolve_attention("auto", cpu, torch.float32) == "numba"
    assert resolve_attention("auto", cpu, torch.bfloat16) == "numba"
    assert resolve_attention("auto", cpu, torch.float16) == "rows"
    assert resolve_attention("rows", cpu, torch.float32) == "rows"
    assert resolve_attention("flex", cpu, torch.float32) == "flex"  # allowed, for checking the layout
    with pytest.raises(ValueError, match="--attention numba cannot run: the numba kernel takes float32 or bfloat16"):
        resolve_attention("numba", cpu, torch.float16)
    with pytest.raises(ValueError, match="--attention numba cannot run: the numba kernel is for CPUs"):
        resolve_attention("numba", cuda, torch.float32)
    with pytest.raises(ValueError, match="unknown attention path 'paged'"):
        resolve_attention("paged", cpu, torch.float32)


def test_a_bfloat16_prompt_has_the_same_bits_however_its_prefill_is_chunked(tiny_target_dir):
    """bfloat16 has no compiled layers, so every step runs the modules; there every row attends in the kernel (long
    rows 16 tokens at a time), as in float32's compiled steps, and with its products as panels a token's logits
    have the same bits in one prefill row of 40 tokens, in chunks of 23 and 17, in a 5-token chunk beside a long
    prefill row and two decode rows, or verified after the prompt. (A long row took SDPA and a short one the
    kernel: the real 1.5B's next-token logits moved by up to 0.125 with the chunking.)"""
    from specedge.server import matmul

    bf16, cpu = torch.bfloat16, torch.device("cpu")
    if (reason := matmul.numba_unavailable(cpu, bf16)) or not matmul.panels_here(bf16):
        pytest.skip(reason or "bfloat16's products are row-invariant at every size only as panels")
    target = load_target(
        ResolvedModel("tiny", "hf", tiny_target_dir), device=cpu, dtype=bf16, matmul="numba", attention="numba"
    )
    model = target.model
    assert model.compiled_layers is None and isinstance(model.lm_head, matmul.PanelLinear)
    runner = ModelRunner(model, KVCache(model, num_slots=4, max_len=MAX_LEN, device=cpu, dtype=bf16))
    torch.manual_seed(3)
    prompt, new = torch.randint(VOCAB, (40,)).tolist(), torch.randint(VOCAB, (5,)).tolist()
    whole = runner.forward([ForwardRequest(0, 0, tuple(prompt))])[0]
    runner.forward([ForwardRequest(1, 0, tuple(prompt[:23]), all_logits=False)])
    rest = runner.forward([ForwardRequest(1, 23, tuple(prompt[23:]))])[0]
    assert torch.equal(rest, whole[23:])
    runner.forward([ForwardRequest(2, 0, tuple(prompt[:30]), all_logits=False)])
    beside = runner.forward(
        [ForwardRequest(2, 30, tuple(prompt[30:35])), ForwardRequest(3, 0, tuple(prompt[:33]), all_logits=False)]
        + [ForwardRequest(slot, 40, (new[0],)) for slot in (0, 1)]
    )[0]
    assert torch.equal(beside[:5], whole[30:35])
    chain = [runner.forward([ForwardRequest(slot, 41, tuple(new[1:]))])[0] for slot in (0, 1)]
    assert torch.equal(chain[0], chain[1])
