// rule: threadgroup-scope
// fix: threadgroup float g_scratch[32]; => constant float g_scratch[32] = {};
// fix: g_scratch[tid % 32] = out[tid]; =>
// A threadgroup array at program scope.
#include <metal_stdlib>
using namespace metal;

threadgroup float g_scratch[32];

[[kernel]] void scratch_user(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  g_scratch[tid % 32] = out[tid];
  out[tid] = g_scratch[(tid + 1) % 32];
}
