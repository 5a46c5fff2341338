// linear (x @ W^T) and embed on the packed weights, the CPU twin of metal/qmatmul.metal and reference.linear.
//
// Decode (up to 8 tokens): a GEMV straight from the packed codes, sum_g scale_g * (q . x)_g + bias_g * sum(x)_g,
// so a weight is read once and never written out as floats; each decoded row serves every token. Prefill: a
// blocked GEMM that dequantizes 16 rows at a time into a small per-thread tile (L2-sized), transposed so that the
// AVX2 kernel needs no horizontal sums, and multiplies every token by it. The AVX2 loops read a chunk of 8 uint32
// words per load and shift out one code per word: lane w of shift s is element (32/bits)*w + s, so they use x in
// that "chunk order" (permuted once per call) and the dot products are unchanged.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "../../../metal/lily.h"
#include "avx2.h"
#include "kernels.h"

#ifdef LILY_CPU_X86
// Loops over a template's rows and tokens are unrolled so that their accumulator arrays live in registers.
#define LILY_UNROLL _Pragma("GCC unroll 16")
#endif

namespace lily::cpu {

namespace {

constexpr size_t kTileRows = 16;       // rows dequantized at once by the GEMM
constexpr size_t kGemvMaxTokens = 8;   // up to this many tokens: the GEMV (each weight row decoded once for all)
constexpr size_t kParallelWork = 1 << 17;  // multiply-adds below which a range is not split (a wake-up costs ~10 us)

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000 | (mantissa << 13));
  if (exponent == 0) return (sign ? -1.0f : 1.0f) * std::ldexp(float(mantissa), -24);  // zero or subnormal
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint32_t load_word(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

float dot_portable(const float* a, const float* b, size_t n) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (size_t j = 0; j < 8; ++j) partial[j] += a[k + j] * b[k + j];
  float sum = 0;
  for (; k < n; ++k) sum += a[k] * b[k];
  for (float p : partial) sum += p;
  return sum;
}

// Whether the AVX2 loops take this weight: quantized, with whole 8-word chunks inside each group.
bool chunked(const Matrix& w) {
  if (!avx2_enabled() || !w.bits) return false;
  const size_t chunk = 8 * (32 / w.bits);
  return w.group % chunk == 0 && w.cols % w.group == 0;
}

#ifdef LILY_CPU_X86
// dst[j * dst_stride + i] = src[i * src_stride + j] for an 8 x 8 block.
__attribute__((target("avx2,fma"))) inline void transpose_8x8(const float* src, size_t src_stride, float* dst,
                                                              size_t dst_stride) {
  __m256 r[8], t[8];
  for (size_t i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (size_t i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (size_t i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (size_t i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// At 4 bits a chunk is an 8 x 8 transpose: out[s * 8 + w] = x[8 * w + s].
__attribute__((target("avx2,fma"))) void transpose_chunks_4bit(const float* x, size_t count, float* out) {
  for (size_t c = 0; c < count; c += 64) transpose_8x8(x + c, 8, out + c, 8);
}

// A full tile of 16 rows [16, cols] into [cols, 16] (cols a multiple of 8), by 8 x 8 blocks.
__attribute__((target("avx2,fma"))) void transpose_tile_avx2(const float* tile, size_t cols, float* tile_t) {
  for (size_t r = 0; r < 16; r += 8)
    for (size_t k = 0; k < cols; k += 8) transpose_8x8(tile + r * cols + k, cols, tile_t + k * 16 + r, 16);
}
#endif

// x [tokens, cols] in chunk order for `bits`.
void permute_to_chunk_order(const float* x, size_t tokens, size_t cols, int bits, float* out) {
#ifdef LILY_CPU_X86
  if (bits == 4 && cols % 64 == 0) return transpose_chunks_4bit(x, tokens * cols, out);
#endif
  const size_t per_word = 32 / bits, chunk = 8 * per_word;
  for (size_t t = 0; t < tokens; ++t)
    for (size_t c = 0; c < cols; c += chunk)
      for (size_t s = 0; s < per_word; ++s)
        for (size_t w = 0; w < 8; ++w) out[t * cols + c + s * 8 + w] = x[t * cols + c + per_word * w + s];
}

#ifdef LILY_CPU_X86

__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, size_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  size_t k = 0;
  for (; k + 16 <= n; k += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), acc1);
  }
  for (; k + 8 <= n; k += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
  float sum = hsum(_mm256_add_ps(acc0, acc1));
  for (; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float alpha, const float* x, float* y, size_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// out[0..n) = sum_j weights[j] rows[j * stride + 0..n) in j order, as repeated axpy would add it, with 64 columns of
// out held in registers across all rows instead of loaded and stored once per row.
__attribute__((target("avx2,fma"))) void weighted_sum_avx2(const float* weights, const float* rows, size_t count,
                                                           size_t stride, size_t n, float* out) {
  size_t c = 0;
  for (; c + 64 <= n; c += 64) {
    __m256 acc[8];
    for (__m256& a : acc) a = _mm256_setzero_ps();
    for (size_t j = 0; j < count; ++j) {
      const __m256 w = _mm256_broadcast_ss(weights + j);
      const float* row = rows + j * stride + c;
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * i), acc[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + c + 8 * i, acc[i]);
  }
  for (; c + 8 <= n; c += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (size_t j = 0; j < count; ++j)
      acc = _mm256_fmadd_ps(_mm256_broadcast_ss(weights + j), _mm256_loadu_ps(rows + j * stride + c), acc);
    _mm256_storeu_ps(out + c, acc);
  }
  for (; c < n; ++c) {
    float acc = 0;
    for (size_t j = 0; j < count; ++j) acc += weights[j] * rows[j * stride + c];
    out[c] = acc;
  }
}

// out[t * groups + g] = the sum of group g of x[t] (a multiple of 8 long), as 8 lanes then one horizontal sum.
__attribute__((target("avx2,fma"))) void group_sums_avx2(const float* x, size_t tokens, size_t cols, size_t group,
                                                         float* out) {
  for (size_t i = 0; i < tokens * cols; i += group) {
    __m256 sum = _mm256_loadu_ps(x + i);
    for (size_t k = 8; k < group; k += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(x + i + k));
    out[i / group] = hsum(sum);
  }
}

// exp(x) for 8 floats: 2^n times a degree-5 polynomial on [-ln2/2, ln2/2] (Cephes expf), at most 1.26 ulp from
// double exp (every float in [-87, 88] checked); inputs clamped to where float exp is finite and normal.
__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// x = SiLU(x) * (y or 1), 8 lanes at a time; the tail as the portable loop.
__attribute__((target("avx2,fma"))) void silu_avx2(float* x, const float* y, size_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    __m256 r = _mm256_div_ps(v, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(zero, v))));
    if (y) r = _mm256_mul_ps(r, _mm256_loadu_ps(y + i));
    _mm256_storeu_ps(x + i, r);
  }
  for (; i < n; ++i) x[i] = y ? silu(x[i]) * y[i] : silu(x[i]);
}

template <DType D>
inline float scale_at(const uint8_t* values, size_t index) {
  if (D == DType::F32) {
    float f;
    std::memcpy(&f, values + 4 * index, 4);
    return f;
  }
  uint16_t v;
  std::memcpy(&v, values + 2 * index, 2);
  return D == DType::BF16 ? bits_to_float(uint32_t(v) << 16) : half_to_float(v);
}

// Rows [r0, r1) of a chunked weight times NT tokens (xc [NT, cols] in chunk order, xsum [NT, groups] the per-group
// sums of x; out[t * ldo + row]), R rows at a time. Each row's codes are decoded once for all NT tokens, and the
// R x NT accumulator chains are independent, so up to 8 of them hide the FMA latency. Every (row, token) gets the
// same sums in the same order whatever R and NT are, so a few-token forward equals one decode step per token.
// Inlined into gemv_chunked_avx2 and gemv_chunked_avx512, which differ only in the registers the compiler may use.
template <DType D, size_t R, size_t NT>
__attribute__((target("avx2,fma"), always_inline)) inline void gemv_chunked_loop(const float* xc, const float* xsum,
                                                                                const Matrix& w, size_t r0,
                                                                                size_t r1, float* out, size_t ldo) {
  const size_t per_word = 32 / w.bits, chunk = 8 * per_word, groups = w.cols / w.group;
  const size_t chunks_per_group = w.group / chunk, row_bytes = w.row_bytes();
  const __m256i mask = _mm256_set1_epi32((1 << w.bits) - 1);
  __m256i shifts[16];
  for (size_t s = 0; s < per_word; ++s) shifts[s] = _mm256_set1_epi32(int(s * w.bits));
  for (size_t row = r0; row < r1; row += R) {
    const size_t n = std::min(R, r1 - row);  // rows past the end repeat the last row and are not stored
    const uint8_t* data[R];
    size_t index[R];
    LILY_UNROLL
    for (size_t r = 0; r < R; ++r) {
      data[r] = w.data + (row + std::min(r, n - 1)) * row_bytes;
      index[r] = (row + std::min(r, n - 1)) * groups;
    }
    __m256 acc[R][NT];
    float bias_sum[R][NT];
    LILY_UNROLL
    for (size_t r = 0; r < R; ++r)
      LILY_UNROLL
      for (size_t t = 0; t < NT; ++t) {
        acc[r][t] = _mm256_setzero_ps();
        bias_sum[r][t] = 0;
      }
    for (size_t g = 0; g < groups; ++g) {
      __m256 sums[R][NT];
      LILY_UNROLL
      for (size_t r = 0; r < R; ++r)
        LILY_UNROLL
        for (size_t t = 0; t < NT; ++t) sums[r][t] = _mm256_setzero_ps();
      for (size_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
        __m256i words[R];
        LILY_UNROLL
        for (size_t r = 0; r < R; ++r)
          words[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data[r] + c * 32));
        const float* xp = xc + c * chunk;
        for (size_t s = 0; s < per_word; ++s) {
          __m256 q[R];
          LILY_UNROLL
          for (size_t r = 0; r < R; ++r)
            q[r] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(words[r], shifts[s]), mask));
          LILY_UNROLL
          for (size_t t = 0; t < NT; ++t) {
            const __m256 xv = _mm256_loadu_ps(xp + t * w.cols + 8 * s);
            LILY_UNROLL
            for (size_t r = 0; r < R; ++r) sums[r][t] = _mm256_fmadd_ps(q[r], xv, sums[r][t]);
          }
        }
      }
      LILY_UNROLL
      for (size_t r = 0; r < R; ++r) {
        const float bias = scale_at<D>(w.biases, index[r] + g);
        const __m256 scale = _mm256_set1_ps(scale_at<D>(w.scales, index[r] + g));
        LILY_UNROLL
        for (size_t t = 0; t < NT; ++t) {
          bias_sum[r][t] += bias * xsum[t * groups + g];
          acc[r][t] = _mm256_fmadd_ps(scale, sums[r][t], acc[r][t]);
        }
      }
    }
    LILY_UNROLL
    for (size_t r = 0; r < R; ++r)
      LILY_UNROLL
      for (size_t t = 0; t < NT; ++t)
        if (r < n) out[t * ldo + row + r] = hsum(acc[r][t]) + bias_sum[r][t];
  }
}

