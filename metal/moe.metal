// Sparse MoE block, batch-1 decode: router softmax + top-k, then the selected experts and the shared
// expert as fused 4-bit GEMVs. The router logits come from the 8-bit router GEMV (qmatmul family); the shared expert
// gate's logit sigmoid(shared_expert_gate·x) is read from a buffer written by that same earlier dispatch.
//   moe_route_f32
//       fp32 softmax over E experts, top-k (ties to the lower expert id), renormalised over the k chosen: writes
//       expert ids (uint32) and weights (f32). One simdgroup per token row, so the same kernel routes a prefill chunk
//       (grid = T rows) with no CPU round trip.
//   moe_gate_up_swiglu_<dtype>[_sf32]
//       h = SiLU(gate·x) ⊙ (up·x) for the k routed experts (ids read from the GPU buffer) and the shared expert
//       (slot k), into an fp32 scratch hidden [k·I + Is].
//   moe_gate_up_swiglu_routed_<dtype>[_sf32]
//       moe_route and the post-attention RMSNorm folded into moe_gate_up_swiglu (decode fusion): x is the hidden
//       stream itself; every routed simdgroup recomputes the softmax/top-k over the E f32 logits (E/32 values per
//       lane, k simd_max/simd_min rounds: far cheaper than a dispatch and a barrier stage) to find its slot's expert,
//       and sums x^2 while it folds x ⊙ norm_weight into its dot products (1/rms applied after the sums). One thread
//       (threadgroup (0, 0), simdgroup 0, lane 0) writes the ids and renormalised weights moe_down_combine reads.
//       Extra reads per simdgroup: E logits and the H norm weights, from cache. Chosen whenever fusion is on.
//   moe_down_combine_<dtype>[_sf32]
//       out = residual + Σ_s w_s·down_s·h_s + sigmoid(gate logit)·down_shared·h_shared: the layer output written once
//       (out may alias residual: the residual stream updated in place).
// Weights: MLX affine 4-bit, group 64 along the input axis: codes packed 8 per uint32 (element 0 in the low bits),
// bf16 scales and biases (f32 with the _sf32 suffix: checkpoints converted from fp32 weights), w = scale·q + bias;
// routed experts stacked [E, out, in]. <dtype> is the activation type (f32: float32 mode, bf16: default, f16).
// GEMV shape (qmv_fast-like): 2 simdgroups × 4 output rows per threadgroup; lanes stride over K
// one uint32 (8 codes) at a time, so consecutive lanes read consecutive words of a row (coalesced), each x value is
// loaded once per lane and reused for 4 rows (×2 matrices in gate/up), and the affine dequantisation folds into
// scale·Σq·x + bias·Σx per group. fp32 accumulation; one simd_sum per output row at the end.
// Traffic per decode token at the model's sizes (H = 2048, I = Is = 512, k = 8): gate/up read 9 × 2 × 512 rows ×
// 1152 B (codes + scales + biases) ≈ 10.6 MB, down 9 × 2048 rows × 288 B ≈ 5.3 MB; activations are < 40 KB. The
// hidden scratch stays fp32 (18 KB written and read once): rounding it would save 9 KB and add an error.
#include <metal_stdlib>
#include "activations.h"
#include "lily.h"
#include "quantized.h"

using namespace metal;

constant constexpr uint MOE_ROWS = LILY_MOE_GEMV_ROWS_PER_SIMDGROUP;
constant constexpr uint MOE_ROWS_PER_THREADGROUP = LILY_MOE_GEMV_ROWS_PER_SIMDGROUP * LILY_MOE_GEMV_SIMDGROUPS;

constant constexpr uint MOE_PER_LANE = LILY_MOE_MAX_EXPERTS / 32;

// Softmax over one row of E router logits into p: expert e = lane + 32·j lives in p[j] of its lane. Called by a whole
// simdgroup (convergent).
template <typename T>
inline void moe_probabilities(device const T* logits, uint num_experts, uint lane, thread float* p) {
  float row_max = -INFINITY;
  for (uint j = 0; j < MOE_PER_LANE; ++j) {
    uint e = lane + 32 * j;
    p[j] = e < num_experts ? float(logits[e]) : -INFINITY;
    row_max = max(row_max, p[j]);
  }
  row_max = simd_max(row_max);
  float sum = 0.0f;
  for (uint j = 0; j < MOE_PER_LANE; ++j) {
    p[j] = lane + 32 * j < num_experts ? precise::exp(p[j] - row_max) : 0.0f;
    sum += p[j];
  }
  sum = simd_sum(sum);
  // Select on the normalised probabilities, as the reference does: rounding may merge near-equal values into ties,
  // and ties must then go to the lower id.
  for (uint j = 0; j < MOE_PER_LANE; ++j) {
    p[j] = p[j] / sum;
  }
}

