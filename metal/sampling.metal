// Token selection on the GPU: the chosen id (uint32) goes to tokens[out_index], where the next step's embedding
// kernel reads it, so the decode loop never waits for the CPU.
//   argmax_partial_<dtype>  greedy (temperature 0), stage 1: each threadgroup reduces a block of LILY_ARGMAX_BLOCK
//                           logits to (value, id). ~61 threadgroups for the 248320-entry vocabulary.
//   argmax_final_f32        greedy, stage 2: one threadgroup reduces the partials and writes the token.
//                           Ties go to the lowest id; a NaN beats every number (numpy.argmax semantics).
//   sample_<dtype>          temperature > 0, the general path: temperature, top-k, top-p, min-p, then a Philox4x32-10
//                           draw keyed by the request seed with counter (step, 0, 0, 0); one threadgroup of up to
//                           1024 threads over the whole vocabulary.
//   sample_partial_<dtype>  the block path, stage 1 (the host's choice, tuning::sample_block_path: every request
//                           but top_k above the candidates' count): one threadgroup per LILY_SAMPLE_BLOCK logits
//                           writes the block's max x, its sum of exp(x - max) and, unless the request is plain
//                           temperature sampling, its LILY_SAMPLE_CANDIDATES largest x in id order.
//   sample_final_<dtype>    the block path, stage 2, one threadgroup: the same steps and draw as sample_* over the
//                           candidates when they hold every token the filters keep (checked against each block's
//                           C-th key), or for plain temperature the block from the block masses and the token from
//                           one scan of it; else sample_*'s steps over the whole vocabulary.
//   penalize_logits_<dtype> lily.sampling steps 1-3 before either choice, for requests with a logit bias or a
//                           penalty: fp32 logits x = logit + bias, divided (x > 0) or multiplied (x <= 0) by the
//                           repetition penalty where `seen` marks the id, minus presence + frequency · count where the
//                           decode chose the id `count` times. One thread per logit; the choice then reads x (f32).
//   count_token             after the choice of a penalized request: marks tokens[out_index] seen and counts it, so
//                           the next step's penalize_logits sees it (the host never learns the token in between).
// Sampling follows lily.sampling step 4-6: x = logit / temperature; top-k keeps every x >= the k-th largest (ties
// kept); top-p keeps the shortest head, in descending order with ties by lowest id, whose mass before each kept token
// is < top_p; min-p keeps p >= min_p * p_max; the token is the first id whose cumulative kept mass (in id order)
// exceeds u * (kept mass), u = (philox.x >> 8) * 2^-24. Order statistics use radix select over the order-preserving
// uint32 key of x: 8 passes of 4-bit digits, per-digit counts and masses reduced with fixed-order sums (no float
// atomics), so the same seed and step give the same token on every run. The block path draws from the same
// distribution with the same u; its sums run in another order, so a draw within fp32 rounding of a boundary may pick
// the neighbouring token of sample_*'s.
// Threadgroups: any multiple of 32 threads (argmax shuffles across whole simdgroups), at most LILY_SAMPLE_THREADS for
// sample_* and sample_final_*; sample_partial_* needs block_size <= threads * LILY_SAMPLE_PER_THREAD.
// Cost: sample_* reads the logits ~3 times plus 8 times for top-k and 8 for top-p (about 20 x 1 MB at f32 for this
// model's vocabulary, from cache, in one threadgroup); the block path reads them once in many threadgroups, then works
// on 64 candidates per block or on one block. Verified here for correctness only.
#include <metal_stdlib>
#include "argmax.h"
#include "lily.h"

using namespace metal;

