"""`specedge-bench neighbours`: what one identity's heavy use does to another's stream, fair shares on and off.

    specedge-bench neighbours --target random:qwen2-0.5b --device cpu --out /tmp/neighbours

One server per setting (fair shares; fair shares without gathering; arrival
order), started as deployed, with the recommended limits (SECURITY.md):
tokens for two identities, 8 sessions, 4 per identity, 50 rounds a second
per identity. Then:

- A alone: one session of server-only rounds (empty drafts), greedy; its
  inter-token latency (ITL), from reply to reply at the edge;
- B alone: four sessions sending, back to back, rounds of 64 random draft
  tokens (all rejected); its rates: rounds, tokens committed, tokens verified;
- A beside B: both at once; A's ITL and its ratio to A alone, B's rates;
- a long prefill: A streams while B opens one session with a 3,000-token
  prompt; A's worst inter-token gap, before and during it.

The ratios are measured side by side in one invocation, so they hold on a
shared machine where absolute times drift; the load average is recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import random
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable

import grpc

from specedge import wire
from specedge.edge_client.channel import ChannelSecurity, open_channel
from specedge.server.auth import make_token
from specedge.v1 import specedge_pb2 as pb
from specedge.v1 import specedge_pb2_grpc

from .server import ServerProcess

# Fair shares with gathering (the default); without gathering; neither (the old arrival order, still gathering).
SETTINGS = {"fair": [], "fair-no-gather": ["--no-gather"], "arrival": ["--no-fair-shares"]}


@dataclasses.dataclass(frozen=True)
class NeighboursConfig:
    target: str = "random:qwen2-0.5b"
    device: str = "cpu"
    settings: tuple[str, ...] = tuple(SETTINGS)
    a_rounds: int = 20  # A's measured rounds, alone and beside B
    b_sessions: int = 4
    b_draft_tokens: int = 64  # the server's default max draft nodes
    b_alone_s: float = 15.0  # how long B's rate is measured alone
    long_prompt_tokens: int = 3000
    prompt_tokens: int = 32  # A's and B's round sessions
    step_tokens: int | None = None  # fair shares: a fixed step budget (specedge-server --step-tokens); None: the knee
    seed: int = 0

    def __post_init__(self):
        unknown = set(self.settings) - set(SETTINGS)
        if unknown or not self.settings:
            raise ValueError(f"unknown settings {sorted(unknown)}; choose from {', '.join(SETTINGS)}")
        if min(self.a_rounds, self.b_sessions, self.b_draft_tokens, self.prompt_tokens) < 1 or self.b_alone_s <= 0:
            raise ValueError(f"invalid neighbours config: {self}")


async def _within_rate(call):
    """A call; past the identity's rate limit, it waits as the server says and tries again."""
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            retry_ms = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "10")
            await asyncio.sleep(int(retry_ms) / 1e3)


class _Identity:
    """One identity's connection (its token), raw rounds through the public wire."""

    def __init__(self, address: str, token: str, fingerprint: pb.TokenizerFingerprint):
        self.channel = open_channel(address, ChannelSecurity(token=token))
        self.stub = specedge_pb2_grpc.SpecEdgeStub(self.channel)
        self.fingerprint = fingerprint

    async def open(self, prompt: list[int], max_new_tokens: int) -> pb.OpenSessionResponse:
        request = pb.OpenSessionRequest(
            tokenizer=self.fingerprint,
            prompt_token_ids=prompt,
            max_new_tokens=max_new_tokens,
            sampling=pb.SamplingParams(),
        )
        return await _within_rate(lambda: self.stub.OpenSession(request, timeout=600))

    async def verify(self, session_id: str, drafts: list[int], num_generated: int) -> pb.VerifyResponse:
        request = pb.VerifyRequest(session_id=session_id, draft_token_ids=drafts, num_generated=num_generated)
        return await _within_rate(lambda: self.stub.Verify(request, timeout=600))

    async def close(self, session_id: str) -> None:
        await self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=60)


@dataclasses.dataclass
class _Tally:
    """B's rounds since `started` (B's sessions all add to the one current tally)."""

    started: float = dataclasses.field(default_factory=time.perf_counter)
    rounds: int = 0
    committed: int = 0
    verified: int = 0  # pending tokens + draft nodes verified
    cut: int = 0

    def add(self, num_drafts: int, reply: pb.VerifyResponse) -> None:
        verified = wire.verified_nodes_from_proto(reply, num_drafts)
        self.rounds += 1
        self.committed += len(reply.token_ids)
        self.verified += 1 + verified
        self.cut += num_drafts - verified

    def rates(self) -> dict:
        seconds = time.perf_counter() - self.started
        return {
            "seconds": round(seconds, 2),
            "rounds": self.rounds,
            "rounds_per_s": self.rounds / seconds,
            "committed_per_s": self.committed / seconds,
            "verified_per_s": self.verified / seconds,
            "cut_nodes": self.cut,
        }


