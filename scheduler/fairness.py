"""Max-min fair shares of a step's token budget, with deficits carried forward.

When a step's queued work exceeds its token budget, the budget is shared
max-min fairly ("water-filling"): a claimant that needs less than an equal
share gets all it needs, and what it leaves is split equally among the rest.

    budget 32; A needs 1, B needs 260, C needs 10
    equal share 32 / 3 = 10.67: A (1) and C (10) need less, so they get all they need
    B gets what is left: 32 - 1 - 10 = 21

Shares are whole tokens. The fractions left over go, a token each, to the
claimants that have come off worst so far: each carries a deficit (its exact
share minus what it was granted, summed over the steps it has been waiting),
as in deficit round robin. So over many steps every claimant gets its exact
share to within a token, even when the budget is smaller than the number of
claimants and some must sit a step out. A claimant that has nothing queued
drops out and starts again from zero when it comes back.

    budget 2; a, b, c need 1 each (exact share 2/3 each)
    step 1: a, b run (c's deficit +2/3)   step 2: c, a run   step 3: b, c run   (deficits back to 0)

Pure Python: numbers in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def water_level(demands: Mapping[K, float], budget: float) -> float:
    """The level L with sum(min(demand, L)) == budget; math.inf when every demand fits.

    demands 1, 260, 10 and budget 32 -> L = 21 (1 + 21 + 10 = 32)
    """
    if sum(demands.values()) <= budget:
        return math.inf
    remaining, left = budget, len(demands)
    for demand in sorted(demands.values()):
        if demand * left > remaining:  # every claimant from here on needs more than an equal share
            return remaining / left
        remaining -= demand
        left -= 1
    return math.inf  # not reached: the demands exceed the budget


def max_min_shares(
    demands: Mapping[K, int], budget: int, deficits: Mapping[K, float]
) -> tuple[dict[K, int], dict[K, float]]:
    """Whole-token max-min shares of `budget`, and the deficits to carry into the next step.

    `deficits` holds what each claimant was owed after the last step (absent: 0). The result's
    deficits hold only the claimants in `demands`; in `demands` order, ties go to the earlier.
    """
    level = water_level(demands, budget)
    exact = {key: min(float(demand), level) for key, demand in demands.items()}
    grants = {key: math.floor(share) for key, share in exact.items()}
    extra = round(sum(exact.values()) - sum(grants.values()))  # whole tokens of the fractions left over
    owed = {key: exact[key] - grants[key] + deficits.get(key, 0.0) for key in demands if grants[key] < demands[key]}
    for key in sorted(owed, key=lambda key: -owed[key])[:extra]:  # sorted() is stable: earlier keys win ties
        grants[key] += 1
    return grants, {key: deficits.get(key, 0.0) + exact[key] - grants[key] for key in demands}


def share_if_unbounded(demands: Mapping[K, int], key: K, budget: int) -> int:
    """The whole tokens `key` would get if it asked for the whole budget, the others asking what they do.

    What a claimant may ask for without being cut:  budget 32, A needs 1, B needs 260
    -> A could have 16 (B would get 16), B 31 (A keeps its 1).
    """
    others = {other: demand for other, demand in demands.items() if other != key}
    return math.floor(min(float(budget), water_level({**others, key: budget}, budget)))
