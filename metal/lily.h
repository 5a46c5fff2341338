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
// lily.reference's [Hv, dk, dv]). Dk is the kernel's template parameter (128; 64 for the demo model).
struct GatedDeltaArgs {
  u32 num_tokens;   // T: tokens in this call (1 for gated_delta_step)
  u32 num_k_heads;  // Hk; gated_delta_step runs one threadgroup per key head
  u32 num_v_heads;  // Hv, a multiple of Hk; value head j uses key head j / (Hv/Hk); gated_delta_prefill:
                    // ceil(dv / LILY_GDN_PREFILL_ROWS_PER_THREADGROUP) threadgroups per value head
  u32 head_v_dim;   // dv; (Hv/Hk)*dv <= LILY_GDN_MAX_ROWS (step); prefill: a threadgroup's rows,
                    // min(dv, LILY_GDN_PREFILL_ROWS_PER_THREADGROUP), <= LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP x
                    // its simdgroups
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
  u32 block_size;   // sample_partial/sample_final: logits per block (the last may be shorter); sample_* ignores it
  u32 num_blocks;   // sample_partial/sample_final: threadgroups of sample_partial; sample_* ignores it
  u32 _pad0;
};
static_assert(sizeof(SampleArgs) == 48, "SampleArgs layout must match the host and tests");

// penalize_logits_<dtype>, count_token (metal/sampling.metal): lily.sampling steps 1-3 (logit bias, repetition,
// presence and frequency penalties) on the GPU, before the choice, and the record of each chosen token.
struct PenaltyArgs {
  u32 vocab_size;          // logits in the row; ids >= vocab_size are never counted
  u32 has_bias;            // 1: add bias[i] (the request's logit_bias, dense over the vocabulary)
  f32 repetition_penalty;  // > 0 (1: off): applied to every id `seen` marks (the context and the tokens chosen)
  f32 presence_penalty;    // subtracted from every id chosen in this decode (counts[i] > 0)
  f32 frequency_penalty;   // subtracted counts[i] times
  u32 out_index;           // count_token: the token slot the choice wrote
  u32 _pad0;
  u32 _pad1;
};
static_assert(sizeof(PenaltyArgs) == 32, "PenaltyArgs layout must match the host and tests");

// qmv_*, qmm_*, qmm_nax_* (metal/qmatmul.metal): Y[M, N] = X[M, K] * W^T, W MLX affine-quantized (uint32 codes
// [N, K*bits/32], element 0 in the low bits; scales and biases [N, K/64]; w = scale*q + bias). K must be a multiple of
// 64 (the model's K: 2048, 4096, 512); the host checks it. X and Y are row-major [M, K] and [M, N].
struct QMatmulArgs {
  u32 in_features;   // K
  u32 out_features;  // N
  u32 num_rows;      // M: rows of X and Y (tokens)
  u32 _pad0;
};
static_assert(sizeof(QMatmulArgs) == 16, "QMatmulArgs layout must match the host and tests");

// dequantize_* (metal/dequantize.metal): out[n, k] = scale * q + bias for the whole [N, K] weight (the
// IN_GEMM_DEQUANT switch off: a separate pass before the dense mm_* GEMM).
struct DequantizeArgs {
  u32 in_features;   // K: a multiple of 64
  u32 out_features;  // N
  u32 _pad0;
  u32 _pad1;
};
static_assert(sizeof(DequantizeArgs) == 16, "DequantizeArgs layout must match the host and tests");

// qmv_norm_* (metal/qmatmul.metal): y = W · (rms_norm(x) ⊙ norm_weight), the RMSNorm folded into the GEMV. The norm
// is over the whole input row (K = in_features elements).
struct QMatmulNormArgs {
  u32 in_features;   // K: also the RMSNorm row length
  u32 out_features;  // N
  u32 num_rows;      // M: rows of X and Y (tokens)
  f32 eps;           // added to mean(x^2); 1e-6 for this model
};
static_assert(sizeof(QMatmulNormArgs) == 16, "QMatmulNormArgs layout must match the host and tests");

