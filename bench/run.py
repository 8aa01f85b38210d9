"""A whole benchmark run: one server, a reference pass, then every (RTT, N, mode) cell back to back.

start specedge-server (target, --draft-model for server_spec, --metrics-port)
reference pass: the server answers every prompt alone (warms it up; gives
    simulated edges the target's answers, and every cell an identity check)
edges: real drafters, or simulated ones built from the references + profile
warm-up: one unmeasured request per mode
for each RTT, each N, each mode (modes back to back, so load noise hits all
    alike), each repeat: run the cell, every edge a stream of requests, their
    starts staggered; counters from /metrics before and after
the server's measured cost curve, for the best ratio this machine allows
    (bench/ideal.py)
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import importlib.metadata
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from tqdm import tqdm

from specedge.edge_client.drafting.base import Drafter

from .config import SERVER_DRIVEN, BenchConfig
from .edges import real_drafters, simulated_drafters
from .ideal import CostCurve
from .metrics import add_ideal, add_ratios, add_schedule, summarize_cell
from .modes import Cell, CellRun, Job, run_cell
from .prompts import assignment, interleave, load_prompts
from .server import ServerProcess
from .simulated import AcceptanceProfile

WARMUP_TOKENS = 8  # a warm-up request exercises each path; its length does not matter


def server_args(config: BenchConfig) -> list[str]:
    args = [
        "--model",
        config.target,
        "--max-sessions",
        str(config.max_sessions + 1),
        "--max-context",
        str(config.max_context),
        "--device",
        config.device,
        "--dtype",
        config.dtype,
        "--tp",
        str(config.tp),
    ]
    if "server_spec" in config.modes:
        args += ["--draft-model", config.server_draft_model]
    return args + list(config.server_extra)


def load_jobs(config: BenchConfig, tokenizer) -> list[Job]:
    prompts = interleave(load_prompts(config.prompts_file, config.categories or None))
    prompts = prompts[: config.max_prompts] if config.max_prompts else prompts
    return [
        Job(i, p.id, p.category, tuple(tokenizer.apply_chat_template(list(p.messages)))) for i, p in enumerate(prompts)
    ]


def run_benchmark(
    config: BenchConfig, progress: bool = True, checkpoint: Callable[[dict], object] | None = None
) -> dict:
    """Measure every cell; `checkpoint` gets the results so far after each cell (a long run keeps its data)."""
    from specedge.edge_client.tokenizer import load_tokenizer
    from specedge.registry import resolve

    simulated = config.edge_kind == "simulated" and config.uses_edges  # then a profile is required (BenchConfig)
    profile = AcceptanceProfile.load(config.profile) if simulated and config.profile is not None else None
    tokenizer = load_tokenizer(resolve(config.draft))
    jobs = load_jobs(config, tokenizer)
    pin_server = None
    if config.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise ValueError("--pin needs at least 2 CPUs")
        pin_server = {cpus[0]}
    meta = _meta(config, profile, jobs, datetime.datetime.now(datetime.UTC), os.getloadavg())

    def results(raw, references, curve) -> dict:
        meta["machine"]["load_average_after"] = os.getloadavg()
        return _results(config, meta, jobs, raw, references, curve)

    with ServerProcess(server_args(config), pin_cpus=pin_server) as server:
        if pin_server:
            os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[1:]))
        on_cell = (lambda *measured: checkpoint(results(*measured))) if checkpoint else None
        measured = asyncio.run(_measure(config, server, tokenizer.fingerprint, jobs, profile, progress, on_cell))
    return results(*measured)


def _results(config: BenchConfig, meta: dict, jobs: list[Job], raw, references, curve: CostCurve | None) -> dict:
    records = [summarize_cell(cell, runs, config.pricing) for cell, runs in raw]
    add_ratios(records)
    add_ideal(records, curve)
    add_schedule(records, curve)
    return {
        "meta": {**meta, "cost_curve": None if curve is None else curve.to_json()},
        "records": records,
        "references": {job.prompt_id: references[job.index] for job in jobs},
        "raw": [
            {"mode": cell.mode, "num_edges": cell.num_edges, "rtt_ms": cell.rtt_ms, "runs": [r.to_json() for r in runs]}
            for cell, runs in raw
        ],
    }


async def _measure(
    config: BenchConfig, server: ServerProcess, fingerprint, jobs: list[Job], profile, progress: bool, on_cell=None
):
    """Everything in one event loop (grpc.aio dislikes a new loop per run)."""
    cells = [Cell(mode, n, rtt) for rtt in config.rtt_ms for n in config.num_edges for mode in config.modes]
    total = sum(config.requests_for(c.num_edges, len(jobs)) * c.num_edges for c in cells) * config.repeats
    bar = tqdm(total=len(jobs) + total, desc="reference pass", unit="answer", disable=not progress, file=sys.stderr)
    references, answer_s = await _reference_pass(config, server.address, fingerprint, jobs, bar.update)
    drafters: Sequence[Drafter] = []  # timed real ones, or simulated
    if config.uses_edges:
        count = max(config.num_edges)
        if config.edge_kind == "real":
            bar.set_description("loading draft models")
            drafters = await asyncio.to_thread(real_drafters, config.draft, count, config.draft_threads)
        else:
            answers = [(list(job.token_ids), references[job.index], job.category) for job in jobs]
            drafters = simulated_drafters(fingerprint, count, profile, answers, config.seed)
    index_of = {job.prompt_id: job.index for job in jobs}
    try:
        if config.warmup:
            bar.set_description("warm-up")
            short = dataclasses.replace(config, max_tokens=min(config.max_tokens, WARMUP_TOKENS))
            for mode in config.modes:
                plan = [[jobs[0]] * config.warmup]
                await run_cell(Cell(mode, 1, 0.0), server.address, fingerprint, short, plan, drafters)
        # With --repeats, every cell runs once before any runs again (AR, SpecEdge, AR, SpecEdge, ...): a machine's
        # drift over minutes then falls on both sides of each ratio, not on whichever cell ran later.
        raw: list = []
        curve = None
        origin = time.monotonic()
        for repeat in range(config.repeats):
            for cell in cells:
                bar.set_description(f"{cell.mode} N={cell.num_edges} rtt={cell.rtt_ms:g}ms")
                requests = config.requests_for(cell.num_edges, len(jobs))
                plan = [[jobs[i] for i in edge] for edge in assignment(len(jobs), cell.num_edges, requests)]
                busy_before = [getattr(d, "busy_s", 0.0) for d in drafters]
                before = await asyncio.to_thread(server.scrape)
                started_s = time.monotonic() - origin
                wall_s, results = await run_cell(
                    dataclasses.replace(cell, repeat=repeat),
                    server.address,
                    fingerprint,
                    config,
                    plan,
                    drafters,
                    on_done=lambda: bar.update(1),
                    stagger_s=answer_s / cell.num_edges if config.stagger else 0.0,
                )
                delta = (await asyncio.to_thread(server.scrape)) - before
                edge_busy = 0.0
                if cell.mode not in SERVER_DRIVEN:
                    edge_busy = sum(getattr(d, "busy_s", 0.0) - b for d, b in zip(drafters, busy_before))
                if _comparable(config, cell.mode):
                    for result in results:
                        result.identical = result.token_ids == references[index_of[result.prompt_id]]
                run = CellRun(wall_s, results, delta, edge_busy, os.getloadavg()[0], started_s)
                if repeat == 0:
                    raw.append((cell, [run]))
                else:
                    next(runs for measured, runs in raw if measured == cell).append(run)
                points = await asyncio.to_thread(server.scrape_cost_points)  # every step so far, calibration included
                curve = CostCurve(points) if points else None
                if on_cell is not None:
                    on_cell(raw, references, curve)
    finally:
        bar.close()
        for drafter in drafters:
            drafter.close()
    return raw, references, curve


def _comparable(config: BenchConfig, mode: str) -> bool:
    """Whether answers must equal the reference: always, except sampled answers verified by rejection
    sampling, whose random draws depend on the drafts (README, "Lossless")."""
    return config.temperature == 0 or mode in SERVER_DRIVEN or config.edge_kind == "simulated"


async def _reference_pass(
    config: BenchConfig, address: str, fingerprint, jobs: list[Job], on_done
) -> tuple[list[list[int]], float]:
    """Every prompt answered by the server alone, as many at once as the server has sessions for; the
    answers, and the median time an answer took (what the cells stagger their edges' starts by)."""
    width = min(len(jobs), config.max_sessions)
    plan = [jobs[i::width] for i in range(width)]
    _, results = await run_cell(Cell("ar", width, 0.0), address, fingerprint, config, plan, [], on_done=on_done)
    by_id = {r.prompt_id: r.token_ids for r in results}
    answer_s = statistics.median(r.deliveries[-1][0] / 1e3 if r.deliveries else 0.0 for r in results)
    return [by_id[job.prompt_id] for job in jobs], answer_s


def _meta(config: BenchConfig, profile, jobs: list[Job], started, load_before) -> dict:
    """How the run was made; load_average_after is filled in as it goes."""
    return {
        "started_utc": started.isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "config": _jsonable(dataclasses.asdict(config)),
        "prompts": [{"id": j.prompt_id, "category": j.category, "prompt_tokens": len(j.token_ids)} for j in jobs],
        "profile": None if profile is None else {"path": str(config.profile), **profile.to_json()},
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": load_before,
        },
    }


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
