"""The gRPC servicer: translate messages, call the engine, map failures to statuses.

Handlers stay thin: conversions live in specedge/wire.py, behaviour in the
engine, and every failure goes through `_statuses`, so one request's error
reaches that request alone.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging

import grpc

import specedge
from specedge import wire
from specedge.server import errors
from specedge.server.engine import Engine, RoundOutcome
from specedge.tokens import IncompatibleTokenizer, check_compatible
from specedge.v1 import specedge_pb2 as pb
from specedge.v1 import specedge_pb2_grpc

log = logging.getLogger(__name__)


def _statuses(handler):
    """Map ServiceError to its status, out-of-memory to RESOURCE_EXHAUSTED, the rest to INTERNAL."""

    async def abort_for(exc: BaseException, context: grpc.aio.ServicerContext):
        if isinstance(exc, errors.ServiceError):
            if exc.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after-ms", str(round(exc.retry_after_s * 1000))),))
            await context.abort(exc.code, str(exc))
        if "out of memory" in str(exc).lower():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the server ran out of memory; retry later")
        log.exception("unexpected error in %s", handler.__name__)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal server error ({type(exc).__name__})")

    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream_wrapper(self, request, context):
            try:
                async for reply in handler(self, request, context):
                    yield reply
            except Exception as exc:
                await abort_for(exc, context)

        return stream_wrapper

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except Exception as exc:
            await abort_for(exc, context)

    return wrapper


class SpecEdgeService(specedge_pb2_grpc.SpecEdgeServicer):
    def __init__(self, engine: Engine):
        self.engine = engine
        self.fingerprint = engine.target.fingerprint

    def _limits(self) -> pb.ServerLimits:
        config = self.engine.config
        return pb.ServerLimits(
            max_context_tokens=config.max_context,
            max_draft_tokens=config.max_draft_tokens,
            max_sessions=config.max_sessions,
        )

    def _check_tokenizer(self, msg: pb.TokenizerFingerprint) -> None:
        try:
            check_compatible(wire.fingerprint_from_proto(msg), self.fingerprint)
        except IncompatibleTokenizer as exc:
            raise errors.FailedPrecondition(f"{exc}: the draft model must use the target's tokenizer") from None

    @staticmethod
    def _sampling(msg: pb.SamplingParams):
        try:
            return wire.sampling_from_proto(msg)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None

    @staticmethod
    def _owner(context: grpc.aio.ServicerContext) -> str:
        # The peer address names the TCP connection: a session opened on one
        # connection cannot be driven from another. (Channels inside one client
        # process may share a connection unless they use a local subchannel pool,
        # as EdgeClient does.)
        return context.peer()

    @_statuses
    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        if request.protocol_version != wire.PROTOCOL_VERSION:
            raise errors.FailedPrecondition(
                f"edge speaks protocol {request.protocol_version}, server speaks {wire.PROTOCOL_VERSION}; upgrade specedge"
            )
        self._check_tokenizer(request.draft_tokenizer)
        return pb.HandshakeResponse(
            protocol_version=wire.PROTOCOL_VERSION,
            server_version=specedge.__version__,
            model_name=self.engine.target.name,
            target_tokenizer=wire.fingerprint_to_proto(self.fingerprint),
            limits=self._limits(),
        )

    @_statuses
    async def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionResponse:
        self._check_tokenizer(request.tokenizer)
        sampling, seed = self._sampling(request.sampling)
        session, outcome = await self.engine.open_session(
            self._owner(context), list(request.prompt_token_ids), request.max_new_tokens, sampling, seed
        )
        return self._opened(session, outcome)

    def _opened(self, session, outcome: RoundOutcome) -> pb.OpenSessionResponse:
        return pb.OpenSessionResponse(
            session_id=session.id,
            first_token_id=outcome.token_ids[0],
            finish_reason=wire.finish_to_proto(outcome.finish),
            limits=self._limits(),
            advised_draft_tokens=outcome.advised_draft_tokens,
        )

    @_statuses
    async def ContinueSession(self, request: pb.ContinueSessionRequest, context) -> pb.OpenSessionResponse:
        sampling, seed = self._sampling(request.sampling)
        session, outcome = await self.engine.continue_session(
            self._owner(context),
            request.session_id,
            request.keep_tokens,
            list(request.token_ids),
            request.max_new_tokens,
            sampling,
            seed,
        )
        return self._opened(session, outcome)

    @_statuses
    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        try:
            dists = wire.dists_from_proto(request.draft_probs)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        outcome = await self.engine.verify(
            self._owner(context),
            request.session_id,
            list(request.draft_token_ids),
            list(request.draft_parents),
            request.num_generated,
            dists,
        )
        return wire.round_to_proto(outcome)

    @_statuses
    async def CloseSession(self, request: pb.CloseSessionRequest, context) -> pb.CloseSessionResponse:
        self.engine.close_session(self._owner(context), request.session_id)
        return pb.CloseSessionResponse()

    @_statuses
    async def Generate(self, request: pb.GenerateRequest, context):
        self._check_tokenizer(request.tokenizer)
        sampling, seed = self._sampling(request.sampling)
        outcomes = self.engine.generate(
            self._owner(context),
            list(request.prompt_token_ids),
            request.max_new_tokens,
            sampling,
            seed,
            server_draft_tokens=request.server_draft_tokens,
        )
        async for outcome in outcomes:
            yield _generate_reply(outcome)

    async def Attach(self, request: pb.AttachRequest, context):
        owner = self._owner(context)
        self.engine.attach(owner)
        try:
            await asyncio.Event().wait()  # until the client goes away or the server stops
            yield pb.ServerNotice()  # never reached; makes this an async generator
        finally:
            self.engine.detach(owner)


def _generate_reply(outcome: RoundOutcome) -> pb.GenerateResponse:
    return pb.GenerateResponse(token_ids=outcome.token_ids, finish_reason=wire.finish_to_proto(outcome.finish))
