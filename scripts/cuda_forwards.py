"""Forward costs on a GPU: eager against CUDA graphs, each as a multiple of its roofline, in one run.

    python scripts/cuda_forwards.py --target random:qwen2-7b@/path/to/a-qwen2-tokenizer-dir --slots 64
    python scripts/cuda_forwards.py --target random:qwen2-1.5b --no-tokenizer   # no checkpoint at hand

`specedge-bench engine` measures the CPU paths; this is its counterpart for the CUDA path until the bench
grows one. It measures the machine (HBM stream: a sum over 4 GiB; bf16 peak: an 8192^3 product), loads the
target as the server does (flex attention), fills `--slots` KV slots with a 200-token prefix, and times
each step eagerly and through the server's GraphedRunner: the time to fill a bucket's tensors and block mask,
the replay alone, and the whole forward. Prefill steps past the largest bucket are timed on their first
call too (a compile shows there). The figures in bench/results/2026-11-25-h100-cuda.md came from it.
`--device cpu` runs the same code without capture (a smoke check of the script itself).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from specedge.bench.engine import Step
from specedge.registry import resolve
from specedge.server import attention, matmul
from specedge.server.cuda_graphs import GraphedRunner, bucket_for, padded
from specedge.server.loading import load_target
from specedge.server.matmul import resolve_matmul
from specedge.server.random_model import PRESETS, build_random, preset_of
from specedge.server.runner import ForwardRequest, KVCache, ModelRunner
from specedge.tokens import TokenizerFingerprint

PREFIX = 200  # cached tokens of each row, as in specedge-bench engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="model name, path, or random:PRESET[@TOKENIZER]")
    parser.add_argument("--steps", default="1x1,8x1,8x5,16x5,7x5+p120", help="comma-separated, as specedge-bench")
    parser.add_argument("--slots", type=int, default=64, help="KV slots (the block mask spans all of them)")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--no-tokenizer", action="store_true", help="random:PRESET built without loading a tokenizer (no checkpoint)"
    )
    parser.add_argument("--matmul", default="auto", help="the matrix-product path (server/matmul.py)")
    parser.add_argument("--eager-prefills", default="129,160,197,256,300", help="prefill lengths timed eagerly first")
    parser.add_argument("--profile", default="", help="comma-separated steps whose replay's kernels are listed")
    parser.add_argument(
        "--packed-too", action="store_true", help="also time each step eagerly in the packed layout of the queries"
    )
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    def timed(fn, repeats: int = args.repeats) -> float:
        """Median ms of `repeats` calls after one untimed, each waited for."""
        fn()
        _finish(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            _finish(device)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    on_gpu = device.type == "cuda"
    values = torch.empty(2 << 30 if on_gpu else 1 << 24, dtype=dtype, device=device).normal_()
    stream = values.nbytes / (timed(values.sum) / 1e3)
    size = 8192 if on_gpu else 512
    values = torch.randn(size, size, dtype=dtype, device=device)
    peak = 2 * size**3 / (timed(functools.partial(torch.matmul, values, values)) / 1e3)
    values = torch.empty(0)
    print(f"stream {stream / 1e9:.0f} GB/s, {args.dtype} peak {peak / 1e12:.1f} TFLOP/s", flush=True)

    if args.no_tokenizer:  # a GPU box without the real checkpoints: random weights and no tokenizer to load
        preset = preset_of(args.target)
        vocab_size = PRESETS[preset].vocab_size or 32_000
        fingerprint = TokenizerFingerprint(vocab_size, vocab_size, "", None, ())
        model, _ = build_random(preset, fingerprint, device=device, dtype=dtype)
        kind = resolve_matmul(args.matmul, device, dtype)
        matmul.prepare(model, kind)
        model.attention, name = "flex", args.target
    else:
        target = load_target(resolve(args.target), device=device, dtype=dtype, matmul=args.matmul, attention="flex")
        model, name, kind = target.model, target.name, target.matmul
    print(f"matrix products: {kind}", flush=True)
    weight_bytes = sum(p.nbytes for p in model.parameters())
    tied = model.args.tie_word_embeddings  # an untied embedding is a lookup, not a product
    flops_per_token = 2 * sum(p.numel() for n, p in model.named_parameters() if "embed" not in n or tied)
    steps = [Step.parse(name) for name in args.steps.split(",")]
    num_slots = max(max(s.rows + (1 if s.prefill else 0) for s in steps) + 2, args.slots)
    kv = KVCache(model, num_slots=num_slots, max_len=args.max_len, device=device, dtype=dtype)
    print(f"{name}: {weight_bytes / 1e9:.2f} GB of weights; KV {num_slots} slots x {args.max_len}", flush=True)
    eager = ModelRunner(model, kv)
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(model.args.vocab_size, (args.max_len,), generator=generator).tolist()
    eager.forward([ForwardRequest(0, 0, tuple(token_ids[:PREFIX]), all_logits=False)])
    for cache in (*kv.k, *kv.v):
        cache[1:, :PREFIX] = cache[0, :PREFIX]
    for n in [int(n) for n in args.eager_prefills.split(",") if n]:
        request = [ForwardRequest(1, 0, tuple(token_ids[:n]), all_logits=False)]
        start = time.perf_counter()
        eager.forward_packed(request)
        _finish(device)
        first = (time.perf_counter() - start) * 1e3
        then = timed(lambda request=request: eager.forward_packed(request), 3)
        print(f"eager prefill {n}: first {first:.0f} ms, then {then:.1f} ms", flush=True)
    graphed = GraphedRunner(eager)
    print(f"capture {graphed.capture():.1f} s", flush=True)
    for step in steps:
        if (bucket := bucket_for(step.num_tokens, graphed.buckets)) is None:
            continue
        requests = step.requests(PREFIX, token_ids)
        state = graphed._captured[bucket]
        pad = padded(requests, bucket, graphed.scratch_slot)
        with torch.inference_mode():  # the buckets' tensors are inference tensors, as every step's are
            fill = timed(lambda state=state, pad=pad: graphed._fill(state, pad))
        replay = timed(state.graph.replay) if state.graph is not None else float("nan")
        print(f"{step.name}: fill {fill:.2f} ms, replay {replay:.2f} ms", flush=True)
        if step.name in args.profile.split(",") and state.graph is not None:
            _profile(step.name, state.graph.replay)
    rows = []
    for step in steps:
        requests = step.requests(PREFIX, token_ids)
        eager_ms = timed(lambda requests=requests: eager.forward_packed(requests))
        graph_ms = timed(lambda requests=requests: graphed.forward_packed(requests))
        roofline = max(weight_bytes / stream, step.num_tokens * flops_per_token / peak) * 1e3
        rows.append({"step": step.name, "eager_ms": eager_ms, "graphs_ms": graph_ms, "roofline_ms": roofline})
        if args.packed_too:
            grouped_max_row, attention.GROUPED_MAX_ROW = attention.GROUPED_MAX_ROW, 0
            try:
                rows[-1]["eager_packed_ms"] = timed(lambda requests=requests: eager.forward_packed(requests))
            finally:
                attention.GROUPED_MAX_ROW = grouped_max_row
            print(f"{step.name:>9} eager, packed layout: {rows[-1]['eager_packed_ms']:7.2f} ms", flush=True)
        print(
            f"{step.name:>9} {step.num_tokens:4d} tokens: eager {eager_ms:7.2f} ms, graphs {graph_ms:7.2f} ms,"
            f" roofline {roofline:6.2f} ms; graphs {graph_ms / roofline:5.2f}x the roofline",
            flush=True,
        )
    machine = {"stream": stream, "peak": peak, "weight_bytes": weight_bytes}
    print(json.dumps({"target": args.target, **machine, "rows": rows}))


def _profile(name: str, replay) -> None:
    """The kernels of ten replays, by their own device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            replay()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    try:
        table = averages.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=70)
    except (AttributeError, KeyError):  # an older torch names it after CUDA
        table = averages.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70)
    print(f"{name}: ten replays' kernels\n{table}", flush=True)


def _finish(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
