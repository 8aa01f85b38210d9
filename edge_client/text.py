"""Committed token ids -> streamed text: incremental detokenizing and stop strings.

Decoding the whole answer on every new token is quadratic; decoding tokens
one by one breaks multi-byte characters and tokenizers that drop a word's
leading space at the start of a decode. So, as vLLM does, each update decodes
a short window twice, with and without the new tokens, and emits the
difference; both decodes start at the same token, so any start-of-text quirk
cancels out, and text ending in an unfinished UTF-8 character waits.

    tokens  [Hel][lo][ w][\xe4\xbd][\xa0]
    feed [Hel]       -> "Hel"
    feed [lo][ w]    -> "lo w"
    feed [\xe4\xbd]  -> ""      (half of a character: held back)
    feed [\xa0]      -> "你"
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class IncrementalText:
    def __init__(self, tokenizer: Decoder, skip_ids: Iterable[int] = ()):
        self._tokenizer = tokenizer
        self._skip_ids = frozenset(skip_ids)  # e.g. end-of-turn tokens: never shown
        self._tokens: list[int] = []
        self._prefix_offset = 0  # the window starts here
        self._read_offset = 0  # tokens before this are emitted

    def feed(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens complete; "" while a character is unfinished."""
        self._tokens += [t for t in token_ids if t not in self._skip_ids]
        emitted, window = self._window()
        if len(window) <= len(emitted) or window.endswith("\ufffd"):
            return ""
        return self._emit(emitted, window)

    def flush(self) -> str:
        """What was held back, once the answer is over (an unfinished character decodes as U+FFFD)."""
        return self._emit(*self._window())

    def _window(self) -> tuple[str, str]:
        """The window's text without and with the tokens not emitted yet."""
        decode, window = self._tokenizer.decode, self._tokens[self._prefix_offset :]
        return decode(window[: self._read_offset - self._prefix_offset]), decode(window)

    def _emit(self, emitted: str, window: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return window[len(emitted) :]


class StopStrings:
    """Cuts the text at the first stop string, holding back what could still become one."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of `text` that is safe to show now."""
        if self.stopped:
            return ""
        self._pending += text
        hits = [i for i in (self._pending.find(stop) for stop in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            shown, self._pending = self._pending[: min(hits)], ""
            return shown
        hold = max((_overlap(self._pending, stop) for stop in self.stops), default=0)
        shown, self._pending = self._pending[: len(self._pending) - hold], self._pending[len(self._pending) - hold :]
        return shown

    def flush(self) -> str:
        """What was held back, once the answer is over without a stop string."""
        shown, self._pending = ("" if self.stopped else self._pending), ""
        return shown


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for length in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