template <typename T>
[[kernel]] void argmax_partial(constant lily::ArgmaxArgs& args [[buffer(0)]],
                               device const T* logits [[buffer(1)]],          // [vocab]
                               device float* partial_values [[buffer(2)]],    // [num_partials]
                               device uint* partial_ids [[buffer(3)]],        // [num_partials]
                               uint block [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint n_threads [[threads_per_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint n_sg [[simdgroups_per_threadgroup]]) {
  threadgroup float values_tg[32];
  threadgroup uint ids_tg[32];
  const uint begin = block * args.block_size;
  const uint end = min(begin + args.block_size, args.vocab_size);
  float value = -INFINITY;
  uint id = 0xFFFFFFFFu;  // loses to any real id, even a -inf logit
  for (uint i = begin + tid; i < end; i += n_threads) {
    const float x = float(logits[i]);
    if (argmax_better(x, i, value, id)) {
      value = x;
      id = i;
    }
  }
  argmax_threadgroup(value, id, values_tg, ids_tg, lane, sg, n_sg);
  if (tid == 0) {
    partial_values[block] = value;
    partial_ids[block] = id;
  }
}

template <typename T>
[[kernel]] void argmax_final(constant lily::ArgmaxArgs& args [[buffer(0)]],
                                 device const T* partial_values [[buffer(1)]],      // [num_partials]
                                 device const uint* partial_ids [[buffer(2)]],      // [num_partials]
                                 device uint* tokens [[buffer(3)]],                 // tokens[out_index] is written
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint n_threads [[threads_per_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]],
                                 uint sg [[simdgroup_index_in_threadgroup]],
                                 uint n_sg [[simdgroups_per_threadgroup]]) {
  threadgroup float values_tg[32];
  threadgroup uint ids_tg[32];
  float value = -INFINITY;
  uint id = 0xFFFFFFFFu;
  for (uint i = tid; i < args.num_partials; i += n_threads) {
    if (argmax_better(partial_values[i], partial_ids[i], value, id)) {
      value = partial_values[i];
      id = partial_ids[i];
    }
  }
  argmax_threadgroup(value, id, values_tg, ids_tg, lane, sg, n_sg);
  if (tid == 0) {
    tokens[args.out_index] = id;
  }
}

// Philox4x32-10 (Salmon et al., SC'11): a counter-based generator; the same key and counter give the same numbers.
inline uint4 philox4x32_10(uint4 counter, uint2 key) {
  for (uint round = 0; round < 10; ++round) {
    const ulong p0 = ulong(0xD2511F53u) * ulong(counter.x);
    const ulong p1 = ulong(0xCD9E8D57u) * ulong(counter.z);
    counter = uint4(uint(p1 >> 32) ^ counter.y ^ key.x, uint(p1), uint(p0 >> 32) ^ counter.w ^ key.y, uint(p0));
    key += uint2(0x9E3779B9u, 0xBB67AE85u);
  }
  return counter;
}

// The uint32 whose unsigned order is the order of the float values (-inf lowest).
inline uint sample_key(float x) {
  const uint bits = as_type<uint>(x);
  return (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
}

inline float sample_key_value(uint key) {
  return as_type<float>((key & 0x80000000u) != 0 ? (key ^ 0x80000000u) : ~key);
}

// Fixed-order threadgroup reductions; the trailing barrier lets the next call reuse `part`.
LILY_INLINE float sample_sum(float v, threadgroup float* part, uint lane, uint sg, uint n_sg) {
  v = simd_sum(v);
  if (lane == 0) {
    part[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint s = 0; s < n_sg; ++s) {
    total += part[s];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return total;
}

LILY_INLINE float sample_max(float v, threadgroup float* part, uint lane, uint sg, uint n_sg) {
  v = simd_max(v);
  if (lane == 0) {
    part[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float best = part[0];
  for (uint s = 1; s < n_sg; ++s) {
    best = max(best, part[s]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return best;
}

// Per-digit counts and masses of one radix pass, summed over the threadgroup into bin_count/bin_mass [16]
// (sum over simdgroups in index order). Ends with a barrier.
LILY_INLINE void sample_reduce_digits(thread uint* count, thread float* mass, threadgroup uint* count_part,
                                 threadgroup float* mass_part, threadgroup uint* bin_count,
                                 threadgroup float* bin_mass, uint tid, uint lane, uint sg, uint n_sg) {
  for (uint b = 0; b < 16; ++b) {
    const uint c = simd_sum(count[b]);
    const float m = simd_sum(mass[b]);
    if (lane == 0) {
      count_part[sg * 16 + b] = c;
      mass_part[sg * 16 + b] = m;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < 16) {
    uint c = 0;
    float m = 0.0f;
    for (uint s = 0; s < n_sg; ++s) {
      c += count_part[s * 16 + tid];
      m += mass_part[s * 16 + tid];
    }
    bin_count[tid] = c;
    bin_mass[tid] = m;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// The simdgroups' digit counts of one radix pass (count_part [n_sg][16], each written by its lane 0) summed in
// simdgroup order into bin_count[16]. Every thread calls it; it begins and ends with a barrier.
LILY_INLINE void sample_total_digit_counts(threadgroup const uint* count_part, threadgroup uint* bin_count, uint tid,
                                           uint n_sg) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < 16) {
    uint c = 0;
    for (uint s = 0; s < n_sg; ++s) {
      c += count_part[s * 16 + tid];
    }
    bin_count[tid] = c;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// e = exp(x - x_max) if the token survives top-k, top-p and min-p, else 0. `tie_rank` counts the tokens tied at key_p
// met so far in id order (advanced here); min-p: p >= min_p * p_max  <=>  e >= min_p, as e_max = 1.
LILY_INLINE float sample_kept_mass(float x, float x_max, bool use_k, uint key_k, bool keep_all_p, uint key_p,
                              uint ties_kept, float min_p, thread uint& tie_rank) {
  const uint key = sample_key(x);
  const float e = precise::exp(x - x_max);
  bool kept = e > 0.0f && (!use_k || key >= key_k) && e >= min_p;
  if (!keep_all_p) {
    if (key == key_p && e > 0.0f && (!use_k || key >= key_k)) {
      kept = kept && tie_rank < ties_kept;
      tie_rank += 1;
    } else {
      kept = kept && key > key_p;
    }
  }
  return kept ? e : 0.0f;
}

// The threadgroup scratch of `sample` and `sample_final` (declared in the kernel) and this thread's place in the
// threadgroup.
struct SampleScratch {
  threadgroup float* f_part;        // [32] per-simdgroup float partials
  threadgroup uint* u_part;         // [32] per-simdgroup uint partials
  threadgroup uint* count_part;     // [32 * 16] per-simdgroup digit counts
  threadgroup float* mass_part;     // [32 * 16] per-simdgroup digit masses
  threadgroup uint* bin_count;      // [16]
  threadgroup float* bin_mass;      // [16]
  threadgroup uint* select_state;   // [3] digit prefix, remaining rank (top-k) or "keep all" flag (top-p), tie count
  threadgroup float* above_tg;      // [1] top-p: kept mass strictly above the current prefix
  threadgroup float* chunk_cum;     // [LILY_SAMPLE_THREADS]
  threadgroup atomic_uint* claim;   // [2] first chunk whose cumulative mass passes the target; last non-empty chunk
};

// Filled member by member: a braced initializer of threadgroup addresses becomes a constant aggregate in global
// memory under the CUDA target, which ptxas rejects (shared addresses are not link-time constants there).
LILY_INLINE SampleScratch sample_scratch(threadgroup float* f_part, threadgroup uint* u_part, threadgroup uint* count_part,
                                    threadgroup float* mass_part, threadgroup uint* bin_count,
                                    threadgroup float* bin_mass, threadgroup uint* select_state,
                                    threadgroup float* above_tg, threadgroup float* chunk_cum,
                                    threadgroup atomic_uint* claim) {
  SampleScratch tg;
  tg.f_part = f_part;
  tg.u_part = u_part;
  tg.count_part = count_part;
  tg.mass_part = mass_part;
  tg.bin_count = bin_count;
  tg.bin_mass = bin_mass;
  tg.select_state = select_state;
  tg.above_tg = above_tg;
  tg.chunk_cum = chunk_cum;
  tg.claim = claim;
  return tg;
}

struct SampleThread {
  uint tid, n_threads, lane, sg, n_sg;
};

// What the order statistics and the draw read: x = logit / temperature and the token id of element i < count.
// SampleLogits: `count` consecutive logits from id `first` (the vocabulary, or one block of it).
// SampleCandidates: what sample_partial kept, a subsequence of the vocabulary in id order (x already divided).
template <typename T>
struct SampleLogits {
  device const T* logits;
  uint first;
  uint count;
  float temperature;
  float x(uint i) const { return float(logits[first + i]) / temperature; }
  uint id(uint i) const { return first + i; }
};

struct SampleCandidates {
  device const float* xs;
  device const uint* ids;
  uint count;
  float x(uint i) const { return xs[i]; }
  uint id(uint i) const { return ids[i]; }
};

// What top-p keeps: every token (keep_all), or those with key > key, plus the first ties_kept tokens tied at key.
struct TopPCut {
  bool keep_all;
  uint key;
  uint ties_kept;
};

// 1. Temperature and the maximum (the max token survives every filter: its p is p_max, and e = 1).
template <typename Src>
LILY_INLINE float sample_max_logit(Src src, SampleScratch tg, SampleThread th) {
  float local_max = -INFINITY;
  for (uint i = th.tid; i < src.count; i += th.n_threads) {
    local_max = max(local_max, src.x(i));
  }
  return sample_max(local_max, tg.f_part, th.lane, th.sg, th.n_sg);
}

// 2. Top-k: radix select of the key of the k-th largest x (keep key >= the result).
template <typename Src>
LILY_INLINE uint sample_top_k_key(Src src, uint top_k, SampleScratch tg, SampleThread th) {
  uint prefix = 0;
  uint remaining = top_k;
  for (int shift = 28; shift >= 0; shift -= 4) {
    // This thread's count of each digit, kept in 8-bit fields of two 64-bit words (digits 0-7, 8-15) for up to 255
    // of its elements at a time, then added into registers: one add per element where an array indexed by the digit
    // lived in local memory.
    uint count[16];
    LILY_UNROLL
    for (uint d = 0; d < 16; ++d) {
      count[d] = 0;
    }
    for (uint base = th.tid; base < src.count; base += 255u * th.n_threads) {
      ulong low = 0;
      ulong high = 0;
      const uint stop = min(src.count, base + 255u * th.n_threads);
      for (uint i = base; i < stop; i += th.n_threads) {
        const uint key = sample_key(src.x(i));
        const uint digit = (key >> shift) & 15u;
        const ulong one = (shift == 28 || (key >> (shift + 4)) == prefix) ? (ulong(1) << (8u * (digit & 7u)))
                                                                          : ulong(0);
        if (digit < 8) {
          low += one;
        } else {
          high += one;
        }
      }
      LILY_UNROLL
      for (uint d = 0; d < 16; ++d) {
        count[d] += uint(((d < 8 ? low : high) >> (8u * (d & 7u))) & 255u);
      }
    }
    LILY_UNROLL
    for (uint d = 0; d < 16; ++d) {
      const uint c = simd_sum(count[d]);
      if (th.lane == 0) {
        tg.count_part[th.sg * 16 + d] = c;
      }
    }
    sample_total_digit_counts(tg.count_part, tg.bin_count, th.tid, th.n_sg);
    if (th.tid == 0) {
      uint b = 15;
      while (b > 0 && tg.bin_count[b] < remaining) {
        remaining -= tg.bin_count[b];
        --b;
      }
      tg.select_state[0] = (prefix << 4) | b;
      tg.select_state[1] = remaining;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    prefix = tg.select_state[0];
    remaining = tg.select_state[1];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  return prefix;
}

// 3. Mass of what top-k keeps: the sum of e = exp(x - x_max).
template <typename Src>
LILY_INLINE float sample_top_k_mass(Src src, float x_max, bool use_k, uint key_k, SampleScratch tg, SampleThread th) {
  float local_mass = 0.0f;
  for (uint i = th.tid; i < src.count; i += th.n_threads) {
    const float x = src.x(i);
    if (!use_k || sample_key(x) >= key_k) {
      local_mass += precise::exp(x - x_max);
    }
  }
  return sample_sum(local_mass, tg.f_part, th.lane, th.sg, th.n_sg);
}

// 4. Top-p: radix select of the key of the last kept token in descending order, by mass.
template <typename Src>
LILY_INLINE TopPCut sample_top_p_cut(Src src, float top_p, float x_max, bool use_k, uint key_k, float mass_k,
                                SampleScratch tg, SampleThread th) {
  TopPCut cut{!(top_p < 1.0f), 0u, 0u};
  if (cut.keep_all) {
    return cut;
  }
  const float target = top_p * mass_k;
  uint prefix = 0;
  float above = 0.0f;
  uint tie_count = 0;
  for (int shift = 28; shift >= 0; shift -= 4) {
    uint count[16];
    float mass[16];
    for (uint b = 0; b < 16; ++b) {
      count[b] = 0;
      mass[b] = 0.0f;
    }
    for (uint i = th.tid; i < src.count; i += th.n_threads) {
      const float x = src.x(i);
      const uint key = sample_key(x);
      const float e = precise::exp(x - x_max);
      if (e > 0.0f && (!use_k || key >= key_k) && (shift == 28 || (key >> (shift + 4)) == prefix)) {
        count[(key >> shift) & 15u] += 1;
        mass[(key >> shift) & 15u] += e;
      }
    }
    sample_reduce_digits(count, mass, tg.count_part, tg.mass_part, tg.bin_count, tg.bin_mass, th.tid, th.lane, th.sg,
                         th.n_sg);
    if (th.tid == 0) {
      uint found = 16;
      for (int b = 15; b >= 0; --b) {
        if (tg.bin_count[b] == 0) {
          continue;
        }
        if (above + tg.bin_mass[b] < target) {
          above += tg.bin_mass[b];  // the whole bin and the token after it are inside the nucleus
        } else {
          found = uint(b);
          break;
        }
      }
      tg.select_state[0] = found < 16 ? ((prefix << 4) | found) : prefix;
      tg.select_state[1] = found < 16 ? 0u : 1u;  // rounding left the mass short of the target: keep everything
      tg.select_state[2] = found < 16 ? tg.bin_count[found] : 0u;
      tg.above_tg[0] = above;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    prefix = tg.select_state[0];
    cut.keep_all = tg.select_state[1] != 0;
    tie_count = tg.select_state[2];
    above = tg.above_tg[0];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (cut.keep_all) {
      return cut;  // uniform: every thread read the same flag
    }
  }
  // Tokens tied at the cut key, in id order: the j-th is kept while the mass before it, above + j·e, is < target.
  cut.key = prefix;
  const float e_tie = precise::exp(sample_key_value(cut.key) - x_max);
  const float needed = ceil((target - above) / e_tie);
  cut.ties_kept = uint(clamp(needed, 1.0f, float(tie_count)));
  return cut;
}

// 5a. Tokens tied at the top-p cut key in the chunks of the threads before this one (elements [0, begin)).
template <typename Src>
LILY_INLINE uint sample_ties_before(Src src, uint begin, uint end, float x_max, uint key_p, SampleScratch tg,
                               SampleThread th) {
  uint ties = 0;
  for (uint i = begin; i < end; ++i) {
    const float x = src.x(i);
    ties += (sample_key(x) == key_p && precise::exp(x - x_max) > 0.0f) ? 1u : 0u;
  }
  const uint before_in_simd = simd_prefix_exclusive_sum(ties);
  const uint simd_total = simd_sum(ties);
  if (th.lane == 0) {
    tg.u_part[th.sg] = simd_total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint tie_rank = before_in_simd;
  for (uint s = 0; s < th.sg; ++s) {
    tie_rank += tg.u_part[s];
  }
  return tie_rank;
}

// The thread whose chunk holds the target, and the target less the mass of the chunks before it.
struct SampleChunk {
  uint owner;
  float target;
};

// 5b. Threads own consecutive chunks (thread order = id order) of kept mass `chunk_mass`. The target is u · (total
// mass), or `fixed_target` when that is >= 0. The chunk holding it is the first whose cumulative mass passes it;
// rounding may make two chunks claim it or none: the first claimant wins, else the last non-empty chunk, with an
// infinite target (its walk ends at its last kept token). Every thread gets the answer; ends with a barrier.
LILY_INLINE SampleChunk sample_choose_chunk(float chunk_mass, float u, float fixed_target, SampleScratch tg,
                                       SampleThread th) {
  const float cum_in_simd = simd_prefix_inclusive_sum(chunk_mass);
  const float simd_total = simd_sum(chunk_mass);
  if (th.lane == 0) {
    tg.f_part[th.sg] = simd_total;
  }
  if (th.tid == 0) {
    atomic_store_explicit(&tg.claim[0], 0xFFFFFFFFu, memory_order_relaxed);
    atomic_store_explicit(&tg.claim[1], 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float cum = cum_in_simd;
  for (uint s = 0; s < th.sg; ++s) {
    cum += tg.f_part[s];
  }
  tg.chunk_cum[th.tid] = cum;
  float total = 0.0f;
  for (uint s = 0; s < th.n_sg; ++s) {
    total += tg.f_part[s];
  }
  const float target = fixed_target >= 0.0f ? fixed_target : u * total;
  if (chunk_mass > 0.0f) {
    if (cum > target) {
      atomic_fetch_min_explicit(&tg.claim[0], th.tid, memory_order_relaxed);
    }
    atomic_fetch_max_explicit(&tg.claim[1], th.tid, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint first = atomic_load_explicit(&tg.claim[0], memory_order_relaxed);
  const bool passed = first != 0xFFFFFFFFu;
  SampleChunk out;
  out.owner = passed ? first : atomic_load_explicit(&tg.claim[1], memory_order_relaxed);
  out.target = passed ? target - (first > 0 ? tg.chunk_cum[first - 1] : 0.0f) : INFINITY;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return out;
}

// 5. The draw over `src`: contiguous chunks per thread, cumulative kept mass in id order; the chosen thread writes the
// token id to tokens[out_index].
template <typename Src>
LILY_INLINE void sample_draw(Src src, float x_max, bool use_k, uint key_k, TopPCut cut, float min_p, float u,
                        float fixed_target, device uint* tokens, uint out_index, SampleScratch tg, SampleThread th) {
  const uint chunk = (src.count + th.n_threads - 1) / th.n_threads;
  const uint begin = min(th.tid * chunk, src.count);
  const uint end = min(begin + chunk, src.count);
  const uint first_tie_rank = cut.keep_all ? 0u : sample_ties_before(src, begin, end, x_max, cut.key, tg, th);
  uint tie_rank = first_tie_rank;
  float chunk_mass = 0.0f;
  for (uint i = begin; i < end; ++i) {
    chunk_mass += sample_kept_mass(src.x(i), x_max, use_k, key_k, cut.keep_all, cut.key, cut.ties_kept, min_p,
                                   tie_rank);
  }
  const SampleChunk chosen = sample_choose_chunk(chunk_mass, u, fixed_target, tg, th);
  if (th.tid == chosen.owner) {
    // The same walk as above (same order, same sums) up to the first element whose running mass passes the target.
    uint rank = first_tie_rank;
    float acc = 0.0f;
    uint token = begin;
    for (uint i = begin; i < end; ++i) {
      const float e = sample_kept_mass(src.x(i), x_max, use_k, key_k, cut.keep_all, cut.key, cut.ties_kept, min_p,
                                       rank);
      if (e > 0.0f) {
        acc += e;
        token = i;
        if (acc > chosen.target) {
          break;
        }
      }
    }
    tokens[out_index] = src.id(token);
  }
}

// Steps 3-5 once x_max and the top-k key are known.
template <typename Src>
LILY_INLINE void sample_after_top_k(Src src, float x_max, bool use_k, uint key_k, float top_p, float min_p, float u,
                               device uint* tokens, uint out_index, SampleScratch tg, SampleThread th) {
  const float mass_k = sample_top_k_mass(src, x_max, use_k, key_k, tg, th);
  const TopPCut cut = sample_top_p_cut(src, top_p, x_max, use_k, key_k, mass_k, tg, th);
  sample_draw(src, x_max, use_k, key_k, cut, min_p, u, -1.0f, tokens, out_index, tg, th);
}

// Every step over the whole vocabulary in one threadgroup (the general path).
template <typename T>
LILY_INLINE void sample_vocabulary(SampleLogits<T> src, uint top_k, float top_p, float min_p, float u, device uint* tokens,
                              uint out_index, SampleScratch tg, SampleThread th) {
  const float x_max = sample_max_logit(src, tg, th);
  const bool use_k = top_k > 0 && top_k < src.count;
  const uint key_k = use_k ? sample_top_k_key(src, top_k, tg, th) : 0u;
  sample_after_top_k(src, x_max, use_k, key_k, top_p, min_p, u, tokens, out_index, tg, th);
}

// u in [0, 1): 24 bits of the first Philox word for counter (step, 0, 0, 0) and the request's seed.
LILY_INLINE float sample_uniform(uint step, uint seed_lo, uint seed_hi) {
  const uint4 random = philox4x32_10(uint4(step, 0u, 0u, 0u), uint2(seed_lo, seed_hi));
  return float(random.x >> 8) * 5.9604644775390625e-8f /* 2^-24 */;
}

template <typename T>
[[kernel]] void sample(constant lily::SampleArgs& args [[buffer(0)]],
                       device const T* logits [[buffer(1)]],  // [vocab]
                       device uint* tokens [[buffer(2)]],     // tokens[out_index] is written
                       uint tid [[thread_index_in_threadgroup]],
                       uint n_threads [[threads_per_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]],
                       uint sg [[simdgroup_index_in_threadgroup]],
                       uint n_sg [[simdgroups_per_threadgroup]]) {
  threadgroup float f_part[32];
  threadgroup uint u_part[32];
  threadgroup uint count_part[32 * 16];
  threadgroup float mass_part[32 * 16];
  threadgroup uint bin_count[16];
  threadgroup float bin_mass[16];
  threadgroup uint select_state[3];
  threadgroup float above_tg[1];
  threadgroup float chunk_cum[LILY_SAMPLE_THREADS];
  threadgroup atomic_uint claim[2];
  const SampleScratch tg = sample_scratch(f_part, u_part, count_part, mass_part, bin_count, bin_mass, select_state,
                                          above_tg, chunk_cum, claim);
  const SampleThread th{tid, n_threads, lane, sg, n_sg};
  const SampleLogits<T> vocabulary{logits, 0u, args.vocab_size, args.temperature};
  sample_vocabulary(vocabulary, args.top_k, args.top_p, args.min_p, sample_uniform(args.step, args.seed_lo,
                                                                                    args.seed_hi),
                    tokens, args.out_index, tg, th);
}

// One radix pass of sample_partial over this thread's keys: how many of the simdgroup's keys that match `prefix` in
// the digits above `shift` (all of them at shift 28) have each 4-bit digit at `shift`, into part[16] (lane 0 writes).
// Each thread counts its keys in 4-bit fields of two 64-bit words (half its keys in each, so a field stays <= 15),
// one add per key where comparing every key with every digit took 16; the simdgroup then sums two digits per 32-bit
// word (16-bit halves: at most 32 * LILY_SAMPLE_PER_THREAD). Integer counts: the same result in any order.
template <uint PER>
LILY_INLINE void sample_digit_counts(thread const uint (&keys)[PER], uint valid, int shift, uint prefix,
                                     threadgroup uint* part, uint lane) {
  static_assert(PER / 2 + PER % 2 <= 15 && 32 * PER <= 0xFFFFu, "per-thread 4-bit and per-simdgroup 16-bit counts");
  ulong low = 0;
  ulong high = 0;
  LILY_UNROLL
  for (uint j = 0; j < PER; ++j) {
    const uint key = keys[j];
    const bool match = j < valid && (shift == 28 || (key >> (shift + 4)) == prefix);
    const ulong one = match ? (ulong(1) << (4u * ((key >> shift) & 15u))) : ulong(0);
    if (j < PER / 2) {
      low += one;
    } else {
      high += one;
    }
  }
  LILY_UNROLL
  for (uint d = 0; d < 16; d += 2) {
    const uint even = uint((low >> (4u * d)) & 15u) + uint((high >> (4u * d)) & 15u);
    const uint odd = uint((low >> (4u * d + 4u)) & 15u) + uint((high >> (4u * d + 4u)) & 15u);
    const uint both = simd_sum(even | (odd << 16));
    if (lane == 0) {
      part[d] = both & 0xFFFFu;
      part[d + 1] = both >> 16;
    }
  }
}

// Stage 1 of the block path: one threadgroup per block of args.block_size logits (at most LILY_SAMPLE_PER_THREAD
// per thread, held in registers). Writes the block's max x and sum of exp(x - max) (fixed order; 0 for a block of
// -inf) and, unless top-k, top-p and min-p are all off, its LILY_SAMPLE_CANDIDATES candidates: every x above the
// block's C-th largest key plus the ties at that key in id order until C are taken, written in id order (a block of
// fewer than C logits keeps them all and pads with x = -inf). block_cut = (C-th key, ties at it left out):
// sample_final falls back to the general path when a token left out could be kept (sample_candidates_complete).
template <typename T>
[[kernel]] void sample_partial(constant lily::SampleArgs& args [[buffer(0)]],
                               device const T* logits [[buffer(1)]],       // [vocab]
                               device float* cand_x [[buffer(2)]],         // [num_blocks * C]: x = logit / temperature
                               device uint* cand_id [[buffer(3)]],         // [num_blocks * C]
                               device float* block_stats [[buffer(4)]],    // [num_blocks * 2]: max x, sum exp(x - max)
                               device uint* block_cut [[buffer(5)]],       // [num_blocks * 2]: C-th key, ties left out
                               uint block [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint n_threads [[threads_per_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint n_sg [[simdgroups_per_threadgroup]]) {
  threadgroup float f_part[32];
  threadgroup uint u_part[32];
  threadgroup uint count_part[32 * 16];
  threadgroup uint bin_count[16];
  threadgroup uint select_state[3];
  constexpr uint C = LILY_SAMPLE_CANDIDATES;
  constexpr uint PER = LILY_SAMPLE_PER_THREAD;
  const uint begin = block * args.block_size;
  const uint end = min(begin + args.block_size, args.vocab_size);
  const uint n = end - begin;
  const uint per = (n + n_threads - 1) / n_threads;  // <= PER (static_assert in src/lily_ext/ops/sampling.cpp)
  const uint first = begin + tid * per;
  const uint valid = first < end ? min(per, end - first) : 0u;
  uint keys[PER];  // the order-preserving keys of this thread's x, ids first .. first + valid - 1
  float local_max = -INFINITY;
  LILY_UNROLL
  for (uint j = 0; j < PER; ++j) {
    const float x = j < valid ? float(logits[first + j]) / args.temperature : -INFINITY;
    keys[j] = sample_key(x);
    local_max = max(local_max, x);
  }
  const float block_max = sample_max(local_max, f_part, lane, sg, n_sg);
  float local_sum = 0.0f;
  LILY_UNROLL
  for (uint j = 0; j < PER; ++j) {
    if (j < valid && block_max != -INFINITY) {
      local_sum += precise::exp(sample_key_value(keys[j]) - block_max);
    }
  }
  const float block_sum = sample_sum(local_sum, f_part, lane, sg, n_sg);
  if (tid == 0) {
    block_stats[2 * block] = block_max;
    block_stats[2 * block + 1] = block_sum;
  }
  if (!(args.top_k > 0 && args.top_k < args.vocab_size) && !(args.top_p < 1.0f) && !(args.min_p > 0.0f)) {
    return;  // uniform: plain temperature sampling needs the statistics only
  }
  // The C-th largest key of the block: radix select, 8 passes of 4-bit digits (counts compared per digit, so the
  // per-thread arrays stay in registers).
  uint key_c = 0u;     // every key is >= 0: a block of at most C logits keeps all of them
  uint ties_kept = C;
  uint ties_left = 0u;
  if (n > C) {
    uint prefix = 0;
    uint remaining = C;
    for (int shift = 28; shift >= 0; shift -= 4) {
      sample_digit_counts(keys, valid, shift, prefix, count_part + sg * 16, lane);
      sample_total_digit_counts(count_part, bin_count, tid, n_sg);
      if (tid == 0) {
        uint b = 15;
        while (b > 0 && bin_count[b] < remaining) {
          remaining -= bin_count[b];
          --b;
        }
        select_state[0] = (prefix << 4) | b;
        select_state[1] = remaining;
        select_state[2] = bin_count[b];
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      prefix = select_state[0];
      remaining = select_state[1];
      ties_left = select_state[2] - remaining;  // after the last pass: the ties at the C-th key beyond the C taken
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    key_c = prefix;
    ties_kept = remaining;
  }
  // Compaction in id order: one exclusive scan of (ties, keys above) packed in one word (each count <= 16384).
  uint above = 0;
  uint ties = 0;
  LILY_UNROLL
  for (uint j = 0; j < PER; ++j) {
    above += (j < valid && keys[j] > key_c) ? 1u : 0u;
    ties += (j < valid && keys[j] == key_c) ? 1u : 0u;
  }
  const uint packed = (ties << 16) | above;
  uint before = simd_prefix_exclusive_sum(packed);
  const uint simd_total = simd_sum(packed);
  if (lane == 0) {
    u_part[sg] = simd_total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = 0; s < sg; ++s) {
    before += u_part[s];
  }
  uint above_before = before & 0xFFFFu;
  uint ties_before = before >> 16;
  const uint out = block * C;
  LILY_UNROLL
  for (uint j = 0; j < PER; ++j) {
    if (j >= valid) {
      continue;
    }
    const uint key = keys[j];
    uint slot = C;
    if (key > key_c) {
      slot = above_before + min(ties_before, ties_kept);
      above_before += 1;
    } else if (key == key_c) {
      slot = ties_before < ties_kept ? above_before + ties_before : C;
      ties_before += 1;
    }
    if (slot < C) {
      cand_x[out + slot] = sample_key_value(key);
      cand_id[out + slot] = first + j;
    }
  }
  for (uint s = n + tid; s < C; s += n_threads) {
    cand_x[out + s] = -INFINITY;
    cand_id[out + s] = 0xFFFFFFFFu;
  }
  if (tid == 0) {
    block_cut[2 * block] = key_c;
    block_cut[2 * block + 1] = ties_left;
  }
}

// Block b's units relative to the vocabulary's max x: exp(m_b - x_max); 0 for a block of -inf.
LILY_INLINE float sample_block_scale(device const float* block_stats, uint b, float x_max) {
  const float m = block_stats[2 * b];
  return m == -INFINITY ? 0.0f : precise::exp(m - x_max);
}

// Mass of block b relative to the vocabulary's max x: sum exp(x - m_b) * exp(m_b - x_max).
LILY_INLINE float sample_block_mass(device const float* block_stats, uint b, float x_max) {
  return block_stats[2 * b + 1] * sample_block_scale(block_stats, b, x_max);
}

// Whether the candidates hold every token of nonzero mass that the filters keep, so that sample_*'s steps over them
// give sample_*'s draw over the vocabulary. A block of more than C logits left out keys below its C-th key key_c and
// `ties left out` at it; none of them may be kept. With top-k, the left-out keys must lie below the k-th key (else
// that key, the kept mass and so the top-p cut change). Without top-k, below the top-p cut key (every key above the
// cut, and every tie at it, is then a candidate, so the masses before each kept token are the vocabulary's), or, for
// min-p, their e below min_p: a token of e >= min_p has only keys of e >= min_p before it, all candidates. Left-out
// tokens of zero mass change neither a mass nor the draw.
LILY_INLINE bool sample_candidates_complete(device const uint* block_cut, uint num_blocks, uint block_size, uint vocab,
                                            float x_max, bool use_k, uint key_k, TopPCut cut, float min_p,
                                            SampleScratch tg, SampleThread th) {
  float incomplete = 0.0f;
  for (uint b = th.tid; b < num_blocks; b += th.n_threads) {
    if (min(block_size, vocab - b * block_size) <= LILY_SAMPLE_CANDIDATES) {
      continue;  // the block's every logit is a candidate
    }
    const uint key_c = block_cut[2 * b];
    const bool ties_left = block_cut[2 * b + 1] != 0u;
    const float e_c = precise::exp(sample_key_value(key_c) - x_max);
    const uint key = use_k ? key_k : cut.key;
    const bool below = (use_k || !cut.keep_all) && (key_c < key || (key_c == key && !ties_left));
    const bool complete = e_c == 0.0f || below || (!use_k && e_c < min_p);
    incomplete = complete ? incomplete : 1.0f;
  }
  return sample_max(incomplete, tg.f_part, th.lane, th.sg, th.n_sg) == 0.0f;
}

// Stage 2 of the block path, one threadgroup; the same draw as sample_* for the same seed and step, up to fp32
// rounding (sums run in another order). Three ways:
//   plain temperature (top_k off, top_p 1, min_p 0): the block from the block masses in block order, then the token
//     from one scan of that block.
//   otherwise, top_k off or in [1, num_blocks * C]: every step of sample_* over the candidates (top-k's mass over
//     them, else the vocabulary's from the block statistics), when they hold every token kept
//     (sample_candidates_complete); else the general path over the vocabulary.
//   top_k above the candidates: the general path (the host sends such requests to sample_* instead).
template <typename T>
[[kernel]] void sample_final(constant lily::SampleArgs& args [[buffer(0)]],
                             device const T* logits [[buffer(1)]],             // [vocab]
                             device const float* cand_x [[buffer(2)]],         // sample_partial's outputs
                             device const uint* cand_id [[buffer(3)]],
                             device const float* block_stats [[buffer(4)]],
                             device const uint* block_cut [[buffer(5)]],
                             device uint* tokens [[buffer(6)]],                // tokens[out_index] is written
                             uint tid [[thread_index_in_threadgroup]],
                             uint n_threads [[threads_per_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint n_sg [[simdgroups_per_threadgroup]]) {
  threadgroup float f_part[32];
  threadgroup uint u_part[32];
  threadgroup uint count_part[32 * 16];
  threadgroup float mass_part[32 * 16];
  threadgroup uint bin_count[16];
  threadgroup float bin_mass[16];
  threadgroup uint select_state[3];
  threadgroup float above_tg[1];
  threadgroup float chunk_cum[LILY_SAMPLE_THREADS];
  threadgroup atomic_uint claim[2];
  threadgroup uint block_choice[1];
  threadgroup float block_target[1];
  const SampleScratch tg = sample_scratch(f_part, u_part, count_part, mass_part, bin_count, bin_mass, select_state,
                                          above_tg, chunk_cum, claim);
  const SampleThread th{tid, n_threads, lane, sg, n_sg};
  const uint vocab = args.vocab_size;
  const uint num_blocks = args.num_blocks;
  const float u = sample_uniform(args.step, args.seed_lo, args.seed_hi);
  const bool use_k = args.top_k > 0 && args.top_k < vocab;
  if (!use_k && !(args.top_p < 1.0f) && !(args.min_p > 0.0f)) {
    float local_max = -INFINITY;
    for (uint b = tid; b < num_blocks; b += n_threads) {
      local_max = max(local_max, block_stats[2 * b]);
    }
    const float x_max = sample_max(local_max, f_part, lane, sg, n_sg);
    const uint chunk = (num_blocks + n_threads - 1) / n_threads;
    const uint begin = min(tid * chunk, num_blocks);
    const uint end = min(begin + chunk, num_blocks);
    float chunk_mass = 0.0f;
    for (uint b = begin; b < end; ++b) {
      chunk_mass += sample_block_mass(block_stats, b, x_max);
    }
    const SampleChunk chosen = sample_choose_chunk(chunk_mass, u, -1.0f, tg, th);
    if (tid == chosen.owner) {
      float acc = 0.0f;
      float before = 0.0f;
      uint pick = begin;
      for (uint b = begin; b < end; ++b) {
        const float mass = sample_block_mass(block_stats, b, x_max);
        if (mass > 0.0f) {
          pick = b;
          before = acc;
          acc += mass;
          if (acc > chosen.target) {
            break;
          }
        }
      }
      // The target inside the block, in the block's own units exp(x - m_b).
      const float scale = sample_block_scale(block_stats, pick, x_max);
      block_choice[0] = pick;
      block_target[0] = scale > 0.0f ? (chosen.target - before) / scale : INFINITY;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint pick = block_choice[0];
    const float target = max(block_target[0], 0.0f);
    const uint first = pick * args.block_size;
    const SampleLogits<T> block{logits, first, min(args.block_size, vocab - first), args.temperature};
    const TopPCut all{true, 0u, 0u};
    sample_draw(block, block_stats[2 * pick], false, 0u, all, 0.0f, u, target, tokens, args.out_index, tg, th);
    return;
  }
  const uint num_candidates = num_blocks * LILY_SAMPLE_CANDIDATES;
  if (!use_k || args.top_k <= num_candidates) {
    const SampleCandidates candidates{cand_x, cand_id, num_candidates};
    const float x_max = sample_max_logit(candidates, tg, th);
    const uint key_k = use_k ? sample_top_k_key(candidates, args.top_k, tg, th) : 0u;
    float mass_k;
    if (use_k) {
      mass_k = sample_top_k_mass(candidates, x_max, true, key_k, tg, th);
    } else {  // the vocabulary's mass, from the block statistics
      float local_mass = 0.0f;
      for (uint b = tid; b < num_blocks; b += n_threads) {
        local_mass += sample_block_mass(block_stats, b, x_max);
      }
      mass_k = sample_sum(local_mass, f_part, lane, sg, n_sg);
    }
    const TopPCut cut = sample_top_p_cut(candidates, args.top_p, x_max, use_k, key_k, mass_k, tg, th);
    if (sample_candidates_complete(block_cut, num_blocks, args.block_size, vocab, x_max, use_k, key_k, cut,
                                   args.min_p, tg, th)) {
      sample_draw(candidates, x_max, use_k, key_k, cut, args.min_p, u, -1.0f, tokens, args.out_index, tg, th);
      return;
    }
  }
  const SampleLogits<T> vocabulary{logits, 0u, vocab, args.temperature};
  sample_vocabulary(vocabulary, args.top_k, args.top_p, args.min_p, u, tokens, args.out_index, tg, th);
}

// lily.sampling steps 1-3 for one logit (Sampler.process): bias, then the repetition penalty, then presence and
// frequency, in fp32.
template <typename T>
[[kernel]] void penalize_logits(constant lily::PenaltyArgs& args [[buffer(0)]],
                                device const T* logits [[buffer(1)]],      // [vocab]
                                device const float* bias [[buffer(2)]],    // [vocab], read only with has_bias
                                device const uint* seen [[buffer(3)]],     // [vocab] 0/1
                                device const uint* counts [[buffer(4)]],   // [vocab]
                                device float* processed [[buffer(5)]],     // [vocab]
                                uint i [[thread_position_in_grid]]) {
  if (i >= args.vocab_size) {
    return;
  }
  float x = float(logits[i]);
  if (args.has_bias != 0u) {
    x += bias[i];
  }
  if (seen[i] != 0u) {
    x = x > 0.0f ? x / args.repetition_penalty : x * args.repetition_penalty;
  }
  const uint count = counts[i];
  if (count != 0u) {
    x -= args.presence_penalty + args.frequency_penalty * float(count);
  }
  processed[i] = x;
}

// One thread: the token just chosen, for the next step's penalize_logits.
[[kernel]] void count_token(constant lily::PenaltyArgs& args [[buffer(0)]],
                            device const uint* tokens [[buffer(1)]],
                            device uint* seen [[buffer(2)]],
                            device uint* counts [[buffer(3)]],
                            uint i [[thread_position_in_grid]]) {
  const uint token = tokens[args.out_index];
  if (i == 0 && token < args.vocab_size) {
    seen[token] = 1u;
    counts[token] += 1u;
  }
}

LILY_INSTANTIATE_KERNEL("argmax_partial_f32", argmax_partial, float)
LILY_INSTANTIATE_KERNEL("argmax_final_f32", argmax_final, float)
LILY_INSTANTIATE_KERNEL("sample_f32", sample, float)
LILY_INSTANTIATE_KERNEL("sample_partial_f32", sample_partial, float)
LILY_INSTANTIATE_KERNEL("sample_final_f32", sample_final, float)
LILY_INSTANTIATE_KERNEL("penalize_logits_f32", penalize_logits, float)
