"""The numba path's decoder layers: a whole layer in one compiled call (server/_forward_numba.py).

On the `numba` matrix path, with `numba` attention, a step of up to numba_max_rows()
tokens whose rows all take the attention kernel (in such a step every row of up to
NUMBA_MAX_NEW tokens, and longer ones over up to NUMBA_MAX_ROW_KEYS keys: see
server/attention.py) runs each layer as one call: the
same product and attention kernels the modules call, with the norms, RoPE, KV
writes, SiLU and residual adds compiled between them. The module path returned to
Python after every product and torch op, and each return ran with caches just
flushed by tens of megabytes of weights. On the 2-core EPYC of bench/results that
glue cost about 50 ms of a 300 ms 1 x 1 forward; compiled, 1 x 1 to 8 x 5 steps
took 0.89-0.93x the modules' time (`specedge-bench engine`, the two in turn).

Other steps (over numba_max_rows() tokens, rows too long for the attention kernel,
tensor-parallel ranks, which all-reduce between a layer's halves)
run the modules. Both compute the same layer; only rounding differs, as between
the kernel and oneDNN's GEMM at the same boundary (server/matmul.py).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from specedge.server.kernels import load_kernel
from specedge.server.matmul import PanelLinear, PlainLinear, numba_max_rows

if TYPE_CHECKING:
    from specedge.server.model import CausalLM, StepBatch

_NONE = np.zeros(0, np.float32)  # an absent bias or per-head norm


@functools.cache
def numba_kernel(panels: bool) -> ModuleType | None:
    """server/_forward_numba.py compiled with its layer over float32 projections as panels (PanelLinear) or plain
    rows (PlainLinear), or None where numba is missing or fails to compile."""
    return load_kernel("_forward_numba", "layers run module by module", "warm_up", panels)


def compile_layers(model: CausalLM) -> None:
    """Give a model on the numba path its compiled layers, where the kernel compiles (else it keeps its modules)."""
    if model.collectives is None:
        layers = CompiledLayers(model)
        if numba_kernel(layers.panels) is not None:
            model.compiled_layers = layers


class CompiledLayers:
    """Every decoder layer's weights as the compiled layer takes them: views of the model's own tensors."""

    def __init__(self, model: CausalLM):
        args = model.args
        self.num_heads = model.partition.num_heads
        self.eps = np.float32(args.rms_norm_eps)
        self.panels = isinstance(model.lm_head, PanelLinear)  # as every projection: plain_for_numba packs all alike
        self.layers = []
        for layer in model.model.decoder_layers():
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = map(_numba, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            self.layers.append(
                (
                    _array(layer.input_layernorm.weight),
                    _weights(qkv),
                    _NONE if qkv.bias is None else qkv.bias.numpy(),
                    _NONE if attn.q_norm is None else _array(attn.q_norm.weight),
                    _NONE if attn.k_norm is None else _array(attn.k_norm.weight),
                    _weights(o),
                    _array(layer.post_attention_layernorm.weight),
                    _weights(gate_up),
                    _weights(down),
                )
            )

    @staticmethod
    def fits(num_tokens: int) -> bool:
        """Whether a step of this many tokens is few enough for the compiled layers (numba_max_rows(): where the
        plain products give way to oneDNN's GEMM; panels take any size, but larger steps are untimed compiled): one
        the layers take if its rows all take the attention kernel (the runner lays such a step's rows out for it)."""
        return num_tokens <= numba_max_rows()

    @staticmethod
    def takes(batch: StepBatch) -> bool:
        """Whether this step runs compiled: few enough tokens for the compiled layers, every row in the
        attention kernel."""
        compiled = batch.compiled
        return compiled is not None and not compiled.others and CompiledLayers.fits(batch.token_ids.shape[0])

    def __call__(
        self,
        x: torch.Tensor,  # [N, hidden] float32, contiguous: updated in place
        cos: torch.Tensor,  # [N, D]
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        batch: StepBatch,
    ) -> None:
        kernel = numba_kernel(self.panels)
        compiled = batch.compiled
        assert kernel is not None and compiled is not None, "CompiledLayers is built where the kernel compiled"
        kernel.set_threads(torch.get_num_threads())
        rows = (compiled.starts, compiled.num_new, compiled.slots, compiled.num_cached)
        tree = (compiled.tree_offsets, compiled.tree_masks)
        residual, cos_rows, sin_rows = x.detach().numpy(), cos.contiguous().numpy(), sin.contiguous().numpy()
        kv_slots, kv_positions = batch.kv_slots.numpy(), batch.kv_positions.numpy()
        task_heads = kernel.task_heads(len(compiled.slots), k_caches[0].shape[2])
        for weights, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down = weights
            kernel.decoder_layer(
                residual,
                self.eps,
                input_norm,
                qkv,
                qkv_bias,
                q_norm,
                k_norm,
                o,
                post_norm,
                gate_up,
                down,
                cos_rows,
                sin_rows,
                k_cache.numpy(),
                v_cache.numpy(),
                kv_slots,
                kv_positions,
                *rows,
                *tree,
                task_heads,
                self.num_heads,
                compiled.tiles,  # as the module path's attention takes them: a token's bits whatever its step
            )


def _array(weight: torch.Tensor) -> np.ndarray:
    return weight.detach().numpy()  # the same memory


def _numba(projection: torch.nn.Module | None) -> PanelLinear | PlainLinear:
    if isinstance(projection, PanelLinear) or (
        isinstance(projection, PlainLinear) and projection.weight.dtype == torch.float32
    ):
        return projection
    raise TypeError("the compiled layer takes the numba path's fused float32 projections")


def _weights(projection: PanelLinear | PlainLinear) -> np.ndarray:
    """A projection's weights as the compiled layer takes them: PanelLinear's panels or PlainLinear's rows."""
    return (projection.panels if isinstance(projection, PanelLinear) else projection.weight).numpy()
