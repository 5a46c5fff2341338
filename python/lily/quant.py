"""MLX affine quantization (mode "affine"): quantize, dequantize, packing, bf16 rounding.

Layout: groups of ``group_size`` consecutive elements along the last (input)
axis share a ``scale`` and a ``bias``; a value is ``scale * q + bias`` with ``q`` unsigned in
``[0, 2**bits - 1]``. Codes are packed little-endian into uint32 words, element 0 of a word in
its least significant bits. Scales and biases have the dtype of the source weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = ("float32", "bfloat16", "float16")

# Elements quantized per chunk, so that quantizing a large stacked expert tensor needs only a
# few chunk-sized temporaries rather than several full-size fp32 copies.
_CHUNK_ELEMENTS = 1 << 22


class QuantizationError(ValueError):
    """Unsupported quantization parameters or inconsistent quantized tensors."""


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 values stored as uint16 bit patterns to float32 (exact)."""
    widened = np.asarray(bits, dtype=np.uint16).astype(np.uint32)
    widened <<= 16  # in place: one temporary, not two
    return widened.view(np.float32)


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bf16 (round to nearest, ties to even) as uint16 bit patterns."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    # NaN must stay NaN: rounding could carry its mantissa into the exponent (→ inf).
    nan_bits = (bits >> 16) | np.uint32(0x0040)
    return np.where(np.isnan(x), nan_bits, rounded).astype(np.uint16)


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 ``x`` to ``dtype`` ("float32", "bfloat16", "float16"), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "bfloat16":
        return bfloat16_bits_to_float32(float32_to_bfloat16_bits(x))
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    raise _unsupported_dtype("scale", dtype)


def _unsupported_dtype(role: str, dtype: str) -> QuantizationError:
    return QuantizationError(f"unsupported {role} dtype {dtype!r}; expected one of {SCALE_DTYPES}")


