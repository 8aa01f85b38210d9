"""`specedge-edge serve` through the official `openai` SDK: real HTTP (uvicorn), real gRPC, tiny models.

Every answer is compared with the server generating alone (EdgeClient without a
drafter): the API must return exactly the target's text, whatever it drafted.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import signal
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from harness import ApiProcess, ApiThread, ServerThread, free_port, health, tiny_server, wait_healthy
from specedge.edge_client.client import ConnectionConfig, EdgeClient, EdgeError
from specedge.edge_client.generation import generate
from specedge.edge_client.openai_api import EdgeAPIServer, ServeConfig
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.runtime import RuntimeConfig
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.server.app import ServerConfig

# With the tiny target (greedy, 30 tokens): the first ends on EOS after 2 tokens, the others on the length limit.
CHATS = ["def add(a, b):", "The quick brown fox", "print(i * i)"]


pytestmark = pytest.mark.server_options(max_sessions=6, max_draft_tokens=16)


@pytest.fixture(scope="module")
def tokenizer(tiny_draft_dir):
    return HFTokenizer(tiny_draft_dir)


@pytest.fixture(scope="module")
def api(server, tiny_draft_dir):
    policy = SpeculationPolicy(num_draft=4)
    runtime = RuntimeConfig(server=server.address, draft=str(tiny_draft_dir), policy=policy, num_drafters=2)
    with ApiThread(runtime, ServeConfig(port=0)) as running:
        wait_healthy(running.base_url)
        yield running


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client, tiny_target_dir):
    [listed] = client.models.list().data
    assert listed.id == str(tiny_target_dir)  # the server's model name, as its handshake gave it
    return listed.id


def server_only(server, tokenizer, prompt: list[int], max_tokens: int) -> list[int]:
    """The target alone: the server decodes, no drafts."""

    async def run():
        async with EdgeClient(server.address, tokenizer.fingerprint) as edge:
            return await generate(edge, prompt, None, policy=SpeculationPolicy(max_new_tokens=max_tokens))

    return asyncio.run(run()).token_ids


def text_of(tokenizer, token_ids) -> str:
    return tokenizer.decode([t for t in token_ids if t not in tokenizer.eos_token_ids])


def chat_prompt(tokenizer, content: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}])


def finish_of(tokenizer, token_ids) -> str:
    return "stop" if token_ids[-1] in tokenizer.eos_token_ids else "length"


def test_chat_completion_is_the_targets_answer_with_usage_and_stats(server, tokenizer, client, model):
    finishes, drafted, accepted = set(), 0, 0
    for content in CHATS:
        prompt = chat_prompt(tokenizer, content)
        expected = server_only(server, tokenizer, prompt, 30)
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=30, temperature=0
        )
        [choice] = reply.choices
        assert choice.message.role == "assistant" and choice.message.content == text_of(tokenizer, expected)
        assert choice.finish_reason == finish_of(tokenizer, expected)
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(expected))
        assert reply.usage.total_tokens == len(prompt) + len(expected)
        assert reply.object == "chat.completion" and reply.model == model and reply.id.startswith("chatcmpl-")
        stats = reply.model_extra["specedge"]
        assert stats["draft_tokens"] > 0 and stats["fallback"] is None
        finishes.add(choice.finish_reason)
        drafted, accepted = drafted + stats["draft_tokens"], accepted + stats["accepted_tokens"]
    assert finishes == {"stop", "length"} and 0 < accepted <= drafted


def test_streamed_chat_completion_with_usage_chunk(server, tokenizer, client, model):
    content = CHATS[2]
    prompt = chat_prompt(tokenizer, content)
    expected = server_only(server, tokenizer, prompt, 30)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *text_chunks, finish_chunk, usage_chunk = chunks
    assert text_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == text_of(tokenizer, expected)
    assert len(text_chunks) > 2  # it streamed, in bursts
    assert all(c.usage is None and c.choices[0].finish_reason is None for c in text_chunks)
    assert finish_chunk.choices[0].finish_reason == "length"
    assert finish_chunk.model_extra["specedge"]["draft_tokens"] > 0
    assert usage_chunk.choices == [] and usage_chunk.object == "chat.completion.chunk"
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (len(prompt), 30)
    assert usage_chunk.model_extra["specedge"]["rounds"] == finish_chunk.model_extra["specedge"]["rounds"] > 0
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_text_completion_sends_the_prompt_without_a_chat_template(server, tokenizer, client, model, stream):
    text = "def add(a, b):\n    return"
    expected = server_only(server, tokenizer, tokenizer.encode(text), 20)
    reply = client.completions.create(model=model, prompt=text, max_tokens=20, temperature=0, stream=stream)
    if stream:
        chunks = list(reply)
        assert chunks[-1].choices[0].finish_reason == finish_of(tokenizer, expected)
        assert chunks[-1].model_extra["specedge"]["draft_tokens"] > 0
        answer = "".join(c.choices[0].text for c in chunks)
    else:
        assert reply.usage.completion_tokens == len(expected)
        assert reply.usage.prompt_tokens == len(tokenizer.encode(text))
        assert reply.object == "text_completion" and reply.choices[0].finish_reason == finish_of(tokenizer, expected)
        answer = reply.choices[0].text
    assert answer == text_of(tokenizer, expected)


def first_stop(text: str) -> str:
    """A stop string that occurs in the answer's middle: its first run of 2+ letters after the 5th character."""
    return re.compile(r"[A-Za-z]{2,}").search(text, 5).group()


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_answer_and_its_usage(server, tokenizer, client, model, stream):
    prompt = chat_prompt(tokenizer, CHATS[1])
    expected = server_only(server, tokenizer, prompt, 40)
    full = text_of(tokenizer, expected)
    stop = first_stop(full)
    # The answer ends at the token that completes the stop string; its text ends before the stop string.
    num_tokens = next(n for n in range(1, len(expected) + 1) if stop in text_of(tokenizer, expected[:n]))
    assert num_tokens < len(expected)
    request = dict(model=model, messages=[{"role": "user", "content": CHATS[1]}], max_tokens=40, temperature=0)
    if stream:
        chunks = list(
            client.chat.completions.create(
                **request, stop=[stop, "never"], stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish, usage = chunks[-2].choices[0].finish_reason, chunks[-1].usage
    else:
        reply = client.chat.completions.create(**request, stop=stop)
        text, finish, usage = reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage
    assert text == full[: full.index(stop)] and finish == "stop"
    assert usage.completion_tokens == num_tokens


def test_max_completion_tokens_gives_length(server, tokenizer, client, model):
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": CHATS[2]}], max_completion_tokens=5, temperature=0
    )
    expected = server_only(server, tokenizer, chat_prompt(tokenizer, CHATS[2]), 5)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == len(expected) == 5
    assert reply.choices[0].message.content == text_of(tokenizer, expected)


def test_concurrent_requests_each_get_their_own_session_and_are_lossless(server, tokenizer, api, model):
    contents = [f"edge {i} says hi" for i in range(4)]
    prompts = [chat_prompt(tokenizer, c) for c in contents]
    expected = [server_only(server, tokenizer, p, 24) for p in prompts]
    prefilled_before = server.server.stats.num_prompt_tokens

    async def ask(client, content, stream):
        request = dict(model=model, messages=[{"role": "user", "content": content}], max_tokens=24, temperature=0)
        if not stream:
            return (await client.chat.completions.create(**request)).choices[0].message.content
        chunks = await client.chat.completions.create(**request, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks])

    async def ask_all():
        async with openai.AsyncOpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(ask(client, c, stream=i % 2 == 1) for i, c in enumerate(contents)))

    answers = asyncio.run(ask_all())
    assert answers == [text_of(tokenizer, e) for e in expected]
    # Each request opened its own session with its whole prompt (none shared or continued another's).
    assert server.server.stats.num_prompt_tokens - prefilled_before == sum(map(len, prompts))
    assert not server.server.engine.sessions  # and closed it


