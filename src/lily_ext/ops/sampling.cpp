// metal/sampling.metal: argmax_partial_<dtype>, argmax_final_f32, sample_<dtype>, sample_partial_<dtype> +
// sample_final_<dtype>, penalize_logits_<dtype>,
// count_token: the token choice, written to the token buffer the next step's embedding reads, and the logit bias
// and penalties in front of it.
#include <cstddef>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

// sample_partial holds at most LILY_SAMPLE_PER_THREAD logits a thread and packs two block counts in one 32-bit scan.
static_assert(LILY_SAMPLE_BLOCK <= tuning::kSamplePartialThreads * LILY_SAMPLE_PER_THREAD &&
                  tuning::kSamplePartialThreads <= 1024 && tuning::kSamplePartialThreads % 32 == 0 &&
                  LILY_SAMPLE_BLOCK < 65536 && LILY_SAMPLE_BLOCK > LILY_SAMPLE_CANDIDATES,
              "sample_partial's block shape");

void argmax(Context& ctx, const Span& logits, size_t vocab, const Span& partial_values, const Span& partial_ids,
            const Span& tokens, size_t out_index) {
  ArgmaxArgs a{};
  a.vocab_size = static_cast<u32>(vocab);
  a.block_size = LILY_ARGMAX_BLOCK;
  a.num_partials = static_cast<u32>((vocab + LILY_ARGMAX_BLOCK - 1) / LILY_ARGMAX_BLOCK);
  a.out_index = static_cast<u32>(out_index);
  Span values = sub(partial_values, 0, a.num_partials * 4), ids = sub(partial_ids, 0, a.num_partials * 4);
  add_node(ctx, std::string("argmax_partial_") + dtype_name(ctx.act), "argmax partial",
           {arg_value(a), arg(logits), arg(values), arg(ids)}, {a.num_partials, 1, 1}, {tuning::kArgmaxThreads, 1, 1},
           {logits}, {values, ids});
  argmax_final(ctx, vocab, partial_values, partial_ids, a.num_partials, tokens, out_index);
}

void argmax_final(Context& ctx, size_t vocab, const Span& partial_values, const Span& partial_ids, size_t partials,
                  const Span& tokens, size_t out_index) {
  ArgmaxArgs a{};
  a.vocab_size = static_cast<u32>(vocab);
  a.block_size = LILY_ARGMAX_BLOCK;  // unread by argmax_final
  a.num_partials = static_cast<u32>(partials);
  a.out_index = static_cast<u32>(out_index);
  Span values = sub(partial_values, 0, partials * 4), ids = sub(partial_ids, 0, partials * 4);
  add_node(ctx, "argmax_final_f32", "argmax final", {arg_value(a), arg(values), arg(ids), arg(tokens)}, {1, 1, 1},
           {tuning::kArgmaxThreads, 1, 1}, {values, ids}, {sub(tokens, out_index * 4, 4)});
}

void penalize_logits(Context& ctx, const Span& logits, size_t vocab, const TokenChoice& choice, const Span& bias,
                     const Span& seen, const Span& counts, const Span& processed) {
  PenaltyArgs a{};
  a.vocab_size = static_cast<u32>(vocab);
  a.has_bias = choice.logit_bias ? 1 : 0;
  a.repetition_penalty = choice.repetition_penalty;
  a.presence_penalty = choice.presence_penalty;
  a.frequency_penalty = choice.frequency_penalty;
  const u32 groups = static_cast<u32>((vocab + tuning::kPenaltyThreads - 1) / tuning::kPenaltyThreads);
  add_node(ctx, std::string("penalize_logits_") + dtype_name(ctx.act), "penalize logits",
           {arg_value(a), arg(logits), arg(bias), arg(seen), arg(counts), arg(processed)}, {groups, 1, 1},
           {tuning::kPenaltyThreads, 1, 1}, {logits, bias, seen, counts}, {processed});
}

