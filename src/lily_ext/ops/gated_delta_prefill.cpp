// Kernels of metal/gated_delta_prefill.metal: gated_delta_conv_* into conv_out, gated_delta_conv_state_*, the scan
// into core_out (gated_delta_prefill[_blockwise]_*, or for long chunks gated_delta_chunk_prepare_* then
// gated_delta_chunk_scan_*), and gated_delta_prefill_norm_* into out.
#include <algorithm>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

namespace {

constexpr size_t kChunk = LILY_GDN_CHUNK;

// gated_delta_chunk_prepare's outputs in the chunk scratch, each [Hv, chunks, ...] fp32; gamma (one float per value
// head and chunk) last, so every other region starts 128-byte aligned.
struct ChunkSpans {
  Span w, u, qg, kdt, m, gamma;
};

size_t chunk_count(size_t tokens) { return (tokens + kChunk - 1) / kChunk; }

ChunkSpans chunk_spans(const ModelConfig& c, const Span& scratch, size_t tokens) {
  const size_t blocks = c.gdn_v_heads * chunk_count(tokens), keys = blocks * kChunk * c.gdn_k_dim * 4;
  ChunkSpans s;
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    const Span part = sub(scratch, offset, bytes);
    offset += bytes;
    return part;
  };
  s.w = take(keys);
  s.u = take(blocks * kChunk * c.gdn_v_dim * 4);
  s.qg = take(keys);
  s.kdt = take(keys);
  s.m = take(blocks * kChunk * kChunk * 4);
  s.gamma = take(blocks * 4);
  return s;
}

// The chunked scan: every chunk's operands at once (one threadgroup per value head and chunk), then the scan over the
// chunks (one simdgroup per 8 state rows, sequential over the chunks) into core_out.
void chunked_scan(Context& ctx, const ModelConfig& c, const std::string& label, const GatedDeltaSpans& s,
                  const GatedDeltaArgs& a, const std::string& suffix, size_t tokens) {
  const ChunkSpans k = chunk_spans(c, ctx.gdn_chunks, tokens);
  add_node(ctx, "gated_delta_chunk_prepare_" + suffix, label + " chunks",
           {arg_value(a), arg(s.conv_out), arg(s.b), arg(s.a), arg(s.a_log->data), arg(s.dt_bias->data), arg(k.w),
            arg(k.u), arg(k.qg), arg(k.kdt), arg(k.m), arg(k.gamma)},
           {c.gdn_v_heads, chunk_count(tokens), 1}, {tuning::kGdnChunkPrepareThreads, 1, 1},
           {s.conv_out, s.b, s.a, s.a_log->data, s.dt_bias->data}, {k.w, k.u, k.qg, k.kdt, k.m, k.gamma});
  const size_t slice_rows = 8 * tuning::kGdnChunkScanSimdgroups;
  add_node(ctx, "gated_delta_chunk_scan_" + suffix, label,
           {arg_value(a), arg(k.w), arg(k.u), arg(k.qg), arg(k.kdt), arg(k.m), arg(k.gamma), arg(s.recurrent_state),
            arg(s.core_out)},
           {c.gdn_v_heads, (c.gdn_v_dim + slice_rows - 1) / slice_rows, 1}, {32 * tuning::kGdnChunkScanSimdgroups, 1, 1},
           {k.w, k.u, k.qg, k.kdt, k.m, k.gamma, s.recurrent_state}, {s.recurrent_state, s.core_out});
}

// The plain scan: threadgroups of kGdnPrefillRowsPerThreadgroup rows of one value head, each simdgroup keeping
// LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP of them in registers for the whole chunk, or (REGISTER_SCAN off) for
// LILY_GDN_SCAN_BLOCK tokens between round trips through memory.
void token_scan(Context& ctx, const ModelConfig& c, const std::string& label, const GatedDeltaSpans& s,
                const GatedDeltaArgs& a, const std::string& suffix, size_t tokens) {
  const size_t slice_rows = std::min(c.gdn_v_dim, tuning::kGdnPrefillRowsPerThreadgroup);
  const size_t slices = (c.gdn_v_dim + slice_rows - 1) / slice_rows;
  const size_t simdgroups =
      (slice_rows + tuning::kGdnPrefillRowsPerSimdgroup - 1) / tuning::kGdnPrefillRowsPerSimdgroup;
  const std::string variant = ctx.register_scan ? "" : "blockwise_";
  Node& scan = add_node(ctx, "gated_delta_prefill_" + variant + suffix, label,
                        {arg_value(a), arg(s.conv_out), arg(s.b), arg(s.a), arg(s.a_log->data), arg(s.dt_bias->data),
                         arg(s.recurrent_state), arg(s.core_out)},
                        {c.gdn_v_heads, slices, 1}, {32 * simdgroups, 1, 1},
                        {s.conv_out, s.b, s.a, s.a_log->data, s.dt_bias->data, s.recurrent_state},
                        {s.recurrent_state, s.core_out});
  scan.early_reads = {s.recurrent_state};  // its state rows (metal/gated_delta_prefill.metal)
  if (!ctx.register_scan) {
    // The state is read and written once per block, not once per chunk: the traffic the ablation measures.
    const size_t extra_trips = (tokens + LILY_GDN_SCAN_BLOCK - 1) / LILY_GDN_SCAN_BLOCK - 1;
    scan.traffic_read += extra_trips * s.recurrent_state.length;
    scan.traffic_written += extra_trips * s.recurrent_state.length;
  }
}

}  // namespace