// qmv_seg_* / qmv_norm_seg_* (metal/qmatmul.metal): one decode GEMV over up to LILY_QMV_MAX_SEGMENTS matrices that
// share their input, each bound from its own buffers (no concatenated copy); segment s writes output rows
// [sum of rows before s, + rows[s]). eps is read by the _norm_ variants only.
#define LILY_QMV_MAX_SEGMENTS 4
struct QMatmulSegmentsArgs {
  u32 in_features;                   // K
  u32 out_features;                  // N: sum of rows[0 .. num_segments)
  u32 num_segments;                  // 1..LILY_QMV_MAX_SEGMENTS; unused segments' bindings are never read
  f32 eps;                           // added to mean(x^2) (qmv_norm_seg)
  u32 rows[LILY_QMV_MAX_SEGMENTS];   // output rows of each segment
};
static_assert(sizeof(QMatmulSegmentsArgs) == 32, "QMatmulSegmentsArgs layout must match the host and tests");

// qmv_gated_norm_residual_staged (metal/qmatmul.metal): out = residual + W · x with x the DeltaNet's gated RMSNorm of o
// (value heads of head_dim values), one input row.
struct QMatmulGatedNormArgs {
  u32 in_features;   // K = value heads * head_dim
  u32 out_features;  // N
  u32 head_dim;      // dv: the gated norm's row length
  f32 eps;           // added to mean(o^2) per head
};
static_assert(sizeof(QMatmulGatedNormArgs) == 16, "QMatmulGatedNormArgs layout must match the host and tests");

// embedding_gather_* (metal/embedding.metal): out[t] = dequantized row ids[ids_offset + t] of the quantized table.
struct EmbeddingArgs {
  u32 hidden_size;  // H, a multiple of 64
  u32 vocab_size;   // V; an id >= V yields a row of NaN (the host validates prompt ids; sampled ids are < V)
  u32 ids_offset;   // first slot of the ids buffer read (decode: the slot argmax/sample wrote)
  u32 _pad0;
};
static_assert(sizeof(EmbeddingArgs) == 16, "EmbeddingArgs layout must match the host and tests");

// moe_* (metal/moe.metal: decode; metal/moe_prefill.metal: prefill): the sparse MoE block, 4-bit affine group-64
// expert weights in the stacked switch_mlp layout (gate/up [E, I, H], down [E, H, I]; bf16 scales and biases).
// H, I and Is are multiples of 64 (the quantization group); every kernel of the family takes this one struct.
struct MoeArgs {
  u32 num_rows;            // T: tokens in this call (1 for decode)
  u32 num_experts;         // E <= LILY_MOE_MAX_EXPERTS
  u32 top_k;               // k <= E experts per token (the model: 8)
  u32 hidden_size;         // H: model width (input of gate/up, output of down)
  u32 expert_size;         // I: routed expert width (moe_intermediate_size)
  u32 shared_expert_size;  // Is: shared expert width (decode kernels; prefill runs the shared expert as dense qmm)
  u32 tile_rows;           // prefill: rows per grouped-GEMM tile (16 or 32, the GEMM kernel's bm)
  u32 max_tiles;           // prefill: rows of the tile map = grouped-GEMM threadgroups along y
};
static_assert(sizeof(MoeArgs) == 32, "MoeArgs layout must match the host and tests");

// moe_gate_up_swiglu_routed_* (metal/moe.metal): the decode gate/up kernel with moe_route and the post-attention
// RMSNorm of the hidden stream folded in. `moe` as for the other decode kernels (num_rows 1).
struct MoeRoutedArgs {
  MoeArgs moe;
  f32 eps;  // RMSNorm eps (model: 1e-6)
  u32 _pad0;
  u32 _pad1;
  u32 _pad2;
};
static_assert(sizeof(MoeRoutedArgs) == 48, "MoeRoutedArgs layout must match the host and tests");

// attention_prep_* (metal/attention_prep.metal): per-head q/k RMSNorm, partial RoPE, [query | gate] split, KV-cache
// write.
// Token t sits at position first_position + t and is written to cache row first_position + t.
struct AttentionPrepArgs {
  u32 num_tokens;      // T: 1 for decode
  u32 num_heads;       // Hq (model: 16)
  u32 num_kv_heads;    // Hkv (model: 2)
  u32 first_position;  // position of token 0 = tokens already in the cache
  u32 cache_capacity;  // rows per KV head of k_cache / v_cache [Hkv, capacity, D]; first_position + T <= capacity
  u32 rotary_dim;      // R: the first R dims are rotated, pairs (d, d + R/2); even, <= head_dim (model: 64)
  f32 rope_theta;      // base of inv_freq = theta^(-2i/R) (model: 1e7)
  f32 eps;             // RMSNorm eps (model: 1e-6)
};
static_assert(sizeof(AttentionPrepArgs) == 32, "AttentionPrepArgs layout must match the host and tests");

