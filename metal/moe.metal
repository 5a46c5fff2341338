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
//       and sums x^2 while it folds x ⊙ norm_weight into its dot products (1/rms applied after the sums). Slot s
//       runs rounds 0..s only; lane 0 of simdgroup 0 of threadgroup (0, k - 1), which runs all k, writes the ids and
//       renormalised weights moe_down_combine reads.
//       Extra reads per simdgroup: E logits and the H norm weights, from cache. Chosen whenever fusion is on.
//   moe_down_combine_<dtype>[_sf32]
//       out = residual + Σ_s w_s·down_s·h_s + sigmoid(gate logit)·down_shared·h_shared: the layer output written once
//       (out may alias residual: the residual stream updated in place).
//   moe_gate_up_swiglu_routed_staged_<dtype>, moe_down_combine_staged_<dtype>  (CUDA's choice with the staged GEMVs:
//       tuning::staged_moe; bf16 scales) the same two with their input staged once per threadgroup in threadgroup
//       memory (qmv_stage.h): the normed x (gate/up, whose shared-expert threadgroups load their first weights before
//       the dependency wait) and the experts' hidden scratch (down, where every simdgroup read all 18 KB of it; it
//       routes again from the router's output and loads its first weights before its wait).
// Weights: MLX affine 4-bit, group 64 along the input axis: codes packed 8 per uint32 (element 0 in the low bits),
// bf16 scales and biases (f32 with the _sf32 suffix: checkpoints converted from fp32 weights), w = scale·q + bias;
// routed experts stacked [E, out, in]. <dtype> is the activation type (f32: float32 mode, bf16: default, f16).
// GEMV shape: the qmv packs (metal/qmatmul.metal): a lane reads LILY_QMV_PACK_WORDS consecutive words of a row (32
// codes at 4 bits, one scale and bias), packs lane + 32 i, and every load of a step is issued before its arithmetic,
// so at the model's sizes each simdgroup has its whole share of the layer's weights in flight at once (gate/up: 4
// output rows = 8 weight rows of H = 2048, one step; down: 2 output rows, their k + 1 slot rows flattened into one row
// of 144 packs, one step). Codes become floats by lily::code_float (two operations each, quantized.h); the affine
// dequantisation folds into scale·Σq·x + bias·Σx per pack. fp32 accumulation; one simd_sum per output row at the end.
// Traffic per decode token at the model's sizes (H = 2048, I = Is = 512, k = 8): gate/up read 9 × 2 × 512 rows ×
// 1152 B (codes + scales + biases) ≈ 10.6 MB, down 9 × 2048 rows × 288 B ≈ 5.3 MB; activations are < 40 KB. The
// hidden scratch stays fp32 (18 KB written and read once): rounding it would save 9 KB and add an error.
#include <metal_stdlib>
#include "activations.h"
#include "lily.h"
#include "qmv_stage.h"
#include "quantized.h"

using namespace metal;

constant constexpr uint MOE_ROWS = LILY_MOE_GEMV_ROWS_PER_SIMDGROUP;
constant constexpr uint MOE_ROWS_PER_THREADGROUP = LILY_MOE_GEMV_ROWS_PER_SIMDGROUP * LILY_MOE_GEMV_SIMDGROUPS;

