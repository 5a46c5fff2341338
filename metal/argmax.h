// The argmax order and its threadgroup reduction: argmax_partial / argmax_final (sampling.metal) and the lm_head GEMV
// that keeps its threadgroup's best logit as it writes them (qmv_norm_argmax_staged, qmatmul.metal). One order for
// both, so a greedy token is the same whichever kernels reduced the logits: the order is total (NaN first, then the
// larger value, then the lower id), so any partition of the logits and any reduction order give the same winner.
#ifndef LILY_ARGMAX_H
#define LILY_ARGMAX_H

#include <metal_stdlib>
#include "lily.h"

using namespace metal;

// `a` (value, id) is a better argmax than `b`: NaN first, then the larger value, then the lower id.
inline bool argmax_better(float a, uint a_id, float b, uint b_id) {
  const bool a_nan = isnan(a);
  const bool b_nan = isnan(b);
  if (a_nan != b_nan) {
    return a_nan;
  }
  if (a_nan || a == b) {
    return a_id < b_id;
  }
  return a > b;
}

// Reduces every thread's (value, id) to the best one, returned to all threads. Threads per threadgroup must be a
// multiple of 32.
inline void argmax_threadgroup(thread float& value, thread uint& id, threadgroup float* values_tg,
                               threadgroup uint* ids_tg, uint lane, uint sg, uint n_sg) {
  for (ushort offset = 16; offset > 0; offset /= 2) {
    const float other = simd_shuffle_xor(value, offset);
    const uint other_id = simd_shuffle_xor(id, offset);
    if (argmax_better(other, other_id, value, id)) {
      value = other;
      id = other_id;
    }
  }
  if (lane == 0) {
    values_tg[sg] = value;
    ids_tg[sg] = id;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = 0; s < n_sg; ++s) {
    if (argmax_better(values_tg[s], ids_tg[s], value, id)) {
      value = values_tg[s];
      id = ids_tg[s];
    }
  }
}

#endif  // LILY_ARGMAX_H
