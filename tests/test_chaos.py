"""Chaos: 50 edges at once, 30 of them killed at random points of their rounds.

A kill closes the edge's connection abruptly, as a crash or a lost network
would: no CloseSession, calls cancelled wherever they are (queued, inside the
batched forward, or answered but unread), the Attach lease broken. Afterwards
no slot may be left behind, and every survivor's output must be token-identical
to target-only decoding.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time

import torch
from transformers import AutoModelForCausalLM

from harness import ServerThread
from reference import greedy_decode
from specedge import wire
from specedge.edge_client.channel import open_channel
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.server.app import ServerConfig
from specedge.server.engine import EngineConfig
from specedge.v1 import specedge_pb2 as pb
from specedge.v1 import specedge_pb2_grpc

NUM_EDGES, NUM_VICTIMS, MAX_NEW, VOCAB = 50, 30, 24, 384
PHASES = ("attached", "opening", "drafting", "verifying")  # where a victim may die; "opening"/"verifying": mid-call


class Killed(Exception):
    pass


class ChaosEdge:
    """A raw edge whose drafts come from a known continuation, right or corrupted; it may be doomed to die."""

    def __init__(self, address, fingerprint, prompt, continuation, rng: random.Random, death=None):
        self.channel = open_channel(address)
        self.stub = specedge_pb2_grpc.SpecEdgeStub(self.channel)
        self.fingerprint, self.prompt, self.continuation, self.rng = fingerprint, prompt, continuation, rng
        self.death = death  # (phase, round, seconds into it) or None for a survivor
        self.died: tuple[str, bool] | None = None  # (phase, whether a call was still in flight)

    async def point(self, phase: str, round_no: int, call=None):
        """Await `call` (an RPC already started), unless this edge dies here: then its connection goes."""
        if self.death is None or self.death[:2] != (phase, round_no):
            return await call if call is not None else None
        await asyncio.sleep(self.death[2])
        self.died = (phase, call is not None and not call.done())
        await self.channel.close(grace=None)  # abrupt: in-flight calls are cancelled, the socket closes
        if call is not None:
            call.cancel()
        raise Killed

    def drafts(self, generated: list[int]) -> list[int]:
        drafts = list(self.continuation[len(generated) : len(generated) + 4])
        if drafts and self.rng.random() < 0.4:  # a wrong token somewhere: the rest of the chain is rejected
            drafts[self.rng.randrange(len(drafts))] = self.rng.randrange(VOCAB)
        return drafts

    async def run(self) -> list[int] | None:
        lease = self.stub.Attach(pb.AttachRequest())
        try:
            await self.point("attached", 0)
            request = pb.OpenSessionRequest(
                tokenizer=self.fingerprint, prompt_token_ids=self.prompt, max_new_tokens=MAX_NEW
            )
            opened = await self.point("opening", 0, self.stub.OpenSession(request))
            tokens, finish, round_no = [opened.first_token_id], opened.finish_reason, 0
            while finish == pb.FINISH_REASON_NONE:
                round_no += 1
                await self.point("drafting", round_no)
                request = pb.VerifyRequest(
                    session_id=opened.session_id, draft_token_ids=self.drafts(tokens), num_generated=len(tokens)
                )
                reply = await self.point("verifying", round_no, self.stub.Verify(request))
                tokens += reply.token_ids
                finish = reply.finish_reason
            await self.stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))
            return tokens
        except Killed:
            return None
        finally:
            lease.cancel()
            await self.channel.close()


def test_fifty_edges_killed_at_random_points_leak_nothing(tiny_target_dir):
    rng = random.Random(2025)
    tokenizer = HFTokenizer(tiny_target_dir)
    fingerprint = wire.fingerprint_to_proto(tokenizer.fingerprint)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"edge {i}: " + "for i in range(10): " * (i % 4)}])
        for i in range(NUM_EDGES)
    ]
    victims = set(rng.sample(range(NUM_EDGES), NUM_VICTIMS))
    reference = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 20 references of tiny forwards: one thread is several times faster on a busy CPU
    try:
        expected = {i: greedy_decode(reference, prompts[i], MAX_NEW, {2}) for i in range(NUM_EDGES) if i not in victims}
    finally:
        torch.set_num_threads(threads)
    # Every phase gets victims; the round and the moment within it are random.
    deaths = {
        i: (
            PHASES[n % len(PHASES)],
            0 if PHASES[n % len(PHASES)] in ("attached", "opening") else rng.randint(1, 6),
            rng.uniform(0, 0.02),
        )
        for n, i in enumerate(sorted(victims))
    }
    config = ServerConfig(model=str(tiny_target_dir), port=0, max_context=160, engine=EngineConfig(max_sessions=64))

    with ServerThread(config) as server:
        engine = server.server.engine
        edges: list[ChaosEdge] = []
        continuations = [expected.get(i, [rng.randrange(VOCAB) for _ in range(MAX_NEW)]) for i in range(NUM_EDGES)]

        async def run():
            edges.extend(
                ChaosEdge(server.address, fingerprint, prompts[i], continuations[i], random.Random(i), deaths.get(i))
                for i in range(NUM_EDGES)
            )  # channels belong to this event loop
            return await asyncio.gather(*(edge.run() for edge in edges))

        outputs = asyncio.run(run())
        deadline = time.monotonic() + 15
        while (engine.sessions or engine._leases or engine._work) and time.monotonic() < deadline:
            time.sleep(0.05)
        leaked = {
            "sessions": len(engine.sessions),
            "slots": engine.slots.num_slots - engine.slots.num_free,
            "queued work": len(engine._work) + len(engine.batcher),
            "leases": len(engine._leases),
        }
        stats = server.server.stats.snapshot()

    assert leaked == {"sessions": 0, "slots": 0, "queued work": 0, "leases": 0}
    for i, output in enumerate(outputs):
        if i in victims:
            assert output is None, f"edge {i} was to die at {deaths[i]} but finished"
        else:
            assert output == expected[i], f"survivor {i} differs from target-only decoding"
    died = [edge.died for edge in edges if edge.died is not None]
    assert len(died) == NUM_VICTIMS
    assert {phase for phase, _ in died} == set(PHASES)
    in_flight = collections.Counter(phase for phase, pending in died if pending)
    assert in_flight["opening"] + in_flight["verifying"] >= 5, in_flight  # killed with a call still running
    assert stats["requests_failed"] == 0  # a vanished edge is not a server failure
    assert stats["batch_size"].total / stats["batch_size"].count > 2  # the edges really shared forwards
