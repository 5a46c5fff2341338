// Sparse MoE block over a prefill chunk of T rows, GPU-resident from the router logits to the layer
// output (no CPU round trip). Order of dispatches:
//   moe_route_f32 (metal/moe.metal, grid T)   ids [T, k] uint32, weights [T, k] f32; pair p = row·k + slot.
//   moe_sort_count_u32    per block of LILY_MOE_SORT_BLOCK pairs: histogram of expert ids (threadgroup atomics)
//                         into block_counts [blocks, E].
//   moe_sort_scan_u32     one threadgroup: block_counts -> offsets within each expert (in place), expert_offsets
//                         [E + 1] (exclusive scan), and the block map: tile_map [max_tiles, 4] = (expert, first
//                         sorted row, row count, 0) for every bm-row tile of every expert, tile_count[0] = tiles.
//   moe_sort_scatter_u32  sorted_pairs [T·k]: the pairs in expert-contiguous order, within an expert by ascending
//                         pair (deterministic: in-block ranks by counting, no atomics).
//   moe_gemm_gate_up_<dtype>[_sf32]_bm<16|32>
//                         h [T·k, I] (sorted order) = SiLU(x_row·gate_eᵀ) ⊙ (x_row·up_eᵀ).
//   moe_gemm_down_<dtype>[_sf32]_bm<16|32>
//                         expert_out [T·k, H] (pair order) = w_p · (h·down_eᵀ): the scatter back to token order, one
//                         row per (token, slot), no float atomics.
//   moe_combine_<dtype>   out = residual + Σ_slot expert_out (slot order) + sigmoid(gate logit) · shared_out.
// The shared expert is a dense SwiGLU over all T rows: it runs as ordinary qmm (qmatmul family) into shared_out, and
// its gate logit comes from the router's GEMM; moe_combine adds both.
// Grouped GEMM: one threadgroup (LILY_GEMM_THREADS) per (64 output columns, tile of bm rows of one expert); the grid's
// y is max_tiles = ceil(T·k / bm) + min(E, T·k), a bound on Σ_e ceil(count_e / bm) known without reading the counts;
// threadgroups past tile_count[0] exit at once. The tile loop is metal/gemm.h's: per 32-deep K step, bm rows of the
// activations (gathered through sorted_pairs for gate/up) and the 64 × 32 weight block(s) are staged in threadgroup
// memory in the activation dtype, the weights dequantised there from 4-bit codes and rounded to it once (never a full
// dequantised matrix), the next step's loads in flight during this step's MMAs; simdgroup_matrix 8×8 MMAs accumulate
// in fp32 (tensor cores on NVIDIA). Gate/up applies SwiGLU to its two fp32 accumulators in registers, so one fp32
// output tile serves both kernels.
// bm = 32 (2 × 2 simdgroups of 16 × 32) when the chunk's mean rows per expert T·k/E is at least
// LILY_MOE_BM32_MIN_ROWS_PER_EXPERT, else bm = 16 (1 × 4 simdgroups of 16 × 16), so sparse experts pad fewer rows.
// Each weight byte is read once per tile of its expert: with 64 rows per expert (2048-token chunk) that is 2 (bm 32)
// or 4 (bm 16) reads, i.e. 114 or 57 FLOP per weight byte. Outputs are rounded once to the
// activation dtype (f32, f16, bf16); scales and biases are bf16, or f32 with the _sf32 suffix.
// Verified on Linux (CPU harness): results, the block map and the sorted order exactly. Mac-only: speed, the
// staging layout's bank conflicts.
#include <metal_stdlib>
#include "activations.h"
#include "gemm.h"
#include "lily.h"
#include "quantized.h"

using namespace metal;

constant constexpr uint MOE_NO_EXPERT = 0xFFFFFFFFu;  // the expert id of a sort block's padding slots
constant constexpr uint GEMM_BN = LILY_GEMM_BN;
constant constexpr uint OUT_STRIDE = LILY_GEMM_BN + 4;  // the fp32 output tile's row stride (as lily::gemm_tiles)

// ---------------------------------------------------------------------------------------------------------------
// Routing: histogram, scan and block map, scatter
// ---------------------------------------------------------------------------------------------------------------

