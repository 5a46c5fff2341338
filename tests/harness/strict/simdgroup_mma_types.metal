// rule: simdgroup-element-types
// fix: simdgroup_half8x8 acc = make_filled_simdgroup_matrix<half, 8, 8>(0.0h); => simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
// Float operands accumulated into a half matrix: only the operands' own type or float accumulates them.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

[[kernel]] void narrowing(device const float* a [[buffer(0)]], device float* out [[buffer(1)]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, a, 8);
  simdgroup_half8x8 acc = make_filled_simdgroup_matrix<half, 8, 8>(0.0h);
  simdgroup_multiply_accumulate(acc, m, m, acc);
  simdgroup_float8x8 result;
  simdgroup_multiply(result, m, m);
  simdgroup_store(result, out, 8);
}
