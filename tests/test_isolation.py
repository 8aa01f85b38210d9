"""Failure isolation: a request that breaks the batched forward fails alone; its batch runs without it."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from harness import ServerThread
from raw_edge import PROMPT, Edge, status_of
from reference import greedy_decode
from specedge import wire
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.server.app import ServerConfig
from specedge.server.draws import RowDraw, draw_rows
from specedge.server.engine import EngineConfig
from specedge.server.isolation import NonFiniteLogits, run_isolated
from specedge.types import SamplingParams, SparseDist

MAX_NEW = 16


def test_bisection_isolates_each_bad_item_and_keeps_the_rest():
    calls = []

    def run_batch(items):
        calls.append(list(items))
        if any(item in ("bad1", "bad2") for item in items):
            raise ValueError("bad item in batch")
        return [item.upper() for item in items]

    items = ["a", "b", "bad1", "c", "d", "e", "bad2", "f"]
    results = run_isolated(run_batch, items)
    assert [r if isinstance(r, str) else "exc" for r in results] == ["A", "B", "exc", "C", "D", "E", "exc", "F"]
    assert all(isinstance(r, ValueError) for r in results if not isinstance(r, str))
    assert len(calls) <= 1 + 2 * 2 * 3  # two bad items among 8: at most log2(8) levels of two halves each
    assert run_isolated(run_batch, ["x", "y"]) == ["X", "Y"] and calls[-1] == ["x", "y"]  # no failure: one batch

    # A row whose logits hold NaN or inf fails alone; its neighbours in the same packed logits draw as usual.
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 1.0, 3.0], [0.0, float("nan"), 1.0], [float("inf"), 0.0, 0.0]])
    greedy = SamplingParams()
    drawn = draw_rows(
        logits,
        [
            RowDraw(2, greedy, positions=(5, 6)),
            RowDraw(1, greedy, positions=(9,)),
            RowDraw(1, SamplingParams(temperature=1.0), positions=(3,)),
        ],
    )
    assert drawn[0] == [1, 2] and all(isinstance(r, NonFiniteLogits) for r in drawn[1:])


class FaultyRunner:
    """The real runner, except: any batch holding SHAPE_BUG raises as a shape bug would; a row holding NAN gets
    NaN logits.

    While `gate` is clear, a forward waits for it (after setting `entered`), so a test can queue work behind it.
    """

    def __init__(self, runner, shape_bug: int, nan: int):
        self.runner, self.kv, self.move_kv, self.device = runner, runner.kv, runner.move_kv, runner.device
        self.forward_packed = lambda requests: torch.cat(self.forward(requests))
        self.shape_bug, self.nan = shape_bug, nan
        self.batches: list[list[tuple[int, ...]]] = []  # token ids of each row of every forward attempted
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def forward(self, requests):
        if not self.gate.is_set():
            self.entered.set()
            self.gate.wait(timeout=30)
        self.batches.append([r.token_ids for r in requests])
        if any(self.shape_bug in r.token_ids for r in requests):
            raise RuntimeError("The size of tensor a (7) must match the size of tensor b (8) (injected)")
        logits = self.runner.forward(requests)
        return [
            torch.full_like(row, float("nan")) if self.nan in r.token_ids else row for r, row in zip(requests, logits)
        ]


@pytest.fixture(scope="module")
def reference(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir)


def test_a_poisoned_request_fails_alone_and_the_batch_goes_on(tiny_target_dir, reference):
    fingerprint = wire.fingerprint_to_proto(HFTokenizer(tiny_target_dir).fingerprint)
    prompts = [PROMPT, PROMPT[::-1], PROMPT[3:] + PROMPT[:3]]
    expected = [greedy_decode(reference, prompt, MAX_NEW, {2}) for prompt in prompts]
    seen = {t for prompt, out in zip(prompts, expected) for t in (*prompt, *out)}
    shape_bug, nan = [t for t in range(300, 384) if t not in seen][:2]  # ids no good row ever carries
    faulty: list[FaultyRunner] = []

    def wrap(runner):
        faulty.append(FaultyRunner(runner, shape_bug, nan))
        return faulty[0]

    config = ServerConfig(model=str(tiny_target_dir), port=0, max_context=128, engine=EngineConfig(max_sessions=6))
    with ServerThread(config, wrap_runner=wrap) as server:
        engine = server.server.engine

        async def run():
            goods = [Edge(server.address, fingerprint) for _ in prompts]
            poisoned = Edge(server.address, fingerprint)
            opened = [await edge.open(prompt=p, max_new_tokens=MAX_NEW) for edge, p in zip(goods, prompts)]
            victim = await poisoned.open(prompt=PROMPT, max_new_tokens=MAX_NEW)
            # Hold the first good round inside its forward, queue the rest behind it: they all share the next step.
            runner = faulty[0]
            runner.gate.clear()
            good_rounds = [
                asyncio.ensure_future(goods[0].verify(opened[0].session_id, expected[0][1:3], num_generated=1))
            ]
            assert await asyncio.to_thread(runner.entered.wait, 30)
            good_rounds += [
                asyncio.ensure_future(edge.verify(o.session_id, out[1:3], num_generated=1))
                for edge, o, out in zip(goods[1:], opened[1:], expected[1:])
            ]
            bad_calls = [
                poisoned.verify(victim.session_id, [nan, 5], num_generated=1),
                poisoned.open(prompt=[shape_bug, 5, 6]),
            ]
            bad_rounds = [asyncio.ensure_future(status_of(call)) for call in bad_calls]
            while len(engine._work) < len(good_rounds) + len(bad_rounds):
                await asyncio.sleep(0.01)
            runner.gate.set()
            first_replies, bad_codes = await asyncio.gather(*good_rounds), await asyncio.gather(*bad_rounds)
            after_nan = await status_of(poisoned.verify(victim.session_id, num_generated=1))
            # The good sessions go on to the end, losslessly.
            outputs = []
            for edge, o, out, first in zip(goods, opened, expected, first_replies):
                tokens = [o.first_token_id, *first.token_ids]
                while len(tokens) < len(out) and tokens[-1] != 2:
                    reply = await edge.verify(
                        o.session_id, out[len(tokens) : len(tokens) + 3], num_generated=len(tokens)
                    )
                    tokens += reply.token_ids
                outputs.append(tokens)
                await edge.close(o.session_id)
            return bad_codes, after_nan, outputs

        failed_before = server.server.stats.snapshot()["requests_failed"]
        bad_codes, after_nan, outputs = asyncio.run(run())
        stats = server.server.stats.snapshot()
        assert not engine.sessions and engine.slots.num_free == engine.slots.num_slots

    internal = grpc.StatusCode.INTERNAL
    (nan_code, nan_details), (shape_code, shape_details) = bad_codes
    assert nan_code == internal and "non-finite logits" in nan_details and "session was closed" in nan_details
    assert shape_code == internal and "(RuntimeError)" in shape_details and "session was closed" in shape_details
    assert after_nan[0] == grpc.StatusCode.NOT_FOUND
    assert outputs == expected
    assert stats["requests_failed"] - failed_before == 2
    # The shared step really held good rows beside the poison, and ran again without it.
    batches = faulty[0].batches
    first_poisoned = next(i for i, batch in enumerate(batches) if any(shape_bug in row for row in batch))
    good_beside_poison = {(o[0], *o[1:3]) for o in expected} & set(batches[first_poisoned])
    assert len(batches[first_poisoned]) == 4 and len(good_beside_poison) == 2
    ran_without = [b for b in batches[first_poisoned + 1 :] if not any(shape_bug in row for row in b)]
    assert good_beside_poison <= {row for batch in ran_without for row in batch}


def test_out_of_memory_is_recognised_by_type_and_by_words():
    """One helper decides, wherever the failure came from (CUDA, oneDNN's words, the host)."""
    from specedge.server.isolation import failure_for_client, is_oom

    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(MemoryError()) and is_oom(RuntimeError("DefaultCPUAllocator: can't allocate: out of memory"))
    assert not is_oom(RuntimeError("The size of tensor a (7) must match the size of tensor b (8)"))
    assert not is_oom(ValueError("a prompt about running out of memory"))  # words alone, in the wrong type
    assert failure_for_client(MemoryError()).code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_row_whose_draws_raise_fails_alone():
    """Should the step's vectorized draws raise (a row the validation let through), the rows are drawn one by
    one and only the bad one fails."""
    from specedge.server.step import Stepper

    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 1.0, 3.0], [1.0, 0.0, 0.0]])
    greedy = SamplingParams()
    bad = RowDraw(
        1,
        SamplingParams(temperature=1.0),
        positions=(1,),
        draft_token_ids=(7,),
        draft_dists=(SparseDist((7,), (1.0,)),),
    )  # a draft id past this vocabulary: cannot be indexed
    drawn = Stepper._draw(logits, [RowDraw(1, greedy, positions=(0,)), bad, RowDraw(1, greedy, positions=(2,))])
    assert drawn[0] == [1] and drawn[2] == [0] and isinstance(drawn[1], Exception)
