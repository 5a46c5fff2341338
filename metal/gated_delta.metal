// Gated DeltaNet token mixer core (model.md §2.5, §3.2): causal conv + SiLU over the q|k|v channels, q/k L2 norms,
// beta = sigmoid(b), g = -exp(A_log)·softplus(a + dt_bias), the gated delta rule on an fp32 state, and the
// SiLU(z)-gated RMSNorm. The projections around it (in_proj_*, out_proj) are qmatmul kernels.
//   gated_delta_step_<dtype>_dk128     decode, one token, everything fused (conv state and recurrent state updated
//                                      in place). Chosen for T = 1.
//   gated_delta_conv_<dtype>_dk128     prefill part 1: the causal conv + SiLU of T tokens into an fp32 scratch
//                                      [T, C], continuing from and updating the conv state. One thread per channel.
//   gated_delta_prefill_<dtype>_dk128  prefill part 2: the sequential scan over T tokens with the state rows held in
//                                      registers for the whole chunk. Chosen for T > 1 (after gated_delta_conv).
//   gated_delta_prefill_blockwise_<dtype>_dk128
//                                      the REGISTER_SCAN ablation (switch off; f32 and bf16, the engine's modes): the
//                                      same scan, but the state rows round-trip through device memory every
//                                      LILY_GDN_SCAN_BLOCK tokens (load at the start of a block, store at its end), the
//                                      design before register residency. Same arithmetic, so the same bits.
//   *_dk64 (f32, bf16)                 the same four at Dk = 64 (two state elements per lane) for the embedded demo
//                                      model and the test fixtures; the host picks by linear_key_head_dim.
// Layout: C = 2·Hk·Dk + Hv·dv channels [q | k | v]; conv state [K-1, C] (raw in_proj_qkv outputs, time-major);
// recurrent state [Hv, dv, Dk] fp32 (one contiguous Dk row per output channel: the transpose of
// lily.reference's [Hv, dk, dv]). Value head j uses key head j / (Hv/Hk).
// Dispatch. step: one threadgroup per KEY head (it owns the q/k channels and all Hv/Hk value heads of that key head,
// so the in-place conv-state shift never races with another threadgroup still reading the old state), any multiple
// of 32 threads up to 1024; state rows go round-robin over simdgroups, one row at a time through registers.
// conv: one thread per channel, grid ceil(C / threads). prefill: one threadgroup per VALUE head, 32·n threads with
// dv <= 8·n (512 threads for dv = 128); each simdgroup keeps its <= 8 rows in registers for the whole chunk.
// Numerics: fp32 everywhere inside (conv, norms, state, gated norm); one rounding of each output to the activation
// dtype. Every reduction has a fixed order that does not depend on the threadgroup size (q/k norms and the gated
// norm are reduced inside one simdgroup), and the kernels share every arithmetic helper, so T step dispatches and one
// conv + prefill of T tokens give identical bits.
// Traffic: the step kernel reads and writes each fp32 state row once (64 KiB per value head at Dk = dv = 128, 2 MiB
// per layer each way), far more than its inputs; the prefill kernel does so once per chunk, not once per token; the
// blockwise variant once per block of LILY_GDN_SCAN_BLOCK tokens (a 512-token chunk: 32 x 2 MiB each way per layer
// instead of 2 MiB, four times the chunk's 16 MiB fp32 conv_out scratch).
#include <metal_stdlib>
#include "lily.h"

using namespace metal;

inline float gdn_sigmoid(float x) {
  return 1.0f / (1.0f + precise::exp(-x));
}

inline float gdn_silu(float x) {
  return x / (1.0f + precise::exp(-x));
}

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
  return gdn_silu(acc);
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

// Beta and the decay exp(g) of value head j for one token.
template <typename T>
inline void gdn_gates(uint j, uint token, constant lily::GatedDeltaArgs& args, device const T* b, device const T* a,
                      device const float* a_log, device const float* dt_bias, threadgroup float* beta,
                      threadgroup float* decay) {
  const size_t idx = size_t(token) * args.num_v_heads + j;
  *beta = gdn_sigmoid(float(b[idx]));
  const float g = -precise::exp(a_log[j]) * gdn_softplus(float(a[idx]) + dt_bias[j]);  // log-decay <= 0
  *decay = precise::exp(g);
}

