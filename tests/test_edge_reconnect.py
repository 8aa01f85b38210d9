"""Concurrent answers of one `specedge-edge serve` ride out a server restart together.

A real server process is killed (SIGKILL: its TCP connections reset, as when
the link drops) while four streamed answers are mid-way, and comes back on
the same port, twice. One EdgeClient carries all four, so each answer sees
the failure at its own moment: in flight, waiting to send its prepared call,
drafting, or only after another answer has already reconnected (its session
then is unknown to the restarted server). Every
answer must still be exactly the target's greedy answer, and every raw SSE
stream must end with `[DONE]`. Before the fix (main at a1bfa3e) the
speculative case failed in each of 6 runs (an answer died with `UsageError:
Channel is closed`, its stream ending in an error event), and the
server-only case can fail with CANCELLED (a stream cut by another answer's
reconnect).

The same four answers then ride out a link that drops for 1.5 s, twice, while
the server stays up (a TCP proxy between them, harness.FlakyLink): every
connection reset and refused meanwhile, or every byte held and the connections
kept. In the second, the speculative answers' held rounds reached the paced
server at once, and before the fix (main at e9cc96d) one of them failed in each
of 3 runs with RESOURCE_EXHAUSTED: the refused answers all came back when the
server said, to be refused together again, until one ran out of retries.

And a path that dies under its connections, neither end told: the edge's
keepalive pings find it (before them, each call waited out its 120 s deadline and
the answer failed), and the server takes an edge's pings every second.

Then the guard itself, step by step (a failure is blamed on the connection
its call went out on), and the bound on re-opening against a server that
refuses every session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal

import openai
import pytest

from harness import ApiThread, FlakyLink, free_port, start_server_process, tiny_server, wait_healthy
from reference import greedy_decode
from specedge.edge_client.client import ConnectionConfig, ConnectionLost, EdgeClient, SessionGone
from specedge.edge_client.generation import generate
from specedge.edge_client.openai_api import ServeConfig
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.rounds import DraftRound
from specedge.edge_client.runtime import RuntimeConfig
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.types import SamplingParams

# Four prompts whose greedy answers with the tiny target run to the length limit.
PROMPTS = ["print(i * i)", "Hello, nice to meet you", "return a + b", "edge 1 says hi"]
MAX_TOKENS = 64
FLAPS = 2  # the server is killed and restarted this many times during the answers
CHUNKS_BEFORE_KILL = 3  # each answer still going has streamed this many chunks since the last restart


@dataclasses.dataclass
class Progress:
    chunks: int = 0
    done: bool = False


async def raw_sse(client: openai.AsyncOpenAI, request: dict, progress: Progress) -> tuple[str, dict, list[str]]:
    """The answer's text, its stats and its SSE data lines, read raw (the SDK would hide a missing [DONE])."""
    data, text, stats = [], [], {}
    try:
        async with client.chat.completions.with_streaming_response.create(**request, stream=True) as response:
            async for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data.append(line[len("data:") :].strip())
                if data[-1] != "[DONE]":
                    event = json.loads(data[-1])
                    assert "error" not in event, event
                    text.append(event["choices"][0]["delta"].get("content") or "")
                    stats = event.get("specedge", stats)
                    progress.chunks += 1
    finally:
        progress.done = True
    return "".join(text), stats, data


async def sdk_stream(client: openai.AsyncOpenAI, request: dict, progress: Progress) -> tuple[str, dict, None]:
    text, stats = [], {}
    try:
        async for chunk in await client.chat.completions.create(**request, stream=True):
            text.append(chunk.choices[0].delta.content or "")
            stats = (chunk.model_extra or {}).get("specedge", stats)
            progress.chunks += 1
    finally:
        progress.done = True
    return "".join(text), stats, None


# The speculative answers' server paces each identity's rounds, as a shared server would: the edge keeps
# them under the rate (client.py), so an answer spends most of a round waiting to send its prepared call,
# which is where another answer's reconnect catches it (on a closed channel, before the fix). The
# server-only answers' server runs unpaced: it paces its own streams, one token a step, far too slowly.
PACED = ("--max-rounds-per-second", "8", "--round-burst", "1")


def server_args(model_dir, server_only_answers: bool) -> tuple[str, ...]:
    return ("--model", str(model_dir), "--max-context", "512", "--log-level", "warning", "--max-sessions", "4") + (
        () if server_only_answers else PACED
    )


