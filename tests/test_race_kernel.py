"""The compiled race (server/race_kernel.py) against the definition and the eager race it replaces on CPU."""

from __future__ import annotations

import collections
import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from specedge import noise
from specedge.server import race_kernel
from specedge.server.draws import RowDraw, draw_rows
from specedge.server.rejection import residual_token, residual_tokens, verify_chain_by_rejection
from specedge.server.sampling import _race_eager, gumbel, logit_floors, probs_with_floors, row_keys, sample
from specedge.types import SamplingParams, SparseDist

pytestmark = pytest.mark.skipif(race_kernel.kernel() is None, reason="numba is not installed")
kernel = race_kernel.kernel()


def test_the_kernels_noise_is_the_definitions_bits():
    """The kernel hashes through its token-hash table in uint32 lanes: the same bits as Python ints."""
    rng = np.random.default_rng(0)
    keys = [noise.row_key(int(s), int(p), noise.TARGET_STREAM) for s, p in rng.integers(0, 2**62, (64, 2))]
    tokens = rng.integers(0, 151_936, 64).tolist() + [0, 151_935]
    table = race_kernel._token_hash_table(151_936)
    for key in keys:
        compiled = [int(kernel._uniform_top(np.uint32(key), table[t])) for t in tokens]
        assert compiled == [noise.token_uniform(noise.token_bits(key, t)) for t in tokens]
    key, token_ids = keys[0], torch.tensor(tokens)
    compiled = torch.tensor([float(kernel._gumbel(np.uint32(key), table[t])) for t in tokens])
    torch.testing.assert_close(compiled, gumbel(torch.full_like(token_ids, key), token_ids), rtol=1e-6, atol=1e-6)


def test_the_noise_bound_admits_every_token_that_can_reach_the_best_score():
    """_largest_y(t) >= 2**(t - 1) + 1/2, the largest y whose token can still reach the best score (y <= 2**23
    always), and at most 9% above it: the race skips every token whose y is above the bound."""
    near_integers = np.arange(-2, 26, dtype=np.float32)[:, None] + np.float32(1e-6) * np.array([-1, 0, 1])
    grid = np.concatenate([np.linspace(-4, 27, 40_001, dtype=np.float32), near_integers.ravel().astype(np.float32)])
    for t in grid:
        bound, exact = float(kernel._largest_y(t)), 2.0 ** (float(t) - 1) + 0.5
        assert bound >= min(exact, 2.0**23), t
        if -1 <= t <= 24:
            assert bound - 0.5 <= 1.09 * (exact - 0.5), t
    assert float(kernel._largest_y(np.float32(math.nan))) < 1  # no y (>= 1) passes


def _race_both(logits, temperature, top_k=0, top_p=1.0, seed=7):
    """(kernel winners, eager winners) on the same logits, filters and keys."""
    num_rows = logits.shape[0]
    temperatures = torch.full((num_rows,), temperature, dtype=torch.float64)
    top_k = top_k if isinstance(top_k, list) else [top_k] * num_rows
    top_p = top_p if isinstance(top_p, list) else [top_p] * num_rows
    floors = logit_floors(logits, temperatures, top_k, top_p)
    keys = row_keys(seed, range(100, 100 + num_rows), logits.device)
    racing = np.ones(num_rows, np.bool_)
    compiled = race_kernel.argmax_and_race(logits, None, racing, temperatures, floors, keys)[2]
    return compiled.tolist(), _race_eager(logits, temperatures, floors, keys).tolist()


@pytest.mark.parametrize("scale", [0.3, 3.0, 20.0, 200.0])  # flat ... peaked
@pytest.mark.parametrize("temperature", [0.8, 1.0, 1e3])
def test_same_winners_as_the_eager_race(scale, temperature):
    logits = torch.randn(96, 6000, generator=torch.Generator().manual_seed(int(scale * 10))) * scale
    compiled, eager = _race_both(logits, temperature)
    assert compiled == eager
    if scale * temperature < 100:  # not so peaked that every row keeps its argmax
        assert compiled != logits.argmax(-1).tolist()


