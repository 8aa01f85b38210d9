"""The edge's gRPC client: handshake, then draft -> verify rounds until the server says stop.

The speculative loop, in full:

    open session (server prefills, returns its first token)
    repeat: draft k tokens after everything committed so far
            send them; the server returns the accepted drafts + its own next token
            append those; stop when the server reports a finish reason
    close session

Draft compute runs in a worker thread so the event loop (and with it the
gRPC channel) never blocks on the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Callable, Sequence

import grpc

from specedge import wire
from specedge.edge_client.drafting.base import DEFAULT_DRAFT_TOP_K, Drafter, DraftSampling
from specedge.tokens import IncompatibleTokenizer, TokenizerFingerprint, check_compatible
from specedge.types import FinishReason, SamplingParams
from specedge.v1 import specedge_pb2 as pb
from specedge.v1 import specedge_pb2_grpc

TokenCallback = Callable[[Sequence[int]], None]


class EdgeError(Exception):
    """A failure the user can act on; the message is one line."""


@dataclasses.dataclass(frozen=True)
class EdgeConfig:
    num_draft: int = 4  # draft tokens per round
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None  # same seed, same output (speculative or not)
    follow_advice: bool = True  # draft min(num_draft, the server's advice) tokens a round
    # Sampled sessions: draft by sampling from a top-k q and send q, so the server
    # verifies by rejection sampling (accepts more than matching its samples).
    rejection_sampling: bool = True
    draft_top_k: int = DEFAULT_DRAFT_TOP_K
    rpc_timeout_s: float = 120.0  # per RPC; a verify round normally takes well under a second

    def __post_init__(self):
        if self.num_draft < 0:
            raise ValueError(f"num_draft must be >= 0, got {self.num_draft}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass
class GenerationStats:
    rounds: int = 0  # verify rounds (each one target forward)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    num_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens committed per verify round (accepted drafts + the server's own), after the first token."""
        return (self.num_tokens - 1) / self.rounds if self.rounds else 0.0

    @property
    def itl_ms(self) -> float:
        """Mean time between tokens after the first."""
        return (self.total_ms - self.ttft_ms) / (self.num_tokens - 1) if self.num_tokens > 1 else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_round": round(self.tokens_per_round, 4),
            "ttft_ms": round(self.ttft_ms, 2),
            "itl_ms": round(self.itl_ms, 2),
        }


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    finish: FinishReason
    stats: GenerationStats


def _explain(exc: grpc.aio.AioRpcError, address: str) -> EdgeError:
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return EdgeError(f"cannot reach the server at {address} ({exc.details()}); is specedge-server running there?")
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return EdgeError(f"the server at {address} did not answer in time")
    return EdgeError(f"server refused: {exc.code().name}: {exc.details()}")


