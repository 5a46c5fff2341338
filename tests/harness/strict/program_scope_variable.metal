// rule: program-scope-constant
// fix: float kScale => constant float kScale
// A program-scope variable outside the constant address space.
#include <metal_stdlib>
using namespace metal;

float kScale = 0.5f;

[[kernel]] void scale(device float* x [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  x[tid] *= kScale;
}