// attention_decode*, attention_prefill_* (metal/attention.metal, metal/attention_prefill.metal): gated causal GQA
// attention over the KV cache [Hkv, capacity, D]. Query t of the call sits at position num_keys - num_queries + t and
// sees cache rows 0 .. its position. Query head h reads KV head h / (Hq / Hkv); Hq / Hkv must be a multiple of
// the heads one threadgroup packs (LILY_ATTN_HEADS_PER_GROUP at D = 256, LILY_ATTN_HEADS_PER_GROUP_D64 at D = 64,
// 1 for the attention_decode*_unpacked_* kernels).
struct AttentionArgs {
  u32 num_queries;     // T: 1 for the decode kernels
  u32 num_heads;       // Hq
  u32 num_kv_heads;    // Hkv
  u32 num_keys;        // cached keys including this call's: position of the last query + 1
  u32 cache_capacity;  // rows per KV head (row stride of the cache)
  u32 reserved;        // 0 (was the split-KV block size: the partial kernel now derives its span from num_keys)
  u32 num_blocks;      // split-KV decode: key blocks; block b holds keys [b * span, (b + 1) * span) of num_keys, with
                       // span = ceil(num_keys / num_blocks) (trailing blocks may be empty)
  f32 scale;           // softmax scale, 1/sqrt(head_dim) = 0.0625 for the model
};
static_assert(sizeof(AttentionArgs) == 32, "AttentionArgs layout must match the host and tests");

// ---- function-constant indices: each op family owns a block of 10 starting at its base ----
#define LILY_FC_BASE_RMS_NORM 0
#define LILY_FC_BASE_ROPE 10
#define LILY_FC_BASE_ATTENTION 20
#define LILY_FC_BASE_QMATMUL 30
#define LILY_FC_BASE_GATED_DELTA 40
#define LILY_FC_BASE_MOE 50

// ---- tuning constants ----
// Threads per row for rms_norm: a full Apple-GPU threadgroup. Untuned: no Mac benchmark yet.
#define LILY_RMS_NORM_MAX_THREADS 1024

