// The simdgroup_matrix lane layout check (see layout_probe.h).
#include "layout_probe.h"

#include <cstring>
#include <memory>
#include <vector>

#include "model.h"

namespace lily {

bool simdgroup_layout_matches(Runtime& runtime) {
  try {
    auto graph = std::make_shared<Graph>();
    const int out_id = graph->add_buffer("probe out", 128 * sizeof(float), BufferRole::Io);
    const Span out{out_id, 0, 128 * sizeof(float)};
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
    std::vector<float> elements(128);  // [32 lanes][2]: what the lane holds, then [32][2]: what the kernels assume
    std::memset(elements.data(), 0xFF, out.length);  // NaN: a lane that writes nothing cannot match
    runtime.upload(*buffer, 0, elements.data(), out.length);
    runtime.submit(runtime.record(graph, 0, 1, {buffer.get()}, {}), 0)->wait();
    runtime.download(*buffer, 0, elements.data(), out.length);
    for (size_t i = 0; i < 64; ++i) {
      if (!(elements[i] == elements[64 + i])) return false;  // NaN never matches
    }
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace lily
