// attention_prep_* (metal/rope.metal; decode and prefill) and attention_decode* (metal/attention.metal): one
// decode token.
#include <cmath>
#include <cstddef>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

namespace {

// Head dims with instantiated attention kernels (metal/rope.metal, attention.metal, attention_prefill.metal) and
// the query heads their packed kernels put in one threadgroup.
size_t packed_heads(size_t head_dim) {
  if (head_dim == 256) return LILY_ATTN_HEADS_PER_GROUP;
  if (head_dim == 64) return LILY_ATTN_HEADS_PER_GROUP_D64;
  return 0;
}

}  // namespace

void check_attention_shapes(const ModelConfig& c) {
  const size_t packed = packed_heads(c.head_dim);
  if (packed == 0) {
    throw mtl::Error("[engine] config field head_dim: the attention kernels are built for 256 and 64; got " +
                     std::to_string(c.head_dim));
  }
  if (c.num_kv_heads == 0 || c.num_heads % (c.num_kv_heads * packed)) {
    throw mtl::Error("[engine] config field num_attention_heads: must be a multiple of " + std::to_string(packed) +
                     " x num_key_value_heads at head_dim " + std::to_string(c.head_dim) +
                     " (GQA packing); got " + std::to_string(c.num_heads) + " heads, " +
                     std::to_string(c.num_kv_heads) + " KV heads");
  }
}

size_t attention_heads_per_group(const ModelConfig& c, bool packing) {
  if (!packing) return 1;
  // `lily plan` may count a shape without kernels (check_attention_shapes refuses to run it): plan it as the model's.
  const size_t packed = packed_heads(c.head_dim);
  return packed ? packed : LILY_ATTN_HEADS_PER_GROUP;
}

std::vector<Span> attention_prep(Context& ctx, const ModelConfig& c, const std::string& label,
                                 const AttentionSpans& s, size_t position, size_t tokens) {
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
  Node& prep = add_node(ctx, "attention_prep_" + dt + suffix, label + " prep",
           {arg_value(p), arg(s.q_and_gate), arg(s.k), arg(s.v), arg(s.q_norm->data), arg(s.k_norm->data), arg(s.q),
            arg(s.gate), arg(s.k_cache), arg(s.v_cache)},
           {(rows + per_group - 1) / per_group, 1, 1}, {32 * per_group, 1, 1},
           {s.q_and_gate, s.k, s.v, s.q_norm->data, s.k_norm->data}, new_rows);
  prep.per_position.push_back({0, offsetof(AttentionPrepArgs, first_position), 0});
  return prefix;
}

AttentionArgs attention_args(const ModelConfig& c, const AttentionSpans& s, size_t queries, size_t keys) {
  AttentionArgs a{};
  a.num_queries = static_cast<u32>(queries);
  a.num_heads = static_cast<u32>(c.num_heads);
  a.num_kv_heads = static_cast<u32>(c.num_kv_heads);
  a.num_keys = static_cast<u32>(keys);
  a.cache_capacity = static_cast<u32>(s.capacity);
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  return a;
}

void attention_decode(Context& ctx, const ModelConfig& c, const std::string& label, const AttentionSpans& s,
                      size_t position, bool split) {
  const size_t D = c.head_dim, keys = position + 1;
  const std::string dt = dtype_name(ctx.act), suffix = "_d" + std::to_string(D);
  std::vector<Span> reads = attention_prep(ctx, c, label, s, position, 1);
  AttentionArgs a = attention_args(c, s, 1, keys);
  // GQA packing off (the ablation): the *_unpacked_* kernels, one query head per threadgroup.
  const size_t heads_per_group = attention_heads_per_group(c, ctx.gqa_packing);
  const size_t packs = (c.num_heads + heads_per_group - 1) / heads_per_group;
  // Coalesced KV off (the ablation, packed kernels only): the *_plain_* kernels, the uncoalesced lane mapping.
  const std::string variant = !ctx.gqa_packing ? "unpacked_" : ctx.coalesced_kv ? "" : "plain_";
  const PositionField num_keys{0, offsetof(AttentionArgs, num_keys), 1};  // keys = position + 1
  if (!split) {
    add_node(ctx, "attention_decode_" + variant + dt + suffix, label,
             {arg_value(a), arg(s.q), arg(s.gate), arg(s.k_cache), arg(s.v_cache), arg(s.out)}, {packs, 1, 1},
             {tuning::kAttentionDecodeThreads, 1, 1}, reads, {s.out})
        .per_position.push_back(num_keys);
    return;
  }
  a.block_size = static_cast<u32>(tuning::kAttentionSplitBlock);
  a.num_blocks = static_cast<u32>((keys + a.block_size - 1) / a.block_size);
  Span partial_out = sub(s.partial_out, 0, c.num_heads * a.num_blocks * D * 4);
  Span partial_stats = sub(s.partial_stats, 0, c.num_heads * a.num_blocks * 2 * 4);
  reads.erase(reads.begin() + 1);  // the partial pass does not read the gate
  add_node(ctx, "attention_decode_partial_" + variant + dt + suffix, label + " partial",
           {arg_value(a), arg(s.q), arg(s.k_cache), arg(s.v_cache), arg(partial_out), arg(partial_stats)},
           {packs, a.num_blocks, 1}, {tuning::kAttentionDecodeThreads, 1, 1}, reads, {partial_out, partial_stats})
      .per_position.push_back(num_keys);
  add_node(ctx, "attention_decode_combine_" + dt + suffix, label + " combine",
           {arg_value(a), arg(s.gate), arg(partial_out), arg(partial_stats), arg(s.out)}, {c.num_heads, 1, 1},
           {tuning::kAttentionDecodeThreads, 1, 1}, {s.gate, partial_out, partial_stats}, {s.out})
      .per_position.push_back(num_keys);
}

}  // namespace lily::ops