def test_same_winners_under_top_k_and_top_p_floors():
    logits = torch.randn(120, 3000, generator=torch.Generator().manual_seed(3)) * 4
    compiled, eager = _race_both(
        logits, 1.3, top_k=[0, 1, 5, 50, 0, 2999] * 20, top_p=[1.0, 1.0, 1.0, 0.9, 0.3, 0.99] * 20
    )
    assert compiled == eager
    assert [compiled[i] for i in range(1, 120, 6)] == logits[1::6].argmax(-1).tolist()  # top-1 is the argmax


def test_tiny_temperature_draws_the_argmax_or_a_token_tied_with_it():
    logits = torch.randn(32, 2000, generator=torch.Generator().manual_seed(4)) * 5
    first = logits.argmax(-1).tolist()
    logits[::2, 1500] = logits[::2].max(dim=-1).values  # even rows: a tie for the max
    compiled, eager = _race_both(logits, 1e-39)
    assert compiled == eager
    assert compiled[1::2] == first[1::2]
    assert all(c in (1500, f) for c, f in zip(compiled[::2], first[::2]))
    assert {c == 1500 for c in compiled[::2]} == {True, False}  # the noise picks between the tied two
    # At T = 1 two tied tokens score by their noise alone: the same one on both paths.
    flat = torch.zeros(32, 500)
    compiled, eager = _race_both(flat, 1.0)
    assert compiled == eager and len(set(compiled)) > 20


def test_argmax_and_finiteness_match_torch():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(5))
    logits[0, 10], logits[0, 900] = 9.0, 9.0  # tie: the first
    logits[1, 5] = math.nan
    logits[2, 7] = math.inf
    logits[3] = -math.inf
    logits[4, :500] = -math.inf  # -inf tokens, a finite max
    logits[5] = 0.0
    logits[5, :3] = -0.0  # -0.0 == 0.0: the first zero is the argmax
    logits[6, 999] = -math.nan
    greedy = (
        np.zeros(8, np.bool_),
        torch.ones(8, dtype=torch.float64),
        torch.full((8,), -math.inf, dtype=torch.float64),
        torch.zeros(8, dtype=torch.long),
    )
    top, finite, drawn, _, _ = race_kernel.argmax_and_race(logits, None, *greedy)
    values, expected = logits.max(dim=-1)
    assert finite.tolist() == torch.isfinite(values).tolist() == [True, False, False, False, True, True, False, True]
    assert [t for t, ok in zip(top.tolist(), finite.tolist()) if ok] == expected[finite].tolist()
    assert drawn.tolist() == top.tolist()  # rows out of the race keep their argmax
    # A draft on a row whose max is not finite is left undecided, with no normaliser.
    drafts = _rejected_outright([SparseDist([0], [1.0])] * 8)
    _, _, _, norms, verdicts = race_kernel.argmax_and_race(logits, None, *greedy, drafts)
    assert [math.isnan(norm) for norm in norms.tolist()] == [not ok for ok in finite.tolist()]
    assert [v == race_kernel.UNDECIDED for v in verdicts.tolist()] == [not ok for ok in finite.tolist()]


def _rejected_outright(dists, chain=None):
    """Drafts for race_kernel.argmax_and_race: at row r the first token of dists[r], rejected outright (threshold
    +inf), so that its residual is drawn; a dist of None: no draft there. Each row alone, or `chain` as one group."""
    num_rows = len(dists)
    token_ids = np.array([race_kernel.NO_TOKEN if d is None else d.token_ids[0] for d in dists], np.int64)
    sizes = [0 if d is None else len(d.token_ids) for d in dists]
    q_ids = np.array([t for d in dists if d is not None for t in d.token_ids], np.int64)
    q_probs = np.array([p / sum(d.probs) for d in dists if d is not None for p in d.probs], np.float64)
    groups = np.arange(num_rows + 1) if chain is None else np.array(chain, np.int64)
    q_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return race_kernel.Drafts(token_ids, np.full(num_rows, math.inf), q_starts, q_ids, q_probs, groups)


