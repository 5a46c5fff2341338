"""Cases of metal/sampling.metal against ``lily.sampling`` (the CPU sampler is the specification of token
selection).

Greedy argmax (argmax_partial + argmax_final) exactly: one entry, a partial simdgroup, block boundaries 31/32/33 and
64/65, many partials, the chosen id written to its slot only, ties across blocks and -inf entries (the lowest id
wins), NaN beating every number. Sampling draw by draw against lily.sampling's filters (top_k_mask, top_p_mask,
min_p_mask) and draw rule (the first id whose cumulative kept probability exceeds u * total) in float64, fed with the
kernel's Philox4x32-10 number u. The kernel works in fp32, so a draw must match exactly unless nudging top_p or min_p
by 1e-5 (relative) or u by 2e-6 changes the float64 answer; such near-boundary draws must be rare (at most 1 in 12)
and must match one of the nudged answers. Ties at the top-p and top-k cuts, banned (-inf) tokens.

Penalties (penalize_logits) against ``Sampler.process`` in float64, with a history that repeats tokens, -inf entries,
a poisoned bias buffer when the bias is off, and vocabularies around the 256-thread group; count_token over a token
sequence written to alternating slots, ids past the vocabulary ignored.
"""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily.kernel_cases.common import Case, Run, dtype_of, poisoned, to_device, to_f64
from lily.sampling import Sampler, SamplingParams, log_softmax, min_p_mask, top_k_mask, top_p_mask

PATTERN = re.compile(r"argmax_partial_(f32|f16|bf16)|argmax_final_f32|sample_(f32|f16|bf16)|"
                     r"sample_(partial|final)_(f32|bf16)|penalize_logits_(f32|bf16)|count_token")
MASK32 = 0xFFFFFFFF
# (vocab, block, threads) of argmax; the first is the self-test's.
ARGMAX_SHAPES = [(5000, 1024, 256), (1, 64, 32), (31, 32, 32), (33, 32, 32), (64, 64, 64), (65, 64, 64),
                 (1000, 96, 64), (5000, 256, 128)]
# (temperature, top_k, top_p, min_p): Qwen's recommended settings (the self-test's); plain; top-p + min-p; top-k only;
# a narrow nucleus; top_k >= vocab (off).
SAMPLE_PARAMS = [(0.7, 20, 0.95, 0.0), (1.0, 0, 1.0, 0.0), (1.0, 0, 0.9, 0.05), (1.5, 5, 1.0, 0.0),
                 (0.8, 0, 0.5, 0.0), (1.0, 100000, 0.8, 0.1)]
SAMPLE_SIZES = [(2000, 256), (37, 32), (300, 64)]  # (vocab, threads)
# The block path (sample_partial + sample_final). LILY_SAMPLE_CANDIDATES and LILY_SAMPLE_PER_THREAD (metal/lily.h).
CANDIDATES = 64
PER_THREAD = 16
# (temperature, top_k, top_p, min_p) the block path takes: the benchmark's setting (the self-test's); plain
# temperature (block masses, no candidates); Qwen's; top_k = 1; top_k = CANDIDATES with top-p and min-p; top-k + min-p;
# top-p alone; min-p alone; top-k above CANDIDATES (within the candidates of 2000 logits in blocks of 256, beyond
# those of 1500 in blocks of 512: the general path).
BLOCK_PARAMS = [(0.7, 50, 0.9, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 20, 0.95, 0.0), (1.0, 1, 1.0, 0.0),
                (1.0, CANDIDATES, 0.8, 0.1), (1.5, 5, 1.0, 0.05), (0.8, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05),
                (1.0, 200, 0.9, 0.0)]
# (vocab, block, sample_partial threads, sample_final threads): the last block short in each; one block of fewer
# than CANDIDATES logits; 16 logits a thread.
BLOCK_SIZES = [(2000, 256, 32, 256), (37, 64, 32, 32), (1500, 512, 32, 64)]
STEPS = 12
# (repetition, presence, frequency, logit-bias entries): the model card's presence 1.5 (the self-test's); each alone;
# all together with a negative presence (a reward).
PENALTY_PARAMS = [(1.0, 1.5, 0.0, 0), (1.3, 0.0, 0.0, 0), (1.0, 0.0, 0.7, 0), (1.0, 0.0, 0.0, 8),
                  (1.2, -0.5, 0.3, 5)]
PENALTY_SIZES = [(5000, 256), (1, 256), (255, 256), (256, 256), (257, 256)]  # (vocab, threads)


def argmax_args(vocab: int, block: int, num_partials: int, out_index: int) -> bytes:
    """lily::ArgmaxArgs (metal/lily.h)."""
    return struct.pack("<IIII", vocab, block, num_partials, out_index)