template <DType D, size_t R, size_t NT>
__attribute__((target("avx2,fma"))) void gemv_chunked_avx2(const float* xc, const float* xsum, const Matrix& w,
                                                           size_t r0, size_t r1, float* out, size_t ldo) {
  gemv_chunked_loop<D, R, NT>(xc, xsum, w, r0, r1, out, ldo);
}

template <DType D, size_t R, size_t NT>
__attribute__((target("avx2,fma,avx512f,avx512vl"))) void gemv_chunked_avx512(const float* xc, const float* xsum,
                                                                              const Matrix& w, size_t r0, size_t r1,
                                                                              float* out, size_t ldo) {
  gemv_chunked_loop<D, R, NT>(xc, xsum, w, r0, r1, out, ldo);
}

// Rows per block for NT tokens: at least 4 accumulator chains (8 where registers allow). With 16 registers, above 4
// tokens the accumulators of one row would not fit, so the first 4 tokens and the rest run as two passes over the
// rows (the second finds the codes in L1): 1.3-1.5x faster at 8 tokens than one pass of 8.
template <DType D>
void gemv_chunked_tokens_avx2(const float* xc, const float* xsum, size_t tokens, const Matrix& w, size_t r0,
                              size_t r1, float* out, size_t ldo) {
  switch (tokens) {
    case 1: return gemv_chunked_avx2<D, 4, 1>(xc, xsum, w, r0, r1, out, ldo);
    case 2: return gemv_chunked_avx2<D, 4, 2>(xc, xsum, w, r0, r1, out, ldo);
    case 3: return gemv_chunked_avx2<D, 2, 3>(xc, xsum, w, r0, r1, out, ldo);
    case 4: return gemv_chunked_avx2<D, 2, 4>(xc, xsum, w, r0, r1, out, ldo);
  }
  gemv_chunked_avx2<D, 2, 4>(xc, xsum, w, r0, r1, out, ldo);
  gemv_chunked_tokens_avx2<D>(xc + 4 * w.cols, xsum + 4 * (w.cols / w.group), tokens - 4, w, r0, r1, out + 4 * ldo,
                              ldo);
}