// Gated DeltaNet (metal/gated_delta.metal). Untuned: no Mac benchmark yet.
// gated_delta_step: state rows per simdgroup and batch (their loads issued together); the step takes any threadgroup
// size, and ceil(rows / 8) simdgroups (1024 threads for the model's 256 rows per key head) give each simdgroup one
// batch of 8 rows.
#define LILY_GDN_ROWS_PER_SIMDGROUP 8
// gated_delta_prefill: state rows of [Dk] fp32 one simdgroup keeps in registers for a whole chunk (Dk/32 per lane).
// Fewer rows per simdgroup shorten the per-token chain of the scan, which is serial over the chunk.
#define LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP 1
// gated_delta_prefill: state rows of one value head per threadgroup (grid: Hv x ceil(dv / 32)): 32 simdgroups of one
// row (1024 threads, as the decode step's) and 4 threadgroups per dv = 128 head, 128 threadgroups for the model's 32
// value heads. Measured on the H200 at T = 512 (rows per threadgroup / per simdgroup, µs): 32/1 1,002, 16/2 1,247,
// 8/1 1,159, 8/2 1,442, 32/4 1,500; one threadgroup of 4-row simdgroups per head 2,003 (docs/performance.md).
#define LILY_GDN_PREFILL_ROWS_PER_THREADGROUP 32
// gated_delta_prefill: the largest key head dim (staged q and k rows).
#define LILY_GDN_MAX_DK 128
// gated_delta_step: value rows per key head, (Hv/Hk)*dv, sized for the threadgroup arrays (model: 2*128 = 256).
#define LILY_GDN_MAX_ROWS 256
// gated_delta_step: at most this many value heads per key head, Hv/Hk (model: 2).
#define LILY_GDN_MAX_HEADS_PER_GROUP 8
// Causal conv taps (linear_conv_kernel_dim of the model).
#define LILY_GDN_CONV_KERNEL 4
// gated_delta_conv: tokens per thread (grid y = ceil(T / this)): at a 512-token chunk, 32 blocks of the model's 8,192
// channels, where one thread per channel walking all T tokens gave 32 threadgroups.
#define LILY_GDN_CONV_TOKENS 16
// gated_delta_prefill_blockwise (the REGISTER_SCAN ablation): tokens between two state round trips through memory.
// 16 as in the blockwise scans that preceded register residency; not a tuning point (the ablation's baseline).
#define LILY_GDN_SCAN_BLOCK 16
// gated_delta_chunk_prepare/_scan (the chunked prefill scan): tokens per chunk. 32, not FLA's 64: the prepare
// kernel's threadgroup arrays (two [C, 64] slabs and two [C, C] matrices, 25 KB at 32) exceed Apple's 32 KB at 64,
// and per token the intra-chunk work grows with C (C·(Dk + dv) of the solve, 2·C·Dk of the Gram matrices) while the
// scan's (3·Dk·dv + C·dv/2) barely changes. Untuned: chosen on those counts, not timed.
#define LILY_GDN_CHUNK 32
// gated_delta_chunk_prepare: columns of the [C, Dk] and [C, dv] operands staged in threadgroup memory at a time.
#define LILY_GDN_CHUNK_SLAB 64
// gated_delta_chunk_scan: simdgroups per threadgroup, each owning 8 value rows of one head (the slice of S^T it keeps
// in registers for the whole prefill): 16 rows per threadgroup, grid Hv x ceil(dv / 16), 256 threadgroups of 64
// threads for the model (the 512 simdgroups spread evenly over the GPU's cores). Untuned.
#define LILY_GDN_CHUNK_SCAN_SIMDGROUPS 2

// Sampling (metal/sampling.metal). Untuned: no Mac benchmark yet.
// argmax_partial: logits per threadgroup; 248320 / 4096 = 61 threadgroups, few enough for one argmax_final group.
#define LILY_ARGMAX_BLOCK 4096
// sample_*: one threadgroup of this many threads scans the whole vocabulary several times (radix select passes).
#define LILY_SAMPLE_THREADS 1024
// sample_partial/sample_final (the block path): logits per sample_partial threadgroup (248320 / 4096 = 61 blocks),
// at most LILY_SAMPLE_PER_THREAD per thread (kept in registers), and the candidates each block keeps (its largest x):
// sample_final draws from them alone when they hold every token the filters keep.
#define LILY_SAMPLE_BLOCK 4096
#define LILY_SAMPLE_PER_THREAD 16
#define LILY_SAMPLE_CANDIDATES 64

