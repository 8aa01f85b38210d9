"""The command lines as a user runs them: subprocesses, a real socket, tiny models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

BIN = os.path.dirname(sys.executable)


pytestmark = pytest.mark.server_options(process=True)


def edge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([f"{BIN}/specedge-edge", *args], capture_output=True, text=True, timeout=300)


def test_edge_json_speculative_equals_server_only(server, tiny_draft_dir):
    address = server.address
    common = ["--server", address, "--draft", str(tiny_draft_dir), "--prompt", "print(i * i)", "--max-tokens", "30"]
    spec = edge(*common, "--json", "--num-draft", "4", "--no-fallback")
    alone = edge(*common, "--json", "--server-only")
    assert spec.returncode == 0 and alone.returncode == 0, spec.stderr + alone.stderr
    spec_out, alone_out = json.loads(spec.stdout), json.loads(alone.stdout)
    assert spec_out["token_ids"] == alone_out["token_ids"] and len(spec_out["token_ids"]) == 30
    assert set(spec_out["stats"]) == {
        "rounds",
        "draft_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "tokens_per_round",
        "ttft_ms",
        "itl_ms",
        "proactive_hit_rate",
        "wait_hidden_share",
        "visible_draft_ms",
        "hidden_draft_ms",
        "wait_ms",
        "resumes",
        "fallback",
    }
    assert spec_out["stats"]["fallback"] is None and alone_out["stats"]["fallback"] is None
    assert spec_out["stats"]["rounds"] < 29 and alone_out["stats"]["rounds"] == 29


def test_edge_errors_are_one_actionable_line(server, tiny_draft_dir, tiny_foreign_dir):
    address = server.address
    cases = {
        "cannot reach the server at 127.0.0.1:9": ["--server", "127.0.0.1:9", "--draft", str(tiny_draft_dir)],
        "unknown model 'no-such-model'; known names:": ["--server", address, "--draft", "no-such-model"],
        "draft vocab 320 != target vocab 384": ["--server", address, "--draft", str(tiny_foreign_dir)],
    }
    for message, args in cases.items():
        result = edge(*args, "--prompt", "hi", "--max-tokens", "4")
        assert result.returncode != 0, message
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("specedge-edge: ") and message in lines[0], result.stderr


def test_streamed_answer_with_a_stats_line(server, tiny_draft_dir):
    address = server.address
    common = ["--server", address, "--draft", str(tiny_draft_dir), "--prompt", "print(i * i)", "--max-tokens", "30"]
    common.append("--no-fallback")  # a loaded machine can measure the draft slower: the line would say so
    streamed = edge(*common, "--stats")
    as_json = edge(*common, "--json")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.rstrip("\n") == json.loads(as_json.stdout)["text"]
    lines = streamed.stderr.strip().splitlines()
    assert len(lines) == 1, streamed.stderr
    [stats_line] = lines
    assert stats_line.startswith("[30 tokens, ") and "acceptance" in stats_line and "first token" in stats_line


def test_server_refuses_an_unknown_model_in_one_line():
    result = subprocess.run(
        [f"{BIN}/specedge-server", "--model", "no-such-model"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("specedge-server: unknown model 'no-such-model'")


def test_server_stops_cleanly_on_sigterm(server):
    process = server.process
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert process.wait(timeout=30) == 0
    assert time.monotonic() - started < 30