constant constexpr uint MOE_PER_LANE = LILY_MOE_MAX_EXPERTS / 32;
// moe_down_combine_staged's staging, in whole blocks of 32 packs (qmv_stage_slot's layout): 4608 values take 5120.
constant constexpr uint MOE_STAGE_FLOAT4S = (LILY_MOE_STAGE_MAX_K + 1023) / 1024 * 256;

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
// goes to `top`. Every lane gets the same winner. Convergent. A probability is in [0, 1], where the order of the
// floats is that of their bits, so the lanes' candidates meet in two integer reductions (one redux.sync each on
// NVIDIA's sm_80 on): the largest key (bits + 1; 0 for no candidate), then the lowest id holding it.
// The routed gate/up kernels run up to k rounds before they can load their expert's weights.
inline uint moe_pick(thread const float* p, thread uint& taken, uint num_experts, uint lane, uint round,
                     thread float& top) {
  float best = -1.0f;  // below every probability, so a lane with no candidate keeps key 0
  uint best_id = 0xFFFFFFFFu;
  for (uint j = 0; j < MOE_PER_LANE; ++j) {
    uint e = lane + 32 * j;
    // Strict '>' keeps the lowest id among equal values within the lane (e grows with j); a NaN never passes.
    if (e < num_experts && ((taken >> j) & 1u) == 0 && p[j] > best) {
      best = p[j];
      best_id = e;
    }
  }
  const uint key = best_id < num_experts ? as_type<uint>(best) + 1u : 0u;
  const uint top_key = simd_max(key);
  uint winner = simd_min(key == top_key ? best_id : 0xFFFFFFFFu);
  top = as_type<float>(top_key - 1u);
  if (top_key == 0u) {
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

// The expert of routed slot `slot`: the softmax over the E f32 logits and top-k rounds 0..slot (slot k - 1: all k).
// The writer simdgroup (running all k rounds) writes the ids and renormalised weights: to device memory for
// moe_down_combine (one writer per dispatch), or to threadgroup memory (moe_down_combine_staged's own routing). Called
// by a whole simdgroup (convergent).
template <typename Ids, typename Weights>
inline uint moe_slot_expert(device const float* router_logits, uint num_experts, uint k, uint slot, bool writer,
                            uint lane, Ids expert_ids, Weights expert_weights) {
  float p[MOE_PER_LANE];
  moe_probabilities(router_logits, num_experts, lane, p);
  uint taken = 0, expert = 0;
  float chosen_sum = 0.0f;
  for (uint r = 0; r <= slot; ++r) {
    float top;
    const uint winner = moe_pick(p, taken, num_experts, lane, r, top);
    chosen_sum += top;
    expert = winner;
    if (writer && lane == 0) {
      expert_ids[r] = winner;
      expert_weights[r] = top;
    }
  }
  if (writer && lane == 0) {
    for (uint r = 0; r < k; ++r) {
      expert_weights[r] = expert_weights[r] / chosen_sum;
    }
  }
  return expert;
}

// One simdgroup's MOE_ROWS SwiGLU outputs: out[r] = silu(gate_r · x') * (up_r · x'), x' = x (Norm false) or
// rms_norm(x) ⊙ norm_weight (Norm: each lane sums x^2 over the values it reads; 1/rms is applied after the row sums).
// The row pointers point at the simdgroup's first gate and up row (codes, scales, biases). A lane reads the qmv packs:
// LILY_QMV_PACK_WORDS consecutive words (32 codes at 4 bits, inside one quantization group), pack lane + 32 i of every
// row, LILY_QMV_PACKS_PER_LANE of them per step, all loads of a step issued before its arithmetic; at H = 2048 one step
// covers the row. A pack past the row re-reads the row's last pack weighted 0 (no load is conditional).
template <bool Norm, typename T, typename S>
LILY_INLINE void moe_gate_up_rows(device const T* x, device const T* norm_weight, device const uint* wg,
                                  device const S* sg, device const S* bg, device const uint* wu, device const S* su,
                                  device const S* bu, uint K, float eps, uint lane, device float* out) {
  constexpr uint kRows = MOE_ROWS;
  constexpr uint kPackWords = LILY_QMV_PACK_WORDS;
  constexpr uint kPacks = LILY_QMV_PACKS_PER_LANE;
  const uint words_per_row = K / 8;
  const uint packs_per_row = words_per_row / kPackWords;
  const uint groups_per_row = K / 64;
  uint magic[lily::kCodeMagicCount<4>];
  lily::code_float_magic<4>(magic);
  float acc_gate[kRows], acc_up[kRows];
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    acc_gate[r] = 0.0f;
    acc_up[r] = 0.0f;
  }
  float sum_sq = 0.0f;
  for (uint p0 = lane; p0 < packs_per_row; p0 += 32 * kPacks) {
    uint words_gate[kPacks][kRows][kPackWords], words_up[kPacks][kRows][kPackWords];
    float scale_gate[kPacks][kRows], bias_gate[kPacks][kRows], scale_up[kPacks][kRows], bias_up[kPacks][kRows];
    LILY_UNROLL
    for (uint i = 0; i < kPacks; ++i) {
      const uint p = min(p0 + 32 * i, packs_per_row - 1);
      const bool in_row = p0 + 32 * i < packs_per_row;
      const uint g = p * kPackWords / 8;  // 8 words per group of 64
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        LILY_UNROLL
        for (uint j = 0; j < kPackWords; ++j) {
          words_gate[i][r][j] = wg[r * words_per_row + p * kPackWords + j];
          words_up[i][r][j] = wu[r * words_per_row + p * kPackWords + j];
        }
        scale_gate[i][r] = in_row ? float(sg[r * groups_per_row + g]) : 0.0f;
        bias_gate[i][r] = in_row ? float(bg[r * groups_per_row + g]) : 0.0f;
        scale_up[i][r] = in_row ? float(su[r * groups_per_row + g]) : 0.0f;
        bias_up[i][r] = in_row ? float(bu[r * groups_per_row + g]) : 0.0f;
      }
    }
    LILY_UNROLL
    for (uint i = 0; i < kPacks; ++i) {
      const uint p = min(p0 + 32 * i, packs_per_row - 1);
      const bool in_row = p0 + 32 * i < packs_per_row;
      float d_gate[kRows], d_up[kRows];
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        d_gate[r] = 0.0f;
        d_up[r] = 0.0f;
      }
      float x_sum = 0.0f, x_sq = 0.0f;
      LILY_UNROLL
      for (uint j = 0; j < kPackWords; ++j) {
        const uint k0 = (p * kPackWords + j) * 8;
        float xs[8];
        LILY_UNROLL
        for (uint c = 0; c < 8; c += 4) {
          float4 v = lily::attn_load4(x + k0 + c);
          if (Norm) {
            x_sq += dot(v, v);
            v *= lily::attn_load4(norm_weight + k0 + c);
          }
          x_sum += (v.x + v.y) + (v.z + v.w);
          LILY_UNROLL
          for (uint e = 0; e < 4; ++e) {
            xs[c + e] = v[e];
          }
        }
        LILY_UNROLL
        for (uint r = 0; r < kRows; ++r) {
          const uint gate_word = words_gate[i][r][j], up_word = words_up[i][r][j];
          const uint gate_high = gate_word >> 16, up_high = up_word >> 16;
          LILY_UNROLL
          for (uint e = 0; e < 8; ++e) {
            d_gate[r] = fma(xs[e], lily::code_float<4>(gate_word, gate_high, e, magic), d_gate[r]);
            d_up[r] = fma(xs[e], lily::code_float<4>(up_word, up_high, e, magic), d_up[r]);
          }
        }
      }
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        acc_gate[r] = fma(scale_gate[i][r], d_gate[r], fma(bias_gate[i][r], x_sum, acc_gate[r]));
        acc_up[r] = fma(scale_up[i][r], d_up[r], fma(bias_up[i][r], x_sum, acc_up[r]));
      }
      sum_sq += in_row ? x_sq : 0.0f;
    }
  }
  const float inv_rms = Norm ? precise::rsqrt(simd_sum(sum_sq) / float(K) + eps) : 1.0f;
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    const float gate = simd_sum(acc_gate[r]) * inv_rms;
    const float up = simd_sum(acc_up[r]) * inv_rms;
    if (lane == r) {
      out[r] = lily::silu(gate) * up;
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
  moe_gate_up_rows<false>(x, x, (is_shared ? shared_gate_weight : gate_weight) + row0 * words,
                          (is_shared ? shared_gate_scales : gate_scales) + row0 * groups,
                          (is_shared ? shared_gate_biases : gate_biases) + row0 * groups,
                          (is_shared ? shared_up_weight : up_weight) + row0 * words,
                          (is_shared ? shared_up_scales : up_scales) + row0 * groups,
                          (is_shared ? shared_up_biases : up_biases) + row0 * groups, args.hidden_size, 0.0f, lane,
                          hidden + size_t(slot) * args.expert_size + first_row);
}

