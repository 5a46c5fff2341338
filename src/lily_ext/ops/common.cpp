// Helpers every op file uses to append dispatches (see ops.h).
#include <stdexcept>

#include "../tuning.h"
#include "ops.h"

namespace lily::ops {

Node& add_node(Context& ctx, std::string kernel, std::string label, std::vector<NodeArg> args, Dim3 groups,
               Dim3 threads, std::vector<Span> reads, std::vector<Span> writes) {
  Node node;
  node.kernel = std::move(kernel);
  node.label = std::move(label);
  node.args = std::move(args);
  node.groups = groups;
  node.threads = threads;
  for (const Span& s : reads) node.traffic_read += s.length;
  for (const Span& s : writes) node.traffic_written += s.length;
  node.reads = std::move(reads);
  node.writes = std::move(writes);
  node.barrier_before = ctx.serial;
  ctx.graph.nodes.push_back(std::move(node));
  return ctx.graph.nodes.back();
}

NodeArg arg(const Span& span) {
  NodeArg a;
  a.buffer = span.buffer;
  a.offset = span.offset;
  return a;
}

Span sub(const Span& span, size_t offset, size_t length) {
  if (offset > span.length || length > span.length - offset) {
    throw std::logic_error("[graph] sub-range [" + std::to_string(offset) + ", +" + std::to_string(length) +
                           ") outside a span of " + std::to_string(span.length) + " bytes");
  }
  return Span{span.buffer, span.offset + offset, length};
}

std::string pack_loads_suffix(const Context& ctx, const std::vector<const WeightRef*>& weights) {
  bool whole_packs = ctx.whole_pack_loads;
  for (const WeightRef* w : weights) whole_packs = whole_packs && tuning::whole_pack_loads(w->data.offset);
  return whole_packs ? "_a16" : "";
}

}  // namespace lily::ops
