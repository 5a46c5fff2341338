// rule: position-attribute-width
// fix: uint n_threads [[threads_per_threadgroup]] => uint2 n_threads [[threads_per_threadgroup]]
// fix: n_threads + => n_threads.x +
// A scalar threads_per_threadgroup next to a vector threadgroup_position_in_grid (MSL §5.2.3).
#include <metal_stdlib>
using namespace metal;

[[kernel]] void widths(device uint* out [[buffer(0)]],
                       uint2 group [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint n_threads [[threads_per_threadgroup]]) {
  out[group.x * n_threads + tid] = group.y;
}
