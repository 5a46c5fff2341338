// The runtime under the engine: what the engine needs from a GPU API, and nothing else. The engine (model.h) keeps
// its buffers, weights and graphs as plain data and talks to the GPU only through this interface; Metal implements
// it over Device and Encoder (metal_runtime.cpp), CUDA over the driver API (cuda/runtime.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "types.h"

namespace lily {

struct Graph;
struct Switches;

// Where a buffer lives. Device: GPU memory the host reaches through upload/download (Metal's shared storage is
// both). HostVisible: memory the host reads and writes directly while the GPU uses it (per-step I/O: token ids).
enum class Memory { Device, HostVisible };

// A runtime's buffer. The engine addresses it only through the Runtime that made it.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  size_t length() const { return length_; }
  // Where byte 0 of a loaded file lies in the buffer (load_file may shift a file so that its tensors are aligned).
  size_t origin() const { return origin_; }

 protected:
  explicit DeviceBuffer(size_t length, size_t origin = 0) : length_(length), origin_(origin) {}

 private:
  size_t length_, origin_;
};

// Nodes of a graph prepared for one runtime (kernels resolved, arguments bound, barriers or dependency edges
// placed), submitted once or replayed many times.
class RecordedGraph {
 public:
  virtual ~RecordedGraph() = default;
};

// Work handed to the GPU. wait() blocks until it has finished; it throws Error with the runtime's description if
// the work failed. Destroying a Submission that was not waited on does not wait.
class Submission {
 public:
  virtual ~Submission() = default;
  virtual void wait() = 0;
  // After wait(), of a graph recorded with RecordOptions::profiled: each node's device time in milliseconds, in
  // node order. Empty otherwise.
  virtual std::vector<double> node_milliseconds() const { return {}; }
};

struct RecordOptions {
  // Submitted once per token (the decode step): prepared so that a submission costs as little host time as the
  // runtime allows. Else submitted once (a prefill chunk).
  bool replayed = false;
  // Tests: the node whose barrier (on CUDA: whose dependency edges) is left out; -1 = none. Dropping one must
  // break the result, which shows the barriers are the ones that matter.
  long dropped_barrier = -1;
  // Per-node device times (lily bench --profile): every node runs on its own, in order, between two timing events
  // (no concurrency, so the times add up to the graph's serial cost). Only runtimes with supports_profiling().
  bool profiled = false;
};

class Runtime {
 public:
  virtual ~Runtime() = default;
  // "metal" or "cuda".
  virtual const char* name() const = 0;

  // ---- memory ----
  virtual std::unique_ptr<DeviceBuffer> allocate(size_t length, Memory memory) = 0;
  // The whole file `path` as one buffer (length: the file padded to the runtime's page), shifted (origin()) so that
  // a safetensors file's data section starts on a 16-byte boundary: writers such as MLX's leave the header at any
  // length, and GPU loads of uint32 codes or bf16 scales fault at misaligned addresses. Metal wraps the mapping
  // without a copy where no shift is needed and copies the file otherwise; CUDA streams it from the mapping into
  // device memory.
  virtual std::unique_ptr<DeviceBuffer> load_file(const std::string& path) = 0;
  // `length` bytes of address space that are never touched (host-cost runs: synthetic weights, kernels stubbed).
  virtual std::unique_ptr<DeviceBuffer> reserve(size_t length) = 0;
  virtual void upload(DeviceBuffer& to, size_t offset, const void* from, size_t length) = 0;
  virtual void download(const DeviceBuffer& from, size_t offset, void* to, size_t length) = 0;
  virtual void copy(const DeviceBuffer& from, size_t from_offset, DeviceBuffer& to, size_t to_offset,
                    size_t length) = 0;
  virtual void fill_zero(DeviceBuffer& buffer) = 0;

  // ---- kernels ----
  // Prepares kernel `name` (Metal: its pipeline); throws Error naming it when the runtime has no such kernel.
  virtual void require_kernel(const std::string& name) = 0;
  // Prefill GEMMs on Metal 4 tensor ops (qmm_nax).
  virtual bool supports_tensor_ops() const = 0;
  // RecordOptions::profiled (per-node device times).
  virtual bool supports_profiling() const { return false; }
  // Decode GEMVs stage x in threadgroup memory (tuning::staged_gemv): where scattered per-lane loads of x cost more
  // than the staging (NVIDIA's L1), not on Apple GPUs.
  virtual bool prefers_staged_gemv() const { return false; }
  // A few rows' GEMVs on matrix units (tuning::mma_gemv): where the vector GEMVs are issue-bound (NVIDIA); not yet
  // measured on Apple GPUs.
  virtual bool prefers_mma_gemv() const { return false; }
  // Split-KV decode in blocks of tuning::kAttentionSplitShortBlockKeys keys (tuning::attention_split_blocks): where
  // the matrix-unit partials otherwise leave SMs idle (NVIDIA); not measured on Apple GPUs.
  virtual bool prefers_short_split_blocks() const { return false; }
  // Turns off the engine switches whose kernels this runtime lacks (the CPU runtime: see cpu/cpu_runtime.h); the
  // builder then emits their plain counterparts. Metal and CUDA run every switch.
  virtual void restrict_switches(Switches&) const {}
  // Kernels read weights at any address: files are bound as mapped, no tensor is copied to align it (the CPU).
  virtual bool reads_unaligned() const { return false; }
  // Kernels exist for any head dims and head counts (the CPU's C++ functions), not only the instantiated ones.
  virtual bool kernels_for_any_shape() const { return false; }

  // ---- graphs ----
  // Nodes [begin, end) of `graph`, whose buffer i is buffers[i]. The buffers must outlive the recording; the
  // recording keeps `graph`.
  virtual std::shared_ptr<RecordedGraph> record(std::shared_ptr<const Graph> graph, size_t begin, size_t end,
                                                const std::vector<DeviceBuffer*>& buffers,
                                                const RecordOptions& options) = 0;
  // Writes `position` into the graph's position fields (Node::per_position), then submits it without waiting.
  virtual std::unique_ptr<Submission> submit(const std::shared_ptr<RecordedGraph>& graph, size_t position) = 0;
  // Host-cost runs: the CPU work of submit without the driver calls (nothing runs).
  virtual void submit_dry(RecordedGraph& graph, size_t position) = 0;
};

}  // namespace lily