// moe_route and the post-attention RMSNorm folded into moe_gate_up_swiglu. Grid and slots as moe_gate_up_swiglu; x
// is the un-normalised hidden stream. The simdgroups of routed slot s recompute the softmax over the E f32 logits
// (E/32 per lane) and run top-k rounds 0..s (their expert is round s's winner: a cheaper chain than a dispatch and a
// barrier); the shared slot routes nothing. Simdgroup 0 of threadgroup (0, k - 1), which runs all k rounds anyway,
// writes the ids and renormalised weights that moe_down_combine reads.
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
    const bool writer_simdgroup = group.x == 0 && slot == k - 1 && simd_group == 0;  // first_row 0: never left
    expert = moe_slot_expert(router_logits, args.moe.num_experts, k, slot, writer_simdgroup, lane, expert_ids,
                             expert_weights);
  }
  const uint words = args.moe.hidden_size / 8;
  const uint groups = args.moe.hidden_size / 64;
  const size_t row0 = first_row + (is_shared ? size_t(0) : size_t(expert) * args.moe.expert_size);
  moe_gate_up_rows<true>(x, norm_weight, (is_shared ? shared_gate_weight : gate_weight) + row0 * words,
                         (is_shared ? shared_gate_scales : gate_scales) + row0 * groups,
                         (is_shared ? shared_gate_biases : gate_biases) + row0 * groups,
                         (is_shared ? shared_up_weight : up_weight) + row0 * words,
                         (is_shared ? shared_up_scales : up_scales) + row0 * groups,
                         (is_shared ? shared_up_biases : up_biases) + row0 * groups, args.moe.hidden_size, args.eps,
                         lane, hidden + size_t(slot) * args.moe.expert_size + first_row);
}

