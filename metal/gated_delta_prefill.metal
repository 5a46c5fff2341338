// Gated DeltaNet prefill of a chunk of T tokens (the decode step and the shared description: metal/gated_delta.metal):
//   gated_delta_conv_<dtype>_dk<Dk>     part 1: the causal conv + SiLU of T tokens into an fp32 scratch [T, C],
//                                      continuing from and updating the conv state. One thread per channel.
//   gated_delta_prefill_<dtype>_dk<Dk>  part 2: the sequential scan over T tokens with the state rows held in
//                                      registers for the whole chunk (LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP per
//                                      simdgroup, one threadgroup per value head), one barrier per token.
//                                      Chosen for T > 1 (after gated_delta_conv).
//   gated_delta_prefill_blockwise_<dtype>_dk<Dk>
//                                      the REGISTER_SCAN ablation (f32 and bf16): the state rows round-trip through
//                                      device memory every LILY_GDN_SCAN_BLOCK tokens. Same arithmetic, same bits.
#include <metal_stdlib>
#include "gated_delta.h"
#include "lily.h"

using namespace metal;
using namespace lily;

template <typename T, uint Dk>
[[kernel]] void gated_delta_conv(constant lily::GatedDeltaArgs& args [[buffer(0)]],
                                 device const T* qkv [[buffer(1)]],          // [T, C] raw in_proj_qkv outputs
                                 device const T* conv_weight [[buffer(2)]],  // [C, K]
                                 device T* conv_state [[buffer(3)]],         // [K-1, C] in/out
                                 device float* conv_out [[buffer(4)]],       // [T, C] SiLU(conv), fp32 scratch
                                 uint c [[thread_position_in_grid]]) {
  const uint channels = 2 * args.num_k_heads * Dk + args.num_v_heads * args.head_v_dim;
  if (c >= channels) {
    return;
  }
  float weight[LILY_GDN_CONV_KERNEL];
  float history[LILY_GDN_CONV_KERNEL];
  for (uint j = 0; j < LILY_GDN_CONV_KERNEL; ++j) {
    weight[j] = float(conv_weight[size_t(c) * LILY_GDN_CONV_KERNEL + j]);
  }
  for (uint j = 0; j + 1 < LILY_GDN_CONV_KERNEL; ++j) {
    history[j] = float(conv_state[size_t(j) * channels + c]);
  }
  // A sliding window in registers: each raw input is read once.
  for (uint t = 0; t < args.num_tokens; ++t) {
    history[LILY_GDN_CONV_KERNEL - 1] = float(qkv[size_t(t) * channels + c]);
    conv_out[size_t(t) * channels + c] = gdn_conv_silu(history, weight);
    for (uint j = 0; j + 1 < LILY_GDN_CONV_KERNEL; ++j) {
      history[j] = history[j + 1];
    }
  }
  for (uint j = 0; j + 1 < LILY_GDN_CONV_KERNEL; ++j) {
    conv_state[size_t(j) * channels + c] = T(history[j]);
  }
}

// Stages token t's scan inputs in one slot of the kernel's double-buffered threadgroup arrays: raw q and k of the key
// head, v of the value head, beta and the decay.
template <typename T, uint Dk>
LILY_INLINE void gdn_stage_token(threadgroup float* q, threadgroup float* k, threadgroup float* v,
                                 threadgroup float* beta, threadgroup float* decay, uint t,
                                 device const float* conv_out, device const T* b, device const T* a,
                                 device const float* a_log, device const float* dt_bias,
                                 constant lily::GatedDeltaArgs& args, uint v_head, uint tid, uint n_threads) {
  const uint dv = args.head_v_dim;
  const uint key_dim = args.num_k_heads * Dk;
  const uint channels = 2 * key_dim + args.num_v_heads * dv;
  const uint key_head = v_head / (args.num_v_heads / args.num_k_heads);
  device const float* x = conv_out + size_t(t) * channels;
  for (uint i = tid; i < 2 * Dk + dv; i += n_threads) {
    if (i < Dk) {
      q[i] = x[key_head * Dk + i];
    } else if (i < 2 * Dk) {
      k[i - Dk] = x[key_dim + key_head * Dk + (i - Dk)];
    } else {
      v[i - 2 * Dk] = x[2 * key_dim + v_head * dv + (i - 2 * Dk)];
    }
  }
  if (tid == 0) {
    gdn_gates<T>(v_head, t, args, b, a, a_log, dt_bias, beta, decay);
  }
}

// This simdgroup's state rows r = sg + m·n_sg of one value head (`head_state`, [dv, Dk]) to (Store) or from its
// registers: Dk/32 consecutive elements per lane.
template <uint Dk, bool Store>
LILY_INLINE void gdn_move_rows(thread float (&s)[LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP][Dk / 32],
                               device float* head_state, uint dv, uint sg, uint n_sg, uint lane) {
  for (uint m = 0; m < LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP; ++m) {
    const uint r = sg + m * n_sg;
    for (uint e = 0; e < Dk / 32 && r < dv; ++e) {
      device float& element = head_state[r * Dk + lane * (Dk / 32) + e];
      if (Store) {
        element = s[m][e];
      } else {
        s[m][e] = element;
      }
    }
  }
}

