"""`specedge-edge`: draft on this machine, let a SpecEdge server verify.

specedge-edge --prompt "..."     one answer, streamed to stdout
specedge-edge                    a multi-turn chat in the terminal
specedge-edge serve              an OpenAI-compatible API on localhost
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from specedge.fleet.broker import add_broker_options
from specedge.types import SamplingParams

DEFAULT_SERVER = "127.0.0.1:50051"


def add_edge_options(parser: argparse.ArgumentParser) -> None:
    """The options every mode shares: where the server is, what drafts, how."""
    parser.add_argument(
        "--server",
        default=None,
        help=f"HOST:PORT of specedge-server (default {DEFAULT_SERVER}); with --discover, the fallback",
    )
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="built-in name, .gguf file or HF directory")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 128; 1024 in chat)")
    parser.add_argument("--num-draft", type=int, default=4, help="draft tokens per round (chains)")
    parser.add_argument("--draft-p-min", type=float, default=0.0, help="stop a chain below this draft probability")
    parser.add_argument("--tree", action="store_true", help="draft trees (torch drafter) instead of chains")
    parser.add_argument("--tree-depth", type=int, default=6)
    parser.add_argument("--tree-width", type=int, default=3)
    parser.add_argument("--tree-nodes", type=int, default=16, help="draft tokens per tree")
    parser.add_argument(
        "--proactive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draft ahead while the server verifies (default: on, except with a server on this machine, whose "
        "verify forward it would slow down: README, 'One box')",
    )
    parser.add_argument(
        "--no-fallback", action="store_true", help="keep drafting even when it is slower than the server"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--server-only", action="store_true", help="let the server generate alone (no draft model)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for the draft model")
    parser.add_argument("--simulate-rtt-ms", type=float, default=0.0, help="emulate a network round trip (benchmarks)")
    parser.add_argument("--simulate-jitter-ms", type=float, default=0.0)
    parser.add_argument("--log-level", default="error", help="log level of the libraries' messages on stderr")
    fleet = parser.add_argument_group("fleet (needs the mqtt extra)")
    fleet.add_argument(
        "--discover", default=None, metavar="URL", help="choose the server via this broker: mqtt://HOST:PORT"
    )
    fleet.add_argument("--telemetry", action="store_true", help="publish this edge's stats (numbers, never text)")
    fleet.add_argument("--edge-id", default=None, help="this edge's id in telemetry (default: random)")
    add_broker_options(parser)
    security = parser.add_argument_group("security (see SECURITY.md)")
    security.add_argument("--token", default=None, help="bearer token from the server's operator (or $SPECEDGE_TOKEN)")
    security.add_argument(
        "--tls-ca", default=None, help="PEM CA that signed the server's certificate: connect with TLS"
    )
    security.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs (no --tls-ca)")
    security.add_argument("--tls-cert", default=None, help="PEM client certificate, for servers requiring mutual TLS")
    security.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        parser = argparse.ArgumentParser(
            prog="specedge-edge serve", description="An OpenAI-compatible API on this machine."
        )
        add_edge_options(parser)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--parallel", type=int, default=2, help="answers that draft at once; more wait")
        args = parser.parse_args(argv[1:])
        args.mode = "serve"
        return args
    parser = argparse.ArgumentParser(prog="specedge-edge", description=__doc__.split("\n")[0].split(":", 1)[1].strip())
    add_edge_options(parser)
    parser.add_argument("--prompt", default=None, help="one user message (chat template applied); none: chat")
    parser.add_argument("--raw", action="store_true", help="send --prompt as is, without the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--stats", action="store_true", help="after the streamed answer, one stats line on stderr")
    args = parser.parse_args(argv)
    args.mode = "chat" if args.prompt is None else "once"
    return args


def runtime_config(args: argparse.Namespace, default_max_tokens: int = 128):
    from specedge.edge_client.channel import ChannelSecurity
    from specedge.edge_client.client import ConnectionConfig
    from specedge.edge_client.drafting.base import TreeBudget
    from specedge.edge_client.policy import SpeculationPolicy, proactive_by_default
    from specedge.edge_client.runtime import RuntimeConfig

    proactive = args.proactive
    if proactive is None:  # the user did not say
        proactive = proactive_by_default(
            args.server or DEFAULT_SERVER, args.server is None and args.discover is not None
        )
    policy = SpeculationPolicy(
        num_draft=0 if args.server_only else args.num_draft,
        max_new_tokens=args.max_tokens or default_max_tokens,
        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k),
        seed=args.seed,
        draft_p_min=args.draft_p_min,
        tree=TreeBudget(args.tree_depth, args.tree_width, args.tree_nodes) if args.tree else None,
        proactive=proactive,
        slow_draft_fallback=not args.no_fallback,
    )
    connection = ConnectionConfig(
        security=ChannelSecurity.from_env(
            args.token, tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key
        ),
        simulated_rtt_ms=args.simulate_rtt_ms,
        simulated_jitter_ms=args.simulate_jitter_ms,
    )
    discovery = None
    if args.discover is not None:
        from specedge.fleet.broker import broker_from_args
        from specedge.fleet.discovery import DiscoveryConfig

        discovery = DiscoveryConfig(
            broker_from_args(args.discover, args), edge_id=args.edge_id, telemetry=args.telemetry
        )
    elif args.telemetry:
        raise ValueError("--telemetry publishes to the fleet broker: give it with --discover mqtt://HOST:PORT")
    return RuntimeConfig(
        server=args.server or (None if discovery else DEFAULT_SERVER),
        discovery=discovery,
        draft=args.draft,
        policy=policy,
        connection=connection,
        server_only=args.server_only,
        threads=args.threads,
        num_drafters=getattr(args, "parallel", 1),
    )


async def _answer_once(args: argparse.Namespace) -> int:
    from specedge.edge_client.runtime import EdgeRuntime
    from specedge.edge_client.text import IncrementalText

    runtime = EdgeRuntime(runtime_config(args))
    try:
        await runtime.start()
        tokenizer = runtime.tokenizer
        if args.raw:
            prompt = tokenizer.encode(args.prompt)
        else:
            prompt = runtime.chat_prompt([{"role": "user", "content": args.prompt}])
        text = IncrementalText(tokenizer, tokenizer.eos_token_ids)

        def show(token_ids) -> None:
            if not args.json:
                sys.stdout.write(text.feed(token_ids))
                sys.stdout.flush()

        result = await runtime.generate(prompt, show)
    finally:
        await runtime.close()
    if args.json:
        answer = tokenizer.decode([t for t in result.token_ids if t not in tokenizer.eos_token_ids])
        print(json.dumps({"text": answer, "token_ids": result.token_ids, "stats": result.stats.as_dict()}))
    else:
        print(flush=True)
        if args.stats:
            print(format_stats(result.stats), file=sys.stderr)
    return 0


def format_stats(stats) -> str:
    """One line a person can read: speed, acceptance, proactive hits, fallback."""
    tokens_per_s = 1e3 * stats.num_tokens / stats.total_ms if stats.total_ms else 0.0
    line = f"[{stats.num_tokens} tokens, {tokens_per_s:.1f} tok/s, first token {stats.ttft_ms:.0f} ms"
    if stats.draft_tokens:
        line += f", acceptance {stats.acceptance_rate:.0%}, {stats.tokens_per_round:.2f} tokens per verify round"
    if stats.proactive_rounds:
        line += f", proactive hits {stats.proactive_hit_rate:.0%} (hid {stats.wait_hidden_share:.0%} of the wait)"
    if stats.resumes:
        line += f", resumed {stats.resumes}x"
    if stats.fallback:
        line += f", server-only: {stats.fallback}"
    return line + "]"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # stdout carries the answer and stderr one line on failure: no library progress bars.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from specedge.edge_client.client import EdgeError
    from specedge.fleet.broker import FleetError
    from specedge.registry import RegistryError

    try:
        if args.mode == "serve":
            from specedge.edge_client.openai_api import serve

            return serve(args)
        if args.mode == "chat":
            from specedge.edge_client.chat import run_chat

            return run_chat(args)
        return asyncio.run(_answer_once(args))
    except (EdgeError, RegistryError, FleetError, ValueError, OSError) as exc:
        print(f"specedge-edge: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nspecedge-edge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
