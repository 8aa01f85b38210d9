"""bfloat16 products in AMX tiles from numba, against the plain rows and oneDNN: tried for the server, not kept.

    python scripts/amx_tiles.py [--rows 1 5 8 16 40 155] [--rounds 5]

On a CPU with AMX (an Intel Xeon from Sapphire Rapids on, Linux 5.16 or later), every projection of the 1.5B's 28
decoder layers (random bfloat16 weights of its shapes, 2.6 GB) runs in turn as: these tiles, the numba kernel's plain
rows (server/matmul.py's PlainLinear, vdpbf16ps up to 8 rows and oneDNN above) and oneDNN's packed GEMM (PackedLinear,
bfloat16's `auto` with AMX); medians of the rounds. The tiles' products are checked first against float64 ones, and
a row's against the same row among others (warm_up). Results and why the server does not use it:
docs/engine-cpu.md ("AMX tiles from numba").

The kernel: y [M, N] = x [M, K] @ w.T, x and w bfloat16 (their int16 bits), y float32. w is packed once as tiles
[ceil(N / 64), ceil(K / 32), 4, 16, 32], so that panel p's chunk kc (4 KB) holds four B tiles of 16 output columns
each, in the pair-interleaved (VNNI) order tdpbf16ps reads: tiles[p, kc, b, r, 2 * c + j] = w[64 * p + 16 * b + c,
32 * kc + 2 * r + j]. Each thread takes a share of the panels; a panel's chunks stream from memory once, in order:
pairs of 16 x rows run two by two C tiles over each half of the panel (the second half and every later pair read it
from L2), and what is left, one or two lone groups of up to 16 rows, four C tiles over the panel's four blocks,
their tiles configured to just their rows. Every value is one sum over K in chunk order, in float32, whatever the
other rows, so a row's products do not depend on its step's size.

The tile instructions are inline assembly naming their tile registers: LLVM's AMX intrinsics need its tile type's
own passes, which numba's pipeline does not run. Linux hands a process the tiles' state only when asked
(arch_prctl ARCH_REQ_XCOMP_PERM): request() asks. A task releases the tiles when it ends: in one probe, the plain
rows taken in turn with the tiles read at 7.3 GB/s with the tiles left configured, 11.6 with them released.
The thread count is an argument: numba's get_num_threads() outside a parallel loop makes a function uncacheable.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import numpy as np
import torch
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from specedge.server._race_numba import set_threads
from specedge.server.matmul import PackedLinear, PlainLinear

_FEATURES = llvm.get_host_cpu_features()
AMX = bool(_FEATURES.get("amx-tile", False) and _FEATURES.get("amx-bf16", False))
if AMX:
    llvm.initialize_native_asmparser()  # the inline tile instructions are assembled as the kernel compiles

PANEL, CHUNK, ROWS = 64, 32, 16  # output columns a panel, K a chunk, x rows a group (one tile's rows)
BLOCKS = PANEL // 16  # B tiles a chunk
_CHUNK_BYTES = BLOCKS * 16 * 64  # one chunk: four 16 x 64-byte tiles
# Each step prefetches the first two lines of the chunk 16 chunks on, into L2: the L2's streamer, which stops at
# every 4 KB page (one chunk), then fetches the rest of that page in time. Over the 1.5B's LM head (467 MB) on a
# 2-core AMX Xeon, alone: 20.4 ms, against 23.3 prefetching every line of the chunk two on and 21.7 with none.
_AHEAD = 16 * _CHUNK_BYTES
_I64 = ir.IntType(64)

_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def request() -> None:
    """Ask Linux for this process's AMX tile state (once is enough; asking again is harmless). Raises where it
    cannot be had: a CPU without AMX, another OS, a kernel before 5.16."""
    if not AMX:
        raise RuntimeError("this CPU has no AMX-BF16 tiles")
    if not sys.platform.startswith("linux"):
        raise RuntimeError("the AMX tiles are requested from Linux only")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        raise RuntimeError(f"Linux refused the AMX tile state (errno {ctypes.get_errno()})")


def _asm(text: str, operands: int):
    """An intrinsic that runs `text` on `operands` int64 registers ($0 ...), as a side effect on memory."""
    signature = ir.FunctionType(ir.VoidType(), [_I64] * operands)
    constraints = ",".join(["r"] * operands + ["~{memory}"])

    def codegen(context, builder, sig, args):
        builder.asm(signature, text, constraints, list(args), side_effect=True)
        return context.get_dummy_value()

    signature_of = types.void(*([types.int64] * operands))
    # numba's intrinsic takes a typer of named parameters (no *args), one per operand
    typers = {
        0: lambda typingctx: (signature_of, codegen),
        1: lambda typingctx, a: (signature_of, codegen),
        2: lambda typingctx, a, b: (signature_of, codegen),
        4: lambda typingctx, a, b, c, d: (signature_of, codegen),
        5: lambda typingctx, a, b, c, d, e: (signature_of, codegen),
    }
    return intrinsic(typers[operands])


@intrinsic
def _address(typingctx, array):
    """An array's first element's address, as an int64 the tile instructions take."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, _I64)

    return types.int64(array), codegen


