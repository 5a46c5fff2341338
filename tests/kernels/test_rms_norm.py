"""metal/rms_norm.metal through the CPU harness, against a float64 numpy reference.

Row lengths cover the SIMD width boundary (31/32/33 threads), a partial second simdgroup, more elements
than threads (1025, 2048), and 1 or 3 rows (decode and prefill). Outputs start NaN-poisoned.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from lily._ext import msl

EPS = 1e-6
KERNELS = {
    ("plain", "f32"): "rms_norm_f32",
    ("plain", "bf16"): "rms_norm_bf16",
    ("residual", "f32"): "rms_norm_residual_f32",
    ("residual", "bf16"): "rms_norm_residual_bf16",
}
# (row_length, threads per threadgroup): one thread per element up to 64, then more elements than threads.
SHAPES = [(31, 31), (32, 32), (33, 33), (64, 64), (1025, 1024), (2048, 256)]
DTYPES = ["f32", "bf16"]


def rms_norm_args(row_length: int, eps: float = EPS) -> bytes:
    """lily::RmsNormArgs (metal/lily.h): u32 row_length, f32 eps, two u32 of padding."""
    return struct.pack("<IfII", row_length, eps, 0, 0)


def reference(h: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row of `h` (float64) times the multiplier `weight`, before the final rounding."""
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * weight


def random_inputs(rng: np.random.Generator, rows: int, n: int, kio, dtype: str):
    x = kio.to_device(rng.standard_normal((rows, n)) * 3.0, dtype)
    weight = kio.to_device(1.0 + 0.5 * rng.standard_normal(n), dtype)  # canonical 1+w
    return x, weight


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("n,threads", SHAPES, ids=[f"n{n}-t{t}" for n, t in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: str, n: int, threads: int, rows: int, kio) -> None:
    rng = np.random.default_rng(1000 * n + 10 * rows + DTYPES.index(dtype))
    x, weight = random_inputs(rng, rows, n, kio, dtype)
    out = kio.poisoned((rows, n), dtype)
    msl.dispatch(KERNELS["plain", dtype], [rms_norm_args(n), x, weight, out], (rows, 1, 1), (threads, 1, 1))
    expected = kio.round(reference(kio.to_f64(x, dtype), kio.to_f64(weight, dtype), EPS), dtype)
    kio.assert_close(kio.to_f64(out, dtype), expected, dtype, f"rms_norm {dtype} n={n} rows={rows}")


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("n,threads", SHAPES, ids=[f"n{n}-t{t}" for n, t in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_residual(dtype: str, n: int, threads: int, rows: int, kio) -> None:
    rng = np.random.default_rng(2000 * n + 10 * rows + DTYPES.index(dtype))
    x, weight = random_inputs(rng, rows, n, kio, dtype)
    residual = kio.to_device(rng.standard_normal((rows, n)) * 3.0, dtype)
    out = kio.poisoned((rows, n), dtype)
    summed = kio.poisoned((rows, n), dtype)
    msl.dispatch(
        KERNELS["residual", dtype],
        [rms_norm_args(n), x, residual, weight, out, summed],
        (rows, 1, 1),
        (threads, 1, 1),
    )
    # The residual stream is stored in the activation dtype: the sum is rounded before it is normalised.
    h = kio.round(kio.to_f64(x, dtype) + kio.to_f64(residual, dtype), dtype)
    assert np.array_equal(kio.to_f64(summed, dtype), h), "sum = x + residual must be rounded once to the dtype"
    expected = kio.round(reference(h, kio.to_f64(weight, dtype), EPS), dtype)
    kio.assert_close(kio.to_f64(out, dtype), expected, dtype, f"rms_norm_residual {dtype} n={n} rows={rows}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_residual_in_place(dtype: str, kio) -> None:
    """`sum` may alias `residual`: the decode loop updates the residual stream in place."""
    rng = np.random.default_rng(7)
    rows, n = 2, 100
    x, weight = random_inputs(rng, rows, n, kio, dtype)
    residual = kio.to_device(rng.standard_normal((rows, n)), dtype)
    h = kio.round(kio.to_f64(x, dtype) + kio.to_f64(residual, dtype), dtype)
    out = kio.poisoned((rows, n), dtype)
    msl.dispatch(
        KERNELS["residual", dtype], [rms_norm_args(n), x, residual, weight, out, residual], (rows, 1, 1), (64, 1, 1)
    )
    assert np.array_equal(kio.to_f64(residual, dtype), h)
    expected = kio.round(reference(h, kio.to_f64(weight, dtype), EPS), dtype)
    kio.assert_close(kio.to_f64(out, dtype), expected, dtype, "in-place residual")


def test_rms_norm_zero_row_and_eps(kio) -> None:
    """A zero row normalises to zeros (eps keeps it finite); eps is read from the argument struct."""
    n = 48
    x = np.zeros((2, n), np.float32)
    x[1] = 1e-3
    weight = np.ones(n, np.float32)
    out = kio.poisoned((2, n), "f32")
    msl.dispatch("rms_norm_f32", [rms_norm_args(n, eps=1e-4), x, weight, out], (2, 1, 1), (32, 1, 1))
    kio.assert_close(out, reference(x.astype(np.float64), 1.0, 1e-4), "f32", "zero row, eps 1e-4")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rms_norm_independent_of_schedule(seed: int, kio) -> None:
    """Every thread sums the simdgroup partials in the same order: the bits do not depend on the schedule."""
    rng = np.random.default_rng(5)
    n = 1000
    x, weight = random_inputs(rng, 2, n, kio, "f32")
    results = []
    for random_schedule in (False, True):
        out = kio.poisoned((2, n), "f32")
        msl.dispatch(
            "rms_norm_f32",
            [rms_norm_args(n), x, weight, out],
            (2, 1, 1),
            (96, 1, 1),
            random_schedule=random_schedule,
            seed=seed,
        )
        results.append(out)
    assert np.array_equal(results[0], results[1])
    expected = reference(x.astype(np.float64), weight.astype(np.float64), EPS)
    kio.assert_close(results[1], expected, "f32", "random schedule")


def test_rms_norm_rejects_wrong_argument_struct() -> None:
    x = np.ones((1, 32), np.float32)
    with pytest.raises(ValueError, match=r"rms_norm_f32.*buffer\(0\).*16 bytes.*got 8"):
        msl.dispatch("rms_norm_f32", [struct.pack("<If", 32, EPS), x, x[0], x], (1, 1, 1), (32, 1, 1))