// Quantized matmul (metal/qmatmul.metal) and embedding (metal/embedding.metal). Untuned: no Mac benchmark yet.
// qmv: each simdgroup computes LILY_QMV_ROWS_PER_SIMDGROUP output rows; LILY_QMV_SIMDGROUPS simdgroups per threadgroup
// (64 threads, 8 rows). A lane reads a row in packs of LILY_QMV_PACK_WORDS consecutive words (32 codes at 4 bits:
// one scale and bias per pack), LILY_QMV_PACKS_PER_LANE packs per row and step, 32 packs apart, so a step of a
// simdgroup covers 256 words (2,048 codes at 4 bits: the model's K = 2048 rows in one step, every load in flight at
// once). Rows and simdgroups: the shape measured on the H200 (docs/performance.md, "Decode kernels on the H200");
// not yet measured on a Mac. Each threadgroup also takes up to LILY_QMV_MAX_ROWS input rows (grid y = ceil(M / that)),
// so the weights are read once for all of them.
#define LILY_QMV_ROWS_PER_SIMDGROUP 4
#define LILY_QMV_SIMDGROUPS 2
#define LILY_QMV_PACK_WORDS 4
#define LILY_QMV_PACKS_PER_LANE 2
// Host rule: M <= LILY_QMV_MAX_ROWS runs qmv (one threadgroup row for all M input rows: the weights are read once),
// larger M the tiled GEMM qmm_*_bm<16|32|64> (tuning::qmm_tile_rows: the widest tile that still launches enough
// threadgroups; each dequantized weight tile serves BM rows).
#define LILY_QMV_MAX_ROWS 4
// qmv_mma (CUDA's choice for a few rows of bf16 activations: tuning::mma_gemv): the GEMV on matrix units. A
// threadgroup owns LILY_QMV_MMA_ROWS output features (8-row fragments of W) for 8 input rows (one 8-column fragment
// of X^T; grid y = ceil(M / 8)); its simdgroups (the host's choice, tuning::qmv_mma_simdgroups; at most
// LILY_QMV_MMA_MAX_SIMDGROUPS, the partial sums' threadgroup array) take interleaved quantization groups of K and add
// their partial sums through threadgroup memory; each simdgroup loads LILY_QMV_MMA_GROUPS_PER_STEP groups before
// using any.
#define LILY_QMV_MMA_ROWS 16
#define LILY_QMV_MMA_MAX_SIMDGROUPS 8
#define LILY_QMV_MMA_GROUPS_PER_STEP 4
// The staged one-row GEMVs (qmv_norm_staged, qmv_residual_staged, qmv_norm_seg_staged; chosen on CUDA): K up to this
// many inputs, staged as fp32 in threadgroup memory (16 KiB at the most, plus the pack sums). The model's K are 2048
// and 4096.
#define LILY_QMV_STAGE_MAX_K 4096
// The staged GEMVs' threadgroups (CUDA): this many simdgroups of LILY_QMV_ROWS_PER_SIMDGROUP rows share one staging of
// x (the kernels take any multiple of 32 threads; the host's choice). 4 against 2 on the H200: lm_head 179 against
// 197 us, tg128 324.8 against 314.5 tok/s (docs/performance.md).
#define LILY_QMV_STAGED_SIMDGROUPS 4
// float4 chunks of x each thread stages per round (all loads of a round in flight at once). The gated-norm staging
// takes one round: K <= 4 * LILY_QMV_STAGE_BATCH * threads.
#define LILY_QMV_STAGE_BATCH 8
// qmv_gated_norm_residual_staged: at most this many value heads (K / head_dim) of the gated norm it stages.
#define LILY_QMV_STAGE_MAX_HEADS 128
#define LILY_QMM_BM16_MAX_ROWS 16
// The tiled GEMMs (metal/gemm.h: qmm, mm and the grouped MoE GEMM): 4 simdgroups own a BM x LILY_GEMM_BN output tile
// and step through K LILY_GEMM_BK at a time (BK divides the group size 64: one scale and bias per weight row and
// step). 64-row tiles exist for 16-bit activations only (fp32 tiles would pass Metal's 32 KB of threadgroup memory).
#define LILY_GEMM_BN 64
#define LILY_GEMM_BK 32
#define LILY_GEMM_THREADS 128
// qmm_nax's K step (Metal 4 tensor ops).
#define LILY_QMM_BK LILY_GEMM_BK
// qmm_nax (Metal 4 tensor ops): 32 x 64 output tile, 4 simdgroups each running a 16x32x32 matmul2d.
#define LILY_QMM_NAX_BM 32
#define LILY_QMM_NAX_BN 64
// dequantize: threads per threadgroup, each expanding one packed uint32 word. Untuned: no Mac benchmark yet.
#define LILY_DEQUANTIZE_THREADS 256
// embedding_gather: threads per token row (each folds 8 codes per step).
#define LILY_EMBEDDING_THREADS 256

