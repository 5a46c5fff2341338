// A fake Metal on the toy Objective-C runtime (Linux only): the classes and selectors Lily's
// binding (src/lily_ext/metal/mtl.cpp) uses, with kernels run on the CPU by the MSL execution
// harness (msl_rt::dispatch).
//
// Command buffers run when committed, in commit order per queue; one that waits for a shared
// event value not yet reached is parked until the event gets there. Inside a concurrent
// encoder the dispatches between two barriers run in reverse encoding order (or shuffled with
// a seed), so a missing barrier between dependent dispatches gives a wrong result in a test.
// API misuse that Metal's validation layer would catch fails the command buffer with a
// "fake Metal validation" error instead of crashing.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../../msl_cpu/msl_rt.h"
#include "../../msl_cpu/registry.h"
#include "fake_metal.h"
#include "objc_toy.h"

namespace {

using objc_toy::make_object;
using objc_toy::Object;

struct MTLSize {
  unsigned long width, height, depth;
};

constexpr unsigned long kMathModeSafe = 0;
constexpr unsigned long kMathModeFast = 2;
constexpr unsigned long kStatusNotEnqueued = 0;
constexpr unsigned long kStatusCommitted = 2;
constexpr unsigned long kStatusCompleted = 4;
constexpr unsigned long kStatusError = 5;
constexpr unsigned long kDispatchTypeConcurrent = 1;
constexpr unsigned long kMaxThreadsPerThreadgroup = 1024;
constexpr unsigned long kSetBytesLimit = 4096;
constexpr unsigned long kMaxBufferArguments = 31;
// Apple-silicon page size: newBufferWithBytesNoCopy needs this alignment on a Mac.
constexpr unsigned long kPageSize = 16384;

// An owning reference inside the fake (retains on copy, releases on destruction).
class Ref {
 public:
  Ref() = default;
  static Ref adopt(id object) { return Ref(object); }
  static Ref retain(id object) { return Ref(object ? objc_toy::retain(object) : nullptr); }
  Ref(const Ref& other) : Ref(other.ptr_ ? objc_toy::retain(other.ptr_) : nullptr) {}
  Ref(Ref&& other) noexcept : ptr_(other.ptr_) { other.ptr_ = nullptr; }
  Ref& operator=(Ref other) noexcept {
    std::swap(ptr_, other.ptr_);
    return *this;
  }
  ~Ref() {
    if (ptr_) objc_toy::release(ptr_);
  }
  id get() const { return ptr_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  explicit Ref(id object) : ptr_(object) {}
  id ptr_ = nullptr;
};

template <class T>
T* self_as(id self) {
  return static_cast<T*>(self);
}

Class class_named(const char* name) { return objc_getClass(name); }

// Foundation

struct NSStringObject : Object {
  std::string text;
};

id new_string(const std::string& text) {
  auto* string = make_object<NSStringObject>(class_named("NSString"));
  string->text = text;
  return string;
}

id string_with_utf8(id, SEL, const char* text) { return objc_toy::autorelease(new_string(text)); }
const char* string_utf8(id self, SEL) { return self_as<NSStringObject>(self)->text.c_str(); }

// Only file URLs: the path of a metallib.
struct NSURLObject : Object {
  std::string path;
};

id url_file_url_with_path(id, SEL, id path) {
  auto* url = make_object<NSURLObject>(class_named("NSURL"));
  url->path = self_as<NSStringObject>(path)->text;
  return objc_toy::autorelease(url);
}

struct NSErrorObject : Object {
  Ref description;
};

// An autoreleased NSError, as Metal hands back through error out-parameters.
id make_error(const std::string& message) {
  auto* error = make_object<NSErrorObject>(class_named("NSError"));
  error->description = Ref::adopt(new_string(message));
  return objc_toy::autorelease(error);
}

id error_localized_description(id self, SEL) {
  return self_as<NSErrorObject>(self)->description.get();
}

// Compile options and function constants

struct CompileOptionsObject : Object {
  unsigned long math_mode = kMathModeFast;  // Metal's default
  unsigned long language_version = 0;       // 0: not set, the OS default
};

void options_set_math_mode(id self, SEL, unsigned long mode) {
  self_as<CompileOptionsObject>(self)->math_mode = mode;
}
void options_set_language_version(id self, SEL, unsigned long version) {
  self_as<CompileOptionsObject>(self)->language_version = version;
}
void options_set_fast_math(id self, SEL, BOOL enabled) {
  self_as<CompileOptionsObject>(self)->math_mode = enabled ? kMathModeFast : kMathModeSafe;
}

struct ConstantValuesObject : Object {
  std::map<int, int64_t> values;
  std::string unsupported;  // the first constant the CPU harness cannot take
};

void constants_set_value(id self, SEL, const void* value, unsigned long type, unsigned long index) {
  auto* constants = self_as<ConstantValuesObject>(self);
  int64_t v = 0;
  switch (type) {
    case 53: v = *static_cast<const bool*>(value) ? 1 : 0; break;  // Bool
    case 29: v = *static_cast<const int32_t*>(value); break;        // Int
    case 33: v = *static_cast<const uint32_t*>(value); break;       // UInt
    case 37: v = *static_cast<const int16_t*>(value); break;        // Short
    case 41: v = *static_cast<const uint16_t*>(value); break;       // UShort
    default:
      if (constants->unsupported.empty()) {
        constants->unsupported = "function constant " + std::to_string(index) + " has MTLDataType " +
                                 std::to_string(type) + ", which the CPU harness does not support";
      }
      return;
  }
  constants->values[static_cast<int>(index)] = v;
}

// Library, function, pipeline

struct LibraryObject : Object {
  std::set<std::string> kernels;
};

struct FunctionObject : Object {
  std::string name;
  std::map<int, int64_t> constants;
};

struct PipelineObject : Object {
  std::string name;
  std::map<int, int64_t> constants;
};

id library_new_function(id self, SEL, id name, id constant_values, id* error) {
  auto* library = self_as<LibraryObject>(self);
  const std::string& kernel = self_as<NSStringObject>(name)->text;
  auto* constants = self_as<ConstantValuesObject>(constant_values);
  std::string problem;
  if (library->kernels.count(kernel) == 0) {
    problem = "Function " + kernel + " was not found in the library";
  } else if (constants == nullptr) {
    problem = "constantValues must not be nil";
  } else if (!constants->unsupported.empty()) {
    problem = constants->unsupported;
  }
  if (!problem.empty()) {
    if (error) *error = make_error(problem);
    return nullptr;
  }
  auto* function = make_object<FunctionObject>(class_named("FakeMTLFunction"));
  function->name = kernel;
  function->constants = constants->values;
  return function;
}

unsigned long pipeline_max_threads(id, SEL) { return kMaxThreadsPerThreadgroup; }
unsigned long pipeline_execution_width(id, SEL) { return 32; }

// Buffers and events

struct BufferObject : Object {
  void* memory = nullptr;
  unsigned long length = 0;
  bool owns_memory = false;
  ~BufferObject() {
    if (owns_memory) std::free(memory);
  }
};

void* buffer_contents(id self, SEL) { return self_as<BufferObject>(self)->memory; }
unsigned long buffer_length(id self, SEL) { return self_as<BufferObject>(self)->length; }

struct EventObject : Object {
  uint64_t value = 0;
};

// The fake GPU: command buffers waiting to run, guarded by one lock.

std::recursive_mutex gpu_mutex;
std::condition_variable_any gpu_progress;
fake_metal::Stats gpu_stats;
fake_metal::StageOrder stage_order = fake_metal::StageOrder::Reverse;
// Off: dispatches are recorded (pipeline, grid, stage) and counted, but neither their bindings are kept nor their
// kernels run, so a host-cost run measures the engine rather than this fake's bookkeeping.
bool execute_kernels = true;
std::mt19937_64 stage_shuffler;

struct Argument {
  Ref buffer;
  unsigned long offset = 0;
  std::shared_ptr<std::vector<std::max_align_t>> bytes;  // setBytes copy, aligned
  unsigned long bytes_length = 0;
  bool bound = false;
};

struct Dispatch {
  Ref pipeline;
  std::vector<Argument> arguments;
  std::vector<size_t> threadgroup_memory_lengths;
  uint32_t threadgroups[3];
  uint32_t threads_per_threadgroup[3];
};

// One command-buffer entry: a compute pass (stages split at barriers), a signal or a wait.
struct Command {
  enum class Kind { Pass, Signal, Wait } kind = Kind::Pass;
  bool concurrent = false;
  std::vector<std::vector<Dispatch>> stages;
  Ref event;
  uint64_t value = 0;
};

struct QueueObject : Object {};

struct CommandBufferObject : Object {
  Ref queue;
  unsigned long status = kStatusNotEnqueued;
  std::vector<Command> commands;
  size_t next_command = 0;
  std::vector<void*> handlers;  // heap copies of the completion blocks
  Ref error;
  std::string validation_error;
  bool encoder_open = false;
  ~CommandBufferObject() {
    for (void* handler : handlers) _Block_release(handler);
  }
};

struct EncoderObject : Object {
  Ref command_buffer;
  size_t command_index = 0;
  Ref pipeline;
  std::vector<Argument> arguments;
  std::vector<size_t> threadgroup_memory_lengths;
  bool ended = false;
};

std::deque<Ref> pending_command_buffers;
bool pumping = false;
bool pump_again = false;

void fail(CommandBufferObject* command_buffer, const std::string& message) {
  if (command_buffer->validation_error.empty()) {
    command_buffer->validation_error = "fake Metal validation: " + message;
  }
}

// Metal wants a buffer's offset aligned to the type the kernel reads through it (a real GPU may fault or read the
// wrong bytes); the CPU would read anywhere. Names the first argument that is not, or "".
std::string misaligned_buffer(const std::string& kernel, const std::vector<Argument>& arguments) {
  const auto* variants = msl_rt::find_kernel(kernel);
  if (!variants) return "";  // msl_rt::dispatch names an unknown kernel
  const msl_rt::KernelVariant& v = variants->front();
  for (size_t i = 0; i < v.params.size(); ++i) {
    const size_t index = size_t(v.attrs[i].index);
    if (v.attrs[i].kind != msl_rt::Attr::buffer || index >= arguments.size()) continue;
    const Argument& argument = arguments[index];
    if (!argument.bound || argument.bytes) continue;
    const auto* buffer = argument.buffer.as<BufferObject>();
    const uintptr_t address = reinterpret_cast<uintptr_t>(buffer->memory) + argument.offset;
    const size_t alignment = msl_rt::buffer_alignment(v.params[i]);
    if (address % alignment) {
      return "[[buffer(" + std::to_string(index) + ")]] at offset " + std::to_string(argument.offset) +
             " is not aligned to its " + std::to_string(alignment) + "-byte elements";
    }
  }
  return "";
}

std::string run_dispatch(const Dispatch& dispatch) {
  if (!execute_kernels) {
    ++gpu_stats.dispatches;
    return "";
  }
  auto* pipeline = dispatch.pipeline.as<PipelineObject>();
  std::string misaligned = misaligned_buffer(pipeline->name, dispatch.arguments);
  if (!misaligned.empty()) return "kernel " + pipeline->name + " failed: " + misaligned;
  std::vector<msl_rt::Binding> bindings(dispatch.arguments.size(), msl_rt::Binding{nullptr, 0, false});
  for (size_t i = 0; i < dispatch.arguments.size(); ++i) {
    const Argument& argument = dispatch.arguments[i];
    if (!argument.bound) continue;
    if (argument.bytes) {
      bindings[i] = msl_rt::Binding{argument.bytes->data(), argument.bytes_length, true};
    } else {
      auto* buffer = argument.buffer.as<BufferObject>();
      bindings[i] = msl_rt::Binding{static_cast<char*>(buffer->memory) + argument.offset,
                                    buffer->length - argument.offset, false};
    }
  }
  msl_rt::DispatchOptions options;
  options.threadgroup_memory_lengths = dispatch.threadgroup_memory_lengths;
  try {
    msl_rt::dispatch(pipeline->name, bindings, dispatch.threadgroups,
                     dispatch.threads_per_threadgroup, pipeline->constants, options);
  } catch (const std::exception& e) {
    return "kernel " + pipeline->name + " failed: " + e.what();
  }
  ++gpu_stats.dispatches;
  return "";
}

// Runs one compute pass; returns the first kernel failure, or "".
std::string run_pass(Command& pass) {
  for (size_t s = 0; s < pass.stages.size(); ++s) {
    std::vector<Dispatch*> order;
    for (Dispatch& d : pass.stages[s]) order.push_back(&d);
    if (pass.concurrent && order.size() > 1) {
      if (stage_order == fake_metal::StageOrder::Reverse) {
        std::reverse(order.begin(), order.end());
      } else {
        std::vector<Dispatch*> encoded = order;
        std::shuffle(order.begin(), order.end(), stage_shuffler);
        // Encoding order would hide a missing barrier; never use it.
        if (order == encoded) std::rotate(order.begin(), order.begin() + 1, order.end());
      }
    }
    for (Dispatch* d : order) {
      std::string failure = run_dispatch(*d);
      if (!failure.empty()) return failure;
    }
    if (s + 1 < pass.stages.size()) ++gpu_stats.barriers;
  }
  return "";
}

// Runs a committed command buffer as far as its event waits allow; true once finished.
bool advance(CommandBufferObject* command_buffer) {
  std::string failure = command_buffer->validation_error;
  while (failure.empty() && command_buffer->next_command < command_buffer->commands.size()) {
    Command& command = command_buffer->commands[command_buffer->next_command];
    if (command.kind == Command::Kind::Wait) {
      if (command.event.as<EventObject>()->value < command.value) return false;
    } else if (command.kind == Command::Kind::Signal) {
      command.event.as<EventObject>()->value = command.value;
    } else {
      failure = run_pass(command);
    }
    ++command_buffer->next_command;
  }
  if (!failure.empty()) {
    command_buffer->status = kStatusError;
    command_buffer->error = Ref::retain(make_error(failure));
  } else {
    command_buffer->status = kStatusCompleted;
  }
  command_buffer->commands.clear();  // drops the buffers and pipelines it kept alive
  ++gpu_stats.command_buffers;
  using Invoke = void (*)(void* block, void* command_buffer);
  struct BlockHeader {
    void* isa;
    int flags;
    int reserved;
    Invoke invoke;
  };
  for (void* handler : command_buffer->handlers) {
    static_cast<BlockHeader*>(handler)->invoke(handler, command_buffer);
    ++gpu_stats.completion_handlers;
  }
  return true;
}

// Runs every pending command buffer that can make progress (commit order within a queue).
void pump() {
  std::lock_guard<std::recursive_mutex> lock(gpu_mutex);
  if (pumping) {
    pump_again = true;  // a completion handler committed or signalled; the outer loop goes on
    return;
  }
  pumping = true;
  // The autoreleased NSErrors made while running need a pool on this thread.
  void* pool = objc_autoreleasePoolPush();
  bool progress = true;
  while (progress || pump_again) {
    progress = false;
    pump_again = false;
    std::set<id> blocked_queues;
    for (auto it = pending_command_buffers.begin(); it != pending_command_buffers.end();) {
      auto* command_buffer = it->as<CommandBufferObject>();
      if (blocked_queues.count(command_buffer->queue.get()) == 0 && advance(command_buffer)) {
        it = pending_command_buffers.erase(it);
        progress = true;
      } else {
        blocked_queues.insert(command_buffer->queue.get());
        ++it;
      }
    }
  }
  objc_autoreleasePoolPop(pool);
  pumping = false;
  gpu_progress.notify_all();
}

// Command buffer methods

id command_buffer_new_encoder(id self, SEL, unsigned long dispatch_type) {
  auto* command_buffer = self_as<CommandBufferObject>(self);
  if (command_buffer->encoder_open) fail(command_buffer, "a new encoder while another is still encoding");
  if (command_buffer->status != kStatusNotEnqueued) fail(command_buffer, "encoding after commit");
  command_buffer->encoder_open = true;
  Command pass;
  pass.concurrent = dispatch_type == kDispatchTypeConcurrent;
  pass.stages.emplace_back();
  command_buffer->commands.push_back(std::move(pass));
  auto* encoder = make_object<EncoderObject>(class_named("FakeMTLComputeCommandEncoder"));
  encoder->command_buffer = Ref::retain(self);
  encoder->command_index = command_buffer->commands.size() - 1;
  return objc_toy::autorelease(encoder);
}

void command_buffer_add_handler(id self, SEL, void* block) {
  auto* command_buffer = self_as<CommandBufferObject>(self);
  if (command_buffer->status != kStatusNotEnqueued) fail(command_buffer, "addCompletedHandler after commit");
  command_buffer->handlers.push_back(_Block_copy(block));
}

void command_buffer_encode_event(CommandBufferObject* command_buffer, Command::Kind kind, id event,
                                 uint64_t value) {
  if (command_buffer->encoder_open) fail(command_buffer, "an event encoded while an encoder is open");
  Command command;
  command.kind = kind;
  command.event = Ref::retain(event);
  command.value = value;
  command_buffer->commands.push_back(std::move(command));
}

void command_buffer_signal(id self, SEL, id event, uint64_t value) {
  command_buffer_encode_event(self_as<CommandBufferObject>(self), Command::Kind::Signal, event, value);
}

void command_buffer_wait(id self, SEL, id event, uint64_t value) {
  command_buffer_encode_event(self_as<CommandBufferObject>(self), Command::Kind::Wait, event, value);
}

void command_buffer_commit(id self, SEL) {
  auto* command_buffer = self_as<CommandBufferObject>(self);
  {
    std::lock_guard<std::recursive_mutex> lock(gpu_mutex);
    if (command_buffer->status != kStatusNotEnqueued) {
      std::fprintf(stderr, "fake Metal: a command buffer was committed twice\n");
      std::abort();  // Metal asserts here too
    }
    if (command_buffer->encoder_open) fail(command_buffer, "commit while an encoder is still encoding");
    command_buffer->status = kStatusCommitted;
    pending_command_buffers.push_back(Ref::retain(self));
  }
  pump();
}

void command_buffer_wait_until_completed(id self, SEL) {
  auto* command_buffer = self_as<CommandBufferObject>(self);
  std::unique_lock<std::recursive_mutex> lock(gpu_mutex);
  if (command_buffer->status == kStatusNotEnqueued) {
    std::fprintf(stderr, "fake Metal: waitUntilCompleted on a command buffer never committed\n");
    std::abort();  // on a GPU this would hang forever
  }
  bool finished = gpu_progress.wait_for(lock, std::chrono::seconds(10), [command_buffer] {
    return command_buffer->status >= kStatusCompleted;
  });
  if (!finished) {
    std::fprintf(stderr, "fake Metal: waitUntilCompleted: the command buffer waits for a shared "
                         "event value that nothing signalled in 10 s (the command buffers of one queue "
                         "run in commit order)\n");
    std::abort();
  }
}

unsigned long command_buffer_status(id self, SEL) {
  std::lock_guard<std::recursive_mutex> lock(gpu_mutex);
  return self_as<CommandBufferObject>(self)->status;
}

id command_buffer_error(id self, SEL) {
  std::lock_guard<std::recursive_mutex> lock(gpu_mutex);
  return self_as<CommandBufferObject>(self)->error.get();
}

// Encoder methods

CommandBufferObject* encoding_target(EncoderObject* encoder) {
  auto* command_buffer = encoder->command_buffer.as<CommandBufferObject>();
  if (encoder->ended) fail(command_buffer, "encoder used after endEncoding");
  return command_buffer;
}

void encoder_set_pipeline(id self, SEL, id pipeline) {
  auto* encoder = self_as<EncoderObject>(self);
  encoding_target(encoder);
  encoder->pipeline = Ref::retain(pipeline);
}

Argument& argument_slot(EncoderObject* encoder, unsigned long index) {
  if (encoder->arguments.size() <= index) encoder->arguments.resize(index + 1);
  return encoder->arguments[index];
}

// Metal's argument table holds [[buffer(0)]] to [[buffer(30)]]; a binding past it fails the command buffer.
bool buffer_index_fits(CommandBufferObject* command_buffer, const char* call, unsigned long end) {
  if (end <= kMaxBufferArguments) return true;
  fail(command_buffer, std::string(call) + " up to index " + std::to_string(end - 1) + " (buffer indices end at " +
                           std::to_string(kMaxBufferArguments - 1) + ")");
  return false;
}

void encoder_set_buffer(id self, SEL, id buffer, unsigned long offset, unsigned long index) {
  auto* encoder = self_as<EncoderObject>(self);
  auto* command_buffer = encoding_target(encoder);
  if (!buffer_index_fits(command_buffer, "setBuffer", index + 1)) return;
  if (buffer != nullptr && offset > self_as<BufferObject>(buffer)->length) {
    fail(command_buffer, "setBuffer offset " + std::to_string(offset) + " beyond the buffer's " +
                             std::to_string(self_as<BufferObject>(buffer)->length) + " bytes");
    return;
  }
  if (!execute_kernels) return;  // nothing will read the binding
  Argument& slot = argument_slot(encoder, index);
  slot = Argument{};
  slot.buffer = Ref::retain(buffer);
  slot.offset = offset;
  slot.bound = buffer != nullptr;
}

struct NSRange {
  unsigned long location;
  unsigned long length;
};

void encoder_set_buffers(id self, SEL, const id* buffers, const unsigned long* offsets, NSRange range) {
  auto* command_buffer = encoding_target(self_as<EncoderObject>(self));
  if (!buffer_index_fits(command_buffer, "setBuffers", range.location + range.length)) return;
  for (unsigned long i = 0; i < range.length; ++i) {
    encoder_set_buffer(self, nullptr, buffers[i], offsets[i], range.location + i);
  }
}

void encoder_set_bytes(id self, SEL, const void* bytes, unsigned long length, unsigned long index) {
  auto* encoder = self_as<EncoderObject>(self);
  auto* command_buffer = encoding_target(encoder);
  if (!buffer_index_fits(command_buffer, "setBytes", index + 1)) return;
  if (length > kSetBytesLimit) {
    fail(command_buffer, "setBytes of " + std::to_string(length) + " bytes (limit 4096)");
    return;
  }
  if (!execute_kernels) return;  // nothing will read the bytes
  Argument& slot = argument_slot(encoder, index);
  slot = Argument{};
  size_t words = (length + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t);
  slot.bytes = std::make_shared<std::vector<std::max_align_t>>(std::max<size_t>(words, 1));
  std::memcpy(slot.bytes->data(), bytes, length);  // Metal copies at encode time
  slot.bytes_length = length;
  slot.bound = true;
}

void encoder_set_threadgroup_memory(id self, SEL, unsigned long length, unsigned long index) {
  auto* encoder = self_as<EncoderObject>(self);
  auto* command_buffer = encoding_target(encoder);
  if (length % 16 != 0 || length > 32768) {
    fail(command_buffer, "threadgroup memory of " + std::to_string(length) +
                             " bytes (a multiple of 16, at most 32 KB)");
    return;
  }
  if (encoder->threadgroup_memory_lengths.size() <= index) {
    encoder->threadgroup_memory_lengths.resize(index + 1, 0);
  }
  encoder->threadgroup_memory_lengths[index] = length;
}

void encoder_dispatch(id self, SEL, MTLSize threadgroups, MTLSize threads) {
  auto* encoder = self_as<EncoderObject>(self);
  auto* command_buffer = encoding_target(encoder);
  if (!encoder->pipeline.get()) {
    fail(command_buffer, "dispatch without a compute pipeline state");
    return;
  }
  if (threads.width * threads.height * threads.depth > kMaxThreadsPerThreadgroup) {
    fail(command_buffer, "dispatch of " + std::to_string(threads.width * threads.height * threads.depth) +
                             " threads per threadgroup exceeds the pipeline's 1024");
    return;
  }
  Dispatch dispatch;
  dispatch.pipeline = encoder->pipeline;
  if (execute_kernels) dispatch.arguments = encoder->arguments;  // stubbed: recorded without its bindings
  dispatch.threadgroup_memory_lengths = encoder->threadgroup_memory_lengths;
  const unsigned long groups[3] = {threadgroups.width, threadgroups.height, threadgroups.depth};
  const unsigned long per_group[3] = {threads.width, threads.height, threads.depth};
  for (int i = 0; i < 3; ++i) {
    dispatch.threadgroups[i] = static_cast<uint32_t>(groups[i]);
    dispatch.threads_per_threadgroup[i] = static_cast<uint32_t>(per_group[i]);
  }
  command_buffer->commands[encoder->command_index].stages.back().push_back(std::move(dispatch));
}

void encoder_memory_barrier(id self, SEL, unsigned long scope) {
  auto* encoder = self_as<EncoderObject>(self);
  auto* command_buffer = encoding_target(encoder);
  if ((scope & 1) == 0) {
    fail(command_buffer, "memoryBarrierWithScope: without MTLBarrierScopeBuffers");
    return;
  }
  command_buffer->commands[encoder->command_index].stages.emplace_back();
}

void encoder_end_encoding(id self, SEL) {
  auto* encoder = self_as<EncoderObject>(self);
  auto* command_buffer = encoding_target(encoder);
  encoder->ended = true;
  command_buffer->encoder_open = false;
}

// Device methods

bool tensor_ops = false;  // answer of supportsFamily: for the Metal 4 tensor-op family (test control)

// An Apple9-class GPU by default; set_tensor_ops(true) makes it M5-class (Apple10 and Metal4, the tensor-op families).
BOOL device_supports_family(id, SEL, unsigned long family) {
  if (family == fake_metal::kTensorOpsFamily || family == fake_metal::kMetal4Family) return tensor_ops;
  return family < fake_metal::kTensorOpsFamily;
}

id device_name(id, SEL) { return objc_toy::autorelease(new_string("Lily fake Metal (CPU harness)")); }

id device_new_queue(id, SEL) { return make_object<QueueObject>(class_named("FakeMTLCommandQueue")); }

id queue_command_buffer(id self, SEL) {
  auto* command_buffer = make_object<CommandBufferObject>(class_named("FakeMTLCommandBuffer"));
  command_buffer->queue = Ref::retain(self);
  return objc_toy::autorelease(command_buffer);
}

id device_new_buffer(id, SEL, unsigned long length, unsigned long options) {
  if (options != 0 || length == 0) return nullptr;  // Lily uses shared storage only
  auto* buffer = make_object<BufferObject>(class_named("FakeMTLBuffer"));
  size_t rounded = (length + kPageSize - 1) / kPageSize * kPageSize;
  buffer->memory = std::aligned_alloc(kPageSize, rounded);
  std::memset(buffer->memory, 0, rounded);  // Metal zero-fills new buffers
  buffer->length = length;
  buffer->owns_memory = true;
  return buffer;
}

id device_new_buffer_no_copy(id, SEL, void* pointer, unsigned long length, unsigned long options,
                             void* deallocator) {
  if (options != 0 || deallocator != nullptr || length == 0 || length % kPageSize != 0 ||
      reinterpret_cast<uintptr_t>(pointer) % kPageSize != 0) {
    return nullptr;
  }
  auto* buffer = make_object<BufferObject>(class_named("FakeMTLBuffer"));
  buffer->memory = pointer;
  buffer->length = length;
  return buffer;
}

// The CPU harness cannot compile MSL, so an #error outside every #if block stands for a compile
// error: "FILE:LINE: error: MESSAGE" (FILE from the last #line, else program_source), or "" when there is none.
std::string unconditional_error_directive(const std::string& text) {
  int depth = 0;
  size_t line_number = 0;
  std::string file = "program_source";
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    ++line_number;
    size_t first = text.find_first_not_of(" \t", start);
    if (first < end && text[first] == '#') {
      size_t word = text.find_first_not_of(" \t", first + 1);
      auto directive = [&](const char* name) {
        return word < end && text.compare(word, std::strlen(name), name) == 0;
      };
      if (directive("line")) {  // #line N "file": the next line is line N of file
        size_t number = text.find_first_not_of(" \t", word + 4);
        line_number = std::strtoul(text.c_str() + number, nullptr, 10) - 1;
        size_t quote = text.find('"', number);
        if (quote < end) file = text.substr(quote + 1, text.find('"', quote + 1) - quote - 1);
      } else if (directive("if")) {
        ++depth;  // #if, #ifdef, #ifndef
      } else if (directive("endif")) {
        --depth;
      } else if (directive("error") && depth == 0) {
        size_t message = text.find_first_not_of(" \t", word + 5);
        return file + ":" + std::to_string(line_number) + ": error: " +
               (message < end ? text.substr(message, end - message) : std::string());
      }
    }
    start = end + 1;
  }
  return "";
}

id device_new_library(id, SEL, id source, id options, id* error) {
  const std::string& text = self_as<NSStringObject>(source)->text;
  auto* compile_options = self_as<CompileOptionsObject>(options);
  std::string problem;
  if (compile_options == nullptr || compile_options->math_mode != kMathModeSafe) {
    problem = "fake Metal: compile with fast math off (MTLMathModeSafe); the kernels are tested without it";
  } else if (compile_options->language_version == 0) {
    problem = "fake Metal: set the language version; the OS default differs from one macOS to the next";
  } else if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    problem = "program_source: error: the kernel source is empty";
  } else {
    problem = unconditional_error_directive(text);
  }
  if (!problem.empty()) {
    if (error) *error = make_error(problem);
    return nullptr;
  }
  auto* library = make_object<LibraryObject>(class_named("FakeMTLLibrary"));
  // The harness's kernels stand for the compiled source: those of the .metal files it names in #line directives
  // (a family's library, as tools/msl2cpu.py --embed writes it), else all of them, test-only ones too.
  std::set<std::string> files;
  for (size_t at = text.find("#line "); at != std::string::npos; at = text.find("#line ", at + 1)) {
    size_t open = text.find('"', at), close = open == std::string::npos ? open : text.find('"', open + 1);
    if (close == std::string::npos || text.find('\n', at) < close) continue;
    std::string file = text.substr(open + 1, close - open - 1);
    file = file.substr(file.rfind('/') + 1);  // the registry keeps the file name only
    if (file.size() > 6 && file.compare(file.size() - 6, 6, ".metal") == 0) files.insert(file);
  }
  for (const std::vector<std::string>& names : {msl_rt::kernel_names(), msl_rt::test_kernel_names()}) {
    for (const std::string& name : names) {
      if (files.empty() || files.count(msl_rt::find_kernel(name)->front().source)) library->kernels.insert(name);
    }
  }
  return library;
}

