"""The OpenAI-compatible API's logic, under its HTTP routes (openai_api.py).

`EdgeAPI` stands between the routes and the `EdgeRuntime`: whether the
runtime is ready, which model names it answers to, a request's prompt ids
and sampling, and one answer per request, returned as one JSON completion or
as an SSE stream of chunks. A streamed request waits for its first token
before it answers, so a refusal (server busy, prompt too long) still gets its
HTTP status; after that, errors travel inside the stream, as OpenAI's do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import sys
import time
from typing import TextIO

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from specedge.edge_client.answer import AnswerResult, answer
from specedge.edge_client.client import ConnectionLost, EdgeError
from specedge.edge_client.openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    Shape,
    usage,
)
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.runtime import EdgeRuntime
from specedge.types import SamplingParams

log = logging.getLogger(__name__)

# HTTP status for each gRPC status the server can refuse a request with; anything else is a bad gateway.
_HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "RESOURCE_EXHAUSTED": 503,  # no KV slot free: retry shortly
    "DEADLINE_EXCEEDED": 504,
}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    default_max_tokens: int | None = None  # for requests without max_tokens; None: up to the server's context
    log_level: str = "error"  # uvicorn's (info shows every request)

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")


class EdgeAPI:
    """What the routes stand on: the runtime, whether it is ready, and one answer per request."""

    def __init__(self, runtime: EdgeRuntime, config: ServeConfig, err: TextIO = sys.stderr):
        self.runtime, self.config, self.err = runtime, config, err
        self.state = "connecting"  # -> "loading" (the draft model, once connected) -> "ready"
        self.created = int(time.time())

    async def start(self) -> None:
        """Connect (forever, with backoff) while the draft model loads; fatal errors propagate."""
        runtime = self.runtime
        drafting = asyncio.create_task(runtime.load_drafters())
        try:
            try:
                await runtime.connect(retry_for_s=0.0)
            except ConnectionLost as exc:
                self._say(f"{exc}; retrying with backoff (/health: connecting)")
                await runtime.connect(retry_for_s=None)
            self._say(f"connected to {runtime.config.server}, model {runtime.model_name}")
            self.state = "loading"
            await drafting
        finally:
            drafting.cancel()
        self.state = "ready"

    def _say(self, line: str) -> None:
        print(f"specedge-edge serve: {line}", file=self.err, flush=True)

    def health(self) -> tuple[int, dict]:
        runtime = self.runtime
        body = {"status": self.state, "server": runtime.config.server}
        if self.state != "ready":
            return 503, body
        drafting = None if runtime.config.server_only else runtime.config.draft
        return 200, {**body, "model": runtime.model_name, "draft": drafting, "fallback": runtime.draft_unavailable}

    def require_ready(self) -> None:
        if self.state == "connecting":
            why = f"not connected to the SpecEdge server at {self.runtime.config.server} yet; retrying (see /health)"
            raise APIError(503, why, code="server_not_ready", retry_after_s=1)
        if self.state == "loading":
            why = "the draft model is still loading (see /health)"
            raise APIError(503, why, code="server_not_ready", retry_after_s=1)

    def models(self) -> list[dict]:
        self.require_ready()
        return [{"id": self.runtime.model_name, "object": "model", "created": self.created, "owned_by": "specedge"}]

    def check_model(self, name: str) -> None:
        self.require_ready()
        if name not in (self.runtime.model_name, self.runtime.config.draft):
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.runtime.model_name}`",
                param="model",
                code="model_not_found",
            )

    def policy(self, request: GenerationRequest, num_prompt_tokens: int, param: str) -> SpeculationPolicy:
        """The runtime's policy with this request's sampling and length."""
        info = self.runtime.client.server_info
        if info is None:  # between servers (a reconnect under way)
            raise APIError(503, "not connected to a server right now", code="server_unreachable", retry_after_s=1)
        max_context = info.limits.max_context_tokens
        if not num_prompt_tokens:
            raise APIError(400, f"{param}: the prompt is empty", param=param)
        if num_prompt_tokens >= max_context:
            raise APIError(
                400,
                f"{param}: the prompt has {num_prompt_tokens} tokens; the server's context holds {max_context} "
                "(prompt and answer together)",
                param=param,
                code="context_length_exceeded",
            )
        base = self.runtime.config.policy
        sampling = SamplingParams(
            temperature=_given(request.temperature, base.sampling.temperature),
            top_p=_given(request.top_p, base.sampling.top_p),
            top_k=_given(request.top_k, base.sampling.top_k),
        )
        max_new_tokens = request.max_new_tokens or self.config.default_max_tokens or max_context - num_prompt_tokens
        return dataclasses.replace(
            base, max_new_tokens=max_new_tokens, sampling=sampling, seed=_given(request.seed, base.seed)
        )

    def chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        from jinja2.exceptions import TemplateError

        messages = request.template_messages()
        try:
            return self.runtime.chat_prompt(messages)
        except (TemplateError, ValueError) as exc:
            raise APIError(400, f"messages: the model's chat template refused them: {exc}", param="messages") from None

    def text_prompt(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        text = prompt if isinstance(prompt, str) else "".join(str(part) for part in prompt)  # parts are str here
        return self.runtime.tokenizer.encode(text) if text else []

    async def respond(self, http: Request, request: GenerationRequest, prompt: list[int], shape: Shape) -> Response:
        """One answer, as one JSON completion or as an SSE stream of chunks."""
        policy = self.policy(request, len(prompt), shape.prompt_param)
        head = {
            "id": f"{shape.id_prefix}-{secrets.token_hex(12)}",
            "created": int(time.time()),
            "model": self.runtime.model_name,
        }
        pieces: asyncio.Queue[str | None] = asyncio.Queue()  # each burst's text; None once the answer is over
        work = asyncio.ensure_future(answer(self.runtime, prompt, policy, request.stops, pieces.put_nowait))
        work.add_done_callback(lambda _: pieces.put_nowait(None))
        if not request.stream:
            result = await _unless_disconnected(http, work, work)
            return JSONResponse({**head, **shape.completion(result)})
        first_piece = await _unless_disconnected(http, pieces.get(), work)
        if first_piece is None:  # over before its first token: refused, and answered with the refusal's HTTP status
            work.result()
            raise APIError(502, "the answer ended before its first token")
        return EventSourceResponse(_chunks(head, shape, request.include_usage, first_piece, pieces, work), ping=15)


async def _chunks(head: dict, shape: Shape, include_usage: bool, first_piece, pieces: asyncio.Queue, work):
    """The SSE events of a streamed answer: text chunks, the finish chunk, usage, [DONE]."""
    extra = {"usage": None} if include_usage else {}

    def event(choices: list[dict], **fields) -> dict:
        return {"data": json.dumps({**head, "object": shape.chunk_object, "choices": choices, **extra, **fields})}

    try:
        yield event([shape.chunk_choice(first_piece or "", None, first=True)])
        while (piece := await pieces.get()) is not None:
            if piece:
                yield event([shape.chunk_choice(piece, None)])
        result: AnswerResult = work.result()
        stats = result.stats.as_dict()
        yield event([shape.chunk_choice("", shape.finish_reason(result))], specedge=stats)
        if include_usage:
            yield event([], usage=usage(result), specedge=stats)
        yield {"data": "[DONE]"}
    except Exception as exc:  # noqa: BLE001 (the stream has begun: the error travels as an event, as OpenAI's do)
        yield {"data": json.dumps(as_api_error(exc).body())}
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # the client went away
        # The answer's task was cancelled under it, not this stream: a stream must end with an error or [DONE].
        yield {"data": json.dumps(APIError(502, "the answer was cancelled before it finished").body())}
    finally:
        work.cancel()  # the client went away: the answer's session is closed on the way out


def _given(value, default):
    return default if value is None else value


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _unless_disconnected(http: Request, awaitable, answering: asyncio.Future):
    """The awaitable's result, unless the client disconnects first: then the answer is cancelled.

    Starlette lets a handler run on after its client has gone; an abandoned
    answer would hold a server session and a drafter until it finished.
    """
    waiting = asyncio.ensure_future(awaitable)

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({waiting, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not waiting.done():
        waiting.cancel()
        answering.cancel()
        raise ClientGone()
    return waiting.result()


def as_api_error(exc: Exception) -> APIError:
    """The HTTP error for a failure: ours, the server's refusal, an unreachable server, or a bug (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ConnectionLost):
        return APIError(503, str(exc), code="server_unreachable", retry_after_s=1)
    if isinstance(exc, EdgeError):
        status = _HTTP_STATUS.get(exc.status or "", 502)
        return APIError(status, str(exc), retry_after_s=1 if status == 503 else None)
    log.error("answering failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")
