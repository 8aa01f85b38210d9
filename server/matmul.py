"""How the target's matrix products run: one seam, chosen per device.

- `eager`: the model's own `nn.Linear` layers (MKL on CPU, cuBLAS on CUDA). The
  plain path, kept for comparison and wherever nothing faster applies.
- `numba` (CPU, float32; bfloat16 when asked). On AVX-512 CPUs where the panels
  ran faster at the machine's first start (panels_here(): by default all but Zen 4),
  float32 weights are packed once, at load, into panels of 64 output columns
  (PanelLinear; the originals freed, a tied embedding reading the LM head's
  panels: PanelEmbedding), and every product, whatever its rows, runs the
  kernel's panel GEMM (server/_forward_numba.py's panel_matmul): over the 1.5B's
  products on a 2-core Xeon, in turn with the plain weights below, M = 8 0.86-0.96x
  the time, M = 24-40 0.71-0.75x; whole 8 x 5 forwards 0.86x, a 512-token prefill
  1.02x (its K = 8960 product runs at 0.9-0.95x oneDNN's rate). bfloat16 too,
  by default on AVX-512 CPUs without AMX but Zen 4 (the kernel's PANELS_BFLOAT16,
  timed likewise): the panels widen each bfloat16 weight to float32 and sum with
  FMAs, twice vdpbf16ps's rate on a Xeon without AMX; whole bfloat16 forwards
  there, in turn with the plain rows: 1 x 1 1.00x, 8 x 1 0.91x, 8 x 5 0.64x,
  16 x 5 0.67x. Elsewhere the weights stay row-major, as loaded, in one copy (a
  tied LM head reads the embedding table itself). A
  product of up to `numba_max_rows()` rows (48 on AVX2, 56 on AVX-512, 40 in
  bfloat16, 8 where AMX runs oneDNN's; on Zen 4 120, and 64 in bfloat16),
  every decode step's and most verify steps', runs a numba kernel that streams the weights at memory speed
  (server/_forward_numba.py); a larger one (prefill) runs oneDNN's GEMM on the
  same plain weights. On a Xeon that measured as fast as oneDNN's own packed
  layout (in float32); on a Zen 4 EPYC it took 1.04-1.16x the packed layout's
  time at 120-256 rows, and 1.14-1.27x at 41-80, which the kernel now takes.
  q/k/v and gate/up are fused as below. bfloat16 on plain rows (Zen 4, AMX)
  needs AVX512_BF16 and runs only when asked: whole bfloat16 forwards of the 1.5B
  on a 2-core Zen 4 EPYC, against `onednn` in three engine runs, took 1 x 1
  0.59-0.78x the time, 8 x 1 0.72-0.80x, 8 x 5 0.93-1.02x, but 16 x 5 1.13x and
  155-token steps 1.06-1.10x: past 64 rows the plain weights run oneDNN's GEMM
  slower than its packed layout does.
- `onednn` (CPU, float32 or bfloat16): every projection's weight is reordered
  once, at load, into oneDNN's blocked layout, and the original is freed, so
  memory holds one copy (a tied LM head keeps the embedding table beside its
  packed copy: the embedding lookup needs the plain rows). q/k/v and gate/up
  are fused into one product each, so a layer reads its weights in four
  passes instead of seven. This is the kernel inductor emits under freezing,
  without the compile or its second copy of the weights.
- `onednn-numba` (CPU, bfloat16, AVX512_BF16 without AMX): the weights packed for oneDNN as `onednn` packs them,
  in one copy, and read two ways (PairPanelLinear). On Zen 4 oneDNN lays bfloat16 out as panels of 64 output
  columns with K in pairs, which the numba kernel's panel product reads in place (vdpbf16ps), so products of up to
  40 rows run the kernel and larger ones oneDNN's own GEMM. Each weight's layout is checked whole at load; one
  that differs runs oneDNN's alone. A tied embedding reads the head's packed rows, so the table is held once.
  Whole bfloat16 forwards of the 1.5B on a 2-core Zen 4 EPYC, in turn with `onednn`: 1 x 1 0.75x the time, 1 x 5
  0.87x, 8 x 1 0.64x, 3 x 5 0.84x, 8 x 5 0.97x; with `numba` (plain rows): 1 x 1 1.07x, 1 x 5 1.13x, 8 x 1 1.01x,
  8 x 5 0.93x, 16 x 5 0.89x, a 155-token prefill 0.93x.
- `fused`: the device's own products (cuBLAS on CUDA) with q/k/v and gate/up
  stacked into one weight each, so a layer launches four products, not seven,
  each over a larger weight. On an H200 the 1.5B's graphed 1-token step spent
  52 of its 125 us a layer in seven products (bench/results/2026-11-27-h200-cuda.md).
- `auto`: on a CPU, `numba` for float32 where numba compiles, and for bfloat16
  where its panels run (panels_here: an AVX-512 CPU without AMX, not Zen 4, and
  timed faster there than the plain rows), else `onednn-numba` for bfloat16 where
  it runs (Zen 4: faster than `onednn` at every step), else `onednn` where it is
  available for the dtype, else `eager`, said in one log line; elsewhere (CUDA) `fused`.

On the 2-core AVX2 EPYC of `bench/results/`, over a [M, 1536] x [1536, 8960]
product: eager MKL takes 4.9 ms at M = 1 and 16 ms at M = 5, packed oneDNN
4.4 and 5.6 ms, the numba kernel 2.6 and 3.2 ms (a read of the same bytes:
2.7 ms); from M = 64 oneDNN is as fast or faster (`specedge-bench engine`).

Each path rounds differently (about 2e-4 on outputs of magnitude 40), so
changing the path can change a near-tie greedy token. One server uses one path
for every forward; within it, as with any kernel, a row's rounding may depend
on the step's size (README, "Lossless, and its one caveat"), so speculative and
server-only decoding agree token for token up to near ties.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from specedge.server.heap import return_freed_memory
from specedge.server.kernels import chosen_form, kernel_array, load_kernel

if TYPE_CHECKING:
    import numpy as np

    from specedge.server.model import CausalLM

log = logging.getLogger(__name__)

MATMUL_KINDS = ("auto", "eager", "fused", "numba", "onednn", "onednn-numba")


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int | None = None):
        """`rows`: the batch oneDNN lays the weight out for; by default `layout_rows(weight.dtype)`."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        rows = layout_rows(weight.dtype) if rows is None else rows
        # Not a parameter or buffer: an opaque mkldnn tensor that no state dict or .to() should touch.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def layout_rows(dtype: torch.dtype) -> int:
    """The batch a packed weight is laid out for: one copy of the weights holds one layout, so one choice serves
    every M. 16 on CPUs with AVX-512 (torch's capability) and for bfloat16, where it was as fast as 1 at M = 1
    and faster above it; 1 for float32 elsewhere, where 16 ran M = 2-40 20-40% faster but M = 1 about 25%
    slower (a 2-core AVX2 EPYC). Whole forwards of the 1.5B on a 2-core AVX512_BF16 Xeon, 16 against 1, in
    turn: bfloat16 1 x 1 1.00x, 8 x 1 0.97x, 8 x 5 0.85x, 16 x 5 0.91x, 7 x 5 + p120 0.84x; float32 1.01x,
    0.88x, 0.97x, 0.97x."""
    return 16 if dtype == torch.bfloat16 or torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 1


