// Gated DeltaNet (reference.py), the CPU twin of metal/gated_delta.metal and gated_delta_prefill.metal:
//   gated_delta_conv_f32_dk<Dk>, gated_delta_conv_state_f32_dk<Dk>  the causal conv + SiLU into an f32 [T, C], then
//                                                                   the conv state (the last K - 1 raw inputs)
//   gated_delta_prefill[_blockwise]_f32_dk<Dk>                      the recurrence over T tokens into an f32 o
//   gated_delta_prefill_norm_f32                                    the SiLU(z)-gated RMSNorm of o
//   gated_delta_step_f32_dk<Dk>                                     one token: the three above in one node
// The step runs the same functions as the prefill kernels, so T steps and one prefill of T tokens give equal bits.
// The recurrent state is [Hv, dv, Dk] fp32: one contiguous Dk row per value channel, worked on row by row.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../../../metal/lily.h"
#include "avx2.h"
#include "kernels.h"

namespace lily::cpu {

namespace {

constexpr size_t kConvTaps = LILY_GDN_CONV_KERNEL;

DeltaNetShape shape(const KernelCall& c, const GatedDeltaArgs& a) {
  return {a.num_k_heads, a.num_v_heads, c.dim, a.head_v_dim, kConvTaps};
}

// conv_out [T, C] = SiLU(causal depthwise conv) of [conv_state (K-1 rows); qkv (T rows)], weights [C, K].
void conv(const float* qkv, size_t tokens, size_t channels, const float* weight, const float* conv_state,
          float* conv_out, ThreadPool& pool) {
  const size_t history = kConvTaps - 1;
  // The weights tap-major, so that each tap is one pass over a row with channels innermost (which the compiler
  // vectorizes); each channel's sum still adds the taps in order.
  thread_local std::vector<float> taps;
  std::vector<float>& tap_major = taps;  // the caller's, also where the workers read it
  tap_major.resize(kConvTaps * channels);
  for (size_t c = 0; c < channels; ++c)
    for (size_t j = 0; j < kConvTaps; ++j) tap_major[j * channels + c] = load_f32(weight + c * kConvTaps + j);
  // Input row r of [state; qkv] for token t's tap j is r = t + j.
  auto input = [&](size_t r) { return r < history ? conv_state + r * channels : qkv + (r - history) * channels; };
  pool.for_items(tokens, channels * (kConvTaps + 8), [&](size_t t0, size_t t1) {
    for (size_t t = t0; t < t1; ++t) {
      float* sum = conv_out + t * channels;
      std::fill(sum, sum + channels, 0.0f);
      for (size_t j = 0; j < kConvTaps; ++j) {
        const float* tap = tap_major.data() + j * channels;
        const float* in = input(t + j);
        for (size_t c = 0; c < channels; ++c) sum[c] += tap[c] * in[c];
      }
      silu(sum, nullptr, channels);
    }
  });
}

// The conv state after T tokens: the last K - 1 rows of [state; qkv], in place.
void conv_state_update(const float* qkv, size_t tokens, size_t channels, float* conv_state) {
  const size_t history = kConvTaps - 1;
  if (tokens >= history) {
    std::memcpy(conv_state, qkv + (tokens - history) * channels, history * channels * sizeof(float));
    return;
  }
  std::memmove(conv_state, conv_state + tokens * channels, (history - tokens) * channels * sizeof(float));
  std::memcpy(conv_state + (history - tokens) * channels, qkv, tokens * channels * sizeof(float));
}

// One token of one state row S_c [dk] (value channel c): S *= decay; e = beta (v - S.k); S += e k; o = S.q.
float delta_row_portable(float* row, const float* q, const float* k, float decay, float beta, float v, size_t dk) {
  float kv = 0.0f;
  for (size_t a = 0; a < dk; ++a) {
    row[a] *= decay;
    kv += row[a] * k[a];
  }
  const float e = beta * (v - kv);
  float o = 0.0f;
  for (size_t a = 0; a < dk; ++a) {
    row[a] += k[a] * e;
    o += row[a] * q[a];
  }
  return o;
}

#ifdef LILY_CPU_X86
// The same step, 8 elements of the row at a time (dk a multiple of 8; the caller checks).
__attribute__((target("avx2,fma"))) float delta_row_avx2(float* row, const float* q, const float* k, float decay,
                                                         float beta, float v, size_t dk) {
  const __m256 d = _mm256_set1_ps(decay);
  __m256 kv = _mm256_setzero_ps();
  for (size_t a = 0; a < dk; a += 8) {
    const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + a), d);
    _mm256_storeu_ps(row + a, s);
    kv = _mm256_fmadd_ps(s, _mm256_loadu_ps(k + a), kv);
  }
  const __m256 e = _mm256_set1_ps(beta * (v - hsum(kv)));
  __m256 o = _mm256_setzero_ps();
  for (size_t a = 0; a < dk; a += 8) {
    const __m256 s = _mm256_fmadd_ps(_mm256_loadu_ps(k + a), e, _mm256_loadu_ps(row + a));
    _mm256_storeu_ps(row + a, s);
    o = _mm256_fmadd_ps(s, _mm256_loadu_ps(q + a), o);
  }
  return hsum(o);
}
#endif