def _prefetches(operand: str) -> str:
    return f"\n\tprefetcht2 {_AHEAD}({operand})\n\tprefetcht2 {_AHEAD + 64}({operand})"


_configure = _asm("ldtilecfg ($0)", 1)
_zero = _asm("tilezero %tmm0\n\ttilezero %tmm1\n\ttilezero %tmm2\n\ttilezero %tmm3", 0)
# One chunk for a lone group: $0 x's tile, $1 x's row stride, $2 the chunk, $3 64 (a B tile's row stride).
_step_1x4 = _asm(
    "tileloadd ($0,$1,1), %tmm4\n\t"
    "tileloadd ($2,$3,1), %tmm5\n\t"
    "tileloadd 1024($2,$3,1), %tmm6\n\t"
    "tileloadd 2048($2,$3,1), %tmm7\n\t"
    "tdpbf16ps %tmm5, %tmm4, %tmm0\n\t"
    "tileloadd 3072($2,$3,1), %tmm5\n\t"
    "tdpbf16ps %tmm6, %tmm4, %tmm1\n\t"
    "tdpbf16ps %tmm7, %tmm4, %tmm2\n\t"
    "tdpbf16ps %tmm5, %tmm4, %tmm3" + _prefetches("$2"),
    4,
)
# One half-chunk for a pair of groups: $0 and $4 the two groups' x tiles, $1 x's row stride, $2 the half-chunk's
# first B tile, $3 64.
_step_2x2 = _asm(
    "tileloadd ($0,$1,1), %tmm4\n\t"
    "tileloadd ($2,$3,1), %tmm6\n\t"
    "tileloadd ($4,$1,1), %tmm5\n\t"
    "tileloadd 1024($2,$3,1), %tmm7\n\t"
    "tdpbf16ps %tmm6, %tmm4, %tmm0\n\t"
    "tdpbf16ps %tmm7, %tmm4, %tmm1\n\t"
    "tdpbf16ps %tmm6, %tmm5, %tmm2\n\t"
    "tdpbf16ps %tmm7, %tmm5, %tmm3" + _prefetches("$2"),
    5,
)
# $0 the first C tile's place in y, $1 y's row stride; 1 x 4: four tiles side by side.
_store_1x4 = _asm(
    "tilestored %tmm0, ($0,$1,1)\n\t"
    "tilestored %tmm1, 64($0,$1,1)\n\t"
    "tilestored %tmm2, 128($0,$1,1)\n\t"
    "tilestored %tmm3, 192($0,$1,1)",
    2,
)
# 2 x 2: $0 and $2 the two groups' places in y, $1 and $3 y's row stride.
_store_2x2 = _asm(
    "tilestored %tmm0, ($0,$1,1)\n\t"
    "tilestored %tmm1, 64($0,$1,1)\n\t"
    "tilestored %tmm2, ($2,$3,1)\n\t"
    "tilestored %tmm3, 64($2,$3,1)",
    4,
)
_release = _asm("tilerelease", 0)


