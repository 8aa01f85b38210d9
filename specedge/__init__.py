"""SpecEdge: edge-assisted lossless speculative decoding."""

import os

__version__ = "0.1.0"

# numba's optimization level for every kernel (server/_*_numba.py), unless the user set one: set here, before any
# module of ours imports numba, which reads it once. At numba's default (3) a kernel loaded from numba's cache, as
# every server start after the first loads it, ran slower than the same kernel compiled in the process: the cache
# keeps each parallel loop as optimized a second time inside its caller. The panel product at M = 1-8 took 1.07-1.12x
# the time, whole forwards of the real 1.5B 1 x 1 to 8 x 1 1.07-1.09x (2-core Xeon, in turn). At 2 the cached and the
# fresh kernel run alike, as fast as the fresh one at 3, and 8 x 5 0.98x (docs/engine-cpu.md).
os.environ.setdefault("NUMBA_OPT", "2")
