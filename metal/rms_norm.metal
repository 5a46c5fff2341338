// RMSNorm over rows: out = x / sqrt(mean(x^2) + eps) * weight, with `weight` the multiplier (canonical 1+w).
//   rms_norm_<dtype>           one row per threadgroup: batch-1 decode (1 row) and prefill (T rows) alike.
//   rms_norm_residual_<dtype>  fused residual add: sum = x + residual (rounded to dtype and written),
//                              out = rms_norm(sum). `sum` may alias `x` or `residual`.
// Invariants: fp32 accumulation, one rounding per output element; any threads_per_threadgroup from 1 to 1024
// (partial simdgroups included); x, residual, out and sum are [rows, row_length], contiguous.
#include <metal_stdlib>
#include "lily.h"

using namespace metal;

// Sum of `value` over the threadgroup, returned to every thread. Every thread must call it.
inline float threadgroup_sum(float value, threadgroup float* partial, uint simd_lane, uint simd_group,
                             uint n_simdgroups) {
  float simd_total = simd_sum(value);
  if (simd_lane == 0) {
    partial[simd_group] = simd_total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint s = 0; s < n_simdgroups; ++s) {
    total += partial[s];  // same order in every thread: every thread gets the same bits
  }
  return total;
}

template <typename T>
[[kernel]] void rms_norm(constant lily::RmsNormArgs& args [[buffer(0)]],
                         device const T* x [[buffer(1)]],
                         device const T* weight [[buffer(2)]],
                         device T* out [[buffer(3)]],
                         uint row [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint n_threads [[threads_per_threadgroup]],
                         uint simd_lane [[thread_index_in_simdgroup]],
                         uint simd_group [[simdgroup_index_in_threadgroup]],
                         uint n_simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  const uint n = args.row_length;
  device const T* x_row = x + size_t(row) * n;
  device T* out_row = out + size_t(row) * n;

  float sum_sq = 0.0f;
  for (uint i = tid; i < n; i += n_threads) {
    float v = float(x_row[i]);
    sum_sq += v * v;
  }
  float total = threadgroup_sum(sum_sq, partial, simd_lane, simd_group, n_simdgroups);
  float inv_rms = precise::rsqrt(total / float(n) + args.eps);
  for (uint i = tid; i < n; i += n_threads) {
    out_row[i] = T(float(x_row[i]) * inv_rms * float(weight[i]));
  }
}

template <typename T>
[[kernel]] void rms_norm_residual(constant lily::RmsNormArgs& args [[buffer(0)]],
                                  device const T* x [[buffer(1)]],
                                  device const T* residual [[buffer(2)]],
                                  device const T* weight [[buffer(3)]],
                                  device T* out [[buffer(4)]],
                                  device T* sum [[buffer(5)]],
                                  uint row [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint n_threads [[threads_per_threadgroup]],
                                  uint simd_lane [[thread_index_in_simdgroup]],
                                  uint simd_group [[simdgroup_index_in_threadgroup]],
                                  uint n_simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  const uint n = args.row_length;
  const size_t base = size_t(row) * n;

  // The residual stream is stored in T, so the norm sees the rounded sum (as the unfused chain would).
  float sum_sq = 0.0f;
  for (uint i = tid; i < n; i += n_threads) {
    T h = T(float(x[base + i]) + float(residual[base + i]));
    sum[base + i] = h;
    float v = float(h);
    sum_sq += v * v;
  }
  float total = threadgroup_sum(sum_sq, partial, simd_lane, simd_group, n_simdgroups);
  float inv_rms = precise::rsqrt(total / float(n) + args.eps);
  // Each thread reads back only the elements it wrote itself: no barrier needed on `sum`.
  for (uint i = tid; i < n; i += n_threads) {
    out[base + i] = T(float(sum[base + i]) * inv_rms * float(weight[i]));
  }
}

LILY_INSTANTIATE_KERNEL("rms_norm_f32", rms_norm, float)
LILY_INSTANTIATE_KERNEL("rms_norm_bf16", rms_norm, bfloat)
LILY_INSTANTIATE_KERNEL("rms_norm_residual_f32", rms_norm_residual, float)
LILY_INSTANTIATE_KERNEL("rms_norm_residual_bf16", rms_norm_residual, bfloat)
