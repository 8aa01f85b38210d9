"""`specedge-edge` without --prompt: a multi-turn chat in the terminal.

Each turn continues the same server session, so only the new message is
prefilled (the drafter's cache likewise keeps the history). Ctrl-C while an
answer streams stops it and frees the server's slot; Ctrl-C at the prompt
(so a second Ctrl-C) or Ctrl-D exits. `/reset` starts a new conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading

from specedge.edge_client.generation import Conversation

CHAT_MAX_TOKENS = 1024


class _Lines:
    """stdin lines delivered to the event loop by a daemon thread (a blocked read never holds up exit)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._loop = loop
        threading.Thread(target=self._read, name="specedge-stdin", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, line.rstrip("\n"))
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)

    async def next(self) -> str | None:
        return await self._queue.get()


async def chat(args: argparse.Namespace, out=sys.stdout, err=sys.stderr) -> int:
    from specedge.edge_client.cli import format_stats, runtime_config
    from specedge.edge_client.runtime import EdgeRuntime
    from specedge.edge_client.text import IncrementalText

    runtime = EdgeRuntime(runtime_config(args, default_max_tokens=CHAT_MAX_TOKENS))
    loop = asyncio.get_running_loop()
    answering: asyncio.Task | None = None
    exiting = asyncio.Event()

    def on_interrupt() -> None:
        if answering is not None and not answering.done():
            answering.cancel()  # the generation closes its session on the way out
        else:
            exiting.set()

    loop.add_signal_handler(signal.SIGINT, on_interrupt)
    try:
        await runtime.start()
        print(
            f"specedge chat with {runtime.model_name} via {runtime.client.address}; "
            "Ctrl-C stops an answer, Ctrl-D exits",
            file=err,
            flush=True,
        )
        lines = _Lines(loop)
        history: list[dict[str, str]] = []
        conversation = Conversation()
        while True:
            if sys.stdin.isatty():
                out.write("> ")
                out.flush()
            line = await _first(lines.next(), exiting)
            if line is None:
                return 0
            if not line.strip():
                continue
            if line.strip() == "/reset":
                history.clear()
                if conversation.session_id is not None:  # its slot counts against our cap until closed
                    await runtime.client.close_session(conversation.session_id)
                conversation.reset()
                continue
            history.append({"role": "user", "content": line})
            text = IncrementalText(runtime.tokenizer, runtime.tokenizer.eos_token_ids)
            answer: list[str] = []

            def show(token_ids, text=text, answer=answer) -> None:  # this turn's, though called after the loop moves
                piece = text.feed(token_ids)
                answer.append(piece)
                out.write(piece)
                out.flush()

            prompt = runtime.chat_prompt(history, conversation)
            answering = asyncio.create_task(runtime.generate(prompt, show, conversation=conversation))
            try:
                result = await answering
                out.write("\n")
                print(format_stats(result.stats), file=err, flush=True)
            except asyncio.CancelledError:
                if exiting.is_set():
                    raise
                out.write("\n")
                print("[stopped]", file=err, flush=True)
            history.append({"role": "assistant", "content": "".join(answer)})
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await runtime.close()


async def _first(line_read, exiting: asyncio.Event) -> str | None:
    """The next line, or None on end of input or an interrupt at the prompt."""
    reading = asyncio.ensure_future(line_read)
    stopping = asyncio.ensure_future(exiting.wait())
    done, pending = await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return reading.result() if reading in done else None


def run_chat(args: argparse.Namespace) -> int:
    return asyncio.run(chat(args))