// With 32 registers every token count runs in one pass, R x NT accumulators never spilled (in a single-thread
// microbenchmark on a Zen 4 core: 2 tokens 1.4x the AVX2 blocking, 3 to 8 tokens 1.1-1.35x, 1 token 1.04x).
template <DType D>
void gemv_chunked_tokens_avx512(const float* xc, const float* xsum, size_t tokens, const Matrix& w, size_t r0,
                                size_t r1, float* out, size_t ldo) {
  switch (tokens) {
    case 1: return gemv_chunked_avx512<D, 4, 1>(xc, xsum, w, r0, r1, out, ldo);
    case 2: return gemv_chunked_avx512<D, 4, 2>(xc, xsum, w, r0, r1, out, ldo);
    case 3: return gemv_chunked_avx512<D, 2, 3>(xc, xsum, w, r0, r1, out, ldo);
    case 4: return gemv_chunked_avx512<D, 2, 4>(xc, xsum, w, r0, r1, out, ldo);
    case 5: return gemv_chunked_avx512<D, 2, 5>(xc, xsum, w, r0, r1, out, ldo);
    case 6: return gemv_chunked_avx512<D, 2, 6>(xc, xsum, w, r0, r1, out, ldo);
    case 7: return gemv_chunked_avx512<D, 1, 7>(xc, xsum, w, r0, r1, out, ldo);
    case 8: return gemv_chunked_avx512<D, 1, 8>(xc, xsum, w, r0, r1, out, ldo);
  }
}

