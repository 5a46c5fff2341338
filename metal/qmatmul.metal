// Quantized matmul with MLX affine weights: Y[M, N] = X[M, K] * W^T, W[n, k] = scale * q + bias, where q is a 4- or
// 8-bit code packed in uint32 words (element 0 in the low bits) and scale/bias are shared by 64 consecutive k (one
// group). K must be a multiple of 64 (the model's K are 2048, 4096 and 512); the host checks it. X, Y: [M, K], [M, N]
// row-major in the activation dtype; fp32 accumulation everywhere; one rounding per output element.
//
//   qmv_q<b>_g64_<dtype>[_sf32]            decode GEMV, M <= LILY_QMV_MAX_ROWS (attention/GDN projections, router and
//                                          shared-expert gate at 8 bits, lm_head). Grid (ceil(N / 8), ceil(M / 4), 1)
//                                          x 64 (a grid y of M is also correct: the extra threadgroups exit). Each
//                                          simdgroup owns 4 output rows; a lane reads packs of 4 consecutive words
//                                          (one scale and bias each), 2 per row and step, 32 packs apart, folds each
//                                          pack with one scale/bias FMA pair, then one simd_sum per row. Reads every
//                                          weight byte once for up to 4 input rows, x once per simdgroup (from
//                                          cache). Writes N values per row.
//   qmv_q<b>_g64_bf16[_sf32]_of32          the same GEMV with bf16 input and f32 output: the router and shared-expert
//                                          gate logits in bf16 mode (moe_route / moe_down_combine read f32 logits).
//   qmv_norm_q<b>_g64_<dtype>[_sf32][_of32] decode GEMV with the RMSNorm in front of it folded in (fusion):
//                                          y = W · (rms_norm(x) ⊙ norm_weight). Lanes as qmv, one input row per
//                                          threadgroup row (grid (ceil(N / 8), M, 1)); each
//                                          lane also sums x^2 over the values it reads and folds x ⊙ norm_weight into
//                                          its dot products, and each simdgroup's simd_sum of x^2 gives 1/rms, applied
//                                          after the row sums (a scalar per row). So x is still read once per
//                                          simdgroup (from cache), no normalised copy is written, rounded or re-read,
//                                          and the separate rms_norm dispatch and its barrier stage disappear. Extra
//                                          work: one FMA per x element per simdgroup; extra bytes: the norm weight
//                                          (K elements, from cache). Chosen for every decode projection that follows
//                                          an RMSNorm of the hidden stream (DeltaNet in_proj, attention q|k|v, router
//                                          | shared gate with _of32 in bf16 mode, lm_head).
//   qmv[_norm]_seg_q<b>_g64_<dtype>[_sf32][_of32]  qmv / qmv_norm over up to 4 matrices sharing one input (DeltaNet
//                                          in_proj_qkv|z|b|a, attention q|k|v, router|shared-expert gate), each bound
//                                          from its own buffers, so loading maps the checkpoint and copies nothing.
//                                          Each segment's rows are padded to whole threadgroups: a threadgroup reads
//                                          one matrix; the grid is sum(ceil(rows_s / 8)) threadgroups, segment s
//                                          writing y[offset_s .. offset_s + rows_s). Same bytes as one GEMV over the
//                                          concatenation; at most 3 idle simdgroups per segment boundary. Chosen by
//                                          the FUSED_PROJECTIONS switch (on by default).
//   qmv_residual_q<b>_g64_<dtype>[_sf32]   decode GEMV with the residual add folded in (fusion): out = residual +
//                                          W · x, one rounding, one input row per threadgroup row (grid
//                                          (ceil(N / 8), M, 1)); out may alias residual (the hidden stream updated in
//                                          place: each element is read and written by the same lane). Chosen for the
//                                          DeltaNet out_proj and the attention o_proj; saves the mixer-output write
//                                          and re-read and, with qmv_norm, the rms_norm_residual stage.
//   qmv_norm_staged_*, qmv_residual_staged_*, qmv_norm_seg_staged_*  (CUDA's choice: tuning::staged_gemv) the same
//                                          three one-row GEMVs with x staged once per threadgroup in threadgroup memory
//                                          in the lanes' read order (qmv_stage: norm weight applied once, pack sums by
//                                          shuffles), and the first step's weights loaded before the staging
//                                          barrier. K <= LILY_QMV_STAGE_MAX_K, bf16 scales; 4-bit (and the 8-bit
//                                          router GEMV with f32 out). Apple GPUs keep the unstaged kernels
//                                          (threadgroup memory and occupancy: not measured there). qmv_norm_staged
//                                          and the segmented ones stream their row blocks: a threadgroup stages x
//                                          once and takes blocks x, x + grid width, ... (the host launches at most
//                                          tuning::kQmvStreamGroups; any grid width gives the same bits).
//                                          qmv_residual_staged, qmv_gated_norm_residual_staged and
//                                          qmv_norm_seg_staged take 2-D threadgroups (32 n, S): row y of simdgroups
//                                          is step slot y, taking steps y, y + S, ... of the rows of row 0, and
//                                          qmv_slot_totals adds the slots' sums (SPLIT_STEPS: tuning::qmv_step_slots);
//                                          S = 1 is 1-D.
//   qmv_norm_argmax_staged_q4_g64_<f32|bf16_of32>[_a16]  (CUDA, greedy decode: FUSED_ARGMAX) the lm_head's
//                                          qmv_norm_staged that also keeps each threadgroup's best logit of the rows it
//                                          wrote (argmax.h's order) and writes it as argmax_partial would: argmax_final
//                                          reduces the grid's partials (one per threadgroup), the same token as
//                                          argmax_partial + argmax_final over the logits, one dispatch fewer.
//   qmv_norm_seg_conv_staged_*, qmv_gated_norm_residual_staged_*  (CUDA: tuning::spread_deltanet_step) a DeltaNet
//                                          decode token's in_proj with the causal conv and SiLU(z) in its epilogue, and
//                                          its out_proj with the gated RMSNorm in its staging: the spread DeltaNet step
//                                          (docs/kernels.md), the same bits as gated_delta_step's chain.
//   qmv_mma_q4_g64_bf16[_of32]            (CUDA's choice for a few rows of bf16 activations: tuning::mma_gemv) the
//                                          GEMV on matrix units: codes masked two at a time into bf16 128 + q, 8x8
//                                          simdgroup MMAs against up to 8 input rows at once (fp32 sums; the offset
//                                          folded into the bias with sum x from an MMA of ones). Grid (ceil(N / 16),
//                                          ceil(M / 8), 1) x 32 n: n simdgroups (1 to 8; the host's 4 or 8 by N:
//                                          tuning::qmv_mma_simdgroups) split the groups of K, partial sums added
//                                          through threadgroup memory in simdgroup order. 4-bit codes, bf16 scales.
//   qmm_q<b>_g64_<dtype>[_sf32][_of32]_bm<BM>
//                                          prefill GEMM on the tile loop of metal/gemm.h (_of32: bf16 in, fp32 out,
//                                          BM 16 or 32: router logits and every-row lm_head logits). Grid (ceil(N / 64),
//                                          ceil(M / BM), 1) of 128 threads; BM = 16, 32 or 64 (64: bf16 only), the
//                                          host's choice by M and N (tuning::qmm_tile_rows). Per K step of 32 the
//                                          threadgroup copies a BM x 32 tile of X and dequantizes a 64 x 32 tile of W
//                                          into threadgroup memory in the activation dtype (the weights rounded to
//                                          it once, as MLX does; the next step's loads in flight during this step's
//                                          MMAs), and each simdgroup accumulates its part of the BM x 64 output with
//                                          simdgroup_matrix 8x8 MMAs in fp32 (tensor cores on NVIDIA). Each weight
//                                          byte is read once per BM rows of X, each X element once per 64 columns of
//                                          W; no dequantized copy of W ever exists in device memory.
//   qmm_nax_q<b>_g64_<dtype>               the same GEMM on Metal 4 tensor ops (M5 "neural accelerators"): 32 x 64
//                                          output tile, 4 simdgroups each running a 16x32x32 mpp matmul2d per K step
//                                          on threadgroup tiles in the activation dtype (the dequantized weights are
//                                          rounded to it, as MLX does), fp32 destination. Compiled only where tensor
//                                          ops exist (Metal >= 4.0 with __HAVE_TENSOR__) and under the CPU harness's
//                                          emulation; the host picks it by host name only on M5-class GPUs.
//                                          UNVERIFIED UNTIL A MAC RUNS IT: the emulation fixes our reading of the API,
//                                          not Apple's compiler or hardware behaviour.
//   (the dense mm_* GEMM of the IN_GEMM_DEQUANT ablation shares the qmm tile loop: metal/mm.metal, metal/gemm.h)
// dtype is the activation dtype (f32, f16, bf16); scales and biases are bf16 (MLX checkpoints) unless the name has
// _sf32 (f32 scales and biases: checkpoints converted from fp32 weights); qmm_nax takes bf16 scales only. Partial
// tiles in M and N are handled; out counts need not be multiples of any tile (the shared-expert gate has N = 1).
#include <metal_stdlib>
#include "argmax.h"
#include "attention_mma.h"
#include "gated_delta.h"
#include "gemm.h"
#include "lily.h"
#include "qmv_stage.h"
#include "quantized.h"

using namespace metal;

// Metal 4 tensor ops: on Apple GPUs that have them, and emulated by the CPU harness (not by its CUDA target).
#if (defined(MSL_CPU) && !defined(MSL_CUDA)) || (defined(__METAL_VERSION__) && __METAL_VERSION__ >= 400 && defined(__HAVE_TENSOR__))
#define LILY_QMATMUL_HAS_TENSOR_OPS 1
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#endif

namespace lily_qmatmul {

enum : uint { kGroupSize = lily::kQuantGroupSize };

// Dequantizes rows [n0, n0 + rows) x columns [k0, k0 + cols) of W into a threadgroup tile[n * ld + k] (qmm_nax),
// one packed word (32 / Bits codes) per thread and iteration. `cols` divides the group size and k0 is a multiple of
// it, so a tile row uses one scale and one bias. Rows past N are zero.
template <int Bits, typename S, typename TileT>
inline void dequantize_w_tile(device const uint* weight, device const S* scales, device const S* biases,
                              threadgroup TileT* tile, uint ld, uint rows, uint cols, uint n0, uint k0, uint N, uint K,
                              uint tid, uint n_threads) {
  constexpr uint kPerWord = lily::codes_per_word<Bits>();
  const uint words_per_tile_row = cols / kPerWord;
  const uint words_per_row = K / kPerWord;
  for (uint i = tid; i < rows * words_per_tile_row; i += n_threads) {
    uint r = i / words_per_tile_row;
    uint c0 = (i % words_per_tile_row) * kPerWord;
    uint n = n0 + r;
    uint word = 0;
    float scale = 0.0f, bias = 0.0f;
    if (n < N) {
      word = weight[size_t(n) * words_per_row + (k0 + c0) / kPerWord];
      size_t g = size_t(n) * (K / kGroupSize) + k0 / kGroupSize;
      scale = float(scales[g]);
      bias = float(biases[g]);
    }
    for (uint e = 0; e < kPerWord; ++e) {
      tile[r * ld + c0 + e] = TileT(lily::dequantize_code<Bits>(word, e, scale, bias));
    }
  }
}


}  // namespace lily_qmatmul

