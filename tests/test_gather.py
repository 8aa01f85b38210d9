"""Gathering rounds (scheduler/gather.py): a step waits, at most its fixed cost, for rounds due back from edges."""

from __future__ import annotations

import asyncio
import time

import pytest

from harness import ServerThread
from raw_edge import PROMPT, Edge
from reference import greedy_decode
from specedge import wire
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.scheduler import BatcherConfig
from specedge.scheduler.gather import MISS_COOLDOWN_STEPS, SLACK, SMOOTHING, Gatherer, Turnaround, hold_until
from specedge.server.app import ServerConfig
from specedge.server.engine import EngineConfig
from specedge.v1 import specedge_pb2 as pb


def test_a_sessions_turnaround_is_learned_from_its_own_rounds():
    turnaround = Turnaround()
    turnaround.arrived(now=1.0)  # its first round (a prompt): nothing to learn from yet
    assert turnaround.due_by() is None
    turnaround.replied(now=2.0)
    assert turnaround.due_by() is None  # replied, but no turnaround known yet
    turnaround.arrived(now=2.4)
    assert turnaround.average_s == pytest.approx(0.4) and turnaround.due_by() is None  # its round is queued
    turnaround.replied(now=5.0)
    turnaround.arrived(now=5.2)  # 0.2 s this time: 0.3 * 0.2 + 0.7 * 0.4
    assert turnaround.average_s == pytest.approx(SMOOTHING * 0.2 + (1 - SMOOTHING) * 0.4) == pytest.approx(0.34)
    turnaround.replied(now=8.0)
    assert turnaround.due_by() == pytest.approx(8.0 + 0.34 * (1 + SLACK))


def test_a_step_holds_for_the_last_round_due_within_its_fixed_cost():
    # Queued work at t = 10; the step's fixed cost is 0.5 s, so rounds due by 10.5 are waited for.
    assert hold_until(10.0, [10.1, 10.3, None], step_fixed_s=0.5, since=10.0) == 10.3
    assert hold_until(10.0, [10.3, 10.7], step_fixed_s=0.5, since=10.0) == 10.3  # 10.7 is not worth a's wait
    assert hold_until(10.0, [9.9], step_fixed_s=0.5, since=10.0) is None  # overdue: never waited for
    assert hold_until(10.0, [10.7], step_fixed_s=0.5, since=10.0) is None
    assert hold_until(10.0, [None, None], step_fixed_s=0.5, since=10.0) is None  # nobody expected
    assert hold_until(10.0, [10.1], step_fixed_s=None, since=10.0) is None  # no measured curve yet
    # The deadline is fixed when the hold begins: arrivals that re-evaluate it do not stretch it.
    assert hold_until(10.4, [10.45, 10.6], step_fixed_s=0.5, since=10.0) == 10.45


def test_an_identity_that_missed_a_hold_is_not_waited_for_until_it_has_cooled_down():
    gatherer = Gatherer()
    due = [("s1", "mallory", 10.2), ("s2", "alice", 10.1)]
    assert gatherer.hold(10.0, due, step_fixed_s=0.5, since=10.0) == (10.2, {"s1", "s2"})
    gatherer.step_started(missed=["mallory"])  # alice's round came, mallory's did not
    for _ in range(MISS_COOLDOWN_STEPS):
        assert gatherer.hold(20.0, [("s1", "mallory", 20.2), ("s2", "alice", 20.1)], 0.5, since=20.0) == (20.1, {"s2"})
        assert gatherer.hold(20.0, [("s1", "mallory", 20.2)], 0.5, since=20.0) is None
        gatherer.step_started(missed=[])
    assert gatherer.hold(30.0, [("s1", "mallory", 30.2)], 0.5, since=30.0) == (30.2, {"s1"})
    assert gatherer.num_misses == 1 and gatherer.num_steps == 1 + MISS_COOLDOWN_STEPS


def test_a_hold_leaves_room_for_the_queued_rows_own_turnaround():
    # a = 0.5 s. Rows queued now that come back 0.2 s after their reply would find a merged step's server idle
    # for those 0.2 s, so the hold ends by since + 0.3: 10.2 is waited for, 10.4 is not.
    assert hold_until(10.0, [10.2], step_fixed_s=0.5, since=10.0, returns_s=0.2) == 10.2
    assert hold_until(10.0, [10.4], step_fixed_s=0.5, since=10.0, returns_s=0.2) is None
    assert hold_until(10.0, [10.2, 10.4], step_fixed_s=0.5, since=10.0, returns_s=0.2) == 10.2
    # Rows that take a step's fixed cost or longer to come back: merging never pays, so no hold at all.
    assert hold_until(10.0, [10.01], step_fixed_s=0.5, since=10.0, returns_s=0.5) is None
    assert hold_until(10.0, [10.01], step_fixed_s=0.5, since=10.0, returns_s=0.8) is None
    assert Gatherer().hold(10.0, [("s1", "alice", 10.2), ("s2", "bob", 10.4)], 0.5, 10.0, returns_s=0.2) == (
        10.2,
        {"s1"},
    )


