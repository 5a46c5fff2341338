// The tiled GEMM shared by qmm (metal/qmatmul.metal), mm (metal/mm.metal) and the grouped MoE GEMM
// (metal/moe_prefill.metal): Y[M, N] = X[M, K] · W^T with threadgroup tiles in the activation dtype T and
// simdgroup_matrix 8x8 MMAs accumulating in fp32, one tile loop (gemm_tile_loop) fed by each kernel's tile loaders.
// Tiles in T, as MLX's and llama.cpp's Metal GEMMs keep them: half the threadgroup memory and traffic of fp32 tiles,
// and bf16/f16 MMAs, which NVIDIA's tensor cores run (the CUDA shim maps them to mma.sync); X is already in T, and
// dequantized weights are rounded to T once (fp32 mode keeps fp32 tiles). Each simdgroup owns FragsM x FragsN
// fragments; tiles are row-major with a padded stride.
#ifndef LILY_GEMM_H
#define LILY_GEMM_H

#include <metal_stdlib>
#include "lily.h"

namespace lily {
using namespace metal;

// Copies rows [row0, row0 + rows) x columns [k0, k0 + cols) of X into a threadgroup tile (row stride `ld`),
// converted to the tile type; rows past M are zero. Consecutive threads read consecutive k: coalesced.
template <typename T, typename TileT>
inline void load_x_tile(device const T* x, threadgroup TileT* tile, uint ld, uint rows, uint cols, uint row0, uint k0,
                        uint M, uint K, uint tid, uint n_threads) {
  for (uint i = tid; i < rows * cols; i += n_threads) {
    uint r = i / cols, c = i % cols;
    uint m = row0 + r;
    tile[r * ld + c] = m < M ? TileT(float(x[size_t(m) * K + k0 + c])) : TileT(0.0f);
  }
}

// Writes the valid part of a rows x cols fp32 threadgroup tile to Y[row0 + r, n0 + c], rounded once to T.
template <typename T>
inline void store_y_tile(threadgroup const float* tile, uint ld, uint rows, uint cols, device T* y, uint row0, uint n0,
                         uint M, uint N, uint tid, uint n_threads) {
  for (uint i = tid; i < rows * cols; i += n_threads) {
    uint r = i / cols, c = i % cols;
    uint m = row0 + r, n = n0 + c;
    if (m < M && n < N) {
      y[size_t(m) * N + n] = T(tile[r * ld + c]);
    }
  }
}

// acc[fm · FragsN + fn] += a_tile(rows row0 + 8·fm ..) · bt_tile(columns col0 + 8·fn ..) over `depth` k: the A tile is
// [rows][lda], the B tile k-major [depth][ldb] (W^T, as simdgroup_load wants it); fragments in the tile type.
template <uint FragsM, uint FragsN, typename TileT>
inline void mma_step(thread simdgroup_float8x8* acc, threadgroup const TileT* a_tile, uint lda,
                     threadgroup const TileT* bt_tile, uint ldb, uint depth, uint row0, uint col0) {
  for (uint kk = 0; kk < depth; kk += 8) {
    simdgroup_matrix<TileT, 8, 8> a[FragsM];
    simdgroup_matrix<TileT, 8, 8> b[FragsN];
    for (uint fm = 0; fm < FragsM; ++fm) {
      simdgroup_load(a[fm], a_tile + (row0 + 8 * fm) * lda + kk, lda);
    }
    for (uint fn = 0; fn < FragsN; ++fn) {
      simdgroup_load(b[fn], bt_tile + kk * ldb + col0 + 8 * fn, ldb);
    }
    for (uint fm = 0; fm < FragsM; ++fm) {
      for (uint fn = 0; fn < FragsN; ++fn) {
        thread simdgroup_float8x8& c = acc[fm * FragsN + fn];
        simdgroup_multiply_accumulate(c, a[fm], b[fn], c);
      }
    }
  }
}

// out_tile[row0 + 8·fm .., col0 + 8·fn ..] = the simdgroup's fragments (row stride ldo).
template <uint FragsM, uint FragsN>
inline void store_fragments(threadgroup float* out_tile, uint ldo, thread const simdgroup_float8x8* acc, uint row0,
                            uint col0) {
  for (uint fm = 0; fm < FragsM; ++fm) {
    for (uint fn = 0; fn < FragsN; ++fn) {
      simdgroup_store(acc[fm * FragsN + fn], out_tile + (row0 + 8 * fm) * ldo + col0 + 8 * fn, ldo);
    }
  }
}

// The tile loop of every tiled GEMM (qmm, mm, the grouped MoE GEMM): NumB products A · B_i^T sharing one A, of which
// this simdgroup owns FragsM x FragsN fragments at (row0, col0), accumulated in acc[i · FragsM · FragsN ..]. Per K
// step of BK, the threads stage the A tile [rows][lda] through `a` and the NumB k-major B tiles [BK][ldb] (tile i at
// b_tiles + i·BK·ldb) through `b` (structs with `void load(threadgroup TileT* tile, uint ld, uint k0) const`), then
// each simdgroup runs its MMAs. The caller stores the fragments (store_fragments) where it wants them.
template <uint FragsM, uint FragsN, uint BK, uint NumB, typename TileT, typename ATile, typename BTiles>
inline void gemm_tile_loop(thread const ATile& a, thread const BTiles& b, uint K, threadgroup TileT* a_tile, uint lda,
                           threadgroup TileT* b_tiles, uint ldb, uint row0, uint col0, thread simdgroup_float8x8* acc) {
  constexpr uint kFrags = FragsM * FragsN;
  for (uint f = 0; f < NumB * kFrags; ++f) {
    acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  for (uint k0 = 0; k0 < K; k0 += BK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done reading the previous step's tiles
    a.load(a_tile, lda, k0);
    b.load(b_tiles, ldb, k0);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = 0; i < NumB; ++i) {
      mma_step<FragsM, FragsN>(acc + i * kFrags, a_tile, lda, b_tiles + i * BK * ldb, ldb, BK, row0, col0);
    }
  }
}

// The qmm / mm A tile source for gemm_tile_loop: rows [row0, row0 + rows) of X[M, K], BK columns per step.
template <typename T>
struct RowsTile {
  device const T* x;
  uint rows, row0, M, K, tid, n_threads;

