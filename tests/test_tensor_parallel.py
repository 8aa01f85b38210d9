"""Tensor parallelism (--tp 2 on CPU, gloo): the same logits and tokens as one process, and clean failure."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
import torch
from test_many_edges import MAX_NEW, prompt_for, tree_generate

from harness import start_server_process, tiny_server
from specedge import wire
from specedge.edge_client.client import EdgeClient
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.generation import generate
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.registry import ResolvedModel
from specedge.server.app import ServerConfig
from specedge.server.distributed import ParallelConfig, RankGroup
from specedge.server.loading import load_target
from specedge.server.matmul import pairs_unavailable
from specedge.server.model import ModelArgs
from specedge.server.parallel import TensorParallelError, load_shard, partition_for
from specedge.server.runner import ForwardRequest, KVCache, KVMove, ModelRunner
from specedge.server.tp_runner import TensorParallelRunner, decode_requests, encode_requests
from specedge.types import SamplingParams
from specedge.v1 import specedge_pb2 as pb
from specedge.v1 import specedge_pb2_grpc
from tiny_models import save_tiny_model

BIN = os.path.dirname(sys.executable)
CPU = torch.device("cpu")
NUM_SLOTS, MAX_LEN = 4, 96
ATOL = 1e-4  # all-reduce sums partial products in another order than one matmul


def _args(**overrides) -> ModelArgs:
    base = dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=2,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        qkv_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    return ModelArgs(**{**base, **overrides})


def test_partitions_split_heads_columns_and_vocab():
    """Qwen2.5-1.5B's shape: the docstring example of server/parallel.py, and its edge cases."""
    r0, r1 = (partition_for(_args(), rank, 2) for rank in (0, 1))
    assert (r0.head_start, r0.num_heads, r0.kv_head_start, r0.num_kv_heads) == (0, 6, 0, 1)
    assert (r1.head_start, r1.num_heads, r1.kv_head_start, r1.num_kv_heads) == (6, 6, 1, 1)
    assert (r1.intermediate_start, r1.intermediate_size) == (4480, 4480)
    assert (r1.vocab_start, r1.num_vocab_rows) == (75968, 75968)
    # Fewer KV heads than ranks: each rank keeps the KV head its query heads read.
    assert [partition_for(_args(), rank, 4).kv_head_start for rank in range(4)] == [0, 0, 1, 1]
    twelve_ways = _args(intermediate_size=12 * 64)
    assert [partition_for(twelve_ways, rank, 12).kv_head_start for rank in range(12)] == [0] * 6 + [1] * 6
    # A vocabulary that does not split evenly: the last share is padded, never cut.
    odd = partition_for(_args(vocab_size=385), 1, 2)
    assert (odd.vocab_start, odd.num_vocab_rows) == (193, 193)
    with pytest.raises(TensorParallelError, match="--tp 5 does not divide the model's 12 attention heads; use one of"):
        partition_for(_args(), 0, 5)
    with pytest.raises(TensorParallelError, match="cannot split the model's 4 KV heads"):
        partition_for(_args(num_kv_heads=4), 0, 6)
    with pytest.raises(TensorParallelError, match="--tp 12 does not divide the model's MLP width 8960"):
        partition_for(_args(), 0, 12)


def test_step_messages_round_trip():
    requests = [
        ForwardRequest(3, 10, (17, 42)),
        ForwardRequest(0, 0, tuple(range(30)), all_logits=False),
        ForwardRequest(1, 5, (7, 8, 9, 10), tree_parents=(0, 0, 2)),
    ]
    assert decode_requests(encode_requests(requests)) == requests
    assert encode_requests(requests[:1]) == [1, 3, 10, 2, 1, 0, 17, 42]  # the example in server/tp_runner.py
    with pytest.raises(ValueError, match="longer than its requests"):
        decode_requests([*encode_requests(requests), 5])


# -- logits: --tp 2 against one process, on the same requests --------------------------------------


