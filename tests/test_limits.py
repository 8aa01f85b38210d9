"""Limits: each one enforced with a precise status, reported in the handshake, and never tripped by the edge."""

from __future__ import annotations

import asyncio
import resource

import grpc
import pytest
from transformers import AutoModelForCausalLM

from harness import ServerThread
from raw_edge import PROMPT, Edge, status_of, until
from reference import greedy_decode
from specedge import wire
from specedge.edge_client.client import EdgeClient
from specedge.edge_client.generation import generate
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.rounds import ServerLimits
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.ratelimit import TokenBucket
from specedge.server import errors
from specedge.server.app import ServerConfig
from specedge.server.engine import EngineConfig
from specedge.server.limits import AttachLimiter, RateLimitConfig, RoundRateLimiter
from specedge.server.runner import KVCache
from specedge.server.transport import TransportConfig
from specedge.v1 import specedge_pb2 as pb

EXHAUSTED, INVALID = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT
RATE, BURST = 25.0, 3
MAX_ATTACH = 2


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_refills_at_its_rate_and_caps_at_its_burst():
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, burst=3, clock=clock)
    assert [bucket.try_take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.try_take() == pytest.approx(0.5)  # refused, nothing taken
    clock.now += 0.5
    assert bucket.try_take() == 0.0
    clock.now += 100
    assert bucket.is_full and [bucket.try_take() for _ in range(4)][-1] == pytest.approx(0.5)
    clock.now += 10
    assert [bucket.reserve() for _ in range(5)] == pytest.approx([0, 0, 0, 0.5, 1.0])  # paced, in debt


def test_a_held_token_bucket_queues_reservations_behind_the_hold():
    """The server said "retry in 0.3 s" to calls that this bucket had let through: they come back one by one."""
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, burst=1, clock=clock)
    assert bucket.try_take() == 0.0
    clock.now += 10  # full again, as far as this bucket knows
    for _ in range(3):  # three calls refused together, each told the same
        bucket.hold(0.3)
    assert [bucket.reserve() for _ in range(3)] == pytest.approx([0.3, 0.8, 1.3])
    bucket.hold(0.1)  # a shorter hold moves nothing: the queue stands
    assert bucket.reserve() == pytest.approx(1.8)


def test_rate_limiter_refuses_per_identity_with_a_retry_hint():
    clock = FakeClock()
    limiter = RoundRateLimiter(RateLimitConfig(rounds_per_s=10, burst=2), clock=clock)
    limiter.admit("a")
    limiter.admit("a")
    with pytest.raises(Exception, match="at most 10 rounds per second per identity") as info:
        limiter.admit("a")
    assert info.value.retry_after_s == pytest.approx(0.1)
    limiter.admit("b")  # another identity has its own bucket
    clock.now += 0.1
    limiter.admit("a")
    assert RoundRateLimiter(RateLimitConfig()).delay("x") == 0.0  # no limit configured


def test_attach_limiter_counts_open_streams_per_identity():
    limiter = AttachLimiter(max_per_identity=2)
    limiter.acquire("a")
    limiter.acquire("a")
    with pytest.raises(errors.ResourceExhausted, match="already holds 2 Attach streams"):
        limiter.acquire("a")
    limiter.acquire("b")  # another identity has its own count
    assert (limiter.held("a"), limiter.held("b"), limiter.num_held) == (2, 1, 3)
    limiter.release("a")
    limiter.acquire("a")  # a stream that ended frees its place
    for identity in ("a", "a", "b"):
        limiter.release(identity)
    assert limiter.num_held == 0 and limiter._held == {}  # identities holding nothing are forgotten
    with pytest.raises(ValueError, match="Attach streams per identity must be >= 1"):
        ServerConfig(model="m", max_attach_per_identity=0)


@pytest.fixture(scope="module")
def fingerprint(tiny_target_dir):
    return HFTokenizer(tiny_target_dir).fingerprint


@pytest.fixture(scope="module")
def limited(tiny_target_dir):
    engine = EngineConfig(
        max_sessions=4,
        max_sessions_per_identity=2,
        max_prompt_tokens=20,
        max_draft_tokens=8,
        max_draft_prob_tokens=4,
        idle_timeout_s=30,
    )
    transport = TransportConfig(max_message_bytes=64 << 10, idle_connection_timeout_s=0.5)
    config = ServerConfig(
        model=str(tiny_target_dir),
        port=0,
        max_context=64,
        engine=engine,
        transport=transport,
        rate_limit=RateLimitConfig(rounds_per_s=RATE, burst=BURST),
        max_attach_per_identity=MAX_ATTACH,
    )
    with ServerThread(config) as server:
        yield server


