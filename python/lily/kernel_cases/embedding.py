"""Cases of metal/embedding.metal against ``lily.reference.embedding`` on the quantized table.

The token ids come from a device buffer at an offset (decode reads the slot the sampler wrote); prefill gathers T
rows, repeated ids and the first and last vocabulary rows included; hidden sizes of one to 32 groups; any thread
count (fewer threads than words, a partial simdgroup, more threads than words); an out-of-range id gives a NaN row
and leaves the others alone.
"""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import Case, Run, dtype_of, poisoned, quantized_weight, round_to, to_f64

PATTERN = re.compile(r"embedding_gather_q(4|8)_g64_(f32|f16|bf16)(_sf32)?")
THREADS = 256  # LILY_EMBEDDING_THREADS


def embedding_args(hidden: int, vocab: int, ids_offset: int) -> bytes:
    """lily::EmbeddingArgs (metal/lily.h): u32 hidden_size, vocab_size, ids_offset, one u32 of padding."""
    return struct.pack("<IIII", hidden, vocab, ids_offset, 0)


def _gather(run: Run, kernel: str, vocab: int, hidden: int, ids: np.ndarray, offset: int, count: int,
            threads: int = THREADS) -> None:
    dtype = dtype_of(kernel)
    table, buffers = quantized_weight(kernel, (vocab, hidden), run.rng)
    ids = np.ascontiguousarray(ids, np.uint32)
    out = poisoned((count, hidden), dtype)
    run.dispatch(kernel, [embedding_args(hidden, vocab, offset), ids, *buffers, out], count, threads)
    chosen = ids[offset : offset + count].astype(np.int64)
    valid = chosen < vocab
    expected = np.full((count, hidden), np.nan)  # a corrupt id (>= vocab) must give a NaN row, not read outside
    expected[valid] = round_to(reference.embedding(chosen[valid], table), dtype)
    run.compare("rows", to_f64(out, dtype), expected, dtype)


def _prefill(run: Run, kernel: str, hidden: int) -> None:
    """T tokens from an ids buffer: first and last vocabulary rows, a repeated id, random ids."""
    vocab = 37
    ids = np.array([0, vocab - 1, 5, 5, *run.rng.integers(0, vocab, 3)])
    _gather(run, kernel, vocab, hidden, ids, 0, len(ids))


def _decode(run: Run, kernel: str, slot: int) -> None:
    """One row, its id read from the slot the previous step's sampler wrote."""
    _gather(run, kernel, 300, 256, run.rng.integers(0, 300, 8), slot, 1)


def cases(kernel: str) -> list[Case]:
    """Every case of one embedding kernel; the first is the self-test's."""
    found = [Case(kernel, "V=50 H=256 T=4 ids_offset=1",
                  partial(_gather, kernel=kernel, vocab=50, hidden=256, ids=np.array([0, 7, 7, 3, 49]), offset=1,
                          count=4), quick=True)]
    found += [Case(kernel, f"V=37 H={hidden} T=7", partial(_prefill, kernel=kernel, hidden=hidden))
              for hidden in (64, 192, 2048)]
    if kernel == "embedding_gather_q4_g64_bf16":
        found += [Case(kernel, f"V=300 H=256 slot={slot}", partial(_decode, kernel=kernel, slot=slot))
                  for slot in (0, 3, 7)]
    if kernel == "embedding_gather_q8_g64_f32":
        found += [Case(kernel, f"V=10 H=320 threads={t}", partial(_gather, kernel=kernel, vocab=10, hidden=320,
                                                                  ids=np.array([9, 0, 4]), offset=0, count=3,
                                                                  threads=t)) for t in (1, 31, 32, 33, 1024)]
    if kernel == "embedding_gather_q4_g64_f32_sf32":
        found.append(Case(kernel, "V=16 H=128 out-of-range-ids", partial(
            _gather, kernel=kernel, vocab=16, hidden=128, ids=np.array([3, 16, 0xFFFFFFFF, 15]), offset=0, count=4)))
    return found
