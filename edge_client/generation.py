"""One answer, start to finish: speculative rounds, proactive drafting, resuming, falling back.

The speculative loop, in full:

    open the session (or continue the conversation's): the server prefills, returns its first token
    repeat: draft k tokens after everything committed so far (or take what was drafted ahead)
            send them; while they are verified, draft ahead from the likeliest outcomes
            append the accepted drafts + the server's own token; stop on a finish reason
    close the session (a conversation keeps it for the next turn)

A lost session or connection re-opens the session with every committed token
as its prompt, so the answer goes on with nothing lost or repeated (the
client reconnects only when the connection itself broke, once for all the
answers that share it). A
draft model that fails (or, if asked, drafts slower than the server decodes
alone) hands the rest of the answer to the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Sequence

from specedge.edge_client.client import (
    ConnectionLost,
    EdgeClient,
    EdgeError,
    Lost,
    SessionGone,
)
from specedge.edge_client.drafting.base import (
    ChainBuilder,
    CoupledSampling,
    DraftChain,
    Drafter,
    DraftSampling,
    DraftTree,
    TreeDrafter,
)
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.proactive import DepthEstimator, DraftWorker, ProactiveRound, concat, guess_outcomes
from specedge.edge_client.results import Conversation, GenerationResult, GenerationStats
from specedge.edge_client.rounds import DraftRound, RoundReply
from specedge.types import FinishReason, SamplingParams, SparseDist

log = logging.getLogger(__name__)

# A callback gets each batch of committed tokens; returning True stops the answer there (a stop string).
TokenCallback = Callable[[Sequence[int]], "bool | None"]

SLOW_FALLBACK_MIN_ROUNDS = 4  # rounds measured before deciding drafting does not pay
# Sessions lost in a row with no token committed in between before the answer gives up: a server that
# answers the handshake but refuses every session (draining, with nowhere else to go) must not loop forever.
MAX_FRUITLESS_RECOVERIES = 3
# How often an answer being resumed asks again a server that has no room for its new session: its lost connection's
# own sessions may hold the room until the server finds that connection dead (by its pings, within 30 s).
ROOM_RETRY_S = 1.0


async def generate(
    client: EdgeClient,
    prompt: Sequence[int],
    drafter: Drafter | None,
    on_tokens: TokenCallback = lambda tokens: None,
    *,
    policy: SpeculationPolicy = SpeculationPolicy(),
    conversation: Conversation | None = None,
    stats: GenerationStats | None = None,
) -> GenerationResult:
    """One answer on `client`: speculative with `drafter`, or server-only when it is None.

    `conversation` keeps the server session for the next turn; `stats` is filled in as the answer goes,
    for a caller that shows live figures.
    """
    return await Generation(client, prompt, drafter, on_tokens, conversation, policy, stats).run()


class _FallBack(Exception):
    """Drafting cannot go on; the rest of the answer is the server's alone."""


