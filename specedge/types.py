"""Internal types shared by the server and the edge (torch-free)."""

from __future__ import annotations

import dataclasses
import enum
import math


class FinishReason(enum.Enum):
    NONE = 0  # still generating
    STOP = 1  # an end-of-sequence token was committed
    LENGTH = 2  # max_new_tokens reached
    CONTEXT = 3  # the KV slot is full


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Probabilities travel as float32 and are renormalised on use, so only a sum
# far from 1 is an error.
PROB_SUM_TOLERANCE = 1e-3


@dataclasses.dataclass(frozen=True)
class SparseDist:
    """A distribution over few tokens (the wire's SparseDistribution).

    probs[i] is the probability of token_ids[i]; every other token has
    probability 0. The probs sum to 1 up to float32 rounding; users
    renormalise (`prob_of` does).
    """

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]

    def __post_init__(self):
        # Accept any sequences (e.g. repeated proto fields); store tuples.
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "probs", tuple(float(p) for p in self.probs))
        if len(self.token_ids) != len(self.probs):
            raise ValueError(f"sparse distribution has {len(self.token_ids)} token ids but {len(self.probs)} probs")
        if not self.token_ids:
            raise ValueError("sparse distribution is empty")
        if len(set(self.token_ids)) != len(self.token_ids):
            raise ValueError(f"sparse distribution repeats a token id: {self.token_ids}")
        if min(self.token_ids) < 0:
            raise ValueError(f"sparse distribution has a negative token id: {min(self.token_ids)}")
        if not all(math.isfinite(p) and p >= 0 for p in self.probs):
            raise ValueError(f"sparse distribution probs must be finite and >= 0, got {self.probs}")
        if abs(sum(self.probs) - 1) > PROB_SUM_TOLERANCE:
            raise ValueError(f"sparse distribution probs must sum to 1, got {sum(self.probs):.6g}")

    def prob_of(self, token_id: int) -> float:
        """q(token_id), renormalised; 0 for a token outside the distribution."""
        try:
            return self.probs[self.token_ids.index(token_id)] / sum(self.probs)
        except ValueError:
            return 0.0
