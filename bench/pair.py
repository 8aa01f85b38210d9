"""One edge, one server: speculative vs server-only on the same prompts, in one run.

    python -m bench.pair                          # real pair, k=4, 64 tokens, 5 prompts
    python -m bench.pair --num-draft 8 --out results.json

Starts `specedge-server` as its own process (as in deployment), drafts in this
process, and runs every prompt both ways back to back, so machine noise hits
both alike. Reports per response: wall time, target forwards per generated
token (1 prefill + 1 per round, over tokens), acceptance, and whether the two
outputs are token-identical.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that returns the ten most recent orders with their customer names.",
    "Translate to Korean: The weather is nice today, so let's go for a walk.",
    "Give a JSON object describing a book with title, author and year.",
]


def start_server(model: str, port: int, *extra_args: str, pin_cpus: set[int] | None = None) -> subprocess.Popen:
    """`specedge-server` in its own process; with `pin_cpus`, confined to those CPUs (torch threads to match)."""
    env = None
    if pin_cpus:
        env = {**os.environ, "OMP_NUM_THREADS": str(len(pin_cpus))}
    process = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "specedge-server"), "--model", model, "--port", str(port),
         *extra_args],
        env=env,
        preexec_fn=(lambda: os.sched_setaffinity(0, pin_cpus)) if pin_cpus else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    for line in process.stdout:
        if line.startswith("specedge-server ready on"):
            return process
    raise RuntimeError("specedge-server exited before it was ready")


async def run(args: argparse.Namespace, address: str) -> list[dict]:
    from specedge.edge_client.client import EdgeClient, EdgeConfig
    from specedge.edge_client.drafting import load_drafter
    from specedge.edge_client.tokenizer import load_tokenizer
    from specedge.registry import resolve

    resolved = resolve(args.draft)
    tokenizer = load_tokenizer(resolved)
    drafter = load_drafter(resolved)
    # Warm-up, not measured: a fresh server's first forwards page its weights in.
    warmup = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    for num_draft in (0, args.num_draft):
        async with EdgeClient(address, tokenizer.fingerprint, config=EdgeConfig(num_draft=num_draft, max_new_tokens=8)) as c:
            await c.generate(warmup, drafter if num_draft else None)
    rows = []
    for text in PROMPTS[: args.num_prompts]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        row = {"prompt": text}
        for mode, num_draft in (("server_only", 0), ("speculative", args.num_draft)):
            config = EdgeConfig(num_draft=num_draft, max_new_tokens=args.max_tokens)
            async with EdgeClient(address, tokenizer.fingerprint, config=config) as client:
                started = time.perf_counter()
                result = await client.generate(prompt, drafter if num_draft else None)
                wall = time.perf_counter() - started
            stats = result.stats
            row[mode] = {
                "wall_s": wall,
                "tokens": len(result.token_ids),
                "target_forwards_per_token": (1 + stats.rounds) / len(result.token_ids),
                **stats.as_dict(),
                "token_ids": result.token_ids,
            }
        row["identical"] = row["speculative"]["token_ids"] == row["server_only"]["token_ids"]
        rows.append(row)
        print(
            f"{text[:48]:48s}  server-only {row['server_only']['wall_s']:6.2f} s  "
            f"speculative {row['speculative']['wall_s']:6.2f} s  "
            f"acceptance {row['speculative']['acceptance_rate']:.2f}  identical {row['identical']}",
            file=sys.stderr,
        )
    drafter.close()
    return rows


def summarize(rows: list[dict], args: argparse.Namespace) -> str:
    spec = [r["speculative"] for r in rows]
    alone = [r["server_only"] for r in rows]
    drafted = sum(s["draft_tokens"] for s in spec)
    ratio = statistics.mean(s["wall_s"] / a["wall_s"] for s, a in zip(spec, alone))
    lines = [
        f"draft {args.draft} -> target {args.model}, k={args.num_draft}, {args.max_tokens} tokens, {len(rows)} prompts",
        "",
        "| metric | server-only | speculative |",
        "|---|---|---|",
        f"| wall time per response (mean) | {statistics.mean(a['wall_s'] for a in alone):.2f} s "
        f"| {statistics.mean(s['wall_s'] for s in spec):.2f} s |",
        f"| wall time ratio (speculative / server-only, mean per prompt) | 1.00 | {ratio:.2f} |",
        f"| target forwards per generated token | "
        f"{sum(a['tokens'] for a in alone) / sum(a['tokens'] for a in alone):.2f} | "
        f"{sum(1 + s['rounds'] for s in spec) / sum(s['tokens'] for s in spec):.3f} |",
        f"| acceptance rate | - | {sum(s['accepted_tokens'] for s in spec) / drafted if drafted else 0:.3f} |",
        f"| tokens per round | 1.00 | {statistics.mean(s['tokens_per_round'] for s in spec):.2f} |",
        f"| token-identical to server-only | - | {sum(r['identical'] for r in rows)}/{len(rows)} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--server", default=None, help="HOST:PORT of a running server (default: start one)")
    parser.add_argument("--out", default=None, help="write every raw measurement here as JSON")
    args = parser.parse_args(argv)

    server = None
    address = args.server
    if address is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = start_server(args.model, port)
        address = f"127.0.0.1:{port}"
    try:
        rows = asyncio.run(run(args, address))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    summary = summarize(rows, args)
    print(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "summary": summary}, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
