"""Cases of metal/sampling.metal against ``lily.sampling`` (the CPU sampler is the specification of token
selection): greedy argmax exactly (ties to the lowest id), and seeded sampling draw by draw, fed with the kernel's
Philox4x32-10 number u."""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily.kernel_cases.common import Case, Run, dtype_of, to_device, to_f64
from lily.sampling import log_softmax, top_k_mask, top_p_mask

PATTERN = re.compile(r"argmax_partial_(f32|f16|bf16)|argmax_final_f32|sample_(f32|f16|bf16)")
MASK32 = 0xFFFFFFFF


def argmax_args(vocab: int, block: int, num_partials: int, out_index: int) -> bytes:
    """lily::ArgmaxArgs (metal/lily.h)."""
    return struct.pack("<IIII", vocab, block, num_partials, out_index)


def sample_args(vocab: int, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, step: int,
                out_index: int) -> bytes:
    """lily::SampleArgs (metal/lily.h): 48 bytes."""
    return struct.pack("<IIfffIIIIIII", vocab, top_k, temperature, top_p, min_p, seed & MASK32, seed >> 32, step,
                       out_index, 0, 0, 0)


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


def _argmax_partial(run: Run, kernel: str, vocab: int, block: int) -> None:
    dtype = dtype_of(kernel)
    logits = to_device(4.0 * run.rng.standard_normal(vocab), dtype)
    partials = -(-vocab // block)
    values, ids = np.full(partials, np.nan, np.float32), np.full(partials, MASK32, np.uint32)
    run.dispatch(kernel, [argmax_args(vocab, block, partials, 0), logits, values, ids], partials, 256)
    widened = to_f64(logits, dtype)
    run.compare_exact("block argmax ids", ids, [int(np.argmax(widened[s : s + block])) + s
                                                for s in range(0, vocab, block)])


def _argmax_final(run: Run, kernel: str, partials: int) -> None:
    values = np.round(run.rng.standard_normal(partials), 1).astype(np.float32)  # rounding makes ties likely
    ids = run.rng.permutation(partials * 10)[:partials].astype(np.uint32)
    tokens = np.full(2, MASK32, np.uint32)
    run.dispatch(kernel, [argmax_args(248320, 4096, partials, 1), values, ids, tokens], 1, 64)
    run.compare_exact("token at out_index", tokens[1:], [int(ids[values == values.max()].min())])


def _expected_sample(x: np.ndarray, top_k: int, top_p: float, u: float) -> int:
    keep = top_k_mask(x, top_k)
    probs = np.exp(log_softmax(np.where(keep, x, -np.inf)))
    keep &= top_p_mask(probs, top_p)
    cdf = np.cumsum(np.where(keep, probs, 0.0))
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), np.flatnonzero(keep)[-1]))


def _sample(run: Run, kernel: str, vocab: int, temperature: float, top_k: int, top_p: float, steps: int) -> None:
    dtype, seed = dtype_of(kernel), 2026
    logits = to_device(3.0 * run.rng.standard_normal(vocab), dtype)
    x = (to_f64(logits, dtype).astype(np.float32) / np.float32(temperature)).astype(np.float64)
    got, allowed = [], []
    for step in range(steps):
        tokens = np.full(1, MASK32, np.uint32)
        run.dispatch(kernel, [sample_args(vocab, temperature, top_k, top_p, 0.0, seed, step, 0), logits, tokens], 1,
                     256)
        got.append(int(tokens[0]))
        u = philox_uniform(seed, step)
        # fp32 sums in the kernel: accept the answers of u and top_p nudged by a few fp32 ulps of the total mass.
        allowed.append({_expected_sample(x, top_k, p, v) for p in (top_p, top_p * (1 + 1e-5), top_p * (1 - 1e-5))
                        for v in (u, max(u - 2e-6, 0.0), min(u + 2e-6, 1 - 2.0**-24))})
    run.compare_allowed("drawn tokens", got, allowed)


def cases(kernel: str) -> list[Case]:
    """Every case of one token-selection kernel; the first is the self-test's."""
    if kernel.startswith("argmax_partial"):
        return [Case(kernel, "vocab=5000 block=1024", partial(_argmax_partial, kernel=kernel, vocab=5000, block=1024),
                     quick=True)]
    if kernel == "argmax_final_f32":  # the model's vocabulary in blocks of LILY_ARGMAX_BLOCK
        return [Case(kernel, "partials=61", partial(_argmax_final, kernel=kernel, partials=61), quick=True)]
    return [Case(kernel, "vocab=2000 T=0.7 top_k=20 top_p=0.95 steps=4",
                 partial(_sample, kernel=kernel, vocab=2000, temperature=0.7, top_k=20, top_p=0.95, steps=4),
                 quick=True)]
