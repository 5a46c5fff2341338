"""Cases of metal/qmatmul.metal against ``lily.reference.qmatmul`` on the dequantized weights.

Weights are quantized with lily.quant.quantize (MLX affine, group 64; bf16 or f32 scales). Shapes cross every
boundary of the kernels: output rows around the 4-row simdgroup and 8-row threadgroup of qmv (N = 1 is the
shared-expert gate), K below, at and above the qmv step (a lane reads packs of 4 words, 2 per row and step: 2,048
codes at 4 bits, 1,024 at 8) and last steps that leave most lanes without a pack, M and N around the 16/32-row and 32/64-column
tiles of qmm and qmm_nax, the model's own K and N; the decode fusions (f32 output, RMSNorm folded in, residual added
in place, up to 4 segments from separate buffers). The tolerance is the output dtype's plus the error of an fp32
sum of K terms.
"""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import (Case, Run, dtype_of, poisoned, quantized_weight, round_to, scale_dtype_of,
                                      to_device, to_f64, weight_buffers)
from lily.quant import QuantizedTensor, pack, round_to_dtype

PATTERN = re.compile(r"qmv(_norm|_residual)?(_seg)?_q(4|8)_g64_(f32|f16|bf16)(_sf32)?(_of32)?"
                     r"|qmv(_norm|_residual)?(_seg)?_staged_q(4|8)_g64_(f32|bf16)(_of32)?(_a16)?"
                     r"|qmv_norm_argmax_staged_q4_g64_(f32|bf16_of32)(_a16)?"
                     r"|qmv_(norm_seg_conv|gated_norm_residual)_staged_q4_g64_(f32|bf16)(_a16)?"
                     r"|qmv_mma_q4_g64_bf16(_of32)?"
                     r"|qmm_q(4|8)_g64_(f32|f16|bf16)(_sf32)?(_of32)?_bm(16|32|64)|qmm_nax_q(4|8)_g64_(f16|bf16)")
QMV_ROWS_PER_THREADGROUP = 8  # LILY_QMV_SIMDGROUPS * LILY_QMV_ROWS_PER_SIMDGROUP
QMV_STAGED_ROWS_PER_SIMDGROUP = 4  # LILY_QMV_ROWS_PER_SIMDGROUP: a staged threadgroup's simdgroups each take 4 rows
QMM_BN, QMM_THREADS = 64, 128  # LILY_GEMM_BN, LILY_GEMM_THREADS
QMV_MMA_ROWS = 16  # LILY_QMV_MMA_ROWS
# qmv_mma's simdgroups splitting K (tuning::qmv_mma_simdgroups: 8 below 8192 output features, 4 from there; the kernel
# takes 1 to LILY_QMV_MMA_MAX_SIMDGROUPS = 8).
QMV_MMA_SIMDGROUPS = (8, 4)
# The code offset of qmv_mma's bf16 codes (128 + q): its fp32 sums add x (128 + q) scale and x (bias - 128 scale).
QMV_MMA_CODE_OFFSET = 128
NAX_BM, NAX_BN = 32, 64  # LILY_QMM_NAX_BM, LILY_QMM_NAX_BN
MAX_SEGMENTS = 4  # LILY_QMV_MAX_SEGMENTS
NORM_EPS = 1e-6
# Allowance for fp32 accumulation, in units of sqrt(K) * 2^-24 * sum|x w| (see _check_matmul).
ACCUMULATION_ULPS = 1.0

# (M, N, K) per kernel kind; the first is the self-test's case.
QMV_SHAPES = [(2, 40, 512), (1, 1, 64), (1, 5, 512), (3, 9, 576), (2, 33, 128)]
# One row with N = 1 (the shared-expert gate), partial threadgroups, K below/at/above the 512 step.
FUSED_SHAPES = [(1, 40, 512), (1, 1, 64), (1, 9, 576), (2, 33, 128), (1, 12, 1024)]
QMM_SHAPES = [(1, 33, 64), (16, 32, 128), (33, 40, 64), (17, 1, 192)]
NAX_SHAPES = [(1, 1, 64), (32, 64, 64), (33, 65, 128), (70, 130, 64)]
# qmv_mma, at each of the engine's simdgroup counts: every row count of its 8-column fragment and past it (grid y),
# output features around its 16-row threadgroup and 8-row fragments, K from one group (all simdgroups but one idle)
# through partial and whole steps of 4 groups x 4 or 8 simdgroups to the model's 2048 and 4096.
QMV_MMA_SHAPES = ([(2, 40, 512)] + [(m, 24, 128) for m in (1, 3, 4, 5, 7, 8, 9, 16, 17)]
                  + [(1, n, 64) for n in (1, 7, 8, 15, 16, 17, 33)]
                  + [(3, 21, k) for k in (192, 576, 1024, 1088, 2048, 2112, 4096)])