class _Heavy:
    """B: sessions sending rounds of random drafts back to back, until stopped."""

    def __init__(self, identity: _Identity, config: NeighboursConfig, prompts: list[list[int]], vocab: int):
        self.tally = _Tally()
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._session(identity, config, p, vocab, i)) for i, p in enumerate(prompts)]

    async def _session(self, identity: _Identity, config: NeighboursConfig, prompt: list[int], vocab: int, i: int):
        rng = random.Random(config.seed * 1000 + i)
        session_id, generated = None, 0
        while not self._stop.is_set():
            if session_id is None:  # the first, or the last one ended (an end-of-sequence token)
                session_id, generated = (await identity.open(prompt, 3500)).session_id, 1
            drafts = [rng.randrange(vocab) for _ in range(config.b_draft_tokens)]
            reply = await identity.verify(session_id, drafts, generated)
            generated += len(reply.token_ids)
            self.tally.add(len(drafts), reply)
            if reply.finish_reason != pb.FINISH_REASON_NONE:
                await identity.close(session_id)
                session_id = None
        if session_id is not None:
            await identity.close(session_id)

    async def running(self) -> None:
        """Returns once every session has had a round answered."""
        while self.tally.rounds < len(self._tasks):
            await asyncio.sleep(0.05)

    def window(self) -> _Tally:
        self.tally = _Tally()
        return self.tally

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def _stream(identity: _Identity, prompt: list[int], num_rounds: int, until: asyncio.Future | None = None):
    """A's session: server-only rounds, `num_rounds` of them (and, given `until`, on until it is done);
    the gap before each reply, in seconds."""
    session_id, generated = (await identity.open(prompt, 4000)).session_id, 1
    gaps: list[float] = []
    last = time.perf_counter()
    while len(gaps) < num_rounds or (until is not None and not until.done()):
        reply = await identity.verify(session_id, [], generated)
        now = time.perf_counter()
        gaps.append(now - last)
        last, generated = now, generated + len(reply.token_ids)
        if reply.finish_reason != pb.FINISH_REASON_NONE:  # an end-of-sequence token: start again, untimed
            await identity.close(session_id)
            session_id, generated = (await identity.open(prompt, 4000)).session_id, 1
            last = time.perf_counter()
    await identity.close(session_id)
    return gaps


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


async def _measure(address: str, tokens: dict[str, str], fingerprint, config: NeighboursConfig) -> dict:
    a, b = (_Identity(address, tokens[name], fingerprint) for name in ("a", "b"))
    rng = random.Random(config.seed)
    vocab = fingerprint.num_tokens

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(length)]

    await _stream(a, prompt(config.prompt_tokens), 3)  # warm-up: unmeasured
    alone = await _stream(a, prompt(config.prompt_tokens), config.a_rounds)

    heavy = _Heavy(b, config, [prompt(config.prompt_tokens) for _ in range(config.b_sessions)], vocab)
    await heavy.running()
    b_alone = heavy.window()  # A idle
    await asyncio.sleep(config.b_alone_s)
    b_alone_rates = b_alone.rates()
    b_beside = heavy.window()
    beside = await _stream(a, prompt(config.prompt_tokens), config.a_rounds)
    b_beside_rates = b_beside.rates()
    await heavy.stop()

    # A long prefill from B while A streams: A's worst gap before it starts, and while it runs.
    async def long_prefill() -> float:
        started = time.perf_counter()
        opened = await b.open(prompt(config.long_prompt_tokens), 1)
        await b.close(opened.session_id)
        return time.perf_counter() - started

    prefill_done = asyncio.get_running_loop().create_future()
    a_task = asyncio.create_task(_stream(a, prompt(config.prompt_tokens), 3, until=prefill_done))
    await asyncio.sleep(1.0)  # A is streaming
    prefill_s = await long_prefill()
    prefill_done.set_result(None)
    gaps = await a_task
    return {
        "a_itl_alone_p50_ms": _ms(statistics.median(alone)),
        "a_itl_beside_p50_ms": _ms(statistics.median(beside)),
        "a_itl_ratio": round(statistics.median(beside) / statistics.median(alone), 2),
        "a_itl_beside_p90_ms": _ms(statistics.quantiles(beside, n=10)[-1]),
        "b_alone": b_alone_rates,
        "b_beside": b_beside_rates,
        "long_prefill": {
            "prompt_tokens": config.long_prompt_tokens,
            "b_ttft_s": round(prefill_s, 4),  # a tiny model's 100-token prefill can take under 5 ms
            "a_worst_gap_alone_ms": _ms(max(alone)),
            "a_worst_gap_during_ms": _ms(max(gaps)),
        },
    }


_STEP_METRICS = {
    "budget_tokens": "specedge:step_budget_tokens",
    "fixed_s": "specedge:step_cost_fixed_seconds",
    "per_token_s": "specedge:step_cost_per_token_seconds",
    "knee_tokens": "specedge:step_cost_knee_tokens",
}