// Round `round` of top-k: the largest probability not yet taken (ties to the lower id), marked taken; its probability
// goes to `top`. Every lane gets the same winner. Convergent.
inline uint moe_pick(thread const float* p, thread uint& taken, uint num_experts, uint lane, uint round,
                     thread float& top) {
  float best = -1.0f;  // below every probability, so a lane with no candidate never wins
  uint best_id = 0xFFFFFFFFu;
  for (uint j = 0; j < MOE_PER_LANE; ++j) {
    uint e = lane + 32 * j;
    // Strict '>' keeps the lowest id among equal values within the lane (e grows with j).
    if (e < num_experts && ((taken >> j) & 1u) == 0 && p[j] > best) {
      best = p[j];
      best_id = e;
    }
  }
  top = simd_max(best);
  uint winner = simd_min(best == top ? best_id : 0xFFFFFFFFu);
  if (winner >= num_experts) {
    // No candidate: the row's probabilities are NaN (a NaN or infinite logit). Keep the ids valid for the expert
    // kernels and let NaN weights carry the fault to the layer output.
    winner = round;
    top = NAN;
  }
  if (winner % 32 == lane) {
    taken |= 1u << (winner / 32);
  }
  return winner;
}

template <typename T>
[[kernel]] void moe_route(constant lily::MoeArgs& args [[buffer(0)]],
                          device const T* router_logits [[buffer(1)]],
                          device uint* expert_ids [[buffer(2)]],
                          device float* expert_weights [[buffer(3)]],
                          uint row [[threadgroup_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]]) {
  const uint num_experts = args.num_experts;
  const uint k = args.top_k;
  float p[MOE_PER_LANE];
  moe_probabilities(router_logits + size_t(row) * num_experts, num_experts, lane, p);

  // k rounds of argmax. Every lane sees the same winners in the same order, so lane 0 can write each as it is found
  // and renormalise its own writes afterwards: no per-thread array, and any k <= E works.
  device uint* row_ids = expert_ids + size_t(row) * k;
  device float* row_weights = expert_weights + size_t(row) * k;
  uint taken = 0;  // bit j: expert lane + 32·j already chosen
  float chosen_sum = 0.0f;
  for (uint r = 0; r < k; ++r) {
    float top;
    const uint winner = moe_pick(p, taken, num_experts, lane, r, top);
    chosen_sum += top;
    if (lane == 0) {
      row_ids[r] = winner;
      row_weights[r] = top;
    }
  }
  if (lane == 0) {
    for (uint r = 0; r < k; ++r) {
      row_weights[r] = row_weights[r] / chosen_sum;
    }
  }
}

