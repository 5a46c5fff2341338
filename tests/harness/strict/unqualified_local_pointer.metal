// rule: unqualified-pointer
// fix: float* p = => thread float* p =
// A local pointer variable without an address space.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void local_pointer(device float* out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  float local[2] = {1.0f, 2.0f};
  float* p = local;
  out[tid] = p[1];
}
