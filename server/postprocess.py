"""After the batched forward: one row's verification and commit, given its logits.

The engine calls these on its thread, one row at a time; a row that raises
fails alone (server/isolation.py). Everything that changes a session after a
forward happens here: KV length, the accepted path's KV made contiguous, and
committed tokens (through `Session.commit`, the single place tokens land).
"""

from __future__ import annotations

import dataclasses

import torch

from specedge.scheduler import PrefillChunk
from specedge.server import tree
from specedge.server.rejection import verify_chain_by_rejection
from specedge.server.runner import ModelRunner
from specedge.server.sampling import sample, target_probs
from specedge.server.session import Session
from specedge.server.stats import ServerStats
from specedge.server.verify import verify_by_sampling
from specedge.types import SparseDist


@dataclasses.dataclass(frozen=True)
class Committed:
    accepted_nodes: tuple[int, ...]  # committed draft nodes, root to leaf
    token_ids: list[int]  # committed this step, cut at a stop


def after_prefill(
    session: Session, chunk: PrefillChunk, logits: torch.Tensor, stats: ServerStats, *, prefill_start: int = 0
) -> Committed | None:
    """logits: [1, vocab] after the chunk's last token. None until the prompt's last chunk is in.

    `prefill_start`: prompt tokens already cached before this prefill began (a later turn).
    """
    session.num_cached = chunk.start + chunk.num_tokens
    if not chunk.is_last:
        return None
    [first] = sample(logits, [session.prompt_len], session.sampling, session.seed)
    kept = session.commit([first], num_new_cached=0)
    stats.observe_prefill(num_prompt_tokens=session.prompt_len - prefill_start)
    return Committed((), kept)


def after_round(
    session: Session,
    draft_token_ids: tuple[int, ...],
    draft_parents: tuple[int, ...],
    draft_dists: tuple[SparseDist, ...],
    logits: torch.Tensor,  # [1 + num_drafts, vocab]: after the pending token and after each draft node
    runner: ModelRunner,  # or a TensorParallelRunner: whatever holds the KV moves it
    stats: ServerStats,
    *,
    server_drafted: bool = False,
) -> Committed:
    # The pending token sits at sequence index num_context - 1; the sample
    # after a node of depth d lands at num_context + d.
    positions = [session.num_context + d for d in tree.depths(draft_parents)]
    if draft_dists and not session.sampling.greedy:
        probs = target_probs(logits, session.sampling)
        result = verify_chain_by_rejection(draft_token_ids, draft_dists, probs, positions, session.seed)
    else:  # greedy, trees, and chains sent without q: lossless for any sampler
        samples = sample(logits, positions, session.sampling, session.seed)
        result = verify_by_sampling(draft_token_ids, draft_parents, samples)
    _compact_path(runner, session, result.accepted_nodes)
    tokens = [draft_token_ids[node - 1] for node in result.accepted_nodes] + [result.next_token]
    if server_drafted:
        # The draft cache holds the context plus every draft but the last.
        session.draft_cached = session.num_context + min(len(result.accepted_nodes), len(draft_token_ids) - 1)
    kept = session.commit(tokens, num_new_cached=1 + len(result.accepted_nodes))
    # Report only drafts that were committed (a stop or the length limit may cut the path).
    accepted = result.accepted_nodes[: len(kept)]
    session.speculation.observe(len(draft_token_ids), len(result.accepted_nodes))
    stats.observe_round(num_draft_tokens=len(draft_token_ids), accepted_depth=len(accepted), num_committed=len(kept))
    return Committed(accepted, kept)


def _compact_path(runner: ModelRunner, session: Session, accepted_nodes: tuple[int, ...]) -> None:
    """Make the accepted path's KV contiguous after the pending token (a no-op for chains)."""
    wanted = tuple(range(1, len(accepted_nodes) + 1))
    if accepted_nodes != wanted:
        base = session.num_cached
        runner.move_kv(session.slot, [base + n for n in accepted_nodes], [base + n for n in wanted])
