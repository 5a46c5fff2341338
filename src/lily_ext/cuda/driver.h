// Lily's CUDA driver layer (docs/cuda.md): the driver API opened at run time (dlopen of libcuda.so.1, or
// $LILY_LIBCUDA), so the same build runs with or without an NVIDIA driver and links nothing of CUDA; RAII handles for
// the context, memory, streams, events and explicit graphs; and the Metal kernels compiled to PTX
// (tools/cuda_kernels.py), loaded as one KernelSet and launched with Metal's grid of threadgroups, the
// [[buffer(i)]] pointers packed into the Params block of src/msl_cpu/include/msl_cuda_launch.h and the
// [[threadgroup(i)]] lengths as dynamic shared memory.
//
// Every failure is a DriverError (a lily::Error) naming the call, the kernel where there is one, and CUDA's error
// name and string. Bad arguments (an unknown kernel, a launch shape, too many buffers) are std::invalid_argument.
// Calls act on the calling thread's current context: Context makes the primary context current when made;
// make_current() does it on another thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../metal/mtl.h"
#include "driver_abi.h"

namespace lily {
using mtl::Error;  // as device.h: the engine's one error type
}

namespace lily::cuda {

// A CUDA driver call failed, or there is no driver. what() names the call (and kernel) and CUDA's error.
class DriverError : public Error {
 public:
  DriverError(const std::string& message, CUresult code) : Error(message), code_(code) {}
  CUresult code() const { return code_; }

 private:
  CUresult code_;
};

// The driver's entry points, resolved by their exported symbol names (driver_abi.h).
struct DriverFunctions {
#define LILY_CUDA_MEMBER(member, symbol, fallback, result, params) result(*member) params = nullptr;
  LILY_CUDA_DRIVER_FUNCTIONS(LILY_CUDA_MEMBER)
  LILY_CUDA_OPTIONAL_DRIVER_FUNCTIONS(LILY_CUDA_MEMBER)
#undef LILY_CUDA_MEMBER
};

class Driver {
 public:
  // The process's driver, opened and initialised (cuInit) on first use: $LILY_LIBCUDA if set, else libcuda.so.1.
  // Throws DriverError if it cannot be opened, lacks a function, or cuInit fails (e.g. no GPU); later calls retry.
  static const Driver& get();

  const DriverFunctions& fn() const { return fn_; }
  const std::string& library() const { return library_; }
  int version() const { return version_; }  // cuDriverGetVersion: 1000 * major + 10 * minor
  int device_count() const;

  // Throws DriverError "kernel K: <call> failed: CUDA_ERROR_X (n): <text>" unless `result` is CUDA_SUCCESS.
  void check(CUresult result, const char* call, const std::string& kernel = {}) const;
  // "CUDA_ERROR_X (n): <cuGetErrorString>"
  std::string error_text(CUresult result) const;

 private:
  Driver() = default;
  void open();

  void* handle_ = nullptr;
  std::string library_;
  int version_ = 0;
  DriverFunctions fn_;
};

// The primary context of GPU `ordinal`, retained while this object lives and made current on the constructing thread.
class Context {
 public:
  explicit Context(int ordinal = 0);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  const Driver& driver() const { return driver_; }
  CUcontext handle() const { return context_; }
  int ordinal() const { return ordinal_; }
  const std::string& device_name() const { return name_; }
  std::pair<int, int> compute_capability() const { return compute_capability_; }
  size_t total_memory() const { return total_memory_; }
  int attribute(int device_attribute) const;  // cuDeviceGetAttribute

  void make_current() const;  // on the calling thread
  void synchronize() const;   // cuCtxSynchronize: waits for all work, reports a failed kernel

 private:
  const Driver& driver_;
  int ordinal_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  std::string name_;
  std::pair<int, int> compute_capability_{0, 0};
  size_t total_memory_ = 0;
};

// Device memory (cuMemAlloc), freed when the object goes. Move-only.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(size_t bytes);  // at least one byte is allocated, so the pointer is never 0
  ~DeviceMemory();
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;

  CUdeviceptr ptr() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  CUdeviceptr ptr_ = 0;
  size_t size_ = 0;
};

