// rule: simdgroup-element-types
// fix: device const float* a => device const half* a
// A half matrix loaded from float memory: Metal declares simdgroup_load over one element type. (Half operands
// accumulated into a float matrix are allowed: llama.cpp's Metal GEMMs do it.)
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

[[kernel]] void mixed(device const float* a [[buffer(0)]], device float* out [[buffer(1)]]) {
  simdgroup_half8x8 m;
  simdgroup_load(m, a, 8);
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_multiply_accumulate(acc, m, m, acc);
  simdgroup_store(acc, out, 8);
}
