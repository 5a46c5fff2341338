// attention_prefill[_mma]_* (metal/attention_prefill.metal): T tokens (after attention_prep, attention_prep.cpp).
#include <algorithm>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

void attention_prefill(Context& ctx, const ModelConfig& c, const std::string& label, const AttentionSpans& s,
                       size_t position, size_t tokens) {
  const std::string dt = dtype_name(ctx.act), suffix = "_d" + std::to_string(c.head_dim);
  const std::vector<Span> prefix = attention_prep(ctx, c, label, s, position, tokens);
  const AttentionArgs a = attention_args(c, s, tokens, position + tokens);
  // Prefill packs G heads of one KV head per threadgroup (the GQA_PACKING switch is a decode ablation) unless the
  // head ratio cannot be split into groups of G: then the *_unpacked_* kernels, one head per threadgroup.
  const size_t heads_per_group = attention_heads_per_group(c, true);
  const size_t packs = (c.num_heads + heads_per_group - 1) / heads_per_group;
  const std::string variant = heads_per_group == 1 ? "unpacked_" : "";
  const std::vector<NodeArg> args = {arg_value(a), arg(s.q), arg(s.gate), arg(s.k_cache), arg(s.v_cache),
                                     arg(s.out)};
  if (tokens >= tuning::kAttentionMmaMinQueries && ctx.mma_attention) {
    // Matrix units: 8 queries x G heads per threadgroup, one simdgroup per head.
    add_node(ctx, "attention_prefill_mma_" + variant + dt + suffix, label, args, {(tokens + 7) / 8, packs, 1},
             {32 * heads_per_group, 1, 1}, prefix, {s.out});
  } else {
    // Few queries (or MMA_ATTENTION off): one simdgroup per query, up to 8 queries per threadgroup.
    const size_t queries = std::min(tokens, tuning::kAttentionMmaMinQueries);
    add_node(ctx, "attention_prefill_" + variant + dt + suffix, label, args, {(tokens + queries - 1) / queries, packs, 1},
             {32 * queries, 1, 1}, prefix, {s.out});
  }
}

}  // namespace lily::ops