class Generation:
    def __init__(
        self,
        client: EdgeClient,
        prompt: Sequence[int],
        drafter: Drafter | None,
        on_tokens: TokenCallback,
        conversation: Conversation | None,
        policy: SpeculationPolicy,
        stats: GenerationStats | None = None,
    ):
        self.client, self.policy = client, policy
        self.prompt = list(prompt)
        self.drafter = drafter
        self.on_tokens = on_tokens
        self.conversation = conversation
        self.tokens: list[int] = []  # committed in this answer
        self.finish = FinishReason.NONE
        self.stats = stats if stats is not None else GenerationStats()  # a caller's: read live while streaming
        self.session_id: str | None = None
        self._session_base = 0  # answer tokens that were the current session's prompt (after a resume)
        self._advised = 0
        self._max_draft = self.policy.num_draft
        self._draft_sampling = _draft_sampling(policy)
        self._depth = DepthEstimator()
        self._server_ms_per_round: float | None = None  # smoothed, for the slow-draft fallback
        self._max_draft_nodes = 0  # the server's limit, learnt when the session opens
        self._fruitless_recoveries = 0  # since the last committed token
        self._lost_at: float | None = None  # when the session being resumed was lost (None: not resuming)

    async def run(self) -> GenerationResult:
        started = time.perf_counter()
        drafter = self.drafter if self.policy.num_draft > 0 or self.policy.tree is not None else None
        if self.policy.tree is not None and self.drafter is not None and not isinstance(self.drafter, TreeDrafter):
            raise EdgeError("tree drafting needs a drafter that drafts trees (the torch drafter); use chains")
        kept_by: Conversation | None = None  # the conversation that keeps the session for its next turn
        try:
            if drafter is not None:
                try:
                    await self._speculative(started, drafter)
                except _FallBack as exc:
                    self.stats.fallback = str(exc)
                    log.warning("falling back to server-only generation: %s", exc)
                    await self._close_session()
            if self.finish is FinishReason.NONE:
                await self._server_only(started)
            kept_by = self.conversation if self.session_id is not None else None
        finally:
            if kept_by is not None:
                kept_by.session_id = self.session_id
                kept_by.tokens = [*self.prompt, *self.tokens]
            else:
                await self._close_session()
                if self.conversation is not None:
                    self.conversation.reset()
        self.stats.num_tokens, self.stats.total_ms = len(self.tokens), (time.perf_counter() - started) * 1e3
        return GenerationResult(self.tokens, self.finish, self.stats)

    # -- speculative -------------------------------------------------------

    async def _speculative(self, started: float, drafter: Drafter) -> None:
        worker = DraftWorker(drafter)
        ready: DraftChain | None = None  # drafted ahead for the outcome that came true
        try:
            while self.finish is FinishReason.NONE:
                try:
                    if self.session_id is None:  # the first, or a lost one again with every committed token
                        await self._open(started)
                    else:
                        ready = await self._round(self.session_id, worker, ready)
                except Lost as exc:
                    ready = None
                    await self._recover(exc)
                except EdgeError as exc:
                    if not await self._room_for_resuming(exc):
                        raise
        finally:
            await worker.close()

    async def _round(self, session_id: str, worker: DraftWorker, ready: DraftChain | None) -> DraftChain | None:
        """One verify round; returns the next round's chain if it was drafted ahead and came true."""
        context = [*self.prompt, *self.tokens]
        draft, chain = await self._draft(worker, context, ready)
        proactive = None
        if chain is not None and chain.token_ids and self.policy.proactive:
            proactive = ProactiveRound(worker, self._draft_sampling, self.policy.draft_p_min)
            depth = self._depth.tokens_per_wait(cap=max(1, self._wanted_draft()))
            proactive.start(context, chain, guess_outcomes(chain, self.policy.max_guesses), depth)
        sent = time.perf_counter()
        try:
            reply = await self.client.verify(session_id, draft)
        except BaseException:
            if proactive is not None:
                await proactive.finish(())  # the drafter must be idle before anything else uses it
            raise
        wait_s = time.perf_counter() - sent
        self._depth.observe_wait(wait_s)
        self.stats.wait_ms += wait_s * 1e3
        predraft = None
        if proactive is not None:
            stopping = time.perf_counter()
            predraft = await proactive.finish(reply.token_ids)  # the drafter ends its step: the answer waits
            self.stats.visible_draft_ms += (time.perf_counter() - stopping) * 1e3
            if reply.finish is not FinishReason.NONE:
                predraft = None  # no next round to use it in
            elif predraft is not None and not predraft.chain.token_ids:
                predraft = None  # guessed right, but the reply came before anything was drafted
            self.stats.proactive_rounds += 1
            self.stats.proactive_hits += predraft is not None
        self._commit_round(draft, reply)
        if self.finish is FinishReason.NONE:  # a finished answer is no fallback, and keeps its session
            self._check_speed(reply)
        if predraft is None or self.finish is not FinishReason.NONE:
            return None
        used = min(len(predraft.chain.token_ids), self._wanted_draft())
        self.stats.hidden_draft_ms += predraft.draft_s * 1e3 * used / len(predraft.chain.token_ids)
        return predraft.chain

    def _wanted_draft(self) -> int:
        return min(self._max_draft, self._advised) if self.policy.follow_advice else self._max_draft

    async def _draft(self, worker: DraftWorker, context: list[int], ready: DraftChain | None):
        """This round's drafts, and its chain (None for a tree)."""
        drafted = time.perf_counter()
        try:
            if self.policy.tree is not None:
                tree = await self._draft_tree(worker, context)
                dists: tuple[SparseDist, ...] = ()
                chain, token_ids, parents = None, tree.token_ids, tree.parents
            else:
                chain = await self._draft_chain(worker, context, ready)
                token_ids, parents, dists = chain.token_ids, (), chain.dists or ()
        except Exception as exc:  # a broken draft model must not end the answer
            raise _FallBack(f"the draft model failed: {type(exc).__name__}: {exc}") from exc
        draft_s = time.perf_counter() - drafted
        self.stats.visible_draft_ms += draft_s * 1e3
        if ready is None:
            self._depth.observe_draft(draft_s, len(token_ids))
        num_generated = len(self.tokens) - self._session_base
        return DraftRound(token_ids, num_generated, parents, dists), chain

    async def _draft_chain(self, worker: DraftWorker, context: list[int], ready: DraftChain | None) -> DraftChain:
        # Advice 0 means drafting does not pay right now: the round carries no
        # drafts and the server decodes one token itself.
        wanted = self._wanted_draft()
        chain = ready if ready is not None else ChainBuilder(self._draft_sampling).build()
        chain = _truncate(chain, wanted)
        if len(chain.token_ids) < wanted:
            more = await worker.run(
                worker.drafter.propose,
                [*context, *chain.token_ids],
                wanted - len(chain.token_ids),
                self._draft_sampling,
                self.policy.draft_p_min,
            )
            chain = concat(chain, more)
        return chain

    async def _draft_tree(self, worker: DraftWorker, context: list[int]) -> DraftTree:
        budget, drafter = self.policy.tree, self.drafter
        # The advice follows this session's share of the server's step: nodes past it would be cut.
        max_nodes = min(self._max_draft_nodes, self._advised) if self.policy.follow_advice else self._max_draft_nodes
        # run() refused a tree policy for a drafter that drafts only chains.
        if budget is None or not isinstance(drafter, TreeDrafter) or max_nodes == 0:
            return DraftTree((), (), ())
        if budget.max_nodes > max_nodes:
            budget = dataclasses.replace(budget, max_nodes=max_nodes)
        return await worker.run(drafter.propose_tree, context, budget, self.policy.draft_p_min)

    def _commit_round(self, draft: DraftRound, reply: RoundReply) -> None:
        self.stats.rounds += 1
        self.stats.draft_tokens += len(draft.token_ids)
        self.stats.accepted_tokens += len(reply.accepted_nodes)
        verified = len(draft.token_ids) if reply.num_verified_nodes is None else reply.num_verified_nodes
        self.stats.cut_nodes += len(draft.token_ids) - verified
        self._advised = reply.advised_draft_tokens
        self._commit(reply.token_ids, reply.finish)

    def _check_speed(self, reply: RoundReply) -> None:
        """Fall back when the measured speculative time per token exceeds the server's time per round."""
        if not self.policy.slow_draft_fallback or not reply.token_ids:
            return
        # Server-only decoding costs about one step per token (no round trip);
        # a round's step carries more tokens, so this errs towards drafting.
        spec_ms = (self.stats.visible_draft_ms + self.stats.wait_ms) / max(1, len(self.tokens) - 1)
        server_ms = reply.timing.forward_ms + reply.timing.queue_ms
        previous = self._server_ms_per_round
        self._server_ms_per_round = server_ms if previous is None else 0.7 * previous + 0.3 * server_ms
        if self.stats.rounds >= SLOW_FALLBACK_MIN_ROUNDS and spec_ms > self._server_ms_per_round:
            raise _FallBack(
                f"drafting is slower than the server alone ({spec_ms:.0f} ms per token with drafts, "
                f"the server takes {self._server_ms_per_round:.0f} ms per token)"
            )

    # -- sessions ----------------------------------------------------------

    async def _open(self, started: float) -> None:
        """Open a session for the prompt, or continue the conversation's with only the new tokens."""
        remaining = self.policy.max_new_tokens - len(self.tokens)
        prompt = [*self.prompt, *self.tokens]
        opened = None
        if self.conversation is not None and self.conversation.session_id is not None:
            opened = await self._continue(self.conversation, self.conversation.session_id, prompt, remaining)
        if opened is None:
            opened = await self.client.open_session(prompt, remaining, *self._sampling())
        self.session_id = opened.session_id
        self._session_base = len(self.tokens)
        self._advised = opened.advised_draft_tokens
        self._max_draft = min(self.policy.num_draft, opened.limits.max_draft_tokens)
        self._max_draft_nodes = opened.limits.max_draft_tokens
        # A q sent for rejection sampling is no wider than the server accepts.
        if isinstance(self._draft_sampling, DraftSampling) and opened.limits.max_draft_prob_tokens:
            top_k = min(self._draft_sampling.top_k, opened.limits.max_draft_prob_tokens)
            self._draft_sampling = dataclasses.replace(self._draft_sampling, top_k=top_k)
        if not self.tokens:
            self.stats.ttft_ms = (time.perf_counter() - started) * 1e3
        self._commit([opened.first_token_id], opened.finish)

    async def _continue(self, conversation: Conversation, session_id: str, prompt: list[int], remaining: int):
        """The conversation's session continued with only the new tokens; None when it cannot be, its slot freed.

        Every way out that leaves the session behind closes it: otherwise it holds its KV slot until the
        server's idle timeout, and counts against this identity's cap on open sessions.
        """
        keep = min(_common_prefix(conversation.tokens, prompt), len(prompt) - 1)  # run >= 1 token, for logits
        if keep > 0:
            try:
                return await self.client.continue_session(session_id, keep, prompt[keep:], remaining, *self._sampling())
            except SessionGone:  # expired while the user was typing: start over with the whole history
                conversation.reset()
                return None
            except ConnectionLost:
                raise  # the session went with the connection's lease
            except EdgeError:  # refused (e.g. the conversation outgrew the context): the answer fails
                await self._drop_conversation_session(conversation, session_id)
                raise
        await self._drop_conversation_session(conversation, session_id)  # nothing to reuse: a fresh one replaces it
        return None

    async def _drop_conversation_session(self, conversation: Conversation, session_id: str) -> None:
        await self.client.close_session(session_id)
        conversation.reset()

    async def _recover(self, lost: Lost) -> None:
        """After a lost session or connection: ready the client (it decides whether to reconnect) to re-open."""
        self._fruitless_recoveries += 1
        if self._fruitless_recoveries > MAX_FRUITLESS_RECOVERIES:
            raise lost
        log.warning("lost the session (%s); resuming", lost)
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        self.stats.resumes += 1
        self.session_id = None
        if self.conversation is not None:
            self.conversation.reset()  # its session is the one lost
        await self.client.recover(lost)

    async def _close_session(self) -> None:
        if self.session_id is not None:
            await self.client.close_session(self.session_id)
            self.session_id = None

    async def _server_only(self, started: float) -> None:
        """The server decodes the rest alone (from the start, or after a fallback), resuming if the stream breaks."""
        while self.finish is FinishReason.NONE:
            prompt = [*self.prompt, *self.tokens]
            remaining = self.policy.max_new_tokens - len(self.tokens)
            stream = self.client.generate_stream(prompt, remaining, *self._sampling(), self.policy.server_draft_tokens)
            try:
                async with contextlib.aclosing(stream):  # leaving early (a stop string) cancels the call
                    async for reply in stream:
                        if not self.tokens:
                            self.stats.ttft_ms = (time.perf_counter() - started) * 1e3
                        elif reply.token_ids:
                            self.stats.rounds += 1
                        self._commit(reply.token_ids, reply.finish)
                        if self.finish is not FinishReason.NONE:
                            break
            except Lost as exc:
                await self._recover(exc)
            except EdgeError as exc:
                if not await self._room_for_resuming(exc):
                    raise

    async def _room_for_resuming(self, refused: EdgeError) -> bool:
        """Whether to ask again after `refused`: an answer being resumed that the server has no room for waits
        ROOM_RETRY_S and tries again, until the reconnect timeout since the loss; a new answer is told at once."""
        if refused.status != "RESOURCE_EXHAUSTED" or self._lost_at is None:
            return False
        if time.monotonic() + ROOM_RETRY_S > self._lost_at + self.client.config.reconnect_timeout_s:
            return False
        log.info("no room yet on the server to resume (%s); asking again", refused)
        await asyncio.sleep(ROOM_RETRY_S)
        return True

    def _sampling(self) -> tuple[SamplingParams, int | None]:
        return self.policy.sampling, self.policy.seed

    def _commit(self, token_ids: Sequence[int], finish: FinishReason) -> None:
        if token_ids:
            self._fruitless_recoveries = 0
            self._lost_at = None
        self.tokens += token_ids
        self.finish = finish
        if self.on_tokens(token_ids) and self.finish is FinishReason.NONE:
            self.finish = FinishReason.STOP  # the caller saw a stop string


def _draft_sampling(policy: SpeculationPolicy) -> DraftSampling | CoupledSampling | None:
    """How a chain's drafts are drawn, which decides how the server verifies them.

    Greedy requests draft greedily. A seeded sampled request drafts coupled to
    the target's noise and sends no q: the server matches its own seeded
    samples, so the answer is the seeded server-only answer whatever the
    drafts, the load or the batch. An unseeded one samples from q and sends it
    for rejection sampling, which accepts more (or, with rejection sampling
    off, drafts greedily for matching).
    """
    if policy.sampling.greedy:
        return None
    if policy.seed is not None:
        return CoupledSampling(policy.sampling, policy.seed)  # the seed the server samples with (_sampling)
    if policy.rejection_sampling:
        return DraftSampling(policy.sampling.temperature, policy.draft_top_k, secrets.randbits(63))
    return None


def _truncate(chain: DraftChain, num_tokens: int) -> DraftChain:
    return DraftChain(
        chain.token_ids[:num_tokens],
        chain.probs[:num_tokens],
        None if chain.dists is None else chain.dists[:num_tokens],
        chain.runner_up_ids[:num_tokens],
        chain.runner_up_probs[:num_tokens],
    )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
