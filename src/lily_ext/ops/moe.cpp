// moe_route_f32, moe_gate_up_swiglu[_routed][_staged]_<dtype>, moe_down_combine[_staged]_<dtype> (metal/moe.metal):
// one decode token (staged: tuning::staged_moe);
// and the MoE block's choice by row count (more rows: moe_prefill.cpp).
#include <algorithm>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

namespace {

MoeArgs decode_args(const ModelConfig& c) {
  MoeArgs a{};
  a.num_rows = 1;
  a.num_experts = static_cast<u32>(c.num_experts);
  a.top_k = static_cast<u32>(c.top_k);
  a.hidden_size = static_cast<u32>(c.hidden_size);
  a.expert_size = static_cast<u32>(c.expert_size);
  a.shared_expert_size = static_cast<u32>(c.shared_expert_size);
  return a;
}

// Every expert tensor of a layer shares one scale dtype (the checkpoint's); "_sf32" kernels read f32 scales.
std::string decode_suffix(const Context& ctx, const MoeSpans& s) {
  return std::string(dtype_name(ctx.act)) + (s.gate->scale_dtype == DType::F32 ? "_sf32" : "");
}

// Only k of the E stacked experts are read: the ranges cover the stacks (read-only: no ordering), the traffic counts
// k experts.
size_t expert_fraction(const ModelConfig& c, const WeightRef* w) { return w->bytes() / w->experts * c.top_k; }

Dim3 gate_up_groups(const ModelConfig& c, size_t rows_per_group) {
  const size_t rows = std::max(c.expert_size, c.shared_expert_size);
  return {(rows + rows_per_group - 1) / rows_per_group, c.top_k + 1, 1};
}

std::vector<NodeArg> gate_up_weight_args(const MoeSpans& s) {
  return {arg(s.gate->data),        arg(s.gate->scales),        arg(s.gate->biases),
          arg(s.up->data),          arg(s.up->scales),          arg(s.up->biases),
          arg(s.shared_gate->data), arg(s.shared_gate->scales), arg(s.shared_gate->biases),
          arg(s.shared_up->data),   arg(s.shared_up->scales),   arg(s.shared_up->biases)};
}

std::vector<Span> gate_up_weight_spans(const MoeSpans& s) {
  return {s.gate->data,        s.gate->scales,        s.gate->biases,        s.up->data,
          s.up->scales,        s.up->biases,          s.shared_gate->data,   s.shared_gate->scales,
          s.shared_gate->biases, s.shared_up->data,   s.shared_up->scales,   s.shared_up->biases};
}

size_t gate_up_weight_traffic(const ModelConfig& c, const MoeSpans& s) {
  return expert_fraction(c, s.gate) + expert_fraction(c, s.up) + s.shared_gate->bytes() + s.shared_up->bytes();
}

bool staged(const Context& ctx, const ModelConfig& c, const MoeSpans& s) {
  return tuning::staged_moe(ctx.staged_gemv, s.gate->scale_dtype == DType::BF16, c.hidden_size, c.top_k,
                            c.expert_size, c.shared_expert_size);
}

void down_combine(Context& ctx, const ModelConfig& c, const std::string& label, const MoeSpans& s, const MoeArgs& a,
                  const Span& hidden, const Span& ids, const Span& weights, const Span& gate_logit, bool staged) {
  const Dim3 groups = {(c.hidden_size + tuning::kMoeDownRowsPerThreadgroup - 1) / tuning::kMoeDownRowsPerThreadgroup,
                       1, 1};
  const std::vector<Span> down_weights = {s.down->data,        s.down->scales,        s.down->biases,
                                          s.shared_down->data, s.shared_down->scales, s.shared_down->biases};
  if (staged) {
    // EARLY_MOE_DOWN: routes again from the router's output (E logits, then the gate logit) before its wait, and loads
    // its first weights and its rows' residual there too (metal/moe.metal): all of it final once the gate/up kernel,
    // the one dispatch it waits for, lets it start. Off (_late_): waits first and reads the gate/up kernel's ids and
    // weights.
    const Span router = sub(s.router, 0, (c.num_experts + 1) * 4);
    std::vector<Span> early = {router};
    early.insert(early.end(), down_weights.begin(), down_weights.end());
    early.push_back(s.residual_out);
    std::vector<Span> reads = early;
    reads.insert(reads.end(), {hidden, ids, weights});
    Node& down = add_node(ctx, std::string("moe_down_combine_staged_") + (ctx.early_moe_down ? "" : "late_") +
                                   decode_suffix(ctx, s) + pack_loads_suffix(ctx, {s.down, s.shared_down}),
                          label + " down/combine",
                          {arg_value(a), arg(hidden), arg(router), arg(ids), arg(weights), arg(s.down->data),
                           arg(s.down->scales), arg(s.down->biases), arg(s.shared_down->data),
                           arg(s.shared_down->scales), arg(s.shared_down->biases), arg(s.residual_out),
                           arg(s.residual_out)},
                          groups, {tuning::kMoeDownThreads, 1, 1}, std::move(reads), {s.residual_out});
    if (ctx.early_moe_down) down.early_reads = std::move(early);
    // The logits are read by simdgroup 0 of each threadgroup (early) from cache, or the ids and weights (late):
    // counted once.
    down.traffic_read = hidden.length + (ctx.early_moe_down ? router.length : ids.length + weights.length + 4) +
                        expert_fraction(c, s.down) + s.shared_down->bytes() + s.residual_out.length;
    return;
  }
  std::vector<Span> reads = {hidden, ids, weights};
  reads.insert(reads.end(), down_weights.begin(), down_weights.end());
  reads.push_back(gate_logit);
  reads.push_back(s.residual_out);
  Node& down = add_node(
      ctx, "moe_down_combine_" + decode_suffix(ctx, s), label + " down/combine",
      {arg_value(a), arg(hidden), arg(ids), arg(weights), arg(s.down->data), arg(s.down->scales), arg(s.down->biases),
       arg(s.shared_down->data), arg(s.shared_down->scales), arg(s.shared_down->biases), arg(gate_logit),
       arg(s.residual_out), arg(s.residual_out)},
      groups, {tuning::kMoeDownThreads, 1, 1}, std::move(reads), {s.residual_out});
  down.traffic_read = hidden.length + ids.length + weights.length + expert_fraction(c, s.down) +
                      s.shared_down->bytes() + gate_logit.length + s.residual_out.length;
}

}  // namespace

