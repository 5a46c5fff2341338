// The runtime interface (runtime.h) on Metal: buffers in shared storage (the host reads and writes them in place),
// checkpoint files wrapped without a copy, and graphs encoded into command buffers with barriers from the barrier
// rule. A replayed graph (the decode step) keeps its pipelines and arguments resolved and is re-encoded per token,
// setting only what changed since the dispatch before.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "device.h"
#include "encoder.h"
#include "runtime.h"

namespace lily {

class MetalRuntime : public Runtime {
 public:
  // The kernels come from `metallib` when given (an ahead-of-time build), else from `kernel_families`.
  MetalRuntime(const std::vector<KernelFamily>& kernel_families, const std::optional<MetallibFile>& metallib);
  const char* name() const override { return "metal"; }
  Device& device() { return *device_; }

  std::unique_ptr<DeviceBuffer> allocate(size_t length, Memory memory) override;
  std::unique_ptr<DeviceBuffer> load_file(const std::string& path) override;
  std::unique_ptr<DeviceBuffer> reserve(size_t length) override;
  void upload(DeviceBuffer& to, size_t offset, const void* from, size_t length) override;
  void download(const DeviceBuffer& from, size_t offset, void* to, size_t length) override;
  void copy(const DeviceBuffer& from, size_t from_offset, DeviceBuffer& to, size_t to_offset, size_t length) override;
  void fill_zero(DeviceBuffer& buffer) override;

  void require_kernel(const std::string& name) override { device_->pipeline(name); }
  bool supports_tensor_ops() const override { return device_->supports_tensor_ops(); }

  std::shared_ptr<RecordedGraph> record(std::shared_ptr<const Graph> graph, size_t begin, size_t end,
                                        const std::vector<DeviceBuffer*>& buffers,
                                        const RecordOptions& options) override;
  std::unique_ptr<Submission> submit(const std::shared_ptr<RecordedGraph>& graph, size_t position) override;
  void submit_dry(RecordedGraph& graph, size_t position) override;

 private:
  struct Recording;
  std::unique_ptr<Encoder> encode_replayed(Recording& recording, size_t position, bool dry);
  std::unique_ptr<Encoder> encode_once(const Recording& recording);

  std::unique_ptr<Device> device_;
};

}  // namespace lily
