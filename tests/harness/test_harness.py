"""Self-tests of the MSL CPU execution harness (docs/harness.md).

The deliberately broken kernels in tests/harness/broken_*.metal must be caught: a missing barrier (wrong
result under every schedule seed), divergent SIMD collectives, barrier divergence, out-of-bounds writes
and a deadlock. tests/harness/shim_semantics.metal pins down the shim: vector conversions, per-operation
half/bfloat rounding, simdgroup_matrix, atomics and SIMD collectives, compared with numpy.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lily._ext import msl
from lily.quant import round_to_dtype

ROOT = Path(__file__).resolve().parents[2]
SEEDS = range(8)


def where(kernel: str) -> str:
    """The start of every fault message: kernel, threadgroup and thread."""
    return rf"kernel '{kernel}' threadgroup \(0,0,0\) thread \(\d+,0,0\)"


# ---- (a) a missing threadgroup_barrier ----


@pytest.mark.parametrize("seed", SEEDS)
def test_missing_barrier_gives_wrong_result_for_every_seed(seed: int) -> None:
    n = 64
    values = np.arange(1, n + 1, dtype=np.float32)
    expected = np.roll(values, -1)
    with_barrier = np.full(n, np.nan, np.float32)
    msl.dispatch("broken_missing_barrier", [values, with_barrier], (1, 1, 1), (n, 1, 1), constants={0: True}, seed=seed)
    np.testing.assert_array_equal(with_barrier, expected)
    without = np.full(n, np.nan, np.float32)
    msl.dispatch("broken_missing_barrier", [values, without], (1, 1, 1), (n, 1, 1), constants={0: False}, seed=seed)
    assert not np.array_equal(without, expected), f"seed {seed}: the missing barrier went unnoticed"
    assert np.isnan(without).any(), "reads before the neighbour's write must see the NaN poison"


def test_random_schedule_is_seeded() -> None:
    n = 64
    values = np.arange(n, dtype=np.float32)
    runs = {}
    for seed in (3, 3, 4):
        out = np.full(n, np.nan, np.float32)
        msl.dispatch("broken_missing_barrier", [values, out], (1, 1, 1), (n, 1, 1), constants={0: False}, seed=seed)
        runs.setdefault(seed, []).append(np.isnan(out))
    np.testing.assert_array_equal(runs[3][0], runs[3][1])
    assert not np.array_equal(runs[3][0], runs[4][0]), "different seeds should give different schedules"


def test_unpoisoned_threadgroup_memory_starts_zeroed() -> None:
    n = 32
    values = np.arange(1, n + 1, dtype=np.float32)
    out = np.full(n, np.nan, np.float32)
    msl.dispatch(
        "broken_missing_barrier",
        [values, out],
        (1, 1, 1),
        (n, 1, 1),
        constants={0: False},
        random_schedule=False,
        poison_threadgroup_memory=False,
    )
    # In FIFO order each thread reads its neighbour's slot before the neighbour wrote it; the last reads slot 0.
    expected = np.zeros(n, np.float32)
    expected[-1] = values[0]
    np.testing.assert_array_equal(out, expected)


# ---- (b) divergent SIMD collectives ----


def test_lanes_in_different_collectives_are_reported() -> None:
    x = np.ones(64, np.float32)
    out = np.zeros(64, np.float32)
    with pytest.raises(msl.KernelError, match=where("broken_collective_kinds") + ".*divergent SIMD collective.*simd_(sum|max).*simd_(sum|max)"):
        msl.dispatch("broken_collective_kinds", [x, out], (1, 1, 1), (64, 1, 1))


def test_lanes_skipping_a_collective_are_reported() -> None:
    x = np.ones(64, np.float32)
    out = np.zeros(64, np.float32)
    with pytest.raises(msl.KernelError, match=where("broken_collective_skipped") + ".*divergent SIMD collective.*simd_sum.*threadgroup_barrier"):
        msl.dispatch("broken_collective_skipped", [x, out], (1, 1, 1), (64, 1, 1))


# ---- (c) barrier divergence ----


def test_early_return_before_a_barrier_is_reported() -> None:
    x = np.arange(64, dtype=np.float32)
    out = np.zeros(64, np.float32)
    with pytest.raises(msl.KernelError, match=where("broken_barrier_early_return") + ": barrier divergence.*returned"):
        msl.dispatch("broken_barrier_early_return", [x, out, struct.pack("<I", 40)], (1, 1, 1), (64, 1, 1))


def test_same_kernel_passes_when_no_thread_returns() -> None:
    x = np.arange(64, dtype=np.float32)
    out = np.full(64, np.nan, np.float32)
    msl.dispatch("broken_barrier_early_return", [x, out, struct.pack("<I", 64)], (1, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(out, x[::-1])


def test_threads_at_different_barriers_are_reported() -> None:
    out = np.zeros(64, np.float32)
    message = where("broken_barrier_branches") + ": barrier divergence: .* at .*broken_barriers.metal:\\d+ while .* at .*broken_barriers.metal:\\d+"
    with pytest.raises(msl.KernelError, match=message):
        msl.dispatch("broken_barrier_branches", [out], (1, 1, 1), (64, 1, 1))


# ---- (d) out-of-bounds writes ----


def test_device_buffer_overflow_names_the_buffer() -> None:
    x = np.ones(64, np.float32)
    out = np.zeros(64, np.float32)
    with pytest.raises(msl.KernelError, match=r"kernel 'broken_device_overflow': out-of-bounds write to buffer\(1\)"):
        msl.dispatch("broken_device_overflow", [x, out], (2, 1, 1), (32, 1, 1))


def test_threadgroup_array_overflow_is_reported() -> None:
    out = np.zeros(32, np.float32)
    with pytest.raises(msl.KernelError, match=r"out-of-bounds write past the end of threadgroup array 'scratch"):
        msl.dispatch("broken_threadgroup_overflow", [out], (1, 1, 1), (32, 1, 1))


# ---- (e) deadlock ----


@pytest.mark.parametrize("threadgroups", [1, 3])
def test_deadlock_is_reported(threadgroups: int) -> None:
    flag = np.zeros(1, np.uint32)
    with pytest.raises(msl.KernelError, match=r"kernel 'broken_deadlock' threadgroup \(\d,0,0\) thread \(0,0,0\): deadlock"):
        msl.dispatch("broken_deadlock", [flag], (threadgroups, 1, 1), (4, 1, 1))


# ---- shim semantics ----


def test_vector_constructors_convert_and_swizzle() -> None:
    rng = np.random.default_rng(0)
    ints = rng.integers(-1000, 1000, (16, 4)).astype(np.int32)
    converted = np.full((16, 4), np.nan, np.float32)
    swizzled = np.full((16, 4), np.nan, np.float32)
    narrowed = np.full((16, 4), np.nan, np.float16)
    msl.dispatch("harness_vector_semantics", [ints, converted, swizzled, narrowed], (1, 1, 1), (16, 1, 1))
    f = ints.astype(np.float32)
    np.testing.assert_array_equal(converted, f)  # a C-style cast would have bit-cast instead
    np.testing.assert_array_equal(swizzled, np.stack([f[:, 3], f[:, 2], np.full(16, 7), np.full(16, 7)], 1) + 0.5)
    np.testing.assert_array_equal(narrowed, (f * 0.5).astype(np.float16))


@pytest.mark.parametrize("guard", [True, False])
def test_a_buffer_off_its_vector_alignment_is_refused(guard: bool) -> None:
    """int4 elements need 16-byte addresses: a GPU faults on a misaligned vector load, so the harness refuses the
    binding before running anything (and the same kernel runs on the aligned buffer, with or without the guarded copy,
    whose addresses keep the caller's alignment)."""
    storage = np.zeros(16 * 4 + 4, np.int32)
    assert storage.ctypes.data % 16 == 0
    outputs = [np.full((16, 4), np.nan, np.float32), np.full((16, 4), np.nan, np.float32),
               np.full((16, 4), np.nan, np.float16)]
    with pytest.raises(ValueError, match=r"\[\[buffer\(0\)\]\] is not aligned to its 16-byte elements"):
        msl.dispatch("harness_vector_semantics", [storage[1:65].reshape(16, 4), *outputs], (1, 1, 1), (16, 1, 1),
                     guard=guard)
    assert np.isnan(outputs[0]).all()  # refused before any thread ran
    msl.dispatch("harness_vector_semantics", [storage[:64].reshape(16, 4), *outputs], (1, 1, 1), (16, 1, 1),
                 guard=guard)
    np.testing.assert_array_equal(outputs[0], 0.0)


def mul_add_inputs(rng: np.random.Generator, ulp: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random a, b in [0.5, 2), c in [-2, 2); element 0 is a*b+c with (1+3u)^2 - 1, which differs when rounded once."""
    a = rng.uniform(0.5, 2.0, 64)
    b = rng.uniform(0.5, 2.0, 64)
    c = rng.uniform(-2.0, 2.0, 64)
    a[0] = b[0] = 1.0 + 3 * ulp
    c[0] = -1.0
    return a, b, c


def test_half_rounds_after_every_operation() -> None:
    a, b, c = (v.astype(np.float16) for v in mul_add_inputs(np.random.default_rng(1), 2.0**-10))
    out = np.full(64, np.nan, np.float16)
    msl.dispatch("harness_mul_add_f16", [a, b, c, out], (1, 1, 1), (64, 1, 1))
    product = (a.astype(np.float64) * b).astype(np.float16)
    expected = (product.astype(np.float64) + c).astype(np.float16)
    np.testing.assert_array_equal(out, expected)
    assert out[0] == np.float16(6 * 2.0**-10), "a*b+c was not rounded after the multiply"


def test_bfloat_rounds_after_every_operation() -> None:
    def bf16(x: np.ndarray) -> np.ndarray:
        return round_to_dtype(x, "bfloat16").astype(np.float64)

    a, b, c = (bf16(v) for v in mul_add_inputs(np.random.default_rng(2), 2.0**-7))
    bits = [np.ascontiguousarray((v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)) for v in (a, b, c)]
    out = np.full(64, 0x7FC0, np.uint16)
    msl.dispatch("harness_mul_add_bf16", [*bits, out], (1, 1, 1), (64, 1, 1))
    got = (out.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    expected = bf16(bf16(a * b) + c)
    np.testing.assert_array_equal(got, expected)
    assert got[0] == 6 * 2.0**-7, "a*b+c was not rounded after the multiply"


@pytest.mark.parametrize("transposed", [False, True])
def test_simdgroup_matrix_multiply_accumulate(transposed: bool) -> None:
    rng = np.random.default_rng(3)
    a, b, c = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    stored_a = np.ascontiguousarray(a.T) if transposed else a
    d = np.full((8, 8), np.nan, np.float32)
    msl.dispatch("harness_simdgroup_mma", [stored_a, b, c, d], (1, 1, 1), (32, 1, 1), constants={0: transposed})
    np.testing.assert_allclose(d, a.astype(np.float64) @ b + c, rtol=1e-5, atol=1e-5)


def test_simdgroup_matrix_needs_a_full_simdgroup() -> None:
    m = np.ones((8, 8), np.float32)
    with pytest.raises(msl.KernelError, match="needs all 32 lanes"):
        msl.dispatch("harness_simdgroup_mma", [m, m, m, m.copy()], (1, 1, 1), (16, 1, 1), constants={0: False})


def test_atomics_from_all_threadgroups() -> None:
    rng = np.random.default_rng(4)
    values = rng.integers(-10**6, 10**6, 256).astype(np.int32)
    counter = np.zeros(1, np.uint32)
    maximum = np.full(1, np.iinfo(np.int32).min, np.int32)
    total = np.zeros(1, np.float32)
    msl.dispatch("harness_atomics", [counter, maximum, total, values], (4, 1, 1), (64, 1, 1))
    assert counter[0] == 256
    assert maximum[0] == values.max()
    assert total[0] == 128.0


def simd_reference(v: np.ndarray) -> np.ndarray:
    """The 12 results of harness_simd_collectives for one simdgroup's active lanes `v`."""
    n = len(v)
    lanes = np.arange(n)
    out = np.zeros((n, 12), np.int64)
    out[:, 0] = v.sum()
    out[:, 1] = v.max()
    out[:, 2] = v.min()
    out[:, 3] = np.cumsum(v)
    out[:, 4] = np.cumsum(v) - v
    out[:, 5] = v[lanes ^ 1]
    out[:, 6] = np.where(lanes + 3 < n, v[np.minimum(lanes + 3, n - 1)], v)
    out[:, 7] = v[2]
    out[:, 8] = sum(1 << i for i in range(n) if v[i] > 0)
    out[:, 9] = lanes == 0
    out[:, 10] = int((v > -1000).all()) + 2 * int((v > 0).any())
    out[:, 11] = np.where(lanes >= 1, v[np.maximum(lanes - 1, 0)], v)
    return out


def test_simd_collectives_with_a_partial_simdgroup() -> None:
    rng = np.random.default_rng(5)
    n = 48  # one full simdgroup and one of 16 lanes
    values = rng.integers(-50, 50, n).astype(np.int32)
    out = np.full((n, 12), -12345, np.int32)
    msl.dispatch("harness_simd_collectives", [values, out], (1, 1, 1), (n, 1, 1))
    expected = np.concatenate([simd_reference(values[:32]), simd_reference(values[32:])])
    np.testing.assert_array_equal(out.astype(np.int64) & 0xFFFFFFFF, expected & 0xFFFFFFFF)


def test_threadgroup_memory_parameter() -> None:
    x = np.arange(128, dtype=np.float32)
    out = np.full(128, np.nan, np.float32)
    msl.dispatch("harness_threadgroup_param", [x, out], (2, 1, 1), (64, 1, 1), threadgroup_memory=[256])
    np.testing.assert_array_equal(out, np.concatenate([x[:64][::-1], x[64:][::-1]]))
    with pytest.raises(ValueError, match=r"\[\[threadgroup\(0\)\]\] needs a threadgroup memory length"):
        msl.dispatch("harness_threadgroup_param", [x, out], (2, 1, 1), (64, 1, 1))


# ---- bad input ----


def test_bad_arguments_get_one_clear_error() -> None:
    x = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="unknown kernel 'no_such_kernel'"):
        msl.dispatch("no_such_kernel", [], (1, 1, 1), (1, 1, 1))
    with pytest.raises(ValueError, match="limit is 1024"):
        msl.dispatch("harness_threadgroup_param", [x, x], (1, 1, 1), (1025, 1, 1), threadgroup_memory=[16])
    with pytest.raises(ValueError, match=r"args\[1\].*read-only"):
        ro = np.zeros(64, np.float32)
        ro.flags.writeable = False
        msl.dispatch("broken_device_overflow", [x, ro], (1, 1, 1), (32, 1, 1))
    with pytest.raises(ValueError, match=r"args\[1\]: expected a numpy array.*got list"):
        msl.dispatch("broken_device_overflow", [x, [1.0, 2.0]], (1, 1, 1), (32, 1, 1))
    with pytest.raises(ValueError, match=r"buffer\(1\)\]\] is not bound"):
        msl.dispatch("broken_device_overflow", [x], (1, 1, 1), (32, 1, 1))
    with pytest.raises(ValueError, match="has no function constant with index 3"):
        msl.dispatch("broken_missing_barrier", [x, x.copy()], (1, 1, 1), (64, 1, 1), constants={3: True})


# ---- compile-time checks ----


def compile_metal(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    """Rewrite `source` with tools/msl2cpu.py and type-check it with clang++-19 against the shim."""
    src = tmp_path / "snippet.metal"
    src.write_text(source)
    rewrite = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "msl2cpu.py"), str(src), str(tmp_path)], capture_output=True, text=True
    )
    if rewrite.returncode != 0:
        return rewrite
    flags = ["-std=c++17", "-fsyntax-only", "-Wall", "-Wno-unknown-attributes", "-DMSL_CPU=1"]
    includes = [f"-I{ROOT / 'src' / 'msl_cpu' / 'include'}", f"-I{ROOT / 'src' / 'msl_cpu'}", f"-I{ROOT / 'metal'}"]
    return subprocess.run(
        ["clang++-19", *flags, *includes, str(tmp_path / "snippet.cpp")], capture_output=True, text=True
    )


