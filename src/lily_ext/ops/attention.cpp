// attention_decode* (metal/attention.metal): one decode token, after attention_prep (attention_prep.cpp) or, split
// on matrix units, with it fused in (FUSED_ATTENTION_PREP); and the family's choice by token count (more tokens:
// attention_prefill.cpp).
#include <cmath>
#include <cstddef>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

namespace {

// Head dims with instantiated attention kernels (metal/attention_prep.metal, attention.metal,
// attention_prefill.metal) and the query heads their packed kernels put in one threadgroup.
size_t packed_heads(size_t head_dim) {
  if (head_dim == 256) return LILY_ATTN_HEADS_PER_GROUP;
  if (head_dim == 64) return LILY_ATTN_HEADS_PER_GROUP_D64;
  return 0;
}
// The same for attention_prefill_mma, which packs the whole GQA group of the model at head dim 256.
size_t mma_packed_heads(size_t head_dim) {
  if (head_dim == 256) return LILY_ATTN_MMA_HEADS_PER_GROUP;
  if (head_dim == 64) return LILY_ATTN_MMA_HEADS_PER_GROUP_D64;
  return 0;
}
static_assert(LILY_ATTN_MMA_HEADS_PER_GROUP % LILY_ATTN_HEADS_PER_GROUP == 0 &&
                  LILY_ATTN_MMA_HEADS_PER_GROUP_D64 % LILY_ATTN_HEADS_PER_GROUP_D64 == 0,
              "a head ratio the mma packing splits, the decode packing splits too");
bool ratio_splits(const ModelConfig& c, size_t packed) {
  return packed && c.num_kv_heads && (c.num_heads / c.num_kv_heads) % packed == 0;
}

}  // namespace

void check_attention_shapes(const ModelConfig& c) {
  if (packed_heads(c.head_dim) == 0) {
    throw Error("[engine] config field head_dim: the attention kernels are built for 256 and 64; got " +
                     std::to_string(c.head_dim));
  }
}

bool gqa_packing_fits(const ModelConfig& c) {
  return ratio_splits(c, packed_heads(c.head_dim));
}

std::vector<std::string> attention_fast_paths_left_out(const ModelConfig& c) {
  // A head dim without kernels is refused by check_attention_shapes; `lily plan` counts it as unpacked.
  const size_t packed = packed_heads(c.head_dim), mma_packed = mma_packed_heads(c.head_dim);
  const std::string ratio = "the head ratio num_attention_heads / num_key_value_heads = " +
                            std::to_string(c.num_heads) + " / " + std::to_string(c.num_kv_heads) +
                            " is not a multiple of ";
  if (packed == 0) return {};
  // A ratio the decode packing cannot split, the mma packing (a multiple of it) cannot either: one line.
  if (!gqa_packing_fits(c)) {
    return {"GQA packing: " + ratio + std::to_string(packed) + " (the query heads one threadgroup packs at head_dim " +
            std::to_string(c.head_dim) + "); attention runs the *_unpacked_* kernels, one query head per threadgroup"};
  }
  if (!ratio_splits(c, mma_packed)) {
    return {"GQA packing of prefill attention and bf16 decode attention on matrix units: " + ratio +
            std::to_string(mma_packed) + " (the query heads one attention_prefill_mma or attention_decode_mma "
            "threadgroup packs at head_dim " + std::to_string(c.head_dim) + "); prefill chunks of " +
            std::to_string(LILY_ATTN_MMA_MIN_QUERIES) +
            "+ tokens run attention_prefill_mma_unpacked_*, one query head per threadgroup, and decode the vector "
            "kernels attention_decode[_partial]_*, " + std::to_string(packed) + " heads per threadgroup"};
  }
  return {};
}

size_t attention_heads_per_group(const ModelConfig& c, bool packing) {
  // A head ratio the packed kernels cannot split falls back to one head per threadgroup, as packing off does.
  if (!packing || !gqa_packing_fits(c)) return 1;
  return packed_heads(c.head_dim);
}