template <DType D>
void gemv_chunked_tokens(const float* xc, const float* xsum, size_t tokens, const Matrix& w, size_t r0, size_t r1,
                         float* out, size_t ldo) {
  if (tokens == 0 || tokens > kGemvMaxTokens) throw std::logic_error("the GEMV takes 1 to 8 tokens");
  if (avx512_enabled()) return gemv_chunked_tokens_avx512<D>(xc, xsum, tokens, w, r0, r1, out, ldo);
  gemv_chunked_tokens_avx2<D>(xc, xsum, tokens, w, r0, r1, out, ldo);
}

void gemv_chunked(const float* xc, const float* xsum, size_t tokens, const Matrix& w, size_t r0, size_t r1,
                  float* out, size_t ldo) {
  switch (w.dtype) {
    case DType::F32: return gemv_chunked_tokens<DType::F32>(xc, xsum, tokens, w, r0, r1, out, ldo);
    case DType::BF16: return gemv_chunked_tokens<DType::BF16>(xc, xsum, tokens, w, r0, r1, out, ldo);
    case DType::F16: return gemv_chunked_tokens<DType::F16>(xc, xsum, tokens, w, r0, r1, out, ldo);
  }
}

// One row of a chunked weight dequantized in chunk order.
__attribute__((target("avx2,fma"))) void dequantize_row_chunked_avx2(const Matrix& w, size_t row, float* out) {
  const size_t per_word = 32 / w.bits, chunk = 8 * per_word, groups = w.cols / w.group;
  const size_t chunks_per_group = w.group / chunk;
  const __m256i mask = _mm256_set1_epi32((1 << w.bits) - 1);
  const uint8_t* data = w.data + row * w.row_bytes();
  for (size_t g = 0; g < groups; ++g) {
    const __m256 scale = _mm256_set1_ps(to_float(w.scales, w.dtype, row * groups + g));
    const __m256 bias = _mm256_set1_ps(to_float(w.biases, w.dtype, row * groups + g));
    for (size_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + c * 32));
      for (size_t s = 0; s < per_word; ++s) {
        const __m256i shift = _mm256_set1_epi32(int(s * w.bits));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(words, shift), mask));
        _mm256_storeu_ps(out + c * chunk + 8 * s, _mm256_fmadd_ps(q, scale, bias));
      }
    }
  }
}

// Stores the first n of 16 row results.
__attribute__((target("avx2,fma"))) inline void store_rows(float* out, size_t n, __m256 lo, __m256 hi) {
  if (n == 16) {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
    return;
  }
  float rows[16];
  _mm256_storeu_ps(rows, lo);
  _mm256_storeu_ps(rows + 8, hi);
  std::memcpy(out, rows, n * sizeof(float));
}