// True when `name` occurs in `text` as a whole identifier.
bool names_identifier(const std::string& text, const std::string& name) {
  auto is_word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t at = text.find(name); at != std::string::npos; at = text.find(name, at + 1)) {
    bool starts = at == 0 || !is_word(text[at - 1]);
    bool ends = at + name.size() == text.size() || !is_word(text[at + name.size()]);
    if (starts && ends) return true;
  }
  return false;
}

// A stand-in metallib: the real format's "MTLB" magic followed by MSL source. The library holds
// the harness kernels that source names, so a test can tell which file the kernels came from.
id device_new_library_with_url(id, SEL, id url, id* error) {
  const std::string& path = self_as<NSURLObject>(url)->path;
  std::string problem;
  std::string text;
  if (std::FILE* file = std::fopen(path.c_str(), "rb")) {
    char chunk[4096];
    for (size_t got; (got = std::fread(chunk, 1, sizeof chunk, file)) > 0;) text.append(chunk, got);
    // A directory opens on Linux and fails on the first read.
    bool unreadable = std::ferror(file);
    int read_error = errno;
    std::fclose(file);
    if (unreadable) {
      problem = "Invalid library file: " + path + " cannot be read (" + std::strerror(read_error) + ")";
    } else if (text.compare(0, 4, "MTLB") != 0) {
      problem = "Invalid library file: " + path + " is not a metallib (no MTLB header)";
    }
  } else {
    problem = "Invalid library file: " + path + " cannot be read (" + std::strerror(errno) + ")";
  }
  if (!problem.empty()) {
    if (error) *error = make_error(problem);
    return nullptr;
  }
  auto* library = make_object<LibraryObject>(class_named("FakeMTLLibrary"));
  for (const std::vector<std::string>& names : {msl_rt::kernel_names(), msl_rt::test_kernel_names()}) {
    for (const std::string& name : names) {
      if (names_identifier(text, name)) library->kernels.insert(name);
    }
  }
  return library;
}