size_t attention_mma_heads_per_group(const ModelConfig& c) {
  return ratio_splits(c, mma_packed_heads(c.head_dim)) ? mma_packed_heads(c.head_dim) : 1;
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

size_t attention_split_blocks(const Switches& sw, size_t keys) {
  if (!sw.split_kv) return 0;
  const size_t min_keys = sw.split_kv_min_keys ? sw.split_kv_min_keys : tuning::kAttentionSplitMinKeys;
  return tuning::attention_split_blocks(keys, min_keys, sw.split_kv_block_keys ? sw.split_kv_block_keys : min_keys);
}

void attention(Context& ctx, const ModelConfig& c, const std::string& label, const AttentionSpans& s,
               size_t position, size_t tokens, size_t split_blocks) {
  if (tokens == 1) {
    attention_decode(ctx, c, label, s, position, split_blocks);
  } else {
    attention_prefill(ctx, c, label, s, position, tokens, split_blocks);
  }
}

void attention_combine(Context& ctx, const ModelConfig& c, const std::string& label, const AttentionArgs& a,
                       const AttentionSpans& s, const Span& partial_out, const Span& partial_stats, size_t rows,
                       const PositionField& num_keys) {
  const size_t D = c.head_dim;
  add_node(ctx, std::string("attention_decode_combine_") + dtype_name(ctx.act) + "_d" + std::to_string(D),
           label + " combine",
           {arg_value(a), arg(s.gate), arg(partial_out), arg(partial_stats), arg(s.out)},
           {rows, (D + tuning::kAttentionCombineSlice - 1) / tuning::kAttentionCombineSlice, 1},
           {tuning::kAttentionCombineThreads, 1, 1}, {s.gate, partial_out, partial_stats}, {s.out})
      .per_position.push_back(num_keys);
}

void attention_decode(Context& ctx, const ModelConfig& c, const std::string& label, const AttentionSpans& s,
                      size_t position, size_t split_blocks) {
  const size_t D = c.head_dim, keys = position + 1;
  const std::string dt = dtype_name(ctx.act), suffix = "_d" + std::to_string(D);
  AttentionArgs a = attention_args(c, s, 1, keys);
  // GQA packing off (the ablation) or a head ratio it cannot split: the *_unpacked_* kernels, one query head per
  // threadgroup.
  const size_t heads_per_group = attention_heads_per_group(c, ctx.gqa_packing);
  const size_t packs = (c.num_heads + heads_per_group - 1) / heads_per_group;
  // Coalesced KV off (the ablation, packed kernels only): the *_plain_* kernels, the uncoalesced lane mapping.
  const std::string variant = heads_per_group == 1 ? "unpacked_" : ctx.coalesced_kv ? "" : "plain_";
  const PositionField num_keys{0, offsetof(AttentionArgs, num_keys), 1};  // keys = position + 1
  // Matrix units (MMA_ATTENTION, bf16 cache; not with the packing and coalescing ablations): the whole GQA group per
  // threadgroup, when the head ratio splits into it.
  const size_t mma_heads = attention_mma_heads_per_group(c);
  const bool mma = ctx.mma_attention && ctx.gqa_packing && ctx.coalesced_kv && ctx.act == DType::BF16 && mma_heads > 1;
  const std::string family = mma ? "mma_" : variant;
  const size_t groups = mma ? c.num_heads / mma_heads : packs;
  const size_t threads = mma ? tuning::kAttentionDecodeMmaThreads : tuning::kAttentionDecodeThreads;
  if (split_blocks > tuning::kAttentionSplitMaxBlocks) {
    throw Error("[attention_decode] " + std::to_string(split_blocks) +
                " split-KV blocks; the combine kernel takes up to " + std::to_string(tuning::kAttentionSplitMaxBlocks));
  }
  a.num_blocks = static_cast<u32>(split_blocks);
  // The combine, after the split pass (the partial kernel derives its block span from num_keys, patched per
  // position, and num_blocks, fixed for the program: the nodes stay valid for every position with this block count).
  Span partial_out = sub(s.partial_out, 0, c.num_heads * split_blocks * D * 4);
  Span partial_stats = sub(s.partial_stats, 0, c.num_heads * split_blocks * 2 * 4);
  // The kernels on matrix units fetch their first steps of earlier tokens' cache rows before their dependency wait
  // (LILY_INSTANTIATE_EARLY_KERNEL): those rows are read early, and among what they read.
  const AttentionPrepSpans cache = attention_prep_spans(c, ctx.act, s, position, 1);
  auto read_early = [&](Node& node) {
    if (!mma) return;
    node.early_reads = cache.old_rows;
    node.reads.insert(node.reads.end(), cache.old_rows.begin(), cache.old_rows.end());
  };
  if (mma && split_blocks && ctx.fused_attention_prep) {
    // FUSED_ATTENTION_PREP: no attention_prep node; each threadgroup preps its own query rows and the new cache row.
    // Split-KV only: fused into the single pass it lost 2 % of tg128 on an H100 (docs/performance.md).
    std::vector<Span> reads = {s.q_and_gate, s.k, s.v, s.q_norm->data, s.k_norm->data};
    reads.insert(reads.end(), cache.prefix.begin(), cache.prefix.end());
    std::vector<Span> writes = {s.gate, partial_out, partial_stats};
    writes.insert(writes.end(), cache.new_rows.begin(), cache.new_rows.end());
    Node& node = add_node(ctx, "attention_decode_partial_prep_mma_" + dt + suffix, label + " partial",
                          {arg_value(a), arg_value(attention_prep_args(c, s, position, 1)), arg(s.q_and_gate),
                           arg(s.k), arg(s.v), arg(s.q_norm->data), arg(s.k_norm->data), arg(s.gate),
                           arg(s.k_cache), arg(s.v_cache), arg(partial_out), arg(partial_stats)},
                          {groups, split_blocks, 1}, {threads, 1, 1}, reads, writes);
    node.per_position.push_back(num_keys);
    node.per_position.push_back({1, offsetof(AttentionPrepArgs, first_position), 0});
    read_early(node);
    attention_combine(ctx, c, label, a, s, partial_out, partial_stats, c.num_heads, num_keys);
    return;
  }
  std::vector<Span> reads = attention_prep(ctx, c, label, s, position, 1);
  if (split_blocks == 0) {
    Node& node = add_node(ctx, "attention_decode_" + family + dt + suffix, label,
                          {arg_value(a), arg(s.q), arg(s.gate), arg(s.k_cache), arg(s.v_cache), arg(s.out)},
                          {groups, 1, 1}, {threads, 1, 1}, reads, {s.out});
    node.per_position.push_back(num_keys);
    read_early(node);
    return;
  }
  reads.erase(reads.begin() + 1);  // the partial pass does not read the gate
  Node& node = add_node(ctx, "attention_decode_partial_" + family + dt + suffix, label + " partial",
                        {arg_value(a), arg(s.q), arg(s.k_cache), arg(s.v_cache), arg(partial_out),
                         arg(partial_stats)},
                        {groups, a.num_blocks, 1}, {threads, 1, 1}, reads, {partial_out, partial_stats});
  node.per_position.push_back(num_keys);
  read_early(node);
  attention_combine(ctx, c, label, a, s, partial_out, partial_stats, c.num_heads, num_keys);
}

}  // namespace lily::ops
