// L2 prefetch plan (see prefetch.h).
#include "prefetch.h"

#include <algorithm>

#include "model.h"
#include "tuning.h"

namespace lily {

namespace {

bool by_place(const Span& a, const Span& b) {
  return a.buffer != b.buffer ? a.buffer < b.buffer : a.offset < b.offset;
}

}  // namespace

std::vector<Span> l2_prefetch_ranges(std::vector<Span> spans) {
  spans.erase(std::remove_if(spans.begin(), spans.end(), [](const Span& s) { return s.length == 0; }), spans.end());
  std::sort(spans.begin(), spans.end(), by_place);
  std::vector<Span> merged;
  for (const Span& s : spans) {
    Span* last = merged.empty() ? nullptr : &merged.back();
    if (last && last->buffer == s.buffer && s.offset <= last->offset + last->length) {
      last->length = std::max(last->length, s.offset + s.length - last->offset);
    } else {
      merged.push_back(s);
    }
  }
  // The largest first (stable: equal lengths keep their place), up to the range and byte limits.
  std::stable_sort(merged.begin(), merged.end(), [](const Span& a, const Span& b) { return a.length > b.length; });
  std::vector<Span> chosen;
  size_t bytes = 0;
  for (const Span& s : merged) {
    if (chosen.size() == tuning::kL2PrefetchRanges || bytes == tuning::kL2PrefetchMaxBytes) break;
    chosen.push_back({s.buffer, s.offset, std::min(s.length, tuning::kL2PrefetchMaxBytes - bytes)});
    bytes += chosen.back().length;
  }
  std::sort(chosen.begin(), chosen.end(), by_place);
  return chosen;
}

void plan_l2_prefetch(Graph& graph, size_t first) {
  for (size_t i = first; i + 1 < graph.nodes.size(); ++i) {
    graph.nodes[i].prefetch = l2_prefetch_ranges(graph.nodes[i + 1].early_reads);
  }
}

}  // namespace lily