// Block = 0: the state rows stay in registers for the whole chunk. Block > 0 (blockwise): they are stored to and
// reloaded from `state` every Block tokens.
// One threadgroup barrier per token: after it, token t's staged inputs and token t - 1's outputs o are complete;
// then token t + 1 is staged into the other slot (its last readers finished before this barrier), every simdgroup
// updates its rows for token t into o slot t % 2, and simdgroup (t - 1) % n_sg applies the gated norm to token t - 1
// (its o slot is next written after the following barrier), so the loads and the norm overlap the row updates.
template <typename T, uint Dk, uint Block>
[[kernel]] void gated_delta_prefill(constant lily::GatedDeltaArgs& args [[buffer(0)]],
                                    device const float* conv_out [[buffer(1)]],  // [T, C] from gated_delta_conv
                                    device const T* z [[buffer(2)]],             // [T, Hv·dv]
                                    device const T* b [[buffer(3)]],             // [T, Hv]
                                    device const T* a [[buffer(4)]],             // [T, Hv]
                                    device const float* a_log [[buffer(5)]],     // [Hv]
                                    device const float* dt_bias [[buffer(6)]],   // [Hv]
                                    device const T* norm_weight [[buffer(7)]],   // [dv]
                                    device float* state [[buffer(8)]],           // [Hv, dv, Dk] in/out
                                    device T* out [[buffer(9)]],                 // [T, Hv·dv]
                                    uint v_head [[threadgroup_position_in_grid]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint n_threads [[threads_per_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]],
                                    uint sg [[simdgroup_index_in_threadgroup]],
                                    uint n_sg [[simdgroups_per_threadgroup]]) {
  static_assert(Dk <= LILY_GDN_MAX_DK, "the staged q and k rows");
  threadgroup float q_tg[2][LILY_GDN_MAX_DK];
  threadgroup float k_tg[2][LILY_GDN_MAX_DK];
  threadgroup float v_tg[2][LILY_GDN_MAX_ROWS];
  threadgroup float o_tg[2][LILY_GDN_MAX_ROWS];
  threadgroup float beta_tg[2];
  threadgroup float decay_tg[2];

  const uint dv = args.head_v_dim;
  const size_t v_offset = size_t(v_head) * dv;
  const uint num_tokens = args.num_tokens;
  const uint block = Block != 0 ? Block : num_tokens;

  // This simdgroup's rows r = sg + m·n_sg stay in registers (host: dv <= LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP·n_sg).
  float s[LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP][Dk / 32];
  gdn_move_rows<Dk, false>(s, state + v_offset * Dk, dv, sg, n_sg, lane);
  gdn_stage_token<T, Dk>(q_tg[0], k_tg[0], v_tg[0], &beta_tg[0], &decay_tg[0], 0, conv_out, b, a, a_log, dt_bias, args,
                         v_head, tid, n_threads);
  for (uint t = 0; t < num_tokens; ++t) {
    const uint slot = t % 2;
    if (Block != 0 && t % block == 0 && t != 0) {
      // The ablation's round trip: a device-memory fence between the store and the reload, so the compiler may not
      // carry the rows in registers across it (each lane reloads its own writes).
      gdn_move_rows<Dk, true>(s, state + v_offset * Dk, dv, sg, n_sg, lane);
      threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
      gdn_move_rows<Dk, false>(s, state + v_offset * Dk, dv, sg, n_sg, lane);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (t + 1 < num_tokens) {
      gdn_stage_token<T, Dk>(q_tg[1 - slot], k_tg[1 - slot], v_tg[1 - slot], &beta_tg[1 - slot], &decay_tg[1 - slot],
                             t + 1, conv_out, b, a, a_log, dt_bias, args, v_head, tid, n_threads);
    }
    if (t > 0 && sg == (t - 1) % n_sg) {
      const size_t offset = size_t(t - 1) * args.num_v_heads * dv + v_offset;
      gdn_gated_norm<T>(o_tg[1 - slot], z + offset, norm_weight, out + offset, dv, args.norm_eps, lane);
    }

    float q[Dk / 32];
    float k[Dk / 32];
    gdn_normalized_qk<Dk>(q_tg[slot], k_tg[slot], args.l2_eps, q, k, lane);
    for (uint m = 0; m < LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP; ++m) {
      const uint r = sg + m * n_sg;
      if (r >= dv) {
        break;  // uniform over the simdgroup: the collectives stay convergent
      }
      const float o = gdn_update_row<Dk>(s[m], q, k, decay_tg[slot], beta_tg[slot], v_tg[slot][r]);
      if (lane == 0) {
        o_tg[slot][r] = o;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == (num_tokens - 1) % n_sg) {
    const size_t offset = size_t(num_tokens - 1) * args.num_v_heads * dv + v_offset;
    gdn_gated_norm<T>(o_tg[(num_tokens - 1) % 2], z + offset, norm_weight, out + offset, dv, args.norm_eps, lane);
  }
  gdn_move_rows<Dk, true>(s, state + v_offset * Dk, dv, sg, n_sg, lane);
}

LILY_INSTANTIATE_KERNEL("gated_delta_conv_f32_dk128", gated_delta_conv, float, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_bf16_dk128", gated_delta_conv, bfloat, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_f32_dk128", gated_delta_prefill, float, 128, 0)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_bf16_dk128", gated_delta_prefill, bfloat, 128, 0)
// Demo model and tiny fixtures (Dk = 64: two state elements per lane), float32 and bf16 modes.
LILY_INSTANTIATE_KERNEL("gated_delta_conv_f32_dk64", gated_delta_conv, float, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_bf16_dk64", gated_delta_conv, bfloat, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_f32_dk64", gated_delta_prefill, float, 64, 0)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_bf16_dk64", gated_delta_prefill, bfloat, 64, 0)
// REGISTER_SCAN off (the ablation): the state round-trips through memory every LILY_GDN_SCAN_BLOCK tokens.
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_f32_dk128", gated_delta_prefill, float, 128, LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_bf16_dk128", gated_delta_prefill, bfloat, 128, LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_f32_dk64", gated_delta_prefill, float, 64, LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_bf16_dk64", gated_delta_prefill, bfloat, 64, LILY_GDN_SCAN_BLOCK)
