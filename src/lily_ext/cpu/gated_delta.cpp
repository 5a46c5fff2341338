// causal_conv1d and gated_delta_rule (reference.py "Gated DeltaNet"), the CPU twin of metal/gated_delta.metal:
// the recurrence runs token by token on the fp32 state, one value head per task.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_ops.h"

namespace lily::cpu {

void causal_conv1d(float* x, size_t tokens, size_t channels, size_t taps, const float* w, float* conv_state) {
  const size_t history_rows = taps - 1;
  // history = [conv_state; x]: row r < K-1 is state row r, row K-1+t is input t.
  std::vector<float> history((history_rows + tokens) * channels);
  std::memcpy(history.data(), conv_state, history_rows * channels * sizeof(float));
  std::memcpy(history.data() + history_rows * channels, x, tokens * channels * sizeof(float));
  for (size_t t = 0; t < tokens; ++t)
    for (size_t c = 0; c < channels; ++c) {
      double sum = 0;
      for (size_t j = 0; j < taps; ++j) sum += double(w[c * taps + j]) * history[(t + j) * channels + c];
      x[t * channels + c] = float(sum / (1.0 + std::exp(-sum)));
    }
  std::memcpy(conv_state, history.data() + tokens * channels, history_rows * channels * sizeof(float));
}

void gated_delta_rule(const float* mixed, const float* g, const float* beta, const DeltaNetShape& s, size_t tokens,
                      float* state, float* o, ThreadPool* pool) {
  const size_t dk = s.k_dim, dv = s.v_dim, channels = s.conv_dim(), heads_per_key = s.v_heads / s.k_heads;
  auto heads = [&](size_t begin, size_t end) {
    std::vector<float> error(dv);
    for (size_t j = begin; j < end; ++j) {
      const size_t kh = j / heads_per_key;
      float* S = state + j * dk * dv;
      for (size_t t = 0; t < tokens; ++t) {
        const float* q = mixed + t * channels + kh * dk;
        const float* k = q + s.key_dim();
        const float* v = mixed + t * channels + 2 * s.key_dim() + j * dv;
        const float decay = std::exp(g[t * s.v_heads + j]), b = beta[t * s.v_heads + j];
        // S *= decay; error = v - S^T k
        std::memcpy(error.data(), v, dv * sizeof(float));
        for (size_t a = 0; a < dk; ++a) {
          float* row = S + a * dv;
          const float ka = k[a];
          for (size_t c = 0; c < dv; ++c) {
            row[c] *= decay;
            error[c] -= ka * row[c];
          }
        }
        // S += k (beta error)^T; o = S^T q after the write
        for (size_t c = 0; c < dv; ++c) error[c] *= b;
        float* out = o + (t * s.v_heads + j) * dv;
        std::memset(out, 0, dv * sizeof(float));
        for (size_t a = 0; a < dk; ++a) {
          float* row = S + a * dv;
          const float ka = k[a], qa = q[a];
          for (size_t c = 0; c < dv; ++c) {
            row[c] += ka * error[c];
            out[c] += qa * row[c];
          }
        }
      }
    }
  };
  const size_t per_head = tokens * dk * dv * 4;
  if (pool) pool->parallel_for(s.v_heads, std::max<size_t>(1, (size_t(1) << 15) / per_head), heads);
  else heads(0, s.v_heads);
}

}  // namespace lily::cpu
