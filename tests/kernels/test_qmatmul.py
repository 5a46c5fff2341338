"""metal/qmatmul.metal through the CPU harness, against lily.reference.qmatmul on the dequantized weights.

Weights are quantized with lily.quant.quantize (MLX affine, group 64; bf16 or f32 scales). Shapes cross every
boundary of the kernels: output rows around the 4-row simdgroup and 8-row threadgroup of qmv (N = 1 is the shared-expert
gate), K below, at and above the 512-element qmv step, M and N around the 16/32-row and 32/64-column tiles of qmm.
Outputs start NaN-poisoned; the fiber schedule is randomised.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from lily import reference
from lily._ext import msl
from lily.quant import QuantizedTensor, pack, quantize, round_to_dtype

# (bits, activation dtype, scale dtype) -> host name
QMV = {
    (4, "f32", "bf16"): "qmv_q4_g64_f32",
    (4, "bf16", "bf16"): "qmv_q4_g64_bf16",
    (4, "f32", "f32"): "qmv_q4_g64_f32_sf32",
    (4, "bf16", "f32"): "qmv_q4_g64_bf16_sf32",
    (8, "f32", "bf16"): "qmv_q8_g64_f32",
    (8, "bf16", "bf16"): "qmv_q8_g64_bf16",
    (8, "f32", "f32"): "qmv_q8_g64_f32_sf32",
    (8, "bf16", "f32"): "qmv_q8_g64_bf16_sf32",
}
# (bits, activation dtype, scale dtype, rows per tile) -> host name
QMM = {
    (4, "f32", "bf16", 16): "qmm_q4_g64_f32_bm16",
    (4, "bf16", "bf16", 16): "qmm_q4_g64_bf16_bm16",
    (4, "f32", "f32", 16): "qmm_q4_g64_f32_sf32_bm16",
    (4, "bf16", "f32", 16): "qmm_q4_g64_bf16_sf32_bm16",
    (4, "f32", "bf16", 32): "qmm_q4_g64_f32_bm32",
    (4, "bf16", "bf16", 32): "qmm_q4_g64_bf16_bm32",
    (4, "f32", "f32", 32): "qmm_q4_g64_f32_sf32_bm32",
    (4, "bf16", "f32", 32): "qmm_q4_g64_bf16_sf32_bm32",
    (8, "f32", "bf16", 16): "qmm_q8_g64_f32_bm16",
    (8, "bf16", "bf16", 16): "qmm_q8_g64_bf16_bm16",
    (8, "f32", "f32", 16): "qmm_q8_g64_f32_sf32_bm16",
    (8, "bf16", "f32", 16): "qmm_q8_g64_bf16_sf32_bm16",
    (8, "f32", "bf16", 32): "qmm_q8_g64_f32_bm32",
    (8, "bf16", "bf16", 32): "qmm_q8_g64_bf16_bm32",
    (8, "f32", "f32", 32): "qmm_q8_g64_f32_sf32_bm32",
    (8, "bf16", "f32", 32): "qmm_q8_g64_bf16_sf32_bm32",
}
# (bits, activation dtype) -> host name; scales bf16. Metal 4 tensor ops, run here on the harness's emulation.
QMM_NAX = {
    (4, "bf16"): "qmm_nax_q4_g64_bf16",
    (8, "bf16"): "qmm_nax_q8_g64_bf16",
}

QMV_ROWS_PER_THREADGROUP = 8  # LILY_QMV_SIMDGROUPS * LILY_QMV_ROWS_PER_SIMDGROUP
QMM_BN = 32
NAX_BM, NAX_BN = 32, 64
SCALE_DTYPE_NAMES = {"bf16": "bfloat16", "f32": "float32"}
# Allowance for fp32 accumulation, in units of sqrt(K) * 2^-24 * sum|x w| (see assert_matmul_close).
ACCUMULATION_ULPS = 1.0


def qmatmul_args(k: int, n: int, m: int) -> bytes:
    """lily::QMatmulArgs (metal/lily.h): u32 in_features, out_features, num_rows, one u32 of padding."""
    return struct.pack("<IIII", k, n, m, 0)


def random_weight(rng: np.random.Generator, n: int, k: int, bits: int, scale_dtype: str) -> QuantizedTensor:
    """An [n, k] weight quantized like an MLX checkpoint; per-row offsets make the biases matter."""
    w = rng.standard_normal((n, k)) / np.sqrt(k) + 0.02 * rng.standard_normal((n, 1))
    return quantize(w.astype(np.float32), bits, 64, dtype=SCALE_DTYPE_NAMES[scale_dtype])


def weight_buffers(qt: QuantizedTensor, scale_dtype: str, kio) -> list[np.ndarray]:
    """[codes, scales, biases] as device buffers (quantize already rounded the scales to their storage dtype)."""
    scales, biases = kio.to_device(qt.scales, scale_dtype), kio.to_device(qt.biases, scale_dtype)
    assert np.array_equal(kio.to_f64(scales, scale_dtype), qt.scales), "scales must be exact in their storage dtype"
    return [np.ascontiguousarray(qt.weight), scales, biases]


def random_x(rng: np.random.Generator, m: int, k: int, dtype: str, kio) -> np.ndarray:
    return kio.to_device(rng.standard_normal((m, k)), dtype)


def expected_output(x: np.ndarray, weight, dtype: str, kio) -> np.ndarray:
    """reference.qmatmul on the kernel's exact inputs (fp64 sums, fp32 result), rounded once to the output dtype."""
    return kio.round(reference.qmatmul(kio.to_f64(x, dtype).astype(np.float32), weight), dtype)