// moe_gate_up_swiglu_routed with x' = rms_norm(x) ⊙ norm_weight staged once per threadgroup (CUDA's choice:
// tuning::staged_moe; qmv_stage.h): threadgroups of any multiple of 32 threads (the host takes
// tuning::kQmvStagedThreads), each simdgroup LILY_QMV_ROWS_PER_SIMDGROUP gate and up rows of the threadgroup's slot,
// grid (ceil(max(I, Is) / rows per threadgroup), k + 1). The shared slot's threadgroups load their first step of
// weights before lily::grid_dependency_wait (on CUDA it overlaps the router GEMV before); a routed slot's simdgroups
// wait, route as moe_gate_up_swiglu_routed, then load theirs; either way the loads are in flight while x is staged.
// H <= LILY_QMV_STAGE_MAX_K (the host checks).
template <typename T, typename S, bool WholePacks>
[[kernel]] void moe_gate_up_swiglu_routed_staged(constant lily::MoeRoutedArgs& args [[buffer(0)]],
                                                 device const T* x [[buffer(1)]],
                                                 device const T* norm_weight [[buffer(2)]],
                                                 device const float* router_logits [[buffer(3)]],
                                                 device uint* expert_ids [[buffer(4)]],
                                                 device float* expert_weights [[buffer(5)]],
                                                 device const lily::pack_codes_t<WholePacks>* gate_weight [[buffer(6)]],
                                                 device const S* gate_scales [[buffer(7)]],
                                                 device const S* gate_biases [[buffer(8)]],
                                                 device const lily::pack_codes_t<WholePacks>* up_weight [[buffer(9)]],
                                                 device const S* up_scales [[buffer(10)]],
                                                 device const S* up_biases [[buffer(11)]],
                                                 device const lily::pack_codes_t<WholePacks>* shared_gate_weight [[buffer(12)]],
                                                 device const S* shared_gate_scales [[buffer(13)]],
                                                 device const S* shared_gate_biases [[buffer(14)]],
                                                 device const lily::pack_codes_t<WholePacks>* shared_up_weight [[buffer(15)]],
                                                 device const S* shared_up_scales [[buffer(16)]],
                                                 device const S* shared_up_biases [[buffer(17)]],
                                                 device float* hidden [[buffer(18)]],
                                                 uint2 group [[threadgroup_position_in_grid]],
                                                 uint tid [[thread_index_in_threadgroup]],
                                                 uint2 threads_per_group [[threads_per_threadgroup]],
                                                 uint lane [[thread_index_in_simdgroup]],
                                                 uint simd_group [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 stage_x[LILY_QMV_STAGE_MAX_K / 4];
  threadgroup float pack_sum[LILY_QMV_STAGE_MAX_K / 32];  // 32 values per 4-bit pack
  threadgroup float simd_sq[32];
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  const uint n_threads = threads_per_group.x;  // 1-D threadgroups
  const uint slot = group.y;
  const uint k = args.moe.top_k;
  const bool is_shared = slot == k;
  const uint out_rows = is_shared ? args.moe.shared_expert_size : args.moe.expert_size;
  if (group.x * (n_threads / 32) * kRows >= out_rows) {
    return;  // the whole threadgroup leaves: the barrier in qmv_stage stays uniform
  }
  const uint first_row = (group.x * (n_threads / 32) + simd_group) * kRows;
  const bool active = first_row < out_rows;  // else the simdgroup only takes part in the staging
  const uint H = args.moe.hidden_size;
  const uint words = H / 8;
  const uint groups = H / 64;
  uint words_gate[LILY_QMV_PACKS_PER_LANE][kRows][LILY_QMV_PACK_WORDS];
  uint words_up[LILY_QMV_PACKS_PER_LANE][kRows][LILY_QMV_PACK_WORDS];
  float scale_gate[LILY_QMV_PACKS_PER_LANE][kRows], bias_gate[LILY_QMV_PACKS_PER_LANE][kRows];
  float scale_up[LILY_QMV_PACKS_PER_LANE][kRows], bias_up[LILY_QMV_PACKS_PER_LANE][kRows];
  // The slot's matrices (first row of its expert): the shared expert's known at once, a routed one after routing.
  device const uint* wg = lily::as_words(shared_gate_weight);
  device const S* sg = shared_gate_scales;
  device const S* bg = shared_gate_biases;
  device const uint* wu = lily::as_words(shared_up_weight);
  device const S* su = shared_up_scales;
  device const S* bu = shared_up_biases;
  if (is_shared) {
    if (active) {
      lily::qmv_load_step<4, WholePacks>(words_gate, scale_gate, bias_gate, wg, sg, bg, H, out_rows, first_row, lane);
      lily::qmv_load_step<4, WholePacks>(words_up, scale_up, bias_up, wu, su, bu, H, out_rows, first_row, lane);
    }
    lily::grid_dependency_wait();  // x and the logits come from the dispatches before
  } else {
    lily::grid_dependency_wait();
    const bool writer_simdgroup = group.x == 0 && slot == k - 1 && simd_group == 0;  // first_row 0: always active
    const size_t row0 = size_t(moe_slot_expert(router_logits, args.moe.num_experts, k, slot, writer_simdgroup, lane,
                                               expert_ids, expert_weights)) *
                        args.moe.expert_size;
    wg = lily::as_words(gate_weight) + row0 * words;
    sg = gate_scales + row0 * groups;
    bg = gate_biases + row0 * groups;
    wu = lily::as_words(up_weight) + row0 * words;
    su = up_scales + row0 * groups;
    bu = up_biases + row0 * groups;
    if (active) {
      lily::qmv_load_step<4, WholePacks>(words_gate, scale_gate, bias_gate, wg, sg, bg, H, out_rows, first_row, lane);
      lily::qmv_load_step<4, WholePacks>(words_up, scale_up, bias_up, wu, su, bu, H, out_rows, first_row, lane);
    }
  }
  // 4 chunks per thread and round (one round at H = 2048 on 128 threads), not kStageBatch's 8: with the gate and up
  // weights in flight the kernel needed 191 registers, two 128-thread groups per SM, and its 288 groups did not fit
  // in one wave on 132 SMs (20.9 against 16.7 us unstaged on the H200).
  const float inv_rms = lily::qmv_stage<true, 4, 4>(x, norm_weight, H, args.eps, stage_x, pack_sum, simd_sq, tid,
                                                    n_threads, lane, simd_group);
  if (!active) {
    return;  // the whole simdgroup leaves (after the staging): the simd_sums below stay convergent
  }
  float acc_gate[kRows], acc_up[kRows];
  lily::qmv_staged_dot<4, WholePacks>(acc_gate, words_gate, scale_gate, bias_gate, wg, sg, bg, H, out_rows, first_row,
                                      stage_x, pack_sum, lane);
  lily::qmv_staged_dot<4, WholePacks>(acc_up, words_up, scale_up, bias_up, wu, su, bu, H, out_rows, first_row, stage_x,
                                      pack_sum, lane);
  device float* out = hidden + size_t(slot) * args.moe.expert_size + first_row;
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    const float gate = simd_sum(acc_gate[r]) * inv_rms;
    const float up = simd_sum(acc_up[r]) * inv_rms;
    if (lane == r && first_row + r < out_rows) {
      out[r] = lily::silu(gate) * up;
    }
  }
}

