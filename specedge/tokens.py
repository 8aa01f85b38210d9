"""Tokenizer fingerprints: the handshake's guard against silent id mismatches.

A draft and a target can only cooperate when the same id means the same token
on both sides. Sizes alone do not prove that (Qwen pads its logits to 151936
or 152064 rows around the same 151665 tokens), so the fingerprint hashes every
real vocabulary entry and keeps the padded width beside it.

Both a GGUF file (read with the `gguf` package, no torch needed, so a
GGUF-only edge can compute it) and a Hugging Face tokenizer give the same
fingerprint for the same vocabulary: GGUF stores the tokenizer's own strings,
and marks padding rows as UNUSED.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Iterable, Mapping


class IncompatibleTokenizer(Exception):
    """The draft's and the target's token ids do not mean the same tokens."""


@dataclasses.dataclass(frozen=True)
class TokenizerFingerprint:
    vocab_size: int  # width of the model's logits, padding included
    num_tokens: int  # real vocabulary entries hashed into vocab_sha256
    vocab_sha256: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


def _hash_vocab(tokens_by_id: Iterable[tuple[int, str]]) -> tuple[int, str]:
    digest = hashlib.sha256()
    count = 0
    for token_id, token in sorted(tokens_by_id):
        digest.update(f"{token_id}\t{token}\n".encode("utf-8", "surrogatepass"))
        count += 1
    return count, digest.hexdigest()


def fingerprint_from_vocab(
    vocab: Mapping[str, int], *, vocab_size: int, bos_token_id: int | None, eos_token_ids: Iterable[int]
) -> TokenizerFingerprint:
    """Fingerprint from a token -> id mapping such as `tokenizer.get_vocab()`."""
    num_tokens, sha = _hash_vocab((token_id, token) for token, token_id in vocab.items())
    return TokenizerFingerprint(
        vocab_size=max(vocab_size, num_tokens),
        num_tokens=num_tokens,
        vocab_sha256=sha,
        bos_token_id=bos_token_id,
        eos_token_ids=tuple(sorted(set(eos_token_ids))),
    )


def fingerprint_from_hf(tokenizer, *, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> TokenizerFingerprint:
    """Fingerprint of a transformers tokenizer serving a model with `vocab_size` logits."""
    eos = set(eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return fingerprint_from_vocab(
        tokenizer.get_vocab(), vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id, eos_token_ids=eos
    )


# gguf.TokenType.UNUSED: the rows llama.cpp's converter adds to pad the vocabulary.
_GGUF_UNUSED = 5


def fingerprint_from_gguf(path: str | pathlib.Path, cache_dir: pathlib.Path | None = None) -> TokenizerFingerprint:
    """Fingerprint of a GGUF file's tokenizer, cached beside the model cache.

    Parsing GGUF metadata takes ~15 s for a 150k-token vocabulary, so the
    result is kept in `cache_dir` keyed by the file's path, size and mtime.
    """
    from specedge.registry import default_cache_dir, file_cache_key

    path = pathlib.Path(path).resolve()
    cache_file = (cache_dir or default_cache_dir()) / "fingerprints" / f"{file_cache_key(path)}.json"
    try:
        cached = json.loads(cache_file.read_text())
        return TokenizerFingerprint(**{**cached, "eos_token_ids": tuple(cached["eos_token_ids"])})
    except (OSError, ValueError, TypeError, KeyError):
        pass
    fingerprint = _read_gguf_fingerprint(path)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    partial = cache_file.with_suffix(f".partial-{os.getpid()}")
    partial.write_text(json.dumps(dataclasses.asdict(fingerprint)))
    os.replace(partial, cache_file)
    return fingerprint


def _read_gguf_fingerprint(path: pathlib.Path) -> TokenizerFingerprint:
    from gguf import GGUFReader  # numpy-only; imported lazily to keep CLIs fast

    reader = GGUFReader(str(path))
    fields = reader.fields

    def scalar(key: str) -> int | None:
        field = fields.get(key)
        return int(field.parts[field.data[0]][0]) if field is not None else None

    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type")
    entries = []
    for token_id, part_index in enumerate(tokens.data):
        if types is not None and int(types.parts[types.data[token_id]][0]) == _GGUF_UNUSED:
            continue
        entries.append((token_id, bytes(tokens.parts[part_index]).decode("utf-8", "surrogateescape")))
    num_tokens, sha = _hash_vocab(entries)
    eos = scalar("tokenizer.ggml.eos_token_id")
    eot = scalar("tokenizer.ggml.eot_token_id")
    return TokenizerFingerprint(
        vocab_size=len(tokens.data),
        num_tokens=num_tokens,
        vocab_sha256=sha,
        bos_token_id=scalar("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(sorted({t for t in (eos, eot) if t is not None})),
    )


def check_compatible(draft: TokenizerFingerprint, target: TokenizerFingerprint) -> None:
    """Raise IncompatibleTokenizer, naming both sides, unless ids mean the same tokens.

    The padded widths may differ (same tokens, different padding). Special ids
    are not compared: the server alone decides when generation stops.
    """
    if draft.vocab_sha256 == target.vocab_sha256 and draft.num_tokens == target.num_tokens:
        return
    if draft.vocab_size != target.vocab_size:
        raise IncompatibleTokenizer(f"draft vocab {draft.vocab_size} != target vocab {target.vocab_size}")
    raise IncompatibleTokenizer(
        f"draft and target vocabularies differ: {draft.num_tokens} tokens (sha256 {draft.vocab_sha256[:12]}) "
        f"!= {target.num_tokens} tokens (sha256 {target.vocab_sha256[:12]})"
    )