def four_answers_cut_mid_way(
    address, cut, tiny_draft_dir, reference_model, server_only_answers, resumes=1, keepalive_s=20.0
) -> int:
    """Four streamed answers through one `specedge-edge serve` on the server at `address`, `cut()` (in a thread)
    FLAPS times while they run, each time once every answer still going has streamed CHUNKS_BEFORE_KILL chunks
    since the last. Asserts that each is the target's greedy answer, resumed at least `resumes` times (0: never),
    and that each raw stream ends with one [DONE]; returns how many cuts there were. The edge pings the server
    every `keepalive_s` and gives a connection up when a ping goes unanswered as long."""
    tokenizer = HFTokenizer(tiny_draft_dir)
    messages = [[{"role": "user", "content": content}] for content in PROMPTS]
    eos = set(tokenizer.eos_token_ids)
    expected = [greedy_decode(reference_model, tokenizer.apply_chat_template(m), MAX_TOKENS, eos) for m in messages]
    assert [len(e) for e in expected] == [MAX_TOKENS] * len(PROMPTS)  # long enough to be cut mid-way
    runtime = RuntimeConfig(
        server=address,
        draft=str(tiny_draft_dir),
        policy=SpeculationPolicy(num_draft=4, follow_advice=False),
        connection=ConnectionConfig(
            simulated_rtt_ms=20, reconnect_timeout_s=120, keepalive_s=keepalive_s, keepalive_timeout_s=keepalive_s
        ),
        num_drafters=len(PROMPTS),
        server_only=server_only_answers,
    )
    with ApiThread(runtime, ServeConfig(port=0)) as api:
        model = wait_healthy(api.base_url, timeout_s=120)["model"]
        progress = [Progress() for _ in PROMPTS]

        async def cuts() -> int:
            for count in range(FLAPS):
                marks = [p.chunks for p in progress]
                while not all(p.done or p.chunks - mark >= CHUNKS_BEFORE_KILL for p, mark in zip(progress, marks)):
                    await asyncio.sleep(0.005)
                if all(p.done for p in progress):
                    return count
                await asyncio.to_thread(cut)
            return FLAPS

        async def ask_all():
            async with openai.AsyncOpenAI(
                base_url=api.base_url + "/v1", api_key="unused", max_retries=0, timeout=300
            ) as client:
                requests = [dict(model=model, messages=m, max_tokens=MAX_TOKENS, temperature=0) for m in messages]
                # Two read raw (to see [DONE]), two through the SDK's own stream parsing.
                readers = [raw_sse, raw_sse, sdk_stream, sdk_stream]
                answers = [read(client, r, p) for read, r, p in zip(readers, requests, progress)]
                return await asyncio.gather(*answers, cuts())

        *answers, count = asyncio.run(asyncio.wait_for(ask_all(), 300))
    texts, stats, raw = zip(*answers)
    assert list(texts) == [tokenizer.decode([t for t in e if t not in eos]) for e in expected]
    assert count >= 1, count
    assert all(s["resumes"] >= resumes if resumes else s["resumes"] == 0 for s in stats), stats
    for data in raw[:2]:
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1, data[-3:]
    return count


@pytest.mark.parametrize("server_only_answers", [False, True], ids=["speculative", "server-only"])
def test_four_answers_survive_a_server_restart(tiny_target_dir, tiny_draft_dir, reference_model, server_only_answers):
    port = free_port()
    args = server_args(tiny_target_dir, server_only_answers)
    processes = [start_server_process(*args, port=port)[0]]

    def restart() -> None:
        processes[-1].send_signal(signal.SIGKILL)
        processes[-1].wait()
        processes.append(start_server_process(*args, port=port)[0])

    try:
        four_answers_cut_mid_way(f"127.0.0.1:{port}", restart, tiny_draft_dir, reference_model, server_only_answers)
    finally:
        for process in processes:
            process.kill()


@pytest.mark.parametrize("drop", ["reset", "stall", "sever"])
@pytest.mark.parametrize("server_only_answers", [False, True], ids=["speculative", "server-only"])
def test_four_answers_survive_a_link_that_drops_for_a_second(
    tiny_target_dir, tiny_draft_dir, reference_model, server_only_answers, drop
):
    """The server stays up while the link to it breaks, twice mid-answer (harness.FlakyLink). `reset`: every
    connection reset, both ways, and nothing answering for 1.5 s; each answer reconnects to the same server, whose
    sessions of the old connection went with its lease (it holds four at most: the new ones would not fit
    otherwise), and goes on. `stall`: every byte held for 1.5 s, the connections kept; the answers wait and go on,
    no reconnect. `sever`: every byte of the open connections lost for good, and neither end told, as when a path
    dies under them; the edge, pinging every second, finds its connection dead within two, and the answers resume
    on a new one (before the edge pinged, each call waited out its deadline, and the answer failed). The server,
    full, finds the old connections dead only by its own pings (within 30 s), and the answers being resumed ask
    again until it has room (before, each failed with RESOURCE_EXHAUSTED after three tries)."""
    args = (*server_args(tiny_target_dir, server_only_answers), "--max-sessions", "4")
    process, address = start_server_process(*args)
    try:
        with FlakyLink(address) as link:
            cut = {"reset": lambda: link.flap(1.5), "stall": lambda: link.stall(1.5), "sever": link.sever}[drop]
            flaps = four_answers_cut_mid_way(
                link.address,
                cut,
                tiny_draft_dir,
                reference_model,
                server_only_answers,
                resumes=int(drop != "stall"),
                keepalive_s=1.0 if drop == "sever" else 20.0,
            )
            assert link.flaps == flaps
        assert process.poll() is None  # the same server throughout
    finally:
        process.kill()