// State rows per task: the rows of a value head are independent, so heads x slabs tasks keep every thread busy
// (4 value heads in the demo model).
constexpr size_t kSlabRows = 16;

// The recurrence over T tokens from conv_out [T, C] (q | k | v, after the conv), b and a [T, Hv]: q and k L2-normed
// (q times dk^-0.5), beta = sigmoid(b), decay = exp(-exp(A_log) softplus(a + dt_bias)); state [Hv, dv, Dk] updated,
// o [T, Hv, dv].
void scan(const float* conv_out, const float* b, const float* a, const float* a_log, const float* dt_bias,
          const DeltaNetShape& s, size_t tokens, float eps, float* state, float* o, ThreadPool& pool) {
  const size_t dk = s.k_dim, dv = s.v_dim, channels = s.conv_dim(), heads_per_key = s.v_heads / s.k_heads;
  // Normalised q and k [T, Hk, dk] and the gates [T, Hv], once per call (not once per slab).
  thread_local std::vector<float> qk_buffer, beta_buffer, decay_buffer;
  std::vector<float> &qk = qk_buffer, &beta = beta_buffer, &decay = decay_buffer;  // the caller's, for the workers
  qk.resize(tokens * 2 * s.key_dim());
  beta.resize(tokens * s.v_heads);
  decay.resize(tokens * s.v_heads);
  const float q_scale = float(1.0 / std::sqrt(double(dk)));
  for (size_t t = 0; t < tokens; ++t) {
    float* row = qk.data() + t * 2 * s.key_dim();
    std::memcpy(row, conv_out + t * channels, 2 * s.key_dim() * sizeof(float));
    for (size_t h = 0; h < 2 * s.k_heads; ++h) {
      float* v = row + h * dk;
      const double inv = 1.0 / std::sqrt(sum_of_squares(v, dk) + eps);
      const float scale = h < s.k_heads ? q_scale : 1.0f;
      for (size_t i = 0; i < dk; ++i) v[i] = float(v[i] * inv) * scale;
    }
    for (size_t h = 0; h < s.v_heads; ++h) {
      const size_t i = t * s.v_heads + h;
      const double u = double(a[i]) + double(load_f32(dt_bias + h));
      const double softplus = u > 20 ? u : u < -15 ? std::exp(u) : std::log1p(std::exp(u));
      beta[i] = sigmoid(b[i]);
      decay[i] = float(std::exp(-std::exp(double(load_f32(a_log + h))) * softplus));
    }
  }
  auto step = delta_row_portable;
#ifdef LILY_CPU_X86
  if (avx2_enabled() && dk % 8 == 0) step = delta_row_avx2;
#endif
  const size_t slabs = (dv + kSlabRows - 1) / kSlabRows;
  pool.parallel_for(s.v_heads * slabs, std::max<size_t>(1, ThreadPool::kMinOps / (tokens * dk * kSlabRows * 4)),
                    [&](size_t begin, size_t end) {
    for (size_t task = begin; task < end; ++task) {
      const size_t j = task / slabs, kh = j / heads_per_key;
      const size_t r0 = task % slabs * kSlabRows, r1 = std::min(dv, r0 + kSlabRows);
      float* head = state + j * dv * dk;
      for (size_t t = 0; t < tokens; ++t) {
        const float* q = qk.data() + t * 2 * s.key_dim() + kh * dk;
        const float* k = q + s.key_dim();
        const float* v = conv_out + t * channels + 2 * s.key_dim() + j * dv;
        const float bt = beta[t * s.v_heads + j], dt = decay[t * s.v_heads + j];
        float* out = o + (t * s.v_heads + j) * dv;
        for (size_t r = r0; r < r1; ++r) out[r] = step(head + r * dk, q, k, dt, bt, v[r], dk);
      }
    }
  });
}

