"""The pure-Python scheduler: slots, the batcher, speculation advice (milliseconds, no torch)."""

import random

import pytest

from specedge.scheduler import Batcher, BatcherConfig, NoFreeSlot, PrefillChunk, SlotAllocator, slots_within_budget
from specedge.scheduler.speculation import SessionSpeculation, SpeculationConfig, StepCostModel, advise, expected_tokens


def test_slots_are_handed_out_and_given_back():
    slots = SlotAllocator(2)
    first, second = slots.acquire(), slots.acquire()
    assert {first, second} == {0, 1}
    with pytest.raises(NoFreeSlot, match="all 2 session slots are in use"):
        slots.acquire()
    slots.release(first)
    assert slots.acquire() == first
    with pytest.raises(ValueError):
        slots.release(7)


def test_double_release_is_refused():
    slots = SlotAllocator(1)
    slot = slots.acquire()
    slots.release(slot)
    with pytest.raises(ValueError, match="not in use"):
        slots.release(slot)


def test_rounds_go_first_in_arrival_order_within_the_token_budget():
    batcher = Batcher(BatcherConfig(max_batch_tokens=10, max_batch_rows=3, prefill_reserve=4, fair_shares=False))
    for name, tokens in [("a", 4), ("b", 5), ("c", 2), ("d", 1), ("e", 1)]:
        batcher.add_round(name, tokens)
    assert batcher.plan_step().rounds == ["a", "b"]  # c would exceed 10 tokens
    assert batcher.plan_step().rounds == ["c", "d", "e"]  # row budget: 3
    assert not batcher.plan_step()


def test_a_round_larger_than_the_budget_still_runs_alone():
    batcher = Batcher(BatcherConfig(max_batch_tokens=8, prefill_reserve=4, fair_shares=False))
    batcher.add_round("big", 100)
    batcher.add_round("small", 1)
    assert batcher.plan_step().rounds == ["big"]
    assert batcher.plan_step().rounds == ["small"]


def test_a_long_prompt_is_prefilled_in_chunks_between_rounds():
    batcher = Batcher(BatcherConfig(max_batch_tokens=64, prefill_reserve=16, fair_shares=False))
    batcher.add_round("a", 5)
    batcher.add_round("b", 40)
    batcher.add_prefill("p", 300)
    first = batcher.plan_step()
    assert first.rounds == ["a", "b"]
    assert first.prefills == [PrefillChunk("p", start=0, num_tokens=19, is_last=False)]
    batcher.add_round("a", 5)  # a's next round arrives while p is still prefilling
    second = batcher.plan_step()
    assert second.rounds == ["a"]
    assert second.prefills == [PrefillChunk("p", start=19, num_tokens=59, is_last=False)]
    chunks = [second.prefills[0]]
    while plan := batcher.plan_step():
        chunks += plan.prefills
    assert chunks[-1].is_last and chunks[-1].start + chunks[-1].num_tokens == 300
    assert all(a.start + a.num_tokens == b.start for a, b in zip(chunks, chunks[1:]))


def test_rounds_cannot_starve_a_waiting_prefill():
    batcher = Batcher(BatcherConfig(max_batch_tokens=32, prefill_reserve=8, fair_shares=False))
    batcher.add_prefill("p", 20)
    prefilled = 0
    for step in range(10):
        for name in "abcdefgh":
            batcher.add_round(f"{name}{step}", 4)  # 32 tokens of rounds every step
        plan = batcher.plan_step()
        assert sum(4 for _ in plan.rounds) <= 32 - 8 or not plan.prefills
        prefilled += sum(chunk.num_tokens for chunk in plan.prefills)
        for key in [f"{name}{step}" for name in "abcdefgh"]:
            batcher.remove(key)  # leftovers are re-queued by their sessions in real life
        if prefilled == 20:
            break
    assert prefilled == 20 and step == 2  # 8 tokens per step: 8 + 8 + 4


def test_prefills_are_served_first_come_first_served():
    batcher = Batcher(BatcherConfig(max_batch_tokens=10, prefill_reserve=10, fair_shares=False))
    batcher.add_prefill("first", 15)
    batcher.add_prefill("second", 5)
    assert [c.key for c in batcher.plan_step().prefills] == ["first"]
    assert [(c.key, c.num_tokens) for c in batcher.plan_step().prefills] == [("first", 5), ("second", 5)]


def test_one_piece_of_work_per_session_and_removal():
    batcher = Batcher()
    batcher.add_round("s", 3)
    with pytest.raises(ValueError, match="already has work queued"):
        batcher.add_round("s", 1)
    batcher.remove("s")
    batcher.remove("never-queued")
    assert not batcher.plan_step()


def test_speculation_advice_follows_acceptance_and_load():
    config = SpeculationConfig(max_draft_tokens=8)
    assert advise(0.8, 0.0, config) == 8  # idle server: drafting is nearly free
    assert advise(0.8, 0.2, config) == 4
    assert advise(0.8, 1.0, config) == 0  # saturated: every draft token costs a full token
    assert advise(0.1, 0.1, config) == 0  # a draft that is rarely right never pays
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_a_session_with_speculation_off_still_probes():
    session = SessionSpeculation(SpeculationConfig(max_draft_tokens=8, probe_every=4))
    for _ in range(20):
        session.observe(4, 0)  # nothing accepted: acceptance decays towards 0
    advice = [session.next_advice(load=0.5) for _ in range(8)]
    assert advice == [0, 0, 0, 1, 0, 0, 0, 1]
    for _ in range(20):
        session.observe(1, 1)  # the probes succeed: speculation comes back
    assert session.next_advice(load=0.0) == 8


