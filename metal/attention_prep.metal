// Attention preparation: everything between the q/k/v projections and the attention core.
//   attention_prep_<dtype>_d<D>   for each token t and head: split q_proj's per-head [query | gate] row, RMS-norm the
//                                 query (q_norm) and the key (k_norm) over all head_dim dims with the multiplier
//                                 (canonical 1+w), apply partial rotary embedding to the first rotary_dim dims
//                                 (rotate-half pairing (d, d + rotary_dim/2), inv_freq = theta^(-2i/rotary_dim),
//                                 position = first_position + t), write q and the gate to their own buffers, and
//                                 write the roped key and the value into the KV cache at row first_position + t.
//                                 One kernel for decode (T = 1) and prefill (T tokens): the rows are independent.
// Dtypes: activations (q_and_gate, k, v, norms, q, gate) are T; the cache is C = bf16 for bf16 and f16 activations,
// f32 in float32 mode. Instantiated for head_dim 256 (the model's; f32, bf16, f16) and 64 (the demo model and test
// fixtures; f32 and bf16), where lanes 16..31 of each simdgroup idle: a 64-dim row is only 16 chunks of 4.
// Layout: q_and_gate [T, Hq, 2D]; k, v [T, Hkv, D]; q, gate [T, Hq, D]; k_cache, v_cache [Hkv, capacity, D].
// Dispatch: one simdgroup per (token, head) row, rows t*(Hq+Hkv) + h with h < Hq a query head and h >= Hq key head
// h - Hq (which also copies its value row); any 32*n threads per threadgroup, ceil(rows / n) threadgroups.
// Traffic per token: reads 2D per query head and 2D per KV head (plus the two [D] norms, cached), writes 2D per query
// head (q and gate: 16 KiB in bf16 for the model; the gate copy costs 8 KiB but lets the attention kernels read
// plain [Hq, D] rows) and 2D per KV head into the cache.
// Numerics: fp32 throughout (sum of squares, norm, angle, rotation), one rounding per stored element. The angle is
// formed in fp32 (float(position) * inv_freq), as the reference and the model's training do. The row transform is
// attention_prep_row (attention_prep.h), which the fused decode attention kernels share.
#include <metal_stdlib>
#include "attention_prep.h"
#include "lily.h"

using namespace metal;

template <typename T, typename C, uint D>
[[kernel]] void attention_prep(constant lily::AttentionPrepArgs& args [[buffer(0)]],
                               device const T* q_and_gate [[buffer(1)]],
                               device const T* k [[buffer(2)]],
                               device const T* v [[buffer(3)]],
                               device const T* q_norm [[buffer(4)]],
                               device const T* k_norm [[buffer(5)]],
                               device T* q_out [[buffer(6)]],
                               device T* gate_out [[buffer(7)]],
                               device C* k_cache [[buffer(8)]],
                               device C* v_cache [[buffer(9)]],
                               uint group [[threadgroup_position_in_grid]],
                               uint simd_lane [[thread_index_in_simdgroup]],
                               uint simd_group [[simdgroup_index_in_threadgroup]],
                               uint n_simdgroups [[simdgroups_per_threadgroup]]) {
  constexpr uint CPL = (D / 4 + 31) / 32;
  const uint heads_per_token = args.num_heads + args.num_kv_heads;
  const uint row = group * n_simdgroups + simd_group;
  if (row >= args.num_tokens * heads_per_token) {
    return;  // whole simdgroup: no collective is left behind
  }
  const uint t = row / heads_per_token;
  const uint head = row % heads_per_token;
  const bool is_query = head < args.num_heads;
  const uint kv_head = head - args.num_heads;  // meaningful only for key rows
  const uint position = args.first_position + t;

  // The row's rotary angles from the arguments alone, before the wait (pow, cos and sin: a chain the dispatch
  // before can hide); then its inputs, which that dispatch writes.
  const AttnRopeAngles<D> angles = attention_rope_angles<D>(float(position), args.rotary_dim, args.rope_theta,
                                                            simd_lane);
  lily::grid_dependency_wait();
  device const T* x = is_query ? q_and_gate + (size_t(t) * args.num_heads + head) * (2 * D)
                               : k + (size_t(t) * args.num_kv_heads + kv_head) * D;
  const AttnPrepRow<D> rotated = attention_prep_row<T, D>(x, is_query ? q_norm : k_norm, angles, args.rotary_dim,
                                                          args.eps, simd_lane);
  if (!attn_prep_lane_active<D>(simd_lane)) {
    return;  // nothing left to store, and no collective follows
  }
  if (is_query) {
    const size_t out_row = (size_t(t) * args.num_heads + head) * D;
    for (uint c = 0; c < CPL; ++c) {
      const uint e = 4 * (simd_lane + 32 * c);
      lily::attn_store4(q_out + out_row + e, rotated.chunk[c]);
      *((device vec<T, 4>*)(gate_out + out_row + e)) = *((device const vec<T, 4>*)(x + D + e));  // exact copy
    }
  } else {
    const size_t cache_row = (size_t(kv_head) * args.cache_capacity + position) * D;
    device const T* v_row = v + (size_t(t) * args.num_kv_heads + kv_head) * D;
    for (uint c = 0; c < CPL; ++c) {
      const uint e = 4 * (simd_lane + 32 * c);
      lily::attn_store4(k_cache + cache_row + e, rotated.chunk[c]);
      lily::attn_store4(v_cache + cache_row + e, lily::attn_load4(v_row + e));
    }
  }
}

LILY_INSTANTIATE_EARLY_KERNEL("attention_prep_f32_d256", attention_prep, float, float, 256)
LILY_INSTANTIATE_EARLY_KERNEL("attention_prep_bf16_d256", attention_prep, bfloat, bfloat, 256)
// Demo model and tiny fixtures (head dim 64): float32 and bf16 modes.
LILY_INSTANTIATE_EARLY_KERNEL("attention_prep_f32_d64", attention_prep, float, float, 64)
LILY_INSTANTIATE_EARLY_KERNEL("attention_prep_bf16_d64", attention_prep, bfloat, bfloat, 64)