# Extra shapes of particular kernels: rows around the qmv simdgroup/threadgroup, the shared-expert gate, qmm row
# tiles, and the model's own K and N (o_proj/out_proj K = 4096, the 8-bit router, down projections K = 512).
EXTRA_SHAPES = {
    "qmv_q4_g64_f32": [(1, n, 192) for n in (1, 3, 4, 7, 8, 12, 17)]
    + [(m, 13, k) for k in (1984, 2048, 2112, 4032, 4160) for m in (1, 4)],
    "qmv_q8_g64_f32": [(m, 13, k) for k in (960, 1024, 1088, 2112) for m in (1, 4)],
    # Partial last steps of the fused norm: 1/rms sums x^2 over K exactly once.
    "qmv_norm_q4_g64_f32": [(2, 11, 2112), (2, 11, 4160)],
    "qmv_norm_q8_g64_f32": [(2, 11, 1088)],
    # The staged GEMVs: K up to LILY_QMV_STAGE_MAX_K = 4096 (the staging buffer full), a partial pack step (2112), two
    # input rows (grid y), a partial simdgroup, 26 row blocks (qmv_norm_staged streams them); the residual the same.
    "qmv_norm_staged_q4_g64_f32": [(2, 11, 2112), (1, 11, 4096), (1, 20, 2048), (2, 203, 256)],
    "qmv_residual_staged_q4_g64_f32": [(2, 11, 2112), (1, 13, 4096)],
    "qmv_q8_g64_bf16": [(1, 1, k) for k in (64, 448, 512, 1088, 2048)] + [(1, 256, 2048)],
    "qmv_q4_g64_bf16": [(1, 40, 4096), (2, 600, 512)],
    "qmm_q4_g64_bf16_bm16": [(m, 33, 256) for m in (15, 16, 31, 32, 65)],
    "qmm_q4_g64_bf16_bm32": [(m, 33, 256) for m in (15, 16, 31, 32, 65)] + [(64, 96, 2048)],
    # 64-row tiles: partial row and column tiles, one K step (32 of a 64-group), many steps with both tile buffers.
    "qmm_q4_g64_bf16_bm64": [(m, n, 256) for m, n in ((63, 65), (64, 64), (65, 127), (130, 33))]
    + [(64, 64, 64), (70, 96, 2048)],
    "qmm_q8_g64_f32_bm16": [(9, 70, 2048)],
    "qmm_q8_g64_bf16_of32_bm32": [(70, 257, 2048)],  # the full-size router | shared-expert gate
    "qmm_nax_q4_g64_bf16": [(64, 128, 512)],
}
# Segment row counts and K of the segmented GEMVs: the DeltaNet-like 4 segments, one row, 31/32/33 rows (around the
# 8-row threadgroup and 4-row simdgroup), 1 to 4 segments, K across the 512-element step.
SEGMENTS = [([33, 9, 1, 1], 512, 1), ([9, 17, 1, 1], 128, 1)]
SEGMENT_BOUNDARIES = [([1], 64, 1), ([32], 64, 1), ([33, 31], 64, 1), ([31, 32, 33, 1], 64, 1), ([5, 3], 576, 1),
                      ([1, 1, 1], 1024, 1)]
EXTRA_SEGMENTS = {
    "qmv_seg_q8_g64_bf16_of32": SEGMENT_BOUNDARIES,  # the router | shared-gate variant in bf16 mode
    "qmv_norm_seg_q8_g64_bf16_of32": SEGMENT_BOUNDARIES,
    "qmv_norm_seg_q4_g64_f32": [([3, 9], 64, 2), ([9, 3], 2112, 1), ([9, 3], 4160, 1)],  # one grid row per input row
    "qmv_norm_seg_q8_g64_f32": [([9, 3], 1088, 1)],
    "qmv_norm_seg_staged_q4_g64_f32": [([3, 9], 64, 2), ([9, 3], 2112, 1), ([9, 3], 4096, 1)],
    # 8-bit K past one step of 64 packs (1024): the router's K = 2048 (two steps), a partial second step.
    "qmv_norm_seg_staged_q8_g64_bf16_of32": SEGMENT_BOUNDARIES + [([9, 1], 2048, 1), ([5, 3], 1088, 1)],
}


# The staged segmented GEMV with two step slots (SPLIT_STEPS; (rows, K, M)): the router | shared gate at the model's
# 8-bit K = 2048 (two steps) with 257 rows, a partial second step (1088), one step (a slot with none), a segment
# leaving whole simdgroups without rows; at 4 bits K = 4096 and 2112, two input rows. The streaming check (2
# threadgroups for every block) runs each with the same slots, so later blocks split their steps too.
SEGMENT_SLOT_SHAPES_Q8 = [([256, 1], 2048, 1), ([9, 3], 1088, 1), ([33, 31], 512, 1), ([5, 1, 17], 2048, 1)]
SEGMENT_SLOT_SHAPES_Q4 = [([9, 3], 4096, 1), ([3, 9], 2112, 2), ([33, 1], 1024, 1)]


# qmv_norm_argmax_staged (the greedy lm_head): (M, N, K, threadgroups, threads); the first is the self-test's. Streaming
# (fewer threadgroups than row blocks) with a partial last block, one threadgroup per block, two input rows with a
# partial pack step, N = 1, and the engine's 4 simdgroups.
ARGMAX_SHAPES = [(1, 203, 256, 3, 64), (1, 40, 512, 5, 64), (2, 77, 2112, 4, 64), (1, 1, 64, 1, 64),
                 (1, 300, 2048, 2, 128)]


def qmatmul_args(k: int, n: int, m: int) -> bytes:
    """lily::QMatmulArgs (metal/lily.h): u32 in_features, out_features, num_rows, one u32 of padding."""
    return struct.pack("<IIII", k, n, m, 0)


def out_dtype_of(kernel: str) -> str:
    return "f32" if "_of32" in kernel else dtype_of(kernel)


