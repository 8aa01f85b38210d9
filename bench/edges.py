"""The edges' drafters: real draft models in this process, or simulated ones (bench/simulated.py).

Either way each edge has one drafter for all its answers, and knows how long
it spent drafting (its `busy_s`): what an edge is billed for.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from specedge.edge_client.drafting.base import (
    CoupledSampling,
    DraftChain,
    Drafter,
    DraftSampling,
    DraftTree,
    TreeBudget,
    TreeDrafter,
)

from .simulated import AcceptanceProfile, AnswerScript, SimulatedDrafter, make_script


@dataclasses.dataclass(frozen=True)
class DraftCall:
    context: tuple[int, ...]
    chain: DraftChain
    seconds: float


class TimedDrafter:
    """A real drafter that adds up the time it drafts; with `record`, keeps every call (for `profile`)."""

    def __init__(self, inner: Drafter, record: bool = False):
        self.inner = inner
        self.fingerprint = inner.fingerprint
        self.busy_s = 0.0
        self.calls: list[DraftCall] | None = [] if record else None

    def propose(
        self,
        context: Sequence[int],
        num_tokens: int,
        sampling: DraftSampling | CoupledSampling | None = None,
        min_prob: float = 0.0,
    ) -> DraftChain:
        started = time.perf_counter()
        chain = self.inner.propose(context, num_tokens, sampling, min_prob)
        seconds = time.perf_counter() - started
        self.busy_s += seconds
        if self.calls is not None:
            self.calls.append(DraftCall(tuple(context), chain, seconds))
        return chain

    def close(self) -> None:
        self.inner.close()


class TimedTreeDrafter(TimedDrafter):
    """A real tree drafter, timed: still a TreeDrafter, so answers can draft trees with it."""

    inner: TreeDrafter

    def __init__(self, inner: TreeDrafter, record: bool = False):
        super().__init__(inner, record)
        self.inner = inner

    def propose_tree(self, context: Sequence[int], budget: TreeBudget, min_prob: float = 0.0) -> DraftTree:
        started = time.perf_counter()
        try:
            return self.inner.propose_tree(context, budget, min_prob)
        finally:
            self.busy_s += time.perf_counter() - started


def timed(inner: Drafter, record: bool = False) -> TimedDrafter:
    """`inner`, timed; a tree drafter stays one."""
    return TimedTreeDrafter(inner, record) if isinstance(inner, TreeDrafter) else TimedDrafter(inner, record)


def real_drafters(draft: str, count: int, threads: int) -> list[TimedDrafter]:
    from specedge.edge_client.drafting import load_drafter
    from specedge.registry import resolve

    resolved = resolve(draft)
    options = {"n_threads": threads} if resolved.format == "gguf" else {}
    return [timed(load_drafter(resolved, **options)) for _ in range(count)]


def simulated_drafters(
    fingerprint, count: int, profile: AcceptanceProfile, answers: Sequence[tuple[list[int], list[int], str]], seed: int
) -> list[SimulatedDrafter]:
    """One drafter per edge, each holding a script for every (prompt ids, reference answer, category).

    Every edge gets the same scripts: a prompt's drafts are right at the same
    positions whichever edge asks it, in every mode and cell.
    """
    scripts: list[AnswerScript] = [
        make_script(prompt, reference, profile.category(category), seed=seed + i)
        for i, (prompt, reference, category) in enumerate(answers)
    ]
    return [
        SimulatedDrafter(
            fingerprint, scripts, s_per_call=profile.draft_s_per_call, s_per_token=profile.draft_s_per_token
        )
        for _ in range(count)
    ]
