// The tiled GEMM shared by qmm (metal/qmatmul.metal), mm (metal/mm.metal) and the grouped MoE GEMM
// (metal/moe_prefill.metal): Y[M, N] = X[M, K] · W^T with threadgroup tiles in the activation dtype T and
// simdgroup_matrix 8x8 MMAs accumulating in fp32, one tile loop (gemm_tile_loop) fed by each kernel's tile loaders.
// Tiles in T, as MLX's and llama.cpp's Metal GEMMs keep them: half the threadgroup memory and traffic of fp32 tiles,
// and bf16/f16 MMAs, which NVIDIA's tensor cores run (the CUDA shim maps them to mma.sync); X is already in T, and
// dequantized weights are rounded to T once (fp32 mode keeps fp32 tiles).
//
// A threadgroup is LILY_GEMM_THREADS = 4 simdgroups and owns a BM x LILY_GEMM_BN output tile (BM = 16, 32 or 64);
// the simdgroups split it 1 x 4 (BM = 16) or 2 x 2, so each holds up to 4 x 4 accumulator fragments and every
// fragment of A it loads serves 2-4 MMAs. Both operand tiles are row-major in K ([BM][ld] rows of X, [BN][ld] rows
// of W: the B fragments are transposed loads), so each thread writes its share of a tile as contiguous words. Per
// 32-deep K step each thread first issues its global loads for the NEXT step into registers (the loaders' fetch),
// then runs the MMAs of this step, then writes the registers into the other of two tile buffers (stage), then one
// barrier: the loads are in flight during the MMAs and a step costs one barrier (fp32 tiles, too large to double,
// use one buffer and two barriers). The loaders keep no division or modulo per step: each thread's rows and column
// are fixed when the loader is made.
#ifndef LILY_GEMM_H
#define LILY_GEMM_H

#include <metal_stdlib>
#include "lily.h"
#include "quantized.h"

