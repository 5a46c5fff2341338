// Kernel choice by workload shape, in one table. Every value says why it is what it is. Where a kernel
// family keeps its own threshold in metal/lily.h, this file refers to it rather than copying it.
// None of these is tuned on a Mac yet: they are derived from the kernels' designs and MLX's choices.
#pragma once

#include <cstddef>

#include "../../metal/lily.h"

namespace lily::tuning {

// GEMV vs GEMM by rows: at most this many rows run qmv (one threadgroup row reads the weights once for all of
// them); more rows run qmm. The qmatmul kernels define the crossover with their tile shapes.
constexpr size_t kQmvMaxRows = LILY_QMV_MAX_ROWS;
// ... and a short prompt's projections of up to twice that many rows keep qmv below kQmmShortMinOutFeatures output
// features: qmv reads the weights once per 4 rows (twice at 8) but launches N / 8 threadgroups, where qmm's N / 64
// tiles of 16 rows leave most of the GPU idle. On the H200 at 8 rows (scripts/bench_kernels.py "short prompt", cold
// L2, qmv vs qmm_bm16, µs): out_proj 2048 x 4096 29 vs 89, in_proj_z 4096 36 vs 45, k/v_proj 512 12 vs 48, in_proj_b/a
// 32 11 vs 46, the 8-bit router 256 12 vs 50; from N = 8192 qmm's tiles win (the DeltaNet qkv and attention q
// projections: 46 vs 58 at 8 rows, lm_head's 3,880 tiles 329 vs 1,376). Not measured on a Mac.
constexpr size_t kQmvShortMaxRows = 2 * LILY_QMV_MAX_ROWS;
// Prompt chunks of up to this many tokens run a pass recorded once per length and replayed (REPLAYED_PROMPTS), as the
// decode step does; longer ones are built and launched per chunk (a recording of ~850 nodes would then be made for
// every chunk length, and their GPU time dwarfs the launches).
constexpr size_t kReplayedPromptMaxRows = kQmvShortMaxRows;
constexpr size_t kQmmShortMinOutFeatures = 8192;
constexpr bool qmv_takes(size_t rows, size_t out_features) {
  return rows <= kQmvMaxRows || (rows <= kQmvShortMaxRows && out_features < kQmmShortMinOutFeatures);
}
// ... unless the GEMV runs on matrix units (MMA_GEMV, chosen where Runtime::prefers_mma_gemv: CUDA): up to this many
// rows (one 8-column fragment of X^T) of bf16 activations against 4-bit weights with bf16 scales run qmv_mma, whose
// cost hardly grows with the rows (the MMA takes 8 columns whatever M is) where qmv's grows by an FMA per weight and
// row: on an H100 (scripts/bench_kernels.py, cold L2, docs/results/h200/2026-12-05-4ef0610/) qmv_mma took 10-20 us
// at every model shape and 1 to 8 rows (lm_head 172-205 us), qmv from 3 rows on more at every shape (8 rows: 2048 x
// 2048 17.0 against 11.4 us, lm_head 1,379 against 205). Below 8,192 outputs it runs 8 simdgroups
// (qmv_mma_simdgroups), which win at 2 rows too (docs/results/h200/2026-12-05-d25e27e-qmv-mma-simdgroups/: 2048 x
// 2048 8.8-9.0 against qmv's 9.5, out_proj 2048 x 4096 13.0-13.2 against 13.7-13.9, in_proj_z 4096 9.6-9.9 against
// 12.0; k/v_proj 512 8.3-8.6 against 8.1, the one loss) but not at one row (out_proj 12.5 against 10.0, k/v_proj 7.8
// against 6.2), so one row takes it only from 8,192 outputs on (lm_head 172 against 214). 8-bit codes do not fit
// bf16's 8-bit significand with the offset the kernel needs.
constexpr size_t kQmvMmaMaxRows = 8;
constexpr size_t kQmvMmaFewRows = 1;
constexpr size_t kQmvMmaFewRowsMinOutFeatures = 8192;
constexpr bool mma_gemv(bool switched_on, size_t rows, size_t out_features, int bits, bool bf16_activations,
                        bool bf16_scales) {
  return switched_on && rows <= kQmvMmaMaxRows &&
         (rows > kQmvMmaFewRows || out_features >= kQmvMmaFewRowsMinOutFeatures) && bits == 4 && bf16_activations &&
         bf16_scales;
}
// ... and an f32-output GEMM with fewer output features than one 8-column MMA fragment (the shared-expert gate's
// logit, N = 1) stays on qmv at any number of rows: qmm's tile would be almost all padding, and re-reading so small
// a weight per 4 rows costs little (on the H200 a 512-row qmm_of32 of N = 1 took 36 us, the router's N = 256 the
// same). Only there: at full size every bf16-output projection has N >= 32.
constexpr size_t kQmmOf32MinOutFeatures = 8;
// qmm tile rows (metal/gemm.h): 16 up to this many rows (fewer padded rows), else the widest of 32 and 64 that still
// launches kQmmMinThreadgroups threadgroups (64 only for bf16 activations: fp32 tiles would pass Metal's 32 KB of
// threadgroup memory). A 64-row tile reads each dequantized weight tile for twice the rows of a 32-row one, but at
// 512 rows an N = 2048 projection has only 256 of them: a few per GPU core, too few to hide the loads' latency (an
// H200 has 132 SMs; Apple's large GPUs 60-80 cores).
constexpr size_t kQmmBm16MaxRows = LILY_QMM_BM16_MAX_ROWS;
constexpr size_t kQmmMinThreadgroups = 512;
constexpr size_t qmm_tile_rows(size_t rows, size_t out_features, bool wide_tiles, bool bf16_activations) {
  if (rows <= kQmmBm16MaxRows || !wide_tiles) return 16;
  const size_t columns = (out_features + LILY_GEMM_BN - 1) / LILY_GEMM_BN;
  if (bf16_activations && columns * ((rows + 63) / 64) >= kQmmMinThreadgroups) return 64;
  return 32;
}
// MoE grouped GEMM tile by mean rows per expert (T*k/E): 32-row tiles from this value on.
constexpr size_t kMoeBm32MinRowsPerExpert = LILY_MOE_BM32_MIN_ROWS_PER_EXPERT;
// Prefill attention: the matrix-unit kernel from this many queries (an 8-row fragment is mostly padding below).
constexpr size_t kAttentionMmaMinQueries = LILY_ATTN_MMA_MIN_QUERIES;
// ... whose threadgroups each take this many query tokens (one 8-column fragment per simdgroup) of G heads
// (ops::attention_mma_heads_per_group: LILY_ATTN_MMA_HEADS_PER_GROUP*), over key tiles of lily::attn_mma_tile_keys
// keys (32 in bf16, 16 in f32 at head dim 256: two tiles fill Metal's 32 KiB of threadgroup memory).
constexpr size_t kAttentionMmaQueries = LILY_ATTN_MMA_QUERIES;
// Attention path by context: split-KV decode (partials + combine) from this many keys on, single pass below.
constexpr size_t kAttentionSplitMinKeys = LILY_ATTN_SPLIT_MIN_KEYS;
// Most split-KV blocks (the partial buffers are sized for it; the combine kernel's limit).
constexpr size_t kAttentionSplitMaxBlocks = LILY_ATTN_SPLIT_MAX_BLOCKS;
// Split-KV blocks at `keys` keys, splitting from `min_keys` (below: 0, the single pass): 2^floor(log2(2 * keys /
// unit)) with unit = min(block_keys, min_keys), up to kAttentionSplitMaxBlocks (block_keys = min_keys: 2 blocks at
// min_keys, doubling with every doubling of the keys). The kernel derives the block span from the key count, so the
// decode program changes only when this does: about log2(kAttentionSplitMaxBlocks) times over a long decode.
constexpr size_t attention_split_blocks(size_t keys, size_t min_keys, size_t block_keys) {
  if (keys < min_keys) return 0;
  const size_t unit = block_keys < min_keys ? block_keys : min_keys;
  size_t blocks = 1;
  // Double while the doubled count stays <= 2 * keys / unit.
  while (blocks < kAttentionSplitMaxBlocks && blocks * unit <= keys) blocks *= 2;
  return blocks;
}
// The unit where the runtime prefers short blocks (Runtime::prefers_short_split_blocks), else min_keys.
constexpr size_t kAttentionSplitShortBlockKeys = LILY_ATTN_SPLIT_SHORT_BLOCK_KEYS;
// Split-KV prefill (attention_prefill_mma_split + attention_decode_combine): key blocks of a chunk whose single pass
// runs `query_groups` threadgroups over `keys` keys, with blocks of at least `min_block_keys` keys
// (kAttentionPrefillSplitMinBlockKeys unless a test lowers it); 0 = the single pass.
constexpr size_t kAttentionPrefillSplitGroups = LILY_ATTN_PREFILL_SPLIT_GROUPS;
constexpr size_t kAttentionPrefillSplitMinBlockKeys = LILY_ATTN_PREFILL_SPLIT_MIN_BLOCK_KEYS;
constexpr size_t attention_prefill_split_blocks(size_t query_groups, size_t keys, size_t min_block_keys) {
  size_t blocks = query_groups ? kAttentionPrefillSplitGroups / query_groups : 0;
  if (blocks > keys / min_block_keys) blocks = keys / min_block_keys;
  if (blocks > kAttentionSplitMaxBlocks) blocks = kAttentionSplitMaxBlocks;
  return blocks >= 2 ? blocks : 0;
}

// Staged one-row GEMVs (qmv_norm_staged, qmv_residual_staged, qmv_norm_seg_staged in metal/qmatmul.metal): x staged in
// threadgroup memory once per threadgroup. Chosen on CUDA (Runtime::prefers_staged_gemv), where each lane loading its
// own pack of x from device memory kept the H200's L1 95 % busy; instantiated for bf16 scales, 4-bit weights (8-bit
// for the segmented router GEMV with f32 output) and K <= LILY_QMV_STAGE_MAX_K. Apple GPUs keep the unstaged kernels.
inline bool staged_gemv(bool switched_on, int bits, bool bf16_scales, size_t in_features, bool eight_bit_allowed) {
  return switched_on && bf16_scales && in_features <= LILY_QMV_STAGE_MAX_K &&
         (bits == 4 || (bits == 8 && eight_bit_allowed));
}

// The staged kernels' loads of codes (the _a16 instances, WHOLE_PACK_LOADS): a pack of 4 code words as one 16-byte
// load where every code tensor the dispatch binds lies on 16 bytes, else 4 word loads (what a mapped checkpoint's
// 4-byte alignment allows). One load instruction where there were four, for GEMVs that are issue-bound on the H200:
// tg128 +2.2 % there (docs/performance.md). `offset` is within its buffer, which every runtime starts on 16 bytes or
// more (a file's data section too: Runtime::load_file).
inline bool whole_pack_loads(size_t code_offset) { return code_offset % 16 == 0; }

// A decode token's DeltaNet spread over many threadgroups (SPREAD_DELTANET_STEP): the causal conv in the in_proj GEMV's
// epilogue (qmv_norm_seg_conv_staged: each channel has one owner, so its state shifts in place without a race), the
// recurrence on the prefill scan's (value head, 32 rows) threadgroups (128 at full size) and the gated norm in the
// out_proj GEMV's staging (qmv_gated_norm_residual_staged): three dispatches, as with gated_delta_step, which puts a
// key head on one threadgroup (16 on 132 SMs on an H200, where it was bound by one SM's shuffles: Nsight Compute,
// docs/performance.md). Where the GEMVs are staged (CUDA) and the gated norm's heads fit one staging round.
inline bool spread_deltanet_step(bool switched_on, size_t value_heads, size_t head_v_dim) {
  return switched_on && head_v_dim % 4 == 0 && value_heads <= LILY_QMV_STAGE_MAX_HEADS &&
         value_heads * head_v_dim <= 4 * LILY_QMV_STAGE_BATCH * 32 * LILY_QMV_STAGED_SIMDGROUPS;  // one round
}

// Step slots of the staged one-row GEMVs that end a step's chain (SPLIT_STEPS; qmv_residual_staged,
// qmv_gated_norm_residual_staged, qmv_norm_seg_staged): threads (kQmvStagedThreads, slots), each row of simdgroups
// taking interleaved K steps of the same output rows (a step: 32 lanes x LILY_QMV_PACKS_PER_LANE packs) and loading
// its first before the dependency wait. At two steps (o_proj and out_proj at 4-bit K = 4096, the router at 8-bit
// K = 2048) one simdgroup took the second step's DRAM round trip after the wait, and loading both before it cost
// 121 -> 164 registers and lost; slots keep a simdgroup's registers and double the warps. At most 2: 256 threads of
// up to 255 registers still fit one SM's 64 K.
inline size_t qmv_step_slots(bool switched_on, size_t in_features, int bits) {
  const size_t step = 32 * LILY_QMV_PACKS_PER_LANE * (LILY_QMV_PACK_WORDS * 32 / bits);
  return switched_on && in_features > step ? 2 : 1;
}

// The staged decode experts (moe_gate_up_swiglu_routed_staged, moe_down_combine_staged in metal/moe.metal): x and the
// experts' hidden scratch staged in threadgroup memory as the staged GEMVs stage x, chosen with them
// (staged_gemv: CUDA) for bf16 scales and the sizes their threadgroup arrays hold. Only the fused (routed) gate/up has
// a staged twin: the unfused chain runs only with FUSION off.
inline bool staged_moe(bool switched_on, bool bf16_scales, size_t hidden_size, size_t top_k, size_t expert_size,
                       size_t shared_expert_size) {
  return staged_gemv(switched_on, 4, bf16_scales, hidden_size, false) &&
         top_k * expert_size + shared_expert_size <= LILY_MOE_STAGE_MAX_K && top_k <= LILY_MOE_DOWN_ROUTE_MAX_K;
}

// Threads per threadgroup.
// qmv: 2 simdgroups x 4 rows = 8 output rows per threadgroup (the kernel's fixed shape).
constexpr size_t kQmvThreads = 32 * LILY_QMV_SIMDGROUPS;
constexpr size_t kQmvRowsPerThreadgroup = LILY_QMV_ROWS_PER_SIMDGROUP * LILY_QMV_SIMDGROUPS;
// qmv_mma: simdgroups splitting K (the kernel takes 1 to LILY_QMV_MMA_MAX_SIMDGROUPS), by output features: 8 below
// kQmvMmaWideMinOutFeatures, where 4 leave an H100 short of warps (N / 16 threadgroups), and 4 from there, where 8
// cost more than their extra warps bring. On an H100 (docs/results/h200/2026-12-05-d25e27e-qmv-mma-simdgroups/, cold
// L2, 1 to 8 rows, us, 4 against 8 simdgroups): out_proj 2048 x 4096 17.2-18.1 against 12.5-13.3, 2048 x 2048
// 10.7-11.5 against 8.3-9.3, in_proj_z 4096 11.6-12.4 against 9.2-10.1, k/v_proj 512 10.2-10.8 against 7.7-8.8; the
// DeltaNet qkv 8192 13.1-13.9 against 14.0-15.3, lm_head 171-205 against 200-221. Through the engine: pp2 +2.6 %, pp4
// and pp8 within noise (docs/performance.md).
constexpr size_t kQmvMmaWideMinOutFeatures = 8192;
constexpr size_t qmv_mma_simdgroups(size_t out_features) {
  return out_features >= kQmvMmaWideMinOutFeatures ? 4 : LILY_QMV_MMA_MAX_SIMDGROUPS;
}
// The staged GEMVs (tuning::staged_gemv): LILY_QMV_STAGED_SIMDGROUPS simdgroups per staging of x.
constexpr size_t kQmvStagedThreads = 32 * LILY_QMV_STAGED_SIMDGROUPS;
constexpr size_t kQmvStagedRowsPerThreadgroup = LILY_QMV_ROWS_PER_SIMDGROUP * LILY_QMV_STAGED_SIMDGROUPS;
// qmv_norm_staged streams row blocks (metal/qmatmul.metal): at most this many threadgroups, each staging x once: 4
// per SM on the H200's 132 (up to 128 registers x 128 threads: four fit), so the lm_head's 15,520 blocks of 16 rows
// run as one resident wave instead of 15,520 stagings. The DeltaNet in_proj's conv GEMV (142-167 registers: 3 per SM)
// streams its 772 blocks over kQmvConvStreamGroups; one threadgroup per block cost its critical path 354 -> 416 us a
// token on an H100. The other segmented one (q|k|v: 576 blocks, the router: 17) takes one threadgroup per block:
// streamed over kQmvStreamGroups (160 registers: 3 of 4 per SM fit), a threadgroup's second block waited for its own
// DRAM round trip after its first (the q|k|v's critical path 151 against 128 us a token; the test option
// seg_stream_groups caps it again).
constexpr size_t kQmvStreamGroups = 4 * 132;
constexpr size_t kQmvConvStreamGroups = 3 * 132;
// rms_norm: one threadgroup per row; 256 threads already cover H = 2048 with 8 elements per thread, and a smaller
// group than the 1024 maximum leaves room for other dispatches of the same stage.
constexpr size_t kRmsNormThreads = 256;
// Gated DeltaNet: state rows per simdgroup; the host sizes the group from (Hv/Hk)*dv (step) or a threadgroup's slice
// of a value head's dv rows (prefill scan, kGdnPrefillRowsPerThreadgroup at most).
constexpr size_t kGdnRowsPerSimdgroup = LILY_GDN_ROWS_PER_SIMDGROUP;
constexpr size_t kGdnPrefillRowsPerSimdgroup = LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP;
constexpr size_t kGdnPrefillRowsPerThreadgroup = LILY_GDN_PREFILL_ROWS_PER_THREADGROUP;
// attention_prep: 8 simdgroups (8 head rows) per threadgroup: the model's 18 rows per token fill 3 groups.
constexpr size_t kAttentionPrepSimdgroups = 8;
// attention_decode: 8 simdgroups split the keys; enough lanes to stream a KV head at 4K context, few enough that
// the merge through threadgroup memory stays short.
constexpr size_t kAttentionDecodeThreads = 256;
// attention_decode[_partial][_prep]_mma (MMA_ATTENTION): exactly LILY_ATTN_DECODE_MMA_SIMDGROUPS simdgroups, each
// owning whole 8-dim fragments of O^T at head dim 64 (8 fragments) and 256 (32).
constexpr size_t kAttentionDecodeMmaThreads = 32 * LILY_ATTN_DECODE_MMA_SIMDGROUPS;
static_assert(LILY_ATTN_DECODE_MMA_SIMDGROUPS == 1 || LILY_ATTN_DECODE_MMA_SIMDGROUPS == 2 ||
                  LILY_ATTN_DECODE_MMA_SIMDGROUPS == 4 || LILY_ATTN_DECODE_MMA_SIMDGROUPS == 8,
              "attention_decode_mma: a divisor of the 8 fragments of head dim 64");
// attention_decode_combine: threads per threadgroup (8 simdgroups splitting the blocks: 8 loads per lane at 64 blocks),
// each threadgroup one slice of 32 elements of a head (the model's 16 heads x 256: 128 threadgroups).
constexpr size_t kAttentionCombineThreads = 256;
constexpr size_t kAttentionCombineSlice = 32;
// MoE decode GEMVs (the kernels' fixed shapes): gate/up 2 simdgroups x 4 rows; down + combine 4 simdgroups x 2 rows.
constexpr size_t kMoeGemvThreads = 32 * LILY_MOE_GEMV_SIMDGROUPS;
constexpr size_t kMoeGemvRowsPerThreadgroup = LILY_MOE_GEMV_ROWS_PER_SIMDGROUP * LILY_MOE_GEMV_SIMDGROUPS;
constexpr size_t kMoeDownThreads = 32 * LILY_MOE_DOWN_SIMDGROUPS;
constexpr size_t kMoeDownRowsPerThreadgroup = LILY_MOE_DOWN_ROWS_PER_SIMDGROUP * LILY_MOE_DOWN_SIMDGROUPS;
// gated_delta_conv: one thread per channel and block of LILY_GDN_CONV_TOKENS tokens, 256 channels per group (32
// groups along x on the model's 8192 channels); gated_delta_conv_state: one thread per channel.
constexpr size_t kGdnConvThreads = 256;
// The chunked DeltaNet scan (CHUNKED_SCAN): chunks of at least this many tokens take it, shorter ones the plain scan.
// Two chunks of LILY_GDN_CHUNK: below that the plain scan's per-token chain is short. Untuned: not timed yet.
constexpr size_t kGdnChunkedMinTokens = 2 * LILY_GDN_CHUNK;
// gated_delta_chunk_prepare: 8 simdgroups per (value head, chunk) threadgroup (its products are 20 and 4x(Dk+dv)/8
// 8x8 blocks; the solve takes one simdgroup). gated_delta_chunk_scan: LILY_GDN_CHUNK_SCAN_SIMDGROUPS (metal/lily.h).
constexpr size_t kGdnChunkPrepareThreads = 256;
constexpr size_t kGdnChunkScanSimdgroups = LILY_GDN_CHUNK_SCAN_SIMDGROUPS;
// gated_delta_prefill_norm: one simdgroup per (token, value head) row, 8 rows per group (2,048 groups for 512 tokens
// of the model's 32 heads). Untuned.
constexpr size_t kGdnPrefillNormThreads = 256;
// MoE prefill: one thread per (token, slot) pair in the sort kernels (the kernels' block), 256 per combine group.
constexpr size_t kMoeSortThreads = LILY_MOE_SORT_BLOCK;
constexpr size_t kGemmThreads = LILY_GEMM_THREADS;
constexpr size_t kMoeCombineThreads = 256;
// Argmax: LILY_ARGMAX_BLOCK logits per partial threadgroup, 256 threads each; the final reduce runs one group.
constexpr size_t kArgmaxThreads = 256;
// sample_*: one threadgroup scans the whole vocabulary (metal/sampling.metal).
constexpr size_t kSampleThreads = LILY_SAMPLE_THREADS;
// The block path (sample_partial_* over LILY_SAMPLE_BLOCK-logit blocks, then sample_final_*): the same draw, the full
// vocabulary read once by many threadgroups instead of ~20 times by one. It takes every request but top_k above the
// candidates (LILY_SAMPLE_CANDIDATES a block); those run sample_*. false: every sampled request runs sample_* (the
// switch back).
constexpr bool kSampleBlockPath = true;
// sample_partial: LILY_SAMPLE_PER_THREAD logits per thread (the kernel's register array).
constexpr size_t kSamplePartialThreads = LILY_SAMPLE_BLOCK / LILY_SAMPLE_PER_THREAD;
// sample_final: one threadgroup over 61 x 64 candidates (16 a thread) or one 4096-logit block; 256 threads keep the
// per-pass reductions over 8 simdgroups short. It falls back to the general path over the vocabulary when the
// candidates miss a token the filters keep: for top_k <= 64, only where a block left out ties at the k-th largest
// value; for top-p or min-p alone, wherever the nucleus or the min-p set reaches below a block's 64th value (flat
// distributions: random weights, high temperatures), and for top_k above 64 wherever a block holds more than 64 of
// the top k. There the general path takes 3.3 ms at 256 threads and 1.1 ms at 1024 (H100, bench_kernels, flat
// logits, top-p alone), where the candidates take 68 us and 99 us: those requests get 1024.
constexpr size_t kSampleFinalThreads = 256;
constexpr size_t sample_final_threads(size_t top_k, float top_p, float min_p, size_t vocab) {
  const bool top_k_on = top_k > 0 && top_k < vocab;
  const bool may_fall_back = top_k_on ? top_k > LILY_SAMPLE_CANDIDATES : (top_p < 1.0f || min_p > 0.0f);
  return may_fall_back ? LILY_SAMPLE_THREADS : kSampleFinalThreads;
}
constexpr bool sample_block_path(size_t top_k, size_t vocab) {
  const bool top_k_on = top_k > 0 && top_k < vocab;
  const size_t candidates = (vocab + LILY_SAMPLE_BLOCK - 1) / LILY_SAMPLE_BLOCK * LILY_SAMPLE_CANDIDATES;
  return kSampleBlockPath && (!top_k_on || top_k <= candidates);
}
// penalize_logits: one thread per logit.
constexpr size_t kPenaltyThreads = 256;
constexpr size_t kEmbeddingThreads = LILY_EMBEDDING_THREADS;

// Prefill: tokens per chunk (one command buffer each). 2048 tokens route 2048*8/256 = 64 rows to an expert on
// average, where the grouped GEMMs run 32-row tiles and read each expert's weights a few times per chunk instead of
// once per 16 rows (H200: MoE time per token about 1.7x lower than at 512); the chunk's temporaries (MoE gather
// buffers, [T, 8192] projections, fp32 DeltaNet scratch) are about 185 KB a token, plus 70 KB for the chunked
// DeltaNet scan's operands (CHUNKED_SCAN): about 520 MB at full size.
constexpr size_t kPrefillChunk = 2048;
// Chunks that return every row's logits ([T, V] f32, 1 MB a row at full size) stop at this many rows.
constexpr size_t kPrefillLogitRows = 512;

// KV cache growth: rows added per KV head at a time (bounded re-allocation count: 128 growths to 256K context).
constexpr size_t kKvCacheBlock = 2048;

}  // namespace lily::tuning
