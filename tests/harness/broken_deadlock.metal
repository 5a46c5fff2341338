// Deliberately broken (harness self-test): thread 0 polls a flag that thread 1 sets only after a barrier
// that thread 0 never reaches.
#include <metal_stdlib>

using namespace metal;

[[kernel]] void broken_deadlock(device atomic_uint* flag [[buffer(0)]],
                                uint tid [[thread_index_in_threadgroup]]) {
  if (tid == 0) {
    while (atomic_load_explicit(flag, memory_order_relaxed) == 0u) {
    }
  }
  threadgroup_barrier(mem_flags::mem_device);
  if (tid == 1) {
    atomic_store_explicit(flag, 1u, memory_order_relaxed);
  }
}
