"""One edge, one server: server-only vs speculative vs proactive, on the same prompts, in one run.

    python -m bench.pair                          # real pair, k=4, 64 tokens, 5 prompts, 14 ms RTT
    python -m bench.pair --num-draft 8 --rtt-ms 0 --out results.json

Starts `specedge-server` as its own process (as in deployment), drafts in this
process, and runs every prompt in every mode back to back, so machine noise
hits all alike. The network round trip is emulated on the edge side. Reports
per response: wall time, inter-token latency, target forwards per generated
token (1 prefill + 1 per round, over tokens), acceptance, proactive hit rate
and the share of the wait it hid, and whether the outputs are token-identical.
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
    drafter = load_drafter(resolved, **({"n_threads": len(os.sched_getaffinity(0))} if args.pin else {}))
    # Warm-up, not measured: a fresh server's first forwards page its weights in.
    warmup = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    modes = {"server_only": (0, False), "speculative": (args.num_draft, False), "proactive": (args.num_draft, True)}
    for num_draft, proactive in modes.values():
        config = EdgeConfig(num_draft=num_draft, max_new_tokens=8, proactive=proactive)
        async with EdgeClient(address, tokenizer.fingerprint, config=config) as c:
            await c.generate(warmup, drafter if num_draft else None)
    rows = []
    for text in PROMPTS[: args.num_prompts]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        row = {"prompt": text}
        for mode, (num_draft, proactive) in modes.items():
            config = EdgeConfig(
                num_draft=num_draft, max_new_tokens=args.max_tokens, proactive=proactive, simulated_rtt_ms=args.rtt_ms
            )
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
        row["identical"] = all(row[mode]["token_ids"] == row["server_only"]["token_ids"] for mode in modes)
        rows.append(row)
        print(
            f"{text[:40]:40s}  ITL ms: server-only {row['server_only']['itl_ms']:6.1f}  "
            f"speculative {row['speculative']['itl_ms']:6.1f}  proactive {row['proactive']['itl_ms']:6.1f}  "
            f"hits {row['proactive']['proactive_hit_rate']:.2f}  identical {row['identical']}",
            file=sys.stderr,
        )
    drafter.close()
    return rows


def summarize(rows: list[dict], args: argparse.Namespace) -> str:
    by_mode = {mode: [r[mode] for r in rows] for mode in ("server_only", "speculative", "proactive")}

    def mean(mode: str, key: str) -> float:
        return statistics.mean(s[key] for s in by_mode[mode])

    def ratio(mode: str, base: str, key: str) -> float:
        return statistics.mean(s[key] / b[key] for s, b in zip(by_mode[mode], by_mode[base]))

    def forwards(mode: str) -> float:
        return sum(1 + s["rounds"] for s in by_mode[mode]) / sum(s["tokens"] for s in by_mode[mode])

    def acceptance(mode: str) -> float:
        drafted = sum(s["draft_tokens"] for s in by_mode[mode])
        return sum(s["accepted_tokens"] for s in by_mode[mode]) / drafted if drafted else 0.0

    lines = [
        f"draft {args.draft} -> target {args.model}, k={args.num_draft}, {args.max_tokens} tokens, "
        f"{len(rows)} prompts, emulated RTT {args.rtt_ms:g} ms",
        "",
        "| metric | server-only | speculative | proactive |",
        "|---|---|---|---|",
        f"| wall time per response (mean) | {mean('server_only', 'wall_s'):.2f} s | {mean('speculative', 'wall_s'):.2f} s "
        f"| {mean('proactive', 'wall_s'):.2f} s |",
        f"| ITL (mean of per-response means) | {mean('server_only', 'itl_ms'):.1f} ms | {mean('speculative', 'itl_ms'):.1f} ms "
        f"| {mean('proactive', 'itl_ms'):.1f} ms |",
        f"| ITL ratio vs server-only (mean per prompt) | 1.00 | {ratio('speculative', 'server_only', 'itl_ms'):.2f} "
        f"| {ratio('proactive', 'server_only', 'itl_ms'):.2f} |",
        f"| ITL ratio vs speculative without proactive | - | 1.00 | {ratio('proactive', 'speculative', 'itl_ms'):.2f} |",
        f"| target forwards per generated token | {forwards('server_only'):.2f} | {forwards('speculative'):.3f} "
        f"| {forwards('proactive'):.3f} |",
        f"| acceptance rate | - | {acceptance('speculative'):.3f} | {acceptance('proactive'):.3f} |",
        f"| proactive hit rate | - | - | {mean('proactive', 'proactive_hit_rate'):.2f} |",
        f"| share of the wait hidden | - | - | {mean('proactive', 'wait_hidden_share'):.2f} |",
        f"| token-identical to server-only | - | {sum(r['identical'] for r in rows)}/{len(rows)} "
        f"| {sum(r['identical'] for r in rows)}/{len(rows)} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--rtt-ms", type=float, default=14.0, help="emulated network round trip, edge side")
    parser.add_argument(
        "--pin", action="store_true",
        help="server on CPU 0, this edge on the others (one draft thread each): drafting ahead then cannot "
        "slow the server's forwards, as on separate machines",
    )  # fmt: skip
    parser.add_argument("--server", default=None, help="HOST:PORT of a running server (default: start one)")
    parser.add_argument("--out", default=None, help="write every raw measurement here as JSON")
    args = parser.parse_args(argv)

    server = None
    address = args.server
    if address is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cpus = sorted(os.sched_getaffinity(0))
        if args.pin and len(cpus) < 2:
            parser.error("--pin needs at least 2 CPUs")
        server = start_server(args.model, port, pin_cpus={cpus[0]} if args.pin else None)
        if args.pin:
            os.sched_setaffinity(0, set(cpus[1:]))
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
