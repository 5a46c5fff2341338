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
  StateBuffers state = add_state_buffers(config, precision, max_rows + 1, graph);
  PassBuffers step = add_pass_buffers(config, precision, 1, 1, max_rows + 1, "", graph);
  PassBuffers chunk = add_pass_buffers(config, precision, max_rows, max_rows, max_rows + 1, "prefill", graph);
  if (!switches.in_gemm_dequant) chunk.dequant = add_dequant_scratch(precision, weights, graph);
  if (switches.chunked_scan) chunk.gdn_chunks = add_gdn_chunk_scratch(config, max_rows, graph);
  std::set<std::string> kernels;
  auto collect = [&](const Graph& g) {
    for (const Node& node : g.nodes) kernels.insert(node.kernel);
  };
  // Decode: greedy and sampled choice (the block path; top-k above its candidates: the one-threadgroup path), plain
  // and penalized, at the first position and past the split-KV threshold.
  const uint32_t beyond_candidates = static_cast<uint32_t>(config.vocab_size - 1);
  TokenChoice sampled{0.7f, 40, 0.9f, 0.05f, 1}, wide_top_k{0.7f, beyond_candidates, 1.0f, 0.0f, 1};
  TokenChoice penalized_greedy, penalized_sampled = sampled;
  penalized_greedy.presence_penalty = penalized_sampled.presence_penalty = 1.5f;
  for (const TokenChoice& choice : {TokenChoice{}, sampled, wide_top_k, penalized_greedy, penalized_sampled}) {
    for (size_t position : {size_t{0}, max_rows}) {
      Graph step_graph;
      step_graph.buffers = graph.buffers;
      build_decode_step(config, precision, switches, weights, state, step, position, 0, 1, step_graph, choice);
      collect(step_graph);
    }
  }
  // Passes of more rows (prefill chunks): lm_head for the last row (what a session asks for) and for every row
  // (model.logits()); and attention split over key blocks, as deep in a context (blocks of any length here).
  auto collect_pass = [&](const Switches& sw, size_t rows, size_t logit_rows) {
    Graph pass;
    pass.buffers = graph.buffers;
    PassInput in;
    in.tokens = rows;
    in.logit_rows = logit_rows;
    in.ids = Span{chunk.ids, 0, rows * 4};
    build_forward(config, precision, sw, weights, state, chunk, in, pass);
    collect(pass);
  };
  Switches split = switches;
  split.split_prefill_block_keys = 1;
  for (size_t rows : prefill_rows) {
    collect_pass(switches, rows, 1);
    collect_pass(switches, rows, rows);
    collect_pass(split, rows, 1);
  }
  return {kernels.begin(), kernels.end()};
}

}  // namespace lily
