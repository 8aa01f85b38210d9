"""The compiled forward's kernels (imported only where numba is installed): the matrix product behind
server/matmul.py's `numba` path, the attention behind server/attention.py's, and the decoder layer behind
server/layer_kernel.py, which calls the other two.

They share one file because numba's disk cache (cache=True) watches only the file that defines a kernel:
a kernel that called code from another file would keep running the old code after that file changed.
Everything the kernels call, and every constant they read, is defined here; tests/test_kernels.py checks
it. From the cache a process loads all three in a fraction of a second, where compiling them takes about
twelve seconds on the 2-core EPYC of bench/results.

The panel product (float32 on AVX-512 CPUs where the first start timed it faster). The weights are
packed once, at load, into panels of 64 output columns, [ceil(N / 64), K, 64] (server/matmul.py's PanelLinear, the
original freed), and y = x @ w.T is a GEMM over them of the broadcast kind: a tile takes up
to six x rows and one panel, and at each value of K loads the panel's four weight vectors
and broadcasts each x row's value into 6 x 4 sums, with no reduction across lanes at the
end. Each thread walks a run of panels 64 values of K at a time; the first tile reads a
chunk (16 KB) from memory and the others from L1, and the tiles share the prefetch of the
next chunk. Every value of y is one sum over K in order, so a row's bits are the same at
every M, in every tile and every block of rows: no row limit, no handing over to oneDNN.
From 19 rows the x rows are first packed tile by tile, so that a step's values lie side by
side, and K goes in parts whose x rows fit in L2 (panel_matmul).

The matrix product over plain weights (bfloat16, and float32 on Zen 4 and AVX2).
y = x @ w.T for x [M, K] and w [N, K], both row-major:
the layout the checkpoint already has, so no packed copy is made. Each thread takes
blocks of four weight rows and walks x a few rows at a time, so a weight row is read
from memory once and then from cache, by each later pass. At small M this reads the
weights at or near the machine's memory speed, where oneDNN and MKL reach 50-85% of it
(`specedge-bench engine`'s kernel table). Larger M are left to oneDNN, whose
blocked GEMM reuses each weight over many more rows (MAX_ROWS). From one x row on
(K a multiple of the step), passes take x up to _GROUP rows at a time, in groups as even
as the rows allow, and each pass prefetches its share of the next block's lines, one
line every step or two (on Zen 4 the whole next block, up to four lines a step), so that a pass reading
its block from cache does not leave the memory idle. On Zen 4, M = 1 reads w a row at a time
instead (_row_by_row), each thread's share one stream for the hardware's prefetcher, and the lone
passes of five and six x rows prefetch each of their w rows 32 lines ahead (_LONE_AHEAD), and
every prefetch of up to four passes a block is issued three times in a row (_PREFETCH_REPEATS).
With AVX2 a pass holds three x rows (a 4 x 3 tile of 8-lane sums: twelve sums, three
x vectors and one w vector in the sixteen registers): M = 3 makes one pass over a
block instead of two (0.90-0.92x the time), M = 8 three instead of four (0.96x the
time at M = 5 and 8, 0.86-0.92x at 16 and 40). With AVX-512 a pass holds six (a
4 x 6 tile of 16-lane sums in 31 of the 32 registers), and each weight vector loaded
meets twice the x rows: over a forward's worth of the 1.5B's products on a 2-core
Xeon, 0.93x the AVX2 tile's time at M = 8 and 0.87-0.93x at 16-40, the same at 1-3.
On AVX-512 the passes themselves change. Where one pass takes every row (M = 3-6) it
prefetches two lines a step, half the next block rather than a quarter. M = 7-8 take
blocks of three weight rows in one pass (a 3 x 8 tile: 24 sums, three w vectors held,
x loaded vector by vector), not blocks of four in two passes, so no pass reads its
block from cache while the memory waits. On Zen 4 so do float32's M = 9-16 and
bfloat16's M = 9-64, in passes of the 3 x 4 .. 3 x 8 tiles that share the next
block's prefetch (0.64-0.98x the time of the chunked passes). Past those, every pass
walks a block a K chunk at a time (_chunked_passes), so that the block streams in
throughout (off Zen 4 two blocks side by side: _SPAN). Whole forwards of the 1.5B on
the 2-core Xeon, in turn with the kernel before each change: 1 x 5 0.92-0.95x and
8 x 1 0.92-0.95x; 2 x 5 to 5 x 5 0.93-0.95x, 8 x 5 0.99x.
`_prefetching_tile` writes the tiles in LLVM IR because a prefetch inside a numba
loop stops LLVM from vectorizing it. Prefetching a whole share at once, between
passes, was slower (docs/engine-cpu.md's 8 x 1 paragraph).

bfloat16 (`--dtype bfloat16 --matmul numba`, on CPUs with AVX512_BF16). x and w come as the int16 bits of
bfloat16, and a tile's step takes 32 values of K as pairs into the 16 float32 lanes of each sum (vdpbf16ps,
written as inline assembly: its LLVM intrinsic's types have changed between versions). So the weights stream at
half the bytes and every sum is float32; the caller rounds once. Passes of several tiles hold five x rows, not
six. [M, 1536] x [1536, 8960], 20 weights in turn with oneDNN's packed bfloat16 product on a 2-core Zen 4 EPYC:
M = 1-6 0.74-0.93x its time (at the stream's speed), M = 7-8 0.99-1.05x, M = 12-64 0.99-1.14x. A bfloat16
block is half a float32 one's bytes, and its lone passes and three-row blocks prefetch all of the next one, on
every CPU. Where the CPU has AMX (AMX-BF16), oneDNN takes bfloat16 products from nine rows on.

Attention. Every short row of a step (a decode token, a verify chain or tree)
attends to its own KV slot in one call: one parallel task per (row, KV head),
or per row where the rows keep every thread busy (AVX-512: task_heads), reading the
slot in place. A task scores each visible key against the G query
heads that share the KV head while the key is in cache, takes a softmax per query
head, and sums the values the same way, prefetching keys and values 16 keys
ahead. On AVX-512 CPUs where they were timed faster, heads of 64, 128 or 256 values
go through two tiles written in IR instead (attend's `tiles`): six queries by four
keys of dot products ending in one shuffle tree, and six queries' weighted sums
over 64 columns held in registers, a key a step. On a CPU this replaces one scaled-dot-product call per row and layer
(about 0.1 ms each, whatever the row's size) with a few microseconds of
arithmetic. A query at new position t sees every cached key and its row's new
keys j <= t: all of them in a chain, its ancestors in a tree (tree_masks). Keys
past t are never read. A bfloat16 cache is read in place as its int16 bits, each
value widened to float32 as it is loaded.

The decoder layer. One call runs a whole layer over a step's packed tokens, in
place on the residual stream x [N, hidden]: RMSNorm, the fused q/k/v product,
Qwen3's per-head norms, RoPE, the KV writes, every row's attention, o_proj,
RMSNorm, gate/up, SiLU, down_proj. The products and the attention are the kernels
the module path calls one by one; what this adds is the glue between them, so the
step returns to Python once a layer instead of after every product and every torch
op. Each of those returns ran cold: a product streams tens of megabytes of weights
through the caches, and the interpreter and torch's dispatcher then missed on their
own code and data.
"""

from __future__ import annotations

import math
import os

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from specedge.server._race_numba import set_threads  # noqa: F401 - the one thread setting for every kernel

# Dot products and sums may be reassociated (vectorized); infinities and NaNs keep their IEEE meaning.
_FAST = {"reassoc", "contract", "nsz"}
NO_TREE = -1  # tree_offsets' value for a chain row
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
# The tile's vector width and x rows a pass: AVX-512's 32 registers hold 4 x 6 sums, six x vectors and one w
# vector of 16 lanes; AVX2's 16 hold 4 x 3 sums of 8 lanes. numba's cache is per CPU, so each compiles its own.
_HOST_AVX512 = bool(llvm.get_host_cpu_features().get("avx512f", False))
# Another CPU's forms, compiled here for tests (tests/test_kernel_forms.py): SPECEDGE_KERNEL_FORMS_OF=znver4 (Zen
# 4's, on any AVX-512 CPU), avx512 (an Intel AVX-512 CPU's, on Zen 4) or avx2 (an AVX2 CPU's, on any), so that the
# forms of the machine kinds CI did not run on are checked on the one it did. The forms are baked in as the kernels
# compile and neither numba's cache nor the cache dir's kernel-forms.json (keyed by the CPU's name) knows them, so
# such a process must name caches of its own.
FORMS_OF_ENV = "SPECEDGE_KERNEL_FORMS_OF"
_FORMS_OF = os.environ.get(FORMS_OF_ENV)
if _FORMS_OF is not None and (
    _FORMS_OF not in ("znver4", "avx512", "avx2")
    or (_FORMS_OF != "avx2" and not _HOST_AVX512)
    or not os.environ.get("NUMBA_CACHE_DIR")
    or not os.environ.get("SPECEDGE_CACHE")
):
    raise RuntimeError(
        f"{FORMS_OF_ENV}={_FORMS_OF}: a test hook that takes znver4 or avx512 (on an AVX-512 CPU) or avx2, with "
        "NUMBA_CACHE_DIR and SPECEDGE_CACHE set to caches of its own"
    )
_AVX512 = _HOST_AVX512 and _FORMS_OF != "avx2"
_LANES, _LANE_BITS, _GROUP = (16, 4, 6) if _AVX512 else (8, 3, 3)
_V = ir.VectorType(_F32, _LANES)
# bfloat16 products (x and w as the int16 bits of bfloat16) on CPUs with AVX512_BF16: a step of a tile takes 32
# values of K, as pairs, into the 16 float32 lanes of a sum (vdpbf16ps).
DPBF16 = _AVX512 and bool(llvm.get_host_cpu_features().get("avx512bf16", False))
if DPBF16:
    llvm.initialize_native_asmparser()  # the inline vdpbf16ps is assembled as the kernel compiles