namespace lily_qmatmul {

// One simdgroup's part of a decode GEMV for B input rows at once, so each weight byte is read once for all of
// them: acc[b][r] = sum_k x'_{b,k} w[first_row + r, k] (this lane's share; the caller does the simd_sum), with
// x' = x ⊙ norm_weight when Norm (then sum_sq[b] is this lane's share of sum_k x_{b,k}^2; 1/rms is applied by the
// caller after the sum). A row is read in packs of LILY_QMV_PACK_WORDS consecutive words (32 codes at 4 bits), all
// inside one quantization group; lanes take interleaved packs (pack lane + 32 i), LILY_QMV_PACKS_PER_LANE of them per
// row and step, every load of a step issued before its arithmetic. Per pack and row: one scale and one bias, 2
// operations per code plus one FMA per code and input row, the scale and bias folded once (sum_i x_i (s q_i + b)
// = s * sum_i x_i q_i + b * sum_i x_i). Loads are 4-byte words, the alignment a mapped checkpoint guarantees. Rows
// past N read row N - 1 (in bounds; the caller never writes them).
template <bool Norm, int Bits, uint B, typename T, typename S>
LILY_INLINE void qmv_accumulate(thread float (&acc)[B][LILY_QMV_ROWS_PER_SIMDGROUP], thread float (&sum_sq)[B],
                                device const T* x, device const T* norm_weight, device const uint* weight,
                                device const S* scales, device const S* biases, uint K, uint N, uint first_row,
                                uint lane) {
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  constexpr uint kPackWords = LILY_QMV_PACK_WORDS;
  constexpr uint kPacks = LILY_QMV_PACKS_PER_LANE;  // per row and step
  constexpr uint kPerWord = 32 / Bits;
  constexpr uint kWordsPerGroup = kGroupSize / kPerWord;
  static_assert(kWordsPerGroup % kPackWords == 0, "a pack must stay inside one quantization group");
  const uint words_per_row = K / kPerWord;
  const uint packs_per_row = words_per_row / kPackWords;
  const uint groups_per_row = K / kGroupSize;
  device const uint* w_row[kRows];
  device const S* s_row[kRows];
  device const S* b_row[kRows];
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    const uint n = min(first_row + r, N - 1);
    w_row[r] = weight + size_t(n) * words_per_row;
    s_row[r] = scales + size_t(n) * groups_per_row;
    b_row[r] = biases + size_t(n) * groups_per_row;
  }
  LILY_UNROLL
  for (uint b = 0; b < B; ++b) {
    sum_sq[b] = 0.0f;
    LILY_UNROLL
    for (uint r = 0; r < kRows; ++r) {
      acc[b][r] = 0.0f;
    }
  }
  uint magic[lily::kCodeMagicCount<Bits>];
  lily::code_float_magic<Bits>(magic);
  for (uint p0 = lane; p0 < packs_per_row; p0 += 32 * kPacks) {
    uint words[kPacks][kRows][kPackWords];
    float scale[kPacks][kRows], bias[kPacks][kRows];
    LILY_UNROLL
    for (uint i = 0; i < kPacks; ++i) {
      // A pack past the row (K not a multiple of a step) reads the row's last pack, weighted 0: no load is
      // conditional.
      const uint p = min(p0 + 32 * i, packs_per_row - 1);
      const bool in_row = p0 + 32 * i < packs_per_row;
      const uint g = p * kPackWords / kWordsPerGroup;
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        LILY_UNROLL
        for (uint j = 0; j < kPackWords; ++j) {
          words[i][r][j] = w_row[r][p * kPackWords + j];
        }
        scale[i][r] = in_row ? float(s_row[r][g]) : 0.0f;
        bias[i][r] = in_row ? float(b_row[r][g]) : 0.0f;
      }
    }
    LILY_UNROLL
    for (uint i = 0; i < kPacks; ++i) {
      const uint p = min(p0 + 32 * i, packs_per_row - 1);
      const bool in_row = p0 + 32 * i < packs_per_row;
      float d[B][kRows], x_sum[B], x_sq[B];
      LILY_UNROLL
      for (uint b = 0; b < B; ++b) {
        x_sum[b] = 0.0f;
        x_sq[b] = 0.0f;
        LILY_UNROLL
        for (uint r = 0; r < kRows; ++r) {
          d[b][r] = 0.0f;
        }
      }
      LILY_UNROLL
      for (uint j = 0; j < kPackWords; ++j) {
        // The x values of this word for every input row, then each weight word unpacked once for all of them.
        const uint k0 = (p * kPackWords + j) * kPerWord;
        float xs[B][kPerWord];
        LILY_UNROLL
        for (uint b = 0; b < B; ++b) {
          LILY_UNROLL
          for (uint c = 0; c < kPerWord; c += 4) {
            float4 v = lily::attn_load4(x + size_t(b) * K + k0 + c);
            if (Norm) {
              x_sq[b] += dot(v, v);
              v *= lily::attn_load4(norm_weight + k0 + c);
            }
            x_sum[b] += (v.x + v.y) + (v.z + v.w);
            LILY_UNROLL
            for (uint e = 0; e < 4; ++e) {
              xs[b][c + e] = v[e];
            }
          }
        }
        LILY_UNROLL
        for (uint r = 0; r < kRows; ++r) {
          const uint word_high = words[i][r][j] >> 16;
          LILY_UNROLL
          for (uint e = 0; e < kPerWord; ++e) {
            const float q = lily::code_float<Bits>(words[i][r][j], word_high, e, magic);
            LILY_UNROLL
            for (uint b = 0; b < B; ++b) {
              d[b][r] = fma(xs[b][e], q, d[b][r]);
            }
          }
        }
      }
      LILY_UNROLL
      for (uint b = 0; b < B; ++b) {
        LILY_UNROLL
        for (uint r = 0; r < kRows; ++r) {
          acc[b][r] = fma(scale[i][r], d[b][r], fma(bias[i][r], x_sum[b], acc[b][r]));
        }
        sum_sq[b] += in_row ? x_sq[b] : 0.0f;
      }
    }
  }
}

// One simdgroup's output rows for B input rows from m0: y[m0 + b, row] = total * 1/rms (Norm), residual + total
// (Residual; y may alias residual: each element is read and written by the same lane) or total.
template <bool Norm, bool Residual, uint B, int Bits, typename T, typename S, typename O>
LILY_INLINE void qmv_rows(device const T* x, device const T* norm_weight, device const uint* weight,
                          device const S* scales, device const S* biases, device const T* residual, device O* y, uint K,
                          uint N, float eps, uint m0, uint first_row, uint lane) {
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  float acc[B][kRows], sum_sq[B];
  qmv_accumulate<Norm, Bits, B>(acc, sum_sq, x + size_t(m0) * K, norm_weight, weight, scales, biases, K, N, first_row,
                                lane);
  LILY_UNROLL
  for (uint b = 0; b < B; ++b) {
    const float inv_rms = Norm ? precise::rsqrt(simd_sum(sum_sq[b]) / float(K) + eps) : 1.0f;
    LILY_UNROLL
    for (uint r = 0; r < kRows; ++r) {
      const float total = simd_sum(acc[b][r]);
      if (lane == 0 && first_row + r < N) {
        const size_t i = size_t(m0 + b) * N + first_row + r;
        y[i] = Residual ? O(float(residual[i]) + total) : O(total * inv_rms);
      }
    }
  }
}

// The input rows of threadgroup row tg_y: up to LILY_QMV_MAX_ROWS from m0 = tg_y * LILY_QMV_MAX_ROWS, each count
// compiled as its own loop (a decode step is one row: no work for absent rows).
template <bool Norm, bool Residual, int Bits, typename T, typename S, typename O>
LILY_INLINE void qmv_batch(device const T* x, device const T* norm_weight, device const uint* weight,
                           device const S* scales, device const S* biases, device const T* residual, device O* y,
                           uint K, uint N, uint M, float eps, uint m0, uint first_row, uint lane) {
  static_assert(LILY_QMV_MAX_ROWS == 4, "qmv_batch dispatches 1..4 input rows");
  const uint rows = min(uint(LILY_QMV_MAX_ROWS), M - m0);
  if (rows == 1) {
    qmv_rows<Norm, Residual, 1, Bits>(x, norm_weight, weight, scales, biases, residual, y, K, N, eps, m0, first_row, lane);
  } else if (rows == 2) {
    qmv_rows<Norm, Residual, 2, Bits>(x, norm_weight, weight, scales, biases, residual, y, K, N, eps, m0, first_row, lane);
  } else if (rows == 3) {
    qmv_rows<Norm, Residual, 3, Bits>(x, norm_weight, weight, scales, biases, residual, y, K, N, eps, m0, first_row, lane);
  } else {
    qmv_rows<Norm, Residual, 4, Bits>(x, norm_weight, weight, scales, biases, residual, y, K, N, eps, m0, first_row, lane);
  }
}

// ---- the staged one-row GEMVs: the staging and dot-product helpers are in qmv_stage.h ----
using lily::kStageBatch;
using lily::kStageChunks;
using lily::qmv_load_and_dot;
using lily::qmv_load_step;
using lily::qmv_slot_first_pack;
using lily::qmv_stage;
using lily::qmv_stage_chunk;
using lily::qmv_stage_slot;
using lily::qmv_staged_dot;

