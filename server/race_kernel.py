"""The argmax and the exponential race as one compiled pass per row: numba, float32 logits on CPU.

server/sampling.py's eager race is torch ops over whole tensors, so on CPU every
step of it (hash, uniform, Gumbel, score, mask, argmax) is another pass over
[rows, vocab] memory. Here each row is read once from memory for its argmax
and raced while it is still in cache, and the noise of a token is hashed only
when its logit is within the race's reach, and turned into a Gumbel value
(two logs) only when even an upper bound on that value could win:

    G = -log(-log u) <= -log(1 - u) = 23 ln 2 - ln(y - 1/2),
    y = 2**23 - token_uniform(bits) in [1, 2**23]

so a token can reach the best score S found so far only if y <= 2**(t - 1) + 1/2,
t = 24 - (S - a) / ln 2, a = (logit - max) / T: one float compare, the power of
two bounded by (1 + f) 2**k for k + f = t - 1. A block of 256 tokens is first
tested by its noise alone, against its highest logit's bound: its smallest y,
from the largest of its hashes (one max per 8 tokens), which rules out three
blocks in four of a flat row before any token's own bound is worked out. A
flat row scores a few tokens exactly, not 150k.

Same bits, same scores, same winner as the eager race: the hash is
specedge/noise.py's integer arithmetic in uint32 lanes, the exact score is
(logit - max) / T + -log(-log u) in float32, and ties go to the lowest token
id. (Only a score tie within the last bit of a float32 log could differ: the
eager path's log is SLEEF's, this one libm's.)

The same pass does rejection sampling for the chains sent with q (`Drafts`):
each chain is one task that walks its rows in order, and at each draft it
reaches it sums p's log-normaliser over the row (exponentials a vector at a
time, skipping blocks too far below the max to count), tests p(token) against
u q(token), and on a rejection races the residual normalize(max(p - q, 0)) at
once, as the row's own race with q's tokens reweighted to log(max(p - q, 0)).
After a rejection the chain's rows are read only for their argmax and
finiteness: no exponentials, no race for the bonus.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from specedge import noise
from specedge.server.kernels import load_kernel

NO_TOKEN = -1  # a race in which no token has a finite score; in Drafts, a row without a draft
# argmax_and_race's verdict on a row's draft: none (no draft, or the walk did not reach it), rejected, accepted.
UNDECIDED, REJECTED, ACCEPTED = -1, 0, 1


@dataclasses.dataclass(frozen=True)
class Drafts:
    """The chains that rejection sampling walks: per row, the draft token decided there and the q it was
    sampled from; and the groups of rows walked in order.

    A row's draft is accepted where p(token) > thresholds[r] (u q(token), server/rejection.py's test);
    a threshold of +inf rejects it outright. Row r's q is q_ids[q_starts[r]:q_starts[r + 1]] with q_probs
    there (renormalised to sum to 1). Group g is rows groups[g]:groups[g + 1]: a chain's drafts and then its
    bonus row, or a single row.
    """

    token_ids: np.ndarray  # [R] int64; NO_TOKEN: no draft at the row
    thresholds: np.ndarray  # [R] float64
    q_starts: np.ndarray  # [R + 1] int64
    q_ids: np.ndarray  # [K] int64
    q_probs: np.ndarray  # [K] float64
    groups: np.ndarray  # [G + 1] int64, from 0 to R

    @staticmethod
    def none(num_rows: int) -> Drafts:
        empty = np.zeros(0, np.int64)
        no_tokens, no_starts = np.full(num_rows, NO_TOKEN, np.int64), np.zeros(num_rows + 1, np.int64)
        return Drafts(no_tokens, np.zeros(num_rows), no_starts, empty, np.zeros(0), np.arange(num_rows + 1))


@functools.cache
def kernel():
    """The compiled kernel, or None (after one log line) where numba is missing or fails to compile."""
    return load_kernel("_race_numba", "sampling runs on torch's eager race")


def covers(logits: torch.Tensor) -> bool:
    """Whether the compiled kernel takes these logits (float32 on CPU); others race eagerly."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and kernel() is not None


