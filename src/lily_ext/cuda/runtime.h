// The runtime interface (runtime.h) on NVIDIA GPUs, over the driver layer (driver.h): weights, state and scratch in
// device memory; each checkpoint file streamed from its mapping into device memory once, through a small pinned
// staging buffer; the Metal kernels as PTX; every graph recorded as an explicit CUDA graph whose dependency edges come
// from the barrier rule (barriers.h). A replayed graph (the decode step) is instantiated once and launched per token.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../runtime.h"

namespace lily::cuda {
class Context;
class KernelSet;
class Stream;
}  // namespace lily::cuda

namespace lily {

class CudaRuntime : public Runtime {
 public:
  // GPU `ordinal`'s primary context and the kernels of `ptx_dir` (empty: $LILY_CUDA_PTX_DIR, else the packaged
  // folder). Throws Error when there is no driver, no such GPU, or no PTX.
  CudaRuntime(int ordinal, const std::string& ptx_dir);
  ~CudaRuntime() override;
  const char* name() const override { return "cuda"; }

  std::unique_ptr<DeviceBuffer> allocate(size_t length, Memory memory) override;
  std::unique_ptr<DeviceBuffer> load_file(const std::string& path) override;
  std::unique_ptr<DeviceBuffer> reserve(size_t length) override;
  void upload(DeviceBuffer& to, size_t offset, const void* from, size_t length) override;
  void download(const DeviceBuffer& from, size_t offset, void* to, size_t length) override;
  void copy(const DeviceBuffer& from, size_t from_offset, DeviceBuffer& to, size_t to_offset, size_t length) override;
  void fill_zero(DeviceBuffer& buffer) override;

  void require_kernel(const std::string& name) override;
  bool supports_tensor_ops() const override { return false; }
  bool supports_profiling() const override { return true; }
  bool prefers_staged_gemv() const override { return true; }
  bool prefers_mma_gemv() const override { return true; }
  bool prefers_short_split_blocks() const override { return true; }

  std::shared_ptr<RecordedGraph> record(std::shared_ptr<const Graph> graph, size_t begin, size_t end,
                                        const std::vector<DeviceBuffer*>& buffers,
                                        const RecordOptions& options) override;
  std::unique_ptr<Submission> submit(const std::shared_ptr<RecordedGraph>& graph, size_t position) override;
  void submit_dry(RecordedGraph& graph, size_t position) override;

 private:
  struct Recording;
  void current() const;  // makes the context current on the calling thread (the server decodes on its own thread)

  std::unique_ptr<cuda::Context> context_;
  std::unique_ptr<cuda::KernelSet> kernels_;
  std::unique_ptr<cuda::Stream> stream_;
  bool early_start_ = false;  // programmatic edges where barriers.h's early_starts allows them
};

}  // namespace lily
