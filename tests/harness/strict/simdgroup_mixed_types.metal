// rule: simdgroup-element-types
// fix: simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f); => simdgroup_half8x8 acc = make_filled_simdgroup_matrix<half, 8, 8>(0.0h);
// A float accumulator multiplied with half matrices: Metal declares the operation over one element type.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

[[kernel]] void mixed(device const half* a [[buffer(0)]], device half* out [[buffer(1)]]) {
  simdgroup_half8x8 m;
  simdgroup_load(m, a, 8);
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_multiply_accumulate(acc, m, m, acc);
  simdgroup_store(acc, out, 8);
}