def accumulation_magnitude(x: np.ndarray, weight, dtype: str, kio) -> np.ndarray:
    """sum_k |x_k| (|scale * q_k| + |bias|) per output: what the fp32 partial sums (and the bias fold) are made of."""
    x64 = np.abs(kio.to_f64(x, dtype))
    if isinstance(weight, QuantizedTensor):
        groups = weight.codes().astype(np.float64).reshape(weight.shape[0], -1, weight.group_size)
        w_abs = np.abs(groups * weight.scales[..., None]) + np.abs(weight.biases[..., None])
        return x64 @ w_abs.reshape(weight.shape).T
    return x64 @ np.abs(np.asarray(weight, np.float64)).T


def assert_matmul_close(y: np.ndarray, x: np.ndarray, weight, dtype: str, kio, what: str) -> None:
    """The dtype's tolerance for the final rounding, widened by the error of fp32 accumulation over K terms.

    A K-term fp32 dot product is off by up to about sqrt(K) * 2^-24 * sum|x w| whatever the output dtype; with
    cancellation (|y| much smaller than that sum) this exceeds the one-rounding tolerance of the table, so the
    allowance is added to the element bound and to the relative RMS bound. NaN anywhere fails.
    """
    assert_gemv_close(kio.to_f64(y, dtype), expected_output(x, weight, dtype, kio),
                      accumulation_magnitude(x, weight, dtype, kio), x.shape[-1], dtype, kio, what)


