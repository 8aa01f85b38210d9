"""Text <-> token ids on the edge, for either model format.

The edge turns the user's chat into prompt ids (which it sends to the server)
and turns committed ids back into text. Both directions must match the
target's tokenizer exactly; the fingerprint lets the handshake check that.

A GGUF edge has no torch and no transformers, so `GGUFTokenizer` works from
the GGUF file alone: llama.cpp loads only its vocabulary, and the chat
template stored in its metadata is rendered with jinja2 the way transformers
renders it.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import pathlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, cast

from specedge.tokens import TokenizerFingerprint, fingerprint_from_gguf, fingerprint_from_hf

if TYPE_CHECKING:
    import jinja2
    from transformers import BatchEncoding

    from specedge.registry import ResolvedModel


class EdgeTokenizer(Protocol):
    fingerprint: TokenizerFingerprint
    eos_token_ids: frozenset[int]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids for `messages`, ending with the assistant's turn opener."""
        ...

    def encode(self, text: str) -> list[int]:
        """Ids of raw text; special-token text becomes the special token.

        A BOS is prepended only where the model's own metadata asks for one.
        """
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens rendered, invalid UTF-8 replaced."""
        ...


class GGUFTokenizer:
    """Tokenizer of a .gguf file, through llama.cpp's own vocabulary code."""

    def __init__(self, path: str | pathlib.Path):
        import llama_cpp

        from specedge.edge_client.llama_log import route_llama_logs_to_logging

        route_llama_logs_to_logging()
        self._llama_cpp = llama_cpp
        # vocab_only skips the weights: ~60 MB and well under a second even
        # for a 150k-token vocabulary.
        self._vocab_model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self._vocab = llama_cpp.llama_model_get_vocab(self._vocab_model.model)
        self._num_vocab = self._vocab_model.n_vocab()
        self.fingerprint = fingerprint_from_gguf(path)
        self.eos_token_ids = frozenset(self.fingerprint.eos_token_ids)
        template = self._vocab_model.metadata.get("tokenizer.chat_template")
        self._chat_template = compile_chat_template(template) if template is not None else None
        self._path = pathlib.Path(path)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self._chat_template is None:
            raise ValueError(f"{self._path.name} has no tokenizer.chat_template in its metadata")
        text = self._chat_template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self._special_text(self._vocab_model.token_bos()),
            eos_token=self._special_text(self._vocab_model.token_eos()),
        )
        # The template writes BOS itself where the model wants one, so none is added here.
        return self._vocab_model.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def encode(self, text: str) -> list[int]:
        # add_bos=True means "if the vocabulary's add_bos flag says so" in llama.cpp.
        return self._vocab_model.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def decode(self, token_ids: Sequence[int]) -> str:
        # Not Llama.detokenize: in 0.3.16 and 0.3.36 it renders each token into a 32-byte
        # buffer and silently mangles longer pieces (runs of spaces or "=" in
        # code vocabularies). llama_detokenize reports the size it needs.
        # An unknown id would abort the process inside llama.cpp, hence the check.
        if any(not 0 <= token_id < self._num_vocab for token_id in token_ids):
            raise ValueError(f"token ids outside the vocabulary [0, {self._num_vocab})")
        ids = (self._llama_cpp.llama_token * len(token_ids))(*token_ids)
        size = max(64, 8 * len(token_ids))
        for _ in range(2):
            buffer = ctypes.create_string_buffer(size)
            written = self._llama_cpp.llama_detokenize(self._vocab, ids, len(token_ids), buffer, size, False, True)
            if written >= 0:
                return buffer.raw[:written].decode("utf-8", errors="replace")
            size = -written
        raise RuntimeError(f"llama_detokenize failed for {len(token_ids)} tokens")

    def _special_text(self, token_id: int) -> str:
        if token_id < 0:  # llama.cpp's "no such token"
            return ""
        return self.decode([token_id])


class HFTokenizer:
    """A transformers tokenizer from a model directory (or one hub snapshot)."""

    def __init__(self, model_dir: str | pathlib.Path, vocab_size: int | None = None):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if vocab_size is None:
            vocab_size = config_vocab_size(model_dir)
        self.fingerprint = fingerprint_from_hf(self._tokenizer, vocab_size=vocab_size)
        self.eos_token_ids = frozenset(self.fingerprint.eos_token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        # transformers 5 returns a BatchEncoding when tokenize=True (its hint lists every call's return type).
        encoding = cast(
            "BatchEncoding",
            self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True),
        )
        return list(encoding["input_ids"])

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)  # type: ignore[return-value]  # a str for one sequence; the hint includes a batch's list


def config_vocab_size(model_dir: str | pathlib.Path) -> int:
    """Width of the model's logits, from its config.json (padding included)."""
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    # Multimodal configs keep the language model's settings in text_config.
    vocab_size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if vocab_size is None:
        raise ValueError(f"{model_dir}/config.json names no vocab_size")
    return int(vocab_size)


def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a Hugging Face chat template the way transformers does.

    Same sandbox, whitespace handling, extension and helpers as transformers'
    own renderer, so that a GGUF edge and an HF edge build the same prompt
    from the same template. Templates inside model files are untrusted code,
    hence the sandbox and the jinja2 floor (older versions have escapes).
    """
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    leading_numbers = (re.match(r"\d*", part) for part in jinja2.__version__.split(".")[:3])  # "3", "1", "6rc1"
    if tuple(int(number.group() or 0) if number else 0 for number in leading_numbers) < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2>=3.1.6 (sandbox fixes); found {jinja2.__version__}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # Jinja's own tojson escapes HTML characters, which a prompt must not.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(date_format: str) -> str:
        return datetime.datetime.now().strftime(date_format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


_LOADERS: Mapping[str, Callable[[ResolvedModel, int | None], EdgeTokenizer]] = {
    "gguf": lambda resolved, vocab_size: GGUFTokenizer(resolved.path),  # the file knows its own width
    "hf": lambda resolved, vocab_size: HFTokenizer(resolved.path, vocab_size),
}


def load_tokenizer(resolved: ResolvedModel, vocab_size: int | None = None) -> EdgeTokenizer:
    """The tokenizer of a resolved model. `vocab_size` overrides an HF config's logit width."""
    try:
        loader = _LOADERS[resolved.format]
    except KeyError:
        raise ValueError(
            f"no tokenizer for model format {resolved.format!r} ({resolved.name}); known: {', '.join(_LOADERS)}"
        ) from None
    return loader(resolved, vocab_size)
