"""specedge/wire.py: the edge's typed messages carry every field of the wire replies, unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from specedge import wire
from specedge.edge_client.rounds import DraftRound, OpenedSession, RoundReply, ServerInfo, ServerLimits, StreamedTokens
from specedge.types import FinishReason, SparseDist
from specedge.v1 import specedge_pb2 as pb

LIMITS = pb.ServerLimits(
    max_context_tokens=512,
    max_draft_tokens=16,
    max_sessions=8,
    max_prompt_tokens=400,
    max_draft_prob_tokens=20,
    max_sessions_per_identity=4,
    max_rounds_per_second=12.5,
    round_burst=3,
    max_message_bytes=1 << 20,
    idle_session_timeout_s=30.0,
    idle_connection_timeout_s=2.5,
    max_attach_streams_per_identity=2,
)


@pytest.mark.parametrize(
    ("typed", "message"),
    [(ServerLimits, pb.ServerLimits), (ServerInfo, pb.HandshakeResponse), (StreamedTokens, pb.GenerateResponse)],
)
def test_a_typed_reply_names_every_field_of_its_message(typed, message):
    """A field added to the proto must reach the edge's typed view too (finish_reason is `finish`)."""
    wire_fields = {field.name.replace("finish_reason", "finish") for field in message.DESCRIPTOR.fields}
    assert {field.name for field in dataclasses.fields(typed)} == wire_fields


def test_replies_convert_field_by_field():
    handshake = pb.HandshakeResponse(
        protocol_version=1,
        server_version="0.1.0",
        model_name="tiny",
        target_tokenizer=pb.TokenizerFingerprint(vocab_size=300, num_tokens=300, vocab_sha256="ab", eos_token_ids=[2]),
        limits=LIMITS,
    )
    info = wire.server_info_from_proto(handshake)
    assert (info.model_name, info.target_tokenizer.vocab_size, info.target_tokenizer.bos_token_id) == (
        "tiny",
        300,
        None,
    )
    assert info.limits.max_rounds_per_second == 12.5 and info.limits.max_attach_streams_per_identity == 2

    opened = wire.opened_from_proto(
        pb.OpenSessionResponse(
            session_id="s",
            first_token_id=7,
            finish_reason=pb.FINISH_REASON_LENGTH,
            limits=LIMITS,
            advised_draft_tokens=3,
        )
    )
    assert opened == OpenedSession("s", 7, FinishReason.LENGTH, info.limits, 3)

    reply = wire.round_reply_from_proto(
        pb.VerifyResponse(
            accepted_nodes=[1, 3],
            token_ids=[5, 6, 9],
            finish_reason=pb.FINISH_REASON_STOP,
            num_generated=4,
            advised_draft_tokens=2,
            timing=pb.RoundTiming(queue_ms=1.5, forward_ms=20.0, batch_size=3, batch_tokens=11),
        )
    )
    assert (reply.accepted_nodes, reply.token_ids, reply.finish) == ((1, 3), (5, 6, 9), FinishReason.STOP)
    assert (reply.timing.forward_ms, reply.timing.batch_tokens) == (20.0, 11)
    assert isinstance(reply, RoundReply)


def test_a_draft_round_goes_out_as_its_verify_request():
    q = SparseDist((5, 6), (0.75, 0.25))
    request = wire.draft_round_to_proto("s", DraftRound((5, 8), num_generated=3, parents=(0, 1), dists=(q, q)))
    assert (request.session_id, list(request.draft_token_ids), list(request.draft_parents)) == ("s", [5, 8], [0, 1])
    assert request.num_generated == 3
    assert wire.dists_from_proto(request.draft_probs) == (q, q)
