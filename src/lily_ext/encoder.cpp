// Command encoding and barrier placement (see encoder.h).
#include "encoder.h"

#include <cstring>

namespace lily {

Argument Argument::buffer(const Buffer& buffer, size_t offset) {
  if (offset >= buffer.length()) {
    throw Error("[encoder] buffer argument offset " + std::to_string(offset) +
                " is not inside the buffer's " + std::to_string(buffer.length()) + " bytes");
  }
  Argument argument;
  argument.buffer_ = &buffer;
  argument.offset_ = offset;
  return argument;
}

Argument Argument::bytes(const void* data, size_t length) {
  if (length == 0 || length > 4096) {
    throw Error("[encoder] a bytes argument holds 1 to 4096 bytes; got " + std::to_string(length));
  }
  Argument argument;
  const auto* begin = static_cast<const unsigned char*>(data);
  argument.data_.assign(begin, begin + length);
  return argument;
}

void Argument::patch_u32(size_t offset, uint32_t value) {
  if (buffer_ != nullptr || offset + 4 > data_.size()) {
    throw Error("[encoder] patch of bytes [" + std::to_string(offset) + ", +4) outside a bytes argument of " +
                std::to_string(data_.size()) + " bytes");
  }
  std::memcpy(data_.data() + offset, &value, 4);
}

Encoder::Encoder(Device& device, BarrierPolicy policy)
    : policy_(policy), command_buffer_(mtl::new_command_buffer(device.queue())) {}

Encoder::Encoder(Device&, BarrierPolicy policy, Dry) : policy_(policy), dry_(true) {}

Encoder::~Encoder() {
  // Metal asserts when an encoder is released while still encoding.
  if (encoder_) mtl::end_encoding(encoder_.get());
}

void Encoder::require_not_committed(const char* what) const {
  if (committed_) throw Error(std::string("[encoder] ") + what + " after commit");
}

void* Encoder::open_encoder() {
  if (!encoder_) {
    encoder_ = mtl::new_compute_encoder(command_buffer_.get(), policy_ == BarrierPolicy::Serial
                                                                  ? mtl::DispatchType::Serial
                                                                  : mtl::DispatchType::Concurrent);
    ++counters_.encoders;
    stage_has_dispatches_ = false;
    stage_.clear();
  }
  return encoder_.get();
}

// Successive compute encoders of one command buffer run in order (Metal tracks hazards on
// buffers between encoders), so closing one also ends the current stage.
void Encoder::close_encoder() {
  if (encoder_) {
    mtl::end_encoding(encoder_.get());
    encoder_ = mtl::Object();
  }
}

// The barrier rule is barriers.h's: in a concurrent compute encoder the GPU may run the dispatches of a stage in any
// order, or at once, until a memory barrier. Ranges are CPU addresses of shared storage (space 0), so two buffers
// wrapping the same memory alias correctly.
void Encoder::issue_barrier() {
  mtl::memory_barrier_buffers(encoder_.get());
  ++counters_.barriers;
  stage_has_dispatches_ = false;
  stage_.clear();
}

namespace {

void check_argument_count(const Pipeline& pipeline, const std::vector<Argument>& arguments) {
  if (arguments.size() > mtl::kMaxBufferArguments) {
    throw Error("[encoder] a dispatch of " + pipeline.name() + " binds " + std::to_string(arguments.size()) +
                " arguments; Metal allows " + std::to_string(mtl::kMaxBufferArguments));
  }
}

}  // namespace

void Encoder::dispatch(const Pipeline& pipeline, const std::vector<Argument>& arguments,
                       mtl::Size threadgroups, mtl::Size threads_per_threadgroup,
                       const std::vector<BufferRange>& reads, const std::vector<BufferRange>& writes,
                       const std::vector<size_t>& threadgroup_memory) {
  require_not_committed("dispatch");
  check_argument_count(pipeline, arguments);
  auto where = [&] { return "[encoder] dispatch of kernel '" + pipeline.name() + "': "; };
  size_t threads =
      threads_per_threadgroup.width * threads_per_threadgroup.height * threads_per_threadgroup.depth;
  if (threads == 0 || threads > pipeline.max_threads_per_threadgroup()) {
    throw Error(where() + "threads per threadgroup must be 1 to " +
                std::to_string(pipeline.max_threads_per_threadgroup()) + "; got " +
                std::to_string(threads));
  }
  auto to_addresses = [&](const std::vector<BufferRange>& ranges, const char* kind) {
    std::vector<ByteRange> addresses;
    for (const BufferRange& range : ranges) {
      if (range.buffer == nullptr || range.offset > range.buffer->length() ||
          range.length > range.buffer->length() - range.offset) {
        throw Error(where() + kind + " range [" + std::to_string(range.offset) + ", +" +
                    std::to_string(range.length) + ") is not inside its buffer" +
                    (range.buffer ? " of " + std::to_string(range.buffer->length()) + " bytes" : ""));
      }
      uintptr_t begin = reinterpret_cast<uintptr_t>(range.buffer->contents()) + range.offset;
      if (range.length > 0) addresses.push_back({0, begin, begin + range.length});
    }
    return addresses;
  };
  std::vector<ByteRange> read_addresses = to_addresses(reads, "read");
  std::vector<ByteRange> write_addresses = to_addresses(writes, "write");

  mtl::AutoreleasePool pool;
  void* encoder = open_encoder();
  if (policy_ == BarrierPolicy::Automatic && stage_.conflicts(read_addresses, write_addresses)) {
    issue_barrier();
  }
  mtl::set_pipeline(encoder, pipeline.handle());
  for (size_t index = 0; index < arguments.size(); ++index) {
    const Argument& argument = arguments[index];
    if (argument.buffer_ptr() != nullptr) {
      mtl::set_buffer(encoder, argument.buffer_ptr()->handle(), argument.offset(), index);
    } else {
      mtl::set_bytes(encoder, argument.data().data(), argument.data().size(), index);
    }
  }
  for (size_t index = 0; index < threadgroup_memory.size(); ++index) {
    mtl::set_threadgroup_memory_length(encoder, threadgroup_memory[index], index);
  }
  mtl::dispatch_threadgroups(encoder, threadgroups, threads_per_threadgroup);

  if (!stage_has_dispatches_) ++counters_.stages;
  stage_has_dispatches_ = true;
  stage_.add(read_addresses, write_addresses);
  ++counters_.dispatches;
  for (const ByteRange& r : read_addresses) counters_.bytes_read += r.end - r.begin;
  for (const ByteRange& w : write_addresses) counters_.bytes_written += w.end - w.begin;
}

void Encoder::dispatch_planned(const Pipeline& pipeline, bool same_pipeline, const std::vector<Argument>& arguments,
                               const std::vector<bool>& rebind, mtl::Size threadgroups,
                               mtl::Size threads_per_threadgroup) {
  require_not_committed("dispatch");
  if (!dry_) {
    void* encoder = open_encoder();
    if (!same_pipeline) mtl::set_pipeline(encoder, pipeline.handle());
    check_argument_count(pipeline, arguments);
    // Consecutive buffers to rebind go down as one setBuffers message (a Metal call costs the host per message).
    void* run_buffers[mtl::kMaxBufferArguments];
    mtl::NSUInteger run_offsets[mtl::kMaxBufferArguments];
    size_t run_first = 0, run_length = 0;
    auto bind_run = [&] {
      if (run_length == 1) mtl::set_buffer(encoder, run_buffers[0], run_offsets[0], run_first);
      if (run_length > 1) mtl::set_buffers(encoder, run_buffers, run_offsets, run_first, run_length);
      run_length = 0;
    };
    for (size_t index = 0; index < arguments.size(); ++index) {
      const Argument& argument = arguments[index];
      if (!rebind[index] || argument.buffer_ptr() == nullptr) bind_run();
      if (!rebind[index]) continue;
      if (argument.buffer_ptr() != nullptr) {
        if (run_length == 0) run_first = index;
        run_buffers[run_length] = argument.buffer_ptr()->handle();
        run_offsets[run_length++] = argument.offset();
      } else {
        mtl::set_bytes(encoder, argument.data().data(), argument.data().size(), index);
      }
    }
    bind_run();
    mtl::dispatch_threadgroups(encoder, threadgroups, threads_per_threadgroup);
  }
  if (!stage_has_dispatches_ || policy_ == BarrierPolicy::Serial) ++counters_.stages;
  stage_has_dispatches_ = true;
  ++counters_.dispatches;
}

void Encoder::barrier() {
  require_not_committed("barrier");
  // A barrier with nothing before it in this encoder orders nothing.
  if (encoder_ && stage_has_dispatches_) issue_barrier();
}

void Encoder::wait_for_event(const Event& event, uint64_t value) {
  require_not_committed("wait_for_event");
  close_encoder();
  mtl::encode_wait_for_event(command_buffer_.get(), event.handle(), value);
}

void Encoder::signal_event(const Event& event, uint64_t value) {
  require_not_committed("signal_event");
  close_encoder();
  mtl::encode_signal_event(command_buffer_.get(), event.handle(), value);
}

void Encoder::add_completed_handler(std::function<void(const std::string&)> handler) {
  require_not_committed("add_completed_handler");
  mtl::add_completed_handler(command_buffer_.get(), [handler = std::move(handler)](void* command_buffer) {
    bool failed = mtl::status(command_buffer) == mtl::CommandBufferStatus::Error;
    handler(failed ? mtl::error_description(command_buffer) : std::string());
  });
}

void Encoder::commit() {
  require_not_committed("commit");
  if (dry_) throw Error("[encoder] a dry encoder cannot be committed");
  mtl::AutoreleasePool pool;
  close_encoder();
  committed_ = true;
  mtl::commit(command_buffer_.get());
}

void Encoder::wait() {
  if (!committed_) throw Error("[encoder] wait before commit");
  mtl::AutoreleasePool pool;
  mtl::wait_until_completed(command_buffer_.get());
  mtl::check_succeeded(command_buffer_.get());
}

}  // namespace lily