def test_address_spaces_are_enforced_at_compile_time(tmp_path: Path) -> None:
    body = """
#include <metal_stdlib>
using namespace metal;
inline float first(thread const float* p) { return p[0]; }
[[kernel]] void k(device const float* x [[buffer(0)]], device float* y [[buffer(1)]]) {
  float local[1] = {x[0]};
  y[0] = first(%s);
}
"""
    ok = compile_metal(tmp_path, body % "local")
    assert ok.returncode == 0, ok.stderr
    bad = compile_metal(tmp_path, body % "x")
    assert bad.returncode != 0 and "address space" in bad.stderr


def test_rewriter_rejects_non_bool_function_constants(tmp_path: Path) -> None:
    result = compile_metal(tmp_path, "constant int tile [[function_constant(0)]];\n")
    assert result.returncode == 1
    assert "snippet.metal:1: function constant 'tile' is int" in result.stderr


SHIM_COVERAGE = """
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
#include <metal_atomic>
using namespace metal;

template <typename T>
[[kernel]] void everything(device const T* x [[buffer(0)]], device T* y [[buffer(1)]],
                           device atomic_uint* counter [[buffer(2)]],
                           uint3 tid [[thread_position_in_grid]], ushort lane [[thread_index_in_simdgroup]],
                           uint3 tg [[threadgroup_position_in_grid]], uint width [[thread_execution_width]]) {
  threadgroup T tile[8][8];
  threadgroup atomic_int local_count;
  T v = x[tid.x];
  vec<T, 4> v4 = vec<T, 4>(v);
  float4 f4 = float4(v4);
  half2 h2 = half2(f4.xy);
  bfloat2 b2 = bfloat2(h2);
  f4 = float4(float2(b2), 1.0h, 2.0);
  float s = 0.5f;
  s = metal::exp(f4.x) + precise::rsqrt(f4.y) + fast::exp2(f4.z) + metal::tanh(f4.w) + dot(f4, f4) +
            clamp(f4.x, 0.0f, 1.0f) + mix(f4.x, f4.y, 0.5f) + metal::max(f4, f4).x + fma(s, s, s) + abs(-s) +
            metal::pow(2.0f, 0.5f) + log2(8.0f) + sqrt(fabs(s)) + floor(s) + ceil(s) + fract(s) + select(1.0f, 2.0f, s > 0);
  T t = metal::exp(v) + metal::max(v, T(1)) + simd_sum(v) + simd_max(v) + simd_min(v) + simd_product(v) +
        simd_prefix_inclusive_product(v) + simd_prefix_exclusive_product(v) + simd_shuffle(v, lane ^ 3) +
        simd_broadcast_first(v);
  uint bits = simd_and(tid.x) | (simd_or(tid.x) ^ simd_xor(tid.x));
  half4 hv = simd_sum(half4(v4));
  bool first = simd_is_first();
  simd_vote vote = simd_active_threads_mask();
  simdgroup_barrier(mem_flags::mem_none);
  tile[lane % 8][lane / 8 % 8] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
  simdgroup_matrix<T, 8, 8> m = make_filled_simdgroup_matrix<T, 8, 8>(v);
  simdgroup_load(m, &tile[0][0], 8, ulong2(0, 0), true);
  simdgroup_matrix<T, 8, 8> acc = make_filled_simdgroup_matrix<T, 8, 8>(T(0));  // one element type, as Metal wants
  simdgroup_multiply_accumulate(acc, m, m, acc);
  simdgroup_multiply(acc, m, m);
  simdgroup_store(acc, y, 8);
  atomic_store_explicit(&local_count, 0, memory_order_relaxed);
  atomic_fetch_add_explicit(&local_count, 1, memory_order_relaxed);
  int expected = 1;
  atomic_compare_exchange_weak_explicit(&local_count, &expected, 2, memory_order_relaxed, memory_order_relaxed);
  atomic_fetch_or_explicit(counter, 1u, memory_order_relaxed);
  float limit = numeric_limits<T>::max() + INFINITY * 0.0f + M_PI_F;
  uint4 u = as_type<uint4>(f4);
  y[tid.x] = T(s + float(t) + float(hv.x) + float(bits + u.x + width + tg.z) + limit + float(first) + float(uint64_t(vote) != 0) +
               float(atomic_load_explicit(&local_count, memory_order_relaxed)) + float(isnan(s)) + float(all(f4 > 0.0f)));
}
template [[host_name("everything_f32")]] [[kernel]] decltype(everything<float>) everything<float>;
template [[host_name("everything_f16")]] [[kernel]] decltype(everything<half>) everything<half>;
template [[host_name("everything_bf16")]] [[kernel]] decltype(everything<bfloat>) everything<bfloat>;
"""


