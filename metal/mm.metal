// Dense prefill GEMM, Y[M, N] = X[M, K] · W^T with W [N, K] already dequantized in the activation dtype: the
// IN_GEMM_DEQUANT switch off (docs/engine.md), after dequantize_* (metal/dequantize.metal) wrote W to a scratch.
//   mm_<dtype>_bm<BM>   the qmm tile loop of metal/gemm.h (grid, threads, tiles and fp32 accumulation of
//                       qmm_*_bm<BM>, metal/qmatmul.metal), with the W tile copied instead of dequantized;
//                       never chosen by default (W moves through device memory twice more than with qmm).
#include <metal_stdlib>
#include "gemm.h"
#include "lily.h"

using namespace metal;

// W's tile is rows [n0, n0 + BN) of the dense W[N, K]: the same row copy as X's (lily::GemmRowWords), rows past N
// zero.
template <typename T, int BM>
[[kernel]] void mm(constant lily::QMatmulArgs& args [[buffer(0)]],
                   device const T* x [[buffer(1)]],
                   device const T* w [[buffer(2)]],
                   device T* y [[buffer(3)]],
                   uint3 tg [[threadgroup_position_in_grid]],
                   uint tid [[thread_index_in_threadgroup]],
                   uint simd_group [[simdgroup_index_in_threadgroup]]) {
  threadgroup float tiles[lily::GemmTileMemory<T, BM, 1>::FLOATS];
  lily::GemmRowWords<T, LILY_GEMM_BN> w_tile =
      lily::gemm_row_words<T, LILY_GEMM_BN>(w, tg.x * LILY_GEMM_BN, args.out_features, args.in_features, tid);
  lily::gemm_tiles<BM>(x, w_tile, y, tiles, args.num_rows, args.out_features, args.in_features, tg, tid, simd_group);
}

LILY_INSTANTIATE_KERNEL("mm_f32_bm16", mm, float, 16)
LILY_INSTANTIATE_KERNEL("mm_bf16_bm16", mm, bfloat, 16)
LILY_INSTANTIATE_KERNEL("mm_f32_bm32", mm, float, 32)
LILY_INSTANTIATE_KERNEL("mm_bf16_bm32", mm, bfloat, 32)
LILY_INSTANTIATE_KERNEL("mm_bf16_bm64", mm, bfloat, 64)
