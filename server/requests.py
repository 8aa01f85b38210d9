"""Request messages in, validated values out: every check that needs no session state.

Sizes are checked before anything is converted or scanned, so a request built
to be expensive (a million-entry prompt or distribution) costs the event loop
one length comparison. Each failure is InvalidArgument or FailedPrecondition
with a message that says what to change; conversions themselves live in
specedge/wire.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specedge import wire
from specedge.server import errors, tree
from specedge.tokens import IncompatibleTokenizer, TokenizerFingerprint, check_compatible
from specedge.types import SamplingParams, SparseDist
from specedge.v1 import specedge_pb2 as pb

# Bytes a request may need beyond its repeated fields (ids, tokenizer fingerprint, sampling, framing).
_FIXED_REQUEST_BYTES = 4096
_VARINT_BYTES = 5  # a uint32 on the wire, at most
_FLOAT_BYTES = 4


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_context: int  # tokens per session
    max_prompt_tokens: int
    max_draft_tokens: int  # draft nodes per round
    max_draft_prob_tokens: int  # entries per draft distribution

    def largest_request_bytes(self) -> int:
        """An upper bound on the size of a request within these limits (the message size must allow it)."""
        prompt = self.max_prompt_tokens * _VARINT_BYTES
        dist = self.max_draft_prob_tokens * (_VARINT_BYTES + _FLOAT_BYTES) + 2 * _VARINT_BYTES
        draft_round = self.max_draft_tokens * (2 * _VARINT_BYTES + dist)
        return _FIXED_REQUEST_BYTES + max(prompt, draft_round)


@dataclasses.dataclass(frozen=True)
class SessionRequest:
    """What OpenSession and Generate ask for, validated."""

    prompt: tuple[int, ...]
    max_new_tokens: int  # 0: until the context is full
    sampling: SamplingParams
    seed: int | None


@dataclasses.dataclass(frozen=True)
class TurnRequest:
    """What ContinueSession asks for, validated as far as it can be without the session."""

    keep_tokens: int  # of the session's tokens (prompt, then generated)
    token_ids: tuple[int, ...]  # the new turn, appended after the kept tokens
    max_new_tokens: int  # 0: until the context is full
    sampling: SamplingParams
    seed: int | None


@dataclasses.dataclass(frozen=True)
class DraftRound:
    """One verify round's drafts, validated: a well-formed tree (chains spelled out) within the limits."""

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    dists: tuple[SparseDist, ...]  # chains only, one per draft token; empty: verify by matching samples


