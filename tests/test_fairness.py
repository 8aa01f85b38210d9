"""Fair shares of a step: the budget from the cost curve, max-min shares, deficits, cut rounds (pure, milliseconds)."""

import collections
import math

import pytest

from specedge.scheduler import Batcher, BatcherConfig, PrefillChunk
from specedge.scheduler.fairness import max_min_shares, share_if_unbounded, water_level


def test_water_level_worked_examples():
    # 1 + L + 10 = 32 with L >= 10: L = 21.
    assert water_level({"a": 1, "b": 260, "c": 10}, 32) == 21
    # Nobody is under the equal share 30 / 3 = 10: everyone gets 10.
    assert water_level({"a": 40, "b": 50, "c": 60}, 30) == 10
    # 2 + 2L = 9: L = 3.5 (c and b both need more).
    assert water_level({"a": 2, "b": 5, "c": 7}, 9) == 3.5
    assert water_level({"a": 3, "b": 4}, 7) == math.inf  # everything fits


def test_max_min_shares_give_the_small_all_they_need_and_split_the_rest():
    grants, deficits = max_min_shares({"a": 1, "b": 260, "c": 10}, 32, {})
    assert grants == {"a": 1, "b": 21, "c": 10}  # see test_water_level_worked_examples
    assert deficits == {"a": 0.0, "b": 0.0, "c": 0.0}
    # Everything fits: everyone gets its demand, the budget is not spent.
    assert max_min_shares({"a": 3, "b": 4}, 100, {})[0] == {"a": 3, "b": 4}


def test_whole_tokens_go_to_the_most_owed_and_the_deficit_carries_forward():
    # 2 + 2 * 3.5 = 9: b and c are owed 3.5 each; one spare token, to the earlier (b) on a tie.
    grants, deficits = max_min_shares({"a": 2, "b": 5, "c": 7}, 9, {})
    assert grants == {"a": 2, "b": 4, "c": 3}
    assert deficits == {"a": 0.0, "b": -0.5, "c": 0.5}
    # Next step, same demands: c is owed 0.5 + 0.5, b only -0.5 + 0.5, so c gets the spare token.
    grants, deficits = max_min_shares({"a": 2, "b": 5, "c": 7}, 9, deficits)
    assert grants == {"a": 2, "b": 3, "c": 4}
    assert deficits == {"a": 0.0, "b": 0.0, "c": 0.0}


def test_more_claimants_than_tokens_take_turns():
    # Budget 2, three claimants of 1 token: each is owed 2/3 a step; over 3 steps each runs twice.
    deficits: dict = {}
    runs = []
    for _ in range(3):
        grants, deficits = max_min_shares({"a": 1, "b": 1, "c": 1}, 2, deficits)
        runs.append(sorted(key for key, granted in grants.items() if granted))
    assert runs == [["a", "b"], ["a", "c"], ["b", "c"]]
    assert all(abs(owed) < 1e-9 for owed in deficits.values())


def test_over_many_steps_everyone_gets_its_exact_share_within_a_token():
    demands = {"a": 3, "b": 50, "c": 50, "d": 50}  # budget 20: a 3, the rest 17 / 3 = 5.67 each
    deficits: dict = {}
    total = collections.Counter()
    for _ in range(300):
        grants, deficits = max_min_shares(demands, 20, deficits)
        assert sum(grants.values()) == 20
        total.update(grants)
    assert total["a"] == 900
    for key in "bcd":
        assert abs(total[key] - 300 * 17 / 3) <= 1


def test_a_claimant_that_left_starts_again_from_zero():
    # 10 / 3 = 3.33 each: 3 each and the spare token to a; b and c are owed a third.
    grants, deficits = max_min_shares({"a": 5, "b": 5, "c": 5}, 10, {})
    assert grants == {"a": 4, "b": 3, "c": 3} and deficits["c"] == pytest.approx(1 / 3)
    _, deficits = max_min_shares({"a": 5, "b": 5}, 10, deficits)  # c had nothing queued
    assert "c" not in deficits


