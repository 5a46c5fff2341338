// embedding_gather_* (metal/embedding.metal): one threadgroup per token row.
#include <stdexcept>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

void embedding(Context& ctx, const Span& ids, size_t ids_offset, const WeightRef& table, const Span& out,
               size_t tokens) {
  if (table.bits == 0) throw std::logic_error("[graph] embed_tokens.weight must be quantized for embedding_gather");
  EmbeddingArgs a{};
  a.hidden_size = static_cast<u32>(table.cols);
  a.vocab_size = static_cast<u32>(table.rows);
  a.ids_offset = static_cast<u32>(ids_offset);
  std::string name = "embedding_gather_q" + std::to_string(table.bits) + "_g64_" + dtype_name(ctx.act);
  if (table.scale_dtype == DType::F32) name += "_sf32";
  // The kernel reads `tokens` rows of the table chosen by the ids: declare the whole table (read-only, so it never
  // orders anything) but count only the rows as traffic.
  size_t row_bytes = table.bytes() / table.rows;
  Node& node = add_node(ctx, name, "embedding",
                        {arg_value(a), arg(ids), arg(table.data), arg(table.scales), arg(table.biases), arg(out)},
                        {tokens, 1, 1}, {tuning::kEmbeddingThreads, 1, 1},
                        {sub(ids, ids_offset * 4, tokens * 4), table.data, table.scales, table.biases}, {out});
  node.traffic_read = tokens * 4 + tokens * row_bytes;
}

}  // namespace lily::ops