id device_new_pipeline(id, SEL, id function_object, id*) {
  auto* function = self_as<FunctionObject>(function_object);
  auto* pipeline = make_object<PipelineObject>(class_named("FakeMTLComputePipelineState"));
  pipeline->name = function->name;
  pipeline->constants = function->constants;
  return pipeline;
}

id device_new_event(id, SEL) { return make_object<EventObject>(class_named("FakeMTLSharedEvent")); }

uint64_t event_value(id self, SEL) {
  std::lock_guard<std::recursive_mutex> lock(gpu_mutex);
  return self_as<EventObject>(self)->value;
}

void event_set_value(id self, SEL, uint64_t value) {
  {
    std::lock_guard<std::recursive_mutex> lock(gpu_mutex);
    self_as<EventObject>(self)->value = value;
  }
  pump();
}

BOOL event_wait(id self, SEL, uint64_t value, uint64_t timeout_ms) {
  auto* event = self_as<EventObject>(self);
  std::unique_lock<std::recursive_mutex> lock(gpu_mutex);
  return gpu_progress.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                               [event, value] { return event->value >= value; });
}

template <class T>
id allocate(Class cls) {
  return make_object<T>(cls);
}

template <class F>
void method(Class cls, const char* selector, F* imp, bool class_method = false) {
  objc_toy::add_method(cls, selector, reinterpret_cast<void*>(imp), class_method);
}

}  // namespace

