"""Every matrix product of a Qwen2.5-1.5B forward on the numba kernel, at a few M, in turn with a read of the
same weights: where a small-M step's cost sits against the memory stream, with no attention or glue around it.

    python scripts/products_at_m.py [--m 1 2 5 8] [--repeats 5]

The weights are random, of the 1.5B's shapes (28 layers of q/k/v, o, gate/up and down, and the LM head: 6.17 GB
of float32), so no checkpoint is needed. Each round reads them once by torch's sum, then runs every product once
at each M; the medians are printed as ms and as a multiple of the read. bench/results' 8 x 1 notes came from it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from specedge.server import _forward_numba

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 1536, 8960, 28, 151_936
LAYER_SHAPES = ((2048, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 5, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    _forward_numba.set_threads(torch.get_num_threads())
    # torch allocates on a 64-byte line, as the server's weights sit; numpy's large arrays start 16 bytes into one,
    # so that every vector load from them would straddle two lines, as none of the server's does.
    torch.manual_seed(0)
    weights = [torch.randn(shape).numpy() for shape in LAYER_SHAPES * LAYERS + ((VOCAB, HIDDEN),)]
    inputs = {m: {k: torch.randn(m, k).numpy() for k in (HIDDEN, INTERMEDIATE)} for m in args.m}
    outputs = {m: [np.empty((m, w.shape[0]), np.float32) for w in weights] for m in args.m}
    tensors = [torch.from_numpy(w) for w in weights]

    def products(m: int) -> None:
        for w, y in zip(weights, outputs[m]):
            _forward_numba.matmul(inputs[m][w.shape[1]], w, y)

    calls = {"read": lambda: [t.sum() for t in tensors]} | {f"M={m}": (lambda m=m: products(m)) for m in args.m}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(args.repeats + 1):  # the first round is untimed (compile, page faults)
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if repeat:
                times[name].append((time.perf_counter() - start) * 1e3)
    gigabytes = sum(w.nbytes for w in weights) / 1e9
    read = statistics.median(times["read"])
    threads = torch.get_num_threads()
    print(f"{gigabytes:.2f} GB of weights, {threads} threads; read at {gigabytes / read * 1e3:.1f} GB/s")
    for name, runs in times.items():
        print(f"{name:>6}: {statistics.median(runs):7.1f} ms  {statistics.median(runs) / read:.2f}x the read")


if __name__ == "__main__":
    main()