class RequestValidator:
    def __init__(self, limits: RequestLimits, fingerprint: TokenizerFingerprint):
        self.limits = limits
        self.fingerprint = fingerprint

    def check_handshake(self, msg: pb.HandshakeRequest) -> None:
        if msg.protocol_version != wire.PROTOCOL_VERSION:
            raise errors.FailedPrecondition(
                f"edge speaks protocol {msg.protocol_version}, server speaks {wire.PROTOCOL_VERSION}; upgrade specedge"
            )
        self.check_tokenizer(msg.draft_tokenizer)

    def check_tokenizer(self, msg: pb.TokenizerFingerprint) -> None:
        try:
            check_compatible(wire.fingerprint_from_proto(msg), self.fingerprint)
        except IncompatibleTokenizer as exc:
            raise errors.FailedPrecondition(f"{exc}: the draft model must use the target's tokenizer") from None

    def session_request(self, msg: pb.OpenSessionRequest | pb.GenerateRequest) -> SessionRequest:
        limits = self.limits
        prompt = msg.prompt_token_ids
        if not prompt:
            raise errors.InvalidArgument("prompt is empty: send at least one token id")
        if len(prompt) >= limits.max_context:
            raise errors.InvalidArgument(
                f"prompt of {len(prompt)} tokens leaves no room to generate within the server's "
                f"max context of {limits.max_context} tokens"
            )
        if len(prompt) > limits.max_prompt_tokens:
            raise errors.InvalidArgument(
                f"prompt of {len(prompt)} tokens exceeds the server's max_prompt_tokens {limits.max_prompt_tokens}"
            )
        self.check_tokenizer(msg.tokenizer)
        self._check_token_ids(prompt, "prompt")
        return SessionRequest(tuple(prompt), msg.max_new_tokens, *self._sampling(msg.sampling))

    def turn_request(self, msg: pb.ContinueSessionRequest) -> TurnRequest:
        """The new tokens of a turn are what it prefills: they count against max_prompt_tokens."""
        limits = self.limits
        if len(msg.token_ids) > limits.max_prompt_tokens:
            raise errors.InvalidArgument(
                f"a new turn of {len(msg.token_ids)} tokens exceeds the server's max_prompt_tokens "
                f"{limits.max_prompt_tokens}"
            )
        self._check_token_ids(msg.token_ids, "prompt")
        return TurnRequest(msg.keep_tokens, tuple(msg.token_ids), msg.max_new_tokens, *self._sampling(msg.sampling))

    @staticmethod
    def _sampling(msg: pb.SamplingParams) -> tuple[SamplingParams, int | None]:
        try:
            return wire.sampling_from_proto(msg)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None

    def server_draft_tokens(self, msg: pb.GenerateRequest) -> int:
        if msg.server_draft_tokens > self.limits.max_draft_tokens:
            raise errors.InvalidArgument(
                f"server_draft_tokens {msg.server_draft_tokens} exceeds max_draft_tokens {self.limits.max_draft_tokens}"
            )
        return msg.server_draft_tokens

    def draft_round(self, msg: pb.VerifyRequest) -> DraftRound:
        limits = self.limits
        num_drafts = len(msg.draft_token_ids)
        if num_drafts > limits.max_draft_tokens:
            raise errors.InvalidArgument(
                f"draft of {num_drafts} tokens exceeds the server's max_draft_tokens {limits.max_draft_tokens}"
            )
        if msg.draft_parents and len(msg.draft_parents) != num_drafts:
            raise errors.InvalidArgument(
                f"{len(msg.draft_parents)} draft parents for {num_drafts} draft tokens; send one per token or none"
            )
        if msg.draft_probs and len(msg.draft_probs) != num_drafts:
            raise errors.InvalidArgument(
                f"{len(msg.draft_probs)} draft distributions for {num_drafts} draft tokens; send one per token"
            )
        for i, dist in enumerate(msg.draft_probs, start=1):
            if len(dist.token_ids) > limits.max_draft_prob_tokens or len(dist.probs) > limits.max_draft_prob_tokens:
                raise errors.InvalidArgument(
                    f"draft distribution {i} has {max(len(dist.token_ids), len(dist.probs))} entries; the server "
                    f"accepts at most max_draft_prob_tokens {limits.max_draft_prob_tokens}"
                )
        token_ids = tuple(msg.draft_token_ids)
        self._check_token_ids(token_ids, "draft")
        parents = tuple(msg.draft_parents) or tree.chain_parents(num_drafts + 1)
        if problem := tree.validate_parents(parents):
            raise errors.InvalidArgument(problem)
        dists = self._draft_dists(token_ids, parents, msg.draft_probs) if msg.draft_probs else ()
        return DraftRound(token_ids, parents, dists)

    def _draft_dists(self, token_ids, parents, msgs) -> tuple[SparseDist, ...]:
        if parents != tree.chain_parents(len(token_ids) + 1):
            raise errors.InvalidArgument("draft distributions are for chains; a tree is verified by matching samples")
        try:
            dists = wire.dists_from_proto(msgs)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        for i, (token, dist) in enumerate(zip(token_ids, dists), start=1):
            if dist.prob_of(token) <= 0:
                raise errors.InvalidArgument(f"draft token {i} ({token}) has probability 0 in its own distribution")
            self._check_token_ids(dist.token_ids, "draft distribution")
        return dists

    def _check_token_ids(self, token_ids: Sequence[int], what: str) -> None:
        vocab_size = self.limits.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise errors.InvalidArgument(f"{what} token id {bad} is out of range for vocab size {vocab_size}")