def test_residuals_from_logits_are_the_dense_residuals():
    """A rejection's residual, drawn in the argmax pass with q's tokens reweighted, equals the dense
    max(p - q, 0) draw."""
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(40, 5000, generator=generator) * torch.tensor([0.5, 3.0, 30.0, 3.0, 3.0] * 8)[:, None]
    temperature = torch.full((40,), 0.7, dtype=torch.float64)
    floors = logit_floors(logits, temperature, [0, 0, 0, 40, 1] * 8, [1.0] * 40)
    p = probs_with_floors(logits, temperature, floors)  # [40, V]
    dists = []
    # q: a perturbed top-8 of p, so p - q > 0 on some of its tokens and not others. (Where p - q is as
    # small as float32's rounding of a dense p, 6e-8, that rounding decides the dense draw, not p.)
    for row in range(40):
        top = p[row].double().topk(8)
        weights = top.values * torch.rand(8, generator=generator, dtype=torch.float64) * 2 + 0.02
        dists.append(SparseDist(top.indices.tolist(), (weights / weights.sum()).tolist()))
    dists[4] = SparseDist([int(logits[4].argmax())], [1.0])  # q = p = one-hot: an empty residual, so p itself
    racing = np.zeros(40, np.bool_)
    for seed in range(5):
        positions = [seed * 100 + row for row in range(40)]
        keys = row_keys(seed, positions, torch.device("cpu"))
        _, _, fast, _, verdicts = race_kernel.argmax_and_race(
            logits, None, racing, temperature, floors, keys, _rejected_outright(dists)
        )
        dense = [residual_token(p[row], dists[row], seed, positions[row]) for row in range(40)]
        assert fast.tolist() == dense
        assert fast[4] == int(logits[4].argmax())
        assert (verdicts == race_kernel.REJECTED).all()
        # The eager path's batched residuals are the dense ones too.
        assert residual_tokens(logits, range(40), temperature, floors, dists, [seed] * 40, positions) == dense


def test_a_chain_is_walked_only_as_far_as_its_drafts_are_accepted():
    """A chain's rows are one group, walked in order: after a rejection (or a row that is not finite) its rows
    get no verdict and no normaliser, and its bonus row is not raced (its draw stays the argmax)."""
    generator = torch.Generator().manual_seed(13)
    logits = torch.randn(8, 3000, generator=generator) * 3
    logits[6, 17] = math.nan
    dists = [SparseDist([5, 9], [0.5, 0.5])] * 8
    drafts = _rejected_outright(dists[:2] + [None] + dists[3:5] + [None] + dists[6:7] + [None], [0, 3, 6, 8])
    racing = np.array([False, False, True, False, False, True, False, True])
    temperature = torch.ones(8, dtype=torch.float64)
    floors = torch.full((8,), -math.inf, dtype=torch.float64)
    keys = torch.arange(8, dtype=torch.long) + 100
    top, finite, drawn, norms, verdicts = race_kernel.argmax_and_race(
        logits, None, racing, temperature, floors, keys, drafts
    )
    rejected, undecided = race_kernel.REJECTED, race_kernel.UNDECIDED
    # Chain [0, 3): rejected at once; chain [3, 6) likewise; chain [6, 8): its first row is not finite.
    assert verdicts.tolist() == [rejected, undecided, undecided, rejected, undecided, undecided, undecided, undecided]
    assert [math.isnan(n) for n in norms.tolist()] == [False, True, True, False, True, True, True, True]
    assert drawn[[1, 2, 4, 5, 6, 7]].tolist() == top[[1, 2, 4, 5, 6, 7]].tolist()
    assert finite.tolist() == [True] * 6 + [False, True]
    # Each row alone, the same bonus rows are raced: a winner other than the argmax somewhere.
    alone = race_kernel.argmax_and_race(logits, None, racing, temperature, floors, keys)[2]
    assert alone[[2, 5, 7]].tolist() != top[[2, 5, 7]].tolist()


def test_the_kernels_exponential_is_within_a_float32_rounding():
    x = np.linspace(-80.0, 0.0, 200_001, dtype=np.float32)
    exact = np.exp(x.astype(np.float64))
    compiled = np.array([kernel._exp(v) for v in x[::97]] + [kernel._exp(x[-1])], np.float64)
    assert np.max(np.abs(compiled / np.append(exact[::97], exact[-1]) - 1)) < 2e-7


