"""The server engine: sessions in, batched forwards out, one step at a time.

`step()` reads schedule -> run -> postprocess. The asyncio side (RPC
handlers) validates a request, queues one work item per session and awaits
its future; a single engine thread runs every forward, so the KV cache has
exactly one writer. Work from any number of sessions shares a forward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence

from specedge.scheduler import Batcher, BatcherConfig, NoFreeSlot, SlotAllocator, WorkItem
from specedge.server import errors, tree
from specedge.server.loading import Target
from specedge.server.runner import ForwardRequest, ModelRunner
from specedge.server.sampling import sample
from specedge.server.session import Session
from specedge.types import FinishReason, SamplingParams
from specedge.server.verify import verify_by_sampling

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_sessions: int = 8  # KV slots; one per open session or server-only stream
    max_context: int = 4096  # tokens per slot: prompt + generated
    max_draft_tokens: int = 64  # draft nodes per verify round
    idle_timeout_s: float = 600.0  # sessions untouched this long are closed and their slot freed
    batcher: BatcherConfig = BatcherConfig()

    def __post_init__(self):
        if self.max_sessions < 1 or self.max_context < 2 or self.max_draft_tokens < 0 or self.idle_timeout_s <= 0:
            raise ValueError(f"invalid engine config: {self}")


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    accepted_nodes: tuple[int, ...]
    token_ids: list[int]  # committed this round, cut at a stop
    finish: FinishReason
    num_generated: int


@dataclasses.dataclass(eq=False)
class _Work:
    session: Session
    request: ForwardRequest
    future: asyncio.Future
    draft_token_ids: tuple[int, ...] = ()
    draft_parents: tuple[int, ...] = ()

    @property
    def is_prefill(self) -> bool:
        return self.request.num_cached == 0


class Engine:
    def __init__(self, runner: ModelRunner, target: Target, config: EngineConfig):
        self.runner = runner
        self.target = target
        self.config = config
        self.vocab_size = target.model.args.vocab_size
        self.sessions: dict[str, Session] = {}
        self.slots = SlotAllocator(config.max_sessions)
        self.batcher: Batcher[_Work] = Batcher(config.batcher)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specedge-engine")
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.num_forwards = 0

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop()), asyncio.create_task(self._reap_idle())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # -- RPC-facing API ------------------------------------------------------

    async def open_session(
        self, owner: str, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams, seed: int | None
    ) -> tuple[Session, RoundOutcome]:
        self._check_token_ids(prompt, "prompt")
        if not prompt:
            raise errors.InvalidArgument("prompt is empty: send at least one token id")
        if len(prompt) >= self.config.max_context:
            raise errors.InvalidArgument(
                f"prompt of {len(prompt)} tokens leaves no room to generate within the server's "
                f"max context of {self.config.max_context} tokens"
            )
        try:
            slot = self.slots.acquire()
        except NoFreeSlot as exc:
            raise errors.ResourceExhausted(f"{exc}; retry later or ask the operator for more --max-sessions") from None
        session = Session(
            id=secrets.token_urlsafe(18),
            owner=owner,
            slot=slot,
            prompt_len=len(prompt),
            max_new_tokens=max_new_tokens or self.config.max_context - len(prompt),
            max_context=self.config.max_context,
            sampling=sampling,
            seed=secrets.randbits(63) if seed is None else seed,
            eos_token_ids=self.target.eos_token_ids,
        )
        self.sessions[session.id] = session
        request = ForwardRequest(slot, 0, tuple(prompt), all_logits=False)
        try:
            outcome = await self._submit(_Work(session, request, asyncio.get_running_loop().create_future()))
        except BaseException:
            self.close_session(owner, session.id)
            raise
        return session, outcome

    async def verify(
        self,
        owner: str,
        session_id: str,
        draft_token_ids: Sequence[int],
        draft_parents: Sequence[int],
        num_generated: int,
    ) -> RoundOutcome:
        session = self._owned(owner, session_id)
        if session.finish is not FinishReason.NONE:
            raise errors.FailedPrecondition(f"session already finished ({session.finish.name.lower()}); open a new one")
        if session.busy:
            raise errors.FailedPrecondition("a verify round for this session is already in flight; wait for its reply")
        if num_generated != len(session.generated):
            raise errors.FailedPrecondition(
                f"edge is out of sync: it has {num_generated} generated tokens, the server {len(session.generated)}; "
                "reopen the session"
            )
        if len(draft_token_ids) > self.config.max_draft_tokens:
            raise errors.InvalidArgument(
                f"draft of {len(draft_token_ids)} tokens exceeds the server's max_draft_tokens {self.config.max_draft_tokens}"
            )
        self._check_token_ids(draft_token_ids, "draft")
        parents = tuple(draft_parents) or tree.chain_parents(len(draft_token_ids) + 1)
        if len(parents) != len(draft_token_ids):
            raise errors.InvalidArgument(
                f"{len(draft_parents)} draft parents for {len(draft_token_ids)} draft tokens; send one per token or none"
            )
        if problem := tree.validate_parents(parents):
            raise errors.InvalidArgument(problem)
        # Nodes beyond the slot's remaining room are dropped; children come after
        # their parents, so what is left is still a tree.
        room = session.draft_room
        drafts, parents = tuple(draft_token_ids[:room]), parents[:room]
        is_chain = parents == tree.chain_parents(len(drafts) + 1)
        request = ForwardRequest(
            session.slot,
            session.num_cached,
            (session.pending_token, *drafts),
            tree_parents=None if is_chain else parents,
        )
        work = _Work(session, request, asyncio.get_running_loop().create_future(), drafts, parents)
        return await self._submit(work)

    def close_session(self, owner: str, session_id: str) -> None:
        session = self._owned(owner, session_id)
        del self.sessions[session_id]
        self.slots.release(session.slot)

    async def generate(
        self, owner: str, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams, seed: int | None
    ) -> AsyncIterator[RoundOutcome]:
        """Target-only decoding: a session whose rounds carry no drafts."""
        session, outcome = await self.open_session(owner, prompt, max_new_tokens, sampling, seed)
        try:
            yield outcome
            while outcome.finish is FinishReason.NONE:
                outcome = await self.verify(owner, session.id, (), (), len(session.generated))
                yield outcome
        finally:
            if session.id in self.sessions:
                self.close_session(owner, session.id)

    # -- internals -----------------------------------------------------------

    def _owned(self, owner: str, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise errors.NotFound("unknown session (never opened, closed, or expired after idling); open a new one")
        if session.owner != owner:
            raise errors.PermissionDenied("this session belongs to another connection")
        return session

    def _check_token_ids(self, token_ids: Sequence[int], what: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise errors.InvalidArgument(f"{what} token id {bad} is out of range for vocab size {self.vocab_size}")

    async def _submit(self, work: _Work) -> RoundOutcome:
        work.session.busy = True
        self.batcher.submit(WorkItem(len(work.request.token_ids), work))
        self._wakeup.set()
        try:
            return await work.future
        finally:
            work.session.busy = False
            work.session.last_used = time.monotonic()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while batch := [item.payload for item in self.batcher.take_batch()]:
                # Work whose caller gave up, or whose session was closed meanwhile, must
                # not run: its slot may already belong to someone else.
                for work in batch:
                    if not work.future.done() and self.sessions.get(work.session.id) is not work.session:
                        work.future.set_exception(errors.NotFound("session was closed while its round was queued"))
                batch = [w for w in batch if not w.future.done()]
                if not batch:
                    continue
                try:
                    outcomes = await loop.run_in_executor(self._executor, self.step, batch)
                except Exception as exc:  # the forward itself failed: every row fails alike
                    log.exception("batched forward failed")
                    outcomes = [exc] * len(batch)
                for work, outcome in zip(batch, outcomes):
                    if work.future.done():
                        continue
                    if isinstance(outcome, Exception):
                        work.future.set_exception(outcome)
                    else:
                        work.future.set_result(outcome)

    def step(self, batch: list[_Work]) -> list[RoundOutcome | Exception]:
        """One batched forward, then each row's verification and commit. Engine thread only."""
        logits = self.runner.forward([w.request for w in batch])
        self.num_forwards += 1
        outcomes: list[RoundOutcome | Exception] = []
        for work, row_logits in zip(batch, logits):
            try:
                outcomes.append(self._postprocess(work, row_logits))
            except Exception as exc:
                log.exception("postprocessing session %s failed", work.session.id[:8])
                outcomes.append(exc)
        return outcomes

    def _postprocess(self, work: _Work, logits) -> RoundOutcome:
        session = work.session
        if work.is_prefill:
            [first] = sample(logits, [session.prompt_len], session.sampling, session.seed)
            kept = session.commit([first], num_new_cached=session.prompt_len)
            return RoundOutcome((), kept, session.finish, len(session.generated))
        # The pending token sits at sequence index num_context - 1; the sample
        # after a node of depth d lands at num_context + d.
        depths = tree.depths(work.draft_parents)
        samples = sample(logits, [session.num_context + d for d in depths], session.sampling, session.seed)
        result = verify_by_sampling(work.draft_token_ids, work.draft_parents, samples)
        self._compact_path(session, result.accepted_nodes)
        tokens = [work.draft_token_ids[node - 1] for node in result.accepted_nodes] + [result.next_token]
        kept = session.commit(tokens, num_new_cached=1 + len(result.accepted_nodes))
        # Report only drafts that were committed (a stop or the length limit may cut the path).
        return RoundOutcome(result.accepted_nodes[: len(kept)], kept, session.finish, len(session.generated))

    def _compact_path(self, session: Session, accepted_nodes: tuple[int, ...]) -> None:
        """Make the accepted path's KV contiguous after the pending token (a no-op for chains)."""
        wanted = tuple(range(1, len(accepted_nodes) + 1))
        if accepted_nodes != wanted:
            base = session.num_cached
            self.runner.kv.move(session.slot, [base + n for n in accepted_nodes], [base + n for n in wanted])

    async def _reap_idle(self) -> None:
        period = min(30.0, self.config.idle_timeout_s / 2)
        while True:
            await asyncio.sleep(period)
            deadline = time.monotonic() - self.config.idle_timeout_s
            for session in [s for s in self.sessions.values() if not s.busy and s.last_used < deadline]:
                log.info("closing session %s after %.0f s idle", session.id[:8], self.config.idle_timeout_s)
                self.close_session(session.owner, session.id)
