// The Metal runtime (see metal_runtime.h).
#include "metal_runtime.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "barriers.h"
#include "encoder.h"
#include "mapped_file.h"
#include "model.h"

namespace lily {

namespace {

// Apple silicon's page size: buffers that wrap memory want the pointer and the length aligned to it.
constexpr size_t kMetalPage = 16384;
// A file whose tensors are not aligned is copied into its buffer in pieces of this size.
constexpr size_t kCopyChunk = 16u << 20;

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// A Metal buffer, and what its memory belongs to when it wraps memory it does not own.
class MetalBuffer : public DeviceBuffer {
 public:
  explicit MetalBuffer(Buffer buffer, size_t origin = 0)
      : DeviceBuffer(buffer.length(), origin), buffer(std::move(buffer)) {}
  ~MetalBuffer() override {
    buffer = Buffer();  // the buffer goes before the memory it wraps
    file.reset();
    if (reservation) ::munmap(reservation, reservation_length);
  }
  unsigned char* at(size_t offset) const { return static_cast<unsigned char*>(buffer.contents()) + offset; }

  Buffer buffer;
  std::unique_ptr<MappedFile> file;
  void* reservation = nullptr;
  size_t reservation_length = 0;
};

MetalBuffer& metal(DeviceBuffer& b) { return static_cast<MetalBuffer&>(b); }
const MetalBuffer& metal(const DeviceBuffer& b) { return static_cast<const MetalBuffer&>(b); }

void check_range(const DeviceBuffer& buffer, size_t offset, size_t length, const char* what) {
  if (offset > buffer.length() || length > buffer.length() - offset) {
    throw Error(std::string("[metal] ") + what + " of [" + std::to_string(offset) + ", +" + std::to_string(length) +
                ") is not inside the buffer's " + std::to_string(buffer.length()) + " bytes");
  }
}

class MetalSubmission : public Submission {
 public:
  explicit MetalSubmission(std::unique_ptr<Encoder> encoder) : encoder_(std::move(encoder)) {}
  void wait() override { encoder_->wait(); }

