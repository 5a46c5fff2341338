// Gated GQA attention for decode: one query token over the KV cache, out = softmax(q k^T * scale) v
// ⊙ sigmoid(gate), per query head h with KV head h / (Hq / Hkv).
//   attention_decode_<dtype>_d<D>          single pass: one threadgroup per G query heads of one KV head (G = 4 at
//                                          D = 256, LILY_ATTN_HEADS_PER_GROUP; 2 at D = 64, ..._D64), over all keys,
//                                          gate fused. Chosen below LILY_ATTN_SPLIT_MIN_KEYS keys (or always with the
//                                          engine switch LILY_DISABLE_SPLIT_KV).
//   attention_decode_partial_<dtype>_d<D>  split-KV pass 1: the same threadgroup over one block of keys (grid y =
//                                          block); block b holds keys [b * span, (b + 1) * span) with span =
//                                          ceil(num_keys / num_blocks), so one recorded program serves every position
//                                          with the same num_blocks (the host picks it by a power-of-two rule,
//                                          tuning::attention_split_blocks). Writes the block's normalised output and
//                                          its softmax max and sum, fp32; an empty trailing block writes output 0,
//                                          max -inf, sum 0. Chosen from LILY_ATTN_SPLIT_MIN_KEYS keys.
//   attention_decode[_partial]_mma_bf16_d<D>  the single pass and split-KV pass 1 on matrix units (MMA_ATTENTION, bf16
//                                          cache): one threadgroup per the whole GQA group of a KV head (and block):
//                                          the query heads are the columns of 8x8 simdgroup matrices (at the kernels).
//   attention_decode_partial_prep_mma_bf16_d<D>  split-KV pass 1 on matrix units with attention_prep fused in front
//                                          (FUSED_ATTENTION_PREP): each threadgroup preps its G query rows (q_norm,
//                                          RoPE) into threadgroup memory, and the threadgroup whose keys end at
//                                          num_keys also the new key row and value row into the cache
//                                          (attention_prep_row: the prep kernel's bits), then attends; block 0 copies
//                                          the gate out of q_and_gate for the combine. One dispatch fewer per layer.
//                                          The single pass has no fused form: on an H100 it lost 2 % of tg128.
//   attention_decode_combine_<dtype>_d<D>  split-KV pass 2: grid (query heads, slices of 32 elements of D): merges
//                                          the blocks (weights sum_b * exp(max_b - max), kept in threadgroup memory: at
//                                          most LILY_ATTN_SPLIT_MAX_BLOCKS blocks; the simdgroups split the blocks, a
//                                          lane takes one element) and applies the gate.
//   attention_decode[_partial]_unpacked_<dtype>_d<D>  the same with G = 1 (one query head per threadgroup, no K/V
//                                          row sharing): the GQA-packing ablation, chosen only when the engine switch
//                                          LILY_DISABLE_GQA_PACKING is set. f32 and bf16.
//   attention_decode[_partial]_plain_<dtype>_d<D>  the packed kernels with the plain (uncoalesced) row mapping: lane
//                                          l holds the CPL consecutive chunks l*CPL .. l*CPL+CPL-1 of each row, so one
//                                          simdgroup load touches addresses CPL chunks apart instead of consecutive
//                                          ones: the coalesced-KV ablation, chosen only when the engine switch
//                                          LILY_DISABLE_COALESCED_KV is set (and GQA packing is on). f32 and bf16.
//                                          At D = 64 a row is 16 chunks (one per lane) and both mappings coincide.
// Dtypes: q, gate, out are T (f32, bf16, f16); the cache is C = f32 in float32 mode, bf16 otherwise (also for f16
// activations: the model's cache dtype); partials are fp32.
// Layout: q, gate, out [Hq, D]; k_cache, v_cache [Hkv, capacity, D]; partial_out [Hq, num_blocks, D];
// partial_stats [Hq, num_blocks, 2] (max, sum). Head dims 256 (the model's; f32, bf16, f16) and 64 (the demo model
// and test fixtures; f32, bf16).
// Dispatch: 32*n threads (n <= 32 simdgroups; the engine picks n); grid (Hq/G) single pass, (Hq/G, num_blocks) partial,
// (Hq, any y) combine with 32*n threads (n <= 32). Hq/Hkv must be a multiple of G.
// Design: simdgroup s takes the runs of U = LILY_ATTN_DECODE_KEYS_PER_STEP consecutive keys starting at s*U, s*U + n*U,
// ...; per step it loads the U K rows, reduces U independent dot products (one float4 simd_sum each: the G heads'
// scores, components past G stay 0), makes one online-softmax update for the U scores (one max, one rescale), then
// loads the U V rows and accumulates them. Keys past the range in the last step read the range's last row (in bounds)
// with score -inf (weight 0). Each K and V row is read once per threadgroup and serves G query heads (GQA packing: 4x
// less cache traffic than one head per threadgroup at G = 4; the model's 8 heads of a KV head are 2 threadgroups). A
// lane holds 8 of the 256 elements as two chunks of 4 at chunk indices lane and lane + 32, so each simdgroup load
// reads 32 consecutive chunks (coalesced); at D = 64 a row is 16 chunks and lanes 16..31 hold zeros (half the lanes
// idle; the demo model is launch-bound). fp32 online softmax per simdgroup, then the n simdgroups are merged through
// threadgroup memory in rounds of min(D, 128) floats per simdgroup. Per call the kernel reads num_keys * D * 2 cache
// elements per G heads once and writes G * D outputs; split-KV adds G * D * 4 bytes of partials per block per G heads
// (written once, read once by the combine). Unpacked (G = 1) reads the cache once per query head: 4x the traffic of
// G = 4 at the model's shape, for 4x the threadgroups.
// Verified here: the maths, boundaries and races through the CPU harness; registers and spills with ptxas -v for
// sm_90. Only a GPU can verify the speed, U, the block counts and the switch point.
#include <metal_stdlib>
#include "activations.h"
#include "attention_mma.h"
#include "attention_prep.h"
#include "lily.h"

using namespace metal;

// Threadgroup-array sizes: up to 32 simdgroups, each with a 128-float slice (one chunk per lane) in the merge.
#define ATTN_DECODE_MAX_SIMDGROUPS 32
#define ATTN_DECODE_MERGE_FLOATS 4096

// Attention of G query heads (head0 ...) over keys [key_begin, key_end) of their KV head (G = 1, 2 or 4); the range
// must not be empty (attention_decode_partial handles an empty block itself).
// Leaves the normalised output of head h, element e in result[h * D + e] (visible to every thread on return) and the
// softmax max and sum per head in components 0 .. G-1 of max_out / sum_out. Every thread of the threadgroup must
// call it.
// Chunk (of 4 elements) of a row that lane `lane` holds in its slot c. Coalesced: lane + 32c, so one simdgroup load
// reads 32 consecutive chunks. Plain (the ablation): lane * cpl + c, so consecutive lanes read cpl chunks apart.
template <bool COALESCED>
inline uint attn_decode_chunk(uint lane, uint c, uint cpl) {
  return COALESCED ? lane + 32 * c : lane * cpl + c;
}