def test_share_if_unbounded_is_what_an_edge_may_ask_for():
    # A needs 1, B 260, budget 32: A asking for everything would get half (B keeps 16); B gets all but A's 1.
    demands = {"A": 1, "B": 260}
    assert share_if_unbounded(demands, "A", 32) == 16
    assert share_if_unbounded(demands, "B", 32) == 31
    assert share_if_unbounded({"A": 1}, "A", 32) == 32  # alone: the whole budget
    # Three claimants needing 2, 30, 30 of 20: the one needing 2 could get 20 / 3 = 6.67 -> 6.
    assert share_if_unbounded({"x": 2, "y": 30, "z": 30}, "x", 20) == 6


# --- the batcher with fair shares ------------------------------------------------------------


def fair_batcher(step_tokens: int | None = 32, **options) -> Batcher:
    return Batcher(BatcherConfig(step_tokens=step_tokens, **options))


def test_a_heavy_neighbour_is_cut_to_its_share():
    """The issue's scenario: A sends 1-token rounds, B four sessions of 64-node drafts."""
    batcher = fair_batcher(32)
    batcher.add_round("a1", 1, owner="A")
    for i in range(4):
        batcher.add_round(f"b{i}", 65, owner="B")
    plan = batcher.plan_step()
    assert plan.budget == 32
    assert plan.rounds == ["a1", "b0", "b1", "b2", "b3"]
    # A gets its 1 token; B's 31 split over its four sessions: 7.75 each -> 8, 8, 8, 7.
    assert plan.cuts == {"b0": 8, "b1": 8, "b2": 8, "b3": 7}
    assert 1 + sum(plan.cuts.values()) == 32
    # What each could have asked for: A half the budget; each B session a quarter of B's 31 (7.75 -> 7).
    assert plan.shares == {"a1": 16, "b0": 7, "b1": 7, "b2": 7, "b3": 7}
    assert not batcher  # every round ran (cut), none waits


def test_alone_an_identity_gets_the_whole_budget_and_small_rounds_are_not_cut():
    batcher = fair_batcher(32)
    for i in range(4):
        batcher.add_round(f"b{i}", 65, owner="B")
    plan = batcher.plan_step()
    assert plan.cuts == {"b0": 8, "b1": 8, "b2": 8, "b3": 8}  # 32 / 4, nothing left unused
    for i in range(4):
        batcher.add_round(f"b{i}", 5, owner="B")  # drafts within the advice: 4 nodes each
    plan = batcher.plan_step()
    assert plan.rounds == ["b0", "b1", "b2", "b3"] and plan.cuts == {}


def test_a_round_larger_than_the_whole_budget_is_cut_not_skipped():
    batcher = fair_batcher(16)
    batcher.add_round("big", 100)
    plan = batcher.plan_step()
    assert plan.rounds == ["big"] and plan.cuts == {"big": 16} and plan.shares == {"big": 16}


def test_a_long_prefill_beside_a_stream_is_chunked_at_the_budget():
    """B's 3,000-token prompt beside A's 1-token rounds: A runs every step, B's chunks fill the rest."""
    batcher = fair_batcher(32)
    batcher.add_prefill("p", 3000, owner="B")
    chunks = []
    for _ in range(5):
        batcher.add_round("a", 1, owner="A")
        plan = batcher.plan_step()
        assert plan.rounds == ["a"] and plan.cuts == {}
        chunks += plan.prefills
    assert chunks[0] == PrefillChunk("p", start=0, num_tokens=31, is_last=False)
    assert [chunk.start for chunk in chunks] == [0, 31, 62, 93, 124]
    alone = batcher.plan_step()  # A idle: the prefill takes the whole budget
    assert alone.prefills == [PrefillChunk("p", start=155, num_tokens=32, is_last=False)]


def test_sessions_of_one_identity_share_its_grant_not_the_step():
    """Two identities: one with a single session, one with three. Shares go by identity first."""
    batcher = fair_batcher(30)
    batcher.add_round("x", 40, owner="X")
    for key in ("y1", "y2", "y3"):
        batcher.add_round(key, 40, owner="Y")
    plan = batcher.plan_step()
    assert plan.cuts == {"x": 15, "y1": 5, "y2": 5, "y3": 5}  # 30 / 2 identities; Y's 15 / 3 sessions


def test_without_identities_each_session_is_its_own():
    batcher = fair_batcher(30)
    for key in ("s1", "s2", "s3"):
        batcher.add_round(key, 40)
    assert batcher.plan_step().cuts == {"s1": 10, "s2": 10, "s3": 10}


