// The CUDA runtime (see runtime.h).
#include "runtime.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "../barriers.h"
#include "../mapped_file.h"
#include "../model.h"
#include "driver.h"

namespace lily {

namespace {

// Checkpoint files go to the GPU in chunks of this size, through two pinned staging halves (one filled by the CPU
// while the other is copied): the only host memory a load holds beyond the page cache.
constexpr size_t kStagingChunk = 16u << 20;
// Alignment of each bytes argument (setBytes data) in its arena: the widest vector a kernel reads from it.
constexpr size_t kArgumentAlign = 16;

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Device memory, or pinned host memory for what the host reads or writes while steps run (the token slots: kernels
// write the chosen token there, and the host reads it once the step's event fired, with no copy queued behind the
// next step). With unified addressing a pinned host pointer is also the device's pointer to it.
class CudaBuffer : public DeviceBuffer {
 public:
  CudaBuffer(size_t length, Memory memory, size_t origin = 0) : DeviceBuffer(length, origin) {
    if (memory == Memory::HostVisible) {
      pinned = cuda::PinnedMemory(length);
    } else {
      device = cuda::DeviceMemory(length);
    }
  }
  bool host_visible() const { return pinned.data() != nullptr; }
  unsigned char* host(size_t offset) const { return static_cast<unsigned char*>(pinned.data()) + offset; }
  cuda::CUdeviceptr at(size_t offset) const {
    return (host_visible() ? reinterpret_cast<cuda::CUdeviceptr>(pinned.data()) : device.ptr()) + offset;
  }
  cuda::DeviceMemory device;
  cuda::PinnedMemory pinned;
};

CudaBuffer& device(DeviceBuffer& b) { return static_cast<CudaBuffer&>(b); }
const CudaBuffer& device(const DeviceBuffer& b) { return static_cast<const CudaBuffer&>(b); }

void check_range(const DeviceBuffer& buffer, size_t offset, size_t length, const char* what) {
  if (offset > buffer.length() || length > buffer.length() - offset) {
    throw Error(std::string("[cuda] ") + what + " of [" + std::to_string(offset) + ", +" + std::to_string(length) +
                ") is not inside the buffer's " + std::to_string(buffer.length()) + " bytes");
  }
}

cuda::Dim3 dim3(const Dim3& d) {
  return {static_cast<uint32_t>(d.width), static_cast<uint32_t>(d.height), static_cast<uint32_t>(d.depth)};
}

}  // namespace

// One graph recorded for the GPU: a CUDA graph when it is replayed (the decode step: one launch per token), else its
// kernels launched one by one in stream order (a prefill chunk runs once: building and instantiating a CUDA graph of
// its ~1,100 nodes cost more host time than the launches, and a graph whose launches the host issues while the GPU
// runs the first ones hides their cost). The bytes arguments live in device memory: those that never change in
// `constants` (uploaded once), those holding per-position fields in `positional`, uploaded from its pinned host copy
// before each launch, in stream order, after the host patched the fields.
struct CudaRuntime::Recording : RecordedGraph {
  struct Patch {
    size_t offset;  // into positional_host
    int32_t delta;
  };
  std::shared_ptr<const Graph> graph;
  cuda::DeviceMemory constants, positional;
  cuda::PinnedMemory positional_host;
  size_t positional_bytes = 0;
  std::vector<Patch> patches;
  std::unique_ptr<cuda::Graph> cuda_graph;
  std::unique_ptr<cuda::GraphExec> exec;
  std::vector<cuda::KernelLaunch> launches;  // no CUDA graph: the nodes in stream order
  bool profiled = false;                      // a timing event before each of `launches` and after the last
  std::shared_ptr<cuda::Event> last;  // the last submission's completion (its upload read positional_host)
};

namespace {

class CudaSubmission : public Submission {
 public:
  // `marks`: for a profiled recording, the timing event before each node and one after the last.
  CudaSubmission(const cuda::Context& context, std::shared_ptr<RecordedGraph> graph, std::shared_ptr<cuda::Event> done,
                 std::vector<std::unique_ptr<cuda::Event>> marks = {})
      : context_(context), graph_(std::move(graph)), done_(std::move(done)), marks_(std::move(marks)) {}
  void wait() override {
    context_.make_current();
    done_->synchronize();
  }
  std::vector<double> node_milliseconds() const override {
    std::vector<double> ms;
    for (size_t i = 1; i < marks_.size(); ++i) ms.push_back(marks_[i]->elapsed_ms_since(*marks_[i - 1]));
    return ms;
  }

