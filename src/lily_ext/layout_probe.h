// The simdgroup_matrix lane layout check (simdgroup_layout_probe, metal/attention_prefill.metal): the
// attention_prefill_mma kernels assume MLX's layout of thread_elements(), which Apple does not specify.
#pragma once

#include <cstdint>

#include "runtime.h"

namespace lily {

// The element (row, col) of an 8x8 simdgroup matrix that lane `lane` holds first (the second is col + 1).
void assumed_simdgroup_lane_element(uint32_t lane, uint32_t& row, uint32_t& col);

// Runs simdgroup_layout_probe once through `runtime` and compares with the assumed layout. False also when the probe
// cannot run (its family did not compile): the engine then keeps to the vector attention kernels.
bool simdgroup_layout_matches(Runtime& runtime);

}  // namespace lily
