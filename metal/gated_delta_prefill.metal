// Gated DeltaNet prefill of a chunk of T tokens (the decode step and the shared description: metal/gated_delta.metal):
//   gated_delta_conv_<dtype>_dk<Dk>     part 1: the causal conv + SiLU of T tokens into an fp32 scratch [T, C],
//                                      continuing from the conv state. One thread per channel and block of
//                                      LILY_GDN_CONV_TOKENS tokens.
//   gated_delta_conv_state_<dtype>_dk<Dk>
//                                      then the conv state: the chunk's last K - 1 inputs. One thread per channel.
//   gated_delta_prefill_<dtype>_dk<Dk>  part 2: the sequential scan over T tokens into an fp32 scratch o [T, Hv·dv]
//                                      (before the gated norm). Grid (Hv, ceil(dv / R)), R =
//                                      LILY_GDN_PREFILL_ROWS_PER_THREADGROUP: a threadgroup owns R state rows of one
//                                      value head and keeps them in registers for the whole chunk
//                                      (LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP per simdgroup), one barrier per token.
//                                      Chosen for T > 1 (after gated_delta_conv).
//   gated_delta_prefill_blockwise_<dtype>_dk<Dk>
//                                      the REGISTER_SCAN ablation (f32 and bf16): the state rows round-trip through
//                                      device memory every LILY_GDN_SCAN_BLOCK tokens. Same grid, arithmetic and bits.
//   gated_delta_prefill_norm_<dtype>   part 3: the SiLU(z)-gated RMSNorm of o into `out`, one simdgroup per
//                                      (token, value head) row; it needs a head's whole row, which part 2 splits.
// The rows of a head are independent given the token's q, k, v and gates, so the split changes no arithmetic: each
// row's o and the norm are computed as in the decode step, and T steps give the same bits as parts 1 to 3.
#include <metal_stdlib>
#include "gated_delta.h"
#include "lily.h"

using namespace metal;
using namespace lily;

// The raw input of channel c at chunk position p (p < 0: the conv state's row K - 1 + p, the inputs before the chunk).
template <typename T>
LILY_INLINE float gdn_conv_input(device const T* qkv, device const T* conv_state, int p, uint c, uint channels) {
  return p >= 0 ? float(qkv[size_t(p) * channels + c])
                : float(conv_state[size_t(int(LILY_GDN_CONV_KERNEL) - 1 + p) * channels + c]);
}

// Grid (ceil(C / threads), ceil(T / LILY_GDN_CONV_TOKENS)): thread (c, block) convolves LILY_GDN_CONV_TOKENS tokens of
// channel c, starting from the K - 1 inputs before its first token (from the chunk, or the conv state for the first
// tokens). The conv state is not written here: gated_delta_conv_state does that after every block has read it.
template <typename T, uint Dk>
[[kernel]] void gated_delta_conv(constant lily::GatedDeltaArgs& args [[buffer(0)]],
                                 device const T* qkv [[buffer(1)]],          // [T, C] raw in_proj_qkv outputs
                                 device const T* conv_weight [[buffer(2)]],  // [C, K]
                                 device const T* conv_state [[buffer(3)]],   // [K-1, C] the inputs before the chunk
                                 device float* conv_out [[buffer(4)]],       // [T, C] SiLU(conv), fp32 scratch
                                 uint2 position [[thread_position_in_grid]]) {
  const uint channels = 2 * args.num_k_heads * Dk + args.num_v_heads * args.head_v_dim;
  const uint c = position.x;
  const uint first = position.y * LILY_GDN_CONV_TOKENS;
  if (c >= channels || first >= args.num_tokens) {
    return;
  }
  float weight[LILY_GDN_CONV_KERNEL];
  float history[LILY_GDN_CONV_KERNEL];
  for (uint j = 0; j < LILY_GDN_CONV_KERNEL; ++j) {
    weight[j] = float(conv_weight[size_t(c) * LILY_GDN_CONV_KERNEL + j]);
  }
  for (uint j = 0; j + 1 < LILY_GDN_CONV_KERNEL; ++j) {
    history[j] = gdn_conv_input(qkv, conv_state, int(first) - int(LILY_GDN_CONV_KERNEL - 1) + int(j), c, channels);
  }
  // A sliding window in registers: each raw input of the block is read once.
  const uint end = min(first + LILY_GDN_CONV_TOKENS, args.num_tokens);
  for (uint t = first; t < end; ++t) {
    history[LILY_GDN_CONV_KERNEL - 1] = float(qkv[size_t(t) * channels + c]);
    conv_out[size_t(t) * channels + c] = gdn_conv_silu(history, weight);
    for (uint j = 0; j + 1 < LILY_GDN_CONV_KERNEL; ++j) {
      history[j] = history[j + 1];
    }
  }
}