// Each lane's Dk/32 consecutive elements of the L2-normalised q (times dk^-0.5) and k. Every simdgroup reduces the
// squares itself in the same order, so the result does not depend on the threadgroup size.
template <uint Dk>
inline void gdn_normalized_qk(threadgroup const float* q_raw, threadgroup const float* k_raw, float l2_eps,
                              thread float* q, thread float* k, uint lane) {
  float q_sq = 0.0f;
  float k_sq = 0.0f;
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
  for (uint e = 0; e < Dk / 32; ++e) {
    q[e] *= q_factor;
    k[e] *= k_factor;
  }
}

// The delta rule on one state row (this lane's Dk/32 elements): decay, error against the decayed state, rank-1
// write, then the read-out o = S^T q AFTER the write. Returns o to every lane.
template <uint Dk>
inline float gdn_update_row(thread float* s, thread const float* q, thread const float* k, float alpha, float beta,
                            float v) {
  float kv = 0.0f;
  for (uint e = 0; e < Dk / 32; ++e) {
    s[e] *= alpha;
    kv = fma(s[e], k[e], kv);
  }
  kv = simd_sum(kv);
  const float delta = beta * (v - kv);
  float o = 0.0f;
  for (uint e = 0; e < Dk / 32; ++e) {
    s[e] = fma(k[e], delta, s[e]);
    o = fma(s[e], q[e], o);
  }
  return simd_sum(o);
}