namespace lily {
using namespace metal;

// Copies rows [row0, row0 + rows) x columns [k0, k0 + cols) of X into a threadgroup tile (row stride `ld`),
// converted to the tile type; rows past M are zero. Consecutive threads read consecutive k: coalesced. (qmm_nax)
template <typename T, typename TileT>
LILY_INLINE void load_x_tile(device const T* x, threadgroup TileT* tile, uint ld, uint rows, uint cols, uint row0,
                             uint k0, uint M, uint K, uint tid, uint n_threads) {
  for (uint i = tid; i < rows * cols; i += n_threads) {
    uint r = i / cols, c = i % cols;
    uint m = row0 + r;
    tile[r * ld + c] = m < M ? TileT(float(x[size_t(m) * K + k0 + c])) : TileT(0.0f);
  }
}

// Writes the valid part of a rows x cols fp32 threadgroup tile to Y[row0 + r, n0 + c], rounded once to T.
template <typename T>
LILY_INLINE void store_y_tile(threadgroup const float* tile, uint ld, uint rows, uint cols, device T* y, uint row0,
                              uint n0, uint M, uint N, uint tid, uint n_threads) {
  for (uint i = tid; i < rows * cols; i += n_threads) {
    uint r = i / cols, c = i % cols;
    uint m = row0 + r, n = n0 + c;
    if (m < M && n < N) {
      y[size_t(m) * N + n] = T(tile[r * ld + c]);
    }
  }
}

// Row stride, in elements, of an operand tile in T: LILY_GEMM_BK plus 16 bytes, so the 8 rows of a fragment load
// fall in 8 different bank groups and every row starts 16-byte aligned.
template <typename T>
constexpr uint gemm_ld() {
  return LILY_GEMM_BK + 16 / uint(sizeof(T));
}
// Operand tile buffers: two (loads of the next step overlap this step's MMAs) for 16-bit tiles, one for fp32.
template <typename T>
constexpr uint gemm_stages() {
  return sizeof(T) == 2 ? 2 : 1;
}
// Threadgroup memory of a GEMM, in floats: the operand tiles (A, then NumB B tiles, per stage), which the fp32 output
// tile [BM][BN + 4] reuses after the last step. (A member, not a function: the CPU harness's rewriter takes array
// bounds without parentheses.)
template <typename T, uint BM, uint NumB>
struct GemmTileMemory {
  static constant constexpr const uint OPERANDS =
      gemm_stages<T>() * (BM + NumB * LILY_GEMM_BN) * gemm_ld<T>() * uint(sizeof(T)) / 4;
  static constant constexpr const uint OUTPUT = BM * (LILY_GEMM_BN + 4);
  static constant constexpr const uint FLOATS = OPERANDS > OUTPUT ? OPERANDS : OUTPUT;
};

// How the 4 simdgroups split a BM x BN tile: 1 x 4 for BM = 16, else 2 x 2; each owns FRAGS_M x FRAGS_N fragments
// from (row0, col0).
template <uint BM, uint BN>
struct GemmLayout {
  static constant constexpr const uint SG_ROWS = BM >= 32 ? 2 : 1;
  static constant constexpr const uint SG_COLS = 4 / SG_ROWS;
  static constant constexpr const uint FRAGS_M = BM / SG_ROWS / 8;
  static constant constexpr const uint FRAGS_N = BN / SG_COLS / 8;
  static_assert(BM == 16 || BM == 32 || BM == 64, "16, 32 or 64 rows");
  static_assert(LILY_GEMM_THREADS == 128, "4 simdgroups");
  LILY_INLINE static uint row0(uint simd_group) { return (simd_group / SG_COLS) * (BM / SG_ROWS); }
  LILY_INLINE static uint col0(uint simd_group) { return (simd_group % SG_COLS) * (BN / SG_COLS); }
};

// A row table entry meaning "no row": the tile row is zeros (rows past M, a partial MoE tile's padding).
constant constexpr uint GEMM_NO_ROW = 0xFFFFFFFFu;

// A BM-row operand tile (rows of X, of the gathered MoE rows, or of a dense W) copied as 32-bit words: thread tid
// holds words of tile rows tid / ROW_WORDS + i · ROW_STEP, all at word column tid % ROW_WORDS, so consecutive threads
// read consecutive words of a row. `offset[i]` is the row's first word in device memory plus that column, or
// GEMM_NO_ROW for a zero row.
template <typename T, uint BM>
struct GemmRowWords {
  static constant constexpr const uint PER_WORD = 4 / uint(sizeof(T));
  static constant constexpr const uint ROW_WORDS = LILY_GEMM_BK / PER_WORD;
  static constant constexpr const uint ROW_STEP = LILY_GEMM_THREADS / ROW_WORDS;
  static constant constexpr const uint WORDS = BM / ROW_STEP;
  static_assert(LILY_GEMM_THREADS % ROW_WORDS == 0 && BM % ROW_STEP == 0, "whole rows per pass of the threads");

  device const uint* source;  // the matrix as words
  uint offset[WORDS];
  uint words[WORDS];
  uint tid;

