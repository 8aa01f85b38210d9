"""Streamed text: incremental detokenizing equals decoding the whole answer; stop strings cut exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.edge_client.text import IncrementalText, StopStrings
from specedge.edge_client.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return HFTokenizer(tiny_target_dir)


def test_multibyte_characters_wait_until_complete(tokenizer):
    ids = tokenizer.encode("안녕하세요, Hello")
    text = IncrementalText(tokenizer)
    pieces = [text.feed([token]) for token in ids]
    assert "".join(pieces) == "안녕하세요, Hello"
    assert all("\ufffd" not in piece for piece in pieces)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_streamed_pieces_add_up_to_the_whole_decode(tokenizer, data):
    """Any text (Korean, emoji, code), streamed in any chunks, comes out whole and never as a broken character."""
    token_ids = tokenizer.encode(data.draw(st.text(max_size=60)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(token_ids)), max_size=8)))
    text, pieces, start = IncrementalText(tokenizer), [], 0
    for cut in [*cuts, len(token_ids)]:
        pieces.append(text.feed(token_ids[start:cut]))
        start = cut
    assert "".join(pieces) == tokenizer.decode(token_ids)
    assert all("\ufffd" not in piece for piece in pieces) or "\ufffd" in tokenizer.decode(token_ids)


@pytest.mark.parametrize(
    "pieces, stops, shown, stopped",
    [
        (["Hello wor", "ld. Bye"], ["."], "Hello world", True),
        (["ab", "c<", "|e", "nd|> tail"], ["<|end|>"], "abc", True),
        (["ab", "c<", "|x"], ["<|end|>"], "abc<|x", False),  # a false start is released at the end
        (["no stops here"], [], "no stops here", False),
        (["x", "STOP", "y"], ["STOP", "ST"], "x", True),
    ],
)
def test_stop_strings(pieces, stops, shown, stopped):
    matcher = StopStrings(stops)
    out = "".join(matcher.feed(piece) for piece in pieces) + matcher.flush()
    assert out == shown and matcher.stopped == stopped


def test_flush_releases_what_an_answer_cut_mid_character_held_back(tokenizer):
    ids = tokenizer.encode("안녕, hi")
    for end in range(len(ids) + 1):
        text = IncrementalText(tokenizer)
        assert text.feed(ids[:end]) + text.flush() == tokenizer.decode(ids[:end])
        assert text.flush() == ""  # nothing twice