 private:
  const cuda::Context& context_;
  std::shared_ptr<RecordedGraph> graph_;  // kept until the work is done
  std::shared_ptr<cuda::Event> done_;
  std::vector<std::unique_ptr<cuda::Event>> marks_;
};

}  // namespace

CudaRuntime::CudaRuntime(int ordinal, const std::string& ptx_dir) {
  context_ = std::make_unique<cuda::Context>(ordinal);
  kernels_ = std::make_unique<cuda::KernelSet>(*context_, ptx_dir);
  stream_ = std::make_unique<cuda::Stream>();
  // Programmatic dependent launch in CUDA graphs, unless $LILY_CUDA_PDL is 0 (the switch back: every edge waits for
  // the whole upstream kernel), the driver predates typed graph edges or the GPU predates Hopper (the kernels' waits
  // are compiled for sm_90 on: metal/lily.h).
  const char* pdl = std::getenv("LILY_CUDA_PDL");
  early_start_ = !(pdl && std::string(pdl) == "0") && cuda::Driver::get().fn().GraphAddDependencies != nullptr &&
                 context_->compute_capability().first >= 9;
}

CudaRuntime::~CudaRuntime() {
  try {
    current();
    stream_->synchronize();
  } catch (const Error&) {
    // A failed kernel was reported to whoever waited on it; nothing more to do while closing.
  }
}

void CudaRuntime::current() const { context_->make_current(); }

std::unique_ptr<DeviceBuffer> CudaRuntime::allocate(size_t length, Memory memory) {
  current();
  return std::make_unique<CudaBuffer>(length, memory);
}

std::unique_ptr<DeviceBuffer> CudaRuntime::load_file(const std::string& path) {
  current();
  MappedFile file(path);
  const size_t shift = file.aligning_shift();
  auto buffer = std::make_unique<CudaBuffer>(file.mapped_length() + shift, Memory::Device, shift);
  cuda::PinnedMemory staging(2 * kStagingChunk);
  cuda::Event copied[2];
  size_t chunk = 0;
  file.copy_out(kStagingChunk, [&](size_t offset, const unsigned char* bytes, size_t n) {
    const size_t half = chunk % 2;
    if (chunk++ >= 2) copied[half].synchronize();  // the copy that last read this half is done
    unsigned char* slot = static_cast<unsigned char*>(staging.data()) + half * kStagingChunk;
    std::memcpy(slot, bytes, n);
    cuda::upload_async(buffer->at(shift + offset), slot, n, stream_->handle());
    copied[half].record(stream_->handle());
  });
  if (file.mapped_length() > file.file_length()) {
    cuda::fill_async(buffer->at(shift + file.file_length()), 0, file.mapped_length() - file.file_length(),
                     stream_->handle());
  }
  stream_->synchronize();
  return buffer;
}

std::unique_ptr<DeviceBuffer> CudaRuntime::reserve(size_t length) {
  // Host-cost runs stub the kernels out on Metal only; here the memory is simply allocated.
  return allocate(length, Memory::Device);
}

void CudaRuntime::upload(DeviceBuffer& to, size_t offset, const void* from, size_t length) {
  check_range(to, offset, length, "upload");
  if (!length) return;
  if (device(to).host_visible()) {
    std::memcpy(device(to).host(offset), from, length);
    return;
  }
  current();
  cuda::upload_async(device(to).at(offset), from, length, stream_->handle());
  stream_->synchronize();
}

void CudaRuntime::download(const DeviceBuffer& from, size_t offset, void* to, size_t length) {
  check_range(from, offset, length, "download");
  if (!length) return;
  if (device(from).host_visible()) {
    std::memcpy(to, device(from).host(offset), length);
    return;
  }
  current();
  cuda::download_async(to, device(from).at(offset), length, stream_->handle());
  stream_->synchronize();
}

void CudaRuntime::copy(const DeviceBuffer& from, size_t from_offset, DeviceBuffer& to, size_t to_offset,
                       size_t length) {
  check_range(from, from_offset, length, "copy");
  check_range(to, to_offset, length, "copy");
  if (!length) return;
  if (device(from).host_visible()) return upload(to, to_offset, device(from).host(from_offset), length);
  if (device(to).host_visible()) return download(from, from_offset, device(to).host(to_offset), length);
  current();
  cuda::copy_async(device(to).at(to_offset), device(from).at(from_offset), length, stream_->handle());
  stream_->synchronize();
}

void CudaRuntime::fill_zero(DeviceBuffer& buffer) {
  if (device(buffer).host_visible()) {
    std::memset(device(buffer).host(0), 0, buffer.length());
    return;
  }
  current();
  cuda::fill_async(device(buffer).at(0), 0, buffer.length(), stream_->handle());
  stream_->synchronize();
}

void CudaRuntime::require_kernel(const std::string& name) {
  if (!kernels_->has_kernel(name)) {
    throw Error("[cuda] kernel '" + name + "' is not in the PTX of " + kernels_->ptx_dir() +
                " (build it with tools/cuda_kernels.py; docs/cuda.md)");
  }
}

std::shared_ptr<RecordedGraph> CudaRuntime::record(std::shared_ptr<const Graph> graph, size_t begin, size_t end,
                                                   const std::vector<DeviceBuffer*>& buffers,
                                                   const RecordOptions& options) {
  current();
  auto r = std::make_shared<Recording>();
  r->graph = std::move(graph);
  const std::vector<Node>& nodes = r->graph->nodes;
  // Where each bytes argument goes: (positional?, offset in its arena), per node and argument.
  std::vector<std::vector<std::pair<bool, size_t>>> placed(end - begin);
  std::vector<unsigned char> constants, positional;
  for (size_t i = begin; i < end; ++i) {
    const Node& node = nodes[i];
    for (size_t k = 0; k < node.args.size(); ++k) {
      const bool follows = std::any_of(node.per_position.begin(), node.per_position.end(),
                                       [&](const PositionField& f) { return f.arg == k; });
      std::vector<unsigned char>& arena = follows ? positional : constants;
      const size_t at = align_up(arena.size(), kArgumentAlign);
      arena.resize(at + node.args[k].bytes.size());
      std::copy(node.args[k].bytes.begin(), node.args[k].bytes.end(), arena.begin() + static_cast<long>(at));
      placed[i - begin].push_back({follows, at});
      for (const PositionField& f : node.per_position) {
        if (f.arg == k) r->patches.push_back({at + f.offset, f.delta});
      }
    }
  }
  r->constants = cuda::DeviceMemory(std::max<size_t>(constants.size(), 1));
  if (!constants.empty()) cuda::upload(r->constants.ptr(), constants.data(), constants.size());
  r->positional_bytes = positional.size();
  r->positional = cuda::DeviceMemory(std::max<size_t>(positional.size(), 1));
  r->positional_host = cuda::PinnedMemory(std::max<size_t>(positional.size(), 1));
  std::copy(positional.begin(), positional.end(), static_cast<unsigned char*>(r->positional_host.data()));

  // Dependency edges by the barrier rule; a dropped barrier (tests) drops every edge into that node. A recording
  // with a dropped barrier is a CUDA graph even when it runs once, so the edges of prefill graphs stay tested (and
  // agree with the stream-ordered launches). A profiled recording runs its nodes one by one: no graph, no edges.
  const bool as_graph = !options.profiled && (options.replayed || options.dropped_barrier >= 0);
  r->profiled = options.profiled;
  std::vector<std::vector<size_t>> edges;
  std::vector<bool> early;  // per node: a programmatic edge from its one upstream node (early_starts)
  if (as_graph) {
    edges = dependencies(*r->graph, begin, end);
    if (options.dropped_barrier >= static_cast<long>(begin) && options.dropped_barrier < static_cast<long>(end)) {
      edges[static_cast<size_t>(options.dropped_barrier) - begin].clear();
    }
    if (early_start_) early = early_starts(*r->graph, begin, end, edges);
    r->cuda_graph = std::make_unique<cuda::Graph>(*context_);
  }
  std::vector<cuda::GraphNode> added;
  for (size_t i = begin; i < end; ++i) {
    const Node& node = nodes[i];
    std::vector<cuda::CUdeviceptr> pointers;
    for (size_t k = 0; k < node.args.size(); ++k) {
      const NodeArg& a = node.args[k];
      if (a.buffer >= 0) {
        pointers.push_back(device(*buffers.at(static_cast<size_t>(a.buffer))).at(a.offset));
      } else {
        const auto [follows, at] = placed[i - begin][k];
        pointers.push_back((follows ? r->positional.ptr() : r->constants.ptr()) + at);
      }
    }
    cuda::KernelLaunch launch = kernels_->prepare(node.kernel, pointers, dim3(node.groups), dim3(node.threads));
    if (!as_graph) {
      r->launches.push_back(std::move(launch));
      continue;
    }
    if (!early.empty() && early[i - begin]) {
      added.push_back(r->cuda_graph->add_kernel_after_start(launch, added[edges[i - begin][0] - begin]));
      continue;
    }
    std::vector<cuda::GraphNode> after;
    for (size_t j : edges[i - begin]) after.push_back(added[j - begin]);
    added.push_back(r->cuda_graph->add_kernel(launch, after));
  }
  if (end > begin && as_graph) r->exec = std::make_unique<cuda::GraphExec>(*r->cuda_graph);
  return r;
}

void CudaRuntime::submit_dry(RecordedGraph& graph, size_t position) {
  auto& r = static_cast<Recording&>(graph);
  if (r.last) r.last->synchronize();  // its upload read the fields about to change
  auto* host = static_cast<unsigned char*>(r.positional_host.data());
  for (const Recording::Patch& p : r.patches) {
    const uint32_t value = static_cast<uint32_t>(static_cast<long>(position) + p.delta);
    std::memcpy(host + p.offset, &value, 4);
  }
}

std::unique_ptr<Submission> CudaRuntime::submit(const std::shared_ptr<RecordedGraph>& graph, size_t position) {
  current();
  auto& r = static_cast<Recording&>(*graph);
  submit_dry(r, position);
  if (r.positional_bytes) {
    cuda::upload_async(r.positional.ptr(), r.positional_host.data(), r.positional_bytes, stream_->handle());
  }
  if (r.exec) r.exec->launch(stream_->handle());
  std::vector<std::unique_ptr<cuda::Event>> marks;  // profiled: one before each node and one after the last
  auto mark = [&] {
    marks.push_back(std::make_unique<cuda::Event>(/*timing=*/true));
    marks.back()->record(stream_->handle());
  };
  for (const cuda::KernelLaunch& launch : r.launches) {
    if (r.profiled) mark();
    kernels_->launch(launch, stream_->handle());
  }
  if (!marks.empty()) mark();
  auto done = std::make_shared<cuda::Event>();
  done->record(stream_->handle());
  r.last = done;
  return std::make_unique<CudaSubmission>(*context_, graph, std::move(done), std::move(marks));
}

}  // namespace lily