def test_more_rows_than_tokens_wait_their_turn():
    batcher = fair_batcher(2)
    seen = collections.Counter()
    for key in ("a", "b", "c"):
        batcher.add_round(key, 1)
    for _ in range(3):
        plan = batcher.plan_step()
        for key in plan.rounds:  # a session re-queues once its round is answered
            batcher.add_round(key, 1)
        assert len(plan.rounds) == 2
        seen.update(plan.rounds)
    assert seen == {"a": 2, "b": 2, "c": 2}


@pytest.mark.parametrize(
    "curve, budget",
    [
        (None, 64),  # not measured yet: the default
        ((0.2, 0.01), 20),  # the knee: a / b
        ((0.2, 0.1), 8),  # a knee of 2 tokens: the floor
        ((0.2, 0.0), 512),  # tokens are free: the whole batch
        ((5.0, 0.001), 512),  # a knee of 5,000: no more than max_batch_tokens
    ],
)
def test_the_budget_is_the_measured_knee_within_its_floor_and_ceiling(curve, budget):
    batcher = Batcher(BatcherConfig(max_batch_tokens=512, min_step_tokens=8, default_step_tokens=64))
    batcher.curve = curve
    assert batcher.step_budget() == budget


def test_a_fixed_budget_overrides_the_curve():
    batcher = fair_batcher(24)
    batcher.curve = (0.2, 0.01)
    assert batcher.step_budget() == 24


def test_a_lone_identity_is_planned_by_arrival_full_chunks_and_no_cuts():
    """With nobody to be fair to, one identity's prompt is prefilled in full chunks and its big rounds run
    whole; a second identity opening a session brings the budget back (the knee, 32 tokens here)."""
    batcher = fair_batcher(None, max_batch_tokens=512)
    batcher.curve = (0.32, 0.01)  # 320 ms + 10 ms a token: the knee is 32 tokens
    batcher.open_identities = 1
    batcher.add_prefill("p", 3000, owner="B")
    assert batcher.plan_step().prefills == [PrefillChunk("p", start=0, num_tokens=512, is_last=False)]
    batcher.remove("p")
    for i in range(4):
        batcher.add_round(f"b{i}", 65, owner="B")
    plan = batcher.plan_step()
    assert plan.rounds == ["b0", "b1", "b2", "b3"] and plan.cuts == {}
    batcher.open_identities = 2
    for i in range(4):
        batcher.add_round(f"b{i}", 65, owner="B")
    assert batcher.plan_step().cuts == {"b0": 8, "b1": 8, "b2": 8, "b3": 8}


def test_the_knee_budget_grows_to_one_full_round_per_identity():
    """Eight equal edges with 5-token rounds (40 tokens) beside a knee of 20: nobody is cut, one step serves all;
    a heavy identity beside a light one is still cut to what the others leave of 2 x 17 = 34 tokens."""
    batcher = fair_batcher(None)
    batcher.curve = (0.2, 0.01)  # knee 20 tokens
    for edge in range(8):
        batcher.add_round(f"e{edge}", 5, owner=f"edge{edge}")
    plan = batcher.plan_step()
    assert plan.budget == 8 * 17 and len(plan.rounds) == 8 and plan.cuts == {}
    batcher.add_round("a", 1, owner="A")
    batcher.add_round("b", 65, owner="B")
    plan = batcher.plan_step()
    assert plan.budget == 34 and plan.cuts == {"b": 33}


def test_while_no_session_is_mid_answer_prompts_are_prefilled_in_full_steps():
    """Eight prompts arriving together (the benchmark's start): nobody's next token waits, so the step takes
    max_batch_tokens, shared max-min; once a session is answering, steps go back to the budget."""
    batcher = fair_batcher(None, max_batch_tokens=512)
    batcher.curve = (0.2, 0.01)  # knee 20 tokens
    batcher.open_identities, batcher.answering = 8, False
    for edge in range(8):
        batcher.add_prefill(f"p{edge}", 100, owner=f"edge{edge}")
    plan = batcher.plan_step()
    assert plan.budget == 512 and [chunk.num_tokens for chunk in plan.prefills] == [64] * 8
    batcher.answering = True
    plan = batcher.plan_step()
    assert plan.budget == 8 * 17 and [chunk.num_tokens for chunk in plan.prefills] == [17] * 8
