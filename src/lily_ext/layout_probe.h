// The simdgroup_matrix lane layout check (simdgroup_layout_probe, metal/attention_prefill.metal): the
// attention_prefill_mma kernels read thread_elements() by position in the layout attn_mma_row/col give (MLX's on
// Apple GPUs, which Apple does not specify; NVIDIA's mma layout in the CUDA shim).
#pragma once

#include "runtime.h"

namespace lily {

// Runs simdgroup_layout_probe once through `runtime`: true when every lane holds the elements the kernels assume.
// False also when the probe cannot run (its family did not compile): the engine then keeps to the vector attention
// kernels.
bool simdgroup_layout_matches(Runtime& runtime);

}  // namespace lily
