// One function per kernel dispatch: each builds the kernel name, fills the argument struct, declares the ranges
// it reads and writes, and appends the dispatch to a Graph. One file per kernel family.
#pragma once

#include <string>
#include <vector>

#include "../model.h"

namespace lily {
struct AttentionArgs;   // metal/lily.h
struct AttentionPrepArgs;  // metal/lily.h
struct GatedDeltaArgs;  // metal/lily.h
}  // namespace lily

namespace lily::ops {

// Where dispatches go and in which dtype activations travel.
struct Context {
  Graph& graph;
  DType act;     // activation dtype: F32 (float32 mode) or BF16
  bool serial;   // a barrier before every dispatch (the CONCURRENT switch off)
  bool wide_tiles = true;  // 32-row GEMM tiles allowed (the WIDE_TILES switch)
  bool gpu_routing = true;  // prefill MoE pairs sorted on the GPU; off = a HostMoeSort step (the GPU_ROUTING switch)
  bool gqa_packing = true;  // decode attention packs query heads of one KV head per threadgroup (GQA_PACKING)
  bool register_scan = true;  // prefill DeltaNet scan keeps the state in registers per chunk (REGISTER_SCAN)
  bool chunked_scan = true;   // long prefill chunks run the chunked DeltaNet scan (CHUNKED_SCAN)
  Span gdn_chunks{};          // its operands' scratch (add_gdn_chunk_scratch; unused and empty when absent)
  bool in_gemm_dequant = true;  // prefill GEMMs dequantize W tiles inside the GEMM (IN_GEMM_DEQUANT)
  Span dequant_scratch{};   // IN_GEMM_DEQUANT off: prefill GEMMs dequantize W here, then run mm_* (else unused)
  bool coalesced_kv = true;  // decode attention lanes read consecutive chunks of a K/V row (COALESCED_KV)
  bool tensor_ops = false;   // bf16 prefill GEMMs with bf16 scales run qmm_nax (TENSOR_OPS, on M5-class GPUs)
  bool mma_attention = true;  // attention on simdgroup matrices: prefill of 8+ tokens, bf16 split-KV decode partials
                              // (MMA_ATTENTION, layout probe)
  bool staged_gemv = false;   // decode GEMVs stage x in threadgroup memory (STAGED_GEMV, on CUDA: tuning::staged_gemv)
  bool mma_gemv = false;      // up to 8 rows' GEMVs on matrix units (MMA_GEMV, on CUDA: tuning::mma_gemv)
  bool spread_deltanet_step = false;  // a decode token's DeltaNet over many threadgroups (SPREAD_DELTANET_STEP)
  bool whole_pack_loads = false;  // staged kernels load a pack of codes at once where aligned (WHOLE_PACK_LOADS)
  bool fused_attention_prep = true;  // split-KV decode on matrix units preps its own rows (FUSED_ATTENTION_PREP)
  bool early_moe_down = true;  // the staged expert down kernel routes and loads before its wait (EARLY_MOE_DOWN)
  bool split_steps = false;  // staged GEMVs split a row's K steps over rows of simdgroups (SPLIT_STEPS)
  size_t seg_stream_groups = 0;   // the staged segmented GEMV (not the conv one): most threadgroups (0: one per block)
};

// Appends a node; traffic defaults to the declared ranges.
Node& add_node(Context& ctx, std::string kernel, std::string label, std::vector<NodeArg> args, Dim3 groups,
               Dim3 threads, std::vector<Span> reads, std::vector<Span> writes);
NodeArg arg(const Span& span);
template <class T>
NodeArg arg_value(const T& value) {
  NodeArg a;
  const auto* p = reinterpret_cast<const unsigned char*>(&value);
  a.bytes.assign(p, p + sizeof(T));
  return a;
}
Span sub(const Span& span, size_t offset, size_t length);  // a sub-range, checked
// The suffix of a staged kernel's instance for the codes it binds: "_a16" where each pack is one 16-byte load
// (tuning::whole_pack_loads), else "".
std::string pack_loads_suffix(const Context& ctx, const std::vector<const WeightRef*>& weights);

// rms_norm.cpp
void rms_norm(Context& ctx, const std::string& label, const Span& x, const WeightRef& weight, const Span& out,
              size_t rows, size_t row_length, float eps);
void rms_norm_residual(Context& ctx, const std::string& label, const Span& x, const Span& residual,
                       const WeightRef& weight, const Span& out, const Span& sum, size_t rows, size_t row_length,
                       float eps);
// qmatmul.cpp: y[rows, w.rows] = x[rows, w.cols] * W^T (qmv for few rows, qmm otherwise), y in `dtype`: the
// activation dtype, or f32 (router and lm_head logits: the _of32 kernels in bf16 mode).
void qmatmul(Context& ctx, const std::string& label, const Span& x, const WeightRef& w, const Span& y, size_t rows,
             DType dtype);
// dequantize.cpp: the whole of `w` written densely in `dtype` at the start of `scratch`, returned (the IN_GEMM_DEQUANT
// ablation).
Span dequantize(Context& ctx, const std::string& label, const WeightRef& w, const Span& scratch, DType dtype);
// mm.cpp: y[rows, out_features] = x[rows, in_features] * W^T with W dense in `dtype`, bm-row tiles (16 or 32).
void mm(Context& ctx, const std::string& label, const Span& x, const Span& w, const Span& y, size_t rows,
        size_t in_features, size_t out_features, size_t bm, DType dtype);
// qmatmul.cpp, decode fusions (one row): y = W · (rms_norm(x) ⊙ norm_weight) with y in the activation dtype or f32
// (qmv_norm), and residual_out += W · x in place (qmv_residual). qmatmul_norm with `argmax_values`/`argmax_ids`
// given (greedy decode's lm_head, FUSED_ARGMAX): where the GEMV is staged it also writes its threadgroups' best
// logits there (qmv_norm_argmax_staged) and returns how many, for argmax_final; 0 where it did not.
size_t qmatmul_norm(Context& ctx, const std::string& label, const Span& x, const WeightRef& norm_weight,
                    const WeightRef& w, const Span& y, float eps, DType dtype, const Span* argmax_values = nullptr,
                    const Span* argmax_ids = nullptr);
void qmatmul_residual(Context& ctx, const std::string& label, const Span& x, const WeightRef& w,
                      const Span& residual_out);
// Whether matrices can share one segmented GEMV: same bits, input features and scale dtype, none stacked.
bool quantized_alike(const std::vector<const WeightRef*>& parts);
// qmatmul.cpp, decode (one row): y = [W_0; W_1; ...] · x' over up to 4 matrices sharing x, each read from its own
// bytes (qmv_seg / qmv_norm_seg: no concatenated copy); x' = rms_norm(x) ⊙ norm_weight when norm_weight is given.
// With `conv` (the spread DeltaNet step; staged, 4-bit, normed): segment 0 is the q|k|v projection, whose outputs go
// through the causal conv into conv.out (f32) and conv.state (qmv_norm_seg_conv_staged) instead of into y, and
// segment 1 is the z projection, whose SiLU also goes to conv.gate (f32).
struct ConvEpilogue {
  const WeightRef* weight;  // conv1d.weight [C, kernel]
  Span state, out, gate;    // the layer's conv state [kernel - 1, C] (in place); the f32 conv outputs [C]; SiLU(z)
};
void qmatmul_segments(Context& ctx, const std::string& label, const Span& x, const WeightRef* norm_weight,
                      const std::vector<const WeightRef*>& parts, const std::vector<std::string>& part_names,
                      const Span& y, float eps, DType dtype, const ConvEpilogue* conv = nullptr);
// qmatmul.cpp, the spread DeltaNet step's out_proj (one row): residual_out += W · gated_norm(o) with the gated norm
// of value heads of head_dim values (gate: SiLU(z), f32) folded into the GEMV's staging
// (qmv_gated_norm_residual_staged).
void qmatmul_gated_norm_residual(Context& ctx, const std::string& label, const Span& o, const Span& gate,
                                 const WeightRef& norm_weight, size_t head_dim, float eps, const WeightRef& w,
                                 const Span& residual_out);
// embedding.cpp: out[t] = table row ids[ids_offset + t].
void embedding(Context& ctx, const Span& ids, size_t ids_offset, const WeightRef& table, const Span& out,
               size_t tokens);
// gated_delta.cpp, gated_delta_prefill.cpp: a DeltaNet layer's core over T tokens, conv and recurrent state in place:
// one token runs the decode step (gated_delta_step: conv, recurrence and gated norm in one kernel); more run the causal
// conv into the f32 scratch conv_out, the scan into the f32 scratch core_out, then the gated norm into out.
struct GatedDeltaSpans {
  Span qkv, z, b, a, conv_out, core_out, out, conv_state, recurrent_state;
  const WeightRef *conv_weight, *a_log, *dt_bias, *norm_weight;
};
void gated_delta(Context& ctx, const ModelConfig& config, const std::string& label, const GatedDeltaSpans& s,
                 size_t tokens);
void gated_delta_step(Context& ctx, const ModelConfig& config, const std::string& label, const GatedDeltaSpans& s);
// The kernels' arguments for `tokens` tokens (gated_delta.cpp; the prefill kernels take the same).
GatedDeltaArgs gated_delta_args(const ModelConfig& config, size_t tokens);
void gated_delta_prefill(Context& ctx, const ModelConfig& config, const std::string& label, const GatedDeltaSpans& s,
                         size_t tokens);
// The spread decode step (tuning::spread_deltanet_step): the conv ran in the in_proj GEMV (conv_out holds its f32
// outputs), so one token's recurrence runs on the prefill scan's (value head, row slice) threadgroups into core_out;
// the gated norm follows in the out_proj GEMV (qmatmul_gated_norm_residual).
void gated_delta_scan(Context& ctx, const ModelConfig& config, const std::string& label, const GatedDeltaSpans& s,
                      size_t tokens);
// Whether a decode token's DeltaNet runs spread (tuning::spread_deltanet_step) on these in_proj and out_proj weights.
bool spread_deltanet_step(const Context& ctx, const ModelConfig& config,
                          const std::vector<const WeightRef*>& in_proj, const WeightRef& out_proj);
// Throws Error naming the config field when no DeltaNet kernel is instantiated for its key head dim.
void check_gated_delta_shapes(const ModelConfig& config);
// Bytes of the chunked scan's scratch for a chunk of `tokens` rows (W, U, Qg, KdT, M and gamma_last of every value
// head and LILY_GDN_CHUNK-token chunk, fp32); 0 when such a chunk keeps the plain scan (fewer than
// tuning::kGdnChunkedMinTokens rows, or dv not a multiple of 8).
size_t gated_delta_chunk_scratch_bytes(const ModelConfig& config, size_t tokens);
// The chunked scan's line for `lily plan` when the shape does not fit it (see fast_paths_left_out), else none.
std::vector<std::string> gated_delta_fast_paths_left_out(const ModelConfig& config);
// attention.cpp: preparation (norms, rope, KV write) and decode attention for one token at `position`.
struct AttentionSpans {
  Span q_and_gate, k, v, q, gate, out, k_cache, v_cache, partial_out, partial_stats;
  const WeightRef *q_norm, *k_norm;
  size_t capacity;
};
// attention over the cache for T tokens at positions position .. position + T - 1 (attention_prep writes their K/V
// rows first, or, for one token split on matrix units with FUSED_ATTENTION_PREP, the attention kernel): one token runs
// attention_decode, more run attention_prefill (split_blocks: 0 = the single-pass kernel, else the split-KV pair over
// that many key blocks: attention_split_blocks for one token, attention_prefill_split_blocks for more).
void attention(Context& ctx, const ModelConfig& config, const std::string& label, const AttentionSpans& s,
               size_t position, size_t tokens, size_t split_blocks);
void attention_decode(Context& ctx, const ModelConfig& config, const std::string& label, const AttentionSpans& s,
                      size_t position, size_t split_blocks);
// Split-KV blocks of a prefill chunk of `tokens` tokens ending at `keys` keys under the switches (0 = single pass):
// tuning::attention_prefill_split_blocks over the single pass's threadgroups on matrix units; 0 with split_prefill_kv
// off, below tuning::kAttentionMmaMinQueries tokens and where the head ratio takes the *_unpacked_* kernel (no split
// instance).
size_t attention_prefill_split_blocks(const Switches& switches, const ModelConfig& config, size_t tokens,
                                      size_t keys);
// The most (query row, block) pairs of split prefill partials a chunk of up to `rows` tokens can write: what the
// partial buffers hold per query head (any split_prefill_block_keys).
size_t attention_prefill_split_rows(const ModelConfig& config, size_t rows);
// Split-KV blocks of the decode step at `keys` keys under the switches (0 = single pass):
// tuning::attention_split_blocks from split_kv_min_keys (0 = tuning::kAttentionSplitMinKeys); 0 with split_kv off.
size_t attention_split_blocks(const Switches& switches, size_t keys);
// Throws Error naming the config field when no attention kernel is instantiated for its head dim.
void check_attention_shapes(const ModelConfig& config);
// Whether the head ratio splits into the groups the packed attention kernels take at the config's head dim.
bool gqa_packing_fits(const ModelConfig& config);
// One line per attention fast path the config cannot take (empty when it takes them all), for `lily plan`.
std::vector<std::string> attention_fast_paths_left_out(const ModelConfig& config);
// Query heads one attention threadgroup packs (the kernels' G) at the config's head dim; 1 when `packing` is off
// or the head ratio does not split into groups of G (the general *_unpacked_* kernels).
size_t attention_heads_per_group(const ModelConfig& config, bool packing);
// Query heads one attention_prefill_mma threadgroup packs (LILY_ATTN_MMA_HEADS_PER_GROUP*), or 1 (its *_unpacked_*
// kernel) when the head ratio is not a multiple of them.
size_t attention_mma_heads_per_group(const ModelConfig& config);
// attention_prep.cpp: the attention_prep_* node for `tokens` new tokens at `position` (decode: 1; prefill: T);
// returns the spans the attention kernels then read: q, gate and the K/V cache prefix of every KV head.
std::vector<Span> attention_prep(Context& ctx, const ModelConfig& config, const std::string& label,
                                 const AttentionSpans& s, size_t position, size_t tokens);
// Its arguments, which the decode kernels with the prep fused take too; and the cache rows of every KV head (K and V)
// the prep writes (`new_rows`: position .. position + tokens - 1), the attention then reads (`prefix`: 0 .. the
// last new row) and the earlier tokens' rows among them (`old_rows`: 0 .. position - 1, which the decode kernels on
// matrix units may read before their dependency wait; empty at position 0).
AttentionPrepArgs attention_prep_args(const ModelConfig& config, const AttentionSpans& s, size_t position,
                                      size_t tokens);
struct AttentionPrepSpans {
  std::vector<Span> new_rows, prefix, old_rows;
};
AttentionPrepSpans attention_prep_spans(const ModelConfig& config, DType act, const AttentionSpans& s,
                                        size_t position, size_t tokens);
// The attention kernels' arguments for `queries` query tokens over `keys` cached keys (no split blocks).
AttentionArgs attention_args(const ModelConfig& config, const AttentionSpans& s, size_t queries, size_t keys);
// attention_decode_combine over `rows` (token, query head) rows of split-KV partials (a.num_blocks each): merges them,
// applies the gate and writes out; its num_keys follows the position like the partial pass's (num_keys).
void attention_combine(Context& ctx, const ModelConfig& config, const std::string& label, const AttentionArgs& a,
                       const AttentionSpans& s, const Span& partial_out, const Span& partial_stats, size_t rows,
                       const PositionField& num_keys);
void attention_prefill(Context& ctx, const ModelConfig& config, const std::string& label, const AttentionSpans& s,
                       size_t position, size_t tokens, size_t split_blocks);
// moe.cpp, moe_prefill.cpp: the MoE block of T rows adding into residual_out (the hidden stream, in place). `router`
// holds the T x E router logits, then the T shared-expert gate logits (f32). One row runs the decode kernels: routing
// and the fused expert GEMVs into the f32 `hidden` scratch, then moe_down_combine; with `norm_weight`, routing and
// the post-attention RMSNorm fold into the gate/up kernel (x is then the un-normalised hidden stream, which is also
// the residual). More rows are routed on the GPU (route, count, scan, scatter) into grouped GEMMs and a combine; the
// shared expert runs through the same grouped GEMMs as one expert that every row uses (a static identity routing the
// host fills: shared_pairs, shared_tile_map, shared_tile_count, ones).
struct MoeSpans {
  Span x, router, expert_ids, expert_weights, hidden, residual_out;
  Span block_counts, expert_offsets, tile_map, tile_count, sorted_pairs, expert_out, shared_pairs, shared_tile_map,
      shared_tile_count, ones, shared_hidden, shared_out;  // more than one row
  const WeightRef *gate, *up, *down, *shared_gate, *shared_up, *shared_down;
};
void moe(Context& ctx, const ModelConfig& config, const std::string& label, const MoeSpans& s, size_t tokens,
         const WeightRef* norm_weight, float eps);
void moe_decode(Context& ctx, const ModelConfig& config, const std::string& label, const MoeSpans& s);
void moe_decode_routed(Context& ctx, const ModelConfig& config, const std::string& label, const MoeSpans& s,
                       const WeightRef& norm_weight, float eps);
void moe_prefill(Context& ctx, const ModelConfig& config, const std::string& label, const MoeSpans& s, size_t tokens);
// Rows per grouped-GEMM tile for `rows_per_expert` mean rows (16 or 32), and the tile-map bound for T*k pairs.
size_t moe_tile_rows(double rows_per_expert, bool wide_tiles);
size_t moe_max_tiles(size_t pairs, size_t experts, size_t tile_rows);
// sampling.cpp: the token choice into tokens[out_index]: greedy (argmax) or sampled (sample: Philox counter
// position + position_delta, marked as a PositionField).
void argmax(Context& ctx, const Span& logits, size_t vocab, const Span& partial_values, const Span& partial_ids,
            const Span& tokens, size_t out_index);
// argmax's second dispatch alone, over `partials` (value, id) pairs another kernel wrote (qmatmul_norm's).
void argmax_final(Context& ctx, size_t vocab, const Span& partial_values, const Span& partial_ids, size_t partials,
                  const Span& tokens, size_t out_index);
// penalize_logits: lily.sampling steps 1-3 from `logits` into the fp32 `processed`; count_token: records
// tokens[out_index] in `seen` and `counts` (after the choice).
void penalize_logits(Context& ctx, const Span& logits, size_t vocab, const TokenChoice& choice, const Span& bias,
                     const Span& seen, const Span& counts, const Span& processed);
void count_token(Context& ctx, size_t vocab, const Span& tokens, size_t out_index, const Span& seen,
                 const Span& counts);
// sample: sample_* (one threadgroup), or sample_partial_* + sample_final_* where tuning::sample_block_path allows,
// with the block path's candidates and block statistics in `values` and `ids` (sample_scratch_words(vocab) each).
void sample(Context& ctx, const Span& logits, size_t vocab, const TokenChoice& choice, const Span& values,
            const Span& ids, const Span& tokens, size_t out_index, size_t position, int position_delta);
size_t sample_scratch_words(size_t vocab);

}  // namespace lily::ops