// MoE (metal/moe.metal, metal/moe_prefill.metal). Untuned: no Mac benchmark yet.
// Router limits: moe_route keeps one row's E probabilities in registers of one simdgroup (E/32 per lane).
#define LILY_MOE_MAX_EXPERTS 256
// Decode gate/up GEMV: 2 simdgroups x 4 output rows (each a gate row and an up row) = 8 rows per threadgroup. A lane
// reads the qmv packs (LILY_QMV_PACK_WORDS words, LILY_QMV_PACKS_PER_LANE per row and step), so at the model's
// H = 2048 a simdgroup issues all of its 8 rows' loads (8 KB) at once; 9 slots x 64 threadgroups keep the layer's
// 10.6 MB in flight in one wave on an H200 (1,152 simdgroups).
#define LILY_MOE_GEMV_ROWS_PER_SIMDGROUP 4
#define LILY_MOE_GEMV_SIMDGROUPS 2
// Decode down + combine GEMV: each simdgroup owns 2 output rows and reads their k + 1 slots' rows as one flattened row
// of packs (k * I / 32 + Is / 32 packs: 144 at the model's k = 8, I = Is = 512), LILY_MOE_DOWN_PACKS_PER_LANE per lane
// and step, so 32 x 5 = 160 >= 144 covers the model's row in one step with every load in flight; 4 simdgroups
// (8 rows) per threadgroup. The routing weight of a pack's slot folds into that pack's partial sum.
#define LILY_MOE_DOWN_ROWS_PER_SIMDGROUP 2
#define LILY_MOE_DOWN_SIMDGROUPS 4
#define LILY_MOE_DOWN_PACKS_PER_LANE 5
// The staged decode experts (CUDA: moe_*_staged, tuning::staged_gemv): the most hidden values moe_down_combine_staged
// stages, k I + Is (the model's 8 x 512 + 512; 20 KB of threadgroup memory, in whole blocks of 32 packs).
#define LILY_MOE_STAGE_MAX_K 4608
// moe_down_combine_staged routes again before its dependency wait (the ids and weights in threadgroup memory): the
// most routed slots it holds (the host stages the experts only up to this top_k; the model's is 8).
#define LILY_MOE_DOWN_ROUTE_MAX_K 16
// Prefill sort: (token, slot) assignments per threadgroup of moe_sort_count / moe_sort_scatter (one per thread).
#define LILY_MOE_SORT_BLOCK 256
// Grouped GEMM: the tiled GEMM of metal/gemm.h (LILY_GEMM_*) on bm rows (16 or 32) of one expert. The host picks
// bm = 32 when the chunk's mean rows per expert T*k/E is at least this threshold, else bm = 16 (fewer padded rows for
// sparse experts). 16: on the H200 at a mean of 16 (a 512-token chunk, uniform random routing) bm = 32 took 446 and
// 231 us for gate/up and down against 472 and 235 for bm = 16 (docs/results/h200/2026-12-03-5e46470); below a mean
// of 16 not timed. Not timed on a Mac.
#define LILY_MOE_BM32_MIN_ROWS_PER_EXPERT 16