// Page-locked host memory (cuMemHostAlloc): what the host reads or writes while the GPU runs. Move-only.
class PinnedMemory {
 public:
  PinnedMemory() = default;
  explicit PinnedMemory(size_t bytes);
  ~PinnedMemory();
  PinnedMemory(PinnedMemory&& other) noexcept;
  PinnedMemory& operator=(PinnedMemory&& other) noexcept;

  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Copies and fills; a null stream is the legacy default stream. The synchronous forms wait for the copy.
void upload(CUdeviceptr dst, const void* src, size_t bytes);
void download(void* dst, CUdeviceptr src, size_t bytes);
void upload_async(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream);
void download_async(void* dst, CUdeviceptr src, size_t bytes, CUstream stream);
void copy_async(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
void fill_async(CUdeviceptr dst, uint8_t value, size_t bytes, CUstream stream);

class Stream {
 public:
  explicit Stream(bool non_blocking = true);  // non-blocking: does not synchronise with the default stream
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  CUstream handle() const { return stream_; }
  void synchronize() const;
  void wait(const class Event& event) const;  // later work on this stream waits for `event`

 private:
  CUstream stream_ = nullptr;
};

class Event {
 public:
  explicit Event(bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  CUevent handle() const { return event_; }
  void record(CUstream stream) const;
  bool done() const;  // cuEventQuery: the work before the record has finished
  void synchronize() const;
  float elapsed_ms_since(const Event& start) const;  // both recorded, with timing

 private:
  CUevent event_ = nullptr;
};

// ---- The Metal kernels as PTX ----

struct Dim3 {
  uint32_t x = 1, y = 1, z = 1;
};


// One kernel parameter as the `<kernel>_msl_params` table exports it: attribute 0 is [[buffer(index)]], 1 is
// [[threadgroup(index)]], others are position attributes (msl_rt::Attr); binding 0 pointer, 1 reference, 2 value;
// size of what it points to.
struct KernelParameter {
  uint32_t attribute, index, binding, size;
};
enum KernelParameterAttribute : uint32_t { kBufferParameter = 0, kThreadgroupParameter = 1 };
enum KernelParameterBinding : uint32_t { kPointerBinding = 0, kReferenceBinding = 1, kValueBinding = 2 };

// A launch ready to enqueue or to put into a graph: the function chosen for the shape and its packed Params.
struct KernelLaunch {
  std::string kernel;
  CUfunction function = nullptr;
  Dim3 threadgroups, threads_per_threadgroup;
  uint32_t shared_memory_bytes = 0;  // the [[threadgroup(i)]] slices, each rounded up to 16 bytes
  KernelParams params{};
};

// Every kernel of the PTX files of one folder, loaded into the current context. Its caches (modules, functions,
// parameter tables) are not locked: one thread at a time prepares launches; launch() itself only reads.
class KernelSet {
 public:
  // $LILY_CUDA_PTX_DIR if set, else the `cuda_kernels` folder beside the extension (where the build installs it).
  static std::string default_ptx_dir();

  // Loads every *.ptx of `ptx_dir` (empty: default_ptx_dir()). Throws DriverError if there is none or the driver
  // refuses one (naming the file).
  explicit KernelSet(const Context& context, std::string ptx_dir = {});
  ~KernelSet();
  KernelSet(const KernelSet&) = delete;
  KernelSet& operator=(const KernelSet&) = delete;

  const std::string& ptx_dir() const { return dir_; }
  std::vector<std::string> kernel_names() const;  // sorted host names
  bool has_kernel(const std::string& kernel) const { return kernel_file_.count(kernel) != 0; }
  // The kernel's parameter table, read from the module once.
  const std::vector<KernelParameter>& parameters(const std::string& kernel);

  // The CPU harness's argument rules, before any GPU work: every [[buffer(i)]] bound, setBytes data for a struct
  // exactly the struct, a buffer bound to one at least as long, a length for every [[threadgroup(i)]]. Throws
  // std::invalid_argument naming the kernel, the parameter and the slot.
  struct BoundArgument {
    size_t bytes;
    bool is_bytes;  // setBytes data rather than a device buffer
  };
  void check_arguments(const std::string& kernel, const std::vector<BoundArgument>& arguments,
                       const std::vector<uint32_t>& threadgroup_memory);

  // Chooses the function for the shape (the register-capped build where the fast one cannot run that many threads),
  // packs `buffers` (device pointers bound at [[buffer(i)]]) and the threadgroup slices, and raises the kernel's
  // dynamic shared memory limit where the slices need more than 48 KB. Throws std::invalid_argument on a bad shape,
  // too many buffers or slices, or an unknown kernel.
  KernelLaunch prepare(const std::string& kernel, const std::vector<CUdeviceptr>& buffers, Dim3 threadgroups,
                       Dim3 threads_per_threadgroup, const std::vector<uint32_t>& threadgroup_memory = {});
  // cuLaunchKernel on `stream` (asynchronous).
  void launch(const KernelLaunch& launch, CUstream stream = nullptr) const;

 private:
  CUmodule module(const std::string& file, bool capped);
  CUfunction function(const std::string& kernel, uint32_t threads);

  const Context& context_;
  std::string dir_;
  std::map<std::string, std::string> images_;       // file name -> PTX text, NUL-terminated
  std::map<std::string, std::string> kernel_file_;  // host name -> file name
  std::map<std::pair<std::string, bool>, CUmodule> modules_;
  std::map<std::pair<std::string, bool>, CUfunction> functions_;
  std::map<std::string, std::vector<KernelParameter>> parameters_;
};

// ---- Explicit CUDA graphs ----

using GraphNode = CUgraphNode;

// A graph under construction: nodes and the dependency edges declared with each.
class Graph {
 public:
  explicit Graph(const Context& context);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  CUgraph handle() const { return graph_; }
  size_t node_count() const { return nodes_; }

  GraphNode add_kernel(const KernelLaunch& launch, const std::vector<GraphNode>& dependencies);
  // A kernel released by `upstream`'s programmatic port (it waits for the rest itself: lily::grid_dependency_wait).
  // Needs Driver::fn().GraphAddDependencies.
  GraphNode add_kernel_after_start(const KernelLaunch& launch, GraphNode upstream);
  GraphNode add_copy(CUdeviceptr dst, CUdeviceptr src, size_t bytes, const std::vector<GraphNode>& dependencies);
  GraphNode add_fill(CUdeviceptr dst, uint8_t value, size_t bytes, const std::vector<GraphNode>& dependencies);
  GraphNode add_empty(const std::vector<GraphNode>& dependencies);  // a join point

 private:
  const Context& context_;
  CUgraph graph_ = nullptr;
  size_t nodes_ = 0;
};

// An instantiated graph, launched as one unit; kernel nodes can be re-pointed without re-instantiating.
class GraphExec {
 public:
  explicit GraphExec(const Graph& graph);
  ~GraphExec();
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;

  void launch(CUstream stream) const;
  // Replaces a kernel node's function, shape and Params (cuGraphExecKernelNodeSetParams); the node's edges stay.
  void set_kernel(GraphNode node, const KernelLaunch& launch) const;

 private:
  CUgraphExec exec_ = nullptr;
};

}  // namespace lily::cuda
