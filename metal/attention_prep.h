// The row transform of attention_prep (attention_prep.metal), which the decode attention kernels with the prep fused
// (attention_decode[_partial]_prep_mma in attention.metal) run as well: one head row RMS-normed over its D dims with
// the multiplier (canonical 1+w), its first rotary_dim dims roped (rotate-half pairing (d, d + rotary_dim/2),
// inv_freq = theta^(-2i/rotary_dim), each pair's cos and sin evaluated once per position: attention_rope_angles). One
// source, so a fused kernel's q and cache rows are the prep kernel's bits.
// Numerics: fp32 throughout (sum of squares, norm, angle, rotation); the caller rounds once as it stores.
#ifndef LILY_ATTENTION_PREP_H
#define LILY_ATTENTION_PREP_H

#include <metal_stdlib>
#include "lily.h"

using namespace metal;

// The cos and sin of one position's rotary angles, for the rotation of attention_prep_row: lane l holds those of
// the pairs l, l + 32, ... (pair i's angle is position * inv_freq_i, inv_freq_i = theta^(-2i/R)), so a row costs
// each lane one evaluation per 32 pairs (one at the model's R = 64) instead of one per rotated element it holds (four
// at R = 64), and an element takes its pair's values by a shuffle (exact: the same bits as computing them itself).
template <uint D>
struct AttnRopeAngles {
  float cos_of[(D / 2 + 31) / 32];
  float sin_of[(D / 2 + 31) / 32];
};

template <uint D>
LILY_INLINE AttnRopeAngles<D> attention_rope_angles(float position, uint rotary_dim, float theta, uint simd_lane) {
  AttnRopeAngles<D> angles;
  LILY_UNROLL
  for (uint slot = 0; slot < (D / 2 + 31) / 32; ++slot) {
    const uint pair = simd_lane + 32 * slot;
    float c = 1.0f, s = 0.0f;
    if (pair < rotary_dim / 2) {
      // fp32 like the reference: exponent 2i/R, theta^exponent, reciprocal, times the position.
      const float inv_freq = 1.0f / precise::pow(theta, float(2 * pair) / float(rotary_dim));
      const float angle = position * inv_freq;
      c = precise::cos(angle);
      s = precise::sin(angle);
    }
    angles.cos_of[slot] = c;
    angles.sin_of[slot] = s;
  }
  return angles;
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

// Row x (D elements) normed with `weight` and roped with `angles` (attention_rope_angles of the row's position: a
// simdgroup whose rows share a position evaluates them once). Every lane of the simdgroup must call it (one simd_sum,
// the shuffles of the angles); an inactive lane's chunks are 0.
template <typename T, uint D>
LILY_INLINE AttnPrepRow<D> attention_prep_row(device const T* x, device const T* weight,
                                              thread const AttnRopeAngles<D>& angles, uint rotary_dim, float eps,
                                              uint simd_lane) {
  static_assert(D % 128 == 0 || D == 64, "head_dim must be 64 or a multiple of 128 (4 elements x 32 lanes)");
  constexpr uint CPL = (D / 4 + 31) / 32;
  constexpr uint SLOTS = (D / 2 + 31) / 32;
  const bool lane_active = attn_prep_lane_active<D>(simd_lane);
  float4 values[CPL];
  float sum_sq = 0.0f;
  for (uint c = 0; c < CPL; ++c) {
    values[c] = lane_active ? lily::attn_load4(x + 4 * (simd_lane + 32 * c)) : float4(0.0f);
    sum_sq += dot(values[c], values[c]);
  }
  const float inv_rms = precise::rsqrt(simd_sum(sum_sq) / float(D) + eps);

  const uint half_dim = rotary_dim / 2;
  AttnPrepRow<D> row;
  LILY_UNROLL
  for (uint c = 0; c < CPL; ++c) {
    float4 r = float4(0.0f);  // built whole, then stored: clang 19's NVPTX back end miscompiled rotated[c][j] = ...
    LILY_UNROLL
    for (uint j = 0; j < 4; ++j) {
      const uint e = 4 * (simd_lane + 32 * c) + j;
      // The pair's cos and sin from the lane that holds them; the same shuffles on every lane (element 0's pair
      // where e is not rotated), and none in a chunk column past rotary_dim (a condition uniform over the lanes).
      const uint pair = e < rotary_dim ? (e < half_dim ? e : e - half_dim) : 0;
      float pair_cos = 1.0f, pair_sin = 0.0f;
      if (128 * c < rotary_dim) {
        LILY_UNROLL
        for (uint slot = 0; slot < SLOTS; ++slot) {
          if (32 * slot < half_dim) {
            const float c_from = simd_shuffle(angles.cos_of[slot], ushort(pair % 32));
            const float s_from = simd_shuffle(angles.sin_of[slot], ushort(pair % 32));
            if (pair / 32 == slot) {
              pair_cos = c_from;
              pair_sin = s_from;
            }
          }
        }
      }
      if (!lane_active) {
        continue;
      }
      const float y = values[c][j] * inv_rms * float(weight[e]);
      if (e < rotary_dim) {
        // The partner may live in another lane: recompute its normalised value from memory (a cached re-read of
        // rotary_dim elements) rather than shuffle, which keeps this independent of head_dim and rotary_dim.
        const uint partner = e < half_dim ? e + half_dim : e - half_dim;
        const float y_partner = float(x[partner]) * inv_rms * float(weight[partner]);
        // rotate_half: first half gets x*cos - x_partner*sin, second half x*cos + x_partner*sin.
        r[j] = e < half_dim ? y * pair_cos - y_partner * pair_sin : y * pair_cos + y_partner * pair_sin;
      } else {
        r[j] = y;
      }
    }
    row.chunk[c] = r;
  }
  return row;
}

#endif  // LILY_ATTENTION_PREP_H