void moe(Context& ctx, const ModelConfig& c, const std::string& label, const MoeSpans& s, size_t tokens,
         const WeightRef* norm_weight, float eps) {
  if (tokens > 1) {
    moe_prefill(ctx, c, label, s, tokens);
  } else if (norm_weight) {
    moe_decode_routed(ctx, c, label, s, *norm_weight, eps);
  } else {
    moe_decode(ctx, c, label, s);
  }
}

void moe_decode(Context& ctx, const ModelConfig& c, const std::string& label, const MoeSpans& s) {
  const MoeArgs a = decode_args(c);
  Span logits = sub(s.router, 0, c.num_experts * 4), gate_logit = sub(s.router, c.num_experts * 4, 4);
  Span ids = sub(s.expert_ids, 0, c.top_k * 4), weights = sub(s.expert_weights, 0, c.top_k * 4);
  add_node(ctx, "moe_route_f32", label + " route", {arg_value(a), arg(logits), arg(ids), arg(weights)}, {1, 1, 1},
           {32, 1, 1}, {logits}, {ids, weights});

  Span hidden = sub(s.hidden, 0, (c.top_k * c.expert_size + c.shared_expert_size) * 4);
  std::vector<NodeArg> args = {arg_value(a), arg(s.x), arg(ids)};
  for (NodeArg& w : gate_up_weight_args(s)) args.push_back(std::move(w));
  args.push_back(arg(hidden));
  std::vector<Span> reads = {s.x, ids};
  for (const Span& w : gate_up_weight_spans(s)) reads.push_back(w);
  Node& gate_up = add_node(ctx, "moe_gate_up_swiglu_" + decode_suffix(ctx, s), label + " gate/up", std::move(args),
                           gate_up_groups(c, tuning::kMoeGemvRowsPerThreadgroup), {tuning::kMoeGemvThreads, 1, 1},
                           std::move(reads), {hidden});
  gate_up.traffic_read = s.x.length + ids.length + gate_up_weight_traffic(c, s);

  down_combine(ctx, c, label, s, a, hidden, ids, weights, gate_logit, false);
}

void moe_decode_routed(Context& ctx, const ModelConfig& c, const std::string& label, const MoeSpans& s,
                       const WeightRef& norm_weight, float eps) {
  MoeRoutedArgs a{};
  a.moe = decode_args(c);
  a.eps = eps;
  // gate/up routes on the E router logits; moe_down_combine reads the shared-expert gate logit after them.
  Span logits = sub(s.router, 0, c.num_experts * 4), gate_logit = sub(s.router, c.num_experts * 4, 4);
  Span ids = sub(s.expert_ids, 0, c.top_k * 4), weights = sub(s.expert_weights, 0, c.top_k * 4);
  Span hidden = sub(s.hidden, 0, (c.top_k * c.expert_size + c.shared_expert_size) * 4);
  std::vector<NodeArg> args = {arg_value(a), arg(s.x), arg(norm_weight.data), arg(logits), arg(ids), arg(weights)};
  for (NodeArg& w : gate_up_weight_args(s)) args.push_back(std::move(w));
  args.push_back(arg(hidden));
  std::vector<Span> reads = {s.x, norm_weight.data, logits};
  for (const Span& w : gate_up_weight_spans(s)) reads.push_back(w);
  const bool stage = staged(ctx, c, s);
  Node& gate_up = add_node(
      ctx,
      stage ? "moe_gate_up_swiglu_routed_staged_" + decode_suffix(ctx, s) +
                  pack_loads_suffix(ctx, {s.gate, s.up, s.shared_gate, s.shared_up})
            : "moe_gate_up_swiglu_routed_" + decode_suffix(ctx, s),
      label + " route+gate/up", std::move(args),
      gate_up_groups(c, stage ? tuning::kQmvStagedRowsPerThreadgroup : tuning::kMoeGemvRowsPerThreadgroup),
      {stage ? tuning::kQmvStagedThreads : tuning::kMoeGemvThreads, 1, 1}, std::move(reads), {ids, weights, hidden});
  // The staged kernel loads the shared expert's first weights before its wait (metal/moe.metal).
  if (stage) gate_up.early_reads = {s.shared_gate->data, s.shared_gate->scales, s.shared_gate->biases,
                                    s.shared_up->data,   s.shared_up->scales,   s.shared_up->biases};
  // The logits are read once per routed simdgroup, but from cache: count them once, like x.
  gate_up.traffic_read = s.x.length + norm_weight.data.length + logits.length + gate_up_weight_traffic(c, s);

  down_combine(ctx, c, label, s, a.moe, hidden, ids, weights, gate_logit, stage);
}

}  // namespace lily::ops