// Grid: (ceil(max(I, Is) / 8), k + 1) threadgroups of 64 threads; threadgroup row y is slot y (slot k: shared).
template <typename T, typename S>
[[kernel]] void moe_gate_up_swiglu(constant lily::MoeArgs& args [[buffer(0)]],
                                   device const T* x [[buffer(1)]],
                                   device const uint* expert_ids [[buffer(2)]],
                                   device const uint* gate_weight [[buffer(3)]],
                                   device const S* gate_scales [[buffer(4)]],
                                   device const S* gate_biases [[buffer(5)]],
                                   device const uint* up_weight [[buffer(6)]],
                                   device const S* up_scales [[buffer(7)]],
                                   device const S* up_biases [[buffer(8)]],
                                   device const uint* shared_gate_weight [[buffer(9)]],
                                   device const S* shared_gate_scales [[buffer(10)]],
                                   device const S* shared_gate_biases [[buffer(11)]],
                                   device const uint* shared_up_weight [[buffer(12)]],
                                   device const S* shared_up_scales [[buffer(13)]],
                                   device const S* shared_up_biases [[buffer(14)]],
                                   device float* hidden [[buffer(15)]],
                                   uint2 group [[threadgroup_position_in_grid]],
                                   uint lane [[thread_index_in_simdgroup]],
                                   uint simd_group [[simdgroup_index_in_threadgroup]]) {
  const uint slot = group.y;
  const bool is_shared = slot == args.top_k;
  const uint out_rows = is_shared ? args.shared_expert_size : args.expert_size;
  const uint first_row = group.x * MOE_ROWS_PER_THREADGROUP + simd_group * MOE_ROWS;
  if (first_row >= out_rows) {
    return;  // the whole simdgroup leaves together (out_rows is a multiple of 64): collectives stay convergent
  }
  const uint words = args.hidden_size / 8;
  const uint groups = args.hidden_size / 64;
  size_t row0 = first_row;
  if (!is_shared) {
    row0 += size_t(expert_ids[slot]) * args.expert_size;
  }
  device const uint* wg = (is_shared ? shared_gate_weight : gate_weight) + row0 * words;
  device const S* sg = (is_shared ? shared_gate_scales : gate_scales) + row0 * groups;
  device const S* bg = (is_shared ? shared_gate_biases : gate_biases) + row0 * groups;
  device const uint* wu = (is_shared ? shared_up_weight : up_weight) + row0 * words;
  device const S* su = (is_shared ? shared_up_scales : up_scales) + row0 * groups;
  device const S* bu = (is_shared ? shared_up_biases : up_biases) + row0 * groups;

  float acc_gate[MOE_ROWS];
  float acc_up[MOE_ROWS];
  for (uint r = 0; r < MOE_ROWS; ++r) {
    acc_gate[r] = 0.0f;
    acc_up[r] = 0.0f;
  }
  for (uint w = lane; w < words; w += 32) {
    float xv[8];
    float x_sum = 0.0f;
    for (uint j = 0; j < 8; ++j) {
      xv[j] = float(x[8 * w + j]);
      x_sum += xv[j];
    }
    const uint g = w / 8;  // 8 words = one group of 64
    for (uint r = 0; r < MOE_ROWS; ++r) {
      acc_gate[r] += float(sg[r * groups + g]) * lily::dot_codes<4>(wg[r * words + w], xv)
                     + float(bg[r * groups + g]) * x_sum;
      acc_up[r] += float(su[r * groups + g]) * lily::dot_codes<4>(wu[r * words + w], xv)
                   + float(bu[r * groups + g]) * x_sum;
    }
  }
  device float* out = hidden + size_t(slot) * args.expert_size + first_row;
  for (uint r = 0; r < MOE_ROWS; ++r) {
    float gate = simd_sum(acc_gate[r]);
    float up = simd_sum(acc_up[r]);
    if (lane == r) {
      out[r] = lily::silu(gate) * up;
    }
  }
}

