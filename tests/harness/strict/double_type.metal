// rule: no-double
// fix: double sum => float sum
// fix: double(x[i]) => x[i]
// Apple's Metal compiler has no double type; the CPU shim (C++) would accept it and compute a different result.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void square_in_double(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  double sum = double(x[i]) * x[i];
  x[i] = float(sum);
}