// Packs in the down projections' flattened row: the k routed slot rows' (I / 32 each), then the shared expert's.
inline uint moe_down_packs(constant lily::MoeArgs& args) {
  return args.top_k * (args.expert_size / (8 * LILY_QMV_PACK_WORDS)) +
         args.shared_expert_size / (8 * LILY_QMV_PACK_WORDS);
}

// Loads one step of the down projections' flattened row for a simdgroup's LILY_MOE_DOWN_ROWS_PER_SIMDGROUP output
// rows from `row` on: packs p0 + 32 i, pack p < k I / 32 being pack p % (I / 32) of routed slot p / (I / 32) and the
// rest the shared expert's, with their scales and biases and each pack's routing weight (sigmoid of the gate logit for
// the shared expert). A pack past the row re-reads the row's last pack with weight 0: no load is conditional.
// WholePacks: a pack as one 16-byte load (codes on 16 bytes): lily::qmv_load_pack.
template <bool WholePacks, typename S, typename Ids, typename Weights>
LILY_INLINE void moe_down_load_step(
    constant lily::MoeArgs& args, uint p0, uint row, Ids expert_ids, Weights expert_weights, float shared_weight,
    device const uint* down_weight, device const S* down_scales, device const S* down_biases,
    device const uint* shared_down_weight, device const S* shared_down_scales, device const S* shared_down_biases,
    thread uint (&words)[LILY_MOE_DOWN_PACKS_PER_LANE][LILY_MOE_DOWN_ROWS_PER_SIMDGROUP][LILY_QMV_PACK_WORDS],
    thread float (&scale)[LILY_MOE_DOWN_PACKS_PER_LANE][LILY_MOE_DOWN_ROWS_PER_SIMDGROUP],
    thread float (&bias)[LILY_MOE_DOWN_PACKS_PER_LANE][LILY_MOE_DOWN_ROWS_PER_SIMDGROUP],
    thread float (&weight)[LILY_MOE_DOWN_PACKS_PER_LANE]) {
  constexpr uint kPackWords = LILY_QMV_PACK_WORDS;
  const uint k = args.top_k;
  const uint routed_packs = args.expert_size / (8 * kPackWords);  // packs per routed slot row
  const uint routed_total = k * routed_packs;
  const uint total = moe_down_packs(args);
  LILY_UNROLL
  for (uint i = 0; i < LILY_MOE_DOWN_PACKS_PER_LANE; ++i) {
    const uint p = min(p0 + 32 * i, total - 1);
    const bool routed = p < routed_total;
    const uint slot = routed ? p / routed_packs : k;
    const uint pack = p - slot * routed_packs;  // pack within the slot's row
    const uint in_size = routed ? args.expert_size : args.shared_expert_size;
    const size_t row0 = routed ? size_t(expert_ids[slot]) * args.hidden_size + row : size_t(row);
    device const uint* w = (routed ? down_weight : shared_down_weight) + row0 * (in_size / 8) + pack * kPackWords;
    device const S* sc = (routed ? down_scales : shared_down_scales) + row0 * (in_size / 64) + pack * kPackWords / 8;
    device const S* bi = (routed ? down_biases : shared_down_biases) + row0 * (in_size / 64) + pack * kPackWords / 8;
    LILY_UNROLL
    for (uint r = 0; r < LILY_MOE_DOWN_ROWS_PER_SIMDGROUP; ++r) {
      lily::qmv_load_pack<WholePacks>(w + r * (in_size / 8), words[i][r]);
      scale[i][r] = float(sc[r * (in_size / 64)]);
      bias[i][r] = float(bi[r * (in_size / 64)]);
    }
    weight[i] = p0 + 32 * i < total ? (routed ? expert_weights[slot] : shared_weight) : 0.0f;
  }
}