// out[t, 0..n) = x[t] . tile rows, from the tile transposed to [cols, 16] (column k holds row r's value at k * 16
// + r): 6 tokens x 16 rows of accumulators, each k adds one broadcast x times two 8-row vectors, and no horizontal
// sums are needed (they dominated at the experts' 64-wide rows).
__attribute__((target("avx2,fma"))) void tile_gemm_transposed_avx2(const float* x, size_t tokens, size_t cols,
                                                                   const float* tile_t, size_t n, float* out,
                                                                   size_t ldo) {
  size_t t = 0;
  for (; t + 6 <= tokens; t += 6) {
    const float* x0 = x + t * cols;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0, b4 = a0,
           a5 = a0, b5 = a0;
    for (size_t k = 0; k < cols; ++k) {
      const __m256 lo = _mm256_loadu_ps(tile_t + k * 16), hi = _mm256_loadu_ps(tile_t + k * 16 + 8);
      __m256 v = _mm256_broadcast_ss(x0 + k);
      a0 = _mm256_fmadd_ps(v, lo, a0);
      b0 = _mm256_fmadd_ps(v, hi, b0);
      v = _mm256_broadcast_ss(x0 + cols + k);
      a1 = _mm256_fmadd_ps(v, lo, a1);
      b1 = _mm256_fmadd_ps(v, hi, b1);
      v = _mm256_broadcast_ss(x0 + 2 * cols + k);
      a2 = _mm256_fmadd_ps(v, lo, a2);
      b2 = _mm256_fmadd_ps(v, hi, b2);
      v = _mm256_broadcast_ss(x0 + 3 * cols + k);
      a3 = _mm256_fmadd_ps(v, lo, a3);
      b3 = _mm256_fmadd_ps(v, hi, b3);
      v = _mm256_broadcast_ss(x0 + 4 * cols + k);
      a4 = _mm256_fmadd_ps(v, lo, a4);
      b4 = _mm256_fmadd_ps(v, hi, b4);
      v = _mm256_broadcast_ss(x0 + 5 * cols + k);
      a5 = _mm256_fmadd_ps(v, lo, a5);
      b5 = _mm256_fmadd_ps(v, hi, b5);
    }
    store_rows(out + t * ldo, n, a0, b0);
    store_rows(out + (t + 1) * ldo, n, a1, b1);
    store_rows(out + (t + 2) * ldo, n, a2, b2);
    store_rows(out + (t + 3) * ldo, n, a3, b3);
    store_rows(out + (t + 4) * ldo, n, a4, b4);
    store_rows(out + (t + 5) * ldo, n, a5, b5);
  }
  for (; t < tokens; ++t) {
    const float* xt = x + t * cols;
    __m256 lo_acc = _mm256_setzero_ps(), hi_acc = lo_acc;
    for (size_t k = 0; k < cols; ++k) {
      const __m256 v = _mm256_broadcast_ss(xt + k);
      lo_acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(tile_t + k * 16), lo_acc);
      hi_acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(tile_t + k * 16 + 8), hi_acc);
    }
    store_rows(out + t * ldo, n, lo_acc, hi_acc);
  }
}

#endif  // LILY_CPU_X86

}  // namespace

float dot(const float* a, const float* b, size_t n) {
#ifdef LILY_CPU_X86
  if (avx2_enabled()) return dot_avx2(a, b, n);
#endif
  return dot_portable(a, b, n);
}

