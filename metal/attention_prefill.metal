// Gated causal GQA attention for prefill: T query tokens of a chunk over the KV cache, which already
// holds the keys of earlier chunks (rows 0 .. num_keys - T - 1) and of this chunk (written by attention_prep).
// out = softmax(q k^T * scale + causal mask) v ⊙ sigmoid(gate), fp32 online softmax, the gate fused.
//   attention_prefill_mma_<dtype>_d<D> matrix units: one threadgroup of G simdgroups per (8 query tokens, G query
//                                       heads of one KV head; G = LILY_ATTN_MMA_HEADS_PER_GROUP = 8 at D = 256, the
//                                       model's whole GQA group, 2 at D = 64); simdgroup s owns head head0 + s. Per
//                                       key tile of BK = lily::attn_mma_tile_keys keys (32 in bf16, 16 in f32 at
//                                       D = 256; 32 at D = 64) staged in threadgroup memory, the transposed products
//                                       S^T = K Q^T and O^T += V^T P^T are simdgroup_matrix MMAs in the cache dtype
//                                       (fp32 accumulators), so that two 8-key (or 8-dim) fragments of A share one
//                                       fragment of B: one full m16n8k8 tensor-core MMA on NVIDIA. Q^T (D/8
//                                       fragments) and O^T (D/8 fp32 fragments) stay in registers for the whole
//                                       chunk; one online-softmax rescale per tile. Chosen for T >= 8.
//   attention_prefill_<dtype>_d<D>      vector ALUs: one threadgroup per (n consecutive queries, G query heads);
//                                       simdgroup s owns query q0 + s for the G heads, one float4 simd_sum of the G
//                                       heads' dot products per key (at D = 64 lanes 16..31 hold zeros); K and V
//                                       staged in tiles of LILY_ATTN_PREFILL_TILE_BYTES / (D * sizeof(C)) keys (16
//                                       in bf16, 8 in f32 at D = 256; 64 and 32 at D = 64); G = 4 at D = 256.
//                                       Chosen for 1 < T < 8, where an 8-row fragment would be mostly padding.
//   attention_prefill[_mma]_unpacked_<dtype>_d<D>  the same with G = 1 (one query head per threadgroup): the general
//                                       kernels for head ratios Hq / Hkv that are not a multiple of G (f32, bf16).
// Query t sits at position num_keys - T + t and sees cache rows 0 .. its position (causal, KV offset included).
// Dtypes: q, gate, out are T (f32, bf16, f16); the cache is C = f32 in float32 mode, bf16 otherwise.
// Layout: q, gate, out [T, Hq, D]; k_cache, v_cache [Hkv, capacity, D]. Head dims 256 (the model's; f32, bf16, f16)
// and 64 (demo model and test fixtures, whose GQA group is 2 or 4; f32, bf16).
// Dispatch: mma: grid (ceil(T / 8), Hq / G), 32*G threads. vector: grid (ceil(T / n), Hq / G), 32*n threads (n <= 32).
// Reuse: each staged K/V element is read from device memory once per threadgroup and serves 8 queries x G heads (mma:
// 64 query rows at D = 256) or n queries x G heads (vector); tiles past the causal limit of the threadgroup's last
// query are never loaded. Loads are coalesced (vector: consecutive threads read consecutive 4-element chunks of a row;
// mma: 16-byte units, AttnKvTileCopy).
// mma per tile of 32 keys at D = 256 in bf16, per simdgroup: 256 fragment loads from threadgroup memory (K and V, 32 KiB
// read), 256 8x8 MMAs (128 m16n8k8 on NVIDIA), 10 exps per lane, one rescale of the 32 O^T fragments; per threadgroup
// 32 KiB loaded from device memory into registers while the MMAs run, and two barriers.
// Verified here: the maths, causality, KV offsets, boundaries and races (CPU harness, which emulates
// simdgroup_matrix with MLX's lane layout). Mac only: compiler acceptance, the lane layout the mma kernel's softmax
// relies on, register pressure (the mma kernel holds 96 fragment registers per lane at D = 256, 256 threads), speed.
#include <metal_stdlib>
#include "activations.h"
#include "attention_mma.h"
#include "lily.h"

using namespace metal;

