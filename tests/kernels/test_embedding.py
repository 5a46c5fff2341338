"""metal/embedding.metal through the CPU harness, against lily.reference.embedding on the quantized table.

The token ids come from a device buffer at an offset (decode reads the slot the sampler wrote); prefill gathers
T rows, repeated ids and the first and last vocabulary rows included. Outputs start NaN-poisoned.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from lily import reference
from lily._ext import msl
from lily.quant import QuantizedTensor, quantize

# (bits, activation dtype, scale dtype) -> host name
KERNELS = {
    (4, "f32", "bf16"): "embedding_gather_q4_g64_f32",
    (4, "bf16", "bf16"): "embedding_gather_q4_g64_bf16",
    (4, "f32", "f32"): "embedding_gather_q4_g64_f32_sf32",
    (4, "bf16", "f32"): "embedding_gather_q4_g64_bf16_sf32",
    (8, "f32", "bf16"): "embedding_gather_q8_g64_f32",
    (8, "bf16", "bf16"): "embedding_gather_q8_g64_bf16",
    (8, "f32", "f32"): "embedding_gather_q8_g64_f32_sf32",
    (8, "bf16", "f32"): "embedding_gather_q8_g64_bf16_sf32",
}
THREADS = 256  # LILY_EMBEDDING_THREADS
SCALE_DTYPE_NAMES = {"bf16": "bfloat16", "f32": "float32"}


def embedding_args(hidden: int, vocab: int, ids_offset: int) -> bytes:
    """lily::EmbeddingArgs (metal/lily.h): u32 hidden_size, vocab_size, ids_offset, one u32 of padding."""
    return struct.pack("<IIII", hidden, vocab, ids_offset, 0)


def random_table(rng: np.random.Generator, vocab: int, hidden: int, bits: int, scale_dtype: str) -> QuantizedTensor:
    table = rng.standard_normal((vocab, hidden)) * 0.05 + 0.01 * rng.standard_normal((vocab, 1))
    return quantize(table.astype(np.float32), bits, 64, dtype=SCALE_DTYPE_NAMES[scale_dtype])


def gather(name: str, ids: np.ndarray, offset: int, count: int, qt: QuantizedTensor, scale_dtype: str, dtype: str,
           kio, threads: int = THREADS) -> np.ndarray:
    vocab, hidden = qt.shape
    out = kio.poisoned((count, hidden), dtype)
    scales, biases = kio.to_device(qt.scales, scale_dtype), kio.to_device(qt.biases, scale_dtype)
    buffers = [np.ascontiguousarray(qt.weight), scales, biases]
    msl.dispatch(name, [embedding_args(hidden, vocab, offset), ids, *buffers, out], (count, 1, 1), (threads, 1, 1))
    return out


@pytest.mark.parametrize("hidden", [64, 192, 2048])
@pytest.mark.parametrize("key", list(KERNELS), ids=list(KERNELS.values()))
def test_embedding_prefill_rows(key, hidden: int, kio) -> None:
    """T tokens from an ids buffer: first and last vocabulary rows, a repeated id, random ids."""
    bits, dtype, scale_dtype = key
    rng = np.random.default_rng([bits, hidden, list(KERNELS).index(key)])
    vocab = 37
    qt = random_table(rng, vocab, hidden, bits, scale_dtype)
    ids = np.array([0, vocab - 1, 5, 5, *rng.integers(0, vocab, 3)], dtype=np.uint32)
    out = gather(KERNELS[key], ids, 0, len(ids), qt, scale_dtype, dtype, kio)
    expected = kio.round(reference.embedding(ids, qt), dtype)
    kio.assert_close(kio.to_f64(out, dtype), expected, dtype, f"{KERNELS[key]} H={hidden}")


@pytest.mark.parametrize("slot", [0, 3, 7])
def test_embedding_decode_reads_id_from_buffer_slot(slot: int, kio) -> None:
    """Decode: one row, its id read on the GPU from the slot the previous step's sampler wrote."""
    rng = np.random.default_rng(50 + slot)
    vocab, hidden = 300, 256
    qt = random_table(rng, vocab, hidden, 4, "bf16")
    ids = rng.integers(0, vocab, 8).astype(np.uint32)
    out = gather("embedding_gather_q4_g64_bf16", ids, slot, 1, qt, "bf16", "bf16", kio)
    expected = kio.round(reference.embedding(ids[slot : slot + 1], qt), "bf16")
    kio.assert_close(kio.to_f64(out, "bf16"), expected, "bf16", f"decode slot {slot}")


@pytest.mark.parametrize("threads", [1, 31, 32, 33, 1024])
def test_embedding_any_thread_count(threads: int, kio) -> None:
    """Fewer threads than words (strided loop), a partial simdgroup, more threads than words."""
    rng = np.random.default_rng(60 + threads)
    qt = random_table(rng, 10, 320, 8, "bf16")
    ids = np.array([9, 0, 4], dtype=np.uint32)
    out = gather("embedding_gather_q8_g64_f32", ids, 0, 3, qt, "bf16", "f32", kio, threads=threads)
    kio.assert_close(out, kio.round(reference.embedding(ids, qt), "f32"), "f32", f"{threads} threads")


def test_embedding_out_of_range_id_gives_nan_row(kio) -> None:
    """A corrupt id (>= vocab) must not read outside the table: its row is NaN, the other rows are unaffected."""
    rng = np.random.default_rng(70)
    vocab, hidden = 16, 128
    qt = random_table(rng, vocab, hidden, 4, "f32")
    ids = np.array([3, vocab, 0xFFFFFFFF, 15], dtype=np.uint32)
    out = gather("embedding_gather_q4_g64_f32_sf32", ids, 0, 4, qt, "f32", "f32", kio)
    assert np.isnan(out[1:3]).all(), "rows of out-of-range ids must be NaN"
    kio.assert_close(out[[0, 3]], reference.embedding(ids[[0, 3]], qt).astype(np.float64), "f32", "valid rows")


def test_embedding_wrong_argument_struct() -> None:
    ids = np.zeros(1, np.uint32)
    w = np.zeros((1, 8), np.uint32)
    s = np.ones((1, 1), np.float32)
    out = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match=r"embedding_gather_q4_g64_f32_sf32.*buffer\(0\).*16 bytes.*got 12"):
        msl.dispatch("embedding_gather_q4_g64_f32_sf32", [struct.pack("<III", 64, 1, 0), ids, w, s, s, out],
                     (1, 1, 1), (64, 1, 1))