STEP_S = 0.3  # each forward's time: the runner below sleeps it, and the pinned curve says it
THINK_S = 0.1  # each edge's time between a reply and its next round (its drafting), under STEP_S
SLOW_THINK_S = 0.4  # an edge that drafts for longer than a step's fixed cost


class SlowRunner:
    """The tiny target, as slow as a large one: every forward takes STEP_S more."""

    def __init__(self, inner):
        self.inner = inner
        self.model, self.kv, self.device = inner.model, inner.kv, inner.device

    def forward_packed(self, requests):
        time.sleep(STEP_S)
        return self.inner.forward_packed(requests)

    def forward(self, requests):
        time.sleep(STEP_S)
        return self.inner.forward(requests)

    def move_kv(self, moves):
        self.inner.move_kv(moves)


async def edge_stream(
    edge: Edge, expected: list[int], start_s: float, think_s: float = THINK_S, barrier: asyncio.Barrier | None = None
) -> tuple[list[int], list[pb.VerifyResponse]]:
    """Greedy rounds, think_s after each reply (empty drafts: one token a round, so the short answer is many);
    with a barrier, think_s after every edge on it has its reply."""
    await asyncio.sleep(start_s)
    opened = await edge.open(max_new_tokens=len(expected))
    tokens, replies = [opened.first_token_id], []
    while not replies or replies[-1].finish_reason == pb.FINISH_REASON_NONE:
        if barrier is not None:
            await barrier.wait()
        await asyncio.sleep(think_s)
        replies.append(await edge.verify(opened.session_id, [], [], num_generated=len(tokens)))
        tokens += replies[-1].token_ids
    return tokens, replies


def serve_slowly(tiny_target_dir, gather: bool) -> ServerThread:
    """The tiny target behind SlowRunner, its cost curve pinned at STEP_S a step."""
    config = ServerConfig(
        model=str(tiny_target_dir), port=0, max_context=256, engine=EngineConfig(batcher=BatcherConfig(gather=gather))
    )
    return ServerThread(config, wrap_runner=SlowRunner)


def pin_curve(server: ServerThread) -> None:
    engine = server.server.engine
    engine._update_curve = lambda curve, announce=False: None  # the pinned curve: STEP_S a step
    engine.batcher.curve = (STEP_S, 0.0)


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "not-gathered"])
def test_two_edges_out_of_phase_share_steps_once_gathered(tiny_target_dir, reference_model, gather):
    """Edge B starts 0.15 s after A. Ungathered, their rounds alternate steps (each arrives while the other's
    step runs); gathered, the step waits the 0.1 s for the other's round and both ride in it."""
    expected = greedy_decode(reference_model, PROMPT, 30, set(HFTokenizer(tiny_target_dir).eos_token_ids))
    fingerprint = wire.fingerprint_to_proto(HFTokenizer(tiny_target_dir).fingerprint)
    with serve_slowly(tiny_target_dir, gather) as server:
        pin_curve(server)

        async def run():
            a, b = Edge(server.address, fingerprint), Edge(server.address, fingerprint)
            return await asyncio.gather(edge_stream(a, expected, 0.0), edge_stream(b, expected, 0.15))

        runs = asyncio.run(run())
        stats = server.server.stats.snapshot()
    assert all(tokens == expected for tokens, _ in runs)  # lossless either way
    later = [reply for _, replies in runs for reply in replies[2:-1]]  # once a turnaround is known
    shared = sum(reply.timing.batch_size == 2 for reply in later) / len(later)
    if gather:
        assert shared >= 0.8
        assert stats["num_holds"] > 0 and 0 < stats["hold_s"] <= stats["num_holds"] * (STEP_S + 0.05)
    else:
        assert shared <= 0.5
        assert stats["num_holds"] == 0


def test_edges_that_draft_for_longer_than_a_steps_fixed_cost_are_not_waited_for(tiny_target_dir, reference_model):
    """Both edges send each round a drafting time after both have their replies: A after 0.4 s, B after 0.43 s,
    each longer than a step's fixed cost (0.3 s). B's round is due well within a of A's, so a hold bounded by a
    alone would wait the 0.03 s for it every round. But a merged step's replies leave the server idle for the
    0.4 s until A comes back, where B's step alone would have run: the hold's budget is a less the queued row's
    turnaround, nothing here, and every step starts the moment A's round is queued."""
    expected = greedy_decode(reference_model, PROMPT, 12, set(HFTokenizer(tiny_target_dir).eos_token_ids))
    fingerprint = wire.fingerprint_to_proto(HFTokenizer(tiny_target_dir).fingerprint)
    with serve_slowly(tiny_target_dir, gather=True) as server:
        pin_curve(server)

        async def run():
            a, b = Edge(server.address, fingerprint), Edge(server.address, fingerprint)
            barrier = asyncio.Barrier(2)
            return await asyncio.gather(
                edge_stream(a, expected, 0.0, SLOW_THINK_S, barrier),
                edge_stream(b, expected, 0.0, SLOW_THINK_S + 0.03, barrier),
            )

        runs = asyncio.run(run())
        stats = server.server.stats.snapshot()
    assert all(tokens == expected for tokens, _ in runs)
    assert len(runs[0][1]) >= 4  # rounds enough to have learned both turnarounds
    assert stats["num_holds"] == 0
