// The simdgroup-matrix helpers of the attention kernels that run on matrix units (attention_prefill_mma in
// attention_prefill.metal, attention_decode_partial_mma in attention.metal): the lane layout of thread_elements(),
// reductions over a fragment's columns, and a column of MMAs sharing one B fragment.
#ifndef LILY_ATTENTION_MMA_H
#define LILY_ATTENTION_MMA_H

#include <metal_stdlib>
#include "lily.h"

using namespace metal;

// Row and first column of the two elements a lane holds in an 8x8 simdgroup matrix: (row, col) and (row, col + 1).
// Apple leaves this mapping implementation-defined; on Apple GPUs it is the one MLX's steel kernels rely on; the CUDA
// shim stores fragments in NVIDIA's mma layout. The eight lanes holding one column (the same attn_mma_col) differ in
// the three bits ATTN_MMA_COL_XOR_*: the bits attn_mma_row reads.
#if defined(MSL_CUDA)
inline uint attn_mma_row(uint lane) {
  return lane / 4;
}
inline uint attn_mma_col(uint lane) {
  return (lane % 4) * 2;
}
constant constexpr ushort ATTN_MMA_COL_XOR_0 = 4;
constant constexpr ushort ATTN_MMA_COL_XOR_1 = 8;
constant constexpr ushort ATTN_MMA_COL_XOR_2 = 16;
#else
inline uint attn_mma_row(uint lane) {
  return ((lane / 4) & 4) + ((lane / 2) % 4);
}
inline uint attn_mma_col(uint lane) {
  return ((lane / 4) & 2) * 2 + (lane % 2) * 2;
}
constant constexpr ushort ATTN_MMA_COL_XOR_0 = 2;
constant constexpr ushort ATTN_MMA_COL_XOR_1 = 4;
constant constexpr ushort ATTN_MMA_COL_XOR_2 = 16;
#endif
// Max and sum over the 8 rows of each of the lane's two columns (three butterflies).
inline float2 attn_mma_col_max(float2 x) {
  x = max(x, simd_shuffle_xor(x, ATTN_MMA_COL_XOR_0));
  x = max(x, simd_shuffle_xor(x, ATTN_MMA_COL_XOR_1));
  return max(x, simd_shuffle_xor(x, ATTN_MMA_COL_XOR_2));
}
inline float2 attn_mma_col_sum(float2 x) {
  x += simd_shuffle_xor(x, ATTN_MMA_COL_XOR_0);
  x += simd_shuffle_xor(x, ATTN_MMA_COL_XOR_1);
  return x + simd_shuffle_xor(x, ATTN_MMA_COL_XOR_2);
}

// acc[i] += a[i] · b for FM fragments of A sharing one B. The CUDA shim runs two of them as the rows 0-7 and 8-15 of
// one m16n8k8 tensor-core MMA (simdgroup_multiply_accumulate_pairs, B transposed once); Apple's compiler, the CPU
// harness and fp32 operands get the plain 8x8 MMAs. The same products and fp32 sums either way.
template <uint FM, typename C>
LILY_INLINE void attn_mma_column(thread simdgroup_float8x8* acc, thread const simdgroup_matrix<C, 8, 8>* a,
                                 thread const simdgroup_matrix<C, 8, 8>& b) {
#if defined(MSL_CUDA)
  if constexpr (sizeof(C) == 2) {
    simdgroup_multiply_accumulate_pairs<FM, 1>(acc, a, &b);
    return;
  }
#endif
  LILY_UNROLL
  for (uint i = 0; i < FM; ++i) {
    simdgroup_multiply_accumulate(acc[i], a[i], b, acc[i]);
  }
}

#endif  // LILY_ATTENTION_MMA_H