def test_the_handshake_reports_every_limit(limited, fingerprint):
    async def run():
        async with EdgeClient(limited.address, fingerprint) as client:
            return client.server_info.limits

    limits = asyncio.run(run())
    assert limits == ServerLimits(
        max_context_tokens=64,
        max_draft_tokens=8,
        max_sessions=4,
        max_prompt_tokens=20,
        max_draft_prob_tokens=4,
        max_sessions_per_identity=2,
        max_rounds_per_second=RATE,
        round_burst=BURST,
        max_message_bytes=64 << 10,
        idle_session_timeout_s=30,
        idle_connection_timeout_s=0.5,
        max_attach_streams_per_identity=MAX_ATTACH,
    )


def test_each_limit_refuses_with_a_precise_status(limited, fingerprint):
    fp = wire.fingerprint_to_proto(fingerprint)
    wide_q = pb.SparseDistribution(token_ids=[5, 6, 7, 8, 9], probs=[0.2] * 5)

    async def run():
        codes = {}
        # Each Edge is its own connection, hence (without tokens) its own identity and rate bucket.
        edge = Edge(limited.address, fp)
        opened = [await edge.open(max_new_tokens=8), await edge.open(max_new_tokens=8)]
        codes["third session of one identity"] = await status_of(edge.open(), with_trailers=True)
        other = Edge(limited.address, fp)
        opened.append(await other.open(max_new_tokens=8))  # another identity still gets a slot
        for o, owner in zip(opened, [edge, edge, other]):
            await owner.close(o.session_id)
        edge = Edge(limited.address, fp)
        codes["prompt past max_prompt_tokens"] = await status_of(edge.open(prompt=[5] * 21), with_trailers=True)
        opened = await edge.open(max_new_tokens=8)
        turn = pb.ContinueSessionRequest(session_id=opened.session_id, keep_tokens=1, token_ids=[5] * 21)
        codes["turn past max_prompt_tokens"] = await status_of(edge.stub.ContinueSession(turn), with_trailers=True)
        await edge.close(opened.session_id)
        edge = Edge(limited.address, fp)  # a fresh rate bucket
        opened = await edge.open(max_new_tokens=8)
        codes["q wider than max_draft_prob_tokens"] = await status_of(
            edge.verify(opened.session_id, [5], num_generated=1, dists=[wide_q]), with_trailers=True
        )
        await edge.close(opened.session_id)
        codes["message past max_message_bytes"] = await status_of(
            Edge(limited.address, fp).stub.CloseSession(pb.CloseSessionRequest(session_id="x" * (65 << 10))),
            with_trailers=True,
        )
        # A raw edge that does not pace itself: the burst passes, the next round is refused.
        edge = Edge(limited.address, fp)
        rounds = [await status_of(edge.verify("no-such-session"), with_trailers=True) for _ in range(BURST + 1)]
        codes["round past the rate"] = rounds[-1]
        return codes, rounds[:-1]

    refused_before = limited.server.stats.snapshot()["requests_refused"]
    codes, first_rounds = asyncio.run(run())
    expected = {
        "third session of one identity": (EXHAUSTED, "this identity already has 2 open sessions"),
        "prompt past max_prompt_tokens": (INVALID, "exceeds the server's max_prompt_tokens 20"),
        "turn past max_prompt_tokens": (INVALID, "a new turn of 21 tokens exceeds the server's max_prompt_tokens 20"),
        "q wider than max_draft_prob_tokens": (INVALID, "at most max_draft_prob_tokens 4"),
        "message past max_message_bytes": (EXHAUSTED, "Received message larger than max"),
        "round past the rate": (EXHAUSTED, f"at most {RATE:g} rounds per second per identity"),
    }
    for name, (code, fragment) in expected.items():
        assert codes[name][0] == code and fragment in codes[name][1], (name, codes[name])
    assert 0 < int(codes["round past the rate"][2]["retry-after-ms"]) <= 1000 / RATE + 1
    # Which limit refused: the edge paces its answers' retries together for this one (edge_client/client.py).
    assert codes["round past the rate"][2]["specedge-limit"] == "round-rate"
    assert "specedge-limit" not in codes["third session of one identity"][2]
    assert [code for code, *_ in first_rounds] == [grpc.StatusCode.NOT_FOUND] * BURST
    refused = limited.server.stats.snapshot()["requests_refused"]
    assert refused["rate_limited"] - refused_before.get("rate_limited", 0) == 1
    assert refused["session_limit"] - refused_before.get("session_limit", 0) == 1


