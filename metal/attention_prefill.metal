// Gated causal GQA attention for prefill: T query tokens of a chunk over the KV cache, which already
// holds the keys of earlier chunks (rows 0 .. num_keys - T - 1) and of this chunk (written by attention_prep).
// out = softmax(q k^T * scale + causal mask) v ⊙ sigmoid(gate), fp32 online softmax, the gate fused.
//   attention_prefill_mma_<dtype>_d<D> matrix units: one threadgroup of G simdgroups per (8 query tokens, G query
//                                       heads of one KV head; G = 4 at D = 256, 2 at D = 64); simdgroup s owns head
//                                       head0 + s. Scores S = Q K^T and the update O += P V are simdgroup_matrix
//                                       products in the cache dtype (fp32 accumulators) over key tiles of
//                                       LILY_ATTN_MMA_TILE_KEYS (8) keys staged in threadgroup memory (K transposed,
//                                       so no transposed load is needed). Q (32 fragments) and O (32 fragments)
//                                       stay in registers for the whole chunk.
//                                       Chosen for T >= LILY_ATTN_MMA_MIN_QUERIES (8).
//   attention_prefill_<dtype>_d<D>      vector ALUs: one threadgroup per (n consecutive queries, G query heads);
//                                       simdgroup s owns query q0 + s for the G heads, one float4 simd_sum of the G
//                                       heads' dot products per key (at D = 64 lanes 16..31 hold zeros); K and V
//                                       staged in tiles of LILY_ATTN_PREFILL_TILE_BYTES / (D * sizeof(C)) keys (16
//                                       in bf16, 8 in f32 at D = 256; 64 and 32 at D = 64).
//                                       Chosen for 1 < T < 8, where an 8-row fragment would be mostly padding.
//   attention_prefill[_mma]_unpacked_<dtype>_d<D>  the same with G = 1 (one query head per threadgroup): the general
//                                       kernels for head ratios Hq / Hkv that are not a multiple of G (f32, bf16).
// Query t sits at position num_keys - T + t and sees cache rows 0 .. its position (causal, KV offset included).
// Dtypes: q, gate, out are T (f32, bf16, f16); the cache is C = f32 in float32 mode, bf16 otherwise.
// Layout: q, gate, out [T, Hq, D]; k_cache, v_cache [Hkv, capacity, D]. Head dims 256 (the model's; f32, bf16, f16)
// and 64 (demo model and test fixtures, whose GQA group is 2 or 4; f32, bf16).
// Dispatch: mma: grid (ceil(T / 8), Hq / G), 32*G threads. vector: grid (ceil(T / n), Hq / G), 32*n threads (n <= 32).
// Reuse: each staged K/V element is read from device memory once per threadgroup and serves 8 queries x G heads (mma)
// or n queries x G heads (vector); tiles past the causal limit of the threadgroup's last query are never loaded. Loads
// are coalesced (consecutive threads read consecutive 4-element chunks of a row).
// Verified here: the maths, causality, KV offsets, boundaries and races (CPU harness, which emulates
// simdgroup_matrix with MLX's lane layout). Mac only: compiler acceptance, the lane layout
// the mma kernel's softmax relies on, register pressure (128 fp32 fragment elements per lane), speed; the key tile
// (8) is small because the fp32 tiles of float32 mode must fit 32 KiB (bf16 mode stages bf16 tiles).
#include <metal_stdlib>
#include "activations.h"
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

