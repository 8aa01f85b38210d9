"""The server engine: sessions in, batched forwards out, one step at a time.

`step()` reads schedule -> run -> postprocess. The asyncio side (RPC
handlers) validates a request, queues the session's work and awaits its
future; the batcher (pure Python) plans each step from whatever is queued,
and a single engine thread runs every forward, so the KV cache has exactly
one writer. A round that arrives while a forward runs joins the next one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator

import torch

from specedge.scheduler import Batcher, BatcherConfig, NoFreeSlot, PrefillChunk, SlotAllocator, StepPlan
from specedge.scheduler.speculation import SessionSpeculation, SpeculationConfig, StepCostModel
from specedge.server import errors, tree
from specedge.server.auth import Caller
from specedge.server.isolation import failure_for_client, run_isolated
from specedge.server.loading import Target
from specedge.server.requests import DraftRound, RequestLimits, SessionRequest, TurnRequest
from specedge.server.draws import RowDraw, draw_rows
from specedge.server.postprocess import after_prefill, after_round, prefill_draw, round_draw
from specedge.server.runner import ForwardRequest, KVMove, Runner
from specedge.server.server_draft import DraftRow, ServerDrafter
from specedge.server.session import Session
from specedge.server.stats import ServerStats
from specedge.types import FinishReason, SparseDist

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0  # hint given with RESOURCE_EXHAUSTED


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_sessions: int = 8  # KV slots; one per open session or server-only stream
    max_context: int = 4096  # tokens per slot: prompt + generated
    max_draft_tokens: int = 64  # draft nodes per verify round
    max_draft_prob_tokens: int = 256  # entries per draft distribution (the edge's top-k q)
    max_prompt_tokens: int | None = None  # None: max_context - 1
    max_sessions_per_identity: int | None = None  # None: max_sessions
    idle_timeout_s: float = 600.0  # sessions untouched this long are closed and their slot freed
    batcher: BatcherConfig = BatcherConfig()
    speculation: SpeculationConfig = SpeculationConfig()

    def __post_init__(self):
        if self.max_sessions < 1 or self.max_context < 2 or self.max_draft_tokens < 0 or self.idle_timeout_s <= 0:
            raise ValueError(f"invalid engine config: {self}")
        optional_limits = (self.max_prompt_tokens, self.max_sessions_per_identity)
        if self.max_draft_prob_tokens < 1 or any(limit is not None and limit < 1 for limit in optional_limits):
            raise ValueError(f"invalid engine config: {self}")

    @property
    def prompt_limit(self) -> int:
        return min(self.max_prompt_tokens or self.max_context, self.max_context - 1)

    @property
    def identity_session_limit(self) -> int:
        return min(self.max_sessions_per_identity or self.max_sessions, self.max_sessions)

    def request_limits(self, vocab_size: int) -> RequestLimits:
        return RequestLimits(
            vocab_size=vocab_size,
            max_context=self.max_context,
            max_prompt_tokens=self.prompt_limit,
            max_draft_tokens=self.max_draft_tokens,
            max_draft_prob_tokens=self.max_draft_prob_tokens,
        )


@dataclasses.dataclass(frozen=True)
class RoundTiming:
    queue_s: float  # from queueing to the start of the forward it rode in
    forward_s: float
    batch_size: int
    batch_tokens: int


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    accepted_nodes: tuple[int, ...]  # committed draft nodes, root to leaf
    token_ids: list[int]  # committed this round, cut at a stop
    finish: FinishReason
    num_generated: int
    advised_draft_tokens: int
    timing: RoundTiming


@dataclasses.dataclass(eq=False)
class _Work:
    """A session's one queued piece of work: a prefill, or a round (pending token + drafts)."""

    session: Session
    future: asyncio.Future
    queued_at: float  # time.monotonic()
    is_prefill: bool = False
    prefill_start: int = 0  # prompt tokens already cached before this prefill (a later turn)
    draft_token_ids: tuple[int, ...] = ()
    draft_parents: tuple[int, ...] = ()
    draft_dists: tuple[SparseDist, ...] = ()  # chains only: q of each draft token (rejection sampling)
    server_draft_tokens: int = 0  # > 0: the server drafts this round itself (baseline)


