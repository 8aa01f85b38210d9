"""The server engine's asyncio side: sessions, admission, leases, reaping and the one queue of work.

An RPC handler validates a request (server/requests.py) and calls in here;
the session's work is queued and its future awaited. Each step, the loop
takes the batcher's plan (scheduler/batcher.py, pure Python) out of the
queue and hands its rows to the engine thread (server/step.py), which runs
plan -> forward -> draws -> commit and returns a typed `StepResult`; the loop
resolves the rows' futures and feeds the measured cost curve back to the batcher.
A single engine thread runs every forward, so the KV cache has exactly one
writer; a round that arrives while a forward runs joins the next one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Hashable

from specedge.scheduler import Batcher, BatcherConfig, NoFreeSlot, SlotAllocator
from specedge.scheduler.gather import Gatherer
from specedge.scheduler.speculation import SessionSpeculation, SpeculationConfig
from specedge.server import errors
from specedge.server.auth import Caller
from specedge.server.isolation import failure_for_client
from specedge.server.loading import Target
from specedge.server.requests import DraftRound, RequestLimits, SessionRequest, TurnRequest
from specedge.server.runner import Runner
from specedge.server.server_draft import ServerDrafter
from specedge.server.session import Session
from specedge.server.stats import ServerStats
from specedge.server.step import RoundOutcome, RoundTiming, Stepper, StepResult, StepRow, Work
from specedge.types import FinishReason

__all__ = ["Engine", "EngineConfig", "RoundOutcome", "RoundTiming"]

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
        # The advice never exceeds what a round may carry: capped here, once, not at each use.
        if self.speculation.max_draft_tokens > self.max_draft_tokens:
            capped = dataclasses.replace(self.speculation, max_draft_tokens=self.max_draft_tokens)
            object.__setattr__(self, "speculation", capped)

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


@dataclasses.dataclass(eq=False)
class _Queued:
    """A session's one piece of work, queued or in flight, and the future its RPC awaits."""

    work: Work
    future: asyncio.Future


