"""`specedge-edge`: draft on this machine, let a SpecEdge server verify."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence

from specedge.types import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specedge-edge", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of specedge-server")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="built-in name, .gguf file or HF directory")
    parser.add_argument("--prompt", required=True, help="a user chat message (chat template applied)")
    parser.add_argument("--raw", action="store_true", help="send --prompt as is, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-draft", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--server-only", action="store_true", help="let the server generate alone (no draft model)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--stats", action="store_true", help="after the streamed answer, one stats line on stderr")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for the draft model")
    parser.add_argument("--log-level", default="error", help="log level of the libraries' messages on stderr")
    return parser.parse_args(argv)


class TextStream:
    """Print decoded text as tokens arrive, holding back bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer, eos_token_ids: frozenset[int], out=sys.stdout):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.out = out
        self.tokens: list[int] = []
        self.printed = ""

    def text(self) -> str:
        return self.tokenizer.decode([t for t in self.tokens if t not in self.eos_token_ids])

    def feed(self, token_ids: Sequence[int]) -> None:
        self.tokens += token_ids
        text = self.text()
        if text.endswith("\ufffd"):
            return
        self.out.write(text[len(self.printed) :])
        self.out.flush()
        self.printed = text


async def _run(args: argparse.Namespace) -> int:
    from specedge.edge_client.client import EdgeClient, EdgeConfig
    from specedge.edge_client.tokenizer import load_tokenizer
    from specedge.registry import resolve

    config = EdgeConfig(
        num_draft=0 if args.server_only else args.num_draft,
        max_new_tokens=args.max_tokens,
        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k),
        seed=args.seed,
    )
    resolved = resolve(args.draft)
    tokenizer = load_tokenizer(resolved)
    if args.raw:
        prompt = tokenizer.encode(args.prompt)
    else:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    stream = TextStream(tokenizer, tokenizer.eos_token_ids)
    # Handshake before loading the draft model: an unreachable server or an
    # incompatible draft is reported in a second, not after a model load.
    async with EdgeClient(args.server, tokenizer.fingerprint, config=config) as client:
        drafter = None
        if not args.server_only:
            from specedge.edge_client.drafting import load_drafter

            options = {"n_threads": args.threads} if args.threads else {}
            drafter = await asyncio.to_thread(load_drafter, resolved, **options)
        try:
            result = await client.generate(prompt, drafter, on_tokens=lambda t: None if args.json else stream.feed(t))
        finally:
            if drafter is not None:
                drafter.close()
    stream.tokens = result.token_ids
    if args.json:
        print(json.dumps({"text": stream.text(), "token_ids": result.token_ids, "stats": result.stats.as_dict()}))
    else:
        print(flush=True)
        if args.stats:
            print(format_stats(result.stats), file=sys.stderr)
    return 0


def format_stats(stats) -> str:
    """One line a person can read: speed, acceptance, tokens per target forward."""
    tokens_per_s = 1e3 * stats.num_tokens / stats.total_ms if stats.total_ms else 0.0
    line = f"[{stats.num_tokens} tokens, {tokens_per_s:.1f} tok/s, first token {stats.ttft_ms:.0f} ms"
    if stats.draft_tokens:
        line += f", acceptance {stats.acceptance_rate:.0%}, {stats.tokens_per_round:.2f} tokens per verify round"
    return line + "]"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # stdout carries the answer and stderr one line on failure: no library progress bars.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from specedge.edge_client.client import EdgeError
    from specedge.registry import RegistryError

    try:
        return asyncio.run(_run(args))
    except (EdgeError, RegistryError, ValueError, OSError) as exc:
        print(f"specedge-edge: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nspecedge-edge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