void axpy(float alpha, const float* x, float* y, size_t n) {
#ifdef LILY_CPU_X86
  if (avx2_enabled()) return axpy_avx2(alpha, x, y, n);
#endif
  for (size_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void weighted_sum(const float* weights, const float* rows, size_t count, size_t stride, size_t n, float* out) {
#ifdef LILY_CPU_X86
  if (avx2_enabled()) return weighted_sum_avx2(weights, rows, count, stride, n, out);
#endif
  std::fill(out, out + n, 0.0f);
  for (size_t j = 0; j < count; ++j)
    for (size_t i = 0; i < n; ++i) out[i] += weights[j] * rows[j * stride + i];
}

void silu(float* x, const float* y, size_t n) {
#ifdef LILY_CPU_X86
  if (avx2_enabled()) return silu_avx2(x, y, n);
#endif
  for (size_t i = 0; i < n; ++i) x[i] = y ? silu(x[i]) * y[i] : silu(x[i]);
}

namespace {

// The portable GEMM of a tile: out[t, r] = x[t] . tile[r].
void tile_gemm_portable(const float* x, size_t tokens, size_t cols, const float* tile, size_t rows, float* out,
                        size_t ldo) {
  for (size_t t = 0; t < tokens; ++t)
    for (size_t r = 0; r < rows; ++r) out[t * ldo + r] = dot_portable(x + t * cols, tile + r * cols, cols);
}

// Rows [r0, r1) of W times one token, natural order (dense weights, the portable path, odd quantizations).
void gemv_rows(const float* x, const Matrix& w, size_t r0, size_t r1, float* out) {
  thread_local std::vector<float> row;
  if (!w.bits && w.dtype == DType::F32) {
    for (size_t r = r0; r < r1; ++r)
      out[r] = dot(x, reinterpret_cast<const float*>(w.data + r * w.row_bytes()), w.cols);
    return;
  }
  row.resize(w.cols);
  for (size_t r = r0; r < r1; ++r) {
    dequantize_row(w, r, row.data());
    out[r] = dot(x, row.data(), w.cols);
  }
}

void run(ThreadPool* pool, size_t n, size_t min_items, const std::function<void(size_t, size_t)>& fn) {
  if (pool) pool->parallel_for(n, min_items, fn);
  else fn(0, n);
}

}  // namespace

// Natural-order dequantization of one row (any bits/group/dtype): the GEMM tiles and embedding_gather.
void dequantize_row(const Matrix& w, size_t row, float* out) {
  const uint8_t* data = w.data + row * w.row_bytes();
  if (!w.bits) {
    for (size_t k = 0; k < w.cols; ++k) out[k] = to_float(data, w.dtype, k);
    return;
  }
  const size_t per_word = 32 / w.bits, groups = w.cols / w.group;
  const uint32_t mask = (1u << w.bits) - 1;
  for (size_t g = 0; g < groups; ++g) {
    const float scale = to_float(w.scales, w.dtype, row * groups + g);
    const float bias = to_float(w.biases, w.dtype, row * groups + g);
    for (size_t i = 0; i < w.group / per_word; ++i) {
      const uint32_t word = load_word(data + (g * w.group / per_word + i) * 4);
      float* o = out + g * w.group + i * per_word;
      for (size_t j = 0; j < per_word; ++j) o[j] = float((word >> (w.bits * j)) & mask) * scale + bias;
    }
  }
}

float to_float(const uint8_t* values, DType dtype, size_t index) {
  switch (dtype) {
    case DType::F32: {
      float f;
      std::memcpy(&f, values + 4 * index, 4);
      return f;
    }
    case DType::BF16: {
      uint16_t b;
      std::memcpy(&b, values + 2 * index, 2);
      return bits_to_float(uint32_t(b) << 16);
    }
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, values + 2 * index, 2);
      return half_to_float(h);
    }
  }
  return 0;
}

Matrix Matrix::expert(size_t e) const {
  if (!experts) return *this;
  Matrix m = *this;
  m.experts = 0;
  m.data = data + e * rows * row_bytes();
  if (bits) {
    const size_t per_expert = rows * (cols / group) * scale_bytes();
    m.scales = scales + e * per_expert;
    m.biases = biases + e * per_expert;
  }
  return m;
}

void linear_many(const float* x, size_t tokens, const LinearTarget* targets, size_t count, ThreadPool* pool) {
  if (tokens > kGemvMaxTokens) {
    for (size_t i = 0; i < count; ++i) linear(targets[i].x ? targets[i].x : x, tokens, *targets[i].w, targets[i].out,
                                              pool);
    return;
  }
  // Each input in chunk order and its per-group sums (groups of at least 32), once per input and weight format
  // among the targets, in a buffer of this thread's that is only ever grown.
  struct Input {
    const float* x;
    int bits, group;
    const float *xc, *xsum;
  };
  if (count > kMaxLinearTargets) throw std::invalid_argument("linear_many: at most 32 weights");
  Input inputs[kMaxLinearTargets];
  const Input* input_of[kMaxLinearTargets];
  size_t formats = 0;
  const size_t cols = targets[0].w->cols, per_format = tokens * (cols + cols / 32);
  thread_local std::vector<float> buffer;
  if (buffer.size() < count * per_format) buffer.resize(count * per_format);
  size_t total_rows = 0, work = 0;
  for (size_t i = 0; i < count; ++i) {
    const Matrix& w = *targets[i].w;
    const float* xi = targets[i].x ? targets[i].x : x;
    if (w.cols != cols) throw std::invalid_argument("linear_many: every weight must have the same columns");
    total_rows += w.rows;
    work += w.rows * cols * tokens;
    const Input* input = nullptr;
    if (chunked(w)) {
      for (size_t f = 0; f < formats; ++f)
        if (inputs[f].x == xi && inputs[f].bits == w.bits && inputs[f].group == w.group) input = &inputs[f];
      if (!input) {
        float* xc = buffer.data() + formats * per_format;
        float* xsum = xc + tokens * cols;
        permute_to_chunk_order(xi, tokens, cols, w.bits, xc);
#ifdef LILY_CPU_X86
        group_sums_avx2(xi, tokens, cols, size_t(w.group), xsum);
#endif
        inputs[formats] = {xi, w.bits, w.group, xc, xsum};
        input = &inputs[formats++];
      }
    }
    input_of[i] = input;
  }
  // The rows of all targets, one after another, as one parallel job.
  const size_t min_rows = std::max<size_t>(1, kParallelWork * total_rows / std::max<size_t>(work, 1));
  run(pool, total_rows, min_rows, [&](size_t begin, size_t end) {
    size_t first = 0;
    for (size_t j = 0; j < count; ++j) {
      const LinearTarget& t = targets[j];
      const Matrix& w = *t.w;
      const size_t lo = std::max(begin, first), hi = std::min(end, first + w.rows);
      [[maybe_unused]] const Input* input = input_of[j];
      const size_t r0 = lo - first, r1 = hi - first;
      first += w.rows;
      if (lo >= hi) continue;
#ifdef LILY_CPU_X86
      if (input) {
        gemv_chunked(input->xc, input->xsum, tokens, w, r0, r1, t.out, w.rows);
        continue;
      }
#endif
      const float* xi = t.x ? t.x : x;
      for (size_t k = 0; k < tokens; ++k) gemv_rows(xi + k * cols, w, r0, r1, t.out + k * w.rows);
    }
  });
}

