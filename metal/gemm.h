// The tiled GEMM shared by qmm (metal/qmatmul.metal), mm (metal/mm.metal) and, for its MMA step and store, the grouped
// MoE GEMM (metal/moe_prefill.metal): Y[M, N] = X[M, K] · W^T with fp32 threadgroup tiles and simdgroup_matrix 8x8
// MMAs accumulating in fp32. Each simdgroup owns FragsM x FragsN fragments; tiles are row-major with a padded stride.
#ifndef LILY_GEMM_H
#define LILY_GEMM_H

#include <metal_stdlib>
#include "lily.h"

namespace lily {
using namespace metal;

// Copies rows [row0, row0 + rows) x columns [k0, k0 + cols) of X into a threadgroup tile (row stride `ld`), widened or
// rounded to the tile type; rows past M are zero. Consecutive threads read consecutive k: coalesced.
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

template <uint Frags>
inline void zero_fragments(thread simdgroup_float8x8* acc) {
  for (uint f = 0; f < Frags; ++f) {
    acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
}

// acc[fm · FragsN + fn] += a_tile(rows row0 + 8·fm ..) · bt_tile(columns col0 + 8·fn ..) over `depth` k: the A tile is
// [rows][lda], the B tile k-major [depth][ldb] (W^T, as simdgroup_load wants it).
template <uint FragsM, uint FragsN>
inline void mma_step(thread simdgroup_float8x8* acc, threadgroup const float* a_tile, uint lda,
                     threadgroup const float* bt_tile, uint ldb, uint depth, uint row0, uint col0) {
  for (uint kk = 0; kk < depth; kk += 8) {
    simdgroup_float8x8 a[FragsM];
    simdgroup_float8x8 b[FragsN];
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

// The qmm / mm tile loop: a BM x LILY_QMM_BN output tile per threadgroup, (BM / 16) x 2 simdgroups of 16 x 16 each.
// Per K step of LILY_QMM_BK the threadgroup copies a BM x BK tile of X and `w_tile` fills the BK x BN k-major W^T tile
// (dequantized or copied), then every simdgroup runs its MMAs. The store goes through threadgroup memory, so partial
// tiles are clipped and rounded per element, independent of the simdgroup_matrix lane layout. The caller declares the
// threadgroup tiles: x_tile [BM][BK + PAD], wt_tile [BK][BN + PAD], y_tile [BM][BN + PAD].
template <int BM, typename T, typename WTile>
inline void gemm_tiles(device const T* x, thread const WTile& w_tile, device T* y, threadgroup float* x_tile,
                       threadgroup float* wt_tile, threadgroup float* y_tile, uint M, uint N, uint K, uint3 tg,
                       uint tid, uint n_threads, uint simd_group) {
  constexpr uint BN = LILY_QMM_BN;
  constexpr uint BK = LILY_QMM_BK;
  constexpr uint kLdX = LILY_QMM_BK + LILY_QMM_PAD;
  constexpr uint kLdW = LILY_QMM_BN + LILY_QMM_PAD;
  static_assert(BN == 32 && (BM == 16 || BM == 32), "simdgroups own 16 x 16 blocks: (BM / 16) x 2 simdgroups");
  const uint row0 = tg.y * BM;
  const uint n0 = tg.x * BN;
  const uint sub_row = (simd_group / 2) * 16;  // this simdgroup's 16 x 16 block of the tile
  const uint sub_col = (simd_group % 2) * 16;

  simdgroup_float8x8 acc[4];
  zero_fragments<4>(acc);
  for (uint k0 = 0; k0 < K; k0 += BK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done reading the previous step's tiles
    load_x_tile(x, x_tile, kLdX, BM, BK, row0, k0, M, K, tid, n_threads);
    w_tile.load(wt_tile, kLdW, BN, BK, n0, k0, N, K, tid, n_threads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mma_step<2, 2>(acc, x_tile, kLdX, wt_tile, kLdW, BK, sub_row, sub_col);
  }
  store_fragments<2, 2>(y_tile, kLdW, acc, sub_row, sub_col);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  store_y_tile(y_tile, kLdW, BM, BN, y, row0, n0, M, N, tid, n_threads);
}

}  // namespace lily

#endif  // LILY_GEMM_H
