"""What every op's cases share: the case and its outcome, the run context a case builds its inputs in and compares
through, storage-dtype conversion, NaN-poisoned outputs and the per-dtype tolerances.

Device buffers are numpy arrays in the kernel's storage type: float32, float16, or bf16 held as uint16 bits. A case
dispatches through ``Run.dispatch``, which forwards to the device it runs on (``lily.selftest.device``: the CPU
harness, the Metal API or CUDA), so one definition runs on every executor.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from lily.quant import QuantizedTensor, bfloat16_bits_to_float32, float32_to_bfloat16_bits, quantize


class Device(Protocol):
    """Where a case's dispatches go (``lily.selftest.device.KernelDevice`` implements it)."""

    def dispatch(self, kernel: str, args: list, threadgroups: tuple[int, int, int],
                 threads_per_threadgroup: tuple[int, int, int], **options) -> None: ...


@dataclass(frozen=True)
class Tolerance:
    """Element-wise |actual - expected| <= atol + rtol * |expected|, plus a bound on the relative RMS error."""

    rtol: float
    atol: float
    rel_rms: float

    def __str__(self) -> str:
        if math.isinf(self.atol):
            return f"rel RMS <= {self.rel_rms:g}"
        return f"|err| <= {self.atol:g} + {self.rtol:g}|e|, rel RMS <= {self.rel_rms:g}"


# One rounding of a result to the dtype is 0.5 ulp; allow 1 ulp (2^-23, 2^-10, 2^-7) for fp32-vs-fp64 sums.
TOLERANCES: dict[str, Tolerance] = {
    "f32": Tolerance(rtol=2e-6, atol=1e-6, rel_rms=1e-6),
    "f16": Tolerance(rtol=1e-3, atol=1e-5, rel_rms=5e-4),
    "bf16": Tolerance(rtol=8e-3, atol=1e-4, rel_rms=4e-3),
}
# Relative RMS error only, for results of long fp32 chains compared with an unrounded fp64 reference (a few roundings
# of the output dtype): the self-test's representative cases of the matmul, attention, MoE and DeltaNet kernels.
REL_RMS: dict[str, Tolerance] = {
    "f32": Tolerance(rtol=0.0, atol=math.inf, rel_rms=1e-5),
    "f16": Tolerance(rtol=0.0, atol=math.inf, rel_rms=2e-3),
    "bf16": Tolerance(rtol=0.0, atol=math.inf, rel_rms=1.5e-2),
}

_STORAGE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
_SCALE_DTYPE_NAMES = {"bf16": "bfloat16", "f32": "float32"}


# ---- storage conversion ----


def to_device(values, dtype: str) -> np.ndarray:
    """A C-contiguous buffer of `values` rounded once to `dtype` ("f32", "f16" or "bf16": round to nearest even)."""
    values = np.asarray(values, dtype=np.float64)
    if dtype == "bf16":
        return np.ascontiguousarray(float32_to_bfloat16_bits(values.astype(np.float32)))
    return np.ascontiguousarray(values.astype(_STORAGE[dtype]))


def to_f64(buffer: np.ndarray, dtype: str) -> np.ndarray:
    """The values a device buffer holds, widened exactly."""
    if dtype == "bf16":
        return bfloat16_bits_to_float32(buffer).astype(np.float64)
    return np.asarray(buffer).astype(np.float64)


def round_to(values, dtype: str) -> np.ndarray:
    """`values` rounded once to `dtype`, as float64."""
    return to_f64(to_device(values, dtype), dtype)


