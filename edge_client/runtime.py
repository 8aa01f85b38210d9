"""What every edge front end shares (terminal chat, OpenAI-compatible API, desktop app).

An `EdgeRuntime` owns the tokenizer, one connection to the server and a small
pool of drafters. Each answer borrows a drafter for its whole length (a
drafter's KV cache follows one context at a time); answers beyond the pool
wait for one. A draft model that cannot be loaded leaves the runtime working
server-only, and every answer's stats say so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specedge.edge_client.client import ConnectionConfig, ConnectionLost, EdgeClient
from specedge.edge_client.generation import TokenCallback, generate
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.results import Conversation, GenerationResult, GenerationStats

if TYPE_CHECKING:
    from specedge.edge_client.tokenizer import EdgeTokenizer
    from specedge.fleet.discovery import DiscoveryConfig, FleetRouter

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    server: str | None  # HOST:PORT of specedge-server; with discovery, the fallback (None: no fallback)
    draft: str  # built-in name, .gguf file or HF directory: the tokenizer, and the drafter unless server_only
    policy: SpeculationPolicy = SpeculationPolicy()  # each answer's, unless it brings its own
    connection: ConnectionConfig = ConnectionConfig()  # timeouts, TLS and the token, an emulated network
    server_only: bool = False  # no draft model: the server generates alone
    threads: int | None = None  # CPU threads per drafter (llama.cpp)
    num_drafters: int = 1  # answers that draft at the same time; more wait for a free drafter
    # Choose the server through a fleet broker (specedge.fleet.discovery.DiscoveryConfig), and move
    # answers off a server that drains or goes offline.
    discovery: DiscoveryConfig | None = None

    def __post_init__(self):
        if self.num_drafters < 1:
            raise ValueError(f"num_drafters must be >= 1, got {self.num_drafters}")
        if self.server is None and self.discovery is None:
            raise ValueError("give a server address, or a fleet broker to discover one")


class EdgeRuntime:
    def __init__(self, config: RuntimeConfig):
        self.config = config
        self._tokenizer: EdgeTokenizer | None = None  # load_tokenizer()
        self._client: EdgeClient | None = None  # connect()
        self.router: FleetRouter | None = None  # with discovery
        self.draft_unavailable: str | None = None  # why answers run server-only, when the draft model failed
        self._drafters: asyncio.Queue = asyncio.Queue()
        self._all_drafters: list = []
        self.connected = asyncio.Event()

    @property
    def tokenizer(self) -> EdgeTokenizer:
        if self._tokenizer is None:
            raise RuntimeError("EdgeRuntime.load_tokenizer() (or start()) comes first")
        return self._tokenizer

    @property
    def client(self) -> EdgeClient:
        if self._client is None:
            raise RuntimeError("EdgeRuntime.connect() (or start()) comes first")
        return self._client

    @property
    def has_client(self) -> bool:
        """Whether connect() has made the client (connected or not since)."""
        return self._client is not None

    async def load_tokenizer(self) -> EdgeTokenizer:
        from specedge.edge_client.tokenizer import load_tokenizer
        from specedge.registry import resolve

        self._resolved = await asyncio.to_thread(resolve, self.config.draft)
        self._tokenizer = await asyncio.to_thread(load_tokenizer, self._resolved)
        return self._tokenizer

    async def connect(self, retry_for_s: float | None = 0.0) -> None:
        """Handshake with the server; keep retrying with backoff for `retry_for_s` (None: forever)."""
        tokenizer = self._tokenizer or await self.load_tokenizer()
        if self._client is not None:  # a failed earlier attempt: close its channel before opening another
            await self._client.__aexit__(None, None, None)
        choose = None
        if self.config.discovery is not None:
            from specedge.fleet.discovery import FleetRouter

            if self.router is None:
                self.router = FleetRouter(self.config.discovery, tokenizer.fingerprint, fallback=self.config.server)
                await self.router.start()
            choose = self.router.choose_address
        address, connection = self.config.server or "", self.config.connection
        client = self._client = EdgeClient(address, tokenizer.fingerprint, config=connection, choose_address=choose)
        if self.router is not None:
            self.router.follow(client)
        while True:
            try:
                await client.reconnect(timeout_s=retry_for_s if retry_for_s is not None else 60.0)
                break
            except ConnectionLost as exc:
                if retry_for_s is not None:
                    raise
                log.warning("%s; still retrying", exc)
        self.connected.set()

    async def load_drafters(self) -> None:
        """Load the draft model(s); on failure, note why and carry on server-only."""
        if self.config.server_only:
            return
        from specedge.edge_client.drafting import load_drafter

        options = {"n_threads": self.config.threads} if self.config.threads else {}
        try:
            for _ in range(self.config.num_drafters):
                drafter = await asyncio.to_thread(load_drafter, self._resolved, **options)
                self._all_drafters.append(drafter)
                self._drafters.put_nowait(drafter)
        except Exception as exc:  # a missing or broken draft model must not stop the answers
            self.draft_unavailable = f"draft model unavailable ({type(exc).__name__}: {exc})"
            log.warning("%s; generating server-only", self.draft_unavailable)

    async def start(self, retry_for_s: float | None = 0.0) -> EdgeRuntime:
        await self.connect(retry_for_s)  # first: an unreachable server is reported before a model load
        await self.load_drafters()
        return self

    async def close(self) -> None:
        if self._client is not None:
            await self._client.__aexit__(None, None, None)
        if self.router is not None:
            await self.router.close()
        for drafter in self._all_drafters:
            drafter.close()
        self._all_drafters.clear()

    @property
    def model_name(self) -> str:
        return self._client.server_info.model_name if self._client and self._client.server_info else ""

    def chat_prompt(self, messages: list[dict[str, str]], conversation: Conversation | None = None) -> list[int]:
        """Prompt ids for `messages`, ending with the assistant's turn opener.

        With a conversation, its tokens (earlier answers exactly as they were
        generated) are kept and only the new turn's text is tokenized, so the
        server and the drafter reuse all their KV. Re-tokenizing an answer's
        text can split it differently from how it was generated, which would
        cut the reuse short there.
        """
        full = self.tokenizer.apply_chat_template(messages)
        if conversation is None or not conversation.tokens:
            return full
        full_text, held_text = self.tokenizer.decode(full), self.tokenizer.decode(conversation.tokens)
        if not full_text.startswith(held_text):
            return full  # the template rewrites history (e.g. strips it): the common prefix is still reused
        new_text = full_text[len(held_text) :]
        new_ids = self.tokenizer.encode(new_text)
        bos = self.tokenizer.fingerprint.bos_token_id
        if new_ids and bos is not None and new_ids[0] == bos and not new_text.startswith(self.tokenizer.decode([bos])):
            new_ids = new_ids[1:]  # encode() added a BOS that belongs only at the start of a conversation
        return [*conversation.tokens, *new_ids]

    async def generate(
        self,
        prompt: Sequence[int],
        on_tokens: TokenCallback = lambda tokens: None,
        *,
        conversation: Conversation | None = None,
        policy: SpeculationPolicy | None = None,
        stats: GenerationStats | None = None,
    ) -> GenerationResult:
        """One answer, by `policy` (default: the runtime's); `stats`, when given, is filled in as it goes
        (live figures for a UI)."""
        policy = policy or self.config.policy
        await self.client.ensure_connected()  # the server was left (draining, offline): start elsewhere
        if not self._all_drafters:
            result = await generate(
                self.client, prompt, None, on_tokens, policy=policy, conversation=conversation, stats=stats
            )
            if self.draft_unavailable and not self.config.server_only:
                result.stats.fallback = self.draft_unavailable
        else:
            drafter = await self._drafters.get()
            try:
                result = await generate(
                    self.client, prompt, drafter, on_tokens, policy=policy, conversation=conversation, stats=stats
                )
            finally:
                self._drafters.put_nowait(drafter)
        if self.router is not None:
            self.router.observe(result.stats)
        return result