void linear(const float* x, size_t tokens, const Matrix& w, float* out, ThreadPool* pool) {
  if (tokens <= kGemvMaxTokens) return linear_many(x, tokens, {{&w, out, nullptr}}, pool);
  const size_t rows = w.rows, cols = w.cols;
  const bool in_chunks = chunked(w);
  Scratch xc(in_chunks ? tokens * cols : 0);
  if (in_chunks) {
    run(pool, tokens, std::max<size_t>(1, kParallelWork / cols), [&](size_t t0, size_t t1) {
      permute_to_chunk_order(x + t0 * cols, t1 - t0, cols, w.bits, xc.data() + t0 * cols);
    });
  }
  const float* xs = in_chunks ? xc.data() : x;
  const size_t blocks = (rows + kTileRows - 1) / kTileRows;
  const size_t min_blocks = std::max<size_t>(1, kParallelWork / (kTileRows * cols * tokens) );
  run(pool, blocks, min_blocks, [&](size_t b0, size_t b1) {
    thread_local std::vector<float> tile;
    tile.resize(kTileRows * cols);
    for (size_t b = b0; b < b1; ++b) {
      const size_t r0 = b * kTileRows, n = std::min(kTileRows, rows - r0);
      const float* t = tile.data();
      if (!w.bits && w.dtype == DType::F32) {
        t = reinterpret_cast<const float*>(w.data + r0 * w.row_bytes());
      } else {
        for (size_t r = 0; r < n; ++r) {
#ifdef LILY_CPU_X86
          if (in_chunks) {
            dequantize_row_chunked_avx2(w, r0 + r, tile.data() + r * cols);
            continue;
          }
#endif
          dequantize_row(w, r0 + r, tile.data() + r * cols);
        }
      }
#ifdef LILY_CPU_X86
      if (avx2_enabled()) {
        static_assert(kTileRows == 16, "the transposed kernel holds 16 rows");
        thread_local std::vector<float> tile_t;
        tile_t.resize(cols * kTileRows);
        if (n == kTileRows && cols % 8 == 0) {
          transpose_tile_avx2(t, cols, tile_t.data());
        } else {
          if (n < kTileRows) std::fill(tile_t.begin(), tile_t.end(), 0.0f);  // rows past n stay zero
          for (size_t k = 0; k < cols; ++k)
            for (size_t r = 0; r < n; ++r) tile_t[k * kTileRows + r] = t[r * cols + k];
        }
        tile_gemm_transposed_avx2(xs, tokens, cols, tile_t.data(), n, out + r0, rows);
        continue;
      }
#endif
      tile_gemm_portable(xs, tokens, cols, t, n, out + r0, rows);
    }
  });
}


// ---- kernels: qmv_*, qmm_*, qmv_norm_*, qmv_residual_*, qmv_seg_*, qmv_norm_seg_* (metal/qmatmul.metal) and
// embedding_gather_* (metal/embedding.metal). Every variant of one product runs `linear`, so a decode step and a
// prompt of up to 8 rows compute each row's sums in the same order. ----

