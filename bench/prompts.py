"""The benchmark's prompt set (bench/prompts.json): categories, sizes, and which edge asks what."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

PROMPTS_FILE = pathlib.Path(__file__).with_name("prompts.json")
CATEGORIES = ("code", "chat", "summarization", "translation", "math", "json")


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: tuple[dict, ...]  # chat messages; the edge applies the chat template
    prompt_tokens: int = 0  # recorded: chat-templated length with the Qwen2.5 tokenizer
    expected_output_tokens: int = 0  # recorded: the real target's greedy answer length (cap 256)

    def __post_init__(self):
        if not self.messages or self.messages[-1].get("role") != "user":
            raise ValueError(f"prompt {self.id}: the last message must be the user's")


def load_prompts(path: str | pathlib.Path | None = None, categories: Sequence[str] | None = None) -> list[Prompt]:
    """The prompts of `path` (default: the shipped set), only those of `categories` when given."""
    path = pathlib.Path(path) if path else PROMPTS_FILE
    try:
        raw = json.loads(path.read_text())["prompts"]
        prompts = [
            Prompt(
                p["id"],
                p["category"],
                tuple(p["messages"]),
                p.get("prompt_tokens", 0),
                p.get("expected_output_tokens", 0),
            )
            for p in raw
        ]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read prompts from {path}: {exc}") from None
    if categories:
        unknown = set(categories) - {p.category for p in prompts}
        if unknown:
            raise ValueError(
                f"no prompts in categories {sorted(unknown)}; the set has {sorted({p.category for p in prompts})}"
            )
        prompts = [p for p in prompts if p.category in categories]
    return prompts


def one_per_category(prompts: Sequence[Prompt]) -> list[Prompt]:
    """The first prompt of each category, categories interleaved: the quick run's set."""
    seen: dict[str, Prompt] = {}
    for prompt in prompts:
        seen.setdefault(prompt.category, prompt)
    return list(seen.values())


def interleave(prompts: Sequence[Prompt]) -> list[Prompt]:
    """Round-robin over categories, so that the first N prompts span as many categories as possible."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    out = []
    for i in range(max(map(len, by_category.values()), default=0)):
        out += [group[i] for group in by_category.values() if i < len(group)]
    return out


def assignment(num_prompts: int, num_edges: int, requests_per_edge: int) -> list[list[int]]:
    """Prompt indices each edge asks, in order: edge e's r-th request is prompt (e + r * N) mod P.

    P = 6, N = 4, 2 requests each:  [[0, 4], [1, 5], [2, 0], [3, 1]]
    """
    return [[(e + r * num_edges) % num_prompts for r in range(requests_per_edge)] for e in range(num_edges)]
