"""`specedge-bench engine`: how close the target's forwards come to this machine's limits, in one run.

    specedge-bench engine --out /tmp/engine                  # the real 1.5B on eager, onednn and numba, 5 repeats
    specedge-bench engine --steps 1x1 8x5 --matmul onednn --repeats 3

Measured one after the other in this process (CPU only):

1. the limits: memory stream bandwidth (a sum over a --stream-gb float32 tensor) and the peak GEMM rate
   (oneDNN's packed linear and eager F.linear, on a weight of the model's MLP shape, at M = --gemm-m);
   the same weight at the small M of verify rounds (--kernel-m) on these kernels: eager, oneDNN-packed (laid
   out for 1-row and for 16-row batches; the server packs for server/matmul.py's layout_rows()),
   inductor's compiled product with frozen weights (the alternative the packed path was chosen over), the
   numba path's product and, on AVX-512 CPUs, the numba product it does not run (the plain kernel where the
   panels run, the panels where they do not: the machine's choice for the dtype, matmul.panels_here());
2. each step's forward on each --matmul path, in ms and as a multiple of its roofline, max(weight bytes /
   bandwidth, FLOPs / peak GEMM rate), both limits measured in step 1; where attention is compiled (numba,
   the CPU float32 default), each forward also on the row loop, and where layers are compiled (numba) also
   module by module, all taken in turn; and one layer's attention alone on both, at --attention-keys cached
   keys a row, where AVX-512 lets the kernel take either also through the attention tiles or loops it did not
   choose (attention.tiles_here());
3. HF transformers' own greedy decoding on the same weights (ms per token; not for random: targets);
4. host time per step: server/draws.py's draw_rows over --host-rows rows x 5 tokens of the target's logits
   (of a random context, flat and scaled to peaked, and of the shipped prompts' text);
5. peak RSS after each phase, the KV cache each path reserved, and the private peak while each path loaded.

A step is named ROWSxTOKENS, +pN or both: "8x5" is 8 rows of 5 new tokens (causal chains with every
token's logits, like verify rounds), each on a --prefix-token cache; "+p120" adds one 120-token prefill
row from position 0 (last logits only); "p155" is that prefill row alone.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import re
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from specedge import noise
from specedge.registry import ResolvedModel, resolve
from specedge.server.draws import RowDraw, draw_rows
from specedge.server.heap import return_freed_memory
from specedge.server.kernels import cache_flush, cpu_name, in_turn_ms
from specedge.server.loading import load_target, weights_dir
from specedge.server.matmul import (
    PackedLinear,
    PairPanelLinear,
    PanelEmbedding,
    PanelLinear,
    PlainLinear,
    numba_projection,
    numba_unavailable,
    onednn_unavailable,
    pairs_unavailable,
    panel_kernel,
)
from specedge.server.model import CausalLM, ModelArgs
from specedge.server.runner import ForwardRequest, KVCache, ModelRunner
from specedge.server.verify import VerifyResult
from specedge.types import SamplingParams, SparseDist

PATHS = ("eager", "onednn", "numba", "onednn-numba")
DEFAULT_PATHS = PATHS[:3]  # onednn-numba is bfloat16's alone: asked for by name
KERNELS = ("eager", "onednn@1", "onednn@16", "inductor", "numba")  # matrix kernels compared at small M
OTHER_NUMBA = ("numba plain", "numba panels")  # the numba product the path does not run, where it can run too
# onednn@1, @16: packed for 1-row and for 16-row batches (the server packs for layout_rows()); inductor: frozen
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_STEPS = ("1x1", "1x5", "8x1", "8x5", "16x5", "7x5+p120", "p155")
HOST_TOKENS_PER_ROW = 5  # a verify round: the pending token and 4 drafts
HOST_TEMPERATURE = 0.8
HOST_PEAKED_SCALE = 20.0  # the host draws' peaked case: the sample's logits times this
HOST_TEXT_TOKENS = 80  # the host draws' text case: the logits at this many positions of the prompts' text
DRAFT_TOP = 20  # tokens in each draft distribution q sent with a sampled round
STREAM_COLUMNS = 1536  # the stream limit's table is [rows, this]: the numba reader's product is a weight's shape
_STEP_NAME = re.compile(r"(?:(\d+)x(\d+))?(?:\+?p(\d+))?")


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward: `rows` rows of `new_tokens` on a cached prefix, and optionally one prefill row from 0."""

    name: str
    rows: int
    new_tokens: int
    prefill: int  # 0: no prefill row

    @classmethod
    def parse(cls, name: str) -> Step:
        match = _STEP_NAME.fullmatch(name)
        rows, new_tokens, prefill = (int(g) if g else 0 for g in match.groups()) if match else (0, 0, 0)
        if (rows == 0) != (new_tokens == 0) or rows + prefill == 0:
            raise ValueError(f"--steps wants ROWSxTOKENS, +pN or both (e.g. 8x5, 7x5+p120, p155), got {name!r}")
        return cls(name, rows, new_tokens, prefill)

    @property
    def num_tokens(self) -> int:
        return self.rows * self.new_tokens + self.prefill

    @property
    def num_logits(self) -> int:
        return self.rows * self.new_tokens + (1 if self.prefill else 0)

    def requests(self, prefix: int, token_ids: list[int]) -> list[ForwardRequest]:
        """Row i in slot i on its `prefix` cached tokens; the prefill row in the next slot, from position 0."""
        rows = [
            ForwardRequest(slot, prefix, tuple(token_ids[: self.new_tokens]), all_logits=True)
            for slot in range(self.rows)
        ]
        if self.prefill:
            rows.append(ForwardRequest(self.rows, 0, tuple(token_ids[: self.prefill]), all_logits=False))
        return rows


