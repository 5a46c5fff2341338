// Host API of the MSL CPU execution harness: run a registered kernel by host name on the CPU.
// Used by the Python binding (lily._ext.msl) and by the fake Metal of the host engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace msl_rt {

// One [[buffer(i)]] argument: a device buffer (read and written in place) or setBytes data.
struct Binding {
  void* data;
  size_t size;     // bytes
  bool is_bytes;   // setBytes copy (constant data) rather than a device buffer
};

struct DispatchOptions {
  bool random_schedule = true;            // run ready GPU threads in a seeded random order
  // keep running one simdgroup's ready threads (a random one when it has none) so that simdgroups run far ahead of
  // each other between barriers: a read of threadgroup memory another simdgroup overwrites too early shows up
  bool greedy_simdgroups = false;
  uint64_t seed = 0;
  bool poison_threadgroup_memory = true;  // fill threadgroup memory with NaN bytes (0xFF) at threadgroup start
  bool guard = true;                      // guard regions around device buffers, checked after the dispatch
  unsigned workers = 0;                   // OS threads running threadgroups; 0 = one per hardware thread
  std::vector<size_t> threadgroup_memory_lengths;  // bytes for [[threadgroup(i)]] parameters
};

// A kernel misbehaved while running: barrier divergence, divergent SIMD collective, deadlock,
// out-of-bounds write, stack or threadgroup-memory misuse. The message names the kernel,
// the threadgroup and the thread.
class KernelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Runs kernel `name` over tgs[0]*tgs[1]*tgs[2] threadgroups of tpt[0]*tpt[1]*tpt[2] threads.
// buffers[i] binds [[buffer(i)]]; constants maps function-constant index -> value (bools as 0/1).
// Throws std::invalid_argument for bad arguments and KernelError for kernel faults.
void dispatch(const std::string& name, const std::vector<Binding>& buffers, const uint32_t tgs[3],
              const uint32_t tpt[3], const std::map<int, int64_t>& constants, const DispatchOptions& opts);

// Every instantiated host name of the real kernels (metal/*.metal), sorted.
std::vector<std::string> kernel_names();

// How many times each kernel has run to completion in this process, by host name (failed runs not counted).
std::map<std::string, uint64_t> executions();

// Host names of the harness self-test kernels (tests/harness/*.metal), sorted; dispatch() runs them too.
std::vector<std::string> test_kernel_names();

}  // namespace msl_rt
