// attention_prefill[_mma][_split]_* (metal/attention_prefill.metal): T tokens (after attention_prep, attention_prep.cpp);
// split over key blocks, with attention_decode_combine (metal/attention.metal) after it.
#include <algorithm>
#include <array>
#include <cstddef>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

size_t attention_prefill_split_blocks(const Switches& sw, const ModelConfig& c, size_t tokens, size_t keys) {
  const size_t heads_per_group = attention_mma_heads_per_group(c);
  if (!sw.split_prefill_kv || tokens < tuning::kAttentionMmaMinQueries || heads_per_group == 1) return 0;
  const size_t query_groups =
      (tokens + tuning::kAttentionMmaQueries - 1) / tuning::kAttentionMmaQueries * (c.num_heads / heads_per_group);
  const size_t min_block_keys =
      sw.split_prefill_block_keys ? sw.split_prefill_block_keys : tuning::kAttentionPrefillSplitMinBlockKeys;
  return tuning::attention_prefill_split_blocks(query_groups, keys, min_block_keys);
}

size_t attention_prefill_split_rows(const ModelConfig& c, size_t rows) {
  Switches any_keys;
  any_keys.split_prefill_block_keys = 1;  // blocks limited by the threadgroups alone
  size_t most = 0;
  for (size_t tokens = tuning::kAttentionMmaMinQueries; tokens <= rows; ++tokens) {
    most = std::max(most, tokens * attention_prefill_split_blocks(any_keys, c, tokens, ~size_t{0}));
  }
  return most;
}

void attention_prefill(Context& ctx, const ModelConfig& c, const std::string& label, const AttentionSpans& s,
                       size_t position, size_t tokens, size_t split_blocks) {
  const std::string dt = dtype_name(ctx.act), suffix = "_d" + std::to_string(c.head_dim);
  const std::vector<Span> prefix = attention_prep(ctx, c, label, s, position, tokens);
  AttentionArgs a = attention_args(c, s, tokens, position + tokens);
  // keys = position + T: a pass recorded once (a short prompt's, REPLAYED_PROMPTS) runs at any position.
  const PositionField num_keys{0, offsetof(AttentionArgs, num_keys), static_cast<int32_t>(tokens)};
  const size_t D = c.head_dim;
  if (tokens >= tuning::kAttentionMmaMinQueries && ctx.mma_attention) {
    // Matrix units: LILY_ATTN_MMA_QUERIES queries x G heads per threadgroup, one simdgroup per head; G is the whole
    // GQA group at head dim 256 (8 for the model) when the head ratio splits into it, else 1 (*_unpacked_*).
    const size_t heads_per_group = attention_mma_heads_per_group(c);
    const std::array<size_t, 2> groups = {(tokens + tuning::kAttentionMmaQueries - 1) / tuning::kAttentionMmaQueries,
                                          c.num_heads / heads_per_group};
    if (split_blocks > 1 && heads_per_group > 1) {
      // Split keys (attention_prefill_split_blocks): each block's partial of every (token, head) row, then the
      // decode combine over the T x Hq rows, which gates them into out.
      a.num_blocks = static_cast<u32>(split_blocks);
      const size_t rows = tokens * c.num_heads;
      const Span partial_out = sub(s.partial_out, 0, rows * split_blocks * D * 4);
      const Span partial_stats = sub(s.partial_stats, 0, rows * split_blocks * 2 * 4);
      add_node(ctx, "attention_prefill_mma_split_" + dt + suffix, label,
               {arg_value(a), arg(s.q), arg(s.k_cache), arg(s.v_cache), arg(partial_out), arg(partial_stats)},
               {groups[0], groups[1], split_blocks}, {32 * heads_per_group, 1, 1}, prefix,
               {partial_out, partial_stats})
          .per_position.push_back(num_keys);
      attention_combine(ctx, c, label, a, s, partial_out, partial_stats, rows, num_keys);
      return;
    }
    const std::string variant = heads_per_group == 1 ? "unpacked_" : "";
    add_node(ctx, "attention_prefill_mma_" + variant + dt + suffix, label,
             {arg_value(a), arg(s.q), arg(s.gate), arg(s.k_cache), arg(s.v_cache), arg(s.out)},
             {groups[0], groups[1], 1}, {32 * heads_per_group, 1, 1}, prefix, {s.out})
        .per_position.push_back(num_keys);
  } else {
    // Few queries (or MMA_ATTENTION off): one simdgroup per query, up to 8 queries per threadgroup; G heads of one
    // KV head (the GQA_PACKING switch is a decode ablation) unless the head ratio cannot be split into groups of G:
    // then the *_unpacked_* kernel, one head per threadgroup.
    const size_t heads_per_group = attention_heads_per_group(c, true);
    const std::string variant = heads_per_group == 1 ? "unpacked_" : "";
    const size_t queries = std::min(tokens, tuning::kAttentionMmaMinQueries);
    add_node(ctx, "attention_prefill_" + variant + dt + suffix, label,
             {arg_value(a), arg(s.q), arg(s.gate), arg(s.k_cache), arg(s.v_cache), arg(s.out)},
             {(tokens + queries - 1) / queries, c.num_heads / heads_per_group, 1}, {32 * queries, 1, 1}, prefix,
             {s.out})
        .per_position.push_back(num_keys);
  }
}

}  // namespace lily::ops