void count_token(Context& ctx, size_t vocab, const Span& tokens, size_t out_index, const Span& seen,
                 const Span& counts) {
  PenaltyArgs a{};
  a.vocab_size = static_cast<u32>(vocab);
  a.out_index = static_cast<u32>(out_index);
  add_node(ctx, "count_token", "count token", {arg_value(a), arg(tokens), arg(seen), arg(counts)}, {1, 1, 1},
           {32, 1, 1}, {sub(tokens, out_index * 4, 4), seen, counts}, {seen, counts});
}

size_t sample_scratch_words(size_t vocab) {
  const size_t blocks = (vocab + LILY_SAMPLE_BLOCK - 1) / LILY_SAMPLE_BLOCK;
  return blocks * (LILY_SAMPLE_CANDIDATES + 2);
}

void sample(Context& ctx, const Span& logits, size_t vocab, const TokenChoice& choice, const Span& values,
            const Span& ids, const Span& tokens, size_t out_index, size_t position, int position_delta) {
  SampleArgs a{};
  a.vocab_size = static_cast<u32>(vocab);
  a.top_k = choice.top_k;
  a.temperature = choice.temperature;
  a.top_p = choice.top_p;
  a.min_p = choice.min_p;
  a.seed_lo = static_cast<u32>(choice.seed);
  a.seed_hi = static_cast<u32>(choice.seed >> 32);
  a.step = static_cast<u32>(position + position_delta);
  a.out_index = static_cast<u32>(out_index);
  if (tuning::sample_block_path(choice.top_k, vocab)) {
    // values: [blocks * C] candidate x, then [blocks * 2] block max and sum; ids: candidate ids, then the cuts.
    a.block_size = LILY_SAMPLE_BLOCK;
    a.num_blocks = static_cast<u32>((vocab + LILY_SAMPLE_BLOCK - 1) / LILY_SAMPLE_BLOCK);
    const size_t cand_bytes = size_t{a.num_blocks} * LILY_SAMPLE_CANDIDATES * 4, stat_bytes = size_t{a.num_blocks} * 8;
    const Span cand_x = sub(values, 0, cand_bytes), stats = sub(values, cand_bytes, stat_bytes);
    const Span cand_id = sub(ids, 0, cand_bytes), cuts = sub(ids, cand_bytes, stat_bytes);
    const std::string dtype = dtype_name(ctx.act);
    Node& partial = add_node(ctx, "sample_partial_" + dtype, "sample partial",
                             {arg_value(a), arg(logits), arg(cand_x), arg(cand_id), arg(stats), arg(cuts)},
                             {a.num_blocks, 1, 1}, {tuning::kSamplePartialThreads, 1, 1}, {logits},
                             {cand_x, cand_id, stats, cuts});
    partial.per_position.push_back({0, offsetof(SampleArgs, step), position_delta});
    const size_t final_threads = tuning::sample_final_threads(choice.top_k, choice.top_p, choice.min_p, vocab);
    Node& last = add_node(ctx, "sample_final_" + dtype, "sample final",
                           {arg_value(a), arg(logits), arg(cand_x), arg(cand_id), arg(stats), arg(cuts), arg(tokens)},
                           {1, 1, 1}, {final_threads, 1, 1}, {logits, cand_x, cand_id, stats, cuts},
                           {sub(tokens, out_index * 4, 4)});
    last.per_position.push_back({0, offsetof(SampleArgs, step), position_delta});
    return;
  }
  Node& node = add_node(ctx, std::string("sample_") + dtype_name(ctx.act), "sample",
                        {arg_value(a), arg(logits), arg(tokens)}, {1, 1, 1}, {tuning::kSampleThreads, 1, 1}, {logits},
                        {sub(tokens, out_index * 4, 4)});
  node.per_position.push_back({0, offsetof(SampleArgs, step), position_delta});
}

}  // namespace lily::ops
