// rule: atomic-version
// metal-version: 300
// fix: atomic_ulong => atomic_uint
// fix: ulong(tid) => tid
// 64-bit atomics (atomic_ulong) need MSL 3.1 (and then only min/max on Apple8+ GPUs).
#include <metal_stdlib>
using namespace metal;

[[kernel]] void widest(device atomic_ulong* best [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  atomic_fetch_max_explicit(best, ulong(tid), memory_order_relaxed);
}