// SiLU(z)-gated RMSNorm of one value head's o [dv] by one simdgroup (fixed order: lane-strided sums, simd_sum).
template <typename T>
inline void gdn_gated_norm(threadgroup const float* o, device const T* z, device const T* norm_weight,
                           device T* out, uint dv, float eps, uint lane) {
  float sq = 0.0f;
  for (uint d = lane; d < dv; d += 32) {
    sq = fma(o[d], o[d], sq);
  }
  const float inv_rms = precise::rsqrt(simd_sum(sq) / float(dv) + eps);
  for (uint d = lane; d < dv; d += 32) {
    out[d] = T(o[d] * inv_rms * float(norm_weight[d]) * gdn_silu(float(z[d])));
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
  // Rows round-robin over simdgroups, one at a time: the state passes through registers once (read, update, write).
  for (uint r = sg; r < n_rows; r += n_sg) {
    const uint h = r / dv;
    device float* row = state + (size_t(key_head) * n_rows + r) * Dk + lane * (Dk / 32);
    float s[Dk / 32];
    for (uint e = 0; e < Dk / 32; ++e) {
      s[e] = row[e];
    }
    const float o = gdn_update_row<Dk>(s, q, k, decay_tg[h], beta_tg[h], v_tg[r]);
    for (uint e = 0; e < Dk / 32; ++e) {
      row[e] = s[e];
    }
    if (lane == 0) {
      o_tg[r] = o;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint h = sg; h < heads; h += n_sg) {
    const size_t head_offset = size_t(key_head * heads + h) * dv;
    gdn_gated_norm<T>(o_tg + h * dv, z + head_offset, norm_weight, out + head_offset, dv, args.norm_eps, lane);
  }
}

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

// Block = 0: the state rows stay in registers for the whole chunk. Block > 0 (blockwise): they are stored to and
// reloaded from `state` every Block tokens.
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
  threadgroup float q_tg[Dk];
  threadgroup float k_tg[Dk];
  threadgroup float v_tg[LILY_GDN_MAX_ROWS];
  threadgroup float o_tg[LILY_GDN_MAX_ROWS];
  threadgroup float beta_tg[1];
  threadgroup float decay_tg[1];

  const uint dv = args.head_v_dim;
  const uint key_dim = args.num_k_heads * Dk;
  const uint channels = 2 * key_dim + args.num_v_heads * dv;
  const uint key_head = v_head / (args.num_v_heads / args.num_k_heads);
  const size_t v_offset = size_t(v_head) * dv;

  // This simdgroup's rows r = sg + m·n_sg stay in registers for a block of tokens (host: dv <= 8·n_sg): the whole
  // chunk when Block = 0.
  float s[LILY_GDN_ROWS_PER_SIMDGROUP][Dk / 32];
  const uint block = Block != 0 ? Block : args.num_tokens;
  for (uint first = 0; first < args.num_tokens; first += block) {
    for (uint m = 0; m < LILY_GDN_ROWS_PER_SIMDGROUP; ++m) {
      const uint r = sg + m * n_sg;
      for (uint e = 0; e < Dk / 32 && r < dv; ++e) {
        s[m][e] = state[(v_offset + r) * Dk + lane * (Dk / 32) + e];
      }
    }
    for (uint t = first; t < min(first + block, args.num_tokens); ++t) {
      // Two barriers per token suffice: the writes below only race with reads made before the previous token's
      // second barrier (q/k/v/gates) or after this token's first barrier (o).
      device const float* x = conv_out + size_t(t) * channels;
      for (uint i = tid; i < 2 * Dk + dv; i += n_threads) {
        if (i < Dk) {
          q_tg[i] = x[key_head * Dk + i];
        } else if (i < 2 * Dk) {
          k_tg[i - Dk] = x[key_dim + key_head * Dk + (i - Dk)];
        } else {
          v_tg[i - 2 * Dk] = x[2 * key_dim + v_offset + (i - 2 * Dk)];
        }
      }
      if (tid == 0) {
        gdn_gates<T>(v_head, t, args, b, a, a_log, dt_bias, &beta_tg[0], &decay_tg[0]);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      float q[Dk / 32];
      float k[Dk / 32];
      gdn_normalized_qk<Dk>(q_tg, k_tg, args.l2_eps, q, k, lane);
      for (uint m = 0; m < LILY_GDN_ROWS_PER_SIMDGROUP; ++m) {
        const uint r = sg + m * n_sg;
        if (r >= dv) {
          break;  // uniform over the simdgroup: the collectives stay convergent
        }
        const float o = gdn_update_row<Dk>(s[m], q, k, decay_tg[0], beta_tg[0], v_tg[r]);
        if (lane == 0) {
          o_tg[r] = o;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      if (sg == 0) {
        const size_t offset = size_t(t) * args.num_v_heads * dv + v_offset;
        gdn_gated_norm<T>(o_tg, z + offset, norm_weight, out + offset, dv, args.norm_eps, lane);
      }
    }
    for (uint m = 0; m < LILY_GDN_ROWS_PER_SIMDGROUP; ++m) {
      const uint r = sg + m * n_sg;
      for (uint e = 0; e < Dk / 32 && r < dv; ++e) {
        state[(v_offset + r) * Dk + lane * (Dk / 32) + e] = s[m][e];
      }
    }
    if (Block != 0) {
      // A device-memory fence between the store and the next block's load: the compiler may not carry the rows in
      // registers across it, so the ablation really moves the state through memory (each lane reloads its own writes).
      threadgroup_barrier(mem_flags::mem_device);
    }
  }
}

LILY_INSTANTIATE_KERNEL("gated_delta_step_f32_dk128", gated_delta_step, float, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_step_bf16_dk128", gated_delta_step, bfloat, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_f32_dk128", gated_delta_conv, float, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_bf16_dk128", gated_delta_conv, bfloat, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_f32_dk128", gated_delta_prefill, float, 128, 0)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_bf16_dk128", gated_delta_prefill, bfloat, 128, 0)
// Demo model and tiny fixtures (Dk = 64: two state elements per lane), float32 and bf16 modes.
LILY_INSTANTIATE_KERNEL("gated_delta_step_f32_dk64", gated_delta_step, float, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_step_bf16_dk64", gated_delta_step, bfloat, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_f32_dk64", gated_delta_conv, float, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_bf16_dk64", gated_delta_conv, bfloat, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_f32_dk64", gated_delta_prefill, float, 64, 0)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_bf16_dk64", gated_delta_prefill, bfloat, 64, 0)
// REGISTER_SCAN off (the ablation): the state round-trips through memory every LILY_GDN_SCAN_BLOCK tokens.
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_f32_dk128", gated_delta_prefill, float, 128, LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_bf16_dk128", gated_delta_prefill, bfloat, 128, LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_f32_dk64", gated_delta_prefill, float, 64, LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_blockwise_bf16_dk64", gated_delta_prefill, bfloat, 64, LILY_GDN_SCAN_BLOCK)