class PanelLinear(nn.Module):
    """y = x @ W.T + b with W packed once, at load, into panels of PANEL output columns (float32, or bfloat16; the
    numba path's projection where panels_here(dtype), and built on any AVX-512 CPU for that choice's timing, tests
    and `specedge-bench engine`): the numba kernel's panel product, for any number of rows. Each value of y is one
    sum over K in order, in float32 (bfloat16 weights and x widen exactly, and y rounds once, at the end), so a
    row's bits do not depend on the rows beside it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        compiled = panel_kernel(weight.dtype)
        assert compiled is not None, "PanelLinear is built only where the panels compiled"
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not parameters: the model's state dict keeps its own names for these weights.
        self.panels = pack_panels(weight.detach(), int(compiled.PANEL))  # [panels, in, PANEL]
        self.bias = None if bias is None else bias.detach().contiguous()
        self._panels = kernel_array(self.panels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead, dtype = x.shape[:-1], x.dtype
        x = x.reshape(-1, self.in_features).float().contiguous()  # bfloat16: widened, exactly (x is small)
        y = _kernel_product(lambda kernel, out: kernel.panel_matmul(x.numpy(), self._panels, out), x, self, dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PairPanelLinear(nn.Module):
    """y = x @ W.T + b for a bfloat16 W held once, as oneDNN packs it (PackedLinear), read two ways
    (`--matmul onednn-numba`): products of up to the kernel's MAX_ROWS_PAIRS rows run its panel product over the
    packed bytes, larger ones oneDNN's own GEMM. On CPUs with AVX512_BF16 but not AMX (Zen 4) oneDNN lays a bfloat16
    weight out as panels of PANEL output columns with K in pairs ([ceil(N / PANEL), K / 2, PANEL] int32, two weights
    of a column at K = 2s and 2s + 1 in each), and the kernel sums a pair of products a lane (vdpbf16ps), each value
    of y one float32 sum over K in order, whatever M. Where the packed bytes are not that layout (checked whole, at
    load: pair_panels; K not a multiple of 32, which oneDNN pads, is not), every product runs oneDNN's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.onednn = PackedLinear(weight, bias)
        self.bias = self.onednn.bias
        self.panels = pair_panels(self.onednn.packed, weight.detach())  # over the packed memory, or None
        self._panels = None if self.panels is None else self.panels.numpy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features).contiguous()
        compiled = numba_kernel()
        # x's pairs must be bfloat16's: other bits viewed as pairs would misread K (oneDNN's own GEMM says so).
        if (
            self._panels is None
            or compiled is None
            or x.shape[0] > compiled.MAX_ROWS_PAIRS
            or x.dtype != torch.bfloat16
        ):
            y = self.onednn(x)
        else:
            pairs = x.view(torch.int32).numpy()
            y = _kernel_product(lambda kernel, out: kernel.panel_matmul(pairs, self._panels, out), x, self, x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        kernel = "numba and oneDNN" if self.panels is not None else "oneDNN only: not pair panels"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kernel}"
        )


