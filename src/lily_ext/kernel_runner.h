// KernelRunner: runs one kernel at a time through the host Metal layer (Device, Encoder, the
// objc_msgSend binding), with the CPU harness's argument convention. `python -m lily.selftest
// --device metal-api` uses it: on a Mac the kernels run on the real GPU, on Linux through the toy
// Objective-C runtime and the fake Metal, which execute on the CPU harness.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "device.h"

namespace lily {

// The host names of every kernel compiled into the extension (tools/msl2cpu.py --embed lists each family's), sorted:
// the kernels a metallib of Lily's sources holds.
std::vector<std::string> embedded_kernel_names();

// One kernel argument, bound at [[buffer(i)]] where i is its position.
struct KernelArgument {
  void* data;     // device buffer: host memory copied into a Metal buffer and back after the run
  size_t size;    // bytes
  bool is_bytes;  // setBytes data (read-only, copied into the command stream) instead of a buffer
};

class KernelRunner {
 public:
  // Opens the default Metal device and compiles `kernel_source`, which instantiates `kernel_names`;
  // throws Error with Metal's description if it does not compile.
  KernelRunner(const std::string& kernel_source, std::vector<std::string> kernel_names);
  // Opens the default Metal device and compiles each family as its own library (Device); a family
  // that fails is listed by library_failures() and its kernels fail to run, naming it.
  explicit KernelRunner(const std::vector<KernelFamily>& families);
  // Opens the default Metal device and loads the precompiled library `metallib`, which should hold
  // `kernel_names`.
  KernelRunner(const MetallibFile& metallib, std::vector<std::string> kernel_names);

  std::string device_name() const;
  const std::vector<LibraryFailure>& library_failures() const { return device_.library_failures(); }

  // Kernels instantiated in the source that the compiled library has, sorted.
  std::vector<std::string> kernel_names();
  // Kernels instantiated in the source that the compiled library lacks: their #if is false on
  // this GPU (e.g. qmm_nax without Metal 4 tensor ops), or the metallib was built without them.
  std::vector<std::string> missing_kernel_names();

  // Runs kernel `name` once over `threadgroups` groups of `threads_per_threadgroup` threads in
  // one command buffer and waits. Buffer arguments are copied into fresh shared Metal buffers
  // and copied back after a successful run. Throws Error naming the kernel (and the argument)
  // on bad arguments, a pipeline Metal refuses, or a failed command buffer.
  void run(const std::string& name, const std::vector<KernelArgument>& arguments,
           mtl::Size threadgroups, mtl::Size threads_per_threadgroup,
           std::vector<FunctionConstant> constants = {});

 private:
  void probe_library();

  std::vector<std::string> names_;  // the kernels the source instantiates, sorted, each once
  Device device_;
  std::mutex mutex_;  // one run or probe at a time: the fake Metal and the probe state are not shared-safe
  bool probed_ = false;
  std::vector<std::string> available_;
  std::vector<std::string> missing_;
};

}  // namespace lily
