"""Load a target checkpoint into the compact model, through transformers.

transformers reads every supported format (safetensors, sharded, GGUF) and
dequantizes GGUF; we then take its tensors as they are (no copy) into
`CausalLM`. Dequantizing a 1.5B GGUF takes about a minute, so the result is
saved once as safetensors in the cache dir and reloaded from there in seconds.

A tensor-parallel rank does not go through transformers' loader: it reads its
slices of those safetensors itself (server/parallel.py), so no rank holds the
whole model. Only the one-time GGUF conversion does, in CPU RAM, before any
rank starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import shutil

import torch
from filelock import FileLock

from specedge.registry import ResolvedModel, default_cache_dir, file_cache_key
from specedge.server.attention import resolve_attention, tiles_here
from specedge.server.heap import return_freed_memory
from specedge.server.layer_kernel import compile_layers
from specedge.server.matmul import panels_here, prepare, resolve_matmul
from specedge.server.model import CausalLM, Collectives, ModelArgs, rope_frequencies
from specedge.server.parallel import load_shard
from specedge.tokens import TokenizerFingerprint, fingerprint_from_gguf, fingerprint_from_hf

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Target:
    name: str
    model: CausalLM
    fingerprint: TokenizerFingerprint
    eos_token_ids: frozenset[int]
    matmul: str = "eager"  # the path its matrix products take (server/matmul.py)


def weights_dir(resolved: ResolvedModel, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """An HF directory holding the checkpoint; a GGUF is dequantized into the cache once."""
    if resolved.format == "gguf":
        return _converted_from_gguf(resolved.path, cache_dir or default_cache_dir())
    return resolved.path


def load_target(
    resolved: ResolvedModel,
    *,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: pathlib.Path | None = None,
    collectives: Collectives | None = None,
    matmul: str = "eager",
    attention: str = "auto",
) -> Target:
    """The whole model; with `collectives` (a tensor-parallel rank's), only that rank's share of it.

    `matmul`: the path its matrix products take (server/matmul.py); `auto` picks the fastest here.
    `attention`: how rows attend to their KV slots (server/attention.py); `auto` picks by device.
    """
    cache_dir = cache_dir or default_cache_dir()
    kind = resolve_matmul(matmul, device, dtype)
    attention = resolve_attention(attention, device, dtype)
    # The kernel's forms on AVX-512 (panels or plain rows, tiles or loops) are timed now, before the weights load,
    # so that the memory the timing takes is free again by then.
    if kind == "numba":
        panels_here(dtype)  # prepare() packs what it chose
    tiles = attention == "numba" and tiles_here()
    target = _load(resolved, device=device, dtype=dtype, cache_dir=cache_dir, collectives=collectives)
    prepare(target.model, kind)
    return_freed_memory()  # the load's freed originals and copies: memory of the process's heap, not the model's
    target.matmul = kind
    target.model.attention = attention
    target.model.attention_tiles = tiles
    if kind == "numba" and attention == "numba" and dtype == torch.float32:
        compile_layers(target.model)  # whole layers in one call: the two kernels with their glue compiled
    return target


def _load(
    resolved: ResolvedModel,
    *,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: pathlib.Path,
    collectives: Collectives | None,
) -> Target:
    if resolved.format == "random":
        if collectives is not None:
            raise ValueError("a random:PRESET target runs on one device; leave out --tp")
        return _random_target(resolved, device=device, dtype=dtype, cache_dir=cache_dir)
    hf_dir = weights_dir(resolved, cache_dir)
    fingerprint = fingerprint_from_gguf(resolved.path, cache_dir) if resolved.format == "gguf" else None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if collectives is None:
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
        config = hf_model.config
        model = _from_hf(hf_model).to(device).eval()
        del hf_model
    else:
        config = AutoConfig.from_pretrained(hf_dir)
        model = load_shard(hf_dir, collectives.rank, collectives.world_size, collectives, device=device, dtype=dtype)
    if fingerprint is None:
        fingerprint = fingerprint_from_hf(AutoTokenizer.from_pretrained(hf_dir), vocab_size=config.vocab_size)
    eos = set(fingerprint.eos_token_ids)
    config_eos = config.eos_token_id
    eos.update(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    return Target(name=resolved.name, model=model, fingerprint=fingerprint, eos_token_ids=frozenset(eos))


def _random_target(resolved: ResolvedModel, *, device: torch.device, dtype: torch.dtype, cache_dir) -> Target:
    """Random weights of a named shape; the tokenizer from `resolved.path` (see server/random_model.py)."""
    from specedge.server.random_model import build_random, preset_of

    preset = preset_of(resolved.name)
    if resolved.path.suffix == ".gguf":
        fingerprint = fingerprint_from_gguf(resolved.path, cache_dir)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolved.path)
        fingerprint = fingerprint_from_hf(tokenizer, vocab_size=len(tokenizer))
    model, fingerprint = build_random(preset, fingerprint, device=device, dtype=dtype)
    return Target(
        name=resolved.name, model=model, fingerprint=fingerprint, eos_token_ids=frozenset(fingerprint.eos_token_ids)
    )


def _from_hf(hf_model) -> CausalLM:
    """Move an HF causal LM's parameters into a CausalLM without copying them."""
    args = ModelArgs.from_hf_config(hf_model.config)
    inv_freq, scaling = rope_frequencies(hf_model.config, args.head_dim)
    with torch.device("meta"):
        model = CausalLM(args, inv_freq, scaling)
    state = hf_model.state_dict()
    if args.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.table()
    model.inv_freq = inv_freq.to(model.model.table().device)
    return model


def _converted_from_gguf(gguf_path: pathlib.Path, cache_dir: pathlib.Path) -> pathlib.Path:
    """An HF safetensors directory holding the dequantized GGUF, made once."""
    out_dir = cache_dir / "converted" / f"{gguf_path.stem}-{file_cache_key(gguf_path)}"
    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (torchrun ranks, or servers started together); the others wait and reuse it.
    with FileLock(f"{out_dir}.lock"):
        if not (out_dir / "config.json").exists():
            _convert(gguf_path, out_dir)
    return out_dir


def _convert(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM

    log.info("dequantizing %s once (about a minute per billion parameters); cached in %s", gguf_path.name, out_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    hf_model.hf_quantizer = None  # type: ignore[assignment]  # transformers hints it as always set
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    partial = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    hf_model.save_pretrained(partial)
    os.replace(partial, out_dir)
