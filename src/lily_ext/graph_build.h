// Helpers the decode and prefill graph builders share (decode_graph.cpp, prefill_graph.cpp): buffer spans, weight
// lookup by canonical name, and the weight groups both graphs bind alike.
#pragma once

#include <string>

#include "model.h"

namespace lily::graph {

inline std::string layer_prefix(size_t i) { return "layers." + std::to_string(i) + "."; }

inline Span whole(const Graph& g, int buffer) { return Span{buffer, 0, g.buffers[buffer].length}; }

inline const WeightRef& weight(const WeightTable& w, const std::string& name) {
  auto found = w.find(name);
  if (found == w.end()) throw Error("[engine] the checkpoint has no tensor " + name);
  return found->second;
}

// The routed (switch_mlp) and shared expert weights of the MoE block `m` ("layers.N.mlp."); decode (MoeSpans) and
// prefill (MoePrefillSpans) name them alike.
template <typename MoeSpansT>
inline void bind_expert_weights(const WeightTable& w, const std::string& m, MoeSpansT& mo) {
  mo.gate = &weight(w, m + "switch_mlp.gate_proj.weight");
  mo.up = &weight(w, m + "switch_mlp.up_proj.weight");
  mo.down = &weight(w, m + "switch_mlp.down_proj.weight");
  mo.shared_gate = &weight(w, m + "shared_expert.gate_proj.weight");
  mo.shared_up = &weight(w, m + "shared_expert.up_proj.weight");
  mo.shared_down = &weight(w, m + "shared_expert.down_proj.weight");
}

// The Gated DeltaNet weights of the mixer `s` ("layers.N.linear_attn."); decode (GatedDeltaSpans) and prefill
// (GatedDeltaPrefillSpans) name them alike.
template <typename GatedDeltaSpansT>
inline void bind_deltanet_weights(const WeightTable& w, const std::string& s, GatedDeltaSpansT& gd) {
  gd.conv_weight = &weight(w, s + "conv1d.weight");
  gd.a_log = &weight(w, s + "A_log");
  gd.dt_bias = &weight(w, s + "dt_bias");
  gd.norm_weight = &weight(w, s + "norm.weight");
}

}  // namespace lily::graph