// Grid: ceil(T·k / LILY_MOE_SORT_BLOCK) threadgroups of any size.
template <typename Id>
[[kernel]] void moe_sort_count(constant lily::MoeArgs& args [[buffer(0)]],
                               device const Id* expert_ids [[buffer(1)]],
                               device uint* block_counts [[buffer(2)]],
                               uint block [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint n_threads [[threads_per_threadgroup]]) {
  threadgroup atomic_uint counts[LILY_MOE_MAX_EXPERTS];
  const uint num_experts = args.num_experts;
  for (uint e = tid; e < num_experts; e += n_threads) {
    atomic_store_explicit(&counts[e], 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint total = args.num_rows * args.top_k;
  const uint first = block * LILY_MOE_SORT_BLOCK;
  const uint last = min(first + LILY_MOE_SORT_BLOCK, total);
  for (uint p = first + tid; p < last; p += n_threads) {
    uint e = uint(expert_ids[p]);
    if (e < num_experts) {
      atomic_fetch_add_explicit(&counts[e], 1u, memory_order_relaxed);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < num_experts; e += n_threads) {
    block_counts[size_t(block) * num_experts + e] = atomic_load_explicit(&counts[e], memory_order_relaxed);
  }
}

// Grid: one threadgroup of a multiple of 32 threads, at least E (LILY_MOE_MAX_EXPERTS fits every E). Thread e owns
// expert e. max_tiles must be the bound above; entries past tile_count[0] are left unwritten.
template <typename Id>
[[kernel]] void moe_sort_scan(constant lily::MoeArgs& args [[buffer(0)]],
                              device uint* block_counts [[buffer(1)]],
                              device uint* expert_offsets [[buffer(2)]],
                              device uint* tile_map [[buffer(3)]],
                              device uint* tile_count [[buffer(4)]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint n_threads [[threads_per_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint simd_group [[simdgroup_index_in_threadgroup]]) {
  threadgroup uint simd_rows[32];
  threadgroup uint simd_tiles[32];
  const uint num_experts = args.num_experts;
  const uint tile_rows = args.tile_rows;
  const uint num_blocks = (args.num_rows * args.top_k + LILY_MOE_SORT_BLOCK - 1) / LILY_MOE_SORT_BLOCK;
  const uint e = tid;

  uint count = 0;  // rows of expert e; block counts become the expert's offsets at each block
  if (e < num_experts) {
    for (uint b = 0; b < num_blocks; ++b) {
      uint c = block_counts[size_t(b) * num_experts + e];
      block_counts[size_t(b) * num_experts + e] = count;
      count += c;
    }
  }
  const uint tiles = (count + tile_rows - 1) / tile_rows;

  // Exclusive scans of rows and tiles over experts: within the simdgroup, then across simdgroup totals.
  uint row_offset = simd_prefix_exclusive_sum(count);
  uint tile_offset = simd_prefix_exclusive_sum(tiles);
  uint simd_row_total = simd_sum(count);
  uint simd_tile_total = simd_sum(tiles);
  if (lane == 0) {
    simd_rows[simd_group] = simd_row_total;
    simd_tiles[simd_group] = simd_tile_total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = 0; s < simd_group; ++s) {
    row_offset += simd_rows[s];
    tile_offset += simd_tiles[s];
  }

  if (e < num_experts) {
    expert_offsets[e] = row_offset;
    for (uint j = 0; j < tiles && tile_offset + j < args.max_tiles; ++j) {
      device uint* entry = tile_map + size_t(tile_offset + j) * 4;
      entry[0] = e;
      entry[1] = row_offset + j * tile_rows;
      entry[2] = min(tile_rows, count - j * tile_rows);
      entry[3] = 0;
    }
  }
  if (tid == n_threads - 1) {  // past every expert (n_threads > E or it is expert E-1): its offsets are the totals
    expert_offsets[num_experts] = row_offset + count;
    tile_count[0] = tile_offset + tiles;
  }
}

// Grid: ceil(T·k / LILY_MOE_SORT_BLOCK) threadgroups of any size. A pair's sorted position is its expert's offset
// + the offset of its block within the expert + its rank among the block's earlier pairs of the same expert.
template <typename Id>
[[kernel]] void moe_sort_scatter(constant lily::MoeArgs& args [[buffer(0)]],
                                 device const Id* expert_ids [[buffer(1)]],
                                 device const uint* block_offsets [[buffer(2)]],
                                 device const uint* expert_offsets [[buffer(3)]],
                                 device uint* sorted_pairs [[buffer(4)]],
                                 uint block [[threadgroup_position_in_grid]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint n_threads [[threads_per_threadgroup]]) {
  threadgroup uint block_ids[LILY_MOE_SORT_BLOCK];
  const uint num_experts = args.num_experts;
  const uint total = args.num_rows * args.top_k;
  const uint first = block * LILY_MOE_SORT_BLOCK;
  const uint n = min(uint(LILY_MOE_SORT_BLOCK), total - first);
  for (uint i = tid; i < LILY_MOE_SORT_BLOCK; i += n_threads) {
    block_ids[i] = i < n ? uint(expert_ids[first + i]) : MOE_NO_EXPERT;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < n; i += n_threads) {
    const uint e = block_ids[i];
    uint rank = 0;
    for (uint q = 0; q < i; ++q) {
      rank += block_ids[q] == e ? 1u : 0u;
    }
    if (e < num_experts) {
      sorted_pairs[expert_offsets[e] + block_offsets[size_t(block) * num_experts + e] + rank] = first + i;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Grouped GEMM
// ---------------------------------------------------------------------------------------------------------------

// Grid: (I / 64, max_tiles) threadgroups of LILY_GEMM_THREADS.
template <typename T, typename S, int BM>
[[kernel]] void moe_gemm_gate_up(constant lily::MoeArgs& args [[buffer(0)]],
                                 device const T* x [[buffer(1)]],
                                 device const uint* sorted_pairs [[buffer(2)]],
                                 device const uint* tile_map [[buffer(3)]],
                                 device const uint* tile_count [[buffer(4)]],
                                 device const uint* gate_weight [[buffer(5)]],
                                 device const S* gate_scales [[buffer(6)]],
                                 device const S* gate_biases [[buffer(7)]],
                                 device const uint* up_weight [[buffer(8)]],
                                 device const S* up_scales [[buffer(9)]],
                                 device const S* up_biases [[buffer(10)]],
                                 device T* hidden [[buffer(11)]],
                                 uint2 group [[threadgroup_position_in_grid]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint simd_group [[simdgroup_index_in_threadgroup]]) {
  typedef lily::GemmLayout<BM, GEMM_BN> L;
  // The operand tiles (the x rows, then the gate and up tiles), then h = SiLU(gate) ⊙ up in fp32 [BM][OUT_STRIDE].
  threadgroup float tiles[lily::GemmTileMemory<T, BM, 2>::FLOATS];
  threadgroup uint row_src[BM];
  const uint tile = group.y;
  if (tile >= tile_count[0]) {
    return;  // past the block map: the whole threadgroup leaves before any barrier
  }
  const uint expert = tile_map[tile * 4];
  const uint first = tile_map[tile * 4 + 1];
  const uint rows = tile_map[tile * 4 + 2];
  const uint n0 = group.x * GEMM_BN;
  const uint hidden_size = args.hidden_size;
  const uint expert_size = args.expert_size;
  for (uint m = tid; m < uint(BM); m += LILY_GEMM_THREADS) {
    row_src[m] = m < rows ? sorted_pairs[first + m] / args.top_k : lily::GEMM_NO_ROW;  // token row of the pair
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const size_t w_offset = size_t(expert) * expert_size * (hidden_size / 8);
  const size_t s_offset = size_t(expert) * expert_size * (hidden_size / 64);
  // The x rows of the tile's pairs (row_src), the gate rows, then the up rows.
  lily::GemmRowWords<T, BM> x_rows = lily::gemm_row_words<T, BM>(x, 0, 0, hidden_size, tid, row_src);
  lily::GemmQuantizedRows<4, S, 2> weights = lily::gemm_quantized_rows<4, S, 2>(
      n0, expert_size, hidden_size, tid, gate_weight + w_offset, gate_scales + s_offset, gate_biases + s_offset,
      up_weight + w_offset, up_scales + s_offset, up_biases + s_offset);
  constexpr uint kFrags = L::FRAGS_M * L::FRAGS_N;
  simdgroup_float8x8 acc[2 * kFrags];  // gate fragments, then up
  lily::gemm_tile_loop<BM, GEMM_BN, 2>(x_rows, weights, hidden_size, (threadgroup T*)tiles, simd_group, acc);
  LILY_UNROLL
  for (uint f = 0; f < kFrags; ++f) {
    // Element-wise on the lane's elements: a gate fragment and its up fragment share the lane layout.
    const float2 gate = acc[f].thread_elements();
    acc[f].thread_elements() = float2(lily::silu(gate[0]), lily::silu(gate[1])) * acc[kFrags + f].thread_elements();
  }
  lily::store_fragments<L::FRAGS_M, L::FRAGS_N>(tiles, OUT_STRIDE, acc, L::row0(simd_group), L::col0(simd_group));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Only the tile's own rows: the rows after them in sorted order belong to the next tile or expert.
  for (uint i = tid; i < rows * GEMM_BN; i += LILY_GEMM_THREADS) {
    const uint m = i / GEMM_BN;
    const uint n = i % GEMM_BN;
    hidden[size_t(first + m) * expert_size + n0 + n] = T(tiles[m * OUT_STRIDE + n]);
  }
}

// Grid: (H / 64, max_tiles) threadgroups of LILY_GEMM_THREADS.
template <typename T, typename S, int BM>
[[kernel]] void moe_gemm_down(constant lily::MoeArgs& args [[buffer(0)]],
                              device const T* hidden [[buffer(1)]],
                              device const uint* sorted_pairs [[buffer(2)]],
                              device const uint* tile_map [[buffer(3)]],
                              device const uint* tile_count [[buffer(4)]],
                              device const float* expert_weights [[buffer(5)]],
                              device const uint* down_weight [[buffer(6)]],
                              device const S* down_scales [[buffer(7)]],
                              device const S* down_biases [[buffer(8)]],
                              device T* expert_out [[buffer(9)]],
                              uint2 group [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint simd_group [[simdgroup_index_in_threadgroup]]) {
  typedef lily::GemmLayout<BM, GEMM_BN> L;
  threadgroup float tiles[lily::GemmTileMemory<T, BM, 1>::FLOATS];  // operand tiles, then the fp32 output tile
  threadgroup uint row_src[BM];
  const uint tile = group.y;
  if (tile >= tile_count[0]) {
    return;
  }
  const uint expert = tile_map[tile * 4];
  const uint first = tile_map[tile * 4 + 1];
  const uint rows = tile_map[tile * 4 + 2];
  const uint n0 = group.x * GEMM_BN;
  const uint hidden_size = args.hidden_size;
  const uint expert_size = args.expert_size;
  for (uint m = tid; m < uint(BM); m += LILY_GEMM_THREADS) {
    row_src[m] = m < rows ? first + m : lily::GEMM_NO_ROW;  // h is already in sorted order
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const size_t w_offset = size_t(expert) * hidden_size * (expert_size / 8);
  const size_t s_offset = size_t(expert) * hidden_size * (expert_size / 64);
  // The h rows of the tile (row_src), then the down rows.
  lily::GemmRowWords<T, BM> h_rows = lily::gemm_row_words<T, BM>(hidden, 0, 0, expert_size, tid, row_src);
  lily::GemmQuantizedRows<4, S, 1> weights = lily::gemm_quantized_rows<4, S, 1>(
      n0, hidden_size, expert_size, tid, down_weight + w_offset, down_scales + s_offset, down_biases + s_offset);
  simdgroup_float8x8 acc[L::FRAGS_M * L::FRAGS_N];
  lily::gemm_tile_loop<BM, GEMM_BN, 1>(h_rows, weights, expert_size, (threadgroup T*)tiles, simd_group, acc);
  lily::store_fragments<L::FRAGS_M, L::FRAGS_N>(tiles, OUT_STRIDE, acc, L::row0(simd_group), L::col0(simd_group));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < rows * GEMM_BN; i += LILY_GEMM_THREADS) {
    const uint m = i / GEMM_BN;
    const uint n = i % GEMM_BN;
    const uint pair = sorted_pairs[first + m];
    expert_out[size_t(pair) * hidden_size + n0 + n] = T(tiles[m * OUT_STRIDE + n] * expert_weights[pair]);
  }
}

// Grid: (ceil(H / threads), T) threadgroups of any size; one thread per output element.
template <typename T>
[[kernel]] void moe_combine(constant lily::MoeArgs& args [[buffer(0)]],
                            device const T* expert_out [[buffer(1)]],
                            device const T* shared_out [[buffer(2)]],
                            device const float* shared_gate_logit [[buffer(3)]],
                            device const T* residual [[buffer(4)]],
                            device T* out [[buffer(5)]],
                            uint2 group [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint2 threads_per_group [[threads_per_threadgroup]]) {
  const uint n_threads = threads_per_group.x;  // 1-D threadgroups: the attribute's width matches the position's
  const uint hidden_size = args.hidden_size;
  const uint column = group.x * n_threads + tid;
  if (column >= hidden_size) {
    return;
  }
  const size_t row = group.y;
  float total = 0.0f;
  for (uint slot = 0; slot < args.top_k; ++slot) {  // slot order: the same bits for any schedule
    total += float(expert_out[(row * args.top_k + slot) * hidden_size + column]);
  }
  total += lily::sigmoid(shared_gate_logit[row]) * float(shared_out[row * hidden_size + column]);
  // Read and write by the same thread: out may alias residual.
  out[row * hidden_size + column] = T(float(residual[row * hidden_size + column]) + total);
}

LILY_INSTANTIATE_KERNEL("moe_sort_count_u32", moe_sort_count, uint)
LILY_INSTANTIATE_KERNEL("moe_sort_scan_u32", moe_sort_scan, uint)
LILY_INSTANTIATE_KERNEL("moe_sort_scatter_u32", moe_sort_scatter, uint)
LILY_INSTANTIATE_KERNEL("moe_gemm_gate_up_f32_bm16", moe_gemm_gate_up, float, bfloat, 16)
LILY_INSTANTIATE_KERNEL("moe_gemm_gate_up_bf16_bm16", moe_gemm_gate_up, bfloat, bfloat, 16)
LILY_INSTANTIATE_KERNEL("moe_gemm_gate_up_f32_sf32_bm16", moe_gemm_gate_up, float, float, 16)
LILY_INSTANTIATE_KERNEL("moe_gemm_gate_up_bf16_sf32_bm16", moe_gemm_gate_up, bfloat, float, 16)
LILY_INSTANTIATE_KERNEL("moe_gemm_gate_up_f32_bm32", moe_gemm_gate_up, float, bfloat, 32)
LILY_INSTANTIATE_KERNEL("moe_gemm_gate_up_bf16_bm32", moe_gemm_gate_up, bfloat, bfloat, 32)
LILY_INSTANTIATE_KERNEL("moe_gemm_gate_up_f32_sf32_bm32", moe_gemm_gate_up, float, float, 32)
LILY_INSTANTIATE_KERNEL("moe_gemm_gate_up_bf16_sf32_bm32", moe_gemm_gate_up, bfloat, float, 32)
LILY_INSTANTIATE_KERNEL("moe_gemm_down_f32_bm16", moe_gemm_down, float, bfloat, 16)
LILY_INSTANTIATE_KERNEL("moe_gemm_down_bf16_bm16", moe_gemm_down, bfloat, bfloat, 16)
LILY_INSTANTIATE_KERNEL("moe_gemm_down_f32_sf32_bm16", moe_gemm_down, float, float, 16)
LILY_INSTANTIATE_KERNEL("moe_gemm_down_bf16_sf32_bm16", moe_gemm_down, bfloat, float, 16)
LILY_INSTANTIATE_KERNEL("moe_gemm_down_f32_bm32", moe_gemm_down, float, bfloat, 32)
LILY_INSTANTIATE_KERNEL("moe_gemm_down_bf16_bm32", moe_gemm_down, bfloat, bfloat, 32)
LILY_INSTANTIATE_KERNEL("moe_gemm_down_f32_sf32_bm32", moe_gemm_down, float, float, 32)
LILY_INSTANTIATE_KERNEL("moe_gemm_down_bf16_sf32_bm32", moe_gemm_down, bfloat, float, 32)
LILY_INSTANTIATE_KERNEL("moe_combine_f32", moe_combine, float)
LILY_INSTANTIATE_KERNEL("moe_combine_bf16", moe_combine, bfloat)