def run_qmv(name: str, x: np.ndarray, qt: QuantizedTensor, scale_dtype: str, dtype: str, kio) -> np.ndarray:
    m, k = x.shape
    n = qt.shape[0]
    y = kio.poisoned((m, n), dtype)
    grid = (-(-n // QMV_ROWS_PER_THREADGROUP), m, 1)
    msl.dispatch(name, [qmatmul_args(k, n, m), x, *weight_buffers(qt, scale_dtype, kio), y], grid, (64, 1, 1))
    return y


def run_qmm(name: str, bm: int, bn: int, threads: int, x: np.ndarray, qt: QuantizedTensor, scale_dtype: str,
            dtype: str, kio) -> np.ndarray:
    m, k = x.shape
    n = qt.shape[0]
    y = kio.poisoned((m, n), dtype)
    grid = (-(-n // bn), -(-m // bm), 1)
    msl.dispatch(name, [qmatmul_args(k, n, m), x, *weight_buffers(qt, scale_dtype, kio), y], grid, (threads, 1, 1))
    return y


# ---- qmv ----

QMV_SHAPES = [(1, 1, 64), (1, 5, 512), (3, 9, 576), (2, 33, 128)]  # (M, N, K)


@pytest.mark.parametrize("m,n,k", QMV_SHAPES, ids=[f"m{m}-n{n}-k{k}" for m, n, k in QMV_SHAPES])
@pytest.mark.parametrize("key", list(QMV), ids=list(QMV.values()))
def test_qmv(key, m: int, n: int, k: int, kio) -> None:
    bits, dtype, scale_dtype = key
    rng = np.random.default_rng([bits, m, n, k, list(QMV).index(key)])
    qt = random_weight(rng, n, k, bits, scale_dtype)
    x = random_x(rng, m, k, dtype, kio)
    y = run_qmv(QMV[key], x, qt, scale_dtype, dtype, kio)
    assert_matmul_close(y, x, qt, dtype, kio, f"{QMV[key]} M={m} N={n} K={k}")


@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 12, 17])
def test_qmv_output_rows_around_simdgroup_and_threadgroup(n: int, kio) -> None:
    """Out counts that are not multiples of the 4 rows per simdgroup or the 8 per threadgroup."""
    rng = np.random.default_rng(100 + n)
    qt = random_weight(rng, n, 192, 4, "bf16")
    x = random_x(rng, 1, 192, "f32", kio)
    y = run_qmv("qmv_q4_g64_f32", x, qt, "bf16", "f32", kio)
    assert_matmul_close(y, x, qt, "f32", kio, f"qmv N={n}")


@pytest.mark.parametrize("k", [64, 448, 512, 1088, 2048])
def test_qmv_shared_expert_gate_shape(k: int, kio) -> None:
    """The shared-expert gate: 8-bit, ONE output row; K below, at and above a multiple of the 512-element step."""
    rng = np.random.default_rng(200 + k)
    qt = random_weight(rng, 1, k, 8, "bf16")
    x = random_x(rng, 1, k, "bf16", kio)
    y = run_qmv("qmv_q8_g64_bf16", x, qt, "bf16", "bf16", kio)
    assert_matmul_close(y, x, qt, "bf16", kio, f"shared gate K={k}")


def test_qmv_extreme_codes_and_zero_scale(kio) -> None:
    """All-0 and all-max codes, and a group with zero scale (bias only): the fold scale*sum(xq) + bias*sum(x)."""
    rng = np.random.default_rng(3)
    n, k = 4, 128
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    codes[0] = 0
    codes[1] = 15
    scales = np.float32(0.01) * (1 + rng.integers(0, 8, (n, k // 64))).astype(np.float32)
    scales[2, 1] = 0.0
    biases = round_to_dtype(rng.standard_normal((n, k // 64)).astype(np.float32), "bfloat16")
    qt = QuantizedTensor(pack(codes, 4), round_to_dtype(scales, "bfloat16"), biases, 4, 64, "bfloat16")
    x = random_x(rng, 1, k, "f32", kio)
    y = run_qmv("qmv_q4_g64_f32", x, qt, "bf16", "f32", kio)
    assert_matmul_close(y, x, qt, "f32", kio, "extreme codes")


def test_qmv_wrong_argument_struct() -> None:
    x = np.ones((1, 64), np.float32)
    w = np.zeros((8, 8), np.uint32)
    s = np.ones((8, 1), np.float32)
    with pytest.raises(ValueError, match=r"qmv_q4_g64_f32_sf32.*buffer\(0\).*16 bytes.*got 8"):
        msl.dispatch("qmv_q4_g64_f32_sf32", [struct.pack("<II", 64, 8), x, w, s, s, x], (1, 1, 1), (64, 1, 1))


# ---- qmm ----

QMM_SHAPES = [(1, 33, 64), (16, 32, 128), (33, 40, 64), (17, 1, 192)]  # (M, N, K)


@pytest.mark.parametrize("m,n,k", QMM_SHAPES, ids=[f"m{m}-n{n}-k{k}" for m, n, k in QMM_SHAPES])
@pytest.mark.parametrize("key", list(QMM), ids=list(QMM.values()))
def test_qmm(key, m: int, n: int, k: int, kio) -> None:
    bits, dtype, scale_dtype, bm = key
    rng = np.random.default_rng([bits, m, n, k, bm, list(QMM).index(key)])
    qt = random_weight(rng, n, k, bits, scale_dtype)
    x = random_x(rng, m, k, dtype, kio)
    y = run_qmm(QMM[key], bm, QMM_BN, bm // 16 * 64, x, qt, scale_dtype, dtype, kio)
    assert_matmul_close(y, x, qt, dtype, kio, f"{QMM[key]} M={m} N={n} K={k}")


@pytest.mark.parametrize("m", [15, 16, 31, 32, 65])
@pytest.mark.parametrize("bm", [16, 32])
def test_qmm_partial_row_tiles(bm: int, m: int, kio) -> None:
    """Row counts around both tile heights, N one past a column tile; a K of several steps and groups."""
    rng = np.random.default_rng(300 + 2 * m + bm)
    qt = random_weight(rng, 33, 256, 4, "bf16")
    x = random_x(rng, m, 256, "bf16", kio)
    name = {16: "qmm_q4_g64_bf16_bm16", 32: "qmm_q4_g64_bf16_bm32"}[bm]
    y = run_qmm(name, bm, QMM_BN, bm // 16 * 64, x, qt, "bf16", "bf16", kio)
    assert_matmul_close(y, x, qt, "bf16", kio, f"{name} M={m}")


# ---- the model's own K and N (real ratios, few rows) ----

# (host name, rows per tile or 0 for qmv, M, N, K, bits, dtype)
MODEL_SHAPES = [
    ("qmv_q4_g64_bf16", 0, 1, 40, 4096, 4, "bf16"),  # o_proj / out_proj: K = 4096
    ("qmv_q8_g64_bf16", 0, 1, 256, 2048, 8, "bf16"),  # MoE router: 256 experts, 8-bit
    ("qmv_q4_g64_bf16", 0, 2, 600, 512, 4, "bf16"),  # down projections: K = 512, many output rows
    ("qmm_q4_g64_bf16_bm32", 32, 64, 96, 2048, 4, "bf16"),
    ("qmm_q8_g64_f32_bm16", 16, 9, 70, 2048, 8, "f32"),
    ("qmm_nax_q4_g64_bf16", 32, 64, 128, 512, 4, "bf16"),
]


MODEL_SHAPE_IDS = [f"{s[0]}-m{s[2]}-n{s[3]}-k{s[4]}" for s in MODEL_SHAPES]


@pytest.mark.parametrize("name,bm,m,n,k,bits,dtype", MODEL_SHAPES, ids=MODEL_SHAPE_IDS)
def test_model_shapes(name: str, bm: int, m: int, n: int, k: int, bits: int, dtype: str, kio) -> None:
    rng = np.random.default_rng([m, n, k, bits])
    qt = random_weight(rng, n, k, bits, "bf16")
    x = random_x(rng, m, k, dtype, kio)
    if bm == 0:
        y = run_qmv(name, x, qt, "bf16", dtype, kio)
        weight = qt
    elif "_nax_" in name:
        y = run_qmm(name, NAX_BM, NAX_BN, 128, x, qt, "bf16", dtype, kio)
        weight = kio.round(qt.dequantize(), dtype).astype(np.float32)
    else:
        y = run_qmm(name, bm, QMM_BN, bm // 16 * 64, x, qt, "bf16", dtype, kio)
        weight = qt
    assert_matmul_close(y, x, weight, dtype, kio, f"{name} M={m} N={n} K={k}")


@pytest.mark.parametrize("name,bm", [("qmv_q4_g64_f32", 0), ("qmm_q4_g64_f32_bm32", 32)])
def test_results_do_not_depend_on_the_schedule(name: str, bm: int, kio) -> None:
    """Each output has one fixed summation order: FIFO and random fiber schedules give the same bits."""
    rng = np.random.default_rng(11)
    m, n, k = (2, 20, 1024) if bm == 0 else (40, 40, 256)
    qt = random_weight(rng, n, k, 4, "bf16")
    x = random_x(rng, m, k, "f32", kio)
    buffers = weight_buffers(qt, "bf16", kio)
    if bm == 0:
        grid, threads = (-(-n // QMV_ROWS_PER_THREADGROUP), m, 1), (64, 1, 1)
    else:
        grid, threads = (-(-n // QMM_BN), -(-m // bm), 1), (128, 1, 1)
    results = []
    for random_schedule, seed in [(False, 0), (True, 1), (True, 2)]:
        y = kio.poisoned((m, n), "f32")
        msl.dispatch(name, [qmatmul_args(k, n, m), x, *buffers, y], grid, threads, random_schedule=random_schedule,
                     seed=seed)
        results.append(y)
    assert all(np.array_equal(results[0], r) for r in results[1:])
    assert_matmul_close(results[0], x, qt, "f32", kio, f"{name} schedules")


# ---- qmm_nax (Metal 4 tensor ops; emulated, unverified until run on an M5) ----

NAX_SHAPES = [(1, 1, 64), (32, 64, 64), (33, 65, 128), (70, 130, 64)]  # (M, N, K)


@pytest.mark.parametrize("m,n,k", NAX_SHAPES, ids=[f"m{m}-n{n}-k{k}" for m, n, k in NAX_SHAPES])
@pytest.mark.parametrize("key", list(QMM_NAX), ids=list(QMM_NAX.values()))
def test_qmm_nax(key, m: int, n: int, k: int, kio) -> None:
    """The tensor-op tiles hold the dequantized weights in the activation dtype: the reference rounds them too."""
    bits, dtype = key
    rng = np.random.default_rng([bits, m, n, k, list(QMM_NAX).index(key), 7])
    qt = random_weight(rng, n, k, bits, "bf16")
    x = random_x(rng, m, k, dtype, kio)
    y = run_qmm(QMM_NAX[key], NAX_BM, NAX_BN, 128, x, qt, "bf16", dtype, kio)
    weight_in_tile = kio.round(qt.dequantize(), dtype).astype(np.float32)
    assert_matmul_close(y, x, weight_in_tile, dtype, kio, f"{QMM_NAX[key]} M={m} N={n} K={k}")


# ---- decode fusions: qmv with f32 output, qmv_norm (RMSNorm folded in), qmv_residual (residual add folded in) ----

# (bits, activation dtype, scale dtype) -> host name; output in the activation dtype unless the name ends in _of32.
QMV_OF32 = {
    (4, "bf16", "bf16"): "qmv_q4_g64_bf16_of32",
    (4, "bf16", "f32"): "qmv_q4_g64_bf16_sf32_of32",
    (8, "bf16", "bf16"): "qmv_q8_g64_bf16_of32",
    (8, "bf16", "f32"): "qmv_q8_g64_bf16_sf32_of32",
}
QMV_NORM = {
    (4, "f32", "bf16"): "qmv_norm_q4_g64_f32",
    (4, "f32", "f32"): "qmv_norm_q4_g64_f32_sf32",
    (4, "bf16", "bf16"): "qmv_norm_q4_g64_bf16",
    (4, "bf16", "f32"): "qmv_norm_q4_g64_bf16_sf32",
    (8, "f32", "bf16"): "qmv_norm_q8_g64_f32",
    (8, "f32", "f32"): "qmv_norm_q8_g64_f32_sf32",
    (8, "bf16", "bf16"): "qmv_norm_q8_g64_bf16",
    (8, "bf16", "f32"): "qmv_norm_q8_g64_bf16_sf32",
}
QMV_NORM_OF32 = {
    (4, "bf16", "bf16"): "qmv_norm_q4_g64_bf16_of32",
    (4, "bf16", "f32"): "qmv_norm_q4_g64_bf16_sf32_of32",
    (8, "bf16", "bf16"): "qmv_norm_q8_g64_bf16_of32",
    (8, "bf16", "f32"): "qmv_norm_q8_g64_bf16_sf32_of32",
}
QMV_RESIDUAL = {
    (4, "f32", "bf16"): "qmv_residual_q4_g64_f32",
    (4, "f32", "f32"): "qmv_residual_q4_g64_f32_sf32",
    (4, "bf16", "bf16"): "qmv_residual_q4_g64_bf16",
    (4, "bf16", "f32"): "qmv_residual_q4_g64_bf16_sf32",
    (8, "f32", "bf16"): "qmv_residual_q8_g64_f32",
    (8, "f32", "f32"): "qmv_residual_q8_g64_f32_sf32",
    (8, "bf16", "bf16"): "qmv_residual_q8_g64_bf16",
    (8, "bf16", "f32"): "qmv_residual_q8_g64_bf16_sf32",
}
NORM_EPS = 1e-6
# (M, N, K): one row with N = 1 (the shared-expert gate), partial threadgroups, K below/at/above the 512 step.
FUSED_SHAPES = [(1, 1, 64), (1, 9, 576), (2, 33, 128), (1, 12, 1024)]
FUSED_SHAPE_IDS = [f"m{m}-n{n}-k{k}" for m, n, k in FUSED_SHAPES]


def qmatmul_norm_args(k: int, n: int, m: int, eps: float) -> bytes:
    """lily::QMatmulNormArgs (metal/lily.h): u32 in_features, out_features, num_rows, f32 eps."""
    return struct.pack("<IIIf", k, n, m, eps)


def assert_gemv_close(actual: np.ndarray, expected: np.ndarray, magnitude: np.ndarray, k: int, dtype: str, kio,
                      what: str, *, relative_ulps: float = 0.0) -> None:
    """assert_matmul_close on a precomputed expectation: the dtype's tolerance plus the fp32 accumulation allowance
    sqrt(K)·2^-24·`magnitude`, plus `relative_ulps`·sqrt(K)·2^-24·|expected| (a scalar computed by a K-term fp32 sum,
    such as 1/rms, scales the whole output)."""
    tol = kio.tolerances[dtype]
    assert not np.isnan(actual).any(), f"{what}: NaN at {np.argwhere(np.isnan(actual))[:5].tolist()}"
    unit = np.sqrt(k) * 2.0**-24
    allowance = ACCUMULATION_ULPS * unit * magnitude + relative_ulps * unit * np.abs(expected)
    err = np.abs(actual - expected)
    limit = tol.atol + tol.rtol * np.abs(expected) + allowance
    worst = np.unravel_index(int(np.argmax(err - limit)), err.shape)
    assert (err <= limit).all(), (
        f"{what}: element {worst}: got {actual[worst]!r}, expected {expected[worst]!r} "
        f"(error {err[worst]:.3g}, limit {limit[worst]:.3g}, {dtype})"
    )
    scale = np.sqrt(np.mean(expected**2))
    rel_rms = np.sqrt(np.mean((actual - expected) ** 2)) / scale
    rel_limit = tol.rel_rms + np.sqrt(np.mean(allowance**2)) / scale
    assert rel_rms <= rel_limit, f"{what}: relative RMS error {rel_rms:.3g} > {rel_limit:.3g} ({dtype})"


def run_qmv_norm(name: str, x: np.ndarray, norm_weight: np.ndarray, qt: QuantizedTensor, scale_dtype: str,
                 out_dtype: str, kio, eps: float = NORM_EPS) -> np.ndarray:
    m, k = x.shape
    n = qt.shape[0]
    y = kio.poisoned((m, n), out_dtype)
    grid = (-(-n // QMV_ROWS_PER_THREADGROUP), m, 1)
    msl.dispatch(name, [qmatmul_norm_args(k, n, m, eps), x, norm_weight, *weight_buffers(qt, scale_dtype, kio), y],
                 grid, (64, 1, 1))
    return y


def check_qmv_norm(name: str, bits: int, dtype: str, scale_dtype: str, out_dtype: str, m: int, n: int, k: int,
                   rng: np.random.Generator, kio, x_scale: float = 1.0) -> None:
    """qmv_norm against reference.qmatmul(reference.rms_norm(x, w)): the normalised row is never rounded to the
    activation dtype (it only lives in registers), so the reference keeps it in fp32 too."""
    qt = random_weight(rng, n, k, bits, scale_dtype)
    x = kio.to_device(rng.standard_normal((m, k)) * x_scale, dtype)
    norm_weight = kio.to_device(1.0 + 0.3 * rng.standard_normal(k), dtype)
    y = run_qmv_norm(name, x, norm_weight, qt, scale_dtype, out_dtype, kio)
    normed = reference.rms_norm(kio.to_f64(x, dtype), kio.to_f64(norm_weight, dtype), NORM_EPS)
    expected = kio.round(reference.qmatmul(normed, qt), out_dtype)
    magnitude = accumulation_magnitude(normed, qt, "f32", kio)
    assert_gemv_close(kio.to_f64(y, out_dtype), expected, magnitude, k, out_dtype, kio, f"{name} M={m} N={n} K={k}",
                      relative_ulps=1.0)


@pytest.mark.parametrize("m,n,k", FUSED_SHAPES, ids=FUSED_SHAPE_IDS)
@pytest.mark.parametrize("key", list(QMV_OF32), ids=list(QMV_OF32.values()))
def test_qmv_f32_output(key, m: int, n: int, k: int, kio) -> None:
    """bf16 input, f32 output (router logits in bf16 mode): the sum is rounded once, to f32."""
    bits, dtype, scale_dtype = key
    rng = np.random.default_rng([bits, m, n, k, 17])
    qt = random_weight(rng, n, k, bits, scale_dtype)
    x = random_x(rng, m, k, dtype, kio)
    y = run_qmv(QMV_OF32[key], x, qt, scale_dtype, "f32", kio)
    expected = reference.qmatmul(kio.to_f64(x, dtype).astype(np.float32), qt).astype(np.float64)
    magnitude = accumulation_magnitude(x, qt, dtype, kio)
    assert_gemv_close(y.astype(np.float64), expected, magnitude, k, "f32", kio, f"{QMV_OF32[key]} M={m} N={n} K={k}")


@pytest.mark.parametrize("m,n,k", FUSED_SHAPES, ids=FUSED_SHAPE_IDS)
@pytest.mark.parametrize("key,out_dtype", [(key, key[1]) for key in QMV_NORM] + [(key, "f32") for key in QMV_NORM_OF32],
                         ids=list(QMV_NORM.values()) + list(QMV_NORM_OF32.values()))
def test_qmv_norm(key, out_dtype: str, m: int, n: int, k: int, kio) -> None:
    bits, dtype, scale_dtype = key
    name = QMV_NORM[key] if out_dtype == dtype else QMV_NORM_OF32[key]
    rng = np.random.default_rng([bits, m, n, k, len(name), 31])
    check_qmv_norm(name, bits, dtype, scale_dtype, out_dtype, m, n, k, rng, kio)


@pytest.mark.parametrize("x_scale", [1e-4, 30.0])
def test_qmv_norm_scale_of_x(x_scale: float, kio) -> None:
    """Tiny rows (eps matters: 1/rms is not 1/|x|) and large ones (the norm undoes the scale) at the model's K."""
    rng = np.random.default_rng(int(x_scale * 1e4))
    check_qmv_norm("qmv_norm_q4_g64_f32", 4, "f32", "bf16", "f32", 1, 20, 2048, rng, kio, x_scale=x_scale)


@pytest.mark.parametrize("m,n,k", FUSED_SHAPES, ids=FUSED_SHAPE_IDS)
@pytest.mark.parametrize("key", list(QMV_RESIDUAL), ids=list(QMV_RESIDUAL.values()))
def test_qmv_residual(key, m: int, n: int, k: int, kio) -> None:
    """out = residual + W·x rounded once; written in place over the residual (the engine's use) and to a separate
    buffer, with the same bits."""
    bits, dtype, scale_dtype = key
    name = QMV_RESIDUAL[key]
    rng = np.random.default_rng([bits, m, n, k, list(QMV_RESIDUAL).index(key), 47])
    qt = random_weight(rng, n, k, bits, scale_dtype)
    x = random_x(rng, m, k, dtype, kio)
    residual = kio.to_device(2.0 * rng.standard_normal((m, n)), dtype)
    grid = (-(-n // QMV_ROWS_PER_THREADGROUP), m, 1)
    separate = kio.poisoned((m, n), dtype)
    buffers = weight_buffers(qt, scale_dtype, kio)
    msl.dispatch(name, [qmatmul_args(k, n, m), x, *buffers, residual, separate], grid, (64, 1, 1))
    expected_sum = kio.to_f64(residual, dtype) + reference.qmatmul(kio.to_f64(x, dtype).astype(np.float32), qt)
    expected = kio.round(expected_sum, dtype)
    magnitude = accumulation_magnitude(x, qt, dtype, kio)
    assert_gemv_close(kio.to_f64(separate, dtype), expected, magnitude, k, dtype, kio, f"{name} M={m} N={n} K={k}")
    in_place = residual.copy()
    msl.dispatch(name, [qmatmul_args(k, n, m), x, *buffers, in_place, in_place], grid, (64, 1, 1))
    assert np.array_equal(in_place, separate), f"{name}: in-place result differs"


# ---- segmented decode GEMVs: one dispatch over up to 4 matrices sharing x, each from its own buffers ----

# (norm folded in, bits, activation dtype, scale dtype, output dtype) -> host name
QMV_SEG = {
    (False, 4, "f32", "bf16", "f32"): "qmv_seg_q4_g64_f32",
    (False, 4, "f32", "f32", "f32"): "qmv_seg_q4_g64_f32_sf32",
    (False, 4, "bf16", "bf16", "bf16"): "qmv_seg_q4_g64_bf16",
    (False, 4, "bf16", "f32", "bf16"): "qmv_seg_q4_g64_bf16_sf32",
    (False, 4, "bf16", "bf16", "f32"): "qmv_seg_q4_g64_bf16_of32",
    (False, 4, "bf16", "f32", "f32"): "qmv_seg_q4_g64_bf16_sf32_of32",
    (False, 8, "f32", "bf16", "f32"): "qmv_seg_q8_g64_f32",
    (False, 8, "f32", "f32", "f32"): "qmv_seg_q8_g64_f32_sf32",
    (False, 8, "bf16", "bf16", "bf16"): "qmv_seg_q8_g64_bf16",
    (False, 8, "bf16", "f32", "bf16"): "qmv_seg_q8_g64_bf16_sf32",
    (False, 8, "bf16", "bf16", "f32"): "qmv_seg_q8_g64_bf16_of32",
    (False, 8, "bf16", "f32", "f32"): "qmv_seg_q8_g64_bf16_sf32_of32",
    (True, 4, "f32", "bf16", "f32"): "qmv_norm_seg_q4_g64_f32",
    (True, 4, "f32", "f32", "f32"): "qmv_norm_seg_q4_g64_f32_sf32",
    (True, 4, "bf16", "bf16", "bf16"): "qmv_norm_seg_q4_g64_bf16",
    (True, 4, "bf16", "f32", "bf16"): "qmv_norm_seg_q4_g64_bf16_sf32",
    (True, 4, "bf16", "bf16", "f32"): "qmv_norm_seg_q4_g64_bf16_of32",
    (True, 4, "bf16", "f32", "f32"): "qmv_norm_seg_q4_g64_bf16_sf32_of32",
    (True, 8, "f32", "bf16", "f32"): "qmv_norm_seg_q8_g64_f32",
    (True, 8, "f32", "f32", "f32"): "qmv_norm_seg_q8_g64_f32_sf32",
    (True, 8, "bf16", "bf16", "bf16"): "qmv_norm_seg_q8_g64_bf16",
    (True, 8, "bf16", "f32", "bf16"): "qmv_norm_seg_q8_g64_bf16_sf32",
    (True, 8, "bf16", "bf16", "f32"): "qmv_norm_seg_q8_g64_bf16_of32",
    (True, 8, "bf16", "f32", "f32"): "qmv_norm_seg_q8_g64_bf16_sf32_of32",
}
MAX_SEGMENTS = 4  # LILY_QMV_MAX_SEGMENTS


def qmatmul_segments_args(k: int, rows: list[int], eps: float) -> bytes:
    """lily::QMatmulSegmentsArgs (metal/lily.h): u32 in_features, out_features, num_segments, f32 eps, u32 rows[4]."""
    padded = list(rows) + [0] * (MAX_SEGMENTS - len(rows))
    return struct.pack("<IIIf4I", k, sum(rows), len(rows), eps, *padded)


def concatenated(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """The matrices stacked along output rows: what the segmented GEMV must compute, as one reference weight."""
    return QuantizedTensor(np.concatenate([p.weight for p in parts]), np.concatenate([p.scales for p in parts]),
                           np.concatenate([p.biases for p in parts]), parts[0].bits, parts[0].group_size,
                           dtype=parts[0].dtype)


def check_qmv_segments(key, rows: list[int], k: int, m: int, rng: np.random.Generator, kio) -> None:
    norm, bits, dtype, scale_dtype, out_dtype = key
    name = QMV_SEG[key]
    parts = [random_weight(rng, n, k, bits, scale_dtype) for n in rows]
    x = random_x(rng, m, k, dtype, kio)
    norm_weight = kio.to_device(1.0 + 0.3 * rng.standard_normal(k), dtype)
    buffers = [weight_buffers(p, scale_dtype, kio) for p in parts]
    # Unused segments bind the first matrix again, as the host does; the kernel must not read them.
    bindings = [b for s in range(MAX_SEGMENTS) for b in buffers[s if s < len(parts) else 0]]
    y = kio.poisoned((m, sum(rows)), out_dtype)
    grid = (sum(-(-n // QMV_ROWS_PER_THREADGROUP) for n in rows), m, 1)
    msl.dispatch(name, [qmatmul_segments_args(k, rows, NORM_EPS), x, norm_weight, *bindings, y], grid, (64, 1, 1))
    whole = concatenated(parts)
    x_in = kio.to_f64(x, dtype)
    if norm:
        x_in = reference.rms_norm(x_in, kio.to_f64(norm_weight, dtype), NORM_EPS)
    expected = kio.round(reference.qmatmul(x_in.astype(np.float32), whole), out_dtype)
    magnitude = accumulation_magnitude(x_in.astype(np.float32), whole, "f32", kio)
    assert_gemv_close(kio.to_f64(y, out_dtype), expected, magnitude, k, out_dtype, kio,
                      f"{name} rows={rows} M={m} K={k}", relative_ulps=1.0 if norm else 0.0)


@pytest.mark.parametrize("key", list(QMV_SEG), ids=list(QMV_SEG.values()))
def test_qmv_segments(key, kio) -> None:
    """Every instantiated variant against reference.qmatmul on the concatenated weight (DeltaNet-like: 4 segments,
    the last two of one row)."""
    rng = np.random.default_rng([list(QMV_SEG).index(key), 61])
    check_qmv_segments(key, [9, 17, 1, 1], 128, 1, rng, kio)


# Segment sizes: one row, 31/32/33 (around the 8-row threadgroup and 4-row simdgroup), not multiples of 8, 1 to 4
# segments; K across the 512-element step.
SEGMENT_LAYOUTS = [([1], 64), ([32], 64), ([33, 31], 64), ([31, 32, 33, 1], 64), ([5, 3], 576), ([1, 1, 1], 1024)]


@pytest.mark.parametrize("rows,k", SEGMENT_LAYOUTS, ids=[f"{'-'.join(map(str, r))}-k{k}" for r, k in SEGMENT_LAYOUTS])
@pytest.mark.parametrize("norm", [False, True])
def test_qmv_segments_boundaries(rows: list[int], k: int, norm: bool, kio) -> None:
    key = (norm, 8, "bf16", "bf16", "f32")  # the router | shared-gate variant in bf16 mode (8-bit routers)
    rng = np.random.default_rng([sum(rows), len(rows), k, norm, 67])
    check_qmv_segments(key, rows, k, 1, rng, kio)


def test_qmv_segments_several_input_rows(kio) -> None:
    """One grid row per input row, each writing its own output row of sum(rows) values."""
    check_qmv_segments((True, 4, "f32", "bf16", "f32"), [3, 9], 64, 2, np.random.default_rng(71), kio)


# ---- qmv lane packs and steps (metal/lily.h LILY_QMV_PACK_WORDS, LILY_QMV_PACKS_PER_LANE) ----
# A lane reads packs of 4 words (32 codes at 4 bits, 16 at 8), 2 per row and step: a simdgroup step is 2,048 codes
# at 4 bits and 1,024 at 8. K one group below, at and above one and two steps, and a K whose last step leaves most
# lanes without a pack (their packs re-read the row's last pack with weight 0: x^2 must not be counted twice).
QMV_STEP_KS = {4: [1984, 2048, 2112, 4032, 4160], 8: [960, 1024, 1088, 2112]}
QMV_STEP_CASES = [(bits, k, m) for bits, ks in QMV_STEP_KS.items() for k in ks for m in (1, 4)]


@pytest.mark.parametrize("bits,k,m", QMV_STEP_CASES, ids=[f"q{b}-k{k}-m{m}" for b, k, m in QMV_STEP_CASES])
def test_qmv_steps_and_partial_steps(bits: int, k: int, m: int, kio) -> None:
    """Plain qmv in fp32 (the exact path) against reference.qmatmul at K around the step, 1 and 4 input rows."""
    name = QMV[(bits, "f32", "bf16")]
    rng = np.random.default_rng([bits, k, m, 83])
    qt = random_weight(rng, 13, k, bits, "bf16")
    x = random_x(rng, m, k, "f32", kio)
    y = run_qmv(name, x, qt, "bf16", "f32", kio)
    assert_matmul_close(y, x, qt, "f32", kio, f"{name} M={m} K={k}")


@pytest.mark.parametrize("bits,k", [(4, 2112), (4, 4160), (8, 1088)], ids=["q4-k2112", "q4-k4160", "q8-k1088"])
def test_qmv_norm_partial_steps(bits: int, k: int, kio) -> None:
    """qmv_norm and qmv_norm_seg where the last step is partial: 1/rms sums x^2 over K exactly once."""
    rng = np.random.default_rng([bits, k, 89])
    check_qmv_norm(QMV_NORM[(bits, "f32", "bf16")], bits, "f32", "bf16", "f32", 2, 11, k, rng, kio)
    check_qmv_segments((True, bits, "f32", "bf16", "f32"), [9, 3], k, 1, rng, kio)
