"""The engine thread: one step reads plan -> forward -> draws -> commit, and returns a `StepResult`.

server/engine.py (the asyncio side) owns the sessions, admission, leases,
reaping and the one queue of work. Each step it takes the batcher's plan out
of that queue and hands its rows to `Stepper.step` on the single engine
thread, the KV cache's only writer. Nothing here touches the queue, a future
or the event loop: what the step learnt for the next plan (the cost curve's
knee, the load that speculation advice follows) travels back in the result.

A failure stays with its row: a forward that raises is bisected, a draws pass
that raises is redone row by row, and a row whose commit raises fails alone
(server/isolation.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from specedge.scheduler import PrefillChunk
from specedge.scheduler.speculation import StepCostModel
from specedge.server import errors, race_kernel, tree
from specedge.server.draws import Drawn, RowDraw, draw_rows
from specedge.server.isolation import failure_for_client, run_isolated
from specedge.server.postprocess import after_prefill, after_round, prefill_draw, round_draw
from specedge.server.runner import ForwardRequest, KVMove, Runner
from specedge.server.server_draft import DraftRow, ServerDrafter
from specedge.server.session import Session
from specedge.server.stats import ServerStats
from specedge.server.verify import VerifyResult
from specedge.types import FinishReason, SparseDist

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = (1, 4, 16, 64)  # forward sizes timed at start, twice each, for the first cost curve


@dataclasses.dataclass(eq=False)
class Work:
    """A session's one queued piece of work: a prefill, or a round (pending token + drafts)."""

    session: Session
    queued_at: float  # time.monotonic()
    is_prefill: bool = False
    prefill_start: int = 0  # prompt tokens already cached before this prefill (a later turn)
    draft_token_ids: tuple[int, ...] = ()
    draft_parents: tuple[int, ...] = ()
    draft_dists: tuple[SparseDist, ...] = ()  # chains only: q of each draft token (rejection sampling)
    server_draft_tokens: int = 0  # > 0: the server drafts this round itself (filled in on the engine thread)
    share: int | None = None  # tokens this row could have had in its step (fair shares); the advice follows it
    num_cut_nodes: int = 0  # draft nodes dropped because the round exceeded its share

    def cut(self, num_tokens: int) -> None:
        """Keep the pending token and the first num_tokens - 1 draft nodes. Children come after
        their parents, so the nodes kept are a chain's prefix, or a subtree closed under parents."""
        keep = num_tokens - 1
        if self.server_draft_tokens:
            self.num_cut_nodes, self.server_draft_tokens = self.server_draft_tokens - keep, keep
            return
        self.num_cut_nodes = len(self.draft_token_ids) - keep
        self.draft_token_ids, self.draft_parents = self.draft_token_ids[:keep], self.draft_parents[:keep]
        self.draft_dists = self.draft_dists[:keep]


@dataclasses.dataclass(frozen=True)
class StepRow:
    work: Work
    chunk: PrefillChunk | None  # the prefill chunk this step runs; None: a round


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
    num_verified_nodes: int = 0  # draft nodes verified: the round's first ones; the rest were cut to its share


# A row's outcome: a committed round (or a prompt's last chunk), None for a prefill chunk
# before its prompt's last, or the error to give its client.
RowOutcome = RoundOutcome | errors.ServiceError | None


