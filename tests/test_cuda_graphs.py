"""CUDA graphs over token-count buckets (server/cuda_graphs.py).

On a CPU a GraphedRunner runs everything but the capture: the buckets, the padding row on the scratch slot,
the static tensors refilled in place and the block mask copied into the captured one. These tests check that
it gives every row what the plain runner gives and writes nothing outside its own rows and the scratch slot.
The capture itself needs a GPU: the last test runs only where one is present.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.registry import ResolvedModel
from specedge.server.attention import groups_of
from specedge.server.cuda_graphs import (
    GraphedRunner,
    bucket_for,
    graphs_unavailable,
    padded,
    static_groups,
)
from specedge.server.loading import load_target
from specedge.server.runner import ForwardRequest, KVCache, ModelRunner
from test_batched_forward import MAX_LEN, NUM_SLOTS, session_rounds

BUCKETS = (4, 16, 64)


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    target = load_target(
        ResolvedModel("tiny", "hf", tiny_target_dir), device=torch.device("cpu"), dtype=torch.float32, attention="flex"
    )
    return target.model


def _plain(model) -> ModelRunner:
    return ModelRunner(model, KVCache(model, num_slots=NUM_SLOTS, max_len=MAX_LEN, device="cpu", dtype=torch.float32))


def _graphed(model) -> GraphedRunner:
    kv = KVCache(model, num_slots=NUM_SLOTS + 1, max_len=MAX_LEN, device="cpu", dtype=torch.float32)
    runner = GraphedRunner(ModelRunner(model, kv), buckets=BUCKETS)
    runner.capture()
    return runner


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    assert [bucket_for(n, BUCKETS) for n in (1, 4, 5, 16, 17, 64, 65)] == [4, 4, 16, 16, 64, 64, None]


def test_padding_is_one_row_on_the_scratch_slot_asking_for_no_logits():
    requests = [ForwardRequest(2, 7, (1, 2, 3)), ForwardRequest(0, 3, (4,))]
    [*kept, pad] = padded(requests, 16, scratch_slot=6)
    assert kept == requests
    assert pad == ForwardRequest(6, 0, (0,) * 12, all_logits=False)
    assert padded(requests, 4, scratch_slot=6) == requests  # nothing to pad
    with pytest.raises(ValueError, match="does not fit a bucket of 2"):
        padded(requests, 2, scratch_slot=6)


@given(
    bucket=st.sampled_from([1, 4, 16, 64, 256, 512]),
    num_slots=st.integers(1, 80),
    data=st.data(),
)
def test_a_bucket_holds_the_groups_of_any_step_in_its_slots(bucket, num_slots, data):
    """Rows in distinct slots (the padding row in the scratch slot among them) never take more query groups
    than the bucket holds, and one step takes them all."""
    rows = min(num_slots, bucket)
    cuts = sorted(data.draw(st.sets(st.integers(1, bucket - 1), max_size=rows - 1))) if bucket > 1 else []
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, bucket])]  # at most `rows` rows, each of a token or more
    assert groups_of(lengths) <= static_groups(bucket, num_slots)
    worst = [1] * (rows - 1) + [bucket - rows + 1]  # one row holds every token the others leave
    assert groups_of(worst) == static_groups(bucket, num_slots)


def test_a_step_of_more_groups_than_its_bucket_holds_runs_eagerly(model, monkeypatch):
    """Two rows in one slot (never sent by the engine) could take more groups than a bucket holds: such a step
    is run by the plain runner, not refused."""
    plain, graphed = _plain(model), _graphed(model)
    for runner in (plain, graphed):
        runner.forward([ForwardRequest(slot, 0, tuple(range(1, 41))) for slot in range(NUM_SLOTS)])
    step = [ForwardRequest(slot % NUM_SLOTS, 30 + slot // NUM_SLOTS, (slot + 3,)) for slot in range(9)]
    assert groups_of([1] * 9 + [16 - 9]) > static_groups(16, NUM_SLOTS + 1)  # 10 groups; the bucket holds 7

    def no_replay(*_):
        raise AssertionError("replayed a step its bucket cannot hold")

    monkeypatch.setattr(graphed, "_replay", no_replay)
    for logits, reference in zip(graphed.forward(step), plain.forward(step)):
        torch.testing.assert_close(logits, reference, atol=2e-4, rtol=0)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=session_rounds())
def test_a_bucketed_step_gives_every_row_what_the_plain_runner_gives(model, rows):
    plain, graphed = _plain(model), _graphed(model)
    prefill = [ForwardRequest(r.slot, 0, tuple(prefix)) for prefix, r in rows]
    for runner in (plain, graphed):
        runner.forward(prefill)
    step = [r for _, r in rows]
    want, got = plain.forward(step), graphed.forward(step)
    assert [len(logits) for logits in got] == [r.num_logits for r in step]
    for logits, reference in zip(got, want):
        torch.testing.assert_close(logits, reference, atol=2e-4, rtol=0)
        assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    for k, k_want in zip(graphed.kv.k, plain.kv.k):
        assert (k[:NUM_SLOTS] - k_want).abs().max() < 1e-4  # the same keys in the same places; padding elsewhere


def test_padding_writes_only_to_the_scratch_slot(model):
    runner = _graphed(model)
    runner.forward([ForwardRequest(slot, 0, tuple(range(5 + slot, 30 + slot))) for slot in range(NUM_SLOTS)])
    before = [k.clone() for k in runner.kv.k]
    runner.forward([ForwardRequest(2, 25, (7, 8, 9, 10), tree_parents=(0, 0, 2)), ForwardRequest(4, 29, (11,))])
    for layer_before, layer_after in zip(before, runner.kv.k):
        changed = (layer_before != layer_after).any(dim=-1).any(dim=-1)  # [slots, positions]
        real = {(slot, pos) for slot, pos in map(tuple, changed.nonzero().tolist()) if slot != NUM_SLOTS}
        assert real == {(2, 25), (2, 26), (2, 27), (2, 28), (4, 29)}  # 5 tokens padded to 16 on the scratch slot


def test_each_step_refills_the_captured_block_mask(model):
    """A compiled kernel skips the blocks the captured mask's tensors leave out, so those must be the step's.
    (On a CPU FlexAttention's reference evaluates the mask everywhere: only this test sees stale blocks.) The
    bucket holds a query group per token; the step's groups are the first, and the others visit nothing."""
    runner = _graphed(model)
    step = [ForwardRequest(2, 25, (7, 8, 9, 10), tree_parents=(0, 0, 2)), ForwardRequest(4, 29, (11,))]
    runner.forward(step)
    captured = runner._captured[16].batch.flex
    want = runner.inner._layout(padded(step, 16, runner.scratch_slot)).flex
    assert captured is not None and want is not None
    assert captured.groups is not None and want.groups is not None
    used = len(want.groups.tokens)  # two rows and the padding row: three groups
    assert used == 3
    assert torch.equal(captured.groups.tokens[:used], want.groups.tokens)
    assert torch.equal(captured.groups.keys[:used], want.groups.keys)
    assert torch.equal(captured.groups.places, want.groups.places)
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        got, expected = getattr(captured.block_mask, counts), getattr(want.block_mask, counts)
        assert torch.equal(got[:used], expected) and not got[used:].any(), counts
        for b in range(used):
            count = int(expected[b, 0, 0])
            assert torch.equal(
                getattr(captured.block_mask, indices)[b, 0, 0, :count],
                getattr(want.block_mask, indices)[b, 0, 0, :count],
            ), (indices, b)
    assert int(captured.block_mask.kv_num_blocks.sum()) > 0


def test_greedy_decoding_through_the_buckets_equals_the_plain_runner(model):
    """Rows join and leave, so the steps cross buckets (and the prefill is larger than every bucket: eager)."""
    prompts = {slot: tuple((7 * slot + i) % 300 for i in range(70 + 3 * slot)) for slot in range(3)}
    answers = {}
    for runner in (_plain(model), _graphed(model)):
        tokens = {slot: list(prompt) for slot, prompt in prompts.items()}
        last = runner.forward([ForwardRequest(slot, 0, prompt, all_logits=False) for slot, prompt in prompts.items()])
        for slot, logits in zip(prompts, last):
            tokens[slot].append(int(logits[-1].argmax()))
        for step in range(12):
            live = [slot for slot in prompts if step < 6 + 3 * slot]
            requests = [ForwardRequest(slot, len(tokens[slot]) - 1, (tokens[slot][-1],)) for slot in live]
            for slot, logits in zip(live, runner.forward(requests)):
                tokens[slot].append(int(logits[-1].argmax()))
        answers[type(runner).__name__] = tokens
    assert answers["GraphedRunner"] == answers["ModelRunner"]


def test_graphs_say_why_they_cannot_run():
    assert "CUDA devices, not cpu" in graphs_unavailable(torch.device("cpu"), "flex", tensor_parallel=False)
    cuda = torch.device("cuda", 0)
    assert "need flex attention" in graphs_unavailable(cuda, "rows", tensor_parallel=False)
    assert "tensor-parallel" in graphs_unavailable(cuda, "flex", tensor_parallel=True)
    assert graphs_unavailable(cuda, "flex", tensor_parallel=False) is None


def test_the_row_loop_cannot_be_graphed(tiny_target_dir):
    target = load_target(ResolvedModel("tiny", "hf", tiny_target_dir), device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ValueError, match="need flex attention"):
        GraphedRunner(_plain(target.model))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU only")
def test_captured_graphs_replay_what_the_eager_forward_computes(tiny_target_dir):
    cuda = torch.device("cuda")
    model = load_target(ResolvedModel("tiny", "hf", tiny_target_dir), device=cuda, dtype=torch.float32).model
    eager = ModelRunner(model, KVCache(model, num_slots=NUM_SLOTS, max_len=MAX_LEN, device=cuda, dtype=torch.float32))
    kv = KVCache(model, num_slots=NUM_SLOTS + 1, max_len=MAX_LEN, device=cuda, dtype=torch.float32)
    graphed = GraphedRunner(ModelRunner(model, kv), buckets=BUCKETS)
    graphed.capture()
    assert all(graphed._captured[b].graph is not None for b in BUCKETS)
    prefill = [ForwardRequest(slot, 0, tuple(range(3 + slot, 20 + slot))) for slot in range(4)]
    step = [
        ForwardRequest(0, 17, (5, 6, 7), tree_parents=(0, 0)),
        ForwardRequest(1, 17, (8,)),
        ForwardRequest(3, 17, (9, 10, 11, 12, 13)),
    ]
    for runner in (eager, graphed):
        runner.forward(prefill)
    for _ in range(2):  # a second replay reads the refilled tensors, not the first step's
        for logits, reference in zip(graphed.forward(step), eager.forward(step)):
            torch.testing.assert_close(logits, reference, atol=2e-3, rtol=0)
        step = [ForwardRequest(r.slot, r.num_cached + len(r.token_ids), (r.token_ids[-1],)) for r in step]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU only")
def test_flex_attention_stays_compiled_past_dynamos_default_recompile_limit(tiny_target_dir):
    """Prefill steps of 1 to 9 query blocks (a compile each), then capture. Past dynamo's default limit of 8
    compiles, flex attention ran its dense reference, whose CPU tensors made capture fail."""
    torch._dynamo.reset()
    cuda, blocks = torch.device("cuda"), 9
    model = load_target(ResolvedModel("tiny", "hf", tiny_target_dir), device=cuda, dtype=torch.float32).model
    kv = KVCache(model, num_slots=3, max_len=blocks * 128 + 16, device=cuda, dtype=torch.float32)
    eager = ModelRunner(model, kv)
    for count in range(1, blocks + 1):
        eager.forward([ForwardRequest(0, 0, tuple(i % 50 for i in range(count * 128)), all_logits=False)])
    graphed = GraphedRunner(ModelRunner(model, kv), buckets=(4,))
    graphed.capture()
    step = [ForwardRequest(0, 5, (7, 8, 9))]
    torch.testing.assert_close(graphed.forward(step)[0], eager.forward(step)[0], atol=2e-3, rtol=0)
