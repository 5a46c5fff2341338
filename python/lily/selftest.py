"""``python -m lily.selftest [--json] [--device {auto,metal-api,harness,cuda}] [--compile-only]``: run every instantiated kernel once against
``lily.reference``.

Each kernel runs at one small representative shape on fresh random inputs and is compared with the numpy
reference (relative RMS error for float outputs; mismatch count for token ids). The exit code is non-zero if any
case fails or if an instantiated kernel has no case.

``--device`` picks how the kernels run: ``metal-api`` through Lily's host Metal layer (``lily._ext.kernels.Runner``:
the objc_msgSend binding, device, pipeline cache and encoder), which on a Mac is the real GPU and on Linux is the
toy Objective-C runtime and fake Metal executing on the CPU harness (docs/engine.md); ``harness`` straight through
the Linux CPU execution harness (``lily._ext.msl``, docs/harness.md; not built on macOS); ``cuda`` an NVIDIA GPU through the
CUDA driver API (``lily.cuda``, docs/cuda.md; ``--compile-only`` compiles every kernel for it and runs ptxas, with no
GPU). ``auto`` (the default) is
``metal-api`` on a Mac and ``harness`` elsewhere.

Cases are a registry: a kernel family adds one builder with ``@case(r"regex over host names")``; the builder gets the
host name and returns a ``Result``. Argument structs are packed here exactly as ``metal/lily.h`` lays them out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from lily import reference
from lily.quant import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from lily.sampling import log_softmax, top_k_mask, top_p_mask

__all__ = ["Result", "case", "run", "main"]


@dataclass
class Result:
    """One selftest row: the kernel, the shape it ran at, its error and whether that is within tolerance."""

    kernel: str
    shape: str
    error: float
    passed: bool


Builder = Callable[[str], Result]
CASES: list[tuple[re.Pattern[str], Builder]] = []

# Relative RMS error allowed against the fp32/fp64 reference: a few roundings of the output dtype.
REL_RMS_TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 1.5e-2}
# Set by --corrupt: the kernel whose expected result is perturbed, to show that a failing case is reported.
_corrupted: set[str] = set()
# Set by --seed: mixed into every case's random stream (each case also has its own stream id).
_seed = [0]


def _rng(stream: int) -> np.random.Generator:
    """A fresh generator for one case, from the run's --seed and the case's stream id."""
    return np.random.default_rng([_seed[0], stream])


def case(pattern: str) -> Callable[[Builder], Builder]:
    """Register a case builder for every host name that fully matches ``pattern``."""

    def register(builder: Builder) -> Builder:
        CASES.append((re.compile(pattern), builder))
        return builder

    return register


def find_builder(kernel: str, cases: Sequence[tuple[re.Pattern[str], Builder]]) -> Builder | None:
    """The first registered builder whose pattern matches the whole host name, or None."""
    for pattern, builder in cases:
        if pattern.fullmatch(kernel):
            return builder
    return None


# ---- storage conversion (bf16 buffers hold raw uint16 bits, as the harness expects) ----

_STORAGE = {"f32": np.float32, "f16": np.float16}


def to_device(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` rounded to the kernel storage dtype (round to nearest even for bf16), C-contiguous."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "bf16":
        return float32_to_bfloat16_bits(values)
    return values.astype(_STORAGE[dtype])


def to_f64(buffer: np.ndarray, dtype: str) -> np.ndarray:
    """The values a device buffer holds, widened exactly."""
    if dtype == "bf16":
        return bfloat16_bits_to_float32(buffer).astype(np.float64)
    return np.asarray(buffer, np.float64)


def poisoned(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """An output buffer of NaN, so unwritten elements show up as errors."""
    if dtype == "bf16":
        return np.full(shape, 0x7FC0, np.uint16)
    return np.full(shape, np.nan, _STORAGE[dtype])


def dtype_of(kernel: str) -> str:
    """The activation dtype named in a host name (`..._bf16_...` -> "bf16")."""
    found = re.search(r"_(f32|f16|bf16)(?:_|$)", kernel)
    if not found:
        raise ValueError(f"selftest: cannot tell the dtype of kernel {kernel!r}")
    return found.group(1)


def compare(kernel: str, shape: str, actual: np.ndarray, expected: np.ndarray, dtype: str) -> Result:
    """Relative RMS error of `actual` against `expected`; NaN anywhere fails."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if kernel in _corrupted:
        expected = expected * 1.01 + 0.01
    scale = np.sqrt(np.mean(expected**2))
    error = float(np.sqrt(np.mean((actual - expected) ** 2)) / (scale if scale > 0 else 1.0))
    if np.isnan(actual).any():
        error = float("nan")
    return Result(kernel, shape, error, bool(error <= REL_RMS_TOLERANCE[dtype]))


def compare_ids(kernel: str, shape: str, actual: Sequence[int], allowed: Sequence[set[int]]) -> Result:
    """Token ids: the error is the number of ids outside their allowed set."""
    if kernel in _corrupted:
        allowed = [{-1} for _ in allowed]
    wrong = sum(int(a) not in ok for a, ok in zip(actual, allowed))
    return Result(kernel, shape, float(wrong), wrong == 0)


def _msl():
    """The CPU execution harness (``lily._ext.msl``); ImportError where it is not built (macOS)."""
    from lily._ext import msl

    return msl


def _metal_runner():
    """A ``lily._ext.kernels.Runner`` over the embedded kernels: the Metal API on the default device."""
    from lily._ext import kernels
    from lily.backends.metal import kernel_metallib

    return kernels.Runner(metallib=kernel_metallib())


@dataclass
class KernelDevice:
    """Where the cases' dispatches go: what it is, its dispatch function and the kernels it has."""

    kind: str  # "metal-api", "harness" or "cuda"
    name: str  # the Metal device's name, or "CPU execution harness"
    # dispatch(kernel, args, threadgroups, threads_per_threadgroup): numpy arrays are device buffers (written back
    # in place), bytes are setBytes data.
    dispatch: Callable[[str, list, tuple[int, int, int], tuple[int, int, int]], None]
    kernels: list[str]  # the instantiated kernels it runs, sorted
    missing: list[str] = field(default_factory=list)  # instantiated in the source, not compiled for this GPU
    # Kernel families (metal/<family>.metal) whose library did not compile: {family, file, diagnostic, kernels}.
    failed_families: list[dict] = field(default_factory=list)

    @property
    def gpu_tested(self) -> bool:
        """Whether the kernels run on a real GPU (the Metal API on a Mac or CUDA; the fake Metal elsewhere)."""
        return self.kind == "cuda" or (self.kind == "metal-api" and platform.system() == "Darwin")

    def note(self) -> str:
        """One sentence for the summary: what ran the kernels."""
        if self.kind == "cuda":
            return f"Kernels ran on the NVIDIA GPU '{self.name}' through the CUDA driver API."
        if self.kind == "harness":
            return "Kernels ran on the CPU execution harness; no GPU is tested."
        if self.gpu_tested:
            return f"Kernels ran on the GPU '{self.name}' through the Metal API."
        return f"Kernels ran through the Metal API on '{self.name}'; no GPU is tested."


def _cuda_runner():
    """A ``lily.cuda.Runner`` over the PTX built from metal/ (raises lily.cuda.CudaError without a driver or PTX)."""
    from lily import cuda

    return cuda.Runner()


def open_device(choice: str = "auto") -> KernelDevice:
    """The device for ``--device`` `choice`: auto, metal-api or harness.

    Raises ImportError when the harness is not built (macOS), RuntimeError when Metal has no device or refuses the
    kernel source, and ValueError for an unknown choice.
    """
    if choice == "auto":
        choice = "metal-api" if platform.system() == "Darwin" else "harness"
    if choice == "harness":
        msl = _msl()
        return KernelDevice("harness", "CPU execution harness", msl.dispatch, list(msl.kernel_names()))
    if choice == "metal-api":
        runner = _metal_runner()
        return KernelDevice("metal-api", runner.device_name, runner.run, list(runner.kernel_names()),
                            list(runner.missing_kernel_names()), list(runner.library_failures()))
    if choice == "cuda":
        runner = _cuda_runner()
        return KernelDevice("cuda", runner.device_name, runner.dispatch, runner.kernel_names())
    raise ValueError(f"selftest: device must be 'auto', 'metal-api', 'harness' or 'cuda'; got {choice!r}")


