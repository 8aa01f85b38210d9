"""What the edge sends and gets back, call by call, as typed immutable messages.

The edge's loop (generation.py) works on these, as the server's engine works on its `RoundOutcome`;
the protobufs stay inside EdgeClient, and specedge/wire.py converts between the two.

    handshake        -> ServerInfo (its limits: ServerLimits)
    OpenSession      -> OpenedSession (also a ContinueSession turn)
    DraftRound       -> RoundReply (Verify)
    Generate stream  -> StreamedTokens, one per step
"""

from __future__ import annotations

import dataclasses

from specedge.tokens import TokenizerFingerprint
from specedge.types import FinishReason, SparseDist


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Every limit the server enforces, as its handshake reports them (protos/specedge/v1: ServerLimits)."""

    max_context_tokens: int  # per session: prompt + generated
    max_draft_tokens: int  # draft tokens (tree nodes) per round
    max_sessions: int  # open at once, over all edges
    max_prompt_tokens: int  # an OpenSession prompt, or a ContinueSession turn's new tokens
    max_draft_prob_tokens: int  # entries of one draft distribution q
    max_sessions_per_identity: int
    max_rounds_per_second: float  # per identity; 0: no limit
    round_burst: int
    max_message_bytes: int
    idle_session_timeout_s: float
    idle_connection_timeout_s: float  # 0: never
    max_attach_streams_per_identity: int  # 0: a server too old to report it


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """The handshake's answer: who the server is, its tokenizer, its limits."""

    protocol_version: int
    server_version: str
    model_name: str
    target_tokenizer: TokenizerFingerprint
    limits: ServerLimits


@dataclasses.dataclass(frozen=True)
class OpenedSession:
    """A session opened (or continued for a new turn): the server prefilled and generated its first token."""

    session_id: str
    first_token_id: int
    finish: FinishReason
    limits: ServerLimits
    advised_draft_tokens: int  # the first round's draft length for the server's load


@dataclasses.dataclass(frozen=True)
class DraftRound:
    """One round's drafts, for the server to verify after everything committed so far.

    A chain has no parents; a tree numbers its nodes as the wire does (0 = the last committed token,
    node i + 1 = token_ids[i]), with parents[i] < i + 1.
    """

    token_ids: tuple[int, ...]
    num_generated: int  # tokens this session has generated so far, as the edge saw them
    parents: tuple[int, ...] = ()  # trees only
    dists: tuple[SparseDist, ...] = ()  # chains drafted for rejection sampling: q of each token


@dataclasses.dataclass(frozen=True)
class RoundTiming:
    """How the server spent a round (for the edge's stats and its slow-draft fallback)."""

    queue_ms: float  # waiting for a forward
    forward_ms: float  # the batched forward the round rode in
    batch_size: int  # sessions in that forward
    batch_tokens: int


@dataclasses.dataclass(frozen=True)
class RoundReply:
    """A verified round: what was accepted and committed."""

    accepted_nodes: tuple[int, ...]  # draft nodes committed, root to leaf
    token_ids: tuple[int, ...]  # committed: the accepted drafts, then the server's own token, cut at a stop
    finish: FinishReason
    num_generated: int  # this session's generated tokens so far
    advised_draft_tokens: int  # 0: drafting does not pay now, send no drafts
    timing: RoundTiming
    num_verified_nodes: int | None = None  # the first nodes the server verified (the rest cut); None: all of them


@dataclasses.dataclass(frozen=True)
class StreamedTokens:
    """One step of a server-driven (Generate) answer."""

    token_ids: tuple[int, ...]
    finish: FinishReason
