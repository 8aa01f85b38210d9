"""Every bad request gets one precise status, and nobody else's session notices."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from transformers import AutoModelForCausalLM

from raw_edge import PROMPT, Edge, status_of
from reference import greedy_decode
from specedge import wire
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.v1 import specedge_pb2 as pb

MAX_SESSIONS, MAX_CONTEXT, MAX_DRAFT = 3, 128, 8
ONE_HOT_5 = pb.SparseDistribution(token_ids=[5], probs=[1.0])


pytestmark = pytest.mark.server_options(max_context=MAX_CONTEXT, max_sessions=MAX_SESSIONS, max_draft_tokens=MAX_DRAFT)


@pytest.fixture(scope="module")
def fingerprint(tiny_target_dir):
    return wire.fingerprint_to_proto(HFTokenizer(tiny_target_dir).fingerprint)


@pytest.fixture(scope="module")
def expected(tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    return greedy_decode(model, PROMPT, 30, {2})


def test_bad_requests_fail_alone(server, fingerprint, expected):
    async def run():
        good, bad, intruder = (Edge(server.address, fingerprint) for _ in range(3))
        # A well-behaved session, open throughout.
        opened = await good.open()
        tokens = [opened.first_token_id]
        sid = opened.session_id

        codes = {
            "token id out of range": await status_of(bad.open(prompt=[5, 99999])),
            "empty prompt": await status_of(bad.open(prompt=[])),
            "prompt too long": await status_of(bad.open(prompt=[5] * MAX_CONTEXT)),
            "negative temperature": await status_of(bad.open(temperature=-1.0)),
            "top_p above one": await status_of(bad.open(temperature=1.0, top_p=1.5)),
            "unknown session": await status_of(bad.verify("no-such-session")),
            "foreign session": await status_of(intruder.verify(sid, num_generated=len(tokens))),
            "foreign close": await status_of(intruder.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))),
            "draft too long": await status_of(good.verify(sid, [5] * (MAX_DRAFT + 1), num_generated=len(tokens))),
            "draft id out of range": await status_of(good.verify(sid, [5, 400], num_generated=len(tokens))),
            "parent after child": await status_of(good.verify(sid, [5, 6], [0, 2], num_generated=len(tokens))),
            "parents miscounted": await status_of(good.verify(sid, [5, 6], [0], num_generated=len(tokens))),
            "out of sync": await status_of(good.verify(sid, [5], num_generated=len(tokens) + 3)),
            "q count": await status_of(good.verify(sid, [5, 6], num_generated=len(tokens), dists=[ONE_HOT_5])),
            "q on a tree": await status_of(
                good.verify(sid, [5, 5], [0, 0], num_generated=len(tokens), dists=[ONE_HOT_5, ONE_HOT_5])
            ),
            "q misses its token": await status_of(good.verify(sid, [6], num_generated=len(tokens), dists=[ONE_HOT_5])),
            "q not a distribution": await status_of(
                good.verify(
                    sid,
                    [5],
                    num_generated=len(tokens),
                    dists=[pb.SparseDistribution(token_ids=[5, 6], probs=[0.9, 0.9])],
                )
            ),
            "wrong protocol": await status_of(
                bad.stub.Handshake(pb.HandshakeRequest(protocol_version=99, draft_tokenizer=fingerprint))
            ),
        }
        # The good session, untouched by all that, finishes losslessly.
        while True:
            reply = await good.verify(sid, expected[len(tokens) : len(tokens) + 3], num_generated=len(tokens))
            tokens += reply.token_ids
            if reply.finish_reason != pb.FINISH_REASON_NONE:
                break
        codes["verify after finish"] = await status_of(good.verify(sid, num_generated=len(tokens)))
        await good.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        codes["closed session"] = await status_of(good.verify(sid, num_generated=len(tokens)))
        return tokens, codes

    tokens, codes = asyncio.run(run())
    assert tokens == expected
    invalid, failed = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    expected_codes = {
        "token id out of range": (invalid, "token id 99999 is out of range for vocab size 384"),
        "empty prompt": (invalid, "prompt is empty"),
        "prompt too long": (invalid, f"max context of {MAX_CONTEXT} tokens"),
        "negative temperature": (invalid, "temperature must be"),
        "top_p above one": (invalid, "top_p must be in (0, 1]"),
        "unknown session": (grpc.StatusCode.NOT_FOUND, "unknown session"),
        "foreign session": (grpc.StatusCode.PERMISSION_DENIED, "another identity"),
        "foreign close": (grpc.StatusCode.PERMISSION_DENIED, "another identity"),
        "draft too long": (invalid, f"exceeds the server's max_draft_tokens {MAX_DRAFT}"),
        "draft id out of range": (invalid, "draft token id 400"),
        "parent after child": (invalid, "draft node 2 has parent 2"),
        "parents miscounted": (invalid, "1 draft parents for 2 draft tokens"),
        "out of sync": (failed, "out of sync"),
        "q count": (invalid, "1 draft distributions for 2 draft tokens"),
        "q on a tree": (invalid, "draft distributions are for chains"),
        "q misses its token": (invalid, "draft token 1 (6) has probability 0"),
        "q not a distribution": (invalid, "probs must sum to 1"),
        "wrong protocol": (failed, "protocol 99"),
        "verify after finish": (failed, "already finished"),
        "closed session": (grpc.StatusCode.NOT_FOUND, "unknown session"),
    }
    for name, (code, fragment) in expected_codes.items():
        assert codes[name][0] == code, (name, codes[name])
        assert fragment in codes[name][1], (name, codes[name])
    assert not server.server.engine.sessions


def test_session_limit_is_resource_exhausted_and_close_frees_a_slot(server, fingerprint):
    async def run():
        edge = Edge(server.address, fingerprint)
        sessions = [await edge.open() for _ in range(MAX_SESSIONS)]
        full = await status_of(edge.open(), with_trailers=True)
        await edge.stub.CloseSession(pb.CloseSessionRequest(session_id=sessions[0].session_id))
        reopened = await edge.open()
        for opened in [*sessions[1:], reopened]:
            await edge.stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))
        return full

    code, details, trailers = asyncio.run(run())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"all {MAX_SESSIONS} session slots are in use" in details and "retry in" in details
    assert int(trailers["retry-after-ms"]) > 0 and "specedge-limit" not in trailers  # not the round rate
    assert server.server.engine.slots.num_free == MAX_SESSIONS


def test_cancelled_server_only_stream_frees_its_slot(server, fingerprint):
    async def run():
        edge = Edge(server.address, fingerprint)
        request = pb.GenerateRequest(tokenizer=fingerprint, prompt_token_ids=PROMPT, max_new_tokens=100)
        call = edge.stub.Generate(request)
        received = [await call.read() for _ in range(3)]
        call.cancel()
        for _ in range(100):  # the server notices the cancellation asynchronously
            if server.server.engine.slots.num_free == MAX_SESSIONS:
                break
            await asyncio.sleep(0.05)
        return received

    received = asyncio.run(run())
    assert len(received) == 3
    assert server.server.engine.slots.num_free == MAX_SESSIONS
    assert not server.server.engine.sessions


def test_tree_round_accepts_the_right_branch_and_keeps_kv_consistent(server, fingerprint, expected):
    """A tree whose correct branch is not the first: its KV must be compacted for later rounds."""

    async def run():
        edge = Edge(server.address, fingerprint)
        opened = await edge.open()
        tokens = [opened.first_token_id]
        wrong = (expected[1] + 1) % 384
        # root -> wrong -> 7 ; root -> right1 -> right2   (nodes 1, 2 | 3, 4)
        drafts = [wrong, 7, expected[1], expected[2]]
        tree_reply = await edge.verify(opened.session_id, drafts, [0, 1, 0, 3], num_generated=1)
        tokens += tree_reply.token_ids
        reply = tree_reply
        while reply.finish_reason == pb.FINISH_REASON_NONE:
            chain = expected[len(tokens) : len(tokens) + 2]
            reply = await edge.verify(opened.session_id, chain, num_generated=len(tokens))
            tokens += reply.token_ids
        await edge.stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))
        return list(tree_reply.accepted_nodes), tokens

    accepted, tokens = asyncio.run(run())
    assert accepted == [3, 4]
    assert tokens == expected