def sample_args(vocab: int, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, step: int,
                out_index: int, block: int = 0) -> bytes:
    """lily::SampleArgs (metal/lily.h): 48 bytes; `block` > 0: the block path's block size and block count."""
    blocks = -(-vocab // block) if block else 0
    return struct.pack("<IIfffIIIIIII", vocab, top_k, temperature, top_p, min_p, seed & MASK32, seed >> 32, step,
                       out_index, block, blocks, 0)


def penalty_args(vocab: int, has_bias: bool, repetition: float, presence: float, frequency: float,
                 out_index: int = 0) -> bytes:
    """lily::PenaltyArgs (metal/lily.h): 32 bytes."""
    return struct.pack("<IIfffIII", vocab, int(has_bias), repetition, presence, frequency, out_index, 0, 0)


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al. 2011), the sampling kernel's random stream, in Python integers."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK32, p1 & MASK32, ((p0 >> 32) ^ c3 ^ k1) & MASK32, p0 & MASK32
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: int, step: int) -> float:
    """The kernel's u in [0, 1) for (request seed, step): 24 bits of the first Philox word."""
    return (philox4x32_10((step, 0, 0, 0), (seed & MASK32, seed >> 32))[0] >> 8) * 2.0**-24


def filtered(x32: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """lily.sampling's filters on temperature-scaled logits in float64: (what they keep, the top-k probabilities)."""
    x = x32.astype(np.float64)
    keep = top_k_mask(x, top_k)
    probs = np.exp(log_softmax(np.where(keep, x, -np.inf)))
    keep &= top_p_mask(probs, top_p)
    if min_p > 0.0:
        keep &= min_p_mask(probs, min_p)
    return keep, probs


def kept_tokens(x32: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The ids the filters keep with nonzero probability."""
    keep, probs = filtered(x32, top_k, top_p, min_p)
    return np.flatnonzero(keep & (probs > 0.0))


def expected_token(x32: np.ndarray, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """lily.sampling.Sampler.choose steps 5-6 on temperature-scaled logits, with the random number u given."""
    keep, probs = filtered(x32, top_k, top_p, min_p)
    cdf = np.cumsum(np.where(keep, probs, 0.0))
    token = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return token if token < x32.size and keep[token] else int(np.flatnonzero(keep)[-1])


def acceptable_tokens(x32: np.ndarray, top_k: int, top_p: float, min_p: float, u: float) -> set[int]:
    """The float64 answer, and the answers with top_p / min_p nudged by 1e-5 and u by 2e-6 (fp32 sums' slack)."""
    top = 1 - 2.0**-24
    nudges = [(top_p, min_p, u)]
    nudges += [(min(1.0, top_p * (1 + s)), min_p * (1 + s), u) for s in (-1e-5, 1e-5)]
    nudges += [(top_p, min_p, min(max(u + s, 0.0), top)) for s in (-2e-6, 2e-6)]
    return {expected_token(x32, top_k, p, m, v) for p, m, v in nudges}


def run_argmax(run: Run, kernel: str, logits: np.ndarray, block: int, threads: int, out_index: int = 0) -> int:
    """argmax_partial (`kernel`) then argmax_final_f32; the slot after out_index must stay untouched."""
    vocab = logits.shape[0]
    num_partials = -(-vocab // block)
    values, ids = np.full(num_partials, np.nan, np.float32), np.full(num_partials, MASK32, np.uint32)
    tokens = np.full(out_index + 2, MASK32, np.uint32)
    args = argmax_args(vocab, block, num_partials, out_index)
    run.dispatch(kernel, [args, logits, values, ids], num_partials, threads)
    run.dispatch("argmax_final_f32", [args, values, ids, tokens], 1, 32 * min(32, -(-num_partials // 32) + 1))
    run.require("slots other than out_index untouched", tokens[out_index + 1] == MASK32, f"tokens {tokens.tolist()}")
    return int(tokens[out_index])


def run_sample(run: Run, kernel: str, logits: np.ndarray, threads: int, temperature: float, top_k: int, top_p: float,
               min_p: float, seed: int, step: int, out_index: int = 1) -> int:
    """One draw into tokens[out_index]; the slots around it must stay untouched."""
    tokens = np.full(out_index + 2, MASK32, np.uint32)
    run.dispatch(kernel, [sample_args(logits.shape[0], temperature, top_k, top_p, min_p, seed, step, out_index), logits,
                          tokens], 1, threads, seed=step)
    run.require("slots other than out_index untouched", tokens[out_index + 1] == MASK32 == tokens[out_index - 1],
                f"tokens {tokens.tolist()}")
    return int(tokens[out_index])


def sample_key(x32: np.ndarray) -> np.ndarray:
    """The kernel's order-preserving uint32 key of fp32 values."""
    bits = np.ascontiguousarray(x32, np.float32).view(np.uint32)
    return np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)


def block_scratch(vocab: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """sample_partial's outputs, poisoned: candidate x and ids, block (max, sum), block (C-th key, ties left out)."""
    blocks = -(-vocab // block)
    return (poisoned((blocks * CANDIDATES,), "f32"), np.full(blocks * CANDIDATES, MASK32, np.uint32),
            poisoned((blocks * 2,), "f32"), np.full(blocks * 2, MASK32, np.uint32))


def run_sample_blocks(run: Run, dtype: str, logits: np.ndarray, block: int, partial_threads: int, final_threads: int,
                      temperature: float, top_k: int, top_p: float, min_p: float, seed: int, step: int,
                      out_index: int = 1, final_logits: np.ndarray | None = None) -> int:
    """sample_partial then sample_final (given `final_logits` when set) into tokens[out_index]; the slots around it
    must stay untouched."""
    vocab = logits.shape[0]
    args = sample_args(vocab, temperature, top_k, top_p, min_p, seed, step, out_index, block)
    scratch = list(block_scratch(vocab, block))
    tokens = np.full(out_index + 2, MASK32, np.uint32)
    run.dispatch(f"sample_partial_{dtype}", [args, logits, *scratch], -(-vocab // block), partial_threads, seed=step)
    final_logits = logits if final_logits is None else final_logits
    run.dispatch(f"sample_final_{dtype}", [args, final_logits, *scratch, tokens], 1, final_threads, seed=step)
    run.require("slots other than out_index untouched", tokens[out_index + 1] == MASK32 == tokens[out_index - 1],
                f"tokens {tokens.tolist()}")
    return int(tokens[out_index])


def block_draws(run: Run, dtype: str, logits: np.ndarray, x32: np.ndarray, block: int, final_threads: int,
                params: tuple, seed: int, steps: int, what: str = "drawn tokens",
                final_logits: np.ndarray | None = None) -> list[int]:
    """`steps` draws of the block path (sample_partial at 32 threads), each checked against lily.sampling's answers
    for x32 (the temperature-scaled logits); the tokens drawn."""
    temperature, top_k, top_p, min_p = params
    got = [run_sample_blocks(run, dtype, logits, block, 32, final_threads, temperature, top_k, top_p, min_p, seed,
                             step, final_logits=final_logits) for step in range(steps)]
    run.compare_allowed(what, got, [acceptable_tokens(x32, top_k, top_p, min_p, philox_uniform(seed, step))
                                    for step in range(steps)])
    return got


def partial_reference(x32: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What sample_partial writes for fp32 x = logit / temperature: per block the CANDIDATES largest (ties at the
    C-th key by lowest id) in id order, padded with (-inf, MASK32); max and float64 sum of exp(x - max); the C-th key
    (0 for a block of at most C) and the ties at it left out."""
    blocks = -(-x32.size // block)
    cand_x = np.full(blocks * CANDIDATES, -np.inf, np.float32)
    cand_id = np.full(blocks * CANDIDATES, MASK32, np.uint32)
    stats = np.zeros(blocks * 2)
    cut = np.zeros(blocks * 2, np.uint32)
    for b in range(blocks):
        xs = x32[b * block:(b + 1) * block]
        keys = sample_key(xs)
        top = float(xs.max())
        stats[2 * b] = top
        stats[2 * b + 1] = np.exp(xs.astype(np.float64) - top).sum() if top != -np.inf else 0.0
        if xs.size <= CANDIDATES:
            chosen = np.arange(xs.size)
        else:
            order = np.lexsort((np.arange(xs.size), -keys.astype(np.int64)))  # key descending, then id
            chosen = np.sort(order[:CANDIDATES])
            key_c = keys[order[CANDIDATES - 1]]
            cut[2 * b] = key_c
            cut[2 * b + 1] = int((keys == key_c).sum() - (keys[chosen] == key_c).sum())
        cand_x[b * CANDIDATES:b * CANDIDATES + chosen.size] = xs[chosen]
        cand_id[b * CANDIDATES:b * CANDIDATES + chosen.size] = chosen + b * block
    return cand_x, cand_id, stats, cut


# The filters of a sample_partial case: candidates are written unless top-k, top-p and min-p are all off.
PARTIAL_FILTERS = {"top-k": (50, 1.0, 0.0), "top-p": (0, 0.9, 0.0), "min-p": (0, 1.0, 0.05), "plain": (0, 1.0, 0.0)}


def _sample_partial(run: Run, kernel: str, vocab: int, block: int, threads: int, values: str,
                    filters: str = "top-k") -> None:
    """sample_partial's outputs exactly (the sums within fp32 rounding): random logits, logits from 6 values (ties at
    every block's C-th key), or a quarter -inf with one block all -inf. Plain temperature sampling writes the block
    statistics alone (the candidates and cuts stay poisoned)."""
    dtype = dtype_of(kernel)
    temperature = 0.7
    top_k, top_p, min_p = PARTIAL_FILTERS[filters]
    top_k = min(top_k, vocab - 1)
    if values == "ties":
        raw = run.rng.choice([-1.0, 0.0, 0.5, 1.0, 1.5, 2.0], vocab)
    else:
        raw = 3.0 * run.rng.standard_normal(vocab)
    if values == "-inf":
        raw[run.rng.choice(vocab, vocab // 4, replace=False)] = -np.inf
        raw[block:2 * block] = -np.inf
    logits = to_device(raw, dtype)
    x32 = (to_f64(logits, dtype).astype(np.float32) / np.float32(temperature)).astype(np.float32)
    cand_x, cand_id, stats, cut = block_scratch(vocab, block)
    untouched = [a.copy() for a in (cand_x, cand_id, cut)]
    run.dispatch(kernel, [sample_args(vocab, temperature, top_k, top_p, min_p, 5, 0, 0, block), logits, cand_x,
                          cand_id, stats, cut], -(-vocab // block), threads)
    want_x, want_id, want_stats, want_cut = partial_reference(x32, block)
    if filters == "plain":
        want_x, want_id, want_cut = untouched
    run.compare_exact("candidate ids", cand_id, want_id)
    run.compare_exact("candidate x (bits)", cand_x.view(np.uint32), want_x.view(np.uint32))
    run.compare_exact("block max", stats[0::2], want_stats[0::2].astype(np.float32))
    run.compare("block sum", stats[1::2], want_stats[1::2], "f32", allowance=block * 2.0**-24 * want_stats[1::2])
    run.compare_exact("block cut (C-th key, ties left out)", cut, want_cut)


def _sample_blocks(run: Run, kernel: str, vocab: int, block: int, partial_threads: int, final_threads: int,
                   params: tuple) -> None:
    """The block path draw by draw against lily.sampling (as _sample), and against sample_* on the same seeds: the
    same token unless the draw is near a rounding boundary."""
    temperature, top_k, top_p, min_p = params
    dtype = dtype_of(kernel)
    logits = to_device(3.0 * run.rng.standard_normal(vocab), dtype)
    x32 = (to_f64(logits, dtype).astype(np.float32) / np.float32(temperature)).astype(np.float32)
    seed = int(run.rng.integers(0, 2**64, dtype=np.uint64))
    got, allowed, general = [], [], []
    for step in range(STEPS):
        got.append(run_sample_blocks(run, dtype, logits, block, partial_threads, final_threads, temperature, top_k,
                                     top_p, min_p, seed, step))
        allowed.append(acceptable_tokens(x32, top_k, top_p, min_p, philox_uniform(seed, step)))
        general.append(run_sample(run, f"sample_{dtype}", logits, 32 * min(8, max(1, vocab // 64)), temperature,
                                  top_k, top_p, min_p, seed, step))
    run.compare_allowed("drawn tokens", got, allowed)
    near = sum(len(a) > 1 for a in allowed)
    run.require("near-boundary draws are rare", near <= 1, f"{near} of {STEPS} draws near a boundary")
    run.compare_allowed("the same tokens as sample_*", got, [{g} if len(a) == 1 else a for g, a in zip(general,
                                                                                                      allowed)])


def _sample_blocks_ties(run: Run, kernel: str, block: int, top_k: int, copies: int) -> None:
    """Ties at the top-k cut spread over blocks: `copies` tokens of the k-th value in every full block, top_k - 1 tokens
    just above it, some finite tokens below, the rest -inf. With more than CANDIDATES copies a block leaves ties out
    and sample_final must fall back to the general path (tokens left out are drawn). Draws match lily.sampling."""
    dtype = dtype_of(kernel)
    vocab = 4 * block + block // 2
    values = np.full(vocab, -np.inf)
    above = run.rng.choice(vocab, top_k - 1, replace=False)
    rest = np.setdiff1d(np.arange(vocab), above)
    tied = np.concatenate([run.rng.choice(rest[(rest >= b) & (rest < b + block)], copies, replace=False)
                           for b in range(0, vocab, block) if ((rest >= b) & (rest < b + block)).sum() >= copies])
    values[tied] = 1.0
    values[above] = 1.0 + 0.25 * (run.rng.random(above.size) + 0.01)
    others = np.setdiff1d(rest, tied)
    values[others[::2]] = 0.5 - run.rng.random(others[::2].size)  # below the cut, finite
    logits = to_device(values, dtype)
    x32 = to_f64(logits, dtype).astype(np.float32)
    left_out = np.setdiff1d(tied, partial_reference(x32, block)[1])
    run.require("the case leaves ties out exactly when copies > CANDIDATES",
                (left_out.size > 0) == (copies > CANDIDATES), f"{left_out.size} tied tokens left out of the candidates")
    got = block_draws(run, dtype, logits, x32, block, 64, (1.0, top_k, 1.0, 0.0), 31, 40)
    run.require("tied tokens are drawn", np.intersect1d(got, tied).size >= 3, f"drawn {sorted(set(got))}")
    if copies > CANDIDATES:
        run.require("tokens left out of the candidates are drawn", np.intersect1d(got, left_out).size > 0,
                    f"drawn {sorted(set(got))}")


def _draws_without_the_logits(run: Run, dtype: str, logits: np.ndarray, x32: np.ndarray, block: int,
                              final_threads: int, params: tuple, seed: int) -> None:
    """12 draws of the block path with sample_final given the logits rolled by one block and 7 ids: a fallback to the
    general path would draw from that other distribution. The case must keep only candidates."""
    kept = kept_tokens(x32, *params[1:])
    candidates = partial_reference(x32, block)[1]
    run.require("the filters keep candidates only", np.isin(kept, candidates).all(),
                f"{np.setdiff1d(kept, candidates).size} kept tokens are not candidates")
    block_draws(run, dtype, logits, x32, block, final_threads, params, seed, STEPS,
                "drawn tokens (sample_final never read the logits)", final_logits=np.roll(logits, block + 7))


def _sample_blocks_candidates_only(run: Run, kernel: str, params: tuple) -> None:
    """Peaked logits (trained-model-like: a few plausible tokens per block, the rest far below): the candidates hold
    every kept token, so sample_final draws from them alone, also for top-k off and top-k above CANDIDATES."""
    dtype = dtype_of(kernel)
    vocab, block = 1800, 256
    values = run.rng.normal(-6.0, 1.0, vocab)
    head = run.rng.choice(vocab, 40, replace=False)
    values[head] = run.rng.uniform(0.0, 3.0, head.size)
    logits = to_device(values, dtype)
    x32 = (to_f64(logits, dtype).astype(np.float32) / np.float32(params[0])).astype(np.float32)
    _draws_without_the_logits(run, dtype, logits, x32, block, 64, params, int(run.rng.integers(0, 2**32)))


def _sample_blocks_flat(run: Run, kernel: str, block: int, params: tuple) -> None:
    """Flat logits: the nucleus, the min-p set or the top-k reaches below blocks' CANDIDATES-th value, so sample_final
    must take the general path; tokens outside the candidates are drawn. Draws match lily.sampling."""
    dtype = dtype_of(kernel)
    vocab = 1100
    logits = to_device(0.3 * run.rng.standard_normal(vocab), dtype)
    x32 = (to_f64(logits, dtype).astype(np.float32) / np.float32(params[0])).astype(np.float32)
    kept = kept_tokens(x32, *params[1:])
    outside = np.setdiff1d(kept, partial_reference(x32, block)[1])
    run.require("a tenth of the kept tokens lie outside the candidates", outside.size * 10 > kept.size,
                f"{outside.size} of {kept.size} outside")
    got = block_draws(run, dtype, logits, x32, block, 64, params, 3, 48)
    run.require("tokens outside the candidates are drawn", np.intersect1d(got, outside).size > 0,
                f"drawn {sorted(set(got))}")


def _sample_blocks_top_p_ties(run: Run, kernel: str, copies: int) -> None:
    """Top-p alone with its cut inside a run of tied tokens: every block of 128 holds 2 tokens at 3.0, `copies` at 1.0
    and the rest at -2.0 (top-p 0.6 cuts inside the 1.0 ties). With 2 + copies = CANDIDATES every tie is a candidate
    (the block's CANDIDATES-th key is the cut key, no ties left out): the candidates suffice, and sample_final is
    given rolled logits. With more, blocks leave ties at the cut out: the general path, drawing some of them."""
    dtype = dtype_of(kernel)
    block, blocks = 128, 5
    values = np.full(block * blocks, -2.0)
    for b in range(blocks):
        ids = b * block + run.rng.permutation(block)
        values[ids[:2]] = 3.0
        values[ids[2:2 + copies]] = 1.0
    logits = to_device(values, dtype)
    x32 = to_f64(logits, dtype).astype(np.float32)
    params = (1.0, 0, 0.6, 0.0)
    if copies + 2 <= CANDIDATES:
        _draws_without_the_logits(run, dtype, logits, x32, block, 64, params, 17)
        return
    left_out = np.setdiff1d(np.flatnonzero(values == 1.0), partial_reference(x32, block)[1])
    got = block_draws(run, dtype, logits, x32, block, 64, params, 17, 40)
    run.require("tied tokens left out of the candidates are drawn", np.intersect1d(got, left_out).size > 0,
                f"drawn {sorted(set(got))}")


def _argmax(run: Run, kernel: str, vocab: int, block: int, threads: int) -> None:
    """Random logits, then (vocab > 2) a tie for the maximum in two blocks among -inf entries."""
    dtype = dtype_of(kernel)
    logits = to_device(4.0 * run.rng.standard_normal(vocab), dtype)
    widened = to_f64(logits, dtype)
    run.compare_exact("argmax", [run_argmax(run, kernel, logits, block, threads, out_index=3)], [np.argmax(widened)])
    if vocab > 2:
        tied = widened.copy()
        lo, hi = sorted(run.rng.choice(vocab, 2, replace=False))
        tied[run.rng.choice(vocab, vocab // 3)] = -np.inf
        tied[[lo, hi]] = widened.max() + 1.0
        run.compare_exact("tied argmax (lowest id)", [run_argmax(run, kernel, to_device(tied, dtype), block, threads)],
                          [lo])


def _argmax_nan_and_negative_infinity(run: Run, kernel: str) -> None:
    logits = np.full(200, -np.inf, np.float32)
    run.compare_exact("all -inf", [run_argmax(run, kernel, logits, 64, 32)], [0])
    logits[[150, 70]] = np.nan
    logits[10] = 5.0
    run.compare_exact("NaN beats every number", [run_argmax(run, kernel, logits, 64, 32)], [70])


def _argmax_final(run: Run, kernel: str, partials: int) -> None:
    values = np.round(run.rng.standard_normal(partials), 1).astype(np.float32)  # rounding makes ties likely
    ids = run.rng.permutation(partials * 10)[:partials].astype(np.uint32)
    tokens = np.full(2, MASK32, np.uint32)
    run.dispatch(kernel, [argmax_args(248320, 4096, partials, 1), values, ids, tokens], 1, 64)
    run.compare_exact("token at out_index", tokens[1:], [int(ids[values == values.max()].min())])


def _sample(run: Run, kernel: str, vocab: int, threads: int, params: tuple) -> None:
    temperature, top_k, top_p, min_p = params
    dtype = dtype_of(kernel)
    logits = to_device(3.0 * run.rng.standard_normal(vocab), dtype)
    x32 = (to_f64(logits, dtype).astype(np.float32) / np.float32(temperature)).astype(np.float32)
    seed = int(run.rng.integers(0, 2**64, dtype=np.uint64))
    got, allowed = [], []
    for step in range(STEPS):
        got.append(run_sample(run, kernel, logits, threads, temperature, top_k, top_p, min_p, seed, step))
        allowed.append(acceptable_tokens(x32, top_k, top_p, min_p, philox_uniform(seed, step)))
    run.compare_allowed("drawn tokens", got, allowed)
    near = sum(len(a) > 1 for a in allowed)
    run.require("near-boundary draws are rare", near <= 1, f"{near} of {STEPS} draws near a boundary")


def _sample_top_p_ties(run: Run, kernel: str, top_p: float) -> None:
    """Logits taking 4 values: the nucleus boundary falls inside a run of tied tokens (kept by lowest id)."""
    logits = run.rng.choice([0.0, 0.5, 1.0, 1.5], 257).astype(np.float32)
    got = [run_sample(run, kernel, logits, 64, 1.0, 0, top_p, 0.0, 12345, step) for step in range(10)]
    run.compare_allowed("drawn tokens", got, [acceptable_tokens(logits, 0, top_p, 0.0, philox_uniform(12345, step))
                                              for step in range(10)])


def _sample_top_k_crowded(run: Run, kernel: str) -> None:
    """9000 logits on 32 threads (282 a thread) in [1, 1.5): every key shares its top digits, so in a top-k pass a
    thread counts more keys of one digit than the 255 its packed 8-bit fields hold at once."""
    logits = run.rng.uniform(1.0, 1.5, 9000).astype(np.float32)
    got = [run_sample(run, kernel, logits, 32, 1.0, 20, 1.0, 0.0, 77, step) for step in range(6)]
    run.compare_allowed("drawn tokens", got, [acceptable_tokens(logits, 20, 1.0, 0.0, philox_uniform(77, step))
                                              for step in range(6)])


def _sample_top_k_ties_and_banned(run: Run, kernel: str) -> None:
    """Top-k keeps every token tied with the k-th value; -inf tokens are never drawn."""
    logits = np.full(100, -np.inf, np.float32)
    logits[[3, 40, 41, 77, 90]] = [2.0, 1.0, 1.0, 1.0, 0.5]
    seen = {run_sample(run, kernel, logits, 32, 1.0, 2, 1.0, 0.0, 9, step) for step in range(60)}
    run.compare_exact("tokens drawn in 60 steps", sorted(seen), [3, 40, 41, 77])


def penalty_inputs(run: Run, vocab: int, n_bias: int) -> tuple[list[int], list[int], dict[int, float]]:
    """A context, the tokens generated so far (repeats likely) and a logit bias of fp32 values."""
    context = run.rng.integers(0, vocab, size=min(vocab, 40)).tolist()
    generated = run.rng.integers(0, max(1, vocab // 8), size=30).tolist()
    ids = run.rng.choice(vocab, size=min(n_bias, vocab), replace=False)
    bias = {int(t): float(np.float32(v)) for t, v in zip(ids, run.rng.uniform(-100.0, 100.0, ids.size))}
    return context, generated, bias


def penalty_tables(vocab: int, context: list[int], generated: list[int], bias: dict[int, float]):
    """The engine's tables for penalize_logits: dense bias (NaN where the bias is off: never read), seen, counts."""
    dense = np.zeros(vocab, np.float32) if bias else np.full(vocab, np.nan, np.float32)
    for token, value in bias.items():
        dense[token] += value
    seen = np.zeros(vocab, np.uint32)
    seen[context + generated] = 1
    counts = np.bincount(np.asarray(generated, np.int64), minlength=vocab).astype(np.uint32)
    return dense, seen, counts


def run_penalize(run: Run, kernel: str, logits: np.ndarray, threads: int, params: SamplingParams,
                 context: list[int], generated: list[int]) -> np.ndarray:
    """penalize_logits over `logits` for a decode that has chosen `generated` after `context`; the fp32 result."""
    vocab = logits.shape[0]
    bias, seen, counts = penalty_tables(vocab, context, generated, params.logit_bias or {})
    processed = poisoned((vocab,), "f32")
    args = penalty_args(vocab, bool(params.logit_bias), params.repetition_penalty, params.presence_penalty,
                        params.frequency_penalty)
    run.dispatch(kernel, [args, logits, bias, seen, counts, processed], -(-vocab // threads), threads)
    return processed


def processed_reference(logits64: np.ndarray, params: SamplingParams, context: list[int],
                        generated: list[int]) -> np.ndarray:
    """lily.sampling steps 1-3 in float64 (``Sampler.process``)."""
    sampler = Sampler(params, context=context)
    sampler.generated = list(generated)
    return sampler.process(logits64)


def _penalize(run: Run, kernel: str, vocab: int, threads: int, params: tuple) -> None:
    repetition, presence, frequency, n_bias = params
    dtype = dtype_of(kernel)
    values = 4.0 * run.rng.standard_normal(vocab)
    values[run.rng.choice(vocab, vocab // 50, replace=False)] = -np.inf  # banned tokens stay banned
    logits = to_device(values, dtype)
    context, generated, bias = penalty_inputs(run, vocab, n_bias)
    sampling = SamplingParams(repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
                              logit_bias=bias)
    got = run_penalize(run, kernel, logits, threads, sampling, context, generated)
    x64 = to_f64(logits, dtype)
    expected = processed_reference(x64, sampling, context, generated)
    # fp32 steps: the bias add, the penalty division, presence + frequency·count and the subtraction (one rounding
    # each, of terms up to these magnitudes).
    counts = np.bincount(np.asarray(generated, np.int64), minlength=vocab)
    dense_bias = np.zeros(vocab)
    dense_bias[list(bias)] = list(bias.values())
    terms = np.abs(np.where(np.isfinite(x64), x64, 0.0)) + np.abs(dense_bias) + abs(presence) + frequency * counts
    run.compare("penalized logits", got, expected, "f32", allowance=4 * 2.0**-24 * terms)


def _count_token(run: Run, kernel: str, vocab: int) -> None:
    """Twenty choices written to alternating slots, repeating (a count must grow), the last id of the vocabulary and
    one past it (ignored), counted one by one."""
    context = run.rng.integers(0, vocab, size=10).tolist()
    _, seen, counts = penalty_tables(vocab, context, [], {})
    chosen = run.rng.integers(0, min(vocab, 5), size=20).tolist()
    chosen[7], chosen[11] = vocab, vocab - 1
    tokens = np.full(3, MASK32, np.uint32)
    for step, token in enumerate(chosen):
        slot = step % 2
        tokens[slot] = token
        run.dispatch(kernel, [penalty_args(vocab, False, 1.0, 0.0, 0.0, slot), tokens, seen, counts], 1, 32)
    valid = [t for t in chosen if t < vocab]
    run.compare_exact("token counts", counts, np.bincount(np.asarray(valid, np.int64), minlength=vocab))
    want_seen = np.zeros(vocab, np.uint32)
    want_seen[context + valid] = 1
    run.compare_exact("seen tokens", seen, want_seen)


def cases(kernel: str) -> list[Case]:
    """Every case of one token-selection kernel; the first is the self-test's."""
    if kernel.startswith("penalize_logits"):
        return [Case(kernel, f"vocab={v} threads={t} repetition={p[0]} presence={p[1]} frequency={p[2]} bias={p[3]}",
                     partial(_penalize, kernel=kernel, vocab=v, threads=t, params=p), quick=i == 0 and j == 0)
                for i, (v, t) in enumerate(PENALTY_SIZES) for j, p in enumerate(PENALTY_PARAMS)]
    if kernel == "count_token":
        return [Case(kernel, f"vocab={v}", partial(_count_token, kernel=kernel, vocab=v), quick=i == 0)
                for i, v in enumerate((248320, 7))]
    if kernel.startswith("argmax_partial"):
        found = [Case(kernel, f"vocab={v} block={b} threads={t}",
                      partial(_argmax, kernel=kernel, vocab=v, block=b, threads=t), quick=i == 0)
                 for i, (v, b, t) in enumerate(ARGMAX_SHAPES)]
        if kernel == "argmax_partial_f32":
            found.append(Case(kernel, "vocab=200 NaN and -inf", partial(_argmax_nan_and_negative_infinity,
                                                                         kernel=kernel)))
        return found
    if kernel.startswith("sample_partial"):
        found = [Case(kernel, f"vocab={v} block={b} threads={t} {values}",
                      partial(_sample_partial, kernel=kernel, vocab=v, block=b, threads=t, values=values),
                      quick=i == 0)
                 for i, (v, b, t, values) in enumerate([(2000, 256, 32, "normal"), (1500, 512, 32, "ties"),
                                                        (700, 128, 64, "-inf"), (100, 64, 32, "normal"),
                                                        (40, 64, 32, "ties")])]
        return found + [Case(kernel, f"vocab=1000 block=256 threads=32 {f} only",
                             partial(_sample_partial, kernel=kernel, vocab=1000, block=256, threads=32,
                                     values="normal", filters=f)) for f in ("top-p", "min-p", "plain")]
    if kernel.startswith("sample_final"):
        found = [Case(kernel, f"vocab={v} block={b} threads={tp}/{tf} T={p[0]} top_k={p[1]} top_p={p[2]} min_p={p[3]}",
                      partial(_sample_blocks, kernel=kernel, vocab=v, block=b, partial_threads=tp, final_threads=tf,
                              params=p), quick=i == 0 and j == 0)
                 for i, (v, b, tp, tf) in enumerate(BLOCK_SIZES) for j, p in enumerate(BLOCK_PARAMS)]
        if kernel == "sample_final_f32":
            found += [Case(kernel, f"block=128 top_k={k} {c} ties per block",
                           partial(_sample_blocks_ties, kernel=kernel, block=128, top_k=k, copies=c))
                      for k, c in ((8, 20), (CANDIDATES, 5), (4, 100))]
            found += [Case(kernel, f"vocab=1800 peaked T={p[0]} top_k={p[1]} top_p={p[2]} min_p={p[3]} candidates only",
                           partial(_sample_blocks_candidates_only, kernel=kernel, params=p))
                      for p in ((0.8, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (0.7, 0, 0.95, 0.02), (1.0, 100, 1.0, 0.0),
                                (0.7, 50, 0.9, 0.0))]
            found += [Case(kernel, f"vocab=1100 block={b} flat T={p[0]} top_k={p[1]} top_p={p[2]} min_p={p[3]} "
                           "general path", partial(_sample_blocks_flat, kernel=kernel, block=b, params=p))
                      for b, p in ((128, (1.0, 0, 0.9, 0.0)), (128, (1.0, 0, 1.0, 0.2)), (256, (1.0, 320, 1.0, 0.0)))]
            found += [Case(kernel, f"block=128 top_p=0.6 {c} ties at the cut per block",
                           partial(_sample_blocks_top_p_ties, kernel=kernel, copies=c)) for c in (62, 90)]
        return found
    if kernel == "argmax_final_f32":  # the model's vocabulary in blocks of LILY_ARGMAX_BLOCK
        return [Case(kernel, "partials=61", partial(_argmax_final, kernel=kernel, partials=61), quick=True)]
    found = [Case(kernel, f"vocab={v} threads={t} T={p[0]} top_k={p[1]} top_p={p[2]} min_p={p[3]}",
                  partial(_sample, kernel=kernel, vocab=v, threads=t, params=p), quick=i == 0 and j == 0)
             for i, (v, t) in enumerate(SAMPLE_SIZES) for j, p in enumerate(SAMPLE_PARAMS)]
    if kernel == "sample_f32":
        found.append(Case(kernel, "vocab=9000 threads=32 top_k=20 crowded keys",
                          partial(_sample_top_k_crowded, kernel=kernel)))
        found += [Case(kernel, f"vocab=257 top_p={p} ties", partial(_sample_top_p_ties, kernel=kernel, top_p=p))
                  for p in (0.3, 0.6, 0.95)]
        found.append(Case(kernel, "vocab=100 top_k=2 ties banned", partial(_sample_top_k_ties_and_banned,
                                                                           kernel=kernel)))
    return found
