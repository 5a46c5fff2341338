// The Metal device as the engine sees it: one device, one command queue, the kernel libraries
// (one per op family, compiled from source with fast math off at an explicit language version, or
// one metallib built that way), a pipeline cache keyed by (kernel name, function constants),
// buffers and shared events.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernel_family.h"
#include "metal/mtl.h"

namespace lily {

using mtl::Error;

// One function-constant value of a pipeline variant. `value` holds bools as 0/1.
struct FunctionConstant {
  int index;
  mtl::DataType type;
  int64_t value;
};

// A compute pipeline: one kernel with one set of function-constant values.
class Pipeline {
 public:
  Pipeline(std::string name, std::vector<FunctionConstant> constants, mtl::Object state);
  const std::string& name() const { return name_; }
  const std::vector<FunctionConstant>& constants() const { return constants_; }
  void* handle() const { return state_.get(); }
  size_t max_threads_per_threadgroup() const { return max_threads_; }
  size_t thread_execution_width() const { return execution_width_; }

 private:
  std::string name_;
  std::vector<FunctionConstant> constants_;
  mtl::Object state_;
  size_t max_threads_;
  size_t execution_width_;
};

// A buffer in shared storage: Metal-allocated, or wrapping caller memory without a copy.
class Buffer {
 public:
  Buffer() = default;
  void* contents() const { return contents_; }
  size_t length() const { return length_; }
  void* handle() const { return buffer_.get(); }

 private:
  friend class Device;
  explicit Buffer(mtl::Object buffer);
  mtl::Object buffer_;
  void* contents_ = nullptr;
  size_t length_ = 0;
};

// A shared event: GPU/CPU signalling with a monotonically increasing value.
class Event {
 public:
  uint64_t value() const;
  void signal(uint64_t value);
  // True once the event reaches `value`; false after `timeout_ms`.
  bool wait(uint64_t value, uint64_t timeout_ms) const;
  void* handle() const { return event_.get(); }

 private:
  friend class Device;
  explicit Event(mtl::Object event) : event_(std::move(event)) {}
  mtl::Object event_;
};

// Counters of the pipeline cache.
struct PipelineCacheStats {
  size_t entries = 0;
  size_t hits = 0;
  size_t misses = 0;
};

// A kernel library compiled ahead of time: the path of a .metallib file.
struct MetallibFile {
  std::string path;
};

// A kernel family whose library did not compile: its kernels are unavailable, the others still run.
struct LibraryFailure {
  std::string family;                // "attention"
  std::string file;                  // "metal/attention.metal"
  std::string diagnostic;            // Metal's message ("metal/attention.metal:12:5: error: ...")
  std::vector<std::string> kernels;  // the host names it instantiates
};

// Whether `error` is Metal's MTLLibraryErrorFunctionNotFound (the fake Metal says the same).
bool is_function_not_found(const Error& error);

class Device {
 public:
  // Opens the system's default Metal device and compiles `kernel_source` (MSL) as one library;
  // throws Error with Metal's diagnostic if it does not compile.
  explicit Device(const std::string& kernel_source);
  // Opens the system's default Metal device and compiles each family as its own library; tensor-op
  // families (metal_version >= 400) only where the device supports them. A family that fails is
  // reported on stderr and listed by library_failures(); its kernels then fail to load, naming it.
  explicit Device(const std::vector<KernelFamily>& families);
  // Opens the system's default Metal device and loads the precompiled library `metallib`.
  explicit Device(const MetallibFile& metallib);

  std::string name() const;
  const std::vector<LibraryFailure>& library_failures() const { return failures_; }
  // Metal 4 tensor ops (the qmm_nax GEMMs): GPU family Apple10 (M5-class). Unverified: no such Mac has run it.
  bool supports_tensor_ops() const;
  void* handle() const { return device_.get(); }
  void* queue() const { return queue_.get(); }

  // The pipeline of kernel `name` with these constants (any order; indices must be distinct),
  // created on first use and cached. Throws Error naming the kernel if Metal refuses it.
  const Pipeline& pipeline(const std::string& name, std::vector<FunctionConstant> constants = {});
  PipelineCacheStats pipeline_cache_stats() const;

  Buffer new_buffer(size_t length);
  // Wraps `length` bytes at `pointer` (page-aligned, e.g. an mmap'd file) without copying;
  // the memory must outlive the buffer.
  Buffer wrap_memory(void* pointer, size_t length);
  Event new_event();

 private:
  // (name, [(index, type, value)] sorted by index).
  using PipelineKey =
      std::pair<std::string, std::vector<std::tuple<int, mtl::DataType, int64_t>>>;
  mtl::Object find_function(const std::string& name, void* constant_values);

  mtl::Object device_;
  mtl::Object queue_;
  std::vector<mtl::Object> libraries_;  // searched in order for a kernel
  std::vector<LibraryFailure> failures_;
  mutable std::mutex cache_mutex_;
  std::map<PipelineKey, std::unique_ptr<Pipeline>> pipelines_;
  PipelineCacheStats cache_stats_;
};

}  // namespace lily