// Grid: ceil(H / 8) threadgroups of 128 threads (4 simdgroups x 2 output rows). Each simdgroup reads its rows' k + 1
// slot rows as one flattened row of packs: pack p < k * I / 32 is pack p % (I / 32) of routed slot p / (I / 32), the
// rest the shared expert's; a lane takes packs lane + 32 i, LILY_MOE_DOWN_PACKS_PER_LANE per step, every load of the
// step (codes, scale, bias, the slot's expert id and routing weight) issued before the arithmetic. Each pack's partial
// sum is weighted by its slot's routing weight (sigmoid of the gate logit for the shared expert), so one simd_sum per
// output row finishes the routed sum, the gated shared expert and (on lane 0) the residual add.
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
  constexpr uint kRows = LILY_MOE_DOWN_ROWS_PER_SIMDGROUP;
  constexpr uint kPackWords = LILY_QMV_PACK_WORDS;
  constexpr uint kPacks = LILY_MOE_DOWN_PACKS_PER_LANE;
  const uint H = args.hidden_size;
  const uint first_row = (group * LILY_MOE_DOWN_SIMDGROUPS + simd_group) * kRows;
  if (first_row >= H) {
    return;  // whole simdgroup (H is a multiple of 64)
  }
  const uint total = moe_down_packs(args);
  const float shared_weight = lily::sigmoid(shared_gate_logit[0]);
  uint magic[lily::kCodeMagicCount<4>];
  lily::code_float_magic<4>(magic);
  float acc[kRows];
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    acc[r] = 0.0f;
  }
  for (uint p0 = lane; p0 < total; p0 += 32 * kPacks) {
    uint words[kPacks][kRows][kPackWords];
    float scale[kPacks][kRows], bias[kPacks][kRows], weight[kPacks];
    moe_down_load_step<false>(args, p0, first_row, expert_ids, expert_weights, shared_weight, down_weight, down_scales,
                              down_biases, shared_down_weight, shared_down_scales, shared_down_biases, words, scale,
                              bias, weight);
    LILY_UNROLL
    for (uint i = 0; i < kPacks; ++i) {
      const uint h_offset = min(p0 + 32 * i, total - 1) * kPackWords * 8;  // pack p reads hidden [32 p, 32 p + 32)
      float d[kRows];
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        d[r] = 0.0f;
      }
      float h_sum = 0.0f;
      LILY_UNROLL
      for (uint j = 0; j < kPackWords; ++j) {
        float hs[8];
        LILY_UNROLL
        for (uint c = 0; c < 8; c += 4) {
          const float4 v = *((device const float4*)(hidden + h_offset + 8 * j + c));
          h_sum += (v.x + v.y) + (v.z + v.w);
          LILY_UNROLL
          for (uint e = 0; e < 4; ++e) {
            hs[c + e] = v[e];
          }
        }
        LILY_UNROLL
        for (uint r = 0; r < kRows; ++r) {
          const uint word = words[i][r][j], high = word >> 16;
          LILY_UNROLL
          for (uint e = 0; e < 8; ++e) {
            d[r] = fma(hs[e], lily::code_float<4>(word, high, e, magic), d[r]);
          }
        }
      }
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        acc[r] = fma(weight[i], fma(scale[i][r], d[r], bias[i][r] * h_sum), acc[r]);
      }
    }
  }
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    const float total_r = simd_sum(acc[r]);
    if (lane == 0) {
      // Read and write by the same thread: out may alias residual.
      out[first_row + r] = T(float(residual[first_row + r]) + total_r);
    }
  }
}

