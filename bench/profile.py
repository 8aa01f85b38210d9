"""`specedge-bench profile`: record a real pair's acceptance profile, for simulated edges to replay.

    specedge-bench profile                     # qwen2.5-coder-0.5b drafting for qwen2.5-coder-1.5b
    specedge-bench profile --write-sizes       # also record prompt sizes and answer lengths in prompts.json

One real edge (the draft model in this process) answers every prompt against
the real target, greedy, with a fixed draft length and no proactive drafting,
so that every round is a plain k-token chain after the committed text. Per
prompt category it records:

- acceptance[d]: P(the draft at depth d + 1 is accepted | depths 1..d were),
  from the server's per-position counters (rounds accepted to each depth);
- runner_up_hit: when a draft was rejected, how often the draft's second
  choice was the target's token (from the drafter's own calls);

and, for the whole pair, the draft's latency as a + b * tokens per call,
fitted on calls of 1, 2, 4 and 8 tokens after a fixed context.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
import pathlib
import sys

from tqdm import tqdm

from specedge.edge_client.client import EdgeClient
from specedge.edge_client.generation import generate
from specedge.edge_client.policy import SpeculationPolicy
from specedge.scheduler.speculation import StepCostModel

from .edges import DraftCall, TimedDrafter, real_drafters, timed
from .prompts import PROMPTS_FILE, load_prompts
from .server import ServerProcess
from .simulated import ALL, AcceptanceProfile, CategoryProfile

LATENCY_PROBE = (1, 2, 4, 8)  # draft lengths timed for the latency fit
LATENCY_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    num_draft: int = 8  # the deepest position measured
    max_tokens: int = 256
    categories: tuple[str, ...] = ()
    prompts_file: pathlib.Path | None = None
    draft_threads: int = 1
    max_context: int = 1024
    out: pathlib.Path | None = None  # default: bench/profiles/<draft>--<target>.json
    write_sizes: bool = False  # record prompt_tokens / expected_output_tokens in the prompts file

    def __post_init__(self):
        if self.num_draft < 1 or self.max_tokens < 1:
            raise ValueError("--num-draft and --max-tokens must be >= 1")

    @property
    def out_path(self) -> pathlib.Path:
        if self.out is not None:
            return self.out
        name = f"{_slug(self.draft)}--{_slug(self.target)}.json"
        return pathlib.Path(__file__).with_name("profiles") / name


def _slug(model: str) -> str:
    return pathlib.Path(model.rstrip("/")).name.removesuffix(".gguf")


def record_profile(config: ProfileConfig, progress: bool = True) -> AcceptanceProfile:
    from specedge.edge_client.tokenizer import load_tokenizer
    from specedge.registry import resolve

    prompts = load_prompts(config.prompts_file, config.categories or None)
    tokenizer = load_tokenizer(resolve(config.draft))
    [drafter] = real_drafters(config.draft, 1, config.draft_threads)
    drafter = timed(drafter.inner, record=True)
    server_args = ["--model", config.target, "--max-sessions", "2", "--max-context", str(config.max_context)]
    load_before = os.getloadavg()
    try:
        with ServerProcess(server_args) as server:
            measured, partial = asyncio.run(_answer_all(config, server, tokenizer, prompts, drafter, progress))
        s_per_call, s_per_token = _latency_fit(drafter, tokenizer)
    finally:
        drafter.close()
    categories: dict[str, CategoryProfile] = {}
    for category in sorted({p.category for p in prompts}) + [ALL]:
        rows = [m for m in measured if category in (ALL, m["category"])]
        categories[category] = _category_profile(rows, config.num_draft)
    profile = AcceptanceProfile(
        draft=config.draft,
        target=config.target,
        categories=categories,
        draft_s_per_call=s_per_call,
        draft_s_per_token=s_per_token,
        meta={
            "recorded_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "num_draft": config.num_draft,
            "max_tokens": config.max_tokens,
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "prompts": [
                {k: m[k] for k in ("id", "category", "prompt_tokens", "output_tokens", "acceptance_rate")}
                for m in measured
            ],
        },
    )
    if config.write_sizes:
        _write_sizes(config.prompts_file or PROMPTS_FILE, measured)
    partial.unlink(missing_ok=True)
    return profile


async def _answer_all(config: ProfileConfig, server: ServerProcess, tokenizer, prompts, drafter, progress: bool):
    """Each prompt's measurement; kept in a side file as it goes, so an interrupted run resumes where it stopped."""
    policy = SpeculationPolicy(
        num_draft=config.num_draft, max_new_tokens=config.max_tokens, proactive=False, follow_advice=False
    )
    partial = config.out_path.with_suffix(".partial.json")
    key = {
        "target": config.target,
        "draft": config.draft,
        "num_draft": config.num_draft,
        "max_tokens": config.max_tokens,
    }
    done = _load_partial(partial, key)
    todo = [p for p in prompts if p.id not in done]
    async with EdgeClient(server.address, tokenizer.fingerprint) as client:
        for prompt in tqdm(todo, desc="profiling", unit="prompt", disable=not progress, file=sys.stderr):
            ids = tokenizer.apply_chat_template(list(prompt.messages))
            drafter.calls.clear()
            before = await asyncio.to_thread(server.scrape)
            result = await generate(client, ids, drafter, policy=policy)
            delta = (await asyncio.to_thread(server.scrape)) - before
            done[prompt.id] = {
                "id": prompt.id,
                "category": prompt.category,
                "prompt_tokens": len(ids),
                "output_tokens": len(result.token_ids),
                "acceptance_rate": round(result.stats.acceptance_rate, 4),
                "drafts": delta.values["drafts"],
                "accepted_per_pos": delta.accepted_per_pos,
                "runner_up": _runner_up_outcomes(len(ids), result.token_ids, drafter.calls),
            }
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"key": key, "done": done}))
    return [done[p.id] for p in prompts], partial


