"""The gRPC servicer: authenticate, validate, call the engine, map failures to statuses.

Every handler goes through `_rpc`, which first names the caller (server/auth.py;
UNAUTHENTICATED otherwise), then refuses a request that failed to parse
(server/decoding.py), and maps each failure to its one status, so one
request's error reaches that request alone. Validation lives in
server/requests.py, conversions in specedge/wire.py, behaviour in the engine.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math

import grpc

import specedge
from specedge import wire
from specedge.server import errors
from specedge.server.auth import Authenticator, Caller
from specedge.server.decoding import Malformed
from specedge.server.engine import Engine, RoundOutcome
from specedge.server.isolation import is_oom
from specedge.server.limits import AttachLimiter, RoundRateLimiter
from specedge.server.requests import RequestValidator
from specedge.server.transport import TransportConfig
from specedge.types import FinishReason
from specedge.v1 import specedge_pb2 as pb
from specedge.v1 import specedge_pb2_grpc

log = logging.getLogger(__name__)


def _rpc(handler):
    """Authenticate, refuse malformed requests, and map failures: ServiceError to its status,
    out-of-memory to RESOURCE_EXHAUSTED, anything else to INTERNAL. The handler gets the Caller."""

    async def abort_for(exc: BaseException, context: grpc.aio.ServicerContext):
        if isinstance(exc, errors.ServiceError):
            trailers = []
            if exc.retry_after_s is not None:
                trailers.append((wire.RETRY_AFTER_TRAILER, str(math.ceil(exc.retry_after_s * 1000))))
            if exc.limit is not None:
                trailers.append((wire.LIMIT_TRAILER, exc.limit))
            if trailers:
                context.set_trailing_metadata(tuple(trailers))
            await context.abort(exc.code, str(exc))
        if is_oom(exc):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the server ran out of memory; retry later")
        log.exception("unexpected error in %s", handler.__name__)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal server error ({type(exc).__name__})")

    def admit(self: SpecEdgeService, request, context: grpc.aio.ServicerContext) -> Caller:
        try:
            caller = self.authenticator.caller(context.invocation_metadata() or (), context.peer())
        except errors.Unauthenticated:
            self.engine.stats.observe_refused("unauthenticated")
            raise
        if isinstance(request, Malformed):
            raise errors.InvalidArgument(str(request))
        return caller

    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream_wrapper(self, request, context):
            try:
                async for reply in handler(self, request, context, admit(self, request, context)):
                    yield reply
            except Exception as exc:
                await abort_for(exc, context)

        return stream_wrapper

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context, admit(self, request, context))
        except Exception as exc:
            await abort_for(exc, context)

    return wrapper


class SpecEdgeService(specedge_pb2_grpc.SpecEdgeServicer):
    def __init__(
        self,
        engine: Engine,
        *,
        authenticator: Authenticator,
        rate_limiter: RoundRateLimiter,
        attach_limiter: AttachLimiter,
        transport: TransportConfig,
    ):
        self.engine = engine
        self.authenticator = authenticator
        self.rate_limiter = rate_limiter
        self.attach_limiter = attach_limiter
        self.fingerprint = engine.target.fingerprint
        self.requests = RequestValidator(engine.config.request_limits(engine.vocab_size), self.fingerprint)
        self.limits = self._limits(transport)

    def _limits(self, transport: TransportConfig) -> pb.ServerLimits:
        config, rate = self.engine.config, self.rate_limiter.config
        return pb.ServerLimits(
            max_context_tokens=config.max_context,
            max_draft_tokens=config.max_draft_tokens,
            max_sessions=config.max_sessions,
            max_prompt_tokens=config.prompt_limit,
            max_draft_prob_tokens=config.max_draft_prob_tokens,
            max_sessions_per_identity=config.identity_session_limit,
            max_rounds_per_second=rate.rounds_per_s or 0.0,
            round_burst=rate.burst,
            max_message_bytes=transport.max_message_bytes,
            idle_session_timeout_s=config.idle_timeout_s,
            idle_connection_timeout_s=transport.idle_connection_timeout_s or 0.0,
            max_attach_streams_per_identity=self.attach_limiter.max_per_identity,
        )

    def _admit_round(self, caller: Caller) -> None:
        try:
            self.rate_limiter.admit(caller.identity)
        except errors.ResourceExhausted:
            self.engine.stats.observe_refused("rate_limited")
            raise

    @_rpc
    async def Handshake(self, request: pb.HandshakeRequest, context, caller: Caller) -> pb.HandshakeResponse:
        self.requests.check_handshake(request)
        return pb.HandshakeResponse(
            protocol_version=wire.PROTOCOL_VERSION,
            server_version=specedge.__version__,
            model_name=self.engine.target.name,
            target_tokenizer=wire.fingerprint_to_proto(self.fingerprint),
            limits=self.limits,
        )

    @_rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context, caller: Caller) -> pb.OpenSessionResponse:
        self._admit_round(caller)
        session, outcome = await self.engine.open_session(caller, self.requests.session_request(request))
        return self._opened(session, outcome)

    def _opened(self, session, outcome: RoundOutcome) -> pb.OpenSessionResponse:
        return pb.OpenSessionResponse(
            session_id=session.id,
            first_token_id=outcome.token_ids[0],
            finish_reason=wire.finish_to_proto(outcome.finish),
            limits=self.limits,
            advised_draft_tokens=outcome.advised_draft_tokens,
        )

    @_rpc
    async def ContinueSession(
        self, request: pb.ContinueSessionRequest, context, caller: Caller
    ) -> pb.OpenSessionResponse:
        self._admit_round(caller)
        turn = self.requests.turn_request(request)
        session, outcome = await self.engine.continue_session(caller, request.session_id, turn)
        return self._opened(session, outcome)

    @_rpc
    async def Verify(self, request: pb.VerifyRequest, context, caller: Caller) -> pb.VerifyResponse:
        self._admit_round(caller)
        draft = self.requests.draft_round(request)
        outcome = await self.engine.verify(caller, request.session_id, draft, request.num_generated)
        return wire.round_to_proto(outcome)

    @_rpc
    async def CloseSession(self, request: pb.CloseSessionRequest, context, caller: Caller) -> pb.CloseSessionResponse:
        self.engine.close_session(caller, request.session_id)
        return pb.CloseSessionResponse()

    @_rpc
    async def Generate(self, request: pb.GenerateRequest, context, caller: Caller):
        self._admit_round(caller)
        session_request = self.requests.session_request(request)
        outcomes = self.engine.generate(caller, session_request, self.requests.server_draft_tokens(request))
        async for outcome in outcomes:
            yield _generate_reply(outcome)
            if outcome.finish is FinishReason.NONE:
                # The server drives this stream, so it is paced to the identity's rate, not refused.
                if delay_s := self.rate_limiter.delay(caller.identity):
                    await asyncio.sleep(delay_s)

    @_rpc
    async def Attach(self, request: pb.AttachRequest, context, caller: Caller):
        try:
            self.attach_limiter.acquire(caller.identity)
        except errors.ResourceExhausted:
            self.engine.stats.observe_refused("attach_limit")
            raise
        self.engine.attach(caller.connection)
        try:
            await asyncio.Event().wait()  # until the client goes away or the server stops
            yield pb.ServerNotice()  # never reached; makes this an async generator
        finally:
            self.engine.detach(caller.connection)
            self.attach_limiter.release(caller.identity)


def _generate_reply(outcome: RoundOutcome) -> pb.GenerateResponse:
    return pb.GenerateResponse(token_ids=outcome.token_ids, finish_reason=wire.finish_to_proto(outcome.finish))
