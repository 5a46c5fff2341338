// The simdgroup_matrix lane layout check (see layout_probe.h).
#include "layout_probe.h"

#include <cstring>

#include "encoder.h"

namespace lily {

void assumed_simdgroup_lane_element(uint32_t lane, uint32_t& row, uint32_t& col) {
  // MLX's mapping (metal-on-linux.md §4), which the CPU harness emulates.
  const uint32_t quad = lane / 4;
  row = (quad & 4) + (lane / 2) % 4;
  col = (quad & 2) * 2 + (lane % 2) * 2;
}

bool simdgroup_layout_matches(Device& device) {
  try {
    const Pipeline& pipeline = device.pipeline("simdgroup_layout_probe");
    Buffer out = device.new_buffer(64 * sizeof(float));
    std::memset(out.contents(), 0xFF, out.length());  // NaN: a lane that writes nothing cannot match
    const std::vector<BufferRange> ranges = {{&out, 0, out.length()}};
    Encoder encoder(device);
    encoder.dispatch(pipeline, {Argument::buffer(out)}, {1, 1, 1}, {32, 1, 1}, ranges, ranges);
    encoder.commit();
    encoder.wait();
    const float* elements = static_cast<const float*>(out.contents());
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