class Engine:
    def __init__(
        self,
        runner: Runner,
        target: Target,
        config: EngineConfig,
        stats: ServerStats | None = None,
        server_drafter: ServerDrafter | None = None,
    ):
        self.target = target
        self.config = config
        self.stats = stats or ServerStats()
        # The engine thread's state: runner(s) and the measured cost curve; used only on that thread.
        self.stepper = Stepper(runner, self.stats, config.batcher.max_batch_tokens, server_drafter)
        self.vocab_size = target.model.args.vocab_size
        self.sessions: dict[str, Session] = {}
        self.slots = SlotAllocator(config.max_sessions)
        self.batcher = Batcher(config.batcher)
        self.gatherer = Gatherer()  # holds a step for rounds due back (scheduler/gather.py)
        self._work: dict[Hashable, _Queued] = {}  # session id (the batcher's key) -> its queued or in-flight work
        self._leases: dict[str, int] = {}  # connection -> open Attach streams
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specedge-engine")
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.load = 0.0  # what speculation advice follows (scheduler/speculation.py), as of the last step
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
        queued = self._enqueue(Work(session, time.monotonic(), is_prefill=True), len(prompt))
        return session, await self._await_work(queued)

    async def continue_session(
        self, caller: Caller, session_id: str, turn: TurnRequest
    ) -> tuple[Session, RoundOutcome]:
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
        work = Work(session, time.monotonic(), is_prefill=True, prefill_start=cached)
        return session, await self._await_work(self._enqueue(work, len(prompt) - cached, start=cached))

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
        work = Work(
            session,
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
        if server_draft_tokens and self.stepper.server_drafter is None:
            raise errors.FailedPrecondition("this server has no draft model; start it with --draft-model NAME")
        session, outcome = await self.open_session(caller, request)
        queued = None
        try:
            while True:
                # Queue the next step before this reply goes out: every server-driven
                # stream woken by a step is then queued before the next one is planned,
                # so the streams share forwards instead of alternating.
                queued = (
                    None
                    if outcome.finish is not FinishReason.NONE
                    else self._next_server_round(session, server_draft_tokens)
                )
                yield outcome
                if queued is None:
                    return
                outcome = await self._await_work(queued)
        finally:
            if queued is not None and not queued.future.done():
                queued.future.cancel()
            self._close(session)

    def _next_server_round(self, session: Session, server_draft_tokens: int) -> _Queued:
        num_draft = min(server_draft_tokens, session.draft_room)
        return self._enqueue(Work(session, time.monotonic(), server_draft_tokens=num_draft), 1 + num_draft)

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
        queued = self._work.pop(session.id, None)
        if queued is not None and not queued.future.done():
            queued.future.set_exception(errors.NotFound("session was closed while its work was queued"))
        self.slots.release(session.slot)
        self._update_session_gauges()

    def _update_session_gauges(self) -> None:
        used = self.slots.num_slots - self.slots.num_free
        self.batcher.open_identities = len({session.owner for session in self.sessions.values()})
        self.stats.set_sessions(active=len(self.sessions), slots_used=used, slots_free=self.slots.num_free)

    def _enqueue(self, work: Work, num_tokens: int, start: int = 0) -> _Queued:
        """Queue a session's one piece of work for the next step (synchronous: no await)."""
        if work.is_prefill:
            self.batcher.add_prefill(work.session.id, num_tokens, start, owner=work.session.owner)
        else:
            self.batcher.add_round(work.session.id, num_tokens, owner=work.session.owner)
        work.session.turnaround.arrived(time.monotonic())
        queued = self._work[work.session.id] = _Queued(work, asyncio.get_running_loop().create_future())
        self._wakeup.set()
        return queued

    async def _await_work(self, queued: _Queued) -> RoundOutcome:
        session = queued.work.session
        try:
            return await queued.future
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
            if self._work.get(session.id) is queued:
                del self._work[session.id]
            session.last_used = time.monotonic()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while True:
                await self._gather()
                planned_at = time.perf_counter()
                self.batcher.answering = any(
                    s.generated and s.finish is FinishReason.NONE for s in self.sessions.values()
                )
                plan = self.batcher.plan_step()
                if not plan:
                    break
                queued = [self._work[key] for key in plan.rounds] + [self._work[chunk.key] for chunk in plan.prefills]
                rows = [StepRow(q.work, None) for q in queued[: len(plan.rounds)]] + [
                    StepRow(q.work, chunk) for q, chunk in zip(queued[len(plan.rounds) :], plan.prefills)
                ]
                for q in queued:  # fair shares: each row's share (the advice follows it), and the cuts
                    q.work.share = plan.shares.get(q.work.session.id)
                for key, num_tokens in plan.cuts.items():
                    self._work[key].work.cut(num_tokens)
                schedule_s = time.perf_counter() - planned_at
                try:
                    result: StepResult = await loop.run_in_executor(self._executor, self.stepper.step, rows, schedule_s)
                except Exception as exc:  # a bug outside any one row: every row fails alike
                    log.exception("engine step failed")
                    result = StepResult([failure_for_client(exc)] * len(rows), None, self.load)
                self.load = result.load
                self._update_curve(result.curve)
                replied_at = time.monotonic()
                for q, outcome in zip(queued, result.outcomes):
                    if q.future.done() or outcome is None:
                        continue
                    if isinstance(outcome, Exception):
                        q.future.set_exception(outcome)
                    else:
                        q.work.session.turnaround.replied(replied_at)
                        q.future.set_result(outcome)
                # Let the sessions just woken queue their next work (server-driven
                # streams do so at once) before the next step is planned.
                await asyncio.sleep(0)

    async def _gather(self) -> None:
        """Hold the next step, at most the step's fixed cost less the queued rows' turnaround, for rounds due back
        from edges (scheduler/gather.py)."""
        awaited: dict[str, Session] = {}
        since = time.monotonic()
        if self.config.batcher.gather and self._work:
            fixed_s = self.batcher.curve[0] if self.batcher.curve else None
            returns_s = self._queued_return_s()
            while (
                hold := self.gatherer.hold(time.monotonic(), self._due_back(), fixed_s, since, returns_s)
            ) is not None:
                until, keys = hold
                awaited.update((key, self.sessions[key]) for key in keys)
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), until - time.monotonic())
        missed = {s.owner for s in awaited.values() if s.id not in self._work}
        self.gatherer.step_started(missed)
        if awaited:
            self.stats.observe_hold(time.monotonic() - since, misses=len(missed))

    def _queued_return_s(self) -> float:
        """How soon the first queued row comes back once answered: the shortest learned turnaround among them
        (0 when none is known yet, as for a new session's prompt)."""
        turnarounds = [q.work.session.turnaround.average_s for q in self._work.values() if not q.future.done()]
        return min((t for t in turnarounds if t is not None), default=0.0)

    def _due_back(self) -> list[tuple[str, str, float | None]]:
        """(session, identity, when its next round is due) of each mid-answer session with nothing queued."""
        return [
            (s.id, s.owner, s.turnaround.due_by())
            for s in self.sessions.values()
            if s.id not in self._work and s.generated and s.finish is FinishReason.NONE
        ]

    # -- the step budget's cost curve ------------------------------------------

    def calibrate(self) -> None:
        """Time the step cost curve before serving (on the engine thread's runner, which nothing else uses
        yet), then log the step budget and the curve it came from."""
        self._update_curve(self.stepper.calibrate(self.config.max_context), announce=True)

    def _update_curve(self, curve: tuple[float, float] | None, announce: bool = False) -> None:
        """Feed the batcher the latest fit (None, a fit not possible now, keeps the last one)."""
        if curve is not None:
            self.batcher.curve = curve
        budget = self.batcher.step_budget()
        self.stats.set_step_cost(curve=self.batcher.curve, knee_tokens=self.batcher.knee_tokens, budget=budget)
        if not announce:
            return
        if not self.config.batcher.fair_shares:
            log.info("fair shares off: steps take rounds in arrival order, up to %d tokens", budget)
        elif self.batcher.curve is None:
            log.info("step budget: %d tokens (the default, until the cost curve is measured)", budget)
        else:
            a, b = self.batcher.curve
            log.info(
                "step budget: %d tokens, shared across identities; cost curve: %.1f ms + %.3f ms per token "
                "(knee %s tokens)",
                budget,
                a * 1e3,
                b * 1e3,
                self.batcher.knee_tokens or "unbounded",
            )

    async def _reap_idle(self) -> None:
        period = min(30.0, self.config.idle_timeout_s / 2)
        while True:
            await asyncio.sleep(period)
            deadline = time.monotonic() - self.config.idle_timeout_s
            for session in [s for s in self.sessions.values() if s.id not in self._work and s.last_used < deadline]:
                log.info("closing session %s after %.0f s idle", session.id[:8], self.config.idle_timeout_s)
                self._close(session)
