// rule: atomic-version
// metal-version: 240
// fix-metal-version: 300
// atomic_float exists from MSL 3.0 on: compiled for 2.4 it must fail.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void accumulate(device atomic_float* sum [[buffer(0)]], device const float* x [[buffer(1)]],
                           uint tid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(sum, x[tid], memory_order_relaxed);
}
