"""The real pair, through the real command lines: Qwen2.5-Coder 0.5B (llama.cpp) -> 1.5B (torch).

Marked `real_model`: slow (the first run dequantizes the 1.5B GGUF once into the
cache, about a minute), but it runs in CI like everything else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import ApiProcess, start_server_process

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
]
BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def server_address():
    process, address = start_server_process("--model", "qwen2.5-coder-1.5b", "--max-sessions", "4")
    yield address
    process.send_signal(2)  # SIGINT: clean shutdown
    try:
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()


def edge_run(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [f"{BIN}/specedge-edge", "--server", address, *args], capture_output=True, text=True, timeout=600
    )


def test_speculative_is_token_identical_to_server_only(server_address):
    accepted = drafted = 0
    for prompt in PROMPTS:
        common = ["--prompt", prompt, "--max-tokens", "40", "--json"]
        speculative = edge_run(server_address, "--draft", "qwen2.5-coder-0.5b", "--num-draft", "4", *common)
        server_only = edge_run(server_address, "--server-only", *common)
        assert speculative.returncode == 0, speculative.stderr
        assert server_only.returncode == 0, server_only.stderr
        spec, alone = json.loads(speculative.stdout), json.loads(server_only.stdout)
        assert spec["token_ids"] == alone["token_ids"]
        assert spec["text"] == alone["text"] and len(spec["token_ids"]) >= 16
        accepted += spec["stats"]["accepted_tokens"]
        drafted += spec["stats"]["draft_tokens"]
    assert accepted / drafted >= 0.6, (accepted, drafted)


def test_streamed_text_matches_the_json_text(server_address):
    prompt = ["--prompt", "Say hello in Korean.", "--max-tokens", "24"]
    streamed = edge_run(server_address, "--draft", "qwen2.5-coder-0.5b", *prompt)
    as_json = edge_run(server_address, "--draft", "qwen2.5-coder-0.5b", "--json", *prompt)
    assert streamed.returncode == 0 and as_json.returncode == 0, streamed.stderr + as_json.stderr
    assert streamed.stdout.rstrip("\n") == json.loads(as_json.stdout)["text"]


def test_incompatible_draft_is_refused_with_both_vocab_sizes(server_address):
    result = edge_run(server_address, "--draft", "smollm2-135m", "--prompt", "hi", "--max-tokens", "4")
    assert result.returncode != 0
    assert "draft vocab 49152 != target vocab 151936" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1  # one actionable line, no traceback


def test_four_concurrent_edges_are_each_token_identical_to_server_only(server_address):
    prompts = [
        "Write a Python function that adds two numbers.",
        "Name three sorting algorithms.",
        "Write a haiku about compilers.",
        "What does HTTP stand for?",
    ]

    def edges(*args: str) -> list[tuple[int, dict | str]]:
        """One edge process per prompt, all at once; (exit status, JSON answer or stderr) each."""
        running = [
            subprocess.Popen(
                [
                    f"{BIN}/specedge-edge",
                    "--server",
                    server_address,
                    *args,
                    "--prompt",
                    prompt,
                    "--max-tokens",
                    "24",
                    "--json",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for prompt in prompts
        ]
        outputs = [edge.communicate(timeout=900) for edge in running]
        return [
            (e.returncode, json.loads(out) if e.returncode == 0 else err) for e, (out, err) in zip(running, outputs)
        ]

    speculative = edges("--draft", "qwen2.5-coder-0.5b", "--threads", "1")
    alone = edges("--server-only")  # also concurrent: batched server-only decoding must give the same tokens
    for (status, spec), (alone_status, reference) in zip(speculative, alone):
        assert status == 0 and alone_status == 0, (spec, reference)
        assert spec["token_ids"] == reference["token_ids"] and len(spec["token_ids"]) >= 8


def test_openai_api_streams_the_targets_answer(server_address):
    """`specedge-edge serve` through the openai SDK: the streamed text is the server-only answer, token for token."""
    import openai

    prompt = "Write a Python function that reverses a string."
    # --no-fallback: on a loaded machine the draft can measure slower than the server alone, and the
    # answer would finish server-only; this test is about the speculative path through the SDK.
    api = ApiProcess("--server", server_address, "--draft", "qwen2.5-coder-0.5b", "--parallel", "1", "--no-fallback")
    try:
        assert api.health["model"] == "qwen2.5-coder-1.5b"
        client = openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        chunks = list(
            client.chat.completions.create(
                model=api.health["model"],
                messages=[{"role": "user", "content": prompt}],
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    finally:
        api.stop()
    alone = edge_run(server_address, "--server-only", "--prompt", prompt, "--max-tokens", "24", "--json")
    assert alone.returncode == 0, alone.stderr
    expected = json.loads(alone.stdout)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert chunks[-1].usage.completion_tokens == len(expected["token_ids"]) == 24
    stats = chunks[-1].model_extra["specedge"]
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0 and stats["fallback"] is None