// Stages x = the DeltaNet's SiLU(z)-gated RMSNorm of o, value heads of `head_dim` values, given gate = SiLU(z), in one
// round: each thread loads its kStageBatch chunks of o, gate and norm_weight at once (one memory round trip) and
// stores o raw in row order, each head's 1/rms is summed from threadgroup memory by one simdgroup in gdn_gated_norm's
// order (a lane-strided fma chain, simd_sum; kHeads heads at a time, so their shuffles overlap), then every thread
// turns its chunks into o * (1/rms) * norm_weight * gate rounded once to T, as gated_delta_prefill_norm writes them,
// and stages them with qmv_stage's pack sums where o lay: so the GEMV after it gives the bits of
// gated_delta_prefill_norm followed by a staged GEMV of its output. The kernel runs one threadgroup per SM (a warp per
// scheduler, nothing to hide latency behind), so this chain is kept short: o in row order makes the sums' addresses
// plain, and a chunk's head and offset step from chunk to chunk without a division. Every thread of the threadgroup
// calls it (barriers); K <= 4 * kStageBatch * threads (one round), a multiple of head_dim and of 64, head_dim a
// multiple of 4, K / head_dim <= LILY_QMV_STAGE_MAX_HEADS (the host checks: tuning::spread_deltanet_step).
template <typename T, int Bits>
LILY_INLINE void qmv_stage_gated_norm(device const float* o, device const float* gate, device const T* norm_weight,
                                      uint K, uint head_dim, float eps, threadgroup float4* stage_x,
                                      threadgroup float* pack_sum, threadgroup float* head_inv_rms, uint tid,
                                      uint n_threads, uint lane, uint simd_group) {
  constexpr uint kHeads = 4;
  const uint chunks = K / 4;
  const uint heads = K / head_dim;
  // Chunk q = u * n_threads + tid holds values 4q .. 4q + 3: head 4q / head_dim from value 4q % head_dim on (a chunk
  // never straddles two heads: head_dim is a multiple of 4). Both step by 4 * n_threads values per u.
  const uint step_heads = 4 * n_threads / head_dim, step_offset = 4 * n_threads % head_dim;
  uint head = 4 * tid / head_dim, offset = 4 * tid % head_dim;
  uint chunk_head[kStageBatch];
  float4 v[kStageBatch], g[kStageBatch], w[kStageBatch];
  LILY_UNROLL
  for (uint u = 0; u < kStageBatch; ++u) {
    const uint q = min(u * n_threads + tid, chunks - 1);
    v[u] = lily::attn_load4(o + 4 * q);
    g[u] = lily::attn_load4(gate + 4 * q);
    w[u] = lily::attn_load4(norm_weight + offset);
    chunk_head[u] = min(head, heads - 1);  // past the row: any head (its chunk is not staged)
    offset += step_offset;
    head += step_heads;
    if (offset >= head_dim) {
      offset -= head_dim;
      ++head;
    }
  }
  threadgroup float4* raw = stage_x;  // o in row order until the sums are done
  LILY_UNROLL
  for (uint u = 0; u < kStageBatch; ++u) {
    const uint q = u * n_threads + tid;
    if (q < chunks) {
      raw[q] = v[u];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup const float* raw_values = (threadgroup const float*)raw;
  for (uint h0 = simd_group * kHeads; h0 < heads; h0 += (n_threads / 32) * kHeads) {  // uniform per simdgroup
    float sq[kHeads];
    LILY_UNROLL
    for (uint j = 0; j < kHeads; ++j) {
      sq[j] = 0.0f;
      threadgroup const float* row = raw_values + min(h0 + j, heads - 1) * head_dim;
      for (uint d = lane; d < head_dim; d += 32) {
        sq[j] = fma(row[d], row[d], sq[j]);
      }
    }
    LILY_UNROLL
    for (uint j = 0; j < kHeads; ++j) {
      sq[j] = simd_sum(sq[j]);
      if (lane == 0 && h0 + j < heads) {
        head_inv_rms[h0 + j] = precise::rsqrt(sq[j] / float(head_dim) + eps);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the sums read o where the normed values go
  LILY_UNROLL
  for (uint u = 0; u < kStageBatch; ++u) {  // uniform trip count: convergent shuffles
    const uint q = min(u * n_threads + tid, chunks - 1);
    const float inv_rms = head_inv_rms[chunk_head[u]];
    float4 x;
    LILY_UNROLL
    for (uint e = 0; e < 4; ++e) {
      x[e] = float(T(v[u][e] * inv_rms * w[u][e] * g[u][e]));
    }
    qmv_stage_chunk<Bits>(x, q, u * n_threads + tid < chunks, stage_x, pack_sum);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// The staged GEMV of one input row for this simdgroup's rows: acc[r] as qmv_staged_dot, returning 1/rms (Norm) or 1.
// The first step's weights are loaded before x is staged, so their latency overlaps the staging and its barrier, and
// before lily::grid_dependency_wait: on CUDA they overlap the dispatch that writes x (the kernels calling this are
// LILY_INSTANTIATE_EARLY_KERNEL). Every thread of the threadgroup calls it; a simdgroup with `active` false (rows past
// N) only takes part in the staging. Step slot `slot` of `slots` takes only its steps (qmv_staged_dot).
template <bool Norm, int Bits, bool WholePacks, typename T, typename S>
LILY_INLINE float qmv_staged_rows(thread float (&acc)[LILY_QMV_ROWS_PER_SIMDGROUP], device const T* x,
                                  device const T* norm_weight, device const uint* weight, device const S* scales,
                                  device const S* biases, uint K, uint N, float eps, uint first_row, bool active,
                                  threadgroup float4* stage_x, threadgroup float* pack_sum, threadgroup float* simd_sq,
                                  uint tid, uint n_threads, uint lane, uint simd_group, uint slot = 0,
                                  uint slots = 1) {
  uint words[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP][LILY_QMV_PACK_WORDS];
  float scale[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP];
  float bias[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP];
  if (active) {
    qmv_load_step<Bits, WholePacks>(words, scale, bias, weight, scales, biases, K, N, first_row,
                                    qmv_slot_first_pack(lane, slot));
  }
  lily::grid_dependency_wait();  // x comes from the dispatch before
  const float inv_rms = qmv_stage<Norm, Bits>(x, norm_weight, K, eps, stage_x, pack_sum, simd_sq, tid, n_threads, lane,
                                              simd_group);
  if (active) {
    qmv_staged_dot<Bits, WholePacks>(acc, words, scale, bias, weight, scales, biases, K, N, first_row, stage_x,
                                     pack_sum, lane, slot, slots);
  }
  return inv_rms;
}

// The segment of a segmented GEMV's threadgroup tg_x: each segment's rows padded to whole threadgroups of
// rows_per_group rows; past the last segment, block counts on in the last one (its threadgroups leave).
struct QmvSegment {
  uint index;       // the segment
  uint block;       // the threadgroup's block of rows_per_group rows within it
  uint row_offset;  // the segment's first output row
};
// Segment i's binding among a segmented GEMV's four (weight codes, scales or biases of segments 0-3).
template <typename P>
inline P qmv_segment_pick(uint i, P p0, P p1, P p2, P p3) {
  return i == 0 ? p0 : i == 1 ? p1 : i == 2 ? p2 : p3;
}

// Threadgroups of rows_per_group rows over every segment (each segment's rows padded to whole threadgroups).
inline uint qmv_segment_blocks(constant lily::QMatmulSegmentsArgs& args, uint rows_per_group) {
  uint blocks = 0;
  for (uint i = 0; i < args.num_segments; ++i) {
    blocks += (args.rows[i] + rows_per_group - 1) / rows_per_group;
  }
  return blocks;
}

inline QmvSegment qmv_find_segment(constant lily::QMatmulSegmentsArgs& args, uint tg_x, uint rows_per_group) {
  QmvSegment s = {0, tg_x, 0};
  while (s.index + 1 < args.num_segments && s.block >= (args.rows[s.index] + rows_per_group - 1) / rows_per_group) {
    s.block -= (args.rows[s.index] + rows_per_group - 1) / rows_per_group;
    s.row_offset += args.rows[s.index];
    ++s.index;
  }
  return s;
}

// Where a thread of a split-step GEMV's threadgroup (32 n, S) stands (SPLIT_STEPS: tuning::qmv_step_slots): row y of
// simdgroups is step slot y, and the simdgroups at x / 32 of every row share output rows. S = 1 is 1-D.
struct QmvSlotLayout {
  uint row_simdgroups;  // simdgroups per slot row, each taking LILY_QMV_ROWS_PER_SIMDGROUP output rows
  uint row_simdgroup;   // this simdgroup's place in its slot row
  uint slots;
  uint slot;
  uint n_threads;  // the threadgroup's, every slot row's (the staging's)
};
inline QmvSlotLayout qmv_slot_layout(uint3 threads_per_group, uint3 position) {
  return {threads_per_group.x / 32, position.x / 32, threads_per_group.y, position.y,
          threads_per_group.x * threads_per_group.y};
}

// The totals of this simdgroup's rows in a threadgroup of step slots (the split GEMVs: qmv_staged_dot): each
// simdgroup's simd_sums, slots 1.. leave theirs in slot_sums, and slot 0 adds them in slot order after its own, so one
// slot gives the bits of a plain simd_sum and needs no barrier. Every thread of the threadgroup calls it (the
// barrier); a simdgroup with `active` false (rows past N) only takes part in the barrier. Returns whether this
// simdgroup holds its rows' totals (slot 0, active; every lane the same values).
LILY_INLINE bool qmv_slot_totals(thread const float (&acc)[LILY_QMV_ROWS_PER_SIMDGROUP],
                                 thread float (&total)[LILY_QMV_ROWS_PER_SIMDGROUP], bool active,
                                 threadgroup float* slot_sums, QmvSlotLayout at, uint lane) {
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  if (active) {  // uniform per simdgroup: the simd_sums stay convergent
    LILY_UNROLL
    for (uint r = 0; r < kRows; ++r) {
      total[r] = simd_sum(acc[r]);
      if (lane == 0 && at.slot > 0) {
        slot_sums[(at.slot * at.row_simdgroups + at.row_simdgroup) * kRows + r] = total[r];
      }
    }
  }
  if (at.slots > 1) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (!active || at.slot > 0) {
    return false;
  }
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    for (uint y = 1; y < at.slots; ++y) {
      total[r] += slot_sums[(y * at.row_simdgroups + at.row_simdgroup) * kRows + r];
    }
  }
  return true;
}

// out[row_base + first_row + r] = residual + the row's total (qmv_slot_totals), rounded once (out may alias residual:
// each element is read and written by the same lane). Every thread of the threadgroup calls it.
template <typename T>
LILY_INLINE void qmv_residual_rows(thread const float (&acc)[LILY_QMV_ROWS_PER_SIMDGROUP], device const T* residual,
                                   device T* out, size_t row_base, uint N, uint first_row, bool active,
                                   threadgroup float* slot_sums, QmvSlotLayout at, uint lane) {
  float total[LILY_QMV_ROWS_PER_SIMDGROUP];
  if (!qmv_slot_totals(acc, total, active, slot_sums, at, lane)) {
    return;
  }
  LILY_UNROLL
  for (uint r = 0; r < LILY_QMV_ROWS_PER_SIMDGROUP; ++r) {
    if (lane == 0 && first_row + r < N) {
      const size_t i = row_base + first_row + r;
      out[i] = T(float(residual[i]) + total[r]);
    }
  }
}

}  // namespace lily_qmatmul

// O is the output type: T, or float for the router and shared-expert gate logits in bf16 mode (_of32).
template <typename T, typename S, int Bits, typename O>
[[kernel]] void qmv(constant lily::QMatmulArgs& args [[buffer(0)]],
                    device const T* x [[buffer(1)]],
                    device const uint* weight [[buffer(2)]],
                    device const S* scales [[buffer(3)]],
                    device const S* biases [[buffer(4)]],
                    device O* y [[buffer(5)]],
                    uint3 tg [[threadgroup_position_in_grid]],
                    uint lane [[thread_index_in_simdgroup]],
                    uint simd_group [[simdgroup_index_in_threadgroup]]) {
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  constexpr uint kBatch = LILY_QMV_MAX_ROWS;
  const uint K = args.in_features;
  const uint N = args.out_features;
  const uint first_row = (tg.x * LILY_QMV_SIMDGROUPS + simd_group) * kRows;
  const uint m0 = tg.y * kBatch;
  if (first_row >= N || m0 >= args.num_rows) {
    return;  // the whole simdgroup leaves: the simd_sum below stays convergent
  }
  lily_qmatmul::qmv_batch<false, false, Bits>(x, x, weight, scales, biases, x, y, K, N, args.num_rows, 0.0f, m0,
                                              first_row, lane);
}

// y = W · (rms_norm(x) ⊙ norm_weight): the RMSNorm in front of a projection folded into its GEMV. Every simdgroup
// sums x^2 over the whole row itself (it reads all of x anyway), so no threadgroup memory and no extra pass. One input
// row per threadgroup row (grid y = M): the engine runs it on decode's one row, and without qmv's 2- to 4-row paths
// it needs far fewer registers (the lm_head GEMV: 255 with spills at 4 rows).
template <typename T, typename S, int Bits, typename O>
[[kernel]] void qmv_norm(constant lily::QMatmulNormArgs& args [[buffer(0)]],
                         device const T* x [[buffer(1)]],
                         device const T* norm_weight [[buffer(2)]],
                         device const uint* weight [[buffer(3)]],
                         device const S* scales [[buffer(4)]],
                         device const S* biases [[buffer(5)]],
                         device O* y [[buffer(6)]],
                         uint3 tg [[threadgroup_position_in_grid]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint simd_group [[simdgroup_index_in_threadgroup]]) {
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  const uint K = args.in_features;
  const uint N = args.out_features;
  const uint first_row = (tg.x * LILY_QMV_SIMDGROUPS + simd_group) * kRows;
  if (first_row >= N || tg.y >= args.num_rows) {
    return;  // the whole simdgroup leaves: the simd_sums below stay convergent
  }
  lily_qmatmul::qmv_rows<true, false, 1, Bits>(x, norm_weight, weight, scales, biases, x, y, K, N, args.eps, tg.y,
                                               first_row, lane);
}

// out = residual + W · x, written once: the residual add after the out/o projection folded into its GEMV. out may
// alias residual (the residual stream updated in place): each element is read and written by the same thread. One
// input row per threadgroup row (grid y = M), as qmv_norm.
template <typename T, typename S, int Bits>
[[kernel]] void qmv_residual(constant lily::QMatmulArgs& args [[buffer(0)]],
                             device const T* x [[buffer(1)]],
                             device const uint* weight [[buffer(2)]],
                             device const S* scales [[buffer(3)]],
                             device const S* biases [[buffer(4)]],
                             device const T* residual [[buffer(5)]],
                             device T* out [[buffer(6)]],
                             uint3 tg [[threadgroup_position_in_grid]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint simd_group [[simdgroup_index_in_threadgroup]]) {
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  const uint K = args.in_features;
  const uint N = args.out_features;
  const uint first_row = (tg.x * LILY_QMV_SIMDGROUPS + simd_group) * kRows;
  if (first_row >= N || tg.y >= args.num_rows) {
    return;  // the whole simdgroup leaves: the simd_sum below stays convergent
  }
  lily_qmatmul::qmv_rows<false, true, 1, Bits>(x, x, weight, scales, biases, residual, out, K, N, 0.0f, tg.y,
                                               first_row, lane);
}

// The segmented decode GEMV: y = W_s · x' for the segment s a threadgroup falls in, x' = rms_norm(x) ⊙ norm_weight
// when Norm. Each segment's rows are padded to whole threadgroups, so a threadgroup (and each simdgroup) reads one
// matrix only; the segment walk is uniform per threadgroup and at most 3 steps.
template <bool Norm, typename T, typename S, int Bits, typename O>
[[kernel]] void qmv_segments(constant lily::QMatmulSegmentsArgs& args [[buffer(0)]],
                             device const T* x [[buffer(1)]],
                             device const T* norm_weight [[buffer(2)]],
                             device const uint* weight0 [[buffer(3)]],
                             device const S* scales0 [[buffer(4)]],
                             device const S* biases0 [[buffer(5)]],
                             device const uint* weight1 [[buffer(6)]],
                             device const S* scales1 [[buffer(7)]],
                             device const S* biases1 [[buffer(8)]],
                             device const uint* weight2 [[buffer(9)]],
                             device const S* scales2 [[buffer(10)]],
                             device const S* biases2 [[buffer(11)]],
                             device const uint* weight3 [[buffer(12)]],
                             device const S* scales3 [[buffer(13)]],
                             device const S* biases3 [[buffer(14)]],
                             device O* y [[buffer(15)]],
                             uint3 tg [[threadgroup_position_in_grid]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint simd_group [[simdgroup_index_in_threadgroup]]) {
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  constexpr uint kRowsPerGroup = LILY_QMV_SIMDGROUPS * kRows;
  const uint K = args.in_features;
  const lily_qmatmul::QmvSegment seg = lily_qmatmul::qmv_find_segment(args, tg.x, kRowsPerGroup);
  const uint segment = seg.index, row_offset = seg.row_offset;
  const uint N = args.rows[segment];
  const uint first_row = (seg.block * LILY_QMV_SIMDGROUPS + simd_group) * kRows;
  if (first_row >= N) {
    return;  // the whole simdgroup leaves: the simd_sums below stay convergent
  }
  device const uint* weight = lily_qmatmul::qmv_segment_pick(segment, weight0, weight1, weight2, weight3);
  device const S* scales = lily_qmatmul::qmv_segment_pick(segment, scales0, scales1, scales2, scales3);
  device const S* biases = lily_qmatmul::qmv_segment_pick(segment, biases0, biases1, biases2, biases3);
  float acc[1][kRows], sum_sq[1];
  lily_qmatmul::qmv_accumulate<Norm, Bits, 1>(acc, sum_sq, x + size_t(tg.y) * K, norm_weight, weight, scales, biases,
                                              K, N, first_row, lane);
  const float scale = Norm ? precise::rsqrt(simd_sum(sum_sq[0]) / float(K) + args.eps) : 1.0f;
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    const float total = simd_sum(acc[0][r]);
    if (lane == 0 && first_row + r < N) {
      y[size_t(tg.y) * args.out_features + row_offset + first_row + r] = O(total * scale);
    }
  }
}

// ---- qmv_mma: Y = X W^T for a few rows of bf16 X on matrix units (CUDA's choice: tuning::mma_gemv) ----
// The vector GEMVs spend about three instructions per 4-bit weight (mask-or, subtract, FMA) and one more FMA per
// weight for every further input row, which keeps them issue-bound below copy speed on an H200. Here a weight costs
// about one integer operation: two codes of a word are masked at once into the mantissas of two bf16 values 128 + q
// (exact: bf16 holds the integers up to 256), and 8x8 simdgroup MMAs (tensor cores on NVIDIA) multiply them with up to
// 8 input rows at once, fp32 sums. Per quantization group g and weight row n, with D' = sum_k (128 + q_k) x_k and
// X = sum_k x_k (an MMA of a ones fragment with the same x): sum_k x_k (scale q_k + bias) = scale D' + (bias -
// 128 scale) X.
//
// Layout. A lane holds row attn_mma_row and columns attn_mma_col, + 1 of each 8x8 fragment (the same for A, B and
// the accumulator). The order of k inside a group is free as long as W and x agree, so a lane's two A elements are
// the codes it can take from one word without a shift per code: lane column c reads words c and c + 1 of its row's
// group (codes 16 (c / 2) .. + 15), and at MMA step s (0..7) of the group element e is the code at k = 16 (c / 2) +
// 8 (s / 4) + s % 4 + 4 e: word s / 4 shifted by 4 (s % 4), masked with 0x000F000F. The B fragment's lane (row r,
// columns c, c + 1) then needs x[m][k(s, r)] of input rows m = c, c + 1: over the 8 steps, two runs of 4 consecutive
// values, i.e. two 8-byte loads per input row and group. The accumulator's lane holds the outputs of row n (its A
// row) for input rows c, c + 1, so the scale and bias it folds are those of the codes it loaded.
template <typename T, typename O>
[[kernel]] void qmv_mma(constant lily::QMatmulArgs& args [[buffer(0)]],
                        device const T* x [[buffer(1)]],
                        device const uint* weight [[buffer(2)]],
                        device const bfloat* scales [[buffer(3)]],
                        device const bfloat* biases [[buffer(4)]],
                        device O* y [[buffer(5)]],
                        uint3 tg [[threadgroup_position_in_grid]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]],
                        uint simd_group [[simdgroup_index_in_threadgroup]],
                        uint n_sg [[simdgroups_per_threadgroup]]) {
  constexpr uint kFrags = LILY_QMV_MMA_ROWS / 8;  // 8-row fragments of W per simdgroup
  constexpr uint kSteps = LILY_QMV_MMA_GROUPS_PER_STEP;  // groups each simdgroup loads before using any
  constexpr uint kPerWord = lily::codes_per_word<4>();
  constexpr uint kWordsPerGroup = lily::kQuantGroupSize / kPerWord;
  // Codes e and e + 4 of a word, shifted down to bits 0-3 of its halves, or-ed into two bf16 128.0: 128 + q each.
  constexpr uint kCodePairMask = 0x000F000Fu, kCodePairOffsetBits = 0x43004300u;
  constexpr float kCodeOffset = 128.0f;
  threadgroup float partial[LILY_QMV_MMA_MAX_SIMDGROUPS][kFrags][8][8];  // n_sg of them (the host's threadgroup)
  const uint K = args.in_features, N = args.out_features, M = args.num_rows;
  const uint groups = K / lily::kQuantGroupSize;
  const uint row = attn_mma_row(lane), col = attn_mma_col(lane);
  const uint n0 = tg.x * LILY_QMV_MMA_ROWS, m0 = tg.y * 8;
  // This lane's weight row in each fragment (rows past N read row N - 1 and are never written), and its two input
  // rows (past M: zero, never loaded).
  device const uint* w_row[kFrags];
  device const bfloat* s_row[kFrags];
  device const bfloat* b_row[kFrags];
  LILY_UNROLL
  for (uint f = 0; f < kFrags; ++f) {
    const size_t n = min(n0 + 8 * f + row, N - 1);
    w_row[f] = weight + n * (K / kPerWord) + col;  // words c, c + 1 of each group (col is even)
    s_row[f] = scales + n * groups;
    b_row[f] = biases + n * groups;
  }
  const bool has_x[2] = {m0 + col < M, m0 + col + 1 < M};
  device const T* x_row[2];
  LILY_UNROLL
  for (uint e = 0; e < 2; ++e) {
    x_row[e] = x + size_t(min(m0 + col + e, M - 1)) * K + 16 * (row / 2) + 4 * (row % 2);
  }
  const simdgroup_bfloat8x8 ones = make_filled_simdgroup_matrix<bfloat, 8, 8>(bfloat(1.0f));
  float2 acc[kFrags];
  LILY_UNROLL
  for (uint f = 0; f < kFrags; ++f) {
    acc[f] = float2(0.0f);
  }
  for (uint g0 = simd_group; g0 < groups; g0 += n_sg * kSteps) {  // uniform per simdgroup: convergent MMAs
    uint words[kSteps][kFrags][2];
    float scale[kSteps][kFrags], bias[kSteps][kFrags];
    vec<T, 4> xs[kSteps][2][2];  // [group][input row c + e][k run 0..3 or 8..11]
    LILY_UNROLL
    for (uint i = 0; i < kSteps; ++i) {
      // A group past K re-reads the last one, weighted 0: no load is conditional on it.
      const uint g = min(g0 + n_sg * i, groups - 1);
      const bool in_row = g0 + n_sg * i < groups;
      LILY_UNROLL
      for (uint f = 0; f < kFrags; ++f) {
        words[i][f][0] = w_row[f][g * kWordsPerGroup];
        words[i][f][1] = w_row[f][g * kWordsPerGroup + 1];
        scale[i][f] = in_row ? float(s_row[f][g]) : 0.0f;
        bias[i][f] = in_row ? float(b_row[f][g]) - kCodeOffset * scale[i][f] : 0.0f;
      }
      LILY_UNROLL
      for (uint e = 0; e < 2; ++e) {
        LILY_UNROLL
        for (uint h = 0; h < 2; ++h) {
          // Loaded whatever has_x says (from row M - 1 past M), then selected: no branch around a load.
          const vec<T, 4> v = *((device const vec<T, 4>*)(x_row[e] + g * lily::kQuantGroupSize + 8 * h));
          xs[i][e][h] = has_x[e] ? v : vec<T, 4>(T(0.0f));
        }
      }
    }
    LILY_UNROLL
    for (uint i = 0; i < kSteps; ++i) {
      // dot[f]: D' of fragment f's rows; dot[kFrags]: X (the ones fragment), for input rows c, c + 1.
      simdgroup_float8x8 dot[kFrags + 1];
      LILY_UNROLL
      for (uint f = 0; f <= kFrags; ++f) {
        dot[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
      LILY_UNROLL
      for (uint s = 0; s < 8; ++s) {
        simdgroup_bfloat8x8 a[kFrags + 1];
        LILY_UNROLL
        for (uint f = 0; f < kFrags; ++f) {
          const uint codes = (words[i][f][s / 4] >> (4 * (s % 4))) & kCodePairMask;
          a[f].thread_elements() = as_type<bfloat2>(codes | kCodePairOffsetBits);
        }
        a[kFrags] = ones;
        simdgroup_bfloat8x8 b;
        b.thread_elements() = bfloat2(bfloat(xs[i][0][s / 4][s % 4]), bfloat(xs[i][1][s / 4][s % 4]));
        attn_mma_column<kFrags + 1>(dot, a, b);
      }
      const float2 x_sum = dot[kFrags].thread_elements();
      LILY_UNROLL
      for (uint f = 0; f < kFrags; ++f) {
        acc[f] = fma(float2(scale[i][f]), dot[f].thread_elements(), fma(float2(bias[i][f]), x_sum, acc[f]));
      }
    }
  }
  LILY_UNROLL
  for (uint f = 0; f < kFrags; ++f) {
    partial[simd_group][f][row][col] = acc[f].x;
    partial[simd_group][f][row][col + 1] = acc[f].y;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // One output per thread (kFrags * 64 of them on 32 * n_sg threads): the partial sums in simdgroup order.
  for (uint i = tid; i < kFrags * 64; i += 32 * n_sg) {
    const uint f = i / 64, r = (i / 8) % 8, c = i % 8;
    float total = 0.0f;
    for (uint g = 0; g < n_sg; ++g) {
      total += partial[g][f][r][c];
    }
    const uint n = n0 + 8 * f + r, m = m0 + c;
    if (n < N && m < M) {
      y[size_t(m) * N + n] = O(total);
    }
  }
}

// The staged one-row GEMVs (CUDA's choice; see qmv_stage): the same results as qmv_norm, qmv_residual and
// qmv_norm_seg with one input row per threadgroup row (grid y = M) and K <= LILY_QMV_STAGE_MAX_K (the host checks).
// Threadgroups past the outputs leave before the staging (uniformly); simdgroups past them after it.
// qmv_norm_staged streams: threadgroup x takes the blocks of rows x, x + grid width, ... against one staging of x, so
// the host can launch fewer threadgroups than blocks (the lm_head's 15,520 blocks each staged x once, 8 KB of x and
// norm weight read from L2 per 16 KB of weights; tuning::kQmvStreamGroups). Any grid width gives the same bits.
// qmv_norm_staged's body; with Argmax also the best (value, id) of the rows the threadgroup wrote (id: the row), in
// argmax.h's order, to partial_values / partial_ids[tg.y * grid width + tg.x] (qmv_norm_argmax_staged).
template <typename T, typename S, int Bits, typename O, bool WholePacks, bool Argmax>
LILY_INLINE void qmv_norm_staged_stream(constant lily::QMatmulNormArgs& args, device const T* x,
                                        device const T* norm_weight,
                                        device const lily::pack_codes_t<WholePacks>* weight, device const S* scales,
                                        device const S* biases, device O* y, device float* partial_values,
                                        device uint* partial_ids, threadgroup float4* stage_x,
                                        threadgroup float* pack_sum, threadgroup float* simd_sq,
                                        threadgroup float* simd_best, threadgroup uint* simd_ids, uint3 tg,
                                        uint3 groups, uint tid,
                                        uint n_threads, uint lane, uint simd_group) {
  using namespace lily_qmatmul;
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  const uint K = args.in_features;
  const uint N = args.out_features;
  const uint rows_per_group = (n_threads / 32) * kRows;
  const uint blocks = (N + rows_per_group - 1) / rows_per_group;
  if (tg.x >= blocks || tg.y >= args.num_rows) {
    return;  // the whole threadgroup leaves: the barrier in qmv_stage stays uniform
  }
  // The first block as the other staged GEMVs (its weights loaded before the wait and the staging); the later ones
  // load theirs against the same staging. No barrier after the staging: the simdgroups go on independently.
  uint first_row = tg.x * rows_per_group + simd_group * kRows;
  float acc[kRows];
  const float inv_rms = qmv_staged_rows<true, Bits, WholePacks>(
      acc, x + size_t(tg.y) * K, norm_weight, lily::as_words(weight), scales, biases, K, N, args.eps, first_row,
      first_row < N, stage_x, pack_sum, simd_sq, tid, n_threads, lane, simd_group);
  float best = -INFINITY;  // every lane holds its simdgroup's best (the totals are simd_sums)
  uint best_id = 0xFFFFFFFFu;  // loses to any real row, even a -inf logit
  // The next block's first step, loaded before this block's sums and stores so that its latency overlaps them.
  uint words[LILY_QMV_PACKS_PER_LANE][kRows][LILY_QMV_PACK_WORDS];
  float scale[LILY_QMV_PACKS_PER_LANE][kRows];
  float bias[LILY_QMV_PACKS_PER_LANE][kRows];
  for (uint block = tg.x; first_row < N;) {  // uniform per simdgroup: the simd_sums stay convergent
    const uint next_block = block + groups.x;
    const uint next_row = next_block < blocks ? next_block * rows_per_group + simd_group * kRows : N;
    if (next_row < N) {
      qmv_load_step<Bits, WholePacks>(words, scale, bias, lily::as_words(weight), scales, biases, K, N, next_row,
                                      lane);
    }
    LILY_UNROLL
    for (uint r = 0; r < kRows; ++r) {
      const float total = simd_sum(acc[r]);
      const O out = O(total * inv_rms);
      if (lane == 0 && first_row + r < N) {
        y[size_t(tg.y) * N + first_row + r] = out;
      }
      if (Argmax && first_row + r < N && argmax_better(float(out), first_row + r, best, best_id)) {
        best = float(out);
        best_id = first_row + r;
      }
    }
    block = next_block;
    first_row = next_row;
    if (first_row < N) {
      qmv_staged_dot<Bits, WholePacks>(acc, words, scale, bias, lily::as_words(weight), scales, biases, K, N,
                                       first_row, stage_x, pack_sum, lane);
    }
  }
  if (Argmax) {
    // Arrays of its own: a simdgroup that finishes early must not overwrite simd_sq before a slow one has read it.
    argmax_threadgroup(best, best_id, simd_best, simd_ids, lane, simd_group, n_threads / 32);
    if (tid == 0) {
      partial_values[size_t(tg.y) * groups.x + tg.x] = best;
      partial_ids[size_t(tg.y) * groups.x + tg.x] = best_id;
    }
  }
}

template <typename T, typename S, int Bits, typename O, bool WholePacks>
[[kernel]] void qmv_norm_staged(constant lily::QMatmulNormArgs& args [[buffer(0)]],
                                device const T* x [[buffer(1)]],
                                device const T* norm_weight [[buffer(2)]],
                                device const lily::pack_codes_t<WholePacks>* weight [[buffer(3)]],
                                device const S* scales [[buffer(4)]],
                                device const S* biases [[buffer(5)]],
                                device O* y [[buffer(6)]],
                                uint3 tg [[threadgroup_position_in_grid]],
                                uint3 groups [[threadgroups_per_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint3 threads_per_group [[threads_per_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]],
                                uint simd_group [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 stage_x[LILY_QMV_STAGE_MAX_K / 4];
  threadgroup float pack_sum[LILY_QMV_STAGE_MAX_K / 16];  // 16 values per 8-bit pack, 32 per 4-bit one
  threadgroup float simd_sq[32];
  qmv_norm_staged_stream<T, S, Bits, O, WholePacks, false>(args, x, norm_weight, weight, scales, biases, y, nullptr,
                                                           nullptr, stage_x, pack_sum, simd_sq, nullptr, nullptr, tg,
                                                           groups, tid, threads_per_group.x, lane, simd_group);
}

// qmv_norm_staged that also writes each threadgroup's best logit (greedy decode's lm_head: FUSED_ARGMAX), for
// argmax_final over groups.x * num_rows partials.
template <typename T, typename S, int Bits, typename O, bool WholePacks>
[[kernel]] void qmv_norm_argmax_staged(constant lily::QMatmulNormArgs& args [[buffer(0)]],
                                       device const T* x [[buffer(1)]],
                                       device const T* norm_weight [[buffer(2)]],
                                       device const lily::pack_codes_t<WholePacks>* weight [[buffer(3)]],
                                       device const S* scales [[buffer(4)]],
                                       device const S* biases [[buffer(5)]],
                                       device O* y [[buffer(6)]],
                                       device float* partial_values [[buffer(7)]],  // [num_rows * grid width]
                                       device uint* partial_ids [[buffer(8)]],      // [num_rows * grid width]
                                       uint3 tg [[threadgroup_position_in_grid]],
                                       uint3 groups [[threadgroups_per_grid]],
                                       uint tid [[thread_index_in_threadgroup]],
                                       uint3 threads_per_group [[threads_per_threadgroup]],
                                       uint lane [[thread_index_in_simdgroup]],
                                       uint simd_group [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 stage_x[LILY_QMV_STAGE_MAX_K / 4];
  threadgroup float pack_sum[LILY_QMV_STAGE_MAX_K / 16];  // 16 values per 8-bit pack, 32 per 4-bit one
  threadgroup float simd_sq[32];
  threadgroup float simd_best[32];
  threadgroup uint simd_ids[32];
  qmv_norm_staged_stream<T, S, Bits, O, WholePacks, true>(args, x, norm_weight, weight, scales, biases, y,
                                                          partial_values, partial_ids, stage_x, pack_sum, simd_sq,
                                                          simd_best, simd_ids, tg, groups, tid, threads_per_group.x,
                                                          lane, simd_group);
}

template <typename T, typename S, int Bits, bool WholePacks>
[[kernel]] void qmv_residual_staged(constant lily::QMatmulArgs& args [[buffer(0)]],
                                    device const T* x [[buffer(1)]],
                                    device const lily::pack_codes_t<WholePacks>* weight [[buffer(2)]],
                                    device const S* scales [[buffer(3)]],
                                    device const S* biases [[buffer(4)]],
                                    device const T* residual [[buffer(5)]],
                                    device T* out [[buffer(6)]],
                                    uint3 tg [[threadgroup_position_in_grid]],
                                    uint3 position [[thread_position_in_threadgroup]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint3 threads_per_group [[threads_per_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]],
                                    uint simd_group [[simdgroup_index_in_threadgroup]]) {
  using namespace lily_qmatmul;
  threadgroup float4 stage_x[LILY_QMV_STAGE_MAX_K / 4];
  threadgroup float pack_sum[LILY_QMV_STAGE_MAX_K / 16];  // 16 values per 8-bit pack, 32 per 4-bit one
  threadgroup float simd_sq[32];
  threadgroup float slot_sums[32 * LILY_QMV_ROWS_PER_SIMDGROUP];  // a total per row of each simdgroup (1024 threads)
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  const uint K = args.in_features;
  const uint N = args.out_features;
  const QmvSlotLayout at = qmv_slot_layout(threads_per_group, position);
  if (tg.x * at.row_simdgroups * kRows >= N || tg.y >= args.num_rows) {
    return;  // the whole threadgroup leaves: the barriers stay uniform
  }
  const uint first_row = (tg.x * at.row_simdgroups + at.row_simdgroup) * kRows;
  float acc[kRows];
  qmv_staged_rows<false, Bits, WholePacks>(acc, x + size_t(tg.y) * K, x, lily::as_words(weight), scales, biases, K, N,
                                           0.0f, first_row, first_row < N, stage_x, pack_sum, simd_sq, tid,
                                           at.n_threads, lane, simd_group, at.slot, at.slots);
  qmv_residual_rows(acc, residual, out, size_t(tg.y) * N, N, first_row, first_row < N, slot_sums, at, lane);
}

template <typename T, typename S, int Bits, typename O, bool WholePacks>
[[kernel]] void qmv_norm_seg_staged(constant lily::QMatmulSegmentsArgs& args [[buffer(0)]],
                                    device const T* x [[buffer(1)]],
                                    device const T* norm_weight [[buffer(2)]],
                                    device const lily::pack_codes_t<WholePacks>* weight0 [[buffer(3)]],
                                    device const S* scales0 [[buffer(4)]],
                                    device const S* biases0 [[buffer(5)]],
                                    device const lily::pack_codes_t<WholePacks>* weight1 [[buffer(6)]],
                                    device const S* scales1 [[buffer(7)]],
                                    device const S* biases1 [[buffer(8)]],
                                    device const lily::pack_codes_t<WholePacks>* weight2 [[buffer(9)]],
                                    device const S* scales2 [[buffer(10)]],
                                    device const S* biases2 [[buffer(11)]],
                                    device const lily::pack_codes_t<WholePacks>* weight3 [[buffer(12)]],
                                    device const S* scales3 [[buffer(13)]],
                                    device const S* biases3 [[buffer(14)]],
                                    device O* y [[buffer(15)]],
                                    uint3 tg [[threadgroup_position_in_grid]],
                                    uint3 groups [[threadgroups_per_grid]],
                                    uint3 position [[thread_position_in_threadgroup]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint3 threads_per_group [[threads_per_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]],
                                    uint simd_group [[simdgroup_index_in_threadgroup]]) {
  using namespace lily_qmatmul;
  threadgroup float4 stage_x[LILY_QMV_STAGE_MAX_K / 4];
  threadgroup float pack_sum[LILY_QMV_STAGE_MAX_K / 16];  // 16 values per 8-bit pack, 32 per 4-bit one
  threadgroup float simd_sq[32];
  threadgroup float slot_sums[32 * LILY_QMV_ROWS_PER_SIMDGROUP];  // a total per row of each simdgroup (1024 threads)
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  const uint K = args.in_features;
  const QmvSlotLayout at = qmv_slot_layout(threads_per_group, position);
  const uint rows_per_group = at.row_simdgroups * kRows;
  const uint blocks = qmv_segment_blocks(args, rows_per_group);
  if (tg.x >= blocks) {
    return;  // the whole threadgroup leaves: the barriers stay uniform
  }
  // Streams blocks tg.x, tg.x + grid width, ... as qmv_norm_staged (one staging of x; any grid width, the same bits).
  QmvSegment seg = qmv_find_segment(args, tg.x, rows_per_group);
  uint N = args.rows[seg.index];
  uint first_row = (seg.block * at.row_simdgroups + at.row_simdgroup) * kRows;
  float acc[kRows];
  const float inv_rms = qmv_staged_rows<true, Bits, WholePacks>(
      acc, x + size_t(tg.y) * K, norm_weight,
      lily::as_words(qmv_segment_pick(seg.index, weight0, weight1, weight2, weight3)),
      qmv_segment_pick(seg.index, scales0, scales1, scales2, scales3),
      qmv_segment_pick(seg.index, biases0, biases1, biases2, biases3), K, N, args.eps, first_row, first_row < N,
      stage_x, pack_sum, simd_sq, tid, at.n_threads, lane, simd_group, at.slot, at.slots);
  for (uint block = tg.x;;) {
    float total[kRows];
    if (qmv_slot_totals(acc, total, first_row < N, slot_sums, at, lane)) {
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        if (lane == 0 && first_row + r < N) {
          y[size_t(tg.y) * args.out_features + seg.row_offset + first_row + r] = O(total[r] * inv_rms);
        }
      }
    }
    block += groups.x;
    if (block >= blocks) {
      break;
    }
    if (at.slots > 1) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // slot 0 has read slot_sums before the next block writes them
    }
    seg = qmv_find_segment(args, block, rows_per_group);
    N = args.rows[seg.index];
    first_row = (seg.block * at.row_simdgroups + at.row_simdgroup) * kRows;
    if (first_row < N) {
      qmv_load_and_dot<Bits, WholePacks>(
          acc, lily::as_words(qmv_segment_pick(seg.index, weight0, weight1, weight2, weight3)),
          qmv_segment_pick(seg.index, scales0, scales1, scales2, scales3),
          qmv_segment_pick(seg.index, biases0, biases1, biases2, biases3), K, N, first_row, stage_x, pack_sum, lane,
          at.slot, at.slots);
    }
  }
}

// The conv inputs of channel c (its K - 1 state values and K taps) where `convolves`: qmv_norm_seg_conv_staged's.
template <typename T>
LILY_INLINE void qmv_conv_inputs(device const T* conv_weight, device const T* conv_state, bool convolves, uint C,
                                 uint c, thread float (&history)[LILY_GDN_CONV_KERNEL],
                                 thread float (&taps)[LILY_GDN_CONV_KERNEL]) {
  if (convolves) {
    for (uint j = 0; j + 1 < LILY_GDN_CONV_KERNEL; ++j) {
      history[j] = float(conv_state[size_t(j) * C + c]);
    }
    for (uint j = 0; j < LILY_GDN_CONV_KERNEL; ++j) {
      taps[j] = float(conv_weight[size_t(c) * LILY_GDN_CONV_KERNEL + j]);
    }
  }
}

// qmv_norm_seg_staged with the DeltaNet's causal conv folded into segment 0 (in_proj_qkv, whose rows are the conv's
// channels): lane r of a simdgroup owns its row r's channel c, rounds the GEMV's output to T, runs gdn_conv_silu
// over c's conv state and writes the fp32 result to conv_out[c] and the shifted state, the arithmetic of
// gated_delta_conv and gated_delta_conv_state for one token; segment 0 writes nothing to y. Segment 1 (in_proj_z)
// also writes the SiLU of each rounded output to `gate` (f32), the factor gdn_gated_norm computes per value, once
// here instead of in every threadgroup of the out_proj GEMV that stages the norm. One input row (a decode token: the
// host's rule). Every channel has one owner here, so its in-place shift cannot race with a reader: the
// DeltaNet scan after this kernel may spread a key head over many threadgroups (gated_delta_step, which convolves
// in place, keeps each key head's channels in one).
template <typename T, typename S, int Bits, bool WholePacks>
[[kernel]] void qmv_norm_seg_conv_staged(constant lily::QMatmulSegmentsArgs& args [[buffer(0)]],
                                         device const T* x [[buffer(1)]],
                                         device const T* norm_weight [[buffer(2)]],
                                         device const lily::pack_codes_t<WholePacks>* weight0 [[buffer(3)]],
                                         device const S* scales0 [[buffer(4)]],
                                         device const S* biases0 [[buffer(5)]],
                                         device const lily::pack_codes_t<WholePacks>* weight1 [[buffer(6)]],
                                         device const S* scales1 [[buffer(7)]],
                                         device const S* biases1 [[buffer(8)]],
                                         device const lily::pack_codes_t<WholePacks>* weight2 [[buffer(9)]],
                                         device const S* scales2 [[buffer(10)]],
                                         device const S* biases2 [[buffer(11)]],
                                         device const lily::pack_codes_t<WholePacks>* weight3 [[buffer(12)]],
                                         device const S* scales3 [[buffer(13)]],
                                         device const S* biases3 [[buffer(14)]],
                                         device T* y [[buffer(15)]],
                                         device const T* conv_weight [[buffer(16)]],  // [C, LILY_GDN_CONV_KERNEL]
                                         device T* conv_state [[buffer(17)]],  // [LILY_GDN_CONV_KERNEL - 1, C] in/out
                                         device float* conv_out [[buffer(18)]],  // [C], C = rows[0]
                                         device float* gate [[buffer(19)]],      // [rows[1]]: SiLU(z)
                                         uint3 tg [[threadgroup_position_in_grid]],
                                         uint3 groups [[threadgroups_per_grid]],
                                         uint tid [[thread_index_in_threadgroup]],
                                         uint3 threads_per_group [[threads_per_threadgroup]],
                                         uint lane [[thread_index_in_simdgroup]],
                                         uint simd_group [[simdgroup_index_in_threadgroup]]) {
  using namespace lily_qmatmul;
  threadgroup float4 stage_x[LILY_QMV_STAGE_MAX_K / 4];
  threadgroup float pack_sum[LILY_QMV_STAGE_MAX_K / 16];
  threadgroup float simd_sq[32];
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  constexpr uint kTaps = LILY_GDN_CONV_KERNEL;
  const uint K = args.in_features;
  const uint n_threads = threads_per_group.x;  // 1-D threadgroups
  const uint rows_per_group = (n_threads / 32) * kRows;
  const uint blocks = qmv_segment_blocks(args, rows_per_group);
  if (tg.x >= blocks) {
    return;  // the whole threadgroup leaves: the barrier in qmv_stage stays uniform
  }
  // Streams blocks tg.x, tg.x + grid width, ... as qmv_norm_staged (one staging of x; any grid width, the same bits).
  QmvSegment seg = qmv_find_segment(args, tg.x, rows_per_group);
  uint N = args.rows[seg.index];
  uint first_row = (seg.block * (n_threads / 32) + simd_group) * kRows;
  // Lane r's channel: its conv inputs loaded first, the first block's before the wait in qmv_staged_rows (only this
  // kernel writes a decode token's conv state, and the host never starts it early behind a dispatch that does:
  // Node::early_reads), so their latency hides behind the GEMV.
  float history[kTaps], taps[kTaps];
  qmv_conv_inputs(conv_weight, conv_state, seg.index == 0 && lane < kRows && first_row + lane < N, N,
                  first_row + lane, history, taps);
  float acc[kRows];
  const float inv_rms = qmv_staged_rows<true, Bits, WholePacks>(
      acc, x, norm_weight, lily::as_words(qmv_segment_pick(seg.index, weight0, weight1, weight2, weight3)),
      qmv_segment_pick(seg.index, scales0, scales1, scales2, scales3),
      qmv_segment_pick(seg.index, biases0, biases1, biases2, biases3), K, N, args.eps, first_row, first_row < N,
      stage_x, pack_sum, simd_sq, tid, n_threads, lane, simd_group);
  for (uint block = tg.x;;) {
    if (first_row < N) {  // uniform per simdgroup: the simd_sums stay convergent
      const uint i = seg.index;
      float mine = 0.0f;
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        const float total = simd_sum(acc[r]) * inv_rms;
        mine = lane == r ? total : mine;
        if (i != 0 && lane == 0 && first_row + r < N) {
          y[seg.row_offset + first_row + r] = T(total);
          if (i == 1) {
            gate[first_row + r] = lily::silu(float(T(total)));  // as gdn_gated_norm gates: SiLU of the rounded z
          }
        }
      }
      const uint c = first_row + lane;
      if (i == 0 && lane < kRows && c < N) {
        history[kTaps - 1] = float(T(mine));  // the projection's output as gated_delta_conv reads it: rounded to T
        conv_out[c] = lily::gdn_conv_silu(history, taps);
        for (uint j = 0; j + 1 < kTaps; ++j) {
          conv_state[size_t(j) * N + c] = T(history[j + 1]);  // exact: the history came from T values
        }
      }
    }
    block += groups.x;
    if (block >= blocks) {
      break;
    }
    seg = qmv_find_segment(args, block, rows_per_group);
    N = args.rows[seg.index];
    first_row = (seg.block * (n_threads / 32) + simd_group) * kRows;
    if (first_row < N) {
      qmv_conv_inputs(conv_weight, conv_state, seg.index == 0 && lane < kRows && first_row + lane < N, N,
                      first_row + lane, history, taps);
      qmv_load_and_dot<Bits, WholePacks>(
          acc, lily::as_words(qmv_segment_pick(seg.index, weight0, weight1, weight2, weight3)),
          qmv_segment_pick(seg.index, scales0, scales1, scales2, scales3),
          qmv_segment_pick(seg.index, biases0, biases1, biases2, biases3), K, N, first_row, stage_x, pack_sum, lane);
    }
  }
}

// qmv_residual_staged over the DeltaNet's gated RMSNorm of its scan output: out = residual + W · x with x =
// qmv_stage_gated_norm(o, SiLU(z)), so gated_delta_prefill_norm's dispatch (and its rounded copy of x) leaves a
// decode token. One input row; the bits of gated_delta_prefill_norm followed by qmv_residual_staged.
template <typename T, typename S, int Bits, bool WholePacks>
[[kernel]] void qmv_gated_norm_residual_staged(constant lily::QMatmulGatedNormArgs& args [[buffer(0)]],
                                               device const float* o [[buffer(1)]],          // [K] scan output
                                               device const float* gate [[buffer(2)]],       // [K] SiLU(z)
                                               device const T* norm_weight [[buffer(3)]],    // [head_dim]
                                               device const lily::pack_codes_t<WholePacks>* weight [[buffer(4)]],
                                               device const S* scales [[buffer(5)]],
                                               device const S* biases [[buffer(6)]],
                                               device const T* residual [[buffer(7)]],
                                               device T* out [[buffer(8)]],
                                               uint3 tg [[threadgroup_position_in_grid]],
                                               uint3 position [[thread_position_in_threadgroup]],
                                               uint tid [[thread_index_in_threadgroup]],
                                               uint3 threads_per_group [[threads_per_threadgroup]],
                                               uint lane [[thread_index_in_simdgroup]],
                                               uint simd_group [[simdgroup_index_in_threadgroup]]) {
  using namespace lily_qmatmul;
  threadgroup float4 stage_x[LILY_QMV_STAGE_MAX_K / 4];
  threadgroup float pack_sum[LILY_QMV_STAGE_MAX_K / 16];
  threadgroup float head_inv_rms[LILY_QMV_STAGE_MAX_HEADS];
  threadgroup float slot_sums[32 * LILY_QMV_ROWS_PER_SIMDGROUP];  // a total per row of each simdgroup (1024 threads)
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  const uint K = args.in_features;
  const uint N = args.out_features;
  const QmvSlotLayout at = qmv_slot_layout(threads_per_group, position);
  if (tg.x * at.row_simdgroups * kRows >= N) {
    return;  // the whole threadgroup leaves: the barriers stay uniform
  }
  const uint first_row = (tg.x * at.row_simdgroups + at.row_simdgroup) * kRows;
  const bool active = first_row < N;
  uint words[LILY_QMV_PACKS_PER_LANE][kRows][LILY_QMV_PACK_WORDS];
  float scale[LILY_QMV_PACKS_PER_LANE][kRows], bias[LILY_QMV_PACKS_PER_LANE][kRows];
  if (active) {
    qmv_load_step<Bits, WholePacks>(words, scale, bias, lily::as_words(weight), scales, biases, K, N, first_row,
                                    qmv_slot_first_pack(lane, at.slot));
  }
  lily::grid_dependency_wait();  // o comes from the dispatch before, gate from the one before that
  qmv_stage_gated_norm<T, Bits>(o, gate, norm_weight, K, args.head_dim, args.eps, stage_x, pack_sum, head_inv_rms, tid,
                                at.n_threads, lane, simd_group);
  float acc[kRows];
  if (active) {
    qmv_staged_dot<Bits, WholePacks>(acc, words, scale, bias, lily::as_words(weight), scales, biases, K, N, first_row,
                                     stage_x, pack_sum, lane, at.slot, at.slots);
  }
  qmv_residual_rows(acc, residual, out, 0, N, first_row, active, slot_sums, at, lane);
}

template <typename T, typename S, int Bits, int BM, typename O = T>
[[kernel]] void qmm(constant lily::QMatmulArgs& args [[buffer(0)]],
                    device const T* x [[buffer(1)]],
                    device const uint* weight [[buffer(2)]],
                    device const S* scales [[buffer(3)]],
                    device const S* biases [[buffer(4)]],
                    device O* y [[buffer(5)]],
                    uint3 tg [[threadgroup_position_in_grid]],
                    uint tid [[thread_index_in_threadgroup]],
                    uint simd_group [[simdgroup_index_in_threadgroup]]) {
  threadgroup float tiles[lily::GemmTileMemory<T, BM, 1>::FLOATS];
  lily::GemmQuantizedRows<Bits, S, 1> w_tile = lily::gemm_quantized_rows<Bits, S, 1>(
      tg.x * LILY_GEMM_BN, args.out_features, args.in_features, tid, weight, scales, biases);
  lily::gemm_tiles<BM>(x, w_tile, y, tiles, args.num_rows, args.out_features, args.in_features, tg, tid, simd_group);
}

#if defined(LILY_QMATMUL_HAS_TENSOR_OPS)
template <typename T, typename S, int Bits>
[[kernel]] void qmm_nax(constant lily::QMatmulArgs& args [[buffer(0)]],
                        device const T* x [[buffer(1)]],
                        device const uint* weight [[buffer(2)]],
                        device const S* scales [[buffer(3)]],
                        device const S* biases [[buffer(4)]],
                        device T* y [[buffer(5)]],
                        uint3 tg [[threadgroup_position_in_grid]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint3 threads_per_group [[threads_per_threadgroup]],
                        uint simd_group [[simdgroup_index_in_threadgroup]]) {
  const uint n_threads = threads_per_group.x;  // 1-D threadgroups: the attribute's width matches the position's
  threadgroup T x_tile[LILY_QMM_NAX_BM][LILY_QMM_BK];
  threadgroup T w_tile[LILY_QMM_NAX_BN][LILY_QMM_BK];
  threadgroup float y_tile[LILY_QMM_NAX_BM][LILY_QMM_NAX_BN];
  constexpr uint BM = LILY_QMM_NAX_BM;
  constexpr uint BN = LILY_QMM_NAX_BN;
  constexpr uint BK = LILY_QMM_BK;
  static_assert(BM == 32 && BN == 64, "4 simdgroups, each a 16 x 32 block of the tile");
  const uint K = args.in_features;
  const uint N = args.out_features;
  const uint M = args.num_rows;
  const uint row0 = tg.y * BM;
  const uint n0 = tg.x * BN;

  // Tensor extents are (x = columns, contiguous; y = rows). W's tile is [n][k], hence transpose_right.
  metal::tensor<threadgroup T, metal::dextents<int32_t, 2>, metal::tensor_inline> x_tensor(
      &x_tile[0][0], metal::dextents<int32_t, 2>(BK, BM));
  metal::tensor<threadgroup T, metal::dextents<int32_t, 2>, metal::tensor_inline> w_tensor(
      &w_tile[0][0], metal::dextents<int32_t, 2>(BK, BN));
  metal::tensor<threadgroup float, metal::dextents<int32_t, 2>, metal::tensor_inline> y_tensor(
      &y_tile[0][0], metal::dextents<int32_t, 2>(BN, BM));
  constexpr auto descriptor = mpp::tensor_ops::matmul2d_descriptor(
      16, 32, BK, false, true, false, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
  mpp::tensor_ops::matmul2d<descriptor, metal::execution_simdgroup> op;
  auto left = x_tensor.slice(0, int((simd_group / 2) * 16));
  auto right = w_tensor.slice(0, int((simd_group % 2) * 32));
  auto acc = op.template get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
  for (ushort i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      acc[i] = 0.0f;
    }
  }
  for (uint k0 = 0; k0 < K; k0 += BK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    lily::load_x_tile(x, &x_tile[0][0], BK, BM, BK, row0, k0, M, K, tid, n_threads);
    lily_qmatmul::dequantize_w_tile<Bits>(weight, scales, biases, &w_tile[0][0], BK, BN, BK, n0, k0, N, K, tid,
                                                 n_threads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op.run(left, right, acc);
  }
  auto y_block = y_tensor.slice(int((simd_group % 2) * 32), int((simd_group / 2) * 16));
  acc.store(y_block);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  lily::store_y_tile(&y_tile[0][0], BN, BM, BN, y, row0, n0, M, N, tid, n_threads);
}
#endif

LILY_INSTANTIATE_KERNEL("qmv_q4_g64_f32", qmv, float, bfloat, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_q4_g64_bf16", qmv, bfloat, bfloat, 4, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_q4_g64_f32_sf32", qmv, float, float, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_q4_g64_bf16_sf32", qmv, bfloat, float, 4, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_q8_g64_f32", qmv, float, bfloat, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_q8_g64_bf16", qmv, bfloat, bfloat, 8, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_q8_g64_f32_sf32", qmv, float, float, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_q8_g64_bf16_sf32", qmv, bfloat, float, 8, bfloat)

LILY_INSTANTIATE_KERNEL("qmv_q8_g64_bf16_of32", qmv, bfloat, bfloat, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_q8_g64_bf16_sf32_of32", qmv, bfloat, float, 8, float)
// 4-bit routers and shared-expert gates (a mixed-bit checkpoint) in bf16 mode.
LILY_INSTANTIATE_KERNEL("qmv_q4_g64_bf16_of32", qmv, bfloat, bfloat, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_q4_g64_bf16_sf32_of32", qmv, bfloat, float, 4, float)

LILY_INSTANTIATE_KERNEL("qmv_norm_q4_g64_f32", qmv_norm, float, bfloat, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_q4_g64_f32_sf32", qmv_norm, float, float, 4, float)
// bf16 out: the projections one GEMV each in bf16 mode (LILY_DISABLE_FUSED_PROJECTIONS).
LILY_INSTANTIATE_KERNEL("qmv_norm_q4_g64_bf16", qmv_norm, bfloat, bfloat, 4, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_norm_q4_g64_bf16_sf32", qmv_norm, bfloat, float, 4, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_norm_q8_g64_f32", qmv_norm, float, bfloat, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_q8_g64_f32_sf32", qmv_norm, float, float, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_q8_g64_bf16", qmv_norm, bfloat, bfloat, 8, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_norm_q8_g64_bf16_sf32", qmv_norm, bfloat, float, 8, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_norm_q8_g64_bf16_of32", qmv_norm, bfloat, bfloat, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_q8_g64_bf16_sf32_of32", qmv_norm, bfloat, float, 8, float)
// 4-bit routers and shared-expert gates (a mixed-bit checkpoint) in bf16 mode.
LILY_INSTANTIATE_KERNEL("qmv_norm_q4_g64_bf16_of32", qmv_norm, bfloat, bfloat, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_q4_g64_bf16_sf32_of32", qmv_norm, bfloat, float, 4, float)

// The staged one-row GEMVs: CUDA's choice for the bf16 model's decode projections (tuning::staged_gemv); f32 for the
// float32 mode and the tests' exact checks. Each twice: codes read a word at a time, and (_a16) a pack of 4 words
// as one 16-byte load where the codes lie on 16 bytes (tuning::whole_pack_loads).
LILY_INSTANTIATE_KERNEL("qmv_mma_q4_g64_bf16", qmv_mma, bfloat, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_mma_q4_g64_bf16_of32", qmv_mma, bfloat, float)

LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_staged_q4_g64_f32", qmv_norm_staged, float, bfloat, 4, float, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_staged_q4_g64_f32_a16", qmv_norm_staged, float, bfloat, 4, float, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_staged_q4_g64_bf16", qmv_norm_staged, bfloat, bfloat, 4, bfloat, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_staged_q4_g64_bf16_a16", qmv_norm_staged, bfloat, bfloat, 4, bfloat, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_staged_q4_g64_bf16_of32", qmv_norm_staged, bfloat, bfloat, 4, float, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_staged_q4_g64_bf16_of32_a16", qmv_norm_staged, bfloat, bfloat, 4, float, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_argmax_staged_q4_g64_f32", qmv_norm_argmax_staged, float, bfloat, 4, float,
                              false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_argmax_staged_q4_g64_f32_a16", qmv_norm_argmax_staged, float, bfloat, 4,
                              float, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_argmax_staged_q4_g64_bf16_of32", qmv_norm_argmax_staged, bfloat, bfloat, 4,
                              float, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_argmax_staged_q4_g64_bf16_of32_a16", qmv_norm_argmax_staged, bfloat, bfloat, 4,
                              float, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_residual_staged_q4_g64_f32", qmv_residual_staged, float, bfloat, 4, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_residual_staged_q4_g64_f32_a16", qmv_residual_staged, float, bfloat, 4, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_residual_staged_q4_g64_bf16", qmv_residual_staged, bfloat, bfloat, 4, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_residual_staged_q4_g64_bf16_a16", qmv_residual_staged, bfloat, bfloat, 4, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_seg_staged_q4_g64_f32", qmv_norm_seg_staged, float, bfloat, 4, float, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_seg_staged_q4_g64_f32_a16", qmv_norm_seg_staged, float, bfloat, 4, float, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_seg_staged_q4_g64_bf16", qmv_norm_seg_staged, bfloat, bfloat, 4, bfloat, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_seg_staged_q4_g64_bf16_a16", qmv_norm_seg_staged,
                              bfloat, bfloat, 4, bfloat, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_seg_staged_q8_g64_bf16_of32", qmv_norm_seg_staged,
                              bfloat, bfloat, 8, float, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_seg_staged_q8_g64_bf16_of32_a16", qmv_norm_seg_staged,
                              bfloat, bfloat, 8, float, true)
// A decode token's DeltaNet spread over many threadgroups (tuning::spread_deltanet_step): the conv in the in_proj GEMV,
// the gated norm in the out_proj GEMV's staging.
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_seg_conv_staged_q4_g64_f32", qmv_norm_seg_conv_staged, float, bfloat, 4, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_seg_conv_staged_q4_g64_f32_a16", qmv_norm_seg_conv_staged,
                              float, bfloat, 4, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_seg_conv_staged_q4_g64_bf16", qmv_norm_seg_conv_staged,
                              bfloat, bfloat, 4, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_norm_seg_conv_staged_q4_g64_bf16_a16", qmv_norm_seg_conv_staged,
                              bfloat, bfloat, 4, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_gated_norm_residual_staged_q4_g64_f32", qmv_gated_norm_residual_staged,
                              float, bfloat, 4, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_gated_norm_residual_staged_q4_g64_f32_a16", qmv_gated_norm_residual_staged,
                              float, bfloat, 4, true)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_gated_norm_residual_staged_q4_g64_bf16", qmv_gated_norm_residual_staged,
                              bfloat, bfloat, 4, false)
LILY_INSTANTIATE_EARLY_KERNEL("qmv_gated_norm_residual_staged_q4_g64_bf16_a16", qmv_gated_norm_residual_staged,
                              bfloat, bfloat, 4, true)
LILY_INSTANTIATE_KERNEL("qmv_seg_q4_g64_f32", qmv_segments, false, float, bfloat, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_seg_q4_g64_f32_sf32", qmv_segments, false, float, float, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_seg_q4_g64_bf16", qmv_segments, false, bfloat, bfloat, 4, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_seg_q4_g64_bf16_sf32", qmv_segments, false, bfloat, float, 4, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_seg_q8_g64_f32", qmv_segments, false, float, bfloat, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_seg_q8_g64_f32_sf32", qmv_segments, false, float, float, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_seg_q8_g64_bf16", qmv_segments, false, bfloat, bfloat, 8, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_seg_q8_g64_bf16_of32", qmv_segments, false, bfloat, bfloat, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_seg_q8_g64_bf16_sf32", qmv_segments, false, bfloat, float, 8, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_seg_q8_g64_bf16_sf32_of32", qmv_segments, false, bfloat, float, 8, float)
// 4-bit routers and shared-expert gates (a mixed-bit checkpoint) in bf16 mode.
LILY_INSTANTIATE_KERNEL("qmv_seg_q4_g64_bf16_of32", qmv_segments, false, bfloat, bfloat, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_seg_q4_g64_bf16_sf32_of32", qmv_segments, false, bfloat, float, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q4_g64_f32", qmv_segments, true, float, bfloat, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q4_g64_f32_sf32", qmv_segments, true, float, float, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q4_g64_bf16", qmv_segments, true, bfloat, bfloat, 4, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q4_g64_bf16_sf32", qmv_segments, true, bfloat, float, 4, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q8_g64_f32", qmv_segments, true, float, bfloat, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q8_g64_f32_sf32", qmv_segments, true, float, float, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q8_g64_bf16", qmv_segments, true, bfloat, bfloat, 8, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q8_g64_bf16_of32", qmv_segments, true, bfloat, bfloat, 8, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q8_g64_bf16_sf32", qmv_segments, true, bfloat, float, 8, bfloat)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q8_g64_bf16_sf32_of32", qmv_segments, true, bfloat, float, 8, float)
// 4-bit routers and shared-expert gates (a mixed-bit checkpoint) in bf16 mode.
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q4_g64_bf16_of32", qmv_segments, true, bfloat, bfloat, 4, float)
LILY_INSTANTIATE_KERNEL("qmv_norm_seg_q4_g64_bf16_sf32_of32", qmv_segments, true, bfloat, float, 4, float)

LILY_INSTANTIATE_KERNEL("qmv_residual_q4_g64_f32", qmv_residual, float, bfloat, 4)
LILY_INSTANTIATE_KERNEL("qmv_residual_q4_g64_f32_sf32", qmv_residual, float, float, 4)
LILY_INSTANTIATE_KERNEL("qmv_residual_q4_g64_bf16", qmv_residual, bfloat, bfloat, 4)
LILY_INSTANTIATE_KERNEL("qmv_residual_q4_g64_bf16_sf32", qmv_residual, bfloat, float, 4)
LILY_INSTANTIATE_KERNEL("qmv_residual_q8_g64_f32", qmv_residual, float, bfloat, 8)
LILY_INSTANTIATE_KERNEL("qmv_residual_q8_g64_f32_sf32", qmv_residual, float, float, 8)
LILY_INSTANTIATE_KERNEL("qmv_residual_q8_g64_bf16", qmv_residual, bfloat, bfloat, 8)
LILY_INSTANTIATE_KERNEL("qmv_residual_q8_g64_bf16_sf32", qmv_residual, bfloat, float, 8)

LILY_INSTANTIATE_KERNEL("qmm_q4_g64_f32_bm16", qmm, float, bfloat, 4, 16)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_bf16_bm16", qmm, bfloat, bfloat, 4, 16)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_f32_sf32_bm16", qmm, float, float, 4, 16)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_bf16_sf32_bm16", qmm, bfloat, float, 4, 16)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_f32_bm32", qmm, float, bfloat, 4, 32)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_bf16_bm32", qmm, bfloat, bfloat, 4, 32)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_f32_sf32_bm32", qmm, float, float, 4, 32)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_bf16_sf32_bm32", qmm, bfloat, float, 4, 32)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_f32_bm16", qmm, float, bfloat, 8, 16)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_bf16_bm16", qmm, bfloat, bfloat, 8, 16)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_f32_sf32_bm16", qmm, float, float, 8, 16)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_bf16_sf32_bm16", qmm, bfloat, float, 8, 16)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_f32_bm32", qmm, float, bfloat, 8, 32)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_bf16_bm32", qmm, bfloat, bfloat, 8, 32)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_f32_sf32_bm32", qmm, float, float, 8, 32)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_bf16_sf32_bm32", qmm, bfloat, float, 8, 32)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_bf16_bm64", qmm, bfloat, bfloat, 4, 64)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_bf16_sf32_bm64", qmm, bfloat, float, 4, 64)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_bf16_bm64", qmm, bfloat, bfloat, 8, 64)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_bf16_sf32_bm64", qmm, bfloat, float, 8, 64)
// bf16 in, fp32 out (the _of32 suffix, as qmv's): the router | shared-expert gate logits and every-row lm_head
// logits of a prefill chunk, above qmv's row limit.
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_bf16_of32_bm16", qmm, bfloat, bfloat, 4, 16, float)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_bf16_of32_bm32", qmm, bfloat, bfloat, 4, 32, float)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_bf16_sf32_of32_bm16", qmm, bfloat, float, 4, 16, float)
LILY_INSTANTIATE_KERNEL("qmm_q4_g64_bf16_sf32_of32_bm32", qmm, bfloat, float, 4, 32, float)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_bf16_of32_bm16", qmm, bfloat, bfloat, 8, 16, float)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_bf16_of32_bm32", qmm, bfloat, bfloat, 8, 32, float)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_bf16_sf32_of32_bm16", qmm, bfloat, float, 8, 16, float)
LILY_INSTANTIATE_KERNEL("qmm_q8_g64_bf16_sf32_of32_bm32", qmm, bfloat, float, 8, 32, float)

#if defined(LILY_QMATMUL_HAS_TENSOR_OPS)
LILY_INSTANTIATE_KERNEL("qmm_nax_q4_g64_bf16", qmm_nax, bfloat, bfloat, 4)
LILY_INSTANTIATE_KERNEL("qmm_nax_q8_g64_bf16", qmm_nax, bfloat, bfloat, 8)
#endif
