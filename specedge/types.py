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