class EdgeClient:
    """One connection to a server. Use as `async with EdgeClient(address, fingerprint) as client:`."""

    def __init__(self, address: str, fingerprint: TokenizerFingerprint, *, config: EdgeConfig = EdgeConfig()):
        self.address = address
        self.fingerprint = fingerprint
        self.config = config
        self._channel: grpc.aio.Channel | None = None
        self._stub: specedge_pb2_grpc.SpecEdgeStub | None = None
        self._lease: grpc.aio.UnaryStreamCall | None = None
        self.server_info: pb.HandshakeResponse | None = None

    async def __aenter__(self) -> EdgeClient:
        # Its own TCP connection, even beside other clients in this process: the
        # server binds sessions to the connection that opened them.
        self._channel = grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])
        self._stub = specedge_pb2_grpc.SpecEdgeStub(self._channel)
        await self.handshake()
        # The connection's lease: if this process dies, the server frees our slots at once.
        self._lease = self._stub.Attach(pb.AttachRequest())
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._lease is not None:
            self._lease.cancel()
        if self._channel is not None:
            await self._channel.close()

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _explain(exc, self.address) from None

    async def handshake(self) -> pb.HandshakeResponse:
        request = pb.HandshakeRequest(
            protocol_version=wire.PROTOCOL_VERSION,
            draft_tokenizer=wire.fingerprint_to_proto(self.fingerprint),
            client_name="specedge-edge",
        )
        try:
            reply = await self._stub.Handshake(request, timeout=self.config.rpc_timeout_s, wait_for_ready=False)
        except grpc.aio.AioRpcError as exc:
            raise _explain(exc, self.address) from None
        try:  # the server checks too; checking here gives the same answer without trusting it
            check_compatible(self.fingerprint, wire.fingerprint_from_proto(reply.target_tokenizer))
        except IncompatibleTokenizer as exc:
            raise EdgeError(f"draft is not compatible with the server's model {reply.model_name}: {exc}") from None
        self.server_info = reply
        return reply

    async def generate(
        self, prompt: Sequence[int], drafter: Drafter | None, on_tokens: TokenCallback = lambda tokens: None
    ) -> GenerationResult:
        """Speculative generation with `drafter`, or server-only generation when it is None."""
        if drafter is None or self.config.num_draft == 0:
            return await self._generate_server_only(prompt, on_tokens)
        return await self._generate_speculative(prompt, drafter, on_tokens)

    async def _generate_speculative(
        self, prompt: Sequence[int], drafter: Drafter, on_tokens: TokenCallback
    ) -> GenerationResult:
        config, stats = self.config, GenerationStats()
        started = time.perf_counter()
        opened = await self._call(
            self._stub.OpenSession,
            pb.OpenSessionRequest(
                tokenizer=wire.fingerprint_to_proto(self.fingerprint),
                prompt_token_ids=prompt,
                max_new_tokens=config.max_new_tokens,
                sampling=wire.sampling_to_proto(config.sampling, config.seed),
            ),
        )
        stats.ttft_ms = (time.perf_counter() - started) * 1e3
        tokens = [opened.first_token_id]
        on_tokens(tokens)
        finish = wire.finish_from_proto(opened.finish_reason)
        max_draft = min(config.num_draft, opened.limits.max_draft_tokens)
        advised = opened.advised_draft_tokens
        draft_sampling = None
        if config.rejection_sampling and not config.sampling.greedy:
            draft_sampling = DraftSampling(
                temperature=config.sampling.temperature,
                top_k=config.draft_top_k,
                seed=config.seed if config.seed is not None else secrets.randbits(63),
            )
        try:
            while finish is FinishReason.NONE:
                # Advice 0 means drafting does not pay right now: the round
                # carries no drafts and the server decodes one token itself.
                num_draft = min(max_draft, advised) if config.follow_advice else max_draft
                draft = await asyncio.to_thread(drafter.propose, [*prompt, *tokens], num_draft, draft_sampling)
                reply = await self._call(
                    self._stub.Verify,
                    pb.VerifyRequest(
                        session_id=opened.session_id,
                        draft_token_ids=draft.token_ids,
                        num_generated=len(tokens),
                        draft_probs=wire.dists_to_proto(draft.dists or ()),
                    ),
                )
                advised = reply.advised_draft_tokens
                stats.rounds += 1
                stats.draft_tokens += len(draft.token_ids)
                stats.accepted_tokens += len(reply.accepted_nodes)
                tokens += reply.token_ids
                on_tokens(reply.token_ids)
                finish = wire.finish_from_proto(reply.finish_reason)
        finally:
            await self._close_quietly(opened.session_id)
        stats.num_tokens, stats.total_ms = len(tokens), (time.perf_counter() - started) * 1e3
        return GenerationResult(tokens, finish, stats)

    async def _close_quietly(self, session_id: str) -> None:
        """Free the server's slot; shielded so that a cancelled generation still frees it."""
        try:
            await asyncio.shield(self._stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=5))
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass  # the server's idle timeout frees the slot anyway

    async def _generate_server_only(self, prompt: Sequence[int], on_tokens: TokenCallback) -> GenerationResult:
        config, stats = self.config, GenerationStats()
        started = time.perf_counter()
        request = pb.GenerateRequest(
            tokenizer=wire.fingerprint_to_proto(self.fingerprint),
            prompt_token_ids=prompt,
            max_new_tokens=config.max_new_tokens,
            sampling=wire.sampling_to_proto(config.sampling, config.seed),
        )
        tokens: list[int] = []
        finish = FinishReason.NONE
        try:
            async for reply in self._stub.Generate(request, timeout=config.rpc_timeout_s * config.max_new_tokens):
                if not tokens:
                    stats.ttft_ms = (time.perf_counter() - started) * 1e3
                else:
                    stats.rounds += 1
                tokens += reply.token_ids
                on_tokens(reply.token_ids)
                finish = wire.finish_from_proto(reply.finish_reason)
        except grpc.aio.AioRpcError as exc:
            raise _explain(exc, self.address) from None
        stats.num_tokens, stats.total_ms = len(tokens), (time.perf_counter() - started) * 1e3
        return GenerationResult(tokens, finish, stats)
