"""Megatron-style tensor parallelism of the compact model: who holds what, and loading just that.

Attention is split by heads: q/k/v are column-parallel (each rank computes its
heads), o_proj row-parallel (each rank multiplies its heads' columns), so the
block's output is a sum over ranks: one all-reduce. The MLP likewise: gate/up
column-parallel, down row-parallel, one all-reduce. The embedding and the LM
head are split by vocabulary rows: a token's embedding comes from the one rank
holding its row (the others add zeros), and rank 0 gathers the logit columns.

    Qwen2.5-1.5B (12 heads, 2 KV heads, MLP 8960, vocab 151936) at --tp 2:
    rank 0: q heads 0-5,  KV head 0, MLP columns 0-4479,    vocab rows 0-75967
    rank 1: q heads 6-11, KV head 1, MLP columns 4480-8959, vocab rows 75968-151935

With fewer KV heads than ranks, each KV head is replicated on the ranks whose
query heads read it (at --tp 4 above: KV head 0 on ranks 0-1, head 1 on 2-3).

Weights are read slice by slice from safetensors (`safe_open` + `get_slice`),
so no rank ever holds the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib

import torch
from torch import distributed as dist

from specedge.server.model import CausalLM, Collectives, ModelArgs, Partition, rope_frequencies

log = logging.getLogger(__name__)


class TensorParallelError(ValueError):
    """The model cannot be split this way, or the machine cannot hold the ranks; the message says why."""


def partition_for(args: ModelArgs, rank: int, world_size: int) -> Partition:
    """Rank `rank`'s share of the model out of `world_size`; raises TensorParallelError if it does not split."""
    n = world_size
    if args.num_heads % n:
        divisors = [d for d in range(1, args.num_heads + 1) if args.num_heads % d == 0]
        raise TensorParallelError(
            f"--tp {n} does not divide the model's {args.num_heads} attention heads; "
            f"use one of {', '.join(map(str, divisors))}"
        )
    if args.num_kv_heads % n and n % args.num_kv_heads:
        raise TensorParallelError(
            f"--tp {n} cannot split the model's {args.num_kv_heads} KV heads: "
            "it must divide them or be a multiple of them"
        )
    if args.intermediate_size % n:
        raise TensorParallelError(f"--tp {n} does not divide the model's MLP width {args.intermediate_size}")
    heads = args.num_heads // n
    if args.num_kv_heads >= n:
        kv_heads, kv_start = args.num_kv_heads // n, rank * (args.num_kv_heads // n)
    else:  # replicated: the KV head that this rank's query heads belong to
        kv_heads, kv_start = 1, rank * heads // (args.num_heads // args.num_kv_heads)
    columns = args.intermediate_size // n
    vocab_rows = -(-args.vocab_size // n)  # ceil: the last rank's share is zero-padded
    return Partition(
        head_start=rank * heads,
        num_heads=heads,
        kv_head_start=kv_start,
        num_kv_heads=kv_heads,
        intermediate_start=rank * columns,
        intermediate_size=columns,
        vocab_start=rank * vocab_rows,
        num_vocab_rows=vocab_rows,
    )


def replication_note(args: ModelArgs, world_size: int) -> str | None:
    """What an operator should know when KV heads are replicated rather than split."""
    if args.num_kv_heads >= world_size:
        return None
    return (
        f"the model has {args.num_kv_heads} KV heads for --tp {world_size}: each KV head is replicated on "
        f"{world_size // args.num_kv_heads} ranks (KV memory per rank as for 1 head)"
    )


def check_splittable(model_dir: pathlib.Path, world_size: int) -> ModelArgs:
    """Before any rank starts: the model in `model_dir` splits `world_size` ways (else TensorParallelError)."""
    from transformers import AutoConfig

    args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(model_dir))
    for rank in range(world_size):
        partition_for(args, rank, world_size)
    if note := replication_note(args, world_size):
        log.info("%s", note)
    return args