def pair_panels(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed bfloat16 `weight` as an int32 tensor [ceil(N / PANEL), K / 2, PANEL] over the same memory,
    where every weight is where that layout puts it (compared bit for bit, a block of panels at a time), else
    None. The tensor keeps `packed` alive."""
    compiled = numba_kernel()
    out_features, in_features = weight.shape
    if compiled is None or weight.dtype != torch.bfloat16 or in_features % 2:
        return None
    panel = int(compiled.PANEL)
    count = -(-out_features // panel)
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if nbytes != count * panel * in_features * weight.element_size():
        return None
    memory = (ctypes.c_int32 * (nbytes // 4)).from_address(torch.ops.mkldnn.data_ptr(packed))
    memory.packed = packed  # type: ignore[attr-defined]  # torch.frombuffer keeps `memory`, and so `packed`, alive
    panels = torch.frombuffer(memory, dtype=torch.int32).view(count, in_features // 2, panel)
    pairs = weight.contiguous().view(torch.int32)  # [N, K / 2]: each int32 the two weights a panel's int32 holds
    full, rest = divmod(out_features, panel)
    blocks = [(first, min(first + PACK_PANELS, full)) for first in range(0, full, PACK_PANELS)]
    for first, last in blocks + ([(full, full + 1)] if rest else []):
        columns = min(last * panel, out_features) - first * panel
        stored = panels[first:last]
        if columns < panel * (last - first):  # the last panel's missing columns: oneDNN's padding
            stored = stored[:, :, :columns]
        written = pairs[first * panel : first * panel + columns].view(last - first, -1, in_features // 2)
        if not torch.equal(stored, written.transpose(1, 2)):
            return None
    return panels


def pack_panels(weight: torch.Tensor, panel: int) -> torch.Tensor:
    """A float32 or bfloat16 weight [out, in] as [ceil(out / panel), in, panel]: panel p holds output columns
    p * panel .. (p + 1) * panel - 1, its `in` rows of `panel` weights each contiguous, the last panel's missing
    columns zero; bfloat16's in the kernel's PANEL_BFLOAT16_ORDER (panel_order). One new tensor: the original is
    freed with its module."""
    out_features, in_features = weight.shape
    full, rest = divmod(out_features, panel)
    panels = torch.empty(full + (rest > 0), in_features, panel, dtype=weight.dtype)
    order = panel_order(weight.dtype, panel)
    reordered = not torch.equal(order, torch.arange(panel))
    for first in range(0, full, PACK_PANELS):  # bfloat16's reordered copy a block at a time, not the whole weight
        last = min(first + PACK_PANELS, full)
        block = weight[first * panel : last * panel].view(last - first, panel, in_features)
        panels[first:last] = (block[:, order] if reordered else block).transpose(1, 2)
    if rest:
        panels[full].zero_()
        slots = torch.argsort(order)[:rest]  # where each of the last panel's columns is stored
        panels[full, :, slots] = weight[full * panel :].T
    return panels


PACK_PANELS = 256  # panels pack_panels reorders at a time (bfloat16's LM head of the 1.5B: 25 MB, not 467)


def panel_order(dtype: torch.dtype, panel: int) -> torch.Tensor:
    """The column each of a panel's `panel` slots stores: in order for float32, the kernel's PANEL_BFLOAT16_ORDER
    for bfloat16 (pairs that widen to vectors of columns in order)."""
    compiled = numba_kernel()
    if dtype == torch.bfloat16 and compiled is not None and int(compiled.PANEL) == panel:
        return torch.from_numpy(compiled.PANEL_BFLOAT16_ORDER)
    return torch.arange(panel)


class PanelEmbedding(nn.Module):
    """A tied embedding read from its LM head's panels: a token's row is column token % PANEL of panel
    token // PANEL (at its slot in the panel's order), the same values, so the tied table is held once. Over
    PairPanelLinear's pairs, each int32 of the column is two bfloat16 values of the row, in order."""

    def __init__(self, head: PanelLinear | PairPanelLinear):
        super().__init__()
        assert head.panels is not None, "a head that kept no panels keeps its embedding too"
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.panels = head.panels  # the same memory
        self.slots = torch.argsort(panel_order(self.panels.dtype, self.panels.shape[2]))  # column -> slot

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., dim]
        panel = self.panels.shape[2]
        rows = self.panels[token_ids // panel, :, self.slots[token_ids % panel]]
        return rows.view(torch.bfloat16) if rows.dtype == torch.int32 else rows

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, read from the LM head's panels"


class PlainLinear(nn.Module):
    """y = x @ W.T + b with W as loaded (row-major float32, or bfloat16, on a CPU): the numba kernel for up to
    numba_max_rows() rows, oneDNN's GEMM on the same weight for more. bfloat16 products sum in float32 and
    round once, at the end, as oneDNN's do."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not parameters: the model's state dict keeps its own names for these weights.
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self._weight_rows = kernel_array(self.weight)  # the same memory, as the kernel takes it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features).contiguous()
        if x.shape[0] > numba_max_rows(self.weight.dtype):
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        else:
            rows = kernel_array(x)
            y = _kernel_product(lambda kernel, out: kernel.matmul(rows, self._weight_rows, out), x, self, x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _kernel_product(
    product: Callable[[ModuleType, np.ndarray], None],
    x: torch.Tensor,
    linear: PanelLinear | PairPanelLinear | PlainLinear,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`linear`'s y for x's rows by the numba kernel: product(kernel, y) sums into a float32 y on torch's threads,
    then the bias is added and y rounds once, to dtype (bfloat16's one rounding)."""
    compiled = numba_kernel()
    assert compiled is not None, f"{type(linear).__name__} runs the kernel only where it compiled"
    y = torch.empty(x.shape[0], linear.out_features, dtype=torch.float32)
    compiled.set_threads(torch.get_num_threads())
    product(compiled, y.numpy())
    if linear.bias is not None:
        y += linear.bias
    return y.to(dtype)


@functools.cache
def numba_kernel() -> ModuleType | None:
    """server/_forward_numba.py compiled, or None where numba is missing or fails to compile."""
    return load_kernel("_forward_numba", "matrix products take another path", "warm_up_matmul")


@functools.cache
def panel_kernel(dtype: torch.dtype = torch.float32) -> ModuleType | None:
    """server/_forward_numba.py with its panel product compiled and checked for weights of `dtype`, or None where
    it cannot run: no AVX-512, or no kernel. warm_up_matmul checks float32's panels only where they are the default
    (PANELS); bfloat16's are checked for a bfloat16 server alone."""
    compiled = numba_kernel()
    if compiled is None or not compiled.AVX512:
        return None
    if dtype == torch.bfloat16:
        return load_kernel("_forward_numba", "bfloat16's panel product cannot run", "warm_up_panels_bfloat16")
    if compiled.PANELS:  # warm_up_matmul has checked them
        return compiled
    return load_kernel("_forward_numba", "the panel product cannot run", "warm_up_panels")


def numba_max_rows(dtype: torch.dtype = torch.float32) -> int:
    """PlainLinear's products of up to this many rows run the numba kernel, larger ones oneDNN's GEMM (0: no kernel
    here). PanelLinear's run the kernel at any size."""
    compiled = numba_kernel()
    if compiled is None:
        return 0
    return int(compiled.MAX_ROWS_BFLOAT16 if dtype == torch.bfloat16 else compiled.MAX_ROWS)


def numba_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the numba path cannot run here, or None when it can."""
    if device.type != "cpu":
        return f"the numba kernel is for CPUs; {device.type} uses its own kernels"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the numba kernel takes float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN for the larger products"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 instructions oneDNN can use for the larger products"
    if (compiled := numba_kernel()) is None:
        return "numba is missing or could not compile its kernel (logged above)"
    if dtype == torch.bfloat16 and not compiled.DPBF16:
        return "the numba kernel's bfloat16 products need AVX512_BF16, which this CPU lacks"
    if dtype == torch.bfloat16 and numba_bfloat16_kernel() is None:
        return "numba could not compile the kernel's bfloat16 products (logged above)"
    return None


@functools.cache
def numba_bfloat16_kernel() -> ModuleType | None:
    """The kernel with its bfloat16 products compiled too (a bfloat16 server's only), or None."""
    return load_kernel("_forward_numba", "bfloat16 products take another path", "warm_up_matmul_bfloat16")


def onednn_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the oneDNN path cannot run here, or None when it can."""
    if device.type != "cpu":
        return f"oneDNN packing is for CPUs; {device.type} uses its own kernels"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 instructions oneDNN can use"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN packing takes float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    return None


def pairs_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `--matmul onednn-numba` cannot run here, or None when it can."""
    if dtype != torch.bfloat16:
        return f"it reads oneDNN's bfloat16 layout; {str(dtype).removeprefix('torch.')} takes numba or onednn"
    if reason := onednn_unavailable(device, dtype) or numba_unavailable(device, dtype):
        return reason
    compiled = pairs_kernel()
    if compiled is None:
        return "numba could not compile the kernel's bfloat16 pairs (logged above)"
    if not compiled.PAIRS:
        return "with AMX, oneDNN runs bfloat16 in its tiles, faster than the kernel from 9 rows: use onednn"
    if not pair_layout_here():
        return "oneDNN lays bfloat16 weights out otherwise on this CPU, so the kernel cannot read them"
    return None


@functools.cache
def pairs_kernel() -> ModuleType | None:
    """The kernel with its panel product over bfloat16 pairs compiled and checked, or None."""
    return load_kernel("_forward_numba", "bfloat16 products take oneDNN alone", "warm_up_pairs")


@functools.cache
def pair_layout_here() -> bool:
    """Whether oneDNN packs bfloat16 weights here as pair_panels reads them, on a weight of a partial panel."""
    compiled = numba_kernel()
    probe = torch.randn(2 * int(compiled.PANEL) + 5, 96).to(torch.bfloat16) if compiled is not None else None
    return probe is not None and pair_panels(PackedLinear(probe, None).packed, probe) is not None


def resolve_matmul(kind: str, device: torch.device, dtype: torch.dtype) -> str:
    """The path a server will use: `kind` itself, or what `auto` means on this device and dtype."""
    if kind not in MATMUL_KINDS:
        raise ValueError(f"unknown matmul path {kind!r}; choose one of {', '.join(MATMUL_KINDS)}")
    if kind in ("eager", "fused"):
        return kind
    if kind == "auto" and device.type != "cpu":
        return "fused"
    unavailable = {"numba": numba_unavailable, "onednn": onednn_unavailable, "onednn-numba": pairs_unavailable}
    # auto tries numba, then onednn. For bfloat16, numba only where its panels run (panels_here), faster than oneDNN
    # at every step on a Xeon without AMX; elsewhere oneDNN's packed layout is faster from 8 x 5 on, so onednn-numba
    # (that layout, its small products on the kernel: as fast or faster at every step on Zen 4), then onednn.
    tried = [kind] if kind != "auto" else ["numba", "onednn"]
    if kind == "auto" and dtype == torch.bfloat16 and not panels_here(dtype):  # False where numba cannot run
        tried = ["onednn-numba", "onednn"]
    reasons = {}
    for path in tried:
        reason = unavailable[path](device, dtype)
        if reason is None:
            return path
        if kind == path:
            raise ValueError(f"--matmul {path} cannot run: {reason}")
        reasons[path] = reason
    log.info("matrix products run eager: %s", "; ".join(f"{path}: {why}" for path, why in reasons.items()))
    return "eager"


def prepare(model: CausalLM, kind: str) -> None:
    """Put a loaded model's projections in the form the resolved path `kind` runs, in place."""
    if kind == "onednn":
        pack_for_onednn(model)
    elif kind == "onednn-numba":
        pairs_for_numba(model)
    elif kind == "numba":
        plain_for_numba(model)
    elif kind == "fused":
        fuse_projections(model)


@torch.no_grad()
def fuse_projections(model: CausalLM) -> None:
    """Stack every layer's q/k/v and gate/up into one nn.Linear each, in place (the device's own products)."""
    _replace_projections(model, _linear)


@torch.no_grad()
def pack_for_onednn(model: CausalLM) -> None:
    """Replace every projection of a CausalLM (server/model.py) by its packed, fused form, in place."""
    _replace_projections(model, PackedLinear)
    _own_memory(model)  # what stays unpacked: the embedding, norms


@torch.no_grad()
def pairs_for_numba(model: CausalLM) -> None:
    """Replace every projection of a CausalLM by its packed, fused form that the numba kernel reads too
    (PairPanelLinear), in place; a tied embedding then reads the LM head's panels, so the table is held once."""
    table = model.model.table()
    tied = model.lm_head.weight is table
    _replace_projections(model, PairPanelLinear)
    if tied and isinstance(model.lm_head, PairPanelLinear) and model.lm_head.panels is not None:
        model.model.embed_tokens = PanelEmbedding(model.lm_head)
    kept = sum(isinstance(m, PairPanelLinear) and m.panels is None for m in model.modules())
    if kept:
        log.info("%d projections are not laid out as the kernel reads them: their products all run oneDNN's", kept)
    _own_memory(model)  # what stays unpacked: the norms, an untied embedding


@torch.no_grad()
def plain_for_numba(model: CausalLM) -> None:
    """Replace every projection of a CausalLM (server/model.py) by its fused form for the numba kernel, in place:
    float32 packed into panels where this process runs them (panels_here(); a tied embedding then reads the head's
    panels), else plain (PlainLinear)."""
    _own_memory(model)  # first: the plain forms keep these tensors (a tied head, the embedding's), not copies
    table = model.model.table()
    tied = model.lm_head.weight is table
    _replace_projections(model, numba_projection(table.dtype))
    if tied and isinstance(model.lm_head, PanelLinear):
        model.model.embed_tokens = PanelEmbedding(model.lm_head)


def numba_projection(dtype: torch.dtype) -> Projection:
    """The numba path's projection for weights of this dtype: PanelLinear where this process runs the panels
    (panels_here(dtype)), else PlainLinear."""
    return PanelLinear if panels_here(dtype) else PlainLinear


# One decoder layer's products of the 1.5B ([out, in]: q/k/v, o, gate/up, down; 187 MB), in order, as a forward runs
# them. On a 2-core Xeon one product alone, just after a flush, ran the panels at 1.00-1.11x the plain kernel's time
# at M = 1 and 0.90-0.99x at M = 8 from one timing to the next; a layer's four read 1.01-1.05x at M = 1, 0.79-0.87x
# at M = 8 and 0.78-0.82x at M = 40, run after run, as whole forwards do (8 x 5 0.86x).
PANEL_TIMING_LAYER = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))
PANEL_TIMING_ROWS = (1, 8, 40)  # one decode row, eight, eight verify rounds of four drafts and a bonus token


