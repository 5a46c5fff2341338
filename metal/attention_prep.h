// The row transform of attention_prep (attention_prep.metal), which the decode attention kernels with the prep fused
// (attention_decode[_partial]_prep_mma in attention.metal) run as well: one head row RMS-normed over its D dims with
// the multiplier (canonical 1+w), its first rotary_dim dims roped (rotate-half pairing (d, d + rotary_dim/2),
// inv_freq = theta^(-2i/rotary_dim)). One source, so a fused kernel's q and cache rows are the prep kernel's bits.
// Numerics: fp32 throughout (sum of squares, norm, angle, rotation); the caller rounds once as it stores.
#ifndef LILY_ATTENTION_PREP_H
#define LILY_ATTENTION_PREP_H

#include <metal_stdlib>
#include "lily.h"

using namespace metal;

// The rotated value of element e of a normalised row (e < rotary_dim), given the normalised partner element.
inline float rope_rotate_element(float value, float partner, uint e, uint rotary_dim, float position, float theta) {
  const uint half_dim = rotary_dim / 2;
  const uint pair = e < half_dim ? e : e - half_dim;
  // fp32 like the reference: exponent 2i/R, theta^exponent, reciprocal, times the position.
  const float inv_freq = 1.0f / precise::pow(theta, float(2 * pair) / float(rotary_dim));
  const float angle = position * inv_freq;
  const float c = precise::cos(angle);
  const float s = precise::sin(angle);
  // rotate_half: first half gets x*cos - x_partner*sin, second half x*cos + x_partner*sin.
  return e < half_dim ? value * c - partner * s : value * c + partner * s;
}

// A lane's share of a prepared row: chunk c holds elements 4 (lane + 32 c) .. + 3, so consecutive lanes touch
// consecutive chunks (coalesced). At D = 64 the row is 16 chunks: lanes 16..31 hold none (attn_prep_lane_active).
template <uint D>
struct AttnPrepRow {
  float4 chunk[(D / 4 + 31) / 32];
};

template <uint D>
inline bool attn_prep_lane_active(uint simd_lane) {
  return simd_lane < D / 4;
}

// Row x (D elements) normed with `weight` and roped at `position`. Every lane of the simdgroup must call it (one
// simd_sum); an inactive lane's chunks are 0.
template <typename T, uint D>
LILY_INLINE AttnPrepRow<D> attention_prep_row(device const T* x, device const T* weight, float position,
                                              uint rotary_dim, float theta, float eps, uint simd_lane) {
  static_assert(D % 128 == 0 || D == 64, "head_dim must be 64 or a multiple of 128 (4 elements x 32 lanes)");
  constexpr uint CPL = (D / 4 + 31) / 32;
  const bool lane_active = attn_prep_lane_active<D>(simd_lane);
  float4 values[CPL];
  float sum_sq = 0.0f;
  for (uint c = 0; c < CPL; ++c) {
    values[c] = lane_active ? lily::attn_load4(x + 4 * (simd_lane + 32 * c)) : float4(0.0f);
    sum_sq += dot(values[c], values[c]);
  }
  const float inv_rms = precise::rsqrt(simd_sum(sum_sq) / float(D) + eps);

  AttnPrepRow<D> row;
  for (uint c = 0; c < CPL; ++c) {
    float4 r = float4(0.0f);  // built whole, then stored: clang 19's NVPTX back end miscompiled rotated[c][j] = ...
    for (uint j = 0; j < 4 && lane_active; ++j) {
      const uint e = 4 * (simd_lane + 32 * c) + j;
      const float y = values[c][j] * inv_rms * float(weight[e]);
      if (e < rotary_dim) {
        // The partner may live in another lane: recompute its normalised value from memory (a cached re-read of
        // rotary_dim elements) rather than shuffle, which keeps this independent of head_dim and rotary_dim.
        const uint partner = e < rotary_dim / 2 ? e + rotary_dim / 2 : e - rotary_dim / 2;
        const float y_partner = float(x[partner]) * inv_rms * float(weight[partner]);
        r[j] = rope_rotate_element(y, y_partner, e, rotary_dim, position, theta);
      } else {
        r[j] = y;
      }
    }
    row.chunk[c] = r;
  }
  return row;
}

#endif  // LILY_ATTENTION_PREP_H