size_t gated_delta_chunk_scratch_bytes(const ModelConfig& c, size_t tokens) {
  if (tokens < tuning::kGdnChunkedMinTokens || c.gdn_v_dim % 8 != 0) return 0;
  const size_t per_block = kChunk * (3 * c.gdn_k_dim + c.gdn_v_dim + kChunk) + 1;  // W, Qg, KdT, U, M; gamma
  return c.gdn_v_heads * chunk_count(tokens) * per_block * 4;
}

std::vector<std::string> gated_delta_fast_paths_left_out(const ModelConfig& c) {
  if (c.gdn_v_dim % 8 == 0) return {};
  return {"chunked DeltaNet scan: linear_value_head_dim = " + std::to_string(c.gdn_v_dim) +
          " is not a multiple of 8 (the scan's 8-row blocks of the state); every prefill chunk runs the token-by-token "
          "gated_delta_prefill_* scan"};
}

void gated_delta_scan(Context& ctx, const ModelConfig& c, const std::string& label, const GatedDeltaSpans& s,
                      size_t tokens) {
  const std::string suffix = std::string(dtype_name(ctx.act)) + "_dk" + std::to_string(c.gdn_k_dim);
  token_scan(ctx, c, label, s, gated_delta_args(c, tokens), suffix, tokens);
}

void gated_delta_prefill(Context& ctx, const ModelConfig& c, const std::string& label,
                         const GatedDeltaSpans& s, size_t tokens) {
  const GatedDeltaArgs a = gated_delta_args(c, tokens);
  const std::string suffix = std::string(dtype_name(ctx.act)) + "_dk" + std::to_string(c.gdn_k_dim);
  const size_t channels = c.conv_dim();
  const size_t channel_groups = (channels + tuning::kGdnConvThreads - 1) / tuning::kGdnConvThreads;
  add_node(ctx, "gated_delta_conv_" + suffix, label + " conv",
           {arg_value(a), arg(s.qkv), arg(s.conv_weight->data), arg(s.conv_state), arg(s.conv_out)},
           {channel_groups, (tokens + LILY_GDN_CONV_TOKENS - 1) / LILY_GDN_CONV_TOKENS, 1},
           {tuning::kGdnConvThreads, 1, 1}, {s.qkv, s.conv_weight->data, s.conv_state}, {s.conv_out});
  // After every block of the conv has read the state it replaces (the barrier rule's write after read).
  add_node(ctx, "gated_delta_conv_state_" + suffix, label + " conv state",
           {arg_value(a), arg(s.qkv), arg(s.conv_state)}, {channel_groups, 1, 1}, {tuning::kGdnConvThreads, 1, 1},
           {s.qkv, s.conv_state}, {s.conv_state});
  // The chunked scan where the chunk is long enough and its scratch was allocated (CHUNKED_SCAN on), else the plain.
  const size_t chunk_bytes = gated_delta_chunk_scratch_bytes(c, tokens);
  if (ctx.chunked_scan && chunk_bytes != 0 && ctx.gdn_chunks.length >= chunk_bytes) {
    chunked_scan(ctx, c, label, s, a, suffix, tokens);
  } else {
    token_scan(ctx, c, label, s, a, suffix, tokens);
  }
  // The gated norm needs a head's whole row of o, which the scan splits over threadgroups: one simdgroup per
  // (token, value head) row.
  const size_t norm_rows = tokens * c.gdn_v_heads, rows_per_group = tuning::kGdnPrefillNormThreads / 32;
  add_node(ctx, std::string("gated_delta_prefill_norm_") + dtype_name(ctx.act), label + " norm",
           {arg_value(a), arg(s.core_out), arg(s.z), arg(s.norm_weight->data), arg(s.out)},
           {(norm_rows + rows_per_group - 1) / rows_per_group, 1, 1}, {tuning::kGdnPrefillNormThreads, 1, 1},
           {s.core_out, s.z, s.norm_weight->data}, {s.out});
}

}  // namespace lily::ops
