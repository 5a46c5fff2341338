// The barrier rule: which dispatches may run at the same time, decided from the byte ranges each one declares it
// reads and writes. Written once, here, for every runtime: Metal's Encoder places its memory barriers by it, the
// engine and `lily plan` count barrier stages by it, and the CUDA runtime draws its graph's dependency edges by it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace lily {

struct Graph;
struct Span;

// A half-open byte range [begin, end) in one address space. Ranges of different spaces never alias: a graph
// buffer is its own space; CPU addresses of shared storage are space 0, so two buffers wrapping the same memory
// alias as they should.
struct ByteRange {
  uintptr_t space = 0, begin = 0, end = 0;
};

// The ranges of graph spans (space = buffer id + 1); empty spans touch nothing and are left out.
std::vector<ByteRange> byte_ranges(const std::vector<Span>& spans);

// The rule. A later dispatch must wait for an earlier one exactly when it
//   - reads bytes the earlier one writes    (read after write)
//   - writes bytes the earlier one reads    (write after read)
//   - writes bytes the earlier one writes   (write after write).
// Reads never conflict with reads.
bool must_wait(const std::vector<ByteRange>& earlier_reads, const std::vector<ByteRange>& earlier_writes,
               const std::vector<ByteRange>& reads, const std::vector<ByteRange>& writes);

// The dispatches since the last barrier: the GPU may run them in any order, or at once. A new dispatch needs a
// barrier in front of it exactly when it must wait for some dispatch of the stage; after the barrier the stage
// holds only the new dispatch.
class Stage {
 public:
  bool empty() const { return empty_; }
  bool conflicts(const std::vector<ByteRange>& reads, const std::vector<ByteRange>& writes) const {
    return !empty_ && must_wait(reads_, writes_, reads, writes);
  }
  void add(const std::vector<ByteRange>& reads, const std::vector<ByteRange>& writes);
  void clear();

 private:
  bool empty_ = true;
  std::vector<ByteRange> reads_, writes_;
};

// Per node of `graph`: whether it opens a new stage (a barrier in front of it, except the first). A node marked
// `barrier_before` always does.
std::vector<bool> stage_starts(const Graph& graph);

// Per node of [begin, end): the earlier nodes of the range it must wait for, as few as orders the same (an edge
// implied by others is left out), ascending. A node marked `barrier_before` waits for everything before it. These
// are the dependency edges of a CUDA graph.
std::vector<std::vector<size_t>> dependencies(const Graph& graph, size_t begin, size_t end);

// Per node of [begin, end) with those `edges`: whether it may start while the node it depends on still runs (a
// programmatic edge on CUDA: docs/cuda.md). Only a node with exactly one edge into it, from a node that writes none
// of its `early_reads`: every other node it depends on has then finished (the one it waits for started only when its
// own were done), and what it reads before lily::grid_dependency_wait is final.
std::vector<bool> early_starts(const Graph& graph, size_t begin, size_t end,
                               const std::vector<std::vector<size_t>>& edges);

}  // namespace lily
