// rule: unqualified-pointer
// fix: float* values; => device float* values;
// A struct member pointer without an address space.
#include <metal_stdlib>
using namespace metal;

struct View {
  float* values;
  uint count;
};

[[kernel]] void first_value(device float* out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  View v = {out, 1};
  out[tid] = v.values[0];
}
