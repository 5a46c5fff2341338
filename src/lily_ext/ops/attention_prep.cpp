// attention_prep_* (metal/attention_prep.metal): per-head q/k RMSNorm, partial RoPE, the [query | gate] split and the
// KV-cache write of T new tokens, in front of decode (attention.cpp) and prefill (attention_prefill.cpp) attention.
#include <cstddef>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

AttentionPrepArgs attention_prep_args(const ModelConfig& c, const AttentionSpans& s, size_t position, size_t tokens) {
  AttentionPrepArgs p{};
  p.num_tokens = static_cast<u32>(tokens);
  p.num_heads = static_cast<u32>(c.num_heads);
  p.num_kv_heads = static_cast<u32>(c.num_kv_heads);
  p.first_position = static_cast<u32>(position);
  p.cache_capacity = static_cast<u32>(s.capacity);
  p.rotary_dim = static_cast<u32>(c.rotary_dim);
  p.rope_theta = c.rope_theta;
  p.eps = c.eps;
  return p;
}

AttentionPrepSpans attention_prep_spans(const ModelConfig& c, DType act, const AttentionSpans& s, size_t position,
                                        size_t tokens) {
  const size_t D = c.head_dim, cache_elem = act == DType::F32 ? 4 : 2;
  const size_t head_stride = s.capacity * D * cache_elem, row = D * cache_elem, keys = position + tokens;
  AttentionPrepSpans spans;
  for (size_t h = 0; h < c.num_kv_heads; ++h) {
    for (const Span& cache : {s.k_cache, s.v_cache}) {
      spans.new_rows.push_back(sub(cache, h * head_stride + position * row, tokens * row));
      spans.prefix.push_back(sub(cache, h * head_stride, keys * row));
      spans.old_rows.push_back(sub(cache, h * head_stride, position * row));
    }
  }
  return spans;
}

std::vector<Span> attention_prep(Context& ctx, const ModelConfig& c, const std::string& label,
                                 const AttentionSpans& s, size_t position, size_t tokens) {
  const std::string dt = dtype_name(ctx.act), suffix = "_d" + std::to_string(c.head_dim);
  const AttentionPrepSpans cache = attention_prep_spans(c, ctx.act, s, position, tokens);
  std::vector<Span> new_rows = {s.q, s.gate}, prefix = {s.q, s.gate};
  new_rows.insert(new_rows.end(), cache.new_rows.begin(), cache.new_rows.end());
  prefix.insert(prefix.end(), cache.prefix.begin(), cache.prefix.end());
  const size_t rows = tokens * (c.num_heads + c.num_kv_heads), per_group = tuning::kAttentionPrepSimdgroups;
  Node& prep = add_node(ctx, "attention_prep_" + dt + suffix, label + " prep",
           {arg_value(attention_prep_args(c, s, position, tokens)), arg(s.q_and_gate), arg(s.k), arg(s.v),
            arg(s.q_norm->data), arg(s.k_norm->data), arg(s.q), arg(s.gate), arg(s.k_cache), arg(s.v_cache)},
           {(rows + per_group - 1) / per_group, 1, 1}, {32 * per_group, 1, 1},
           {s.q_and_gate, s.k, s.v, s.q_norm->data, s.k_norm->data}, new_rows);
  prep.per_position.push_back({0, offsetof(AttentionPrepArgs, first_position), 0});
  return prefix;
}

}  // namespace lily::ops
