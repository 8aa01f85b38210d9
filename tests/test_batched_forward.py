"""Property: a batched forward gives every session the logits it would get alone.

Random mixes of sessions (cache lengths, chains, trees, prefill chunks) go
through one forward; each row must match the same request run by itself on a
fresh cache, within float tolerance. A mask leaking across rows (the research
baseline's bug) or padding reaching a real token would break it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.registry import ResolvedModel
from specedge.server.loading import load_target
from specedge.server.runner import ForwardRequest, KVCache, ModelRunner

NUM_SLOTS, MAX_LEN, VOCAB = 6, 96, 384


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    target = load_target(ResolvedModel("tiny", "hf", tiny_target_dir), device=torch.device("cpu"), dtype=torch.float32)
    return target.model


def _runner(model) -> ModelRunner:
    kv = KVCache(model, num_slots=NUM_SLOTS, max_len=MAX_LEN, device=torch.device("cpu"), dtype=torch.float32)
    return ModelRunner(model, kv)


@st.composite
def session_rounds(draw):
    """A batch of (prefix tokens already cached, the round's request) for distinct slots."""
    num_rows = draw(st.integers(1, NUM_SLOTS))
    slots = draw(st.permutations(range(NUM_SLOTS)))[:num_rows]
    rows = []
    for slot in slots:
        prefix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
        num_new = draw(st.integers(1, 12))
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


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=session_rounds())
def test_flex_attention_gives_every_row_what_the_row_loop_gives(model, rows):
    """CUDA's path (one FlexAttention call, a block mask over every slot) against the CPU's row loop, on the same
    random mixes of prefixes, chains, trees and chunks. On a CPU FlexAttention runs its eager reference, so this
    checks the mask and layout; the compiled kernel's speed is for a GPU to measure."""
    expected = _runner(model)
    expected.forward([ForwardRequest(r.slot, 0, tuple(prefix)) for prefix, r in rows])
    want = expected.forward([r for _, r in rows])
    model.attention = "flex"
    try:
        flex = _runner(model)
        flex.forward([ForwardRequest(r.slot, 0, tuple(prefix)) for prefix, r in rows])
        got = flex.forward([r for _, r in rows])
        kv_written = [(k[:, :MAX_LEN] - k_want).abs().max() for k, k_want in zip(flex.kv.k, expected.kv.k)]
    finally:
        model.attention = "rows"
    for logits, reference in zip(got, want):
        torch.testing.assert_close(logits, reference, atol=2e-4, rtol=0)
    assert max(kv_written) < 1e-4  # the same keys landed in the same places


def test_attention_path_is_chosen_by_device():
    from specedge.server.attention import resolve_attention

    assert resolve_attention("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_attention("auto", torch.device("cpu")) == "rows"
    assert resolve_attention("flex", torch.device("cpu")) == "flex"  # allowed, for checking the layout
    with pytest.raises(ValueError, match="unknown attention path 'paged'"):
        resolve_attention("paged", torch.device("cpu"))