// Attention (metal/attention.metal, metal/attention_prefill.metal). Untuned: no Mac benchmark yet.
// Query heads per threadgroup sharing one KV head (GQA packing): each K/V row read serves this many heads.
#define LILY_ATTN_HEADS_PER_GROUP 4
// The same for the head-dim-64 instances (demo model, test fixtures): their GQA group is 2 (demo) or 4, so 2.
#define LILY_ATTN_HEADS_PER_GROUP_D64 2
// attention_decode*: keys one simdgroup takes per loop step. Its U K-row loads are independent and in flight
// together, and one online-softmax update (one max, one rescale) covers U scores, so the dependent chain load ->
// dot -> simd_sum -> exp -> V load runs once per U keys instead of once per key. 8 keeps the U rows' registers
// (U x 2 float4 per lane at D = 256) next to the 4 heads' query and accumulator without spills (ptxas -v at sm_90).
#define LILY_ATTN_DECODE_KEYS_PER_STEP 8
// Decode runs split-KV (attention_decode_partial + attention_decode_combine) from this many keys on, with
// num_blocks = 2^floor(log2(2 * keys / this)) blocks (tuning::attention_split_blocks): 2 blocks of 128 keys here,
// doubling with the keys, so one recorded program serves a whole doubling of the context. Below it the single pass
// has at most 4 loop steps per simdgroup (8 simdgroups x 8 keys per step): its Hq/4 threadgroups suffice. A design
// guess, not measured (nor on Apple GPUs).
#define LILY_ATTN_SPLIT_MIN_KEYS 256
// Where the runtime prefers short split-KV blocks (Runtime::prefers_short_split_blocks: CUDA), the block count doubles
// with every doubling of keys / this instead (from the same threshold): 8 blocks at 256 keys, 64 from 2K. On matrix
// units a threadgroup takes a whole GQA group, so the rule above gave 32 blocks x 2 threadgroups at 4K keys, 64 of an
// H100's 132 SMs; with this, 128 threadgroups: tg128 +0.7 % at depths 1024 and 4096 on an H100
// (docs/performance.md).
#define LILY_ATTN_SPLIT_SHORT_BLOCK_KEYS 64
// Most split-KV blocks (reached at 32x the block unit: 8K keys, 2K with CUDA's short blocks; past that the blocks
// grow): 64 blocks x 4 threadgroups of the vector kernel (the model's 16 heads), x 2 on matrix units, and the
// partials (Hq x blocks x D fp32, 1 MiB) stay small next to the cache they summarise (67 MB at 32K keys).
// attention_decode_combine keeps one weight per block in threadgroup memory, so this is also its limit. 64, not
// 128: on the H200 at 32K keys partials + combine took 81.4 + 11.6 us against 91.2 + 17.4 with 128 blocks (cold L2;
// docs/results/h200/2026-12-04-c9038d5/earlier/sweep.json).
#define LILY_ATTN_SPLIT_MAX_BLOCKS 64
// attention_decode[_partial][_prep]_mma: simdgroups per threadgroup (the kernels take exactly this many; 1, 2, 4 or
// 8, a divisor of D / 8 at D = 64 and 256): each scores 8 keys of a chunk of 8n and accumulates D / n output dims of
// it. 8: on the H200 at 32K keys (64 blocks) 34.3 us against 39.3 with 4, and 4 x 128 blocks 35.6, when the
// simdgroups took every n-th step of 8 keys and merged their O^T (docs/results/h200/2026-12-04-ec4bc8a).
#define LILY_ATTN_DECODE_MMA_SIMDGROUPS 8
// attention_prefill: bytes of one staged K (or V) tile in threadgroup memory; tile keys = this / (D * sizeof(cache
// element)): 16 keys at D = 256 in bf16, 8 in f32. K and V tiles together stay at 16 KiB of the 32 KiB.
#define LILY_ATTN_PREFILL_TILE_BYTES 8192
// attention_prefill_mma: the chunk length from which the host picks it over attention_prefill (below it most of the 8
// query columns of a fragment would be padding), and the query tokens of one threadgroup (one 8-column fragment per
// simdgroup).
#define LILY_ATTN_MMA_MIN_QUERIES 8
#define LILY_ATTN_MMA_QUERIES 8
// attention_prefill_mma: query heads per threadgroup, one simdgroup each, all reading the same staged K/V tiles. At
// D = 256 the model's whole GQA group (16 / 2 = 8 heads: each K/V tile serves 64 query rows); at D = 64 the demo
// model's group of 2. Head ratios that are not a multiple run the *_unpacked_* kernels (one head per threadgroup).
#define LILY_ATTN_MMA_HEADS_PER_GROUP 8
#define LILY_ATTN_MMA_HEADS_PER_GROUP_D64 2
// attention_prefill_mma_split (SPLIT_PREFILL_KV): a chunk whose single pass has fewer than half this many threadgroups
// (ceil(T / 8) x Hq / G: 2 for an 8-token chunk of the model, 128 for 512 tokens) splits its keys into
// floor(this / those) blocks, at most LILY_ATTN_SPLIT_MAX_BLOCKS (the combine's limit) and at most one per
// LILY_ATTN_PREFILL_SPLIT_MIN_BLOCK_KEYS keys, so that short chunks deep in a context (a chat turn's prompt) fill the
// GPU instead of walking the whole cache in Hq / G threadgroups. Design guesses, measured in docs/performance.md.
#define LILY_ATTN_PREFILL_SPLIT_GROUPS 256
#define LILY_ATTN_PREFILL_SPLIT_MIN_BLOCK_KEYS 512
// attention_prefill_mma key tiles: at most LILY_ATTN_MMA_TILE_KEYS keys and LILY_ATTN_MMA_TILE_BYTES bytes per K (and
// per V) tile, so the two stay within Metal's 32 KiB of threadgroup memory (attn_mma_tile_keys below: 32 keys in
// bf16 and 16 in f32 at D = 256, 32 at D = 64). A tile costs two barriers and one online-softmax rescale of the 32
// O fragments, so wider is better up to the threadgroup-memory limit.
#define LILY_ATTN_MMA_TILE_KEYS 32
#define LILY_ATTN_MMA_TILE_BYTES 16384