def test_attach_streams_are_capped_per_identity(limited, fingerprint):
    """One identity (without tokens: one connection) cannot hold every call the server allows."""
    fp = wire.fingerprint_to_proto(fingerprint)
    limiter = limited.server.service.attach_limiter

    async def run():
        await until(lambda: limiter.num_held == 0)  # earlier tests' leases have ended
        edge, other = Edge(limited.address, fp), Edge(limited.address, fp)
        streams = []
        for expected in range(1, MAX_ATTACH + 1):
            streams.append(edge.stub.Attach(pb.AttachRequest()))
            await until(lambda expected=expected: limiter.num_held == expected)
        refused = edge.stub.Attach(pb.AttachRequest())
        status = await refused.code(), await refused.details()
        streams.append(other.stub.Attach(pb.AttachRequest()))  # another identity still attaches
        await until(lambda: limiter.num_held == MAX_ATTACH + 1)
        streams.pop(0).cancel()  # an ended stream frees its place
        await until(lambda: limiter.num_held == MAX_ATTACH)
        streams.append(edge.stub.Attach(pb.AttachRequest()))
        await until(lambda: limiter.num_held == MAX_ATTACH + 1)
        assert not any(stream.done() for stream in streams)
        for stream in streams:
            stream.cancel()
        await until(lambda: limiter.num_held == 0)
        for e in (edge, other):
            await e.channel.close()
        return status

    refused_before = limited.server.stats.snapshot()["requests_refused"].get("attach_limit", 0)
    code, details = asyncio.run(run())
    assert code == EXHAUSTED and f"already holds {MAX_ATTACH} Attach streams" in details, (code, details)
    assert limited.server.stats.snapshot()["requests_refused"]["attach_limit"] == refused_before + 1


def test_a_well_behaved_edge_never_trips_the_rate_limit(limited, fingerprint, tiny_target_dir, tiny_draft_dir):
    from specedge.edge_client.drafting.torch_drafter import TorchDrafter

    prompt = PROMPT[::-1]  # the tiny target goes on for 40 tokens after it
    expected = greedy_decode(AutoModelForCausalLM.from_pretrained(tiny_target_dir), prompt, 24, {2})
    drafter = TorchDrafter(tiny_draft_dir)

    async def run():
        policy = SpeculationPolicy(num_draft=1, max_new_tokens=24, follow_advice=False)
        async with EdgeClient(limited.address, fingerprint) as client:
            started = asyncio.get_running_loop().time()
            result = await generate(client, prompt, drafter, policy=policy)
            return result, asyncio.get_running_loop().time() - started

    refused_before = limited.server.stats.snapshot()["requests_refused"].get("rate_limited", 0)
    result, seconds = asyncio.run(run())
    assert result.token_ids == expected
    # OpenSession + rounds: past the burst they cannot go faster than the rate, and none was refused.
    num_calls = 1 + result.stats.rounds
    assert num_calls > 2 * BURST
    assert seconds >= (num_calls - BURST) / RATE * 0.9
    assert limited.server.stats.snapshot()["requests_refused"].get("rate_limited", 0) == refused_before


