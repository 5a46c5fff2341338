// rule: unqualified-pointer
// fix: (const float* p) => (thread const float* p)
// A pointer parameter without an address space: Metal requires one on every pointer.
#include <metal_stdlib>
using namespace metal;

inline float first(const float* p) { return p[0]; }

[[kernel]] void copy_first(device float* out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  float local[2] = {1.0f, 2.0f};
  out[tid] = first(local);
}