// moe_down_combine with the hidden scratch (k slot rows and the shared one, f32) staged once per threadgroup (CUDA's
// choice: tuning::staged_moe; qmv_stage.h), where each lane loaded its own packs of it (per simdgroup the whole
// 18 KB, four times the weight bytes it reads at the model's sizes). Same grid and threadgroups as moe_down_combine,
// any multiple of 32 threads; the flattened pack p reads hidden values [32 p, 32 p + 32): the packs of the slot rows in
// order. k I + Is <= LILY_MOE_STAGE_MAX_K and k <= LILY_MOE_DOWN_ROUTE_MAX_K (the host checks).
// It takes the router's output (E logits, then the shared expert's gate logit) beside the gate/up kernel's ids and
// weights. EarlyLoads (EARLY_MOE_DOWN, the default): before lily::grid_dependency_wait, simdgroup 0 routes again
// (moe_slot_expert, the gate/up writer's code: the same ids and weights) into threadgroup memory, and every simdgroup
// issues its first step of weights and reads its rows' residual; the router and the dispatch before it have finished
// by the time the gate/up kernel (the one dispatch this waits for) lets it start, so on CUDA those loads overlap the
// gate/up kernel, and after the wait only the hidden scratch, which the gate/up kernel writes, is staged. Without
// (moe_down_combine_staged_late_*), it waits first and reads the ids and weights the gate/up kernel wrote.
template <typename T, typename S, bool WholePacks, bool EarlyLoads>
[[kernel]] void moe_down_combine_staged(constant lily::MoeArgs& args [[buffer(0)]],
                                        device const float* hidden [[buffer(1)]],
                                        device const float* router [[buffer(2)]],
                                        device const uint* expert_ids [[buffer(3)]],
                                        device const float* expert_weights [[buffer(4)]],
                                        device const lily::pack_codes_t<WholePacks>* down_weight [[buffer(5)]],
                                        device const S* down_scales [[buffer(6)]],
                                        device const S* down_biases [[buffer(7)]],
                                        device const lily::pack_codes_t<WholePacks>* shared_down_weight [[buffer(8)]],
                                        device const S* shared_down_scales [[buffer(9)]],
                                        device const S* shared_down_biases [[buffer(10)]],
                                        device const T* residual [[buffer(11)]],
                                        device T* out [[buffer(12)]],
                                        uint group [[threadgroup_position_in_grid]],
                                        uint tid [[thread_index_in_threadgroup]],
                                        uint n_threads [[threads_per_threadgroup]],
                                        uint lane [[thread_index_in_simdgroup]],
                                        uint simd_group [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 stage_h[MOE_STAGE_FLOAT4S];
  threadgroup float pack_sum[LILY_MOE_STAGE_MAX_K / 32];  // 32 values per 4-bit pack
  threadgroup float simd_sq[32];
  threadgroup uint route_ids[LILY_MOE_DOWN_ROUTE_MAX_K];
  threadgroup float route_weights[LILY_MOE_DOWN_ROUTE_MAX_K];
  constexpr uint kRows = LILY_MOE_DOWN_ROWS_PER_SIMDGROUP;
  constexpr uint kPackWords = LILY_QMV_PACK_WORDS;
  constexpr uint kPacks = LILY_MOE_DOWN_PACKS_PER_LANE;
  constexpr uint kChunks = lily::kStageChunks<4>;
  const uint H = args.hidden_size;
  if (group * (n_threads / 32) * kRows >= H) {
    return;  // the whole threadgroup leaves: the barriers below stay uniform
  }
  const uint first_row = (group * (n_threads / 32) + simd_group) * kRows;
  const bool active = first_row < H;  // else the simdgroup only takes part in the staging
  const uint total = moe_down_packs(args);
  // The slots' ids and weights in threadgroup memory either way: routed again here (early), or the gate/up kernel's.
  if (!EarlyLoads) {
    lily::grid_dependency_wait();  // the ids, weights and hidden come from the dispatch before
    static_assert(LILY_MOE_DOWN_ROUTE_MAX_K <= 32, "one lane copies each slot");
    if (simd_group == 0 && lane < args.top_k) {  // top_k <= LILY_MOE_DOWN_ROUTE_MAX_K (the host checks)
      route_ids[lane] = expert_ids[lane];
      route_weights[lane] = expert_weights[lane];
    }
  } else if (simd_group == 0) {
    moe_slot_expert(router, args.num_experts, args.top_k, args.top_k - 1, true, lane, route_ids, route_weights);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float shared_weight = lily::sigmoid(router[args.num_experts]);
  float residual_rows[kRows];
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    residual_rows[r] = active ? float(residual[first_row + r]) : 0.0f;
  }
  uint magic[lily::kCodeMagicCount<4>];
  lily::code_float_magic<4>(magic);
  float acc[kRows];
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    acc[r] = 0.0f;
  }
  // One step covers the flattened row at the model's sizes (144 packs <= 32 x 5): its loads go out before the wait; a
  // longer row loads its later steps after the staging.
  uint words[kPacks][kRows][kPackWords];
  float scale[kPacks][kRows], bias[kPacks][kRows], weight[kPacks];
  for (uint s0 = 0; s0 < total; s0 += 32 * kPacks) {  // uniform trip count: the staging in the first stays uniform
    const uint p0 = s0 + lane;
    // An inactive simdgroup reads the last rows (never stored).
    moe_down_load_step<WholePacks>(args, p0, min(first_row, H - kRows), (threadgroup const uint*)route_ids,
                                   (threadgroup const float*)route_weights, shared_weight, lily::as_words(down_weight),
                                   down_scales, down_biases, lily::as_words(shared_down_weight), shared_down_scales,
                                   shared_down_biases, words, scale, bias, weight);
    if (s0 == 0) {
      if (EarlyLoads) {
        lily::grid_dependency_wait();  // hidden comes from the dispatch before
      }
      lily::qmv_stage<false, 4>(hidden, hidden, total * 8 * kPackWords, 0.0f, stage_h, pack_sum, simd_sq, tid,
                                n_threads, lane, simd_group);
    }
    LILY_UNROLL
    for (uint i = 0; i < kPacks; ++i) {
      const uint p = min(p0 + 32 * i, total - 1);
      threadgroup const float4* chunk = stage_h + (p / 32) * kChunks * 32 + p % 32;
      float d[kRows];
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        d[r] = 0.0f;
      }
      LILY_UNROLL
      for (uint j = 0; j < kPackWords; ++j) {
        float hs[8];
        LILY_UNROLL
        for (uint c = 0; c < 8; c += 4) {
          const float4 v = chunk[((j * 8 + c) / 4) * 32];
          LILY_UNROLL
          for (uint e = 0; e < 4; ++e) {
            hs[c + e] = v[e];
          }
        }
        LILY_UNROLL
        for (uint r = 0; r < kRows; ++r) {
          const uint word = words[i][r][j], high = word >> 16;
          LILY_UNROLL
          for (uint e = 0; e < 8; ++e) {
            d[r] = fma(hs[e], lily::code_float<4>(word, high, e, magic), d[r]);
          }
        }
      }
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        acc[r] = fma(weight[i], fma(scale[i][r], d[r], bias[i][r] * pack_sum[p]), acc[r]);
      }
    }
  }
  if (!active) {
    return;  // the whole simdgroup leaves: the simd_sums below stay convergent
  }
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    const float total_r = simd_sum(acc[r]);
    if (lane == 0) {
      // The residual was read by this thread before it writes: out may alias residual.
      out[first_row + r] = T(residual_rows[r] + total_r);
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
// Staged (CUDA): bf16 scales only, as the staged GEMVs, and each twice as they are: codes a word at a time, and (_a16)
// a pack as one 16-byte load (tuning::whole_pack_loads).
LILY_INSTANTIATE_EARLY_KERNEL("moe_gate_up_swiglu_routed_staged_f32", moe_gate_up_swiglu_routed_staged, float, bfloat,
                              false)
LILY_INSTANTIATE_EARLY_KERNEL("moe_gate_up_swiglu_routed_staged_f32_a16", moe_gate_up_swiglu_routed_staged, float,
                              bfloat, true)
LILY_INSTANTIATE_EARLY_KERNEL("moe_gate_up_swiglu_routed_staged_bf16", moe_gate_up_swiglu_routed_staged, bfloat,
                              bfloat, false)
LILY_INSTANTIATE_EARLY_KERNEL("moe_gate_up_swiglu_routed_staged_bf16_a16", moe_gate_up_swiglu_routed_staged, bfloat,
                              bfloat, true)
LILY_INSTANTIATE_KERNEL("moe_down_combine_f32", moe_down_combine, float, bfloat)
LILY_INSTANTIATE_KERNEL("moe_down_combine_bf16", moe_down_combine, bfloat, bfloat)
LILY_INSTANTIATE_KERNEL("moe_down_combine_f32_sf32", moe_down_combine, float, float)
LILY_INSTANTIATE_EARLY_KERNEL("moe_down_combine_staged_f32", moe_down_combine_staged, float, bfloat, false, true)
LILY_INSTANTIATE_EARLY_KERNEL("moe_down_combine_staged_f32_a16", moe_down_combine_staged, float, bfloat, true, true)
LILY_INSTANTIATE_EARLY_KERNEL("moe_down_combine_staged_bf16", moe_down_combine_staged, bfloat, bfloat, false, true)
LILY_INSTANTIATE_EARLY_KERNEL("moe_down_combine_staged_bf16_a16", moe_down_combine_staged, bfloat, bfloat, true, true)
LILY_INSTANTIATE_EARLY_KERNEL("moe_down_combine_staged_late_f32", moe_down_combine_staged, float, bfloat,
                              false, false)
LILY_INSTANTIATE_EARLY_KERNEL("moe_down_combine_staged_late_f32_a16", moe_down_combine_staged, float, bfloat,
                              true, false)
LILY_INSTANTIATE_EARLY_KERNEL("moe_down_combine_staged_late_bf16", moe_down_combine_staged, bfloat, bfloat,
                              false, false)
LILY_INSTANTIATE_EARLY_KERNEL("moe_down_combine_staged_late_bf16_a16", moe_down_combine_staged, bfloat, bfloat,
                              true, false)
LILY_INSTANTIATE_KERNEL("moe_down_combine_bf16_sf32", moe_down_combine, bfloat, float)