def test_a_full_server_says_503_and_a_client_that_disconnects_frees_its_session(tiny_target_dir, tiny_draft_dir):
    # A 100 ms round trip makes the answer take ~60 rounds, several seconds, unless it is cancelled.
    policy, connection = SpeculationPolicy(num_draft=4), ConnectionConfig(simulated_rtt_ms=100)
    with tiny_server(tiny_target_dir, max_sessions=1) as server:
        runtime = RuntimeConfig(server.address, str(tiny_draft_dir), policy, connection, num_drafters=2)
        with ApiThread(runtime, ServeConfig(port=0)) as api:
            model = wait_healthy(api.base_url)["model"]
            request = dict(model=model, messages=[{"role": "user", "content": CHATS[2]}], max_tokens=200, temperature=0)
            client = openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
            for stream in (True, False):
                if stream:
                    chunks = client.chat.completions.create(**request, stream=True)
                    next(iter(chunks))
                    assert server.server.engine.sessions  # answering, in the server's only KV slot
                    with pytest.raises(openai.APIStatusError) as busy:  # refused before its stream began
                        client.chat.completions.create(**request, stream=True)
                    assert busy.value.status_code == 503 and "RESOURCE_EXHAUSTED" in busy.value.message
                    assert busy.value.response.headers["retry-after"] == "1"
                    chunks.close()
                else:  # a non-streamed request whose client gives up
                    with pytest.raises(openai.APITimeoutError):
                        client.with_options(timeout=0.5).chat.completions.create(**request)
                closed = time.monotonic()
                while server.server.engine.sessions:
                    assert time.monotonic() - closed < 2, "the session outlived its client"
                    time.sleep(0.05)


