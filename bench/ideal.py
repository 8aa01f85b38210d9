"""The best SpecEdge/AR throughput ratio this machine allows, from its measured step cost curve.

T(t) is the server's forward time for a step of t tokens, measured in the same run (the server's
`specedge:step_cost_seconds` points: its start-up calibration and every step since, by token count).
At N edges, AR decodes N rows of one token per step, so its best rate is N / T(N). A SpecEdge round
sends one pending token and k draft tokens and commits L tokens on average (the mean accepted length).
Say the N edges' rounds ride in c steps of N / c rounds each (c cohorts, 1 <= c <= N), and each edge
gets a round every C seconds. Two bounds hold together:

    the server's:   it runs the c steps one after the other:       C >= c * T(N * (1 + k) / c)
    an edge's:      its round's step, then its draft and the round trip:  C >= T(N * (1 + k) / c) + d + RTT
                    (d: the drafting a round waited for, as the edges measured it;
                    with proactive drafting, what the guesses did not hide)

One merged step (c = 1) pays the step's fixed cost once, but leaves the server idle while the edges
draft; many small steps keep it busy, each paying the fixed cost. The best schedule is the c that
minimises the larger bound, and

    ideal ratio = L * T(N) / min over c of max(c * T(N * (1 + k) / c), T(N * (1 + k) / c) + d + RTT)

For an affine curve T(t) = a + b * t this is a bound on every schedule, not only on equal cohorts: over
a long window, one server gives sum over steps T(n_j) <= W, and each edge's rounds in turn give
sum over rounds (T(n_j) + d + RTT) <= N * W; with c = N / (mean rows a step), Cauchy-Schwarz turns the
two sums into the two bounds above. The measured curve is used as it is (linear between its points).

Prompts. Both modes prefill the same prompts: q prompt tokens per decoded token inside the window that
decode throughput is measured over (the prompts of the requests whose first token arrived in it, over the
tokens counted there; bench/metrics.py). A prefilled token costs at least the curve's
slope over its largest steps, b (its marginal cost, riding in a step that runs anyway), so each decoded
token carries p = q * b seconds of prefill. AR's best time per token is T(N) / N + p. Each SpecEdge round
commits L tokens, so it carries L * p of its own edge's prefill, which that edge waits for (its bound
gains L * p) and which the server runs along with the other N - 1 edges' (its bound gains N * L * p):

    C >= c * T(N * (1 + k) / c) + N * L * p    and    C >= T(N * (1 + k) / c) + d + RTT + L * p
    ideal ratio = (T(N) / N + p) / (C / (L * N))

Where the edges bound the cycle, the server is idle while they draft, and the bounds let other edges'
prefills fill that time. A schedule that did so would pay a step's fixed cost for each step it ran in those
gaps, which the bounds leave out: so this stays an upper bound, but its best c (often one merged step once
prompts count) is not a schedule to aim for. With every prefill riding in the round steps instead (each step
carrying N * L * p / c of it, which its rounds wait for), the recorded CPU runs' ideal at N = 8 would be
0.00-0.10x lower, at c = 1.0-1.3. Recomputed
over the recorded runs on a 2-core CPU (48-token answers, q 1.4-1.8, b 8-9 ms): SpecEdge at N = 8 -0.01x to
+0.05x against the ideal without prompts, proactive drafting there 1.36-1.40x where it was 1.43-1.63x (its
drafts leave the server little idle time to hide prefill in), N = 1 0.02-0.04x lower.

Each mode's ideal rate bounds its measured rate (forwards only: the draws and the protocol are left out), but
their ratio is not a strict bound on the measured ratio: where AR loses more of its ideal to those overheads than
SpecEdge does (a step and a reply for every token), the measured ratio can pass it (N = 1 in one recorded run:
1.22x against 1.20x).

The schedule. The bounds' best c may be fractional, or one merged step whose drafting gap the other edges'
prefills fill for free, since an edge's bound holds only its own prefill: a relaxation no server reaches, where
an edge back while another cohort's step runs waits for it, and a cohort's rows wait for the prefill their step
carries. `schedule_rate` is the best round-robin schedule of whole cohorts (c = 1 .. N), the prefill costed as
above:

    C_c = max(c * T(N * (1 + k) / c) + N * L * p,  T(N * (1 + k) / c) + (N / c) * L * p + d + RTT)

and for AR (one token a round, back a round trip after its step) the same with L = 1, k = 0, d = 0. It is a
rate a scheduler can reach on the measured curve, not a bound; the bench reports each cell's decode rate
against it. In two kept 2-core Xeon runs at N = 8 (2026-11-27, prompts counted), where the bound said 1.31x
and 1.41x, the schedules' ratio was 1.13x and 1.17x and the runs measured 1.12x and 1.00x: SpecEdge at 94%
and 84% of its schedule, AR at 95% and 97%. A step trace of another run showed that schedule at work: two
cohorts alternating (a session rode every second step 388 times in 461, the next step 64 times), steps on the
curve (69.0 s measured where the curve gives 70.7), 1-2 ms between steps.

Worked example (README): T(5) = 0.19 s, T(8) = 0.20 s, T(40) = 0.45 s, L = 3.2, k = 4, RTT = 14 ms,
d = 0.06 s, N = 8. One step of all 40 tokens: max(0.45, 0.45 + 0.074) = 0.524 s; eight of 5 tokens:
max(1.52, 0.264) = 1.52 s; the bounds cross at c = 1.18 (steps of 33.8 tokens, 0.401 s): C = 0.475 s,
and the ideal is 3.2 * 0.20 / 0.475 = 1.35x. At N = 1, c = 1: 3.2 * 0.19 / (0.19 + 0.074) = 2.30x.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


class CostCurve:
    """Seconds per step against tokens, linear between measured points, flat below the first and
    extended by the last segment's slope above the last."""

    def __init__(self, points: Sequence[tuple[float, float]]):
        self.points = sorted((float(t), float(s)) for t, s in points)
        if not self.points:
            raise ValueError("the cost curve has no measured points")

    def seconds(self, tokens: float) -> float:
        xs = [t for t, _ in self.points]
        if tokens <= xs[0] or len(xs) == 1:
            return self.points[0][1]
        i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)  # the segment (i - 1, i) holds tokens, or the last
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        if tokens > x1:  # past the last point: its segment's slope, never downhill
            return y1 + self.marginal_s() * (tokens - x1)
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def marginal_s(self) -> float:
        """b: seconds a token adds to a step, the slope over the curve's two largest steps (0 with one point)."""
        if len(self.points) < 2:
            return 0.0
        (x0, y0), (x1, y1) = self.points[-2:]
        return max(0.0, (y1 - y0) / (x1 - x0))

    def to_json(self) -> list[list[float]]:
        return [[t, s] for t, s in self.points]