template <typename T, typename C, uint D, uint G, bool COALESCED>
LILY_INLINE void attn_decode_heads(constant lily::AttentionArgs& args, device const T* q, device const C* k_cache,
                              device const C* v_cache, uint head0, uint key_begin, uint key_end,
                              threadgroup float* stats_max, threadgroup float* stats_sum, threadgroup float* merge,
                              threadgroup float* result, thread float4& max_out, thread float4& sum_out, uint tid,
                              uint n_threads, uint simd_lane, uint simd_group, uint n_simdgroups) {
  static_assert(G == 1 || G == 2 || G == 4, "up to four heads' scores travel as one float4");
  static_assert(D % 128 == 0 || D == 64, "a lane holds CPL chunks of 4 (attn_decode_chunk)");
  constexpr uint CHUNKS = D / 4;               // chunks of 4 per row
  constexpr uint CPL = (CHUNKS + 31) / 32;     // chunks per lane (D = 64: lanes 16..31 hold none)
  constexpr uint ROUND = D < 128 ? D : 128;    // floats per simdgroup per merge round
  const uint kv_head = head0 / (args.num_heads / args.num_kv_heads);
  // Lanes past the row hold zeros: they add 0 to every dot product and never store.
  const bool lane_active = simd_lane < CHUNKS;

  float4 query[G][CPL];
  float4 acc[G][CPL];
  LILY_UNROLL
  for (uint h = 0; h < G; ++h) {
    LILY_UNROLL
    for (uint c = 0; c < CPL; ++c) {
      const uint chunk = attn_decode_chunk<COALESCED>(simd_lane, c, CPL);
      query[h][c] = lane_active ? lily::attn_load4(q + size_t(head0 + h) * D + 4 * chunk) * args.scale : float4(0.0f);
      acc[h][c] = float4(0.0f);
    }
  }
  // Components G..3 of the score vectors stay 0 (finite): they cost nothing but a few spare ALU lanes.
  float4 run_max = float4(-INFINITY);
  float4 run_sum = float4(0.0f);

  device const C* k_head = k_cache + size_t(kv_head) * args.cache_capacity * D;
  device const C* v_head = v_cache + size_t(kv_head) * args.cache_capacity * D;
  // U consecutive keys per step (LILY_ATTN_DECODE_KEYS_PER_STEP): the U K rows are loaded first, their U dot
  // products reduced independently, one online-softmax update covers the U scores, then the U V rows are loaded and
  // accumulated. A key past key_end (the last step's tail) re-reads row key_end - 1 (in bounds) and gets score -inf,
  // so p = 0. The trip count depends only on simd_group: the simd_sums below are convergent.
  constexpr uint U = LILY_ATTN_DECODE_KEYS_PER_STEP;
  for (uint s0 = key_begin + simd_group * U; s0 < key_end; s0 += n_simdgroups * U) {
    float4 key[U][CPL];
    LILY_UNROLL
    for (uint u = 0; u < U; ++u) {
      const size_t row = size_t(min(s0 + u, key_end - 1)) * D;
      LILY_UNROLL
      for (uint c = 0; c < CPL; ++c) {
        const uint chunk = attn_decode_chunk<COALESCED>(simd_lane, c, CPL);
        key[u][c] = lane_active ? lily::attn_load4(k_head + row + 4 * chunk) : float4(0.0f);
      }
    }
    float4 score[U];
    LILY_UNROLL
    for (uint u = 0; u < U; ++u) {
      float4 partial = float4(0.0f);
      LILY_UNROLL
      for (uint c = 0; c < CPL; ++c) {
        LILY_UNROLL
        for (uint h = 0; h < G; ++h) {
          partial[h] += dot(query[h][c], key[u][c]);
        }
      }
      score[u] = simd_sum(partial);
    }
    float4 step_max = run_max;
    LILY_UNROLL
    for (uint u = 0; u < U; ++u) {
      score[u] = s0 + u < key_end ? score[u] : float4(-INFINITY);
      step_max = max(step_max, score[u]);
    }
    // step_max is finite: key s0 < key_end is always valid.
    const float4 rescale = precise::exp(run_max - step_max);  // 0 on the first step (run_max = -inf)
    float4 p[U];
    float4 p_sum = float4(0.0f);
    LILY_UNROLL
    for (uint u = 0; u < U; ++u) {
      p[u] = precise::exp(score[u] - step_max);
      p_sum += p[u];
    }
    run_sum = run_sum * rescale + p_sum;
    run_max = step_max;
    LILY_UNROLL
    for (uint c = 0; c < CPL; ++c) {
      const uint chunk = attn_decode_chunk<COALESCED>(simd_lane, c, CPL);
      float4 value[U];
      LILY_UNROLL
      for (uint u = 0; u < U; ++u) {
        const size_t row = size_t(min(s0 + u, key_end - 1)) * D;
        value[u] = lane_active ? lily::attn_load4(v_head + row + 4 * chunk) : float4(0.0f);
      }
      LILY_UNROLL
      for (uint h = 0; h < G; ++h) {
        float4 sum = acc[h][c] * rescale[h];
        LILY_UNROLL
        for (uint u = 0; u < U; ++u) {
          sum += p[u][h] * value[u];
        }
        acc[h][c] = sum;
      }
    }
  }

  // Merge the simdgroups: global max, total sum, then the rescaled accumulators, ROUND floats per simdgroup per round.
  if (simd_lane == 0) {
    LILY_UNROLL
    for (uint h = 0; h < G; ++h) {
      stats_max[simd_group * 4 + h] = run_max[h];
      stats_sum[simd_group * 4 + h] = run_sum[h];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float4 total_max = float4(-INFINITY);
  for (uint g = 0; g < n_simdgroups; ++g) {
    LILY_UNROLL
    for (uint h = 0; h < G; ++h) {
      total_max[h] = max(total_max[h], stats_max[g * 4 + h]);
    }
  }
  float4 total_sum = float4(0.0f);
  for (uint g = 0; g < n_simdgroups; ++g) {
    LILY_UNROLL
    for (uint h = 0; h < G; ++h) {
      // A simdgroup that saw no key has max -inf and sum 0: weight exp(-inf) = 0 (total_max is finite).
      total_sum[h] += stats_sum[g * 4 + h] * precise::exp(stats_max[g * 4 + h] - total_max[h]);
    }
  }
  LILY_UNROLL
  for (uint h = 0; h < G; ++h) {
    const float own_weight = precise::exp(run_max[h] - total_max[h]);
    LILY_UNROLL
    for (uint c = 0; c < CPL; ++c) {
      const float4 mine = acc[h][c] * own_weight;
      if (lane_active) {
        LILY_UNROLL
        for (uint j = 0; j < 4; ++j) {
          merge[simd_group * ROUND + 4 * simd_lane + j] = mine[j];
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint e = tid; e < ROUND; e += n_threads) {
        float total = 0.0f;
        for (uint g = 0; g < n_simdgroups; ++g) {
          total += merge[g * ROUND + e];
        }
        // Merge slot e of round c is element e % 4 of chunk (lane e / 4, slot c).
        result[h * D + 4 * attn_decode_chunk<COALESCED>(e / 4, c, CPL) + e % 4] = total / total_sum[h];
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
  max_out = total_max;
  sum_out = total_sum;
}

template <typename T, typename C, uint D, uint G, bool COALESCED>
[[kernel]] void attention_decode(constant lily::AttentionArgs& args [[buffer(0)]],
                                 device const T* q [[buffer(1)]],
                                 device const T* gate [[buffer(2)]],
                                 device const C* k_cache [[buffer(3)]],
                                 device const C* v_cache [[buffer(4)]],
                                 device T* out [[buffer(5)]],
                                 uint group [[threadgroup_position_in_grid]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint n_threads [[threads_per_threadgroup]],
                                 uint simd_lane [[thread_index_in_simdgroup]],
                                 uint simd_group [[simdgroup_index_in_threadgroup]],
                                 uint n_simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float stats_max[ATTN_DECODE_MAX_SIMDGROUPS * 4];
  threadgroup float stats_sum[ATTN_DECODE_MAX_SIMDGROUPS * 4];
  threadgroup float merge[ATTN_DECODE_MERGE_FLOATS];
  threadgroup float result[G * D];
  const uint head0 = group * G;
  float4 total_max;
  float4 total_sum;
  attn_decode_heads<T, C, D, G, COALESCED>(args, q, k_cache, v_cache, head0, 0, args.num_keys, stats_max, stats_sum,
                                        merge, result, total_max, total_sum, tid, n_threads, simd_lane, simd_group,
                                        n_simdgroups);
  for (uint i = tid; i < G * D; i += n_threads) {
    const size_t index = size_t(head0) * D + i;  // head0 + i / D, element i % D
    out[index] = T(result[i] * lily::sigmoid(float(gate[index])));
  }
}

// Where a split-KV partial kernel's block outputs go (attention_decode_partial, attention_decode_partial_mma):
// partial_out [Hq, num_blocks, D], partial_stats [Hq, num_blocks, 2].
template <uint D>
struct AttnDecodePartialStore {
  device float* partial_out;
  device float* partial_stats;
  uint head0, block, num_blocks;

  LILY_INLINE void output(uint h, uint dim, float value) {
    partial_out[(size_t(head0 + h) * num_blocks + block) * D + dim] = value;
  }
  LILY_INLINE void block_stats(uint h, float max_score, float sum) {
    const size_t slot = (size_t(head0 + h) * num_blocks + block) * 2;
    partial_stats[slot] = max_score;
    partial_stats[slot + 1] = sum;
  }
  LILY_INLINE void prepare(uint, uint) {}
};

// An empty block (the keys end in an earlier block): zero weight for the combine (max -inf, sum 0) and a finite
// output (0), so its weight 0 times the output stays 0. The whole threadgroup returns after it, before any barrier.
template <uint D, uint G>
LILY_INLINE void attn_decode_empty_block(thread AttnDecodePartialStore<D>& store, uint tid, uint n_threads) {
  for (uint i = tid; i < G * D; i += n_threads) {
    store.output(i / D, i % D, 0.0f);
  }
  if (tid < G) {
    store.block_stats(tid, -INFINITY, 0.0f);
  }
}

template <typename T, typename C, uint D, uint G, bool COALESCED>
[[kernel]] void attention_decode_partial(constant lily::AttentionArgs& args [[buffer(0)]],
                                         device const T* q [[buffer(1)]],
                                         device const C* k_cache [[buffer(2)]],
                                         device const C* v_cache [[buffer(3)]],
                                         device float* partial_out [[buffer(4)]],
                                         device float* partial_stats [[buffer(5)]],
                                         uint2 group [[threadgroup_position_in_grid]],
                                         uint tid [[thread_index_in_threadgroup]],
                                         uint2 threads_per_group [[threads_per_threadgroup]],
                                         uint simd_lane [[thread_index_in_simdgroup]],
                                         uint simd_group [[simdgroup_index_in_threadgroup]],
                                         uint n_simdgroups [[simdgroups_per_threadgroup]]) {
  const uint n_threads = threads_per_group.x;  // 1-D threadgroups: the attribute's width matches the position's
  threadgroup float stats_max[ATTN_DECODE_MAX_SIMDGROUPS * 4];
  threadgroup float stats_sum[ATTN_DECODE_MAX_SIMDGROUPS * 4];
  threadgroup float merge[ATTN_DECODE_MERGE_FLOATS];
  threadgroup float result[G * D];
  const uint head0 = group.x * G;
  const uint block = group.y;
  // Block span from the key count, so one recorded program serves every position with the same num_blocks.
  const uint span = (args.num_keys + args.num_blocks - 1) / args.num_blocks;
  const uint key_begin = block * span;
  AttnDecodePartialStore<D> store{partial_out, partial_stats, head0, block, args.num_blocks};
  if (key_begin >= args.num_keys) {
    attn_decode_empty_block<D, G>(store, tid, n_threads);
    return;
  }
  const uint key_end = min(args.num_keys, key_begin + span);
  float4 block_max;
  float4 block_sum;
  attn_decode_heads<T, C, D, G, COALESCED>(args, q, k_cache, v_cache, head0, key_begin, key_end, stats_max, stats_sum,
                                        merge, result, block_max, block_sum, tid, n_threads, simd_lane, simd_group,
                                        n_simdgroups);
  for (uint i = tid; i < G * D; i += n_threads) {
    store.output(i / D, i % D, result[i]);
  }
  LILY_UNROLL
  for (uint h = 0; h < G; ++h) {
    if (tid == h) {  // constant component indices: no local-memory copy of the float4s on CUDA
      store.block_stats(h, block_max[h], block_sum[h]);
    }
  }
}

// Decode attention on matrix units (attention_decode_mma: the single pass, the gate fused;
// attention_decode_partial_mma: split-KV pass 1). One threadgroup per G query heads of one KV head (and block of
// keys), G = the whole GQA group at D = 256 (LILY_ATTN_MMA_HEADS_PER_GROUP: 8 for the model, so each K/V row is read
// once per token; the vector kernel's 4 heads read it twice), 2 at D = 64. Exactly n = LILY_ATTN_DECODE_MMA_SIMDGROUPS
// simdgroups (the kernels write nothing with another count). The keys go in chunks of 8 n: simdgroup s computes the
// scores of the chunk's keys 8s .. 8s + 7, S^T = K Q^T (8 keys x 8 heads, over D/8 fragments), into threadgroup
// memory; after one barrier every simdgroup takes the whole chunk's scores, updates the same running max and sum, and
// accumulates its own D / n output dims, O^T += V^T P^T (D / n dims x 8 heads), so the simdgroups never merge: each
// writes its dims. Simdgroup matrices: bf16 operands, fp32 accumulators; P is rounded to bf16 (as
// attention_prefill_mma does). Query heads are the fragments' columns (columns >= G are zero and never stored), so a
// chunk's softmax is one max and one sum over the rows of each column. The fragments are filled straight from device
// memory, with no staging: a dot product may take the head dim in any order, so K and the query permute it so that
// each lane loads 16 contiguous bytes (a K load fills four fragments, 8 keys x 64 bytes per simdgroup load): the key
// (and query) dim a lane holds at position (row or col) k of fragment f is 32 (f / 4) + 8 (k / 2) + 2 (f % 4) + k % 2.
// V^T's rows may hold the simdgroup's dims in any order: row r of its fragment i is dim D / n s + F r + i (F = D / 8 n
// fragments), so a lane loads F consecutive bf16 of a V row per key. Keys past key_end read row key_end - 1 (in
// bounds) and get score -inf. Same outputs as attention_decode and attention_decode_partial (normalised block output,
// block max and sum; an empty block writes 0, -inf, 0).
// Verified here: the maths, block boundaries and races (CPU harness, simdgroup matrices in MLX's lane layout; the
// engine runs it only where simdgroup_layout_probe confirms the layout).
constant constexpr uint kAttnDecodeMmaSimdgroups = LILY_ATTN_DECODE_MMA_SIMDGROUPS;
constant constexpr uint kAttnDecodeMmaChunkKeys = 8 * kAttnDecodeMmaSimdgroups;

// F consecutive bf16 of a V row as one load, and the bits of element i of it.
template <uint F>
struct AttnValueWord;
template <>
struct AttnValueWord<1> {
  using type = ushort;
  static uint half_bits(ushort w, uint) { return w; }
};
template <>
struct AttnValueWord<2> {
  using type = uint;
  static uint half_bits(uint w, uint i) { return (w >> (16 * i)) & 0xFFFFu; }
};
template <>
struct AttnValueWord<4> {
  using type = uint2;
  static uint half_bits(uint2 w, uint i) { return (w[i / 2] >> (16 * (i % 2))) & 0xFFFFu; }
};
template <>
struct AttnValueWord<8> {
  using type = uint4;
  static uint half_bits(uint4 w, uint i) { return (w[i / 2] >> (16 * (i % 2))) & 0xFFFFu; }
};

// K and V rows of a KV head (rows of D bf16).
inline device const bfloat* attn_decode_mma_rows(device const bfloat* cache, constant lily::AttentionArgs& args,
                                                 uint kv_head, uint D) {
  return cache + size_t(kv_head) * args.cache_capacity * D;
}

// One chunk's loads of a simdgroup s (keys c0 ..): K rows c0 + 8s + row (dims 32m + 8 (col / 2) ..), and for each
// step k of 8 keys the V rows c0 + 8k + col and + 1 (its dims D / n s + F row ..); rows past key_end read row
// key_end - 1. `fetched` marks what is loaded: bit 0 the K rows, bit 1 + k step k's V rows, so that a chunk can be
// fetched in part before lily::grid_dependency_wait and completed after it.
template <uint D>
struct AttnDecodeMmaLoads {
  static constant constexpr uint F = D / 8 / kAttnDecodeMmaSimdgroups;  // O^T fragments per simdgroup
  using Word = typename AttnValueWord<F>::type;
  uint4 key[D / 32];
  Word value[kAttnDecodeMmaSimdgroups][2];
  uint fetched;

  LILY_INLINE void fetch_key(device const bfloat* k_rows, uint c0, uint key_end, uint row, uint col,
                             uint simd_group) {
    const size_t key_row = size_t(min(c0 + 8 * simd_group + row, key_end - 1)) * (D / 8);
    device const uint4* words = (device const uint4*)k_rows;
    LILY_UNROLL
    for (uint m = 0; m < D / 32; ++m) {
      key[m] = words[key_row + 4 * m + col / 2];
    }
    fetched |= 1u;
  }
  LILY_INLINE void fetch_value(device const bfloat* v_rows, uint c0, uint k, uint key_end, uint row, uint col,
                               uint simd_group) {
    LILY_UNROLL
    for (uint e = 0; e < 2; ++e) {
      const size_t value_row = size_t(min(c0 + 8 * k + col + e, key_end - 1));
      value[k][e] = *(device const Word*)(v_rows + value_row * D + (D / kAttnDecodeMmaSimdgroups) * simd_group +
                                          F * row);
    }
    fetched |= 2u << k;
  }
  // What of chunk c0 is not loaded yet, holds keys below key_end and reads only rows below `below`: key_end after
  // the wait, the first row this call's prep writes before it (attn_decode_mma_fetch_early).
  LILY_INLINE void fetch(device const bfloat* k_rows, device const bfloat* v_rows, uint c0, uint key_end, uint below,
                         uint row, uint col, uint simd_group) {
    const uint key0 = c0 + 8 * simd_group;
    // A step reads rows up to min(its first key + 7, key_end - 1).
    if (!(fetched & 1u) && key0 < key_end && min(key0 + 7, key_end - 1) < below) {
      fetch_key(k_rows, c0, key_end, row, col, simd_group);
    }
    LILY_UNROLL
    for (uint k = 0; k < kAttnDecodeMmaSimdgroups; ++k) {
      if (!(fetched & (2u << k)) && c0 + 8 * k < key_end && min(c0 + 8 * k + 7, key_end - 1) < below) {
        fetch_value(v_rows, c0, k, key_end, row, col, simd_group);
      }
    }
  }
};

// The first chunk of the decode mma kernels (keys key_begin ..), fetched before lily::grid_dependency_wait where it
// reads only rows before this call's new keys (rows num_keys - num_queries ..., which the prep of this token writes:
// an earlier dispatch, or this kernel's own fused prep). On CUDA the loads then overlap the dispatch before.
template <uint D>
LILY_INLINE void attn_decode_mma_fetch_early(thread AttnDecodeMmaLoads<D>& first, constant lily::AttentionArgs& args,
                                             device const bfloat* k_cache, device const bfloat* v_cache, uint kv_head,
                                             uint key_begin, uint key_end, uint simd_lane, uint simd_group) {
  first.fetched = 0;
  if (key_begin < key_end) {
    first.fetch(attn_decode_mma_rows(k_cache, args, kv_head, D), attn_decode_mma_rows(v_cache, args, kv_head, D),
                key_begin, key_end, args.num_keys - args.num_queries, attn_mma_row(simd_lane),
                attn_mma_col(simd_lane), simd_group);
  }
}

// Eight consecutive bf16 elements as one 16-byte load (from device memory or threadgroup memory).
inline uint4 attn_load8(device const bfloat* p) {
  return *(device const uint4*)p;
}
inline uint4 attn_load8(threadgroup const bfloat* p) {
  return *(threadgroup const uint4*)p;
}

// One chunk (keys c0 .. c0 + 8n, those from key_end masked) of the decode mma kernels, whose loads `loads` holds:
// this simdgroup's scores into scores (one of the two buffers, [8n keys][8 columns]), the barrier, then the whole
// chunk folded into the running max, sum (of this lane's row of each step) and this simdgroup's O^T.
template <uint D>
LILY_INLINE void attn_decode_mma_chunk(thread const AttnDecodeMmaLoads<D>& loads,
                                       thread const simdgroup_bfloat8x8* query_t, thread simdgroup_float8x8* acc_t,
                                       thread float2& run_max, thread float2& run_sum, threadgroup float* scores,
                                       uint c0, uint key_end, uint row, uint col, uint simd_group) {
  constexpr uint FRAGS = D / 8;
  constexpr uint F = AttnDecodeMmaLoads<D>::F;
  constexpr uint N = kAttnDecodeMmaSimdgroups;
  // S^T = K Q^T for keys c0 + 8 simd_group ..: fragment f of K holds the lane's dims 2 (f % 4), + 1 of its 16-byte
  // load f / 4. Four independent sums (f % 4) keep the MMAs' dependent chain a quarter as long.
  float2 s = float2(-INFINITY);
  if (c0 + 8 * simd_group < key_end) {  // uniform per simdgroup
    simdgroup_float8x8 scores_part[4];
    LILY_UNROLL
    for (uint j = 0; j < 4; ++j) {
      scores_part[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    LILY_UNROLL
    for (uint f = 0; f < FRAGS; ++f) {
      simdgroup_bfloat8x8 key_frag;
      key_frag.thread_elements() = as_type<bfloat2>(loads.key[f / 4][f % 4]);
      attn_mma_column<1>(&scores_part[f % 4], &key_frag, query_t[f]);
    }
    s = (scores_part[0].thread_elements() + scores_part[1].thread_elements()) +
        (scores_part[2].thread_elements() + scores_part[3].thread_elements());
    if (c0 + 8 * simd_group + row >= key_end) {
      s = float2(-INFINITY);
    }
  }
  *(threadgroup float2*)(scores + (8 * simd_group + row) * 8 + col) = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Key c0 < key_end: every column has a finite score in this chunk.
  float2 step_scores[N];
  float2 chunk_max = float2(-INFINITY);
  LILY_UNROLL
  for (uint k = 0; k < N; ++k) {
    step_scores[k] = *(threadgroup const float2*)(scores + (8 * k + row) * 8 + col);
    chunk_max = max(chunk_max, step_scores[k]);
  }
  const float2 new_max = max(run_max, attn_mma_col_max(chunk_max));
  const float2 rescale = float2(precise::exp(run_max.x - new_max.x), precise::exp(run_max.y - new_max.y));
  run_max = new_max;
  run_sum *= rescale;
  LILY_UNROLL
  for (uint i = 0; i < F; ++i) {
    acc_t[i].thread_elements() *= rescale;
  }
  // O^T += V^T P^T per step of 8 keys: fragment i of V^T holds element i of the lane's loads of keys col and col + 1
  // (paired into one operand register).
  LILY_UNROLL
  for (uint k = 0; k < N; ++k) {
    if (c0 + 8 * k < key_end) {  // uniform: a step past the keys has weight 0 and unloaded rows
      const float2 p = float2(precise::exp(step_scores[k].x - new_max.x), precise::exp(step_scores[k].y - new_max.y));
      run_sum += p;
      simdgroup_bfloat8x8 probs_t;
      probs_t.thread_elements() = bfloat2(p);
      simdgroup_bfloat8x8 value_t[F];
      LILY_UNROLL
      for (uint i = 0; i < F; ++i) {
        const uint first = AttnValueWord<F>::half_bits(loads.value[k][0], i);
        const uint second = AttnValueWord<F>::half_bits(loads.value[k][1], i);
        value_t[i].thread_elements() = as_type<bfloat2>(first | (second << 16));
      }
      attn_mma_column<F>(acc_t, value_t, probs_t);
    }
  }
}

// Attention of the G query heads head0 .. over keys [key_begin, key_end) (not empty) of their KV head on matrix
// units, for attention_decode[_partial][_prep]_mma, after lily::grid_dependency_wait: `first` holds what
// attn_decode_mma_fetch_early fetched of the first chunk; `q_rows` points at head0's query row (rows of D, 16-byte
// aligned, device memory or the fused kernels' threadgroup copy), `store` takes each head's normalised output, element
// by element (output(h, dim, value)), and its softmax max and sum (block_stats(h, max, sum)); its prepare(tid,
// n_threads) runs before the first barrier. `scores` holds 2 x 64 n floats. Every thread of the threadgroup must call
// it.
template <typename T, uint D, uint G, typename QRows, typename Store>
LILY_INLINE void attn_decode_mma_heads(constant lily::AttentionArgs& args, QRows q_rows,
                                       device const bfloat* k_cache, device const bfloat* v_cache,
                                       thread AttnDecodeMmaLoads<D>& first, uint head0, uint key_begin,
                                       uint key_end, threadgroup float* scores, thread Store& store, uint tid,
                                       uint n_threads, uint simd_lane, uint simd_group) {
  static_assert(G <= 8 && D % (8 * kAttnDecodeMmaSimdgroups) == 0,
                "the heads are one fragment's columns; each simdgroup owns whole fragments of O^T");
  static_assert(is_same<T, bfloat>::value, "the query rows are loaded as 16-byte words of bf16");
  constexpr uint FRAGS = D / 8;  // fragments across the head dim
  constexpr uint F = AttnDecodeMmaLoads<D>::F;
  constexpr uint CHUNK = kAttnDecodeMmaChunkKeys;
  const uint kv_head = head0 / (args.num_heads / args.num_kv_heads);
  const uint row = attn_mma_row(simd_lane);
  const uint col = attn_mma_col(simd_lane);

  // Q^T: fragment f element (k = row, column h) is q_rows[h][key dim of (f, row)], scaled (1/sqrt(D):
  // a power of two), rounded to bf16 (the MMA operand). Fragments 4m .. 4m + 3 of a lane come from one 16-byte load:
  // dims 32m + 8 (row / 2) + 2i + row % 2, i.e. the 16-bit half row % 2 of its word i.
  simdgroup_bfloat8x8 query_t[FRAGS];
  LILY_UNROLL
  for (uint e = 0; e < 2; ++e) {
    LILY_UNROLL
    for (uint m = 0; m < D / 32; ++m) {
      const uint4 words = col + e < G ? attn_load8(q_rows + size_t(col + e) * D + 32 * m + 8 * (row / 2)) : uint4(0);
      LILY_UNROLL
      for (uint i = 0; i < 4; ++i) {
        const float x = float(as_type<bfloat2>(words[i])[row % 2]);
        query_t[4 * m + i].thread_elements()[e] = bfloat(x * args.scale);
      }
    }
  }
  simdgroup_float8x8 acc_t[F];
  LILY_UNROLL
  for (uint i = 0; i < F; ++i) {
    acc_t[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  float2 run_max = float2(-INFINITY);  // of the lane's two columns
  float2 run_sum = float2(0.0f);       // this lane's rows' share of the columns' sums

  device const bfloat* k_rows = attn_decode_mma_rows(k_cache, args, kv_head, D);
  device const bfloat* v_rows = attn_decode_mma_rows(v_cache, args, kv_head, D);
  store.prepare(tid, n_threads);
  // Each chunk's loads are issued before the chunk before it computes (two register sets, even and odd chunks, and
  // the two score buffers, so one barrier per chunk suffices); the first chunk may be fetched in part already.
  thread AttnDecodeMmaLoads<D>& even = first;
  AttnDecodeMmaLoads<D> odd;
  even.fetch(k_rows, v_rows, key_begin, key_end, key_end, row, col, simd_group);
  for (uint c0 = key_begin; c0 < key_end;) {
    const uint c1 = c0 + CHUNK, c2 = c1 + CHUNK;
    odd.fetched = 0;
    if (c1 < key_end) {
      odd.fetch(k_rows, v_rows, c1, key_end, key_end, row, col, simd_group);
    }
    attn_decode_mma_chunk<D>(even, query_t, acc_t, run_max, run_sum, scores, c0, key_end, row, col, simd_group);
    if (c1 >= key_end) {
      break;
    }
    even.fetched = 0;
    if (c2 < key_end) {
      even.fetch(k_rows, v_rows, c2, key_end, key_end, row, col, simd_group);
    }
    attn_decode_mma_chunk<D>(odd, query_t, acc_t, run_max, run_sum, scores + 8 * CHUNK, c1, key_end, row, col,
                             simd_group);
    c0 = c2;
  }

  // Every simdgroup holds the same max and sums: each writes its own dims, simdgroup 0 the block's (max, sum).
  const float2 total_sum = attn_mma_col_sum(run_sum);
  LILY_UNROLL
  for (uint e = 0; e < 2; ++e) {
    if (col + e < G) {
      LILY_UNROLL
      for (uint i = 0; i < F; ++i) {
        store.output(col + e, (D / kAttnDecodeMmaSimdgroups) * simd_group + F * row + i,
                     acc_t[i].thread_elements()[e] / total_sum[e]);
      }
      if (simd_group == 0 && row == 0) {
        store.block_stats(col + e, run_max[e], total_sum[e]);
      }
    }
  }
}

// attention_decode_mma's: the gated output out [Hq, D]; no stats. The G gate rows are copied into threadgroup
// memory before the first chunk's barrier (one 16-byte load per thread at D = 256 and 256 threads), so the stores do
// not each wait on device loads.
template <typename T, uint D, uint G>
struct AttnDecodeGatedStore {
  device const T* gate;
  threadgroup uint4* gate_rows;  // [G * D / 8]
  device T* out;
  uint head0;

  LILY_INLINE void prepare(uint tid, uint n_threads) {
    device const uint4* rows = (device const uint4*)(gate + size_t(head0) * D);
    for (uint i = tid; i < G * D / 8; i += n_threads) {
      gate_rows[i] = rows[i];
    }
  }
  LILY_INLINE void output(uint h, uint dim, float value) {
    const float g = float(((threadgroup const T*)gate_rows)[h * D + dim]);
    out[size_t(head0 + h) * D + dim] = T(value * lily::sigmoid(g));
  }
  LILY_INLINE void block_stats(uint, float, float) {}
};

template <typename T, uint D, uint G>
[[kernel]] void attention_decode_partial_mma(constant lily::AttentionArgs& args [[buffer(0)]],
                                             device const T* q [[buffer(1)]],
                                             device const bfloat* k_cache [[buffer(2)]],
                                             device const bfloat* v_cache [[buffer(3)]],
                                             device float* partial_out [[buffer(4)]],
                                             device float* partial_stats [[buffer(5)]],
                                             uint2 group [[threadgroup_position_in_grid]],
                                             uint tid [[thread_index_in_threadgroup]],
                                             uint2 threads_per_group [[threads_per_threadgroup]],
                                             uint simd_lane [[thread_index_in_simdgroup]],
                                             uint simd_group [[simdgroup_index_in_threadgroup]],
                                             uint n_simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float2 score_pairs[8 * kAttnDecodeMmaChunkKeys];  // two buffers of [chunk keys][8 columns]
  threadgroup float* scores = (threadgroup float*)score_pairs;
  if (n_simdgroups != kAttnDecodeMmaSimdgroups) {
    return;  // the host dispatches exactly this many
  }
  const uint n_threads = threads_per_group.x;  // 1-D threadgroups
  const uint head0 = group.x * G;
  const uint block = group.y;
  const uint span = (args.num_keys + args.num_blocks - 1) / args.num_blocks;
  const uint key_begin = block * span;
  const uint key_end = min(args.num_keys, key_begin + span);
  AttnDecodeMmaLoads<D> first;  // none fetched in an empty block
  attn_decode_mma_fetch_early<D>(first, args, k_cache, v_cache, head0 / (args.num_heads / args.num_kv_heads),
                                 key_begin, key_end, simd_lane, simd_group);
  lily::grid_dependency_wait();  // q comes from the dispatch before
  AttnDecodePartialStore<D> store{partial_out, partial_stats, head0, block, args.num_blocks};
  if (key_begin >= args.num_keys) {
    attn_decode_empty_block<D, G>(store, tid, n_threads);
    return;
  }
  attn_decode_mma_heads<T, D, G>(args, q + size_t(head0) * D, k_cache, v_cache, first, head0, key_begin, key_end,
                                 scores, store, tid, n_threads, simd_lane, simd_group);
}

// The single pass on matrix units: one threadgroup per G heads over all keys, the gate applied as it writes.
template <typename T, uint D, uint G>
[[kernel]] void attention_decode_mma(constant lily::AttentionArgs& args [[buffer(0)]],
                                     device const T* q [[buffer(1)]],
                                     device const T* gate [[buffer(2)]],
                                     device const bfloat* k_cache [[buffer(3)]],
                                     device const bfloat* v_cache [[buffer(4)]],
                                     device T* out [[buffer(5)]],
                                     uint group [[threadgroup_position_in_grid]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint n_threads [[threads_per_threadgroup]],
                                     uint simd_lane [[thread_index_in_simdgroup]],
                                     uint simd_group [[simdgroup_index_in_threadgroup]],
                                     uint n_simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float2 score_pairs[8 * kAttnDecodeMmaChunkKeys];  // two buffers of [chunk keys][8 columns]
  threadgroup float* scores = (threadgroup float*)score_pairs;
  if (n_simdgroups != kAttnDecodeMmaSimdgroups) {
    return;  // the host dispatches exactly this many
  }
  threadgroup uint4 gate_rows[G * D / 8];
  const uint head0 = group * G;
  AttnDecodeMmaLoads<D> first;
  attn_decode_mma_fetch_early<D>(first, args, k_cache, v_cache, head0 / (args.num_heads / args.num_kv_heads), 0,
                                 args.num_keys, simd_lane, simd_group);
  lily::grid_dependency_wait();  // q and gate come from the dispatch before
  AttnDecodeGatedStore<T, D, G> store{gate, gate_rows, out, head0};
  attn_decode_mma_heads<T, D, G>(args, q + size_t(head0) * D, k_cache, v_cache, first, head0, 0, args.num_keys,
                                 scores, store, tid, n_threads, simd_lane, simd_group);
}

// The prep of the fused kernel (attention_decode_partial_prep_mma): the G query rows of heads head0 .. normed and
// roped into q_rows, rounded to T as attention_prep stores q; with `writes_row`, the new key row normed and roped
// and the value row into the cache at row prep.first_position of kv_head, rounded to bfloat as attention_prep writes
// them. Simdgroup s takes rows s, s + n, ... (query rows first, then the key row). Ends with a barrier, after which
// the threadgroup sees q_rows and the cache row it wrote.
template <typename T, uint D, uint G>
LILY_INLINE void attn_decode_prep_rows(constant lily::AttentionPrepArgs& prep, device const T* q_and_gate,
                                       device const T* k, device const T* v, device const T* q_norm,
                                       device const T* k_norm, device bfloat* k_cache, device bfloat* v_cache,
                                       threadgroup T* q_rows, uint head0, uint kv_head, bool writes_row,
                                       thread const AttnRopeAngles<D>& angles, uint simd_lane, uint simd_group,
                                       uint n_simdgroups) {
  constexpr uint CPL = (D / 4 + 31) / 32;
  const uint rows = writes_row ? G + 1 : G;
  for (uint r = simd_group; r < rows; r += n_simdgroups) {
    const bool is_query = r < G;
    device const T* x = is_query ? q_and_gate + size_t(head0 + r) * (2 * D) : k + size_t(kv_head) * D;
    const AttnPrepRow<D> row = attention_prep_row<T, D>(x, is_query ? q_norm : k_norm, angles, prep.rotary_dim,
                                                        prep.eps, simd_lane);
    if (attn_prep_lane_active<D>(simd_lane)) {
      const size_t cache_row = (size_t(kv_head) * prep.cache_capacity + prep.first_position) * D;
      for (uint c = 0; c < CPL; ++c) {
        const uint e = 4 * (simd_lane + 32 * c);
        if (is_query) {
          for (uint j = 0; j < 4; ++j) {
            q_rows[r * D + e + j] = T(row.chunk[c][j]);
          }
        } else {
          lily::attn_store4(k_cache + cache_row + e, row.chunk[c]);
          lily::attn_store4(v_cache + cache_row + e, lily::attn_load4(v + size_t(kv_head) * D + e));
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
}

// attention_decode_partial_mma with attention_prep fused in front: each threadgroup preps its own G query rows (and,
// in the block that holds the new key, that key's cache row) instead of reading q from a prep dispatch; block 0's
// threadgroups also copy their heads' gate rows out of q_and_gate for the combine.
template <typename T, uint D, uint G>
[[kernel]] void attention_decode_partial_prep_mma(constant lily::AttentionArgs& args [[buffer(0)]],
                                                  constant lily::AttentionPrepArgs& prep [[buffer(1)]],
                                                  device const T* q_and_gate [[buffer(2)]],
                                                  device const T* k [[buffer(3)]],
                                                  device const T* v [[buffer(4)]],
                                                  device const T* q_norm [[buffer(5)]],
                                                  device const T* k_norm [[buffer(6)]],
                                                  device T* gate [[buffer(7)]],
                                                  device bfloat* k_cache [[buffer(8)]],
                                                  device bfloat* v_cache [[buffer(9)]],
                                                  device float* partial_out [[buffer(10)]],
                                                  device float* partial_stats [[buffer(11)]],
                                                  uint2 group [[threadgroup_position_in_grid]],
                                                  uint tid [[thread_index_in_threadgroup]],
                                                  uint2 threads_per_group [[threads_per_threadgroup]],
                                                  uint simd_lane [[thread_index_in_simdgroup]],
                                                  uint simd_group [[simdgroup_index_in_threadgroup]],
                                                  uint n_simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float2 score_pairs[8 * kAttnDecodeMmaChunkKeys];  // two buffers of [chunk keys][8 columns]
  threadgroup float* scores = (threadgroup float*)score_pairs;
  if (n_simdgroups != kAttnDecodeMmaSimdgroups) {
    return;  // the host dispatches exactly this many
  }
  threadgroup uint4 q_row_words[G * D / 8];  // the query rows, 16-byte aligned for attn_decode_mma_heads's loads
  threadgroup T* q_rows = (threadgroup T*)q_row_words;
  const uint n_threads = threads_per_group.x;  // 1-D threadgroups
  const uint head0 = group.x * G;
  const uint kv_head = head0 / (args.num_heads / args.num_kv_heads);
  const uint block = group.y;
  const uint span = (args.num_keys + args.num_blocks - 1) / args.num_blocks;
  const uint key_begin = block * span;
  const uint key_end = min(args.num_keys, key_begin + span);
  AttnDecodeMmaLoads<D> first;  // none fetched in an empty block
  attn_decode_mma_fetch_early<D>(first, args, k_cache, v_cache, kv_head, key_begin, key_end, simd_lane, simd_group);
  // Every prepped row is at the new token's position: its rotary angles once per simdgroup, for all of its rows, from
  // the arguments alone, so before the wait (pow, cos and sin: a chain the dispatch before can hide).
  const AttnRopeAngles<D> angles = attention_rope_angles<D>(float(prep.first_position), prep.rotary_dim,
                                                            prep.rope_theta, simd_lane);
  lily::grid_dependency_wait();  // q_and_gate, k and v come from the dispatch before
  if (block == 0) {
    for (uint i = tid; i < G * D; i += n_threads) {
      gate[size_t(head0) * D + i] = q_and_gate[size_t(head0 + i / D) * (2 * D) + D + i % D];  // exact copy
    }
  }
  AttnDecodePartialStore<D> store{partial_out, partial_stats, head0, block, args.num_blocks};
  if (key_begin >= args.num_keys) {
    attn_decode_empty_block<D, G>(store, tid, n_threads);
    return;
  }
  // The new key (row num_keys - 1 = prep.first_position) lies in the last non-empty block: the one ending at num_keys.
  attn_decode_prep_rows<T, D, G>(prep, q_and_gate, k, v, q_norm, k_norm, k_cache, v_cache, q_rows, head0, kv_head,
                                 key_end == args.num_keys, angles, simd_lane, simd_group, n_simdgroups);
  attn_decode_mma_heads<T, D, G>(args, q_rows, k_cache, v_cache, first, head0, key_begin, key_end, scores, store,
                                 tid, n_threads, simd_lane, simd_group);
}

// Element e of the blocks b, b + n, ..., b + 7n of one head's partials (0 past num_blocks), loads issued together.
template <uint D>
LILY_INLINE void attn_combine_load_batch(thread float* loaded, device const float* outs, uint b, uint e,
                                         uint num_blocks, uint n_simdgroups) {
  LILY_UNROLL
  for (uint j = 0; j < 8; ++j) {
    loaded[j] = b + j * n_simdgroups < num_blocks ? outs[size_t(b + j * n_simdgroups) * D + e] : 0.0f;
  }
}

template <typename T, uint D>
[[kernel]] void attention_decode_combine(constant lily::AttentionArgs& args [[buffer(0)]],
                                         device const T* gate [[buffer(1)]],
                                         device const float* partial_out [[buffer(2)]],
                                         device const float* partial_stats [[buffer(3)]],
                                         device T* out [[buffer(4)]],
                                         uint2 group [[threadgroup_position_in_grid]],
                                         uint2 groups [[threadgroups_per_grid]],
                                         uint tid [[thread_index_in_threadgroup]],
                                         uint simd_lane [[thread_index_in_simdgroup]],
                                         uint simd_group [[simdgroup_index_in_threadgroup]],
                                         uint n_simdgroups [[simdgroups_per_threadgroup]]) {
  // num_blocks <= LILY_ATTN_SPLIT_MAX_BLOCKS (the host's rule caps it there); n <= 32 simdgroups.
  threadgroup float block_max[LILY_ATTN_SPLIT_MAX_BLOCKS];
  threadgroup float weight[LILY_ATTN_SPLIT_MAX_BLOCKS];
  threadgroup float sums[32 * 32];  // [simdgroup][lane]
  const uint head = group.x;
  device const float* stats = partial_stats + size_t(head) * args.num_blocks * 2;
  device const float* outs = partial_out + size_t(head) * args.num_blocks * D;
  // Grid y takes slices of 32 elements of the head (lane = element); the n simdgroups split the blocks (simdgroup s
  // the blocks s, s + n, ...), in batches of 8 blocks whose loads are issued together (at 64 blocks and 8
  // simdgroups one batch); then simdgroup 0 adds their sums in a fixed order. The first slice's first batch and its
  // gate are loaded before the blocks' weights are worked out, so those loads wait alongside the stats' instead of
  // after them; the sum runs over the simdgroup's blocks in order either way.
  float loaded[8];
  float gate_value = 0.0f;
  if (group.y * 32 < D) {
    attn_combine_load_batch<D>(loaded, outs, simd_group, group.y * 32 + simd_lane, args.num_blocks, n_simdgroups);
    gate_value = float(gate[size_t(head) * D + group.y * 32 + simd_lane]);
  }
  for (uint b = tid; b < args.num_blocks; b += 32 * n_simdgroups) {
    block_max[b] = stats[2 * b];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // An empty block has max -inf and sum 0, and at least one block is not empty, so total_max is finite and the empty
  // block's weight is 0.
  float total_max = -INFINITY;
  for (uint b = 0; b < args.num_blocks; ++b) {
    total_max = max(total_max, block_max[b]);
  }
  for (uint b = tid; b < args.num_blocks; b += 32 * n_simdgroups) {
    weight[b] = stats[2 * b + 1] * precise::exp(block_max[b] - total_max);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total_sum = 0.0f;
  for (uint b = 0; b < args.num_blocks; ++b) {
    total_sum += weight[b];
  }
  for (uint e0 = group.y * 32; e0 < D; e0 += groups.y * 32) {
    const uint e = e0 + simd_lane;
    if (e0 != group.y * 32) {
      attn_combine_load_batch<D>(loaded, outs, simd_group, e, args.num_blocks, n_simdgroups);
      gate_value = float(gate[size_t(head) * D + e]);
    }
    float value = 0.0f;
    for (uint b = simd_group; b < args.num_blocks; b += 8 * n_simdgroups) {
      if (b != simd_group) {
        attn_combine_load_batch<D>(loaded, outs, b, e, args.num_blocks, n_simdgroups);
      }
      LILY_UNROLL
      for (uint j = 0; j < 8; ++j) {
        if (b + j * n_simdgroups < args.num_blocks) {
          value += weight[b + j * n_simdgroups] * loaded[j];
        }
      }
    }
    sums[simd_group * 32 + simd_lane] = value;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (simd_group == 0) {
      float total = 0.0f;
      for (uint s = 0; s < n_simdgroups; ++s) {
        total += sums[s * 32 + simd_lane];
      }
      out[size_t(head) * D + e] = T(total / total_sum * lily::sigmoid(gate_value));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// Model (head dim 256, GQA group 8): 4 heads per threadgroup.
LILY_INSTANTIATE_KERNEL("attention_decode_f32_d256", attention_decode, float, float, 256, 4, true)
LILY_INSTANTIATE_KERNEL("attention_decode_bf16_d256", attention_decode, bfloat, bfloat, 256, 4, true)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_f32_d256", attention_decode_partial, float, float, 256, 4, true)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_bf16_d256", attention_decode_partial, bfloat, bfloat, 256, 4, true)
LILY_INSTANTIATE_KERNEL("attention_decode_combine_f32_d256", attention_decode_combine, float, 256)
LILY_INSTANTIATE_KERNEL("attention_decode_combine_bf16_d256", attention_decode_combine, bfloat, 256)
LILY_INSTANTIATE_EARLY_KERNEL("attention_decode_mma_bf16_d256", attention_decode_mma,
                              bfloat, 256, LILY_ATTN_MMA_HEADS_PER_GROUP)
LILY_INSTANTIATE_EARLY_KERNEL("attention_decode_partial_mma_bf16_d256", attention_decode_partial_mma,
                              bfloat, 256, LILY_ATTN_MMA_HEADS_PER_GROUP)
LILY_INSTANTIATE_EARLY_KERNEL("attention_decode_partial_prep_mma_bf16_d256", attention_decode_partial_prep_mma,
                              bfloat, 256, LILY_ATTN_MMA_HEADS_PER_GROUP)
// Demo model and tiny fixtures (head dim 64, GQA group 2 or 4): 2 heads per threadgroup, float32 and bf16 modes.
LILY_INSTANTIATE_KERNEL("attention_decode_f32_d64", attention_decode, float, float, 64, 2, true)
LILY_INSTANTIATE_KERNEL("attention_decode_bf16_d64", attention_decode, bfloat, bfloat, 64, 2, true)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_f32_d64", attention_decode_partial, float, float, 64, 2, true)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_bf16_d64", attention_decode_partial, bfloat, bfloat, 64, 2, true)
LILY_INSTANTIATE_KERNEL("attention_decode_combine_f32_d64", attention_decode_combine, float, 64)
LILY_INSTANTIATE_KERNEL("attention_decode_combine_bf16_d64", attention_decode_combine, bfloat, 64)
LILY_INSTANTIATE_EARLY_KERNEL("attention_decode_mma_bf16_d64", attention_decode_mma,
                              bfloat, 64, LILY_ATTN_MMA_HEADS_PER_GROUP_D64)
LILY_INSTANTIATE_EARLY_KERNEL("attention_decode_partial_mma_bf16_d64", attention_decode_partial_mma,
                              bfloat, 64, LILY_ATTN_MMA_HEADS_PER_GROUP_D64)
LILY_INSTANTIATE_EARLY_KERNEL("attention_decode_partial_prep_mma_bf16_d64", attention_decode_partial_prep_mma,
                              bfloat, 64, LILY_ATTN_MMA_HEADS_PER_GROUP_D64)
// GQA-packing ablation (LILY_DISABLE_GQA_PACKING): one head per threadgroup; the combine kernels are shared.
LILY_INSTANTIATE_KERNEL("attention_decode_unpacked_f32_d256", attention_decode, float, float, 256, 1, true)
LILY_INSTANTIATE_KERNEL("attention_decode_unpacked_bf16_d256", attention_decode, bfloat, bfloat, 256, 1, true)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_unpacked_f32_d256", attention_decode_partial, float, float, 256, 1, true)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_unpacked_bf16_d256", attention_decode_partial, bfloat, bfloat, 256, 1, true)
LILY_INSTANTIATE_KERNEL("attention_decode_unpacked_f32_d64", attention_decode, float, float, 64, 1, true)
LILY_INSTANTIATE_KERNEL("attention_decode_unpacked_bf16_d64", attention_decode, bfloat, bfloat, 64, 1, true)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_unpacked_f32_d64", attention_decode_partial, float, float, 64, 1, true)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_unpacked_bf16_d64", attention_decode_partial, bfloat, bfloat, 64, 1, true)
// Coalesced-KV ablation (LILY_DISABLE_COALESCED_KV): the packed kernels with the plain row mapping.
LILY_INSTANTIATE_KERNEL("attention_decode_plain_f32_d256", attention_decode, float, float, 256, 4, false)
LILY_INSTANTIATE_KERNEL("attention_decode_plain_bf16_d256", attention_decode, bfloat, bfloat, 256, 4, false)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_plain_f32_d256", attention_decode_partial, float, float, 256, 4, false)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_plain_bf16_d256", attention_decode_partial, bfloat, bfloat, 256, 4, false)
LILY_INSTANTIATE_KERNEL("attention_decode_plain_f32_d64", attention_decode, float, float, 64, 2, false)
LILY_INSTANTIATE_KERNEL("attention_decode_plain_bf16_d64", attention_decode, bfloat, bfloat, 64, 2, false)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_plain_f32_d64", attention_decode_partial, float, float, 64, 2, false)
LILY_INSTANTIATE_KERNEL("attention_decode_partial_plain_bf16_d64", attention_decode_partial, bfloat, bfloat, 64, 2, false)