@pytest.fixture(scope="module", params=["split-kv", "replicated-kv", "qwen3", "split-kv-flex"])
def runners(request, tmp_path_factory, tiny_target_dir):
    """(one process, rank 0 of two) over the same weights. "replicated-kv": 1 KV head, tied, vocab 387 (padded);
    "qwen3": per-head q/k norms, held whole by every rank; "split-kv-flex": the ranks take CUDA's attention path
    (query groups of each rank's heads; FlexAttention's eager reference on a CPU), the one process the row loop."""
    attention = "flex" if request.param.endswith("-flex") else "rows"
    if request.param.startswith("split-kv"):
        model_dir = tiny_target_dir
    elif request.param == "qwen3":
        model_dir = request.getfixturevalue("tiny_qwen3_dir")
    else:
        model_dir = save_tiny_model(
            tmp_path_factory.mktemp("tiny-kv1"),
            seed=4,
            arch="llama",
            num_kv_heads=1,
            vocab_size=387,
            tie_word_embeddings=True,
        )
    whole = load_target(ResolvedModel("tiny", "hf", model_dir), device=CPU, dtype=torch.float32).model
    config = ParallelConfig(tp=2, collective_timeout_s=60, exit_on_failure=False)
    group = RankGroup.launch(config, model_dir, device_type="cpu", dtype=torch.float32, attention=attention)
    try:
        shard = load_shard(model_dir, 0, 2, group.collectives, device=CPU, dtype=torch.float32)
        shard.attention = attention
        kv = KVCache(shard, num_slots=NUM_SLOTS, max_len=MAX_LEN, device=CPU, dtype=torch.float32)
        group.start_serving(NUM_SLOTS, MAX_LEN)
        whole_kv = KVCache(whole, num_slots=NUM_SLOTS, max_len=MAX_LEN, device=CPU, dtype=torch.float32)
        single = ModelRunner(whole, whole_kv)
        yield single, TensorParallelRunner(ModelRunner(shard, kv), group)
    finally:
        group.close()


def _same_logits(runners, requests):
    single, parallel = runners
    expected, got = single.forward(requests), parallel.forward(requests)
    assert len(got) == len(expected) == len(requests)
    for e, g in zip(expected, got):
        assert g.shape == e.shape and e.shape[-1] == single.model.args.vocab_size
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
    return got