 private:
  std::unique_ptr<Encoder> encoder_;
};

}  // namespace

// Nodes of a graph over Metal buffers. A replayed recording also holds each dispatch resolved: its pipeline, its
// arguments, its barrier, and what differs from what the dispatches before it left bound in the compute encoder.
struct MetalRuntime::Recording : RecordedGraph {
  struct Dispatch {
    const Pipeline* pipeline;
    std::vector<Argument> args;
    Dim3 groups, threads;
    bool barrier;
    std::vector<PositionField> per_position;
    bool same_pipeline;        // as the dispatch before (left bound)
    std::vector<bool> rebind;  // per argument: differs from what the dispatches before left bound
  };
  std::shared_ptr<const Graph> graph;
  size_t begin = 0, end = 0;
  std::vector<const Buffer*> buffers;
  RecordOptions options;
  std::vector<bool> starts;           // the graph's stage starts (barriers.h)
  std::vector<Dispatch> dispatches;   // replayed only
  bool serial = false;  // every dispatch starts a stage: a serial encoder orders them with no barrier calls
};

MetalRuntime::MetalRuntime(const std::vector<KernelFamily>& kernel_families,
                           const std::optional<MetallibFile>& metallib)
    : device_(metallib ? std::make_unique<Device>(*metallib) : std::make_unique<Device>(kernel_families)) {}

std::unique_ptr<DeviceBuffer> MetalRuntime::allocate(size_t length, Memory) {
  return std::make_unique<MetalBuffer>(device_->new_buffer(length));
}

std::unique_ptr<DeviceBuffer> MetalRuntime::load_file(const std::string& path) {
  auto file = std::make_unique<MappedFile>(path);
  const size_t shift = file->aligning_shift();
  if (shift == 0) {  // the mapping itself becomes the buffer
    auto buffer = std::make_unique<MetalBuffer>(device_->wrap_memory(file->data(), file->mapped_length()));
    buffer->file = std::move(file);
    return buffer;
  }
  // setBuffer:offset: wants offsets aligned to the type a kernel reads, and a mapping keeps the file's offsets
  // modulo the page: a file whose data section is not aligned is copied, shifted, into a buffer of its own.
  auto buffer = std::make_unique<MetalBuffer>(device_->new_buffer(file->mapped_length() + shift), shift);
  std::memset(buffer->at(0), 0, shift);
  file->copy_out(kCopyChunk, [&](size_t offset, const unsigned char* bytes, size_t n) {
    std::memcpy(buffer->at(shift + offset), bytes, n);
  });
  std::memset(buffer->at(shift + file->file_length()), 0, file->mapped_length() - file->file_length());
  return buffer;
}

std::unique_ptr<DeviceBuffer> MetalRuntime::reserve(size_t length) {
  // Address space only (MAP_NORESERVE, never written): a full-size model's synthetic weights cost no memory while
  // the kernels that would read them are stubbed out.
  const size_t mapped = round_up(std::max<size_t>(length, 1), kMetalPage);
  void* reservation = ::mmap(nullptr, mapped + kMetalPage, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANON | MAP_NORESERVE, -1, 0);
  if (reservation == MAP_FAILED) throw Error("[engine] cannot reserve " + std::to_string(mapped) + " bytes");
  void* aligned = reinterpret_cast<void*>(round_up(reinterpret_cast<uintptr_t>(reservation), kMetalPage));
  std::unique_ptr<MetalBuffer> buffer;
  try {
    buffer = std::make_unique<MetalBuffer>(device_->wrap_memory(aligned, mapped));
  } catch (...) {
    ::munmap(reservation, mapped + kMetalPage);
    throw;
  }
  buffer->reservation = reservation;
  buffer->reservation_length = mapped + kMetalPage;
  return buffer;
}

void MetalRuntime::upload(DeviceBuffer& to, size_t offset, const void* from, size_t length) {
  check_range(to, offset, length, "upload");
  if (length) std::memcpy(metal(to).at(offset), from, length);
}

void MetalRuntime::download(const DeviceBuffer& from, size_t offset, void* to, size_t length) {
  check_range(from, offset, length, "download");
  if (length) std::memcpy(to, metal(from).at(offset), length);
}

void MetalRuntime::copy(const DeviceBuffer& from, size_t from_offset, DeviceBuffer& to, size_t to_offset,
                        size_t length) {
  check_range(from, from_offset, length, "copy");
  check_range(to, to_offset, length, "copy");
  if (length) std::memcpy(metal(to).at(to_offset), metal(from).at(from_offset), length);
}

void MetalRuntime::fill_zero(DeviceBuffer& buffer) { std::memset(metal(buffer).at(0), 0, buffer.length()); }

std::shared_ptr<RecordedGraph> MetalRuntime::record(std::shared_ptr<const Graph> graph, size_t begin, size_t end,
                                                    const std::vector<DeviceBuffer*>& buffers,
                                                    const RecordOptions& options) {
  auto r = std::make_shared<Recording>();
  for (DeviceBuffer* b : buffers) r->buffers.push_back(&metal(*b).buffer);
  r->graph = std::move(graph);
  r->begin = begin;
  r->end = end;
  r->options = options;
  r->starts = stage_starts(*r->graph);
  if (!options.replayed) return r;
  r->dispatches.reserve(end - begin);
  // What the dispatches before leave bound at each index (one compute encoder holds the whole step): a NodeArg.
  std::vector<const NodeArg*> bound;
  const Pipeline* previous = nullptr;
  for (size_t i = begin; i < end; ++i) {
    const Node& node = r->graph->nodes[i];
    const Pipeline* pipeline = &device_->pipeline(node.kernel);
    Recording::Dispatch d{pipeline, {}, node.groups, node.threads, i > begin && r->starts[i], node.per_position,
                          pipeline == previous, {}};
    previous = pipeline;
    if (bound.size() < node.args.size()) bound.resize(node.args.size(), nullptr);
    for (size_t k = 0; k < node.args.size(); ++k) {
      const NodeArg& a = node.args[k];
      d.args.push_back(a.buffer >= 0 ? Argument::buffer(*r->buffers.at(static_cast<size_t>(a.buffer)), a.offset)
                                     : Argument::bytes(a.bytes.data(), a.bytes.size()));
      const bool follows_position = std::any_of(node.per_position.begin(), node.per_position.end(),
                                                [&](const PositionField& f) { return f.arg == k; });
      const NodeArg* was = bound[k];
      const bool same = was != nullptr && !follows_position && was->buffer == a.buffer && was->offset == a.offset &&
                        was->bytes == a.bytes;
      d.rebind.push_back(!same);
      // A field that follows the position differs between tokens: nothing may count on it staying bound.
      bound[k] = follows_position ? nullptr : &a;
    }
    r->dispatches.push_back(std::move(d));
  }
  r->serial = std::all_of(r->starts.begin() + static_cast<long>(begin), r->starts.begin() + static_cast<long>(end),
                          [](bool start) { return start; });
  return r;
}

// Rewrites the fields that follow the position, then encodes with the barriers placed when the step was recorded.
std::unique_ptr<Encoder> MetalRuntime::encode_replayed(Recording& r, size_t position, bool dry) {
  const long dropped = r.options.dropped_barrier;
  // A dropped barrier (tests) needs the concurrent encoder whose barrier it drops.
  const bool serial = r.serial && dropped < 0;
  const BarrierPolicy policy = serial ? BarrierPolicy::Serial : BarrierPolicy::Manual;
  auto encoder = dry ? std::make_unique<Encoder>(*device_, policy, Encoder::Dry{})
                     : std::make_unique<Encoder>(*device_, policy);
  mtl::AutoreleasePool pool;
  for (size_t i = 0; i < r.dispatches.size(); ++i) {
    Recording::Dispatch& d = r.dispatches[i];
    for (const PositionField& f : d.per_position) {
      d.args[f.arg].patch_u32(f.offset, static_cast<uint32_t>(static_cast<long>(position) + f.delta));
    }
    if (!serial && d.barrier && static_cast<long>(r.begin + i) != dropped) encoder->barrier();
    encoder->dispatch_planned(*d.pipeline, d.same_pipeline, d.args, d.rebind, d.groups, d.threads);
  }
  return encoder;
}

// Automatic barriers: the Encoder places them from the declared ranges (serial mode adds one before every node). A
// dropped barrier: manual barriers at the graph's stage starts, with that one left out.
std::unique_ptr<Encoder> MetalRuntime::encode_once(const Recording& r) {
  const long dropped = r.options.dropped_barrier;
  const bool manual = dropped >= 0;
  auto encoder = std::make_unique<Encoder>(*device_, manual ? BarrierPolicy::Manual : BarrierPolicy::Automatic);
  auto ranges = [&](const std::vector<Span>& spans) {
    std::vector<BufferRange> out;
    for (const Span& s : spans) out.push_back({r.buffers.at(static_cast<size_t>(s.buffer)), s.offset, s.length});
    return out;
  };
  for (size_t i = r.begin; i < r.end; ++i) {
    const Node& node = r.graph->nodes[i];
    if (manual ? (i > r.begin && r.starts[i] && static_cast<long>(i) != dropped) : node.barrier_before) {
      encoder->barrier();
    }
    std::vector<Argument> args;
    for (const NodeArg& a : node.args) {
      args.push_back(a.buffer >= 0 ? Argument::buffer(*r.buffers.at(static_cast<size_t>(a.buffer)), a.offset)
                                   : Argument::bytes(a.bytes.data(), a.bytes.size()));
    }
    encoder->dispatch(device_->pipeline(node.kernel), args, node.groups, node.threads, ranges(node.reads),
                      ranges(node.writes));
  }
  return encoder;
}

std::unique_ptr<Submission> MetalRuntime::submit(const std::shared_ptr<RecordedGraph>& graph, size_t position) {
  auto& r = static_cast<Recording&>(*graph);
  std::unique_ptr<Encoder> encoder = r.options.replayed ? encode_replayed(r, position, false) : encode_once(r);
  encoder->commit();
  return std::make_unique<MetalSubmission>(std::move(encoder));
}

void MetalRuntime::submit_dry(RecordedGraph& graph, size_t position) {
  auto& r = static_cast<Recording&>(graph);
  if (!r.options.replayed) throw Error("[metal] a dry submission needs a replayed recording");
  encode_replayed(r, position, true);
}

}  // namespace lily
