"""What one benchmark run measures: the one config every bench module reads its part of."""

from __future__ import annotations

import dataclasses
import math
import pathlib

from specedge.edge_client.drafting.base import TreeBudget

MODES = ("ar", "server_spec", "specedge", "specedge_proactive")
SERVER_DRIVEN = ("ar", "server_spec")  # the server generates alone; no edge drafting
EDGE_KINDS = ("simulated", "real")
PROFILES_DIR = pathlib.Path(__file__).with_name("profiles")
DEFAULT_PROFILE = PROFILES_DIR / "qwen2.5-coder-0.5b--qwen2.5-coder-1.5b.json"

# $/hour. The paper's cloud prices (A100-80GB server, RTX 4090 edges); CPU
# prices depend on the machine: set them with --price NAME=USD_PER_HOUR.
DEFAULT_PRICES = {
    "a100-40gb": 4.05,
    "a100-80gb": 5.05,
    "rtx-4090": 0.35,
    "cpu-2core": 0.10,
}


@dataclasses.dataclass(frozen=True)
class Pricing:
    server_hw: str = "a100-80gb"  # billed for the cell's wall time
    edge_hw: str = "rtx-4090"  # billed for each edge's drafting (busy) time
    prices: tuple[tuple[str, float], ...] = tuple(DEFAULT_PRICES.items())

    def __post_init__(self):
        table = dict(self.prices)
        for name in (self.server_hw, self.edge_hw):
            if name not in table:
                raise ValueError(
                    f"no price for {name!r}; known: {', '.join(table)} (add one with --price {name}=USD_PER_HOUR)"
                )
        if any(not math.isfinite(p) or p < 0 for p in table.values()):
            raise ValueError("prices must be finite and >= 0")

    def usd_per_s(self, hw: str) -> float:
        return dict(self.prices)[hw] / 3600.0


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    target: str = "qwen2.5-coder-1.5b"  # the server's model (random:PRESET for random weights)
    draft: str = "qwen2.5-coder-0.5b"  # the edges' draft model (its tokenizer builds every prompt)
    server_draft: str | None = None  # the server's draft model for server_spec (default: `draft`)
    modes: tuple[str, ...] = MODES
    num_edges: tuple[int, ...] = (1, 2, 4, 8, 16)
    edge_kind: str = "simulated"
    profile: pathlib.Path | None = DEFAULT_PROFILE  # simulated edges replay it
    num_draft: int = 4  # draft tokens per round (chains), also the server_spec draft length
    tree: TreeBudget | None = None  # real torch-drafter edges only
    follow_advice: bool = True  # edges draft min(num_draft, the server's advice), as deployed
    temperature: float = 0.0
    seed: int = 0  # sampled runs: prompt i uses seed + i, in every mode (so outputs compare)
    rtt_ms: tuple[float, ...] = (0.0, 14.0)
    jitter_ms: float = 0.0
    categories: tuple[str, ...] = ()  # empty: all
    prompts_file: pathlib.Path | None = None  # default: bench/prompts.json
    max_prompts: int | None = None
    max_tokens: int = 96
    # A steady stream per edge (the paper's 60 prompts per client, in short): throughput is measured while
    # every edge is mid-stream (bench/metrics.py). None: ceil(prompts / N), so every N covers every prompt.
    requests_per_edge: int | None = 4
    stagger: bool = True  # edge i starts i / N of a reference answer's time late, so prefills do not coincide
    warmup: int = 1  # unmeasured requests per mode before the first cell
    repeats: int = 1
    device: str = "auto"
    dtype: str = "auto"
    tp: int = 1  # the server's --tp (tensor-parallel ranks)
    max_context: int = 1024
    draft_threads: int = 1  # llama.cpp threads per real edge
    pin: bool = False  # real edges: server on CPU 0, edges on the rest
    server_extra: tuple[str, ...] = ()  # more specedge-server options, e.g. ("--no-fair-shares",)
    pricing: Pricing = Pricing()

    def __post_init__(self):
        if not self.modes or set(self.modes) - set(MODES):
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {', '.join(self.modes) or 'none'}")
        if not self.num_edges or min(self.num_edges) < 1:
            raise ValueError("--num-edges needs at least one count, each >= 1")
        if self.edge_kind not in EDGE_KINDS:
            raise ValueError(f"edge kind must be one of {', '.join(EDGE_KINDS)}, got {self.edge_kind!r}")
        if self.edge_kind == "simulated" and self.uses_edges and self.profile is None:
            raise ValueError("simulated edges need an acceptance profile: --profile PATH (record one with `profile`)")
        if self.edge_kind == "simulated" and self.tree is not None:
            raise ValueError(
                "simulated edges draft chains only; use --edge-kind real with a torch (HF) draft for trees"
            )
        if self.num_draft < 1:
            raise ValueError(f"--num-draft must be >= 1, got {self.num_draft}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not self.rtt_ms or min(self.rtt_ms) < 0 or self.jitter_ms < 0:
            raise ValueError("round-trip times and jitter must be >= 0")
        if min(self.max_tokens, self.requests_per_edge or 1, self.repeats) < 1 or self.warmup < 0:
            raise ValueError("--max-tokens, --requests-per-edge and --repeats must be >= 1, --warmup >= 0")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError("--max-prompts must be >= 1")
        if self.pin and self.edge_kind != "real":
            raise ValueError("--pin separates real edges from the server; simulated edges use no CPU")

    @property
    def uses_edges(self) -> bool:
        return any(mode not in SERVER_DRIVEN for mode in self.modes)

    @property
    def server_draft_model(self) -> str:
        return self.server_draft or self.draft

    @property
    def max_sessions(self) -> int:
        return max(self.num_edges)

    def requests_for(self, num_edges: int, num_prompts: int) -> int:
        return self.requests_per_edge or -(-num_prompts // num_edges)


def quick(config: BenchConfig) -> BenchConfig:
    """The smoke-test preset: N = 1 and 4, every mode, 14 ms RTT, 4 prompts of 4 categories, two short answers
    per edge. An explicit smaller --max-tokens, --max-prompts or --requests-per-edge makes it smaller still.

    About 8 minutes on a 2-core CPU with the real pair when the machine is quiet.
    """
    return dataclasses.replace(
        config,
        num_edges=(1, 4),
        modes=MODES,
        rtt_ms=(14.0,),
        max_tokens=min(config.max_tokens, 24),
        max_prompts=min(config.max_prompts or 4, 4),
        requests_per_edge=min(config.requests_per_edge or 2, 2),
        repeats=1,
        warmup=1,
    )