def test_rank_zero_holds_half_of_every_split_weight(runners):
    single, parallel = runners
    whole, shard = single.model, parallel.model
    shard_layer, whole_layer = shard.model.layers[0], whole.model.layers[0]
    assert shard_layer.self_attn.q_proj.weight.shape[0] * 2 == whole_layer.self_attn.q_proj.weight.shape[0]
    assert shard_layer.self_attn.o_proj.weight.shape[1] * 2 == whole_layer.self_attn.o_proj.weight.shape[1]
    assert shard_layer.mlp.down_proj.weight.shape[1] * 2 == whole_layer.mlp.down_proj.weight.shape[1]
    assert shard.lm_head.weight.shape[0] == -(-whole.args.vocab_size // 2)
    assert sum(p.numel() for p in shard.parameters()) < 0.6 * sum(p.numel() for p in whole.parameters())


def test_prefill_mixed_batch_and_tree_logits_match_one_process(runners):
    a, b, c = tuple(range(5, 40)), tuple(range(100, 112)), tuple(range(200, 230))
    # Prefill: a full prompt (every position), and a chunked one (last position only).
    _same_logits(runners, [ForwardRequest(0, 0, a), ForwardRequest(1, 0, b[:8], all_logits=False)])
    # A mixed batch: a decode step, a 4-token chain, the next prefill chunk, a new prompt.
    _same_logits(
        runners,
        [
            ForwardRequest(0, len(a), (7,)),
            ForwardRequest(1, 8, b[8:]),
            ForwardRequest(2, 0, c[:20], all_logits=False),
        ],
    )
    # A tree (root -> 50 -> 51, root -> 60 -> 61), then its accepted path moved together, on every rank.
    [tree] = _same_logits(runners, [ForwardRequest(2, 20, (c[20], 50, 51, 60, 61), tree_parents=(0, 1, 0, 3))])
    assert tree.shape[0] == 5
    for runner in runners:
        runner.move_kv([KVMove(2, (23, 24), (21, 22))])  # keep root, 60, 61
    _same_logits(runners, [ForwardRequest(2, 23, (62, 63)), ForwardRequest(0, len(a) + 1, (8, 9, 10))])


# -- the real server: --tp 2 serves several edges exactly as --tp 1 ---------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return HFTokenizer(tiny_target_dir)


@pytest.fixture(scope="module")
def tp2_address(tiny_target_dir):
    process, address = start_server_process(
        "--model", str(tiny_target_dir), "--tp", "2", "--device", "cpu", "--max-context", "256"
    )
    yield address
    process.send_signal(signal.SIGINT)
    try:
        assert process.wait(timeout=30) == 0  # a clean stop: the worker got STOP and exited
    finally:
        process.kill()


async def _edges(address: str, tokenizer, prompts, draft_dir) -> list[list[int]]:
    """Two chain edges, two tree edges and two server-only streams, all at once."""
    drafters = [TorchDrafter(draft_dir) for _ in range(4)]
    policy = SpeculationPolicy(num_draft=4, max_new_tokens=MAX_NEW)

    async def chain(i):
        async with EdgeClient(address, tokenizer.fingerprint) as client:
            result = await generate(client, prompts[i], drafters[i], policy=policy)
            assert result.stats.accepted_tokens > 0
            return result.token_ids

    async def tree(i):
        async with EdgeClient(address, tokenizer.fingerprint) as client:
            return await tree_generate(client, prompts[i], drafters[i], SamplingParams(), None)

    async def alone(i):
        async with EdgeClient(address, tokenizer.fingerprint) as client:
            return (await generate(client, prompts[i], None, policy=policy)).token_ids

    try:
        return list(await asyncio.gather(chain(0), chain(1), tree(2), tree(3), alone(4), alone(5)))
    finally:
        for drafter in drafters:
            drafter.close()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [prompt_for(tokenizer, i) for i in range(6)]


@pytest.fixture(scope="module")
def tp1_outputs(tiny_target_dir, tiny_draft_dir, tokenizer, prompts):
    with tiny_server(tiny_target_dir, max_sessions=8) as tp1:
        return asyncio.run(_edges(tp1.address, tokenizer, prompts, tiny_draft_dir))


def test_tp2_greedy_output_is_token_identical_to_tp1(tp2_address, tp1_outputs, tiny_draft_dir, tokenizer, prompts):
    got = asyncio.run(_edges(tp2_address, tokenizer, prompts, tiny_draft_dir))
    assert got == tp1_outputs
    assert all(len(tokens) >= 2 for tokens in got)


def test_tp2_bfloat16_reads_each_ranks_packed_pairs_and_stays_lossless(
    tiny_target_dir, tiny_draft_dir, tokenizer, prompts
):
    """--tp 2 --dtype bfloat16 --matmul onednn-numba: every rank packs its shards for oneDNN and the kernel reads
    each one's pairs (no rank logs a projection left to oneDNN alone), and speculative decoding equals the same
    server's own server-only decoding (bfloat16 changes the target's numerics, and --tp sums in another order)."""
    if reason := pairs_unavailable(CPU, torch.bfloat16):
        pytest.skip(reason)
    output: list[str] = []
    process, address = start_server_process(
        "--model",
        str(tiny_target_dir),
        "--tp",
        "2",
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--matmul",
        "onednn-numba",
        "--max-context",
        "256",
        output=output,
    )

    async def answers():
        drafter = TorchDrafter(tiny_draft_dir)
        policy = SpeculationPolicy(num_draft=4, max_new_tokens=MAX_NEW)
        try:
            async with EdgeClient(address, tokenizer.fingerprint) as client:
                return [
                    (
                        await generate(client, prompt, drafter, policy=policy),
                        await generate(client, prompt, None, policy=policy),
                    )
                    for prompt in prompts[:3]
                ]
        finally:
            drafter.close()

    try:
        for speculative, alone in asyncio.run(answers()):
            assert speculative.token_ids == alone.token_ids and speculative.stats.accepted_tokens > 0
        log = "".join(output)
        assert "onednn-numba matrix products" in log
        assert "not laid out as the kernel reads them" not in log, log
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()


def test_torchrun_launches_the_same_server(tiny_target_dir, tp1_outputs, tiny_draft_dir, tokenizer, prompts):
    """torchrun starts both ranks (env:// rendezvous); rank 0 serves, and serves the same tokens."""
    launcher = [f"{BIN}/torchrun", "--standalone", "--nproc-per-node", "2", "--no-python"]
    process, address = start_server_process(
        "--model", str(tiny_target_dir), "--device", "cpu", "--max-context", "256", launcher=launcher
    )
    try:
        assert asyncio.run(_edges(address, tokenizer, prompts, tiny_draft_dir)) == tp1_outputs
    finally:
        process.terminate()  # torchrun stops its ranks
        process.wait(timeout=60)


# -- failing clearly ---------------------------------------------------------------------------------


def test_bad_tp_fails_at_start_in_one_line(tiny_target_dir):
    result = subprocess.run(
        [f"{BIN}/specedge-server", "--model", str(tiny_target_dir), "--tp", "3", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "specedge-server: --tp 3 does not divide the model's 4 attention heads; use one of 1, 2, 4"
    )


def test_a_port_in_use_fails_in_one_line_and_stops_the_ranks(tiny_target_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [f"{BIN}/specedge-server", "--model", str(tiny_target_dir), "--tp", "2", "--device", "cpu"]
        result = subprocess.run([*command, "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"specedge-server: could not bind 127.0.0.1:{port} (in use?)"
    # Rank 1 was stopped in order, not found dead by its watcher after the event loop had closed.
    assert "Traceback" not in result.stderr and "exited with code" not in result.stderr, result.stderr


def test_more_ranks_than_gpus_is_refused_before_loading(tiny_target_dir):
    too_many = ParallelConfig(tp=max(2, torch.cuda.device_count() + 1))
    config = ServerConfig(model=str(tiny_target_dir), device="cuda", parallel=too_many)
    with pytest.raises(ValueError, match=r"^--tp \d+ needs \d+ GPUs \(one per rank\), but \d+ are present$"):
        config.torch_device()


def test_killing_a_rank_stops_the_server_and_in_flight_edges_see_unavailable(tiny_target_dir, tokenizer):
    output: list[str] = []
    process, address = start_server_process(
        "--model", str(tiny_target_dir), "--tp", "2", "--device", "cpu", "--max-context", "512", output=output
    )
    try:
        [worker_pid] = [int(line.split()[-1]) for line in output if "tensor-parallel rank 1: pid" in line]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "print(i * i)"}])  # no EOS for 259 tokens

        async def stream_until_failure() -> grpc.aio.AioRpcError:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = specedge_pb2_grpc.SpecEdgeStub(channel)
                request = pb.GenerateRequest(
                    tokenizer=wire.fingerprint_to_proto(tokenizer.fingerprint),
                    prompt_token_ids=prompt,
                    max_new_tokens=250,
                )
                call = stub.Generate(request)
                await call.read()  # the stream is in flight
                os.kill(worker_pid, signal.SIGKILL)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                return info.value

        started = time.monotonic()
        error = asyncio.run(asyncio.wait_for(stream_until_failure(), timeout=60))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "tensor-parallel rank 1 exited with code -9" in error.details()
        assert process.wait(timeout=60) == 1
        assert time.monotonic() - started < 60
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("stopped serving" in line for line in output):
            time.sleep(0.1)  # the reader thread drains what the process wrote last
        assert "specedge-server: tensor-parallel rank 1 exited with code -9; stopped serving\n" in output
    finally:
        process.kill()


# -- the real pair --------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_target_with_tp2_serves_the_real_edge_losslessly():
    process, address = start_server_process("--model", "qwen2.5-coder-1.5b", "--tp", "2", "--device", "cpu")
    try:
        common = [
            "--server",
            address,
            "--prompt",
            "Write a Python function that adds two numbers.",
            "--max-tokens",
            "24",
            "--json",
        ]
        speculative = subprocess.run(
            [f"{BIN}/specedge-edge", "--draft", "qwen2.5-coder-0.5b", "--num-draft", "4", *common],
            capture_output=True,
            text=True,
            timeout=600,
        )
        alone = subprocess.run(
            [f"{BIN}/specedge-edge", "--server-only", *common], capture_output=True, text=True, timeout=600
        )
        assert speculative.returncode == 0 and alone.returncode == 0, speculative.stderr + alone.stderr
        spec, server_only = json.loads(speculative.stdout), json.loads(alone.stdout)
        assert spec["text"] == server_only["text"] and spec["token_ids"] == server_only["token_ids"]
        assert len(spec["token_ids"]) == 24 and spec["stats"]["accepted_tokens"] > 0
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
