// moe_route_f32 (metal/moe.metal) and moe_sort_*, moe_gemm_*, moe_combine_* (metal/moe_prefill.metal): T rows;
// the router GEMMs in front of them (ops::qmatmul with f32 output: qmm or qmv, _of32 in bf16 mode).
#include <algorithm>

#include "../../../metal/lily.h"
#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

size_t moe_tile_rows(double rows_per_expert, bool wide_tiles) {
  return wide_tiles && rows_per_expert >= static_cast<double>(tuning::kMoeBm32MinRowsPerExpert) ? 32 : 16;
}

size_t moe_max_tiles(size_t pairs, size_t experts, size_t tile_rows) {
  return (pairs + tile_rows - 1) / tile_rows + std::min(experts, pairs);
}

namespace {

// Grouped SwiGLU GEMMs over `args` (sorted pairs, tile map): hidden = SiLU(x gate^T) * (x up^T), then
// out[pair] = weight[pair] * hidden down^T.
void grouped_swiglu(Context& ctx, const std::string& label, const MoeArgs& a, const Span& x, const Span& pairs,
                    const Span& tile_map, const Span& tile_count, const Span& weights, const WeightRef& gate,
                    const WeightRef& up, const WeightRef& down, const Span& hidden, const Span& out,
                    size_t expert_size, double used_fraction) {
  const std::string suffix = std::string(dtype_name(ctx.act)) + (gate.scale_dtype == DType::F32 ? "_sf32" : "") +
                             "_bm" + std::to_string(a.tile_rows);
  auto traffic = [&](const WeightRef& w) { return static_cast<uint64_t>(w.bytes() * used_fraction); };
  Node& gu = add_node(ctx, "moe_gemm_gate_up_" + suffix, label + " gate/up",
                      {arg_value(a), arg(x), arg(pairs), arg(tile_map), arg(tile_count), arg(gate.data),
                       arg(gate.scales), arg(gate.biases), arg(up.data), arg(up.scales), arg(up.biases), arg(hidden)},
                      {expert_size / LILY_GEMM_BN, a.max_tiles, 1}, {tuning::kGemmThreads, 1, 1},
                      {x, pairs, tile_map, tile_count, gate.data, gate.scales, gate.biases, up.data, up.scales,
                       up.biases},
                      {hidden});
  gu.traffic_read = x.length + pairs.length + tile_map.length + tile_count.length + traffic(gate) + traffic(up);
  Node& dn = add_node(ctx, "moe_gemm_down_" + suffix, label + " down",
                      {arg_value(a), arg(hidden), arg(pairs), arg(tile_map), arg(tile_count), arg(weights),
                       arg(down.data), arg(down.scales), arg(down.biases), arg(out)},
                      {a.hidden_size / LILY_GEMM_BN, a.max_tiles, 1}, {tuning::kGemmThreads, 1, 1},
                      {hidden, pairs, tile_map, tile_count, weights, down.data, down.scales, down.biases}, {out});
  dn.traffic_read = hidden.length + pairs.length + tile_map.length + tile_count.length + weights.length + traffic(down);
}

}  // namespace

