"""Shared pieces of the MoE kernel tests (test_moe.py: decode, test_moe_prefill.py: prefill).

Weights are MLX affine 4-bit, group 64, bf16 (or f32) scales and biases (``lily.quant.QuantizedTensor``), in the
stacked switch_mlp layout; the references run on their exact fp32 dequantisation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from lily import quant
from lily.quant import QuantizedTensor

# fp32 sums of K products differ from the fp64 reference by a few ulp of the output's typical size, not of each
# element: an element that cancels to near zero keeps the absolute error of its terms. The element-wise bound adds
# this fraction of the output's RMS to the fp32 table's rtol (32 ulp of the RMS at 2^-23).
F32_DOT_RMS_FRACTION = 4e-6


def moe_args(
    num_rows: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    expert: int,
    shared: int = 0,
    tile_rows: int = 0,
    max_tiles: int = 0,
) -> bytes:
    """lily::MoeArgs (metal/lily.h): eight u32 fields."""
    return struct.pack("<8I", num_rows, num_experts, top_k, hidden, expert, shared, tile_rows, max_tiles)


@dataclass
class QWeight:
    """One quantized weight: device buffers (uint32 codes; scales and biases as bf16 bits or f32) and its tensor."""

    tensor: QuantizedTensor
    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray

    def buffers(self) -> list[np.ndarray]:
        return [self.codes, self.scales, self.biases]

    @cached_property
    def dense(self) -> np.ndarray:
        """The exact fp32 dequantisation scale·q + bias, [..., out, in]."""
        return self.tensor.dequantize()


def quantized_weight(rng: np.random.Generator, shape: tuple[int, ...], kio, scales: str = "bf16") -> QWeight:
    """A random 4-bit weight [..., out, in]: uniform codes, `scales` ("bf16" or "f32") scales and biases, W·x of
    about unit variance for unit x.

    Drawn directly in the quantized layout (every code value 0..15 occurs), which is all the kernels see and is much
    faster than quantizing a float weight.
    """
    out_in = shape[-1]
    groups = shape[:-1] + (out_in // 64,)
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    scale = rng.uniform(0.5, 1.5, groups) * (0.4 / np.sqrt(out_in))  # codes have variance 21.25: 0.4^2 x 21 ~ 1
    bias = -7.5 * scale * rng.uniform(0.8, 1.2, groups)  # near-symmetric weights, as quantized ones are
    scale, bias = kio.round(scale, scales).astype(np.float32), kio.round(bias, scales).astype(np.float32)
    tensor = QuantizedTensor(quant.pack(codes, 4), scale, bias, 4, 64, {"bf16": "bfloat16", "f32": "float32"}[scales])
    return QWeight(
        tensor=tensor,
        codes=np.ascontiguousarray(tensor.weight),
        scales=kio.to_device(scale, scales),
        biases=kio.to_device(bias, scales),
    )


def silu64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / (1.0 + np.exp(-x))


def sigmoid64(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def assert_close_dot(kio, actual: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
    """kio.assert_close, with the fp32 element-wise bound widened by F32_DOT_RMS_FRACTION·RMS for fp32 outputs."""
    if dtype != "f32":
        kio.assert_close(actual, expected, dtype, what)
        return
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN at {np.argwhere(np.isnan(actual))[:5].tolist()}"
    tol = kio.tolerances["f32"]
    rms = float(np.sqrt(np.mean(expected**2)))
    rel_rms = float(np.sqrt(np.mean((actual - expected) ** 2))) / rms
    assert rel_rms <= tol.rel_rms, f"{what}: relative RMS error {rel_rms:.3g} > {tol.rel_rms:g}"
    err = np.abs(actual - expected)
    limit = tol.atol + tol.rtol * np.abs(expected) + F32_DOT_RMS_FRACTION * rms
    worst = np.unravel_index(int(np.argmax(err - limit)), err.shape)
    assert (err <= limit).all(), (
        f"{what}: element {tuple(int(i) for i in worst)}: got {actual[worst]!r}, expected {expected[worst]!r}"
    )


def routing_for_counts(rng: np.random.Generator, counts: list[int], num_rows: int, top_k: int) -> np.ndarray:
    """Expert ids [T, k] (k distinct experts per row) in which expert e is chosen by exactly counts[e] rows.

    Greedy: each row takes the k experts with the most assignments left, which always succeeds while no count
    exceeds the rows left. Rows are shuffled afterwards so experts are spread over the chunk.
    """
    left = np.array(counts, dtype=np.int64)
    assert left.sum() == num_rows * top_k and left.max() <= num_rows, "counts must fill T·k with at most T per expert"
    ids = np.empty((num_rows, top_k), dtype=np.int64)
    for row in range(num_rows):
        order = np.lexsort((np.arange(len(left)), -left))[:top_k]
        assert (left[order] > 0).all(), "counts are not realisable"
        ids[row] = rng.permutation(order)
        left[order] -= 1
    return ids[rng.permutation(num_rows)]


def logits_for_routing(rng: np.random.Generator, ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Router logits [T, E] whose top-k are exactly `ids`, in that order, with clear gaps (no near-ties)."""
    num_rows, top_k = ids.shape
    logits = rng.uniform(-3.0, 1.0, (num_rows, num_experts))
    for row in range(num_rows):
        logits[row, ids[row]] = 2.0 + 0.5 * np.arange(top_k)[::-1] + rng.uniform(0.0, 0.2, top_k)
    return logits.astype(np.float32)
