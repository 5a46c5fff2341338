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
//   gated_delta_chunk_prepare_<dtype>_dk<Dk>
//   gated_delta_chunk_scan_<dtype>_dk<Dk>
//                                      part 2 for chunks of tokens >= tuning::kGdnChunkedMinTokens (CHUNKED_SCAN on,
//                                      dv a multiple of 8): the chunked (parallel-in-time) scan, same core_out.
//                                      prepare: grid (Hv, ceil(T / LILY_GDN_CHUNK)), every chunk's matrices at once;
//                                      scan: grid (Hv, ceil(dv / (8 * LILY_GDN_CHUNK_SCAN_SIMDGROUPS))), sequential
//                                      over the chunks, matrix products only. Not the plain scan's bits.
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
  // The state rows are loaded before the wait: only this kernel writes the state (the host never starts it early
  // behind a dispatch that does: Node::early_reads), so on CUDA their loads overlap the dispatch before.
  lily::grid_dependency_wait();  // conv_out, b and a come from the dispatches before
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

// ---- The chunked scan: gated_delta_chunk_prepare, then gated_delta_chunk_scan ----
// Per value head and chunk of C = LILY_GDN_CHUNK tokens starting from the state S0 [dv, Dk], with q^, k^ the
// normalised rows, D(i, j) = g_{j+1} + ... + g_i the log-decay from token j to token i (0 for i = j; every term <= 0)
// and gamma_i = e^{D(i, -1)} the decay from the chunk's start:
//   A_ij = beta_i e^{D(i, j)} k^_i·k^_j (j < i),  Tinv = (I + A)^{-1} (unit lower triangular)
//   W = Tinv diag(beta * gamma) K^ [C, Dk],  U = Tinv diag(beta) V [C, dv]
//   M_ij = e^{D(i, j)} q^_i·k^_j (j <= i),  Qg = diag(gamma) Q^ [C, Dk],  KdT = (diag(e^{D(last, j)}) K^)^T [Dk, C]
// and per chunk, in order: V' = U - W S0^T (row j: the delta rule's rank-1 update vector of token j),
//   o = Qg S0^T + M V',  S^T = gamma_last S0^T + KdT V'.
// (Unrolling the token rule: delta_t + sum_{j<t} A_tj delta_j = beta_t (v_t - gamma_t S0 k^_t).) Every exponent is
// <= 0; D is summed over its own tokens, not as a difference of cumulative sums, which would cancel. Rows past the
// last token of a partial chunk have q^ = k^ = v = beta = g = 0, so every operand row of theirs is zero and they change
// nothing.

