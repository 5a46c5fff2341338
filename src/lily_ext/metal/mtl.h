// Lily's Metal binding: the ~40 Metal and Foundation calls the engine needs, made through
// objc_msgSend from plain C++17 (no Objective-C++), so the same code compiles on macOS and on
// Linux, where it runs against the toy runtime and fake Metal of src/test_doubles/objc_toy.
//
// Objects are held by `Object`, an owning (+1) reference. Every function that makes
// autoreleased temporaries (NSString, NSError, command buffers, encoders) runs inside its own
// autorelease pool and retains what it returns, so nothing it hands back depends on a pool.
// Failures raise lily::mtl::Error carrying NSError's localizedDescription.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

#include "../types.h"

namespace lily::mtl {

using NSUInteger = unsigned long;

// MTLSize: three NSUIntegers, passed to Metal by value (lily::Dim3 has that layout).
using Size = Dim3;
static_assert(sizeof(Size) == 3 * sizeof(NSUInteger), "MTLSize is three NSUIntegers");

// Values from Apple's MTLDataType.h, MTLCommandBuffer.h, MTLCommandEncoder.h, MTLResource.h.
enum class DataType : NSUInteger {
  Float = 3,
  Half = 16,
  Int = 29,
  UInt = 33,
  Short = 37,
  UShort = 41,
  Bool = 53,
  BFloat = 121,
};
enum class DispatchType : NSUInteger { Serial = 0, Concurrent = 1 };
enum class CommandBufferStatus : NSUInteger {
  NotEnqueued = 0,
  Enqueued = 1,
  Committed = 2,
  Scheduled = 3,
  Completed = 4,
  Error = 5,
};
constexpr NSUInteger kResourceStorageModeShared = 0;
constexpr NSUInteger kBarrierScopeBuffers = 1;
constexpr NSUInteger kMathModeSafe = 0;

// A Metal or Objective-C failure; what() names the call and carries Metal's description.
using Error = lily::Error;

// An owning reference to an Objective-C object: releases it when the last copy goes.
class Object {
 public:
  Object() = default;
  // Takes over a +1 reference (from new…, alloc, copy, MTLCreateSystemDefaultDevice).
  static Object adopt(void* owned);
  // Retains a borrowed or autoreleased object.
  static Object retain(void* borrowed);
  Object(const Object& other);
  Object(Object&& other) noexcept;
  Object& operator=(Object other) noexcept;
  ~Object();

  void* get() const { return ptr_; }
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  explicit Object(void* ptr) : ptr_(ptr) {}
  void* ptr_ = nullptr;
};

// RAII objc_autoreleasePoolPush/Pop; hold one around every stretch of Metal calls on a thread.
class AutoreleasePool {
 public:
  AutoreleasePool();
  ~AutoreleasePool();
  AutoreleasePool(const AutoreleasePool&) = delete;
  AutoreleasePool& operator=(const AutoreleasePool&) = delete;

 private:
  void* token_;
};

// Device and queue.
Object system_default_device();
std::string device_name(void* device);
Object new_command_queue(void* device);

// Buffers in shared storage (unified memory: `contents` is what the GPU reads).
Object new_buffer(void* device, size_t length);
// Wraps caller-owned memory without copying; Metal requires a page-aligned pointer and a
// length that is a multiple of the page size. The memory must outlive the buffer.
Object new_buffer_no_copy(void* device, void* pointer, size_t length);
void* buffer_contents(void* buffer);
size_t buffer_length(void* buffer);

// Kernel library compiled at run time from source for `metal_version` (__METAL_VERSION__: 310 is
// MTLLanguageVersion3_1), with fast math off (MTLMathModeSafe on macOS 15+, fastMathEnabled = NO before).
Object new_library_with_source(void* device, const std::string& source, unsigned metal_version);
// Whether the device supports Metal 4 tensor ops (MTLGPUFamilyMetal4 and MTLGPUFamilyApple10, M5 class).
bool supports_tensor_ops(void* device);
// Kernel library compiled ahead of time (a .metallib file at `path`, built with fast math off).
Object new_library_with_file(void* device, const std::string& path);
Object new_function_constant_values();
// `value` points at a value of `type` (bool as one byte, Int as int32_t, ...).
void set_function_constant(void* values, const void* value, DataType type, size_t index);
// `constant_values` may be null for a kernel without function constants.
// Throws Error with Metal's description when the library has no such kernel.
Object new_function(void* library, const std::string& name, void* constant_values);
Object new_compute_pipeline(void* device, void* function, const std::string& name);
size_t max_total_threads_per_threadgroup(void* pipeline);
size_t thread_execution_width(void* pipeline);

// Command buffers and compute encoders.
Object new_command_buffer(void* queue);
Object new_compute_encoder(void* command_buffer, DispatchType type);
void set_pipeline(void* encoder, void* pipeline);
void set_buffer(void* encoder, void* buffer, size_t offset, size_t index);
// Binds buffers[i] at offsets[i] to [[buffer(first + i)]] for i < count: one message for a run of indices
// (setBuffers:offsets:withRange:), where setBuffer would send `count`.
void set_buffers(void* encoder, void* const* buffers, const NSUInteger* offsets, size_t first, size_t count);
// The most buffer argument indices a compute kernel has (MTLDevice's limit: [[buffer(0)]] to [[buffer(30)]]).
constexpr size_t kMaxBufferArguments = 31;
// Copies `length` bytes (at most 4 KB) into the command stream at encode time.
void set_bytes(void* encoder, const void* bytes, size_t length, size_t index);
// Threadgroup memory for a [[threadgroup(index)]] parameter; a multiple of 16 bytes.
void set_threadgroup_memory_length(void* encoder, size_t length, size_t index);
void dispatch_threadgroups(void* encoder, Size threadgroups, Size threads_per_threadgroup);
// Orders every buffer access before it against every one after it, within one encoder.
void memory_barrier_buffers(void* encoder);
void end_encoding(void* encoder);

// Runs `handler` (on a Metal thread) once the command buffer has finished; add before commit.
// The handler must not throw.
void add_completed_handler(void* command_buffer, std::function<void(void*)> handler);
void commit(void* command_buffer);
void wait_until_completed(void* command_buffer);
CommandBufferStatus status(void* command_buffer);
// The command buffer's NSError description, or "" when it has none.
std::string error_description(void* command_buffer);
// Throws Error with the command buffer's NSError description if it failed.
void check_succeeded(void* command_buffer);

// Shared events: ordering between command buffers, queues and the CPU.
Object new_shared_event(void* device);
void encode_signal_event(void* command_buffer, void* event, uint64_t value);
void encode_wait_for_event(void* command_buffer, void* event, uint64_t value);
uint64_t signaled_value(void* event);
void set_signaled_value(void* event, uint64_t value);
// True once the event reaches `value`; false after `timeout_ms` milliseconds.
bool wait_until_signaled_value(void* event, uint64_t value, uint64_t timeout_ms);

}  // namespace lily::mtl