def _check_params(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise QuantizationError(f"unsupported bits {bits!r}; expected one of {SUPPORTED_BITS}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise QuantizationError(f"unsupported group_size {group_size!r}; expected one of {SUPPORTED_GROUP_SIZES}")


@dataclass(frozen=True)
class QuantizedTensor:
    """An MLX affine-quantized weight.

    ``weight`` is uint32 ``[..., out, in * bits / 32]``; ``scales`` and ``biases`` are float32
    ``[..., out, in / group_size]`` holding exactly the values of their storage ``dtype``
    ("bfloat16" for mlx-community files).
    """

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    group_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_params(self.bits, self.group_size)
        if self.dtype not in SCALE_DTYPES:
            raise _unsupported_dtype("scale", self.dtype)
        if self.weight.dtype != np.uint32:
            raise QuantizationError(f"packed weight must be uint32, got {self.weight.dtype}")
        if self.weight.ndim < 2:
            raise QuantizationError(f"packed weight must have at least 2 dims, got shape {self.weight.shape}")
        expected = self.weight.shape[:-1] + (self.shape[-1] // self.group_size,)
        for name, arr in (("scales", self.scales), ("biases", self.biases)):
            if tuple(arr.shape) != expected:
                raise QuantizationError(
                    f"{name} shape {tuple(arr.shape)} does not match packed weight shape "
                    f"{tuple(self.weight.shape)} at {self.bits} bits, group {self.group_size} "
                    f"(expected {expected})"
                )

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``[..., out, in]`` of the dequantized weight."""
        return tuple(self.weight.shape[:-1]) + (self.weight.shape[-1] * 32 // self.bits,)

    @property
    def ndim(self) -> int:
        """Number of dimensions of the logical (and of the packed) weight."""
        return self.weight.ndim

    def codes(self) -> np.ndarray:
        """The unpacked codes ``q`` as uint8 ``[..., out, in]``."""
        return unpack(self.weight, self.bits)

    def dequantize(self, *, round_like_mlx: bool = False) -> np.ndarray:
        """The float32 weight ``scale * q + bias``; see :func:`dequantize`."""
        return dequantize(self, round_like_mlx=round_like_mlx)

    def __getitem__(self, index) -> "QuantizedTensor":
        """Slice along the leading (expert / row) axes, e.g. one expert of a stacked weight."""
        weight = self.weight[index]
        if weight.ndim < 2:
            raise QuantizationError("indexing a QuantizedTensor must keep the last two axes")
        return QuantizedTensor(weight, self.scales[index], self.biases[index], self.bits, self.group_size, self.dtype)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes ``[..., n]`` (n a multiple of 32/bits) into uint32 ``[..., n*bits/32]``."""
    per_word = 32 // bits
    codes = np.asarray(codes)
    if codes.shape[-1] % per_word:
        raise QuantizationError(f"last dim {codes.shape[-1]} is not a multiple of {per_word} at {bits} bits")
    grouped = codes.astype(np.uint32).reshape(codes.shape[:-1] + (codes.shape[-1] // per_word, per_word))
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint32)


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """Unpack uint32 words ``[..., m]`` into codes ``[..., m*32/bits]`` (uint8)."""
    per_word = 32 // bits
    words = np.asarray(words, dtype=np.uint32)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(words.shape[:-1] + (words.shape[-1] * per_word,)).astype(np.uint8)


def _quantize_groups(groups: np.ndarray, bits: int, dtype: str):
    """Quantize fp32 ``[n, group]`` rows exactly as MLX's affine quantizer does.

    The edge of larger magnitude (min or max) is made exactly representable: the scale is
    adjusted so that it maps to an integer code, and that edge becomes the bias. All the
    arithmetic is fp32, as in MLX; only the stored scale and bias are rounded to ``dtype``.
    """
    n_bins = np.float32((1 << bits) - 1)
    w_min = groups.min(axis=1)
    w_max = groups.max(axis=1)
    min_is_edge = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(min_is_edge, scale, -scale)
    edge = np.where(min_is_edge, w_min, w_max)
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(nonzero, edge / np.where(nonzero, q0, np.float32(1)), scale).astype(np.float32)
    bias = np.where(nonzero, edge, np.float32(0)).astype(np.float32)
    codes = np.rint((groups - bias[:, None]) / scale[:, None])
    codes = np.clip(codes, 0, n_bins).astype(np.uint8)
    return codes, round_to_dtype(scale, dtype), round_to_dtype(bias, dtype)


def quantize(w: np.ndarray, bits: int = 4, group_size: int = 64, *, dtype: str | None = None) -> QuantizedTensor:
    """Quantize ``w`` (``[..., out, in]``) bit-identically to ``mx.quantize(w, group_size, bits)``.

    ``dtype`` is the source dtype, which is also the dtype of the resulting scales and biases;
    it defaults to ``w``'s own dtype. Pass ``dtype="bfloat16"`` for a bf16 weight held in float32
    (numpy has no bf16); the values of ``w`` are then rounded to bf16 first.
    """
    _check_params(bits, group_size)
    w = np.asarray(w)
    if dtype is None:
        dtype = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(w.dtype)
        if dtype is None:
            raise QuantizationError(f"cannot quantize an array of dtype {w.dtype}; pass dtype=")
    if dtype not in SCALE_DTYPES:
        raise _unsupported_dtype("source", dtype)
    if w.ndim < 2:
        raise QuantizationError(f"quantize needs at least 2 dims [..., out, in], got shape {w.shape}")
    if w.shape[-1] % group_size:
        raise QuantizationError(f"last dim {w.shape[-1]} is not a multiple of group_size {group_size}")

    n_in = w.shape[-1]
    rows = w.reshape(-1, n_in)
    packed = np.empty((rows.shape[0], n_in * bits // 32), dtype=np.uint32)
    scales = np.empty((rows.shape[0], n_in // group_size), dtype=np.float32)
    biases = np.empty_like(scales)
    step = max(1, _CHUNK_ELEMENTS // n_in)
    for start in range(0, rows.shape[0], step):
        chunk = round_to_dtype(np.asarray(rows[start : start + step], dtype=np.float32), dtype)
        codes, s, b = _quantize_groups(chunk.reshape(-1, group_size), bits, dtype)
        stop = start + chunk.shape[0]
        packed[start:stop] = pack(codes.reshape(chunk.shape), bits)
        scales[start:stop] = s.reshape(chunk.shape[0], -1)
        biases[start:stop] = b.reshape(chunk.shape[0], -1)
    lead = w.shape[:-1]
    return QuantizedTensor(
        packed.reshape(lead + (packed.shape[-1],)),
        scales.reshape(lead + (scales.shape[-1],)),
        biases.reshape(lead + (biases.shape[-1],)),
        bits,
        group_size,
        dtype,
    )


def dequantize(qt: QuantizedTensor, *, round_like_mlx: bool = False) -> np.ndarray:
    """The float32 weight ``scale * q + bias`` of ``qt``, shape ``qt.shape``.

    By default the result is exact fp32 (what the fp32-accumulating matmul kernels use). With
    ``round_like_mlx`` it reproduces ``mx.dequantize``, which computes in the scale dtype and so
    rounds twice: ``round(round(scale * q) + bias)``.
    """
    codes = qt.codes().astype(np.float32)
    grouped = codes.reshape(codes.shape[:-1] + (-1, qt.group_size))
    scales = np.asarray(qt.scales, dtype=np.float32)[..., None]
    biases = np.asarray(qt.biases, dtype=np.float32)[..., None]
    if round_like_mlx:
        out = round_to_dtype(round_to_dtype(grouped * scales, qt.dtype) + biases, qt.dtype)
    else:
        out = grouped * scales + biases
    return out.reshape(qt.shape)