@dataclasses.dataclass(frozen=True)
class EngineBenchConfig:
    target: str = "qwen2.5-coder-1.5b"  # a model name, path, or random:PRESET
    matmul: tuple[str, ...] = DEFAULT_PATHS  # the matrix-product paths whose forwards are timed (server/matmul.py)
    steps: tuple[str, ...] = DEFAULT_STEPS
    repeats: int = 5  # timed runs of each measurement (after one untimed); medians are reported
    threads: int | None = None  # torch threads; None: every core this process may use
    dtype: str = "float32"  # bfloat16 halves the weight stream but changes the target's numerics
    prefix: int = 200  # cached tokens of each non-prefill row (and HF's prompt)
    stream_gb: float = 2.0  # size of the tensor summed to measure memory bandwidth
    gemm_m: tuple[int, ...] = (64, 128, 256)  # GEMM rows tried for the peak rate
    kernel_m: tuple[int, ...] = (1, 2, 5, 8, 16, 40, 64)  # rows at which the matrix kernels are compared; () skips
    attention_keys: tuple[int, ...] = (200, 2000)  # cached keys at which one layer's attention paths are compared
    hf_decode: int = 16  # HF greedy decode steps timed; 0 skips HF
    host_rows: int = 64  # rows of HOST_TOKENS_PER_ROW logits each for the host-time draws

    def __post_init__(self):
        if not self.matmul or any(path not in PATHS for path in self.matmul):
            raise ValueError(f"--matmul takes {' and/or '.join(PATHS)}, got {' '.join(self.matmul) or 'nothing'}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype takes {' or '.join(DTYPES)}, got {self.dtype!r}")
        for step in self.steps:
            Step.parse(step)
        if not self.steps:
            raise ValueError("--steps needs at least one step")
        sizes = (self.repeats, self.prefix, self.host_rows, *self.gemm_m, *self.kernel_m, *self.attention_keys)
        if min(sizes) < 1 or self.hf_decode < 0:
            raise ValueError(
                "--repeats, --prefix, --host-rows, --gemm-m, --kernel-m and --attention-keys must be >= 1, "
                "--hf-decode >= 0"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if not 0 < self.stream_gb <= 64:
            raise ValueError(f"--stream-gb must be in (0, 64], got {self.stream_gb}")
        checks = (("onednn", onednn_unavailable), ("numba", numba_unavailable), ("onednn-numba", pairs_unavailable))
        for path, unavailable in checks:
            if path in self.matmul and (reason := unavailable(torch.device("cpu"), DTYPES[self.dtype])):
                raise ValueError(f"--matmul {path} cannot run: {reason}")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What one forward must stream and compute, from the model's shape (norms and biases are negligible)."""

    layer_params: int  # matrix weights of all decoder layers
    head_params: int  # the LM head's; a tied embedding is counted here once (a lookup reads only a few rows)
    attention_flops_per_key: int  # QK^T and PV for one token against one cached key, all layers and heads
    bytes_per_param: int
    kv_bytes_per_key: int  # one cached position's keys and values, all layers: read once by its row's step

    @classmethod
    def of(cls, args: ModelArgs, dtype: torch.dtype) -> CostModel:
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        per_layer = args.hidden_size * (2 * q_size + 2 * kv_size) + 3 * args.hidden_size * args.intermediate_size
        return cls(
            layer_params=args.num_layers * per_layer,
            head_params=args.vocab_size * args.hidden_size,
            attention_flops_per_key=4 * args.num_layers * args.num_heads * args.head_dim,
            bytes_per_param=torch.finfo(dtype).bits // 8,
            kv_bytes_per_key=2 * args.num_layers * kv_size * (torch.finfo(dtype).bits // 8),
        )

    @property
    def weight_bytes(self) -> int:
        return (self.layer_params + self.head_params) * self.bytes_per_param

    def flops(self, step: Step, prefix: int) -> float:
        """Every token runs the layers, only logit rows run the LM head, each token attends its keys."""

        def keys(cached: int, new: int) -> int:  # token j of a chain sees cached + j + 1 keys
            return new * cached + new * (new + 1) // 2

        num_keys = step.rows * keys(prefix, step.new_tokens) + keys(0, step.prefill)
        return 2.0 * (step.num_tokens * self.layer_params + step.num_logits * self.head_params) + (
            self.attention_flops_per_key * num_keys
        )

    def bytes(self, step: Step, prefix: int) -> int:
        """The weights once, and each row's keys and values once (its cached ones and its new ones, which its
        own tokens read back). On the 1.5B in fp32 the KV is 0.2% of the weights for one row at 200 cached
        tokens, and 15% for eight rows at 2,000."""
        num_keys = step.rows * (prefix + step.new_tokens) + step.prefill
        return self.weight_bytes + self.kv_bytes_per_key * num_keys

    def roofline_s(self, step: Step, prefix: int, bandwidth_gb_s: float, peak_gflop_s: float) -> float:
        return max(self.bytes(step, prefix) / (bandwidth_gb_s * 1e9), self.flops(step, prefix) / (peak_gflop_s * 1e9))


def _times_ms(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> list[float]:
    """`repeats` timings of fn after one untimed call (first-call packing, page faults); `before` runs untimed
    ahead of each."""
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _memory() -> dict:
    """Peak RSS so far (ru_maxrss: KiB on Linux, bytes on macOS) and, where /proc exists, the RSS now.

    rss_anon_bytes is the private part: weights read from a memory-mapped safetensors file count in RSS as
    file pages (clean, reclaimable) for as long as any tensor keeps that mapping alive.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    status = _proc_status()
    return {"peak_rss_bytes": peak, "rss_bytes": status.get("VmRSS"), "rss_anon_bytes": status.get("RssAnon")}


def _proc_status() -> dict[str, int | None]:
    """/proc/self/status's sizes in bytes ("RssAnon:   6378688 kB"); {} where there is no /proc."""
    status: dict[str, int | None] = {}
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            status[key] = int(value.split()[0]) * 1024 if value.strip().endswith("kB") else None
    except OSError:
        pass
    return status


class PrivatePeak:
    """`with PrivatePeak() as peak:` ... then peak.bytes: the largest private (anonymous) RSS seen meanwhile, read
    from /proc every `interval_s`; None where there is no /proc.

    This is what a load needs of memory. ru_maxrss, the peak RSS, also counts the pages of the memory-mapped
    checkpoint that the load copies the weights out of: on the 1.5B in float32 the peak read 13.8 GiB, about half
    of it that clean, reclaimable map (bench/RESULTS.md, 2026-12-07). Linux keeps no peak of the private part,
    hence the sampling; a spike shorter than the interval can be missed.
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.bytes: int | None = None
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="private-peak", daemon=True)

    def __enter__(self) -> PrivatePeak:
        self._note()  # the start, before the sampler's first turn
        self._sampler.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._sampler.join()
        self._note()  # the end state, whatever the last interval saw

    def _sample(self) -> None:
        while True:
            self._note()
            if self._stop.wait(self.interval_s):
                return

    def _note(self) -> None:
        anon = _proc_status().get("RssAnon")
        if anon is not None:
            self.bytes = max(self.bytes or 0, anon)


def stream_bandwidth(gb: float, repeats: int) -> dict:
    """GB/s of reading a float32 tensor far larger than any cache, every core its share: the faster of torch's sum
    and, where numba compiles, the numba kernel's one-row product over it (which reads each byte once)."""
    data = torch.ones(int(gb * 1e9) // (4 * STREAM_COLUMNS), STREAM_COLUMNS)
    readers = _stream_readers(data)
    measured: dict[str, dict] = {}
    for name, read in readers.items():
        times = _times_ms(read, repeats)
        rates = [data.nbytes / (t * 1e6) for t in times]
        measured[name] = {"times_ms": times, "gb_s_median": statistics.median(rates), "gb_s_best": max(rates)}
    best = max(measured, key=lambda name: float(measured[name]["gb_s_median"]))
    return {"bytes": data.nbytes, "by": best, **measured[best], "readers": measured}


def _stream_readers(table: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Reads of every byte of a [rows, columns] table, as float32 whatever it holds (torch's bfloat16 sum reads
    at two thirds of the stream, which made a bfloat16 forward look faster than its roofline): torch's sum, and
    where numba compiles, the kernel's one-row product over it (which reads each byte once)."""
    if table.dtype != torch.float32:
        table = table.contiguous().view(torch.float32)  # [rows, bytes a row / 4]: the same bytes
    readers: dict[str, Callable[[], object]] = {"torch sum": table.sum}
    if numba_unavailable(torch.device("cpu"), table.dtype) is None:
        readers["numba product, M=1"] = functools.partial(PlainLinear(table, None), torch.ones(1, table.shape[1]))
    return readers


def gemm_rates(out_features: int, in_features: int, ms: tuple[int, ...], dtype: torch.dtype, repeats: int) -> dict:
    """GFLOP/s of y = x W^T on [out, in] W for each M, eager and (where they run) the oneDNN and numba paths;
    medians."""
    paths = _products(torch.randn(out_features, in_features).to(dtype))
    rows: list[dict] = []
    with torch.inference_mode():
        for m in ms:
            x = torch.randn(m, in_features).to(dtype)
            for path, linear in paths.items():
                times = _times_ms(functools.partial(linear, x), repeats)
                gflop_s = 2 * m * out_features * in_features / (statistics.median(times) * 1e6)
                rows.append({"path": path, "m": m, "times_ms": times, "gflop_s": gflop_s})
    peak = max(rows, key=lambda row: float(row["gflop_s"]))
    return {
        "shape": [out_features, in_features],
        "rows": rows,
        "peak_gflop_s": peak["gflop_s"],
        "peak": {"path": peak["path"], "m": peak["m"]},
    }


def _products(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """y = x W^T on the eager path and, where they run, the oneDNN and numba paths."""
    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"eager": lambda x: F.linear(x, weight)}
    if onednn_unavailable(torch.device("cpu"), weight.dtype) is None:
        paths["onednn"] = PackedLinear(weight, None)
    if numba_unavailable(torch.device("cpu"), weight.dtype) is None:
        # Panels (where panels_here(dtype)) at every M; plain weights past numba_max_rows() run oneDNN's GEMM.
        paths["numba"] = numba_projection(weight.dtype)(weight, None)
    if pairs_unavailable(torch.device("cpu"), weight.dtype) is None:
        paths["onednn-numba"] = PairPanelLinear(weight, None)  # past MAX_ROWS_PAIRS, oneDNN's packed GEMM
    return paths


def _peak_product(gemm: dict, dtype: torch.dtype) -> tuple[Callable[[], object], float]:
    """The product that set the run's GEMM peak, on a weight of its own, and its FLOPs."""
    out_features, in_features = gemm["shape"]
    m = gemm["peak"]["m"]
    product = _products(torch.randn(out_features, in_features).to(dtype))[gemm["peak"]["path"]]
    return functools.partial(product, torch.randn(m, in_features).to(dtype)), 2.0 * m * out_features * in_features


def matrix_kernels(out_features: int, in_features: int, ms: tuple[int, ...], dtype: torch.dtype, repeats: int) -> dict:
    """ms of y = x W^T at each small M on eager, oneDNN-packed (for 1 row, and for 16), inductor-frozen and numba
    kernels (the numba path's product and, on AVX-512, the one it does not run, taken in turn).

    Inductor compiles the product as it would inside the model under freezing (its own packed weight, one
    compile per M, none counted in the times); a kernel that cannot run here says why instead. Each timed call
    starts with the weight out of cache, as in a forward, where the products before it flushed it: a weight of
    this size (55 MB for the 1.5B) otherwise stays partly in a 32 MB L3 from one call to the next.
    """
    linear = torch.nn.Linear(in_features, out_features, bias=False).to(dtype).eval()
    flush = cache_flush()  # before each call: its weight leaves the L3
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor] | str] = {"eager": linear}
    why_not = onednn_unavailable(torch.device("cpu"), dtype)
    kernels["onednn@1"] = why_not or PackedLinear(linear.weight, None, rows=1)
    kernels["onednn@16"] = why_not or PackedLinear(linear.weight, None, rows=16)
    # The numba path's product, and the one it does not run where that runs too, are taken in turn: their ratio
    # says which this machine should run. The others one after the other.
    paired: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    if no_numba := numba_unavailable(torch.device("cpu"), dtype):
        kernels["numba"] = no_numba
    else:
        paired["numba"] = numba_projection(dtype)(linear.weight, None)
        if other := _other_numba_product(dtype):
            paired[other[0]] = other[1](linear.weight, None)
    rows, compile_s = [], {}
    with torch.inference_mode():
        for m in ms:
            x = torch.randn(m, in_features).to(dtype)
            row: dict = {"m": m}
            for name, kernel in kernels.items():
                row[name] = (
                    kernel
                    if isinstance(kernel, str)
                    else statistics.median(_times_ms(functools.partial(kernel, x), repeats, flush))
                )
            calls = {name: functools.partial(kernel, x) for name, kernel in paired.items()}
            row |= {name: statistics.median(times) for name, times in in_turn_ms(calls, repeats, flush).items()}
            row["inductor"], compile_s[m] = _inductor_frozen_ms(linear, x, repeats, flush)
            rows.append(row)
    return {
        "shape": [out_features, in_features],
        "weight_bytes": linear.weight.nbytes,
        "rows": rows,
        "compile_s": compile_s,
    }


def _other_numba_product(dtype: torch.dtype) -> tuple[str, type[nn.Module]] | None:
    """The numba product the numba path does not run, where it can run here (an AVX-512 CPU): the plain kernel
    where this process runs the panels (matmul.panels_here(dtype)), else the panels, so that every such machine's
    run times both in turn."""
    if numba_unavailable(torch.device("cpu"), dtype) or panel_kernel(dtype) is None:
        return None
    return ("numba plain", PlainLinear) if numba_projection(dtype) is PanelLinear else ("numba panels", PanelLinear)


def _inductor_frozen_ms(
    linear: torch.nn.Module, x: torch.Tensor, repeats: int, flush: Callable[[], object]
) -> tuple[float | str, float | None]:
    """(median ms, compile seconds) of inductor's frozen-weight product, or (why it could not run, None)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    try:
        with inductor_config.patch(freezing=True):
            compiled = torch.compile(linear, dynamic=False)
            start = time.perf_counter()
            compiled(x)
            compile_s = time.perf_counter() - start
            return statistics.median(_times_ms(lambda: compiled(x), repeats, flush)), compile_s
    except Exception as exc:  # no compiler, an unsupported dtype: the table says so
        return f"not run: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}", None
    finally:
        torch._dynamo.reset()


def _token_ids(vocab_size: int, count: int) -> list[int]:
    return torch.randint(vocab_size, (count,), generator=torch.Generator().manual_seed(0)).tolist()


def prefixed_runner(
    model: CausalLM, steps: Sequence[Step], prefix: int, dtype: torch.dtype
) -> tuple[ModelRunner, KVCache, list[int]]:
    """A CPU runner over a fresh KV cache for `steps` on `prefix` cached tokens a row: a slot for each of the
    largest step's rows (and its prefill row), every slot holding the same `prefix` tokens (computed once in slot 0,
    then copied), long enough for every step's tokens; and the token ids (one a position) that the steps read on
    from."""
    num_slots = max(step.rows + (1 if step.prefill else 0) for step in steps)
    max_len = max(max(prefix + step.new_tokens, step.prefill) for step in steps)  # >= prefix
    kv = KVCache(model, num_slots=num_slots, max_len=max_len, device=torch.device("cpu"), dtype=dtype)
    runner = ModelRunner(model, kv)
    token_ids = _token_ids(model.args.vocab_size, max_len)
    runner.forward([ForwardRequest(0, 0, tuple(token_ids[:prefix]), all_logits=False)])
    for cache in (*kv.k, *kv.v):
        cache[1:, :prefix] = cache[0, :prefix]
    return runner, kv, token_ids


def forwards_in_turn(
    forwards: Mapping[str, Callable[[list[ForwardRequest]], list[torch.Tensor]]],
    steps: Sequence[Step],
    prefix: int,
    token_ids: list[int],
    rounds: int,
) -> list[str]:
    """Each step's forward by every version in `forwards` (a name -> the call that runs a step's requests), the
    versions in turn: an untimed round first (kernels compile or load), then `rounds`, each in the reverse order of
    the last, so that no version always goes first. One line a step: each version's median in ms, the median and
    every round's ratio of the first version's time to the second's, and whether all gave the same logits bit for
    bit, else the same argmax at every position (paths that round differently give other bits)."""
    names = list(forwards)
    times: dict[tuple[str, str], list[float]] = {(name, step.name): [] for name in names for step in steps}
    same_bits = {step.name: True for step in steps}
    same_argmax = dict(same_bits)
    for turn in range(rounds + 1):
        for step in steps:
            logits = []
            for name in names if turn % 2 else reversed(names):
                requests = step.requests(prefix, token_ids)
                start = time.perf_counter()
                out = forwards[name](requests)
                if turn:
                    times[name, step.name].append((time.perf_counter() - start) * 1e3)
                logits.append(torch.cat([row.float() for row in out]))  # [positions, vocab]
            same_bits[step.name] &= all(torch.equal(logits[0], other) for other in logits[1:])
            same_argmax[step.name] &= all(torch.equal(logits[0].argmax(-1), other.argmax(-1)) for other in logits[1:])
    lines = []
    first, second = names[:2]
    for step in steps:
        medians = ", ".join(f"{name} {statistics.median(times[name, step.name]):.1f} ms" for name in names)
        ratios = [a / b for a, b in zip(times[first, step.name], times[second, step.name])]
        same = "argmax the same" if same_argmax[step.name] else "argmax differs"
        same = "logits the same bits" if same_bits[step.name] else same
        lines.append(
            f"{step.name}: {medians}; {first} / {second} {statistics.median(ratios):.3f}x "
            f"({', '.join(f'{r:.2f}' for r in ratios)}); {same}"
        )
    return lines


def time_path(
    resolved: ResolvedModel,
    path: str,
    config: EngineBenchConfig,
    steps: list[Step],
    peak_product: tuple[Callable[[], object], float],
    progress: Callable[[str], None],
    text_ids: list[int] | None = None,
) -> tuple[dict, dict[str, torch.Tensor], ModelArgs]:
    """Load the target on one matmul path and time every step; also logits for the host draws (the largest
    step's, "random", and where `text_ids` are given the logits at each of their positions, "text"), and the
    shape.

    Each step's forwards are taken in turn with reads of the embedding table (plain on every path, and far
    larger than any cache) by each stream reader, the faster median counting, and with the product that set the
    run's GEMM peak: the stream and the compute rate at the moment the forwards ran, for a roofline that the
    hour's drift moves with them.
    """
    dtype, cpu = DTYPES[config.dtype], torch.device("cpu")
    start = time.perf_counter()
    with PrivatePeak() as load_peak:
        target = load_target(resolved, device=cpu, dtype=dtype, matmul=path)
    load_s = time.perf_counter() - start
    progress(f"{path}: loaded {target.name} in {load_s:.1f} s")
    model = target.model
    runner, kv, token_ids = prefixed_runner(model, steps, config.prefix, dtype)
    results: dict[str, dict] = {}
    attention, layers = model.attention, model.compiled_layers
    # Where attention is compiled, the row loop as its baseline; where layers are compiled, the same forwards
    # layer by layer through the modules (with the compiled attention): all taken in turn.
    baselines = {"rows": ("rows", None), **({"modules": (attention, None)} if layers is not None else {})}
    settings = {"default": (attention, layers), **(baselines if attention != "rows" else {})}
    embedding = model.model.embed_tokens  # a tied table on panels: the same bytes, as [panels x in, PANEL]
    table = embedding.panels.flatten(0, 1) if isinstance(embedding, PanelEmbedding) else embedding.weight.detach()
    readers = {f"stream: {name}": read for name, read in _stream_readers(table).items()}

    def on(setting: tuple, forward: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            model.attention, model.compiled_layers = setting  # fields set: nothing worth timing
            return forward()

        return call

    for step in steps:
        forward = functools.partial(runner.forward_packed, step.requests(config.prefix, token_ids))
        try:
            calls = {name: on(setting, forward) for name, setting in settings.items()}
            timed = in_turn_ms({**calls, **readers, "gemm": peak_product[0]}, config.repeats)
        finally:
            model.attention, model.compiled_layers = attention, layers
        results[step.name] = {
            "ms": statistics.median(timed["default"]),
            "times_ms": timed["default"],
            "stream_gb_s": max(table.nbytes / (statistics.median(timed[name]) * 1e6) for name in readers),
            "gemm_gflop_s": peak_product[1] / (statistics.median(timed["gemm"]) * 1e6),
        }
        for name in settings.keys() - {"default"}:
            key = "rows_attention" if name == "rows" else name
            results[step.name] |= {f"{key}_ms": statistics.median(timed[name]), f"{key}_times_ms": timed[name]}
        progress(f"{path} {step.name}: {results[step.name]['ms']:.1f} ms")
    largest = max(steps, key=lambda step: step.num_logits)
    sample = runner.forward_packed(largest.requests(config.prefix, token_ids))  # [num_logits, vocab]
    assert sample is not None, "one process: the logits are all here"
    samples = {"random": sample}
    if text_ids:
        text = tuple(text_ids[: min(HOST_TEXT_TOKENS, kv.max_len)])
        text_logits = runner.forward_packed([ForwardRequest(0, 0, text, all_logits=True)])
        assert text_logits is not None, "one process: the logits are all here"
        samples["text"] = text_logits
    kv_bytes = sum(t.nbytes for t in (*kv.k, *kv.v))
    figures = {
        "matmul": target.matmul,
        "attention": attention,
        "compiled_layers": layers is not None,
        "load_s": load_s,
        "load_private_peak_bytes": load_peak.bytes,
        "steps": results,
        "kv_cache_bytes": kv_bytes,
        **_memory(),
    }
    return figures, samples, model.args


def hf_greedy(resolved: ResolvedModel, config: EngineBenchConfig, progress: Callable[[str], None]) -> dict:
    """transformers' own model and KV cache: a --prefix-token prompt, then --hf-decode greedy tokens."""
    from transformers import AutoModelForCausalLM

    from specedge.edge_client.drafting.torch_drafter import cache_kwarg

    model = AutoModelForCausalLM.from_pretrained(weights_dir(resolved), dtype=DTYPES[config.dtype]).eval()
    prompt = torch.tensor([_token_ids(model.config.vocab_size, config.prefix)])
    kwarg = cache_kwarg(model)
    times = []
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(prompt, use_cache=True)
        prefill_ms = (time.perf_counter() - start) * 1e3
        for _ in range(config.hf_decode):
            next_token = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [1, 1]
            start = time.perf_counter()
            cache = out.cache if kwarg == "cache" else out.past_key_values
            out = model(next_token, **{kwarg: cache}, use_cache=True)
            times.append((time.perf_counter() - start) * 1e3)
    del model, out
    result = {"prefill_ms": prefill_ms, "times_ms": times, "ms_per_token": statistics.median(times), **_memory()}
    progress(f"transformers: {result['ms_per_token']:.1f} ms per token")
    return result


def host_draws(samples: Mapping[str, torch.Tensor], config: EngineBenchConfig) -> dict:
    """draw_rows over host_rows verify rounds of real logits (a sample's rows, repeated): ms per step.

    On the logits of a random context as they are (flat), and scaled by HOST_PEAKED_SCALE (peaked: the race
    has few tokens within reach); and, where the bench has them, on the logits of real text (the shipped
    prompts), which lie between. In turn with the draws, one read of the same logits (torch's amax over each
    row): the floor of any step that looks at them.
    """
    num_logits = config.host_rows * HOST_TOKENS_PER_ROW

    def rows_of(sample: torch.Tensor) -> torch.Tensor:  # [L, V]
        return sample.repeat(math.ceil(num_logits / sample.shape[0]), 1)[:num_logits].contiguous()

    flat = rows_of(samples["random"])
    cases = {"flat": flat, "peaked": flat * HOST_PEAKED_SCALE}
    if "text" in samples:
        cases["text"] = rows_of(samples["text"])
    results: dict = {"logits_shape": list(flat.shape), "peaked_scale": HOST_PEAKED_SCALE}
    for case, logits in cases.items():
        # How much of the vocabulary the race's first bound admits: logit >= max + T * (g - GUMBEL_MAX).
        within_reach = logits >= (logits.max(dim=-1).values - HOST_TEMPERATURE * noise.GUMBEL_MAX)[:, None]
        calls: dict[str, Callable[[], object]] = {"read": functools.partial(torch.amax, logits, dim=-1)}
        calls |= {kind: functools.partial(draw_rows, logits, rows) for kind, rows in _host_rows(logits, config).items()}
        times: dict[str, object] = {"fraction_within_race_bound": within_reach.float().mean().item()}
        for kind, runs in in_turn_ms(calls, config.repeats).items():
            times[kind] = {"ms": statistics.median(runs), "times_ms": runs}
        if case == "text":  # how deep the chains' walks went: drafts accepted per chain
            drawn = draw_rows(logits, _host_rows(logits, config)["rejection"])
            times["accepted_per_chain"] = statistics.mean(
                len(d.accepted_nodes) for d in drawn if isinstance(d, VerifyResult)
            )
            times["tokens"] = samples["text"].shape[0]
        results[case] = times
    return results


def _text_ids(resolved: ResolvedModel) -> list[int] | None:
    """Token ids of the shipped prompts' text, through the target's own tokenizer (None for random weights)."""
    if resolved.format == "random":
        return None
    from specedge.bench.prompts import load_prompts
    from specedge.edge_client.tokenizer import load_tokenizer

    text = "\n\n".join(message["content"] for prompt in load_prompts() for message in prompt.messages)
    return load_tokenizer(resolved).encode(text)


def _host_rows(logits: torch.Tensor, config: EngineBenchConfig) -> dict[str, list[RowDraw]]:
    positions = tuple(config.prefix + d for d in range(HOST_TOKENS_PER_ROW))
    greedy, sampled = SamplingParams(), SamplingParams(temperature=HOST_TEMPERATURE)

    def rejection_row(start: int) -> RowDraw:
        # q of draft j: the target's own top tokens before it, as from a good draft model.
        probs = (logits[start : start + HOST_TOKENS_PER_ROW - 1].double() / HOST_TEMPERATURE).softmax(dim=-1)
        top = probs.topk(DRAFT_TOP, dim=-1)
        dists = tuple(SparseDist(ids.tolist(), (p / p.sum()).tolist()) for p, ids in zip(top.values, top.indices))
        return RowDraw(HOST_TOKENS_PER_ROW, sampled, 0, positions, tuple(d.token_ids[0] for d in dists), dists)

    return {
        "greedy": [RowDraw(HOST_TOKENS_PER_ROW, greedy, 0, positions)] * config.host_rows,
        "sampled": [RowDraw(HOST_TOKENS_PER_ROW, sampled, 0, positions)] * config.host_rows,
        "rejection": [rejection_row(i * HOST_TOKENS_PER_ROW) for i in range(config.host_rows)],
    }


def run_engine_bench(config: EngineBenchConfig, *, progress: bool = True) -> dict:
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    threads = config.threads or (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    torch.set_num_threads(threads)
    steps = [Step.parse(name) for name in config.steps]
    resolved = resolve(config.target)
    meta = _machine(config, threads)

    limits = {"stream": stream_bandwidth(config.stream_gb, config.repeats)}
    limits["gemm"] = gemm_rates(*_mlp_shape(resolved), config.gemm_m, DTYPES[config.dtype], config.repeats)
    if config.kernel_m:
        limits["kernels"] = matrix_kernels(*_mlp_shape(resolved), config.kernel_m, DTYPES[config.dtype], config.repeats)
        say(
            "kernels: "
            + "; ".join(
                f"M={r['m']} " + " ".join(f"{k} {_kernel_ms(r[k])}" for k in KERNELS) for r in limits["kernels"]["rows"]
            )
        )
    limits["memory"] = _memory()
    bandwidth, peak = limits["stream"]["gb_s_median"], limits["gemm"]["peak_gflop_s"]
    say(f"limits: stream {bandwidth:.1f} GB/s (median), GEMM peak {peak:.0f} GFLOP/s")

    paths: dict[str, dict] = {}
    samples: dict[str, torch.Tensor] | None = None
    args: ModelArgs | None = None
    peak_product = _peak_product(limits["gemm"], DTYPES[config.dtype])
    text_ids = _text_ids(resolved)
    for path in config.matmul:
        # The host draws take the first path's logits: the text's forward runs on that path only.
        text = text_ids if samples is None else None
        paths[path], logits, args = time_path(resolved, path, config, steps, peak_product, say, text)
        samples = logits if samples is None else samples
        del logits
        gc.collect()  # the previous path's weights go before the next path loads its own,
        return_freed_memory()  # and their pages too, or the next path's private peak would count them
    if samples is None or args is None:
        raise ValueError("no --matmul path to time")
    cost = CostModel.of(args, DTYPES[config.dtype])
    if config.attention_keys:
        limits["attention"] = attention_kernels(args, config.attention_keys, DTYPES[config.dtype], config.repeats)
    hf = {"skipped": "random weights exist only in this process"} if resolved.format == "random" else None
    if hf is None and config.hf_decode == 0:
        hf = {"skipped": "--hf-decode 0"}
    hf = hf or hf_greedy(resolved, config, say)
    gc.collect()
    host = host_draws(samples, config)
    meta["load_average_after"] = os.getloadavg()

    roofline = {
        step.name: {
            "tokens": step.num_tokens,
            "logits": step.num_logits,
            "gflop": cost.flops(step, config.prefix) / 1e9,
            "gbytes": cost.bytes(step, config.prefix) / 1e9,
            "ms": cost.roofline_s(step, config.prefix, bandwidth, peak) * 1e3,
        }
        for step in steps
    }
    for figures in paths.values():
        for step in steps:
            timed = figures["steps"][step.name]
            rates = (timed["stream_gb_s"], timed["gemm_gflop_s"])
            timed["roofline_in_turn_ms"] = cost.roofline_s(step, config.prefix, *rates) * 1e3
    model = {**dataclasses.asdict(cost), "weight_bytes": cost.weight_bytes, "args": dataclasses.asdict(args)}
    return {
        "meta": meta,
        "model": model,
        "limits": limits,
        "roofline": roofline,
        "paths": paths,
        "hf": hf,
        "host": host,
    }


BELOW_ROOFLINE = 0.95  # a forward this far under its in-turn roofline: a reading taken in turn with it ran slow
ATTENTION_STEPS = ("1x1", "8x1", "1x5", "8x5", "16x5")  # rows x new tokens of one layer's attention


def attention_kernels(args: ModelArgs, keys: tuple[int, ...], dtype: torch.dtype, repeats: int) -> dict:
    """One layer's attention at the target's head shape, for each step of ATTENTION_STEPS on `keys` cached keys
    a row (random values): the numba kernel against the row loop's SDPA calls and, on AVX-512 CPUs, against the
    kernel through the attention tiles or loops this process does not take (attention.tiles_here(); "other"),
    all taken in turn; ms (medians)."""
    from specedge.server.attention import (
        TILE_FORMS,
        compiled_rows,
        numba_kernel,
        numba_unavailable,
        row_attention,
        tiles_here,
    )
    from specedge.server.tree import ancestor_mask

    shape = {"heads": args.num_heads, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim}
    if reason := numba_unavailable(torch.device("cpu"), dtype):
        return {**shape, "skipped": reason}
    kernel = numba_kernel()
    assert kernel is not None, "numba_unavailable said the kernel runs"
    tiled = tiles_here()
    chosen, not_chosen = TILE_FORMS if tiled else TILE_FORMS[::-1]
    other = not_chosen if kernel.AVX512 else None
    rows = []
    generator = torch.Generator().manual_seed(0)
    for cached in keys:
        for name in ATTENTION_STEPS:
            step = Step.parse(name)
            new, num_keys = step.new_tokens, cached + step.new_tokens
            cache = (step.rows, num_keys, args.num_kv_heads, args.head_dim)
            k, v = (torch.randn(cache, generator=generator, dtype=dtype) for _ in "kv")
            q = torch.randn(step.num_tokens, args.num_heads, args.head_dim, generator=generator, dtype=dtype)
            cu, slots = tuple(range(0, step.num_tokens + 1, new)), tuple(range(step.rows))
            mask = torch.ones(new, num_keys, dtype=torch.bool)
            mask[:, cached:] = ancestor_mask(None, new)
            masks = (None if new == 1 else mask,) * step.rows
            # as a step the compiled layers take (float32) lays its rows out: every row in the kernel
            layout = compiled_rows(
                cu,
                slots,
                (num_keys,) * step.rows,
                (None,) * step.rows,
                compiled_step=dtype == torch.float32,
                tiles=tiled,
            )
            on = (q, k, v, cu, slots, (num_keys,) * step.rows, masks)
            paths = {
                "numba": functools.partial(row_attention, *on, layout),
                "rows": functools.partial(row_attention, *on),
            }
            if other is not None:
                paths[other] = functools.partial(row_attention, *on, dataclasses.replace(layout, tiles=not tiled))
            times = in_turn_ms(paths, repeats)
            rows.append({"step": name, "cached": cached, **{p: statistics.median(t) for p, t in times.items()}})
    return {**shape, "numba": chosen, "other": other, "rows": rows}


def _mlp_shape(resolved: ResolvedModel) -> tuple[int, int]:
    """[intermediate, hidden]: the shape of the target's gate and up weights, read before any weights load."""
    if resolved.format == "random":
        from specedge.server.random_model import PRESETS, preset_of

        shape = PRESETS[preset_of(resolved.name)]
        return shape.intermediate_size, shape.hidden_size
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(weights_dir(resolved))
    return config.intermediate_size, config.hidden_size


def _machine(config: EngineBenchConfig, threads: int) -> dict:
    return {
        "config": dataclasses.asdict(config),
        "command": " ".join(sys.argv),
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "threads": threads,
        "torch": importlib.metadata.version("torch"),
        "platform": platform.platform(),
        "load_average_before": os.getloadavg(),
    }


def write_engine_report(results: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """engine.json (every raw figure) and engine.md (the tables)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "engine.json", out_dir / "engine.md"]
    paths[0].write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    paths[1].write_text(engine_markdown(results))
    return paths


def _ms(value: float | str | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _kernel_lines(kernels: dict | None, bandwidth: float) -> list[str]:
    if kernels is None:
        return []
    out, inner = kernels["shape"]
    floor_ms = kernels["weight_bytes"] / (bandwidth * 1e6)
    lines = [
        "",
        f"## Matrix kernels at small M ([M, {inner}] x [{inner}, {out}], {kernels['weight_bytes'] / 1e6:.0f} MB of "
        f"weight; its stream floor {floor_ms:.2f} ms)",
        "",
    ]
    other = next((k for k in OTHER_NUMBA if k in kernels["rows"][0]), None)
    names = (*KERNELS, other) if other else KERNELS
    ratio = [f"numba / {other}"] if other else []
    lines += [
        "| M | " + " | ".join([*(f"{k} ms" for k in names), "best / floor", *ratio]) + " |",
        "|---" * (len(names) + 2 + len(ratio)) + "|",
    ]
    for row in kernels["rows"]:
        timed = [row[k] for k in names if isinstance(row[k], float)]
        best = f"{min(timed) / floor_ms:.2f}x" if timed else "-"
        against = [_x(row["numba"] / row[other])] if other and isinstance(row["numba"], float) else ["-"] * len(ratio)
        lines.append(f"| {row['m']} | " + " | ".join([*(_kernel_ms(row[k]) for k in names), best, *against]) + " |")
    compiles = [f"{s:.1f}" for s in kernels["compile_s"].values() if s is not None]
    notes = sorted({row[k] for row in kernels["rows"] for k in names if isinstance(row[k], str)})
    paired = [f"numba and {other} taken in turn, the others one after the other."] if other else []
    lines += (
        [""]
        + paired
        + ([f"inductor compile per M: {', '.join(compiles)} s (not in the times)."] if compiles else [])
        + notes
    )
    return lines


def _attention_kernel_lines(kernels: dict | None) -> list[str]:
    if kernels is None:
        return []
    other = kernels.get("other")
    title = (
        f"## One layer's attention ({kernels['heads']} query heads, {kernels['kv_heads']} KV heads of "
        f"{kernels['head_dim']}; random values; {'all' if other else 'the two'} taken in turn, median ms)"
    )
    if "skipped" in kernels:
        return ["", title, "", f"Skipped: {kernels['skipped']}."]
    lines = ["", title, ""]
    timed, against = ["numba", "rows"], ["rows"]  # ms columns, and what numba is divided by
    if other is not None:
        timed.insert(1, other)
        against.append(other)
        lines += [
            f"The kernel takes heads of {kernels['head_dim']} through its attention {kernels['numba']} here; the "
            f"{other} are the same kernel with the other choice (attend's tiles), which this CPU can also run.",
            "",
        ]
    names = [f"numba ({kernels['numba']})" if other else "numba", *timed[1:]]
    header = ["cached keys", "step", *(f"{n} ms" for n in names), *(f"numba / {a}" for a in against)]
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in kernels["rows"]:
        cells = [f"{row[p]:.3f}" for p in timed] + [_x(row["numba"] / row[a]) for a in against]
        lines.append(f"| {row['cached']} | {row['step']} | " + " | ".join(cells) + " |")
    return lines


def _in_turn_lines(results: dict, timed: list[str]) -> list[str]:
    """Each path's forwards against the roofline of the stream and the GEMM rate measured in turn with them."""
    paths, limits = results["paths"], results["limits"]
    args = results["model"]["args"]
    table_gb = args["vocab_size"] * args["hidden_size"] * results["model"]["bytes_per_param"] / 1e9
    peak, shape = limits["gemm"]["peak"], limits["gemm"]["shape"]
    lines = [
        "",
        "## Forwards against the limits measured in turn with them",
        "",
        "The limits above are read once, before any forward, and the hour may move them. Here each step's forwards "
        f"were taken in turn with reads of the embedding table ({table_gb:.2f} GB) by "
        f"{' and '.join(limits['stream']['readers'])} (the faster median counts), and with the product that set the "
        f"GEMM peak ({peak['path']}, [{peak['m']}, {shape[1]}] x [{shape[1]}, {shape[0]}]); the roofline takes both.",
        "",
        "| step | " + " | ".join(f"{p} ms | GB/s | GFLOP/s | roofline ms | {p}/roofline" for p in timed) + " |",
        "|---" * (1 + 5 * len(timed)) + "|",
    ]
    for name in results["roofline"]:
        cells = []
        for p in timed:
            step = paths[p]["steps"][name]
            roof = step["roofline_in_turn_ms"]
            cells.append(
                f"{_ms(step['ms'])} | {step['stream_gb_s']:.1f} | {_rate(step['gemm_gflop_s'])} | {roof:.1f} | "
                f"{_x(step['ms'] / roof)}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + _below_roofline_lines(results, timed)


def _below_roofline_lines(results: dict, timed: list[str]) -> list[str]:
    """A note naming the forwards that ran more than BELOW_ROOFLINE under their in-turn roofline, each with the
    reading that bounds it: no forward beats its roofline, so that reading ran slower than the machine can."""
    limits, flagged = results["limits"], []
    for name, roofline in results["roofline"].items():
        for p in timed:
            step = results["paths"][p]["steps"][name]
            if step["ms"] >= BELOW_ROOFLINE * step["roofline_in_turn_ms"]:
                continue
            floor = roofline["gbytes"] * 1e3 / step["stream_gb_s"]
            compute = roofline["gflop"] * 1e3 / step["gemm_gflop_s"]
            if compute >= floor:
                in_turn, once = _rate(step["gemm_gflop_s"]), _rate(limits["gemm"]["peak_gflop_s"])
                reading = f"the GEMM rate, {in_turn} GFLOP/s against {once}"
            else:
                reading = f"the stream, {step['stream_gb_s']:.1f} GB/s against {limits['stream']['gb_s_median']:.1f}"
            flagged.append(f"{p} {name} ({_x(step['ms'] / step['roofline_in_turn_ms'])}; {reading} read once)")
    if not flagged:
        return []
    return [
        "",
        f"Under the roofline measured in turn by more than {1 - BELOW_ROOFLINE:.0%}: " + "; ".join(flagged) + ". "
        "No forward runs faster than its roofline, so the reading taken in turn with it ran slower than the machine "
        "can (the hour, or contention with the forwards around it); for these rows the read-once roofline of the "
        "table above is the one to read.",
    ]


def _attention_lines(roofline: dict, paths: dict, timed: list[str]) -> list[str]:
    """The compiled attention against the row loop, each path's forwards taken in turn on both."""
    compared = [p for p in timed if paths[p].get("attention", "rows") != "rows"]
    if not compared:
        return []
    attention = paths[compared[0]]["attention"]
    title = f"## Attention: {attention} against the row loop (the same forwards, taken in turn)"
    return _against_lines(title, roofline, paths, compared, (attention, "rows"), "rows_attention_ms")


def _layers_lines(roofline: dict, paths: dict, timed: list[str]) -> list[str]:
    """Compiled layers against the same forwards module by module, taken in turn."""
    compared = [p for p in timed if paths[p].get("compiled_layers")]
    title = (
        "## Compiled layers against the modules (the same forwards, taken in turn; steps the compiled layers "
        "do not take run the modules in both)"
    )
    return _against_lines(title, roofline, paths, compared, ("compiled", "modules"), "modules_ms") if compared else []


def _against_lines(
    title: str, roofline: dict, paths: dict, compared: list[str], names: tuple[str, str], baseline: str
) -> list[str]:
    """Each compared path's forwards (names[0]) against a baseline timed in turn with them (names[1])."""
    lines = [
        "",
        title,
        "",
        "| step | " + " | ".join(f"{p}: {names[0]} ms | {names[1]} ms | ratio" for p in compared) + " |",
        "|---" * (1 + 3 * len(compared)) + "|",
    ]
    for name in roofline:
        cells = []
        for p in compared:
            step = paths[p]["steps"][name]
            cells.append(f"{step['ms']:.1f} | {step[baseline]:.1f} | {_x(step['ms'] / step[baseline])}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _kernel_ms(value: float | str) -> str:
    return f"{value:.2f}" if isinstance(value, float) else "-"


def _rss(memory: dict) -> str:
    return " | ".join(_gib(memory[key]) for key in ("peak_rss_bytes", "rss_bytes", "rss_anon_bytes"))


def engine_markdown(results: dict) -> str:
    meta, limits, model, paths = results["meta"], results["limits"], results["model"], results["paths"]
    config, stream, gemm = meta["config"], limits["stream"], limits["gemm"]
    bandwidth, peak = stream["gb_s_median"], gemm["peak_gflop_s"]
    load = (
        "/".join(f"{v:.2f}" for v in meta["load_average_before"]),
        "/".join(f"{v:.2f}" for v in meta["load_average_after"]),
    )
    lines = [
        f"# specedge-bench engine: {config['target']}, {config['dtype']}, {meta['threads']} threads",
        "",
        f"{meta['cpu']} ({meta['cpus']} CPUs), torch {meta['torch']}; load average {load[0]} before, {load[1]} after.",
        *(
            ["bfloat16 weights change the target's numerics (the operator's choice, never a silent default)."]
            if config["dtype"] == "bfloat16"
            else []
        ),
        "",
        "## Limits (measured in this run)",
        "",
        "| limit | median | best | measured on |",
        "|---|---|---|---|",
    ]
    for name, read in stream["readers"].items():
        lines.append(
            f"| memory stream{' (used)' if name == stream['by'] else ''} | {read['gb_s_median']:.1f} GB/s | "
            f"{read['gb_s_best']:.1f} GB/s | {name} over {stream['bytes'] / 1e9:.2f} GB float32 |"
        )
    for row in gemm["rows"]:
        best = 2 * row["m"] * math.prod(gemm["shape"]) / (min(row["times_ms"]) * 1e6)
        lines.append(
            f"| GEMM {row['path']} M={row['m']} | {_rate(row['gflop_s'])} GFLOP/s | {_rate(best)} GFLOP/s | "
            f"[{row['m']}, {gemm['shape'][1]}] x [{gemm['shape'][1]}, {gemm['shape'][0]}] |"
        )
    lines += _kernel_lines(limits.get("kernels"), bandwidth)
    gflop_per_token = 2 * (model["layer_params"] + model["head_params"]) / 1e9
    timed = [p for p in PATHS if p in paths]
    baseline = "eager" in paths and len(timed) > 1  # the plain path, and something to compare it with
    lines += [
        "",
        f"Roofline of a forward = max(bytes / {bandwidth:.1f} GB/s, FLOPs / {_rate(peak)} GFLOP/s), the median "
        f"stream and the highest median GEMM rate: {model['weight_bytes'] / 1e9:.2f} GB of matrix weights "
        f"(floor {model['weight_bytes'] / bandwidth / 1e6:.1f} ms) plus {model['kv_bytes_per_key'] / 1e3:.1f} KB "
        f"of keys and values per position each row holds or adds, {gflop_per_token:.2f} GFLOP per token "
        "(the LM head only on tokens whose logits are wanted) plus attention over the cache.",
        "",
        f"## Forwards ({config['prefix']} cached tokens per row; median of {config['repeats']})",
        "",
        "| step | tokens | "
        + " | ".join(f"{p} ms" for p in timed)
        + " | roofline ms | "
        + " | ".join(f"{p}/roofline" for p in timed)
        + (" | fastest vs eager |" if baseline else " |"),
        "|---" * (3 + 2 * len(timed) + bool(baseline)) + "|",
    ]
    for name, roof in results["roofline"].items():
        ms = {p: paths[p]["steps"][name]["ms"] for p in timed}
        fastest = min(ms[p] for p in timed if p != "eager") if baseline else None
        lines.append(
            f"| {name} | {roof['tokens']} | "
            + " | ".join(_ms(ms[p]) for p in timed)
            + f" | {roof['ms']:.1f} | "
            + " | ".join(_x(ms[p] / roof["ms"]) for p in timed)
            + (f" | {_x(ms['eager'] / fastest)} |" if fastest else " |")
        )
    lines += _in_turn_lines(results, timed)
    lines += _attention_lines(results["roofline"], paths, timed)
    lines += _layers_lines(results["roofline"], paths, timed)
    lines += _attention_kernel_lines(limits.get("attention"))
    hf, host = results["hf"], results["host"]
    lines += ["", "## transformers' own greedy decoding, same weights", ""]
    if "skipped" in hf:
        lines.append(f"Skipped: {hf['skipped']}.")
    else:
        ours = ", ".join(f"{p} {paths[p]['steps']['1x1']['ms']:.1f} ms" for p in paths if "1x1" in paths[p]["steps"])
        lines.append(
            f"{hf['ms_per_token']:.1f} ms per token (median of {len(hf['times_ms'])} decode steps after a "
            f"{config['prefix']}-token prompt, which took {hf['prefill_ms']:.0f} ms)"
            + (f"; this engine's 1x1 step: {ours}." if ours else ".")
        )
    rows, vocab = host["logits_shape"]
    cases = [case for case in ("flat", "peaked", "text") if case in host]
    lines += [
        "",
        f"## Host time per step: draw_rows over {rows // HOST_TOKENS_PER_ROW} rows x {HOST_TOKENS_PER_ROW} tokens "
        f"([{rows}, {vocab}] logits from a random-token context" + (", and from text)" if "text" in host else ")"),
        "",
        f"A random context's logits are flatter than text's: the race's first bound (T x {noise.GUMBEL_MAX:g} below "
        f"the row's max) admits {host['flat']['fraction_within_race_bound']:.0%} of them. The peaked case scales them "
        f"by {host['peaked_scale']:g}, which leaves {host['peaked']['fraction_within_race_bound']:.2%}."
        + (
            f" The text case takes the logits at {host['text']['tokens']} positions of the shipped prompts' text "
            f"({host['text']['fraction_within_race_bound']:.2%} within the bound; with top-{DRAFT_TOP} q its chains "
            f"accept {host['text']['accepted_per_chain']:.1f} of {HOST_TOKENS_PER_ROW - 1} drafts on average)."
            if "text" in host
            else ""
        ),
        "",
        "Each case's calls were taken in turn with one read of its logits (torch's amax over each row), the floor "
        "of anything that looks at every logit once.",
        "",
        "| draws | " + " | ".join(f"{case} ms | x read" for case in cases) + " |",
        "|---|" + "---|---|" * len(cases),
        *(
            f"| {label} | "
            + " | ".join(
                f"{host[case][kind]['ms']:.1f} | {_x(host[case][kind]['ms'] / host[case]['read']['ms'])}"
                for case in cases
            )
            + " |"
            for kind, label in (
                ("read", "read once (the floor)"),
                ("greedy", "greedy"),
                ("sampled", f"sampled, T={HOST_TEMPERATURE}, no q (verified by matching samples)"),
                ("rejection", f"sampled, T={HOST_TEMPERATURE}, top-{DRAFT_TOP} q (rejection sampling)"),
            )
        ),
        "",
        "## Memory",
        "",
        "The peak RSS also counts the memory-mapped checkpoint's clean pages while a load copies the weights out of"
        " them; the private peak while loading is what the load needs of memory.",
        "",
        "| after | peak RSS GiB | RSS GiB | of which private GiB | private peak while loading GiB | KV cache GiB |",
        "|---|---|---|---|---|---|",
        f"| limits | {_rss(limits['memory'])} | - | - |",
        *(
            f"| {p} path | {_rss(f)} | {_gib(f.get('load_private_peak_bytes'))} | {_gib(f['kv_cache_bytes'])} |"
            for p, f in paths.items()
        ),
        *([] if "skipped" in hf else [f"| transformers | {_rss(hf)} | - | - |"]),
    ]
    return "\n".join(lines) + "\n"
