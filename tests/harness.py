"""Run a real SpecEdge server on a loopback socket, in a background thread, for tests."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from specedge.bench.lifeline import dying_with_parent
from specedge.server.app import ServerConfig, SpecEdgeServer
from specedge.server.runner import Runner


class ServerThread:
    """`with ServerThread(config) as server:` serves on server.address until the block ends.

    `wrap_runner` wraps the engine's model runner before the server starts: the
    seam through which a test injects faults into the batched forward.
    """

    def __init__(self, config: ServerConfig, wrap_runner: Callable[[Runner], Runner] | None = None):
        self.server = SpecEdgeServer(config)
        if wrap_runner is not None:
            self.server.engine.stepper.runner = wrap_runner(self.server.engine.stepper.runner)
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


def generate(server, tokenizer, prompt, drafter, **policy):
    """One answer through a real EdgeClient: speculative with `drafter`, server-only with None; `policy`
    is SpeculationPolicy's fields."""
    from specedge.edge_client import generation
    from specedge.edge_client.client import EdgeClient
    from specedge.edge_client.policy import SpeculationPolicy

    async def run():
        async with EdgeClient(server.address, tokenizer.fingerprint) as client:
            return await generation.generate(client, prompt, drafter, policy=SpeculationPolicy(**policy))

    return asyncio.run(run())


def tiny_server(
    model_dir, *, max_context: int = 256, draft_model=None, metrics_port: int | None = None, **engine_options
) -> ServerThread:
    """A server thread for a tiny model: `with tiny_server(dir, max_sessions=8) as server:`."""
    from specedge.server.engine import EngineConfig

    config = ServerConfig(
        model=str(model_dir),
        port=0,
        max_context=max_context,
        engine=EngineConfig(**engine_options),
        draft_model=None if draft_model is None else str(draft_model),
        metrics_port=metrics_port,
    )
    return ServerThread(config)


