// The CPU runtime (see cpu_runtime.h) and its kernel table's lookup.
#include "cpu_runtime.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "../mapped_file.h"
#include "../model.h"

namespace lily {

namespace {

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Host memory: an anonymous mapping (zeroed, its pages committed when first touched), a mapped checkpoint file, or
// memory the caller owns (`borrowed`).
class CpuBuffer : public DeviceBuffer {
 public:
  CpuBuffer(size_t length, unsigned char* data, std::unique_ptr<MappedFile> file = nullptr, bool borrowed = false)
      : DeviceBuffer(length), data(data), file(std::move(file)), borrowed(borrowed) {}
  ~CpuBuffer() override {
    if (!file && !borrowed) ::munmap(data, round_up(std::max<size_t>(length(), 1), 4096));
  }
  unsigned char* data;
  std::unique_ptr<MappedFile> file;
  bool borrowed;
};

unsigned char* base(const DeviceBuffer& b) { return static_cast<const CpuBuffer&>(b).data; }

void check_range(const DeviceBuffer& buffer, size_t offset, size_t length, const char* what) {
  if (offset > buffer.length() || length > buffer.length() - offset) {
    throw Error(std::string("[cpu] ") + what + " of [" + std::to_string(offset) + ", +" + std::to_string(length) +
                ") is not inside the buffer's " + std::to_string(buffer.length()) + " bytes");
  }
}

unsigned char* map_anonymous(size_t length, int protection) {
  void* p = ::mmap(nullptr, round_up(std::max<size_t>(length, 1), 4096), protection, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (p == MAP_FAILED) throw Error("[cpu] cannot allocate " + std::to_string(length) + " bytes");
  return static_cast<unsigned char*>(p);
}

// The layer a node's label names ("layers.<i>. ..."), or -1.
int label_layer(const std::string& label) {
  if (label.rfind("layers.", 0) != 0) return -1;
  return std::atoi(label.c_str() + 7);
}

// The work ran in submit(): nothing is left to wait for; a profiled one keeps each node's milliseconds.
class DoneSubmission : public Submission {
 public:
  explicit DoneSubmission(std::vector<double> milliseconds = {}) : milliseconds_(std::move(milliseconds)) {}
  void wait() override {}
  std::vector<double> node_milliseconds() const override { return milliseconds_; }

 private:
  std::vector<double> milliseconds_;
};

}  // namespace

// A node resolved for the host: its kernel, its argument struct (patched per position) and its buffer pointers.
struct CpuRuntime::Recording : RecordedGraph {
  struct Call {
    const cpu::Kernel* kernel;
    std::vector<unsigned char> params;
    std::vector<unsigned char*> buffers;
    std::vector<PositionField> per_position;
    size_t dim;
    Dim3 groups;
    int layer;
  };
  std::shared_ptr<const Graph> graph;
  std::vector<Call> calls;
  bool profiled = false;
};

CpuRuntime::CpuRuntime(size_t threads) : pool_(std::max<size_t>(threads, 1)) {}

std::vector<std::string> CpuRuntime::kernel_names() const { return table_.names(); }

std::unique_ptr<DeviceBuffer> CpuRuntime::allocate(size_t length, Memory) {
  return std::make_unique<CpuBuffer>(length, map_anonymous(length, PROT_READ | PROT_WRITE));
}

// The file as mapped, unshifted: the kernels read weights with unaligned loads (reads_unaligned), so no tensor is
// copied whatever offsets its writer left.
std::unique_ptr<DeviceBuffer> CpuRuntime::load_file(const std::string& path) {
  auto file = std::make_unique<MappedFile>(path);
  auto* data = static_cast<unsigned char*>(file->data());
  const size_t length = file->mapped_length();
  return std::make_unique<CpuBuffer>(length, data, std::move(file));
}

std::unique_ptr<DeviceBuffer> CpuRuntime::reserve(size_t length) {
  return std::make_unique<CpuBuffer>(length, map_anonymous(length, PROT_NONE));
}

std::unique_ptr<DeviceBuffer> CpuRuntime::wrap(void* data, size_t length) {
  return std::make_unique<CpuBuffer>(length, static_cast<unsigned char*>(data), nullptr, true);
}

void CpuRuntime::upload(DeviceBuffer& to, size_t offset, const void* from, size_t length) {
  check_range(to, offset, length, "upload");
  std::memcpy(base(to) + offset, from, length);
}

void CpuRuntime::download(const DeviceBuffer& from, size_t offset, void* to, size_t length) {
  check_range(from, offset, length, "download");
  std::memcpy(to, base(from) + offset, length);
}

void CpuRuntime::copy(const DeviceBuffer& from, size_t from_offset, DeviceBuffer& to, size_t to_offset,
                      size_t length) {
  check_range(from, from_offset, length, "copy source");
  check_range(to, to_offset, length, "copy destination");
  std::memmove(base(to) + to_offset, base(from) + from_offset, length);
}

void CpuRuntime::fill_zero(DeviceBuffer& buffer) { std::memset(base(buffer), 0, buffer.length()); }

const cpu::Kernel& CpuRuntime::kernel(const std::string& name, size_t* dim) const {
  const cpu::Kernel* found = table_.find(name, dim);
  if (!found) throw Error("[cpu] no CPU kernel " + name + " (the CPU runtime runs the float32 kernel set)");
  return *found;
}

void CpuRuntime::require_kernel(const std::string& name) {
  size_t dim = 0;
  kernel(name, &dim);
}

void CpuRuntime::restrict_switches(Switches& s) const {
  s.gpu_token = false;
  s.split_kv = false;
  s.chunked_scan = false;
  s.mma_attention = false;
}

std::shared_ptr<RecordedGraph> CpuRuntime::record(std::shared_ptr<const Graph> graph, size_t begin, size_t end,
                                                  const std::vector<DeviceBuffer*>& buffers,
                                                  const RecordOptions& options) {
  auto recording = std::make_shared<Recording>();
  recording->profiled = options.profiled;
  for (size_t i = begin; i < end; ++i) {
    const Node& node = graph->nodes[i];
    Recording::Call call{};
    call.kernel = &kernel(node.kernel, &call.dim);
    call.groups = node.groups;
    call.layer = label_layer(node.label);
    call.per_position = node.per_position;
    call.buffers.assign(node.args.size(), nullptr);
    for (size_t a = 0; a < node.args.size(); ++a) {
      const NodeArg& arg = node.args[a];
      if (arg.buffer < 0) {
        if (a != 0) throw Error("[cpu] " + node.kernel + ": argument " + std::to_string(a) + " is bytes");
        call.params = arg.bytes;
        continue;
      }
      const DeviceBuffer& b = *buffers.at(static_cast<size_t>(arg.buffer));
      check_range(b, arg.offset, 0, node.kernel.c_str());
      call.buffers[a] = base(b) + arg.offset;
    }
    for (const PositionField& f : call.per_position) {
      if (f.arg != 0 || f.offset + 4 > call.params.size()) {
        throw Error("[cpu] " + node.kernel + ": a position field outside its argument struct");
      }
    }
    recording->calls.push_back(std::move(call));
  }
  recording->graph = std::move(graph);
  return recording;
}

std::unique_ptr<Submission> CpuRuntime::submit(const std::shared_ptr<RecordedGraph>& graph, size_t position) {
  auto& recording = static_cast<Recording&>(*graph);
  std::vector<double> milliseconds;
  for (Recording::Call& call : recording.calls) {
    for (const PositionField& f : call.per_position) {
      const uint32_t value = static_cast<uint32_t>(static_cast<int64_t>(position) + f.delta);
      std::memcpy(call.params.data() + f.offset, &value, 4);
    }
    const cpu::KernelCall kernel_call{call.params, call.buffers, call.dim, call.groups, call.layer, pool_, load_};
    if (!recording.profiled) {
      (*call.kernel)(kernel_call);
      continue;
    }
    const auto start = std::chrono::steady_clock::now();
    (*call.kernel)(kernel_call);
    milliseconds.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return std::make_unique<DoneSubmission>(std::move(milliseconds));
}

void CpuRuntime::submit_dry(RecordedGraph&, size_t) {}

}  // namespace lily

namespace lily::cpu {

void ExpertLoad::add(int layer, const uint32_t* ids, size_t pairs, size_t experts) {
  if (layer < 0) return;
  if (counts.size() <= static_cast<size_t>(layer)) counts.resize(layer + 1);
  std::vector<uint64_t>& row = counts[layer];
  if (row.size() < experts) row.resize(experts);
  for (size_t p = 0; p < pairs; ++p) {
    if (ids[p] < experts) ++row[ids[p]];
  }
}

Matrix KernelCall::matrix(size_t i, int bits, DType scales, size_t experts, size_t rows, size_t cols) const {
  Matrix m;
  m.bits = bits;
  m.group = 64;
  m.dtype = scales;
  m.experts = experts;
  m.rows = rows;
  m.cols = cols;
  m.data = at<const uint8_t>(i);
  m.scales = at<const uint8_t>(i + 1);
  m.biases = at<const uint8_t>(i + 2);
  return m;
}

KernelTable::KernelTable() {
  add_qmatmul_kernels(*this);
  add_rms_norm_kernels(*this);
  add_attention_kernels(*this);
  add_gated_delta_kernels(*this);
  add_moe_kernels(*this);
}

void KernelTable::add(const std::string& name, Kernel kernel, std::vector<size_t> sizes) {
  kernels_[name] = std::move(kernel);
  if (name.back() == '#') sizes_[name] = std::move(sizes);
}

const Kernel* KernelTable::find(const std::string& name, size_t* dim) const {
  *dim = 0;
  auto exact = kernels_.find(name);
  if (exact != kernels_.end()) return &exact->second;
  const size_t digits = name.find_last_not_of("0123456789") + 1;
  if (digits == 0 || digits == name.size()) return nullptr;
  auto sized = kernels_.find(name.substr(0, digits) + "#");
  if (sized == kernels_.end()) return nullptr;
  *dim = std::stoul(name.substr(digits));
  return &sized->second;
}

std::vector<std::string> KernelTable::names() const {
  std::vector<std::string> out;
  for (const auto& [name, kernel] : kernels_) {
    if (name.back() != '#') {
      out.push_back(name);
      continue;
    }
    for (size_t size : sizes_.at(name)) out.push_back(name.substr(0, name.size() - 1) + std::to_string(size));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace lily::cpu