@pytest.mark.parametrize("temperature", [1e-39, 0.8, 1.0, 1e3])
def test_log_norms_are_float64_logsumexp(temperature):
    """The argmax pass's log-normalisers at the rows with a draft: the vectorized sum (float32 exponentials
    and lanes) against torch's float64 logsumexp."""
    generator = torch.Generator().manual_seed(10)
    logits = torch.randn(24, 20_000, generator=generator) * torch.tensor([0.3, 3.0, 30.0] * 8)[:, None]
    logits[3, :5000] = -math.inf
    temperatures = torch.full((24,), temperature, dtype=torch.float64)
    floors = logit_floors(logits, temperatures, [0, 0, 0, 40, 1, 5000] * 4, [1.0] * 24)
    values, top = logits.max(dim=-1)
    with_draft = torch.arange(24) % 5 != 2  # rows without a draft get no normaliser
    dists = [SparseDist([int(t)], [1.0]) if ok else None for t, ok in zip(top.tolist(), with_draft.tolist())]
    keys = torch.zeros(24, dtype=torch.long)
    racing = np.zeros(24, np.bool_)
    drafts = _rejected_outright(dists)
    compiled = race_kernel.argmax_and_race(logits, None, racing, temperatures, floors, keys, drafts)[3]
    assert compiled[~with_draft].isnan().all()
    shifted = (logits.double() - values[:, None].double()) / max(temperature, torch.finfo(torch.float32).tiny)
    exact = shifted.masked_fill(logits < floors[:, None].float(), -math.inf).logsumexp(dim=-1)
    torch.testing.assert_close(compiled[with_draft], exact[with_draft], rtol=0, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.8, 1.0])
def test_drafts_decided_on_part_of_the_normaliser_get_the_whole_ones_verdict(temperature):
    """A draft is first judged on the exponentials of the blocks near its row's max and a bound on the others
    (_near_terms); the whole normaliser is summed only where that cannot accept it. Thresholds on either side of
    each draft's p get the verdict the whole normaliser gives: 1e-4 off p (torch's float64 logsumexp), and 1e-12 off
    the p the kernel computes from its whole normaliser. Only a threshold far enough below p is decided without the
    whole normaliser (its row's normaliser left NaN)."""
    generator = torch.Generator().manual_seed(12)
    logits = torch.randn(8, 20_000, generator=generator) * 2.0  # text-like: a few tokens far above the rest
    logits[:, 100:104] += torch.tensor([14.0, 13.0, 11.0, 9.0])
    # 32 blocks just past the near ones: about 1% of the normaliser, which only the bound on them accounts for.
    logits[:, 4096:12288] = (logits.max(dim=-1).values - 13.5 * temperature)[:, None]
    temperatures = torch.full((8,), temperature, dtype=torch.float64)
    floors = torch.full((8,), -math.inf, dtype=torch.float64)
    racing, keys = np.zeros(8, np.bool_), torch.zeros(8, dtype=torch.long)
    tokens = torch.tensor([100, 101, 102, 103] * 2)
    dists = [SparseDist([int(t)], [1.0]) for t in tokens.tolist()]

    def decided(thresholds):
        drafts = dataclasses.replace(_rejected_outright(dists), thresholds=thresholds)
        _, _, _, norms, verdicts = race_kernel.argmax_and_race(logits, None, racing, temperatures, floors, keys, drafts)
        return verdicts.tolist(), norms.isnan().tolist()

    picked, top_logits = logits[torch.arange(8), tokens], logits.max(dim=-1).values
    weights = ((picked - top_logits) / torch.tensor(temperature, dtype=torch.float32)).double()
    shifted = (logits.double() - top_logits[:, None].double()) / temperature
    exact = (weights - shifted.logsumexp(dim=-1)).exp().numpy()
    whole = race_kernel.argmax_and_race(logits, None, racing, temperatures, floors, keys, _rejected_outright(dists))[3]
    computed = (weights - whole).exp().numpy()  # p as the kernel computes it from the whole normaliser
    accepted, rejected = [race_kernel.ACCEPTED] * 8, [race_kernel.REJECTED] * 8
    assert decided(exact * 0.5) == (accepted, [True] * 8)  # surely, on part of each row
    assert decided(exact * (1 - 1e-4))[0] == accepted
    assert decided(exact * (1 + 1e-4)) == (rejected, [False] * 8)
    assert decided(computed * (1 - 1e-12)) == (accepted, [False] * 8)  # within the slack: the whole normaliser
    assert decided(computed * (1 + 1e-12)) == (rejected, [False] * 8)


