"""One answer as text: committed token ids -> text pieces, cut at stop strings, with token counts.

For front ends that show text (the OpenAI-compatible API). The runtime
commits tokens in bursts (accepted drafts + the server's own token), and a
stop string can end in the middle of one. So with stop strings the burst is
read one token at a time: the answer ends at the token that completed the
stop string, its text ends before the stop string, and the completion counts
the tokens up to that one; the rest of the burst is dropped. The end-of-turn
token is counted (it was generated) but never shown.

    stop "\\n\\n", burst [" b"][":"]["\\n\\n"]["x"]  ->  text "... b:", 3 tokens counted, "x" dropped
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.results import GenerationStats
from specedge.edge_client.text import IncrementalText, StopStrings
from specedge.types import FinishReason

if TYPE_CHECKING:
    from specedge.edge_client.runtime import EdgeRuntime
    from specedge.edge_client.tokenizer import EdgeTokenizer

TextCallback = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class AnswerResult:
    text: str
    finish: FinishReason  # STOP: end of turn or a stop string; LENGTH / CONTEXT: out of tokens or room
    num_prompt_tokens: int
    num_completion_tokens: int  # up to the one that completed a stop string
    stats: GenerationStats


class TextAnswer:
    """Feeds a generation's committed tokens through incremental detokenizing and stop strings."""

    def __init__(self, tokenizer: EdgeTokenizer, stops: Iterable[str] = (), on_text: TextCallback = lambda piece: None):
        self._text = IncrementalText(tokenizer, tokenizer.eos_token_ids)
        self._stops = StopStrings(stops)
        self._on_text = on_text
        self._pieces: list[str] = []
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        """A stop string was hit."""
        return self._stops.stopped

    def on_tokens(self, token_ids: Sequence[int]) -> bool:
        """The generation's callback: shows the new text; True (stop the answer) when a stop string hit."""
        if not self._stops.stops:
            self.num_tokens += len(token_ids)
            self._show(self._text.feed(token_ids))
            return False
        shown = []
        for token_id in token_ids:
            self.num_tokens += 1
            shown.append(self._stops.feed(self._text.feed([token_id])))
            if self._stops.stopped:
                break
        self._show("".join(shown))
        return self._stops.stopped

    def finish(self) -> str:
        """Shows what was held back (an unfinished character, a possible stop string's start); the whole text."""
        if not self._stops.stopped:
            self._show(self._stops.feed(self._text.flush()) + self._stops.flush(), final=True)
        return "".join(self._pieces)

    def _show(self, piece: str, final: bool = False) -> None:
        # Called once per committed burst, even with no new text, so a caller learns the answer has started.
        self._pieces.append(piece)
        if piece or not final:
            self._on_text(piece)


async def answer(
    runtime: EdgeRuntime,
    prompt: Sequence[int],
    policy: SpeculationPolicy,
    stops: Iterable[str] = (),
    on_text: TextCallback = lambda piece: None,
) -> AnswerResult:
    """Generate one answer with `runtime` (its own server session); `on_text` gets each burst's new text."""
    text = TextAnswer(runtime.tokenizer, stops, on_text)
    result = await runtime.generate(prompt, text.on_tokens, policy=policy)
    finish = FinishReason.STOP if text.stopped else result.finish  # a stop string wins over a burst's length limit
    return AnswerResult(text.finish(), finish, len(prompt), text.num_tokens, result.stats)
