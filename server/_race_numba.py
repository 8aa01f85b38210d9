"""The compiled loops behind server/race_kernel.py (imported only where numba is installed).

Loops index with np.uintp so that numba drops negative-index wraparound and LLVM
vectorizes them; uint32 casts keep the hash in 32-bit lanes, as
specedge/noise.py's MASK32 does for Python ints.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from specedge import noise

# numba compiles these values into the kernels it caches on disk, and its cache watches this file only: values
# read from another file would stay stale there. So they are written out here, and tests/test_kernels.py checks
# them against their sources.
NO_TOKEN = -1  # server/race_kernel.py's NO_TOKEN
UNDECIDED, REJECTED, ACCEPTED = -1, 0, 1  # server/race_kernel.py's: argmax_and_race's verdicts
_MIX = np.uint32(0x45D9F3B)  # specedge/noise.py's MIX_MULTIPLIER
_UNIFORM_BITS = 23  # specedge/noise.py's UNIFORM_BITS
_SHIFT = np.uint32(32 - _UNIFORM_BITS)
_ONE = np.uint32(1 << _UNIFORM_BITS)  # y = _ONE - token_uniform(bits), in [1, 2**23]
_U_SCALE = np.float32(2.0**-_UNIFORM_BITS)
# The bound's slack, in units of e (ln 2 of score): float32 rounding of a score is ~1e-5 of it.
BOUND_SLACK = 1 / 64
LN2 = math.log(2.0)
# Rows are read in blocks: the argmax keeps each block's max, and the race skips a block whose
# max is out of reach and updates its bound between blocks.
_BLOCK = 256
_KEY_MAGNITUDE = np.int32(0x7FFFFFFF)
_KEY_INF = np.int32(0x7F800000)  # the ordered key of +inf; -_KEY_INF is -inf's, NaNs lie beyond both


def set_threads(num_threads: int) -> None:
    # numba.config sets its attributes at import, from the environment: mypy cannot see them.
    numba.set_num_threads(max(1, min(num_threads, numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits` (a register move, so loops around it vectorize)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


# The vector width a loop here may take. On CPUs with AVX-512, LLVM's tuning prefers 256-bit vectors in the loops
# it vectorizes (wide ones once slowed the clock). These loops read a row from cache, and do more per token where
# the row is flat. 512 bits on a 2-core Xeon (AVX-512), the step's draws over the 1.5B's logits (64 rows x 5 x
# 152k, in turn): 0.91x at T = 0.8 and 0.94x with top-20 q on flat rows, 0.95x greedy; peaked rows unchanged.
# Without AVX-512 there is nothing wider, and nothing changes.
_VECTOR_BITS = '"prefer-vector-width"="512"'


@intrinsic
def _wide_vectors(typingctx):
    """Lets LLVM vectorize the loops of the function it is called in at _VECTOR_BITS. llvmlite lists only LLVM's
    enum attributes as known; a string attribute is written out as it stands."""

    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, _VECTOR_BITS)
        return context.get_dummy_value()

    return types.none(), codegen


@njit(inline="always")
def _largest_y(t):
    """An upper bound on the y a token can have and still reach the best score, from its t (see _race):
    2**(t - 1) + 1/2, taken as (1 + f) 2**k + 1/2 with k + f = t - 1, 0 <= f < 1, since 2**f <= 1 + f.
    At most 1.09x the exact power, where testing y < 2**(floor(t) + 1) admitted 2-4x as many noises."""
    v = min(t if t > np.float32(-1.0) else np.float32(-1.0), np.float32(24.0)) - np.float32(1.0)  # NaN -> -2
    k = np.floor(v)
    power = _float32_from_bits(np.int32((np.int32(k) + np.int32(127)) << np.int32(23)))
    return (np.float32(1.0) + (v - k)) * power + np.float32(0.5)


@njit(inline="always")
def _mix32(x):
    x = np.uint32(np.uint32((x >> np.uint32(16)) ^ x) * _MIX)
    x = np.uint32(np.uint32((x >> np.uint32(16)) ^ x) * _MIX)
    return np.uint32((x >> np.uint32(16)) ^ x)


@njit(inline="always")
def _uniform_top(key, token_hash):
    """noise.token_uniform(noise.token_bits(key, token)) from the token's tabulated hash."""
    return np.uint32(_mix32(np.uint32(key ^ token_hash)) >> _SHIFT)