@pytest.mark.parametrize(
    "request_fields, status, param, message",
    [
        ({"n": 2}, 400, "n", "only n=1 is supported"),
        ({"model": "gpt-4o"}, 404, "model", "The model `gpt-4o` does not exist"),
        ({"logprobs": True}, 400, "logprobs", "logprobs are not supported"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role", "Input should be"),
        ({"max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
        # Past the wire's uint32: refused by the schema, not a protobuf error (a 500) inside the answer.
        ({"max_tokens": 2**32}, 400, "max_tokens", "less than 4294967296"),
        ({"max_completion_tokens": 2**32}, 400, "max_completion_tokens", "less than 4294967296"),
        ({"extra_body": {"top_k": 2**32}}, 400, "top_k", "less than 4294967296"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed when stream is true"),
        ({"messages": [{"role": "user", "content": "x" * 2000}]}, 400, "messages", "the server's context holds 256"),
    ],
)
def test_bad_requests_get_openai_errors(client, model, request_fields, status, param, message):
    request = {"model": model, "messages": [{"role": "user", "content": "hi"}], **request_fields}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**request)
    error = caught.value
    assert error.status_code == status and error.body["param"] == param and message in error.body["message"]
    assert error.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "request_fields, param, message",
    [
        ({"prompt": [5, -1]}, "prompt", "token id -1 at index 1 is not in [0, 2^32)"),
        ({"prompt": [2**32, 5]}, "prompt", "token id 4294967296 at index 0 is not in [0, 2^32)"),
        ({"prompt": [5, 7], "max_tokens": 2**40}, "max_tokens", "less than 4294967296"),
        ({"prompt": "def", "extra_body": {"top_k": 2**32}}, "top_k", "less than 4294967296"),
    ],
)
def test_out_of_range_completion_fields_get_400_naming_the_field(client, model, request_fields, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{"model": model, **request_fields})
    error = caught.value
    assert error.body["param"] == param and message in error.body["message"], error.body
    assert error.body["type"] == "invalid_request_error"


def test_a_token_id_past_the_vocabulary_is_refused_by_the_server_as_400(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=[5, 10**6])  # fits the wire; the target has 384 tokens
    assert "out of range for vocab size 384" in caught.value.body["message"]


def test_unknown_paths_get_an_openai_error_body(api):
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(api.base_url + "/v1/embeddings", timeout=10)
    assert caught.value.code == 404 and json.loads(caught.value.read())["error"]["type"] == "invalid_request_error"


def test_server_down_at_start_then_up(tiny_target_dir, tiny_draft_dir, tokenizer):
    port = free_port()
    runtime = RuntimeConfig(server=f"127.0.0.1:{port}", draft=str(tiny_draft_dir), server_only=True)
    with ApiThread(runtime, ServeConfig(port=0)) as api:
        client = openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0)
        assert health(api.base_url) == (503, {"status": "connecting", "server": f"127.0.0.1:{port}"})
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 503 and "not connected to the SpecEdge server" in caught.value.message
        assert caught.value.response.headers["retry-after"] == "1"
        assert f"cannot reach the server at 127.0.0.1:{port}" in api.err.getvalue()
        with ServerThread(ServerConfig(model=str(tiny_target_dir), port=port, max_context=256)) as server:
            status = wait_healthy(api.base_url, timeout_s=30)
            assert status["model"] == str(tiny_target_dir) and status["draft"] is None
            prompt = chat_prompt(tokenizer, CHATS[2])
            reply = client.chat.completions.create(
                model=status["model"], messages=[{"role": "user", "content": CHATS[2]}], max_tokens=12
            )
            assert reply.choices[0].message.content == text_of(tokenizer, server_only(server, tokenizer, prompt, 12))
            assert reply.model_extra["specedge"]["draft_tokens"] == 0  # --server-only


def test_an_incompatible_draft_stops_the_api_with_the_reason(server, tiny_foreign_dir):
    """Retrying cannot help here: the HTTP server stops, and run() raises the handshake's refusal."""
    runtime = RuntimeConfig(server=server.address, draft=str(tiny_foreign_dir), server_only=True)
    api = EdgeAPIServer(runtime, ServeConfig(port=0), err=io.StringIO())
    with pytest.raises(EdgeError, match="draft vocab 320 != target vocab 384"):
        asyncio.run(asyncio.wait_for(api.run(), 60))


def test_the_command_line_serves_and_stops_on_ctrl_c(server, tiny_draft_dir, tokenizer):
    api = ApiProcess("--server", server.address, "--draft", str(tiny_draft_dir), "--parallel", "1", "--max-tokens", "8")
    try:
        client = openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model=str(tiny_draft_dir), prompt="print(i")  # the draft's name is accepted
        expected = server_only(server, tokenizer, tokenizer.encode("print(i"), 8)  # --max-tokens is the default
        assert reply.choices[0].text == text_of(tokenizer, expected) and reply.usage.completion_tokens == len(expected)
    finally:
        status = api.stop(signal.SIGINT)
    stderr = "".join(api.stderr_lines)
    assert status == 130 and f"OpenAI-compatible API on {api.base_url}/v1" in stderr, stderr
    # The last word is the clean one-liner (a library may still log after it on a slow shutdown).
    assert [line for line in api.stderr_lines if line.startswith("specedge-edge:")][
        -1
    ] == "specedge-edge: interrupted\n"
    assert "Traceback" not in stderr, stderr


def test_a_port_in_use_is_one_clear_error(tiny_draft_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        runtime = RuntimeConfig(server="127.0.0.1:9", draft=str(tiny_draft_dir), server_only=True)
        api = EdgeAPIServer(runtime, ServeConfig(port=port), err=io.StringIO())
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            asyncio.run(asyncio.wait_for(api.run(), 60))


def test_a_vanishing_temperature_is_the_greedy_answer_not_token_0(server, tokenizer, client, model):
    """temperature 1e-39 once overflowed logits / T into NaN, and the sampler silently returned token 0.

    (logits - max) / T is finite for any T > 0, so the answer is the target's argmax, through drafting
    (the edge's q) and rejection sampling (the server's p) alike."""
    content = CHATS[1]
    expected = server_only(server, tokenizer, chat_prompt(tokenizer, content), 20)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=20, temperature=1e-39, seed=3
    )
    assert reply.choices[0].message.content == text_of(tokenizer, expected)
    assert reply.model_extra["specedge"]["draft_tokens"] > 0
