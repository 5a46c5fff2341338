// `lily plan`: the decode graph of a configuration, built but not run, and what it costs per token.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "barriers.h"
#include "model.h"

namespace lily {

// Counts of a graph. Stages come from the barrier rule (barriers.h), the one the Encoder applies to declared ranges:
// a dispatch opens a new stage when it reads what the stage writes, or writes what the stage reads or writes; tests
// check these counts against a real Encoder's counters.
struct GraphCounts {
  uint64_t dispatches = 0, stages = 0, barriers = 0;
  uint64_t bytes_read = 0, bytes_written = 0;  // traffic (data-dependent reads counted as what is read)
  std::map<std::string, uint64_t> dispatches_by_kernel;
};
GraphCounts count_graph(const Graph& graph);

// The minimum bytes one decode token must move: active weights, DeltaNet recurrent state
// read and written, conv state read and written, and the KV cache of `context` tokens.
struct MinimumBytes {
  uint64_t weights = 0, recurrent_state = 0, conv_state = 0, kv_cache = 0;
  uint64_t total() const { return weights + recurrent_state + conv_state + kv_cache; }
};

struct DecodePlan {
  GraphCounts counts;
  MinimumBytes minimum;
  size_t context = 0, kv_capacity = 0;
  // What the engine holds for this step (its decode buffers: no prefill chunk's), and what the KV cache grows by
  // per token of context.
  DeviceMemory memory;
  uint64_t kv_bytes_per_token = 0;
  Graph graph;
  std::vector<std::string> fast_paths_left_out;  // see fast_paths_left_out()
};

// One line per fast path the config's shape does not fit, naming the path, the reason and the general kernel the
// engine runs instead (switches the user turned off are not listed). Empty for the model's own shape.
std::vector<std::string> fast_paths_left_out(const ModelConfig& config);

// The decode step at `context` tokens already cached, with synthetic weights (MLX 4-bit layout) for `config`.
DecodePlan plan_decode(const ModelConfig& config, Precision precision, const Switches& switches, size_t context);

// The minimum for a weight table (canonical tensors only, MoE stacks at k of E experts, one embedding row).
MinimumBytes minimum_bytes(const ModelConfig& config, Precision precision, const WeightTable& weights,
                           size_t context);

}  // namespace lily
