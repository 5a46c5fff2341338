"""metal/embedding.metal: every case of lily.kernel_cases.embedding (ids from a buffer at an offset, prefill rows,
any thread count, out-of-range ids) against lily.reference.embedding, and the refusal of a wrong argument struct."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cases import check, checks_arguments, op_cases

from lily._ext import msl


@pytest.mark.parametrize("case", op_cases("embedding"))
def test_embedding(case, kernel_device) -> None:
    check(case, kernel_device)


@checks_arguments
def test_embedding_wrong_argument_struct() -> None:
    ids = np.zeros(1, np.uint32)
    w = np.zeros((1, 8), np.uint32)
    s = np.ones((1, 1), np.float32)
    out = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match=r"embedding_gather_q4_g64_f32_sf32.*buffer\(0\).*16 bytes.*got 12"):
        msl.dispatch("embedding_gather_q4_g64_f32_sf32", [struct.pack("<III", 64, 1, 0), ids, w, s, s, out],
                     (1, 1, 1), (64, 1, 1))