namespace {

// x rms-normed and multiplied by the norm weight, into this thread's buffer: what qmv_norm folds into its GEMV.
const float* normed_rows(const float* x, size_t rows, size_t n, const float* weight, float eps) {
  thread_local std::vector<float> normed;
  normed.resize(rows * n);
  rms_norm(x, rows, n, weight, eps, normed.data());
  return normed.data();
}

void qmatmul_kernel(const KernelCall& c, int bits, DType scales) {
  const auto a = c.args<QMatmulArgs>();
  const Matrix w = c.matrix(2, bits, scales, 0, a.out_features, a.in_features);
  linear(c.at<const float>(1), a.num_rows, w, c.at<float>(5), &c.pool);
}

void qmatmul_norm_kernel(const KernelCall& c, int bits, DType scales) {
  const auto a = c.args<QMatmulNormArgs>();
  const Matrix w = c.matrix(3, bits, scales, 0, a.out_features, a.in_features);
  const float* x = normed_rows(c.at<const float>(1), a.num_rows, a.in_features, c.at<const float>(2), a.eps);
  linear(x, a.num_rows, w, c.at<float>(6), &c.pool);
}

void qmatmul_residual_kernel(const KernelCall& c, int bits, DType scales) {
  const auto a = c.args<QMatmulArgs>();
  const Matrix w = c.matrix(2, bits, scales, 0, a.out_features, a.in_features);
  thread_local std::vector<float> y;
  y.resize(size_t(a.num_rows) * a.out_features);
  linear(c.at<const float>(1), a.num_rows, w, y.data(), &c.pool);
  const float* residual = c.at<const float>(5);
  float* out = c.at<float>(6);
  for (size_t i = 0; i < y.size(); ++i) out[i] = residual[i] + y[i];
}

// Each input row (one per grid row) through up to 4 matrices: y [rows, out_features], each segment's outputs after
// the previous one's; `norm` folds the RMSNorm in.
void qmatmul_segments_kernel(const KernelCall& c, int bits, DType scales, bool norm) {
  const auto a = c.args<QMatmulSegmentsArgs>();
  if (a.num_segments == 0 || a.num_segments > LILY_QMV_MAX_SEGMENTS) throw std::logic_error("[cpu] qmv_seg segments");
  Matrix w[LILY_QMV_MAX_SEGMENTS];
  for (size_t s = 0; s < a.num_segments; ++s) w[s] = c.matrix(3 + 3 * s, bits, scales, 0, a.rows[s], a.in_features);
  for (size_t m = 0; m < c.groups.height; ++m) {
    const float* x = c.at<const float>(1) + m * a.in_features;
    if (norm) x = normed_rows(x, 1, a.in_features, c.at<const float>(2), a.eps);
    LinearTarget targets[LILY_QMV_MAX_SEGMENTS];
    float* y = c.at<float>(3 + 3 * LILY_QMV_MAX_SEGMENTS) + m * a.out_features;
    for (size_t s = 0; s < a.num_segments; ++s) {
      targets[s] = {&w[s], y, nullptr};
      y += a.rows[s];
    }
    linear_many(x, 1, targets, a.num_segments, &c.pool);
  }
}

// Rows ids[ids_offset + t] of the table, t < the grid's width; an id out of range gives a row of NaN.
void embedding_kernel(const KernelCall& c, int bits, DType scales) {
  const auto a = c.args<EmbeddingArgs>();
  const Matrix table = c.matrix(2, bits, scales, 0, a.vocab_size, a.hidden_size);
  const uint32_t* ids = c.at<const uint32_t>(1) + a.ids_offset;
  float* out = c.at<float>(5);
  for (size_t t = 0; t < c.groups.width; ++t) {
    if (ids[t] < a.vocab_size) {
      dequantize_row(table, ids[t], out + t * a.hidden_size);
    } else {
      std::fill(out + t * a.hidden_size, out + (t + 1) * a.hidden_size, std::nanf(""));
    }
  }
}

}  // namespace

void add_qmatmul_kernels(KernelTable& table) {
  for (int bits : {4, 8}) {
    for (DType scales : {DType::BF16, DType::F32}) {
      const std::string q = "_q" + std::to_string(bits) + "_g64_f32" + (scales == DType::F32 ? "_sf32" : "");
      auto dense = [=](const KernelCall& c) { qmatmul_kernel(c, bits, scales); };
      table.add("qmv" + q, dense);
      for (const char* bm : {"_bm16", "_bm32"}) table.add("qmm" + q + bm, dense);
      table.add("qmv_norm" + q, [=](const KernelCall& c) { qmatmul_norm_kernel(c, bits, scales); });
      table.add("qmv_residual" + q, [=](const KernelCall& c) { qmatmul_residual_kernel(c, bits, scales); });
      table.add("qmv_seg" + q, [=](const KernelCall& c) { qmatmul_segments_kernel(c, bits, scales, false); });
      table.add("qmv_norm_seg" + q, [=](const KernelCall& c) { qmatmul_segments_kernel(c, bits, scales, true); });
      table.add("embedding_gather" + q, [=](const KernelCall& c) { embedding_kernel(c, bits, scales); });
    }
  }
}

}  // namespace lily::cpu
