// Gated full attention (reference.py), the CPU twin of metal/attention_prep.metal, attention.metal and
// attention_prefill.metal: attention_prep_f32_d<D> (q/k RMSNorm, partial RoPE, the [query | gate] split, the KV-cache
// write), attention_decode[_unpacked|_plain]_f32_d<D> and attention_prefill[_unpacked]_f32_d<D> (one function: a
// query row sees its causal prefix of the caches [Hkv, capacity, D]; the variants only differ in GPU work layout).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../../../metal/lily.h"
#include "kernels.h"

namespace lily::cpu {

namespace {

// inv_freq[i] = 1 / theta^(2i / R) with exponent, power and reciprocal each rounded once to fp32, as the reference
// and attention_prep.metal form them.
std::vector<float> rope_inv_freq(size_t rotary_dim, float theta) {
  std::vector<float> inv(rotary_dim / 2);
  for (size_t i = 0; i < inv.size(); ++i) {
    const float exponent = float(double(2 * i) / double(rotary_dim));
    const float power = float(std::pow(double(theta), double(exponent)));
    inv[i] = float(1.0 / double(power));
  }
  return inv;
}

// Rotate-half RoPE on the first rotary_dim dims of one head; angles formed in fp32, as the reference does.
void rope(float* x, size_t rotary_dim, const float* inv_freq, size_t position) {
  const size_t half = rotary_dim / 2;
  for (size_t d = 0; d < half; ++d) {
    const double angle = double(float(position) * inv_freq[d]);
    const double c = std::cos(angle), s = std::sin(angle), first = x[d], second = x[d + half];
    x[d] = float(first * c - second * s);
    x[d + half] = float(second * c + first * s);
  }
}

void attention_prep_kernel(const KernelCall& c) {
  const auto a = c.args<AttentionPrepArgs>();
  const size_t d = c.dim, T = a.num_tokens, Hq = a.num_heads, Hkv = a.num_kv_heads;
  const float *q_and_gate = c.at<const float>(1), *k = c.at<const float>(2), *v = c.at<const float>(3);
  const float *q_norm = c.at<const float>(4), *k_norm = c.at<const float>(5);
  float *q = c.at<float>(6), *gate = c.at<float>(7), *k_cache = c.at<float>(8), *v_cache = c.at<float>(9);
  const std::vector<float> inv_freq = rope_inv_freq(a.rotary_dim, a.rope_theta);
  // Rows t * (Hq + Hkv) + h: a query head, or a key head (which also copies its value row).
  c.pool.for_items(T * (Hq + Hkv), 8 * d, [&](size_t r0, size_t r1) {
    for (size_t row = r0; row < r1; ++row) {
      const size_t t = row / (Hq + Hkv), h = row % (Hq + Hkv), position = a.first_position + t;
      if (h < Hq) {
        const float* src = q_and_gate + (t * Hq + h) * 2 * d;
        float* qh = q + (t * Hq + h) * d;
        rms_norm(src, 1, d, q_norm, a.eps, qh);
        rope(qh, a.rotary_dim, inv_freq.data(), position);
        std::memcpy(gate + (t * Hq + h) * d, src + d, d * sizeof(float));
      } else {
        const size_t kv = h - Hq, cache_row = (kv * a.cache_capacity + position) * d;
        float* kh = k_cache + cache_row;
        rms_norm(k + (t * Hkv + kv) * d, 1, d, k_norm, a.eps, kh);
        rope(kh, a.rotary_dim, inv_freq.data(), position);
        std::memcpy(v_cache + cache_row, v + (t * Hkv + kv) * d, d * sizeof(float));
      }
    }
  });
}

// q [T, Hq, D], gate, the caches and out [T, Hq, D]: buffers 1 to 5 of every attention kernel.
void attention_kernel(const KernelCall& c) {
  const auto a = c.args<AttentionArgs>();
  const AttentionShape s{a.num_heads, a.num_kv_heads, c.dim, a.cache_capacity};
  attention(c.at<const float>(1), c.at<const float>(3), c.at<const float>(4), c.at<const float>(2), s,
            a.num_queries, a.num_keys - a.num_queries, a.scale, c.at<float>(5), &c.pool);
}

}  // namespace

void attention(const float* q, const float* keys, const float* values, const float* gate, const AttentionShape& s,
               size_t tokens, size_t first, float scale, float* out, ThreadPool* pool) {
  const size_t d = s.head_dim, group = s.heads / s.kv_heads, head_stride = s.capacity * d;
  auto rows = [&](size_t begin, size_t end) {
    thread_local std::vector<float> scores;
    for (size_t item = begin; item < end; ++item) {
      const size_t t = item / s.heads, h = item % s.heads, kv = h / group, keys_seen = first + t + 1;
      const float* qh = q + item * d;
      const float* k = keys + kv * head_stride;
      scores.resize(keys_seen);
      float max_score = -INFINITY;
      for (size_t j = 0; j < keys_seen; ++j) {
        scores[j] = dot(qh, k + j * d, d) * scale;
        max_score = std::max(max_score, scores[j]);
      }
      double sum = 0;
      for (size_t j = 0; j < keys_seen; ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        sum += scores[j];
      }
      float* o = out + item * d;
      weighted_sum(scores.data(), values + kv * head_stride, keys_seen, d, d, o);
      const float* g = gate + item * d;
      const float inverse_sum = float(1.0 / sum);
      for (size_t i = 0; i < d; ++i) o[i] = o[i] * inverse_sum * sigmoid(g[i]);
    }
  };
  // Split only when each thread gets enough work to pay for handing it over.
  const size_t per_item = (first + tokens) * d * 2;
  if (pool) pool->parallel_for(tokens * s.heads, std::max<size_t>(1, ThreadPool::kMinOps / per_item), rows);
  else rows(0, tokens * s.heads);
}

void add_attention_kernels(KernelTable& table) {
  const std::vector<size_t> head_dims{64, 256};
  table.add("attention_prep_f32_d#", attention_prep_kernel, head_dims);
  for (const char* variant : {"", "unpacked_", "plain_"}) {
    table.add(std::string("attention_decode_") + variant + "f32_d#", attention_kernel, head_dims);
  }
  for (const char* variant : {"", "unpacked_"}) {
    table.add(std::string("attention_prefill_") + variant + "f32_d#", attention_kernel, head_dims);
  }
}

}  // namespace lily::cpu