@njit(inline="always")
def _gumbel(key, token_hash):
    """Float32 -log(-log u), u = (top + 0.5) / 2**23: sampling.gumbel's arithmetic."""
    u = (np.float32(_uniform_top(key, token_hash)) + np.float32(0.5)) * _U_SCALE
    return -np.float32(math.log(-np.float32(math.log(u))))


@njit(inline="always")
def _ordered(bits):
    """An int32 that orders float32 bits as the floats are ordered (-0.0 and 0.0 alike)."""
    sign = bits >> np.int32(31)
    return np.int32(((bits & _KEY_MAGNITUDE) ^ sign) - sign)


@njit
def _argmax(bits, block_max_bits):
    """(first index of the max, max finite) of a float32 row read as int32 bits [V]; fills
    block_max_bits [ceil(V / _BLOCK)] with the bits of each block's max (NaN's beyond +inf).

    The row's four quarters are read side by side, a block of each at a time: four streams keep
    more of the memory's lines in flight than one, and a step's rows read in 0.8x the time."""
    _wide_vectors()
    num_tokens = bits.shape[0]
    best, lowest, best_start = np.int32(-_KEY_MAGNITUDE), np.int32(_KEY_MAGNITUDE), num_tokens
    span = num_tokens // (4 * _BLOCK) * _BLOCK  # a quarter's whole blocks
    for first in range(0, span, _BLOCK):
        max0 = max1 = max2 = max3 = np.int32(-_KEY_MAGNITUDE)
        min0 = min1 = min2 = min3 = np.int32(_KEY_MAGNITUDE)
        for j in range(first, first + _BLOCK):
            key0, key1 = _ordered(bits[np.uintp(j)]), _ordered(bits[np.uintp(j + span)])
            key2, key3 = _ordered(bits[np.uintp(j + 2 * span)]), _ordered(bits[np.uintp(j + 3 * span)])
            max0, min0, max1, min1 = max(max0, key0), min(min0, key0), max(max1, key1), min(min1, key1)
            max2, min2, max3, min3 = max(max2, key2), min(min2, key2), max(max3, key3), min(min3, key3)
        lowest = min(lowest, min(min0, min1), min(min2, min3))
        for start, block_max in (
            (first, max0),
            (first + span, max1),
            (first + 2 * span, max2),
            (first + 3 * span, max3),
        ):
            block_max_bits[start // _BLOCK] = _ordered(block_max)  # the map is its own inverse
            if block_max > best or (block_max == best and start < best_start):
                best, best_start = block_max, start
    for start in range(4 * span, num_tokens, _BLOCK):  # the blocks left over, the last perhaps partial
        block_max, block_min = np.int32(-_KEY_MAGNITUDE), np.int32(_KEY_MAGNITUDE)
        for j in range(start, min(start + _BLOCK, num_tokens)):
            key = _ordered(bits[np.uintp(j)])
            block_max, block_min = max(block_max, key), min(block_min, key)
        block_max_bits[start // _BLOCK] = _ordered(block_max)
        lowest = min(lowest, block_min)
        if block_max > best or (block_max == best and start < best_start):
            best, best_start = block_max, start
    top = best_start
    while _ordered(bits[np.uintp(top)]) != best:
        top += 1
    # NaN beyond +inf or below -inf, or a max of +inf or -inf: not finite.
    return top, best < _KEY_INF and lowest >= -_KEY_INF and best != -_KEY_INF


@njit(inline="always")
def _log_weight(token, logit, top_logit, temperature, override_ids, override_weights):
    for k in range(override_ids.shape[0]):
        if override_ids[k] == token:
            return override_weights[k]
    return np.float32(logit - top_logit) / temperature


@njit
def _race(row, top, block_max, temperature, floor, key, token_hash, override_ids, override_weights):
    """The winner of the race on one row [V] whose argmax is `top` (block maxima [V / _BLOCK]), or NO_TOKEN."""
    _wide_vectors()
    num_tokens = row.shape[0]
    top_logit = row[top]
    best, winner = -np.inf, NO_TOKEN
    score = _log_weight(top, top_logit, top_logit, temperature, override_ids, override_weights)
    score += _gumbel(key, token_hash[top])
    if score > -np.inf:
        best, winner = score, top
    # A token's noise is at most 23 ln 2 - ln(y - 1/2), so with a = (logit - max) / T it can reach `best`
    # only if y <= 2**(t - 1) + 1/2, t = 24 - (best - a) / ln 2 (plus BOUND_SLACK): _largest_y(t).
    scale = np.float32(1.0 / LN2) / temperature
    for start in range(0, num_tokens, _BLOCK):
        stop = min(start + _BLOCK, num_tokens)
        offset = np.float32(24.0 + BOUND_SLACK - best / LN2)
        highest = block_max[start // _BLOCK]
        reach = (highest - top_logit) * scale + offset  # an upper bound on the block's t
        if not (highest >= floor and reach >= np.float32(0.0)):
            continue  # no token of the block is within reach
        # First the noise alone, against the block's highest t: its smallest y.
        highest_bits = np.uint32(0)
        for j in range(start, stop):
            highest_bits = max(highest_bits, _mix32(np.uint32(key ^ token_hash[np.uintp(j)])))
        if np.float32(np.int32(_ONE) - np.int32(highest_bits >> _SHIFT)) > _largest_y(reach):
            continue
        candidates = False
        for j in range(start, stop):
            logit = row[np.uintp(j)]
            t = (logit - top_logit) * scale + offset
            y = np.int32(np.int32(_ONE) - np.int32(_uniform_top(key, token_hash[np.uintp(j)])))
            candidates |= (logit >= floor) & (np.float32(y) <= _largest_y(t))
        if not candidates:
            continue
        for j in range(start, stop):
            logit = row[j]
            if not logit >= floor or j == top:
                continue
            t = (logit - top_logit) * scale + offset
            if not t >= 0.0:
                continue
            y = np.int32(np.int32(_ONE) - np.int32(_uniform_top(key, token_hash[j])))
            if np.float32(y) > _largest_y(t):
                continue
            score = _log_weight(j, logit, top_logit, temperature, override_ids, override_weights)
            score += _gumbel(key, token_hash[j])
            if score > best or (score == best and score > -np.inf and j < winner):
                best, winner = score, j
    return winner


_NO_IDS, _NO_WEIGHTS = np.zeros(0, np.int64), np.zeros(0, np.float32)  # a race without overrides
_TINY = np.float32(np.finfo(np.float32).tiny)
_LOG_SMALLEST_P = math.log(2.0**-149)  # float32's smallest positive p


@njit(parallel=True, cache=True)
def argmax_and_race(
    logits,
    rows,
    groups,
    racing,
    temperature,
    floors,
    keys,
    token_hash,
    draft_tokens,
    thresholds,
    q_starts,
    q_ids,
    q_probs,
    top,
    finite,
    winners,
    norms,
    verdicts,
):
    """Each group of rows (groups[g]:groups[g + 1]) in order, the groups in parallel: a chain verified by
    rejection (its drafts' rows, then its bonus row) is one group, walked until a draft is rejected;
    any other row is a group of its own (server/race_kernel.py's argmax_and_race says what each gets)."""
    num_blocks = (logits.shape[1] + _BLOCK - 1) // _BLOCK
    for g in prange(groups.shape[0] - 1):
        block_max = np.empty(num_blocks, np.float32)
        reached = True  # by the walk: every draft before the row accepted, every row before it finite
        for r in range(groups[g], groups[g + 1]):
            row = logits[rows[r]]
            top[r], finite[r] = _argmax(row.view(np.int32), block_max.view(np.int32))
            winners[r], norms[r], verdicts[r] = top[r], np.nan, UNDECIDED
            reached = reached and finite[r]
            if not reached:
                continue  # read for its argmax and finiteness only: nothing is drawn there
            scale, floor = _scale(temperature[r]), np.float32(floors[r])
            if draft_tokens[r] == NO_TOKEN:
                if racing[r]:
                    winners[r] = _race(row, top[r], block_max, scale, floor, keys[r], token_hash, _NO_IDS, _NO_WEIGHTS)
                continue
            # Rejection sampling's verdict on the row's draft, from p there, with the row still in cache; a
            # rejection's residual is raced at once, and ends the walk.
            # First on the blocks near the max and a bound on the others: where that accepts the draft, the whole
            # normaliser would too (_VERDICT_SLACK to spare), and the rest of the row's exponentials are skipped.
            top_logit = row[top[r]]
            lowest, near = _lowest_terms(top_logit, scale, floor)
            near_sum, far_bound = _near_terms(row, top_logit, block_max, scale, lowest, near)
            highest_norm = math.log((near_sum + far_bound * (1.0 + _BOUND_SLACK)) * (1.0 + _VERDICT_SLACK))
            surely = _prob(row[draft_tokens[r]], top_logit, scale, floors[r], highest_norm) * (1.0 - _VERDICT_SLACK)
            if thresholds[r] < surely:
                verdicts[r] = ACCEPTED  # norms[r] stays NaN
                continue
            norms[r] = math.log(near_sum + _block_terms(row, top_logit, block_max, scale, lowest, (lowest, near)))
            if thresholds[r] < _prob(row[draft_tokens[r]], top_logit, scale, floors[r], norms[r]):
                verdicts[r] = ACCEPTED
                continue
            verdicts[r], reached = REJECTED, False
            span = slice(q_starts[r], q_starts[r + 1])
            weights = _residual_weights(row, top_logit, scale, floors[r], norms[r], q_ids[span], q_probs[span])
            # A token whose p is below float32's smallest (2**-149) is 0, as in a dense float32 p.
            kept = np.float32(max(floors[r], np.float64(top_logit) + temperature[r] * (norms[r] + _LOG_SMALLEST_P)))
            winners[r] = _race(row, top[r], block_max, scale, kept, keys[r], token_hash, q_ids[span], weights)
            if winners[r] == NO_TOKEN:  # p <= q everywhere: p itself, the row's own race
                winners[r] = _race(row, top[r], block_max, scale, floor, keys[r], token_hash, _NO_IDS, _NO_WEIGHTS)


@njit(inline="always")
def _scale(temperature):
    """The float32 temperature scores are divided by (torch's temperature.float().clamp_min(tiny))."""
    return max(np.float32(temperature), _TINY)


@njit(inline="always")
def _prob(logit, top_logit, scale, floor, norm):
    """p of a token: exp((logit - max) / T - norm) in float64 from the float32 weight, 0 below the floor."""
    if not np.float64(logit) >= floor:
        return 0.0
    return math.exp(np.float64(np.float32(logit - top_logit) / scale) - norm)


@njit
def _residual_weights(row, top_logit, scale, floor, norm, ids, q):
    """log(max(p - q, 0)) + norm on q's tokens: the residual's weights on the race's (logit - max) / T scale."""
    weights = np.empty(ids.shape[0], np.float32)
    for k in range(ids.shape[0]):
        residual = _prob(row[ids[k]], top_logit, scale, floor, norm) - q[k]
        weights[k] = np.float32(math.log(residual) + norm) if residual > 0.0 else np.float32(-np.inf)
    return weights


# exp((logit - max) / T) below e**-64 adds nothing a float64 sum of <= 2**18 terms >= 1 can hold.
_NEGLIGIBLE = np.float32(-64.0)


_LOG2E = np.float32(1.44269504088896341)
_LN2_HIGH, _LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)


@njit(inline="always")
def _exp(x):
    """float32 e**x for x in [-80, 0], within 1e-7 of it: Cephes' expf without branches, so that
    a loop of it vectorizes (libm's exp is a call per token)."""
    k = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - k * _LN2_HIGH - k * _LN2_LOW
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * (r * r) + r + np.float32(1.0)) * _float32_from_bits(np.int32((np.int32(k) + np.int32(127)) << 23))


# A rejection-sampled row's normaliser, log sum exp((logit - max) / T) over its tokens with logit >= floor, is summed
# while the row is still in cache from its argmax: first over the blocks whose max (block_max, from _argmax) lies
# within _NEAR T of the row's max, with each other block bounded by _BLOCK times its max's term; where that cannot
# accept the draft, over the other blocks too. A block whose max is below the lowest logit that counts is skipped.
# On the 1.5B's logits of real text (T = 0.8) the near blocks were 14% of a row's blocks and the bound on the others
# 2% of the normaliser (a median; at 16 T, 37% and 0.08%), and a good draft model's drafts are mostly accepted, so
# most of such a row's exponentials are never computed. The bound's slack covers a block's float32 sum of terms each
# within 2e-7 of its exponential; the verdict's, the float64 sums' order and the verdict's logarithm and exponential.
_NEAR = np.float32(-12.0)
_NO_LOGIT = np.float32(np.inf)  # above every block's max: the near blocks' range has no upper end
_BOUND_SLACK, _VERDICT_SLACK = 1e-3, 1e-9


@njit(inline="always")
def _lowest_terms(top_logit, temperature, floor):
    """(the lowest logit whose term counts, the lowest a near block's max may be), float32."""
    lowest = max(floor, top_logit + _NEGLIGIBLE * temperature)
    return lowest, max(lowest, top_logit + _NEAR * temperature)


# Sums in any order, so that the exponentials go a vector at a time (16 with AVX-512, else 8): a block's 256
# terms in float32 lanes (each <= 1), the blocks in float64. Calls of their own, not inlined, so that they keep
# these flags.
@njit(fastmath={"reassoc", "nsz", "arcp", "contract"})
def _near_terms(row, top_logit, block_max, temperature, lowest, near):
    """(the sum of exp((logit - max) / T) over the near blocks' logits >= lowest, float64; a bound on the same sum
    over the other blocks, _BLOCK times each one's largest term)."""
    _wide_vectors()
    scale = np.float32(1.0) / temperature
    far_tops = np.float32(0.0)  # the far blocks' largest terms, summed
    for block in range(block_max.shape[0]):
        highest = block_max[np.uintp(block)]
        term = _exp(max(np.float32(highest - top_logit) * scale, _NEGLIGIBLE))
        far_tops += term if (highest >= lowest) & (highest < near) else np.float32(0.0)
    return _block_terms(row, top_logit, block_max, temperature, lowest, (near, _NO_LOGIT)), np.float64(
        far_tops
    ) * _BLOCK


@njit(fastmath={"reassoc", "nsz", "arcp", "contract"})
def _block_terms(row, top_logit, block_max, temperature, lowest, maxima):
    """The sum of exp((logit - max) / T) over the logits >= lowest of the blocks whose max lies in maxima = [low,
    high) (float64): _near_terms' blocks, [near, inf), or the others, [lowest, near)."""
    _wide_vectors()
    scale = np.float32(1.0) / temperature
    low, high = maxima
    total = 0.0
    for block in range(block_max.shape[0]):
        highest = block_max[block]
        if highest >= low and highest < high:
            start = block * _BLOCK
            total += _terms(row, start, min(start + _BLOCK, row.shape[0]), top_logit, scale, lowest)
    return total


@njit(inline="always", fastmath={"reassoc", "nsz", "arcp", "contract"})
def _terms(row, start, stop, top_logit, scale, lowest):
    """The float32 sum of exp((logit - max) / T) over row[start:stop]'s logits >= lowest."""
    block = np.float32(0.0)
    for j in range(start, stop):
        logit = row[np.uintp(j)]
        term = _exp(max(np.float32(logit - top_logit) * scale, _NEGLIGIBLE))
        block += term if logit >= lowest else np.float32(0.0)
    return block


def warm_up() -> None:
    """Compile (or load from numba's cache) on a tiny input, so a failure shows before the first step:
    eight equal logits, a draft of token 0 that q gave all its mass to (p = 1/8), rejected."""
    logits = np.zeros((1, 8), np.float32)
    one = np.ones(1)
    table = noise.token_hash(np.arange(8, dtype=np.int64)).astype(np.uint32)
    row, span = np.zeros(1, np.int64), np.array([0, 1], np.int64)
    top, winners, finite = row.copy(), row.copy(), np.zeros(1, np.bool_)
    norms, verdicts = np.zeros(1), np.zeros(1, np.int8)
    argmax_and_race(
        logits,
        row,
        span,
        np.zeros(1, np.bool_),
        one,
        -np.inf * one,
        np.zeros(1, np.uint32),
        table,
        row,  # draft token 0
        one / 2,  # u q(0) = 1/2 > p(0) = 1/8: rejected
        span,
        row,
        one,
        top,
        finite,
        winners,
        norms,
        verdicts,
    )
    if abs(norms[0] - math.log(8.0)) > 1e-6:
        raise RuntimeError(f"the compiled log-normaliser is wrong: {norms[0]}")
    if verdicts[0] != REJECTED or not 1 <= winners[0] < 8:  # the residual: any token but 0
        raise RuntimeError(f"the compiled rejection is wrong: verdict {verdicts[0]}, residual {winners[0]}")
