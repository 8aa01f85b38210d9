"""A conversation's server session is closed whenever the edge stops using it, and kept whenever it can be.

Each test counts the server's open sessions while the edge is still
connected (its lease would close them all on the way out): a session the edge
forgets without closing holds its KV slot until the idle timeout (ten minutes
by default) and counts against the identity's cap on open sessions.
"""

from __future__ import annotations

import asyncio
import functools
import time

import pytest

from reference import greedy_decode
from specedge.edge_client.client import EdgeClient, EdgeError
from specedge.edge_client.drafting.base import DraftChain
from specedge.edge_client.drafting.torch_drafter import TorchDrafter
from specedge.edge_client.generation import SLOW_FALLBACK_MIN_ROUNDS, Conversation, generate
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.tokenizer import HFTokenizer

MAX_CONTEXT = 128
EIGHT_TOKENS = SpeculationPolicy(max_new_tokens=8)


# One session per identity: a session left open by mistake makes the next one be refused.
pytestmark = pytest.mark.server_options(max_context=MAX_CONTEXT, max_sessions=4, max_sessions_per_identity=1)


@pytest.fixture(scope="module")
def tokenizer(tiny_draft_dir):
    return HFTokenizer(tiny_draft_dir)


def chat_prompt(tokenizer, content: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}])


def open_sessions(server) -> list[str]:
    return list(server.server.engine.sessions)


def test_a_refused_turn_closes_the_conversations_session(server, tokenizer, tiny_draft_dir):
    first = chat_prompt(tokenizer, "def add(a, b):")

    async def run():
        async with EdgeClient(server.address, tokenizer.fingerprint) as client:
            conversation = Conversation()
            answer = functools.partial(generate, client, policy=EIGHT_TOKENS, conversation=conversation)
            await answer(first, TorchDrafter(tiny_draft_dir))
            kept = open_sessions(server)
            assert kept == [conversation.session_id]  # the conversation holds its session between turns
            # The next turn outgrows the server's context: ContinueSession is refused.
            too_long = [*conversation.tokens, *tokenizer.encode("print(i * i)\n" * 40)]
            assert len(too_long) >= MAX_CONTEXT
            with pytest.raises(EdgeError, match="INVALID_ARGUMENT"):
                await answer(too_long, TorchDrafter(tiny_draft_dir))
            return conversation, open_sessions(server)

    conversation, left_open = asyncio.run(run())
    assert left_open == [] and conversation.session_id is None  # closed at once, not at the idle timeout


def test_a_turn_with_nothing_in_common_replaces_the_session(server, tokenizer, tiny_draft_dir, reference_model):
    first, unrelated = chat_prompt(tokenizer, "def add(a, b):"), tokenizer.encode("The quick brown fox")
    assert first[0] != unrelated[0]  # keep == 0: nothing of the held session can be reused

    async def run():
        async with EdgeClient(server.address, tokenizer.fingerprint) as client:
            conversation = Conversation()
            answer = functools.partial(generate, client, policy=EIGHT_TOKENS, conversation=conversation)
            await answer(first, TorchDrafter(tiny_draft_dir))
            old = conversation.session_id
            # With one session per identity, the new session is refused unless the old one was closed first.
            started = time.monotonic()
            result = await answer(unrelated, TorchDrafter(tiny_draft_dir))
            return old, conversation, result, time.monotonic() - started, open_sessions(server)

    old, conversation, result, took_s, left_open = asyncio.run(run())
    assert result.token_ids == greedy_decode(reference_model, unrelated, 8, set(tokenizer.eos_token_ids))
    assert conversation.session_id not in (None, old) and left_open == [conversation.session_id]
    assert took_s < 1.0  # never refused and retried after the server's 1 s retry-after


class WrongDrafter:
    """Drafts one token the target never picks, slowly: every round commits just the server's own token."""

    def __init__(self, fingerprint, wrong_token: int, delay_s: float):
        self.fingerprint, self.wrong_token, self.delay_s = fingerprint, wrong_token, delay_s

    def propose(self, context, num_tokens, sampling=None, min_prob=0.0) -> DraftChain:
        time.sleep(self.delay_s)
        return DraftChain((self.wrong_token,) * num_tokens, (0.9,) * num_tokens)

    def close(self) -> None:
        pass


def test_an_answer_that_finishes_on_the_round_that_measures_it_slow_is_no_fallback(server, tokenizer, reference_model):
    prompt = chat_prompt(tokenizer, "print(i * i)")
    # The first token comes with the session, then one token a round: the answer ends on the round that
    # first measures drafting (SLOW_FALLBACK_MIN_ROUNDS rounds in), and measures it far slower than the server.
    num_tokens = 1 + SLOW_FALLBACK_MIN_ROUNDS
    expected = greedy_decode(reference_model, prompt, num_tokens, set(tokenizer.eos_token_ids))
    assert len(expected) == num_tokens
    wrong = next(t for t in range(10, 100) if t not in expected)
    policy = SpeculationPolicy(
        max_new_tokens=num_tokens, num_draft=1, slow_draft_fallback=True, proactive=False, follow_advice=False
    )

    async def run():
        async with EdgeClient(server.address, tokenizer.fingerprint) as client:
            conversation = Conversation()
            drafter = WrongDrafter(tokenizer.fingerprint, wrong, delay_s=0.1)
            result = await generate(client, prompt, drafter, policy=policy, conversation=conversation)
            return result, conversation, open_sessions(server)

    result, conversation, held = asyncio.run(run())
    assert result.token_ids == expected
    assert result.stats.rounds == SLOW_FALLBACK_MIN_ROUNDS and result.stats.accepted_tokens == 0
    assert result.stats.fallback is None
    assert held == [conversation.session_id] and conversation.tokens == [*prompt, *expected]  # kept for the next turn