class GroupCollectives:
    """`Collectives` over a torch.distributed process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)  # x is a fresh block output: summing in place is safe
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:  # [L, rows] -> [L, ranks * rows]
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(logits, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


@dataclasses.dataclass(frozen=True)
class _Split:
    """Which slice of a checkpoint tensor a rank reads: rows or columns [start, stop)."""

    dim: int
    start: int
    stop: int


def _split_of(name: str, args: ModelArgs, part: Partition) -> _Split | None:
    """The slice of parameter `name` that `part` holds; None: the whole tensor (norms)."""
    d = args.head_dim
    kind = name.split(".")[-2]  # "q_proj" in "model.layers.3.self_attn.q_proj.weight"
    if kind == "q_proj":
        return _Split(0, part.head_start * d, (part.head_start + part.num_heads) * d)
    if kind in ("k_proj", "v_proj"):
        return _Split(0, part.kv_head_start * d, (part.kv_head_start + part.num_kv_heads) * d)
    if kind == "o_proj":
        return _Split(1, part.head_start * d, (part.head_start + part.num_heads) * d)
    if kind in ("gate_proj", "up_proj"):
        return _Split(0, part.intermediate_start, part.intermediate_start + part.intermediate_size)
    if kind == "down_proj":
        return _Split(1, part.intermediate_start, part.intermediate_start + part.intermediate_size)
    if kind in ("embed_tokens", "lm_head"):
        return _Split(0, part.vocab_start, part.vocab_start + part.num_vocab_rows)
    return None


def _tensor_files(model_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise TensorParallelError(
            f"--tp > 1 loads safetensors weights, and {model_dir} has none; "
            "save the model with save_pretrained (safetensors) first"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return {name: single for name in handle.keys()}


def _read_slice(handle, name: str, split: _Split | None) -> torch.Tensor:
    """Only the slice's bytes are read. A vocab share past the vocabulary is zero-padded to its full size."""
    tensor_slice = handle.get_slice(name)
    if split is None:
        return tensor_slice[:]
    stop = min(split.stop, tensor_slice.get_shape()[split.dim])
    tensor = tensor_slice[split.start : stop] if split.dim == 0 else tensor_slice[:, split.start : stop]
    missing = split.stop - split.start - tensor.shape[split.dim]
    if missing:
        padding = list(tensor.shape)
        padding[split.dim] = missing
        tensor = torch.cat([tensor, tensor.new_zeros(padding)], dim=split.dim)
    return tensor


def load_shard(
    model_dir: pathlib.Path,
    rank: int,
    world_size: int,
    collectives: Collectives,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """Rank `rank`'s share of the HF checkpoint in `model_dir`, read slice by slice."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    args = ModelArgs.from_hf_config(config)
    part = partition_for(args, rank, world_size)
    inv_freq, scaling = rope_frequencies(config, args.head_dim)
    with torch.device("meta"):
        model = CausalLM(args, inv_freq, scaling, partition=part, collectives=collectives)
    files = _tensor_files(model_dir)
    sources = {name: name for name in model.state_dict()}  # parameter -> checkpoint tensor
    if args.tie_word_embeddings:
        sources["lm_head.weight"] = "model.embed_tokens.weight"
    missing = sorted(source for source in sources.values() if source not in files)
    if missing:
        raise TensorParallelError(f"{model_dir} lacks {len(missing)} tensors the model needs, e.g. {missing[0]}")
    read: dict[str, torch.Tensor] = {}
    for file in sorted({files[source] for source in sources.values()}):
        with safe_open(file, framework="pt") as handle:
            for source in sorted({s for s in sources.values() if files[s] == file}):
                tensor = _read_slice(handle, source, _split_of(source, args, part))
                read[source] = tensor.to(device=device, dtype=dtype)
    state = {name: read[source] for name, source in sources.items()}
    model.load_state_dict(state, assign=True, strict=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = inv_freq.to(device)
    return model.eval()