def accumulation_magnitude(x: np.ndarray, weight) -> np.ndarray:
    """sum_k |x_k| (|scale * q_k| + |bias|) per output: what the fp32 partial sums (and the bias fold) are made of."""
    x_abs = np.abs(np.asarray(x, np.float64))
    if isinstance(weight, QuantizedTensor):
        groups = weight.codes().astype(np.float64).reshape(weight.shape[0], -1, weight.group_size)
        w_abs = np.abs(groups * weight.scales[..., None]) + np.abs(weight.biases[..., None])
        return x_abs @ w_abs.reshape(weight.shape).T
    return x_abs @ np.abs(np.asarray(weight, np.float64)).T


def check_matmul(run: Run, y: np.ndarray, out_dtype: str, x: np.ndarray, weight, *, add: np.ndarray | None = None,
                 relative_ulps: float = 0.0, code_offset: int = 0) -> None:
    """y (+ `add`) against reference.qmatmul(x, weight) rounded once to `out_dtype`: the dtype's tolerance widened by
    the error of a K-term fp32 sum, about sqrt(K)·2^-24·sum|x w| (with cancellation this exceeds one rounding), plus
    `relative_ulps`·sqrt(K)·2^-24·|expected| (a scalar from a K-term fp32 sum, such as 1/rms, scales the output).
    `code_offset`: the kernel sums x (code_offset + q) scale and x (bias - code_offset scale) (qmv_mma), so those
    terms make up its sums."""
    x32 = np.asarray(x, np.float64).astype(np.float32)
    exact = reference.qmatmul(x32, weight).astype(np.float64) + (0.0 if add is None else add)
    expected = round_to(exact, out_dtype)
    unit = np.sqrt(x.shape[-1]) * 2.0**-24
    if code_offset:
        weight = QuantizedTensor(weight.weight, weight.scales, weight.biases - code_offset * weight.scales,
                                 weight.bits, weight.group_size, weight.dtype)
        offset_terms = code_offset * np.abs(x32).astype(np.float64) @ np.abs(
            np.repeat(weight.scales.astype(np.float64), weight.group_size, axis=-1)).T
    else:
        offset_terms = 0.0
    magnitude = accumulation_magnitude(x32, weight) + offset_terms
    allowance = ACCUMULATION_ULPS * unit * magnitude + relative_ulps * unit * np.abs(expected)
    run.compare("y", to_f64(y, out_dtype), expected, out_dtype, allowance)


