// rms_norm, gated_rms_norm and l2_normalize (reference.py): sums in double, rounded once to float (the gate of
// gated_rms_norm, SiLU(z), in float).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_ops.h"

namespace lily::cpu {

namespace {
double inverse_rms(const float* x, size_t n, float eps) {
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += double(x[i]) * x[i];
  return 1.0 / std::sqrt(sum / double(n) + eps);
}
}  // namespace

void rms_norm(const float* x, size_t rows, size_t n, const float* w, float eps, float* out) {
  for (size_t r = 0; r < rows; ++r) {
    const double inv = inverse_rms(x + r * n, n, eps);
    for (size_t i = 0; i < n; ++i) out[r * n + i] = float(x[r * n + i] * inv * w[i]);
  }
}

void gated_rms_norm(const float* o, const float* z, size_t rows, size_t n, const float* w, float eps, float* out) {
  thread_local std::vector<float> normed;
  normed.resize(n);
  for (size_t r = 0; r < rows; ++r) {
    const double inv = inverse_rms(o + r * n, n, eps);
    for (size_t i = 0; i < n; ++i) normed[i] = float(o[r * n + i] * inv * w[i]);
    // SiLU(z) in float on the chosen instruction set (a double exp per value cost more than the whole norm).
    std::copy(z + r * n, z + (r + 1) * n, out + r * n);
    silu(out + r * n, normed.data(), n);
  }
}

void l2_normalize(float* x, size_t rows, size_t n, float scale) {
  for (size_t r = 0; r < rows; ++r) {
    float* v = x + r * n;
    double sum = 0;
    for (size_t i = 0; i < n; ++i) sum += double(v[i]) * v[i];
    const double inv = 1.0 / std::sqrt(sum + 1e-6);
    for (size_t i = 0; i < n; ++i) v[i] = float(v[i] * inv) * scale;
  }
}

}  // namespace lily::cpu