class ServerProcess:
    """`with ServerProcess(dir) as server:` runs `specedge-server --model DIR` as a user would, on server.address.

    For the tests of the command line itself, and of how the process ends (server.process).
    """

    def __init__(self, model_dir, *, max_context: int = 256):
        self.process, self.address = start_server_process("--model", str(model_dir), "--max-context", str(max_context))

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process.poll() is None:
            self.process.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_pki(folder) -> dict[str, str]:
    """PEM files made with trustme: the server's CA and certificate (localhost, 127.0.0.1), the edges' CA and
    one edge's certificate, and a rogue CA's edge certificate. Keys: server_ca, client_ca, rogue_ca, and
    {server,client,rogue}_{cert,key}."""
    import trustme

    server_ca, client_ca, rogue_ca = trustme.CA(), trustme.CA(), trustme.CA()
    leaves = {
        "server": server_ca.issue_cert("localhost", "127.0.0.1"),
        "client": client_ca.issue_cert("edge-alice"),
        "rogue": rogue_ca.issue_cert("edge-alice"),
    }
    files = {}
    for name, ca in [("server_ca", server_ca), ("client_ca", client_ca), ("rogue_ca", rogue_ca)]:
        files[name] = str(folder / f"{name}.pem")
        ca.cert_pem.write_to_path(files[name])
    for name, leaf in leaves.items():
        files[f"{name}_cert"], files[f"{name}_key"] = str(folder / f"{name}.crt"), str(folder / f"{name}.key")
        with open(files[f"{name}_cert"], "wb") as chain:
            chain.write(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(files[f"{name}_key"])
    return files


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
    server = os.path.join(os.path.dirname(sys.executable), "specedge-server")
    # Port 0 unless the caller needs a known one: a port picked here and bound later by the server could be taken
    # meanwhile (tensor-parallel ranks open their own sockets first).
    command = [*launcher, server, *args, "--port", str(port or 0)]
    process = subprocess.Popen(dying_with_parent(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = re.compile(rf"specedge-server ready on (127\.0\.0\.1:{port or '[0-9]+'})")
    lines: list[str] = output if output is not None else []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        for line in list(lines):
            if found := ready.fullmatch(line.strip()):
                return process, found.group(1)
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("specedge-server did not become ready:\n" + "".join(lines[-20:]))


class FlakyLink:
    """`with FlakyLink("127.0.0.1:P") as link:` forwards TCP from link.address to that address, byte for byte, until
    `link.flap(seconds)` drops it as a flaky network does: every connection through it is reset, both ways, and for
    `seconds` nothing answers on its port (a connect is refused); then it forwards again. `link.stall(seconds)`
    instead holds every byte in flight for that long, as a link that loses packets until TCP's retransmissions get
    through: the connections survive. `link.sever()` loses every byte of the connections open then, for good, and
    tells neither end, while new connections go through. The server behind it stays up, with whatever sessions it
    held."""

    def __init__(self, target: str):
        self.host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.port = free_port()
        self.flaps = 0
        self._loop = asyncio.new_event_loop()
        self._listener: asyncio.AbstractServer | None = None
        self._transports: set[asyncio.BaseTransport] = set()
        self._flowing: asyncio.Event | None = None  # made on the link's own loop
        self._dead: set[asyncio.BaseTransport] = set()  # connections whose bytes vanish (`sever`)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _listen(self) -> None:
        if self._flowing is None:
            self._flowing = asyncio.Event()
            self._flowing.set()
        self._listener = await asyncio.start_server(self._forward, "127.0.0.1", self.port, reuse_address=True)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._transports |= {writer.transport, upstream_writer.transport}

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    assert self._flowing is not None
                    await self._flowing.wait()
                    if sink.transport in self._dead:
                        continue  # lost on the way: neither end hears of it
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                if sink.transport not in self._dead:  # a dead path loses the news of a close too
                    sink.transport.abort()  # one side gone: so is the other, at once
                self._transports.discard(sink.transport)

        await asyncio.gather(pump(reader, upstream_writer), pump(upstream_reader, writer))

    async def _flap(self, seconds: float) -> None:
        assert self._listener is not None
        self._listener.close()
        for transport in list(self._transports):
            transport.abort()  # a reset, not a goodbye: neither end learns more than that the link broke
        self._transports.clear()
        await asyncio.sleep(seconds)
        await self._listen()
        self.flaps += 1

    def flap(self, seconds: float) -> None:
        """Drop the link for `seconds`; returns once it forwards again."""
        asyncio.run_coroutine_threadsafe(self._flap(seconds), self._loop).result(timeout=seconds + 30)

    async def _stall(self, seconds: float) -> None:
        assert self._flowing is not None
        self._flowing.clear()
        await asyncio.sleep(seconds)
        self._flowing.set()
        self.flaps += 1

    def stall(self, seconds: float) -> None:
        """Hold every byte for `seconds`, the connections kept; returns once bytes flow again."""
        asyncio.run_coroutine_threadsafe(self._stall(seconds), self._loop).result(timeout=seconds + 30)

    async def _sever(self) -> None:
        self._dead |= self._transports
        self.flaps += 1

    def sever(self) -> None:
        """Lose every byte of every connection open now, for good, telling neither end, while new connections work:
        a network path that died under its connections (a NAT that forgot them, a laptop that moved networks)."""
        asyncio.run_coroutine_threadsafe(self._sever(), self._loop).result(timeout=30)

    def __enter__(self) -> FlakyLink:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc_info) -> None:
        async def close() -> None:
            if self._listener is not None:
                self._listener.close()
            for transport in list(self._transports):
                transport.abort()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


class ApiThread:
    """`with ApiThread(runtime_config, serve_config) as api:` runs `specedge-edge serve`'s server on api.base_url."""

    def __init__(self, runtime_config, serve_config):
        import io

        from specedge.edge_client.openai_api import EdgeAPIServer

        self.err = io.StringIO()  # its status lines
        self.server = EdgeAPIServer(runtime_config, serve_config, err=self.err)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self.server.run())
        except BaseException as exc:  # noqa: BLE001 (reported by __exit__ and the tests)
            self.error = exc

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def __enter__(self) -> ApiThread:
        self._thread.start()
        deadline = time.monotonic() + 120
        while not self.server.http.started:  # listening
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server did not start: {self.error!r}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.stop()
        self._thread.join(timeout=30)


def health(base_url: str) -> tuple[int, dict]:
    """GET /health of an API server: (status, body)."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_healthy(base_url: str, timeout_s: float = 60, process: subprocess.Popen | None = None) -> dict:
    """Poll /health until 200 (connected, draft loaded); its body."""
    deadline = time.monotonic() + timeout_s
    reply: tuple | Exception = (0, {})
    while time.monotonic() < deadline and (process is None or process.poll() is None):
        try:
            reply = health(base_url)
        except (urllib.error.URLError, OSError) as exc:  # not listening yet, or too busy to answer in time
            reply = exc
        if isinstance(reply, tuple) and reply[0] == 200:
            return reply[1]
        time.sleep(0.05)
    raise TimeoutError(f"{base_url} did not become healthy: {reply}")


class ApiProcess:
    """`specedge-edge serve ARGS --port P` run as a user would; __init__ returns once /health says 200."""

    def __init__(self, *args: str, timeout_s: float = 600):
        port = free_port()
        command = [os.path.join(os.path.dirname(sys.executable), "specedge-edge"), "serve", *args, "--port", str(port)]
        self.process = subprocess.Popen(dying_with_parent(command), stderr=subprocess.PIPE, text=True)
        self.stderr_lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.stderr_lines.extend(iter(self.process.stderr.readline, "")))
        self._reader.start()
        self.base_url = f"http://127.0.0.1:{port}"
        try:
            self.health = wait_healthy(self.base_url, timeout_s, self.process)
        except TimeoutError:
            self.stop(signal.SIGKILL)
            last_lines = "".join(self.stderr_lines[-20:])
            raise RuntimeError(f"specedge-edge serve did not become ready:\n{last_lines}") from None

    def stop(self, sig: int = signal.SIGINT) -> int:
        """Send `sig`; the exit status, once all of stderr is read."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=180)  # a loaded CI machine shuts uvicorn and gRPC down slowly
        finally:
            self.process.kill()  # a no-op once it has exited
            self._reader.join(timeout=10)
