"""The server's counters and gauges: a plain object the engine feeds through `observe_*`.

Exporters (Prometheus, see server/metrics.py) read it; nothing here knows
about them. Meanings follow vLLM where they overlap:

- a *draft* is one verify round that carried at least one draft token;
- acceptance rate = num_accepted_tokens / num_draft_tokens;
- mean acceptance length = 1 + num_accepted_tokens / num_drafts;
- num_accepted_tokens_per_pos[i]: rounds whose draft token at depth i+1 was
  accepted (for trees: the accepted path's depth).

Fair shares (scheduler/batcher.py): *verified tokens* are what the target ran
for an identity's rounds (each round's pending token and the draft nodes it
verified); *cut nodes* are draft nodes dropped because a round exceeded its
share of a step. They are kept per identity only when the operator asks
(`per_identity`): identities may be sensitive, and without tokens every
connection is one.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import threading


@dataclasses.dataclass
class Histogram:
    """Histogram with per-bucket counts (the last bucket is +Inf); exporters accumulate them."""

    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[index] += 1
        self.total += value
        self.count += 1


_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class ServerStats:
    """Thread-safe: the engine thread and the event loop both report."""

    def __init__(self, per_identity: bool = False):
        self._lock = threading.Lock()
        self.per_identity = per_identity
        self.num_verified_tokens = 0
        self.num_cut_nodes = 0
        self.num_holds = 0  # steps held for rounds due back from edges (scheduler/gather.py)
        self.hold_s = 0.0
        self.num_hold_misses = 0  # identities whose awaited round did not come
        self.verified_tokens_by_identity: collections.Counter[str] = collections.Counter()
        self.cut_nodes_by_identity: collections.Counter[str] = collections.Counter()
        self.step_budget_tokens = 0
        self.step_cost_fixed_s = 0.0  # the measured curve: a step takes fixed + per_token * tokens seconds
        self.step_cost_per_token_s = 0.0
        self.step_cost_knee_tokens = 0  # 0: unknown, or tokens are free
        self.step_cost_points: list[tuple[float, float]] = []  # (mean tokens, mean forward seconds) per bucket
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: collections.Counter[int] = collections.Counter()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_rounds = 0  # verify rounds, drafts or not
        self.num_steps = 0
        self.active_sessions = 0
        self.kv_slots_used = 0
        self.kv_slots_free = 0
        self.queue_wait_s = Histogram(_SECONDS)
        self.forward_s = Histogram(_SECONDS)
        self.schedule_s = Histogram(_SECONDS)
        self.postprocess_s = Histogram(_SECONDS)
        self.batch_size = Histogram(_SIZES)
        self.batch_tokens = Histogram(_SIZES)
        self.sessions_rejected = 0
        self.requests_refused: collections.Counter[str] = collections.Counter()  # reason -> calls refused by policy
        self.requests_failed = 0  # requests that failed inside the engine (server/isolation.py)

    def observe_round(self, *, num_draft_tokens: int, accepted_depth: int, num_committed: int) -> None:
        with self._lock:
            self.num_rounds += 1
            self.num_generated_tokens += num_committed
            if num_draft_tokens:
                self.num_drafts += 1
                self.num_draft_tokens += num_draft_tokens
                self.num_accepted_tokens += accepted_depth
                for position in range(accepted_depth):
                    self.num_accepted_tokens_per_pos[position] += 1

    def observe_prefill(self, *, num_prompt_tokens: int) -> None:
        with self._lock:
            self.num_prompt_tokens += num_prompt_tokens
            self.num_generated_tokens += 1  # the first token comes with the prefill

    def observe_step(
        self, *, batch_size: int, batch_tokens: int, forward_s: float, schedule_s: float, postprocess_s: float = 0.0
    ) -> None:
        """One engine step: planning, the batched forward, then per-row verification and commit."""
        with self._lock:
            self.num_steps += 1
            self.batch_size.observe(batch_size)
            self.batch_tokens.observe(batch_tokens)
            self.forward_s.observe(forward_s)
            self.schedule_s.observe(schedule_s)
            self.postprocess_s.observe(postprocess_s)

    def observe_share(self, identity: str, *, verified_tokens: int, cut_nodes: int) -> None:
        """One round's use of its share: tokens the target ran for it, and draft nodes cut from it."""
        with self._lock:
            self.num_verified_tokens += verified_tokens
            self.num_cut_nodes += cut_nodes
            if self.per_identity:
                self.verified_tokens_by_identity[identity] += verified_tokens
                self.cut_nodes_by_identity[identity] += cut_nodes

    def observe_hold(self, seconds: float, *, misses: int) -> None:
        """A step held `seconds` for rounds due back; `misses` identities among them did not send theirs."""
        with self._lock:
            self.num_holds += 1
            self.hold_s += seconds
            self.num_hold_misses += misses

    def set_step_cost(self, *, curve: tuple[float, float] | None, knee_tokens: int | None, budget: int) -> None:
        """The step budget and the measured cost curve (seconds ~ a + b * tokens) it came from."""
        with self._lock:
            self.step_budget_tokens = budget
            self.step_cost_fixed_s, self.step_cost_per_token_s = curve or (0.0, 0.0)
            self.step_cost_knee_tokens = knee_tokens or 0

    def set_step_cost_points(self, points: list[tuple[float, float]]) -> None:
        """The measured forward cost per token-count bucket (scheduler/speculation.py StepCostModel.points)."""
        with self._lock:
            self.step_cost_points = list(points)

    def observe_queue_wait(self, seconds: float) -> None:
        with self._lock:
            self.queue_wait_s.observe(seconds)

    def observe_rejected_session(self) -> None:
        with self._lock:
            self.sessions_rejected += 1

    def observe_refused(self, reason: str) -> None:
        """A call refused by policy: unauthenticated, rate_limited, session_limit or attach_limit."""
        with self._lock:
            self.requests_refused[reason] += 1

    def observe_failed_request(self) -> None:
        with self._lock:
            self.requests_failed += 1

    def set_sessions(self, *, active: int, slots_used: int, slots_free: int) -> None:
        with self._lock:
            self.active_sessions, self.kv_slots_used, self.kv_slots_free = active, slots_used, slots_free

    def snapshot(self) -> dict:
        """A consistent copy for exporters."""
        with self._lock:
            return {
                "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": dict(self.num_accepted_tokens_per_pos),
                "num_generated_tokens": self.num_generated_tokens,
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_rounds": self.num_rounds,
                "num_steps": self.num_steps,
                "active_sessions": self.active_sessions,
                "kv_slots_used": self.kv_slots_used,
                "kv_slots_free": self.kv_slots_free,
                "sessions_rejected": self.sessions_rejected,
                "requests_refused": dict(self.requests_refused),
                "requests_failed": self.requests_failed,
                "num_verified_tokens": self.num_verified_tokens,
                "num_cut_nodes": self.num_cut_nodes,
                "num_holds": self.num_holds,
                "hold_s": self.hold_s,
                "num_hold_misses": self.num_hold_misses,
                "verified_tokens_by_identity": dict(self.verified_tokens_by_identity),
                "cut_nodes_by_identity": dict(self.cut_nodes_by_identity),
                "step_budget_tokens": self.step_budget_tokens,
                "step_cost_fixed_s": self.step_cost_fixed_s,
                "step_cost_per_token_s": self.step_cost_per_token_s,
                "step_cost_knee_tokens": self.step_cost_knee_tokens,
                "step_cost_points": list(self.step_cost_points),
                **{
                    name: copy.deepcopy(getattr(self, name))
                    for name in (
                        "queue_wait_s",
                        "forward_s",
                        "schedule_s",
                        "postprocess_s",
                        "batch_size",
                        "batch_tokens",
                    )
                },
            }
