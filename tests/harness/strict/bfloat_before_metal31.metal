// rule: bfloat-version
// metal-version: 300
// fix-metal-version: 310
// bfloat exists from MSL 3.1 on (macOS 14): compiled for 3.0 (macOS 13) it must fail.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void widen(device const bfloat* x [[buffer(0)]], device float* y [[buffer(1)]],
                      uint tid [[thread_position_in_grid]]) {
  y[tid] = float(x[tid]);
}
