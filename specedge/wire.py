"""Conversions between the wire messages (specedge.v1) and internal types: the only place they meet."""

from __future__ import annotations

import dataclasses
from typing import cast

from specedge.edge_client.rounds import (
    DraftRound,
    OpenedSession,
    RoundReply,
    RoundTiming,
    ServerInfo,
    ServerLimits,
    StreamedTokens,
)
from specedge.tokens import TokenizerFingerprint
from specedge.types import FinishReason, SamplingParams, SparseDist
from specedge.v1 import specedge_pb2 as pb

PROTOCOL_VERSION = 1
# Trailers of a RESOURCE_EXHAUSTED refusal: how long to wait before the same call again, and which limit refused
# (LIMIT_ROUND_RATE: the identity's round rate, which the edge paces itself to).
RETRY_AFTER_TRAILER = "retry-after-ms"
LIMIT_TRAILER = "specedge-limit"
LIMIT_ROUND_RATE = "round-rate"
# The shortest keepalive interval a server accepts from an edge (faster pings count as abuse, and the server closes
# the connection after two).
MIN_PING_INTERVAL_S = 1.0


def fingerprint_to_proto(fp: TokenizerFingerprint) -> pb.TokenizerFingerprint:
    return pb.TokenizerFingerprint(
        vocab_size=fp.vocab_size,
        num_tokens=fp.num_tokens,
        vocab_sha256=fp.vocab_sha256,
        bos_token_id=fp.bos_token_id,
        eos_token_ids=fp.eos_token_ids,
    )


def fingerprint_from_proto(msg: pb.TokenizerFingerprint) -> TokenizerFingerprint:
    return TokenizerFingerprint(
        vocab_size=msg.vocab_size,
        num_tokens=msg.num_tokens,
        vocab_sha256=msg.vocab_sha256,
        bos_token_id=msg.bos_token_id if msg.HasField("bos_token_id") else None,
        eos_token_ids=tuple(msg.eos_token_ids),
    )


def sampling_to_proto(params: SamplingParams, seed: int | None) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed)


def sampling_from_proto(msg: pb.SamplingParams) -> tuple[SamplingParams, int | None]:
    """Raises ValueError with a user-facing message on out-of-range values."""
    params = SamplingParams(temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k)
    return params, msg.seed if msg.HasField("seed") else None


def finish_to_proto(reason: FinishReason) -> pb.FinishReason:
    # The enums are declared in the same order; a wire enum's members are plain ints at runtime.
    return cast(pb.FinishReason, reason.value)


def finish_from_proto(value: int) -> FinishReason:
    return FinishReason(value)


def round_to_proto(outcome) -> pb.VerifyResponse:
    """A server-side RoundOutcome (server/engine.py) as the wire reply."""
    timing = outcome.timing
    return pb.VerifyResponse(
        accepted_nodes=outcome.accepted_nodes,
        token_ids=outcome.token_ids,
        finish_reason=finish_to_proto(outcome.finish),
        num_generated=outcome.num_generated,
        advised_draft_tokens=outcome.advised_draft_tokens,
        num_verified_nodes=outcome.num_verified_nodes,
        timing=pb.RoundTiming(
            queue_ms=timing.queue_s * 1e3,
            forward_ms=timing.forward_s * 1e3,
            batch_size=timing.batch_size,
            batch_tokens=timing.batch_tokens,
        ),
    )


def verified_nodes_from_proto(reply: pb.VerifyResponse, num_draft_tokens: int) -> int:
    """Draft nodes the server verified; a server older than the field verified all it was sent."""
    return reply.num_verified_nodes if reply.HasField("num_verified_nodes") else num_draft_tokens


def dists_to_proto(dists) -> list[pb.SparseDistribution]:
    return [pb.SparseDistribution(token_ids=d.token_ids, probs=d.probs) for d in dists]


def dists_from_proto(msgs) -> tuple[SparseDist, ...]:
    """Raises ValueError with a user-facing message on a malformed distribution."""
    return tuple(SparseDist(msg.token_ids, msg.probs) for msg in msgs)


# -- the edge's side: its typed requests out, the server's replies in (edge_client/rounds.py) --


def draft_round_to_proto(session_id: str, draft: DraftRound) -> pb.VerifyRequest:
    return pb.VerifyRequest(
        session_id=session_id,
        draft_token_ids=draft.token_ids,
        draft_parents=draft.parents,
        num_generated=draft.num_generated,
        draft_probs=dists_to_proto(draft.dists),
    )


def limits_from_proto(msg: pb.ServerLimits) -> ServerLimits:
    # Field for field, by name (tests/test_wire.py checks the two declare the same fields).
    return ServerLimits(**{field.name: getattr(msg, field.name) for field in dataclasses.fields(ServerLimits)})


def server_info_from_proto(msg: pb.HandshakeResponse) -> ServerInfo:
    return ServerInfo(
        protocol_version=msg.protocol_version,
        server_version=msg.server_version,
        model_name=msg.model_name,
        target_tokenizer=fingerprint_from_proto(msg.target_tokenizer),
        limits=limits_from_proto(msg.limits),
    )


def opened_from_proto(msg: pb.OpenSessionResponse) -> OpenedSession:
    return OpenedSession(
        session_id=msg.session_id,
        first_token_id=msg.first_token_id,
        finish=finish_from_proto(msg.finish_reason),
        limits=limits_from_proto(msg.limits),
        advised_draft_tokens=msg.advised_draft_tokens,
    )


def round_reply_from_proto(msg: pb.VerifyResponse) -> RoundReply:
    timing = msg.timing
    return RoundReply(
        accepted_nodes=tuple(msg.accepted_nodes),
        token_ids=tuple(msg.token_ids),
        finish=finish_from_proto(msg.finish_reason),
        num_generated=msg.num_generated,
        advised_draft_tokens=msg.advised_draft_tokens,
        timing=RoundTiming(timing.queue_ms, timing.forward_ms, timing.batch_size, timing.batch_tokens),
        # Unset by a server older than the field, which verified every node it was sent.
        num_verified_nodes=msg.num_verified_nodes if msg.HasField("num_verified_nodes") else None,
    )


def streamed_from_proto(msg: pb.GenerateResponse) -> StreamedTokens:
    return StreamedTokens(token_ids=tuple(msg.token_ids), finish=finish_from_proto(msg.finish_reason))
