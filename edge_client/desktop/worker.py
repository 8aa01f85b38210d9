"""The edge runtime on its own thread: an asyncio loop that the window talks to, and that talks back by signals.

The window calls the public methods (from the UI thread); each hands a
coroutine to the loop and returns at once, so the UI never waits on the
network or the draft model. Everything the loop learns comes back as a Qt
signal, delivered to the window's slots on the UI thread.

The connection is one long-running task:

    prepare the draft model (a built-in is assembled once, with progress) and its tokenizer
    loop: connect -> (first time) load the drafter -> connected -> watch until the server is lost
          offline: retry with backoff (Reconnect retries at once)
          incompatible or refused (token, TLS): wait for Reconnect or new settings
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal

from specedge.edge_client.client import ConnectionConfig, ConnectionLost, EdgeError
from specedge.edge_client.desktop import connection_words as words
from specedge.edge_client.desktop import stats as figures
from specedge.edge_client.desktop.settings import ChatSettings
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.results import Conversation, GenerationStats
from specedge.edge_client.runtime import EdgeRuntime
from specedge.edge_client.text import IncrementalText
from specedge.fleet.broker import FleetError
from specedge.registry import RegistryError, resolve

log = logging.getLogger(__name__)


class State(enum.StrEnum):
    PREPARING = "preparing"  # assembling or loading the draft model
    CONNECTING = "connecting"
    CONNECTED = "connected"
    INCOMPATIBLE = "incompatible"  # the handshake refused the draft model
    REFUSED = "refused"  # the server refused us: the access token, or the TLS settings
    OFFLINE = "offline"  # the server cannot be reached; retrying
    ERROR = "error"  # the settings cannot work (unknown model, unreadable file)


# Ways an answer ends; the window maps them to a stored status.
DONE, STOPPED, INTERRUPTED, FAILED = "done", "stopped", "interrupted", "failed"


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    policy: SpeculationPolicy = SpeculationPolicy(slow_draft_fallback=True)  # drafting options (settings add sampling)
    connection: ConnectionConfig = ConnectionConfig(reconnect_timeout_s=10.0)  # settings add TLS and the token
    retry_initial_s: float = 1.0  # first wait before reconnecting to a server that went away
    retry_max_s: float = 15.0  # backoff cap
    watch_interval_s: float = 3.0  # how often an idle connection checks the server is still there
    threads: int | None = None  # CPU threads for the draft model
    resolver: Callable = resolve  # model string -> ResolvedModel (tests pass a fake built-in)

    def __post_init__(self):
        if not 0 < self.retry_initial_s <= self.retry_max_s:
            raise ValueError("retry delays must satisfy 0 < retry_initial_s <= retry_max_s")
        if self.watch_interval_s <= 0:
            raise ValueError(f"watch_interval_s must be > 0, got {self.watch_interval_s}")


class WorkerSignals(QObject):
    state = Signal(str, str)  # State value, detail: the server's model name or a plain-words message
    progress = Signal(str, object, object)  # what is being prepared, bytes done, bytes total
    delta = Signal(int, str, object)  # answer id, new text, live figures (stats.live)
    # answer id, DONE/STOPPED/INTERRUPTED/FAILED, figures, message, the answer's text decoded whole
    # (streamed pieces hold back an unfinished character; the whole decode is what is kept)
    finished = Signal(int, str, object, str, str)


class EdgeWorker:
    def __init__(self, config: WorkerConfig = WorkerConfig()):
        self.config = config
        self.signals = WorkerSignals()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="specedge-chat-edge", daemon=True)
        self._thread.start()
        # Touched only on the loop's thread:
        self._runtime: EdgeRuntime | None = None
        self._connection: asyncio.Task | None = None
        self._settings: ChatSettings | None = None
        self._answer: asyncio.Task | None = None
        # Made anew for each connection (_start_connection), so that none wakes a later one's waiters.
        self._retry_now = asyncio.Event()
        self._lost = asyncio.Event()  # an answer found the server gone
        self._conversation: tuple[int, Conversation] | None = None  # the chat whose server session is kept

    # -- called from the UI thread -----------------------------------------

    def connect(self, settings: ChatSettings) -> None:
        """(Re)start the connection with these settings; an answer in progress is stopped."""
        self._loop.call_soon_threadsafe(self._start_connection, settings)

    def reconnect(self) -> None:
        """Retry now: wakes an offline backoff, or starts over after an error."""
        self._loop.call_soon_threadsafe(self._reconnect_now)

    def ask(self, answer_id: int, conversation_id: int, messages: list[dict], policy: SpeculationPolicy) -> None:
        self._loop.call_soon_threadsafe(self._start_answer, answer_id, conversation_id, messages, policy)

    def stop(self) -> None:
        """Cancel the answer; the generation closes its server session (frees the slot) on the way out."""
        self._loop.call_soon_threadsafe(lambda: self._answer and self._answer.cancel())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=timeout_s)
        except Exception:  # closing is best effort: the server's lease frees our slots anyway
            log.warning("edge worker did not close cleanly", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout_s)

    # -- on the loop -------------------------------------------------------

    def _emit_state(self, state: State, detail: str = "") -> None:
        self.signals.state.emit(state.value, detail)

    def _start_connection(self, settings: ChatSettings) -> None:
        self._settings = settings
        self._retry_now, self._lost = asyncio.Event(), asyncio.Event()
        self._connection = self._loop.create_task(self._connect(settings, previous=self._connection))

    def _reconnect_now(self) -> None:
        if self._connection is None or self._connection.done():
            if self._settings is not None:
                self._start_connection(self._settings)
        else:
            self._retry_now.set()

    async def _close(self) -> None:
        for task in (self._answer, self._connection):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self._drop_runtime()

    async def _drop_runtime(self) -> None:
        runtime, self._runtime, self._conversation = self._runtime, None, None
        if runtime is not None:
            await runtime.close()

    async def _connect(self, settings: ChatSettings, previous: asyncio.Task | None) -> None:
        for task in (self._answer, previous):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self._drop_runtime()
        try:
            runtime = await self._prepare(settings)
            await self._stay_connected(runtime, settings)
        except asyncio.CancelledError:
            raise
        except (RegistryError, EdgeError, FleetError, ValueError, OSError) as exc:
            self._emit_state(State.ERROR, str(exc))
        except Exception as exc:  # whatever it was, the window says so in one line, and the log keeps the rest
            log.exception("edge runtime failed")
            self._emit_state(State.ERROR, f"the edge could not start ({type(exc).__name__}: {exc})")

    async def _prepare(self, settings: ChatSettings) -> EdgeRuntime:
        """Resolve the draft model (assembling a built-in with progress) and load its tokenizer."""
        self._emit_state(State.PREPARING, f"preparing the draft model {settings.draft}")
        last = [0.0]

        def on_progress(done: int, total: int) -> None:  # on the resolver's thread
            now = time.monotonic()
            if now - last[0] > 0.05 or done >= total:  # a redraw per 50 ms is plenty
                last[0] = now
                self.signals.progress.emit(settings.draft, done, total)

        resolved = await asyncio.to_thread(self.config.resolver, settings.draft, on_progress=on_progress)
        # The draft is resolved once, here; a path resolves to itself in the runtime.
        policy, connection = self.config.policy, self.config.connection
        runtime = EdgeRuntime(settings.runtime_config(str(resolved.path), policy, connection, self.config.threads))
        self._runtime = runtime
        await runtime.load_tokenizer()
        return runtime

    async def _stay_connected(self, runtime: EdgeRuntime, settings: ChatSettings) -> None:
        backoff = self.config.retry_initial_s
        drafters_loaded = False
        while True:
            self._emit_state(State.CONNECTING, words.connecting(settings))
            try:
                if not runtime.has_client:
                    await runtime.connect(retry_for_s=0.0)  # one attempt; the backoff is ours
                else:
                    await runtime.client.connect()
            except EdgeError as exc:
                refused = words.refusal(exc, settings)  # the token or TLS settings: for the user to fix
                if isinstance(exc, ConnectionLost) and refused is None:  # not there (yet)
                    self._emit_state(State.OFFLINE, f"{exc} Retrying in {backoff:g} s.")
                    await self._wait_for_retry(backoff)
                    backoff = min(backoff * 2, self.config.retry_max_s)
                    continue
                # The server answered no: wait for Reconnect (or new settings).
                incompatible = exc.status in (None, "FAILED_PRECONDITION")  # tokenizers differ
                state = State.REFUSED if refused else State.INCOMPATIBLE if incompatible else State.ERROR
                self._emit_state(state, refused or str(exc))
                await self._wait_for_retry(None)
                continue
            backoff = self.config.retry_initial_s
            if not drafters_loaded:
                if not runtime.config.server_only:
                    self._emit_state(State.PREPARING, "loading the draft model")
                await runtime.load_drafters()
                drafters_loaded = True
            self._emit_state(State.CONNECTED, words.connected(runtime))
            await self._watch(runtime)
            self._conversation = None  # its server session went with the server

    async def _wait_for_retry(self, delay_s: float | None) -> None:
        self._retry_now.clear()
        try:
            await asyncio.wait_for(self._retry_now.wait(), delay_s)
        except TimeoutError:
            pass

    async def _watch(self, runtime: EdgeRuntime) -> None:
        """Return once the server is gone or refuses us: an answer lost it, or an idle check found out."""
        self._lost.clear()
        shown = runtime.client.address
        while True:
            try:
                await asyncio.wait_for(self._lost.wait(), self.config.watch_interval_s)
                return
            except TimeoutError:
                pass
            if runtime.client.address != shown:  # the fleet moved an answer to another server
                shown = runtime.client.address
                self._emit_state(State.CONNECTED, words.connected(runtime))
            if self._answer is not None and not self._answer.done():
                continue  # a running answer notices a lost server by itself (and resumes if it can)
            try:
                await runtime.client.handshake()
            except EdgeError:  # gone, or refusing us now (a revoked token): the next connect says which
                return

    def _start_answer(
        self, answer_id: int, conversation_id: int, messages: list[dict], policy: SpeculationPolicy
    ) -> None:
        if self._answer is not None and not self._answer.done():
            self.signals.finished.emit(answer_id, FAILED, None, "an answer is already being written", "")
            return
        self._answer = self._loop.create_task(self._generate(answer_id, conversation_id, messages, policy))

    async def _generate(
        self, answer_id: int, conversation_id: int, messages: list[dict], policy: SpeculationPolicy
    ) -> None:
        runtime, settings = self._runtime, self._settings
        if runtime is None or settings is None or not runtime.has_client or runtime.client.server_info is None:
            self.signals.finished.emit(answer_id, FAILED, None, "not connected to a server yet", "")
            return
        conversation = await self._conversation_for(runtime, conversation_id)
        live = GenerationStats()  # filled in by the generation as it goes
        tokenizer = runtime.tokenizer
        eos = set(tokenizer.eos_token_ids)
        text = IncrementalText(tokenizer, eos)
        started, tokens, samples = time.perf_counter(), [], []

        def on_tokens(token_ids) -> None:
            tokens.extend(token_ids)
            elapsed = time.perf_counter() - started
            samples.append((elapsed, len(tokens)))
            self.signals.delta.emit(answer_id, text.feed(token_ids), figures.live(live, len(tokens), elapsed))

        def end(outcome: str, message: str = "") -> None:
            data = figures.final(live, len(tokens), time.perf_counter() - started, samples)
            whole = tokenizer.decode([t for t in tokens if t not in eos])
            self.signals.finished.emit(answer_id, outcome, data, message, whole)

        try:
            prompt = runtime.chat_prompt(messages, conversation)
            await runtime.generate(prompt, on_tokens, conversation=conversation, policy=policy, stats=live)
            end(DONE)
        except asyncio.CancelledError:
            end(STOPPED)
        except ConnectionLost as exc:
            end(INTERRUPTED, f"The server went away mid-answer: {exc}")
            self._lost.set()
        except EdgeError as exc:
            end(INTERRUPTED if tokens else FAILED, words.refusal(exc, settings) or str(exc))
        except Exception as exc:  # one line in the window; the traceback goes to the log only
            log.exception("answer %d failed", answer_id)
            end(INTERRUPTED if tokens else FAILED, f"The answer failed ({type(exc).__name__}: {exc})")

    async def _conversation_for(self, runtime: EdgeRuntime, conversation_id: int) -> Conversation:
        """The chat's kept server session; another chat's is closed first (each holds a server slot)."""
        if self._conversation is not None and self._conversation[0] == conversation_id:
            return self._conversation[1]
        if self._conversation is not None and self._conversation[1].session_id is not None:
            await runtime.client.close_session(self._conversation[1].session_id)
        self._conversation = (conversation_id, Conversation())
        return self._conversation[1]