template <typename T, typename C, uint D, uint G>
[[kernel]] void attention_prefill(constant lily::AttentionArgs& args [[buffer(0)]],
                                  device const T* q [[buffer(1)]],
                                  device const T* gate [[buffer(2)]],
                                  device const C* k_cache [[buffer(3)]],
                                  device const C* v_cache [[buffer(4)]],
                                  device T* out [[buffer(5)]],
                                  uint2 group [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint2 threads_per_group [[threads_per_threadgroup]],
                                  uint simd_lane [[thread_index_in_simdgroup]],
                                  uint simd_group [[simdgroup_index_in_threadgroup]],
                                  uint n_simdgroups [[simdgroups_per_threadgroup]]) {
  const uint n_threads = threads_per_group.x;  // 1-D threadgroups: the attribute's width matches the position's
  constexpr uint TILE_ELEMENTS = LILY_ATTN_PREFILL_TILE_BYTES / sizeof(C);
  threadgroup C k_tile[TILE_ELEMENTS];
  threadgroup C v_tile[TILE_ELEMENTS];
  static_assert(G == 1 || G == 2 || G == 4, "up to four heads' scores travel as one float4");
  static_assert(D % 128 == 0 || D == 64, "a lane holds chunks of 4 at chunk indices lane + 32c");
  constexpr uint CHUNKS_PER_ROW = D / 4;
  constexpr uint CPL = (CHUNKS_PER_ROW + 31) / 32;  // chunks of 4 per lane (D = 64: lanes 16..31 hold none)
  constexpr uint TILE_KEYS = TILE_ELEMENTS / D;

  const uint head0 = group.y * G;
  const uint kv_head = head0 / (args.num_heads / args.num_kv_heads);
  const uint first_position = args.num_keys - args.num_queries;  // position of query 0 (the KV offset)
  const uint q0 = group.x * n_simdgroups;
  const uint t = q0 + simd_group;
  const bool active = t < args.num_queries;  // the last tile's spare simdgroups still help load and meet barriers
  const uint position = first_position + t;
  const bool lane_active = simd_lane < CHUNKS_PER_ROW;  // lanes past the row hold zeros and store nothing

  float4 query[G][CPL];
  float4 acc[G][CPL];
  for (uint h = 0; h < G; ++h) {
    for (uint c = 0; c < CPL; ++c) {
      query[h][c] = active && lane_active ? lily::attn_load4(q + (size_t(t) * args.num_heads + head0 + h) * D +
                                              4 * (simd_lane + 32 * c)) * args.scale
                           : float4(0.0f);
      acc[h][c] = float4(0.0f);
    }
  }
  // Components G..3 of the score vectors stay 0 (finite) and are never read back.
  float4 run_max = float4(-INFINITY);
  float4 run_sum = float4(0.0f);

  device const C* k_head = k_cache + size_t(kv_head) * args.cache_capacity * D;
  device const C* v_head = v_cache + size_t(kv_head) * args.cache_capacity * D;
  // One past the last key any query of this threadgroup sees.
  const uint key_end = min(args.num_keys, first_position + q0 + n_simdgroups);
  for (uint tile_start = 0; tile_start < key_end; tile_start += TILE_KEYS) {
    const uint tile_keys = min(TILE_KEYS, key_end - tile_start);
    for (uint i = tid; i < tile_keys * CHUNKS_PER_ROW; i += n_threads) {
      const size_t src = size_t(tile_start) * D + 4 * i;  // rows are contiguous: chunk i of the tile
      *((threadgroup vec<C, 4>*)(k_tile + 4 * i)) = *((device const vec<C, 4>*)(k_head + src));
      *((threadgroup vec<C, 4>*)(v_tile + 4 * i)) = *((device const vec<C, 4>*)(v_head + src));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Keys of this tile the simdgroup's query sees; uniform across the simdgroup, so simd_sum stays convergent.
    const uint visible = !active || position < tile_start ? 0 : min(tile_keys, position + 1 - tile_start);
    for (uint r = 0; r < visible; ++r) {
      float4 key[CPL];
      float4 partial = float4(0.0f);
      for (uint c = 0; c < CPL; ++c) {
        key[c] = lane_active ? lily::attn_load4(k_tile + r * D + 4 * (simd_lane + 32 * c)) : float4(0.0f);
        for (uint h = 0; h < G; ++h) {
          partial[h] += dot(query[h][c], key[c]);
        }
      }
      const float4 score = simd_sum(partial);
      const float4 new_max = max(run_max, score);
      const float4 rescale = precise::exp(run_max - new_max);  // 0 on the first key (run_max = -inf)
      const float4 p = precise::exp(score - new_max);
      run_sum = run_sum * rescale + p;
      run_max = new_max;
      for (uint c = 0; c < CPL; ++c) {
        const float4 value =
            lane_active ? lily::attn_load4(v_tile + r * D + 4 * (simd_lane + 32 * c)) : float4(0.0f);
        for (uint h = 0; h < G; ++h) {
          acc[h][c] = acc[h][c] * rescale[h] + p[h] * value;
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is consumed before the next load overwrites it
  }

  if (active && lane_active) {
    for (uint h = 0; h < G; ++h) {
      const size_t row = (size_t(t) * args.num_heads + head0 + h) * D;
      for (uint c = 0; c < CPL; ++c) {
        const uint e = 4 * (simd_lane + 32 * c);
        float4 g = lily::attn_load4(gate + row + e);
        float4 gated;
        for (uint j = 0; j < 4; ++j) {
          gated[j] = acc[h][c][j] / run_sum[h] * lily::sigmoid(g[j]);
        }
        lily::attn_store4(out + row + e, gated);
      }
    }
  }
}

// The lane layout check attention_prefill_mma depends on: lane l writes the two element indices 8r + c its
// thread_elements() hold after a simdgroup_load of M[r][c] = 8r + c (out[l]), and the two that attn_mma_row/col say it
// holds (out[32 + l]). The engine runs it once per device (src/lily_ext/layout_probe.cpp) and uses the vector kernel
// when they differ; lily.selftest has its row.
[[kernel]] void simdgroup_layout_probe(device float2* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float matrix[64];
  matrix[lane] = float(lane);
  matrix[lane + 32] = float(lane + 32);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 m;
  simdgroup_load(m, matrix, 8);
  out[lane] = m.thread_elements();
  const float first = float(8 * attn_mma_row(lane) + attn_mma_col(lane));
  out[32 + lane] = float2(first, first + 1.0f);
}

// The cooperative copy of one key tile of K and V ([BK keys, D] rows of the cache) into threadgroup memory, in
// 16-byte units. A tile is stored block-major: the 8x8 block (keys 8kb.., dims 8f..) is 64 consecutive elements at
// element (kb · D/8 + f) · 64, row-major (8 elements per key). A fragment load then reads 8 rows of 16 bytes that lie
// next to each other (one ldmatrix with no bank conflict on NVIDIA; no padding needed), and unit u of the tile,
// copied by thread u % THREADS, is stored at element u · UNIT: consecutive threads write consecutive 16 bytes and read
// 64 contiguous bytes of each of 8 key rows. Keys from key_end on (the causal limit, or the end of the cache) are
// zeros: a masked key's probability is exactly 0, and 0 · 0 adds nothing. ROUNDS passes of N units of K and V per
// thread: one pass (N <= 4) is the whole tile, held in registers from before this tile's MMAs until the barrier after
// them, so the loads of the next tile are in flight during the MMAs; more passes (one query head per threadgroup) copy
// the tile after the barrier instead.
template <typename C, uint D, uint THREADS>
struct AttnKvTileCopy {
  static constant constexpr const uint BK = lily::attn_mma_tile_keys(D, sizeof(C));
  static constant constexpr const uint UNIT = 16 / sizeof(C);       // elements per 16-byte unit
  static constant constexpr const uint TILE_UNITS = BK * D / UNIT;  // units of one K (or V) tile
  static constant constexpr const uint PER_THREAD = TILE_UNITS / THREADS;
  // Units of K (and of V) per pass: 4 (128 bytes of registers with V's), 2 for fp32 tiles, whose Q^T fragments
  // already take twice the registers of 16-bit ones.
  static constant constexpr const uint MAX_N = 8 / sizeof(C);
  static constant constexpr const uint N = PER_THREAD < MAX_N ? PER_THREAD : MAX_N;
  static constant constexpr const uint ROUNDS = PER_THREAD / N;
  static_assert(TILE_UNITS % THREADS == 0 && PER_THREAD % N == 0, "whole passes of the threads over a tile");
  static_assert(BK % 8 == 0 && D % 8 == 0, "whole 8x8 blocks");

  device const uint4* k_rows;  // the KV head's rows as 16-byte units
  device const uint4* v_rows;
  uint tid;
  uint4 k[N];
  uint4 v[N];

  // Key (within the tile) and 16-byte unit (within the key's row) of this thread's unit i of pass r.
  LILY_INLINE uint unit(uint r, uint i) const { return (r * N + i) * THREADS + tid; }
  LILY_INLINE static uint unit_key(uint u) { return 8 * (u / (8 * D / UNIT)) + (u * UNIT / 8) % 8; }
  LILY_INLINE static uint unit_column(uint u) { return (u / (64 / UNIT)) % (D / 8) * (8 / UNIT) + u % (8 / UNIT); }

  LILY_INLINE void fetch(uint r, uint tile_start, uint key_end) {
    LILY_UNROLL
    for (uint i = 0; i < N; ++i) {
      const uint u = unit(r, i), key = tile_start + unit_key(u);
      const size_t src = size_t(key) * (D / UNIT) + unit_column(u);
      k[i] = key < key_end ? k_rows[src] : uint4(0);
      v[i] = key < key_end ? v_rows[src] : uint4(0);
    }
  }
  LILY_INLINE void stage(uint r, threadgroup uint4* k_tile, threadgroup uint4* v_tile) const {
    LILY_UNROLL
    for (uint i = 0; i < N; ++i) {
      k_tile[unit(r, i)] = k[i];
      v_tile[unit(r, i)] = v[i];
    }
  }
  LILY_INLINE void copy(uint tile_start, uint key_end, threadgroup uint4* k_tile, threadgroup uint4* v_tile) {
    for (uint r = 0; r < ROUNDS; ++r) {
      fetch(r, tile_start, key_end);
      stage(r, k_tile, v_tile);
    }
  }
};

// One threadgroup of attention_prefill_mma[_split]: 8 queries x G heads over the keys [begin, end) of the cache
// (SPLIT: one key block of them, written as a partial for attention_decode_combine; else all of them, gated into out).
template <typename T, typename C, uint D, uint G, bool SPLIT>
LILY_INLINE void attn_prefill_mma_group(constant lily::AttentionArgs& args, device const T* q, device const T* gate,
                                        device const C* k_cache, device const C* v_cache, device T* out,
                                        device float* partial_out, device float* partial_stats,
                                        threadgroup uint4* k_tile, threadgroup uint4* v_tile, uint3 group, uint tid,
                                        uint simd_lane, uint simd_group) {
  // K and V of one key tile in the cache dtype C, which is also the MMA operand type: bf16 MMAs with fp32
  // accumulators in bf16 mode (tensor cores on NVIDIA; the probabilities are rounded to bf16 for P·V, as
  // FlashAttention does), fp32 in float32 mode.
  typedef AttnKvTileCopy<C, D, 32 * G> Copy;
  constexpr uint BK = Copy::BK;           // keys per tile
  constexpr uint KB = BK / 8;             // 8-key blocks per tile
  constexpr uint FRAGS = D / 8;           // 8-wide blocks across the head dim
  constexpr uint QUERIES = LILY_ATTN_MMA_QUERIES;
  static_assert(QUERIES == 8, "one 8-column fragment of queries per simdgroup");
  threadgroup const C* k_blocks = (threadgroup const C*)k_tile;
  threadgroup const C* v_blocks = (threadgroup const C*)v_tile;

  const uint head = group.y * G + simd_group;  // simdgroup s owns query head head0 + s
  const uint kv_head = head / (args.num_heads / args.num_kv_heads);
  const uint first_position = args.num_keys - args.num_queries;
  const uint q0 = group.x * QUERIES;  // the threadgroup's 8 query tokens
  const uint row = attn_mma_row(simd_lane);
  const uint col = attn_mma_col(simd_lane);
  // This lane's two query columns, col and col + 1 (columns past num_queries compute but are not written).
  const uint2 t = uint2(q0 + col, q0 + col + 1);
  const uint2 position = first_position + t;
  const uint key_end = min(args.num_keys, first_position + q0 + QUERIES);  // one past the last key the 8 queries see

  // The keys this threadgroup reads. SPLIT: the keys every one of its queries sees, [0, first_position + q0 + 1),
  // cut into num_blocks spans of whole tiles; the block that reaches their end also takes the diagonal keys up to
  // key_end, and a block that starts past it is empty (its partial: output 0, max -inf, sum 0, weight 0 in the
  // combine). So each block's first key is visible to every query of the threadgroup, and only the last tile of the
  // last block needs the causal mask.
  uint begin = 0;
  uint end = key_end;
  if (SPLIT) {
    const uint shared_keys = first_position + q0 + 1;
    const uint span = (shared_keys + args.num_blocks - 1) / args.num_blocks;
    const uint span_tiles = (span + BK - 1) / BK * BK;
    begin = group.z * span_tiles;
    end = begin + span_tiles >= shared_keys ? key_end : begin + span_tiles;
    if (begin >= shared_keys) {  // uniform: the whole threadgroup returns before any barrier
      for (uint i = simd_lane; i < QUERIES * D; i += 32) {
        if (q0 + i / D < args.num_queries) {
          const size_t slot = (size_t(q0 + i / D) * args.num_heads + head) * args.num_blocks + group.z;
          partial_out[slot * D + i % D] = 0.0f;
          if (i % D == 0) {
            partial_stats[2 * slot] = -INFINITY;
            partial_stats[2 * slot + 1] = 0.0f;
          }
        }
      }
      return;
    }
  }

  // Transposed products, so that on NVIDIA each MMA is a full m16n8k8 (two 8-row fragments of A against one B):
  // S^T = K Q^T (keys x queries) and O^T += V^T P^T (dims x queries). Q^T (FRAGS fragments of 8 dims x 8 queries,
  // scaled) and O^T stay in registers for the whole chunk; each lane holds two query columns.
  simdgroup_matrix<C, 8, 8> query_t[FRAGS];
  simdgroup_float8x8 acc_t[FRAGS];
  LILY_UNROLL
  for (uint f = 0; f < FRAGS; ++f) {
    LILY_UNROLL
    for (uint e = 0; e < 2; ++e) {
      float x = 0.0f;
      if (t[e] < args.num_queries) {
        x = float(q[(size_t(t[e]) * args.num_heads + head) * D + 8 * f + row]) * args.scale;  // 1/sqrt(D): 2^-k
      }
      query_t[f].thread_elements()[e] = C(x);
    }
    acc_t[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  float2 run_max = float2(-INFINITY);  // of the lane's two query columns
  float2 run_sum = float2(0.0f);       // this lane's share of the columns' sums (the 8 row lanes add up at the end)

  Copy copy;
  copy.k_rows = (device const uint4*)(k_cache + size_t(kv_head) * args.cache_capacity * D);
  copy.v_rows = (device const uint4*)(v_cache + size_t(kv_head) * args.cache_capacity * D);
  copy.tid = tid;
  copy.copy(begin, end, k_tile, v_tile);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint tile_start = begin; tile_start < end; tile_start += BK) {
    const bool more = tile_start + BK < end;  // uniform: the barriers below stay convergent
    if (Copy::ROUNDS == 1 && more) {
      copy.fetch(0, tile_start + BK, end);  // in flight during this tile's MMAs
    }

    // S^T = K Q^T: per 8 dims, the tile's KB key blocks against one Q^T fragment.
    simdgroup_float8x8 scores_t[KB];
    LILY_UNROLL
    for (uint kb = 0; kb < KB; ++kb) {
      scores_t[kb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    LILY_UNROLL
    for (uint f = 0; f < FRAGS; ++f) {
      simdgroup_matrix<C, 8, 8> key_frag[KB];
      LILY_UNROLL
      for (uint kb = 0; kb < KB; ++kb) {
        simdgroup_load(key_frag[kb], k_blocks + (kb * FRAGS + f) * 64, 8);
      }
      attn_mma_column<KB>(scores_t, key_frag, query_t[f]);
    }

    // Causal mask (only in tiles that reach past the first query's position; zero-filled keys past key_end are
    // masked there too) and one online-softmax step per tile on the lane's 2 x KB scores.
    const bool diagonal = tile_start + BK > first_position + q0 + 1;
    float2 tile_max = float2(-INFINITY);
    LILY_UNROLL
    for (uint kb = 0; kb < KB; ++kb) {
      if (diagonal) {
        const uint key = tile_start + 8 * kb + row;
        LILY_UNROLL
        for (uint e = 0; e < 2; ++e) {
          if (key > position[e]) {
            scores_t[kb].thread_elements()[e] = -INFINITY;
          }
        }
      }
      tile_max = max(tile_max, scores_t[kb].thread_elements());
    }
    // Key `begin` is in the first tile and visible to every query, so new_max is finite from the first tile on.
    const float2 new_max = max(run_max, attn_mma_col_max(tile_max));
    const float2 rescale = float2(precise::exp(run_max.x - new_max.x), precise::exp(run_max.y - new_max.y));
    run_max = new_max;
    simdgroup_matrix<C, 8, 8> probs_t[KB];
    float2 tile_sum = float2(0.0f);
    LILY_UNROLL
    for (uint kb = 0; kb < KB; ++kb) {
      const float2 s = scores_t[kb].thread_elements();
      const float2 p = float2(precise::exp(s.x - new_max.x), precise::exp(s.y - new_max.y));
      tile_sum += p;
      probs_t[kb].thread_elements()[0] = C(p.x);
      probs_t[kb].thread_elements()[1] = C(p.y);
    }
    run_sum = run_sum * rescale + tile_sum;

    // O^T = O^T · rescale + V^T P^T: per key block, the head dim's V^T fragments (transposed loads) against P^T.
    LILY_UNROLL
    for (uint f = 0; f < FRAGS; ++f) {
      acc_t[f].thread_elements() *= rescale;  // the lane's two elements are in its two query columns
    }
    LILY_UNROLL
    for (uint kb = 0; kb < KB; ++kb) {
      LILY_UNROLL
      for (uint f = 0; f < FRAGS; f += 4) {
        simdgroup_matrix<C, 8, 8> value_t[4];
        LILY_UNROLL
        for (uint i = 0; i < 4; ++i) {
          simdgroup_load(value_t[i], v_blocks + (kb * FRAGS + f + i) * 64, 8, ulong2(0, 0), true);
        }
        attn_mma_column<4>(acc_t + f, value_t, probs_t[kb]);
      }
    }

    if (more) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is consumed before the next one overwrites it
      if (Copy::ROUNDS == 1) {
        copy.stage(0, k_tile, v_tile);
      } else {
        copy.copy(tile_start + BK, end, k_tile, v_tile);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  const float2 total = attn_mma_col_sum(run_sum);
  LILY_UNROLL
  for (uint e = 0; e < 2; ++e) {
    if (t[e] < args.num_queries) {
      const size_t out_row = size_t(t[e]) * args.num_heads + head;
      const size_t slot = out_row * args.num_blocks + group.z;  // SPLIT: this block's partial of the row
      LILY_UNROLL
      for (uint f = 0; f < FRAGS; ++f) {
        const float value = acc_t[f].thread_elements()[e] / total[e];  // the block's (or the row's) softmax
        if (SPLIT) {
          partial_out[slot * D + 8 * f + row] = value;
        } else {
          const size_t index = out_row * D + 8 * f + row;
          out[index] = T(value * lily::sigmoid(float(gate[index])));
        }
      }
      if (SPLIT && row == 0) {
        partial_stats[2 * slot] = run_max[e];
        partial_stats[2 * slot + 1] = total[e];
      }
    }
  }
}

template <typename T, typename C, uint D, uint G>
[[kernel]] void attention_prefill_mma(constant lily::AttentionArgs& args [[buffer(0)]],
                                      device const T* q [[buffer(1)]],
                                      device const T* gate [[buffer(2)]],
                                      device const C* k_cache [[buffer(3)]],
                                      device const C* v_cache [[buffer(4)]],
                                      device T* out [[buffer(5)]],
                                      uint2 group [[threadgroup_position_in_grid]],
                                      uint tid [[thread_index_in_threadgroup]],
                                      uint simd_lane [[thread_index_in_simdgroup]],
                                      uint simd_group [[simdgroup_index_in_threadgroup]]) {
  threadgroup uint4 k_tile[AttnKvTileCopy<C, D, 32 * G>::TILE_UNITS];
  threadgroup uint4 v_tile[AttnKvTileCopy<C, D, 32 * G>::TILE_UNITS];
  attn_prefill_mma_group<T, C, D, G, false>(args, q, gate, k_cache, v_cache, out, nullptr, nullptr, k_tile, v_tile,
                                            uint3(group, 0u), tid, simd_lane, simd_group);
}

// Split-KV prefill (grid z = args.num_blocks key blocks): each threadgroup writes its block's partial of every
// (query, head) row, [T * Hq, num_blocks] x (D outputs of the block's own softmax; its max score and sum), the layout of
// attention_decode_partial's [Hq, num_blocks] rows; attention_decode_combine over T * Hq rows then gates and writes
// out. For chunks whose ceil(T / 8) x Hq / G threadgroups leave the GPU mostly idle at long contexts.
template <typename T, typename C, uint D, uint G>
[[kernel]] void attention_prefill_mma_split(constant lily::AttentionArgs& args [[buffer(0)]],
                                            device const T* q [[buffer(1)]],
                                            device const C* k_cache [[buffer(2)]],
                                            device const C* v_cache [[buffer(3)]],
                                            device float* partial_out [[buffer(4)]],
                                            device float* partial_stats [[buffer(5)]],
                                            uint3 group [[threadgroup_position_in_grid]],
                                            uint tid [[thread_index_in_threadgroup]],
                                            uint simd_lane [[thread_index_in_simdgroup]],
                                            uint simd_group [[simdgroup_index_in_threadgroup]]) {
  threadgroup uint4 k_tile[AttnKvTileCopy<C, D, 32 * G>::TILE_UNITS];
  threadgroup uint4 v_tile[AttnKvTileCopy<C, D, 32 * G>::TILE_UNITS];
  attn_prefill_mma_group<T, C, D, G, true>(args, q, nullptr, k_cache, v_cache, nullptr, partial_out, partial_stats,
                                           k_tile, v_tile, group, tid, simd_lane, simd_group);
}

// Model (head dim 256, GQA group 8): the vector kernel packs 4 heads per threadgroup, the mma kernel the whole group.
LILY_INSTANTIATE_KERNEL("attention_prefill_f32_d256", attention_prefill, float, float, 256, 4)
LILY_INSTANTIATE_KERNEL("attention_prefill_bf16_d256", attention_prefill, bfloat, bfloat, 256, 4)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_f32_d256", attention_prefill_mma, float, float, 256,
                        LILY_ATTN_MMA_HEADS_PER_GROUP)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_bf16_d256", attention_prefill_mma, bfloat, bfloat, 256,
                        LILY_ATTN_MMA_HEADS_PER_GROUP)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_split_f32_d256", attention_prefill_mma_split, float, float, 256,
                        LILY_ATTN_MMA_HEADS_PER_GROUP)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_split_bf16_d256", attention_prefill_mma_split, bfloat, bfloat, 256,
                        LILY_ATTN_MMA_HEADS_PER_GROUP)
// Demo model and tiny fixtures (head dim 64, GQA group 2 or 4): 2 heads per threadgroup, float32 and bf16 modes.
LILY_INSTANTIATE_KERNEL("attention_prefill_f32_d64", attention_prefill, float, float, 64, 2)
LILY_INSTANTIATE_KERNEL("attention_prefill_bf16_d64", attention_prefill, bfloat, bfloat, 64, 2)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_f32_d64", attention_prefill_mma, float, float, 64,
                        LILY_ATTN_MMA_HEADS_PER_GROUP_D64)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_bf16_d64", attention_prefill_mma, bfloat, bfloat, 64,
                        LILY_ATTN_MMA_HEADS_PER_GROUP_D64)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_split_f32_d64", attention_prefill_mma_split, float, float, 64,
                        LILY_ATTN_MMA_HEADS_PER_GROUP_D64)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_split_bf16_d64", attention_prefill_mma_split, bfloat, bfloat, 64,
                        LILY_ATTN_MMA_HEADS_PER_GROUP_D64)
// Head ratios the packing cannot split (e.g. 3 query heads per KV head at D = 64, 1, or 4 for the mma kernel at
// D = 256): one head per threadgroup.
LILY_INSTANTIATE_KERNEL("attention_prefill_unpacked_f32_d256", attention_prefill, float, float, 256, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_unpacked_bf16_d256", attention_prefill, bfloat, bfloat, 256, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_unpacked_f32_d256", attention_prefill_mma, float, float, 256, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_unpacked_bf16_d256", attention_prefill_mma, bfloat, bfloat, 256, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_unpacked_f32_d64", attention_prefill, float, float, 64, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_unpacked_bf16_d64", attention_prefill, bfloat, bfloat, 64, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_unpacked_f32_d64", attention_prefill_mma, float, float, 64, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_unpacked_bf16_d64", attention_prefill_mma, bfloat, bfloat, 64, 1)
