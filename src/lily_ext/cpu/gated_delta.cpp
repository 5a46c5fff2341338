// causal_conv1d and gated_delta_rule (reference.py "Gated DeltaNet"), the CPU twin of metal/gated_delta.metal:
// the recurrence runs token by token on the fp32 state, one slab of a value head's columns per task.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace lily::cpu {

void causal_conv1d(float* x, size_t tokens, size_t channels, size_t taps, const float* w, float* conv_state,
                   ThreadPool* pool) {
  const size_t history_rows = taps - 1;
  // history = [conv_state; x]: row r < K-1 is state row r, row K-1+t is input t.
  std::vector<float> history((history_rows + tokens) * channels);
  std::memcpy(history.data(), conv_state, history_rows * channels * sizeof(float));
  std::memcpy(history.data() + history_rows * channels, x, tokens * channels * sizeof(float));
  // The weights tap-major [taps, channels], so that each tap is one pass over a row with channels innermost (which
  // the compiler vectorizes); each channel's sum still adds the taps in order.
  std::vector<float> tap_major(taps * channels);
  for (size_t c = 0; c < channels; ++c)
    for (size_t j = 0; j < taps; ++j) tap_major[j * channels + c] = w[c * taps + j];
  auto rows = [&](size_t begin, size_t end) {
    std::vector<float> sum(channels);
    for (size_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (size_t j = 0; j < taps; ++j) {
        const float* tap = tap_major.data() + j * channels;
        const float* in = history.data() + (t + j) * channels;
        for (size_t c = 0; c < channels; ++c) sum[c] += tap[c] * in[c];
      }
      std::copy(sum.begin(), sum.end(), x + t * channels);
      silu(x + t * channels, nullptr, channels);
    }
  };
  if (pool) pool->for_items(tokens, channels * (taps + 8), rows);
  else rows(0, tokens);
  std::memcpy(conv_state, history.data() + tokens * channels, history_rows * channels * sizeof(float));
}

namespace {

// Columns are independent in the recurrence (column c of S, v, e and o only meet column c), so the state is worked
// on in slabs of this many columns: heads x slabs tasks instead of heads alone (4 value heads in the demo model).
// A slab holds up to 4 vectors of 8 columns, whose sums are independent FMA chains (one chain waits on the FMA
// latency); each column's operations are the same whatever the slab width.
constexpr size_t kSlabColumns = 32;

// One token of one value head on columns [c0, c1) of its state S [dk, dv]: S *= decay; e = beta (v - S^T k);
// S += k e^T; o = S^T q.
void delta_step_portable(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                         size_t dk, size_t dv, size_t c0, size_t c1, float* out) {
  float error[kSlabColumns];
  for (size_t c = c0; c < c1; ++c) error[c - c0] = v[c];
  for (size_t a = 0; a < dk; ++a) {
    float* row = S + a * dv;
    for (size_t c = c0; c < c1; ++c) {
      row[c] *= decay;
      error[c - c0] -= k[a] * row[c];
    }
  }
  for (size_t c = c0; c < c1; ++c) {
    error[c - c0] *= beta;
    out[c] = 0.0f;
  }
  for (size_t a = 0; a < dk; ++a) {
    float* row = S + a * dv;
    for (size_t c = c0; c < c1; ++c) {
      row[c] += k[a] * error[c - c0];
      out[c] += q[a] * row[c];
    }
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The same step on NV vectors of 8 columns from c0.
template <size_t NV>
__attribute__((target("avx2,fma"))) void delta_step_avx2(float* S, const float* q, const float* k, const float* v,
                                                         float decay, float beta, size_t dk, size_t dv, size_t c0,
                                                         float* out) {
  const __m256 d = _mm256_set1_ps(decay), b = _mm256_set1_ps(beta);
  __m256 e[NV], o[NV];
  for (size_t i = 0; i < NV; ++i) e[i] = _mm256_loadu_ps(v + c0 + 8 * i);
  for (size_t a = 0; a < dk; ++a) {
    float* row = S + a * dv + c0;
    const __m256 ka = _mm256_set1_ps(k[a]);
    for (size_t i = 0; i < NV; ++i) {
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * i), d);
      _mm256_storeu_ps(row + 8 * i, s);
      e[i] = _mm256_fnmadd_ps(ka, s, e[i]);
    }
  }
  for (size_t i = 0; i < NV; ++i) {
    e[i] = _mm256_mul_ps(e[i], b);
    o[i] = _mm256_setzero_ps();
  }
  for (size_t a = 0; a < dk; ++a) {
    float* row = S + a * dv + c0;
    const __m256 ka = _mm256_set1_ps(k[a]), qa = _mm256_set1_ps(q[a]);
    for (size_t i = 0; i < NV; ++i) {
      const __m256 s = _mm256_fmadd_ps(ka, e[i], _mm256_loadu_ps(row + 8 * i));
      _mm256_storeu_ps(row + 8 * i, s);
      o[i] = _mm256_fmadd_ps(qa, s, o[i]);
    }
  }
  for (size_t i = 0; i < NV; ++i) _mm256_storeu_ps(out + c0 + 8 * i, o[i]);
}

// Columns [c0, c1), a multiple of 8 columns (dv is; the caller checks).
void delta_step_avx2_slab(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                          size_t dk, size_t dv, size_t c0, size_t c1, float* out) {
  switch ((c1 - c0) / 8) {
    case 1: return delta_step_avx2<1>(S, q, k, v, decay, beta, dk, dv, c0, out);
    case 2: return delta_step_avx2<2>(S, q, k, v, decay, beta, dk, dv, c0, out);
    case 3: return delta_step_avx2<3>(S, q, k, v, decay, beta, dk, dv, c0, out);
    default: return delta_step_avx2<4>(S, q, k, v, decay, beta, dk, dv, c0, out);
  }
}
#endif

}  // namespace

void gated_delta_rule(const float* mixed, const float* g, const float* beta, const DeltaNetShape& s, size_t tokens,
                      float* state, float* o, ThreadPool* pool) {
  const size_t dk = s.k_dim, dv = s.v_dim, channels = s.conv_dim(), heads_per_key = s.v_heads / s.k_heads;
  auto step = delta_step_portable;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (avx2_enabled() && dv % 8 == 0) step = delta_step_avx2_slab;
#endif
  const size_t slabs = (dv + kSlabColumns - 1) / kSlabColumns;
  std::vector<float> decay(tokens * s.v_heads);  // exp(g) once, not once per slab
  for (size_t i = 0; i < decay.size(); ++i) decay[i] = std::exp(g[i]);
  auto tasks = [&](size_t begin, size_t end) {
    for (size_t task = begin; task < end; ++task) {
      const size_t j = task / slabs, kh = j / heads_per_key;
      const size_t c0 = task % slabs * kSlabColumns, c1 = std::min(dv, c0 + kSlabColumns);
      for (size_t t = 0; t < tokens; ++t) {
        const float* q = mixed + t * channels + kh * dk;
        const float* v = mixed + t * channels + 2 * s.key_dim() + j * dv;
        step(state + j * dk * dv, q, q + s.key_dim(), v, decay[t * s.v_heads + j], beta[t * s.v_heads + j], dk, dv,
             c0, c1, o + (t * s.v_heads + j) * dv);
      }
    }
  };
  const size_t per_task = tokens * dk * kSlabColumns * 4;
  if (pool) pool->parallel_for(s.v_heads * slabs, std::max<size_t>(1, ThreadPool::kMinOps / per_task), tasks);
  else tasks(0, s.v_heads * slabs);
}

}  // namespace lily::cpu