def poisoned(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """An output buffer of NaN, so elements the kernel does not write show up as errors."""
    if dtype == "bf16":
        return np.full(shape, 0x7FC0, np.uint16)
    return np.full(shape, np.nan, _STORAGE[dtype])


def dtype_of(kernel: str) -> str:
    """The activation dtype named in a host name (`..._bf16_...` -> "bf16")."""
    found = re.search(r"_(f32|f16|bf16)(?:_|$)", kernel)
    if not found:
        raise ValueError(f"kernel_cases: cannot tell the dtype of kernel {kernel!r}")
    return found.group(1)


def bits_of(kernel: str) -> int:
    """The weight bit width named in a host name (`_q8_` -> 8; 4 when absent)."""
    found = re.search(r"_q(4|8)_", kernel)
    return int(found.group(1)) if found else 4


def scale_dtype_of(kernel: str) -> str:
    """The storage dtype of a quantized weight's scales and biases: f32 for `_sf32` names, else bf16."""
    return "f32" if "_sf32" in kernel else "bf16"


def random_weight(rng: np.random.Generator, shape: tuple[int, ...], bits: int, scale_dtype: str) -> QuantizedTensor:
    """A weight [..., n, k] quantized like an MLX checkpoint (group 64); per-row offsets make the biases matter."""
    k = shape[-1]
    w = rng.standard_normal(shape) / np.sqrt(k) + 0.02 * rng.standard_normal(shape[:-1] + (1,))
    return quantize(w.astype(np.float32), bits, 64, dtype=_SCALE_DTYPE_NAMES[scale_dtype])


def weight_buffers(qt: QuantizedTensor, scale_dtype: str) -> list[np.ndarray]:
    """[codes, scales, biases] as device buffers (quantize already rounded the scales to their storage dtype)."""
    scales, biases = to_device(qt.scales, scale_dtype), to_device(qt.biases, scale_dtype)
    assert np.array_equal(to_f64(scales, scale_dtype), qt.scales), "scales must be exact in their storage dtype"
    return [np.ascontiguousarray(qt.weight), scales, biases]


def quantized_weight(kernel: str, shape: tuple[int, ...], rng: np.random.Generator):
    """(QuantizedTensor, [codes, scales, biases]) of a random weight in the bits and scale dtype `kernel` names."""
    scale_dtype = scale_dtype_of(kernel)
    qt = random_weight(rng, shape, bits_of(kernel), scale_dtype)
    return qt, weight_buffers(qt, scale_dtype)


# ---- comparisons and outcomes ----


@dataclass
class Comparison:
    """One output of a case against its reference: its error, the tolerance and what went wrong."""

    what: str
    error: float  # relative RMS error (float outputs) or the number of wrong elements (exact outputs)
    max_error: float  # the largest absolute error (float) or the largest |difference| (exact)
    tolerance: str
    passed: bool
    detail: str = ""


@dataclass
class Outcome:
    """A case's result: the first failing comparison, or the worst one when all pass."""

    kernel: str
    shape: str
    error: float
    max_error: float
    tolerance: str
    passed: bool
    comparisons: list[Comparison] = field(default_factory=list)

    def message(self) -> str:
        """One line naming the kernel, the shape, the output, the errors and the tolerance."""
        failed = [c for c in self.comparisons if not c.passed] or self.comparisons
        c = failed[0] if failed else Comparison("(nothing compared)", math.nan, math.nan, "", False)
        verdict = "within" if self.passed else "NOT within"
        return (f"{self.kernel} [{self.shape}] {c.what}: max error {c.max_error:.3g}, error {c.error:.3g}, "
                f"{verdict} tolerance ({c.tolerance}){'; ' + c.detail if c.detail else ''}")


def compare_values(what: str, actual: np.ndarray, expected: np.ndarray, tol: Tolerance,
                   allowance: np.ndarray | None = None, allowance_in_rms: bool = True) -> Comparison:
    """Float `actual` against `expected`: NaN/Inf positions, relative RMS, then element-wise bounds."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return Comparison(what, math.nan, math.nan, str(tol), False, f"shape {actual.shape} != {expected.shape}")
    bad_nan = np.isnan(actual) != np.isnan(expected)
    if bad_nan.any():
        return Comparison(what, math.nan, math.nan, str(tol), False,
                          f"NaN mismatch at {np.argwhere(bad_nan)[:5].tolist()} (an element unwritten or wrong)")
    inf = np.isinf(expected) | np.isinf(actual)
    if not np.array_equal(actual[inf], expected[inf]):
        return Comparison(what, math.inf, math.inf, str(tol), False, "Inf mismatch")
    finite = np.isfinite(expected)
    a, e = actual[finite], expected[finite]
    if e.size == 0:
        return Comparison(what, 0.0, 0.0, str(tol), True)
    extra = np.zeros_like(e) if allowance is None else np.broadcast_to(allowance, expected.shape)[finite]
    scale = np.sqrt(np.mean(e * e))
    rel_rms = float(np.sqrt(np.mean((a - e) ** 2)) / scale if scale > 0 else np.sqrt(np.mean(a * a)))
    rel_limit = tol.rel_rms + (float(np.sqrt(np.mean(extra**2)) / scale) if scale > 0 and allowance_in_rms else 0.0)
    err = np.abs(a - e)
    excess = err - (tol.atol + tol.rtol * np.abs(e) + extra)
    worst = int(np.argmax(excess))
    passed = bool(rel_rms <= rel_limit and excess[worst] <= 0)
    described = str(tol) if allowance is None else f"{tol} + fp32 accumulation allowance"
    detail = "" if passed else f"element {worst}: got {a[worst]!r}, expected {e[worst]!r}"
    return Comparison(what, rel_rms, float(err.max()), described, passed, detail)


def _compare_exact(what: str, actual, expected) -> Comparison:
    actual, expected = np.asarray(actual).ravel(), np.asarray(expected).ravel()
    if actual.size != expected.size:
        return Comparison(what, math.nan, math.nan, "exact", False, f"{actual.size} values, {expected.size} expected")
    wrong = np.flatnonzero(actual != expected)
    distance = float(np.abs(actual[wrong].astype(np.float64) - expected[wrong].astype(np.float64)).max()) \
        if wrong.size else 0.0
    detail = f"first wrong element {wrong[0]}: got {actual[wrong[0]]}, expected {expected[wrong[0]]}" \
        if wrong.size else ""
    return Comparison(what, float(wrong.size), distance, "exact", not wrong.size, detail)


def _compare_allowed(what: str, actual, allowed: Sequence[set[int]]) -> Comparison:
    actual = [int(v) for v in np.asarray(actual).ravel()]
    if len(actual) != len(allowed):
        return Comparison(what, math.nan, math.nan, "exact", False, f"{len(actual)} values, {len(allowed)} expected")
    wrong = [i for i, (a, ok) in enumerate(zip(actual, allowed)) if a not in ok]
    distance = max((min(abs(actual[i] - v) for v in allowed[i]) for i in wrong), default=0)
    detail = f"first wrong element {wrong[0]}: got {actual[wrong[0]]}, expected one of " \
        f"{sorted(allowed[wrong[0]])[:4]}" if wrong else ""
    return Comparison(what, float(len(wrong)), float(distance), "exact", not wrong, detail)


class Run:
    """The context one case runs in: its random stream, the device, and the comparisons it records."""

    def __init__(self, device: Device, rng: np.random.Generator, corrupt: bool = False) -> None:
        self.device = device
        self.rng = rng
        self.corrupt = corrupt  # perturb every expected value: shows that a failing case is reported
        self.comparisons: list[Comparison] = []

    def dispatch(self, kernel: str, args: list, threadgroups, threads_per_threadgroup, **options) -> None:
        """One dispatch on the case's device; numpy arrays in `args` are device buffers, written back in place."""
        as3 = lambda v: tuple(int(x) for x in (v if isinstance(v, tuple) else (v, 1, 1)))  # noqa: E731
        self.device.dispatch(kernel, args, as3(threadgroups), as3(threads_per_threadgroup), **options)

    def compare(self, what: str, actual: np.ndarray, expected: np.ndarray, tolerance: Tolerance | str,
                allowance: np.ndarray | float | None = None, allowance_in_rms: bool = True) -> None:
        """Float output against its float64 reference: NaN/Inf positions, relative RMS, then element-wise bounds.
        `tolerance` is a Tolerance or a dtype name (its TOLERANCES row); `allowance` widens each element's bound (and,
        with `allowance_in_rms`, the relative RMS bound by its RMS), e.g. for the rounding of a long fp32 sum."""
        tol = TOLERANCES[tolerance] if isinstance(tolerance, str) else tolerance
        if self.corrupt:
            expected = np.asarray(expected, np.float64) * 1.01 + 0.01
        self.comparisons.append(compare_values(what, actual, expected, tol, allowance, allowance_in_rms))

    def compare_exact(self, what: str, actual: np.ndarray, expected: np.ndarray) -> None:
        """Integer (or bit-exact) output: the error is the number of elements that differ."""
        if self.corrupt:
            expected = np.asarray(expected) + 1
        self.comparisons.append(_compare_exact(what, actual, expected))

    def require(self, what: str, condition: bool, detail: str = "") -> None:
        """A property of the outputs the reference does not give element by element (counts, slots left alone)."""
        passed = bool(condition)
        self.comparisons.append(Comparison(what, 0.0 if passed else 1.0, 0.0 if passed else 1.0, "holds", passed,
                                           "" if passed else detail))

    def compare_allowed(self, what: str, actual, allowed: Sequence[set[int]]) -> None:
        """Token ids with more than one right answer: each element must be in its allowed set."""
        if self.corrupt:
            allowed = [{-1} for _ in allowed]
        self.comparisons.append(_compare_allowed(what, actual, allowed))


@dataclass(frozen=True)
class Case:
    """One kernel at one shape: `body(run)` builds inputs from ``run.rng``, dispatches and compares.

    `quick` marks the self-test's default set (one representative case per kernel); the kernel tests and
    ``python -m lily.selftest --all`` run every case.
    """

    kernel: str
    shape: str
    body: Callable[[Run], None] = field(compare=False, repr=False)
    quick: bool = False

    @property
    def id(self) -> str:
        """The pytest id: kernel and shape, with no spaces."""
        return f"{self.kernel}-{self.shape.replace(' ', '-')}"

    def run(self, device: Device, seed: int = 0, corrupt: bool = False) -> Outcome:
        """Run the case on `device`, inputs from `seed` mixed with the case's id (each case has its own stream)."""
        run = Run(device, np.random.default_rng([seed, zlib.crc32(self.id.encode())]), corrupt)
        self.body(run)
        comparisons = run.comparisons
        failed = [c for c in comparisons if not c.passed]
        # The row shows the first failure, else the largest error (a compared output before a property check).
        worst = failed[0] if failed else max(comparisons, key=lambda c: (c.error, c.tolerance != "holds"), default=None)
        if worst is None:
            return Outcome(self.kernel, self.shape, math.nan, math.nan, "", False, comparisons)
        return Outcome(self.kernel, self.shape, worst.error, worst.max_error, worst.tolerance, not failed, comparisons)