def _qmv(run: Run, kernel: str, m: int, n: int, k: int, weight: QuantizedTensor | None = None) -> None:
    dtype, out_dtype = dtype_of(kernel), out_dtype_of(kernel)
    if weight is None:
        weight, buffers = quantized_weight(kernel, (n, k), run.rng)
    else:
        buffers = weight_buffers(weight, scale_dtype_of(kernel))
    x = to_device(run.rng.standard_normal((m, k)), dtype)
    y = poisoned((m, n), out_dtype)
    run.dispatch(kernel, [qmatmul_args(k, n, m), x, *buffers, y], (-(-n // QMV_ROWS_PER_THREADGROUP), m, 1), 64)
    check_matmul(run, y, out_dtype, to_f64(x, dtype), weight)


def _qmv_extreme_codes(run: Run, kernel: str) -> None:
    """All-0 and all-max codes, and a group with zero scale (bias only): the fold scale*sum(xq) + bias*sum(x)."""
    _qmv(run, kernel, 1, 4, 128, _extreme_codes_weight(run.rng, 4, 128))


def _qmv_mma(run: Run, kernel: str, m: int, n: int, k: int, simdgroups: int,
             weight: QuantizedTensor | None = None) -> None:
    """The bf16 x is exact in the MMAs; the sums carry the codes' offset of 128 (check_matmul's code_offset)."""
    out_dtype = out_dtype_of(kernel)
    if weight is None:
        weight, buffers = quantized_weight(kernel, (n, k), run.rng)
    else:
        buffers = weight_buffers(weight, scale_dtype_of(kernel))
    x = to_device(run.rng.standard_normal((m, k)), "bf16")
    y = poisoned((m, n), out_dtype)
    run.dispatch(kernel, [qmatmul_args(k, n, m), x, *buffers, y], (-(-n // QMV_MMA_ROWS), -(-m // 8), 1),
                 32 * simdgroups)
    check_matmul(run, y, out_dtype, to_f64(x, "bf16"), weight, code_offset=QMV_MMA_CODE_OFFSET)


def _extreme_codes_weight(rng: np.random.Generator, n: int, k: int) -> QuantizedTensor:
    """All-0 and all-max code rows and a group with zero scale (bias only)."""
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    codes[0], codes[1] = 0, 15
    scales = np.float32(0.01) * (1 + rng.integers(0, 8, (n, k // 64))).astype(np.float32)
    scales[2, 1] = 0.0
    biases = round_to_dtype(rng.standard_normal((n, k // 64)).astype(np.float32), "bfloat16")
    return QuantizedTensor(pack(codes, 4), round_to_dtype(scales, "bfloat16"), biases, 4, 64, "bfloat16")


def _qmm(run: Run, kernel: str, m: int, n: int, k: int) -> None:
    """qmm's tiles hold the dequantized weights in the activation dtype (as MLX's): the reference rounds them too."""
    dtype, out_dtype = dtype_of(kernel), out_dtype_of(kernel)
    if "_nax_" in kernel:
        bm, bn, threads = NAX_BM, NAX_BN, 128
    else:
        bm, bn, threads = int(kernel[-2:]), QMM_BN, QMM_THREADS
    weight, buffers = quantized_weight(kernel, (n, k), run.rng)
    x = to_device(run.rng.standard_normal((m, k)), dtype)
    y = poisoned((m, n), out_dtype)
    run.dispatch(kernel, [qmatmul_args(k, n, m), x, *buffers, y], (-(-n // bn), -(-m // bm), 1), threads)
    if dtype != "f32":
        weight = round_to(weight.dequantize(), dtype).astype(np.float32)
    check_matmul(run, y, out_dtype, to_f64(x, dtype), weight)


def _qmv_norm(run: Run, kernel: str, m: int, n: int, k: int, x_scale: float = 1.0) -> None:
    """The normalised row is never rounded to the activation dtype (it only lives in registers): the reference keeps
    it in fp32 too."""
    dtype, out_dtype = dtype_of(kernel), out_dtype_of(kernel)
    weight, buffers = quantized_weight(kernel, (n, k), run.rng)
    x = to_device(x_scale * run.rng.standard_normal((m, k)), dtype)
    norm_weight = to_device(1.0 + 0.3 * run.rng.standard_normal(k), dtype)
    y = poisoned((m, n), out_dtype)
    args = struct.pack("<IIIf", k, n, m, NORM_EPS)  # lily::QMatmulNormArgs
    blocks = -(-n // QMV_ROWS_PER_THREADGROUP)
    run.dispatch(kernel, [args, x, norm_weight, *buffers, y], (blocks, m, 1), 64)
    normed = reference.rms_norm(to_f64(x, dtype), to_f64(norm_weight, dtype), NORM_EPS)
    check_matmul(run, y, out_dtype, normed, weight, relative_ulps=1.0)
    if "_staged_" in kernel:
        # It streams row blocks: fewer threadgroups than blocks (the lm_head's launch) give the same bits.
        streamed = poisoned((m, n), out_dtype)
        run.dispatch(kernel, [args, x, norm_weight, *buffers, streamed], (min(3, blocks), m, 1), 64)
        run.compare_exact("3 threadgroups streaming == one per block (bits)", streamed.view(np.uint8), y.view(np.uint8))


def argmax_order(values: np.ndarray) -> int:
    """The index argmax.h's order picks: the first NaN, else the first of the largest values."""
    nan = np.flatnonzero(np.isnan(values))
    return int(nan[0]) if nan.size else int(np.flatnonzero(values == values.max())[0])


def _qmv_norm_argmax(run: Run, kernel: str, m: int, n: int, k: int, groups: int, threads: int,
                     special: str = "") -> None:
    """The logits as qmv_norm_staged writes them (against the reference, and bit for bit against that kernel), each
    threadgroup's partial exactly the best of the rows it streamed (blocks x, x + groups, ...) in argmax order, and
    argmax_final over the partials the token of the logits. `special`: "ties" copies the best row to a lower row of
    another threadgroup and to a higher one (the lowest id must win), "nan" gives two rows a NaN scale (NaN wins,
    the lower one)."""
    dtype, out_dtype = dtype_of(kernel), out_dtype_of(kernel)
    weight, _ = quantized_weight(kernel, (n, k), run.rng)
    x = to_device(run.rng.standard_normal((m, k)), dtype)
    norm_weight = to_device(1.0 + 0.3 * run.rng.standard_normal(k), dtype)
    rows_per_group = (threads // 32) * QMV_STAGED_ROWS_PER_SIMDGROUP
    assert -(-n // rows_per_group) >= groups, "the host launches at most one threadgroup per row block"
    owner = (np.arange(n) // rows_per_group) % groups  # the threadgroup that streams each row
    if special:
        normed = reference.rms_norm(to_f64(x, dtype), to_f64(norm_weight, dtype), NORM_EPS)
        best = int(np.argmax(reference.qmatmul(normed[:1].astype(np.float32), weight)[0]))
        others = [r for r in range(n) if owner[r] != owner[best]]
        picks = [min(others), max(others)] if special == "ties" else sorted(run.rng.choice(n, 2, replace=False))
        if special == "ties":
            codes, scales, biases = weight.weight.copy(), weight.scales.copy(), weight.biases.copy()
            for r in picks:
                codes[r], scales[r], biases[r] = codes[best], scales[best], biases[best]
            weight = QuantizedTensor(codes, scales, biases, weight.bits, weight.group_size, weight.dtype)
    buffers = weight_buffers(weight, scale_dtype_of(kernel))
    if special == "nan":
        buffers[1][picks, 0] = to_device(np.full(2, np.nan), scale_dtype_of(kernel))
    args = struct.pack("<IIIf", k, n, m, NORM_EPS)  # lily::QMatmulNormArgs
    y = poisoned((m, n), out_dtype)
    values, ids = np.full(m * groups, np.nan, np.float32), np.full(m * groups, 0xFFFFFFFF, np.uint32)
    run.dispatch(kernel, [args, x, norm_weight, *buffers, y, values, ids], (groups, m, 1), threads)
    if not special:
        normed = reference.rms_norm(to_f64(x, dtype), to_f64(norm_weight, dtype), NORM_EPS)
        check_matmul(run, y, out_dtype, normed, weight, relative_ulps=1.0)
    twin = poisoned((m, n), out_dtype)
    run.dispatch(kernel.replace("_argmax", ""), [args, x, norm_weight, *buffers, twin], (groups, m, 1), threads)
    run.compare_exact("logits == qmv_norm_staged's (bits)", y.view(np.uint8), twin.view(np.uint8))
    logits = to_f64(y, out_dtype)
    expected = [int(np.flatnonzero(owner == g)[argmax_order(row[owner == g])]) for row in logits for g in range(groups)]
    run.compare_exact("partial ids", ids, expected)
    expected_values = np.array([logits[i // groups, r] for i, r in enumerate(expected)], np.float32)
    run.compare_exact("partial values (bits)", values.view(np.uint32), expected_values.view(np.uint32))
    if m == 1:
        tokens = np.full(2, 0xFFFFFFFF, np.uint32)
        final_args = struct.pack("<IIII", n, rows_per_group, groups, 0)  # lily::ArgmaxArgs
        run.dispatch("argmax_final_f32", [final_args, values, ids, tokens], 1, 64)
        run.compare_exact("argmax_final over the partials", tokens[:1], [argmax_order(logits[0])])
        if special == "ties":
            run.require("the tie is for the maximum", logits[0, picks[0]] == logits[0].max(), f"rows {picks}, {best}")


def _qmv_residual(run: Run, kernel: str, m: int, n: int, k: int, slots: int = 0) -> None:
    """out = residual + W·x rounded once; written to a separate buffer and in place over the residual (the engine's
    use), with the same bits. `slots`: the staged kernel's split steps, threads (128, slots) (0: 64 threads, 1-D)."""
    dtype = dtype_of(kernel)
    weight, buffers = quantized_weight(kernel, (n, k), run.rng)
    x = to_device(run.rng.standard_normal((m, k)), dtype)
    residual = to_device(2.0 * run.rng.standard_normal((m, n)), dtype)
    if slots:
        grid, threads = (-(-n // (4 * QMV_STAGED_ROWS_PER_SIMDGROUP)), m, 1), (128, slots, 1)
    else:
        grid, threads = (-(-n // QMV_ROWS_PER_THREADGROUP), m, 1), 64
    separate = poisoned((m, n), dtype)
    run.dispatch(kernel, [qmatmul_args(k, n, m), x, *buffers, residual, separate], grid, threads)
    check_matmul(run, separate, dtype, to_f64(x, dtype), weight, add=to_f64(residual, dtype))
    in_place = residual.copy()
    run.dispatch(kernel, [qmatmul_args(k, n, m), x, *buffers, in_place, in_place], grid, threads)
    run.compare_exact("in place == separate (bits)", in_place.view(np.uint8), separate.view(np.uint8))


def _concatenated(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """The matrices stacked along output rows: what the segmented GEMV must compute, as one reference weight."""
    return QuantizedTensor(np.concatenate([p.weight for p in parts]), np.concatenate([p.scales for p in parts]),
                           np.concatenate([p.biases for p in parts]), parts[0].bits, parts[0].group_size,
                           dtype=parts[0].dtype)


def _segment_bindings(parts: list) -> list:
    """The 4 segments' weight buffers of (QuantizedTensor, buffers) parts; unused segments bind the first matrix
    again, as the host does (the kernel must not read them)."""
    return [b for s in range(MAX_SEGMENTS) for b in parts[s if s < len(parts) else 0][1]]


def _qmv_segments(run: Run, kernel: str, rows: list[int], k: int, m: int, slots: int = 1) -> None:
    """Up to 4 matrices sharing x, each in its own buffers, against one GEMV over their concatenation. `slots`: the
    staged kernel's split steps, threads (64, slots) (SPLIT_STEPS)."""
    dtype, out_dtype = dtype_of(kernel), out_dtype_of(kernel)
    parts = [quantized_weight(kernel, (n, k), run.rng) for n in rows]
    x = to_device(run.rng.standard_normal((m, k)), dtype)
    norm_weight = to_device(1.0 + 0.3 * run.rng.standard_normal(k), dtype)
    bindings = _segment_bindings(parts)
    y = poisoned((m, sum(rows)), out_dtype)
    padded = list(rows) + [0] * (MAX_SEGMENTS - len(rows))
    args = struct.pack("<IIIf4I", k, sum(rows), len(rows), NORM_EPS, *padded)  # lily::QMatmulSegmentsArgs
    grid = (sum(-(-n // QMV_ROWS_PER_THREADGROUP) for n in rows), m, 1)
    threads = (64, slots, 1)
    run.dispatch(kernel, [args, x, norm_weight, *bindings, y], grid, threads)
    x_in = to_f64(x, dtype)
    norm = kernel.startswith("qmv_norm")
    if norm:
        x_in = reference.rms_norm(x_in, to_f64(norm_weight, dtype), NORM_EPS).astype(np.float64)
    check_matmul(run, y, out_dtype, x_in, _concatenated([qt for qt, _ in parts]), relative_ulps=1.0 if norm else 0.0)
    if "_staged_" in kernel:
        # It streams blocks across segments: 2 threadgroups (the first segment's blocks and the next ones
        # interleaved) give the bits of one per block.
        streamed = poisoned((m, sum(rows)), out_dtype)
        run.dispatch(kernel, [args, x, norm_weight, *bindings, streamed], (min(2, grid[0]), m, 1), threads)
        run.compare_exact("2 threadgroups streaming == one per block (bits)", streamed.view(np.uint8), y.view(np.uint8))


# The spread DeltaNet step's GEMVs (tuning::spread_deltanet_step). Conv epilogue: (Hk, Hv, dv, K) of a DeltaNet
# layer at Dk = 64, its in_proj segments [C = 2 Hk 64 + Hv dv | z | b | a]; the first is the self-test's; a channel
# count that leaves a partial simdgroup (dv = 33), K from one group to the staging's limit. Gated norm: (heads,
# head_dim, N): the model's 32 x 128 heads (K = 4096: two steps), partial threadgroups, N = 1, a head_dim that is not
# a multiple of 32, 17 x 128 (a partial second step).
CONV_LAYERS = [(1, 2, 32, 512), (2, 4, 64, 2048), (1, 1, 33, 64), (1, 2, 16, 4096)]
GATED_NORM_SHAPES = [(2, 128, 40), (32, 128, 20), (3, 64, 13), (1, 64, 1), (2, 96, 17), (17, 128, 9)]
# The split-step GEMVs (SPLIT_STEPS: threads (128, S), row y of simdgroups taking steps y, y + S, ... of 2,048 codes):
# (M, N, K, S) for the residual GEMV and (heads, head_dim, N, S) for the gated-norm one. One slot at two steps (the
# plain path at the engine's width), the engine's two at K = 4096, a partial second step (2112; 17 x 128), slots that
# get no step (K = 1024 on 2; 3 and 4 slots: at 4 bits K <= LILY_QMV_STAGE_MAX_K = 4096 is two steps at most), N
# leaving whole simdgroups without rows (9: the fourth; 37: the last threadgroup's third and fourth), two input rows.
RESIDUAL_SLOT_SHAPES = [(1, 9, 4096, 1), (1, 37, 4096, 2), (2, 9, 2112, 2), (1, 20, 1024, 2), (1, 37, 4096, 3),
                        (2, 9, 4096, 4)]
GATED_NORM_SLOT_SHAPES = [(32, 128, 9, 1), (32, 128, 37, 2), (17, 128, 9, 2), (4, 128, 20, 2), (32, 128, 37, 3),
                          (32, 128, 9, 4)]


def _qmv_seg_conv(run: Run, kernel: str, hk: int, hv: int, dv: int, k: int) -> None:
    """qmv_norm_seg_conv_staged against the reference (the projections, then the causal conv + SiLU of segment 0),
    and bit for bit against what it replaces: qmv_norm_seg_staged, gated_delta_conv and gated_delta_conv_state."""
    from lily.kernel_cases.gated_delta import make_layer, run_conv

    dtype = dtype_of(kernel)
    layer = make_layer(run.rng, hk, hv, dv, dtype, dk=64)  # its conv weight and conv state
    c = layer.channels
    rows = [c, hv * dv, hv, hv]
    parts = [quantized_weight(kernel, (n, k), run.rng) for n in rows]
    x = to_device(run.rng.standard_normal((1, k)), dtype)
    norm_weight = to_device(1.0 + 0.3 * run.rng.standard_normal(k), dtype)
    conv_weight, state_before = layer.conv_weight, layer.conv_state.copy()
    args = struct.pack("<IIIf4I", k, sum(rows), len(rows), NORM_EPS, *rows)  # lily::QMatmulSegmentsArgs
    grid = (sum(-(-n // QMV_ROWS_PER_THREADGROUP) for n in rows), 1, 1)
    y, conv_state, conv_out = poisoned((1, sum(rows)), dtype), state_before.copy(), poisoned((c,), "f32")
    gate = poisoned((rows[1],), "f32")
    run.dispatch(kernel, [args, x, norm_weight, *_segment_bindings(parts), y, conv_weight, conv_state, conv_out,
                          gate], grid, 64)

    normed = reference.rms_norm(to_f64(x, dtype), to_f64(norm_weight, dtype), NORM_EPS).astype(np.float64)
    newest = np.ascontiguousarray(conv_state[-1:])  # segment 0's outputs, rounded: the state's newest row
    check_matmul(run, newest, dtype, normed, parts[0][0], relative_ulps=1.0)
    check_matmul(run, np.ascontiguousarray(y[:, c:]), dtype, normed, _concatenated([qt for qt, _ in parts[1:]]),
                 relative_ulps=1.0)
    run.require("segment 0 writes nothing to y",
                np.array_equal(y[:, :c].view(np.uint8), poisoned((1, c), dtype).view(np.uint8)))
    run.compare_exact("conv state shifted", conv_state[:-1].view(np.uint8), state_before[1:].view(np.uint8))
    history = np.concatenate([to_f64(state_before, dtype), to_f64(newest, dtype)])  # [taps, C], oldest first
    pre = np.sum(to_f64(conv_weight, dtype).T * history, axis=0)
    run.compare("conv out", conv_out.astype(np.float64), pre / (1.0 + np.exp(-pre)), "f32")
    z = to_f64(y[:, c:c + rows[1]], dtype)[0]
    run.compare("gate = SiLU(z)", gate.astype(np.float64), z / (1.0 + np.exp(-z)), "f32")

    # The unspread path on the same inputs (layer still holds the state before).
    y2 = poisoned((1, sum(rows)), dtype)
    run.dispatch(f"qmv_norm_seg_staged_q4_g64_{dtype}", [args, x, norm_weight, *_segment_bindings(parts), y2], grid,
                 64)
    out2 = run_conv(run, layer, np.ascontiguousarray(y2[:, :c]))
    run.compare_exact("== the unspread conv (bits)", conv_out.view(np.uint8), out2[0].view(np.uint8))
    run.compare_exact("== the unspread conv state (bits)", conv_state.view(np.uint8), layer.conv_state.view(np.uint8))
    run.compare_exact("== the unspread z|b|a (bits)", y[:, c:].view(np.uint8), y2[:, c:].view(np.uint8))

    # It streams blocks across segments: 3 threadgroups from the same state give the same bits.
    y3, state3, out3 = poisoned((1, sum(rows)), dtype), state_before.copy(), poisoned((c,), "f32")
    gate3 = poisoned((rows[1],), "f32")
    run.dispatch(kernel, [args, x, norm_weight, *_segment_bindings(parts), y3, conv_weight, state3, out3, gate3],
                 (min(3, grid[0]), 1, 1), 64)
    for what, streamed, whole in (("conv out", out3, conv_out), ("conv state", state3, conv_state),
                                  ("z|b|a", y3[:, c:], y[:, c:]), ("gate", gate3, gate)):
        run.compare_exact(f"3 threadgroups streaming == one per block: {what} (bits)",
                          np.ascontiguousarray(streamed).view(np.uint8), np.ascontiguousarray(whole).view(np.uint8))


def _qmv_gated_norm_residual(run: Run, kernel: str, heads: int, head_dim: int, n: int, slots: int = 1) -> None:
    """qmv_gated_norm_residual_staged against the reference: out = residual + W · x with x the gated RMSNorm of o per
    head (gate = SiLU(z), f32, as qmv_norm_seg_conv_staged writes it) rounded once to the dtype. The kernel rounds x
    from fp32, the reference from fp64, so an element may land one ulp of the dtype apart: the allowance adds that
    ulp of every x times its weight (the engine's switch test checks the bits against the unspread step). `slots`:
    rows of simdgroups splitting the steps (SPLIT_STEPS)."""
    dtype = dtype_of(kernel)
    k = heads * head_dim
    weight, buffers = quantized_weight(kernel, (n, k), run.rng)
    o = (run.rng.standard_normal(k) * run.rng.uniform(0.1, 10.0, heads).repeat(head_dim)).astype(np.float32)
    gate = (2.0 * run.rng.standard_normal(k)).astype(np.float32)
    norm_weight = to_device(1.0 + 0.2 * run.rng.standard_normal(head_dim), dtype)
    residual = to_device(2.0 * run.rng.standard_normal((1, n)), dtype)
    out = poisoned((1, n), dtype)
    # Threads: 4-row simdgroups; enough for one staging round (K <= 32 per thread: LILY_QMV_STAGE_BATCH chunks).
    simdgroups = max(2, -(-k // (32 * 32)))
    run.dispatch(kernel, [struct.pack("<IIIf", k, n, head_dim, NORM_EPS), o, gate, norm_weight, *buffers, residual,
                          out], (-(-n // (4 * simdgroups)), 1, 1), (32 * simdgroups, slots, 1))
    in_place = residual.copy()  # the engine's use
    run.dispatch(kernel, [struct.pack("<IIIf", k, n, head_dim, NORM_EPS), o, gate, norm_weight, *buffers, in_place,
                          in_place], (-(-n // (4 * simdgroups)), 1, 1), (32 * simdgroups, slots, 1))
    run.compare_exact("in place == separate (bits)", in_place.view(np.uint8), out.view(np.uint8))
    heads_o = o.astype(np.float64).reshape(heads, head_dim)
    inv_rms = 1.0 / np.sqrt(np.mean(heads_o**2, axis=1, keepdims=True) + NORM_EPS)
    x = (heads_o * inv_rms * to_f64(norm_weight, dtype) * gate.astype(np.float64).reshape(heads, head_dim))
    x = round_to(x.reshape(1, k), dtype)
    expected = reference.qmatmul(x.astype(np.float32), weight).astype(np.float64) + to_f64(residual, dtype)
    magnitude = accumulation_magnitude(x, weight)
    x_ulp = {"f32": 2.0**-21, "bf16": 2.0**-7}[dtype]  # a few fp32 roundings; one bf16 ulp
    allowance = (np.sqrt(k) * 2.0**-24 + x_ulp) * magnitude
    run.compare("y", to_f64(out, dtype), round_to(expected, dtype), dtype, allowance)


def _shape_cases(kernel: str, body, shapes) -> list[Case]:
    return [Case(kernel, f"M={m} N={n} K={k}", partial(body, kernel=kernel, m=m, n=n, k=k), quick=i == 0)
            for i, (m, n, k) in enumerate(shapes)]


def cases(kernel: str) -> list[Case]:
    """Every case of one qmatmul kernel; the first is the self-test's. A staged kernel's _a16 instance (a pack of
    codes as one 16-byte load) takes the cases of its word-load twin."""
    extra = EXTRA_SHAPES.get(kernel.removesuffix("_a16"), [])
    if kernel.startswith("qmv_norm_seg_conv"):
        return [Case(kernel, f"Hk={hk} Hv={hv} dv={dv} K={k}", partial(_qmv_seg_conv, kernel=kernel, hk=hk, hv=hv,
                                                                       dv=dv, k=k), quick=i == 0)
                for i, (hk, hv, dv, k) in enumerate(CONV_LAYERS)]
    if kernel.startswith("qmv_norm_argmax"):
        found = [Case(kernel, f"M={m} N={n} K={k} groups={g} threads={t}",
                      partial(_qmv_norm_argmax, kernel=kernel, m=m, n=n, k=k, groups=g, threads=t), quick=i == 0)
                 for i, (m, n, k, g, t) in enumerate(ARGMAX_SHAPES)]
        return found + [Case(kernel, f"M=1 N=50 K=128 groups=3 {special}",
                             partial(_qmv_norm_argmax, kernel=kernel, m=1, n=50, k=128, groups=3, threads=64,
                                     special=special)) for special in ("ties", "nan")]
    if kernel.startswith("qmv_gated_norm"):
        found = [Case(kernel, f"heads={h} head_dim={d} N={n}",
                      partial(_qmv_gated_norm_residual, kernel=kernel, heads=h, head_dim=d, n=n), quick=i == 0)
                 for i, (h, d, n) in enumerate(GATED_NORM_SHAPES)]
        return found + [Case(kernel, f"heads={h} head_dim={d} N={n} slots={s}",
                             partial(_qmv_gated_norm_residual, kernel=kernel, heads=h, head_dim=d, n=n, slots=s))
                        for h, d, n, s in GATED_NORM_SLOT_SHAPES]
    if "_seg_" in kernel:
        layouts = SEGMENTS + EXTRA_SEGMENTS.get(kernel.removesuffix("_a16"), [])
        found = [Case(kernel, f"rows={'/'.join(map(str, rows))} K={k} M={m}",
                      partial(_qmv_segments, kernel=kernel, rows=rows, k=k, m=m), quick=i == 0)
                 for i, (rows, k, m) in enumerate(layouts)]
        if kernel.startswith("qmv_norm_seg_staged"):
            shapes = SEGMENT_SLOT_SHAPES_Q8 if "_q8_" in kernel else SEGMENT_SLOT_SHAPES_Q4
            found += [Case(kernel, f"rows={'/'.join(map(str, rows))} K={k} M={m} slots=2",
                           partial(_qmv_segments, kernel=kernel, rows=rows, k=k, m=m, slots=2))
                      for rows, k, m in shapes]
        return found
    if kernel.startswith("qmv_norm"):
        found = _shape_cases(kernel, _qmv_norm, FUSED_SHAPES + extra)
        if kernel == "qmv_norm_q4_g64_f32":  # tiny rows (eps matters) and large ones (the norm undoes the scale)
            found += [Case(kernel, f"M=1 N=20 K=2048 x_scale={s:g}",
                           partial(_qmv_norm, kernel=kernel, m=1, n=20, k=2048, x_scale=s)) for s in (1e-4, 30.0)]
        return found
    if kernel.startswith("qmv_residual"):
        found = _shape_cases(kernel, _qmv_residual, FUSED_SHAPES + extra)
        if "_staged" in kernel:
            found += [Case(kernel, f"M={m} N={n} K={k} slots={s}",
                           partial(_qmv_residual, kernel=kernel, m=m, n=n, k=k, slots=s))
                      for m, n, k, s in RESIDUAL_SLOT_SHAPES]
        return found
    if kernel.startswith("qmv_mma"):
        # The engine's simdgroup counts at every shape; 1 and 5 (any count up to 8 works) at a few.
        found = [Case(kernel, f"M={m} N={n} K={k} simdgroups={g}",
                      partial(_qmv_mma, kernel=kernel, m=m, n=n, k=k, simdgroups=g), quick=i == 0 and g == 8)
                 for g in QMV_MMA_SIMDGROUPS for i, (m, n, k) in enumerate(QMV_MMA_SHAPES)]
        found += [Case(kernel, f"M={m} N={n} K={k} simdgroups={g}",
                       partial(_qmv_mma, kernel=kernel, m=m, n=n, k=k, simdgroups=g))
                  for g in (1, 5) for (m, n, k) in ((3, 21, 1088), (8, 33, 2112))]
        return found + [Case(kernel, f"M=2 N=4 K=128 extreme-codes simdgroups={g}",
                             lambda run, kernel=kernel, g=g: _qmv_mma(run, kernel, 2, 4, 128, g,
                                                                        _extreme_codes_weight(run.rng, 4, 128)))
                        for g in QMV_MMA_SIMDGROUPS]
    if kernel.startswith("qmv"):
        found = _shape_cases(kernel, _qmv, (FUSED_SHAPES if kernel.endswith("_of32") else QMV_SHAPES) + extra)
        if kernel == "qmv_q4_g64_f32":
            found.append(Case(kernel, "M=1 N=4 K=128 extreme-codes", partial(_qmv_extreme_codes, kernel=kernel)))
        return found
    bm, bn = (NAX_BM, NAX_BN) if "_nax_" in kernel else (int(kernel[-2:]), QMM_BN)
    quick = [(bm + 3, bn + 5, 256)]  # partial tiles in M and N
    return _shape_cases(kernel, _qmm, quick + (NAX_SHAPES if "_nax_" in kernel else QMM_SHAPES) + extra)