// out [T, Hv, dv] = rms_norm(o) * w * SiLU(z), per (token, value head) row.
void gated_norm(const float* o, const float* z, const float* weight, size_t rows, size_t dv, float eps, float* out,
                ThreadPool& pool) {
  pool.for_items(rows, dv * 8, [&](size_t r0, size_t r1) {
    gated_rms_norm(o + r0 * dv, z + r0 * dv, r1 - r0, dv, weight, eps, out + r0 * dv);
  });
}

void conv_kernel(const KernelCall& c) {
  const auto a = c.args<GatedDeltaArgs>();
  const DeltaNetShape s = shape(c, a);
  conv(c.at<const float>(1), a.num_tokens, s.conv_dim(), c.at<const float>(2), c.at<const float>(3),
       c.at<float>(4), c.pool);
}

void conv_state_kernel(const KernelCall& c) {
  const auto a = c.args<GatedDeltaArgs>();
  conv_state_update(c.at<const float>(1), a.num_tokens, shape(c, a).conv_dim(), c.at<float>(2));
}

void scan_kernel(const KernelCall& c) {
  const auto a = c.args<GatedDeltaArgs>();
  scan(c.at<const float>(1), c.at<const float>(2), c.at<const float>(3), c.at<const float>(4), c.at<const float>(5),
       shape(c, a), a.num_tokens, a.l2_eps, c.at<float>(6), c.at<float>(7), c.pool);
}

void norm_kernel(const KernelCall& c) {
  const auto a = c.args<GatedDeltaArgs>();
  gated_norm(c.at<const float>(1), c.at<const float>(2), c.at<const float>(3), size_t(a.num_tokens) * a.num_v_heads,
             a.head_v_dim, a.norm_eps, c.at<float>(4), c.pool);
}

// qkv, z, b, a, conv weight, A_log, dt_bias, norm weight, conv state, recurrent state, out: buffers 1 to 11.
void step_kernel(const KernelCall& c) {
  const auto a = c.args<GatedDeltaArgs>();
  const DeltaNetShape s = shape(c, a);
  thread_local std::vector<float> conv_out, o;
  conv_out.resize(s.conv_dim());
  o.resize(s.value_dim());
  const float* qkv = c.at<const float>(1);
  float* conv_state = c.at<float>(9);
  conv(qkv, 1, s.conv_dim(), c.at<const float>(5), conv_state, conv_out.data(), c.pool);
  conv_state_update(qkv, 1, s.conv_dim(), conv_state);
  scan(conv_out.data(), c.at<const float>(3), c.at<const float>(4), c.at<const float>(6), c.at<const float>(7), s, 1,
       a.l2_eps, c.at<float>(10), o.data(), c.pool);
  gated_norm(o.data(), c.at<const float>(2), c.at<const float>(8), s.v_heads, s.v_dim, a.norm_eps, c.at<float>(11),
             c.pool);
}

}  // namespace

void add_gated_delta_kernels(KernelTable& table) {
  const std::vector<size_t> key_dims{64, 128};
  table.add("gated_delta_conv_f32_dk#", conv_kernel, key_dims);
  table.add("gated_delta_conv_state_f32_dk#", conv_state_kernel, key_dims);
  table.add("gated_delta_prefill_f32_dk#", scan_kernel, key_dims);
  table.add("gated_delta_prefill_blockwise_f32_dk#", scan_kernel, key_dims);
  table.add("gated_delta_prefill_norm_f32", norm_kernel);
  table.add("gated_delta_step_f32_dk#", step_kernel, key_dims);
}

}  // namespace lily::cpu
