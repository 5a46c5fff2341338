// The one header shared by Lily's Metal kernels and the host engine: argument structs, function-constant
// index bases, tuning constants and the kernel instantiation macro. It compiles three ways:
// as MSL (xcrun metal / run-time compilation), under the Linux CPU harness (MSL_CPU), and as host C++.
#pragma once

#if defined(MSL_CPU) || defined(__METAL_VERSION__)
#include <metal_stdlib>
#define LILY_KERNEL_SIDE 1
#else
#include <cstdint>
#endif

namespace lily {

// Fixed-width field types that mean the same bytes on host and GPU.
#if defined(LILY_KERNEL_SIDE)
typedef uint u32;
typedef int i32;
#else
typedef std::uint32_t u32;
typedef std::int32_t i32;
#endif
typedef float f32;

// ---- argument structs: one per kernel family, bound at [[buffer(0)]]; explicit padding to 16 bytes ----

// rms_norm_*, rms_norm_residual_*: rows of `row_length` contiguous elements, one threadgroup per row.
struct RmsNormArgs {
  u32 row_length;  // elements per row (the hidden size, or the head dim for q/k norms)
  f32 eps;         // added to mean(x^2); 1e-6 for this model
  u32 _pad0;
  u32 _pad1;
};
static_assert(sizeof(RmsNormArgs) == 16, "RmsNormArgs layout must match the host and tests");

// gated_delta_conv_*, gated_delta_step_*, gated_delta_prefill_* (metal/gated_delta.metal): one Gated DeltaNet
// layer's token mixer core. Shapes: C = 2*Hk*Dk + Hv*dv conv channels [q | k | v]; conv state [K-1, C] (time-major,
// raw in_proj_qkv outputs); recurrent state [Hv, dv, Dk] fp32 (each dv row contiguous over Dk: the TRANSPOSE of
// lily.reference's [Hv, dk, dv]). Dk is the kernel's template parameter (128).
struct GatedDeltaArgs {
  u32 num_tokens;   // T: tokens in this call (1 for gated_delta_step)
  u32 num_k_heads;  // Hk; one threadgroup per key head (it owns its q/k channels and its Hv/Hk value heads)
  u32 num_v_heads;  // Hv, a multiple of Hk; value head j uses key head j / (Hv/Hk)
  u32 head_v_dim;   // dv; (Hv/Hk)*dv <= LILY_GDN_MAX_ROWS and <= LILY_GDN_ROWS_PER_SIMDGROUP * simdgroups
  f32 l2_eps;       // added to sum(q^2) and sum(k^2) before the rsqrt; 1e-6
  f32 norm_eps;     // added to mean(o^2) in the gated RMSNorm; 1e-6
  u32 _pad0;
  u32 _pad1;
};
static_assert(sizeof(GatedDeltaArgs) == 32, "GatedDeltaArgs layout must match the host and tests");

// argmax_partial_*, argmax_final_f32, sample_* (metal/sampling.metal): choose the next token from [vocab] logits and
// write its id to tokens[out_index], where the next step's embedding kernel reads it.
struct ArgmaxArgs {
  u32 vocab_size;   // logits per row
  u32 block_size;   // logits per threadgroup in argmax_partial (the last block may be shorter)
  u32 num_partials; // partial results argmax_final reduces (= threadgroups of argmax_partial)
  u32 out_index;    // slot of the token buffer written by argmax_final
};
static_assert(sizeof(ArgmaxArgs) == 16, "ArgmaxArgs layout must match the host and tests");

struct SampleArgs {
  u32 vocab_size;   // logits in the row
  u32 top_k;        // 0 or >= vocab_size: off
  f32 temperature;  // > 0 (temperature 0 is greedy: the host dispatches argmax instead)
  f32 top_p;        // in (0, 1]; 1: off
  f32 min_p;        // in [0, 1]; 0: off
  u32 seed_lo;      // Philox4x32-10 key: the request's 64-bit seed
  u32 seed_hi;
  u32 step;         // Philox counter word 0: the decode step (same seed and step -> same draw)
  u32 out_index;    // slot of the token buffer written
  u32 _pad0;
  u32 _pad1;
  u32 _pad2;
};
static_assert(sizeof(SampleArgs) == 48, "SampleArgs layout must match the host and tests");

// ---- function-constant indices: each op family owns a block of 10 starting at its base ----
#define LILY_FC_BASE_RMS_NORM 0
#define LILY_FC_BASE_ROPE 10
#define LILY_FC_BASE_ATTENTION 20
#define LILY_FC_BASE_QMATMUL 30
#define LILY_FC_BASE_GATED_DELTA 40
#define LILY_FC_BASE_MOE 50

// ---- tuning constants ----
// Threads per row for rms_norm: a full Apple-GPU threadgroup. Untuned: no Mac benchmark yet (issue 5).
#define LILY_RMS_NORM_MAX_THREADS 1024

// Gated DeltaNet (metal/gated_delta.metal). Untuned: no Mac benchmark yet (issue 5).
// One simdgroup updates up to this many state rows of [Dk] fp32 held in registers (Dk/32 per lane): 8 rows x 4 =
// 32 floats per lane, so 32 simdgroups (1024 threads) cover the model's (Hv/Hk)*dv = 256 rows of a key head.
#define LILY_GDN_ROWS_PER_SIMDGROUP 8
// Value rows per key head, (Hv/Hk)*dv, sized for the threadgroup arrays (model: 2*128 = 256).
#define LILY_GDN_MAX_ROWS 256
// Value heads per key head, Hv/Hk (model: 2).
#define LILY_GDN_MAX_HEADS_PER_GROUP 8
// Causal conv taps (linear_conv_kernel_dim of the model).
#define LILY_GDN_CONV_KERNEL 4

// Sampling (metal/sampling.metal). Untuned: no Mac benchmark yet (issue 5).
// argmax_partial: logits per threadgroup; 248320 / 4096 = 61 threadgroups, few enough for one argmax_final group.
#define LILY_ARGMAX_BLOCK 4096
// Partials one argmax_final threadgroup reduces (its thread count bound).
#define LILY_ARGMAX_MAX_PARTIALS 1024
// sample_*: one threadgroup of this many threads scans the whole vocabulary several times (radix select passes).
#define LILY_SAMPLE_THREADS 1024

}  // namespace lily

// ---- instantiation: LILY_INSTANTIATE_KERNEL("host_name", kernel_template, template args...) ----
#if defined(MSL_CPU)
#define LILY_INSTANTIATE_KERNEL(name_, fn_, ...) MSL_CPU_INSTANTIATE(name_, fn_, __VA_ARGS__)
#elif defined(__METAL_VERSION__)
#define LILY_INSTANTIATE_KERNEL(name_, fn_, ...) \
  template [[host_name(name_)]] [[kernel]] decltype(fn_<__VA_ARGS__>) fn_<__VA_ARGS__>;
#endif