def _load_partial(path: pathlib.Path, key: dict) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if data.get("key") != key:
        return {}
    for row in data["done"].values():  # JSON keys are strings
        row["accepted_per_pos"] = {int(p): c for p, c in row["accepted_per_pos"].items()}
    return data["done"]


def _runner_up_outcomes(prompt_len: int, answer: list[int], calls: list[DraftCall]) -> list[bool]:
    """For each round's first rejected draft: was the draft's runner-up the target's token?"""
    outcomes = []
    for call in calls:
        start = len(call.context) - prompt_len
        for j, token in enumerate(call.chain.token_ids):
            position = start + j
            if position >= len(answer):
                break
            if token != answer[position]:
                if j < len(call.chain.runner_up_ids):
                    outcomes.append(call.chain.runner_up_ids[j] == answer[position])
                break
    return outcomes


def _category_profile(rows: list[dict], depth: int) -> CategoryProfile:
    drafts = sum(r["drafts"] for r in rows)
    reached = [sum(r["accepted_per_pos"].get(d, 0.0) for r in rows) for d in range(depth)]
    acceptance: list[float] = []
    previous = drafts
    for count in reached:
        # A depth no round got to keeps the last measured rate (too little data to say more).
        acceptance.append(count / previous if previous else (acceptance[-1] if acceptance else 0.0))
        previous = count
    outcomes = [hit for r in rows for hit in r["runner_up"]]
    return CategoryProfile(
        acceptance=tuple(round(a, 4) for a in acceptance),
        runner_up_hit=round(sum(outcomes) / len(outcomes), 4) if outcomes else 0.0,
        rounds=int(drafts),
    )


def _latency_fit(drafter: TimedDrafter, tokenizer) -> tuple[float, float]:
    """Seconds per propose() call = a + b * tokens, measured on a fixed context."""
    context = tokenizer.apply_chat_template([{"role": "user", "content": "Write a function that sorts a list."}])
    drafter.propose(context, 1)  # prefill once; later calls reuse it
    model = StepCostModel(window=len(LATENCY_PROBE) * LATENCY_REPEATS, min_steps=len(LATENCY_PROBE))
    for _ in range(LATENCY_REPEATS):
        for n in LATENCY_PROBE:
            before = drafter.busy_s
            chain = drafter.propose(context, n)
            model.observe(batch_tokens=len(chain.token_ids), batch_rows=1, seconds=drafter.busy_s - before)
    a, b = model.fit() or (0.0, 0.0)
    return round(a, 5), round(b, 5)


def _write_sizes(path: pathlib.Path, measured: list[dict]) -> None:
    data = json.loads(path.read_text())
    sizes = {m["id"]: m for m in measured}
    for prompt in data["prompts"]:
        if prompt["id"] in sizes:
            prompt["prompt_tokens"] = sizes[prompt["id"]]["prompt_tokens"]
            prompt["expected_output_tokens"] = sizes[prompt["id"]]["output_tokens"]
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
