// L2 prefetch plan (the L2_PREFETCH switch): which bytes each dispatch asks the GPU to bring into its cache for the
// dispatch after it (Node::prefetch). Runtimes that cannot prefetch ignore it; the results never depend on it.
#pragma once

#include <cstddef>
#include <vector>

namespace lily {

struct Graph;
struct Span;

// What a dispatch prefetches for one that reads `spans`: the spans of one buffer merged where they touch or overlap,
// the tuning::kL2PrefetchRanges largest (equal lengths in merged order), at most tuning::kL2PrefetchMaxBytes in all
// (the last one taken cut short), in buffer and offset order.
std::vector<Span> l2_prefetch_ranges(std::vector<Span> spans);

// Nodes [first, end) of `graph`: each node prefetches l2_prefetch_ranges of the next node's early reads
// (Node::early_reads: the weights and state a kernel may read before waiting for the dispatch before it, so final
// while that dispatch runs). The last node prefetches nothing.
void plan_l2_prefetch(Graph& graph, size_t first);

}  // namespace lily