# The device run() sends the cases' dispatches to.
_device: list[KernelDevice | None] = [None]


def _dispatch(kernel: str, args: list, threadgroups: tuple[int, int, int],
              threads_per_threadgroup: tuple[int, int, int]) -> None:
    """One dispatch of a case, on the device of the current run()."""
    device = _device[0]
    if device is None:
        raise RuntimeError("selftest: cases dispatch only inside run()")
    device.dispatch(kernel, args, threadgroups, threads_per_threadgroup)


# ---- rms_norm family (metal/rms_norm.metal) ----


@case(r"rms_norm(_residual)?_(f32|f16|bf16)")
def rms_norm_case(kernel: str) -> Result:
    dtype, rows, n, eps = dtype_of(kernel), 2, 1000, 1e-6
    rng = _rng(1)
    x = to_device(3.0 * rng.standard_normal((rows, n)), dtype)
    weight = to_device(1.0 + 0.5 * rng.standard_normal(n), dtype)
    out = poisoned((rows, n), dtype)
    args = struct.pack("<IfII", n, eps, 0, 0)  # lily::RmsNormArgs
    if kernel.startswith("rms_norm_residual"):
        residual = to_device(rng.standard_normal((rows, n)), dtype)
        summed = poisoned((rows, n), dtype)
        _dispatch(kernel, [args, x, residual, weight, out, summed], (rows, 1, 1), (256, 1, 1))
        h = to_f64(to_device(to_f64(x, dtype) + to_f64(residual, dtype), dtype), dtype)
    else:
        _dispatch(kernel, [args, x, weight, out], (rows, 1, 1), (256, 1, 1))
        h = to_f64(x, dtype)
    expected = reference.rms_norm(h, to_f64(weight, dtype), eps)
    return compare(kernel, f"rows={rows} n={n}", to_f64(out, dtype), expected, dtype)


# ---- quantized matmul and embedding (metal/qmatmul.metal, metal/embedding.metal) ----


def _quantized_weight(kernel: str, rows: int, cols: int, rng: np.random.Generator, experts: int = 0):
    """An MLX-style affine weight [(experts,) rows, cols] for `kernel` and its buffers [codes, scales, biases].

    Bits from the name's q<b> (4 if absent); scales and biases f32 for _sf32 names, else bf16.
    """
    from lily.quant import quantize

    found = re.search(r"_q(4|8)_", kernel)
    bits = int(found.group(1)) if found else 4
    scale_dtype = "f32" if "_sf32" in kernel else "bf16"
    shape = ((experts,) if experts else ()) + (rows, cols)
    w = rng.standard_normal(shape) / np.sqrt(cols) + 0.02 * rng.standard_normal(shape[:-1] + (1,))
    qt = quantize(w.astype(np.float32), bits, 64, dtype="float32" if scale_dtype == "f32" else "bfloat16")
    buffers = [np.ascontiguousarray(qt.weight), to_device(qt.scales, scale_dtype), to_device(qt.biases, scale_dtype)]
    return qt, buffers


@case(r"qmv_q(4|8)_g64_(f32|f16|bf16)(_sf32)?"
      r"|qmm_q(4|8)_g64_(f32|f16|bf16)(_sf32)?_bm(16|32)"
      r"|qmm_nax_q(4|8)_g64_(f16|bf16)")
