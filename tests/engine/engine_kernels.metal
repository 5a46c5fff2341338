// Test-only kernels of the host engine (tests/engine/test_fake_metal.py), registered with the CPU
// harness's test kernels: small enough that dispatch order, barriers and function-constant
// variants show directly in the results.
#include <metal_stdlib>

using namespace metal;

constant bool add_one [[function_constant(0)]];
constant bool use_add_one = is_function_constant_defined(add_one) && add_one;

// y[i] = scale * x[i], plus 1 in the add_one variant, for i < n.
[[kernel]] void engine_scale(device const float* x [[buffer(0)]],
                             device float* y [[buffer(1)]],
                             constant float& scale [[buffer(2)]],
                             constant uint& n [[buffer(3)]],
                             uint i [[thread_position_in_grid]]) {
  if (i < n) {
    y[i] = scale * x[i] + (use_add_one ? 1.0f : 0.0f);
  }
}
