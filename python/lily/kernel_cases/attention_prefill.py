"""Cases of metal/attention_prefill.metal against ``lily.reference.attention`` (causal, over a KV cache with an
offset), and of ``simdgroup_layout_probe``, the lane layout of ``thread_elements()`` the mma kernel assumes."""

from __future__ import annotations

import re
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.attention import CACHE_DTYPE, attention_args, attention_layout, cache_rows, kv_cache
from lily.kernel_cases.common import REL_RMS, Case, Run, dtype_of, poisoned, to_device, to_f64

PATTERN = re.compile(r"attention_prefill(_mma)?_(unpacked_)?(f32|f16|bf16)_d(256|64)|simdgroup_layout_probe")


def assumed_simdgroup_layout() -> np.ndarray:
    """[32, 2]: the element index 8 * row + col of an 8x8 simdgroup matrix that each lane's thread_elements() holds,
    in the layout attention_prefill_mma assumes (MLX's; src/lily_ext/layout_probe.cpp has the same mapping)."""
    lanes = np.arange(32)
    quad = lanes // 4
    first = 8 * ((quad & 4) + (lanes // 2) % 4) + (quad & 2) * 2 + (lanes % 2) * 2
    return np.stack([first, first + 1], axis=1)


def _layout_probe(run: Run, kernel: str) -> None:
    """Apple does not specify the lane layout of thread_elements(); where it differs, the engine runs prefill
    attention on the vector kernel, and this case fails to say so."""
    out = np.full((32, 2), np.nan, np.float32)
    run.dispatch(kernel, [out], 1, 32)
    run.compare_exact("element index per lane", np.where(np.isfinite(out), out, -1).astype(np.int64),
                      assumed_simdgroup_layout())


def _prefill(run: Run, kernel: str, kv_heads: int, queries: int, offset: int) -> None:
    dtype = dtype_of(kernel)
    d, per_group, heads = attention_layout(kernel)
    # The mma variant takes one simdgroup per packed head and 8 queries (one 8-row fragment) per threadgroup; the
    # other one query per simdgroup (4 simdgroups here).
    mma = "_mma_" in kernel
    simdgroups = per_group if mma else 4
    queries_per_group = 8 if mma else simdgroups
    cache_dtype = CACHE_DTYPE[dtype]
    keys = offset + queries
    capacity = keys + 4
    q = to_device(2.0 * run.rng.standard_normal((queries, heads, d)), dtype)
    gate = to_device(2.0 * run.rng.standard_normal((queries, heads, d)), dtype)
    k_cache = kv_cache(run.rng, cache_dtype, kv_heads, keys, capacity, d)
    v_cache = kv_cache(run.rng, cache_dtype, kv_heads, keys, capacity, d)
    out = poisoned((queries, heads, d), dtype)
    run.dispatch(kernel, [attention_args(queries, heads, kv_heads, keys, capacity, scale=d**-0.5), q, gate, k_cache,
                          v_cache, out],
                 (-(-queries // queries_per_group), heads // per_group, 1), 32 * simdgroups)
    expected = reference.attention(to_f64(q, dtype), cache_rows(k_cache, cache_dtype, keys),
                                   cache_rows(v_cache, cache_dtype, keys), to_f64(gate, dtype), offset=offset)
    run.compare("out", to_f64(out, dtype), expected, REL_RMS[dtype])


def cases(kernel: str) -> list[Case]:
    """Every case of one prefill attention kernel (or the layout probe); the first is the self-test's."""
    if kernel == "simdgroup_layout_probe":
        return [Case(kernel, "32 lanes x 2 elements", partial(_layout_probe, kernel=kernel), quick=True)]
    d, _, heads = attention_layout(kernel)
    return [Case(kernel, f"T=12 offset=21 Hq={heads} Hkv=2 D={d}",
                 partial(_prefill, kernel=kernel, kv_heads=2, queries=12, offset=21), quick=True)]
