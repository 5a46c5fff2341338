// rule: memory-order
// fix: memory_order_seq_cst => memory_order_relaxed
// Metal's atomic functions take memory_order_relaxed only.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void count(device atomic_uint* counter [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(counter, 1u, memory_order_seq_cst);
}
