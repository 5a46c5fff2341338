// Test controls of the fake Metal (Linux only), for the private test binding.
#pragma once

#include <cstdint>

namespace fake_metal {

// How the dispatches between two barriers of a concurrent encoder are run. A GPU may run them
// in any order, so the fake never runs them in encoding order: a missing barrier shows.
enum class StageOrder { Reverse, Shuffle };
void set_stage_order(StageOrder order, uint64_t seed);

// Off: command buffers run as before (order, events, handlers) but each dispatch is only counted, its kernel not
// run, so the host's own cost per token can be measured on a full-size graph (`lily bench --host-only`).
void set_kernel_execution(bool execute);

// The GPU family with Metal 4 tensor ops (MTLGPUFamilyApple10, M5-class) that Device::supports_tensor_ops asks
// for; the fake answers supportsFamily: for it as set here (default false: no tensor ops) and yes below it.
constexpr unsigned long kTensorOpsFamily = 1010;
constexpr unsigned long kMetal4Family = 5002;  // MTLGPUFamilyMetal4, also required for tensor ops
void set_tensor_ops(bool supported);

// What the fake GPU has executed since the last reset.
struct Stats {
  uint64_t dispatches = 0;
  uint64_t barriers = 0;
  uint64_t command_buffers = 0;
  uint64_t completion_handlers = 0;
};
Stats stats();
void reset_stats();

}  // namespace fake_metal