// Row and first column of the two elements a lane holds in an 8x8 simdgroup matrix: (row, col) and (row, col + 1),
// and the sum or max over the four lanes holding one row. Apple leaves this mapping implementation-defined; on Apple
// GPUs it is the one MLX's steel kernels rely on; the CUDA shim stores fragments in NVIDIA's mma layout.
#if defined(MSL_CUDA)
inline uint attn_mma_row(uint lane) {
  return lane / 4;
}
inline uint attn_mma_col(uint lane) {
  return (lane % 4) * 2;
}
constant constexpr ushort ATTN_MMA_ROW_XOR_NEAR = 1;  // the lanes of a row differ in these two bits
constant constexpr ushort ATTN_MMA_ROW_XOR_FAR = 2;
#else
inline uint attn_mma_row(uint lane) {
  return ((lane / 4) & 4) + ((lane / 2) % 4);
}
inline uint attn_mma_col(uint lane) {
  return ((lane / 4) & 2) * 2 + (lane % 2) * 2;
}
constant constexpr ushort ATTN_MMA_ROW_XOR_NEAR = 1;
constant constexpr ushort ATTN_MMA_ROW_XOR_FAR = 8;
#endif
inline float attn_mma_row_max(float x) {
  x = max(x, simd_shuffle_xor(x, ATTN_MMA_ROW_XOR_NEAR));
  return max(x, simd_shuffle_xor(x, ATTN_MMA_ROW_XOR_FAR));
}
inline float attn_mma_row_sum(float x) {
  x += simd_shuffle_xor(x, ATTN_MMA_ROW_XOR_NEAR);
  return x + simd_shuffle_xor(x, ATTN_MMA_ROW_XOR_FAR);
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
  // K^T (dims x keys) and V (keys x dims) of one key tile in the cache dtype C, which is also the MMA operand type:
  // bf16 MMAs with fp32 accumulators in bf16 mode (tensor cores on NVIDIA; the probabilities are rounded to bf16 for
  // P·V, as FlashAttention does), fp32 in float32 mode.
  threadgroup C kt_tile[LILY_ATTN_MMA_TILE_KEYS * D];
  threadgroup C v_tile[LILY_ATTN_MMA_TILE_KEYS * D];
  static_assert(LILY_ATTN_MMA_TILE_KEYS == 8, "one 8x8 fragment of scores per simdgroup and tile");
  static_assert(D % 8 == 0, "head_dim is a whole number of 8-wide fragments");
  constexpr uint BK = LILY_ATTN_MMA_TILE_KEYS;
  constexpr uint FRAGS = D / 8;   // 8x8 fragments across the head dim
  constexpr uint THREADS = 32 * G;  // one simdgroup per head

  const uint head = group.y * G + simd_group;  // simdgroup s owns query head head0 + s
  const uint kv_head = head / (args.num_heads / args.num_kv_heads);
  const uint first_position = args.num_keys - args.num_queries;
  const uint q0 = group.x * 8;  // the threadgroup's 8 query tokens
  const uint row = attn_mma_row(simd_lane);
  const uint col = attn_mma_col(simd_lane);
  const uint t = q0 + row;  // this lane's query token (rows past num_queries compute but are not written)
  const uint position = first_position + t;

  // Q fragments (8 tokens x 8 dims each), scaled, straight from device memory into the lane's two elements.
  simdgroup_matrix<C, 8, 8> query[FRAGS];
  simdgroup_float8x8 acc[FRAGS];
  for (uint f = 0; f < FRAGS; ++f) {
    float2 elements = float2(0.0f);
    if (t < args.num_queries) {
      device const T* src = q + (size_t(t) * args.num_heads + head) * D + 8 * f + col;
      elements = float2(float(src[0]), float(src[1])) * args.scale;  // 1/sqrt(D): a power of 2 for D = 64, 256
    }
    query[f].thread_elements()[0] = C(elements[0]);
    query[f].thread_elements()[1] = C(elements[1]);
    acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  float run_max = -INFINITY;  // of this lane's row (the four lanes of a row hold the same values)
  float run_sum = 0.0f;

  device const C* k_head = k_cache + size_t(kv_head) * args.cache_capacity * D;
  device const C* v_head = v_cache + size_t(kv_head) * args.cache_capacity * D;
  const uint key_end = min(args.num_keys, first_position + q0 + 8);  // one past the last key the 8 queries see
  for (uint tile_start = 0; tile_start < key_end; tile_start += BK) {
    // Coalesced load of BK rows; rows past key_end are zero so that masked keys add 0 * 0, never NaN.
    for (uint i = tid; i < BK * D / 4; i += THREADS) {
      const uint key = i / (D / 4);
      const uint d = 4 * (i % (D / 4));
      float4 k4 = float4(0.0f);
      float4 v4 = float4(0.0f);
      if (tile_start + key < key_end) {
        k4 = lily::attn_load4(k_head + size_t(tile_start + key) * D + d);
        v4 = lily::attn_load4(v_head + size_t(tile_start + key) * D + d);
      }
      for (uint j = 0; j < 4; ++j) {
        kt_tile[(d + j) * BK + key] = C(k4[j]);  // exact: the values came from C
        v_tile[key * D + d + j] = C(v4[j]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    simdgroup_float8x8 scores = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint f = 0; f < FRAGS; ++f) {
      simdgroup_matrix<C, 8, 8> key_frag;
      simdgroup_load(key_frag, kt_tile + 8 * f * BK, BK);  // dims 8f..8f+7 x the tile's keys
      simdgroup_multiply_accumulate(scores, query[f], key_frag, scores);
    }
    // Causal mask and online softmax on the lane's two scores (keys tile_start + col, + col + 1).
    float2 s = scores.thread_elements();
    for (uint e = 0; e < 2; ++e) {
      if (tile_start + col + e > position || tile_start + col + e >= key_end) {
        s[e] = -INFINITY;
      }
    }
    // Key 0 is in the first tile and visible to every query, so new_max is finite from the first tile on.
    const float new_max = max(run_max, attn_mma_row_max(max(s[0], s[1])));
    const float rescale = precise::exp(run_max - new_max);
    const float2 p = float2(precise::exp(s[0] - new_max), precise::exp(s[1] - new_max));
    run_sum = run_sum * rescale + attn_mma_row_sum(p[0] + p[1]);
    run_max = new_max;
    simdgroup_matrix<C, 8, 8> probs;
    probs.thread_elements()[0] = C(p[0]);
    probs.thread_elements()[1] = C(p[1]);
    for (uint f = 0; f < FRAGS; ++f) {
      acc[f].thread_elements() *= rescale;  // the lane's elements are all in its row
      simdgroup_matrix<C, 8, 8> value_frag;
      simdgroup_load(value_frag, v_tile + 8 * f, D);  // the tile's keys x dims 8f..8f+7
      simdgroup_multiply_accumulate(acc[f], probs, value_frag, acc[f]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is consumed before the next load overwrites it
  }

  if (t < args.num_queries) {
    const size_t out_row = (size_t(t) * args.num_heads + head) * D;
    for (uint f = 0; f < FRAGS; ++f) {
      const float2 o = acc[f].thread_elements() / run_sum;
      for (uint e = 0; e < 2; ++e) {
        const size_t index = out_row + 8 * f + col + e;
        out[index] = T(o[e] * lily::sigmoid(float(gate[index])));
      }
    }
  }
}

// Model (head dim 256, GQA group 8): 4 heads per threadgroup.
LILY_INSTANTIATE_KERNEL("attention_prefill_f32_d256", attention_prefill, float, float, 256, 4)
LILY_INSTANTIATE_KERNEL("attention_prefill_bf16_d256", attention_prefill, bfloat, bfloat, 256, 4)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_f32_d256", attention_prefill_mma, float, float, 256, 4)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_bf16_d256", attention_prefill_mma, bfloat, bfloat, 256, 4)
// Demo model and tiny fixtures (head dim 64, GQA group 2 or 4): 2 heads per threadgroup, float32 and bf16 modes.
LILY_INSTANTIATE_KERNEL("attention_prefill_f32_d64", attention_prefill, float, float, 64, 2)
LILY_INSTANTIATE_KERNEL("attention_prefill_bf16_d64", attention_prefill, bfloat, bfloat, 64, 2)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_f32_d64", attention_prefill_mma, float, float, 64, 2)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_bf16_d64", attention_prefill_mma, bfloat, bfloat, 64, 2)
// Head ratios the packing cannot split (e.g. 3 query heads per KV head at D = 64, or 1): one head per threadgroup.
LILY_INSTANTIATE_KERNEL("attention_prefill_unpacked_f32_d256", attention_prefill, float, float, 256, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_unpacked_bf16_d256", attention_prefill, bfloat, bfloat, 256, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_unpacked_f32_d256", attention_prefill_mma, float, float, 256, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_unpacked_bf16_d256", attention_prefill_mma, bfloat, bfloat, 256, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_unpacked_f32_d64", attention_prefill, float, float, 64, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_unpacked_bf16_d64", attention_prefill, bfloat, bfloat, 64, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_unpacked_f32_d64", attention_prefill_mma, float, float, 64, 1)
LILY_INSTANTIATE_KERNEL("attention_prefill_mma_unpacked_bf16_d64", attention_prefill_mma, bfloat, bfloat, 64, 1)
