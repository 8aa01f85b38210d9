"""`specedge-edge serve`: an OpenAI-compatible API on this machine.

    POST /v1/chat/completions, /v1/completions   (stream: SSE, as OpenAI sends it)
    GET  /v1/models, /health

Every request is one answer of a shared `EdgeRuntime`: its own server
session, a drafter from the runtime's pool (`--parallel` answers draft at
once; more wait for a drafter). The HTTP server starts at once and the
runtime connects in the background, retrying with backoff; until it has,
/health and every request answer 503. Each response carries its speculative
stats in a `specedge` field (on the completion, and on a stream's last chunks).

This module is the HTTP side (routes, error bodies, the server's life);
openai_service.py answers, openai_schema.py holds the shapes.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from typing import TextIO

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from specedge.edge_client.client import EdgeError
from specedge.edge_client.openai_schema import CHAT, TEXT, APIError, ChatCompletionRequest, CompletionRequest
from specedge.edge_client.openai_service import ClientGone, EdgeAPI, ServeConfig, as_api_error
from specedge.edge_client.runtime import EdgeRuntime, RuntimeConfig


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


def create_app(api: EdgeAPI) -> FastAPI:
    app = FastAPI(title="SpecEdge edge API", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    @app.exception_handler(EdgeError)
    @app.exception_handler(Exception)  # a bug: 500 with OpenAI's error body, and a logged traceback
    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(as_api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        return _error_response(APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the answer was cancelled

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = api.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": api.models()}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        api.check_model(name)
        return api.models()[0]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, http: Request) -> Response:
        request.check_supported()
        api.check_model(request.model)
        return await api.respond(http, request, api.chat_prompt(request), CHAT)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request) -> Response:
        request.check_supported()
        api.check_model(request.model)
        return await api.respond(http, request, api.text_prompt(request), TEXT)

    return app


class EdgeAPIServer:
    """The runtime and the HTTP server on one event loop: `await EdgeAPIServer(...).run()` until `stop()`."""

    def __init__(self, runtime_config: RuntimeConfig, config: ServeConfig, err: TextIO = sys.stderr):
        self.runtime = EdgeRuntime(runtime_config)
        self.api = EdgeAPI(self.runtime, config, err)
        self.config, self.err = config, err
        self.http = uvicorn.Server(
            uvicorn.Config(
                create_app(self.api),
                host=config.host,
                port=config.port,
                log_level=config.log_level.lower(),
                timeout_graceful_shutdown=5,
            )
        )
        self._fatal: BaseException | None = None
        self._socket: socket.socket | None = None

    @property
    def port(self) -> int:
        """The bound port (a free one for port 0), once run() has started."""
        if self._socket is None:
            raise RuntimeError("run() has not bound the port yet")
        return self._socket.getsockname()[1]

    async def run(self) -> None:
        """Serve until stop() (or a signal); raises what made starting impossible (e.g. an incompatible draft)."""
        await self.runtime.load_tokenizer()  # an unknown draft fails here, before the port is taken
        self._socket = _listen(self.config.host, self.config.port)  # a port in use: one OSError, not uvicorn's exit
        starting = asyncio.create_task(self._start())
        interrupted = []
        uvicorn_handler = self.http.handle_exit

        def handle_exit(sig, frame) -> None:  # uvicorn installs this for SIGINT/SIGTERM while it serves
            interrupted.append(sig)
            uvicorn_handler(sig, frame)

        self.http.handle_exit = handle_exit  # type: ignore[method-assign]  # uvicorn has no other hook for it
        try:
            await self.http.serve(sockets=[self._socket])
        finally:
            starting.cancel()
            await self.runtime.close()
            self._socket.close()
        if self._fatal is not None:
            raise self._fatal
        if signal.SIGINT in interrupted:
            # uvicorn re-raises the signal after its graceful shutdown only on some paths;
            # Ctrl-C always ends as the other modes do (one line, exit 130).
            raise KeyboardInterrupt

    def stop(self) -> None:
        self.http.should_exit = True  # uvicorn polls it: safe from any thread

    async def _start(self) -> None:
        while not self.http.started:
            await asyncio.sleep(0.02)
        print(
            f"specedge-edge serve: OpenAI-compatible API on http://{self.config.host}:{self.port}/v1",
            file=self.err,
            flush=True,
        )
        try:
            await self.api.start()
        except Exception as exc:  # noqa: BLE001 (re-raised by run() once the HTTP server has stopped)
            self._fatal = exc
            self.stop()


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(args) -> int:
    """`specedge-edge serve`, from its parsed arguments."""
    from specedge.edge_client.cli import runtime_config

    config = ServeConfig(host=args.host, port=args.port, default_max_tokens=args.max_tokens, log_level=args.log_level)
    asyncio.run(EdgeAPIServer(runtime_config(args), config).run())
    return 0
