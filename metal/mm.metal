// Dense prefill GEMM, Y[M, N] = X[M, K] · W^T with W [N, K] already dequantized in the activation dtype: the
// IN_GEMM_DEQUANT switch off (docs/engine.md), after dequantize_* (metal/dequantize.metal) wrote W to a scratch.
//   mm_<dtype>_bm<BM>   the qmm tile loop of metal/gemm.h (grid, threads, tiles and fp32 accumulation of
//                       qmm_*_bm<BM>, metal/qmatmul.metal), with the W tile copied instead of dequantized;
//                       never chosen by default (W moves through device memory twice more than with qmm).
#include <metal_stdlib>
#include "gemm.h"
#include "lily.h"

using namespace metal;

namespace lily_mm {

// The mm W^T tile source for lily::gemm_tiles: rows [n0, n0 + BN) x columns [k0, k0 + BK) of a dense W[N, K] into a
// k-major threadgroup tile (tile[k * ld + n]) in T; rows past N are zero.
template <typename T>
struct DenseWTile {
  device const T* w;
  uint n0, N, K, tid, n_threads;

  void load(threadgroup T* tile, uint ld, uint k0) const {
    for (uint i = tid; i < LILY_QMM_BN * LILY_QMM_BK; i += n_threads) {
      uint r = i / LILY_QMM_BK, c = i % LILY_QMM_BK;
      uint n = n0 + r;
      tile[c * ld + r] = n < N ? w[size_t(n) * K + k0 + c] : T(0.0f);
    }
  }
};

}  // namespace lily_mm

template <typename T, int BM>
[[kernel]] void mm(constant lily::QMatmulArgs& args [[buffer(0)]],
                   device const T* x [[buffer(1)]],
                   device const T* w [[buffer(2)]],
                   device T* y [[buffer(3)]],
                   uint3 tg [[threadgroup_position_in_grid]],
                   uint tid [[thread_index_in_threadgroup]],
                   uint3 threads_per_group [[threads_per_threadgroup]],
                   uint simd_group [[simdgroup_index_in_threadgroup]]) {
  const uint n_threads = threads_per_group.x;  // 1-D threadgroups: the attribute's width matches the position's
  threadgroup T x_tile[BM][LILY_QMM_BK + LILY_QMM_PAD];
  threadgroup T wt_tile[LILY_QMM_BK][LILY_QMM_BN + LILY_QMM_PAD];
  threadgroup float y_tile[BM][LILY_QMM_BN + LILY_QMM_PAD];
  const lily_mm::DenseWTile<T> w_tile{w, tg.x * LILY_QMM_BN, args.out_features, args.in_features, tid, n_threads};
  lily::gemm_tiles<BM>(x, w_tile, y, &x_tile[0][0], &wt_tile[0][0], &y_tile[0][0], args.num_rows, args.out_features,
                       args.in_features, tg, tid, n_threads, simd_group);
}

LILY_INSTANTIATE_KERNEL("mm_f32_bm16", mm, float, 16)
LILY_INSTANTIATE_KERNEL("mm_bf16_bm16", mm, bfloat, 16)
LILY_INSTANTIATE_KERNEL("mm_f32_bm32", mm, float, 32)
LILY_INSTANTIATE_KERNEL("mm_bf16_bm32", mm, bfloat, 32)
