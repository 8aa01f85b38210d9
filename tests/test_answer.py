"""Committed bursts -> text: stop strings inside a burst, held-back text, end-of-turn tokens, token counts."""

from __future__ import annotations

import asyncio

from specedge.edge_client.answer import TextAnswer, answer
from specedge.edge_client.results import GenerationResult, GenerationStats
from specedge.types import FinishReason

EOS = 0


class ByteTokenizer:
    """Token i > 0 is the byte string PIECES[i]; 0 is the end of turn (shown as <eos> if not skipped)."""

    PIECES = [b"<eos>", b"ab", b"c:", b"\n\n", b"x", b"E", b"N", b"D", b"\xe4\xbd", b"\xa0", b" hi "]
    eos_token_ids = frozenset({EOS})

    def decode(self, token_ids) -> str:
        return b"".join(self.PIECES[t] for t in token_ids).decode("utf-8", errors="replace")


def run(bursts, stops=(), finish=FinishReason.LENGTH):
    shown: list[str] = []
    text = TextAnswer(ByteTokenizer(), stops, shown.append)
    stopped_at = None
    for i, burst in enumerate(bursts):
        if text.on_tokens(burst):
            stopped_at = i
            break
    return text, text.finish(), shown, stopped_at


def test_a_stop_string_inside_a_burst_ends_the_answer_at_its_token():
    text, whole, shown, stopped_at = run([[1], [2, 3, 4]], stops=["\n\n"])
    assert whole == "abc:" and stopped_at == 1 and text.stopped
    assert text.num_tokens == 3  # "ab", "c:", "\n\n"; the "x" after it in the burst is dropped
    assert shown == ["ab", "c:"]


def test_a_stop_string_split_across_bursts_is_held_back_then_cut():
    text, whole, shown, stopped_at = run([[10], [5], [6], [7, 4]], stops=["END"])
    assert whole == " hi " and stopped_at == 3 and text.num_tokens == 4
    assert shown == [" hi ", "", "", ""]  # one call per burst, even with nothing to show yet


def test_a_held_back_prefix_that_never_completes_is_shown_at_the_end():
    text, whole, shown, stopped_at = run([[10, 5], [6]], stops=["END"])
    assert whole == " hi EN" and stopped_at is None and not text.stopped
    assert shown == [" hi ", "", "EN"]


def test_end_of_turn_is_counted_never_shown_and_multibyte_characters_wait():
    text, whole, shown, _ = run([[8], [9, EOS]])
    assert whole == "你" and shown == ["", "你"] and text.num_tokens == 3


def test_an_unfinished_character_at_the_end_is_flushed_as_a_replacement():
    _, whole, shown, _ = run([[1, 8]])
    assert whole == "ab\ufffd" and shown == ["", "ab\ufffd"]  # the burst waits for the character as a whole


class FakeRuntime:
    """Commits fixed bursts and reports the server's finish, as EdgeRuntime.generate does."""

    tokenizer = ByteTokenizer()

    def __init__(self, bursts, finish):
        self.bursts, self.finish = bursts, finish

    async def generate(self, prompt, on_tokens, *, policy=None):
        committed = []
        for burst in self.bursts:
            committed += burst
            if on_tokens(burst):
                break
        return GenerationResult(committed, self.finish, GenerationStats(num_tokens=len(committed)))


def test_a_stop_string_wins_over_the_length_limit_of_the_same_burst():
    result = asyncio.run(answer(FakeRuntime([[1], [2, 3]], FinishReason.LENGTH), [7, 7, 7], None, stops=["c:"]))
    assert (result.text, result.finish, result.num_prompt_tokens, result.num_completion_tokens) == (
        "ab",
        FinishReason.STOP,
        3,
        2,
    )
    result = asyncio.run(answer(FakeRuntime([[1], [2, 3]], FinishReason.LENGTH), [7], None, stops=["zz"]))
    assert (result.text, result.finish, result.num_completion_tokens) == ("abc:\n\n", FinishReason.LENGTH, 3)
