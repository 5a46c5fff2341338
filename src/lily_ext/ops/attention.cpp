// attention_prep_* (metal/rope.metal) and attention_decode* (metal/attention.metal): one decode token.
#include <cmath>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

void attention_decode(Context& ctx, const ModelConfig& c, const std::string& label, const AttentionSpans& s,
                      size_t position, bool split) {
  const size_t D = c.head_dim, cache_elem = ctx.act == DType::F32 ? 4 : 2;
  const std::string dt = dtype_name(ctx.act), suffix = "_d" + std::to_string(D);
  const size_t head_stride = s.capacity * D * cache_elem, row = D * cache_elem, keys = position + 1;

  AttentionPrepArgs p{};
  p.num_tokens = 1;
  p.num_heads = static_cast<u32>(c.num_heads);
  p.num_kv_heads = static_cast<u32>(c.num_kv_heads);
  p.first_position = static_cast<u32>(position);
  p.cache_capacity = static_cast<u32>(s.capacity);
  p.rotary_dim = static_cast<u32>(c.rotary_dim);
  p.rope_theta = c.rope_theta;
  p.eps = c.eps;
  std::vector<Span> cache_rows, cache_prefix;
  for (size_t h = 0; h < c.num_kv_heads; ++h) {
    cache_rows.push_back(sub(s.k_cache, h * head_stride + position * row, row));
    cache_rows.push_back(sub(s.v_cache, h * head_stride + position * row, row));
    cache_prefix.push_back(sub(s.k_cache, h * head_stride, keys * row));
    cache_prefix.push_back(sub(s.v_cache, h * head_stride, keys * row));
  }
  std::vector<Span> prep_writes = {s.q, s.gate};
  prep_writes.insert(prep_writes.end(), cache_rows.begin(), cache_rows.end());
  size_t rows = c.num_heads + c.num_kv_heads, per_group = tuning::kAttentionPrepSimdgroups;
  add_node(ctx, "attention_prep_" + dt + suffix, label + " prep",
           {arg_value(p), arg(s.q_and_gate), arg(s.k), arg(s.v), arg(s.q_norm->data), arg(s.k_norm->data), arg(s.q),
            arg(s.gate), arg(s.k_cache), arg(s.v_cache)},
           {(rows + per_group - 1) / per_group, 1, 1}, {32 * per_group, 1, 1},
           {s.q_and_gate, s.k, s.v, s.q_norm->data, s.k_norm->data}, prep_writes);

  AttentionArgs a{};
  a.num_queries = 1;
  a.num_heads = static_cast<u32>(c.num_heads);
  a.num_kv_heads = static_cast<u32>(c.num_kv_heads);
  a.num_keys = static_cast<u32>(keys);
  a.cache_capacity = static_cast<u32>(s.capacity);
  a.scale = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t packs = (c.num_heads + LILY_ATTN_HEADS_PER_GROUP - 1) / LILY_ATTN_HEADS_PER_GROUP;
  std::vector<Span> reads = {s.q, s.gate};
  reads.insert(reads.end(), cache_prefix.begin(), cache_prefix.end());
  if (!split) {
    add_node(ctx, "attention_decode_" + dt + suffix, label,
             {arg_value(a), arg(s.q), arg(s.gate), arg(s.k_cache), arg(s.v_cache), arg(s.out)}, {packs, 1, 1},
             {tuning::kAttentionDecodeThreads, 1, 1}, reads, {s.out});
    return;
  }
  a.block_size = static_cast<u32>(tuning::kAttentionSplitBlock);
  a.num_blocks = static_cast<u32>((keys + a.block_size - 1) / a.block_size);
  Span partial_out = sub(s.partial_out, 0, c.num_heads * a.num_blocks * D * 4);
  Span partial_stats = sub(s.partial_stats, 0, c.num_heads * a.num_blocks * 2 * 4);
  reads.erase(reads.begin() + 1);  // the partial pass does not read the gate
  add_node(ctx, "attention_decode_partial_" + dt + suffix, label + " partial",
           {arg_value(a), arg(s.q), arg(s.k_cache), arg(s.v_cache), arg(partial_out), arg(partial_stats)},
           {packs, a.num_blocks, 1}, {tuning::kAttentionDecodeThreads, 1, 1}, reads, {partial_out, partial_stats});
  add_node(ctx, "attention_decode_combine_" + dt + suffix, label + " combine",
           {arg_value(a), arg(s.gate), arg(partial_out), arg(partial_stats), arg(s.out)}, {c.num_heads, 1, 1},
           {tuning::kAttentionDecodeThreads, 1, 1}, {s.gate, partial_out, partial_stats}, {s.out});
}

}  // namespace lily::ops
