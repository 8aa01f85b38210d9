"""Simulated edges: drafts with a recorded acceptance behaviour, against the real target.

How a simulated edge knows what the target will say
---------------------------------------------------
Verification is lossless: a greedy answer is the target's own greedy answer,
and a seeded sampled answer verified by matching samples is the target's own
seeded sample, whatever the drafts. So the benchmark first has the server
generate every prompt alone (the *reference* pass, which also warms it up),
and a simulated edge then knows the target's next token at every position of
every answer without running any model. It needs no GPU and no weights, and
it takes no compute from the server: this is how a random-weight 7B target is
benchmarked with the acceptance of a real draft model.

Which drafts it gets right
--------------------------
For each answer, a *script* decides once, position by position, whether the
draft model would have predicted the target's token there given the right
prefix. It follows the profile's per-depth acceptance as a run-length chain:
after r correct positions in a row, the next is correct with probability
acceptance[r] (the last entry repeats). A round that starts after a rejection
is therefore accepted to depth d with exactly the profile's probabilities;
profile [1, 1, 0] accepts exactly 2 tokens of every 3-token round. Where the
draft is wrong, its runner-up is the target's token with the profile's
runner-up hit rate (what proactive guesses feed on). The confidence a chain
reports is the profile's acceptance at that depth, never whether the token is
right: proactive drafting gets no oracle.

Caveats (also in bench/README.md)
---------------------------------
- Needs an answer identical to the reference. A greedy tie decided
  differently by batched rounding (README, "Lossless") makes the rest of that
  answer unknown to the edge, whose drafts then all miss; every record counts
  answers not identical to the reference, so this shows.
- Sampled (temperature > 0) runs verify by matching samples (no rejection
  sampling: a simulated draft has no distribution q to send).
- Draft latency is the profile's measured time per call and per token, slept
  in the drafting thread; an edge's busy time is that sleep.
- Trees are not simulated (chains only).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import threading
import time
from collections.abc import Mapping, Sequence

from specedge.edge_client.drafting.base import CoupledSampling, DraftChain, DraftSampling
from specedge.tokens import TokenizerFingerprint

ALL = "all"  # the profile entry for categories without one of their own


@dataclasses.dataclass(frozen=True)
class CategoryProfile:
    # acceptance[d]: P(the draft at depth d + 1 is accepted | depths 1..d were), d = 0..K-1
    acceptance: tuple[float, ...]
    runner_up_hit: float = 0.0  # P(the draft's runner-up is the target's token | the draft was rejected)
    rounds: int = 0  # measured rounds behind these numbers

    def __post_init__(self):
        if not self.acceptance or not all(0.0 <= a <= 1.0 for a in self.acceptance):
            raise ValueError(f"acceptance must be a non-empty list of probabilities, got {self.acceptance}")
        if not 0.0 <= self.runner_up_hit <= 1.0:
            raise ValueError(f"runner_up_hit must be a probability, got {self.runner_up_hit}")

    def at_run(self, run: int) -> float:
        return self.acceptance[min(run, len(self.acceptance) - 1)]


@dataclasses.dataclass(frozen=True)
class AcceptanceProfile:
    """Per-category acceptance of a draft/target pair and the draft's speed, as `profile` recorded them."""

    draft: str
    target: str
    categories: Mapping[str, CategoryProfile]
    draft_s_per_call: float = 0.0  # fixed cost of one propose() call
    draft_s_per_token: float = 0.0
    meta: Mapping[str, object] = dataclasses.field(default_factory=dict)  # how it was measured

    def __post_init__(self):
        if ALL not in self.categories:
            raise ValueError(f"a profile needs an {ALL!r} entry (the fallback category)")
        if min(self.draft_s_per_call, self.draft_s_per_token) < 0:
            raise ValueError("draft latencies must be >= 0")

    def category(self, name: str) -> CategoryProfile:
        return self.categories.get(name, self.categories[ALL])

    def to_json(self) -> dict:
        return {
            "draft": self.draft,
            "target": self.target,
            "draft_s_per_call": self.draft_s_per_call,
            "draft_s_per_token": self.draft_s_per_token,
            "categories": {name: dataclasses.asdict(c) for name, c in self.categories.items()},
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, data: dict) -> AcceptanceProfile:
        categories = {
            name: CategoryProfile(tuple(c["acceptance"]), c.get("runner_up_hit", 0.0), c.get("rounds", 0))
            for name, c in data["categories"].items()
        }
        return cls(
            data["draft"],
            data["target"],
            categories,
            data.get("draft_s_per_call", 0.0),
            data.get("draft_s_per_token", 0.0),
            data.get("meta", {}),
        )

    @classmethod
    def load(cls, path: str | pathlib.Path) -> AcceptanceProfile:
        try:
            return cls.from_json(json.loads(pathlib.Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read acceptance profile {path}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class AnswerScript:
    """What a simulated draft gets right along one reference answer."""

    prompt: tuple[int, ...]
    reference: tuple[int, ...]  # the target's answer
    correct: tuple[bool, ...]  # per answer position: the draft predicts reference[p] given the right prefix
    runner_up_hit: tuple[bool, ...]  # per position where the draft is wrong: its runner-up is reference[p]
    confidence: tuple[float, ...]  # the draft probability reported at each position
    runner_up_share: float  # of a draft's rejected probability mass, what its runner-up reports


def make_script(prompt: Sequence[int], reference: Sequence[int], profile: CategoryProfile, seed: int) -> AnswerScript:
    rng = random.Random(seed)
    # The first token comes from the server's prefill, never from a draft: like
    # a bonus token after a rejection, drafting starts after it at run length 0.
    correct, runner_up, confidence = [False], [False], [profile.at_run(0)]
    run = 0
    for _ in reference[1:]:
        p = profile.at_run(run)
        ok = rng.random() < p
        correct.append(ok)
        runner_up.append(not ok and rng.random() < profile.runner_up_hit)
        confidence.append(p)
        run = run + 1 if ok else 0
    n = len(reference)
    return AnswerScript(
        tuple(prompt),
        tuple(reference),
        tuple(correct[:n]),
        tuple(runner_up[:n]),
        tuple(confidence[:n]),
        profile.runner_up_hit,
    )


class SimulatedDrafter:
    """A `Drafter` that replays scripts; one per simulated edge (like a real drafter, one answer at a time)."""

    def __init__(
        self,
        fingerprint: TokenizerFingerprint,
        scripts: Sequence[AnswerScript],
        *,
        s_per_call: float = 0.0,
        s_per_token: float = 0.0,
    ):
        self.fingerprint = fingerprint
        self._scripts = list(scripts)
        self._s_per_call, self._s_per_token = s_per_call, s_per_token
        self._lock = threading.Lock()
        self.busy_s = 0.0  # simulated drafting time, for the edges' bill
        self._last: AnswerScript | None = None

    def propose(
        self,
        context: Sequence[int],
        num_tokens: int,
        sampling: DraftSampling | CoupledSampling | None = None,
        min_prob: float = 0.0,
    ) -> DraftChain:
        # Coupled drafts are verified by matching, like greedy ones: the script stands in for either.
        if isinstance(sampling, DraftSampling):
            raise ValueError("simulated edges verify by matching samples: turn rejection sampling off")
        script = self._script_for(context)
        answer = list(context[len(script.prompt) :])
        # Right so far only if the context is the reference's own prefix (a wrong guess or draft is not).
        on_track = answer == list(script.reference[: len(answer)])
        token_ids, probs, runner_ups, runner_up_probs = [], [], [], []
        for position in range(len(answer), len(answer) + num_tokens):
            known = position < len(script.reference)
            confidence = script.confidence[position] if known else 0.0
            if confidence < min_prob:
                break
            truth = script.reference[position] if known else None
            if on_track and truth is not None and script.correct[position]:
                token, runner_up = truth, _other_than(truth, 1, self.fingerprint)
            else:
                token = _other_than(truth, 1, self.fingerprint)
                hit = on_track and known and script.runner_up_hit[position]
                runner_up = truth if hit and truth is not None else _other_than(truth, 2, self.fingerprint)
                on_track = False
            token_ids.append(token)
            probs.append(confidence)
            runner_ups.append(runner_up)
            runner_up_probs.append((1.0 - confidence) * script.runner_up_share)
        delay = self._s_per_call + self._s_per_token * len(token_ids)
        if delay:
            time.sleep(delay)
            with self._lock:
                self.busy_s += delay
        return DraftChain(tuple(token_ids), tuple(probs), None, tuple(runner_ups), tuple(runner_up_probs))

    def close(self) -> None:
        self._scripts = []

    def _script_for(self, context: Sequence[int]) -> AnswerScript:
        # Calls come answer by answer: the last script found is almost always the one.
        for script in ([self._last] if self._last else []) + self._scripts:
            n = len(script.prompt)
            if len(context) >= n and tuple(context[:n]) == script.prompt:
                self._last = script
                return script
        raise ValueError("simulated edge asked to draft for a prompt it has no reference answer for")


def _other_than(token: int | None, offset: int, fingerprint: TokenizerFingerprint) -> int:
    """A valid token id that is not `token` (a draft the target rejects), never an end-of-sequence id."""
    candidate = ((token or 0) + offset) % fingerprint.num_tokens
    while candidate == token or candidate in fingerprint.eos_token_ids:
        candidate = (candidate + 1) % fingerprint.num_tokens
    return candidate
