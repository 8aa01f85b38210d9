"""Proactive drafting: draft the next round while this one is being verified.

While a chain is in flight, the edge guesses how the server will answer and
drafts on from each guess, likeliest first:

    draft a b c, draft probabilities .9 .8 .3, runner-ups x y z (.05 .1 .5)
    all accepted, then the drafter's own next token d:  .9 * .8 * .3      = .216
    a b accepted, z instead of c (c's runner-up):       .9 * .8 * .5      = .360
    a accepted, y instead of b:                         .9 * .1           = .090
    -> draft after "a b z" first, then after "a b c d", then after "a y"

When the reply lands, the pending guess is abandoned (the worker stops
between two tokens). If the committed tokens match a guess, its drafts go out
at once; on a miss they are dropped, and the drafter's KV simply rolls back
to the common prefix on the next call (no re-prefill).

How far ahead to draft follows the measured wait: no point drafting 8 tokens
ahead when the reply comes back in the time of 2.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence

from specedge.edge_client.drafting.base import ChainBuilder, CoupledSampling, DraftChain, Drafter, DraftSampling

log = logging.getLogger(__name__)


class DraftWorker:
    """The one thread a generation drafts on (drafters are not thread-safe); the event loop never drafts."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specedge-draft")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def close(self) -> None:
        """Wait (off the event loop) for a draft still running, e.g. after a cancel: the drafter is then free."""
        await asyncio.to_thread(self._executor.shutdown, True)


@dataclasses.dataclass(frozen=True)
class Guess:
    """One outcome of verifying a chain: `num_accepted` drafts, then the server's token `bonus`."""

    num_accepted: int
    bonus: int | None  # None: all drafts accepted, and the bonus is the drafter's own next token
    prob: float


def guess_outcomes(draft: DraftChain, max_guesses: int) -> list[Guess]:
    """The likeliest verify outcomes of `draft`, taking draft probabilities as acceptance estimates."""
    guesses = []
    prefix_prob = 1.0
    for position, prob in enumerate(draft.probs):
        if position < len(draft.runner_up_ids):  # cut here: the target picks the draft's second choice
            guesses.append(
                Guess(position, draft.runner_up_ids[position], prefix_prob * draft.runner_up_probs[position])
            )
        prefix_prob *= prob
    guesses.append(Guess(len(draft.token_ids), None, prefix_prob))
    guesses.sort(key=lambda guess: -guess.prob)
    return guesses[:max_guesses]


@dataclasses.dataclass
class PreDraft:
    committed: tuple[int, ...]  # the tokens the guess says the server commits
    chain: DraftChain  # drafted after them
    draft_s: float  # drafting time spent on `chain`


class DepthEstimator:
    """How many tokens fit in one round's wait: the smoothed wait over the smoothed time per draft token."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing = smoothing
        self.wait_s: float | None = None
        self.token_s: float | None = None

    def observe_wait(self, seconds: float) -> None:
        self.wait_s = seconds if self.wait_s is None else self.wait_s + self.smoothing * (seconds - self.wait_s)

    def observe_draft(self, seconds: float, num_tokens: int) -> None:
        if num_tokens:
            per_token = seconds / num_tokens
            self.token_s = (
                per_token if self.token_s is None else self.token_s + self.smoothing * (per_token - self.token_s)
            )

    def tokens_per_wait(self, cap: int) -> int:
        """At least 1 (nothing measured yet, or a fast wait still hides one token), at most `cap`."""
        if self.wait_s is None or not self.token_s:
            return cap
        return max(1, min(cap, math.floor(self.wait_s / self.token_s)))


class ProactiveRound:
    """Drafting ahead for one in-flight round; `start` it, then `finish` it when the reply lands."""

    def __init__(self, worker: DraftWorker, sampling: DraftSampling | CoupledSampling | None, min_prob: float):
        self._worker = worker
        self._sampling = sampling
        self._min_prob = min_prob
        self._stop = threading.Event()
        self._predrafts: list[PreDraft] = []
        self._job: asyncio.Future | None = None

    def start(self, context: Sequence[int], draft: DraftChain, guesses: list[Guess], depth: int) -> None:
        self._job = asyncio.ensure_future(self._worker.run(self._draft_ahead, list(context), draft, guesses, depth))

    async def finish(self, committed: Sequence[int]) -> PreDraft | None:
        """Abandon what is still being drafted; the pre-draft made for exactly `committed`, if any."""
        self._stop.set()
        if self._job is not None:
            try:
                await self._job
            except Exception:  # the next draft, on the critical path, will meet the same failure and fall back
                log.warning("drafting ahead failed", exc_info=True)
                return None
        return next((p for p in self._predrafts if p.committed == tuple(committed)), None)

    @property
    def predrafts(self) -> list[PreDraft]:
        return self._predrafts

    def _draft_ahead(self, context: list[int], draft: DraftChain, guesses: list[Guess], depth: int) -> None:
        """Worker thread: for each guess in turn, draft `depth` tokens past it, one token per call."""
        for guess in guesses:
            committed = list(draft.token_ids[: guess.num_accepted])
            started = time.perf_counter()
            if guess.bonus is None:  # the drafter's next token stands in for the server's bonus
                bonus = self._extend(context + committed, DraftChain((), ()))
                if bonus is None:
                    return  # the reply is in: abandon
                if not bonus.token_ids:
                    continue  # the drafter is unsure of its next token (min_prob): no guess to draft after
                committed.append(bonus.token_ids[0])
            else:
                committed.append(guess.bonus)
            predraft = PreDraft(tuple(committed), ChainBuilder(self._sampling).build(), 0.0)
            self._predrafts.append(predraft)
            while len(predraft.chain.token_ids) < depth:
                longer = self._extend(context + committed, predraft.chain)
                if longer is None:
                    return  # the reply is in: abandon
                if len(longer.token_ids) == len(predraft.chain.token_ids):
                    break  # confidence fell below min_prob (or the context is full)
                predraft.chain = longer
                predraft.draft_s = time.perf_counter() - started

    def _extend(self, context: list[int], chain: DraftChain) -> DraftChain | None:
        """`chain` plus one more draft token; None once the round is over."""
        if self._stop.is_set():
            return None
        step = self._worker.drafter.propose([*context, *chain.token_ids], 1, self._sampling, self._min_prob)
        return concat(chain, step)


def concat(first: DraftChain, second: DraftChain) -> DraftChain:
    dists = None if first.dists is None or second.dists is None else first.dists + second.dists
    return DraftChain(
        first.token_ids + second.token_ids,
        first.probs + second.probs,
        dists,
        first.runner_up_ids + second.runner_up_ids,
        first.runner_up_probs + second.runner_up_probs,
    )
