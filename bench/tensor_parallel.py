"""--tp 1 vs --tp N: server throughput at N concurrent edges, both in one run.

    python -m bench.tensor_parallel                    # --tp 1 2, 4 edges, real pair, k = 4, 48 tokens
    python -m bench.tensor_parallel --tp 1 2 --edges 4 --out tp.json

For each --tp value one `specedge-server --tp T` process serves the same
edges (server-only decoding, then SpecEdge with llama.cpp drafts drafted in
this process), one server after the other, and the same metrics as
bench/throughput.py are read from its /metrics: tokens per server-busy-second
(rank 0's step time, which includes waiting for the other ranks) and per
wall-second. Every --tp must produce the tokens --tp 1 produced (lossless).
On a machine whose cores are shared by the ranks and the edges, expect no gain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys

from .pair import PROMPTS, start_server
from .throughput import EXTRA_PROMPTS, measure


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--edges", type=int, default=4)
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--draft-threads", type=int, default=1, help="llama.cpp threads per simulated edge")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.edges = [args.edges]  # what bench.throughput.measure iterates over

    from specedge.edge_client.drafting import load_drafter
    from specedge.edge_client.tokenizer import load_tokenizer
    from specedge.registry import resolve

    resolved = resolve(args.draft)
    tokenizer = load_tokenizer(resolved)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in PROMPTS + EXTRA_PROMPTS]
    drafters = [load_drafter(resolved, n_threads=args.draft_threads) for _ in range(args.edges[0])]
    results = {}
    try:
        for tp in args.tp:
            port, metrics_port = _free_ports(2)
            server = start_server(
                args.model, port, "--tp", str(tp), "--device", "cpu", "--metrics-port", str(metrics_port),
                "--max-sessions", str(args.edges[0]),
            )  # fmt: skip
            try:
                address = f"127.0.0.1:{port}"
                [row] = asyncio.run(measure(args, address, metrics_port, prompts, drafters, tokenizer.fingerprint))
            finally:
                server.terminate()
                server.wait(timeout=60)
            results[tp] = row
    finally:
        for drafter in drafters:
            drafter.close()
    print(_table(results, args))
    base = results[args.tp[0]]
    lossless = all(
        row[mode]["token_ids"] == base[mode]["token_ids"] and row["identical"]
        for row in results.values()
        for mode in ("server_only", "specedge")
    )
    print(f"every --tp produced the same tokens as --tp {args.tp[0]}: {lossless}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "cpus": len(os.sched_getaffinity(0)), "rows": results}, f, indent=1)
    return 0 if lossless else 1


def _table(results: dict[int, dict], args) -> str:
    base = results[args.tp[0]]
    lines = [
        f"target {args.model}, {args.edges[0]} edges, draft {args.draft} (k={args.num_draft}), "
        f"{args.max_tokens} tokens per edge, {len(os.sched_getaffinity(0))} CPUs shared by the ranks and the edges",
        "",
        "| --tp | server-only tok/server-s | vs first | SpecEdge tok/server-s | vs first | "
        "server-only tok/wall-s | SpecEdge tok/wall-s | acceptance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tp, row in results.items():
        alone, spec = row["server_only"], row["specedge"]
        lines.append(
            f"| {tp} | {alone['tokens_per_server_s']:.2f} | "
            f"{alone['tokens_per_server_s'] / base['server_only']['tokens_per_server_s']:.2f}x | "
            f"{spec['tokens_per_server_s']:.2f} | "
            f"{spec['tokens_per_server_s'] / base['specedge']['tokens_per_server_s']:.2f}x | "
            f"{alone['tokens_per_wall_s']:.2f} | {spec['tokens_per_wall_s']:.2f} | {spec['acceptance_rate']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
