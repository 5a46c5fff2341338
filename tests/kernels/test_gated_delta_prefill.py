"""metal/gated_delta_prefill.metal: every case of lily.kernel_cases.gated_delta_prefill (the conv alone, the register
and blockwise scans, each followed by the gated norm, over chunks around the 16-token block and dv around the 32-row
threadgroup, from random and empty states, Dk 128 and 64; the chunked scan around its 32-token chunk, against the
float64 rule and the plain scan; the norm alone), then what the cases do not cover: one conv + prefill of T tokens
gives the bits of T decode steps, in one chunk or (blockwise) in two; the chunked scan's bits do not depend on its
threadgroup sizes or the fiber schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import check, op_cases

from lily.kernel_cases.common import Run
from lily.kernel_cases.gated_delta import (CHUNK, make_layer, make_tokens, prefill_threads, run_chunk_scan, run_conv,
                                           run_prefill, run_steps, token_range)

SCAN_BLOCK = 16  # LILY_GDN_SCAN_BLOCK (metal/lily.h): tokens between the blockwise kernel's state round trips


@pytest.mark.parametrize("case", op_cases("gated_delta_prefill"))
def test_gated_delta_prefill(case, kernel_device) -> None:
    check(case, kernel_device)


@pytest.mark.parametrize("dtype,dk,hv,dv,tokens,threads", [("f32", 128, 4, 31, 4, 160), ("bf16", 128, 4, 31, 4, 160),
                                                           ("f32", 64, 4, 64, 3, 512), ("bf16", 64, 4, 64, 3, 512)])
def test_prefill_equals_decode_steps_bitwise(dtype: str, dk: int, hv: int, dv: int, tokens: int, threads: int,
                                             kernel_device) -> None:
    """One conv + prefill of T tokens and T decode steps give identical outputs and states (any threadgroup sizes)."""
    run = Run(kernel_device, np.random.default_rng(55 + dk))
    stepped = make_layer(run.rng, 2, hv, dv, dtype, dk=dk)
    prefilled = stepped.copy()
    chunk = make_tokens(run.rng, stepped, tokens)
    outs = run_steps(run, stepped, chunk, threads)
    out = run_prefill(run, prefilled, chunk, prefill_threads(prefilled, 1 if dk == 128 else 0), seed=9)
    assert np.array_equal(outs, out)
    assert np.array_equal(stepped.conv_state, prefilled.conv_state)
    assert np.array_equal(stepped.state, prefilled.state)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gated_delta_prefill_blockwise_in_chunks_equals_steps(dtype: str, kernel_device) -> None:
    """A sequence start (zero states) in two blockwise chunks of 18 + 3 tokens gives the decode steps' bits."""
    run = Run(kernel_device, np.random.default_rng(81 + ["f32", "bf16"].index(dtype)))
    stepped = make_layer(run.rng, 1, 2, 31, dtype, fresh=True)  # 31 rows: room for an extra simdgroup (1024 threads)
    chunked = stepped.copy()
    tokens = make_tokens(run.rng, stepped, SCAN_BLOCK + 5)
    outs = run_steps(run, stepped, tokens, 64)
    split = SCAN_BLOCK + 2
    first = run_prefill(run, chunked, token_range(tokens, 0, split), prefill_threads(chunked),
                        scan="prefill_blockwise")
    second = run_prefill(run, chunked, token_range(tokens, split, SCAN_BLOCK + 5), prefill_threads(chunked, 1),
                         scan="prefill_blockwise", seed=2)
    assert np.array_equal(outs, np.concatenate([first, second]))
    assert np.array_equal(stepped.conv_state, chunked.conv_state)
    assert np.array_equal(stepped.state, chunked.state)


@pytest.mark.parametrize("dtype,dk", [("f32", 128), ("bf16", 64)])
def test_chunked_scan_bits_do_not_depend_on_threadgroup_sizes(dtype: str, dk: int, kernel_device) -> None:
    """gated_delta_chunk_prepare with one simdgroup instead of eight and gated_delta_chunk_scan with one 8-row
    simdgroup per threadgroup instead of two (each element is computed by one thread or simdgroup whatever the split),
    under another fiber schedule: the same o and state bits."""
    run = Run(kernel_device, np.random.default_rng(7 + dk))
    layer = make_layer(run.rng, 1, 2, 24, dtype, dk=dk)
    other = layer.copy()
    tokens = make_tokens(run.rng, layer, 2 * CHUNK + 3)
    conv_out = run_conv(run, layer, tokens["qkv"])
    out = run_chunk_scan(run, layer, conv_out, tokens)
    other_out = run_chunk_scan(run, other, conv_out, tokens, prepare_threads=32, scan_simdgroups=1, seed=11)
    assert not np.isnan(out).any()
    assert np.array_equal(out, other_out)
    assert np.array_equal(layer.state, other.state)
