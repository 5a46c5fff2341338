"""lily.quant against MLX's own affine quantizer (mx.quantize / mx.dequantize, CPU backend)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lily.quant import (
    QuantizationError,
    QuantizedTensor,
    bfloat16_bits_to_float32,
    dequantize,
    float32_to_bfloat16_bits,
    pack,
    quantize,
    round_to_dtype,
    unpack,
)

_MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _edge_case_matrix(rng: np.random.Generator, rows: int, cols: int, group: int) -> np.ndarray:
    """Random rows plus groups that stress the scale/bias choice."""
    w = (rng.standard_normal((rows, cols)) * rng.choice([1e-3, 0.1, 3.0], size=(rows, 1))).astype(np.float32)
    g = slice(0, group)
    w[0, g] = 0.37  # constant group
    w[1, g] = -np.abs(w[1, g]) - 0.5  # all negative
    w[2, g] = np.abs(w[2, g]) + 0.5  # all positive
    w[3, g] = 1.0 + rng.standard_normal(group).astype(np.float32) * 1e-6  # tiny range
    w[4, g] = 0.0  # all zero
    w[5, g] = rng.standard_normal(group).astype(np.float32) * 1e-9  # below the 1e-7 scale floor
    w[6, g] = np.linspace(-1.0, 1.0, group, dtype=np.float32)  # |min| == |max|
    w[7, g] = np.where(np.arange(group) % 2, 2.0, -1.0).astype(np.float32)  # two values
    return w


def _mlx_reference(w: np.ndarray, bits: int, group: int, dtype: str):
    mw = mx.array(w).astype(_MX_DTYPES[dtype])
    q, s, b = mx.quantize(mw, group_size=group, bits=bits)
    deq = mx.dequantize(q, s, b, group_size=group, bits=bits).astype(mx.float32)
    as_np = lambda a: np.array(a.astype(mx.float32)) if a.dtype != mx.uint32 else np.array(a)
    return as_np(q), as_np(s), as_np(b), np.array(deq)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("group", [64, 32, 128])
def test_quantize_bit_identical_to_mlx(bits: int, dtype: str, group: int) -> None:
    rng = np.random.default_rng(bits * 1000 + group + len(dtype))
    w = _edge_case_matrix(rng, 24, 4 * group, group)
    if dtype == "float16":
        w = np.clip(w, -60000, 60000)
    ref_q, ref_s, ref_b, ref_deq = _mlx_reference(w, bits, group, dtype)

    qt = quantize(w, bits=bits, group_size=group, dtype=dtype)
    assert qt.shape == w.shape
    np.testing.assert_array_equal(qt.weight, ref_q)
    np.testing.assert_array_equal(qt.scales, ref_s)
    np.testing.assert_array_equal(qt.biases, ref_b)
    np.testing.assert_array_equal(qt.dequantize(round_like_mlx=True), ref_deq)
    # The exact fp32 dequantization is within one rounding of MLX's (scale-dtype) arithmetic.
    exact = qt.dequantize()
    tol = {"float32": 0.0, "bfloat16": 2.0**-7, "float16": 2.0**-10}[dtype]
    np.testing.assert_allclose(exact, ref_deq, rtol=2 * tol, atol=np.abs(ref_b).max() * tol + 1e-30)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(
        st.floats(-1e4, 1e4, allow_nan=False, width=32) | st.sampled_from([0.0, -0.0, 1e-8, -3.0, 3.0]),
        min_size=128,
        max_size=128,
    ),
    bits=st.sampled_from([4, 8]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
def test_quantize_matches_mlx_on_arbitrary_groups(values: list[float], bits: int, dtype: str) -> None:
    w = np.array(values, dtype=np.float32).reshape(2, 64)
    ref_q, ref_s, ref_b, _ = _mlx_reference(w, bits, 64, dtype)
    qt = quantize(w, bits, 64, dtype=dtype)
    np.testing.assert_array_equal(qt.weight, ref_q)
    np.testing.assert_array_equal(qt.scales, ref_s)
    np.testing.assert_array_equal(qt.biases, ref_b)


def test_quantize_stacked_experts_and_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    import lily.quant as quant_module

    # A tiny chunk size forces the chunked path to cover several row blocks.
    monkeypatch.setattr(quant_module, "_CHUNK_ELEMENTS", 300)
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((3, 10, 128)) * 0.1).astype(np.float32)
    ref_q, ref_s, ref_b, _ = _mlx_reference(w, 4, 64, "bfloat16")
    qt = quantize(w, 4, 64, dtype="bfloat16")
    assert qt.weight.shape == (3, 10, 16) and qt.scales.shape == (3, 10, 2)
    np.testing.assert_array_equal(qt.weight, ref_q)
    np.testing.assert_array_equal(qt.scales, ref_s)
    np.testing.assert_array_equal(qt.biases, ref_b)
    # Indexing one expert keeps a valid QuantizedTensor.
    np.testing.assert_array_equal(qt[1].dequantize(), qt.dequantize()[1])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_layout_little_endian(bits: int) -> None:
    rng = np.random.default_rng(bits)
    per_word = 32 // bits
    codes = rng.integers(0, 2**bits, size=(5, 4 * per_word), dtype=np.uint8)
    words = pack(codes, bits)
    # Independent check: element k of a word sits at bit offset bits * k.
    for r in range(5):
        for j in range(4):
            expect = sum(int(codes[r, j * per_word + k]) << (bits * k) for k in range(per_word))
            assert int(words[r, j]) == expect
    np.testing.assert_array_equal(unpack(words, bits), codes)


def test_bfloat16_rounding_matches_mlx() -> None:
    rng = np.random.default_rng(11)
    x = np.concatenate(
        [
            rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 5000),
            np.array([0.0, -0.0, np.inf, -np.inf, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38], np.float32),
        ]
    ).astype(np.float32)
    ref = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(round_to_dtype(x, "bfloat16"), ref)
    bits = float32_to_bfloat16_bits(np.array([np.nan], np.float32))
    assert np.isnan(bfloat16_bits_to_float32(bits)).all()


def test_bad_parameters_are_rejected() -> None:
    w = np.zeros((4, 128), np.float32)
    with pytest.raises(QuantizationError, match="bits"):
        quantize(w, bits=3)
    with pytest.raises(QuantizationError, match="group_size"):
        quantize(w, group_size=16)
    with pytest.raises(QuantizationError, match="multiple of group_size"):
        quantize(np.zeros((4, 96), np.float32))
    with pytest.raises(QuantizationError, match="at least 2 dims"):
        quantize(np.zeros(128, np.float32))
    with pytest.raises(QuantizationError, match="dtype"):
        quantize(np.zeros((4, 128), np.int32))
    qt = quantize(w)
    with pytest.raises(QuantizationError, match="scales shape"):
        QuantizedTensor(qt.weight, qt.scales[:, :1], qt.biases, 4, 64)
    with pytest.raises(QuantizationError, match="uint32"):
        QuantizedTensor(qt.weight.astype(np.int64), qt.scales, qt.biases, 4, 64)
    assert dequantize(qt).shape == (4, 128)