class Engine:
    def __init__(
        self,
        runner: Runner,
        target: Target,
        config: EngineConfig,
        stats: ServerStats | None = None,
        server_drafter: ServerDrafter | None = None,
    ):
        self.runner = runner
        self.server_drafter = server_drafter
        self.target = target
        self.config = config
        self.stats = stats or ServerStats()
        self.vocab_size = target.model.args.vocab_size
        self.sessions: dict[str, Session] = {}
        self.slots = SlotAllocator(config.max_sessions)
        self.batcher = Batcher(config.batcher)
        self._work: dict[str, _Work] = {}
        self._leases: dict[str, int] = {}  # connection -> open Attach streams
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specedge-engine")
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.cost_model = StepCostModel()  # measured step cost -> marginal cost of a draft token
        self._budget_share = 0.0  # busy share of the step token budget, smoothed: the fallback load
        self.load = 0.0  # what speculation advice uses (scheduler/speculation.py)
        # Set by the fleet control plane (server/fleet_link.py): why new sessions are refused while
        # running ones finish (an operator's drain), and the acceptance edges report, as new sessions' prior.
        self.draining: str | None = None
        self.acceptance_prior = config.speculation.prior_acceptance

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop()), asyncio.create_task(self._reap_idle())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # -- RPC-facing API ------------------------------------------------------

    async def open_session(self, caller: Caller, request: SessionRequest) -> tuple[Session, RoundOutcome]:
        """A new session for `caller` (a request already validated by server/requests.py)."""
        if self.draining is not None:
            raise errors.Unavailable(self.draining)
        try:
            slot = self.slots.acquire()
        except NoFreeSlot as exc:
            self.stats.observe_rejected_session()
            raise errors.ResourceExhausted(
                f"{exc} (the KV memory budget); retry in {RETRY_AFTER_S:.0f} s or ask the operator for more",
                retry_after_s=RETRY_AFTER_S,
            ) from None
        limit = self.config.identity_session_limit
        if sum(session.owner == caller.identity for session in self.sessions.values()) >= limit:
            self.slots.release(slot)
            self.stats.observe_refused("session_limit")
            raise errors.ResourceExhausted(
                f"this identity already has {limit} open sessions, the most the server allows one identity; "
                "close one (or let it finish) first",
                retry_after_s=RETRY_AFTER_S,
            )
        prompt = request.prompt
        session = Session(
            id=secrets.token_urlsafe(18),
            owner=caller.identity,
            connection=caller.connection,
            slot=slot,
            prompt=prompt,
            max_new_tokens=request.max_new_tokens or self.config.max_context - len(prompt),
            max_context=self.config.max_context,
            sampling=request.sampling,
            seed=secrets.randbits(63) if request.seed is None else request.seed,
            eos_token_ids=self.target.eos_token_ids,
            speculation=SessionSpeculation(self.config.speculation, acceptance=self.acceptance_prior),
        )
        self.sessions[session.id] = session
        self._update_session_gauges()
        work = self._enqueue(_Work(session, self._new_future(), time.monotonic(), is_prefill=True), len(prompt))
        return session, await self._await_work(work)

    async def continue_session(self, caller: Caller, session_id: str, turn: TurnRequest) -> tuple[Session, RoundOutcome]:
        """A new turn: keep the session's first `keep_tokens` tokens (and their KV), prefill the turn's tokens."""
        session = self._owned(caller, session_id)
        if session.id in self._work:
            raise errors.FailedPrecondition("the session has work in flight; wait for its reply before a new turn")
        if turn.keep_tokens > session.num_context:
            raise errors.InvalidArgument(
                f"keep_tokens {turn.keep_tokens} exceeds the session's {session.num_context} tokens; open a new session"
            )
        prompt = (*session.prompt, *session.generated)[: turn.keep_tokens] + turn.token_ids
        if not turn.token_ids and turn.keep_tokens == session.num_context:
            raise errors.InvalidArgument("the new turn is empty: send the new message's token ids")
        if not prompt:
            raise errors.InvalidArgument("the new turn leaves an empty prompt: send at least one token id")
        if len(prompt) >= self.config.max_context:
            raise errors.InvalidArgument(
                f"conversation of {len(prompt)} tokens leaves no room to generate within the server's "
                f"max context of {self.config.max_context} tokens; start a new conversation"
            )
        # KV is valid for the kept tokens that were cached; at least the last
        # prompt token is run again, for the logits of the next one.
        cached = min(session.num_cached, turn.keep_tokens, len(prompt) - 1)
        session.prompt, session.generated, session.num_cached = prompt, [], cached
        session.draft_cached = min(session.draft_cached, cached)
        session.max_new_tokens = turn.max_new_tokens or self.config.max_context - len(prompt)
        session.sampling = turn.sampling
        session.seed = secrets.randbits(63) if turn.seed is None else turn.seed
        session.finish = FinishReason.NONE
        work = _Work(session, self._new_future(), time.monotonic(), is_prefill=True, prefill_start=cached)
        self._enqueue(work, len(prompt) - cached, start=cached)
        return session, await self._await_work(work)

    async def verify(self, caller: Caller, session_id: str, draft: DraftRound, num_generated: int) -> RoundOutcome:
        """Queue one round of a validated draft (server/requests.py) and await its outcome."""
        session = self._owned(caller, session_id)
        if session.finish is not FinishReason.NONE:
            raise errors.FailedPrecondition(f"session already finished ({session.finish.name.lower()}); open a new one")
        if session.id in self._work:
            raise errors.FailedPrecondition("a verify round for this session is already in flight; wait for its reply")
        if num_generated != len(session.generated):
            raise errors.FailedPrecondition(
                f"edge is out of sync: it has {num_generated} generated tokens, the server {len(session.generated)}; "
                "reopen the session"
            )
        # Nodes beyond the slot's remaining room are dropped; children come after
        # their parents, so what is left is still a tree.
        room = session.draft_room
        work = _Work(
            session,
            self._new_future(),
            time.monotonic(),
            draft_token_ids=draft.token_ids[:room],
            draft_parents=draft.parents[:room],
            draft_dists=draft.dists[:room],
        )
        return await self._await_work(self._enqueue(work, 1 + len(work.draft_token_ids)))

    def close_session(self, caller: Caller, session_id: str) -> None:
        self._close(self._owned(caller, session_id))

    def attach(self, connection: str) -> None:
        """`connection` holds a lease (see the Attach RPC)."""
        self._leases[connection] = self._leases.get(connection, 0) + 1

    def detach(self, connection: str) -> None:
        """A lease ended; when it was the connection's last, close the sessions opened on it."""
        self._leases[connection] -= 1
        if self._leases[connection] == 0:
            del self._leases[connection]
            orphans = [s for s in self.sessions.values() if s.connection == connection]
            if orphans:
                log.info("connection %s went away; closing its %d sessions", connection, len(orphans))
            for session in orphans:
                self._close(session)

    async def generate(
        self, caller: Caller, request: SessionRequest, server_draft_tokens: int = 0
    ) -> AsyncIterator[RoundOutcome]:
        """Server-side generation: target-only decoding, or with the server's own draft model."""
        if server_draft_tokens and self.server_drafter is None:
            raise errors.FailedPrecondition("this server has no draft model; start it with --draft-model NAME")
        session, outcome = await self.open_session(caller, request)
        work = None
        try:
            while True:
                # Queue the next step before this reply goes out: every server-driven
                # stream woken by a step is then queued before the next one is planned,
                # so the streams share forwards instead of alternating.
                work = None if outcome.finish is not FinishReason.NONE else self._next_server_round(session, server_draft_tokens)
                yield outcome
                if work is None:
                    return
                outcome = await self._await_work(work)
        finally:
            if work is not None and not work.future.done():
                work.future.cancel()
            self._close(session)

    def _next_server_round(self, session: Session, server_draft_tokens: int) -> _Work:
        num_draft = min(server_draft_tokens, session.draft_room)
        work = _Work(session, self._new_future(), time.monotonic(), server_draft_tokens=num_draft)
        return self._enqueue(work, 1 + num_draft)

    # -- internals -----------------------------------------------------------

    def _owned(self, caller: Caller, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise errors.NotFound("unknown session (never opened, closed, or expired after idling); open a new one")
        if session.owner != caller.identity:
            raise errors.PermissionDenied(
                "this session belongs to another identity (the token, or without tokens the connection, that opened it)"
            )
        return session

    def _close(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is None:
            return
        self.batcher.remove(session.id)
        work = self._work.pop(session.id, None)
        if work is not None and not work.future.done():
            work.future.set_exception(errors.NotFound("session was closed while its work was queued"))
        self.slots.release(session.slot)
        self._update_session_gauges()

    def _update_session_gauges(self) -> None:
        used = self.slots.num_slots - self.slots.num_free
        self.stats.set_sessions(active=len(self.sessions), slots_used=used, slots_free=self.slots.num_free)

    def _new_future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    def _enqueue(self, work: _Work, num_tokens: int, start: int = 0) -> _Work:
        """Queue a session's one piece of work for the next step (synchronous: no await)."""
        if work.is_prefill:
            self.batcher.add_prefill(work.session.id, num_tokens, start)
        else:
            self.batcher.add_round(work.session.id, num_tokens)
        self._work[work.session.id] = work
        self._wakeup.set()
        return work

    async def _await_work(self, work: _Work) -> RoundOutcome:
        session = work.session
        try:
            return await work.future
        except asyncio.CancelledError:
            # The edge went away mid-round (disconnect, cancel, deadline): its
            # session cannot continue coherently, so free the slot now.
            log.info("session %s cancelled by its client; freeing its slot", session.id[:8])
            self._close(session)
            raise
        except BaseException:
            # A failed prefill leaves nothing usable, and a round that failed inside
            # the engine leaves the session's KV suspect: either way it is closed.
            self._close(session)
            raise
        finally:
            if self._work.get(session.id) is work:
                del self._work[session.id]
            session.last_used = time.monotonic()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while True:
                planned_at = time.perf_counter()
                plan = self.batcher.plan_step()
                if not plan:
                    break
                rows = self._rows(plan)
                schedule_s = time.perf_counter() - planned_at
                try:
                    outcomes = await loop.run_in_executor(self._executor, self.step, rows, schedule_s)
                except Exception as exc:  # a bug outside any one row: every row fails alike
                    log.exception("engine step failed")
                    outcomes = [failure_for_client(exc)] * len(rows)
                for (work, _), outcome in zip(rows, outcomes):
                    if work.future.done() or outcome is None:
                        continue
                    if isinstance(outcome, Exception):
                        work.future.set_exception(outcome)
                    else:
                        work.future.set_result(outcome)
                # Let the sessions just woken queue their next work (server-driven
                # streams do so at once) before the next step is planned.
                await asyncio.sleep(0)

    def _rows(self, plan: StepPlan) -> list[tuple[_Work, PrefillChunk | None]]:
        return [(self._work[key], None) for key in plan.rounds] + [
            (self._work[chunk.key], chunk) for chunk in plan.prefills
        ]

    def _request(self, work: _Work, chunk: PrefillChunk | None) -> ForwardRequest:
        session = work.session
        if chunk is not None:
            tokens = session.prompt[chunk.start : chunk.start + chunk.num_tokens]
            return ForwardRequest(session.slot, chunk.start, tokens, all_logits=False)
        is_chain = work.draft_parents == tree.chain_parents(len(work.draft_token_ids) + 1)
        return ForwardRequest(
            session.slot,
            session.num_cached,
            (session.pending_token, *work.draft_token_ids),
            tree_parents=None if is_chain else work.draft_parents,
        )

    def _draft_on_server(self, works: list[_Work]) -> list[Exception | None]:
        """Fill in the drafts of server-drafted rounds, batched across them; each work's failure or None."""

        def draft(batch: list[_Work]) -> list[list[int]]:
            rows = []
            for work in batch:
                context = (*work.session.prompt, *work.session.generated)
                cached = work.session.draft_cached
                rows.append(DraftRow(work.session.slot, cached, context[cached:], work.server_draft_tokens))
            return self.server_drafter.propose(rows)

        results = run_isolated(draft, works)
        for work, result in zip(works, results):
            if not isinstance(result, Exception):
                work.draft_token_ids = tuple(result)
                work.draft_parents = tree.chain_parents(len(work.draft_token_ids) + 1)
        return [result if isinstance(result, Exception) else None for result in results]

    def step(self, rows, schedule_s: float) -> list[RoundOutcome | Exception | None]:
        """One batched forward, then every row's draws, verification and commit. Engine thread only.

        A row's outcome is None for a prefill chunk that is not its prompt's last, and an
        error for a row that failed: a failure stays with its row (server/isolation.py).
        """
        started = time.monotonic()
        outcomes: list[RoundOutcome | Exception | None] = [None] * len(rows)
        drafted = [i for i, (work, chunk) in enumerate(rows) if chunk is None and work.server_draft_tokens]
        if drafted:
            for i, failure in zip(drafted, self._draft_on_server([rows[i][0] for i in drafted])):
                outcomes[i] = failure
        live = [i for i, outcome in enumerate(outcomes) if outcome is None]
        requests = [self._request(*rows[i]) for i in live]
        target_started = time.monotonic()
        logits, failures = self._forward(requests)
        forward_s = time.monotonic() - started
        batch_tokens = sum(len(request.token_ids) for request in requests)
        if not any(failures):  # retries would skew the cost model
            self.cost_model.observe(
                batch_tokens=batch_tokens, batch_rows=len(requests), seconds=time.monotonic() - target_started
            )
            self.batcher.knee_tokens = self.cost_model.knee_tokens()
        self._budget_share += 0.25 * (min(1.0, batch_tokens / self.config.batcher.max_batch_tokens) - self._budget_share)
        self.load = self.cost_model.load(fallback=self._budget_share)

        ok = [j for j, failure in enumerate(failures) if failure is None]
        asks = [self._ask(*rows[live[j]]) for j in ok]
        drawn = self._draw(logits, asks) if ok else []
        moves: dict[int, KVMove] = {}
        for j, failure in enumerate(failures):
            outcomes[live[j]] = failure
        for j, row_drawn in zip(ok, drawn):
            work, chunk = rows[live[j]]
            timing = RoundTiming(max(0.0, started - work.queued_at), forward_s, len(rows), batch_tokens)
            outcome = row_drawn if isinstance(row_drawn, Exception) else self._postprocess(work, chunk, row_drawn, timing)
            if isinstance(outcome, tuple):
                outcome, moves[live[j]] = outcome
            outcomes[live[j]] = outcome
        self._move_kv(moves, outcomes)
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Exception):
                log.error("session %s failed in the engine; closing it", rows[i][0].session.id[:8], exc_info=outcome)
                self.stats.observe_failed_request()
                outcomes[i] = failure_for_client(outcome)
        self.stats.observe_step(
            batch_size=len(rows),
            batch_tokens=batch_tokens,
            forward_s=forward_s,
            schedule_s=schedule_s,
            postprocess_s=time.monotonic() - started - forward_s,
        )
        return outcomes

    def _forward(self, requests: list[ForwardRequest]) -> tuple[torch.Tensor | None, list[Exception | None]]:
        """The step's packed logits of the rows that ran, and each row's failure or None.

        One forward for the whole step; only when it raises are the rows bisected (server/isolation.py),
        and the logits of those that succeed alone are packed again.
        """
        if not requests:
            return None, []
        try:
            return self.runner.forward_packed(requests), [None] * len(requests)
        except Exception as exc:
            if len(requests) == 1:
                return None, [exc]
        half = len(requests) // 2
        per_row = run_isolated(self.runner.forward, requests[:half]) + run_isolated(self.runner.forward, requests[half:])
        good = [row for row in per_row if not isinstance(row, Exception)]
        failures = [row if isinstance(row, Exception) else None for row in per_row]
        return (torch.cat(good) if good else None), failures

    @staticmethod
    def _draw(logits: torch.Tensor, asks: list[RowDraw]) -> list:
        """Every row's draws in one pass; should that pass raise, each row alone, so a failure stays with its row."""
        try:
            return draw_rows(logits, asks)
        except Exception:
            log.exception("the step's draws failed; drawing its rows one by one")
        drawn, start = [], 0
        for ask in asks:
            try:
                [row] = draw_rows(logits[start : start + ask.num_logits], [ask])
            except Exception as exc:
                row = exc
            drawn.append(row)
            start += ask.num_logits
        return drawn

    def _ask(self, work: _Work, chunk: PrefillChunk | None) -> RowDraw:
        if chunk is not None:
            return prefill_draw(work.session, chunk)
        return round_draw(work.session, work.draft_token_ids, work.draft_parents, work.draft_dists)

    def _move_kv(self, moves: dict[int, KVMove], outcomes: list) -> None:
        """Every accepted tree path of the step made contiguous at once; if that fails, those rows fail."""
        if not moves:
            return
        try:
            self.runner.move_kv(list(moves.values()))
        except Exception as exc:
            for i in moves:
                outcomes[i] = exc

    def _postprocess(self, work: _Work, chunk: PrefillChunk | None, drawn, timing: RoundTiming):
        """One row's verification and commit (server/postprocess.py): its outcome, with its KV move
        when it has one; a failure is returned, to stay with the row."""
        session = work.session
        try:
            if chunk is not None:
                committed = after_prefill(session, chunk, drawn, self.stats, prefill_start=work.prefill_start)
            else:
                self.stats.observe_queue_wait(timing.queue_s)
                committed = after_round(
                    session, work.draft_token_ids, work.draft_parents, drawn, self.stats,
                    server_drafted=work.server_draft_tokens > 0,
                )  # fmt: skip
        except Exception as exc:
            return exc
        if committed is None:  # a prefill chunk before the prompt's last
            return None
        advice = min(session.speculation.next_advice(self.load), self.config.max_draft_tokens)
        num_generated = len(session.generated)
        outcome = RoundOutcome(committed.accepted_nodes, committed.token_ids, session.finish, num_generated, advice, timing)
        return outcome if committed.kv_move is None else (outcome, committed.kv_move)

    async def _reap_idle(self) -> None:
        period = min(30.0, self.config.idle_timeout_s / 2)
        while True:
            await asyncio.sleep(period)
            deadline = time.monotonic() - self.config.idle_timeout_s
            for session in [s for s in self.sessions.values() if s.id not in self._work and s.last_used < deadline]:
                log.info("closing session %s after %.0f s idle", session.id[:8], self.config.idle_timeout_s)
                self._close(session)
