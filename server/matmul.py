"""How the target's matrix products run: one seam, chosen per device.

- `eager`: the model's own `nn.Linear` layers (MKL on CPU, cuBLAS on CUDA). The
  plain path, kept for comparison and wherever nothing faster applies.
- `onednn` (CPU, float32 or bfloat16): every projection's weight is reordered
  once, at load, into oneDNN's blocked layout, and the original is freed, so
  memory holds one copy (a tied LM head keeps the embedding table beside its
  packed copy: the embedding lookup needs the plain rows). q/k/v and gate/up
  are fused into one product each, so a layer reads its weights in four
  passes instead of seven. This is the kernel inductor emits under freezing,
  without the compile or its second copy of the weights. On a 2-core AMD EPYC,
  eager MKL streams an 880 MB fp32 weight at 18-20 GB/s at M=1 and 8 GB/s at
  M=5; oneDNN's packed product runs the same at memory speed (see
  `specedge-bench engine` for this machine's figures).
- `auto`: `onednn` where it is available for the device and dtype, else `eager`,
  said in one log line.

The packed kernel rounds differently from MKL (about 2e-4 on outputs of
magnitude 40), so changing the path can change a near-tie greedy token; one
server uses one path for every forward, so speculative and server-only
decoding on it still agree token for token.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from specedge.server.model import CausalLM

log = logging.getLogger(__name__)

MATMUL_KINDS = ("auto", "eager", "onednn")


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int = 1):
        """`rows`: the batch oneDNN lays the weight out for. 1 (the server's) keeps a lone stream's step at
        memory speed; a layout for batches runs M = 2-40 20-40% faster but M = 1 about 25% slower on a 2-core
        AVX2 EPYC (`specedge-bench engine`'s kernel table), and one copy of the weights holds one layout."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Not a parameter or buffer: an opaque mkldnn tensor that no state dict or .to() should touch.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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


def resolve_matmul(kind: str, device: torch.device, dtype: torch.dtype) -> str:
    """The path a server will use: `kind` itself, or what `auto` means on this device and dtype."""
    if kind not in MATMUL_KINDS:
        raise ValueError(f"unknown matmul path {kind!r}; choose one of {', '.join(MATMUL_KINDS)}")
    if kind == "eager":
        return "eager"
    reason = onednn_unavailable(device, dtype)
    if reason is None:
        return "onednn"
    if kind == "onednn":
        raise ValueError(f"--matmul onednn cannot run: {reason}")
    log.info("matrix products run eager: %s", reason)
    return "eager"


@torch.no_grad()
def pack_for_onednn(model: CausalLM) -> None:
    """Replace every projection of a CausalLM (server/model.py) by its packed, fused form, in place."""
    for layer in model.model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _fused(attn.q_proj, attn.k_proj, attn.v_proj)
        attn.q_proj = attn.k_proj = attn.v_proj = None  # frees the plain weights
        attn.o_proj = _packed(attn.o_proj)
        mlp.gate_up_proj = _fused(mlp.gate_proj, mlp.up_proj)
        mlp.gate_proj = mlp.up_proj = None
        mlp.down_proj = _packed(mlp.down_proj)
    model.lm_head = _packed(model.lm_head)
    # What stays unpacked (the embedding, norms) may still point into the checkpoint's memory map,
    # which would keep the whole file resident beside the packed copies: give them memory of their own.
    for tensor in (*model.parameters(), *model.buffers()):
        tensor.data = tensor.data.clone()


def _as_linear(module: nn.Module | None) -> nn.Linear:
    if not isinstance(module, nn.Linear):  # e.g. packed already: a model is packed once, as loaded
        raise TypeError(f"only a model's nn.Linear projections are packed, not {type(module).__name__}")
    return module


def _packed(module: nn.Module | None) -> PackedLinear:
    linear = _as_linear(module)
    return PackedLinear(linear.weight, linear.bias)


def _fused(*modules: nn.Module | None) -> PackedLinear:
    linears = [_as_linear(module) for module in modules]
    weight = torch.cat(tuple(linear.weight for linear in linears))  # [sum(out), in]
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat(tuple(biases))
    return PackedLinear(weight, bias)
