// Gated DeltaNet token mixer core: causal conv + SiLU over the q|k|v channels, q/k L2 norms,
// beta = sigmoid(b), g = -exp(A_log)·softplus(a + dt_bias), the gated delta rule on an fp32 state, and the
// SiLU(z)-gated RMSNorm. The projections around it (in_proj_*, out_proj) are qmatmul kernels.
//   gated_delta_step_<dtype>_dk128     decode, one token, everything fused (conv state and recurrent state updated
//                                      in place). Chosen for T = 1, except on CUDA, where the spread step (the conv in
//                                      the in_proj GEMV, gated_delta_prefill's scan, the gated norm in out_proj's
//                                      GEMV: tuning::spread_deltanet_step) replaces it.
//   gated_delta_conv_*, gated_delta_prefill[_blockwise]_*, gated_delta_prefill_norm_*
//                                      prefill of a chunk: metal/gated_delta_prefill.metal.
//   *_dk64 (f32, bf16)                 the same kernels at Dk = 64 (two state elements per lane) for the embedded demo
//                                      model and the test fixtures; the host picks by linear_key_head_dim.
// Layout: C = 2·Hk·Dk + Hv·dv channels [q | k | v]; conv state [K-1, C] (raw in_proj_qkv outputs, time-major);
// recurrent state [Hv, dv, Dk] fp32 (one contiguous Dk row per output channel: the transpose of
// lily.reference's [Hv, dk, dv]). Value head j uses key head j / (Hv/Hk).
// Dispatch. step: one threadgroup per KEY head (it owns the q/k channels and all Hv/Hk value heads of that key head,
// so the in-place conv-state shift never races with another threadgroup still reading the old state), any multiple
// of 32 threads up to 1024; state rows go round-robin over simdgroups, LILY_GDN_ROWS_PER_SIMDGROUP at a time through
// registers (their loads issued together, one memory round trip per batch).
// conv: one thread per channel, grid ceil(C / threads). prefill scan: grid (Hv, ceil(dv / 32)), each threadgroup
// owning 32 rows of one VALUE head (LILY_GDN_PREFILL_ROWS_PER_THREADGROUP), 32·n threads with rows <= 4·n (256
// threads); each simdgroup keeps its <= 4 rows in registers for the whole chunk. prefill norm: one simdgroup per
// (token, value head) row.
// Numerics: fp32 everywhere inside (conv, norms, state, gated norm); one rounding of each output to the activation
// dtype. Every reduction has a fixed order that does not depend on the threadgroup size (q/k norms and the gated
// norm are reduced inside one simdgroup), and the kernels share every arithmetic helper, so T step dispatches and one
// conv + prefill of T tokens give identical bits.
// Traffic: the step kernel reads and writes each fp32 state row once (64 KiB per value head at Dk = dv = 128, 2 MiB
// per layer each way), far more than its inputs; the prefill kernel does so once per chunk, not once per token; the
// blockwise variant once per block of LILY_GDN_SCAN_BLOCK tokens (a 512-token chunk: 32 x 2 MiB each way per layer
// instead of 2 MiB, four times the chunk's 16 MiB fp32 conv_out scratch).
#include <metal_stdlib>
#include "gated_delta.h"
#include "lily.h"

using namespace metal;
using namespace lily;

// A simdgroup's batch of LILY_GDN_ROWS_PER_SIMDGROUP state rows r0 + i * n_sg (this lane's Dk / 32 values of each),
// every load issued before the first is used; a row past n_rows re-reads the last row (never written back).
template <uint Dk>
LILY_INLINE void gdn_load_state_rows(thread float (&s)[LILY_GDN_ROWS_PER_SIMDGROUP][Dk / 32],
                                     device const float* head_state, uint r0, uint n_sg, uint n_rows) {
  LILY_UNROLL
  for (uint i = 0; i < LILY_GDN_ROWS_PER_SIMDGROUP; ++i) {
    device const float* row = head_state + size_t(min(r0 + i * n_sg, n_rows - 1)) * Dk;
    LILY_UNROLL
    for (uint e = 0; e < Dk / 32; ++e) {
      s[i][e] = row[e];
    }
  }
}