void moe_prefill(Context& ctx, const ModelConfig& c, const std::string& label, const MoeSpans& s,
                 size_t tokens) {
  const size_t pairs = tokens * c.top_k, act = dtype_size(ctx.act);
  MoeArgs a{};
  a.num_rows = static_cast<u32>(tokens);
  a.num_experts = static_cast<u32>(c.num_experts);
  a.top_k = static_cast<u32>(c.top_k);
  a.hidden_size = static_cast<u32>(c.hidden_size);
  a.expert_size = static_cast<u32>(c.expert_size);
  a.shared_expert_size = static_cast<u32>(c.shared_expert_size);
  a.tile_rows = static_cast<u32>(moe_tile_rows(static_cast<double>(pairs) / c.num_experts, ctx.wide_tiles));
  a.max_tiles = static_cast<u32>(moe_max_tiles(pairs, c.num_experts, a.tile_rows));

  Span logits = sub(s.router, 0, tokens * c.num_experts * 4);
  Span ids = sub(s.expert_ids, 0, pairs * 4), weights = sub(s.expert_weights, 0, pairs * 4);
  add_node(ctx, "moe_route_f32", label + " route", {arg_value(a), arg(logits), arg(ids), arg(weights)},
           {tokens, 1, 1}, {32, 1, 1}, {logits}, {ids, weights});
  const size_t blocks = (pairs + LILY_MOE_SORT_BLOCK - 1) / LILY_MOE_SORT_BLOCK;
  Span counts = sub(s.block_counts, 0, blocks * c.num_experts * 4);
  Span offsets = sub(s.expert_offsets, 0, (c.num_experts + 1) * 4);
  Span tile_map = sub(s.tile_map, 0, a.max_tiles * 4 * 4), tile_count = sub(s.tile_count, 0, 4);
  Span sorted = sub(s.sorted_pairs, 0, pairs * 4);
  if (ctx.gpu_routing) {
    add_node(ctx, "moe_sort_count_u32", label + " count", {arg_value(a), arg(ids), arg(counts)}, {blocks, 1, 1},
             {tuning::kMoeSortThreads, 1, 1}, {ids}, {counts});
    add_node(ctx, "moe_sort_scan_u32", label + " scan",
             {arg_value(a), arg(counts), arg(offsets), arg(tile_map), arg(tile_count)}, {1, 1, 1},
             {(c.num_experts + 31) / 32 * 32, 1, 1}, {counts}, {counts, offsets, tile_map, tile_count});
    add_node(ctx, "moe_sort_scatter_u32", label + " scatter",
             {arg_value(a), arg(ids), arg(counts), arg(offsets), arg(sorted)}, {blocks, 1, 1},
             {tuning::kMoeSortThreads, 1, 1}, {ids, counts, offsets}, {sorted});
  } else {
    // The CPU round trip: the command buffer ends after the routing, the CPU sorts, the next one starts here.
    HostMoeSort sort;
    sort.before_node = ctx.graph.nodes.size();
    sort.expert_ids = ids;
    sort.expert_offsets = offsets;
    sort.tile_map = tile_map;
    sort.tile_count = tile_count;
    sort.sorted_pairs = sorted;
    sort.pairs = pairs;
    sort.experts = c.num_experts;
    sort.tile_rows = a.tile_rows;
    sort.max_tiles = a.max_tiles;
    ctx.graph.host_sorts.push_back(sort);
  }
  // Each routed expert's weights are read once per tile; at most min(E, T*k) experts are used.
  const double used = std::min(1.0, static_cast<double>(pairs) / c.num_experts);
  Span hidden = sub(s.hidden, 0, pairs * c.expert_size * act), expert_out = sub(s.expert_out, 0, pairs * c.hidden_size * act);
  grouped_swiglu(ctx, label + " experts", a, s.x, sorted, tile_map, tile_count, weights, *s.gate, *s.up, *s.down,
                 hidden, expert_out, c.expert_size, used);

  // The shared expert: one "expert" every row uses once (identity pairs, weight 1, a host-written tile map).
  MoeArgs shared = a;
  shared.num_experts = 1;
  shared.top_k = 1;
  shared.expert_size = static_cast<u32>(c.shared_expert_size);
  shared.tile_rows = static_cast<u32>(moe_tile_rows(static_cast<double>(tokens), ctx.wide_tiles));
  shared.max_tiles = static_cast<u32>((tokens + shared.tile_rows - 1) / shared.tile_rows);
  Span shared_hidden = sub(s.shared_hidden, 0, tokens * c.shared_expert_size * act);
  Span shared_out = sub(s.shared_out, 0, tokens * c.hidden_size * act);
  grouped_swiglu(ctx, label + " shared expert", shared, s.x, sub(s.shared_pairs, 0, tokens * 4),
                 sub(s.shared_tile_map, 0, shared.max_tiles * 4 * 4), s.shared_tile_count, sub(s.ones, 0, tokens * 4),
                 *s.shared_gate, *s.shared_up, *s.shared_down, shared_hidden, shared_out, c.shared_expert_size, 1.0);

  Span gate_logit = sub(s.router, tokens * c.num_experts * 4, tokens * 4);
  add_node(ctx, std::string("moe_combine_") + dtype_name(ctx.act), label + " combine",
           {arg_value(a), arg(expert_out), arg(shared_out), arg(gate_logit), arg(s.residual_out), arg(s.residual_out)},
           {(c.hidden_size + tuning::kMoeCombineThreads - 1) / tuning::kMoeCombineThreads, tokens, 1},
           {tuning::kMoeCombineThreads, 1, 1}, {expert_out, shared_out, gate_logit, s.residual_out}, {s.residual_out});
}

}  // namespace lily::ops