  // Tile row of this thread's i-th word.
  LILY_INLINE uint row(uint i) const { return tid / ROW_WORDS + i * ROW_STEP; }
  // Points word i at device row `device_row` of a matrix with `row_words` words per row (GEMM_NO_ROW: zeros).
  LILY_INLINE void set_row(uint i, uint device_row, uint row_words) {
    offset[i] = device_row == GEMM_NO_ROW ? GEMM_NO_ROW : device_row * row_words + tid % ROW_WORDS;
  }
  LILY_INLINE void fetch(uint k0) {
    LILY_UNROLL
    for (uint i = 0; i < WORDS; ++i) {
      words[i] = offset[i] == GEMM_NO_ROW ? 0u : source[offset[i] + k0 / PER_WORD];
    }
  }
  LILY_INLINE void stage(threadgroup T* tile) const {
    threadgroup uint* tile_words = (threadgroup uint*)tile;
    LILY_UNROLL
    for (uint i = 0; i < WORDS; ++i) {
      tile_words[row(i) * (gemm_ld<T>() / PER_WORD) + tid % ROW_WORDS] = words[i];
    }
  }
};

// Rows of a row-major [rows, K] matrix as a GemmRowWords tile: rows [row0, row0 + BM), those past `rows` zero
// (row_table null), or tile row m = device row row_table[m] (a gathered tile; GEMM_NO_ROW: zeros).
template <typename T, uint BM>
LILY_INLINE GemmRowWords<T, BM> gemm_row_words(device const T* matrix, uint row0, uint rows, uint K, uint tid,
                                               threadgroup const uint* row_table = nullptr) {
  GemmRowWords<T, BM> tile;
  tile.source = (device const uint*)matrix;
  tile.tid = tid;
  LILY_UNROLL
  for (uint i = 0; i < GemmRowWords<T, BM>::WORDS; ++i) {
    const uint m = row0 + tile.row(i);
    const uint device_row = row_table ? row_table[tile.row(i)] : (m < rows ? m : GEMM_NO_ROW);
    tile.set_row(i, device_row, K / GemmRowWords<T, BM>::PER_WORD);
  }
  return tile;
}

// NumB weight tiles of one K step, each LILY_GEMM_BN rows (output columns) of an MLX affine-quantized matrix
// (group 64), dequantized (scale · q + bias) and rounded to T in stage(). A row's step is ROW_WORDS words (16 bytes
// at 4 bits); ROW_WORDS consecutive threads read one row's words, so each load instruction of a simdgroup reads whole
// 16-byte row segments (coalesced), and thread tid holds word tid % ROW_WORDS of the ROWS tile rows
// r_j = tid / ROW_WORDS + j · ROW_STEP (of all NumB · BN rows: tile i at tiles + i · BN · ld, so row r at tiles + r · ld;
// its matrix is known per j). A step lies inside one group: one scale and bias per row and step. Rows past N read
// row N - 1 with a zero scale and bias (zeros, no conditional load).
template <int Bits, typename S, uint NumB>
struct GemmQuantizedRows {
  static constant constexpr const uint CODES = codes_per_word<Bits>();  // per word
  static constant constexpr const uint ROW_WORDS = LILY_GEMM_BK / CODES;
  static constant constexpr const uint ROW_STEP = LILY_GEMM_THREADS / ROW_WORDS;
  static constant constexpr const uint ROWS = NumB * LILY_GEMM_BN / ROW_STEP;
  static_assert(LILY_GEMM_BN % ROW_STEP == 0 && CODES % 4 == 0, "a thread's rows each in one matrix; 4-code stores");
  static_assert(kQuantGroupSize % LILY_GEMM_BK == 0, "a K step inside one quantization group");

  device const uint* weight[NumB];
  device const S* scales[NumB];
  device const S* biases[NumB];
  uint row[ROWS];      // device row of r_j (clamped to N - 1)
  uint in_range;       // bit j: r_j < N
  uint tid, K;
  uint words[ROWS];
  float scale[ROWS], bias[ROWS];

  // The matrix of a thread's j-th row (the same for every thread).
  LILY_INLINE static uint matrix_of(uint j) { return j * ROW_STEP / LILY_GEMM_BN; }

