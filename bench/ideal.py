"""The best SpecEdge/AR throughput ratio this machine allows, from its measured step cost curve.

T(t) is the server's forward time for a step of t tokens, measured in the same run (the server's
`specedge:step_cost_seconds` points: its start-up calibration and every step since, by token count).
At N edges, AR decodes N rows of one token per step, so its best rate is N / T(N). A SpecEdge round
sends one pending token and k draft tokens and commits L tokens on average (the mean accepted length),
so N rounds commit N * L tokens, and no schedule beats either bound:

    the server's:   a step of N rounds carries N * (1 + k) tokens:  N * L / T(N * (1 + k))
    an edge's:      a round cannot be shorter than its draft, the round trip and a lone verify:
                    N * L / (d + RTT + T(1 + k))      (d = 0 with proactive drafting: the draft is ready)

    ideal ratio = L * T(N) / max(T(N * (1 + k)), d + RTT + T(1 + k))

Worked example (README): T(8) = 0.20 s, T(40) = 0.45 s, T(5) = 0.19 s, L = 3.2, k = 4, RTT = 14 ms,
d = 0.06 s at N = 8: max(0.45, 0.06 + 0.014 + 0.19) = 0.45, so the ideal is 3.2 * 0.20 / 0.45 = 1.42x.
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
            return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (tokens - x1)
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def to_json(self) -> list[list[float]]:
        return [[t, s] for t, s in self.points]


def ideal_ratio(
    curve: CostCurve, num_edges: int, accepted_length: float, draft_tokens: float, rtt_s: float, draft_s: float
) -> float:
    """The best SpecEdge/AR throughput ratio at `num_edges` (module docstring); draft_s = 0 when proactive."""
    round_tokens = 1 + draft_tokens
    server_bound = curve.seconds(num_edges * round_tokens)
    edge_bound = draft_s + rtt_s + curve.seconds(round_tokens)
    return accepted_length * curve.seconds(num_edges) / max(server_bound, edge_bound)