def test_shim_compiles_every_documented_feature(tmp_path: Path) -> None:
    """Types, constructors, math, every collective, atomics and simdgroup_matrix for float, half and bfloat."""
    result = compile_metal(tmp_path, SHIM_COVERAGE)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr, result.stderr


def test_lily_h_compiles_as_host_cpp(tmp_path: Path) -> None:
    """metal/lily.h is shared with the host engine: it must compile as plain C++17 (its static_asserts included)."""
    main = tmp_path / "host.cpp"
    main.write_text('#include "lily.h"\nint main() { return int(sizeof(lily::RmsNormArgs)) - 16; }\n')
    result = subprocess.run(
        ["clang++-19", "-std=c++17", "-fsyntax-only", "-Wall", f"-I{ROOT / 'metal'}", str(main)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and not result.stderr, result.stderr


def test_partly_overlapping_buffers_share_one_copy() -> None:
    """One Metal buffer bound at several offsets (how the engine binds a weights file) must work."""
    rng = np.random.default_rng(6)
    big = rng.uniform(0.5, 2.0, 128).astype(np.float16)
    a, b, c = big[0:64], big[32:96], big[64:128]
    out = np.full(64, np.nan, np.float16)
    msl.dispatch("harness_mul_add_f16", [a, b, c, out], (1, 1, 1), (64, 1, 1))
    expected = ((a.astype(np.float64) * b).astype(np.float16).astype(np.float64) + c).astype(np.float16)
    np.testing.assert_array_equal(out, expected)
    overflow_into = np.zeros(96, np.float32)
    with pytest.raises(msl.KernelError, match=r"out-of-bounds write to buffer\(1\)"):
        # buffer(1) = overflow_into[32:96] ends last: the write one past its end is caught
        msl.dispatch("broken_device_overflow", [overflow_into[:64], overflow_into[32:]], (1, 1, 1), (64, 1, 1))