COHORT_GRID = 4096  # cohort counts c tried between 1 and N


def ideal_cycle(
    curve: CostCurve, num_edges: int, draft_tokens: float, rtt_s: float, draft_s: float, prefill_s: float = 0.0
) -> float:
    """The shortest time C in which every one of `num_edges` edges can get a round verified, each round carrying
    `prefill_s` of its own edge's prefill (L * p; module docstring)."""
    round_tokens = 1 + draft_tokens
    best = float("inf")
    for i in range(COHORT_GRID + 1):
        cohorts = 1 + (num_edges - 1) * i / COHORT_GRID
        step_s = curve.seconds(num_edges * round_tokens / cohorts)
        server_s = cohorts * step_s + num_edges * prefill_s
        best = min(best, max(server_s, step_s + draft_s + rtt_s + prefill_s))
    return best


def ideal_ratio(
    curve: CostCurve,
    num_edges: int,
    accepted_length: float,
    draft_tokens: float,
    rtt_s: float,
    draft_s: float,
    prompt_tokens_per_token: float = 0.0,
) -> float:
    """The best SpecEdge/AR throughput ratio at `num_edges` (module docstring); draft_s: d; prompt_tokens_per_token:
    q, the prompt tokens prefilled per token decoded."""
    prefill_s = prompt_tokens_per_token * curve.marginal_s()  # p
    cycle = ideal_cycle(curve, num_edges, draft_tokens, rtt_s, draft_s, accepted_length * prefill_s)
    return (curve.seconds(num_edges) / num_edges + prefill_s) * accepted_length * num_edges / cycle


def schedule_rate(
    curve: CostCurve,
    num_edges: int,
    tokens_per_round: float,
    round_tokens: float,
    turnaround_s: float,
    prefill_s: float = 0.0,
) -> float:
    """Tokens per second of the best round-robin schedule of whole cohorts (module docstring): each of `num_edges`
    rounds a cycle commits `tokens_per_round` (L; 1 for AR), carries `round_tokens` (1 + k; 1 for AR) and
    `prefill_s` of its edge's prefill (L * p), and comes back `turnaround_s` after its step (d + RTT; RTT)."""
    n = num_edges
    best = float("inf")
    for cohorts in range(1, n + 1):
        step_s = curve.seconds(n * round_tokens / cohorts)
        best = min(best, max(cohorts * step_s + n * prefill_s, step_s + n / cohorts * prefill_s + turnaround_s))
    return tokens_per_round * n / best