@functools.cache
def panels_here(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this process's projections of `dtype` run as panels (PanelLinear) or as plain rows (PlainLinear),
    where both can (AVX-512; bfloat16 where the plain rows' vdpbf16ps runs too): the kernel's default unless the
    other form took at most kernels.SWITCH its time (PANEL_TIMING_LAYER at PANEL_TIMING_ROWS; about a second, once
    per machine and dtype: kernels.chosen_form). float32's default, PANELS, is the panels but on Zen 4, whose plain
    kernel was tuned there; on a 2-core Xeon the panels took 0.83-0.88x the plain kernel's time, start after start.
    bfloat16's, PANELS_BFLOAT16, is the panels but on Zen 4 and with AMX, where the plain rows hand products of over
    a few rows to oneDNN's AMX tiles."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    compiled = panel_kernel(dtype)
    if compiled is None or (dtype == torch.bfloat16 and numba_unavailable(torch.device("cpu"), dtype)):
        return False
    panels = compiled.PANELS_BFLOAT16 if dtype == torch.bfloat16 else compiled.PANELS
    default, other = ("panels", "plain rows") if panels else ("plain rows", "panels")
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    chosen = chosen_form(f"{name} products", default, other, compiled, functools.partial(_panel_timings, dtype))
    return chosen == "panels"


def _panel_timings(dtype: torch.dtype = torch.float32) -> list[dict[str, Callable[[], object]]]:
    weights = [torch.full(shape, 0.01, dtype=dtype) for shape in PANEL_TIMING_LAYER]
    forms: dict[str, list[nn.Module]] = {
        "panels": [PanelLinear(weight, None) for weight in weights],
        "plain rows": [PlainLinear(weight, None) for weight in weights],
    }
    return [
        {
            name: functools.partial(_in_order, layer, [torch.randn(m, w.shape[1]).to(dtype) for w in weights])
            for name, layer in forms.items()
        }
        for m in PANEL_TIMING_ROWS
    ]


@torch.inference_mode()
def _in_order(projections: list[nn.Module], xs: list[torch.Tensor]) -> None:
    for projection, x in zip(projections, xs):
        projection(x)


Projection = Callable[[torch.Tensor, torch.Tensor | None], nn.Module]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding these tensors, not copies. A parameter stays itself, so a tied head's weight is still
    the embedding's one parameter (a second Parameter over the same memory would be counted twice)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = _parameter(weight)
    if bias is not None:
        linear.bias = _parameter(bias)
    return linear


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


def _replace_projections(model: CausalLM, make: Projection) -> None:
    """q/k/v and gate/up fused into one product each, so a layer reads its weights in four passes, not seven."""
    for layer in model.model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _fused(make, attn.q_proj, attn.k_proj, attn.v_proj)
        attn.q_proj = attn.k_proj = attn.v_proj = None  # frees the separate weights
        attn.o_proj = _fused(make, attn.o_proj)
        mlp.gate_up_proj = _fused(make, mlp.gate_proj, mlp.up_proj)
        mlp.gate_proj = mlp.up_proj = None
        mlp.down_proj = _fused(make, mlp.down_proj)
        return_freed_memory()  # the layer's replaced weights: else the heap keeps them beside the new (heap.py)
    model.lm_head = _fused(make, model.lm_head)


def _own_memory(model: nn.Module) -> None:
    """Weights may still point into the checkpoint's memory map, which would keep the whole file resident beside
    what the model uses: give them memory of their own."""
    for tensor in (*model.parameters(), *model.buffers()):
        tensor.data = tensor.data.clone()
        return_freed_memory()  # the original, where it was the heap's: else the copies pile up beside them


def _as_linear(module: nn.Module | None) -> nn.Linear:
    if not isinstance(module, nn.Linear):  # e.g. packed already: a model is packed once, as loaded
        raise TypeError(f"only a model's nn.Linear projections are packed, not {type(module).__name__}")
    return module


def _fused(make: Projection, *modules: nn.Module | None) -> nn.Module:
    """One `make` projection over the modules' weights stacked by output; one module's own weight, uncopied."""
    linears = [_as_linear(module) for module in modules]
    if len(linears) == 1:
        return make(linears[0].weight, linears[0].bias)
    weight = torch.cat(tuple(linear.weight for linear in linears))  # [sum(out), in]
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat(tuple(biases))
    return make(weight, bias)
