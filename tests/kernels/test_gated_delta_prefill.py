"""metal/gated_delta_prefill.metal through the CPU harness: the conv + scan of a chunk against lily.reference's Gated
DeltaNet pieces (the chain and the fixtures are test_gated_delta.py's), and bit for bit against decode steps.

Chunks of 1, 2, 3, 17 tokens continue from random conv and recurrent states or start empty; the Dk = 64 instances run
the demo model's layout. The blockwise instances (the REGISTER_SCAN ablation: the state round-trips through memory
every 16 tokens) run chunks shorter than, equal to and across the block against the reference and must give the
register-resident kernel's bits. Outputs start NaN-poisoned.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import check, op_cases
from test_gated_delta import (
    CONV,
    DTYPES,
    PREFILL,
    PREFILL_DK64,
    SCAN_BLOCK,
    STEP_DK64,
    assert_close,
    check_against_reference,
    copy_layer,
    gdn_args,
    make_layer,
    make_tokens,
    prefill_threads,
    run_prefill,
    run_step,
)

from lily import reference
from lily._ext import msl

# (tokens, dv, extra simdgroups): dv 33 leaves the last simdgroup's row slots partly empty; dv 128 is the model's.
PREFILL_SHAPES = [(1, 32, 0), (3, 33, 1), (17, 32, 0), (2, 128, 0)]


@pytest.mark.parametrize("num_tokens,dv,extra", PREFILL_SHAPES, ids=[f"T{t}-dv{d}-x{x}" for t, d, x in PREFILL_SHAPES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_delta_prefill(dtype: str, num_tokens: int, dv: int, extra: int, kio) -> None:
    """gated_delta_conv + gated_delta_prefill over a chunk, continuing from random states."""
    rng = np.random.default_rng(100 + num_tokens + dv + 7 * DTYPES.index(dtype))
    layer = make_layer(rng, 2, 4, dv, dtype, kio)
    start = copy_layer(layer)
    tokens = make_tokens(rng, layer, num_tokens, kio)
    out = run_prefill(layer, tokens, prefill_threads(layer, extra), kio)
    check_against_reference(layer, start, tokens, out, kio, f"{PREFILL[dtype]} T={num_tokens}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_delta_prefill_from_empty_state_in_chunks(dtype: str, kio) -> None:
    """Sequence start (zero states) then a second chunk: chunks of 2 + 3 equal the reference over 5 tokens."""
    rng = np.random.default_rng(31 + DTYPES.index(dtype))
    layer = make_layer(rng, 1, 2, 64, dtype, kio, fresh=True)
    start = copy_layer(layer)
    tokens = make_tokens(rng, layer, 5, kio)
    first = run_prefill(layer, {n: x[:2] for n, x in tokens.items()}, prefill_threads(layer), kio)
    second = run_prefill(layer, {n: x[2:] for n, x in tokens.items()}, prefill_threads(layer), kio)
    check_against_reference(layer, start, tokens, np.concatenate([first, second]), kio, f"{CONV[dtype]} chunks")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_prefill_equals_decode_steps_bitwise(dtype: str, kio) -> None:
    """One conv + prefill of T tokens and T decode steps give identical outputs and states (any threadgroup sizes)."""
    rng = np.random.default_rng(55)
    stepped = make_layer(rng, 2, 4, 32, dtype, kio)
    prefilled = copy_layer(stepped)
    tokens = make_tokens(rng, stepped, 4, kio)
    outs = np.concatenate([run_step(stepped, {n: x[t : t + 1] for n, x in tokens.items()}, 160, kio, seed=t)
                           for t in range(4)])
    out = run_prefill(prefilled, tokens, prefill_threads(prefilled, 1), kio, seed=9)
    assert np.array_equal(outs, out)
    assert np.array_equal(stepped.conv_state, prefilled.conv_state)
    assert np.array_equal(stepped.state, prefilled.state)


def test_gated_delta_conv_alone(kio) -> None:
    """The conv kernel's fp32 output and new conv state against reference.causal_conv1d (partial threadgroup)."""
    rng = np.random.default_rng(3)
    layer = make_layer(rng, 1, 2, 33, "bf16", kio)
    tokens = make_tokens(rng, layer, 6, kio)
    expected, new_state = reference.causal_conv1d(
        kio.to_f64(tokens["qkv"], "bf16"), kio.to_f64(layer.conv_weight, "bf16"), kio.to_f64(layer.conv_state, "bf16"))
    conv_out = np.full((6, layer.channels), np.nan, np.float32)
    msl.dispatch("gated_delta_conv_bf16_dk128",
                 [gdn_args(6, 1, 2, 33), tokens["qkv"], layer.conv_weight, layer.conv_state, conv_out],
                 (-(-layer.channels // 96), 1, 1), (96, 1, 1))
    kio.assert_close(conv_out, expected, "f32", "conv + SiLU")
    assert np.array_equal(kio.to_f64(layer.conv_state, "bf16"), new_state)


@pytest.mark.parametrize("num_tokens,hv,extra", [(1, 4, 0), (5, 4, 1), (17, 6, 0)])
@pytest.mark.parametrize("dtype", list(PREFILL_DK64))
def test_gated_delta_prefill_dk64(dtype: str, num_tokens: int, hv: int, extra: int, kio) -> None:
    """gated_delta_conv + gated_delta_prefill (Dk = 64, dv = 64) over a chunk, continuing from random states."""
    rng = np.random.default_rng(500 + num_tokens + hv + 7 * DTYPES.index(dtype))
    layer = make_layer(rng, 2, hv, 64, dtype, kio, dk=64)
    start = copy_layer(layer)
    tokens = make_tokens(rng, layer, num_tokens, kio)
    out = run_prefill(layer, tokens, prefill_threads(layer, extra), kio)
    check_against_reference(layer, start, tokens, out, kio, f"{PREFILL_DK64[dtype]} T={num_tokens}")


@pytest.mark.parametrize("dtype", list(STEP_DK64))
def test_prefill_equals_decode_steps_bitwise_dk64(dtype: str, kio) -> None:
    """Dk = 64: one conv + prefill of T tokens and T decode steps give identical outputs and states."""
    rng = np.random.default_rng(56)
    stepped = make_layer(rng, 2, 4, 64, dtype, kio, dk=64)
    prefilled = copy_layer(stepped)
    tokens = make_tokens(rng, stepped, 3, kio)
    outs = np.concatenate([run_step(stepped, {n: x[t : t + 1] for n, x in tokens.items()}, 512, kio, seed=t)
                           for t in range(3)])
    out = run_prefill(prefilled, tokens, prefill_threads(prefilled), kio, seed=4)
    assert np.array_equal(outs, out)
    assert np.array_equal(stepped.conv_state, prefilled.conv_state)
    assert np.array_equal(stepped.state, prefilled.state)


# (Dk, Hv, dv, tokens, extra simdgroups): one token; a chunk shorter than the block; exactly one block; one token
# past it; two blocks and a partial third; Dk = 64 (demo model) with dv 33 rows over uneven simdgroups.
BLOCKWISE_SHAPES = [(128, 4, 32, 1, 0), (128, 2, 33, 15, 1), (128, 4, 32, 16, 0), (128, 2, 32, 17, 0),
                    (128, 2, 32, 33, 1), (64, 4, 64, 17, 0), (64, 6, 33, 32, 0)]


@pytest.mark.parametrize("dk,hv,dv,num_tokens,extra", BLOCKWISE_SHAPES,
                         ids=[f"dk{a}-hv{b}-dv{c}-T{d}-x{e}" for a, b, c, d, e in BLOCKWISE_SHAPES])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gated_delta_prefill_blockwise(dtype: str, dk: int, hv: int, dv: int, num_tokens: int, extra: int,
                                       kio) -> None:
    """gated_delta_prefill_blockwise_*: against the reference, and bit-identical to the register-resident scan
    (same arithmetic; the state only passes through memory between blocks, exact in fp32)."""
    rng = np.random.default_rng(700 + num_tokens + dv + dk + 7 * DTYPES.index(dtype))
    blockwise = make_layer(rng, 2, hv, dv, dtype, kio, dk=dk)
    start, registers = copy_layer(blockwise), copy_layer(blockwise)
    tokens = make_tokens(rng, blockwise, num_tokens, kio)
    threads = prefill_threads(blockwise, extra)
    out = run_prefill(blockwise, tokens, threads, kio, seed=3, scan="blockwise")
    check_against_reference(blockwise, start, tokens, out, kio, f"{blockwise.kernel('blockwise')} T={num_tokens}")
    expected = run_prefill(registers, tokens, prefill_threads(registers), kio, seed=5)
    assert np.array_equal(out, expected), "blockwise and register scans differ in the output"
    assert np.array_equal(blockwise.state, registers.state), "blockwise and register scans differ in the state"


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gated_delta_prefill_blockwise_in_chunks_equals_steps(dtype: str, kio) -> None:
    """A sequence start (zero states) in two blockwise chunks of 18 + 3 tokens gives the decode steps' bits."""
    rng = np.random.default_rng(81 + DTYPES.index(dtype))
    stepped = make_layer(rng, 1, 2, 32, dtype, kio, fresh=True)
    chunked = copy_layer(stepped)
    tokens = make_tokens(rng, stepped, SCAN_BLOCK + 5, kio)
    outs = np.concatenate([run_step(stepped, {n: x[t : t + 1] for n, x in tokens.items()}, 64, kio, seed=t)
                           for t in range(SCAN_BLOCK + 5)])
    split = SCAN_BLOCK + 2
    first = run_prefill(chunked, {n: x[:split] for n, x in tokens.items()}, prefill_threads(chunked), kio,
                        scan="blockwise")
    second = run_prefill(chunked, {n: x[split:] for n, x in tokens.items()}, prefill_threads(chunked, 1), kio,
                         seed=2, scan="blockwise")
    assert np.array_equal(outs, np.concatenate([first, second]))
    assert np.array_equal(stepped.conv_state, chunked.conv_state)
    assert np.array_equal(stepped.state, chunked.state)


@pytest.mark.parametrize("case", op_cases("gated_delta_prefill"))
def test_gated_delta_prefill_cases(case, kernel_device) -> None:
    """Every case of lily.kernel_cases.gated_delta_prefill: the self-test's, on this session's device."""
    check(case, kernel_device)
