// rule: barrier-mem-flags
// fix: mem_flags::mem_none => mem_flags::mem_threadgroup
// A barrier with mem_none between a threadgroup write and another thread's read: it synchronises execution but does
// not make the write visible, a race on a GPU.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void rotate(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                       uint tid [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]]) {
  threadgroup float shared[64];
  shared[tid] = in[tid];
  threadgroup_barrier(mem_flags::mem_none);
  out[tid] = shared[(tid + 1) % n];
}
