"""`specedge-bench` (also `python -m bench`): SpecEdge against server-only baselines, in one invocation.

    specedge-bench --quick --out /tmp/bench              # N = 1, 4; every mode; 14 ms RTT; 4 short answers
    specedge-bench --num-edges 1 2 4 8 16 --out results  # the full sweep (RTT 0 and 14 ms)
    specedge-bench --target random:qwen2-7b --device cuda --modes ar specedge specedge_proactive
    specedge-bench profile                               # record the real pair's acceptance profile
    specedge-bench engine --out /tmp/engine              # the target's forwards against this machine's limits
    specedge-bench neighbours --out /tmp/neighbours      # a stream beside a heavy one: fair shares, gathering on/off

Every failure ends in one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import signal
import sys
from collections.abc import Callable

from specedge.edge_client.drafting.base import TreeBudget

from .config import DEFAULT_PRICES, EDGE_KINDS, MODES, BenchConfig, Pricing, quick

SUBCOMMANDS = ("run", "profile", "engine", "neighbours")


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="measure every mode (the default sub-command)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="server model; random:PRESET for random weights")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="edge draft model (its tokenizer builds the prompts)")
    p.add_argument("--server-draft", default=None, help="server's draft model for server_spec (default: --draft)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--num-edges", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="N sweep")
    p.add_argument(
        "--edge-kind",
        choices=EDGE_KINDS,
        default="simulated",
        help="simulated: replay --profile against the real target (edges use no CPU, as on their own "
        "machines); real: the draft model in this process",
    )
    p.add_argument("--profile", type=pathlib.Path, default=BenchConfig.profile, help="acceptance profile to replay")
    p.add_argument("--num-draft", type=int, default=4, help="draft tokens per round (edges and server_spec)")
    p.add_argument(
        "--tree", default=None, metavar="DEPTH,WIDTH,NODES", help="draft trees (real edges with a torch draft model)"
    )
    p.add_argument("--no-advice", action="store_true", help="edges always draft --num-draft (ignore server advice)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 14.0], help="emulated round trips (sweep)")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--categories", nargs="+", default=[], help="prompt categories (default: all)")
    p.add_argument("--prompts", type=pathlib.Path, default=None, help="prompt file (default: bench/prompts.json)")
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=BenchConfig.max_tokens, help="new tokens per request")
    p.add_argument(
        "--requests-per-edge",
        type=int,
        default=BenchConfig.requests_per_edge,
        help="each edge's stream of requests (0: prompts / N, rounded up)",
    )
    p.add_argument("--no-stagger", action="store_true", help="every edge sends its first request at once")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per mode")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tp", type=int, default=1, help="the server's tensor-parallel ranks (specedge-server --tp)")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--draft-threads", type=int, default=1, help="llama.cpp threads per real edge")
    p.add_argument("--pin", action="store_true", help="real edges: server on CPU 0, edges on the others")
    p.add_argument(
        "--server-args",
        default="",
        metavar="'OPTIONS'",
        help="more specedge-server options as one string, e.g. --server-args='--no-fair-shares --step-tokens 32'",
    )
    p.add_argument("--server-hw", default="a100-80gb", help="price-table entry the server is billed as")
    p.add_argument("--edge-hw", default="rtx-4090", help="price-table entry each edge is billed as")
    p.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="NAME=USD_PER_HOUR",
        help=f"add or change a price (defaults: {', '.join(f'{k}={v}' for k, v in DEFAULT_PRICES.items())})",
    )
    p.add_argument("--quick", action="store_true", help="N = 1 and 4, every mode, 14 ms RTT, 4 prompts, 24 tokens")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results"))
    p.add_argument("--no-progress", action="store_true")


def _profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="record a real pair's per-category acceptance for simulated edges")
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--num-draft", type=int, default=8, help="fixed draft length: the deepest position measured")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--categories", nargs="+", default=[])
    p.add_argument("--prompts", type=pathlib.Path, default=None)
    p.add_argument("--draft-threads", type=int, default=1, help="llama.cpp threads (1 copes best with a busy CPU)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="default: bench/profiles/DRAFT--TARGET.json")
    p.add_argument("--write-sizes", action="store_true", help="record prompt and answer lengths in the prompt file")
    p.add_argument("--no-progress", action="store_true")


def _engine_parser(sub) -> None:
    import dataclasses

    from .engine import DEFAULT_PATHS, DEFAULT_STEPS, PATHS, EngineBenchConfig

    defaults = {field.name: field for field in dataclasses.fields(EngineBenchConfig)}
    p = sub.add_parser("engine", help="time the target's forwards against this machine's measured limits (CPU)")
    p.add_argument("--target", default=defaults["target"].default, help="model name, path, or random:PRESET")
    p.add_argument(
        "--matmul",
        nargs="+",
        default=list(DEFAULT_PATHS),
        help=f"paths to time: {', '.join(PATHS)} (default: {' '.join(DEFAULT_PATHS)})",
    )
    p.add_argument(
        "--steps",
        nargs="+",
        default=list(DEFAULT_STEPS),
        help="ROWSxTOKENS on a cached prefix, +pN for a prefill row from 0, or both (e.g. 7x5+p120)",
    )
    p.add_argument("--repeats", type=int, default=defaults["repeats"].default, help="timed runs; medians reported")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    p.add_argument("--dtype", default=defaults["dtype"].default, help="float32, or bfloat16 (changes numerics)")
    p.add_argument("--prefix", type=int, default=defaults["prefix"].default, help="cached tokens per row")
    p.add_argument("--stream-gb", type=float, default=defaults["stream_gb"].default, help="bandwidth test size")
    p.add_argument("--gemm-m", type=int, nargs="+", default=list(EngineBenchConfig.gemm_m), help="GEMM rows tried")
    p.add_argument(
        "--kernel-m",
        type=int,
        nargs="*",
        default=list(EngineBenchConfig.kernel_m),
        help="small M at which eager, oneDNN and inductor-frozen products are compared (none: skip)",
    )
    p.add_argument(
        "--attention-keys",
        type=int,
        nargs="*",
        default=list(EngineBenchConfig.attention_keys),
        help="cached keys a row at which one layer's numba and row-loop attention are compared (none: skip)",
    )
    p.add_argument(
        "--hf-decode", type=int, default=defaults["hf_decode"].default, help="transformers greedy steps timed (0: skip)"
    )
    p.add_argument("--host-rows", type=int, default=defaults["host_rows"].default, help="rows of draws timed")
    p.add_argument("--out", type=pathlib.Path, default=None, help="write engine.json and engine.md here")
    p.add_argument("--no-progress", action="store_true")


def _neighbours_parser(sub) -> None:
    from .neighbours import SETTINGS, NeighboursConfig

    defaults = NeighboursConfig()
    p = sub.add_parser("neighbours", help="a stream's latency beside a heavy identity, fair shares, gathering on/off")
    p.add_argument("--target", default=defaults.target, help="server model; random:PRESET for random weights")
    p.add_argument("--device", default=defaults.device)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(defaults.settings))
    p.add_argument("--a-rounds", type=int, default=defaults.a_rounds, help="A's measured rounds, alone and beside B")
    p.add_argument("--b-alone-s", type=float, default=defaults.b_alone_s, help="seconds B's rate is measured alone")
    p.add_argument("--long-prompt", type=int, default=defaults.long_prompt_tokens, help="B's long prompt, in tokens")
    p.add_argument("--step-tokens", type=int, default=None, help="fair: a fixed step budget (default: the knee)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "run")
    parser = argparse.ArgumentParser(prog="specedge-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    _profile_parser(sub)
    _engine_parser(sub)
    _neighbours_parser(sub)
    return parser.parse_args(argv)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    prices = dict(DEFAULT_PRICES)
    for item in args.price:
        name, sep, value = item.partition("=")
        try:
            prices[name] = float(value) if sep else float("nan")
        except ValueError:
            raise ValueError(f"--price wants NAME=USD_PER_HOUR, got {item!r}") from None
    tree = None
    if args.tree:
        try:
            tree = TreeBudget(*(int(v) for v in args.tree.split(",")))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--tree wants DEPTH,WIDTH,NODES (e.g. 6,3,16), got {args.tree!r}: {exc}") from None
    config = BenchConfig(
        target=args.target,
        draft=args.draft,
        server_draft=args.server_draft,
        modes=tuple(args.modes),
        num_edges=tuple(sorted(set(args.num_edges))),
        edge_kind=args.edge_kind,
        profile=args.profile,
        num_draft=args.num_draft,
        tree=tree,
        follow_advice=not args.no_advice,
        temperature=args.temperature,
        seed=args.seed,
        rtt_ms=tuple(args.rtt_ms),
        jitter_ms=args.jitter_ms,
        categories=tuple(args.categories),
        prompts_file=args.prompts,
        max_prompts=args.max_prompts,
        max_tokens=args.max_tokens,
        server_extra=tuple(shlex.split(args.server_args)),
        requests_per_edge=args.requests_per_edge or None,
        stagger=not args.no_stagger,
        warmup=args.warmup,
        repeats=args.repeats,
        device=args.device,
        dtype=args.dtype,
        tp=args.tp,
        max_context=args.max_context,
        draft_threads=args.draft_threads,
        pin=args.pin,
        pricing=Pricing(args.server_hw, args.edge_hw, tuple(prices.items())),
    )
    return quick(config) if args.quick else config


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # so that the server process is stopped on the way out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = {"run": _run, "profile": _profile, "engine": _engine, "neighbours": _neighbours}[args.command]
    return guarded(lambda: command(args))


def guarded(command: Callable[[], int]) -> int:
    """Run a bench command: every failure is one line on stderr and exit 2; Ctrl-C or SIGTERM stops the server."""
    from specedge.registry import RegistryError

    from .server import ServerFailed

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return command()
    except (ValueError, RegistryError, ServerFailed, OSError) as exc:
        print(f"specedge-bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specedge-bench: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    from .report import write_report
    from .run import run_benchmark

    config = bench_config(args)
    # Results so far are written after every cell: a long run stopped midway keeps what it measured.
    results = run_benchmark(
        config, progress=not args.no_progress, checkpoint=lambda partial: write_report(partial, args.out, plots=False)
    )
    paths = write_report(results, args.out)
    print((args.out / "summary.md").read_text())
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


def _profile(args: argparse.Namespace) -> int:
    import json

    from .profile import ProfileConfig, record_profile

    config = ProfileConfig(
        target=args.target,
        draft=args.draft,
        num_draft=args.num_draft,
        max_tokens=args.max_tokens,
        categories=tuple(args.categories),
        prompts_file=args.prompts,
        draft_threads=args.draft_threads,
        out=args.out,
        write_sizes=args.write_sizes,
    )
    profile = record_profile(config, progress=not args.no_progress)
    config.out_path.parent.mkdir(parents=True, exist_ok=True)
    config.out_path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    for name, category in profile.categories.items():
        print(f"{name:14s} acceptance by depth {list(category.acceptance)}  runner-up hit {category.runner_up_hit}")
    print(
        f"draft latency {profile.draft_s_per_call * 1e3:.1f} ms/call + {profile.draft_s_per_token * 1e3:.1f} ms/token"
    )
    print(f"wrote {config.out_path}", file=sys.stderr)
    return 0


def _engine(args: argparse.Namespace) -> int:
    from .engine import EngineBenchConfig, engine_markdown, run_engine_bench, write_engine_report

    config = EngineBenchConfig(
        target=args.target,
        matmul=tuple(args.matmul),
        steps=tuple(args.steps),
        repeats=args.repeats,
        threads=args.threads,
        dtype=args.dtype,
        prefix=args.prefix,
        stream_gb=args.stream_gb,
        gemm_m=tuple(args.gemm_m),
        kernel_m=tuple(args.kernel_m),
        attention_keys=tuple(args.attention_keys),
        hf_decode=args.hf_decode,
        host_rows=args.host_rows,
    )
    results = run_engine_bench(config, progress=not args.no_progress)
    print(engine_markdown(results))
    if args.out is not None:
        paths = write_engine_report(results, args.out)
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


def _neighbours(args: argparse.Namespace) -> int:
    from .neighbours import NeighboursConfig, run_neighbours, summary, write

    config = NeighboursConfig(
        target=args.target,
        device=args.device,
        settings=tuple(args.settings),
        a_rounds=args.a_rounds,
        b_alone_s=args.b_alone_s,
        long_prompt_tokens=args.long_prompt,
        step_tokens=args.step_tokens,
    )
    results = run_neighbours(config, progress=lambda line: print(line, file=sys.stderr))
    paths = write(results, args.out)
    print(summary(results))
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