@njit(nogil=True, cache=False)
def _tile_config(config, rows):
    """Palette 1: the sums' tiles (0-3) and x's first (4) `rows` rows of 64 bytes, the others 16 (a lone group of
    fewer than 16 x rows loads and stores just its rows)."""
    config[:] = 0
    config[0] = 1
    for tile in range(8):
        config[16 + 2 * tile] = 64
        config[48 + tile] = rows if tile <= 4 else ROWS


@njit(parallel=True, nogil=True, cache=False)
def matmul(x, tiles, y, threads):
    """y = x @ w.T: x [M, 32 * C] int16 (bfloat16 bits), tiles [P, C, 4, 16, 32] int16 (w as packed above),
    y [M, 64 * P] float32; `threads` tasks (set_threads(threads) first), each a share of the panels. Pairs of 16
    rows run two by two tiles; what is left, one or two lone groups (of 16 and fewer) four tiles side by side."""
    rows, k = x.shape
    panels, chunks = tiles.shape[0], tiles.shape[1]
    assert k == chunks * CHUNK and y.shape[0] == rows and y.shape[1] == panels * PANEL
    x_stride, y_stride = k * 2, y.shape[1] * 4
    x_at, tiles_at, y_at = _address(x), _address(tiles), _address(y)
    panel_bytes = chunks * _CHUNK_BYTES
    pairs, left = rows // (2 * ROWS), rows % (2 * ROWS)
    lone = (ROWS, left - ROWS) if left > ROWS else (left, 0)  # the lone groups' rows (0: none)
    for task in prange(threads):
        config = np.empty(64, np.uint8)
        configured = -1  # the rows of x's tile as configured
        for p in range(panels * task // threads, panels * (task + 1) // threads):
            panel, column = tiles_at + p * panel_bytes, y_at + p * PANEL * 4
            if pairs and configured != ROWS:
                configured = ROWS
                _tile_config(config, ROWS)
                _configure(_address(config))
            for half in range(2):
                for pair in range(pairs):
                    top = 2 * ROWS * pair
                    x0, x1 = x_at + top * x_stride, x_at + (top + ROWS) * x_stride
                    _zero()
                    for kc in range(chunks):
                        _step_2x2(x0 + kc * 64, x_stride, panel + kc * _CHUNK_BYTES + half * 2048, 64, x1 + kc * 64)
                    at = column + half * 128
                    _store_2x2(at + top * y_stride, y_stride, at + (top + ROWS) * y_stride, y_stride)
            top = 2 * ROWS * pairs
            for group in lone:
                if group == 0:
                    break
                if configured != group:
                    configured = group
                    _tile_config(config, group)
                    _configure(_address(config))
                x0 = x_at + top * x_stride
                _zero()
                for kc in range(chunks):
                    _step_1x4(x0 + kc * 64, x_stride, panel + kc * _CHUNK_BYTES, 64)
                _store_1x4(column + top * y_stride, y_stride)
                top += group
        _release()


def pack(weight: np.ndarray) -> np.ndarray:
    """A weight [N, K] (bfloat16's int16 bits) as tiles [ceil(N / 64), ceil(K / 32), 4, 16, 32], zero-padded."""
    n, k = weight.shape
    panels, chunks = -(-n // PANEL), -(-k // CHUNK)
    padded = np.zeros((panels * PANEL, chunks * CHUNK), np.int16)
    padded[:n, :k] = weight
    by_place = padded.reshape(panels, BLOCKS, 16, chunks, 16, 2)  # p, b, c, kc, r, j
    return np.ascontiguousarray(by_place.transpose(0, 3, 1, 4, 2, 5)).reshape(panels, chunks, BLOCKS, 16, 32)


def warm_up() -> None:
    """Request the tiles, compile (or load) the kernel and check it against float64 products: a lone group, a pair
    and a pair with a lone group, and that a row's values do not change with the rows beside it."""
    request()
    rng = np.random.default_rng(0)
    n, k = 200, 100  # neither a whole number of panels nor of chunks
    w = _bfloat16_bits(rng.standard_normal((n, k), dtype=np.float32))
    tiles = pack(w)
    first = None
    for m in (1, 5, 16, 17, 40, 75):
        x = _bfloat16_bits(rng.standard_normal((m, k), dtype=np.float32))
        if first is not None:
            x[0] = first[0]
        xp = np.zeros((m, tiles.shape[1] * CHUNK), np.int16)
        xp[:, :k] = x
        y = np.empty((m, tiles.shape[0] * PANEL), np.float32)
        matmul(xp, tiles, y, 2)
        exact = _float64(x) @ _float64(w).T
        if not np.allclose(y[:m, :n], exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max()):
            raise RuntimeError(f"the AMX product at {m} rows is off by {np.abs(y[:m, :n] - exact).max()}")
        if first is None:
            first = (x[0].copy(), y[0, :n].copy())
        elif not np.array_equal(y[0, :n], first[1]):
            raise RuntimeError(f"a row's AMX product changed with {m - 1} rows beside it")


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)  # truncated: any bfloat16 will do


def _float64(bits: np.ndarray) -> np.ndarray:
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


SHAPES = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))  # one layer's q/k/v, o, gate/up, down
LAYERS = 28


