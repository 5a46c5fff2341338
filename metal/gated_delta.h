// Helpers shared by the Gated DeltaNet kernels (metal/gated_delta.metal: decode step; metal/gated_delta_prefill.metal:
// conv, scan and gated norm). Sharing every arithmetic helper is what makes T step dispatches and one conv + prefill of
// T tokens give identical bits.
#ifndef LILY_GATED_DELTA_H
#define LILY_GATED_DELTA_H

#include <metal_stdlib>
#include "activations.h"
#include "lily.h"

namespace lily {
using namespace metal;

// log(1 + e^x) as torch/FLA compute it (threshold 20); e^x below -15, where 1 + e^x would round away the answer.
inline float gdn_softplus(float x) {
  if (x > 20.0f) {
    return x;
  }
  if (x < -15.0f) {
    return precise::exp(x);
  }
  return precise::log(1.0f + precise::exp(x));
}

// SiLU of the causal conv of one channel: history[K-1] is the current token, history[0] the oldest.
inline float gdn_conv_silu(thread const float* history, thread const float* weight) {
  float acc = 0.0f;
  for (uint j = 0; j < LILY_GDN_CONV_KERNEL; ++j) {
    acc = fma(weight[j], history[j], acc);  // explicit fma: the same bits in the step and conv kernels
  }
  return silu(acc);
}

// Conv channel of local index `lc` of a key head: [q_i (Dk) | k_i (Dk) | v of its value heads ((Hv/Hk)·dv)].
template <uint Dk>
inline uint gdn_channel(uint lc, uint key_head, constant lily::GatedDeltaArgs& args) {
  const uint key_dim = args.num_k_heads * Dk;
  if (lc < Dk) {
    return key_head * Dk + lc;
  }
  if (lc < 2 * Dk) {
    return key_dim + key_head * Dk + (lc - Dk);
  }
  const uint rows = (args.num_v_heads / args.num_k_heads) * args.head_v_dim;
  return 2 * key_dim + key_head * rows + (lc - 2 * Dk);
}

// The log-decay g <= 0 of value head j for one token.
template <typename T>
inline float gdn_log_decay(uint j, uint token, constant lily::GatedDeltaArgs& args, device const T* a,
                           device const float* a_log, device const float* dt_bias) {
  const size_t idx = size_t(token) * args.num_v_heads + j;
  return -precise::exp(a_log[j]) * gdn_softplus(float(a[idx]) + dt_bias[j]);
}

// Beta and the decay exp(g) of value head j for one token.
template <typename T>
inline void gdn_gates(uint j, uint token, constant lily::GatedDeltaArgs& args, device const T* b, device const T* a,
                      device const float* a_log, device const float* dt_bias, threadgroup float* beta,
                      threadgroup float* decay) {
  *beta = sigmoid(float(b[size_t(token) * args.num_v_heads + j]));
  *decay = precise::exp(gdn_log_decay<T>(j, token, args, a, a_log, dt_bias));
}

// Each lane's Dk/32 consecutive elements of the L2-normalised q (times dk^-0.5) and k. Every simdgroup reduces the
// squares itself in the same order, so the result does not depend on the threadgroup size.
template <uint Dk>
LILY_INLINE void gdn_normalized_qk(threadgroup const float* q_raw, threadgroup const float* k_raw, float l2_eps,
                                   thread float* q, thread float* k, uint lane) {
  float q_sq = 0.0f;
  float k_sq = 0.0f;
  LILY_UNROLL
  for (uint e = 0; e < Dk / 32; ++e) {
    q[e] = q_raw[lane * (Dk / 32) + e];
    k[e] = k_raw[lane * (Dk / 32) + e];
    q_sq = fma(q[e], q[e], q_sq);
    k_sq = fma(k[e], k[e], k_sq);
  }
  q_sq = simd_sum(q_sq);
  k_sq = simd_sum(k_sq);
  const float q_factor = precise::rsqrt(q_sq + l2_eps) * precise::rsqrt(float(Dk));
  const float k_factor = precise::rsqrt(k_sq + l2_eps);
  LILY_UNROLL
  for (uint e = 0; e < Dk / 32; ++e) {
    q[e] *= q_factor;
    k[e] *= k_factor;
  }
}

// The delta rule on one state row (this lane's Dk/32 elements): decay, error against the decayed state, rank-1
// write, then the read-out o = S^T q AFTER the write. Returns o to every lane.
template <uint Dk>
LILY_INLINE float gdn_update_row(thread float* s, thread const float* q, thread const float* k, float alpha,
                                 float beta, float v) {
  float kv = 0.0f;
  LILY_UNROLL
  for (uint e = 0; e < Dk / 32; ++e) {
    s[e] *= alpha;
    kv = fma(s[e], k[e], kv);
  }
  kv = simd_sum(kv);
  const float delta = beta * (v - kv);
  float o = 0.0f;
  LILY_UNROLL
  for (uint e = 0; e < Dk / 32; ++e) {
    s[e] = fma(k[e], delta, s[e]);
    o = fma(s[e], q[e], o);
  }
  return simd_sum(o);
}

// SiLU(z)-gated RMSNorm of one value head's o [dv] by one simdgroup (fixed order: lane-strided sums, simd_sum).
// `Rows` is o's fp32 pointer: threadgroup memory in the decode step, the device scratch in gated_delta_prefill_norm.
template <typename T, typename Rows>
inline void gdn_gated_norm(Rows o, device const T* z, device const T* norm_weight, device T* out, uint dv, float eps,
                           uint lane) {
  float sq = 0.0f;
  for (uint d = lane; d < dv; d += 32) {
    sq = fma(o[d], o[d], sq);
  }
  const float inv_rms = precise::rsqrt(simd_sum(sq) / float(dv) + eps);
  for (uint d = lane; d < dv; d += 32) {
    out[d] = T(o[d] * inv_rms * float(norm_weight[d]) * silu(float(z[d])));
  }
}

}  // namespace lily

#endif  // LILY_GATED_DELTA_H