def _step_cost(metrics_text: str) -> dict:
    """The server's step budget and the cost curve it came from, read from its /metrics."""
    values = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return {key: float(values.get(name, "nan")) for key, name in _STEP_METRICS.items()}


def _fingerprint(target: str) -> pb.TokenizerFingerprint:
    from specedge.edge_client.tokenizer import load_tokenizer
    from specedge.registry import RANDOM_PREFIX, RANDOM_TOKENIZER, resolve

    source = target
    if target.startswith(RANDOM_PREFIX):
        source = target.partition("@")[2] or RANDOM_TOKENIZER
    return wire.fingerprint_to_proto(load_tokenizer(resolve(source)).fingerprint)


def run_neighbours(config: NeighboursConfig, progress: Callable[[str], None] = print) -> dict:
    """Every setting's figures, measured one server after the other in this invocation."""
    fingerprint = _fingerprint(config.target)
    settings: dict[str, dict] = {}
    results = {"config": dataclasses.asdict(config), "load_average_before": os.getloadavg(), "settings": settings}
    with tempfile.TemporaryDirectory() as folder:
        tokens, lines = {}, []
        for name in ("a", "b"):
            tokens[name], line = make_token(name)
            lines.append(line)
        token_file = pathlib.Path(folder) / "tokens"
        token_file.write_text("\n".join(lines) + "\n")
        token_file.chmod(0o600)
        for setting in config.settings:
            progress(f"neighbours: {setting} ...")
            args = [
                "--model",
                config.target,
                "--device",
                config.device,
                "--auth-tokens",
                str(token_file),
                "--max-sessions",
                "8",
                "--max-sessions-per-identity",
                "4",
                "--max-rounds-per-second",
                "50",
                *SETTINGS[setting],
            ]
            if "--no-fair-shares" not in SETTINGS[setting] and config.step_tokens is not None:
                args += ["--step-tokens", str(config.step_tokens)]
            with ServerProcess(args) as server:
                figures = asyncio.run(_measure(server.address, tokens, fingerprint, config))
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30)
                figures["step"] = _step_cost(metrics.read().decode())
            settings[setting] = figures
            progress(f"neighbours: {setting}: {json.dumps(figures)}")
    results["load_average_after"] = os.getloadavg()
    return results


def summary(results: dict) -> str:
    """The figures as a Markdown table, one column per setting."""
    settings = results["settings"]
    rows = [
        ("A's ITL p50 alone (ms)", lambda f: f["a_itl_alone_p50_ms"]),
        ("A's ITL p50 beside B (ms)", lambda f: f["a_itl_beside_p50_ms"]),
        ("ratio beside / alone", lambda f: f"{f['a_itl_ratio']}x"),
        ("A's ITL p90 beside B (ms)", lambda f: f["a_itl_beside_p90_ms"]),
        ("B alone: rounds/s", lambda f: f"{f['b_alone']['rounds_per_s']:.2f}"),
        ("B alone: tokens committed/s", lambda f: f"{f['b_alone']['committed_per_s']:.2f}"),
        ("B alone: tokens verified/s", lambda f: f"{f['b_alone']['verified_per_s']:.1f}"),
        ("B beside A: tokens verified/s", lambda f: _beside(f["b_beside"])),
        ("B's long prompt: TTFT (s)", lambda f: f"{f['long_prefill']['b_ttft_s']:.3f}"),
        ("A's worst gap alone (ms)", lambda f: f["long_prefill"]["a_worst_gap_alone_ms"]),
        ("A's worst gap during B's prefill (ms)", lambda f: f["long_prefill"]["a_worst_gap_during_ms"]),
        ("step budget (tokens)", lambda f: f"{f['step']['budget_tokens']:.0f}"),
        (
            "cost curve a + b * tokens (ms)",
            lambda f: f"{f['step']['fixed_s'] * 1e3:.1f} + {f['step']['per_token_s'] * 1e3:.2f}",
        ),
    ]
    lines = ["| | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(str(cell(f)) for f in settings.values()) + " |" for label, cell in rows]
    before, after = results["load_average_before"], results["load_average_after"]
    prompt = results["config"]["long_prompt_tokens"]
    lines.append(f"\nB's long prompt: {prompt} tokens. Load average (1, 5, 15 min): before {before}, after {after}.")
    return "\n".join(lines) + "\n"


def _beside(rates: dict) -> str:
    """B's verified rate beside A; a window too short for any of B's rounds (A's rounds can all fit between two of
    B's on a small model) says so rather than reading as a rate of zero."""
    if rates.get("rounds", 1) == 0:
        return f"no round in {rates['seconds']} s"
    return f"{rates['verified_per_s']:.1f}"


def write(results: dict, out: pathlib.Path) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "neighbours.json", out / "neighbours.md"]
    paths[0].write_text(json.dumps(results, indent=2) + "\n")
    paths[1].write_text(summary(results))
    return paths
