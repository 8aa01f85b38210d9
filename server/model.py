"""A compact Llama / Qwen2 / Qwen3-family decoder over packed rows and a slotted KV cache.

One forward serves any mix of sessions: each row is one session's new tokens
(a prompt chunk, a decode step, or a draft tree). Every row's tokens sit in
one packed [num_tokens, hidden] tensor for the embedding, norms, projections,
MLP and LM head, so no padding is ever computed; each row writes its tokens
into its own KV slot and attends to that slot in place (its prefix plus
whatever of its own new tokens the mask allows). Module names mirror transformers'
(`model.layers.N.self_attn.q_proj`, ...) so its state dicts load as they are.

Under tensor parallelism each rank builds the same module tree over its
`Partition` (fewer heads, MLP columns and vocabulary rows) and combines partial
results through `Collectives`; a single process has neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn
from torch.nn import functional as F

from specedge.server.attention import CompiledRows, FlexLayout, flex_attention, row_attention

if TYPE_CHECKING:
    from specedge.server.layer_kernel import CompiledLayers
    from specedge.server.matmul import PanelEmbedding

# RoPE variants whose frequencies do not depend on the sequence length; the
# dynamic ones would make a token's result depend on its batch.
_STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "proportional"}


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's queries and keys, before RoPE

    @classmethod
    def from_hf_config(cls, config) -> ModelArgs:
        supported = {"llama", "qwen2", "qwen3"}
        if config.model_type not in supported:
            raise ValueError(
                f"unsupported architecture {config.model_type!r}; supported: {', '.join(sorted(supported))}"
            )
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=config.model_type == "qwen3",
            tie_word_embeddings=bool(config.tie_word_embeddings),
            max_position_embeddings=config.max_position_embeddings,
        )


@dataclasses.dataclass(frozen=True)
class Partition:
    """The share of the model one process holds: all of it (`whole`), or one tensor-parallel rank's.

    Each range is contiguous; server/parallel.py decides them and loads just those weights.
    """

    head_start: int  # query heads [head_start, head_start + num_heads)
    num_heads: int
    kv_head_start: int  # KV heads held (replicated on several ranks when there are fewer than ranks)
    num_kv_heads: int
    intermediate_start: int  # MLP columns
    intermediate_size: int
    vocab_start: int  # embedding and LM-head rows
    num_vocab_rows: int  # may run past the vocabulary on the last rank: zero padding, cut after the gather

    @classmethod
    def whole(cls, args: ModelArgs) -> Partition:
        return cls(0, args.num_heads, 0, args.num_kv_heads, 0, args.intermediate_size, 0, args.vocab_size)


class Collectives(Protocol):
    """How the ranks of a partitioned model combine partial results (server/parallel.py)."""

    rank: int  # this process's, in [0, world_size)
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (same shape on every rank)."""

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[L, num_vocab_rows] on every rank -> [L, ranks * num_vocab_rows] on rank 0, None elsewhere."""


def rope_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and output scaling, computed by transformers' own RoPE code."""
    params = config.rope_parameters or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported (only static types: {sorted(_STATIC_ROPE_TYPES)})")
    if rope_type == "default":
        theta = params["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's tokens from every row, packed: built once per step, shared by every layer.

    Row r owns packed tokens cu_num_tokens[r] .. cu_num_tokens[r + 1]; no padding exists.

        rows: A (cached 7, new [a0 a1 a2]), B (cached 3, new [b0])
        token_ids     = [a0 a1 a2 b0]      cu_num_tokens = [0, 3, 4]
        kv_positions  = [7 8 9 3]          num_keys      = [10, 4]
        row_masks[0]  = [3, 10] (cached columns visible, then the chain's or tree's own mask); row_masks[1] = None
    """

    token_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens] RoPE position (a tree node's depth after the cache)
    kv_slots: torch.Tensor  # [num_tokens] KV slot each token is stored in
    kv_positions: torch.Tensor  # [num_tokens] KV position each token is stored at
    logit_indices: torch.Tensor  # [num_logits] packed index of each token whose logits are wanted
    cu_num_tokens: tuple[int, ...]  # [num_rows + 1] row boundaries in the packed tokens
    slots: tuple[int, ...]  # [num_rows]
    num_keys: tuple[int, ...]  # [num_rows] keys each row attends: its cache plus its new tokens
    row_masks: tuple[torch.Tensor | None, ...]  # [num_rows] [new, num_keys] bool; None: one token sees all
    flex: FlexLayout | None = None  # the whole step's block mask, when attention takes the flex path
    compiled: CompiledRows | None = None  # the rows the numba kernel takes, when attention takes the numba path

    @property
    def num_rows(self) -> int:
        return len(self.slots)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """The partition's heads; under tensor parallelism o_proj's output is this rank's partial sum."""

    def __init__(self, args: ModelArgs, part: Partition):
        super().__init__()
        self.args = args
        self.num_heads, self.num_kv_heads = part.num_heads, part.num_kv_heads
        # nn.Module and Optional: server/matmul.py replaces them by their packed forms, q/k/v by one fused product.
        self.q_proj: nn.Module | None = nn.Linear(args.hidden_size, part.num_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj: nn.Module | None = nn.Linear(
            args.hidden_size, part.num_kv_heads * args.head_dim, bias=args.qkv_bias
        )
        self.v_proj: nn.Module | None = nn.Linear(
            args.hidden_size, part.num_kv_heads * args.head_dim, bias=args.qkv_bias
        )
        self.o_proj: nn.Module = nn.Linear(part.num_heads * args.head_dim, args.hidden_size, bias=False)
        # Per head, so every tensor-parallel rank holds them whole.
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        # server/matmul.py may replace q/k/v with one fused product (one pass over the weights).
        self.qkv_proj: nn.Module | None = None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        k_cache: torch.Tensor,  # [num_slots, max_len, kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, max_len, kv_heads, head_dim]
        batch: StepBatch,
    ) -> torch.Tensor:
        num_tokens, head_dim = x.shape[0], self.args.head_dim
        if self.qkv_proj is not None:
            q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
            q, k, v = self.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None  # not fused
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(num_tokens, -1, head_dim)  # [N, H, D]
        k = k.view(num_tokens, -1, head_dim)  # [N, KVH, D]
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (args.qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_cache[batch.kv_slots, batch.kv_positions] = k.to(k_cache.dtype)
        v_cache[batch.kv_slots, batch.kv_positions] = v.view(num_tokens, -1, head_dim).to(v_cache.dtype)
        if batch.flex is not None:
            out = flex_attention(q, k_cache, v_cache, batch.flex)  # [N, H, D]
        else:
            out = row_attention(
                q,
                k_cache,
                v_cache,
                batch.cu_num_tokens,
                batch.slots,
                batch.num_keys,
                batch.row_masks,
                batch.compiled,
            )
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    """The partition's MLP columns; under tensor parallelism down_proj's output is a partial sum."""

    def __init__(self, args: ModelArgs, part: Partition):
        super().__init__()
        # nn.Module and Optional: server/matmul.py replaces them by their packed forms, gate/up by one fused product.
        self.gate_proj: nn.Module | None = nn.Linear(args.hidden_size, part.intermediate_size, bias=False)
        self.up_proj: nn.Module | None = nn.Linear(args.hidden_size, part.intermediate_size, bias=False)
        self.down_proj: nn.Module = nn.Linear(part.intermediate_size, args.hidden_size, bias=False)
        # server/matmul.py may replace gate/up with one fused product.
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            assert self.gate_proj is not None and self.up_proj is not None  # not fused
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, part: Partition):
        super().__init__()
        self.self_attn = Attention(args, part)
        self.mlp = MLP(args, part)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs, part: Partition):
        super().__init__()
        # Or, on the numba path with a tied head on panels, server/matmul.py's PanelEmbedding.
        self.embed_tokens: nn.Embedding | PanelEmbedding = nn.Embedding(part.num_vocab_rows, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, part) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def decoder_layers(self) -> Iterable[DecoderLayer]:
        return cast("Iterable[DecoderLayer]", self.layers)  # nn.ModuleList is typed as holding any Module

    def table(self) -> torch.Tensor:
        """The embedding's table, as loaded (before the numba path may move a tied one onto its head's panels)."""
        if not isinstance(self.embed_tokens, nn.Embedding):
            raise TypeError("the embedding reads its LM head's panels: it has no table of its own")
        return self.embed_tokens.weight


