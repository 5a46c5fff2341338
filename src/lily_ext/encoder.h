// Command encoding for the engine: one command buffer with concurrent compute encoders, barriers
// placed from the buffer ranges each dispatch declares, shared-event waits and signals, and
// completion handlers. Not thread-safe: one Encoder is filled by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "barriers.h"
#include "device.h"

namespace lily {

// A byte range of a buffer that a dispatch reads or writes.
struct BufferRange {
  const Buffer* buffer;
  size_t offset;
  size_t length;
};

// One kernel argument, bound at [[buffer(i)]] where i is its position in the argument list.
class Argument {
 public:
  // A buffer from `offset` on (the kernel sees contents + offset).
  static Argument buffer(const Buffer& buffer, size_t offset = 0);
  // Bytes copied into the command stream at encode time (setBytes, at most 4 KB).
  static Argument bytes(const void* data, size_t length);
  template <class T>
  static Argument value(const T& value) {
    return bytes(&value, sizeof(T));
  }

  const Buffer* buffer_ptr() const { return buffer_; }
  size_t offset() const { return offset_; }
  const std::vector<unsigned char>& data() const { return data_; }
  // Rewrites a u32 field of a bytes argument (a decode step re-encoded for the next token).
  void patch_u32(size_t offset, uint32_t value);

 private:
  const Buffer* buffer_ = nullptr;
  size_t offset_ = 0;
  std::vector<unsigned char> data_;
};

enum class BarrierPolicy {
  Automatic,  // barriers from declared ranges (the engine's mode)
  Manual,     // only explicit barrier() calls (tests of the hazard checks)
  Serial,     // serial compute encoders: every dispatch after the one before, no barrier calls (a decode step whose
              // every dispatch depends on the one before)
};

struct EncoderCounters {
  uint64_t dispatches = 0;
  uint64_t stages = 0;    // groups of dispatches free to run concurrently
  uint64_t barriers = 0;  // memory barriers issued
  uint64_t encoders = 0;  // compute encoders opened
  uint64_t bytes_read = 0;     // declared
  uint64_t bytes_written = 0;  // declared
};

class Encoder {
 public:
  explicit Encoder(Device& device, BarrierPolicy policy = BarrierPolicy::Automatic);
  // An encoder that makes no Metal call: dispatch_planned and barrier do only the encoder's own bookkeeping, and it
  // cannot be committed. Host-cost runs encode a step once this way to time the engine's C++ without Metal's share.
  struct Dry {};
  Encoder(Device& device, BarrierPolicy policy, Dry);
  ~Encoder();
  Encoder(const Encoder&) = delete;
  Encoder& operator=(const Encoder&) = delete;

  // Encodes kernel `pipeline` over `threadgroups` groups of `threads_per_threadgroup` threads.
  // `reads` and `writes` are the byte ranges the kernel touches; they decide the barriers.
  // `threadgroup_memory[i]` sizes [[threadgroup(i)]] (multiples of 16 bytes).
  void dispatch(const Pipeline& pipeline, const std::vector<Argument>& arguments,
                mtl::Size threadgroups, mtl::Size threads_per_threadgroup,
                const std::vector<BufferRange>& reads, const std::vector<BufferRange>& writes,
                const std::vector<size_t>& threadgroup_memory = {});
  // A dispatch whose barriers the caller places (BarrierPolicy::Manual) from ranges checked when it was planned:
  // no range bookkeeping, no validation beyond Metal's own (the engine's decode step, re-encoded per token).
  // Bindings persist between the dispatches of a compute encoder, so only what changed is set: the pipeline unless
  // `same_pipeline`, and arguments[i] where `rebind[i]`.
  void dispatch_planned(const Pipeline& pipeline, bool same_pipeline, const std::vector<Argument>& arguments,
                        const std::vector<bool>& rebind, mtl::Size threadgroups, mtl::Size threads_per_threadgroup);
  // True until the first dispatch of a fresh compute encoder (nothing bound yet).
  bool encoder_open() const { return static_cast<bool>(encoder_); }
  // Orders everything encoded so far before everything encoded after.
  void barrier();
  // The GPU waits here until `event` reaches `value`.
  void wait_for_event(const Event& event, uint64_t value);
  // The GPU sets `event` to `value` once everything encoded before this call has run.
  void signal_event(const Event& event, uint64_t value);
  // Called once the command buffer has finished, with "" or the failure's description. Runs on
  // a Metal thread on a Mac; must not throw.
  void add_completed_handler(std::function<void(const std::string& error)> handler);
  void commit();
  // Blocks until the command buffer has finished; throws Error with Metal's description if it
  // failed.
  void wait();

  const EncoderCounters& counters() const { return counters_; }

 private:
  void* open_encoder();
  void close_encoder();
  void require_not_committed(const char* what) const;
  void issue_barrier();

  BarrierPolicy policy_;
  bool dry_ = false;
  mtl::Object command_buffer_;
  mtl::Object encoder_;
  bool committed_ = false;
  bool stage_has_dispatches_ = false;
  Stage stage_;  // the ranges of the dispatches since the last barrier (Automatic only)
  EncoderCounters counters_;
};

}  // namespace lily