template <typename T, uint Dk>
[[kernel]] void gated_delta_step(constant lily::GatedDeltaArgs& args [[buffer(0)]],
                                 device const T* qkv [[buffer(1)]],           // [C] raw in_proj_qkv output
                                 device const T* z [[buffer(2)]],             // [Hv·dv] in_proj_z output
                                 device const T* b [[buffer(3)]],             // [Hv]
                                 device const T* a [[buffer(4)]],             // [Hv]
                                 device const T* conv_weight [[buffer(5)]],   // [C, K]
                                 device const float* a_log [[buffer(6)]],     // [Hv]
                                 device const float* dt_bias [[buffer(7)]],   // [Hv]
                                 device const T* norm_weight [[buffer(8)]],   // [dv] plain weight
                                 device T* conv_state [[buffer(9)]],          // [K-1, C] in/out
                                 device float* state [[buffer(10)]],          // [Hv, dv, Dk] in/out
                                 device T* out [[buffer(11)]],                // [Hv·dv]
                                 uint key_head [[threadgroup_position_in_grid]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint n_threads [[threads_per_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]],
                                 uint sg [[simdgroup_index_in_threadgroup]],
                                 uint n_sg [[simdgroups_per_threadgroup]]) {
  threadgroup float q_tg[Dk];
  threadgroup float k_tg[Dk];
  threadgroup float v_tg[LILY_GDN_MAX_ROWS];
  threadgroup float o_tg[LILY_GDN_MAX_ROWS];
  threadgroup float beta_tg[LILY_GDN_MAX_HEADS_PER_GROUP];
  threadgroup float decay_tg[LILY_GDN_MAX_HEADS_PER_GROUP];

  const uint heads = args.num_v_heads / args.num_k_heads;
  const uint dv = args.head_v_dim;
  const uint n_rows = heads * dv;
  const uint channels = 2 * args.num_k_heads * Dk + args.num_v_heads * dv;

  // State rows round-robin over simdgroups (row r0 + i * n_sg), LILY_GDN_ROWS_PER_SIMDGROUP at a time: all of a
  // batch's loads are issued before its first update (one memory round trip per batch, not per row), and the state
  // passes through registers once (read, update, write). A row past n_rows re-reads the last row and is never
  // written. The first batch is loaded before lily::grid_dependency_wait: only this layer's step writes the state, and
  // the host never starts this kernel early behind a dispatch that does (Node::early_reads), so on CUDA the state's
  // loads overlap the in_proj GEMV before it.
  constexpr uint kRows = LILY_GDN_ROWS_PER_SIMDGROUP;
  device float* head_state = state + size_t(key_head) * n_rows * Dk + lane * (Dk / 32);  // this lane's values
  float s[kRows][Dk / 32];
  if (sg < n_rows) {
    gdn_load_state_rows<Dk>(s, head_state, sg, n_sg, n_rows);
  }
  lily::grid_dependency_wait();  // qkv, z, b and a come from the dispatch before

  // Conv + SiLU of the key head's channels; each channel's conv state is shifted by the one thread that owns it.
  for (uint lc = tid; lc < 2 * Dk + n_rows; lc += n_threads) {
    const uint c = gdn_channel<Dk>(lc, key_head, args);
    float history[LILY_GDN_CONV_KERNEL];
    float weight[LILY_GDN_CONV_KERNEL];
    for (uint j = 0; j < LILY_GDN_CONV_KERNEL; ++j) {
      weight[j] = float(conv_weight[size_t(c) * LILY_GDN_CONV_KERNEL + j]);
    }
    for (uint j = 0; j + 1 < LILY_GDN_CONV_KERNEL; ++j) {
      history[j] = float(conv_state[size_t(j) * channels + c]);
    }
    history[LILY_GDN_CONV_KERNEL - 1] = float(qkv[c]);
    const float x = gdn_conv_silu(history, weight);
    for (uint j = 0; j + 1 < LILY_GDN_CONV_KERNEL; ++j) {
      conv_state[size_t(j) * channels + c] = T(history[j + 1]);  // exact: the history came from T values
    }
    if (lc < Dk) {
      q_tg[lc] = x;
    } else if (lc < 2 * Dk) {
      k_tg[lc - Dk] = x;
    } else {
      v_tg[lc - 2 * Dk] = x;
    }
  }
  if (tid < heads) {
    gdn_gates<T>(key_head * heads + tid, 0, args, b, a, a_log, dt_bias, &beta_tg[tid], &decay_tg[tid]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float q[Dk / 32];
  float k[Dk / 32];
  gdn_normalized_qk<Dk>(q_tg, k_tg, args.l2_eps, q, k, lane);
  for (uint r0 = sg; r0 < n_rows; r0 += n_sg * kRows) {
    if (r0 != sg) {
      gdn_load_state_rows<Dk>(s, head_state, r0, n_sg, n_rows);
    }
    LILY_UNROLL
    for (uint i = 0; i < kRows; ++i) {
      const uint r = r0 + i * n_sg;
      if (r >= n_rows) {
        break;  // uniform across the simdgroup: the simd_sums stay convergent
      }
      const uint h = r / dv;
      const float o = gdn_update_row<Dk>(s[i], q, k, decay_tg[h], beta_tg[h], v_tg[r]);
      device float* row = head_state + size_t(r) * Dk;
      LILY_UNROLL
      for (uint e = 0; e < Dk / 32; ++e) {
        row[e] = s[i][e];
      }
      if (lane == 0) {
        o_tg[r] = o;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint h = sg; h < heads; h += n_sg) {
    const size_t head_offset = size_t(key_head * heads + h) * dv;
    gdn_gated_norm<T>(o_tg + h * dv, z + head_offset, norm_weight, out + head_offset, dv, args.norm_eps, lane);
  }
}

LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_step_f32_dk128", gated_delta_step, float, 128)
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_step_bf16_dk128", gated_delta_step, bfloat, 128)
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_step_f32_dk64", gated_delta_step, float, 64)
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_step_bf16_dk64", gated_delta_step, bfloat, 64)