namespace objc_toy {

// Defines the fake classes; runs inside objc_getClass's first call, so it must not call it.
void load_images() {
  Class root = root_class();
  Class string = define_class("NSString", root);
  method(string, "stringWithUTF8String:", string_with_utf8, true);
  method(string, "UTF8String", string_utf8);
  Class url = define_class("NSURL", root);
  method(url, "fileURLWithPath:", url_file_url_with_path, true);
  Class error = define_class("NSError", root);
  method(error, "localizedDescription", error_localized_description);

  Class options = define_class("MTLCompileOptions", root);
  set_allocator(options, allocate<CompileOptionsObject>);
  method(options, "setMathMode:", options_set_math_mode);
  method(options, "setLanguageVersion:", options_set_language_version);
  method(options, "setFastMathEnabled:", options_set_fast_math);
  Class constants = define_class("MTLFunctionConstantValues", root);
  set_allocator(constants, allocate<ConstantValuesObject>);
  method(constants, "setConstantValue:type:atIndex:", constants_set_value);

  Class device = define_class("FakeMTLDevice", root);
  method(device, "name", device_name);
  method(device, "supportsFamily:", device_supports_family);
  method(device, "newCommandQueue", device_new_queue);
  method(device, "newBufferWithLength:options:", device_new_buffer);
  method(device, "newBufferWithBytesNoCopy:length:options:deallocator:", device_new_buffer_no_copy);
  method(device, "newLibraryWithSource:options:error:", device_new_library);
  method(device, "newLibraryWithURL:error:", device_new_library_with_url);
  method(device, "newComputePipelineStateWithFunction:error:", device_new_pipeline);
  method(device, "newSharedEvent", device_new_event);
  Class queue = define_class("FakeMTLCommandQueue", root);
  method(queue, "commandBuffer", queue_command_buffer);
  Class library = define_class("FakeMTLLibrary", root);
  method(library, "newFunctionWithName:constantValues:error:", library_new_function);
  define_class("FakeMTLFunction", root);
  Class pipeline = define_class("FakeMTLComputePipelineState", root);
  method(pipeline, "maxTotalThreadsPerThreadgroup", pipeline_max_threads);
  method(pipeline, "threadExecutionWidth", pipeline_execution_width);
  Class buffer = define_class("FakeMTLBuffer", root);
  method(buffer, "contents", buffer_contents);
  method(buffer, "length", buffer_length);
  Class event = define_class("FakeMTLSharedEvent", root);
  method(event, "signaledValue", event_value);
  method(event, "setSignaledValue:", event_set_value);
  method(event, "waitUntilSignaledValue:timeoutMS:", event_wait);

  Class command_buffer = define_class("FakeMTLCommandBuffer", root);
  method(command_buffer, "computeCommandEncoderWithDispatchType:", command_buffer_new_encoder);
  method(command_buffer, "addCompletedHandler:", command_buffer_add_handler);
  method(command_buffer, "encodeSignalEvent:value:", command_buffer_signal);
  method(command_buffer, "encodeWaitForEvent:value:", command_buffer_wait);
  method(command_buffer, "commit", command_buffer_commit);
  method(command_buffer, "waitUntilCompleted", command_buffer_wait_until_completed);
  method(command_buffer, "status", command_buffer_status);
  method(command_buffer, "error", command_buffer_error);
  Class encoder = define_class("FakeMTLComputeCommandEncoder", root);
  method(encoder, "setComputePipelineState:", encoder_set_pipeline);
  method(encoder, "setBuffer:offset:atIndex:", encoder_set_buffer);
  method(encoder, "setBuffers:offsets:withRange:", encoder_set_buffers);
  method(encoder, "setBytes:length:atIndex:", encoder_set_bytes);
  method(encoder, "setThreadgroupMemoryLength:atIndex:", encoder_set_threadgroup_memory);
  method(encoder, "dispatchThreadgroups:threadsPerThreadgroup:", encoder_dispatch);
  method(encoder, "memoryBarrierWithScope:", encoder_memory_barrier);
  method(encoder, "endEncoding", encoder_end_encoding);
}

}  // namespace objc_toy

extern "C" id MTLCreateSystemDefaultDevice(void) {
  return make_object<Object>(objc_getClass("FakeMTLDevice"));
}

namespace fake_metal {

void set_kernel_execution(bool execute) { execute_kernels = execute; }

void set_tensor_ops(bool supported) { tensor_ops = supported; }

void set_stage_order(StageOrder order, uint64_t seed) {
  std::lock_guard<std::recursive_mutex> lock(gpu_mutex);
  stage_order = order;
  stage_shuffler.seed(seed);
}

Stats stats() {
  std::lock_guard<std::recursive_mutex> lock(gpu_mutex);
  return gpu_stats;
}

void reset_stats() {
  std::lock_guard<std::recursive_mutex> lock(gpu_mutex);
  gpu_stats = Stats{};
}

}  // namespace fake_metal
