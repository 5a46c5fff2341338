// rule: threadgroup-scope
// fix: threadgroup float scratch[32]; =>
// fix: scratch[lane] => tile[lane]
// fix: out[tid] = stage(out[tid], tid % 32, nullptr); => threadgroup float scratch[32]; out[tid] = stage(out[tid], tid % 32, scratch);
// A threadgroup array declared in a helper function: Metal allows them only in a kernel's body.
#include <metal_stdlib>
using namespace metal;

inline float stage(float v, uint lane, threadgroup float* tile) {
  threadgroup float scratch[32];
  scratch[lane] = v;
  return scratch[lane];
}

[[kernel]] void staged(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = stage(out[tid], tid % 32, nullptr);
}