// The conv state after the chunk: its last K - 1 inputs (with fewer tokens than that, the older state's last rows
// first). One thread per channel; row j reads row T + j of the old state (T >= 1) before any later row is written.
template <typename T, uint Dk>
[[kernel]] void gated_delta_conv_state(constant lily::GatedDeltaArgs& args [[buffer(0)]],
                                       device const T* qkv [[buffer(1)]],  // [T, C]
                                       device T* conv_state [[buffer(2)]],  // [K-1, C] in/out
                                       uint c [[thread_position_in_grid]]) {
  const uint channels = 2 * args.num_k_heads * Dk + args.num_v_heads * args.head_v_dim;
  if (c >= channels) {
    return;
  }
  for (uint j = 0; j + 1 < LILY_GDN_CONV_KERNEL; ++j) {
    const int p = int(args.num_tokens) - int(LILY_GDN_CONV_KERNEL - 1) + int(j);
    conv_state[size_t(j) * channels + c] = T(gdn_conv_input(qkv, conv_state, p, c, channels));
  }
}

// Stages token t's scan inputs in one slot of the kernel's double-buffered threadgroup arrays: raw q and k of the key
// head, v of this threadgroup's `rows` rows from `first_row` of the value head, beta and the decay.
template <typename T, uint Dk>
LILY_INLINE void gdn_stage_token(threadgroup float* q, threadgroup float* k, threadgroup float* v,
                                 threadgroup float* beta, threadgroup float* decay, uint t,
                                 device const float* conv_out, device const T* b, device const T* a,
                                 device const float* a_log, device const float* dt_bias,
                                 constant lily::GatedDeltaArgs& args, uint v_head, uint first_row, uint rows, uint tid,
                                 uint n_threads) {
  const uint dv = args.head_v_dim;
  const uint key_dim = args.num_k_heads * Dk;
  const uint channels = 2 * key_dim + args.num_v_heads * dv;
  const uint key_head = v_head / (args.num_v_heads / args.num_k_heads);
  device const float* x = conv_out + size_t(t) * channels;
  for (uint i = tid; i < 2 * Dk + rows; i += n_threads) {
    if (i < Dk) {
      q[i] = x[key_head * Dk + i];
    } else if (i < 2 * Dk) {
      k[i - Dk] = x[key_dim + key_head * Dk + (i - Dk)];
    } else {
      v[i - 2 * Dk] = x[2 * key_dim + v_head * dv + first_row + (i - 2 * Dk)];
    }
  }
  if (tid == 0) {
    gdn_gates<T>(v_head, t, args, b, a, a_log, dt_bias, beta, decay);
  }
}

// This simdgroup's rows r = sg + m·n_sg < `rows` of the threadgroup's slice (`slice_state`, [rows, Dk]) to (Store) or
// from its registers: Dk/32 consecutive elements per lane.
template <uint Dk, bool Store>
LILY_INLINE void gdn_move_rows(thread float (&s)[LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP][Dk / 32],
                               device float* slice_state, uint rows, uint sg, uint n_sg, uint lane) {
  LILY_UNROLL
  for (uint m = 0; m < LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP; ++m) {
    const uint r = sg + m * n_sg;
    LILY_UNROLL
    for (uint e = 0; e < Dk / 32; ++e) {
      if (r < rows) {
        device float& element = slice_state[r * Dk + lane * (Dk / 32) + e];
        if (Store) {
          element = s[m][e];
        } else {
          s[m][e] = element;
        }
      }
    }
  }
}