  void load(threadgroup T* tile, uint ld, uint k0) const {
    load_x_tile(x, tile, ld, rows, LILY_QMM_BK, row0, k0, M, K, tid, n_threads);
  }
};

// The qmm / mm GEMM: a BM x LILY_QMM_BN output tile per threadgroup, (BM / 16) x 2 simdgroups of 16 x 16 each; `w_tile`
// (bound to W rows tg.x · BN ..) fills the BK x BN k-major W^T tile in T, dequantized or copied, rows past N zero. The
// store goes through the fp32 tile y_tile, so partial tiles are clipped and rounded once per element, independent of
// the simdgroup_matrix lane layout. The caller declares the threadgroup tiles: x_tile [BM][BK + PAD] and wt_tile
// [BK][BN + PAD] in T, y_tile [BM][BN + PAD] in fp32.
template <int BM, typename T, typename WTile>
inline void gemm_tiles(device const T* x, thread const WTile& w_tile, device T* y, threadgroup T* x_tile,
                       threadgroup T* wt_tile, threadgroup float* y_tile, uint M, uint N, uint K, uint3 tg, uint tid,
                       uint n_threads, uint simd_group) {
  constexpr uint BN = LILY_QMM_BN;
  constexpr uint kLdX = LILY_QMM_BK + LILY_QMM_PAD;
  constexpr uint kLdW = LILY_QMM_BN + LILY_QMM_PAD;
  static_assert(BN == 32 && (BM == 16 || BM == 32), "simdgroups own 16 x 16 blocks: (BM / 16) x 2 simdgroups");
  const uint row0 = tg.y * BM;
  const uint n0 = tg.x * BN;
  const uint frag_row = (simd_group / 2) * 16;
  const uint frag_col = (simd_group % 2) * 16;
  const RowsTile<T> x_rows{x, BM, row0, M, K, tid, n_threads};
  simdgroup_float8x8 acc[4];
  gemm_tile_loop<2, 2, LILY_QMM_BK, 1>(x_rows, w_tile, K, x_tile, kLdX, wt_tile, kLdW, frag_row, frag_col, acc);
  store_fragments<2, 2>(y_tile, kLdW, acc, frag_row, frag_col);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  store_y_tile(y_tile, kLdW, BM, BN, y, row0, n0, M, N, tid, n_threads);
}

}  // namespace lily

#endif  // LILY_GEMM_H