def test_an_edge_pinging_every_second_keeps_its_connection(tiny_target_dir, tiny_draft_dir):
    """The server takes the edge's keepalive pings as often as every second (wire.MIN_PING_INTERVAL_S), with no
    data between them: gRPC's own default counts a ping more often than every five minutes as abuse and closes the
    connection after the third, which the edge would take for a lost connection."""
    tokenizer = HFTokenizer(tiny_draft_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    config = ConnectionConfig(keepalive_s=1.0, keepalive_timeout_s=1.0)

    async def run(server):
        async with EdgeClient(server.address, tokenizer.fingerprint, config=config) as client:
            opened = await client.open_session(prompt, 8, SamplingParams(), None)
            lease, epoch = client._lease, client._epoch
            await asyncio.sleep(5)  # five pings, nothing else on the connection
            assert not lease.done() and client._epoch == epoch
            reply = await client.verify(opened.session_id, DraftRound((), num_generated=1))
            assert reply.token_ids and opened.session_id in server.server.engine.sessions
        with pytest.raises(ValueError, match="every 1 s or less often"):
            ConnectionConfig(keepalive_s=0.5)

    with tiny_server(tiny_target_dir) as server:
        asyncio.run(run(server))


def test_only_the_first_answer_to_notice_a_lost_connection_reconnects(tiny_target_dir, tiny_draft_dir):
    """The reconnect guard, step by step: a failure is blamed on the connection its call went out on."""
    tokenizer = HFTokenizer(tiny_draft_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    greedy = SamplingParams()

    async def run(server):
        sessions = server.server.engine.sessions
        async with EdgeClient(server.address, tokenizer.fingerprint) as client:
            first = await client.open_session(prompt, 8, greedy, None)
            # Another answer saw the connection break and reconnected: the old lease took the session with it.
            await client.recover(ConnectionLost("reset by peer", epoch=1))
            await asyncio.sleep(0.2)  # the server notices the cancelled lease
            assert first.session_id not in sessions
            with pytest.raises(SessionGone) as gone:
                await client.verify(first.session_id, DraftRound((), num_generated=1))
            assert gone.value.epoch == 2  # it went out on the new connection, whose lease holds
            await client.recover(gone.value)
            again = await client.open_session(prompt, 8, greedy, None)
            # Late news of the first break (a call cut short on the old connection) must not break the new one.
            await client.recover(ConnectionLost("cut short", epoch=1))
            await client.recover(SessionGone("unknown session", epoch=1))
            await asyncio.sleep(0.2)
            assert again.session_id in sessions
            reply = await client.verify(again.session_id, DraftRound((), num_generated=1))
            assert reply.token_ids

    with tiny_server(tiny_target_dir) as server:
        asyncio.run(run(server))


@pytest.mark.parametrize("speculative", [True, False])
def test_a_server_that_refuses_every_session_ends_the_answer(tiny_target_dir, tiny_draft_dir, speculative):
    """Draining, with no other server to go to: the handshake succeeds, every session is refused. The answer
    reconnects a bounded number of times, then fails with the server's reason instead of looping forever."""
    from specedge.edge_client.drafting.torch_drafter import TorchDrafter
    from specedge.edge_client.generation import MAX_FRUITLESS_RECOVERIES

    tokenizer = HFTokenizer(tiny_draft_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])

    async def run(server):
        server.server.engine.draining = "server s1 is draining (test): it admits no new sessions"
        async with EdgeClient(server.address, tokenizer.fingerprint) as client:
            drafter = TorchDrafter(tiny_draft_dir) if speculative else None
            with pytest.raises(ConnectionLost, match="is draining") as refused:
                answer = generate(client, prompt, drafter, policy=SpeculationPolicy(max_new_tokens=8))
                await asyncio.wait_for(answer, 30)
            return refused.value, client._epoch

    with tiny_server(tiny_target_dir) as server:
        refused, connections = asyncio.run(run(server))
    assert connections == 1 + MAX_FRUITLESS_RECOVERIES  # the first connection, then one per attempt to re-open
    assert "is draining" in str(refused) and not server.server.engine.sessions


def test_an_answer_cancelled_under_its_stream_ends_it_with_an_error_event():
    """Whatever kills an answer's task, its SSE stream says so: never a stream that just stops."""
    from specedge.edge_client.openai_schema import CHAT
    from specedge.edge_client.openai_service import _chunks

    async def run():
        work = asyncio.get_running_loop().create_future()
        work.cancel()  # as an answer's task ends when a CancelledError escapes it
        pieces: asyncio.Queue = asyncio.Queue()
        pieces.put_nowait(None)
        head = {"id": "chatcmpl-1", "created": 0, "model": "m"}
        return [event["data"] async for event in _chunks(head, CHAT, False, "Hi", pieces, work)]

    first, last = asyncio.run(run())
    assert json.loads(first)["choices"][0]["delta"]["content"] == "Hi"
    assert json.loads(last)["error"]["message"] == "the answer was cancelled before it finished"
