// Graph counting and the decode plan (see plan.h).
#include "plan.h"

#include <vector>

#include "barriers.h"
#include "ops/ops.h"
#include "tuning.h"

namespace lily {

GraphCounts count_graph(const Graph& graph) {
  GraphCounts counts;
  std::vector<bool> starts = stage_starts(graph);
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    const Node& node = graph.nodes[i];
    counts.stages += starts[i];
    counts.barriers += starts[i] && i > 0;
    ++counts.dispatches;
    ++counts.dispatches_by_kernel[node.kernel];
    counts.bytes_read += node.traffic_read;
    counts.bytes_written += node.traffic_written;
  }
  return counts;
}

MinimumBytes minimum_bytes(const ModelConfig& c, Precision precision, const WeightTable& weights, size_t context) {
  MinimumBytes m;
  for (const auto& [name, w] : weights) {
    if (name == "embed_tokens.weight") {
      m.weights += w.bytes() / w.rows;  // one row
    } else if (w.experts) {
      m.weights += w.bytes() / w.experts * c.top_k;  // the k routed experts
    } else {
      m.weights += w.bytes();
    }
  }
  StateLayout s = state_layout(c, precision);
  size_t attention = 0;
  for (bool a : c.attention_layers) attention += a;
  size_t gdn = c.num_layers() - attention;
  m.recurrent_state = 2 * gdn * s.recurrent_bytes;
  m.conv_state = 2 * gdn * s.conv_bytes;
  m.kv_cache = attention * 2 * s.kv_bytes_per_row * context;
  return m;
}

std::vector<std::string> fast_paths_left_out(const ModelConfig& config) {
  bool any_attention = false, any_deltanet = false;
  for (bool a : config.attention_layers) {
    any_attention |= a;
    any_deltanet |= !a;
  }
  std::vector<std::string> lines;
  if (any_attention) lines = ops::attention_fast_paths_left_out(config);
  if (any_deltanet) {
    for (std::string& line : ops::gated_delta_fast_paths_left_out(config)) lines.push_back(std::move(line));
  }
  return lines;
}

DecodePlan plan_decode(const ModelConfig& config, Precision precision, const Switches& switches, size_t context) {
  config.validate();
  DecodePlan plan;
  plan.context = context;
  // The cache holds the context plus the new token, grown in whole blocks.
  const size_t block = switches.kv_growth_block();
  plan.kv_capacity = (context + 1 + block - 1) / block * block;
  WeightTable weights = synthetic_weights(config, plan.graph);
  StateBuffers state = add_state_buffers(config, precision, plan.kv_capacity, plan.graph);
  PassBuffers step = add_pass_buffers(config, precision, 1, 1, plan.kv_capacity, "", plan.graph);
  // The plan is the Metal engine's step: no runtime here to prefer staged or matrix-unit GEMVs, as Apple GPUs never
  // do (the engine turns the switches off the same way, Engine::Engine).
  Switches metal = switches;
  metal.staged_gemv = false;
  metal.mma_gemv = false;
  build_decode_step(config, precision, metal, weights, state, step, context, 0, 1, plan.graph);
  plan.counts = count_graph(plan.graph);
  plan.minimum = minimum_bytes(config, precision, weights, context);
  for (size_t id = 0; id < plan.graph.buffers.size(); ++id) {
    const GraphBuffer& buffer = plan.graph.buffers[id];
    plan.memory.add(state, static_cast<int>(id), buffer.role, buffer.length);
  }
  plan.memory.peak = plan.memory.total();
  plan.kv_bytes_per_token = plan.memory.kv_cache / plan.kv_capacity;
  plan.fast_paths_left_out = fast_paths_left_out(config);
  return plan;
}

}  // namespace lily