// gated_delta_chunk_prepare: one threadgroup per (value head, chunk), any number of whole simdgroups >= C threads.
// Writes the chunk's operands of the scan (fp32, zero rows past the last token): W, U, Qg, KdT, M and gamma_last.
// Threadgroup memory: two [C, LILY_GDN_CHUNK_SLAB] slabs (the staged operands: q^ and k^ columns for the Gram matrices,
// then K^ or V columns for W and U) and two [C, C] matrices (Q^K^^T then Tinv; K^K^^T then A).
template <typename T, uint Dk>
[[kernel]] void gated_delta_chunk_prepare(constant lily::GatedDeltaArgs& args [[buffer(0)]],
                                          device const float* conv_out [[buffer(1)]],  // [T, channels]
                                          device const T* b [[buffer(2)]],             // [T, Hv]
                                          device const T* a [[buffer(3)]],             // [T, Hv]
                                          device const float* a_log [[buffer(4)]],     // [Hv]
                                          device const float* dt_bias [[buffer(5)]],   // [Hv]
                                          device float* w_out [[buffer(6)]],      // [Hv, chunks, C, Dk] W
                                          device float* u_out [[buffer(7)]],      // [Hv, chunks, C, dv] U
                                          device float* qg_out [[buffer(8)]],     // [Hv, chunks, C, Dk] Qg
                                          device float* kdt_out [[buffer(9)]],    // [Hv, chunks, Dk, C] KdT
                                          device float* m_out [[buffer(10)]],     // [Hv, chunks, C, C] M
                                          device float* gamma_out [[buffer(11)]],  // [Hv, chunks] gamma_last
                                          uint2 group [[threadgroup_position_in_grid]],  // (value head, chunk)
                                          uint tid [[thread_index_in_threadgroup]],
                                          uint2 threads_per_group [[threads_per_threadgroup]],
                                          uint lane [[thread_index_in_simdgroup]],
                                          uint sg [[simdgroup_index_in_threadgroup]],
                                          uint n_sg [[simdgroups_per_threadgroup]]) {
  constexpr uint C = LILY_GDN_CHUNK;
  constexpr uint SLAB = LILY_GDN_CHUNK_SLAB;
  constexpr uint NB = C / 8;                  // 8-token blocks of a chunk
  constexpr uint LOWER = NB * (NB + 1) / 2;   // blocks on and below the diagonal of a [C, C] matrix
  static_assert(C % 8 == 0 && C <= 32 && Dk % SLAB == 0 && SLAB % 8 == 0, "the chunk and slab shapes");
  threadgroup float slab_a[LILY_GDN_CHUNK * LILY_GDN_CHUNK_SLAB];  // q^ columns; then the K^ or V columns of W, U
  threadgroup float slab_b[LILY_GDN_CHUNK * LILY_GDN_CHUNK_SLAB];  // k^ columns
  threadgroup float qk[LILY_GDN_CHUNK * LILY_GDN_CHUNK];  // Q^K^^T (lower blocks), then Tinv
  threadgroup float kk[LILY_GDN_CHUNK * LILY_GDN_CHUNK];  // K^K^^T (lower blocks), then A
  threadgroup float g_tg[LILY_GDN_CHUNK];       // log-decay g_i
  threadgroup float beta_tg[LILY_GDN_CHUNK];
  threadgroup float q_factor[LILY_GDN_CHUNK];   // q^ = q_factor · q (Dk^-0.5 included)
  threadgroup float k_factor[LILY_GDN_CHUNK];
  threadgroup float gamma_tg[LILY_GDN_CHUNK];   // e^{D(i, -1)}
  threadgroup float to_end[LILY_GDN_CHUNK];     // e^{D(last, j)}

  const uint n_threads = threads_per_group.x;
  const uint dv = args.head_v_dim;
  const uint v_head = group.x, chunk = group.y;
  const uint key_dim = args.num_k_heads * Dk;
  const uint channels = 2 * key_dim + args.num_v_heads * dv;
  const uint key_head = v_head / (args.num_v_heads / args.num_k_heads);
  const uint first = chunk * C;
  const uint n = min(C, args.num_tokens - first);  // tokens of this chunk
  const size_t hc = size_t(v_head) * ((args.num_tokens + C - 1) / C) + chunk;
  device const float* q_raw = conv_out + size_t(first) * channels + key_head * Dk;
  device const float* k_raw = q_raw + key_dim;
  device const float* v_raw = conv_out + size_t(first) * channels + 2 * key_dim + v_head * dv;
  device float* w_c = w_out + hc * C * Dk;
  device float* u_c = u_out + hc * C * dv;
  device float* qg_c = qg_out + hc * C * Dk;
  device float* kdt_c = kdt_out + hc * Dk * C;
  device float* m_c = m_out + hc * C * C;

  // 1. Per token (one simdgroup each): the q and k norms as gdn_normalized_qk forms them, beta and g.
  for (uint i = sg; i < C; i += n_sg) {  // uniform over the simdgroup
    float q_sq = 0.0f;
    float k_sq = 0.0f;
    if (i < n) {
      LILY_UNROLL
      for (uint e = 0; e < Dk / 32; ++e) {
        const float q = q_raw[size_t(i) * channels + lane * (Dk / 32) + e];
        const float k = k_raw[size_t(i) * channels + lane * (Dk / 32) + e];
        q_sq = fma(q, q, q_sq);
        k_sq = fma(k, k, k_sq);
      }
    }
    q_sq = simd_sum(q_sq);
    k_sq = simd_sum(k_sq);
    if (lane == 0) {
      const bool valid = i < n;
      q_factor[i] = valid ? precise::rsqrt(q_sq + args.l2_eps) * precise::rsqrt(float(Dk)) : 0.0f;
      k_factor[i] = valid ? precise::rsqrt(k_sq + args.l2_eps) : 0.0f;
      beta_tg[i] = valid ? sigmoid(float(b[size_t(first + i) * args.num_v_heads + v_head])) : 0.0f;
      g_tg[i] = valid ? gdn_log_decay<T>(v_head, first + i, args, a, a_log, dt_bias) : 0.0f;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // 2. The decays from the chunk's start and to its end (g = 0 past the last token: the end is the last token).
  if (tid < C) {
    float from_start = 0.0f;
    float until_end = 0.0f;
    for (uint l = 0; l < C; ++l) {
      if (l <= tid) {
        from_start += g_tg[l];
      } else {
        until_end += g_tg[l];
      }
    }
    gamma_tg[tid] = precise::exp(from_start);
    to_end[tid] = precise::exp(until_end);
    if (tid == C - 1) {
      gamma_out[hc] = precise::exp(from_start);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. The Gram matrices Q^K^^T and K^K^^T (blocks on and below the diagonal), over slabs of SLAB key dims staged with
  // zero rows past the last token; the staging also writes the scan's Qg and KdT columns.
  for (uint d0 = 0; d0 < Dk; d0 += SLAB) {
    for (uint e = tid; e < C * SLAB; e += n_threads) {
      const uint i = e / SLAB, s = e % SLAB;
      const float q = i < n ? q_raw[size_t(i) * channels + d0 + s] * q_factor[i] : 0.0f;
      const float k = i < n ? k_raw[size_t(i) * channels + d0 + s] * k_factor[i] : 0.0f;
      slab_a[e] = q;
      slab_b[e] = k;
      qg_c[i * Dk + d0 + s] = gamma_tg[i] * q;
      kdt_c[(d0 + s) * C + i] = to_end[i] * k;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint f = sg; f < 2 * LOWER; f += n_sg) {  // uniform over the simdgroup
      const bool keys = f >= LOWER;
      uint bi = 0;
      uint bj = keys ? f - LOWER : f;
      while (bj > bi) {
        bj -= bi + 1;
        ++bi;
      }
      threadgroup float* block = (keys ? kk : qk) + bi * 8 * C + bj * 8;
      threadgroup const float* left = (keys ? slab_b : slab_a) + bi * 8 * SLAB;
      threadgroup const float* right = slab_b + bj * 8 * SLAB;
      simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      if (d0 != 0) {
        simdgroup_load(acc, block, C);
      }
      for (uint kd = 0; kd < SLAB / 8; ++kd) {
        simdgroup_matrix<float, 8, 8> x;
        simdgroup_matrix<float, 8, 8> y;
        simdgroup_load(x, left + kd * 8, SLAB);
        simdgroup_load(y, right + kd * 8, SLAB, ulong2(0, 0), true);  // rows bj as columns
        simdgroup_multiply_accumulate(acc, x, y, acc);
      }
      simdgroup_store(acc, block, C);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // 4. The decays of the pairs: M into the scratch, A in place of K^K^^T (upper blocks never read).
  for (uint e = tid; e < C * C; e += n_threads) {
    const uint i = e / C, j = e % C;
    float decay = 0.0f;
    if (j <= i) {
      float d = 0.0f;
      for (uint l = j + 1; l <= i; ++l) {
        d += g_tg[l];
      }
      decay = precise::exp(d);
    }
    m_c[e] = j <= i ? decay * qk[e] : 0.0f;
    kk[e] = j < i ? beta_tg[i] * decay * kk[e] : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 5. Tinv = (I + A)^{-1} by forward substitution, thread c solving column c (in registers, zero above row c), into
  // qk.
  if (tid < C) {
    float x[LILY_GDN_CHUNK];
    LILY_UNROLL
    for (uint i = 0; i < C; ++i) {
      float acc = 0.0f;
      LILY_UNROLL
      for (uint j = 0; j < i; ++j) {
        acc = fma(kk[i * C + j], x[j], acc);
      }
      x[i] = (i == tid ? 1.0f : 0.0f) - acc;
      qk[i * C + tid] = x[i];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 6. W = Tinv (diag(beta * gamma) K^) and U = Tinv (diag(beta) V), SLAB columns at a time (Dk is whole slabs; dv a
  // multiple of 8).
  for (uint c0 = 0; c0 < Dk + dv; c0 += SLAB) {
    const bool keys = c0 < Dk;
    const uint width = min(SLAB, Dk + dv - c0);
    for (uint e = tid; e < C * SLAB; e += n_threads) {
      const uint j = e / SLAB, s = e % SLAB;
      float x = 0.0f;
      if (j < n && s < width) {
        x = keys ? k_raw[size_t(j) * channels + c0 + s] * k_factor[j] * (beta_tg[j] * gamma_tg[j])
                 : v_raw[size_t(j) * channels + (c0 - Dk) + s] * beta_tg[j];
      }
      slab_a[e] = x;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint col_blocks = width / 8;
    for (uint f = sg; f < NB * col_blocks; f += n_sg) {  // uniform over the simdgroup
      const uint bi = f / col_blocks, bs = f % col_blocks;
      simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (uint bj = 0; bj <= bi; ++bj) {
        simdgroup_matrix<float, 8, 8> x;
        simdgroup_matrix<float, 8, 8> y;
        simdgroup_load(x, qk + bi * 8 * C + bj * 8, C);
        simdgroup_load(y, slab_a + bj * 8 * SLAB + bs * 8, SLAB);
        simdgroup_multiply_accumulate(acc, x, y, acc);
      }
      if (keys) {
        simdgroup_store(acc, w_c + bi * 8 * Dk + c0 + bs * 8, Dk);
      } else {
        simdgroup_store(acc, u_c + bi * 8 * dv + (c0 - Dk) + bs * 8, dv);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// gated_delta_chunk_scan: simdgroup sg of threadgroup (value head, y) owns the 8 state rows from (y·n_sg + sg)·8 (n_sg
// <= LILY_GDN_CHUNK_SCAN_SIMDGROUPS) and keeps their transpose, S^T [Dk, 8], in registers as Dk/8 matrices for the
// whole prefill; per chunk, matrix products only (no threadgroup barrier: the simdgroups are independent), reading
// gated_delta_chunk_prepare's operands from device memory. Writes o [T, Hv·dv] (fp32, before the norm) as
// gated_delta_prefill does.
template <typename T, uint Dk>
[[kernel]] void gated_delta_chunk_scan(constant lily::GatedDeltaArgs& args [[buffer(0)]],
                                       device const float* w [[buffer(1)]],      // [Hv, chunks, C, Dk]
                                       device const float* u [[buffer(2)]],      // [Hv, chunks, C, dv]
                                       device const float* qg [[buffer(3)]],     // [Hv, chunks, C, Dk]
                                       device const float* kdt [[buffer(4)]],    // [Hv, chunks, Dk, C]
                                       device const float* m [[buffer(5)]],      // [Hv, chunks, C, C]
                                       device const float* gamma [[buffer(6)]],  // [Hv, chunks]
                                       device float* state [[buffer(7)]],        // [Hv, dv, Dk] in/out
                                       device float* core_out [[buffer(8)]],     // [T, Hv·dv] o, before the norm
                                       uint2 group [[threadgroup_position_in_grid]],  // (value head, row slice)
                                       uint lane [[thread_index_in_simdgroup]],
                                       uint sg [[simdgroup_index_in_threadgroup]],
                                       uint n_sg [[simdgroups_per_threadgroup]]) {
  constexpr uint C = LILY_GDN_CHUNK;
  constexpr uint NB = C / 8;   // 8-token blocks of a chunk
  constexpr uint KB = Dk / 8;  // 8-dim blocks of a key
  threadgroup float tail[LILY_GDN_CHUNK_SCAN_SIMDGROUPS * 64];  // o of a block past the last token, per simdgroup

  const uint dv = args.head_v_dim;
  const uint v_head = group.x;
  const uint first_row = (group.y * n_sg + sg) * 8;
  if (first_row >= dv) {
    return;  // whole simdgroups; nothing below waits for the threadgroup
  }
  const uint num_tokens = args.num_tokens;
  const uint chunks = (num_tokens + C - 1) / C;
  const size_t out_stride = size_t(args.num_v_heads) * dv;
  device float* rows = state + (size_t(v_head) * dv + first_row) * Dk;
  device float* out = core_out + size_t(v_head) * dv + first_row;

  simdgroup_matrix<float, 8, 8> st[KB];  // S^T: key dims 8kd.. x this simdgroup's 8 rows
  LILY_UNROLL
  for (uint kd = 0; kd < KB; ++kd) {
    simdgroup_load(st[kd], rows + kd * 8, Dk, ulong2(0, 0), true);
  }
  for (uint c = 0; c < chunks; ++c) {
    const size_t hc = size_t(v_head) * chunks + c;
    device const float* w_c = w + hc * C * Dk;
    device const float* u_c = u + hc * C * dv + first_row;
    device const float* qg_c = qg + hc * C * Dk;
    device const float* kdt_c = kdt + hc * Dk * C;
    device const float* m_c = m + hc * C * C;

    // V' = U - W S0^T, one [8, 8] block per 8 tokens.
    simdgroup_matrix<float, 8, 8> vp[NB];
    LILY_UNROLL
    for (uint bi = 0; bi < NB; ++bi) {
      simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      LILY_UNROLL
      for (uint kd = 0; kd < KB; ++kd) {
        simdgroup_matrix<float, 8, 8> x;
        simdgroup_load(x, w_c + bi * 8 * Dk + kd * 8, Dk);
        simdgroup_multiply_accumulate(acc, x, st[kd], acc);
      }
      simdgroup_load(vp[bi], u_c + bi * 8 * dv, dv);
      vp[bi].thread_elements() -= acc.thread_elements();  // element-wise: the same lane layout
    }
    // o = Qg S0^T + M V'.
    LILY_UNROLL
    for (uint bi = 0; bi < NB; ++bi) {
      simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      LILY_UNROLL
      for (uint kd = 0; kd < KB; ++kd) {
        simdgroup_matrix<float, 8, 8> x;
        simdgroup_load(x, qg_c + bi * 8 * Dk + kd * 8, Dk);
        simdgroup_multiply_accumulate(acc, x, st[kd], acc);
      }
      LILY_UNROLL
      for (uint bj = 0; bj <= bi; ++bj) {
        simdgroup_matrix<float, 8, 8> x;
        simdgroup_load(x, m_c + bi * 8 * C + bj * 8, C);
        simdgroup_multiply_accumulate(acc, x, vp[bj], acc);
      }
      const uint token = c * C + bi * 8;
      if (token + 8 <= num_tokens) {
        simdgroup_store(acc, out + size_t(token) * out_stride, out_stride);
      } else if (token < num_tokens) {  // the last chunk's partial block: only its tokens' rows
        threadgroup float* block = tail + sg * 64;
        simdgroup_store(acc, block, 8);
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (uint e = lane; e < (num_tokens - token) * 8; e += 32) {
          out[size_t(token + e / 8) * out_stride + e % 8] = block[e];
        }
      }
    }
    // S^T = gamma_last S0^T + KdT V'.
    const float decay = gamma[hc];
    LILY_UNROLL
    for (uint kd = 0; kd < KB; ++kd) {
      st[kd].thread_elements() *= decay;
      LILY_UNROLL
      for (uint bi = 0; bi < NB; ++bi) {
        simdgroup_matrix<float, 8, 8> x;
        simdgroup_load(x, kdt_c + kd * 8 * C + bi * 8, C);
        simdgroup_multiply_accumulate(st[kd], x, vp[bi], st[kd]);
      }
    }
  }
  LILY_UNROLL
  for (uint kd = 0; kd < KB; ++kd) {
    simdgroup_store(st[kd], rows + kd * 8, Dk, ulong2(0, 0), true);
  }
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
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_prefill_f32_dk128", gated_delta_prefill, float, 128, 0)
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_prefill_bf16_dk128", gated_delta_prefill, bfloat, 128, 0)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_norm_f32", gated_delta_prefill_norm, float)
LILY_INSTANTIATE_KERNEL("gated_delta_prefill_norm_bf16", gated_delta_prefill_norm, bfloat)
// Demo model and tiny fixtures (Dk = 64: two state elements per lane), float32 and bf16 modes.
LILY_INSTANTIATE_KERNEL("gated_delta_conv_f32_dk64", gated_delta_conv, float, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_bf16_dk64", gated_delta_conv, bfloat, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_state_f32_dk64", gated_delta_conv_state, float, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_conv_state_bf16_dk64", gated_delta_conv_state, bfloat, 64)
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_prefill_f32_dk64", gated_delta_prefill, float, 64, 0)
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_prefill_bf16_dk64", gated_delta_prefill, bfloat, 64, 0)
// The chunked scan (CHUNKED_SCAN on, chunks of tuning::kGdnChunkedMinTokens tokens or more).
LILY_INSTANTIATE_KERNEL("gated_delta_chunk_prepare_f32_dk128", gated_delta_chunk_prepare, float, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_chunk_prepare_bf16_dk128", gated_delta_chunk_prepare, bfloat, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_chunk_scan_f32_dk128", gated_delta_chunk_scan, float, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_chunk_scan_bf16_dk128", gated_delta_chunk_scan, bfloat, 128)
LILY_INSTANTIATE_KERNEL("gated_delta_chunk_prepare_f32_dk64", gated_delta_chunk_prepare, float, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_chunk_prepare_bf16_dk64", gated_delta_chunk_prepare, bfloat, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_chunk_scan_f32_dk64", gated_delta_chunk_scan, float, 64)
LILY_INSTANTIATE_KERNEL("gated_delta_chunk_scan_bf16_dk64", gated_delta_chunk_scan, bfloat, 64)
// REGISTER_SCAN off (the ablation): the state round-trips through memory every LILY_GDN_SCAN_BLOCK tokens.
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_prefill_blockwise_f32_dk128", gated_delta_prefill, float, 128,
                              LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_prefill_blockwise_bf16_dk128", gated_delta_prefill, bfloat, 128,
                              LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_prefill_blockwise_f32_dk64", gated_delta_prefill, float, 64,
                              LILY_GDN_SCAN_BLOCK)
LILY_INSTANTIATE_EARLY_KERNEL("gated_delta_prefill_blockwise_bf16_dk64", gated_delta_prefill, bfloat, 64,
                              LILY_GDN_SCAN_BLOCK)
