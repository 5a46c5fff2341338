// The barrier rule (see barriers.h).
#include "barriers.h"

#include <algorithm>

#include "model.h"

namespace lily {

std::vector<ByteRange> byte_ranges(const std::vector<Span>& spans) {
  std::vector<ByteRange> out;
  out.reserve(spans.size());
  for (const Span& s : spans) {
    if (s.length) out.push_back({static_cast<uintptr_t>(s.buffer) + 1, s.offset, s.offset + s.length});
  }
  return out;
}

namespace {

bool overlap(const std::vector<ByteRange>& a, const std::vector<ByteRange>& b) {
  for (const ByteRange& x : a) {
    for (const ByteRange& y : b) {
      if (x.space == y.space && x.begin < y.end && y.begin < x.end) return true;
    }
  }
  return false;
}

}  // namespace

bool must_wait(const std::vector<ByteRange>& earlier_reads, const std::vector<ByteRange>& earlier_writes,
               const std::vector<ByteRange>& reads, const std::vector<ByteRange>& writes) {
  return overlap(reads, earlier_writes) || overlap(writes, earlier_reads) || overlap(writes, earlier_writes);
}

void Stage::add(const std::vector<ByteRange>& reads, const std::vector<ByteRange>& writes) {
  empty_ = false;
  reads_.insert(reads_.end(), reads.begin(), reads.end());
  writes_.insert(writes_.end(), writes.begin(), writes.end());
}

void Stage::clear() {
  empty_ = true;
  reads_.clear();
  writes_.clear();
}

std::vector<bool> stage_starts(const Graph& graph) {
  std::vector<bool> starts;
  starts.reserve(graph.nodes.size());
  Stage stage;
  for (const Node& node : graph.nodes) {
    const std::vector<ByteRange> reads = byte_ranges(node.reads), writes = byte_ranges(node.writes);
    const bool start = stage.empty() || node.barrier_before || stage.conflicts(reads, writes);
    if (start) stage.clear();
    starts.push_back(start);
    stage.add(reads, writes);
  }
  return starts;
}

std::vector<std::vector<size_t>> dependencies(const Graph& graph, size_t begin, size_t end) {
  const size_t n = end - begin;
  std::vector<std::vector<ByteRange>> reads(n), writes(n);
  for (size_t i = 0; i < n; ++i) {
    reads[i] = byte_ranges(graph.nodes[begin + i].reads);
    writes[i] = byte_ranges(graph.nodes[begin + i].writes);
  }
  // ancestors[i][j]: node j runs before node i by the edges chosen so far. Walking back from the nearest earlier
  // node, an earlier node that is already an ancestor needs no edge of its own.
  std::vector<std::vector<bool>> ancestors(n, std::vector<bool>(n, false));
  std::vector<std::vector<size_t>> edges(n);
  for (size_t i = 0; i < n; ++i) {
    const bool barrier = graph.nodes[begin + i].barrier_before;
    for (size_t j = i; j-- > 0;) {
      if (ancestors[i][j] || !(barrier || must_wait(reads[j], writes[j], reads[i], writes[i]))) continue;
      edges[i].push_back(begin + j);
      ancestors[i][j] = true;
      for (size_t k = 0; k < j; ++k) {
        if (ancestors[j][k]) ancestors[i][k] = true;
      }
    }
    std::reverse(edges[i].begin(), edges[i].end());
  }
  return edges;
}

std::vector<bool> early_starts(const Graph& graph, size_t begin, size_t end,
                               const std::vector<std::vector<size_t>>& edges) {
  std::vector<bool> early(end - begin, false);
  for (size_t i = begin; i < end; ++i) {
    const std::vector<size_t>& into = edges[i - begin];
    early[i - begin] = into.size() == 1 && !overlap(byte_ranges(graph.nodes[into[0]].writes),
                                                    byte_ranges(graph.nodes[i].early_reads));
  }
  return early;
}

}  // namespace lily