def argmax_and_race(
    logits: torch.Tensor,  # [L, V] float32 on CPU
    rows: torch.Tensor | None,  # [R] int64 logit rows to draw from; None: all L
    racing: np.ndarray,  # [R] bool: race this row (else its draw is the argmax)
    temperature: torch.Tensor,  # [R] float64 > 0
    floors: torch.Tensor,  # [R] float64: tokens with logit < floor are excluded
    keys: torch.Tensor,  # [R] int64 noise keys (< 2**32)
    drafts: Drafts | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's argmax (ties to the lowest id), whether its max is finite (no NaN, no +-inf max), its
    draw, its log-normaliser and its verdict, in one read of the row.

    A row's draw is the race's winner where racing, else the argmax; NO_TOKEN where nothing could win.
    A row with a draft (`drafts`) gets rejection sampling's verdict on it, from p there, and its
    log-normaliser, log sum exp((logit - max) / T) over its tokens with logit >= floor (float64; NaN at
    every other row), summed while the row is still in cache, skipping the blocks whose weight a float64
    sum cannot see. A draft that the blocks near the max and a bound on the others already accept is
    accepted there, as the whole sum would, and its row's normaliser is left NaN (never summed). A
    rejected draft's draw is its residual's sample, normalize(max(p - q, 0)) (p itself
    where that is empty), raced with the row's own noise key. A chain is walked in order: after its
    first rejection or a row that is not finite, its rows are read for their argmax and finiteness
    only (UNDECIDED, their draw the argmax), so a bonus row is raced only where every draft was accepted."""
    compiled = kernel()
    values = logits.detach().contiguous().numpy()
    row_index = np.arange(values.shape[0], dtype=np.int64) if rows is None else rows.numpy().astype(np.int64)
    num_rows = len(row_index)
    drafts = drafts or Drafts.none(num_rows)
    _check_ids(drafts, values.shape[1])
    top = np.empty(num_rows, np.int64)
    finite = np.empty(num_rows, np.bool_)
    winners = np.empty(num_rows, np.int64)
    norms = np.empty(num_rows, np.float64)
    verdicts = np.empty(num_rows, np.int8)
    compiled.set_threads(torch.get_num_threads())
    compiled.argmax_and_race(
        values,
        row_index,
        drafts.groups,
        np.ascontiguousarray(racing, np.bool_),
        np.ascontiguousarray(temperature.double().numpy()),
        np.ascontiguousarray(floors.double().numpy()),
        keys.numpy().astype(np.uint32),
        _token_hash_table(values.shape[1]),
        drafts.token_ids,
        drafts.thresholds,
        drafts.q_starts,
        drafts.q_ids,
        drafts.q_probs,
        top,
        finite,
        winners,
        norms,
        verdicts,
    )
    return (
        torch.from_numpy(top),
        torch.from_numpy(finite),
        torch.from_numpy(winners),
        torch.from_numpy(norms),
        torch.from_numpy(verdicts),
    )


def _check_ids(drafts: Drafts, vocab_size: int) -> None:
    """The kernel reads the logits at every draft and q token unchecked: an id outside the row must not get there."""
    ids = np.concatenate([drafts.token_ids[drafts.token_ids != NO_TOKEN], drafts.q_ids])
    if len(ids) and not (0 <= ids.min() and ids.max() < vocab_size):
        raise IndexError(f"a draft token id outside the vocabulary [0, {vocab_size}): {ids.min()}..{ids.max()}")


@functools.lru_cache(maxsize=4)
def _token_hash_table(vocab_size: int) -> np.ndarray:
    """[V] uint32 noise.token_hash of every token id, hashed once per vocabulary size."""
    return noise.token_hash(np.arange(vocab_size, dtype=np.int64)).astype(np.uint32)
