"""Cases of metal/rms_norm.metal against ``lily.reference.rms_norm``.

Row lengths cross the SIMD width (31/32/33 threads), a partial second simdgroup, more elements than threads (1025,
2048); 1 or 3 rows (decode and prefill); the residual sum written in place over the residual (the decode loop);
a zero row with eps read from the argument struct.
"""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import Case, Run, dtype_of, poisoned, round_to, to_device, to_f64

PATTERN = re.compile(r"rms_norm(_residual)?_(f32|f16|bf16)")
EPS = 1e-6
# (row_length, threads per threadgroup): one thread per element up to 64, then more elements than threads.
SHAPES = [(31, 31), (32, 32), (33, 33), (64, 64), (1025, 1024), (2048, 256)]


def rms_norm_args(row_length: int, eps: float = EPS) -> bytes:
    """lily::RmsNormArgs (metal/lily.h): u32 row_length, f32 eps, two u32 of padding."""
    return struct.pack("<IfII", row_length, eps, 0, 0)


def _inputs(run: Run, rows: int, n: int, dtype: str):
    x = to_device(3.0 * run.rng.standard_normal((rows, n)), dtype)
    weight = to_device(1.0 + 0.5 * run.rng.standard_normal(n), dtype)  # canonical 1 + w
    return x, weight


def _rms_norm(run: Run, kernel: str, rows: int, n: int, threads: int) -> None:
    dtype = dtype_of(kernel)
    x, weight = _inputs(run, rows, n, dtype)
    out = poisoned((rows, n), dtype)
    run.dispatch(kernel, [rms_norm_args(n), x, weight, out], rows, threads)
    expected = reference.rms_norm(to_f64(x, dtype), to_f64(weight, dtype), EPS)
    run.compare("out", to_f64(out, dtype), round_to(expected, dtype), dtype)


def _rms_norm_residual(run: Run, kernel: str, rows: int, n: int, threads: int, in_place: bool = False) -> None:
    """The residual stream is stored in the activation dtype: the sum is rounded once, then normalised. In place, the
    sum overwrites the residual (the decode loop's aliasing)."""
    dtype = dtype_of(kernel)
    x, weight = _inputs(run, rows, n, dtype)
    residual = to_device(3.0 * run.rng.standard_normal((rows, n)), dtype)
    h = round_to(to_f64(x, dtype) + to_f64(residual, dtype), dtype)
    out = poisoned((rows, n), dtype)
    summed = residual if in_place else poisoned((rows, n), dtype)
    run.dispatch(kernel, [rms_norm_args(n), x, residual, weight, out, summed], rows, threads)
    run.compare_exact("sum (one rounding of x + residual)", to_device(to_f64(summed, dtype), "f32").view(np.uint32),
                      to_device(h, "f32").view(np.uint32))
    expected = reference.rms_norm(h, to_f64(weight, dtype), EPS)
    run.compare("out", to_f64(out, dtype), round_to(expected, dtype), dtype)


def _zero_row_and_eps(run: Run, kernel: str) -> None:
    """A zero row normalises to zeros (eps keeps it finite); eps is read from the argument struct."""
    n, eps = 48, 1e-4
    x = np.zeros((2, n), np.float32)
    x[1] = 1e-3
    weight = np.ones(n, np.float32)
    out = poisoned((2, n), "f32")
    run.dispatch(kernel, [rms_norm_args(n, eps), x, weight, out], 2, 32)
    run.compare("out", out, reference.rms_norm(x, weight, eps), "f32")


def cases(kernel: str) -> list[Case]:
    """Every case of one rms_norm kernel; the first is the self-test's."""
    body = _rms_norm_residual if kernel.startswith("rms_norm_residual") else _rms_norm
    found = [Case(kernel, "rows=2 n=1000 threads=256", partial(body, kernel=kernel, rows=2, n=1000, threads=256),
                  quick=True)]
    found += [Case(kernel, f"rows={rows} n={n} threads={threads}",
                   partial(body, kernel=kernel, rows=rows, n=n, threads=threads))
              for n, threads in SHAPES for rows in (1, 3)]
    if body is _rms_norm_residual:
        found.append(Case(kernel, "rows=2 n=100 threads=64 in-place",
                          partial(body, kernel=kernel, rows=2, n=100, threads=64, in_place=True)))
    if kernel == "rms_norm_f32":
        found.append(Case(kernel, "zero-row eps=1e-4", partial(_zero_row_and_eps, kernel=kernel)))
    return found
