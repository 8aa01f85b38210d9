"""Run a real SpecEdge server on a loopback socket, in a background thread, for tests."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from specedge.server.app import ServerConfig, SpecEdgeServer


class ServerThread:
    """`with ServerThread(config) as server:` serves on server.address until the block ends."""

    def __init__(self, config: ServerConfig):
        self.server = SpecEdgeServer(config)
        self.loop = asyncio.new_event_loop()
        self.address: str | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.address = self.loop.run_until_complete(self.server.start())
        self._ready.set()
        self.loop.run_forever()

    def call(self, coro):
        """Run a coroutine on the server's loop (e.g. to inspect engine state safely)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout=60):
            raise TimeoutError("server did not start")
        return self

    def __exit__(self, *exc_info) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace=1), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


def tiny_server(model_dir, *, max_context: int = 256, **engine_options) -> ServerThread:
    """A server thread for a tiny model: `with tiny_server(dir, max_sessions=8) as server:`."""
    from specedge.server.engine import EngineConfig

    engine = EngineConfig(**engine_options)
    return ServerThread(ServerConfig(model=str(model_dir), port=0, max_context=max_context, engine=engine))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server_process(
    *args: str,
    timeout_s: float = 600,
    port: int | None = None,
    output: list[str] | None = None,
    launcher: Sequence[str] = (),
) -> tuple[subprocess.Popen, str]:
    """Run `[LAUNCHER] specedge-server ARGS --port P` as a user would; return once it prints its ready line.

    Its output lines (stdout and stderr) keep arriving in `output`, when given.
    """
    port = port or free_port()
    server = os.path.join(os.path.dirname(sys.executable), "specedge-server")
    command = [*launcher, server, *args, "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = f"specedge-server ready on 127.0.0.1:{port}"
    lines: list[str] = output if output is not None else []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if any(line.strip() == ready for line in lines):
            return process, f"127.0.0.1:{port}"
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("specedge-server did not become ready:\n" + "".join(lines[-20:]))
