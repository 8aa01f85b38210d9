"""One cell of the benchmark: one mode, N edges, one network model; every edge asks its prompts in turn.

Modes, all through the same server and the same client code:

    ar                  the server decodes alone (Generate; continuous batching across edges)
    server_spec         the server drafts too (Generate with server_draft_tokens, --draft-model)
    specedge            edges draft, the server verifies (Verify rounds), proactive drafting off
    specedge_proactive  the same, drafting the next round while this one is verified

Each edge keeps one connection for the cell (as a deployed edge does), opened
before the clock starts. Time stamps are taken when tokens reach the edge,
after the emulated network delay.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

from specedge.edge_client.client import ConnectionConfig, EdgeClient
from specedge.edge_client.generation import generate
from specedge.edge_client.policy import SpeculationPolicy
from specedge.types import SamplingParams

from .config import SERVER_DRIVEN, BenchConfig
from .server import ServerCounters


@dataclasses.dataclass(frozen=True)
class Cell:
    mode: str
    num_edges: int
    rtt_ms: float
    repeat: int = 0


@dataclasses.dataclass(frozen=True)
class Job:
    """One prompt as the edges send it."""

    index: int  # in the run's prompt list; also picks the sampling seed
    prompt_id: str
    category: str
    token_ids: tuple[int, ...]


@dataclasses.dataclass
class RequestResult:
    edge: int
    prompt_id: str
    category: str
    token_ids: list[int]
    finish: str
    start_s: float  # since the cell started
    deliveries: list[tuple[float, int]]  # (ms since the request started, tokens that arrived)
    stats: dict  # the edge's GenerationStats.as_dict()
    proactive_rounds: int
    proactive_hits: int
    identical: bool | None = None  # equal to the reference answer (None: no reference)
    prompt_tokens: int = 0  # the prompt the server prefilled for it

    @property
    def ttft_ms(self) -> float | None:
        return self.deliveries[0][0] if self.deliveries else None

    def itl_samples_ms(self) -> list[float]:
        """Per token after the first: the gap before its delivery, shared by the tokens delivered together.

        A round that delivers 3 tokens 120 ms after the previous delivery
        gives 3 samples of 40 ms (the paper's per-round time / tokens).
        """
        samples = []
        for (before, _), (at, count) in zip(self.deliveries, self.deliveries[1:]):
            samples += [(at - before) / count] * count if count else []
        return samples

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "num_tokens": len(self.token_ids), "ttft_ms": self.ttft_ms}


@dataclasses.dataclass
class CellRun:
    """One run of a cell: what the edges saw, and the server's counters over it."""

    wall_s: float
    results: list[RequestResult]
    counters: ServerCounters  # delta over the run
    edge_busy_s: float  # summed drafting time of the edges
    load_average: float  # the machine's 1-minute load average at the end (others' work shows here)
    started_s: float = 0.0  # since the first cell started: the order the cells ran in

    def to_json(self) -> dict:
        return {
            "started_s": self.started_s,
            "wall_s": self.wall_s,
            "edge_busy_s": self.edge_busy_s,
            "load_average": self.load_average,
            "server_counters": self.counters.values,
            "accepted_per_pos": self.counters.accepted_per_pos,
            "requests": [r.to_json() for r in self.results],
        }


def connection(config: BenchConfig, rtt_ms: float) -> ConnectionConfig:
    """Each edge's emulated network for a cell."""
    return ConnectionConfig(simulated_rtt_ms=rtt_ms, simulated_jitter_ms=config.jitter_ms)


def policy(config: BenchConfig, mode: str, seed: int | None) -> SpeculationPolicy:
    base = SpeculationPolicy(
        max_new_tokens=config.max_tokens, sampling=SamplingParams(temperature=config.temperature), seed=seed
    )
    if mode == "ar":
        return dataclasses.replace(base, num_draft=0)
    if mode == "server_spec":
        return dataclasses.replace(base, num_draft=0, server_draft_tokens=config.num_draft)
    return dataclasses.replace(
        base,
        num_draft=config.num_draft,
        tree=config.tree,
        proactive=mode == "specedge_proactive",
        follow_advice=config.follow_advice,
        # A simulated draft has no distribution q to send: verify by matching samples.
        rejection_sampling=config.edge_kind == "real",
    )


async def run_cell(
    cell: Cell,
    address: str,
    fingerprint,
    config: BenchConfig,
    plan: Sequence[Sequence[Job]],  # per edge: the jobs it sends, in order
    drafters: Sequence,  # per edge (ignored by server-driven modes)
    on_done: Callable[[], None] = lambda: None,
    stagger_s: float = 0.0,  # edge i sends its first request i * stagger_s after the cell starts
) -> tuple[float, list[RequestResult]]:
    """Run the cell; its wall time and every request's result."""
    use_drafter = cell.mode not in SERVER_DRIVEN
    clients = [EdgeClient(address, fingerprint, config=connection(config, cell.rtt_ms)) for _ in plan]
    await asyncio.gather(*(client.connect() for client in clients))
    started = time.perf_counter()

    async def edge(index: int, client: EdgeClient, jobs: Sequence[Job]) -> list[RequestResult]:
        results = []
        await asyncio.sleep(index * stagger_s)
        for job in jobs:
            seed = config.seed + job.index if config.temperature > 0 else None
            deliveries: list[tuple[float, int]] = []
            request_started = time.perf_counter()

            def on_tokens(token_ids, t0=request_started, out=deliveries):
                out.append(((time.perf_counter() - t0) * 1e3, len(token_ids)))

            result = await generate(
                client,
                job.token_ids,
                drafters[index] if use_drafter else None,
                on_tokens,
                policy=policy(config, cell.mode, seed),
            )
            results.append(
                RequestResult(
                    edge=index,
                    prompt_id=job.prompt_id,
                    category=job.category,
                    token_ids=list(result.token_ids),
                    finish=result.finish.name.lower(),
                    start_s=request_started - started,
                    deliveries=deliveries,
                    stats=result.stats.as_dict(),
                    proactive_rounds=result.stats.proactive_rounds,
                    proactive_hits=result.stats.proactive_hits,
                    prompt_tokens=len(job.token_ids),
                )
            )
            on_done()
        return results

    try:
        per_edge = await asyncio.gather(*(edge(i, c, jobs) for i, (c, jobs) in enumerate(zip(clients, plan))))
        wall_s = time.perf_counter() - started
    finally:
        await asyncio.gather(*(client.__aexit__(None, None, None) for client in clients))
    return wall_s, [result for results in per_edge for result in results]
