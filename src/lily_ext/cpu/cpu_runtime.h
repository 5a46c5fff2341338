// The runtime interface (runtime.h) on the CPU: buffers in host memory (checkpoint files mapped, never copied), and
// a graph recorded as its nodes' kernels from the CPU kernel table (kernels.h), run in order on a thread pool when
// submitted. The engine's graphs run here unchanged: the backend="cpu" engine.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../runtime.h"
#include "kernels.h"

namespace lily {

class CpuRuntime : public Runtime {
 public:
  explicit CpuRuntime(size_t threads);
  const char* name() const override { return "cpu"; }
  size_t threads() const { return pool_.size(); }
  // Routed (token, slot) pairs per [layer][expert] since the runtime started or the last reset.
  const std::vector<std::vector<uint64_t>>& expert_tokens() const { return load_.counts; }
  void reset_expert_tokens() { load_.counts.clear(); }
  // Every kernel name the table runs (`#` names at the sizes the Metal kernels are instantiated at), sorted.
  std::vector<std::string> kernel_names() const;

  std::unique_ptr<DeviceBuffer> allocate(size_t length, Memory memory) override;
  std::unique_ptr<DeviceBuffer> load_file(const std::string& path) override;
  std::unique_ptr<DeviceBuffer> reserve(size_t length) override;
  // `length` bytes of memory the caller owns and keeps alive (tests: a kernel run on numpy arrays in place).
  std::unique_ptr<DeviceBuffer> wrap(void* data, size_t length);
  void upload(DeviceBuffer& to, size_t offset, const void* from, size_t length) override;
  void download(const DeviceBuffer& from, size_t offset, void* to, size_t length) override;
  void copy(const DeviceBuffer& from, size_t from_offset, DeviceBuffer& to, size_t to_offset, size_t length) override;
  void fill_zero(DeviceBuffer& buffer) override;

  void require_kernel(const std::string& name) override;
  bool supports_tensor_ops() const override { return false; }
  // The table has no token choice, split-KV attention, chunked DeltaNet scan or simdgroup-matrix attention: their
  // plain counterparts do the same work serially here.
  void restrict_switches(Switches& switches) const override;
  bool reads_unaligned() const override { return true; }
  // A profiled recording times each node's call on the host clock (the pool's threads included).
  bool supports_profiling() const override { return true; }
  bool kernels_for_any_shape() const override { return true; }

  std::shared_ptr<RecordedGraph> record(std::shared_ptr<const Graph> graph, size_t begin, size_t end,
                                        const std::vector<DeviceBuffer*>& buffers,
                                        const RecordOptions& options) override;
  std::unique_ptr<Submission> submit(const std::shared_ptr<RecordedGraph>& graph, size_t position) override;
  void submit_dry(RecordedGraph& graph, size_t position) override;

 private:
  struct Recording;
  const cpu::Kernel& kernel(const std::string& name, size_t* dim) const;

  cpu::KernelTable table_;
  cpu::ThreadPool pool_;
  cpu::ExpertLoad load_;
};

}  // namespace lily
