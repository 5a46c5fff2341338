// The kernels the engine's graphs dispatch for a configuration (see model.h): the registry test holds every
// instantiated kernel to an engine path through this.
#include <set>

#include "model.h"

namespace lily {

std::vector<std::string> graph_kernels(const ModelConfig& config, Precision precision, const Switches& switches,
                                       int bits, DType scale_dtype, const std::vector<size_t>& prefill_rows) {
  config.validate();
  Graph graph;
  WeightTable weights = synthetic_weights(config, graph);
  for (auto& [name, w] : weights) {
    if (!w.bits) continue;
    w.scale_dtype = scale_dtype;
    if (bits) w.bits = bits;
  }
  size_t max_rows = 1;
  for (size_t rows : prefill_rows) max_rows = std::max(max_rows, rows);
  DecodeBuffers decode = add_decode_buffers(config, precision, max_rows + 1, max_rows + 1, graph);
  PrefillBuffers prefill = add_prefill_buffers(config, precision, max_rows, max_rows, graph);
  if (!switches.in_gemm_dequant) prefill.dequant = add_dequant_scratch(precision, weights, graph);
  if (switches.chunked_scan) prefill.gdn_chunks = add_gdn_chunk_scratch(config, max_rows, graph);
  std::set<std::string> kernels;
  auto collect = [&](const Graph& g) {
    for (const Node& node : g.nodes) kernels.insert(node.kernel);
  };
  // Decode: greedy and sampled choice (top-k: the block path; nucleus alone: the one-threadgroup path), plain and
  // penalized, at the first position and past the split-KV threshold.
  TokenChoice sampled{0.7f, 40, 0.9f, 0.05f, 1}, nucleus{0.7f, 0, 0.9f, 0.0f, 1};
  TokenChoice penalized_greedy, penalized_sampled = sampled;
  penalized_greedy.presence_penalty = penalized_sampled.presence_penalty = 1.5f;
  for (const TokenChoice& choice : {TokenChoice{}, sampled, nucleus, penalized_greedy, penalized_sampled}) {
    for (size_t position : {size_t{0}, max_rows}) {
      Graph step;
      step.buffers = graph.buffers;
      build_decode_step(config, precision, switches, weights, decode, position, 0, 1, step, choice);
      collect(step);
    }
  }
  // Prefill chunks: lm_head for the last row (what a session asks for) and for every row (model.logits()).
  for (size_t rows : prefill_rows) {
    for (size_t logit_rows : {size_t{1}, rows}) {
      Graph chunk;
      chunk.buffers = graph.buffers;
      build_prefill_chunk(config, precision, switches, weights, decode, prefill, 0, rows, logit_rows, chunk);
      collect(chunk);
    }
  }
  return {kernels.begin(), kernels.end()};
}

}  // namespace lily