  LILY_INLINE void fetch(uint k0) {
    const uint words_per_row = K / CODES, groups_per_row = K / kQuantGroupSize;
    LILY_UNROLL
    for (uint j = 0; j < ROWS; ++j) {
      const uint m = matrix_of(j);
      words[j] = weight[m][size_t(row[j]) * words_per_row + k0 / CODES + tid % ROW_WORDS];
      const size_t group = size_t(row[j]) * groups_per_row + k0 / kQuantGroupSize;
      const bool valid = (in_range >> j) & 1u;
      scale[j] = valid ? float(scales[m][group]) : 0.0f;
      bias[j] = valid ? float(biases[m][group]) : 0.0f;
    }
  }
  // Codes become floats by the decode GEMVs' mask-into-mantissa (lily::code_float: two operations per code, no shift
  // or int-to-float conversion), then scale · q + bias as dequantize_code computes it: the same values.
  template <typename T>
  LILY_INLINE void stage(threadgroup T* tiles) const {
    uint magic[kCodeMagicCount<Bits>];
    code_float_magic<Bits>(magic);
    LILY_UNROLL
    for (uint j = 0; j < ROWS; ++j) {
      threadgroup T* dst = tiles + (tid / ROW_WORDS + j * ROW_STEP) * gemm_ld<T>() + (tid % ROW_WORDS) * CODES;
      const uint word_high = words[j] >> 16;
      LILY_UNROLL
      for (uint c = 0; c < CODES; c += 4) {
        vec<T, 4> v;
        LILY_UNROLL
        for (uint e = 0; e < 4; ++e) {
          v[e] = T(scale[j] * code_float<Bits>(words[j], word_high, c + e, magic) + bias[j]);
        }
        *((threadgroup vec<T, 4>*)(dst + c)) = v;
      }
    }
  }
};

// Thread tid's GemmQuantizedRows of rows [n0, n0 + BN) of NumB (1 or 2) matrices [N, K]: matrix 0 (weight0, scales0,
// biases0) and, for NumB = 2, matrix 1.
template <int Bits, typename S, uint NumB>
LILY_INLINE GemmQuantizedRows<Bits, S, NumB> gemm_quantized_rows(uint n0, uint N, uint K, uint tid,
                                                                 device const uint* weight0, device const S* scales0,
                                                                 device const S* biases0,
                                                                 device const uint* weight1 = nullptr,
                                                                 device const S* scales1 = nullptr,
                                                                 device const S* biases1 = nullptr) {
  static_assert(NumB == 1 || NumB == 2, "one or two matrices");
  typedef GemmQuantizedRows<Bits, S, NumB> Q;
  Q q;
  q.weight[0] = weight0;
  q.scales[0] = scales0;
  q.biases[0] = biases0;
  if (NumB == 2) {
    q.weight[NumB - 1] = weight1;
    q.scales[NumB - 1] = scales1;
    q.biases[NumB - 1] = biases1;
  }
  q.tid = tid;
  q.K = K;
  q.in_range = 0;
  LILY_UNROLL
  for (uint j = 0; j < Q::ROWS; ++j) {
    const uint n = n0 + (tid / Q::ROW_WORDS + j * Q::ROW_STEP) % LILY_GEMM_BN;
    q.row[j] = min(n, N - 1);
    q.in_range |= uint(n < N) << j;
  }
  return q;
}

// acc[fm · FragsN + fn] += a[fm] · b[fn]. The CUDA shim runs two fragments of A against one of B as one m16n8k8
// tensor-core MMA (simdgroup_multiply_accumulate_pairs); Apple's compiler and the CPU harness get the plain MMAs.
// The same products and fp32 sums either way.
template <uint FragsM, uint FragsN, typename TileT>
LILY_INLINE void gemm_mma_block(thread simdgroup_float8x8* acc, thread const simdgroup_matrix<TileT, 8, 8>* a,
                                thread const simdgroup_matrix<TileT, 8, 8>* b) {
#if defined(MSL_CUDA)
  simdgroup_multiply_accumulate_pairs<FragsM, FragsN>(acc, a, b);
#else
  LILY_UNROLL
  for (uint fm = 0; fm < FragsM; ++fm) {
    LILY_UNROLL
    for (uint fn = 0; fn < FragsN; ++fn) {
      thread simdgroup_float8x8& c = acc[fm * FragsN + fn];
      simdgroup_multiply_accumulate(c, a[fm], b[fn], c);
    }
  }
#endif
}

// One K step of this simdgroup's MMAs: A rows row0 + 8·fm of a_tile [BM][ld], against each of the NumB B tiles
// [BN][ld] (rows = output columns col0 + 8·fn, loaded transposed), into acc[i · FRAGS_M · FRAGS_N ..].
template <uint BM, uint BN, uint NumB, typename TileT>
LILY_INLINE void gemm_mma_step(thread simdgroup_float8x8* acc, threadgroup const TileT* a_tile,
                               threadgroup const TileT* b_tiles, uint row0, uint col0) {
  typedef GemmLayout<BM, BN> L;
  constexpr uint ld = gemm_ld<TileT>();
#if defined(MSL_CUDA)
  if constexpr (sizeof(TileT) == 2) {
    // CUDA, 16-bit tiles: each fragment row of the step as one ldmatrix.x4 (the 4 K fragments of 8 rows; every tile
    // row is 16-byte aligned: ld · 2 bytes is a multiple of 16 and the tiles start aligned), and the weight rows
    // as stored are mma.sync's B operand. The same MMAs, products and sums as the portable loop below.
    static_assert(LILY_GEMM_BK == 32 && (ld * sizeof(TileT)) % 16 == 0, "x4 loads of 16-byte aligned rows");
    uint a[4][L::FRAGS_M];
    LILY_UNROLL
    for (uint fm = 0; fm < L::FRAGS_M; ++fm) {
      uint rows[4];
      simdgroup_fragment_rows_x4(rows, a_tile + (row0 + 8 * fm) * ld, ld);
      LILY_UNROLL
      for (uint kf = 0; kf < 4; ++kf) {
        a[kf][fm] = rows[kf];
      }
    }
    LILY_UNROLL
    for (uint i = 0; i < NumB; ++i) {
      uint bt[4][L::FRAGS_N];
      LILY_UNROLL
      for (uint fn = 0; fn < L::FRAGS_N; ++fn) {
        uint rows[4];
        simdgroup_fragment_rows_x4(rows, b_tiles + (i * BN + col0 + 8 * fn) * ld, ld);
        LILY_UNROLL
        for (uint kf = 0; kf < 4; ++kf) {
          bt[kf][fn] = rows[kf];
        }
      }
      LILY_UNROLL
      for (uint kf = 0; kf < 4; ++kf) {
        simdgroup_multiply_accumulate_rows<TileT, L::FRAGS_M, L::FRAGS_N>(acc + i * L::FRAGS_M * L::FRAGS_N, a[kf],
                                                                         bt[kf]);
      }
    }
    return;
  }
#endif
  LILY_UNROLL
  for (uint kk = 0; kk < LILY_GEMM_BK; kk += 8) {
    simdgroup_matrix<TileT, 8, 8> a[L::FRAGS_M];
    simdgroup_matrix<TileT, 8, 8> b[L::FRAGS_N];
    LILY_UNROLL
    for (uint fm = 0; fm < L::FRAGS_M; ++fm) {
      simdgroup_load(a[fm], a_tile + (row0 + 8 * fm) * ld + kk, ld);
    }
    LILY_UNROLL
    for (uint i = 0; i < NumB; ++i) {
      threadgroup const TileT* b_tile = b_tiles + i * BN * ld;
      LILY_UNROLL
      for (uint fn = 0; fn < L::FRAGS_N; ++fn) {
        simdgroup_load(b[fn], b_tile + (col0 + 8 * fn) * ld + kk, ld, ulong2(0, 0), true);
      }
      gemm_mma_block<L::FRAGS_M, L::FRAGS_N>(acc + i * L::FRAGS_M * L::FRAGS_N, a, b);
    }
  }
}

// The tile loop of every tiled GEMM (qmm, mm, the grouped MoE GEMM): NumB products A · B_i^T sharing one A, of which
// this simdgroup owns the fragments GemmLayout<BM, BN> gives it, accumulated in acc[i · FRAGS_M · FRAGS_N ..]. `a`
// and `b` are the loaders (fetch(k0): this thread's global loads for the step at k0 into registers; stage(tile): the
// registers into a tile buffer, the B loader writing its NumB tiles [BN][ld] one after another). `tiles` is the
// threadgroup memory of GemmTileMemory<TileT, BM, NumB>::FLOATS. The caller stores the fragments (store_fragments).
template <uint BM, uint BN, uint NumB, typename TileT, typename ALoader, typename BLoader>
LILY_INLINE void gemm_tile_loop(thread ALoader& a, thread BLoader& b, uint K, threadgroup TileT* tiles,
                                uint simd_group, thread simdgroup_float8x8* acc) {
  typedef GemmLayout<BM, BN> L;
  constexpr uint ld = gemm_ld<TileT>();
  constexpr uint kStages = gemm_stages<TileT>();
  constexpr uint kStage = (BM + NumB * BN) * ld;  // elements of one buffer: A, then the B tiles
  const uint row0 = L::row0(simd_group), col0 = L::col0(simd_group);
  LILY_UNROLL
  for (uint f = 0; f < NumB * L::FRAGS_M * L::FRAGS_N; ++f) {
    acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  if (kStages == 1) {
    for (uint k0 = 0; k0 < K; k0 += LILY_GEMM_BK) {
      a.fetch(k0);
      b.fetch(k0);
      threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done reading the previous step's tiles
      a.stage(tiles);
      b.stage(tiles + BM * ld);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      gemm_mma_step<BM, BN, NumB>(acc, tiles, tiles + BM * ld, row0, col0);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // as below: the caller may reuse the tiles
    return;
  }
  a.fetch(0);
  b.fetch(0);
  a.stage(tiles);
  b.stage(tiles + BM * ld);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint buffer = 0;
  for (uint k0 = 0; k0 < K; k0 += LILY_GEMM_BK) {
    const bool more = k0 + LILY_GEMM_BK < K;  // uniform: the barrier below stays convergent
    if (more) {
      a.fetch(k0 + LILY_GEMM_BK);
      b.fetch(k0 + LILY_GEMM_BK);
    }
    threadgroup const TileT* current = tiles + buffer * kStage;
    gemm_mma_step<BM, BN, NumB>(acc, current, current + BM * ld, row0, col0);
    if (more) {
      // The other buffer's last readers finished before the previous step's barrier.
      threadgroup TileT* next = tiles + (1 - buffer) * kStage;
      a.stage(next);
      b.stage(next + BM * ld);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    buffer = 1 - buffer;
  }
}

// out_tile[row0 + 8·fm .., col0 + 8·fn ..] = the simdgroup's fragments (row stride ldo).
template <uint FragsM, uint FragsN>
LILY_INLINE void store_fragments(threadgroup float* out_tile, uint ldo, thread const simdgroup_float8x8* acc,
                                 uint row0, uint col0) {
  LILY_UNROLL
  for (uint fm = 0; fm < FragsM; ++fm) {
    LILY_UNROLL
    for (uint fn = 0; fn < FragsN; ++fn) {
      simdgroup_store(acc[fm * FragsN + fn], out_tile + (row0 + 8 * fm) * ldo + col0 + 8 * fn, ldo);
    }
  }
}

// The qmm / mm GEMM: a BM x LILY_GEMM_BN output tile per threadgroup (grid (ceil(N / BN), ceil(M / BM))); `w_tile`
// loads W rows tg.x · BN .. (dequantized or copied; rows past N zero). The store goes through the fp32 tile in
// `tiles` (after the last step), so partial tiles are clipped and rounded once per element, independent of the
// simdgroup_matrix lane layout.
template <uint BM, typename T, typename WTile, typename O>
LILY_INLINE void gemm_tiles(device const T* x, thread WTile& w_tile, device O* y, threadgroup float* tiles, uint M,
                            uint N, uint K, uint3 tg, uint tid, uint simd_group) {
  typedef GemmLayout<BM, LILY_GEMM_BN> L;
  constexpr uint ldy = LILY_GEMM_BN + 4;
  const uint row0 = tg.y * BM;
  GemmRowWords<T, BM> x_rows = gemm_row_words<T, BM>(x, row0, M, K, tid);
  simdgroup_float8x8 acc[L::FRAGS_M * L::FRAGS_N];
  gemm_tile_loop<BM, LILY_GEMM_BN, 1>(x_rows, w_tile, K, (threadgroup T*)tiles, simd_group, acc);
  // The loop ends with a barrier: every simdgroup is done with the operand tiles the output tile reuses.
  store_fragments<L::FRAGS_M, L::FRAGS_N>(tiles, ldy, acc, L::row0(simd_group), L::col0(simd_group));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  store_y_tile(tiles, ldy, BM, LILY_GEMM_BN, y, row0, tg.x * LILY_GEMM_BN, M, N, tid, LILY_GEMM_THREADS);
}

}  // namespace lily

#endif  // LILY_GEMM_H