class CausalLM(nn.Module):
    """The whole model, or with `partition` and `collectives` one tensor-parallel rank's share of it.

    `args` always describes the whole model (vocab_size is the real vocabulary); `partition` what
    this process holds.
    """

    inv_freq: torch.Tensor  # a buffer (register_buffer): typed here, as nn.Module's attributes are not

    def __init__(
        self,
        args: ModelArgs,
        inv_freq: torch.Tensor,
        rope_scaling: float,
        partition: Partition | None = None,
        collectives: Collectives | None = None,
    ):
        super().__init__()
        self.args = args
        self.attention = "rows"  # or "numba" or "flex": how rows attend to their KV slots (server/attention.py)
        self.attention_tiles = False  # numba attention through the kernel's tiles, else its loops (tiles_here())
        self.partition = partition or Partition.whole(args)
        self.collectives = collectives
        self.model = Backbone(args, self.partition)
        self.lm_head: nn.Module = nn.Linear(args.hidden_size, self.partition.num_vocab_rows, bias=False)  # or packed
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.table()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scaling = rope_scaling
        # Set on the numba path (server/layer_kernel.py), never on a tensor-parallel rank: the steps it takes run
        # each layer in one compiled call.
        self.compiled_layers: CompiledLayers | None = None

    def forward(
        self,
        batch: StepBatch,
        k_caches: list[torch.Tensor],  # per layer: [num_slots, max_len, kv_heads, head_dim]
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """Logits of the tokens named by batch.logit_indices: [num_logits, vocab] in float32.

        None on a tensor-parallel rank other than 0: its share of the logits went to rank 0.
        """
        x = self._embed(batch.token_ids)  # [N, hidden]
        freqs = batch.positions[:, None].float() * self.inv_freq  # [N, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.rope_scaling).to(x.dtype)[:, None]  # [N, 1, D]
        sin = (angles.sin() * self.rope_scaling).to(x.dtype)[:, None]
        compiled = self.compiled_layers
        if compiled is not None and compiled.takes(batch):
            compiled(x, cos[:, 0], sin[:, 0], k_caches, v_caches, batch)  # x in place
        else:
            for layer, k_cache, v_cache in zip(self.model.decoder_layers(), k_caches, v_caches):
                x = x + self._sum(layer.self_attn(layer.input_layernorm(x), cos, sin, k_cache, v_cache, batch))
                x = x + self._sum(layer.mlp(layer.post_attention_layernorm(x)))
        hidden = self.model.norm(x[batch.logit_indices])  # [L, hidden]
        logits = self.lm_head(hidden).float()  # [L, num_vocab_rows]
        if self.collectives is None:
            return logits
        gathered = self.collectives.gather_vocab(logits)  # [L, ranks * num_vocab_rows] on rank 0
        return None if gathered is None else gathered[:, : self.args.vocab_size]

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A block half's output: this rank's partial sum, summed over ranks (one all-reduce)."""
        return partial if self.collectives is None else self.collectives.all_reduce(partial)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        if self.collectives is None:
            return self.model.embed_tokens(token_ids)
        # Vocab-parallel: the one rank holding a token's row contributes it, the others zeros.
        local = token_ids - self.partition.vocab_start
        outside = (local < 0) | (local >= self.partition.num_vocab_rows)
        rows = self.model.embed_tokens(local.masked_fill(outside, 0))
        return self.collectives.all_reduce(rows.masked_fill(outside[..., None], 0))