_PAIRS = ir.VectorType(_I32, _LANES)  # 32 bfloat16 values, two to a lane
_I8P = ir.IntType(8).as_pointer()
# AMD's AVX-512 cores (Zen 4 on): there a lone pass (one pass takes every x row) prefetching the whole next block
# read [8960, 1536] weights at 0.93-0.98x a torch read where the plain loop read at 0.79-0.81x (M = 1), and at
# M = 3-6 1.10-1.16x faster than prefetching half the block, in turn on a 2-core EPYC (docs/engine-cpu.md). On
# a 2-core AVX-512 Xeon the lone pass took 0.99x the plain loop's time at M = 1 and 0.95x at M = 2 in float32, 0.61x
# and 0.69x in bfloat16; on a 2-core AVX2 EPYC, over all of the 1.5B's products in turn with an identical copy of the
# plain loops (0.97-0.99x), 0.98-1.00x at M = 1 and 0.95-0.96x at M = 2 (prefetching two lines a step instead of
# one: 1.12-1.14x). And the plain loops sum in LLVM's order, so that M = 1 gave each row other bits than M >= 2
# (docs/engine-cpu.md): every CPU now takes the lone pass from one row.
_ZEN_AVX512 = _AVX512 and (_FORMS_OF or llvm.get_host_cpu_name()).startswith("znver")
# Plain-weight products of up to this many rows run `matmul` (and steps of as many tokens, the compiled layers);
# larger ones, oneDNN's GEMM on the same plain weights (server/matmul.py), whose blocked kernels reuse each weight
# over many more rows. Over a forward's worth of the
# 1.5B's products (1.1 GB, more than the caches hold), oneDNN caught up at M = 40 on a 2-core AVX-512 Xeon (x rows
# on cache lines: 103 ms each at 40, oneDNN 0.90x at 48) and between 40 and 64 on a 2-core AVX2 EPYC. On a 2-core
# Zen 4 EPYC, over all of the 1.5B's products (6.2 GB) in turn with oneDNN's GEMM on the same weights, float32 took
# 0.81-0.88x its time at M = 41-64, 0.91-0.94x at 72-96, 0.99x at 112-120 and 1.01-1.04x at 128-160 (with
# _LONG_CHUNKS 0.78-0.91x at 48-96 and 0.97x at 120); bfloat16 0.85-0.86x at 41-64, 0.99x at 80 and 1.02-1.05x at
# 96-128 (docs/engine-cpu.md). On the Xeon, once the chunked passes took two blocks side by side (_SPAN), float32
# took 0.84-0.91x oneDNN's time at M = 40-56, 0.94-0.96x at 64, 0.98x at 72, 1.00x at 80, 1.07x at 96; whole
# forwards in turn with the limit at 40: 41-56 tokens (8 x 6, 9 x 5, 10 x 5, 11 x 5, 12 x 4) 0.91-0.96x, but 12 x 5
# (60 tokens) 1.02x with the limit at 64 and 14 x 5 (70) 1.07x at 72, so 56.
# bfloat16 on AVX-512 CPUs without AMX keeps 40 (untimed at 41-56); with AMX, 8 (below).
MAX_ROWS = 120 if _ZEN_AVX512 else 56 if _AVX512 else 48
# bfloat16 on a CPU with AMX (AMX-BF16: an Intel Xeon from Sapphire Rapids on): oneDNN's GEMM runs it in AMX tiles,
# and over three layers' worth of the 1.5B's products in turn on a 2-core Xeon took 0.82-0.86x the kernel's time at
# M = 9-12 (on the plain weights the kernel reads), 0.44x at M = 40, but 1.09-1.35x at M = 4-8: so up to 8 rows.
_AMX = _AVX512 and bool(llvm.get_host_cpu_features().get("amx-bf16", False))
MAX_ROWS_BFLOAT16 = 64 if _ZEN_AVX512 else 8 if _AMX else 40 if _AVX512 else MAX_ROWS
# bfloat16 weights as oneDNN packs them on CPUs with AVX512_BF16 but not AMX (Zen 4): panels of PANEL columns, K in
# pairs, which panel_matmul reads in place (server/matmul.py's PairPanelLinear, `--matmul onednn-numba`). Products of
# up to this many rows run it, larger ones oneDNN's GEMM on its own layout. Over all of the 1.5B's products (random
# weights of its shapes) in turn with oneDNN's on the same bytes, on a 2-core Zen 4 EPYC: M = 1 0.80x the time, 5
# 0.95x, 8-12 0.73-0.74x, 16 0.80x, 24-40 0.92-0.96x, 48 0.98x, 64 1.07x; whole forwards of the 1.5B in turn with
# `--matmul onednn`: 8 x 5 (40 tokens) 0.97x, but 16 x 3 (48) 1.06x (docs/engine-cpu.md).
PAIRS = DPBF16 and not _AMX  # with AMX, oneDNN's tiles run bfloat16 from 9 rows faster than any of these kernels
MAX_ROWS_PAIRS = 40
_PREFETCH_FROM = 1  # x rows from which the product's passes prefetch the next block
_LONE_LINES = 4 if _ZEN_AVX512 else 2 if _AVX512 else 1  # lines a step of a lone pass may prefetch
# The 3 x 7 and 3 x 8 tiles' prefetches a step: on Zen 4 three, the whole next block (each line once); two thirds of
# it elsewhere. With the 3 x 8 tile's fence (_step_fence), every product of the 1.5B in turn with the tiles before
# them on a 2-core Zen 4 EPYC: M = 7 0.77-0.87x the time, M = 8 0.59-0.88x (docs/engine-cpu.md).
_THREE_ROW_LINES = 3 if _ZEN_AVX512 else 2
# On Zen 4, float32 products of 9 to _THREE_ROW_TO rows take the three-row blocks too, in two passes of the 3 x 4 ..
# 3 x 8 tiles that share the prefetch of the next block, rather than the chunked passes' blocks of four rows. Over
# all of the 1.5B's products in turn with the chunked passes on a 2-core Zen 4 EPYC, the same bits: at 31-33 GB/s
# M = 9-11 0.92-0.95x the time, 12 0.85x, 13-15 0.71-0.80x, 16 0.94-0.97x; at 48 GB/s M = 9-12 0.91-0.95x, 14
# 0.81x, 16 0.97x. Three passes took M = 17 1.06x the long chunks' time, 20 0.98x, 24 1.04x (docs/engine-cpu.md).
# bfloat16, whose chunked passes hold five x rows, gains more and further: all of its products there up to
# MAX_ROWS_BFLOAT16 (64), at 35-51 GB/s M = 9 0.86x the time, 12-14 0.64-0.66x, 16-24 0.77-0.85x, 32 0.90x, 40
# 0.98x, 48 0.91x, 64 0.97x.
_THREE_ROW_TO = 16 if _ZEN_AVX512 else 8
_THREE_ROW_TO_BFLOAT16 = 64 if _ZEN_AVX512 else 8
# bfloat16 prefetches the whole next block everywhere: a lone pass four lines a step, the 3 x 7 and 3 x 8 tiles
# three. A bfloat16 block is half a float32 one's bytes, and on a 2-core Xeon, over three layers' worth of the
# 1.5B's bfloat16 products in turn with the float32 counts (two lines a step in both), M = 1-2 took 0.90-0.97x the
# time, M = 3-6 0.80-0.89x, M = 7-8 0.93-0.97x; float32 there lost with them (M = 1-5 1.02-1.09x, M = 8 1.10x).
_LONE_LINES_BFLOAT16 = 4
_THREE_ROW_LINES_BFLOAT16 = 3
# Lines a step of a chunked pass (M > _GROUP) may prefetch. At one, M = 9-18 (two or three passes) prefetched only
# half to three quarters of the next block; on Zen 4 two let them take all of it: in turn over 24 [35838, 1536]
# weights, M = 10-12 0.76-0.82x the time, M = 16 0.87-0.89x, 24 0.94x, 40 0.99x (docs/engine-cpu.md).
_CHUNK_LINES = 2 if _ZEN_AVX512 else 1
# M = 1 on Zen 4 reads w a row at a time, in memory order (_row_by_row), where the lone pass reads four rows at once
# and prefetches the next four. Over 24 [35838, 1536] weights in turn with the lone pass, at 50 GB/s it took 0.98x
# a read of them where the lone pass took 1.25x, at 32-35 GB/s 0.99-1.01x against 1.02-1.05x; bfloat16 0.83-0.92x
# the time. Its x row is read again for every w row: at K = 8960 (35 KB of x, more than L1 holds) it took
# 1.36-1.40x, so such products keep the lone pass (docs/engine-cpu.md).
_ROW_BY_ROW = _ZEN_AVX512
_ROW_BY_ROW_BYTES = 16384  # the largest x row _row_by_row takes: half of Zen 4's 32 KB L1
# On Zen 4 the lone passes of _LONE_AHEAD_FROM x rows on prefetch each of their four w rows _LONE_AHEAD lines
# ahead (on into the next block's rows), rather than the next block line by line: M = 5 took 0.84-0.86x the time
# at 55-56 GB/s and 0.82-0.94x at 32-35, M = 6 0.86x and 0.96-0.98x, while M = 2-4 gained nothing or lost up to 5%
# (docs/engine-cpu.md). The 3 x 7 and 3 x 8 tiles keep the line by line prefetch. So the 3 x 8 tile took
# 1.02-1.09x the time at 54-58 GB/s; and the 3 x 7 tile alone so (M = 7 a median 0.97x) left the unchanged 3 x 8
# tile at 1.15-1.22x its time at 30-33 GB/s and 1.29-1.34x at 52-54, also with the two in separate functions. Why
# is not known.
_LONE_AHEAD = 32 if _ZEN_AVX512 else 0
_LONE_AHEAD_FROM = 5
# On Zen 4, float32 products of M >= _LONG_CHUNKS_FROM rows walk each block _LONG_CHUNKS values of K at a time (all
# of K = 1536), not 256 or 512: each pass loads and stores its sums once a chunk, and three passes or more over a
# block keep the memory busy without short chunks. Over all of the 1.5B's products in turn with the short chunks,
# at 31 GB/s: M = 16-48 0.87-0.95x the time, 64-120 0.87-0.96x; but M = 12-13 1.05-1.07x, so below 16 they stay.
# bfloat16 was mixed (M = 24-32 1.01-1.03x, 40-64 0.91-0.95x) and keeps them (docs/engine-cpu.md).
_LONG_CHUNKS = 2048 if _ZEN_AVX512 else 0
_LONG_CHUNKS_FROM = 16
# Elsewhere the chunked passes take two blocks side by side: a pass walks a chunk of one block, then the same chunk of
# the next, with the same x rows, and each block's calls prefetch the block two on. Over all of the 1.5B's products
# in turn with blocks one at a time on a 2-core AVX-512 Xeon: M = 9 and 16-24 0.93-0.94x the time, 12 0.99x, 40
# 0.96-0.97x, 64 0.97x; prefetching two blocks on with blocks one at a time gained nothing (0.98-1.01x), nor did
# two blocks side by side prefetching one on (1.01-1.06x), three or four side by side gained less (M = 24
# 0.94-0.96x), and bfloat16 was unchanged (1.00x). Whole forwards 2 x 5 0.97x, 4 x 5 0.93x, 8 x 5 0.95x, same bits
# (docs/engine-cpu.md). Zen 4, untimed with it, keeps one block at a time.
_SPAN = 1 if _ZEN_AVX512 else 2
# The 3 x 8 tile's sums that go through memory every step on Zen 4 (stored, and loaded again after the step's
# fence) rather than staying in registers. numba links each parallel loop into every kernel that calls it and
# optimizes it again there, and its disk cache keeps only those copies: a process that compiled the kernel ran the
# loop as first optimized, which happened to spill three sums, and every later process (every server start after
# the first) ran the copy that kept them in registers, which took 1.19-1.23x the time at M = 8 (whole 8 x 1
# forwards: 1.19x, in turn on a 2-core Zen 4 EPYC). With three sums in memory the cached kernel's M = 8 took
# 0.98-1.04x the freshly compiled one's (docs/engine-cpu.md).
_SUMS_IN_MEMORY = 3 if _ZEN_AVX512 else 0
_TO_L2 = 2  # llvm.prefetch's locality: 2 fills L2 (prefetcht1); into L1 (3) was slower at K = 8960
# On Zen 4 the tiles issue each of their prefetches three times in a row. Over all of the 1.5B's products (kernels
# from numba's cache) in turn with the single prefetch and a torch read of the weights, at 50-61 GB/s: M = 5-8
# 1.05-1.33x the read where one prefetch took 1.49-1.86x (M = 8 0.65-0.80x the time), M = 2-4 1.12-1.29x against
# 1.27-1.67x, M = 9-12 0.76-0.93x the time; at 30-34 GB/s M = 3-12 0.81-0.97x. Twice gained less (M = 4 1.28-1.35x,
# M = 8 1.17-1.29x); a prefetch repeated a block later, into L1 (prefetcht0) or as prefetcht2 did not help, so why a
# repeat counts is not known. The chunked passes repeat only up to _REPEATED_PASSES passes a block: M = 16-24
# 0.85-0.98x the time, while at 20 passes (M = 120, its arithmetic the limit) three repeats took 1.01x
# (docs/engine-cpu.md).
_PREFETCH_REPEATS = 3 if _ZEN_AVX512 else 1
_REPEATED_PASSES = 4
# Attention's prefetches of keys and values: into L1 (prefetcht0), each read while it is there. On AVX-512 CPUs
# into L2, and a task takes all of a row's KV heads where the rows keep every thread busy (task_heads), reading
# each key's heads side by side: one layer's attention at 8 x 1 on 2,000 cached keys a row, from memory, took 0.51x
# the time of a task a head prefetching into L1 (scores alone, one thread: 0.45x; heads side by side into L1 0.99x,
# a head a task into L2 0.92x), whole 8 x 1 forwards there 0.90x, other steps and 200 keys 0.99-1.01x, on a 2-core
# Zen 4 EPYC; on a 2-core AVX-512 Xeon 28 layers' attention at 8 x 1 took 0.74x at 2,000 keys, 0.82x at 1,000
# and 0.96x at 200, 8 x 5 0.97-1.01x, and whole 8 x 1 forwards at 2,000 keys 0.94-0.97x (docs/engine-cpu.md).
# AVX2 CPUs keep what they had (untimed there).
_TO_L1 = 3  # prefetcht0
_HEADS_TOGETHER = _AVX512
_KEYS_TO = _TO_L2 if _AVX512 else _TO_L1
_VALUE_QUERIES = 3  # queries that share each value read in _weighted_values (six from L2: 0.71-0.76x the time of one)
_KEYS_AHEAD = 16  # keys a task prefetches ahead of the four it reads (8 KB of one head at D = 128)
# On AVX-512 CPUs where they run faster (by default all but Zen 4, untimed there, as the panels), heads of a multiple of
# PANEL values (64, 128, 256) attend through two tiles written in IR, as the products' are. A score tile takes
# _SCORE_QUERIES queries by four keys, dot products a vector of the head at a time (6 x 4 sums, four key vectors and a
# query's in 29 of the 32 registers), and one shuffle tree a four; a value tile _VALUE_ROWS queries' weighted sums over
# PANEL of the head's columns, a key a step (the panel product's step: the key's values as four vectors, each query's
# weight broadcast). A tile walks a block of one head's keys, which its block's other tiles then read from L1, and the
# block's tiles share the prefetch of the next block, a line or more a step each. Those blocks: _SCORE_KEYS and
# _VALUE_KEYS (from memory, one thread, the score tiles took 0.80-0.90x the time with blocks of 16 keys as with 64, the
# value tiles 0.92-0.97x with 32). 28 layers' attention (12 heads, 2 KV heads of 128) at 2,000 cached keys a row, in
# turn with the loops of dot_4x2 and _four_values on a 2-core Xeon: 8 x 5 0.65x the time, 8 x 1 0.86x, 1 x 5 0.67x, 1 x
# 1 0.73x; at 200 keys 8 x 5 0.69x, 16 x 5 0.70x. Whole forwards of the real 1.5B at 2,000 keys: 8 x 5 0.90x, 8 x 1 and
# 1 x 5 0.97x (docs/engine-cpu.md). Other heads and AVX2 keep the loops, and so does Zen 4 by
# default (the tiles untimed there) unless its first start times them faster. attend takes the choice as an argument,
# so that tests check both on every AVX-512 CPU and `specedge-bench engine` times both in turn.
TILED_ATTENTION = _AVX512 and not _ZEN_AVX512
# The panels and the attention tiles are AVX-512 IR: they run on every AVX-512 CPU (PanelLinear, attend's and
# decoder_layer's `tiles`), and are the defaults where they were timed faster (PANELS, TILED_ATTENTION). A machine's
# first server start times each against the other form and runs the other where it is clearly faster, and later
# starts read that choice (server/matmul.py's panels_here(), server/attention.py's tiles_here(), kernels.py).
AVX512 = _AVX512
_SCORE_QUERIES = 6
_VALUE_ROWS = 6
_SCORE_KEYS = 16  # one head's 8 KB at D = 128, float32
_VALUE_KEYS = 32  # 8 KB of one head's PANEL columns
_CHUNK_TOKENS = 16  # a row's tokens attend in chunks of at most this many (attention.py's NUMBA_MAX_NEW)
_CHUNK_SCORES = 2048 * 1024  # and of at most this many scores (8 MB), down to one token
_SILU_CHUNK = 2048  # columns per parallel task
_LINE = 64  # bytes in a cache line
_STRIPES = 64  # runs of blocks the chunked passes share among the threads
# Float32 products on AVX-512 CPUs where they run faster (by default all but Zen 4) run panel_matmul over weights packed
# at load as panels of PANEL output columns (server/matmul.py's PanelLinear), at every M. Over all of the 1.5B's
# products in turn with `matmul` on the plain weights, on a 2-core Xeon: M = 1-5 0.95-0.98x the time, 8 0.86-0.96x,
# 12-16 0.83-0.90x, 24 0.71x, 40 0.72-0.75x; against oneDNN's GEMM at 120-512 rows 0.85-1.00x its time at K = 1536,
# 0.94-1.09x at K = 8960. Whole forwards 8 x 5 0.86x, 16 x 5 0.85x, 8 x 1 0.93x, 1 x 1 and 1 x 5 0.98x, a 155-token
# prefill 0.99x, 512 tokens 1.02x (docs/engine-cpu.md). float32's products on Zen 4 (untimed with panels, whose plain
# kernel was tuned there) and on AVX2 run `matmul` over the plain weights: the default a machine's first start keeps
# unless the plain weights run clearly faster (or, on Zen 4, the panels do).
PANELS = _AVX512 and not _ZEN_AVX512
# bfloat16's products run the panels too, by default, on AVX-512 CPUs without AMX but Zen 4: their tiles widen each
# weight to float32 (exactly: a shift and a mask) and sum with FMAs, where the plain kernel and oneDNN's GEMM use
# vdpbf16ps, which on a 2-core Xeon without AMX runs half the FMA's products a cycle (1.26 G instructions a second
# a core, of 32 products, against 5.2 G FMAs of 16). There, over [M, 1536] x [1536, 8960] in turn with the plain
# kernel: M = 1 0.88-0.90x the time, 2-5 0.89-0.99x, 8 0.83-0.89x, 16 0.67-0.75x, 40 0.57-0.67x (oneDNN's GEMM on
# the plain rows is no faster past 40); whole forwards of the 1.5B 1 x 1 1.00-1.01x, 8 x 1 0.90-0.92x, 8 x 5 0.64x,
# 16 x 5 0.67x, 7 x 5 + p120 0.69x (docs/engine-cpu.md). Not on Zen 4, whose vdpbf16ps runs at the FMA's rate and
# whose plain kernel was tuned there, nor with AMX, whose tiles take the plain rows' larger products in oneDNN's
# GEMM; the first start times the other form there too.
PANELS_BFLOAT16 = PANELS and not _AMX
PANEL = 4 * _LANES  # a panel's columns: four vectors
# bfloat16 panels store each 2 x lanes columns as pairs, column c and c + lanes of the group side by side, so that a
# step's loads widen to its vectors of columns in order. PANEL_BFLOAT16_ORDER[s]: the panel's column stored at s.
_GROUP_COLUMNS = 2 * _LANES  # a load's columns: a vector of pairs
PANEL_BFLOAT16_ORDER = np.array(
    [_GROUP_COLUMNS * (s // _GROUP_COLUMNS) + _LANES * (s % 2) + (s % _GROUP_COLUMNS) // 2 for s in range(PANEL)]
)
# What the panel tiles take, (x, panels): float32 weights; bfloat16 bits (int16) widened to float32; or bfloat16
# pairs along K (int32, x as pairs too) summed by vdpbf16ps, as oneDNN lays bfloat16 out on Zen 4 (PairPanelLinear).
_PANEL_TYPES = ((types.float32, types.float32), (types.float32, types.int16), (types.int32, types.int32))
_PANEL_ROWS = 6  # x rows a panel tile takes: 6 x 4 sums, four w vectors and an x value in 32 registers
_PANEL_CHUNK = 64  # values of K a tile walks between loading and storing its sums
_PANEL_BLOCK = 128  # x rows a walk over the weights takes
_PANEL_PACK_FROM = 3 * _PANEL_ROWS + 1  # x rows from which a block's rows are packed for its tiles (four tiles on)
_PANEL_X_BYTES = 1 << 20  # x values a walk over the weights takes at most: half of an AVX-512 Xeon's 2 MB L2


def warm_up(panels: bool = PANELS) -> None:
    """Compile the three kernels, or load them from numba's cache, and check a known answer from each, the
    layer over weights as panels or as plain rows. The layer calls the other two, so server/layer_kernel.py
    warms all three; the product and the attention warm only their own (warm_up_matmul, warm_up_attention).
    Each is float32's: bfloat16's products and attention compile only for a server that runs them (the
    *_bfloat16 warm-ups)."""
    warm_up_matmul()
    warm_up_attention()
    warm_up_layer(panels)


def warm_up_matmul() -> None:
    _check_products(_ONE)
    if PANELS:
        warm_up_panels()


def warm_up_matmul_bfloat16() -> None:
    """bfloat16's products (AVX512_BF16 only): compiling them took a first start on a 2-core Zen 4 EPYC from 7.8
    to 14.5 s, so only a bfloat16 server pays it."""
    if not DPBF16:
        raise RuntimeError("bfloat16 products need AVX512_BF16")
    _check_products(np.int16(0x3F80))  # 1.0 in bfloat16


def _check_products(one) -> None:
    """All-ones products of every pass the kernel has, in one's type: the plain loops, then prefetching passes of
    every size (AVX2: 1 and 2 alone, 2 + 2, 3 + 2, 3 + 2 + 2, 3 + 3 + 2, 3 + 3 + 3 + 2; AVX-512: 4 and 5 alone, the
    3 x 7 and 3 x 8 tiles, 6 + 5 (bfloat16: 4 + 4 + 3), 1 and 2 alone; on Zen 4 also 1 row by row, and 1 alone where
    x passes _ROW_BY_ROW_BYTES). 64 columns: two of bfloat16's steps."""
    shapes = ((3, 5), (1, 4 * _LANES), (2, 4 * _LANES), (4, 4 * _LANES), (5, 4 * _LANES), (7, 4 * _LANES))
    long_row = (1, _ROW_BY_ROW_BYTES // np.dtype(type(one)).itemsize + 4 * _LANES)
    for rows, columns in (*shapes, (8, 4 * _LANES), long_row, (11, 4 * _LANES)):
        x, w = np.full((rows, columns), one), np.full((6, columns), one)
        y = np.empty((rows, 6), np.float32)
        matmul(x, w, y)
        if not np.array_equal(y, np.full((rows, 6), columns, np.float32)):
            raise RuntimeError(f"the compiled product is wrong: {y}")


# ---------------------------------------------------------------------------------------------------------
# The matrix product


@njit(parallel=True, fastmath=True, cache=True)
def matmul(x, w, y):
    m_rows, k = x.shape
    n = w.shape[0]
    pairs = m_rows // 2
    width = _step_width(w)
    prefetching = m_rows >= _PREFETCH_FROM and k >= width and k % width == 0  # the tile divides by k / width
    # Prefetching passes take x rows up to _GROUP at a time, in groups as even as possible (AVX2: M = 8 is
    # 3 + 3 + 2, M = 4 is 2 + 2), so that each weight vector loaded meets as many x rows as the registers hold.
    passes = (m_rows + _GROUP - 1) // _GROUP
    if _ROW_BY_ROW and m_rows == 1 and k % width == 0 and k * x.itemsize <= _ROW_BY_ROW_BYTES:
        _row_by_row(x, w, y)
        return
    if _AVX512 and prefetching and 7 <= m_rows <= (_THREE_ROW_TO_BFLOAT16 if w.itemsize == 2 else _THREE_ROW_TO):
        _three_row_blocks(x, w, y)
        return
    if _AVX512 and prefetching and passes > 1:
        _chunked_passes(x, w, y)
        return
    size, larger = m_rows // passes, m_rows % passes  # the first `larger` groups take size + 1 rows
    full_blocks = n // 4
    per_line = _LINE // w.itemsize  # weights a cache line holds: 16 float32, 32 bfloat16
    # A pass's share of the next block's 4 k / per_line lines: a lone pass (M <= _GROUP) up to _LONE_LINES a
    # step (bfloat16 _LONE_LINES_BFLOAT16), each of several passes (AVX2 only, here) at most one.
    lone_lines = _LONE_LINES_BFLOAT16 if w.itemsize == 2 else _LONE_LINES
    share = min((4 * k // per_line) // passes, (lone_lines if passes == 1 else 1) * (k // width))
    for block in prange((n + 3) // 4):
        o = block * 4
        if o + 4 <= n:
            ahead = min(block + 1, full_blocks - 1) * 4 * k  # the last block prefetches itself, harmlessly
            if prefetching and passes == 1:
                _lone_pass(x, m_rows, w, o, y, ahead, share)
            elif prefetching:
                for group in range(passes):
                    first = group * size + min(group, larger)
                    at = ahead + group * share * per_line
                    _prefetching_pass(x, first, size + (group < larger), w, o, y, at, share)
            else:
                for pair in range(pairs):
                    dot_4x2(x, 2 * pair, 2 * pair + 1, w, o, 1, y, o)
                if m_rows % 2:
                    dot_4x1(x, m_rows - 1, w, o, 1, y, o)
        else:  # the last 1-3 weight rows
            _dot_rows(x, w, o, y)


@njit(parallel=True, fastmath=True, cache=True)
def _row_by_row(x, w, y):
    """matmul for M = 1 on Zen 4 (K a multiple of the step, x within _ROW_BY_ROW_BYTES): one weight row after
    another, so that each thread's share of w is one stream in memory order. The sums are the 4-row tiles' (one
    vector over K, then across its lanes), so the bits are the same."""
    for j in prange(w.shape[0]):
        _tile_1x1(x, 0, w, j, y, 0, 0)


@njit(parallel=True, fastmath=True, cache=True)
def _three_row_blocks(x, w, y):
    """matmul for M = 7 or 8 on AVX-512, and on Zen 4 up to _THREE_ROW_TO rows (bfloat16 _THREE_ROW_TO_BFLOAT16;
    K a multiple of the step): blocks of three weight rows, each in passes of the 3 x 4 .. 3 x 8 tiles over at most
    eight x rows, the groups as even as possible (M = 12: 6 + 6). The passes share the prefetch of the next block,
    each at most _THREE_ROW_LINES lines a step (one pass: all of it on Zen 4 and in bfloat16, two thirds
    elsewhere), and the later passes read the block from cache."""
    m_rows, k = x.shape
    n = w.shape[0]
    passes = (m_rows + 7) // 8
    size, larger = m_rows // passes, m_rows % passes  # the first `larger` groups take size + 1 rows
    full_blocks = n // 3
    row_lines = _THREE_ROW_LINES_BFLOAT16 if w.itemsize == 2 else _THREE_ROW_LINES
    block_lines = 3 * k // (_LINE // w.itemsize)
    share = min((block_lines + passes - 1) // passes, row_lines * (k // _step_width(w)))
    for block in prange((n + 2) // 3):
        o = block * 3
        if o + 3 <= n:
            ahead = min(block + 1, full_blocks - 1) * 3 * k  # the last block prefetches itself, harmlessly
            for group in range(passes):
                first = group * size + min(group, larger)
                lines = max(0, min(share, block_lines - group * share))
                _three_row_pass(
                    x, first, size + (group < larger), w, o, y, ahead + group * share * _LINE // w.itemsize, lines
                )
        else:  # the last 1-2 weight rows
            _dot_rows(x, w, o, y)


@njit(inline="always", fastmath=True)
def _three_row_pass(x, m0, columns, w, o, y, ahead, lines):
    """One pass of the 3 x `columns` tile (4 .. 8) for x rows from m0."""
    if columns == 8:
        _tile_3x8(x, m0, w, o, y, ahead, lines)
    elif columns == 7:
        _tile_3x7(x, m0, w, o, y, ahead, lines)
    elif columns == 6:
        _tile_3x6(x, m0, w, o, y, ahead, lines)
    elif columns == 5:
        _tile_3x5(x, m0, w, o, y, ahead, lines)
    else:
        _tile_3x4(x, m0, w, o, y, ahead, lines)


@njit(inline="always")
def _step_width(w):
    """Values of K a step of a tile takes: a vector of float32 sums, or twice as many for bfloat16 pairs."""
    return _LANES * 4 // w.itemsize


@njit(inline="always", fastmath=True)
def _dot_rows(x, w, first, y):
    """y[:, first:] = x . w[first:].T: the last few weight rows, past the whole blocks. Where K is a multiple of the
    step, each with the 1 x 1 tile, which sums as every tile does, so that no value of y depends on how many rows x
    has (the scalar loop, vectorized by LLVM in its own order, differed from the tiles at ragged N, and at M = 7-8
    in the last rows the three-row blocks leave); else one dot product at a time."""
    if x.shape[1] % _step_width(w) == 0:
        for j in range(first, w.shape[0]):
            for m in range(x.shape[0]):
                _tile_1x1(x, m, w, j, y, 0, 0)
        return
    for j in range(first, w.shape[0]):
        for m in range(x.shape[0]):
            acc = _ZERO
            for i in range(x.shape[1]):
                acc += _as_float(x[m, i]) * _as_float(w[j, i])
            y[m, j] = acc


@njit(parallel=True, fastmath=True, cache=True)
def _chunked_passes(x, w, y):
    """matmul for M > _GROUP on AVX-512 (K a multiple of 16): each block of four weight rows is walked a K chunk
    at a time, every pass over the chunk before the next chunk, its sums kept in a scratch between chunks. So the
    block streams in throughout, not only in the first of its passes, and the later passes read the chunk from L1
    (in turn with whole passes over every product of the 1.5B on a 2-core Xeon: M = 9-24 0.91-0.94x, M = 28
    0.95x, M = 40 0.96-0.97x). 256 floats a chunk up to four passes; 512 beyond, where the sums' loads and
    stores weigh more; on Zen 4 _LONG_CHUNKS from _LONG_CHUNKS_FROM float32 rows. _SPAN blocks side by side: each
    pass over a chunk goes on to the same chunk of the next block in the span, each block with its own sums."""
    m_rows, k = x.shape
    n = w.shape[0]
    # bfloat16's passes hold five x rows: vdpbf16ps takes its operands in registers, where an FMA reads its w vector
    # from memory, and six left M = 12 at 1.34x oneDNN's time against 1.08x with five (docs/engine-cpu.md).
    group_rows = _GROUP - (w.itemsize == 2)
    passes = (m_rows + group_rows - 1) // group_rows
    size, larger = m_rows // passes, m_rows % passes  # the first `larger` groups take size + 1 rows
    full_blocks = n // 4
    chunk = (256 if passes <= 4 else 512) * _step_width(w) // _LANES  # as many steps for bfloat16
    if _LONG_CHUNKS and m_rows >= _LONG_CHUNKS_FROM and w.itemsize == 4:
        chunk = _LONG_CHUNKS
    chunks = (k + chunk - 1) // chunk
    per_line = _LINE // w.itemsize
    block_lines = 4 * k // per_line
    # A call's share of the next block's lines, spread over the block's calls, at most _CHUNK_LINES a step.
    last_steps = (k - (chunks - 1) * chunk) // _step_width(w)
    share = min((block_lines + chunks * passes - 1) // (chunks * passes), _CHUNK_LINES * last_steps)
    repeated = passes <= _REPEATED_PASSES
    for stripe in prange(_STRIPES):  # runs of blocks, each with one scratch for its sums
        sums = _lined_rows(_SPAN * passes * 4 * _GROUP, _LANES)
        start, end = full_blocks * stripe // _STRIPES, full_blocks * (stripe + 1) // _STRIPES
        for span in range(start, end, _SPAN):  # _SPAN blocks, each pass over a chunk of each in turn
            for c in range(chunks):
                for group in range(passes):
                    first = group * size + min(group, larger)
                    call = min(c * passes + group, block_lines // share - 1)  # the last calls prefetch again
                    for block in range(span, min(span + _SPAN, end)):
                        # Each block's calls prefetch the block _SPAN on; the last blocks prefetch the last one.
                        ahead = min(block + _SPAN, full_blocks - 1) * 4 * k
                        _chunk_pass(
                            x,
                            first,
                            size + (group < larger),
                            w,
                            block * 4,
                            y,
                            (ahead + call * share * per_line, share, repeated),
                            (c * chunk, min((c + 1) * chunk, k)),
                            sums[((block - span) * passes + group) * 4 * _GROUP :],
                        )
    _dot_rows(x, w, full_blocks * 4, y)


@njit(inline="always", fastmath=True)
def _chunk_pass(x, m0, columns, w, o, y, prefetching, span, sums):
    """One pass of the chunked tile for `columns` (2 .. _GROUP) x rows from m0, over K span = (k0, k1):
    prefetching = (ahead, lines, repeated), (ahead, lines) as the tile takes them; `repeated`, the tile that
    issues each prefetch _PREFETCH_REPEATS times."""
    ahead, lines, repeated = prefetching
    k0, k1 = span
    first, last = k0 == 0, k1 == x.shape[1]
    if repeated:
        if columns == 2:
            _chunk_2r(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last)
        elif columns == 3:
            _chunk_3r(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last)
        elif columns == 4:
            _chunk_4r(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last)
        elif columns == 5:
            _chunk_5r(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last)
        else:
            _chunk_6r(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last)
    elif columns == 2:
        _chunk_2(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last)
    elif columns == 3:
        _chunk_3(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last)
    elif columns == 4:
        _chunk_4(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last)
    elif columns == 5:
        _chunk_5(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last)
    else:
        _chunk_6(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last)


def _prefetching_tile(columns, prefetches=(1, 1), w_rows=4, fenced=False, steps_ahead=0, in_memory=0, repeats=1):
    """An intrinsic tile(x, m0, w, o, y, ahead, lines): y[m0 .. m0 + columns - 1, o:o + w_rows] = those rows of x
    [M, K] . rows o..o + w_rows - 1 of w [N, K] (float32, C order, K a multiple of the lanes), a vector a step,
    while prefetching `lines` (<= prefetches * K / lanes) 64-byte lines from w.ravel()[ahead:], evenly spread over
    the steps, `prefetches` instructions a step (none at 0; a pair: float32's, then bfloat16's); `fenced`, each
    step ending in _step_fence. With `steps_ahead`, a step instead prefetches each w row's line that many steps on,
    and past a row's end the same line of the same row in the block at `ahead` (`prefetches` and `lines` unused).
    With `in_memory` (fenced only), the last that many sums go through memory every step (_SUMS_IN_MEMORY). Each
    prefetch is issued `repeats` times in a row (_PREFETCH_REPEATS). dot_4x2's loop for `columns` x rows, written
    in IR so that the prefetch does not stop it vectorizing."""
    assert fenced or not in_memory, "only the fence keeps LLVM from taking the sums back into registers"

    @intrinsic
    def tile(typingctx, x, m0, w, o, y, ahead, lines):
        if any(array.layout != "C" for array in (x, w, y)) or not _tile_types(x, w):
            return None  # the IR steps through rows by their length: a strided array fails to type, loudly

        def codegen(context, builder, signature, args):
            shape = (columns, prefetches[signature.args[2].dtype == types.int16], w_rows)
            _tile_ir(context, builder, signature, args, shape, False, fenced, steps_ahead, in_memory, repeats)
            return context.get_dummy_value()

        return types.none(x, m0, w, o, y, ahead, lines), codegen

    return tile


def _chunk_tile(columns, repeats=1):
    """An intrinsic tile(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last): _prefetching_tile's 4 x columns
    tile over steps k0 / lanes .. k1 / lanes only (`lines` <= their number), its sums starting at zero (first) or
    from the rows of `sums` [>= 4 columns, lanes], and ending in y (last) or back in `sums`; each prefetch issued
    `repeats` times."""

    @intrinsic
    def tile(typingctx, x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last):
        if any(array.layout != "C" for array in (x, w, y, sums)) or not _tile_types(x, w):
            return None

        def codegen(context, builder, signature, args):
            _tile_ir(context, builder, signature, args, (columns, _CHUNK_LINES, 4), chunked=True, repeats=repeats)
            return context.get_dummy_value()

        return types.none(x, m0, w, o, y, ahead, lines, k0, k1, sums, first, last), codegen

    return tile


def _tile_types(x, w) -> bool:
    """Whether a tile takes these x and w: both float32, or both bfloat16 bits where the CPU has vdpbf16ps."""
    return x.dtype == w.dtype and (w.dtype == types.float32 or (w.dtype == types.int16 and DPBF16))


def _tile_ir(context, builder, signature, args, shape, chunked, fenced=False, steps_ahead=0, in_memory=0, repeats=1):
    """The IR of a tile (_prefetching_tile's, or with `chunked` _chunk_tile's) at the builder; shape = (columns,
    prefetches, w_rows), and `fenced`, `steps_ahead`, `in_memory` and `repeats`, as _prefetching_tile takes them."""
    columns, prefetches, w_rows = shape
    xs, ws, ys = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4))
    m0, o, ahead, lines = args[1], args[3], args[5], args[6]
    k, n = builder.extract_value(xs.shape, 1), builder.extract_value(ys.shape, 1)
    rows = [builder.add(m0, _I64(c)) for c in range(columns)]
    x_rows = [builder.gep(xs.data, [builder.mul(m, k)]) for m in rows]
    w_ptrs = [builder.gep(ws.data, [builder.mul(builder.add(o, _I64(j)), k)]) for j in range(w_rows)]
    prefetched = builder.gep(ws.data, [ahead])
    bfloat16 = signature.args[2].dtype == types.int16  # x and w hold bfloat16 bits: a step takes 32 values of K
    step_bits, line_bits = (_I64(_LANE_BITS + 1), _I64(5)) if bfloat16 else (_I64(_LANE_BITS), _I64(4))
    count = w_rows * columns
    zero = ir.Constant(_V, [0.0] * _LANES)
    if chunked:
        first_step, end_step = (builder.lshr(args[i], step_bits) for i in (7, 8))
    else:
        first_step, end_step = _I64(0), builder.lshr(k, step_bits)
    if prefetches and not steps_ahead:  # (none: the tile reads a lone row, and the hardware prefetches it)
        slots = builder.mul(builder.sub(end_step, first_step), _I64(prefetches))
        per_slot = builder.sdiv(builder.shl(lines, _I64(16)), slots)  # lines a prefetch, in 1/65536ths
    fma = _dpbf16(builder) if bfloat16 else _fmuladd(builder)
    prefetch = _llvm_prefetch(builder)
    head, body, done = (builder.append_basic_block(name) for name in ("head", "body", "done"))
    if chunked:  # the sums start at zero (first) or where the last chunk left them
        scratch = context.make_array(signature.args[9])(context, builder, args[9]).data
        kept = [builder.bitcast(builder.gep(scratch, [_I64(i * _LANES)]), _V.as_pointer()) for i in range(count)]
        load_block, zero_block = builder.append_basic_block("load"), builder.append_basic_block("zero")
        builder.cbranch(_is_true(builder, args[10]), zero_block, load_block)
        builder.position_at_end(load_block)
        starts = [(zero_block, [zero] * count), (load_block, [builder.load(p, align=4) for p in kept])]
        builder.branch(head)
        builder.position_at_end(zero_block)
    else:
        starts = [(builder.block, [zero] * count)]
    held = {}  # index -> the stack slot of a sum kept in memory
    for index in range(count - in_memory, count):
        with builder.goto_entry_block():
            held[index] = builder.alloca(_V)
        held[index].align = _LINE  # as its loads and stores say, not only by the data layout's default
        builder.store(zero, held[index], align=_LINE)
    builder.branch(head)
    builder.position_at_end(head)
    step = builder.phi(_I64)
    sums = [builder.phi(_V) for _ in range(count)]  # w row o against x rows m0.., then o + 1, ...
    builder.cbranch(builder.icmp_signed("<", step, end_step), body, done)

    builder.position_at_end(body)
    first = builder.shl(step, step_bits)
    vector, alignment = (_PAIRS, 2) if bfloat16 else (_V, 4)

    def load(row):
        return builder.load(builder.bitcast(builder.gep(row, [first]), vector.as_pointer()), align=alignment)

    if w_rows == 4:
        # Weight row by weight row: each w vector meets every x vector while those stay in registers
        # (AVX2's 4 x 3 tile: twelve sums, three x vectors and one w, all sixteen registers).
        u = [load(row) for row in x_rows]
        p = [load(row) for row in w_ptrs]
        new = [builder.call(fma, [u[i % columns], p[i // columns], total]) for i, total in enumerate(sums)]
    else:
        # x row by x row: the w vectors stay in registers (3 x 8: 24 sums, three w vectors and one x).
        p = [load(row) for row in w_ptrs]
        new = list(sums)
        for c, row in enumerate(x_rows):
            u = load(row)
            for j in range(w_rows):
                index = j * columns + c
                if index in held:  # its phi stays at zero
                    total = builder.call(fma, [u, p[j], builder.load(held[index], align=_LINE)])
                    builder.store(total, held[index], align=_LINE)
                else:
                    new[index] = builder.call(fma, [u, p[j], sums[index]])
    if fenced:
        _step_fence(builder, list(held.values()))
    if steps_ahead:
        steps = (step, end_step, step_bits)
        _prefetch_rows_ahead(builder, (prefetch, repeats), steps, w_ptrs, (prefetched, k, steps_ahead))
    for i in range(0 if steps_ahead else prefetches):
        slot = builder.add(builder.mul(builder.sub(step, first_step), _I64(prefetches)), _I64(i))
        line = builder.ashr(builder.mul(slot, per_slot), _I64(16))
        address = builder.bitcast(builder.gep(prefetched, [builder.shl(line, line_bits)]), _I8P)
        for _ in range(repeats):
            builder.call(prefetch, [address, _I32(0), _I32(_TO_L2), _I32(1)])
    next_step = builder.add(step, _I64(1))
    back = builder.branch(head)
    if chunked:
        back.set_metadata("llvm.loop", _no_unrolling(builder.module))
    for block, values in starts:
        step.add_incoming(first_step, block)
        for total, value in zip(sums, values):
            total.add_incoming(value, block)
    step.add_incoming(next_step, body)
    for total, updated in zip(sums, new):
        total.add_incoming(updated, body)

    builder.position_at_end(done)
    if chunked:
        store_block, sum_block, end = (builder.append_basic_block(name) for name in ("store", "sum", "end"))
        builder.cbranch(_is_true(builder, args[11]), sum_block, store_block)
        builder.position_at_end(store_block)
        for total, pointer in zip(sums, kept):
            builder.store(total, pointer, align=4)
        builder.branch(end)
        builder.position_at_end(sum_block)
    totals = [builder.load(held[index], align=_LINE) if index in held else total for index, total in enumerate(sums)]
    for index, value in enumerate(_horizontal_sums(builder, totals)):
        m, j = rows[index % columns], index // columns
        out = builder.gep(ys.data, [builder.add(builder.mul(m, n), builder.add(o, _I64(j)))])
        builder.store(value, out)
    if chunked:
        builder.branch(end)
        builder.position_at_end(end)


def _prefetch_rows_ahead(builder, prefetching, steps, w_ptrs, ahead):
    """Prefetch each w row's line `distance` steps on from this one, prefetching = (llvm.prefetch, as _tile_ir holds
    it, and the times each is issued), steps = (step, end_step, step_bits) and ahead = (prefetched, k, distance);
    past the row's end, the same line of the same row of the block at `prefetched`, k values a row."""
    prefetch, repeats = prefetching
    step, end_step, step_bits = steps
    prefetched, k, distance = ahead
    target = builder.add(step, _I64(distance))
    past = builder.icmp_signed(">=", target, end_step)
    beyond = builder.shl(builder.sub(target, end_step), step_bits)
    last = builder.sub(k, _I64(1))  # rows shorter than `distance` steps: the row's last value, within the block
    beyond = builder.select(builder.icmp_signed("<", beyond, k), beyond, last)
    for j, row in enumerate(w_ptrs):
        here = builder.gep(row, [builder.shl(target, step_bits)])
        there = builder.gep(prefetched, [builder.add(builder.mul(_I64(j), k), beyond)])
        address = builder.bitcast(builder.select(past, there, here), _I8P)
        for _ in range(repeats):
            builder.call(prefetch, [address, _I32(0), _I32(_TO_L2), _I32(1)])


def _step_fence(builder, slots=()):
    """An empty instruction that no load crosses, at the end of the 3 x 8 tile's step. Without it LLVM unrolled the
    loop by two and loaded the next step's x vectors early: with 24 sums and three w vectors held, they outgrew the
    32 registers, and it spilled sums and x vectors to the stack every step. With it the loop is neither unrolled
    nor spilled. On a 2-core Zen 4 EPYC, in turn over 24 [35838, 1536] weights at 30-35 GB/s, M = 8 took 1.4-2.3x
    a read of them, and a C twin of the tile that GCC keeps in registers (scripts/tile_twin.c) 1.1-1.4x; with the
    fence 0.95-1.15x, as the twin, and 0.92-0.99x the time of the loop with unrolling merely disabled. The 3 x 7
    tile, unrolled, spills less and ran 1.01-1.13x slower fenced, so it keeps its loop (docs/engine-cpu.md). With
    `slots` (pointers), the fence may read and write them, so the values stored there stay in memory."""
    kinds = [slot.type for slot in slots]
    builder.asm(ir.FunctionType(ir.VoidType(), kinds), "", "r," * len(slots) + "~{memory}", slots, side_effect=True)


def _no_unrolling(module):
    """Loop metadata that keeps LLVM from unrolling a loop: the chunked tiles'. They kept their sums in registers
    unrolled too, yet without unrolling M = 12-16 took 0.92-0.97x the time at K = 1536 and 0.93-1.01x at K = 8960
    (2-core Zen 4 EPYC, in turn, two runs each). A loop's metadata names itself first, and is its own: each loop
    gets a new node."""
    unroll = module.add_metadata(["llvm.loop.unroll.disable"])
    loop = module.add_metadata([unroll, f"specedge tile loop {len(module.metadata)}"])  # a new key: a new node
    loop.operands = (loop, unroll)
    return loop


@intrinsic
def _as_float(typingctx, value):
    """A value as float32: a float32 itself, an int16 as the bfloat16 whose bits it holds (exactly)."""
    if value == types.float32:
        return types.float32(value), lambda context, builder, signature, args: args[0]
    if value != types.int16:
        return None

    def codegen(context, builder, signature, args):
        return _from_bfloat16(builder, args[0])

    return types.float32(value), codegen


def _from_bfloat16(builder, bits):
    """bfloat16 bits (an int16, or a vector of them) as the float32s they are: each the high half of its 32 bits."""
    if isinstance(bits.type, ir.VectorType):
        count = bits.type.count
        wide, floats, sixteen = (
            ir.VectorType(_I32, count),
            ir.VectorType(_F32, count),
            ir.Constant(ir.VectorType(_I32, count), [16] * count),
        )
    else:
        wide, floats, sixteen = _I32, _F32, _I32(16)
    return builder.bitcast(builder.shl(builder.zext(bits, wide), sixteen), floats)


def _widened_pairs(builder, pairs):
    """A vector of bfloat16 pairs (<lanes x i32>) as two float32 vectors, exactly: each lane's low half, then each
    lane's high half (a shift and a mask, two instructions that share the FMA's ports but not its latency)."""
    low = builder.shl(pairs, ir.Constant(_PAIRS, [16] * _LANES))
    high = builder.and_(pairs, ir.Constant(_PAIRS, [-65536] * _LANES))  # 0xFFFF0000
    return [builder.bitcast(low, _V), builder.bitcast(high, _V)]


def _is_true(builder, flag):
    """A numba boolean argument as an LLVM i1."""
    return flag if flag.type == ir.IntType(1) else builder.icmp_unsigned("!=", flag, ir.Constant(flag.type, 0))


_tile_2, _tile_3, _tile_4, _tile_5, _tile_6 = (_prefetching_tile(columns) for columns in range(2, 7))
_lone_1, _lone_2, _lone_3, _lone_4, _lone_5, _lone_6 = (
    _prefetching_tile(
        c,
        (_LONE_LINES, _LONE_LINES_BFLOAT16),
        steps_ahead=_LONE_AHEAD if c >= _LONE_AHEAD_FROM else 0,
        repeats=_PREFETCH_REPEATS,
    )
    for c in range(1, 7)
)
_tile_1x1 = _prefetching_tile(1, (0, 0), 1)  # _row_by_row's: one w row, one x row, no prefetch
_tile_3x4, _tile_3x5, _tile_3x6, _tile_3x7 = (
    _prefetching_tile(c, (_THREE_ROW_LINES, _THREE_ROW_LINES_BFLOAT16), 3, repeats=_PREFETCH_REPEATS)
    for c in range(4, 8)
)
_tile_3x8 = _prefetching_tile(
    8,
    (_THREE_ROW_LINES, _THREE_ROW_LINES_BFLOAT16),
    3,
    fenced=True,
    in_memory=_SUMS_IN_MEMORY,
    repeats=_PREFETCH_REPEATS,  # _step_fence
)
_chunk_2, _chunk_3, _chunk_4, _chunk_5, _chunk_6 = (_chunk_tile(columns) for columns in range(2, 7))
_chunk_2r, _chunk_3r, _chunk_4r, _chunk_5r, _chunk_6r = (_chunk_tile(c, _PREFETCH_REPEATS) for c in range(2, 7))


@njit(inline="always", fastmath=True)
def _prefetching_pass(x, m0, columns, w, o, y, ahead, lines):
    """One pass of the tile for `columns` (2 .. _GROUP) x rows from m0."""
    if columns == 2:
        _tile_2(x, m0, w, o, y, ahead, lines)
    elif columns == 3:
        _tile_3(x, m0, w, o, y, ahead, lines)
    elif columns == 4:
        _tile_4(x, m0, w, o, y, ahead, lines)
    elif columns == 5:
        _tile_5(x, m0, w, o, y, ahead, lines)
    else:
        _tile_6(x, m0, w, o, y, ahead, lines)


@njit(inline="always", fastmath=True)
def _lone_pass(x, columns, w, o, y, ahead, lines):
    """The one pass of a block for all `columns` (_PREFETCH_FROM .. _GROUP) x rows, _LONE_LINES prefetches a step
    (bfloat16 _LONE_LINES_BFLOAT16)."""
    if columns == 1:
        _lone_1(x, 0, w, o, y, ahead, lines)
    elif columns == 2:
        _lone_2(x, 0, w, o, y, ahead, lines)
    elif columns == 3:
        _lone_3(x, 0, w, o, y, ahead, lines)
    elif columns == 4:
        _lone_4(x, 0, w, o, y, ahead, lines)
    elif columns == 5:
        _lone_5(x, 0, w, o, y, ahead, lines)
    else:
        _lone_6(x, 0, w, o, y, ahead, lines)


def _fmuladd(builder):
    """sum + x * w, lane by lane (float32): LLVM's fmuladd, declared once in the builder's module."""
    signature = ir.FunctionType(_V, [_V] * 3)
    return cgutils.get_or_insert_function(builder.module, signature, f"llvm.fmuladd.v{_LANES}f32")


def _dpbf16(builder):
    """A function(x pairs, w pairs, sum) -> sum + x[2i] w[2i] + x[2i + 1] w[2i + 1] in lane i: AVX512_BF16's
    vdpbf16ps, as inline assembly, which reads the same on every LLVM (its intrinsic's argument types have
    changed between versions)."""
    signature = ir.FunctionType(_V, [_PAIRS, _PAIRS, _V])
    return ir.InlineAsm(signature, "vdpbf16ps $2, $1, $0", "=v,v,v,0")


def _llvm_prefetch(builder):
    """LLVM's prefetch(address, rw, locality, cache type), declared once in the builder's module."""
    signature = ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32])
    return cgutils.get_or_insert_function(builder.module, signature, "llvm.prefetch.p0")


def _broadcast(builder, value, pairs=False):
    """A float32 in every lane of a vector (or, with `pairs`, an int32 pair of bfloat16s)."""
    vector = _PAIRS if pairs else _V
    undefined, lanes = ir.Constant(vector, ir.Undefined), ir.Constant(ir.VectorType(_I32, _LANES), [0] * _LANES)
    return builder.shuffle_vector(builder.insert_element(undefined, value, _I32(0)), undefined, lanes)


def _clamped(builder, index, last):
    """min(index, last), int64."""
    return builder.select(builder.icmp_signed("<", index, last), index, last)


def _horizontal_sums(builder, vectors):
    """Each vector's lanes' sum: halves added, then quarters, and so on to the last two, as the tiles have always
    summed (so the same bits), a vector's worth of vectors at a time (sixteen with AVX-512, eight with AVX2). At each
    level one shuffle takes the low halves of two vectors' sources side by side, another their high halves, and one
    add serves every source of both, so that the group's sums end in the lanes of one vector: about three
    instructions a sum where each vector alone took nine.
    Over all of the 1.5B's products in turn on a 2-core Xeon: M = 24-56 0.95-0.98x the time, M = 1-16 (memory
    bound) 0.99-1.01x, bfloat16 0.99x; whole forwards within that hour's noise (8 x 5 0.99-1.00x, 4 x 5 0.98x, an
    identical copy 0.97-1.01x). A short group is padded with copies of its last vector."""
    totals = []
    for first in range(0, len(vectors), _LANES):
        group = list(vectors[first : first + _LANES])
        count, size = len(group), 1
        while size < count:
            size *= 2
        parts = group + [group[-1]] * (size - count)
        per, width = 1, _LANES // 2  # sources a vector holds, and half the lanes each holds
        while width:
            if len(parts) == 1:
                parts = parts * 2  # past the group's own vectors: a vector paired with itself
            low, high = [], []
            for side in (0, 1):
                for source in range(per):
                    start = side * _LANES + source * 2 * width
                    low += range(start, start + width)
                    high += range(start + width, start + 2 * width)
            mask_low, mask_high = (ir.Constant(ir.VectorType(_I32, _LANES), lanes) for lanes in (low, high))
            parts = [
                builder.fadd(builder.shuffle_vector(a, b, mask_low), builder.shuffle_vector(a, b, mask_high))
                for a, b in zip(parts[0::2], parts[1::2])
            ]
            per, width = per * 2, width // 2
        totals += [builder.extract_element(parts[0], _I32(source)) for source in range(count)]
    return totals


@njit(inline="always", fastmath=True)
def dot_4x2(x, m0, m1, w, o, step, out, column):
    """Rows m0 and m1 of x [M, K] against rows o, o + step, o + 2 step, o + 3 step of w [N, K], into
    out[m0 and m1, column:column + 4]: eight dot products, kept in registers (numba keeps scalars there,
    not arrays), each w row read once for both."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _ZERO
    for i in range(x.shape[1]):
        u, v = _as_float(x[m0, i]), _as_float(x[m1, i])
        p0, p1 = _as_float(w[o, i]), _as_float(w[o + step, i])
        p2, p3 = _as_float(w[o + 2 * step, i]), _as_float(w[o + 3 * step, i])
        a0 += u * p0
        a1 += u * p1
        a2 += u * p2
        a3 += u * p3
        b0 += v * p0
        b1 += v * p1
        b2 += v * p2
        b3 += v * p3
    out[m0, column], out[m0, column + 1], out[m0, column + 2], out[m0, column + 3] = a0, a1, a2, a3
    out[m1, column], out[m1, column + 1], out[m1, column + 2], out[m1, column + 3] = b0, b1, b2, b3


@njit(inline="always", fastmath=True)
def dot_4x1(x, m, w, o, step, out, column):
    """Row m of x against four rows of w, into out[m, column:column + 4], as dot_4x2."""
    a0 = a1 = a2 = a3 = _ZERO
    for i in range(x.shape[1]):
        u = _as_float(x[m, i])
        a0 += u * _as_float(w[o, i])
        a1 += u * _as_float(w[o + step, i])
        a2 += u * _as_float(w[o + 2 * step, i])
        a3 += u * _as_float(w[o + 3 * step, i])
    out[m, column], out[m, column + 1], out[m, column + 2], out[m, column + 3] = a0, a1, a2, a3


# ---------------------------------------------------------------------------------------------------------
# Attention


# ---------------------------------------------------------------------------------------------------------
# The panel product (float32 and bfloat16 on AVX-512 CPUs where it runs faster: server/matmul.py's panels_here())


def warm_up_panels() -> None:
    _check_panels(bfloat16=False)


def warm_up_panels_bfloat16() -> None:
    """bfloat16's panel product (any AVX-512 CPU: it widens the weights to float32), for a bfloat16 server only."""
    _check_panels(bfloat16=True)


def warm_up_pairs() -> None:
    """The panel product over bfloat16 pairs (vdpbf16ps), for a `--matmul onednn-numba` server only."""
    if not DPBF16:
        raise RuntimeError("bfloat16 pairs need AVX512_BF16")
    _check_panels(bfloat16=True, pairs=True)


def _check_panels(bfloat16: bool, pairs: bool = False) -> None:
    """The panel product's known answers: x all ones against weights of column + 1 (so a column out of place shows),
    products of 1-13 and 19 rows (one to four tiles: prefetching four, two and one lines a step; x packed from 19),
    over a partial last panel and K past a chunk, one of _PANEL_BLOCK + 1 rows (two blocks), and one of
    _PANEL_BLOCK rows whose K takes two parts. Every sum is an integer below 2**24: exact in either dtype. With
    `pairs`, the weights and x are bfloat16 pairs along K (int32), each pair's two weights the same."""
    short_k, long_k = _PANEL_CHUNK + 3, _PANEL_X_BYTES // (4 * _PANEL_BLOCK) + 3
    cases = (*((rows, short_k) for rows in (*range(1, 14), 19, _PANEL_BLOCK + 1)), (_PANEL_BLOCK, long_k))
    n = PANEL + 5
    columns = np.arange(2 * PANEL, dtype=np.float32) + _ONE
    columns[n:] = _ZERO  # the last panel's missing columns
    stored: np.ndarray = columns.reshape(2, PANEL)
    one: np.ndarray = np.ones(1, np.float32)
    if pairs:  # a bfloat16's bits in each half of an int32
        stored = (stored.view(np.int32) >> 16) * 0x10001
        one = (one.view(np.int32) >> 16) * 0x10001
    elif bfloat16:
        stored = (stored[:, PANEL_BFLOAT16_ORDER].view(np.int32) >> 16).astype(np.int16)
    for rows, k in cases:
        panels = np.ascontiguousarray(np.broadcast_to(stored[:, None, :], (2, k, PANEL)))
        y = np.empty((rows, n), np.float32)
        panel_matmul(np.full((rows, k), one[0]), panels, y)
        if not np.array_equal(y, np.broadcast_to(columns[:n] * np.float32(k * (2 if pairs else 1)), (rows, n))):
            kind = "bfloat16 pairs " if pairs else "bfloat16 " if bfloat16 else ""
            raise RuntimeError(f"the compiled {kind}panel product is wrong: {y}")


@njit(parallel=True, fastmath=True, cache=True)
def panel_matmul(x, panels, y):
    """y = x @ w.T for float32 x [M, K] and w [N, K] packed as panels [ceil(N / PANEL), K, PANEL] (server/matmul.py's
    PanelLinear; float32, or bfloat16's int16 bits in PANEL_BFLOAT16_ORDER, widened as they load), or for bfloat16
    x and w both as int32 pairs along K, x [M, K / 2] and panels [ceil(N / PANEL), K / 2, PANEL] (PairPanelLinear,
    oneDNN's own layout; each pair of products summed by vdpbf16ps, a K value here a pair): y [M, N]. Each
    thread takes runs of whole panels and walks a chunk of K at a time (_PANEL_CHUNK float32 values, as many bytes
    of bfloat16); every tile of up to _PANEL_ROWS x rows reads the chunk, from memory the first and from L1 the
    rest, and the tiles share the prefetch of the next chunk. Every value of y is one sum over K in order, whatever
    M: x rows come in blocks of up to _PANEL_BLOCK, each block a walk over the weights (in parts of K where its x
    rows would outgrow _PANEL_X_BYTES)."""
    m_rows, k = x.shape
    count = panels.shape[0]
    # The last panel's sums where it runs past y's last column (N not a multiple of PANEL), kept between K parts.
    scratch = np.empty((m_rows if y.shape[1] % PANEL else 0, PANEL), np.float32)
    blocks = (m_rows + _PANEL_BLOCK - 1) // _PANEL_BLOCK
    for block in range(blocks):  # as even as the rows allow: 155 rows are 78 + 77, not 128 + 27
        first = m_rows * block // blocks
        rows = m_rows * (block + 1) // blocks - first
        # K in parts whose x rows fit _PANEL_X_BYTES, so that every panel reads them from L2 (one part up to K = 2048
        # at 128 rows), each part a multiple of the chunk.
        parts = (rows * k * 4 + _PANEL_X_BYTES - 1) // _PANEL_X_BYTES
        part = ((k + parts - 1) // parts + _PANEL_CHUNK - 1) // _PANEL_CHUNK * _PANEL_CHUNK
        pack = rows >= _PANEL_PACK_FROM
        packed = np.empty((1, rows * part if pack else 0), x.dtype)
        for k0 in range(0, k, part):
            k1 = min(k0 + part, k)
            if pack:
                _pack_rows(x, first, rows, k0, k1, packed)
            for stripe in prange(_STRIPES):  # runs of panels, each thread's a few of them in a row
                run = (count * stripe // _STRIPES, count * (stripe + 1) // _STRIPES)
                _panel_run((x, packed, pack), (first, rows), (k0, k1), panels, (y, scratch), run)


@njit(inline="always")
def _tile_rows(rows, tiles, tile):
    """The first of a block's `rows` x rows that tile `tile` of `tiles` takes (from the block's first) and how many:
    as even as the rows allow, the first rows % tiles tiles one more."""
    size, larger = rows // tiles, rows % tiles
    return tile * size + min(tile, larger), size + (1 if tile < larger else 0)


@njit(parallel=True, fastmath=True, cache=True)
def _pack_rows(x, m0, rows, k0, k1, packed):
    """x rows m0 .. m0 + rows - 1, values k0 .. k1 - 1, into `packed` tile by tile as _panel_run's tiles take them:
    a tile of r rows as [k1 - k0, r], so that each step's r values are side by side."""
    tiles = (rows + _PANEL_ROWS - 1) // _PANEL_ROWS
    width = k1 - k0
    for task in prange(tiles):
        # prange's index may be unsigned, and unsigned plus signed is a float in numba.
        top, count = _tile_rows(rows, tiles, np.int64(task))
        for i in range(width):
            for r in range(count):
                packed[0, top * width + i * count + r] = x[m0 + top + r, k0 + i]


@njit(inline="always", fastmath=True)
def _panel_run(xs, block, span, panels, outs, run):
    """x rows block = (m0, rows) over K span = (k0, k1) against panels run = (p0, p1), into outs = (y, scratch); xs =
    (x, packed, is_packed), the tiles reading `packed` (_pack_rows's layout) where is_packed, else x. A panel past
    y's last column (N not a multiple of PANEL) sums in the scratch, and once K is done its columns within y are
    copied."""
    x, packed, is_packed = xs
    y, scratch = outs
    k, n = x.shape[1], y.shape[1]
    m0, rows = block
    first, last = span
    p0, p1 = run
    tiles = (rows + _PANEL_ROWS - 1) // _PANEL_ROWS
    per_line = _LINE // panels.itemsize
    chunk = _PANEL_CHUNK * 4 // panels.itemsize  # the same bytes a chunk: its prefetches reach as far ahead
    end_line = p1 * k * PANEL // per_line  # the run's last line, + 1: no tile prefetches past it
    # A step's prefetches (share <= lines * steps): half as many for bfloat16, whose step reads half the lines
    # (with float32's counts its lone tile took 1.10-1.22x the plain kernel's time at M = 1, then 0.88-0.90x).
    lines = max((4 if tiles == 1 else 2 if tiles <= 3 else 1) * panels.itemsize // 4, 1)
    for p in range(p0, p1):
        inside = (p + 1) * PANEL <= n
        out, column = (y, p * PANEL) if inside else (scratch, 0)
        for k0 in range(first, last, chunk):
            k1 = min(k0 + chunk, last)
            steps = k1 - k0
            # The next chunk's first line: on in this panel, else the next panel's part (panels follow each other).
            ahead = (p * k + k1 if k1 < last else (p + 1) * k + first) * PANEL // per_line
            share = (steps * PANEL // per_line + tiles - 1) // tiles  # each tile's part of the next chunk's lines
            for tile in range(tiles):
                start = min(ahead + tile * share, end_line - 1)
                stop = max(min(ahead + (tile + 1) * share, end_line), start + 1)
                top, count = _tile_rows(rows, tiles, tile)
                pf = (start, stop, lines)
                # Two calls, not one on a chosen array: choosing took M = 40-155 1.03-1.05x the time.
                if is_packed:  # value (r, step) at top * width + (step - first) * count + r
                    x_at = (top * (last - first) - first * count, 1, count)
                    _panel_tile(packed, x_at, m0 + top, count, panels, p, (k0, k1), out, column, pf)
                else:
                    _panel_tile(x, ((m0 + top) * k, k, 1), m0 + top, count, panels, p, (k0, k1), out, column, pf)
        if not inside and last == k:
            for m in range(m0, m0 + rows):
                for j in range(n - p * PANEL):
                    y[m, p * PANEL + j] = scratch[m, j]


def _panel_tile_rows(rows, lines):
    """An intrinsic tile(x, m0, panels, p, k0, k1, y, column, start, stop): y[m0 .. m0 + rows - 1,
    column:column + PANEL] = x[m0 .., k0:k1] against panel p's K rows k0 .. k1 - 1, plus what y holds there
    unless k0 is 0. A step takes one value of K: the panel's PANEL weights as PANEL / lanes vectors, and each x
    row's value broadcast to a vector, into rows x PANEL / lanes sums (6 x 4 in 30 of AVX-512's 32 registers).
    Each step also prefetches `lines` (1, 2 or 4) lines from line `start` of panels.ravel() on, up to line
    `stop` (a count fixed as the tile compiles: counted at run time, the branches took M = 40 from 0.73x the
    plain tiles' time to 0.87x); a lone tile of pairs (int32 panels, `lines` 4) prefetches none."""

    @intrinsic
    def tile(typingctx, x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step):
        if x.layout != "C" or y.layout != "C" or y.dtype != types.float32 or panels.ndim != 3:
            return None
        if panels.layout != "C" or (x.dtype, panels.dtype) not in _PANEL_TYPES:
            return None

        def codegen(context, builder, signature, args):
            _panel_tile_ir(context, builder, signature, args, (rows, lines))
            return context.get_dummy_value()

        return types.none(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step), codegen

    return tile


def _panel_tile_ir(context, builder, signature, args, shape):
    """The IR of a panel tile at the builder; shape = (rows, lines), as _panel_tile_rows takes them."""
    rows, lines = shape
    xs, ps, ys = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 6))
    m0, p, k0, k1, column, start, stop, x_first, x_row, x_step = (args[i] for i in (1, 3, 4, 5, 7, 8, 9, 10, 11, 12))
    k, n = builder.extract_value(ps.shape, 1), builder.extract_value(ys.shape, 1)
    vectors = PANEL // _LANES
    bfloat16 = signature.args[2].dtype == types.int16  # panels of bfloat16 bits in PANEL_BFLOAT16_ORDER
    in_pairs = signature.args[2].dtype == types.int32  # panels of bfloat16 pairs along K, and x as pairs too
    fma, prefetch = (_dpbf16 if in_pairs else _fmuladd)(builder), _llvm_prefetch(builder)
    x_rows = [builder.gep(xs.data, [builder.add(x_first, builder.mul(x_row, _I64(r)))]) for r in range(rows)]
    panel = builder.gep(ps.data, [builder.mul(p, builder.mul(k, _I64(PANEL)))])
    outs = []
    for r in range(rows):
        row = builder.gep(ys.data, [builder.add(builder.mul(builder.add(m0, _I64(r)), n), column)])
        outs += [builder.bitcast(builder.gep(row, [_I64(j * _LANES)]), _V.as_pointer()) for j in range(vectors)]
    zero = ir.Constant(_V, [0.0] * _LANES)
    load_block, zero_block, head, body, done = (
        builder.append_basic_block(name) for name in ("load", "zero", "head", "body", "done")
    )
    builder.cbranch(builder.icmp_signed("==", k0, _I64(0)), zero_block, load_block)
    builder.position_at_end(load_block)
    kept = [builder.load(pointer, align=4) for pointer in outs]
    builder.branch(head)
    builder.position_at_end(zero_block)
    builder.branch(head)

    builder.position_at_end(head)
    step = builder.phi(_I64)
    sums = [builder.phi(_V) for _ in outs]  # x row 0's PANEL sums, then row 1's, ...
    builder.cbranch(builder.icmp_signed("<", step, k1), body, done)
    builder.position_at_end(body)
    weights = builder.gep(panel, [builder.mul(step, _I64(PANEL))])
    if bfloat16:  # each 32 values widen to two vectors of columns: the lanes' low halves, then their high halves
        w = []
        for j in range(vectors // 2):
            pairs = builder.bitcast(builder.gep(weights, [_I64(j * 2 * _LANES)]), _PAIRS.as_pointer())
            w += _widened_pairs(builder, builder.load(pairs, align=2))
    else:
        vector = _PAIRS if in_pairs else _V
        w = [
            builder.load(builder.bitcast(builder.gep(weights, [_I64(j * _LANES)]), vector.as_pointer()), align=4)
            for j in range(vectors)
        ]
    new = []
    for r in range(rows):
        broadcast = _broadcast(builder, builder.load(builder.gep(x_rows[r], [builder.mul(step, x_step)])), in_pairs)
        new += [builder.call(fma, [broadcast, w[j], sums[r * vectors + j]]) for j in range(vectors)]
    # A lone tile of pairs prefetches nothing: it walks one panel at a time, one stream in memory order, which the
    # hardware's prefetchers keep ahead of on their own. Over all of the 1.5B's bfloat16 products on Zen 4, in turn
    # with its prefetch into L1 (which had taken M = 1-3 to 0.79-0.85x the time of prefetching into L2): M = 2-5
    # 0.80-0.93x the time at 39-47 GB/s, M = 1-5 0.89-1.02x at 29-32; whole forwards 1 x 1-6 0.83-1.00x (8 x 1, two
    # tiles, 0.98-1.03x). Two tiles or more keep their prefetch into L2: without it M = 8 took 1.20-1.62x, 12 1.47-1.65x
    # (docs/engine-cpu.md).
    slot = builder.mul(builder.sub(step, k0), _I64(lines))
    for i in range(0 if in_pairs and lines == 4 else lines):
        line = builder.add(start, builder.add(slot, _I64(i)))
        line = builder.select(builder.icmp_signed("<", line, stop), line, builder.sub(stop, _I64(1)))
        address = builder.gep(ps.data, [builder.mul(line, _I64(_LINE // (2 if bfloat16 else 4)))])
        builder.call(prefetch, [builder.bitcast(address, _I8P), _I32(0), _I32(_TO_L2), _I32(1)])
    next_step = builder.add(step, _I64(1))
    builder.branch(head)
    for block, values in ((load_block, kept), (zero_block, [zero] * len(outs))):
        step.add_incoming(k0, block)
        for total, value in zip(sums, values):
            total.add_incoming(value, block)
    step.add_incoming(next_step, body)
    for total, updated in zip(sums, new):
        total.add_incoming(updated, body)

    builder.position_at_end(done)
    for total, pointer in zip(sums, outs):
        builder.store(total, pointer, align=4)


# The tiles a walk takes: a lone tile (1-6 rows) prefetches four lines a step (pairs: none); two or three tiles (7-18
# rows, so 3-6 a tile) two each; four tiles or more (19 rows on: rows > 6 (tiles - 1) leaves at least 4 to each) one
# each.
_panel_1, _panel_2, _panel_3, _panel_4, _panel_5, _panel_6 = (_panel_tile_rows(r, 4) for r in range(1, 7))
_panel_1h, _panel_2h, _panel_3h, _panel_4h, _panel_5h, _panel_6h = (_panel_tile_rows(r, 2) for r in range(1, 7))
_panel_1q, _panel_2q, _panel_3q, _panel_4q, _panel_5q, _panel_6q = (_panel_tile_rows(r, 1) for r in range(1, 7))


@njit(inline="always", fastmath=True)
def _panel_tile(x, x_at, m0, rows, panels, p, span, y, column, prefetching):
    """The tile for `rows` (1 .. _PANEL_ROWS) x rows from m0, over K span = (k0, k1), x's value (r, step) at
    x_first + r * x_row + step * x_step with x_at = (x_first, x_row, x_step); prefetching = (start, stop, lines),
    lines as the tiles above take them."""
    k0, k1 = span
    start, stop, lines = prefetching
    x_first, x_row, x_step = x_at
    if lines == 4:
        if rows == 1:
            _panel_1(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
        elif rows == 2:
            _panel_2(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
        elif rows == 3:
            _panel_3(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
        elif rows == 4:
            _panel_4(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
        elif rows == 5:
            _panel_5(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
        else:
            _panel_6(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
    elif lines == 2:
        if rows == 1:
            _panel_1h(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
        elif rows == 2:
            _panel_2h(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
        elif rows == 3:
            _panel_3h(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
        elif rows == 4:
            _panel_4h(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
        elif rows == 5:
            _panel_5h(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
        else:
            _panel_6h(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
    elif rows == 1:
        _panel_1q(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
    elif rows == 2:
        _panel_2q(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
    elif rows == 3:
        _panel_3q(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
    elif rows == 4:
        _panel_4q(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
    elif rows == 5:
        _panel_5q(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)
    else:
        _panel_6q(x, m0, panels, p, k0, k1, y, column, start, stop, x_first, x_row, x_step)


def warm_up_attention() -> None:
    _check_attentions(lambda cache: cache)


def warm_up_attention_bfloat16() -> None:
    # The cache as bfloat16 bits: its values are exact in bfloat16, the top 16 bits of their float32.
    _check_attentions(lambda cache: (cache.view(np.uint32) >> 16).astype(np.uint16).view(np.int16))


def _check_attentions(as_cache) -> None:
    """The loops at a narrow head and a wide one, and the tiles wherever they run (AVX512), default or not."""
    for head_dim, tiles in ((4, False), (PANEL, False), *(((PANEL, True),) if AVX512 else ())):
        _check_attention(as_cache, head_dim, tiles)


def _check_attention(as_cache, head_dim, tiles) -> None:
    """Equal scores: token 0 averages keys 0-2, token 1 keys 0-3, with the cache as as_cache(float32 values)."""
    q = np.zeros((2, 2, head_dim), np.float32)  # two tokens of a chain, two heads sharing one KV head
    keys = np.zeros((1, 4, 1, head_dim), np.float32)
    values = np.arange(4 * head_dim, dtype=np.float32).reshape(1, 4, 1, head_dim)
    out = np.empty_like(q)
    one = np.ones(1, np.int64)
    rows = (np.zeros(1, np.int64), 2 * one, np.zeros(1, np.int64), 2 * one, -one, np.ones(0, np.bool_))
    attend(q, as_cache(keys), as_cache(values), *rows, 1, tiles, out)
    expected = np.stack([values[0, :3, 0].mean(0), values[0, :4, 0].mean(0)])[:, None].repeat(2, 1)
    if not np.allclose(out, expected):
        raise RuntimeError(f"the compiled attention is wrong: {out}")


def task_heads(num_rows: int, num_kv_heads: int) -> int:
    """The KV heads an attention task takes in a step of num_rows rows (attend's task_heads), after set_threads.

    All of a row's where the rows alone keep every thread busy (_HEADS_TOGETHER), so that a task reads each key's
    heads side by side, in the cache's order; else one each. A head's keys alone lie 512 bytes in every KVH * 512
    (D = 128), a stride memory served a task at under half the rate of the whole run (docs/engine-cpu.md).
    """
    return num_kv_heads if _HEADS_TOGETHER and num_rows >= get_num_threads() else 1


@njit(parallel=True, fastmath=_FAST, cache=True)
def attend(q, k_cache, v_cache, starts, num_new, slots, num_cached, tree_offsets, tree_masks, task_heads, tiles, out):
    """out[starts[r] + t, h] = softmax(q . keys / sqrt(D)) . values over the keys row r's token t sees.

    q, out [N, H, D]; k_cache, v_cache [num_slots, max_len, KVH, D] (C-contiguous); per row r: starts,
    num_new, slots, num_cached, tree_offsets (NO_TREE, or where its [num_new, num_new] ancestor mask
    begins in tree_masks); task_heads: the KV heads a task takes (task_heads() of the step); tiles: heads of a
    multiple of PANEL values through the tiles (TILED_ATTENTION where they are faster; AVX512 only), else the
    loops.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    scale = np.float32(1.0 / math.sqrt(head_dim))
    heads = num_kv_heads if task_heads == num_kv_heads else 1
    tasks_per_row = num_kv_heads // heads
    for task in prange(slots.shape[0] * tasks_per_row):
        r, first_head = task // tasks_per_row, task % tasks_per_row * heads
        slot, cached, new, tree = slots[r], num_cached[r], num_new[r], tree_offsets[r]
        # The row's tokens a chunk at a time, each chunk's scores within _CHUNK_SCORES: a query's sums do not
        # depend on which others share its chunk (_scores, _weighted_values), so neither on the chunking.
        chunk = max(1, min(_CHUNK_TOKENS, _CHUNK_SCORES // (heads * group * (cached + new))))
        for first in range(0, new, chunk):
            end = min(first + chunk, new)
            place = (slot, cached, first_head, heads, tiles)
            _attend_chunk(q, k_cache, v_cache, starts[r], (first, end, new), place, tree, tree_masks, scale, out)


@njit(inline="always", fastmath=_FAST)
def _attend_chunk(q, k_cache, v_cache, start, tokens, place, tree, tree_masks, scale, out):
    """attend for tokens (first, end, new) of one row (its queries from q[start + first]) and KV heads
    first_head .. first_head + heads - 1, through the tiles or not: place = (slot, cached, first_head, heads,
    tiles). The chunk's keys end at its last token's own."""
    first, end, new = tokens
    slot, cached, first_head, heads, tiles = place
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    num_queries, num_keys = (end - first) * group, cached + end
    # The chunk's queries for each of these KV heads, scaled: query i of KV head first_head + h is token
    # first + i // G, head (first_head + h) * G + i % G.
    queries = np.empty((heads, num_queries, head_dim), np.float32)
    for h in range(heads):
        for i in range(num_queries):  # the indices outside the copy: at numba's level 2 they were computed in it
            token, head = start + first + i // group, (first_head + h) * group + i % group
            for d in range(head_dim):
                queries[h, i, d] = q[token, head, d] * scale
    scores = np.empty((heads, num_queries, num_keys), np.float32)
    tiled = tiles and head_dim % PANEL == 0
    if tiled:
        _tiled_scores(queries, k_cache, slot, first_head, num_keys, scores)
    else:
        _scores(queries, k_cache, slot, first_head, num_keys, scores)
    for h in range(heads):
        for i in range(num_queries):
            _softmax(scores[h, i], first + i // group, (cached, num_keys, new), tree, tree_masks)
    # Each head's sums in _VALUE_QUERIES - 1 rows more than its queries: scratch (_weighted_values).
    sums = np.zeros((heads, num_queries + _VALUE_QUERIES - 1, head_dim), np.float32)
    if tiled:
        _tiled_values(scores, v_cache, slot, first_head, num_keys, sums)
    else:
        _weighted_values(scores, v_cache, slot, first_head, num_keys, sums)
    for h in range(heads):
        for i in range(num_queries):
            token, head = start + first + i // group, (first_head + h) * group + i % group
            for d in range(head_dim):
                out[token, head, d] = sums[h, i, d]


@njit(inline="always", fastmath=_FAST)
def _softmax(scores, t, keys, tree, tree_masks):
    """One query's scores over keys = (cached, num_keys, new), in place: its weights, for token t of its row."""
    cached, num_keys, new = keys
    seen = cached + t + 1  # a chain's and a tree's keys both end at the query's own
    for key in range(seen, num_keys):
        scores[key] = 0.0
    if tree != NO_TREE:
        for j in range(t + 1):
            if not tree_masks[tree + t * new + j]:
                scores[cached + j] = -np.inf
    _exp_minus(scores, seen, _largest(scores, seen))
    if tree != NO_TREE:  # exactly nothing from the keys the tree hides
        for j in range(t + 1):
            if not tree_masks[tree + t * new + j]:
                scores[cached + j] = 0.0
    _normalize(scores, seen)


# Cephes' expf: exp(x) = 2**n * e**r, n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), e**r by a
# degree-6 polynomial; within 2 ulp in float32. Written out, without branches, so that a loop of it vectorizes:
# numba's math.exp is a scalar libm call per value. (server/_race_numba.py keeps its own copy: numba's cache
# watches one file.)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HIGH, _LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_FLOOR = np.float32(-87.0)  # e**-87 is a normal float32; below it a weight is as good as zero


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits` (a register move, so loops around it vectorize)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


# _race_numba's 512-bit loops on AVX-512, for attention's: one layer's attention (12 heads, 2 KV heads of 128) at
# 200 and 2,000 cached keys a row took 0.85-0.96x on a 2-core Xeon, in turn. Its own copy: numba's cache watches
# only this file (tests/test_kernels.py).
_VECTOR_BITS = '"prefer-vector-width"="512"'


@intrinsic
def _wide_vectors(typingctx):
    """Lets LLVM vectorize the loops of the function it is called in at _VECTOR_BITS (as _race_numba's)."""

    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, _VECTOR_BITS)
        return context.get_dummy_value()

    return types.none(), codegen


@njit(inline="always")
def _exp(x):
    """float32 e**x for x in [_EXP_FLOOR, 0]."""
    n = np.floor(x * _LOG2E + np.float32(0.5))  # np.floor, not math.floor: an int round trip stops vectorizing
    r = x - n * _LN2_HIGH - n * _LN2_LOW
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * (r * r) + r + _ONE) * _float32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(fastmath=_FAST)
def _largest(row, count):
    """max(row[:count]) for count >= 1 values, none NaN. Through each value's bits as an int32 whose order is the
    floats' (a negative float's other 31 bits flipped), since LLVM vectorizes an integer max and no form of the float
    max numba writes: 0.1 ns a value against 1.1 on a 2-core Xeon, which had made the max half of attention's softmax
    (8 x 5 at 2,000 cached keys: 35 ms of a 150 ms forward's attention)."""
    _wide_vectors()
    bits = row[:count].view(np.int32)
    top = np.int32(-(1 << 31))
    for k in range(count):
        top = max(top, bits[k] ^ ((bits[k] >> np.int32(31)) & np.int32(0x7FFFFFFF)))
    return _float32_from_bits(top ^ ((top >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@njit(fastmath=_FAST)
def _normalize(row, count):
    """row[:count] times the inverse of its sum: in a function of its own, whose loops vectorize at numba's level 2
    as inlined into the attention they did not."""
    _wide_vectors()
    total = _ZERO
    for k in range(count):
        total += row[k]
    inverse = _ONE / total
    for k in range(count):
        row[k] *= inverse


@njit(fastmath=_FAST)
def _exp_minus(row, count, top):
    """row[:count] = exp(row[:count] - top) for values <= top (-inf gives e**-87, not 0)."""
    _wide_vectors()
    for k in range(count):
        row[k] = _exp(max(row[k] - top, _EXP_FLOOR))


@njit(fastmath=_FAST)
def _scores(queries, k_cache, slot, first_head, num_keys, scores):
    """scores[h, i, key] = queries[h, i] . k_cache[slot, key, first_head + h]: two queries by four keys at a time
    (the matrix kernel's blocking), so each key is read from memory once and each pair of queries from cache,
    and a key's heads one after the other, in the cache's order. The four keys _KEYS_AHEAD on are prefetched
    meanwhile, a share before each call (the hardware's prefetchers followed one head's stride too late)."""
    _wide_vectors()
    heads, num_queries = queries.shape[0], queries.shape[1]
    max_len, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    keys = k_cache[slot].reshape(max_len * num_kv_heads, head_dim)  # key k of head h: row k * KVH + h
    calls = (num_queries + 1) // 2  # dot calls per four keys of a head, which share its prefetches between them
    # The last 1-3 keys take the block of the last four (computing some keys again, to the same bits), so that
    # every score comes from the same loop whatever the number of keys: a query's scores do not depend on the
    # row's length.
    last = num_keys - 4
    for block in range((num_keys + 3) // 4 if num_keys >= 4 else 0):
        key = min(4 * block, last)
        for h in range(heads):
            head_queries, head_scores, kv_head = queries[h], scores[h], first_head + h
            row = key * num_kv_heads + kv_head
            i = 0
            while i + 1 < num_queries:
                _prefetch_keys(keys, key + _KEYS_AHEAD, i // 2, calls, num_keys, num_kv_heads, kv_head)
                dot_4x2(head_queries, i, i + 1, keys, row, num_kv_heads, head_scores, key)
                i += 2
            if i < num_queries:  # the odd query out, paired with itself: the same code as every other query's
                _prefetch_keys(keys, key + _KEYS_AHEAD, i // 2, calls, num_keys, num_kv_heads, kv_head)
                dot_4x2(head_queries, i, i, keys, row, num_kv_heads, head_scores, key)
    for k in range(num_keys if num_keys >= 4 else 0, num_keys):  # fewer than four keys in all
        for h in range(heads):
            for i in range(num_queries):
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += queries[h, i, d] * _as_float(keys[k * num_kv_heads + first_head + h, d])
                scores[h, i, k] = dot


@njit(fastmath=_FAST)
def _weighted_values(weights, v_cache, slot, first_head, num_keys, sums):
    """sums[h, i] += sum over keys of weights[h, i, key] * v_cache[slot, key, first_head + h]: four keys at a
    time, a key's heads one after the other, and _VALUE_QUERIES queries at a time, while the values _KEYS_AHEAD
    keys on stream in (as _scores' keys). sums has _VALUE_QUERIES - 1 rows a head past its queries', which take
    a last group's missing queries (a copy of the head's last query's weights)."""
    _wide_vectors()
    heads, num_queries = weights.shape[0], weights.shape[1]
    max_len, num_kv_heads, head_dim = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
    values = v_cache[slot].reshape(max_len * num_kv_heads, head_dim)  # as _scores' keys
    groups, last_query = (num_queries + _VALUE_QUERIES - 1) // _VALUE_QUERIES, num_queries - 1
    # Keys in fours from key 0, the last 1-3 padded with the row's last key at weight zero, each four through
    # the one call of _four_values, three queries at a time (a group short of three filled with the last query's
    # weights, its sums into the scratch rows): a key's term joins the same three others in the same code whatever
    # the number of keys or queries, so a query's sums do not depend on the row's length or its chunk (keys past a
    # query's own weigh exactly zero). One call for the whole fours and the last: two copies of the loop were
    # vectorized differently, which gave the last four's keys other bits.
    last = num_keys - 1
    for key in range(0, num_keys, 4):
        keys_of = (key, min(key + 1, last), min(key + 2, last), min(key + 3, last))
        for h in range(heads):
            head_weights, head_sums, kv_head = weights[h], sums[h], first_head + h
            for i in range(0, num_queries, _VALUE_QUERIES):  # not i = 3 g: LLVM then kept the loop scalar (0.4x)
                i1, i2 = min(i + 1, last_query), min(i + 2, last_query)
                _prefetch_keys(values, key + _KEYS_AHEAD, i // _VALUE_QUERIES, groups, num_keys, num_kv_heads, kv_head)
                weights_of = (
                    _key_weights(head_weights, i, key, num_keys),
                    _key_weights(head_weights, i1, key, num_keys),
                    _key_weights(head_weights, i2, key, num_keys),
                )
                _four_values(v_cache, (slot, kv_head), keys_of, weights_of, head_sums, i)


@njit(inline="always")
def _key_weights(weights, i, key, num_keys):
    """Query i's weights of keys key .. key + 3, zero past num_keys."""
    w1 = weights[i, key + 1] if key + 1 < num_keys else _ZERO
    w2 = weights[i, key + 2] if key + 2 < num_keys else _ZERO
    w3 = weights[i, key + 3] if key + 3 < num_keys else _ZERO
    return weights[i, key], w1, w2, w3


@njit(inline="always", fastmath=_FAST)
def _four_values(v_cache, place, keys_of, weights_of, sums, i):
    """Three queries' sums += the four keys' values, each times the query's weight (keys_of: four; weights_of:
    four per query), each value read once for the three."""
    slot, kv_head = place
    k0, k1, k2, k3 = keys_of
    (a0, a1, a2, a3), (b0, b1, b2, b3), (c0, c1, c2, c3) = weights_of
    for d in range(sums.shape[1]):
        v0 = _as_float(v_cache[slot, k0, kv_head, d])
        v1 = _as_float(v_cache[slot, k1, kv_head, d])
        v2 = _as_float(v_cache[slot, k2, kv_head, d])
        v3 = _as_float(v_cache[slot, k3, kv_head, d])
        sums[i, d] += a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3
        sums[i + 1, d] += b0 * v0 + b1 * v1 + b2 * v2 + b3 * v3
        sums[i + 2, d] += c0 * v0 + c1 * v1 + c2 * v2 + c3 * v3


@njit(inline="always")
def _prefetch_keys(rows, first, share, shares, end, num_kv_heads, kv_head):
    """Prefetch (_KEYS_TO) the share-th of `shares` parts of keys first .. first + 3 of one head, those below end
    (the keys a row sees): rows key * KVH + kv_head of rows [max_len * KVH, D]. A loop over four keys calls it
    once per part, spread over its work: issued at once, the same prefetches took 0.79-0.92x the time of
    none; spread, 0.67-0.85x (docs/engine-cpu.md's attention paragraph)."""
    for key in range(first + share * 4 // shares, min(first + (share + 1) * 4 // shares, end)):
        _prefetch_row(rows, key * num_kv_heads + kv_head)


@intrinsic
def _prefetch_row(typingctx, rows, row):
    """Prefetch (_KEYS_TO) every 64-byte line of rows[row] (a C-contiguous 2D float32 array, or int16: bfloat16)."""
    if rows.layout != "C":
        return None
    line_bits = 5 if rows.dtype == types.int16 else 4  # log2 of the values a line holds

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        width = builder.extract_value(array.shape, 1)
        start = builder.gep(array.data, [builder.mul(args[1], width)])
        lines = builder.lshr(builder.add(width, _I64((1 << line_bits) - 1)), _I64(line_bits))
        with cgutils.for_range(builder, lines) as loop:
            _prefetch_at(builder, builder.gep(start, [builder.shl(loop.index, _I64(line_bits))]))
        return context.get_dummy_value()

    return types.none(rows, row), codegen


@njit(fastmath=_FAST)
def _tiled_scores(queries, k_cache, slot, first_head, num_keys, scores):
    """_scores through the score tiles (attend's tiles): _SCORE_KEYS keys at a time, a block's heads one after
    the other, each head's queries _SCORE_QUERIES a tile."""
    heads, num_queries = queries.shape[0], queries.shape[1]
    max_len, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    keys = k_cache[slot].reshape(max_len * num_kv_heads, head_dim)  # key k of head h: row k * KVH + h
    tiles = (num_queries + _SCORE_QUERIES - 1) // _SCORE_QUERIES
    for k0 in range(0, num_keys, _SCORE_KEYS):
        k1 = min(k0 + _SCORE_KEYS, num_keys)
        for h in range(heads):
            head = (first_head + h, num_kv_heads)
            for tile in range(tiles):
                ahead = (k1, num_keys - 1, tile, tiles)
                _attention_tile_call(False, queries[h], tile * _SCORE_QUERIES, keys, head, scores[h], (k0, k1), ahead)


@njit(fastmath=_FAST)
def _tiled_values(weights, v_cache, slot, first_head, num_keys, sums):
    """_weighted_values through the value tiles (attend's tiles): _VALUE_KEYS keys at a time, a block's heads
    one after the other, each head's PANEL columns at a time and its queries _VALUE_ROWS a tile."""
    heads, num_queries = weights.shape[0], weights.shape[1]
    max_len, num_kv_heads, head_dim = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
    values = v_cache[slot].reshape(max_len * num_kv_heads, head_dim)  # as _tiled_scores' keys
    tiles = (num_queries + _VALUE_ROWS - 1) // _VALUE_ROWS
    for k0 in range(0, num_keys, _VALUE_KEYS):
        k1 = min(k0 + _VALUE_KEYS, num_keys)
        for h in range(heads):
            head = (first_head + h, num_kv_heads)
            for column in range(0, head_dim, PANEL):
                for tile in range(tiles):
                    ahead = (k1, num_keys - 1, tile, tiles)
                    span = (k0, k1, column)
                    _attention_tile_call(True, weights[h], tile * _VALUE_ROWS, values, head, sums[h], span, ahead)


@njit(inline="always")
def _attention_tile_call(values, rows, i0, cache, head, out, span, ahead):
    """A value tile (`values`) or a score tile, the one whose prefetches with the block's other tiles' (ahead[3] in
    all) cover the next block: alone a score tile's four keys a four and a value tile's four lines a step, two
    among two or three tiles, one among four or more."""
    tiles = ahead[3]
    lines = 4 if tiles == 1 else 2 if tiles <= 3 else 1
    if values:
        if lines == 4:
            _value_4(rows, i0, cache, head, out, span, ahead)
        elif lines == 2:
            _value_2(rows, i0, cache, head, out, span, ahead)
        else:
            _value_1(rows, i0, cache, head, out, span, ahead)
    elif lines == 4:
        _score_4(rows, i0, cache, head, out, span, ahead)
    elif lines == 2:
        _score_2(rows, i0, cache, head, out, span, ahead)
    else:
        _score_1(rows, i0, cache, head, out, span, ahead)


def _attention_types(rows, cache, out) -> bool:
    """Whether an attention tile takes these arrays: float32 rows and out, a float32 or bfloat16-bits cache, all C
    order."""
    return (
        all(a.layout == "C" for a in (rows, cache, out))
        and rows.dtype == out.dtype == types.float32
        and (cache.dtype in (types.float32, types.int16))
    )


def _attention_tile(emit, lines):
    """An intrinsic tile(rows, i0, cache, head, out, span, ahead) whose IR `emit` writes (_score_tile_ir or
    _value_tile_ir), each step prefetching `lines` lines of the next block."""

    @intrinsic
    def tile(typingctx, rows, i0, cache, head, out, span, ahead):
        if not _attention_types(rows, cache, out):
            return None

        def codegen(context, builder, signature, args):
            emit(context, builder, signature, args, lines)
            return context.get_dummy_value()

        return types.none(rows, i0, cache, head, out, span, ahead), codegen

    return tile


def _score_tile_ir(context, builder, signature, args, lines):
    """The IR of a score tile(queries, i0, keys, head, scores, span, ahead): scores[i, key] = queries[i] .
    keys[row + key * stride] for the tile's queries i = min(i0 + r, Q - 1), r < _SCORE_QUERIES, and keys k0 .. k1 -
    1 four at a time (a four's keys min(key + j, K - 1): one past K - 1 is computed again, to the same bits):
    queries [Q, D] and scores [Q, K] float32, keys [R, D] float32 or bfloat16 bits, head = (row, stride), span =
    (k0, k1). Each step dot products a vector of D for the six queries by four keys; each four ends in one shuffle
    tree (_horizontal_sums), so that a score's bits are the same in every tile. Each four also prefetches the rows
    of `lines` keys of the next block (_next_block; ahead = (next key, last key, tile, tiles)), a line of each a
    step."""
    qs, ks, ss = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4))
    i0, (row, stride), (k0, k1) = args[1], _ints(builder, args[3], 2), _ints(builder, args[5], 2)
    ahead, bfloat16 = _ints(builder, args[6], 4), signature.args[2].dtype == types.int16
    dim, width = builder.extract_value(qs.shape, 1), builder.extract_value(ss.shape, 1)
    last_query = builder.sub(builder.extract_value(qs.shape, 0), _I64(1))
    rows = [_clamped(builder, builder.add(i0, _I64(r)), last_query) for r in range(_SCORE_QUERIES)]
    q_rows = [builder.gep(qs.data, [builder.mul(i, dim)]) for i in rows]
    fma, zero = _fmuladd(builder), ir.Constant(_V, [0.0] * _LANES)

    def key_row(key):
        return builder.gep(ks.data, [builder.mul(builder.add(row, builder.mul(key, stride)), dim)])

    entry = builder.block
    fours, four, steps, step, summing, done = (
        builder.append_basic_block(name) for name in ("fours", "four", "steps", "step", "sums", "done")
    )
    builder.branch(fours)
    builder.position_at_end(fours)
    first = builder.phi(_I64)  # the four's first key
    builder.cbranch(builder.icmp_signed("<", first, k1), four, done)
    builder.position_at_end(four)
    last_key = builder.sub(width, _I64(1))
    columns = [_clamped(builder, builder.add(first, _I64(j)), last_key) for j in range(4)]
    k_rows = [key_row(key) for key in columns]
    fours_done = builder.ashr(builder.sub(first, k0), _I64(2))
    ahead_rows = [key_row(key) for key in _next_block(builder, ahead, lines, fours_done)]
    builder.branch(steps)

    builder.position_at_end(steps)
    at = builder.phi(_I64)
    sums = [builder.phi(_V) for _ in range(4 * _SCORE_QUERIES)]  # query r by key j at r * 4 + j
    builder.cbranch(builder.icmp_signed("<", at, dim), step, summing)
    builder.position_at_end(step)
    k = [_cache_vector(builder, builder.gep(pointer, [at]), bfloat16) for pointer in k_rows]
    new = []
    for r in range(_SCORE_QUERIES):
        u = builder.load(builder.bitcast(builder.gep(q_rows[r], [at]), _V.as_pointer()), align=4)
        new += [builder.call(fma, [u, k[j], sums[r * 4 + j]]) for j in range(4)]
    for pointer in ahead_rows:
        _prefetch_at(builder, builder.gep(pointer, [at]))
    next_at = builder.add(at, _I64(_LANES))
    builder.branch(steps)
    at.add_incoming(_I64(0), four)
    at.add_incoming(next_at, step)
    for total, updated in zip(sums, new):
        total.add_incoming(zero, four)
        total.add_incoming(updated, step)

    builder.position_at_end(summing)
    for index, value in enumerate(_horizontal_sums(builder, sums)):
        place = builder.add(builder.mul(rows[index // 4], width), columns[index % 4])
        builder.store(value, builder.gep(ss.data, [place]))
    next_first = builder.add(first, _I64(4))
    builder.branch(fours)
    first.add_incoming(k0, entry)
    first.add_incoming(next_first, summing)
    builder.position_at_end(done)


def _value_tile_ir(context, builder, signature, args, lines):
    """The IR of a value tile(weights, i0, values, head, sums, span, ahead): sums[i, c:c + PANEL] += weights[i, key] *
    values[row + key * stride, c:c + PANEL] over key = k0 .. k1 - 1 in order, for the tile's queries i = min(i0 +
    r, Q - 1), r < _VALUE_ROWS: weights [Q, >= k1] and sums [>= Q, D] float32, values [R, D] float32 or bfloat16
    bits, head = (row, stride), span = (k0, k1, c). A step takes one key: its PANEL values as four vectors and each
    query's weight broadcast. A query's sums are one chain of fused multiply-adds over the keys, whatever the tile,
    and a weight of zero adds exactly nothing. A step also prefetches `lines` lines of the next block's columns c
    .. c + PANEL - 1: line l of them is part l % P of key l // P, P the lines a key's PANEL values take, and the
    s-th step of tile t of n takes lines (s n + t) lines + i, i < lines (_next_block's keys, as lines)."""
    ws, vs, ss = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4))
    i0, (row, stride), (k0, k1, column) = args[1], _ints(builder, args[3], 2), _ints(builder, args[5], 3)
    next_key, last_key, tile, tiles = _ints(builder, args[6], 4)
    bfloat16 = signature.args[2].dtype == types.int16
    width, dim = builder.extract_value(ws.shape, 1), builder.extract_value(ss.shape, 1)
    last = builder.sub(builder.extract_value(ws.shape, 0), _I64(1))
    rows = [_clamped(builder, builder.add(i0, _I64(r)), last) for r in range(_VALUE_ROWS)]
    w_rows = [builder.gep(ws.data, [builder.mul(i, width)]) for i in rows]
    vectors = PANEL // _LANES
    outs = []
    for i in rows:
        start = builder.gep(ss.data, [builder.add(builder.mul(i, dim), column)])
        outs += [builder.bitcast(builder.gep(start, [_I64(j * _LANES)]), _V.as_pointer()) for j in range(vectors)]
    fma = _fmuladd(builder)
    per_line = _LINE // (2 if bfloat16 else 4)  # values a line holds
    parts = (PANEL // per_line).bit_length() - 1  # log2 of the lines a key's PANEL values take

    def place(key):  # where the key's values from `column` begin
        return builder.add(builder.mul(builder.add(row, builder.mul(key, stride)), dim), column)

    last_line = builder.sub(builder.shl(builder.add(last_key, _I64(1)), _I64(parts)), _I64(1))
    ahead = (builder.shl(next_key, _I64(parts)), last_line, tile, tiles)  # in lines, as _next_block takes keys
    kept = [builder.load(pointer, align=4) for pointer in outs]
    entry = builder.block
    head, body, done = (builder.append_basic_block(name) for name in ("head", "body", "done"))
    builder.branch(head)
    builder.position_at_end(head)
    key = builder.phi(_I64)
    sums = [builder.phi(_V) for _ in outs]  # query r's PANEL columns at r * vectors ..
    builder.cbranch(builder.icmp_signed("<", key, k1), body, done)
    builder.position_at_end(body)
    value_row = builder.gep(vs.data, [place(key)])
    v = [_cache_vector(builder, builder.gep(value_row, [_I64(j * _LANES)]), bfloat16) for j in range(vectors)]
    new = []
    for r in range(_VALUE_ROWS):
        broadcast = _broadcast(builder, builder.load(builder.gep(w_rows[r], [key])))
        new += [builder.call(fma, [broadcast, v[j], sums[r * vectors + j]]) for j in range(vectors)]
    for line in _next_block(builder, ahead, lines, builder.sub(key, k0)):
        offset = builder.mul(builder.and_(line, _I64((1 << parts) - 1)), _I64(per_line))
        address = builder.add(place(builder.ashr(line, _I64(parts))), offset)
        _prefetch_at(builder, builder.gep(vs.data, [address]))
    next_key = builder.add(key, _I64(1))
    builder.branch(head)
    key.add_incoming(k0, entry)
    key.add_incoming(next_key, body)
    for total, value, updated in zip(sums, kept, new):
        total.add_incoming(value, entry)
        total.add_incoming(updated, body)
    builder.position_at_end(done)
    for total, pointer in zip(sums, outs):
        builder.store(total, pointer, align=4)


def _next_block(builder, ahead, lines, step):
    """The keys (as key indices) whose rows a tile prefetches at its step-th unit (a four's steps, a key): ahead =
    (next key, last key, tile, tiles); tile t of n takes keys (step n + t) lines + i, i < lines, of the next block,
    each within the last key, so that a block's tiles together take n x lines keys a unit, each its own."""
    next_key, last_key, tile, tiles = ahead
    first = builder.mul(builder.add(builder.mul(step, tiles), tile), _I64(lines))
    return [_clamped(builder, builder.add(next_key, builder.add(first, _I64(i))), last_key) for i in range(lines)]


def _prefetch_at(builder, pointer):
    """Prefetch the line at `pointer` (_KEYS_TO)."""
    builder.call(_llvm_prefetch(builder), [builder.bitcast(pointer, _I8P), _I32(0), _I32(_KEYS_TO), _I32(1)])


def _ints(builder, value, count):
    """The int64s of a tuple argument."""
    return [builder.extract_value(value, i) for i in range(count)]


def _cache_vector(builder, pointer, bfloat16):
    """_LANES values of a cache from `pointer` as float32: float32 themselves, or bfloat16 bits (int16), each the
    high half of its float32."""
    if not bfloat16:
        return builder.load(builder.bitcast(pointer, _V.as_pointer()), align=4)
    kind = ir.VectorType(ir.IntType(16), _LANES)
    return _from_bfloat16(builder, builder.load(builder.bitcast(pointer, kind.as_pointer()), align=2))


_score_1, _score_2, _score_4 = (_attention_tile(_score_tile_ir, lines) for lines in (1, 2, 4))
_value_1, _value_2, _value_4 = (_attention_tile(_value_tile_ir, lines) for lines in (1, 2, 4))


# ---------------------------------------------------------------------------------------------------------
# The decoder layer


def warm_up_layer(panels: bool = PANELS) -> None:
    """The layer over zero weights as panels or as plain rows (the layout a server's float32 projections take)."""
    num, hidden, heads, head_dim, inner = 2, 8, 2, 4, 6
    x = np.arange(num * hidden, dtype=np.float32).reshape(num, hidden)
    zeros = np.zeros  # with zero weights the layer adds nothing, and each value is its bias

    def weights(out_features, in_features):
        if panels:
            return zeros(((out_features + PANEL - 1) // PANEL, in_features, PANEL), np.float32)
        return zeros((out_features, in_features), np.float32)

    caches = zeros((1, 4, 1, head_dim), np.float32), zeros((1, 4, 1, head_dim), np.float32)
    positions = np.arange(num, dtype=np.int64)
    rows = np.zeros(1, np.int64), np.full(1, num, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    before = x.copy()
    decoder_layer(
        x,
        np.float32(1e-6),
        np.ones(hidden, np.float32),
        weights((heads + 2) * head_dim, hidden),
        np.ones((heads + 2) * head_dim, np.float32),
        zeros(0, np.float32),
        zeros(0, np.float32),
        weights(hidden, heads * head_dim),
        np.ones(hidden, np.float32),
        weights(2 * inner, hidden),
        weights(hidden, inner),
        np.ones((num, head_dim), np.float32),
        zeros((num, head_dim), np.float32),
        *caches,
        zeros(num, np.int64),
        positions,
        *rows,
        np.full(1, -1, np.int64),
        zeros(0, np.bool_),
        1,
        heads,
        TILED_ATTENTION,
    )
    if not np.array_equal(x, before) or not np.array_equal(caches[1][0, :num], np.ones((num, 1, head_dim))):
        raise RuntimeError(f"the compiled layer is wrong: {x}, {caches[1]}")


@njit(fastmath=_FAST)
def _rms_norm(x, weight, eps, out):
    """out = weight * x / sqrt(mean(x ** 2) + eps), for one vector x [D]."""
    total = np.float32(0.0)
    for j in range(x.shape[0]):
        total += x[j] * x[j]
    scale = _ONE / np.sqrt(total / np.float32(x.shape[0]) + eps)
    for j in range(x.shape[0]):
        out[j] = weight[j] * (x[j] * scale)


@njit(fastmath=_FAST)
def _rms_norm_rows(x, weight, eps, out):
    for t in range(x.shape[0]):
        _rms_norm(x[t], weight, eps, out[t])


@njit(fastmath=_FAST)
def _rope_head(head, cos, sin, out):
    """RoPE on one head's [D] vector: head * cos + rotate_half(head) * sin (transformers' layout)."""
    half = head.shape[0] // 2
    for d in range(half):
        out[d] = head[d] * cos[d] - head[d + half] * sin[d]
        out[d + half] = head[d + half] * cos[d + half] + head[d] * sin[d + half]


@njit(fastmath=_FAST)
def _positions(qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, kv_slots, kv_positions, q):
    """Split qkv [N, (H + 2 KVH) D] into q [N, H, D] (normed per head where q_norm is given, rotated) and
    each token's key (likewise) and value, written to its KV slot and position."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    normed = np.empty(head_dim, np.float32)
    for t in range(qkv.shape[0]):
        slot, position = kv_slots[t], kv_positions[t]
        for head in range(num_heads + num_kv_heads):
            vector = qkv[t, head * head_dim : (head + 1) * head_dim]
            weights = q_norm if head < num_heads else k_norm
            out = q[t, head] if head < num_heads else k_cache[slot, position, head - num_heads]
            if weights.shape[0]:
                _rms_norm(vector, weights, eps, normed)
                _rope_head(normed, cos[t], sin[t], out)
            else:
                _rope_head(vector, cos[t], sin[t], out)
        values = (num_heads + num_kv_heads) * head_dim
        for head in range(num_kv_heads):
            for d in range(head_dim):
                v_cache[slot, position, head, d] = qkv[t, values + head * head_dim + d]


@njit(parallel=True, fastmath=_FAST)
def _silu_mul(gate_up, out):
    """out = silu(gate) * up for gate_up [N, 2 I] = [gate | up], vectorized (libm's exp is a call per value)."""
    num, inner = out.shape
    chunks = (inner + _SILU_CHUNK - 1) // _SILU_CHUNK
    for task in prange(num * chunks):
        t, start = task // chunks, (task % chunks) * _SILU_CHUNK
        for j in range(start, min(start + _SILU_CHUNK, inner)):
            gate = gate_up[t, j]
            small = _exp(max(-abs(gate), _EXP_FLOOR))  # e**-|gate|: sigmoid(gate) is 1 / (1 + it), or it / (1 + it)
            sigmoid = (_ONE if gate >= 0 else small) / (_ONE + small)
            out[t, j] = gate * sigmoid * gate_up[t, inner + j]


@njit(inline="always")
def _lined_rows(num, width):
    """np.empty((num, width), float32), starting on a cache line, as the product's x rows should: numba's own
    arrays start 32 bytes into one, so that every 64-byte AVX-512 load from them straddles two lines (the
    product took 1.09-1.15x the time at 32-40 rows on a 2-core Xeon, 1.00-1.07x at 8-24). Each row starts on
    a line too where width is a multiple of 16, as every width of the models' products is."""
    flat = np.empty(num * width + _LINE // 4, np.float32)
    skip = ((_LINE - flat.ctypes.data % _LINE) % _LINE) // 4
    return flat[skip : skip + num * width].reshape((num, width))


def _product(x, w, y):
    """y = x @ w.T in the decoder layer: panel_matmul for panels [P, K, PANEL], matmul for plain rows [N, K]
    (numba picks one by w's type as it compiles the layer)."""
    raise NotImplementedError("compiled code only")


@overload(_product)
def _product_by_layout(x, w, y):
    if w.ndim == 3:
        return lambda x, w, y: panel_matmul(x, w, y)
    return lambda x, w, y: matmul(x, w, y)


@njit(fastmath=_FAST)
def _add(x, y):
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[t, j] += y[t, j]


@njit(fastmath=_FAST, cache=True)
def decoder_layer(
    x,
    eps,
    input_norm,
    qkv_weight,
    qkv_bias,
    q_norm,
    k_norm,
    o_weight,
    post_norm,
    gate_up_weight,
    down_weight,
    cos,
    sin,
    k_cache,
    v_cache,
    kv_slots,
    kv_positions,
    starts,
    num_new,
    slots,
    num_cached,
    tree_offsets,
    tree_masks,
    task_heads,
    num_heads,
    tiles,
):
    """One layer over x [N, hidden] in place (x += attention(norm(x)); x += mlp(norm(x))).

    Weights as server/matmul.py's PanelLinear holds them ([panels, in, PANEL]) or PlainLinear ([out, in]), all
    four the same, q/k/v and gate/up fused; qkv_bias,
    q_norm and k_norm may be empty (none). cos, sin [N, D]; the caches, the rows' arrays and `tiles` as
    attend takes them, every row of the step among them.
    """
    num, hidden = x.shape
    head_dim = k_cache.shape[3]
    normed = _lined_rows(num, hidden)
    _rms_norm_rows(x, input_norm, eps, normed)
    qkv = np.empty((num, (num_heads + 2 * k_cache.shape[2]) * head_dim), np.float32)
    _product(normed, qkv_weight, qkv)
    if qkv_bias.shape[0]:
        for t in range(num):
            for j in range(qkv.shape[1]):
                qkv[t, j] += qkv_bias[j]
    q = _lined_rows(num, num_heads * head_dim).reshape((num, num_heads, head_dim))
    _positions(qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, kv_slots, kv_positions, q)
    attended = _lined_rows(num, num_heads * head_dim).reshape((num, num_heads, head_dim))
    rows = (starts, num_new, slots, num_cached, tree_offsets, tree_masks)
    attend(q, k_cache, v_cache, *rows, task_heads, tiles, attended)
    projected = np.empty_like(x)
    _product(attended.reshape((num, num_heads * head_dim)), o_weight, projected)
    _add(x, projected)
    _rms_norm_rows(x, post_norm, eps, normed)
    gate_up = np.empty((num, 2 * down_weight.shape[1]), np.float32)
    _product(normed, gate_up_weight, gate_up)
    activated = _lined_rows(num, down_weight.shape[1])
    _silu_mul(gate_up, activated)
    _product(activated, down_weight, projected)
    _add(x, projected)
