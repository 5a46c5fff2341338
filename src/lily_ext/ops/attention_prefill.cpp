// attention_prep_* (metal/rope.metal) and attention_prefill[_mma]_* (metal/attention_prefill.metal): T tokens.
#include <cmath>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

void attention_prefill(Context& ctx, const ModelConfig& c, const std::string& label, const AttentionSpans& s,
                       size_t position, size_t tokens) {
  const size_t D = c.head_dim, cache_elem = ctx.act == DType::F32 ? 4 : 2;
  const std::string dt = dtype_name(ctx.act), suffix = "_d" + std::to_string(D);
  const size_t head_stride = s.capacity * D * cache_elem, row = D * cache_elem, keys = position + tokens;

  AttentionPrepArgs p{};
  p.num_tokens = static_cast<u32>(tokens);
  p.num_heads = static_cast<u32>(c.num_heads);
  p.num_kv_heads = static_cast<u32>(c.num_kv_heads);
  p.first_position = static_cast<u32>(position);
  p.cache_capacity = static_cast<u32>(s.capacity);
  p.rotary_dim = static_cast<u32>(c.rotary_dim);
  p.rope_theta = c.rope_theta;
  p.eps = c.eps;
  std::vector<Span> new_rows = {s.q, s.gate}, prefix = {s.q, s.gate};
  for (size_t h = 0; h < c.num_kv_heads; ++h) {
    for (const Span& cache : {s.k_cache, s.v_cache}) {
      new_rows.push_back(sub(cache, h * head_stride + position * row, tokens * row));
      prefix.push_back(sub(cache, h * head_stride, keys * row));
    }
  }
  const size_t rows = tokens * (c.num_heads + c.num_kv_heads), per_group = tuning::kAttentionPrepSimdgroups;
  add_node(ctx, "attention_prep_" + dt + suffix, label + " prep",
           {arg_value(p), arg(s.q_and_gate), arg(s.k), arg(s.v), arg(s.q_norm->data), arg(s.k_norm->data), arg(s.q),
            arg(s.gate), arg(s.k_cache), arg(s.v_cache)},
           {(rows + per_group - 1) / per_group, 1, 1}, {32 * per_group, 1, 1},
           {s.q_and_gate, s.k, s.v, s.q_norm->data, s.k_norm->data}, new_rows);

  AttentionArgs a{};
  a.num_queries = static_cast<u32>(tokens);
  a.num_heads = static_cast<u32>(c.num_heads);
  a.num_kv_heads = static_cast<u32>(c.num_kv_heads);
  a.num_keys = static_cast<u32>(keys);
  a.cache_capacity = static_cast<u32>(s.capacity);
  a.scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Prefill always packs (the GQA_PACKING switch is a decode ablation): G heads of one KV head per threadgroup.
  const size_t heads_per_group = attention_heads_per_group(c, true);
  const size_t packs = (c.num_heads + heads_per_group - 1) / heads_per_group;
  const std::vector<NodeArg> args = {arg_value(a), arg(s.q), arg(s.gate), arg(s.k_cache), arg(s.v_cache),
                                     arg(s.out)};
  if (tokens >= tuning::kAttentionMmaMinQueries) {
    // Matrix units: 8 queries x G heads per threadgroup, one simdgroup per head.
    add_node(ctx, "attention_prefill_mma_" + dt + suffix, label, args, {(tokens + 7) / 8, packs, 1},
             {32 * heads_per_group, 1, 1}, prefix, {s.out});
  } else {
    // Few queries: one simdgroup per query.
    add_node(ctx, "attention_prefill_" + dt + suffix, label, args, {1, packs, 1}, {32 * tokens, 1, 1}, prefix,
             {s.out});
  }
}

}  // namespace lily::ops