def qmatmul_case(kernel: str) -> Result:
    dtype = dtype_of(kernel)
    rng = _rng(6)
    if kernel.startswith("qmv"):
        m, n, k = 2, 40, 512
        grid, threads = (-(-n // 8), m, 1), 64  # 8 output rows per threadgroup (LILY_QMV_ROWS_PER_SIMDGROUP x 2)
    else:
        if "_nax_" in kernel:
            bm, bn, threads = 32, 64, 128  # LILY_QMM_NAX_BM x LILY_QMM_NAX_BN tile, 4 simdgroups
        else:
            bm, bn = int(kernel[-2:]), 32
            threads = 64 if bm == 16 else 128
        m, n, k = bm + 3, bn + 5, 256  # partial tiles in M and N
        grid = (-(-n // bn), -(-m // bm), 1)
    qt, weight = _quantized_weight(kernel, n, k, rng)
    x = to_device(rng.standard_normal((m, k)), dtype)
    y = poisoned((m, n), dtype)
    _dispatch(kernel, [struct.pack("<IIII", k, n, m, 0), x, *weight, y], grid, (threads, 1, 1))
    w = qt.dequantize().astype(np.float32)
    if "_nax_" in kernel:
        w = to_f64(to_device(w, dtype), dtype).astype(np.float32)  # tensor-op tiles hold weights in the dtype
    expected = reference.qmatmul(to_f64(x, dtype).astype(np.float32), w)
    return compare(kernel, f"M={m} N={n} K={k}", to_f64(y, dtype), expected, dtype)


@case(r"qmv_q(4|8)_g64_bf16(_sf32)?_of32"
      r"|qmv_norm_q(4|8)_g64_(f32|bf16)(_sf32)?"
      r"|qmv_norm_q(4|8)_g64_bf16(_sf32)?_of32"
      r"|qmv_residual_q(4|8)_g64_(f32|bf16)(_sf32)?")
def qmv_fused_case(kernel: str) -> Result:
    """The decode GEMV variants: f32 output (_of32), the RMSNorm folded in (qmv_norm), the residual add folded in."""
    dtype = dtype_of(kernel)
    out_dtype = "f32" if kernel.endswith("_of32") else dtype
    rng = _rng(17)
    m, n, k, eps = 1, 40, 512, 1e-6
    qt, weight = _quantized_weight(kernel, n, k, rng)
    w = qt.dequantize().astype(np.float32)
    x = to_device(3.0 * rng.standard_normal((m, k)), dtype)
    y = poisoned((m, n), out_dtype)
    grid, threads = (-(-n // 8), m, 1), (64, 1, 1)  # 8 output rows per threadgroup (LILY_QMV_*)
    xs = to_f64(x, dtype)
    if kernel.startswith("qmv_norm"):
        norm_weight = to_device(1.0 + 0.3 * rng.standard_normal(k), dtype)
        _dispatch(kernel, [struct.pack("<IIIf", k, n, m, eps), x, norm_weight, *weight, y], grid, threads)
        expected = reference.qmatmul(reference.rms_norm(xs, to_f64(norm_weight, dtype), eps), w)
    elif kernel.startswith("qmv_residual"):
        residual = to_device(rng.standard_normal((m, n)), dtype)
        _dispatch(kernel, [struct.pack("<IIII", k, n, m, 0), x, *weight, residual, y], grid, threads)
        expected = to_f64(residual, dtype) + reference.qmatmul(xs.astype(np.float32), w)
    else:
        _dispatch(kernel, [struct.pack("<IIII", k, n, m, 0), x, *weight, y], grid, threads)
        expected = reference.qmatmul(xs.astype(np.float32), w)
    return compare(kernel, f"M={m} N={n} K={k}", to_f64(y, out_dtype), expected, out_dtype)


@case(r"qmv(_norm)?_seg_q(4|8)_g64_(f32|bf16)(_sf32)?(_of32)?")
def qmv_segments_case(kernel: str) -> Result:
    """The segmented decode GEMV (fused projections without a concatenated copy): four matrices sharing x, each in
    its own buffers, against one GEMV over their concatenation; segments are not multiples of 8 rows."""
    dtype = dtype_of(kernel)
    out_dtype = "f32" if kernel.endswith("_of32") else dtype
    rng = _rng(19)
    rows, k, eps = [33, 9, 1, 1], 512, 1e-6
    parts = [_quantized_weight(kernel, n, k, rng) for n in rows]
    w = np.concatenate([qt.dequantize().astype(np.float32) for qt, _ in parts])
    x = to_device(3.0 * rng.standard_normal((1, k)), dtype)
    norm_weight = to_device(1.0 + 0.3 * rng.standard_normal(k), dtype)
    y = poisoned((1, sum(rows)), out_dtype)
    grid = (sum(-(-n // 8) for n in rows), 1, 1)  # each segment padded to 8-row threadgroups (LILY_QMV_*)
    args = struct.pack("<IIIf4I", k, sum(rows), len(rows), eps, *rows)
    _dispatch(kernel, [args, x, norm_weight, *[b for _, buffers in parts for b in buffers], y], grid, (64, 1, 1))
    xs = to_f64(x, dtype)
    if kernel.startswith("qmv_norm"):
        xs = reference.rms_norm(xs, to_f64(norm_weight, dtype), eps)
    expected = reference.qmatmul(xs.astype(np.float32), w)
    return compare(kernel, f"rows={rows} K={k}", to_f64(y, out_dtype), expected, out_dtype)


@case(r"dequantize_q(4|8)_g64_(f32|bf16)(_sf32)?")
def dequantize_case(kernel: str) -> Result:
    """The IN_GEMM_DEQUANT ablation's first pass: the whole weight expanded to the activation dtype."""
    dtype = dtype_of(kernel)
    rng = _rng(23)
    n, k = 40, 512
    qt, weight = _quantized_weight(kernel, n, k, rng)
    out = poisoned((n, k), dtype)
    words = qt.weight.size
    _dispatch(kernel, [struct.pack("<IIII", k, n, 0, 0), *weight, out], (-(-words // 256), 1, 1),
              (256, 1, 1))  # one packed word per thread, LILY_DEQUANTIZE_THREADS per threadgroup
    return compare(kernel, f"N={n} K={k}", to_f64(out, dtype), qt.dequantize(), dtype)


@case(r"mm_(f32|bf16)_bm(16|32)")
def mm_case(kernel: str) -> Result:
    """The IN_GEMM_DEQUANT ablation's dense GEMM: qmm's tiles on an already dequantized weight."""
    dtype = dtype_of(kernel)
    rng = _rng(24)
    bm = int(kernel[-2:])
    m, n, k = bm + 3, 37, 256  # partial tiles in M and N
    x = to_device(rng.standard_normal((m, k)), dtype)
    w = to_device(rng.standard_normal((n, k)) / np.sqrt(k), dtype)
    y = poisoned((m, n), dtype)
    _dispatch(kernel, [struct.pack("<IIII", k, n, m, 0), x, w, y], (-(-n // 32), -(-m // bm), 1),
              (64 if bm == 16 else 128, 1, 1))
    expected = reference.qmatmul(to_f64(x, dtype).astype(np.float32), to_f64(w, dtype).astype(np.float32))
    return compare(kernel, f"M={m} N={n} K={k}", to_f64(y, dtype), expected, dtype)


@case(r"embedding_gather_q(4|8)_g64_(f32|f16|bf16)(_sf32)?")
def embedding_case(kernel: str) -> Result:
    dtype, vocab, hidden = dtype_of(kernel), 50, 256
    rng = _rng(7)
    qt, weight = _quantized_weight(kernel, vocab, hidden, rng)
    ids = np.array([0, 7, 7, 3, 49], np.uint32)
    out = poisoned((ids.size - 1, hidden), dtype)
    # ids_offset 1: the decode path reads the slot the sampler wrote.
    _dispatch(kernel, [struct.pack("<IIII", hidden, vocab, 1, 0), ids, *weight, out], (ids.size - 1, 1, 1),
             (64, 1, 1))
    expected = reference.embedding(ids[1:], qt)
    return compare(kernel, f"V={vocab} H={hidden} T={ids.size - 1}", to_f64(out, dtype), expected, dtype)


# ---- gated attention (metal/attention_prep.metal, metal/attention.metal, metal/attention_prefill.metal) ----

# Query heads per threadgroup of the packed kernels by head dim (LILY_ATTN_HEADS_PER_GROUP, ..._D64); the
# attention_decode*_unpacked_* kernels (the GQA-packing ablation) take one; the *_plain_* ones (coalesced-KV
# ablation) pack like the default kernels.
_ATTN_HEADS_PER_GROUP = {256: 4, 64: 2}
# The KV cache is bf16 except in float32 mode.
_CACHE_DTYPE = {"f32": "f32", "f16": "bf16", "bf16": "bf16"}


def _attn_layout(kernel: str) -> tuple[int, int, int]:
    """(head dim, query heads per threadgroup, query heads of the case) of an attention kernel's host name: the model's
    16 heads at head dim 256, the demo model's 4 at head dim 64, always 2 KV heads."""
    head_dim = int(re.search(r"_d(\d+)$", kernel).group(1))
    per_group = 1 if "_unpacked_" in kernel else _ATTN_HEADS_PER_GROUP[head_dim]
    return head_dim, per_group, 16 if head_dim == 256 else 4


def _attention_args(queries: int, heads: int, kv_heads: int, keys: int, capacity: int, head_dim: int,
                    block_size: int = 0, num_blocks: int = 0) -> bytes:
    return struct.pack("<IIIIIIIf", queries, heads, kv_heads, keys, capacity, block_size, num_blocks,
                       head_dim**-0.5)  # lily::AttentionArgs


def _kv_cache(rng: np.random.Generator, cache_dtype: str, kv_heads: int, keys: int, capacity: int,
              head_dim: int) -> np.ndarray:
    """[Hkv, capacity, D] with `keys` random rows and NaN after them (a read past the context shows)."""
    cache = poisoned((kv_heads, capacity, head_dim), cache_dtype)
    cache[:, :keys] = to_device(rng.standard_normal((kv_heads, keys, head_dim)), cache_dtype)
    return cache


@case(r"attention_prep_(f32|f16|bf16)_d(256|64)")
def attention_prep_case(kernel: str) -> Result:
    dtype = dtype_of(kernel)
    cache_dtype = _CACHE_DTYPE[dtype]
    d, _, heads = _attn_layout(kernel)
    tokens, kv_heads, position, rotary_dim, theta, eps = 3, 2, 37, d // 4, 1e7, 1e-6  # partial rotary factor 0.25
    capacity = position + tokens + 2
    rng = _rng(8)
    q_and_gate = to_device(2.0 * rng.standard_normal((tokens, heads, 2 * d)), dtype)
    k = to_device(2.0 * rng.standard_normal((tokens, kv_heads, d)), dtype)
    v = to_device(rng.standard_normal((tokens, kv_heads, d)), dtype)
    q_norm = to_device(1.0 + 0.3 * rng.standard_normal(d), dtype)
    k_norm = to_device(1.0 + 0.3 * rng.standard_normal(d), dtype)
    q_out, gate_out = poisoned((tokens, heads, d), dtype), poisoned((tokens, heads, d), dtype)
    k_cache = poisoned((kv_heads, capacity, d), cache_dtype)
    v_cache = poisoned((kv_heads, capacity, d), cache_dtype)
    args = struct.pack("<IIIIIIff", tokens, heads, kv_heads, position, capacity, rotary_dim, theta, eps)
    rows = tokens * (heads + kv_heads)  # one simdgroup per (token, head) row
    _dispatch(kernel, [args, q_and_gate, k, v, q_norm, k_norm, q_out, gate_out, k_cache, v_cache],
             (-(-rows // 2), 1, 1), (64, 1, 1))
    q_ref, gate_ref, k_ref = reference.attention_prep(
        to_f64(q_and_gate, dtype), to_f64(k, dtype), to_f64(q_norm, dtype), to_f64(k_norm, dtype),
        np.arange(position, position + tokens), rotary_dim, theta, eps)
    window = slice(position, position + tokens)
    actual = np.concatenate([to_f64(q_out, dtype).ravel(), to_f64(gate_out, dtype).ravel(),
                             to_f64(k_cache, cache_dtype)[:, window].ravel(),
                             to_f64(v_cache, cache_dtype)[:, window].ravel()])
    expected = np.concatenate([q_ref.ravel(), gate_ref.ravel(), k_ref.transpose(1, 0, 2).ravel(),
                               to_f64(v, dtype).transpose(1, 0, 2).ravel()])
    # q and the cache are checked together: the looser tolerance of the two dtypes.
    return compare(kernel, f"T={tokens} Hq={heads} Hkv={kv_heads} pos={position} R={rotary_dim} D={d}", actual,
                   expected, "bf16" if cache_dtype == "bf16" else dtype)


def _decode_inputs(dtype: str, heads: int, kv_heads: int, keys: int, head_dim: int, rng: np.random.Generator):
    cache_dtype = _CACHE_DTYPE[dtype]
    capacity = keys + 3
    q = to_device(2.0 * rng.standard_normal((heads, head_dim)), dtype)
    gate = to_device(2.0 * rng.standard_normal((heads, head_dim)), dtype)
    k_cache = _kv_cache(rng, cache_dtype, kv_heads, keys, capacity, head_dim)
    v_cache = _kv_cache(rng, cache_dtype, kv_heads, keys, capacity, head_dim)
    k = to_f64(k_cache, cache_dtype)[:, :keys].transpose(1, 0, 2)
    v = to_f64(v_cache, cache_dtype)[:, :keys].transpose(1, 0, 2)
    expected = reference.attention(to_f64(q, dtype)[None], k, v, to_f64(gate, dtype)[None], offset=keys - 1)[0]
    return capacity, q, gate, k_cache, v_cache, expected


@case(r"attention_decode_(unpacked_|plain_)?(f32|f16|bf16)_d(256|64)")
def attention_decode_case(kernel: str) -> Result:
    dtype, kv_heads, keys = dtype_of(kernel), 2, 45
    d, per_group, heads = _attn_layout(kernel)
    capacity, q, gate, k_cache, v_cache, expected = _decode_inputs(dtype, heads, kv_heads, keys, d, _rng(9))
    out = poisoned((heads, d), dtype)
    _dispatch(kernel, [_attention_args(1, heads, kv_heads, keys, capacity, d), q, gate, k_cache, v_cache, out],
             (heads // per_group, 1, 1), (128, 1, 1))
    return compare(kernel, f"Hq={heads} Hkv={kv_heads} S={keys} D={d}", to_f64(out, dtype), expected, dtype)


def _block_partials(q: np.ndarray, k: np.ndarray, v: np.ndarray, group: int, block: int):
    """Per block of keys: the softmax-normalised output [Hq, blocks, D] and (max score, sum of exp) [Hq, blocks, 2]."""
    heads = q.shape[0]
    kv = np.arange(heads) // group
    outs, stats = [], []
    for begin in range(0, k.shape[0], block):
        kb, vb = k[begin : begin + block][:, kv], v[begin : begin + block][:, kv]  # [n, Hq, D]
        scores = np.einsum("hd,nhd->hn", q, kb) * q.shape[1] ** -0.5
        top = scores.max(axis=1, keepdims=True)
        weights = np.exp(scores - top)
        outs.append(np.einsum("hn,nhd->hd", weights / weights.sum(axis=1, keepdims=True), vb))
        stats.append(np.stack([top[:, 0], weights.sum(axis=1)], axis=-1))
    return np.stack(outs, axis=1), np.stack(stats, axis=1)


@case(r"attention_decode_(partial|partial_unpacked|partial_plain|combine)_(f32|f16|bf16)_d(256|64)")
def attention_split_case(kernel: str) -> Result:
    dtype, kv_heads, keys, block = dtype_of(kernel), 2, 45, 16
    d, per_group, heads = _attn_layout(kernel)
    capacity, q, gate, k_cache, v_cache, expected = _decode_inputs(dtype, heads, kv_heads, keys, d, _rng(10))
    blocks = -(-keys // block)
    args = _attention_args(1, heads, kv_heads, keys, capacity, d, block, blocks)
    cache_dtype = _CACHE_DTYPE[dtype]
    k = to_f64(k_cache, cache_dtype)[:, :keys].transpose(1, 0, 2)
    v = to_f64(v_cache, cache_dtype)[:, :keys].transpose(1, 0, 2)
    part_out, part_stats = _block_partials(to_f64(q, dtype), k, v, heads // kv_heads, block)
    shape = f"Hq={heads} Hkv={kv_heads} S={keys} block={block} D={d}"
    if "_partial" in kernel:
        out = np.full((heads, blocks, d), np.nan, np.float32)
        stats = np.full((heads, blocks, 2), np.nan, np.float32)
        _dispatch(kernel, [args, q, k_cache, v_cache, out, stats], (heads // per_group, blocks, 1), (64, 1, 1))
        actual = np.concatenate([out.ravel(), stats.ravel()])
        return compare(kernel, shape, actual, np.concatenate([part_out.ravel(), part_stats.ravel()]), "f32")
    out = poisoned((heads, d), dtype)
    _dispatch(kernel, [args, gate, part_out.astype(np.float32), part_stats.astype(np.float32), out],
             (heads, 1, 1), (64, 1, 1))
    return compare(kernel, shape, to_f64(out, dtype), expected, dtype)


def assumed_simdgroup_layout() -> np.ndarray:
    """[32, 2]: the element index 8 * row + col of an 8x8 simdgroup matrix that each lane's thread_elements() holds,
    in the layout attention_prefill_mma assumes (MLX's; src/lily_ext/layout_probe.cpp has the same mapping)."""
    lanes = np.arange(32)
    quad = lanes // 4
    first = 8 * ((quad & 4) + (lanes // 2) % 4) + (quad & 2) * 2 + (lanes % 2) * 2
    return np.stack([first, first + 1], axis=1)


@case(r"simdgroup_layout_probe")
def simdgroup_layout_case(kernel: str) -> Result:
    """Apple does not specify the lane layout of thread_elements(); where it differs, the engine runs prefill
    attention on the vector kernel, and this row fails to say so."""
    out = np.full((32, 2), np.nan, np.float32)
    _dispatch(kernel, [out], (1, 1, 1), (32, 1, 1))
    got = np.where(np.isfinite(out), out, -1).astype(np.int64).ravel()
    return compare_ids(kernel, "32 lanes x 2 elements", got, [{int(e)} for e in assumed_simdgroup_layout().ravel()])


@case(r"attention_prefill(_mma)?_(unpacked_)?(f32|f16|bf16)_d(256|64)")
def attention_prefill_case(kernel: str) -> Result:
    dtype, kv_heads, queries, offset = dtype_of(kernel), 2, 12, 21
    d, per_group, heads = _attn_layout(kernel)
    # The mma variant takes one simdgroup per packed head and 8 queries (one 8-row fragment) per threadgroup; the
    # other one query per simdgroup (4 simdgroups here).
    mma = "_mma_" in kernel
    simdgroups = per_group if mma else 4
    queries_per_group = 8 if mma else simdgroups
    cache_dtype = _CACHE_DTYPE[dtype]
    keys = offset + queries
    capacity = keys + 4
    rng = _rng(11)
    q = to_device(2.0 * rng.standard_normal((queries, heads, d)), dtype)
    gate = to_device(2.0 * rng.standard_normal((queries, heads, d)), dtype)
    k_cache = _kv_cache(rng, cache_dtype, kv_heads, keys, capacity, d)
    v_cache = _kv_cache(rng, cache_dtype, kv_heads, keys, capacity, d)
    out = poisoned((queries, heads, d), dtype)
    _dispatch(kernel, [_attention_args(queries, heads, kv_heads, keys, capacity, d), q, gate, k_cache, v_cache, out],
             (-(-queries // queries_per_group), heads // per_group, 1), (32 * simdgroups, 1, 1))
    k = to_f64(k_cache, cache_dtype)[:, :keys].transpose(1, 0, 2)
    v = to_f64(v_cache, cache_dtype)[:, :keys].transpose(1, 0, 2)
    expected = reference.attention(to_f64(q, dtype), k, v, to_f64(gate, dtype), offset=offset)
    return compare(kernel, f"T={queries} offset={offset} Hq={heads} Hkv={kv_heads} D={d}", to_f64(out, dtype),
                   expected, dtype)


# ---- mixture of experts (metal/moe.metal: decode; metal/moe_prefill.metal: prefill) ----

_MOE_SORT_BLOCK = 256  # LILY_MOE_SORT_BLOCK
_MOE_GEMM_BN, _MOE_GEMM_THREADS = 64, 128  # LILY_MOE_GEMM_BN, LILY_MOE_GEMM_THREADS
_MOE_GEMV_ROWS, _MOE_GEMV_THREADS = 8, 64  # 2 simdgroups x LILY_MOE_GEMV_ROWS_PER_SIMDGROUP
# (T, E, k, H, I, Is): 70 rows x 4 slots = 280 pairs span two sort blocks; I != Is.
_MOE_SHAPE = (70, 32, 4, 128, 64, 128)


def _moe_args(rows: int, experts: int, k: int, hidden: int, expert: int, shared: int = 0, tile_rows: int = 0,
              max_tiles: int = 0) -> bytes:
    return struct.pack("<8I", rows, experts, k, hidden, expert, shared, tile_rows, max_tiles)  # lily::MoeArgs


def _silu64(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _moe_routing(rng: np.random.Generator, rows: int, experts: int, k: int, tile_rows: int):
    """Random distinct expert ids [T, k], softmax-like weights, and the numpy sort products the kernels build."""
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(rows)]).astype(np.uint32)
    weights = rng.dirichlet(np.ones(k), rows).astype(np.float32)
    flat = ids.reshape(-1).astype(np.int64)
    blocks = -(-flat.size // _MOE_SORT_BLOCK)
    block_counts = np.stack([np.bincount(flat[b * _MOE_SORT_BLOCK : (b + 1) * _MOE_SORT_BLOCK], minlength=experts)
                             for b in range(blocks)]).astype(np.uint32)
    counts = block_counts.sum(axis=0)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    block_offsets = (np.cumsum(block_counts, axis=0) - block_counts).astype(np.uint32)  # within each expert
    tiles = [(e, offsets[e] + first, min(tile_rows, counts[e] - first), 0)
             for e in range(experts) for first in range(0, counts[e], tile_rows)]
    max_tiles = -(-flat.size // tile_rows) + min(experts, flat.size)
    tile_map = np.zeros((max_tiles, 4), np.uint32)
    tile_map[: len(tiles)] = np.array(tiles, np.uint32).reshape(-1, 4)
    return {
        "ids": ids, "weights": weights, "block_counts": block_counts, "block_offsets": block_offsets,
        "offsets": offsets, "sorted_pairs": np.argsort(flat, kind="stable").astype(np.uint32),
        "tile_map": tile_map, "tile_count": np.array([len(tiles)], np.uint32), "max_tiles": max_tiles,
    }


@case(r"moe_route_f32")
def moe_route_case(kernel: str) -> Result:
    rows, experts, k = 3, 256, 8
    logits = (2.0 * _rng(12).standard_normal((rows, experts))).astype(np.float32)
    ids = np.full((rows, k), 0xFFFFFFFF, np.uint32)
    weights = np.full((rows, k), np.nan, np.float32)
    _dispatch(kernel, [_moe_args(rows, experts, k, 0, 0), logits, ids, weights], (rows, 1, 1), (32, 1, 1))
    expected_ids, expected_weights = reference.moe_route(logits, k)
    shape = f"T={rows} E={experts} k={k}"
    if not np.array_equal(ids.astype(np.int64), expected_ids):
        return Result(kernel, shape + " (ids)", float(np.sum(ids != expected_ids)), False)
    return compare(kernel, shape, weights, expected_weights, "f32")


@case(r"moe_sort_(count|scan|scatter)_u32")
def moe_sort_case(kernel: str) -> Result:
    rows, experts, k, tile_rows = 70, 32, 4, 16
    r = _moe_routing(_rng(13), rows, experts, k, tile_rows)
    args = _moe_args(rows, experts, k, 0, 0, 0, tile_rows, r["max_tiles"])
    blocks = r["block_counts"].shape[0]
    shape = f"T={rows} E={experts} k={k} bm={tile_rows}"
    if "_count_" in kernel:
        block_counts = np.full(r["block_counts"].shape, 0xFFFFFFFF, np.uint32)
        _dispatch(kernel, [args, r["ids"], block_counts], (blocks, 1, 1), (_MOE_SORT_BLOCK, 1, 1))
        return compare_ids(kernel, shape, block_counts.ravel(), [{int(v)} for v in r["block_counts"].ravel()])
    if "_scan_" in kernel:
        block_counts = r["block_counts"].copy()  # becomes the per-block offsets within each expert
        offsets = np.full(experts + 1, 0xFFFFFFFF, np.uint32)
        tile_map = np.full((r["max_tiles"], 4), 0xFFFFFFFF, np.uint32)
        tile_count = np.full(1, 0xFFFFFFFF, np.uint32)
        _dispatch(kernel, [args, block_counts, offsets, tile_map, tile_count], (1, 1, 1), (256, 1, 1))
        tiles = int(r["tile_count"][0])
        actual = np.concatenate([block_counts.ravel(), offsets, tile_map[:tiles].ravel(), tile_count])
        expected = np.concatenate([r["block_offsets"].ravel(), r["offsets"], r["tile_map"][:tiles].ravel(),
                                   r["tile_count"]])
        return compare_ids(kernel, shape, actual, [{int(v)} for v in expected])
    sorted_pairs = np.full(rows * k, 0xFFFFFFFF, np.uint32)
    _dispatch(kernel, [args, r["ids"], r["block_offsets"], r["offsets"], sorted_pairs], (blocks, 1, 1),
             (_MOE_SORT_BLOCK, 1, 1))
    return compare_ids(kernel, shape, sorted_pairs, [{int(v)} for v in r["sorted_pairs"]])


@case(r"moe_gemm_(gate_up|down)_(f32|f16|bf16)(_sf32)?_bm(16|32)")
def moe_gemm_case(kernel: str) -> Result:
    dtype, tile_rows = dtype_of(kernel), int(kernel[-2:])
    rows, experts, k, hidden, expert, _ = _MOE_SHAPE
    rng = _rng(14)
    r = _moe_routing(rng, rows, experts, k, tile_rows)
    args = _moe_args(rows, experts, k, hidden, expert, 0, tile_rows, r["max_tiles"])
    routing = [r["sorted_pairs"], r["tile_map"], r["tile_count"]]
    flat_ids = r["ids"].reshape(-1).astype(np.int64)
    pairs = r["sorted_pairs"].astype(np.int64)
    shape = f"T={rows} E={experts} k={k} H={hidden} I={expert} bm={tile_rows}"
    if "_gate_up_" in kernel:
        gate, gate_buffers = _quantized_weight(kernel, expert, hidden, rng, experts)
        up, up_buffers = _quantized_weight(kernel, expert, hidden, rng, experts)
        x = to_device(rng.standard_normal((rows, hidden)), dtype)
        h = poisoned((pairs.size, expert), dtype)
        _dispatch(kernel, [args, x, *routing, *gate_buffers, *up_buffers, h],
                 (expert // _MOE_GEMM_BN, r["max_tiles"], 1), (_MOE_GEMM_THREADS, 1, 1))
        xs = to_f64(x, dtype).astype(np.float32)
        g_all, u_all = gate.dequantize(), up.dequantize()
        expected = np.stack([_silu64(reference.qmatmul(xs[p // k], g_all[flat_ids[p]]).astype(np.float64))
                             * reference.qmatmul(xs[p // k], u_all[flat_ids[p]]) for p in pairs])
        return compare(kernel, shape, to_f64(h, dtype), expected, dtype)
    down, down_buffers = _quantized_weight(kernel, hidden, expert, rng, experts)
    h = to_device(rng.standard_normal((pairs.size, expert)), dtype)  # sorted order
    y = poisoned((pairs.size, hidden), dtype)
    _dispatch(kernel, [args, h, *routing, r["weights"].reshape(-1), *down_buffers, y],
             (hidden // _MOE_GEMM_BN, r["max_tiles"], 1), (_MOE_GEMM_THREADS, 1, 1))
    hs, d_all, w = to_f64(h, dtype).astype(np.float32), down.dequantize(), r["weights"].reshape(-1)
    expected = np.empty((pairs.size, hidden))
    for pos, pair in enumerate(pairs):
        expected[pair] = float(w[pair]) * reference.qmatmul(hs[pos], d_all[flat_ids[pair]])
    return compare(kernel, shape, to_f64(y, dtype), expected, dtype)


@case(r"moe_combine_(f32|f16|bf16)")
def moe_combine_case(kernel: str) -> Result:
    dtype, rows, k, hidden, threads = dtype_of(kernel), 5, 8, 200, 96
    rng = _rng(15)
    y = to_device(0.3 * rng.standard_normal((rows * k, hidden)), dtype)
    shared_out = to_device(rng.standard_normal((rows, hidden)), dtype)
    gate_logits = (3.0 * rng.standard_normal(rows)).astype(np.float32)
    residual = to_device(2.0 * rng.standard_normal((rows, hidden)), dtype)
    out = poisoned((rows, hidden), dtype)
    _dispatch(kernel, [_moe_args(rows, 32, k, hidden, 0), y, shared_out, gate_logits, residual, out],
             (-(-hidden // threads), rows, 1), (threads, 1, 1))
    expected = (to_f64(residual, dtype) + to_f64(y, dtype).reshape(rows, k, hidden).sum(axis=1)
                + to_f64(shared_out, dtype) / (1.0 + np.exp(-gate_logits.astype(np.float64)))[:, None])
    return compare(kernel, f"T={rows} k={k} H={hidden}", to_f64(out, dtype), expected, dtype)


@case(r"moe_(gate_up_swiglu|down_combine)_(f32|f16|bf16)(_sf32)?")
def moe_decode_case(kernel: str) -> Result:
    dtype = dtype_of(kernel)
    _, experts, k, hidden, expert, shared = _MOE_SHAPE
    rng = _rng(16)
    ids = rng.choice(experts, k, replace=False).astype(np.uint32)
    args = _moe_args(1, experts, k, hidden, expert, shared)
    shape = f"E={experts} k={k} H={hidden} I={expert} Is={shared}"
    if "_gate_up_" in kernel:
        gate, gate_buffers = _quantized_weight(kernel, expert, hidden, rng, experts)
        up, up_buffers = _quantized_weight(kernel, expert, hidden, rng, experts)
        shared_gate, shared_gate_buffers = _quantized_weight(kernel, shared, hidden, rng)
        shared_up, shared_up_buffers = _quantized_weight(kernel, shared, hidden, rng)
        x = to_device(rng.standard_normal(hidden), dtype)
        h = np.full(k * expert + shared, np.nan, np.float32)  # fp32 scratch in both modes
        _dispatch(kernel, [args, x, ids, *gate_buffers, *up_buffers, *shared_gate_buffers, *shared_up_buffers, h],
                 (-(-max(expert, shared) // _MOE_GEMV_ROWS), k + 1, 1), (_MOE_GEMV_THREADS, 1, 1))
        xs = to_f64(x, dtype).astype(np.float32)
        pieces = [_silu64(reference.qmatmul(xs, g).astype(np.float64)) * reference.qmatmul(xs, u)
                  for g, u in [(gate.dequantize()[e], up.dequantize()[e]) for e in ids]
                  + [(shared_gate.dequantize(), shared_up.dequantize())]]
        return compare(kernel, shape, h, np.concatenate(pieces), "f32")
    down, down_buffers = _quantized_weight(kernel, hidden, expert, rng, experts)
    shared_down, shared_down_buffers = _quantized_weight(kernel, hidden, shared, rng)
    h = rng.standard_normal(k * expert + shared).astype(np.float32)
    weights = rng.dirichlet(np.ones(k)).astype(np.float32)
    gate_logit = np.array([0.4], np.float32)
    residual = to_device(2.0 * rng.standard_normal(hidden), dtype)
    out = poisoned((hidden,), dtype)
    _dispatch(kernel, [args, h, ids, weights, *down_buffers, *shared_down_buffers, gate_logit, residual, out],
             (hidden // _MOE_GEMV_ROWS, 1, 1), (_MOE_GEMV_THREADS, 1, 1))
    expected = to_f64(residual, dtype).copy()
    for slot, e in enumerate(ids):
        expected += float(weights[slot]) * reference.qmatmul(h[slot * expert : (slot + 1) * expert],
                                                            down.dequantize()[e])
    expected += reference.qmatmul(h[k * expert :], shared_down.dequantize()) / (1.0 + np.exp(-0.4))
    return compare(kernel, shape, to_f64(out, dtype), expected, dtype)


@case(r"moe_gate_up_swiglu_routed_(f32|bf16)(_sf32)?")
def moe_routed_case(kernel: str) -> Result:
    """Routing (softmax/top-k over f32 logits) and the RMSNorm folded into gate/up: the hidden scratch and the ids and
    weights it writes for moe_down_combine."""
    dtype = dtype_of(kernel)
    _, experts, k, hidden, expert, shared = _MOE_SHAPE
    rng = _rng(18)
    eps = 1e-6
    gate, gate_buffers = _quantized_weight(kernel, expert, hidden, rng, experts)
    up, up_buffers = _quantized_weight(kernel, expert, hidden, rng, experts)
    shared_gate, shared_gate_buffers = _quantized_weight(kernel, shared, hidden, rng)
    shared_up, shared_up_buffers = _quantized_weight(kernel, shared, hidden, rng)
    x = to_device(2.0 * rng.standard_normal(hidden), dtype)
    norm_weight = to_device(1.0 + 0.3 * rng.standard_normal(hidden), dtype)
    logits = (2.0 * rng.standard_normal((1, experts))).astype(np.float32)
    ids = np.full(k, 0xFFFFFFFF, np.uint32)
    weights = np.full(k, np.nan, np.float32)
    h = np.full(k * expert + shared, np.nan, np.float32)
    args = _moe_args(1, experts, k, hidden, expert, shared) + struct.pack("<fIII", eps, 0, 0, 0)  # MoeRoutedArgs
    _dispatch(kernel, [args, x, norm_weight, logits, ids, weights, *gate_buffers, *up_buffers, *shared_gate_buffers,
                       *shared_up_buffers, h],
              (-(-max(expert, shared) // _MOE_GEMV_ROWS), k + 1, 1), (_MOE_GEMV_THREADS, 1, 1))
    expected_ids, expected_weights = reference.moe_route(logits, k)
    xs = reference.rms_norm(to_f64(x, dtype), to_f64(norm_weight, dtype), eps)
    pieces = [_silu64(reference.qmatmul(xs, g).astype(np.float64)) * reference.qmatmul(xs, u)
              for g, u in [(gate.dequantize()[e], up.dequantize()[e]) for e in expected_ids[0]]
              + [(shared_gate.dequantize(), shared_up.dequantize())]]
    result = compare(kernel, f"E={experts} k={k} H={hidden} I={expert} Is={shared}",
                     np.concatenate([h, weights]), np.concatenate(pieces + [expected_weights[0]]), "f32")
    if not np.array_equal(ids.astype(np.int64), expected_ids[0]):
        return Result(kernel, result.shape + " (wrong expert ids)", result.error, False)
    return result


# ---- Gated DeltaNet (metal/gated_delta.metal) ----

_GDN_TAPS = 4


def _gdn_inputs(dtype: str, hk: int, hv: int, dk: int, dv: int, tokens: int,
                rng: np.random.Generator) -> dict[str, np.ndarray]:
    c = 2 * hk * dk + hv * dv
    return {
        "qkv": to_device(rng.standard_normal((tokens, c)), dtype),
        "z": to_device(rng.standard_normal((tokens, hv * dv)), dtype),
        "b": to_device(rng.standard_normal((tokens, hv)), dtype),
        "a": to_device(4.0 * rng.standard_normal((tokens, hv)), dtype),
        "conv_weight": to_device(0.5 * rng.standard_normal((c, _GDN_TAPS)), dtype),
        "a_log": np.log(rng.uniform(1.0, 16.0, hv)).astype(np.float32),
        "dt_bias": rng.standard_normal(hv).astype(np.float32),
        "norm_weight": to_device(1.0 + 0.2 * rng.standard_normal(dv), dtype),
        "conv_state": to_device(rng.standard_normal((_GDN_TAPS - 1, c)), dtype),
        "state": np.ascontiguousarray(0.3 * rng.standard_normal((hv, dv, dk)), np.float32),  # [Hv, dv, Dk]
    }


def _gdn_reference(inp: dict[str, np.ndarray], dtype: str, hk: int, hv: int, dk: int, dv: int):
    """lily.reference's DeltaNet pieces: outputs [T, Hv*dv], conv output [T, C], state [Hv, dv, Dk]."""
    qkv = to_f64(inp["qkv"], dtype)
    t = qkv.shape[0]
    mixed, _ = reference.causal_conv1d(qkv, to_f64(inp["conv_weight"], dtype), to_f64(inp["conv_state"], dtype))
    key_dim = hk * dk
    q = reference.l2_normalize(mixed[:, :key_dim].reshape(t, hk, dk)) * np.float32(dk**-0.5)
    k = reference.l2_normalize(mixed[:, key_dim : 2 * key_dim].reshape(t, hk, dk))
    v = mixed[:, 2 * key_dim :].reshape(t, hv, dv)
    beta = 1.0 / (1.0 + np.exp(-to_f64(inp["b"], dtype)))
    g = -np.exp(inp["a_log"].astype(np.float64)) * np.logaddexp(0.0, to_f64(inp["a"], dtype) + inp["dt_bias"])
    o, state = reference.gated_delta_rule(q, k, v, g, beta, inp["state"].transpose(0, 2, 1))
    z = to_f64(inp["z"], dtype).reshape(t, hv, dv)
    y = reference.gated_rms_norm(o, z, to_f64(inp["norm_weight"], dtype), 1e-6).reshape(t, hv * dv)
    return y, mixed, state.transpose(0, 2, 1)


def _gdn_args(tokens: int, hk: int, hv: int, dv: int) -> bytes:
    return struct.pack("<IIIIffII", tokens, hk, hv, dv, 1e-6, 1e-6, 0, 0)  # lily::GatedDeltaArgs


@case(r"gated_delta_(step|conv|prefill|prefill_blockwise)_(f32|f16|bf16)_dk(128|64)")
def gated_delta_case(kernel: str) -> Result:
    # One key head with 2 value heads: the model's (dk = dv = 128, 256 state rows) or the demo model's (dk = dv = 64).
    dk = int(re.search(r"_dk(\d+)$", kernel).group(1))
    dtype, hk, hv, dv = dtype_of(kernel), 1, 2, dk
    # The blockwise scan gets more tokens than its 16-token block, so its state makes a round trip through memory.
    tokens = 1 if "_step_" in kernel else 19 if "_blockwise_" in kernel else 4
    inp = _gdn_inputs(dtype, hk, hv, dk, dv, tokens, _rng(2))
    y, mixed, state = _gdn_reference(inp, dtype, hk, hv, dk, dv)
    args, shape = _gdn_args(tokens, hk, hv, dv), f"T={tokens} Hk={hk} Hv={hv} dk={dk} dv={dv}"
    out = poisoned((tokens, hv * dv), dtype)
    if "_conv_" in kernel:
        conv_out = np.full(mixed.shape, np.nan, np.float32)
        _dispatch(kernel, [args, inp["qkv"], inp["conv_weight"], inp["conv_state"], conv_out],
                 (-(-mixed.shape[1] // 256), 1, 1), (256, 1, 1))
        return compare(kernel, shape, conv_out, mixed, "f32")
    if "_step_" in kernel:  # one threadgroup per key head
        buffers = [args, inp["qkv"], inp["z"], inp["b"], inp["a"], inp["conv_weight"], inp["a_log"], inp["dt_bias"],
                   inp["norm_weight"], inp["conv_state"], inp["state"], out]
        grid, threads = hk, 1024
    else:  # one threadgroup per value head, 8 state rows per simdgroup
        conv_out = np.ascontiguousarray(mixed, np.float32)
        buffers = [args, conv_out, inp["z"], inp["b"], inp["a"], inp["a_log"], inp["dt_bias"], inp["norm_weight"],
                   inp["state"], out]
        grid, threads = hv, 32 * dv // 8
    _dispatch(kernel, buffers, (grid, 1, 1), (threads, 1, 1))
    result = compare(kernel, shape, to_f64(out, dtype), y, dtype)
    state_check = compare(kernel, shape, inp["state"], state, "f32")
    if not state_check.passed:
        return Result(kernel, shape + " (state)", state_check.error, False)
    return result


# ---- token selection (metal/sampling.metal) ----


@case(r"argmax_partial_(f32|f16|bf16)")
def argmax_partial_case(kernel: str) -> Result:
    dtype, vocab, block = dtype_of(kernel), 5000, 1024
    logits = to_device(4.0 * _rng(3).standard_normal(vocab), dtype)
    partials = -(-vocab // block)
    values, ids = np.full(partials, np.nan, np.float32), np.full(partials, 0xFFFFFFFF, np.uint32)
    _dispatch(kernel, [struct.pack("<IIII", vocab, block, partials, 0), logits, values, ids],
             (partials, 1, 1), (256, 1, 1))
    widened = to_f64(logits, dtype)
    expected = [{int(np.argmax(widened[s : s + block])) + s} for s in range(0, vocab, block)]
    return compare_ids(kernel, f"vocab={vocab} block={block}", ids, expected)


@case(r"argmax_final_f32")
def argmax_final_case(kernel: str) -> Result:
    partials = 61  # the model's vocabulary in blocks of LILY_ARGMAX_BLOCK
    rng = _rng(4)
    values = np.round(rng.standard_normal(partials), 1).astype(np.float32)  # rounding makes ties likely
    ids = rng.permutation(partials * 10)[:partials].astype(np.uint32)
    tokens = np.full(2, 0xFFFFFFFF, np.uint32)
    _dispatch(kernel, [struct.pack("<IIII", 248320, 4096, partials, 1), values, ids, tokens], (1, 1, 1),
             (64, 1, 1))
    best = values.max()
    return compare_ids(kernel, f"partials={partials}", [tokens[1]], [{int(ids[values == best].min())}])


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al. 2011), the sampling kernel's random stream, in Python integers."""
    mask = 0xFFFFFFFF
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & mask, p1 & mask, ((p0 >> 32) ^ c3 ^ k1) & mask, p0 & mask
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0, c1, c2, c3


def _expected_sample(x: np.ndarray, top_k: int, top_p: float, u: float) -> int:
    keep = top_k_mask(x, top_k)
    probs = np.exp(log_softmax(np.where(keep, x, -np.inf)))
    keep &= top_p_mask(probs, top_p)
    cdf = np.cumsum(np.where(keep, probs, 0.0))
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), np.flatnonzero(keep)[-1]))


@case(r"sample_(f32|f16|bf16)")
def sample_case(kernel: str) -> Result:
    dtype, vocab, temperature, top_k, top_p, seed = dtype_of(kernel), 2000, 0.7, 20, 0.95, 2026
    logits = to_device(3.0 * _rng(5).standard_normal(vocab), dtype)
    x = (to_f64(logits, dtype).astype(np.float32) / np.float32(temperature)).astype(np.float64)
    got, allowed = [], []
    for step in range(4):
        tokens = np.full(1, 0xFFFFFFFF, np.uint32)
        args = struct.pack("<IIfffIIIIIII", vocab, top_k, temperature, top_p, 0.0, seed, 0, step, 0, 0, 0, 0)
        _dispatch(kernel, [args, logits, tokens], (1, 1, 1), (256, 1, 1))
        got.append(int(tokens[0]))
        u = (philox4x32_10((step, 0, 0, 0), (seed, 0))[0] >> 8) * 2.0**-24
        # fp32 sums in the kernel: accept the answers of u and top_p nudged by a few fp32 ulps of the total mass.
        allowed.append({_expected_sample(x, top_k, p, v) for p in (top_p, top_p * (1 + 1e-5), top_p * (1 - 1e-5))
                        for v in (u, max(u - 2e-6, 0.0), min(u + 2e-6, 1 - 2.0**-24))})
    return compare_ids(kernel, f"vocab={vocab} T={temperature} top_k={top_k} top_p={top_p} steps=4", got, allowed)


# ---- running ----


def run(kernels: Sequence[str], cases: Sequence[tuple[re.Pattern[str], Builder]] | None = None,
        device: KernelDevice | None = None) -> list[Result]:
    """Run the case of each kernel on `device` (default: ``open_device("auto")``); a kernel without a case, or whose
    case raises, is a failed row."""
    cases = CASES if cases is None else cases
    previous, _device[0] = _device[0], device if device is not None else open_device("auto")
    results = []
    try:
        for kernel in kernels:
            builder = find_builder(kernel, cases)
            if builder is None:
                results.append(Result(kernel, "no selftest case", float("nan"), False))
                continue
            try:
                results.append(builder(kernel))
            except Exception as exc:  # a crashing case is a failure row, and the other kernels still run
                results.append(Result(kernel, f"error: {type(exc).__name__}: {exc}", float("nan"), False))
    finally:
        _device[0] = previous
    return results


def _table(results: Sequence[Result]) -> str:
    rows = [("kernel", "shape", "error", "passed")]
    rows += [(r.kernel, r.shape, f"{r.error:.3g}", "yes" if r.passed else "NO") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _compile_cuda(ptx_out: str | None = None) -> int:
    """--device cuda --compile-only: every kernel of metal/ through clang (CUDA) and ptxas, one row per kernel; the PTX
    is kept in `ptx_out` when given (a folder for LILY_CUDA_PTX_DIR)."""
    import importlib.util
    import tempfile
    from pathlib import Path

    # The kernel sources and the build tool live in Lily's source tree: an editable install's, $LILY_SOURCE_DIR, or
    # the current directory (a checkout where `pip install .` was run).
    roots = [Path(__file__).resolve().parents[2], Path.cwd()]
    if os.environ.get("LILY_SOURCE_DIR"):
        roots.insert(0, Path(os.environ["LILY_SOURCE_DIR"]))
    tools = [root / "tools" / "cuda_kernels.py" for root in roots]
    tool = next((t for t in tools if t.is_file()), None)
    if tool is None:
        print("lily.selftest: --compile-only needs Lily's source tree (tools/cuda_kernels.py is not at "
              f"{', '.join(map(str, tools))}); run it in a checkout or set LILY_SOURCE_DIR. Nothing was compiled.",
              file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("lily_cuda_kernels", tool)
    builder = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = builder  # its dataclasses look their module up
    spec.loader.exec_module(builder)
    with tempfile.TemporaryDirectory() as scratch:
        try:
            built = builder.build(Path(ptx_out or scratch))
        except (builder.ToolchainError, RuntimeError) as exc:
            print(f"lily.selftest: {exc}", file=sys.stderr)
            return 1
    archs = " ".join(builder.CHECK_ARCHS)
    rows = [Result(k, f"{ptx} ptxas {archs}", 0.0, True) for ptx, names in sorted(built.items()) for k in names]
    print(_table(rows))
    print(f"\n{len(rows)} kernels compiled for CUDA ({builder.DEFAULT_ARCH} PTX) and assembled by ptxas for {archs}. "
          "No GPU was used.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m lily.selftest", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list of {kernel, shape, error, passed}")
    parser.add_argument("--device", choices=["auto", "metal-api", "harness", "cuda"], default="auto",
                        help="metal-api: through the Metal API (the GPU on a Mac, the fake Metal on Linux); "
                             "harness: the Linux CPU execution harness; cuda: an NVIDIA GPU through the CUDA driver "
                             "(docs/cuda.md); auto (default): metal-api on a Mac, harness elsewhere")
    parser.add_argument("--compile-only", action="store_true",
                        help="with --device cuda: compile every kernel for the NVIDIA targets and check it with "
                             "ptxas; no GPU needed")
    parser.add_argument("--ptx-out", metavar="DIR", help="with --compile-only: keep the PTX files in DIR")
    parser.add_argument("--kernels", metavar="REGEX", help="only the instantiated kernels whose name matches REGEX")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--corrupt", metavar="KERNEL", action="append", default=[],
                        help="perturb KERNEL's expected result (checks that a failing case is reported)")
    args = parser.parse_args(argv)
    if args.compile_only:
        if args.device != "cuda":
            print("lily.selftest: --compile-only needs --device cuda", file=sys.stderr)
            return 2
        return _compile_cuda(args.ptx_out)

    try:
        device = open_device(args.device)
    except ImportError as exc:
        if args.device == "harness" or platform.system() != "Darwin":
            where = "on macOS the harness is not built; use --device metal-api" if platform.system() == "Darwin" \
                else f"import failed: {exc}"
            print(f"lily.selftest: the CPU kernel harness lily._ext.msl is absent ({where}). Nothing was tested.",
                  file=sys.stderr)
        else:
            print(f"lily.selftest: the Metal kernel runner lily._ext.kernels is absent (import failed: {exc}; "
                  "rebuild Lily). Nothing was tested.", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # no Metal/CUDA device, or the kernel source does not compile
        what = "CUDA" if args.device == "cuda" else "Metal"
        print(f"lily.selftest: cannot open the {what} device: {exc}. Nothing was tested.", file=sys.stderr)
        return 2
    if device.gpu_tested:
        api = "the CUDA driver API" if device.kind == "cuda" else "the Metal API"
        print(f"lily.selftest: running the kernels on the GPU '{device.name}' through {api}", file=sys.stderr)
    if device.missing:
        print(f"lily.selftest: not compiled for this GPU, so not run (their #if is false here): "
              f"{', '.join(device.missing)}", file=sys.stderr)
    for failure in device.failed_families:
        print(f"lily.selftest: the kernel family '{failure['family']}' ({failure['file']}) did not compile; its "
              f"{len(failure['kernels'])} kernels fail below. Metal says: {failure['diagnostic']}", file=sys.stderr)

    kernels = device.kernels
    if args.kernels:
        pattern = re.compile(args.kernels)
        kernels = [k for k in kernels if pattern.search(k)]
        if not kernels:
            print(f"lily.selftest: --kernels {args.kernels!r} matches no instantiated kernel", file=sys.stderr)
            return 2
    unknown = [k for k in args.corrupt if k not in kernels]
    if unknown:
        print(f"lily.selftest: --corrupt names kernels that are not run: {unknown}", file=sys.stderr)
        return 2
    _corrupted.clear()  # main() may run more than once in a process (tests)
    _corrupted.update(args.corrupt)
    _seed[0] = args.seed

    results = run(kernels, device=device)
    if args.json:
        # Strict JSON: an error that could not be measured (NaN) is null.
        rows = [{**asdict(r), "error": r.error if np.isfinite(r.error) else None} for r in results]
        print(json.dumps(rows))
    else:
        print(_table(results))
        failed = [r.kernel for r in results if not r.passed]
        print(f"\n{len(results) - len(failed)}/{len(results)} kernels passed. {device.note()}")
        if failed:
            print("failed: " + ", ".join(failed))
        if device.failed_families:
            print("families that did not compile: " + ", ".join(
                f"{f['family']} ({f['file']})" for f in device.failed_families))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
