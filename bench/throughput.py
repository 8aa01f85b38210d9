"""Server throughput with N concurrent edges: SpecEdge vs server-only decoding, one run.

    python -m bench.throughput                         # N = 1 2 4 8, real pair, k = 4, 48 tokens
    python -m bench.throughput --edges 1 4 --out t.json

One `specedge-server` process (with --metrics-port) serves every mode; for
each N the same N prompts run server-only (continuous batching, target
alone) and speculative (N edges drafting with llama.cpp in this process),
back to back. Reported per mode and N:

- tokens per server-busy-second: generated tokens / the server's summed step
  time (from its /metrics). This is what an operator pays for, and it is not
  distorted by the edges' drafting, which shares this machine's CPU here but
  runs on the users' own devices in deployment;
- tokens per wall-second, for completeness (distorted by that sharing);
- the scheduler's share of step time, and mean batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import sys
import time
import urllib.request

from .pair import PROMPTS, start_server

EXTRA_PROMPTS = [
    "Write a bash one-liner that counts lines in all .py files.",
    "What is the difference between a list and a tuple in Python?",
    "Write a function that reverses a linked list.",
]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    wanted = {
        "forward": r"^specedge:forward_seconds_sum (\S+)$",
        "schedule": r"^specedge:schedule_seconds_sum (\S+)$",
        "postprocess": r"^specedge:postprocess_seconds_sum (\S+)$",
        "steps": r"^specedge:engine_steps_total (\S+)$",
        "rows": r"^specedge:batch_size_sum (\S+)$",
        "generated": r"^specedge:generation_tokens_total (\S+)$",
    }
    return {name: float(re.search(pattern, text, re.M).group(1)) for name, pattern in wanted.items()}


async def run_mode(address: str, prompts: list[list[int]], drafters, fingerprint, num_draft: int, max_tokens: int):
    from specedge.edge_client.client import EdgeClient, EdgeConfig

    async def one(prompt, drafter):
        config = EdgeConfig(num_draft=num_draft if drafter else 0, max_new_tokens=max_tokens)
        async with EdgeClient(address, fingerprint, config=config) as client:
            return await client.generate(prompt, drafter)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(p, d) for p, d in zip(prompts, drafters)))
    return {"wall_s": time.perf_counter() - started, "results": results}


async def measure(args, address: str, metrics_port: int, all_prompts, drafters, fingerprint) -> list[dict]:
    """Every mode and N in one event loop (grpc.aio dislikes a new loop per run)."""
    # Warm-up, not measured: a fresh server's first forwards page its weights in.
    await run_mode(address, all_prompts[:1], [None], fingerprint, 0, 8)
    rows = []
    for num_edges in args.edges:
        prompts = [all_prompts[i % len(all_prompts)] for i in range(num_edges)]
        row = {"edges": num_edges}
        for mode, edge_drafters in (("server_only", [None] * num_edges), ("specedge", drafters[:num_edges])):
            before = await asyncio.to_thread(scrape, metrics_port)
            measured = await run_mode(address, prompts, edge_drafters, fingerprint, args.num_draft, args.max_tokens)
            after = await asyncio.to_thread(scrape, metrics_port)
            delta = {key: after[key] - before[key] for key in after}
            results = measured["results"]
            tokens = sum(len(r.token_ids) for r in results)
            busy = delta["forward"] + delta["schedule"] + delta["postprocess"]
            row[mode] = {
                "tokens": tokens,
                "wall_s": measured["wall_s"],
                "server_busy_s": busy,
                "tokens_per_server_s": tokens / busy,
                "tokens_per_wall_s": tokens / measured["wall_s"],
                # Everything the engine does besides the forward: planning, verification, commit.
                "scheduler_share": (delta["schedule"] + delta["postprocess"]) / busy,
                "mean_batch_size": delta["rows"] / delta["steps"],
                "acceptance_rate": sum(r.stats.accepted_tokens for r in results)
                / max(1, sum(r.stats.draft_tokens for r in results)),
                "token_ids": [r.token_ids for r in results],
            }
        row["identical"] = row["specedge"]["token_ids"] == row["server_only"]["token_ids"]
        rows.append(row)
        print(_line(row), file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--edges", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--draft-threads", type=int, default=1, help="llama.cpp threads per simulated edge")
    parser.add_argument(
        "--pin", action="store_true",
        help="server on CPU 0, edges on the others, in every mode: the edges' drafting then cannot slow the "
        "server's forwards, as on separate machines",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from specedge.edge_client.drafting import load_drafter
    from specedge.edge_client.tokenizer import load_tokenizer
    from specedge.registry import resolve

    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        port, metrics_port = a.getsockname()[1], b.getsockname()[1]
    server_args = ["--metrics-port", str(metrics_port), "--max-sessions", str(max(args.edges))]
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin:
        if len(cpus) < 2:
            parser.error("--pin needs at least 2 CPUs")
        server = start_server(args.model, port, *server_args, pin_cpus={cpus[0]})
        os.sched_setaffinity(0, set(cpus[1:]))
    else:
        server = start_server(args.model, port, *server_args)
    address = f"127.0.0.1:{port}"
    resolved = resolve(args.draft)
    tokenizer = load_tokenizer(resolved)
    texts = PROMPTS + EXTRA_PROMPTS
    all_prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    drafters = [load_drafter(resolved, n_threads=args.draft_threads) for _ in range(max(args.edges))]
    try:
        rows = asyncio.run(measure(args, address, metrics_port, all_prompts, drafters, tokenizer.fingerprint))
    finally:
        for drafter in drafters:
            drafter.close()
        server.terminate()
        server.wait(timeout=30)
    print(_table(rows, args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


def _line(row: dict) -> str:
    spec, alone = row["specedge"], row["server_only"]
    return (
        f"N={row['edges']}: server-only {alone['tokens_per_server_s']:.1f} tok/server-s, "
        f"SpecEdge {spec['tokens_per_server_s']:.1f} tok/server-s "
        f"({spec['tokens_per_server_s'] / alone['tokens_per_server_s']:.2f}x), identical {row['identical']}"
    )


def _table(rows: list[dict], args) -> str:
    lines = [
        f"target {args.model}, draft {args.draft} (k={args.num_draft}), {args.max_tokens} tokens per edge",
        "",
        "| edges | server-only tok/server-s | SpecEdge tok/server-s | ratio | server-only tok/wall-s | "
        "SpecEdge tok/wall-s | ratio | acceptance | mean batch (AR / SpecEdge) | scheduler share | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        spec, alone = row["specedge"], row["server_only"]
        lines.append(
            f"| {row['edges']} | {alone['tokens_per_server_s']:.2f} | {spec['tokens_per_server_s']:.2f} | "
            f"{spec['tokens_per_server_s'] / alone['tokens_per_server_s']:.2f}x | {alone['tokens_per_wall_s']:.2f} | "
            f"{spec['tokens_per_wall_s']:.2f} | {spec['tokens_per_wall_s'] / alone['tokens_per_wall_s']:.2f}x | "
            f"{spec['acceptance_rate']:.2f} | {alone['mean_batch_size']:.1f} / {spec['mean_batch_size']:.1f} | "
            f"{max(spec['scheduler_share'], alone['scheduler_share']):.2%} | {row['identical']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