def test_idle_connections_are_closed(limited, fingerprint):
    async def run():
        edge = Edge(limited.address, wire.fingerprint_to_proto(fingerprint))
        await edge.stub.Handshake(pb.HandshakeRequest(protocol_version=1, draft_tokenizer=edge.fingerprint))
        busy = edge.channel.get_state()
        await asyncio.sleep(1.5)  # past the 0.5 s idle-connection timeout, no call in progress
        idle = edge.channel.get_state()
        await edge.channel.close()
        return busy, idle

    busy, idle = asyncio.run(run())
    assert busy == grpc.ChannelConnectivity.READY
    assert idle == grpc.ChannelConnectivity.IDLE  # the server closed it; the next call would reconnect


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def test_sessions_past_capacity_are_refused_and_memory_stays_in_budget(tiny_target_dir, fingerprint):
    num_fitting, max_context = 5, 64
    bytes_per_slot = 2 * 2 * 2 * 16 * 4 * max_context  # K and V x layers x kv heads x head dim x fp32, per token
    budget_bytes = num_fitting * bytes_per_slot + bytes_per_slot // 2
    config = ServerConfig(
        model=str(tiny_target_dir),
        port=0,
        max_context=max_context,
        kv_cache_gb=budget_bytes / 2**30,
        engine=EngineConfig(max_sessions=64),
    )
    fp = wire.fingerprint_to_proto(fingerprint)

    async def flood(address):
        edges = [Edge(address, fp) for _ in range(20)]
        results = []
        for _ in range(3):  # every edge keeps asking: 60 opens for 5 slots
            results += await asyncio.gather(*(status_of(edge.open(max_new_tokens=4)) for edge in edges))
        # Oversized messages cost nothing past the limit.
        big = pb.OpenSessionRequest(tokenizer=fp, prompt_token_ids=[5] * (1 << 20))  # > 1 MiB, the default limit
        results += [await status_of(edges[0].stub.OpenSession(big)) for _ in range(20)]
        return results

    with ServerThread(config) as server:
        engine = server.server.engine
        kv = engine.stepper.runner.kv
        rss_before = _rss_bytes()
        results = asyncio.run(flood(server.address))
        rss_growth = _rss_bytes() - rss_before
        kv_bytes = sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v))
        assert engine.slots.num_slots == num_fitting and len(engine.sessions) == num_fitting

    assert KVCache.bytes_per_token_for(engine.stepper.runner.model, kv.k[0].dtype) * max_context == bytes_per_slot
    codes = [code for code, _ in results]
    assert codes.count(grpc.StatusCode.OK) == num_fitting
    assert codes.count(EXHAUSTED) == len(codes) - num_fitting
    assert all(
        f"all {num_fitting} session slots are in use" in details for code, details in results[:60] if code == EXHAUSTED
    )
    assert kv_bytes <= budget_bytes
    assert rss_growth < 64 << 20, f"resident memory grew {rss_growth >> 20} MiB during the flood"


FROZEN_EDGE = """
import sys, time, grpc
from specedge.v1 import specedge_pb2 as pb, specedge_pb2_grpc
channel = grpc.insecure_channel(sys.argv[1])
stub = specedge_pb2_grpc.SpecEdgeStub(channel)
lease = stub.Attach(pb.AttachRequest())
fingerprint = pb.TokenizerFingerprint.FromString(bytes.fromhex(sys.argv[2]))
stub.OpenSession(pb.OpenSessionRequest(tokenizer=fingerprint, prompt_token_ids=[5, 6, 7], max_new_tokens=8))
print("open", flush=True)
time.sleep(3600)
"""


def test_keepalive_frees_the_slots_of_an_edge_that_stops_answering(tiny_target_dir, fingerprint):
    """A frozen process keeps its socket open but answers no ping: like a peer whose network vanished."""
    import signal
    import subprocess
    import sys
    import time

    transport = TransportConfig(keepalive_s=0.5, keepalive_timeout_s=0.5)
    config = ServerConfig(model=str(tiny_target_dir), port=0, max_context=64, transport=transport)
    with ServerThread(config) as server:
        engine = server.server.engine
        serialized = wire.fingerprint_to_proto(fingerprint).SerializeToString().hex()
        edge = subprocess.Popen(
            [sys.executable, "-c", FROZEN_EDGE, server.address, serialized], stdout=subprocess.PIPE, text=True
        )
        try:
            assert edge.stdout.readline().strip() == "open"
            time.sleep(1.5)  # answering pings: the lease holds
            held = len(engine.sessions)
            edge.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + 15
            while engine.sessions and time.monotonic() < deadline:
                time.sleep(0.1)
            freed_after = time.monotonic() - deadline + 15
        finally:
            edge.kill()
            edge.wait(timeout=10)
        assert held == 1
        assert not engine.sessions and engine.slots.num_free == engine.slots.num_slots, "the frozen edge kept its slot"
    assert freed_after < 10
