// rms_norm and gated_rms_norm (reference.py): sums in double, rounded once to float (the gate of gated_rms_norm,
// SiLU(z), in float); the kernels rms_norm_f32 and rms_norm_residual_f32 (metal/rms_norm.metal).
#include <algorithm>
#include <cmath>
#include <vector>

#include "../../../metal/lily.h"
#include "kernels.h"

namespace lily::cpu {

// Eight running sums (element i in sum i % 8), added pairwise at the end: one order on every instruction set, and
// not one chain of n dependent double adds (a 256-value norm took ~0.35 us that way; 8 rows, a whole dispatch).
double sum_of_squares(const float* x, size_t n) {
  double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (size_t j = 0; j < 8; ++j) s[j] += double(x[i + j]) * x[i + j];
  for (; i < n; ++i) s[i % 8] += double(x[i]) * x[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

namespace {
double inverse_rms(const float* x, size_t n, float eps) {
  return 1.0 / std::sqrt(sum_of_squares(x, n) / double(n) + eps);
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

void add_rms_norm_kernels(KernelTable& table) {
  // One row per threadgroup of the grid.
  table.add("rms_norm_f32", [](const KernelCall& c) {
    const auto a = c.args<RmsNormArgs>();
    const size_t n = a.row_length;
    const float *x = c.at<const float>(1), *w = c.at<const float>(2);
    float* out = c.at<float>(3);
    c.pool.for_items(c.groups.width, 4 * n,
                     [&](size_t r0, size_t r1) { rms_norm(x + r0 * n, r1 - r0, n, w, a.eps, out + r0 * n); });
  });
  // sum = x + residual (may alias residual), out = rms_norm(sum) * w.
  table.add("rms_norm_residual_f32", [](const KernelCall& c) {
    const auto a = c.args<RmsNormArgs>();
    const size_t n = a.row_length;
    const float *x = c.at<const float>(1), *residual = c.at<const float>(2), *w = c.at<const float>(3);
    float *out = c.at<float>(4), *sum = c.at<float>(5);
    c.pool.for_items(c.groups.width, 5 * n, [&](size_t r0, size_t r1) {
      for (size_t i = r0 * n; i < r1 * n; ++i) sum[i] = x[i] + residual[i];
      rms_norm(sum + r0 * n, r1 - r0, n, w, a.eps, out + r0 * n);
    });
  });
}

}  // namespace lily::cpu