def product(x: torch.Tensor, tiles: np.ndarray, out_features: int) -> torch.Tensor:
    """x [M, K] bfloat16 @ w.T through the tiles, rounded once to bfloat16."""
    width = tiles.shape[1] * CHUNK
    x = torch.nn.functional.pad(x, (0, width - x.shape[1])).contiguous()
    y = torch.empty(x.shape[0], tiles.shape[0] * PANEL, dtype=torch.float32)
    threads = torch.get_num_threads()
    set_threads(threads)
    matmul(x.view(torch.int16).numpy(), tiles, y.numpy(), threads)
    return y[:, :out_features].to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8, 16, 40, 155])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warm_up()
    weights = [torch.randn(*shape).to(torch.bfloat16) * 0.02 for _ in range(LAYERS) for shape in SHAPES]
    tiles = [pack(w.view(torch.int16).numpy()) for w in weights]
    forms = {
        "tiles": [lambda x, t=t, n=w.shape[0]: product(x, t, n) for t, w in zip(tiles, weights)],
        "plain rows": [PlainLinear(w, None) for w in weights],
        "onednn": [PackedLinear(w, None) for w in weights],
    }
    del weights
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for m in args.rows:
                xs = [torch.randn(m, shape[1]).to(torch.bfloat16) for shape in SHAPES]
                for name, products in forms.items():
                    start = time.perf_counter()
                    for i, call in enumerate(products):
                        call(xs[i % len(SHAPES)])
                    times.setdefault((name, m), []).append((time.perf_counter() - start) * 1e3)
    gb = sum(out * k * 2 for out, k in SHAPES) * LAYERS / 1e9
    for m in args.rows:
        tiles_ms, plain_ms, onednn_ms = (statistics.median(times[(name, m)]) for name in forms)
        print(
            f"M = {m}: tiles {tiles_ms:.1f} ms ({gb / tiles_ms * 1e3:.1f} GB/s), plain rows {plain_ms:.1f}, "
            f"onednn {onednn_ms:.1f}; tiles / plain rows {tiles_ms / plain_ms:.2f}x, "
            f"/ onednn {tiles_ms / onednn_ms:.2f}x"
        )


if __name__ == "__main__":
    main()