// moe_route and the post-attention RMSNorm folded into moe_gate_up_swiglu. Grid and slots as moe_gate_up_swiglu; x
// is the un-normalised hidden stream. Each routed simdgroup recomputes the softmax/top-k over the E f32 logits (E/32
// per lane, k rounds: cheaper than a dispatch and a barrier) to find its slot's expert, and sums x^2 over the row
// while it folds x ⊙ norm_weight into its dot products; 1/rms is applied after the sums. Threadgroup (0, 0),
// simdgroup 0, lane 0 writes the ids and renormalised weights that moe_down_combine reads.
template <typename T, typename S>
[[kernel]] void moe_gate_up_swiglu_routed(constant lily::MoeRoutedArgs& args [[buffer(0)]],
                                          device const T* x [[buffer(1)]],
                                          device const T* norm_weight [[buffer(2)]],
                                          device const float* router_logits [[buffer(3)]],
                                          device uint* expert_ids [[buffer(4)]],
                                          device float* expert_weights [[buffer(5)]],
                                          device const uint* gate_weight [[buffer(6)]],
                                          device const S* gate_scales [[buffer(7)]],
                                          device const S* gate_biases [[buffer(8)]],
                                          device const uint* up_weight [[buffer(9)]],
                                          device const S* up_scales [[buffer(10)]],
                                          device const S* up_biases [[buffer(11)]],
                                          device const uint* shared_gate_weight [[buffer(12)]],
                                          device const S* shared_gate_scales [[buffer(13)]],
                                          device const S* shared_gate_biases [[buffer(14)]],
                                          device const uint* shared_up_weight [[buffer(15)]],
                                          device const S* shared_up_scales [[buffer(16)]],
                                          device const S* shared_up_biases [[buffer(17)]],
                                          device float* hidden [[buffer(18)]],
                                          uint2 group [[threadgroup_position_in_grid]],
                                          uint lane [[thread_index_in_simdgroup]],
                                          uint simd_group [[simdgroup_index_in_threadgroup]]) {
  const uint slot = group.y;
  const uint k = args.moe.top_k;
  const bool is_shared = slot == k;
  const uint out_rows = is_shared ? args.moe.shared_expert_size : args.moe.expert_size;
  const uint first_row = group.x * MOE_ROWS_PER_THREADGROUP + simd_group * MOE_ROWS;
  if (first_row >= out_rows) {
    return;  // the whole simdgroup leaves together (out_rows is a multiple of 64): collectives stay convergent
  }
  uint expert = 0;
  if (!is_shared) {
    const uint num_experts = args.moe.num_experts;
    const bool writer = group.x == 0 && group.y == 0 && simd_group == 0 && lane == 0;
    float p[MOE_PER_LANE];
    moe_probabilities(router_logits, num_experts, lane, p);
    uint taken = 0;
    float chosen_sum = 0.0f;
    for (uint r = 0; r < k; ++r) {
      float top;
      const uint winner = moe_pick(p, taken, num_experts, lane, r, top);
      chosen_sum += top;
      if (r == slot) {
        expert = winner;
      }
      if (writer) {
        expert_ids[r] = winner;
        expert_weights[r] = top;
      }
    }
    if (writer) {
      for (uint r = 0; r < k; ++r) {
        expert_weights[r] = expert_weights[r] / chosen_sum;
      }
    }
  }
  const uint words = args.moe.hidden_size / 8;
  const uint groups = args.moe.hidden_size / 64;
  size_t row0 = first_row;
  if (!is_shared) {
    row0 += size_t(expert) * args.moe.expert_size;
  }
  device const uint* wg = (is_shared ? shared_gate_weight : gate_weight) + row0 * words;
  device const S* sg = (is_shared ? shared_gate_scales : gate_scales) + row0 * groups;
  device const S* bg = (is_shared ? shared_gate_biases : gate_biases) + row0 * groups;
  device const uint* wu = (is_shared ? shared_up_weight : up_weight) + row0 * words;
  device const S* su = (is_shared ? shared_up_scales : up_scales) + row0 * groups;
  device const S* bu = (is_shared ? shared_up_biases : up_biases) + row0 * groups;

  float acc_gate[MOE_ROWS];
  float acc_up[MOE_ROWS];
  for (uint r = 0; r < MOE_ROWS; ++r) {
    acc_gate[r] = 0.0f;
    acc_up[r] = 0.0f;
  }
  float sum_sq = 0.0f;
  for (uint w = lane; w < words; w += 32) {
    float xv[8];
    float x_sum = 0.0f;
    for (uint j = 0; j < 8; ++j) {
      const float v = float(x[8 * w + j]);
      sum_sq += v * v;
      xv[j] = v * float(norm_weight[8 * w + j]);
      x_sum += xv[j];
    }
    const uint g = w / 8;  // 8 words = one group of 64
    for (uint r = 0; r < MOE_ROWS; ++r) {
      acc_gate[r] += float(sg[r * groups + g]) * lily::dot_codes<4>(wg[r * words + w], xv)
                     + float(bg[r * groups + g]) * x_sum;
      acc_up[r] += float(su[r * groups + g]) * lily::dot_codes<4>(wu[r * words + w], xv)
                   + float(bu[r * groups + g]) * x_sum;
    }
  }
  const float inv_rms = precise::rsqrt(simd_sum(sum_sq) / float(args.moe.hidden_size) + args.eps);
  device float* out = hidden + size_t(slot) * args.moe.expert_size + first_row;
  for (uint r = 0; r < MOE_ROWS; ++r) {
    float gate = simd_sum(acc_gate[r]) * inv_rms;
    float up = simd_sum(acc_up[r]) * inv_rms;
    if (lane == r) {
      out[r] = lily::silu(gate) * up;
    }
  }
}

