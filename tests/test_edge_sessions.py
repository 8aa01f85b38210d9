"""Sessions that outlive one round trip: chat turns, lost connections, failing drafters, Ctrl-C.

Every answer is still compared with target-only greedy decoding of exactly
the prompt the server saw: a resumed, continued or fallen-back answer must
have no token lost, repeated or changed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from harness import free_port, start_server_process
from reference import greedy_decode
from specedge.edge_client.client import ConnectionConfig, EdgeClient
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.generation import Conversation, generate
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.runtime import EdgeRuntime, RuntimeConfig
from specedge.edge_client.tokenizer import HFTokenizer

BIN = os.path.dirname(sys.executable)


pytestmark = pytest.mark.server_options(max_context=512, max_sessions=6, max_draft_tokens=16)


def prompt_tokens_prefilled(server) -> int:
    return server.server.stats.snapshot()["num_prompt_tokens"]


def test_chat_turns_prefill_only_the_new_message(server, tiny_draft_dir, reference_model):
    runtime = EdgeRuntime(RuntimeConfig(server.address, str(tiny_draft_dir), SpeculationPolicy(max_new_tokens=24)))
    eos = set(HFTokenizer(tiny_draft_dir).eos_token_ids)

    async def chat():
        await runtime.start()
        conversation = Conversation()
        history, turns = [], []
        for message in ("def add(a, b):", "print(i * i)", "The quick brown fox"):
            history.append({"role": "user", "content": message})
            prompt = runtime.chat_prompt(history, conversation)
            before = prompt_tokens_prefilled(server)
            held = len(conversation.tokens)
            result = await runtime.generate(prompt, conversation=conversation)
            turns.append((prompt, result.token_ids, prompt_tokens_prefilled(server) - before, held))
            history.append(
                {
                    "role": "assistant",
                    "content": runtime.tokenizer.decode([t for t in result.token_ids if t not in eos]),
                }
            )
        session_id = conversation.session_id
        await runtime.close()
        return turns, session_id

    turns, session_id = asyncio.run(chat())
    assert session_id is not None  # the conversation kept one session open across turns
    for index, (prompt, answer, prefilled, held) in enumerate(turns):
        assert answer == greedy_decode(reference_model, prompt, 24, eos)
        if index == 0:
            assert prefilled == len(prompt)
        else:
            # Only the new turn, plus the last answer's final token (sampled, never run through the model).
            assert prompt[:held] == turns[index - 1][0] + turns[index - 1][1]
            assert prefilled == len(prompt) - held + 1


def test_an_expired_conversation_session_is_reopened(server, tiny_draft_dir, reference_model):
    tokenizer = HFTokenizer(tiny_draft_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}])

    async def run():
        async with EdgeClient(server.address, tokenizer.fingerprint) as client:
            stale = Conversation(session_id="no-such-session", tokens=prompt[:5])
            policy = SpeculationPolicy(max_new_tokens=16)
            result = await generate(client, prompt, TorchDrafter(tiny_draft_dir), policy=policy, conversation=stale)
            return result, stale

    result, conversation = asyncio.run(run())
    assert result.token_ids == greedy_decode(reference_model, prompt, 16, set(tokenizer.eos_token_ids))
    assert conversation.session_id not in (None, "no-such-session")


class BrokenDrafter(TorchDrafter):
    """Drafts normally, then fails (a GPU lost, a corrupt model page...)."""

    def __init__(self, *args, fail_after: int, delay_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.fail_after, self.delay_s = 0, fail_after, delay_s

    def propose(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay_s)
        if self.calls > self.fail_after:
            raise RuntimeError("draft model crashed")
        return super().propose(*args, **kwargs)


@pytest.mark.parametrize(
    "drafter_options, policy, connection, reason",
    [
        (
            dict(fail_after=6),
            {},
            dict(simulated_rtt_ms=10),
            "the draft model failed: RuntimeError: draft model crashed",
        ),
        (
            dict(fail_after=10**6, delay_s=0.05),
            dict(slow_draft_fallback=True, proactive=False),
            {},
            "drafting is slower",
        ),
    ],
)
def test_a_failing_or_slow_drafter_falls_back_to_server_only(
    server, tiny_draft_dir, reference_model, drafter_options, policy, connection, reason
):
    tokenizer = HFTokenizer(tiny_draft_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "print(i * i)"}])
    drafter = BrokenDrafter(tiny_draft_dir, **drafter_options)
    slots_before = server.server.engine.slots.num_free

    async def run():
        async with EdgeClient(server.address, tokenizer.fingerprint, config=ConnectionConfig(**connection)) as client:
            answer = SpeculationPolicy(max_new_tokens=40, follow_advice=False, **policy)
            return await generate(client, prompt, drafter, policy=answer)

    result = asyncio.run(run())
    assert result.token_ids == greedy_decode(reference_model, prompt, 40, set(tokenizer.eos_token_ids))
    assert result.stats.fallback.startswith(reason)
    assert 0 < result.stats.rounds and result.stats.draft_tokens > 0  # it did draft before falling back
    assert server.server.engine.slots.num_free == slots_before  # the speculative session was closed


def test_a_missing_draft_model_runs_server_only_and_says_so(server, tiny_draft_dir, tmp_path, reference_model):
    # The tokenizer is there, the weights are not.
    for name in os.listdir(tiny_draft_dir):
        if not name.endswith(".safetensors"):
            os.symlink(tiny_draft_dir / name, tmp_path / name)
    runtime = EdgeRuntime(RuntimeConfig(server.address, str(tmp_path), SpeculationPolicy(max_new_tokens=12)))
    tokenizer = HFTokenizer(tiny_draft_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}])

    async def run():
        await runtime.start()
        try:
            return await runtime.generate(prompt)
        finally:
            await runtime.close()

    result = asyncio.run(run())
    assert result.token_ids == greedy_decode(reference_model, prompt, 12, set(tokenizer.eos_token_ids))
    assert result.stats.fallback.startswith("draft model unavailable")
    assert result.stats.draft_tokens == 0


@pytest.mark.parametrize("speculative", [True, False])
def test_restarting_the_server_mid_answer_loses_and_repeats_nothing(
    tiny_target_dir, tiny_draft_dir, reference_model, speculative
):
    port = free_port()
    server_args = ("--model", str(tiny_target_dir), "--max-context", "512", "--log-level", "warning")
    process, address = start_server_process(*server_args, port=port)
    tokenizer = HFTokenizer(tiny_draft_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "print(i * i)"}])
    restarted = threading.Event()
    processes = [process]

    def restart_once(received: list[int]) -> None:
        if len(received) >= 8 and not restarted.is_set():
            restarted.set()
            processes[0].kill()
            processes[0].wait()
            # Back on the same port a few seconds later, as after a crash and a supervisor restart.
            threading.Thread(
                target=lambda: processes.append(start_server_process(*server_args, port=port)[0]), daemon=True
            ).start()

    async def run():
        # A 30 ms emulated round trip keeps the answer going long enough to kill the server mid-way.
        connection = ConnectionConfig(simulated_rtt_ms=30, reconnect_timeout_s=120)
        received: list[int] = []

        def on_tokens(token_ids):
            received.extend(token_ids)
            restart_once(received)

        async with EdgeClient(address, tokenizer.fingerprint, config=connection) as client:
            drafter = TorchDrafter(tiny_draft_dir) if speculative else None
            policy = SpeculationPolicy(max_new_tokens=60, proactive=speculative)
            return await generate(client, prompt, drafter, on_tokens, policy=policy), received

    try:
        result, received = asyncio.run(run())
    finally:
        for running in processes:
            running.kill()
    assert restarted.is_set() and result.stats.resumes >= 1
    expected = greedy_decode(reference_model, prompt, 60, set(tokenizer.eos_token_ids))
    assert result.token_ids == received == expected


def test_terminal_chat_turns_and_ctrl_c(server, tiny_draft_dir):
    """Two turns through stdin, a Ctrl-C that stops a long answer and frees its slot, a Ctrl-C at the prompt to exit."""
    command = [
        f"{BIN}/specedge-edge",
        "--server",
        server.address,
        "--draft",
        str(tiny_draft_dir),
        "--max-tokens",
        "400",
        "--simulate-rtt-ms",
        "40",
        "--no-fallback",
    ]
    chat = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr_lines: list[str] = []
    threading.Thread(target=lambda: stderr_lines.extend(iter(chat.stderr.readline, "")), daemon=True).start()
    stdout_chunks: list[str] = []
    threading.Thread(target=lambda: stdout_chunks.extend(iter(lambda: chat.stdout.read(1), "")), daemon=True).start()

    def wait_for(predicate, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out; stderr: {''.join(stderr_lines)}")

    engine = server.server.engine
    try:
        wait_for(lambda: any("specedge chat with" in line for line in stderr_lines))
        # A prompt the tiny model answers at length: the answer is still streaming when Ctrl-C comes.
        chat.stdin.write("for i in range(10):\n")
        chat.stdin.flush()
        wait_for(lambda: len(engine.sessions) == 1 and len("".join(stdout_chunks)) > 5)
        chat.send_signal(signal.SIGINT)
        wait_for(lambda: any("[stopped]" in line for line in stderr_lines))
        wait_for(lambda: len(engine.sessions) == 0, timeout_s=10)  # the slot is free, the chat goes on
        assert chat.poll() is None
        chat.stdin.write("def add(a, b):\n")
        chat.stdin.flush()
        wait_for(lambda: any(line.startswith("[") and "tok/s" in line for line in stderr_lines))
        chat.send_signal(signal.SIGINT)  # at the prompt: exit
        assert chat.wait(timeout=30) == 0
    finally:
        chat.kill()
