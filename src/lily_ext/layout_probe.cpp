// The simdgroup_matrix lane layout check (see layout_probe.h).
#include "layout_probe.h"

#include <cstring>
#include <memory>
#include <vector>

#include "model.h"

namespace lily {

void assumed_simdgroup_lane_element(uint32_t lane, uint32_t& row, uint32_t& col) {
  // MLX's mapping (metal-on-linux.md §4), which the CPU harness emulates.
  const uint32_t quad = lane / 4;
  row = (quad & 4) + (lane / 2) % 4;
  col = (quad & 2) * 2 + (lane % 2) * 2;
}

bool simdgroup_layout_matches(Runtime& runtime) {
  try {
    auto graph = std::make_shared<Graph>();
    const int out_id = graph->add_buffer("probe out", 64 * sizeof(float), BufferRole::Io);
    const Span out{out_id, 0, 64 * sizeof(float)};
    Node node;
    node.kernel = "simdgroup_layout_probe";
    node.label = "simdgroup_matrix lane layout probe";
    node.args = {NodeArg{out_id, 0, {}}};
    node.groups = {1, 1, 1};
    node.threads = {32, 1, 1};
    node.reads = node.writes = {out};
    graph->nodes.push_back(node);
    runtime.require_kernel(node.kernel);
    std::unique_ptr<DeviceBuffer> buffer = runtime.allocate(out.length, Memory::Device);
    std::vector<float> elements(64);
    std::memset(elements.data(), 0xFF, out.length);  // NaN: a lane that writes nothing cannot match
    runtime.upload(*buffer, 0, elements.data(), out.length);
    runtime.submit(runtime.record(graph, 0, 1, {buffer.get()}, {}), 0)->wait();
    runtime.download(*buffer, 0, elements.data(), out.length);
    for (uint32_t lane = 0; lane < 32; ++lane) {
      uint32_t row, col;
      assumed_simdgroup_lane_element(lane, row, col);
      for (uint32_t e = 0; e < 2; ++e) {
        if (elements[2 * lane + e] != float(8 * row + col + e)) return false;
      }
    }
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace lily
