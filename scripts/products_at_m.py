"""Every matrix product of a Qwen2.5-1.5B forward on the numba kernel, at a few M, in turn with a read of the
same weights: where a small-M step's cost sits against the memory stream, with no attention or glue around it.

    python scripts/products_at_m.py [--m 1 2 5 8] [--repeats 5] [--dtype bfloat16] [--against onednn]

The weights are random, of the 1.5B's shapes (28 layers of q/k/v, o, gate/up and down, and the LM head: 6.17 GB
of float32, 3.09 GB of bfloat16), so no checkpoint is needed. Each round reads them once by torch's sum, then runs
every product once at each M, on the plain weights as `PlainLinear` holds them. Here the kernel takes every M:
nothing is handed to oneDNN above numba_max_rows. With `--against`, the same products run in turn on another form
of the same weights: oneDNN's packed layout (`PackedLinear`, a second copy) or the panels (`PanelLinear`, on
AVX-512). The medians are printed in ms, GB/s and GFLOP/s, as a multiple of the read, and each other
form's time as a multiple of the plain kernel's. bench/results' 8 x 1 notes came from it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from specedge.server import _forward_numba
from specedge.server.kernels import kernel_array
from specedge.server.matmul import PackedLinear, PanelLinear, panel_kernel

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 1536, 8960, 28, 151_936
LAYER_SHAPES = ((2048, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 5, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--against", choices=("onednn", "panels"), default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    _forward_numba.set_threads(torch.get_num_threads())
    if dtype == torch.bfloat16:
        _forward_numba.warm_up_matmul_bfloat16()
    # torch allocates on a 64-byte line, as the server's weights sit (numpy's large arrays start 16 bytes into one,
    # so that every vector load from them would straddle two lines, as none of the server's does).
    torch.manual_seed(0)
    tensors = [torch.randn(shape).to(dtype) for shape in LAYER_SHAPES * LAYERS + ((VOCAB, HIDDEN),)]
    weights = [kernel_array(t) for t in tensors]
    inputs = {m: {k: torch.randn(m, k).to(dtype) for k in (HIDDEN, INTERMEDIATE)} for m in args.m}
    outputs = {m: [np.empty((m, w.shape[0]), np.float32) for w in weights] for m in args.m}

    def products(m: int) -> None:
        for w, y in zip(weights, outputs[m]):
            _forward_numba.matmul(kernel_array(inputs[m][w.shape[1]]), w, y)

    calls: dict[str, Callable[[], object]] = {"read": lambda: [t.sum() for t in tensors]}
    calls |= {f"M={m}": (lambda m=m: products(m)) for m in args.m}
    if args.against is not None:
        calls |= {f"{args.against} M={m}": call for m, call in _other_form(args.against, tensors, inputs).items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(args.repeats + 1):  # the first round is untimed (compile, page faults)
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if repeat:
                times[name].append((time.perf_counter() - start) * 1e3)
    gigabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e9
    gigaflops = 2 * sum(t.numel() for t in tensors) / 1e9  # a token's
    read = statistics.median(times["read"])
    threads = torch.get_num_threads()
    print(f"{gigabytes:.2f} GB of {args.dtype} weights, {threads} threads; read at {gigabytes / read * 1e3:.1f} GB/s")
    for name, runs in times.items():
        ms = statistics.median(runs)
        line = f"{name:>13}: {ms:7.1f} ms  {ms / read:.2f}x the read"
        if name != "read":
            m = int(name.rsplit("=", 1)[1])
            line += f"  {gigabytes / ms * 1e3:5.1f} GB/s  {gigaflops * m / ms * 1e3:5.0f} GFLOP/s"
            if not name.startswith("M="):
                line += f"  {ms / statistics.median(times[f'M={m}']):.2f}x the plain kernel"
        print(line)


def _other_form(
    form: str, tensors: list[torch.Tensor], inputs: dict[int, dict[int, torch.Tensor]]
) -> dict[int, Callable[[], object]]:
    """Each M's call running every product through `form`'s module over its own copy of the weights, as a server
    holds them: PackedLinear (oneDNN's packed layout) or PanelLinear (the panels)."""
    if form == "panels" and panel_kernel(tensors[0].dtype) is None:
        raise SystemExit("--against panels: the panels run on AVX-512 CPUs only (and where numba compiles them)")
    make = PackedLinear if form == "onednn" else PanelLinear
    modules = [make(t, None) for t in tensors]

    def products(m: int) -> None:
        for t, module in zip(tensors, modules):
            module(inputs[m][t.shape[1]])

    return {m: (lambda m=m: products(m)) for m in inputs}


if __name__ == "__main__":
    main()
