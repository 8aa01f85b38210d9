"""After the batched forward: what each row draws, then its verification and commit.

The engine calls these on its thread: first `*_draw` says what each row asks
of its logits (server/draws.py answers every row in one vectorized pass),
then `after_*` commits one row's answer; a row that raises fails alone
(server/isolation.py). Everything that changes a session after a forward
happens here: KV length, the accepted path's KV move (which the engine
applies for the whole step at once), and committed tokens (through
`Session.commit`, the single place tokens land).
"""

from __future__ import annotations

import dataclasses

from specedge.scheduler import PrefillChunk
from specedge.server import tree
from specedge.server.draws import RowDraw
from specedge.server.runner import KVMove
from specedge.server.session import Session
from specedge.server.stats import ServerStats
from specedge.server.verify import VerifyResult, verify_by_sampling
from specedge.types import SparseDist


@dataclasses.dataclass(frozen=True)
class Committed:
    accepted_nodes: tuple[int, ...]  # committed draft nodes, root to leaf
    token_ids: list[int]  # committed this step, cut at a stop
    kv_move: KVMove | None = None  # the accepted tree path's KV, to be made contiguous (None for chains)


def prefill_draw(session: Session, chunk: PrefillChunk) -> RowDraw:
    """A prefill chunk's ask: the first token after the prompt, once its last chunk is in."""
    if not chunk.is_last:
        return RowDraw(num_logits=1, params=None)
    return RowDraw(num_logits=1, params=session.sampling, seed=session.seed, positions=(session.prompt_len,))


def round_draw(
    session: Session,
    draft_token_ids: tuple[int, ...],
    draft_parents: tuple[int, ...],
    draft_dists: tuple[SparseDist, ...],
) -> RowDraw:
    """A round's ask: the target's token after the pending token and after each draft node."""
    # The pending token sits at sequence index num_context - 1; the sample
    # after a node of depth d lands at num_context + d.
    positions = tuple(session.num_context + d for d in tree.depths(draft_parents))
    return RowDraw(
        num_logits=1 + len(draft_token_ids),
        params=session.sampling,
        seed=session.seed,
        positions=positions,
        draft_token_ids=draft_token_ids,
        draft_dists=draft_dists,
    )


def after_prefill(
    session: Session, chunk: PrefillChunk, drawn: list[int] | None, stats: ServerStats, *, prefill_start: int = 0
) -> Committed | None:
    """None until the prompt's last chunk is in; then its first token, drawn after the prompt.

    `prefill_start`: prompt tokens already cached before this prefill began (a later turn).
    """
    session.num_cached = chunk.start + chunk.num_tokens
    if not chunk.is_last:
        return None
    assert drawn is not None, "the prompt's last chunk draws its first token"
    [first] = drawn
    kept = session.commit([first], num_new_cached=0)
    stats.observe_prefill(num_prompt_tokens=session.prompt_len - prefill_start)
    return Committed((), kept)


def after_round(
    session: Session,
    draft_token_ids: tuple[int, ...],
    draft_parents: tuple[int, ...],
    drawn: list[int] | VerifyResult,  # the target's samples after each node, or a rejection verdict
    stats: ServerStats,
    *,
    server_drafted: bool = False,
) -> Committed:
    # Greedy, trees, and chains sent without q: match the target's samples, lossless for any sampler.
    result = drawn if isinstance(drawn, VerifyResult) else verify_by_sampling(draft_token_ids, draft_parents, drawn)
    kv_move = _path_move(session, result.accepted_nodes)
    tokens = [draft_token_ids[node - 1] for node in result.accepted_nodes] + [result.next_token]
    if server_drafted:
        # The draft cache holds the context plus every draft but the last.
        session.draft_cached = session.num_context + min(len(result.accepted_nodes), len(draft_token_ids) - 1)
    kept = session.commit(tokens, num_new_cached=1 + len(result.accepted_nodes))
    # Report only drafts that were committed (a stop or the length limit may cut the path).
    accepted = result.accepted_nodes[: len(kept)]
    session.speculation.observe(len(draft_token_ids), len(result.accepted_nodes))
    stats.observe_round(num_draft_tokens=len(draft_token_ids), accepted_depth=len(accepted), num_committed=len(kept))
    return Committed(accepted, kept, kv_move)


def _path_move(session: Session, accepted_nodes: tuple[int, ...]) -> KVMove | None:
    """The accepted path's KV, moved to sit contiguously after the pending token (None for chains)."""
    wanted = tuple(range(1, len(accepted_nodes) + 1))
    if accepted_nodes == wanted:
        return None
    base = session.num_cached
    return KVMove(session.slot, tuple(base + n for n in accepted_nodes), tuple(base + n for n in wanted))
