"""The numba kernel at M = 8 against its C twin (scripts/tile_twin.c), in turn with a torch read of the same weights.

    gcc -O3 -march=x86-64-v4 -fopenmp -shared -fPIC scripts/tile_twin.c -o /tmp/tile_twin.so
    python scripts/tile_twin.py [--k 1536] [--twin /tmp/tile_twin.so]

24 copies of an [N, K] float32 weight of 220 MB (N = 35838 at K = 1536; 5.3 GB in all). Each
round reads them by torch's sum, then runs the kernel and the twin prefetching two and three lines a step over
them; medians of eight rounds, as multiples of the read. The twin's bits must equal the kernel's.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
import torch

from specedge.server import _forward_numba


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--twin", default="/tmp/tile_twin.so")
    args = parser.parse_args()
    _forward_numba.set_threads(torch.get_num_threads())
    twin = ctypes.CDLL(args.twin)
    k = args.k
    n = (55_050_240 // k // 3) * 3  # 220 MB a weight
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((n, k), dtype=np.float32) for _ in range(24)]
    x = rng.standard_normal((8, k), dtype=np.float32)
    y, y_twin = np.empty((8, n), np.float32), np.empty((8, n), np.float32)
    tensors = [torch.from_numpy(w) for w in weights]

    def twin_product(lines: int) -> None:
        for w in weights:
            pointers = (ctypes.c_void_p(a.ctypes.data) for a in (x, w, y_twin))
            twin.product(*pointers, ctypes.c_long(n), ctypes.c_long(k), lines)

    calls = {
        "read": lambda: [t.sum() for t in tensors],
        "kernel": lambda: [_forward_numba.matmul(x, w, y) for w in weights],
        "twin, 2 lines": lambda: twin_product(2),
        "twin, 3 lines": lambda: twin_product(3),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(9):  # the first round is untimed (compile, page faults)
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if repeat:
                times[name].append(time.perf_counter() - start)
    read = statistics.median(times["read"])
    gigabytes = sum(w.nbytes for w in weights) / 1e9
    same = np.array_equal(y, y_twin)
    print(f"[{n}, {k}] x 24, {gigabytes:.2f} GB; read at {gigabytes / read:.1f} GB/s; the twin's bits equal: {same}")
    for name, runs in times.items():
        print(f"{name:>14}: {statistics.median(runs) / read:.2f}x the read")


if __name__ == "__main__":
    main()