// Block = 0: the state rows stay in registers for the whole chunk. Block > 0 (blockwise): they are stored to and
// reloaded from `state` every Block tokens.
// One threadgroup barrier per token: after it, token t's staged inputs are complete; then token t + 1 is staged into
// the other slot (its last readers finished before this barrier) while every simdgroup updates its rows for token t,
// so the loads overlap the row updates. Lane 0 writes each row's o to `core_out`.
template <typename T, uint Dk, uint Block>
[[kernel]] void gated_delta_prefill(constant lily::GatedDeltaArgs& args [[buffer(0)]],
                                    device const float* conv_out [[buffer(1)]],  // [T, C] from gated_delta_conv
                                    device const T* b [[buffer(2)]],             // [T, Hv]
                                    device const T* a [[buffer(3)]],             // [T, Hv]
                                    device const float* a_log [[buffer(4)]],     // [Hv]
                                    device const float* dt_bias [[buffer(5)]],   // [Hv]
                                    device float* state [[buffer(6)]],           // [Hv, dv, Dk] in/out
                                    device float* core_out [[buffer(7)]],        // [T, Hv·dv] o, before the norm
                                    uint2 group [[threadgroup_position_in_grid]],  // (value head, row slice)
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint2 threads_per_group [[threads_per_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]],
                                    uint sg [[simdgroup_index_in_threadgroup]],
                                    uint n_sg [[simdgroups_per_threadgroup]]) {
  static_assert(Dk <= LILY_GDN_MAX_DK, "the staged q and k rows");
  const uint n_threads = threads_per_group.x;  // 1-D threadgroups: the attribute's width matches the position's
  threadgroup float q_tg[2][LILY_GDN_MAX_DK];
  threadgroup float k_tg[2][LILY_GDN_MAX_DK];
  threadgroup float v_tg[2][LILY_GDN_PREFILL_ROWS_PER_THREADGROUP];
  threadgroup float beta_tg[2];
  threadgroup float decay_tg[2];

  const uint dv = args.head_v_dim;
  const uint v_head = group.x;
  const uint first_row = group.y * LILY_GDN_PREFILL_ROWS_PER_THREADGROUP;
  if (first_row >= dv) {
    return;  // the whole threadgroup, before any barrier
  }
  const uint rows = min(uint(LILY_GDN_PREFILL_ROWS_PER_THREADGROUP), dv - first_row);
  device float* slice_state = state + (size_t(v_head) * dv + first_row) * Dk;
  device float* slice_out = core_out + size_t(v_head) * dv + first_row;
  const size_t out_stride = size_t(args.num_v_heads) * dv;
  const uint num_tokens = args.num_tokens;
  const uint block = Block != 0 ? Block : num_tokens;

  // This simdgroup's rows r = sg + m·n_sg of the slice stay in registers (host: rows <=
  // LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP·n_sg).
  float s[LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP][Dk / 32];
  gdn_move_rows<Dk, false>(s, slice_state, rows, sg, n_sg, lane);
  gdn_stage_token<T, Dk>(q_tg[0], k_tg[0], v_tg[0], &beta_tg[0], &decay_tg[0], 0, conv_out, b, a, a_log, dt_bias, args,
                         v_head, first_row, rows, tid, n_threads);
  for (uint t = 0; t < num_tokens; ++t) {
    const uint slot = t % 2;
    if (Block != 0 && t % block == 0 && t != 0) {
      // The ablation's round trip: a device-memory fence between the store and the reload, so the compiler may not
      // carry the rows in registers across it (each lane reloads its own writes).
      gdn_move_rows<Dk, true>(s, slice_state, rows, sg, n_sg, lane);
      threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
      gdn_move_rows<Dk, false>(s, slice_state, rows, sg, n_sg, lane);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (t + 1 < num_tokens) {
      gdn_stage_token<T, Dk>(q_tg[1 - slot], k_tg[1 - slot], v_tg[1 - slot], &beta_tg[1 - slot], &decay_tg[1 - slot],
                             t + 1, conv_out, b, a, a_log, dt_bias, args, v_head, first_row, rows, tid, n_threads);
    }

    float q[Dk / 32];
    float k[Dk / 32];
    gdn_normalized_qk<Dk>(q_tg[slot], k_tg[slot], args.l2_eps, q, k, lane);
    // Unrolled, so the state rows s[m] stay in registers (a loop with a break indexed them in local memory on CUDA).
    LILY_UNROLL
    for (uint m = 0; m < LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP; ++m) {
      const uint r = sg + m * n_sg;
      if (r < rows) {  // uniform over the simdgroup: the collectives stay convergent
        const float o = gdn_update_row<Dk>(s[m], q, k, decay_tg[slot], beta_tg[slot], v_tg[slot][r]);
        if (lane == 0) {
          slice_out[size_t(t) * out_stride + r] = o;
        }
      }
    }
  }
  gdn_move_rows<Dk, true>(s, slice_state, rows, sg, n_sg, lane);
}

// The gated RMSNorm of gated_delta_prefill's o: simdgroup sg of threadgroup g takes row g·n_sg + sg of the T·Hv
// (token, value head) rows, the decode step's gdn_gated_norm on the same fp32 values.
template <typename T>
[[kernel]] void gated_delta_prefill_norm(constant lily::GatedDeltaArgs& args [[buffer(0)]],
                                         device const float* core_out [[buffer(1)]],  // [T, Hv·dv] o
                                         device const T* z [[buffer(2)]],             // [T, Hv·dv]
                                         device const T* norm_weight [[buffer(3)]],   // [dv]
                                         device T* out [[buffer(4)]],                 // [T, Hv·dv]
                                         uint group [[threadgroup_position_in_grid]],
                                         uint lane [[thread_index_in_simdgroup]],
                                         uint sg [[simdgroup_index_in_threadgroup]],
                                         uint n_sg [[simdgroups_per_threadgroup]]) {
  const uint row = group * n_sg + sg;
  if (row >= args.num_tokens * args.num_v_heads) {
    return;  // whole simdgroups; no barrier follows
  }
  const size_t offset = size_t(row) * args.head_v_dim;
  gdn_gated_norm<T>(core_out + offset, z + offset, norm_weight, out + offset, args.head_v_dim, args.norm_eps, lane);
}

LILY_INSTANTIATE_KERNEL("gated_delta_conv_f32_dk128", gated_delta_conv, float, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_bf16_dk128", gated_delta_conv, bfloat, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_state_f32_dk128", gated_delta_conv_state, float, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_state_bf16_dk128", gated_delta_conv_state, bfloat, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_f32_dk128", gated_delta_prefill, float, 128, 0)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_bf16_dk128", gated_delta_prefill, bfloat, 128, 0)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_norm_f32", gated_delta_prefill_norm, float)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_norm_bf16", gated_delta_prefill_norm, bfloat)
// Demo model and tiny fixtures (Dk = 64: two state elements per lane), float32 and bf16 modes.
LILY_INSTANTIATE_KERNEL("gated_delta_conv_f32_dk64", gated_delta_conv, float, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_bf16_dk64", gated_delta_conv, bfloat, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_state_f32_dk64", gated_delta_conv_state, float, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_state_bf16_dk64", gated_delta_conv_state, bfloat, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_f32_dk64", gated_delta_prefill, float, 64, 0)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_bf16_dk64", gated_delta_prefill, bfloat, 64, 0)
// REGISTER_SCAN off (the ablation): the state round-trips through memory every LILY_GDN_SCAN_BLOCK tokens.
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_f32_dk128", gated_delta_prefill, float, 128, LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_bf16_dk128", gated_delta_prefill, bfloat, 128, LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_f32_dk64", gated_delta_prefill, float, 64, LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_bf16_dk64", gated_delta_prefill, bfloat, 64, LILY_GDN_SCAN_BLOCK)