def test_draw_rows_agree_on_the_compiled_and_the_eager_path():
    """float64 logits take the eager path; the same values in float32 take the kernel."""
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(30, 4000, generator=generator) * torch.tensor([1.0, 8.0, 3.0] * 10)[:, None]  # [L, V]
    params = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=30, top_p=0.9)]
    rows = []
    for i in range(6):
        start = i * 5
        probs = (logits[start : start + 4].double() / 0.8).softmax(dim=-1)
        top = probs.topk(20)
        dists = tuple(SparseDist(ids.tolist(), (w / w.sum()).tolist()) for w, ids in zip(top.values, top.indices))
        positions = tuple(range(50 + i, 55 + i))
        if i % 2:
            rows.append(RowDraw(5, params[1], i, positions, tuple(d.token_ids[i % 3] for d in dists), dists))
        else:
            rows.append(RowDraw(5, params[i % 3], i, positions))
    compiled, eager = draw_rows(logits, rows), draw_rows(logits.double(), rows)
    assert compiled == eager
    assert any(r.accepted_nodes for r in compiled[1::2]) and not all(len(r.accepted_nodes) == 4 for r in compiled[1::2])


def test_the_pass_decides_drafts_as_the_dense_rejection_sampler_does():
    """The argmax pass walks each chain: p at each draft it reaches, its verdict, a rejected draft's residual
    raced there, the bonus where every draft was accepted. Every chain's outcome, on flat rows and peaked,
    under top-k and top-p, equals verify_chain_by_rejection on the dense p."""
    generator = torch.Generator().manual_seed(14)
    num_chains, depth = 12, 4
    # Flat rows and peaked rows, each chain's own.
    scales = torch.tensor([1.0, 1.0, 12.0, 12.0, 4.0, 0.5] * 2).repeat_interleave(depth + 1)
    logits = torch.randn(num_chains * (depth + 1), 3000, generator=generator) * scales[:, None]
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.1, top_k=50, top_p=0.95)]
    outcomes = collections.Counter()
    for seed in range(25):
        rows, references = [], []
        for c in range(num_chains):
            span = slice(c * (depth + 1), (c + 1) * (depth + 1))
            row_params = params[c % 2]
            temperature = torch.full((depth + 1,), row_params.temperature, dtype=torch.float64)
            floors = logit_floors(logits[span], temperature, [row_params.top_k] * 5, [row_params.top_p] * 5)
            p = probs_with_floors(logits[span], temperature, floors)  # [depth + 1, V]
            # q: p's top 8, perturbed, so that drafts are accepted often and rejected often; a draft from q.
            dists, drafts = [], []
            for d in range(depth):
                top = p[d].double().topk(8)
                weights = top.values * torch.rand(8, generator=generator, dtype=torch.float64) * 2 + 0.02
                dists.append(SparseDist(top.indices.tolist(), (weights / weights.sum()).tolist()))
                drafts.append(dists[-1].token_ids[int(torch.multinomial(weights, 1, generator=generator))])
            positions = tuple(range(100 + c, 105 + c))
            rows.append(RowDraw(depth + 1, row_params, seed, positions, tuple(drafts), tuple(dists)))
            references.append(verify_chain_by_rejection(drafts, dists, p, positions, seed))
        drawn = draw_rows(logits, rows)
        assert drawn == references
        outcomes.update(min(len(r.accepted_nodes), 2) for r in drawn)
    assert outcomes[0] and outcomes[1] and outcomes[2]  # none of a chain's drafts accepted, one, two or more


def test_without_numba_the_eager_race_draws_the_same_tokens_after_one_log_line():
    script = (
        "import sys, logging; sys.modules['numba'] = None; logging.basicConfig(format='%(message)s')\n"
        "import torch; from specedge.server.sampling import sample; from specedge.types import SamplingParams\n"
        "logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(9)) * 3\n"
        "for _ in range(2): print(sample(logits, range(6), SamplingParams(temperature=0.9), seed=4))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(9)) * 3
    expected = str(sample(logits, range(6), SamplingParams(temperature=0.9), seed=4))
    assert run.stdout.splitlines() == [expected, expected]
    [line] = run.stderr.splitlines()
    assert line.startswith("numba unavailable") and "eager race" in line