def finish(device: torch.device) -> None:
    """Wait for the device to finish what was queued on it. A CUDA forward returns as soon as its kernels are
    launched; what they cost, and any error they raise, show only here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass(frozen=True)
class StepResult:
    outcomes: list[RowOutcome]  # one per row, in the plan's order
    curve: tuple[float, float] | None  # the step cost curve as measured so far (scheduler/batcher.py); None: unknown
    load: float  # marginal cost of a draft token, what speculation advice follows


class Stepper:
    """What the engine thread owns: the runner(s), the measured cost curve, and one step at a time."""

    def __init__(
        self,
        runner: Runner,
        stats: ServerStats,
        max_batch_tokens: int,
        server_drafter: ServerDrafter | None = None,
    ):
        self.runner = runner
        self.stats = stats
        self.server_drafter = server_drafter
        self.max_batch_tokens = max_batch_tokens
        self.cost_model = StepCostModel()  # measured step cost -> marginal cost of a draft token
        self._budget_share = 0.0  # busy share of the step token budget, smoothed: the fallback load
        self.load = 0.0

    def step(self, rows: list[StepRow], schedule_s: float) -> StepResult:
        """One batched forward, then every row's draws, verification and commit."""
        started = time.monotonic()
        outcomes: list = [None] * len(rows)
        for i, failure in self._draft_on_server(rows):
            outcomes[i] = failure
        live = [i for i, outcome in enumerate(outcomes) if outcome is None]
        requests = [_request(rows[i]) for i in live]
        target_started = time.monotonic()
        logits, failures = self._forward(requests)
        forward_s = time.monotonic() - started  # what the rows waited for: their drafts too
        batch_tokens = sum(len(request.token_ids) for request in requests)
        self._measure(batch_tokens, len(requests), time.monotonic() - target_started, clean=not any(failures))

        ok = [j for j, failure in enumerate(failures) if failure is None]
        drawn = self._draw(logits, [_ask(rows[live[j]]) for j in ok]) if logits is not None else []  # None: none ok
        for j, forward_failure in enumerate(failures):
            outcomes[live[j]] = forward_failure
        moves: dict[int, KVMove] = {}
        for j, row_drawn in zip(ok, drawn):
            row = rows[live[j]]
            timing = RoundTiming(max(0.0, started - row.work.queued_at), forward_s, len(rows), batch_tokens)
            outcome = row_drawn if isinstance(row_drawn, Exception) else self._commit(row, row_drawn, timing)
            if isinstance(outcome, tuple):
                outcome, moves[live[j]] = outcome
            outcomes[live[j]] = outcome
        self._move_kv(moves, outcomes)

        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Exception):
                log.error("session %s failed in the engine; closing it", rows[i].work.session.id[:8], exc_info=outcome)
                self.stats.observe_failed_request()
                outcomes[i] = failure_for_client(outcome)
        self.stats.observe_step(
            batch_size=len(rows),
            batch_tokens=batch_tokens,
            forward_s=forward_s,
            schedule_s=schedule_s,
            postprocess_s=time.monotonic() - started - forward_s,
        )
        return StepResult(outcomes, self.cost_model.fit(), self.load)

    def calibrate(self, max_tokens: int) -> tuple[float, float] | None:
        """Time a few forwards of different sizes (below `max_tokens`) on slot 0, before any session holds
        it, so the step budget starts from a measured cost curve; the curve. On CPU, also make the draws
        kernel ready."""
        sizes = [n for n in CALIBRATION_TOKENS if n < max_tokens]
        try:
            # Warm-up, not timed: on CUDA a shape's first forward compiles its kernels, so each size; elsewhere one.
            for num_tokens in sizes if self.runner.device.type == "cuda" else sizes[:1]:
                self.runner.forward_packed([ForwardRequest(0, 0, (0,) * num_tokens)])
            finish(self.runner.device)
            for num_tokens in sizes * 2:
                started = time.monotonic()
                self.runner.forward_packed([ForwardRequest(0, 0, (0,) * num_tokens)])
                finish(self.runner.device)
                self.cost_model.observe(batch_tokens=num_tokens, batch_rows=1, seconds=time.monotonic() - started)
            self.stats.set_step_cost_points(self.cost_model.points())
        except Exception:  # the engine still serves, from the default budget until steps are measured
            log.exception("timing the step cost curve failed")
        if self.runner.device.type == "cpu":
            race_kernel.kernel()  # compiled (or loaded from numba's cache) now, not on the first request's step
        return self.cost_model.fit()

    def _measure(self, batch_tokens: int, batch_rows: int, seconds: float, *, clean: bool) -> None:
        """Feed the cost curve (only steps without retries: those would skew it) and the load."""
        if clean and batch_rows:
            self.cost_model.observe(batch_tokens=batch_tokens, batch_rows=batch_rows, seconds=seconds)
            self.stats.set_step_cost_points(self.cost_model.points())
        self._budget_share += 0.25 * (min(1.0, batch_tokens / self.max_batch_tokens) - self._budget_share)
        self.load = self.cost_model.load(fallback=self._budget_share)

    def _draft_on_server(self, rows: list[StepRow]) -> list[tuple[int, Exception]]:
        """Fill in the drafts of server-drafted rounds, batched across them; the rows that failed."""
        drafted = [i for i, row in enumerate(rows) if row.chunk is None and row.work.server_draft_tokens]
        if not drafted:
            return []
        drafter = self.server_drafter
        assert drafter is not None, "server drafts are granted only by a server with a drafter"

        def draft(batch: list[Work]) -> list[list[int]]:
            requests = []
            for work in batch:
                context = (*work.session.prompt, *work.session.generated)
                cached = work.session.draft_cached
                requests.append(DraftRow(work.session.slot, cached, context[cached:], work.server_draft_tokens))
            return drafter.propose(requests)

        failed = []
        for i, result in zip(drafted, run_isolated(draft, [rows[i].work for i in drafted])):
            if isinstance(result, Exception):
                failed.append((i, result))
            else:
                rows[i].work.draft_token_ids = tuple(result)
                rows[i].work.draft_parents = tree.chain_parents(len(result) + 1)
        return failed

    def _forward(self, requests: list[ForwardRequest]) -> tuple[torch.Tensor | None, list[Exception | None]]:
        """The step's packed logits of the rows that ran, and each row's failure or None.

        One forward for the whole step; only when it raises are the rows bisected (server/isolation.py),
        and the logits of those that succeed alone are packed again.
        """
        if not requests:
            return None, []
        try:
            logits = self.runner.forward_packed(requests)
            finish(self.runner.device)  # the time this step is billed, and any error its kernels raise, are its own
            return logits, [None] * len(requests)
        except Exception as exc:
            if len(requests) == 1:
                return None, [exc]
        half = len(requests) // 2
        per_row = run_isolated(self.runner.forward, requests[:half]) + run_isolated(
            self.runner.forward, requests[half:]
        )
        good = [row for row in per_row if not isinstance(row, Exception)]
        failures = [row if isinstance(row, Exception) else None for row in per_row]
        return (torch.cat(good) if good else None), failures

    @staticmethod
    def _draw(logits: torch.Tensor, asks: list[RowDraw]) -> list[Drawn | Exception]:
        """Every row's draws in one pass; should that pass raise, each row alone, so a failure stays with its row."""
        try:
            return list(draw_rows(logits, asks))
        except Exception:
            log.exception("the step's draws failed; drawing its rows one by one")
        drawn: list[Drawn | Exception] = []
        start = 0
        for ask in asks:
            try:
                [row] = draw_rows(logits[start : start + ask.num_logits], [ask])
            except Exception as exc:
                row = exc
            drawn.append(row)
            start += ask.num_logits
        return drawn

    def _move_kv(self, moves: dict[int, KVMove], outcomes: list) -> None:
        """Every accepted tree path of the step made contiguous at once; if that fails, those rows fail."""
        if not moves:
            return
        try:
            self.runner.move_kv(list(moves.values()))
        except Exception as exc:
            for i in moves:
                outcomes[i] = exc

    def _commit(self, row: StepRow, drawn: list[int] | VerifyResult | None, timing: RoundTiming):
        """One row's verification and commit (server/postprocess.py): its outcome, with its KV move
        when it has one; a failure is returned, to stay with the row."""
        work, session = row.work, row.work.session
        try:
            if row.chunk is not None:
                assert not isinstance(drawn, VerifyResult), "a prefill has no drafts to verify"
                committed = after_prefill(session, row.chunk, drawn, self.stats, prefill_start=work.prefill_start)
            else:
                self.stats.observe_queue_wait(timing.queue_s)
                assert drawn is not None, "a round always draws"
                committed = after_round(
                    session,
                    work.draft_token_ids,
                    work.draft_parents,
                    drawn,
                    self.stats,
                    server_drafted=work.server_draft_tokens > 0,
                )
        except Exception as exc:
            return exc
        if row.chunk is None:
            num_verified = len(work.draft_token_ids)
            self.stats.observe_share(session.owner, verified_tokens=1 + num_verified, cut_nodes=work.num_cut_nodes)
        if committed is None:  # a prefill chunk before the prompt's last
            return None
        advice = session.speculation.next_advice(self.load)
        if work.share is not None:  # never more than the row's share: a well-behaved edge is then never cut
            advice = min(advice, max(0, work.share - 1))
        outcome = RoundOutcome(
            committed.accepted_nodes,
            committed.token_ids,
            session.finish,
            len(session.generated),
            advice,
            timing,
            num_verified_nodes=len(work.draft_token_ids) if row.chunk is None else 0,
        )
        return outcome if committed.kv_move is None else (outcome, committed.kv_move)


def _request(row: StepRow) -> ForwardRequest:
    work, chunk, session = row.work, row.chunk, row.work.session
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


def _ask(row: StepRow) -> RowDraw:
    work = row.work
    if row.chunk is not None:
        return prefill_draw(work.session, row.chunk)
    return round_draw(work.session, work.draft_token_ids, work.draft_parents, work.draft_dists)
