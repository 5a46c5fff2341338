// attention_prep and attention (reference.py "Gated full attention"), the CPU twin of metal/attention*.metal.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_ops.h"

namespace lily::cpu {

namespace {
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
}  // namespace

void attention_prep(const float* q_and_gate, float* k, const AttentionShape& s, size_t tokens, const float* q_norm,
                    const float* k_norm, const float* inv_freq, size_t position, float eps, float* q, float* gate) {
  const size_t d = s.head_dim;
  for (size_t t = 0; t < tokens; ++t) {
    for (size_t h = 0; h < s.heads; ++h) {
      const float* src = q_and_gate + (t * s.heads + h) * 2 * d;
      float* qh = q + (t * s.heads + h) * d;
      rms_norm(src, 1, d, q_norm, eps, qh);
      rope(qh, s.rotary_dim, inv_freq, position + t);
      std::memcpy(gate + (t * s.heads + h) * d, src + d, d * sizeof(float));
    }
    for (size_t h = 0; h < s.kv_heads; ++h) {
      float* kh = k + (t * s.kv_heads + h) * d;
      rms_norm(kh, 1, d, k_norm, eps, kh);
      rope(kh, s.rotary_dim, inv_freq, position + t);
    }
  }
}

void attention(const float* q, const float* keys, const float* values, const float* gate, const AttentionShape& s,
               size_t tokens, size_t offset, float* out, ThreadPool* pool) {
  const size_t d = s.head_dim, group = s.heads / s.kv_heads, row = s.kv_heads * d;
  const float scale = float(1.0 / std::sqrt(double(d)));
  auto rows = [&](size_t begin, size_t end) {
    thread_local std::vector<float> scores;
    for (size_t item = begin; item < end; ++item) {
      const size_t t = item / s.heads, h = item % s.heads, kv = h / group, keys_seen = offset + t + 1;
      const float* qh = q + item * d;
      scores.resize(keys_seen);
      float max_score = -INFINITY;
      for (size_t j = 0; j < keys_seen; ++j) {
        scores[j] = dot(qh, keys + j * row + kv * d, d) * scale;
        max_score = std::max(max_score, scores[j]);
      }
      double sum = 0;
      for (size_t j = 0; j < keys_seen; ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        sum += scores[j];
      }
      float* o = out + item * d;
      weighted_sum(scores.data(), values + kv * d, keys_seen, row, d, o);
      const float* g = gate + item * d;
      const float inverse_sum = float(1.0 / sum);
      for (size_t i = 0; i < d; ++i) o[i] = o[i] * inverse_sum * sigmoid(g[i]);
    }
  };
  // Split only when each thread gets enough work to pay for handing it over.
  const size_t per_item = (offset + tokens) * d * 2;
  if (pool) pool->parallel_for(tokens * s.heads, std::max<size_t>(1, ThreadPool::kMinOps / per_item), rows);
  else rows(0, tokens * s.heads);
}

}  // namespace lily::cpu
