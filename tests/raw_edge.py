"""A raw edge for tests: its own connection, no drafter, any message (well-formed or not) sent as is."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from specedge.edge_client.channel import ChannelSecurity, open_channel
from specedge.v1 import specedge_pb2 as pb
from specedge.v1 import specedge_pb2_grpc

# A prompt of real ids of the tiny tokenizer (tests/tiny_models.py).
PROMPT = [1, 87, 324, 201, 260, 309, 81, 223, 2, 201, 1, 67, 85, 201]


class Edge:
    """A raw client on its own connection (as a separate machine would be), so the tests can send anything."""

    def __init__(
        self, address: str, fingerprint: pb.TokenizerFingerprint, security: ChannelSecurity = ChannelSecurity()
    ):
        self.channel = open_channel(address, security)  # its own connection, TLS and token as `security` says
        self.stub = specedge_pb2_grpc.SpecEdgeStub(self.channel)
        self.fingerprint = fingerprint

    async def open(self, prompt=PROMPT, max_new_tokens=30, **sampling) -> pb.OpenSessionResponse:
        request = pb.OpenSessionRequest(
            tokenizer=self.fingerprint,
            prompt_token_ids=prompt,
            max_new_tokens=max_new_tokens,
            sampling=pb.SamplingParams(**sampling),
        )
        return await self.stub.OpenSession(request)

    async def verify(self, session_id, drafts=(), parents=(), num_generated=1, dists=()) -> pb.VerifyResponse:
        request = pb.VerifyRequest(
            session_id=session_id,
            draft_token_ids=drafts,
            draft_parents=parents,
            num_generated=num_generated,
            draft_probs=dists,
        )
        return await self.stub.Verify(request)

    async def close(self, session_id: str) -> pb.CloseSessionResponse:
        return await self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))


async def status_of(coro, *, with_trailers: bool = False):
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        if with_trailers:
            return exc.code(), exc.details(), dict(exc.trailing_metadata() or ())
        return exc.code(), exc.details()
    return (grpc.StatusCode.OK, "", {}) if with_trailers else (grpc.StatusCode.OK, "")


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for the server to get somewhere (its state is polled; it runs on another thread)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting for the server"
        await asyncio.sleep(0.01)
