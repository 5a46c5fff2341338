// moe_route_f32, moe_gate_up_swiglu_<dtype>, moe_down_combine_<dtype> (metal/moe.metal): one decode token.
#include <algorithm>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

void moe_decode(Context& ctx, const ModelConfig& c, const std::string& label, const MoeSpans& s) {
  MoeArgs a{};
  a.num_rows = 1;
  a.num_experts = static_cast<u32>(c.num_experts);
  a.top_k = static_cast<u32>(c.top_k);
  a.hidden_size = static_cast<u32>(c.hidden_size);
  a.expert_size = static_cast<u32>(c.expert_size);
  a.shared_expert_size = static_cast<u32>(c.shared_expert_size);
  // Every expert tensor of a layer shares one scale dtype (the checkpoint's); "_sf32" kernels read f32 scales.
  const std::string dt = std::string(dtype_name(ctx.act)) + (s.gate->scale_dtype == DType::F32 ? "_sf32" : "");
  Span logits = sub(s.router_logits, 0, c.num_experts * 4), gate_logit = sub(s.router_logits, c.num_experts * 4, 4);
  Span ids = sub(s.expert_ids, 0, c.top_k * 4), weights = sub(s.expert_weights, 0, c.top_k * 4);
  add_node(ctx, "moe_route_f32", label + " route", {arg_value(a), arg(logits), arg(ids), arg(weights)}, {1, 1, 1},
           {32, 1, 1}, {logits}, {ids, weights});

  // Only k of the E stacked experts are read: the ranges cover the stacks (read-only: no ordering), the traffic
  // counts k experts.
  auto expert_fraction = [&](const WeightRef* w) { return w->bytes() / w->experts * c.top_k; };
  const size_t rows = std::max(c.expert_size, c.shared_expert_size);
  Span hidden = sub(s.hidden, 0, (c.top_k * c.expert_size + c.shared_expert_size) * 4);
  Node& gate_up = add_node(
      ctx, "moe_gate_up_swiglu_" + dt, label + " gate/up",
      {arg_value(a), arg(s.x), arg(ids), arg(s.gate->data), arg(s.gate->scales), arg(s.gate->biases), arg(s.up->data),
       arg(s.up->scales), arg(s.up->biases), arg(s.shared_gate->data), arg(s.shared_gate->scales),
       arg(s.shared_gate->biases), arg(s.shared_up->data), arg(s.shared_up->scales), arg(s.shared_up->biases),
       arg(hidden)},
      {(rows + tuning::kMoeGemvRowsPerThreadgroup - 1) / tuning::kMoeGemvRowsPerThreadgroup, c.top_k + 1, 1},
      {tuning::kMoeGemvThreads, 1, 1},
      {s.x, ids, s.gate->data, s.gate->scales, s.gate->biases, s.up->data, s.up->scales, s.up->biases,
       s.shared_gate->data, s.shared_gate->scales, s.shared_gate->biases, s.shared_up->data, s.shared_up->scales,
       s.shared_up->biases},
      {hidden});
  gate_up.traffic_read = s.x.length + ids.length + expert_fraction(s.gate) + expert_fraction(s.up) +
                         s.shared_gate->bytes() + s.shared_up->bytes();

  Node& down = add_node(
      ctx, "moe_down_combine_" + dt, label + " down/combine",
      {arg_value(a), arg(hidden), arg(ids), arg(weights), arg(s.down->data), arg(s.down->scales), arg(s.down->biases),
       arg(s.shared_down->data), arg(s.shared_down->scales), arg(s.shared_down->biases), arg(gate_logit),
       arg(s.residual_out), arg(s.residual_out)},
      {(c.hidden_size + tuning::kMoeGemvRowsPerThreadgroup - 1) / tuning::kMoeGemvRowsPerThreadgroup, 1, 1},
      {tuning::kMoeGemvThreads, 1, 1},
      {hidden, ids, weights, s.down->data, s.down->scales, s.down->biases, s.shared_down->data,
       s.shared_down->scales, s.shared_down->biases, gate_logit, s.residual_out},
      {s.residual_out});
  down.traffic_read = hidden.length + ids.length + weights.length + expert_fraction(s.down) + s.shared_down->bytes() +
                      gate_logit.length + s.residual_out.length;
}

}  // namespace lily::ops