// Grid: H / 8 threadgroups of 64 threads. Every lane accumulates w_s·(its partial dot) over all k + 1 slots, so one
// simd_sum per output row finishes the routed sum, the gated shared expert and (on lane r) the residual add.
template <typename T, typename S>
[[kernel]] void moe_down_combine(constant lily::MoeArgs& args [[buffer(0)]],
                                 device const float* hidden [[buffer(1)]],
                                 device const uint* expert_ids [[buffer(2)]],
                                 device const float* expert_weights [[buffer(3)]],
                                 device const uint* down_weight [[buffer(4)]],
                                 device const S* down_scales [[buffer(5)]],
                                 device const S* down_biases [[buffer(6)]],
                                 device const uint* shared_down_weight [[buffer(7)]],
                                 device const S* shared_down_scales [[buffer(8)]],
                                 device const S* shared_down_biases [[buffer(9)]],
                                 device const float* shared_gate_logit [[buffer(10)]],
                                 device const T* residual [[buffer(11)]],
                                 device T* out [[buffer(12)]],
                                 uint group [[threadgroup_position_in_grid]],
                                 uint lane [[thread_index_in_simdgroup]],
                                 uint simd_group [[simdgroup_index_in_threadgroup]]) {
  const uint first_row = group * MOE_ROWS_PER_THREADGROUP + simd_group * MOE_ROWS;
  if (first_row >= args.hidden_size) {
    return;  // whole simdgroup (H is a multiple of 64)
  }
  float acc[MOE_ROWS];
  for (uint r = 0; r < MOE_ROWS; ++r) {
    acc[r] = 0.0f;
  }
  for (uint slot = 0; slot <= args.top_k; ++slot) {
    const bool is_shared = slot == args.top_k;
    const uint in_size = is_shared ? args.shared_expert_size : args.expert_size;
    const uint words = in_size / 8;
    const uint groups = in_size / 64;
    size_t row0 = first_row;
    if (!is_shared) {
      row0 += size_t(expert_ids[slot]) * args.hidden_size;
    }
    const float weight = is_shared ? lily::sigmoid(shared_gate_logit[0]) : expert_weights[slot];
    device const uint* wd = (is_shared ? shared_down_weight : down_weight) + row0 * words;
    device const S* sd = (is_shared ? shared_down_scales : down_scales) + row0 * groups;
    device const S* bd = (is_shared ? shared_down_biases : down_biases) + row0 * groups;
    device const float* h = hidden + size_t(slot) * args.expert_size;
    for (uint w = lane; w < words; w += 32) {
      float hv[8];
      float h_sum = 0.0f;
      for (uint j = 0; j < 8; ++j) {
        hv[j] = h[8 * w + j];
        h_sum += hv[j];
      }
      const uint g = w / 8;
      for (uint r = 0; r < MOE_ROWS; ++r) {
        const float dot = float(sd[r * groups + g]) * lily::dot_codes<4>(wd[r * words + w], hv);
        acc[r] += weight * (dot + float(bd[r * groups + g]) * h_sum);
      }
    }
  }
  for (uint r = 0; r < MOE_ROWS; ++r) {
    float total = simd_sum(acc[r]);
    if (lane == r) {
      // Read and write by the same thread: out may alias residual.
      out[first_row + r] = T(float(residual[first_row + r]) + total);
    }
  }
}

LILY_INSTANTIATE_KERNEL("moe_route_f32", moe_route, float)
LILY_INSTANTIATE_KERNEL("moe_gate_up_swiglu_f32", moe_gate_up_swiglu, float, bfloat)
LILY_INSTANTIATE_KERNEL("moe_gate_up_swiglu_bf16", moe_gate_up_swiglu, bfloat, bfloat)
LILY_INSTANTIATE_KERNEL("moe_gate_up_swiglu_f32_sf32", moe_gate_up_swiglu, float, float)
LILY_INSTANTIATE_KERNEL("moe_gate_up_swiglu_bf16_sf32", moe_gate_up_swiglu, bfloat, float)
LILY_INSTANTIATE_KERNEL("moe_gate_up_swiglu_routed_f32", moe_gate_up_swiglu_routed, float, bfloat)
LILY_INSTANTIATE_KERNEL("moe_gate_up_swiglu_routed_bf16", moe_gate_up_swiglu_routed, bfloat, bfloat)
LILY_INSTANTIATE_KERNEL("moe_gate_up_swiglu_routed_f32_sf32", moe_gate_up_swiglu_routed, float, float)
LILY_INSTANTIATE_KERNEL("moe_gate_up_swiglu_routed_bf16_sf32", moe_gate_up_swiglu_routed, bfloat, float)
LILY_INSTANTIATE_KERNEL("moe_down_combine_f32", moe_down_combine, float, bfloat)
LILY_INSTANTIATE_KERNEL("moe_down_combine_bf16", moe_down_combine, bfloat, bfloat)
LILY_INSTANTIATE_KERNEL("moe_down_combine_f32_sf32", moe_down_combine, float, float)
LILY_INSTANTIATE_KERNEL("moe_down_combine_bf16_sf32", moe_down_combine, bfloat, float)
