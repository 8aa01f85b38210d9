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