def test_slots_are_sized_to_the_kv_budget():
    gib = 2**30
    assert slots_within_budget(requested=8, bytes_per_slot=gib, budget_bytes=None) == 8
    assert slots_within_budget(requested=8, bytes_per_slot=gib, budget_bytes=3 * gib + 5) == 3
    assert slots_within_budget(requested=2, bytes_per_slot=gib, budget_bytes=10 * gib) == 2
    with pytest.raises(ValueError, match="one KV slot needs 1.00 GiB but the KV budget is 0.50 GiB"):
        slots_within_budget(requested=1, bytes_per_slot=gib, budget_bytes=gib // 2)


def test_step_cost_model_measures_the_marginal_cost_of_a_token():
    model = StepCostModel(min_steps=4)
    assert model.load(fallback=0.1) == 0.1  # nothing measured yet
    for tokens in (1, 5, 2, 9, 1, 5):
        model.observe(batch_tokens=tokens, batch_rows=1, seconds=0.75 + 0.25 * tokens)
    a, b = model.fit()
    assert a == pytest.approx(0.75) and b == pytest.approx(0.25)
    assert model.load(fallback=0.0) == pytest.approx(0.25)  # one round per step pays the fixed cost alone
    for tokens in (8, 12, 16, 8, 12, 16) * 30:
        model.observe(batch_tokens=tokens, batch_rows=8, seconds=0.75 + 0.25 * tokens)
    assert model.load(fallback=0.0) == pytest.approx(0.25 / (0.75 / 8 + 0.25))  # rows share it: tokens dominate


def test_a_fit_without_a_fixed_cost_gives_the_fallback_load_not_every_token_at_full_price():
    # A tiny model on a busy CPU: small steps cost next to nothing and large ones grow faster than a line, so the
    # least-squares line crosses zero; its intercept clamps to 0, and b / (0 + b) = 1 would turn drafting off.
    convex = StepCostModel(min_steps=4)
    for tokens, seconds in [(1, 0.001), (4, 0.001), (64, 0.02), (256, 0.2)]:
        convex.observe(batch_tokens=tokens, batch_rows=1, seconds=seconds)
    fitted = convex.fit()
    assert fitted is not None and fitted[0] == 0.0 and fitted[1] > 0
    assert convex.load(fallback=0.2) == 0.2


def test_step_cost_model_needs_varied_steps_and_free_tokens_mean_no_load():
    flat = StepCostModel(min_steps=3)
    for _ in range(10):
        flat.observe(batch_tokens=4, batch_rows=4, seconds=0.3)
    assert flat.fit() is None and flat.load(fallback=0.5) == 0.5
    memory_bound = StepCostModel(min_steps=3)  # a GPU at small batch: time does not grow with tokens
    for tokens in (1, 4, 16, 64):
        memory_bound.observe(batch_tokens=tokens, batch_rows=1, seconds=0.02)
    assert memory_bound.load(fallback=0.9) == 0.0


def test_a_waiting_prefill_always_gets_a_row():
    """Rounds enough to fill every row leave one for the prefill (the reserve once counted only tokens)."""
    batcher = Batcher(BatcherConfig(max_batch_tokens=512, max_batch_rows=4, prefill_reserve=8, fair_shares=False))
    for key in "abcdef":
        batcher.add_round(key, 2)
    batcher.add_prefill("p", 30)
    plan = batcher.plan_step()
    assert plan.rounds == ["a", "b", "c"] and [(c.key, c.start, c.num_tokens) for c in plan.prefills] == [("p", 0, 30)]
    assert plan.num_rows == 4


def test_rounds_keep_a_step_near_the_knee():
    """With the knee known, a chunk beside rounds fills only up to it (never below the reserve);
    without rounds the prefill takes the whole budget."""
    batcher = Batcher(BatcherConfig(max_batch_tokens=512, prefill_reserve=16, fair_shares=False))
    batcher.curve = (0.6, 0.01)  # seconds ~ 0.6 + 0.01 * tokens: the knee is at 60 tokens
    batcher.add_round("a", 5)
    batcher.add_round("b", 5)
    batcher.add_prefill("p", 1000)
    assert [c.num_tokens for c in batcher.plan_step().prefills] == [50]  # 60 - 10
    batcher.add_round("a", 50)
    assert [c.num_tokens for c in batcher.plan_step().prefills] == [16]  # the reserve
    assert [c.num_tokens for c in batcher.plan_step().prefills] == [512]  # no rounds


def test_the_knee_comes_from_the_measured_cost_curve():
    model = StepCostModel(min_steps=4)
    assert model.knee_tokens() is None
    for tokens in (1, 5, 10, 40, 80):
        model.observe(batch_tokens=tokens, batch_rows=1, seconds=0.2 + 0.01 * tokens)  # a = 0.2, b = 0.01
    assert model.knee_tokens() == 20


def test_the_knee_holds_when_most_steps_sit_at_the_budget():
    """Steps cluster at the budget once it binds; their noise must not drag the fit (and the knee) away."""
    model = StepCostModel(min_steps=4)
    for tokens in (1, 4, 16, 64):  # the start-up timing: a = 0.1, b = 0.01 -> knee 10
        model.observe(batch_tokens=tokens, batch_rows=1, seconds=0.1 + 0.01 * tokens)
    noise = random.Random(0)
    for i in range(500):  # then the budget binds: steps of 9-11 tokens, on a busy machine (times +-30%)
        tokens = 9 + i % 3
        model.observe(batch_tokens=tokens, batch_rows=4, seconds=(0.1 + 0.01 * tokens) * noise.uniform(0.7, 1.3))
        assert 7 <= model.knee_tokens() <= 14, i
