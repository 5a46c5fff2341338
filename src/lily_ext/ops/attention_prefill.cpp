// attention_prefill[_mma]_* (metal/attention_prefill.metal): T tokens (after attention_prep, attention_prep.cpp).
#include <algorithm>
#include <cstddef>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

void attention_prefill(Context& ctx, const ModelConfig& c, const std::string& label, const AttentionSpans& s,
                       size_t position, size_t tokens) {
  const std::string dt = dtype_name(ctx.act), suffix = "_d" + std::to_string(c.head_dim);
  const std::vector<Span> prefix = attention_prep(ctx, c, label, s, position, tokens);
  const AttentionArgs a = attention_args(c, s, tokens, position + tokens);
  const std::vector<NodeArg> args = {arg_value(a), arg(s.q), arg(s.gate), arg(s.k_cache), arg(s.v_cache),
                                     arg(s.out)};
  // keys = position + T: a pass recorded once (a short prompt's, REPLAYED_PROMPTS) runs at any position.
  const PositionField num_keys{0, offsetof(AttentionArgs, num_keys), static_cast<int32_t>(tokens)};
  if (tokens >= tuning::kAttentionMmaMinQueries && ctx.mma_attention) {
    // Matrix units: LILY_ATTN_MMA_QUERIES queries x G heads per threadgroup, one simdgroup per head; G is the whole
    // GQA group at head dim 256 (8 for the model) when the head ratio splits into it, else 1 (*_unpacked_*).
    const size_t heads_per_group = attention_mma_heads_per_group(c);
    const std::string variant = heads_per_group == 1 ? "unpacked_" : "";
    add_node(ctx, "attention_prefill_mma_" + variant + dt + suffix, label, args,
             {(tokens + tuning::kAttentionMmaQueries - 1) / tuning::kAttentionMmaQueries,
              c.num_heads / heads_per_group, 1},
             {32 * heads_per_group, 1, 1}, prefix, {s.out})
        .per_position.push_back(num_keys);
  } else {
    // Few queries (or MMA_ATTENTION off): one simdgroup per query, up to 8 queries per threadgroup; G heads of one
    // KV head (the GQA_PACKING switch is a decode ablation) unless the head ratio cannot be split into groups of G:
    // then the *_unpacked_* kernel, one head per threadgroup.
    const size_t heads_per_group = attention_heads_per_group(c, true);
    const std::string variant = heads_per_group == 1 ? "unpacked_" : "";
    const size_t queries = std::min(tokens, tuning::kAttentionMmaMinQueries);
    add_node(ctx, "attention_prefill_" + variant + dt + suffix, label, args,
             {(tokens + queries - 1) / queries, c.num_heads / heads_per_group, 1}, {32 * queries, 1, 1}, prefix,
             {s.out})
        .per_position.push_back(num_keys);
  }
}

}  // namespace lily::ops
