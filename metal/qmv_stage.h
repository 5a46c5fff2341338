// The staged GEMV helpers (CUDA's choice, tuning::staged_gemv): x staged once per threadgroup in threadgroup memory in
// the order the lanes read it, and the dot products of a simdgroup's rows against it. Used by qmatmul.metal (the staged
// one-row GEMVs) and moe.metal (the staged decode experts).
#ifndef LILY_QMV_STAGE_H
#define LILY_QMV_STAGE_H

#include <metal_stdlib>
#include "lily.h"
#include "quantized.h"

namespace lily {
using namespace metal;

// ---- the staged one-row GEMVs ----
// Each lane reads packs p = lane + 32 s of every row (qmv_accumulate); here the pack's x values come from threadgroup
// memory instead of device memory, staged once per threadgroup in the order the lanes read them: float4 chunk c of pack
// p at stage_x[((p / 32) * kChunks + c) * 32 + p % 32], so a simdgroup's 32 lanes read 32 consecutive float4 (no bank
// conflict) where, from device memory, each lane loads its own pack's values 64 bytes from its neighbour's: on an
// H200 those scattered loads kept the L1 95 % busy at 15 % of DRAM bandwidth (Nsight Compute, qmv_norm_q4 at the
// lm_head shape: 128 L1 wavefronts per x load instruction against 4 for a weight word). Staging also applies
// norm_weight once per threadgroup instead of once per simdgroup, and keeps each pack's sum for the bias fold. Apple
// GPUs keep the unstaged kernels: 16 KiB of threadgroup memory per 64-thread group may cost them occupancy (not
// measured), so the staged ones are a CUDA variant in the kernel-choice table (tuning::staged_gemv).
template <int Bits>
constexpr uint kStageChunks = LILY_QMV_PACK_WORDS * (32 / Bits) / 4;  // float4 chunks per pack: 8 (4-bit), 4 (8-bit)
// Chunks each thread loads per staging round: K = 2048 (the model's hidden size) in one round on 64 threads.
constant constexpr uint kStageBatch = LILY_QMV_STAGE_BATCH;

// Where chunk q (values 4q .. 4q + 3) of a staged row lies in stage_x: chunk c of pack p at ((p / 32) * kChunks + c)
// * 32 + p % 32, so the 32 lanes reading a pack each read 32 consecutive float4.
template <int Bits>
inline uint qmv_stage_slot(uint q) {
  constexpr uint kChunks = kStageChunks<Bits>;
  const uint p = q / kChunks;
  return ((p / 32) * kChunks + q % kChunks) * 32 + p % 32;
}

// Stores float4 chunk q (values 4q .. 4q + 3) of the staged row and, from its pack's first lane, the pack's sum: the
// kChunks chunks of a pack lie in consecutive lanes of one simdgroup, which add it with shuffles (a fixed order).
// Called by whole simdgroups (convergent shuffles); `in_row` false stores nothing.
template <int Bits>
LILY_INLINE void qmv_stage_chunk(float4 v, uint q, bool in_row, threadgroup float4* stage_x,
                                 threadgroup float* pack_sum) {
  constexpr uint kChunks = kStageChunks<Bits>;
  float s = (v.x + v.y) + (v.z + v.w);
  LILY_UNROLL
  for (uint o = 1; o < kChunks; o *= 2) {
    s += simd_shuffle_xor(s, ushort(o));
  }
  if (in_row) {
    stage_x[qmv_stage_slot<Bits>(q)] = v;
    if (q % kChunks == 0) {
      pack_sum[q / kChunks] = s;
    }
  }
}

// Stages x' = x (⊙ norm_weight when Norm) of one input row; returns 1/rms of x (Norm) or 1. Every thread of the
// threadgroup calls it (it ends with a barrier); threads per threadgroup a multiple of 32, K a multiple of 64 and at
// most what the caller's stage_x and pack_sum hold (LILY_QMV_STAGE_MAX_K in the GEMVs). Chunk q (values 4q .. 4q + 3) is thread q % n_threads's: the kChunks chunks of a pack lie
// in consecutive lanes of one simdgroup, which add their pack's sum with shuffles (a fixed order).
template <bool Norm, int Bits, uint Batch = kStageBatch, typename T>
LILY_INLINE float qmv_stage(device const T* x, device const T* norm_weight, uint K, float eps,
                            threadgroup float4* stage_x, threadgroup float* pack_sum, threadgroup float* simd_sq,
                            uint tid, uint n_threads, uint lane, uint simd_group) {
  const uint chunks = K / 4;
  float sq = 0.0f;
  // Batch chunks per thread and round (kStageBatch unless the caller needs the registers), every load of a round
  // issued before the first is used: one memory round trip per round (K = 2048 on 64 threads: one) where a chunk at
  // a time took one per chunk.
  for (uint q0 = 0; q0 < chunks; q0 += Batch * n_threads) {  // uniform trip counts: convergent shuffles
    float4 v[Batch], w[Batch];
    LILY_UNROLL
    for (uint u = 0; u < Batch; ++u) {
      const uint q = min(q0 + u * n_threads + tid, chunks - 1);
      v[u] = lily::attn_load4(x + 4 * q);
      w[u] = Norm ? lily::attn_load4(norm_weight + 4 * q) : float4(1.0f);
    }
    LILY_UNROLL
    for (uint u = 0; u < Batch; ++u) {
      const uint q = min(q0 + u * n_threads + tid, chunks - 1);
      const bool in_row = q0 + u * n_threads + tid < chunks;  // whole packs in or out (K: a multiple of 64)
      if (Norm) {
        sq += in_row ? dot(v[u], v[u]) : 0.0f;
        v[u] *= w[u];
      }
      qmv_stage_chunk<Bits>(v[u], q, in_row, stage_x, pack_sum);
    }
  }
  if (Norm) {
    sq = simd_sum(sq);
    if (lane == 0) {
      simd_sq[simd_group] = sq;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (!Norm) {
    return 1.0f;
  }
  float total = 0.0f;
  for (uint g = 0; g < n_threads / 32; ++g) {
    total += simd_sq[g];
  }
  return precise::rsqrt(total / float(K) + eps);
}

// The type a staged kernel binds its code tensors as: uint, or uint4 where a pack's 4 words are one 16-byte load
// (WholePacks), so that the binding states the alignment the loads need (the test runtimes check each bound address
// against its pointee's size, as a GPU faults on a misaligned vector load).
template <bool WholePacks>
struct PackCodes {
  using type = uint;
};
template <>
struct PackCodes<true> {
  using type = uint4;
};
template <bool WholePacks>
using pack_codes_t = typename PackCodes<WholePacks>::type;
// A staged kernel's codes as the words the helpers index.
inline device const uint* as_words(device const uint* codes) { return codes; }
inline device const uint* as_words(device const uint4* codes) { return (device const uint*)codes; }
// One pack of LILY_QMV_PACK_WORDS code words from `pack`: one 16-byte load (WholePacks: `pack` on 16 bytes) or a word
// at a time.
template <bool WholePacks>
LILY_INLINE void qmv_load_pack(device const uint* pack, thread uint (&words)[LILY_QMV_PACK_WORDS]) {
  if (WholePacks) {
    static_assert(LILY_QMV_PACK_WORDS == 4, "a pack is one 16-byte load");
    const uint4 v = *(device const uint4*)pack;
    LILY_UNROLL
    for (uint j = 0; j < LILY_QMV_PACK_WORDS; ++j) {
      words[j] = v[j];
    }
  } else {
    LILY_UNROLL
    for (uint j = 0; j < LILY_QMV_PACK_WORDS; ++j) {
      words[j] = pack[j];
    }
  }
}

// The first pack a lane loads in step slot `slot` (the split-step GEMVs: slot s takes steps s, s + slots, ... of a
// row, a step being kPacks packs of each of the 32 lanes): what qmv_load_step's p0 and qmv_staged_dot start from.
inline uint qmv_slot_first_pack(uint lane, uint slot) { return lane + 32 * LILY_QMV_PACKS_PER_LANE * slot; }

// Loads one step of a simdgroup's kRows rows: kPacks packs (lane + 32 i from p0) of LILY_QMV_PACK_WORDS words each,
// and their scales and biases (0 past the row: a pack past the row re-reads the row's last pack). WholePacks: a pack
// is one 16-byte load (one load instruction for four: on the H200 tg128 +2 %, docs/performance.md), which needs the
// codes on 16 bytes (every row and pack then is: K a multiple of 64); else 4 word loads, the alignment a mapped
// checkpoint guarantees. The host picks by where the codes lie (tuning::whole_pack_loads).
template <int Bits, bool WholePacks, typename S>
LILY_INLINE void qmv_load_step(
    thread uint (&words)[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP][LILY_QMV_PACK_WORDS],
                               thread float (&scale)[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP],
                               thread float (&bias)[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP],
                               device const uint* weight, device const S* scales, device const S* biases, uint K,
                               uint N, uint first_row, uint p0) {
  constexpr uint kPerWord = 32 / Bits;
  constexpr uint kWordsPerGroup = kQuantGroupSize / kPerWord;
  const uint words_per_row = K / kPerWord;
  const uint packs_per_row = words_per_row / LILY_QMV_PACK_WORDS;
  const uint groups_per_row = K / kQuantGroupSize;
  LILY_UNROLL
  for (uint i = 0; i < LILY_QMV_PACKS_PER_LANE; ++i) {
    const uint p = min(p0 + 32 * i, packs_per_row - 1);
    const bool in_row = p0 + 32 * i < packs_per_row;
    const uint g = p * LILY_QMV_PACK_WORDS / kWordsPerGroup;
    LILY_UNROLL
    for (uint r = 0; r < LILY_QMV_ROWS_PER_SIMDGROUP; ++r) {
      const size_t n = min(first_row + r, N - 1);  // rows past N read row N - 1 (never written)
      qmv_load_pack<WholePacks>(weight + n * words_per_row + p * LILY_QMV_PACK_WORDS, words[i][r]);
      scale[i][r] = in_row ? float(scales[n * groups_per_row + g]) : 0.0f;
      bias[i][r] = in_row ? float(biases[n * groups_per_row + g]) : 0.0f;
    }
  }
}

// The dot products of a staged GEMV for this simdgroup's rows: acc[r] = this lane's share of sum_k x'_k w[first_row +
// r, k] over the steps it takes (the caller does the simd_sum), given its first step's weights already loaded
// (qmv_load_step with p0 = qmv_slot_first_pack(lane, slot)): later steps load their own. Step slot `slot` of `slots`
// takes steps slot, slot + slots, ... of the row (the split-step GEMVs: other simdgroups take the rest); one slot
// takes them all.
template <int Bits, bool WholePacks, typename S>
LILY_INLINE void qmv_staged_dot(
    thread float (&acc)[LILY_QMV_ROWS_PER_SIMDGROUP],
    thread uint (&words)[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP][LILY_QMV_PACK_WORDS],
    thread float (&scale)[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP],
    thread float (&bias)[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP], device const uint* weight,
    device const S* scales, device const S* biases, uint K, uint N, uint first_row, threadgroup const float4* stage_x,
    threadgroup const float* pack_sum, uint lane, uint slot = 0, uint slots = 1) {
  constexpr uint kRows = LILY_QMV_ROWS_PER_SIMDGROUP;
  constexpr uint kPacks = LILY_QMV_PACKS_PER_LANE;
  constexpr uint kPerWord = 32 / Bits;
  constexpr uint kChunks = kStageChunks<Bits>;
  const uint packs_per_row = K / kPerWord / LILY_QMV_PACK_WORDS;
  LILY_UNROLL
  for (uint r = 0; r < kRows; ++r) {
    acc[r] = 0.0f;
  }
  uint magic[lily::kCodeMagicCount<Bits>];
  lily::code_float_magic<Bits>(magic);
  const uint first = qmv_slot_first_pack(lane, slot);
  for (uint p0 = first; p0 < packs_per_row; p0 += 32 * kPacks * slots) {
    if (p0 != first) {
      qmv_load_step<Bits, WholePacks>(words, scale, bias, weight, scales, biases, K, N, first_row, p0);
    }
    LILY_UNROLL
    for (uint i = 0; i < kPacks; ++i) {
      const uint p = min(p0 + 32 * i, packs_per_row - 1);
      threadgroup const float4* chunk = stage_x + (p / 32) * kChunks * 32 + p % 32;
      float d[kRows];
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        d[r] = 0.0f;
      }
      LILY_UNROLL
      for (uint j = 0; j < LILY_QMV_PACK_WORDS; ++j) {
        float xs[kPerWord];
        LILY_UNROLL
        for (uint c = 0; c < kPerWord; c += 4) {
          const float4 v = chunk[((j * kPerWord + c) / 4) * 32];
          LILY_UNROLL
          for (uint e = 0; e < 4; ++e) {
            xs[c + e] = v[e];
          }
        }
        LILY_UNROLL
        for (uint r = 0; r < kRows; ++r) {
          const uint word = words[i][r][j];
          const uint word_high = word >> 16;
          LILY_UNROLL
          for (uint e = 0; e < kPerWord; ++e) {
            d[r] = fma(xs[e], lily::code_float<Bits>(word, word_high, e, magic), d[r]);
          }
        }
      }
      const float x_sum = pack_sum[p];
      LILY_UNROLL
      for (uint r = 0; r < kRows; ++r) {
        acc[r] = fma(scale[i][r], d[r], fma(bias[i][r], x_sum, acc[r]));
      }
    }
  }
}

// qmv_staged_dot for rows whose first step is not loaded yet: a streaming GEMV's later blocks, against the staging
// its first block made (step slot `slot` of `slots`: its steps only).
template <int Bits, bool WholePacks, typename S>
LILY_INLINE void qmv_load_and_dot(thread float (&acc)[LILY_QMV_ROWS_PER_SIMDGROUP], device const uint* weight,
                                  device const S* scales, device const S* biases, uint K, uint N, uint first_row,
                                  threadgroup const float4* stage_x, threadgroup const float* pack_sum, uint lane,
                                  uint slot = 0, uint slots = 1) {
  uint words[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP][LILY_QMV_PACK_WORDS];
  float scale[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP];
  float bias[LILY_QMV_PACKS_PER_LANE][LILY_QMV_ROWS_PER_SIMDGROUP];
  qmv_load_step<Bits, WholePacks>(words, scale, bias, weight, scales, biases, K, N, first_row,
                                  qmv_slot_first_pack(lane, slot));
  qmv_staged_dot<Bits, WholePacks>(acc, words, scale, bias, weight, scales, biases, K, N, first_row, stage_x, pack_sum,
                                   lane, slot, slots);
}

}  // namespace lily

#endif  // LILY_QMV_STAGE_H