// Keys per attention_prefill_mma tile at head dim `head_dim` with `element_bytes`-byte cache elements.
constexpr u32 attn_mma_tile_keys(u32 head_dim, u32 element_bytes) {
  return LILY_ATTN_MMA_TILE_BYTES / (head_dim * element_bytes) < LILY_ATTN_MMA_TILE_KEYS
             ? LILY_ATTN_MMA_TILE_BYTES / (head_dim * element_bytes)
             : LILY_ATTN_MMA_TILE_KEYS;
}

#if defined(LILY_KERNEL_SIDE)
// LILY_UNROLL fully unrolls the loop that follows (constant trip count), so the small arrays it indexes stay in
// registers: MSL and the CPU harness's clang take the same pragma; clang's CUDA back end otherwise keeps them in local
// memory.
#define LILY_UNROLL _Pragma("clang loop unroll(full)")
// A helper inlined into its kernel whatever its size (MSL and clang alike): as a real call on CUDA, its arrays
// passed by reference live in local memory.
#define LILY_INLINE inline __attribute__((always_inline))

// Programmatic dependent launch (CUDA on sm_90, the runtime's PDL edges: docs/cuda.md): a kernel may start while the
// dispatch before it in the graph is still running, and must wait here before it reads anything an earlier dispatch
// wrote or writes anything at all; only model weights may be read before. Waiting also lets the next kernel start
// (its own loads of weights then overlap this kernel). Once every earlier dispatch has finished, or where a GPU has no
// such launch (Metal, the CPU harness), it returns at once. Kernels instantiated with LILY_INSTANTIATE_KERNEL wait
// before their first instruction; LILY_INSTANTIATE_EARLY_KERNEL ones call this themselves.
LILY_INLINE void grid_dependency_wait() {
#if defined(MSL_CUDA)
  ::msl_cuda_detail::grid_dependency_wait();  // the wait the shim's entry points run (msl_cuda_launch.h)
#endif
}
#endif

#if defined(LILY_KERNEL_SIDE)
// Attention-family helpers: four consecutive elements as one float4 load, and stored back rounded element-wise (a
// vector-to-vector constructor is a bit-cast in the CPU harness).
template <typename T>
inline float4 attn_load4(device const T* p) {
  return float4(*((device const metal::vec<T, 4>*)p));
}
template <typename T>
inline float4 attn_load4(threadgroup const T* p) {
  return float4(*((threadgroup const metal::vec<T, 4>*)p));
}
template <typename T>
inline void attn_store4(device T* p, float4 v) {
  p[0] = T(v.x);
  p[1] = T(v.y);
  p[2] = T(v.z);
  p[3] = T(v.w);
}
#endif

}  // namespace lily

// ---- instantiation: LILY_INSTANTIATE_KERNEL("host_name", kernel_template, template args...) ----
// LILY_INSTANTIATE_EARLY_KERNEL instantiates a kernel that calls lily::grid_dependency_wait() itself, after loading
// only what no earlier dispatch of its graph writes (model weights); every other kernel waits before its first
// instruction. The same kernel everywhere but on CUDA (see grid_dependency_wait).
#if defined(MSL_CPU)
#define LILY_INSTANTIATE_KERNEL(name_, fn_, ...) MSL_CPU_INSTANTIATE(name_, fn_, __VA_ARGS__)
#define LILY_INSTANTIATE_EARLY_KERNEL(name_, fn_, ...) MSL_CPU_INSTANTIATE_EARLY(name_, fn_, __VA_ARGS__)
#elif defined(__METAL_VERSION__)
#define LILY_INSTANTIATE_KERNEL(name_, fn_, ...) \
  template [[host_name(name_)]] [[kernel]] decltype(fn_<__VA_ARGS__>) fn_<__VA_ARGS__>;
#define LILY_INSTANTIATE_EARLY_KERNEL(name_, fn_, ...) LILY_INSTANTIATE_KERNEL(name_, fn_, __VA_ARGS__)
#endif
