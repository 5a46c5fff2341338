// The objc_msgSend binding (see mtl.h). Each call casts objc_msgSend to the exact C function
// type of the method: receiver and selector first, NSUInteger for every integer, MTLSize by
// value, and no struct returns (x86-64 would need objc_msgSend_stret for those).
#include "mtl.h"

#include <atomic>
#include <cstdio>
#include <exception>
#include <utility>

#include "objc_api.h"

namespace lily::mtl {
namespace {

// Sends `sel` to `receiver` through objc_msgSend cast to R(id, SEL, Args...). Never variadic:
// on arm64 variadic arguments travel on the stack, where the method does not look.
template <class R, class... Args>
R send(const void* receiver, SEL sel, Args... args) {
  using Method = R (*)(const void*, SEL, Args...);
  return reinterpret_cast<Method>(&objc_msgSend)(receiver, sel, args...);
}

// Selectors, registered once when the library loads.
namespace sel {
const SEL alloc = sel_registerName("alloc");
const SEL init = sel_registerName("init");
const SEL retain = sel_registerName("retain");
const SEL release = sel_registerName("release");
const SEL responds_to_selector = sel_registerName("respondsToSelector:");
const SEL string_with_utf8 = sel_registerName("stringWithUTF8String:");
const SEL utf8_string = sel_registerName("UTF8String");
const SEL localized_description = sel_registerName("localizedDescription");
const SEL name = sel_registerName("name");
const SEL new_command_queue = sel_registerName("newCommandQueue");
const SEL new_buffer = sel_registerName("newBufferWithLength:options:");
const SEL new_buffer_no_copy = sel_registerName("newBufferWithBytesNoCopy:length:options:deallocator:");
const SEL contents = sel_registerName("contents");
const SEL length = sel_registerName("length");
const SEL set_math_mode = sel_registerName("setMathMode:");
const SEL set_fast_math_enabled = sel_registerName("setFastMathEnabled:");
const SEL set_language_version = sel_registerName("setLanguageVersion:");
const SEL supports_family = sel_registerName("supportsFamily:");
const SEL new_library_with_source = sel_registerName("newLibraryWithSource:options:error:");
const SEL file_url_with_path = sel_registerName("fileURLWithPath:");
const SEL new_library_with_url = sel_registerName("newLibraryWithURL:error:");
const SEL set_constant_value = sel_registerName("setConstantValue:type:atIndex:");
const SEL new_function = sel_registerName("newFunctionWithName:constantValues:error:");
const SEL new_pipeline = sel_registerName("newComputePipelineStateWithFunction:error:");
const SEL max_total_threads = sel_registerName("maxTotalThreadsPerThreadgroup");
const SEL thread_execution_width = sel_registerName("threadExecutionWidth");
const SEL command_buffer = sel_registerName("commandBuffer");
const SEL compute_encoder = sel_registerName("computeCommandEncoderWithDispatchType:");
const SEL set_pipeline = sel_registerName("setComputePipelineState:");
const SEL set_buffer = sel_registerName("setBuffer:offset:atIndex:");
const SEL set_buffers = sel_registerName("setBuffers:offsets:withRange:");
const SEL set_bytes = sel_registerName("setBytes:length:atIndex:");
const SEL set_threadgroup_memory = sel_registerName("setThreadgroupMemoryLength:atIndex:");
const SEL dispatch = sel_registerName("dispatchThreadgroups:threadsPerThreadgroup:");
const SEL memory_barrier = sel_registerName("memoryBarrierWithScope:");
const SEL end_encoding = sel_registerName("endEncoding");
const SEL add_completed_handler = sel_registerName("addCompletedHandler:");
const SEL commit = sel_registerName("commit");
const SEL wait_until_completed = sel_registerName("waitUntilCompleted");
const SEL status = sel_registerName("status");
const SEL error = sel_registerName("error");
const SEL new_shared_event = sel_registerName("newSharedEvent");
const SEL encode_signal = sel_registerName("encodeSignalEvent:value:");
const SEL encode_wait = sel_registerName("encodeWaitForEvent:value:");
const SEL signaled_value = sel_registerName("signaledValue");
const SEL set_signaled_value = sel_registerName("setSignaledValue:");
const SEL wait_until_signaled = sel_registerName("waitUntilSignaledValue:timeoutMS:");
}  // namespace sel

// Looked up on first use (a class is registered once its framework has loaded).
Class lookup_class(const char* name) {
  Class cls = reinterpret_cast<Class>(objc_getClass(name));
  if (cls == nullptr) throw Error(std::string("[metal] Objective-C class not found: ") + name);
  return cls;
}

Class ns_string_class() {
  static Class cls = lookup_class("NSString");
  return cls;
}

// An autoreleased NSString; call inside an autorelease pool.
void* make_ns_string(const std::string& text) {
  return send<void*>(ns_string_class(), sel::string_with_utf8, text.c_str());
}

std::string to_std_string(void* ns_string) {
  if (ns_string == nullptr) return "";
  const char* utf8 = send<const char*>(ns_string, sel::utf8_string);
  return utf8 ? utf8 : "";
}

std::string describe_error(void* ns_error) {
  if (ns_error == nullptr) return "no NSError given";
  return to_std_string(send<void*>(ns_error, sel::localized_description));
}

// Adopts the +1 result of a `new…:error:` call, or throws with the NSError's description.
Object adopt_or_throw(void* result, void* ns_error, const std::string& what) {
  if (result == nullptr) throw Error("[metal] " + what + ": " + describe_error(ns_error));
  return Object::adopt(result);
}

// A hand-built block literal (clang's Block ABI), so no -fblocks and no BlocksRuntime library
// are needed: `box` holds the C++ handler, shared by the stack literal and Metal's heap copy
// through a reference count that the copy and dispose helpers maintain.
struct HandlerBox {
  std::atomic<int> references{1};
  std::function<void(void*)> handler;
};

struct BlockDescriptor {
  unsigned long reserved;
  unsigned long size;
  void (*copy)(void* dst, const void* src);
  void (*dispose)(const void* block);
  const char* signature;
};

struct CompletionBlock {
  void* isa;
  int flags;
  int reserved;
  void (*invoke)(void* self, void* command_buffer);
  const BlockDescriptor* descriptor;
  HandlerBox* box;
};

constexpr int kBlockHasCopyDispose = 1 << 25;
constexpr int kBlockHasSignature = 1 << 30;

void release_box(HandlerBox* box) {
  if (box->references.fetch_sub(1) == 1) delete box;
}

void copy_completion_block(void* dst, const void* src) {
  auto* source = static_cast<const CompletionBlock*>(src);
  static_cast<CompletionBlock*>(dst)->box = source->box;
  source->box->references.fetch_add(1);
}

void dispose_completion_block(const void* block) {
  release_box(static_cast<const CompletionBlock*>(block)->box);
}

void invoke_completion_block(void* self, void* command_buffer) noexcept {
  static_cast<CompletionBlock*>(self)->box->handler(command_buffer);
}

// Type encoding of void (^)(id<MTLCommandBuffer>).
const BlockDescriptor completion_block_descriptor = {
    0, sizeof(CompletionBlock), copy_completion_block, dispose_completion_block, "v16@?0@8"};

}  // namespace

Object Object::adopt(void* owned) { return Object(owned); }

Object Object::retain(void* borrowed) {
  if (borrowed != nullptr) send<void*>(borrowed, sel::retain);
  return Object(borrowed);
}

Object::Object(const Object& other) : ptr_(other.ptr_) {
  if (ptr_ != nullptr) send<void*>(ptr_, sel::retain);
}

Object::Object(Object&& other) noexcept : ptr_(std::exchange(other.ptr_, nullptr)) {}

Object& Object::operator=(Object other) noexcept {
  std::swap(ptr_, other.ptr_);
  return *this;
}

Object::~Object() {
  if (ptr_ != nullptr) send<void>(ptr_, sel::release);
}

AutoreleasePool::AutoreleasePool() : token_(objc_autoreleasePoolPush()) {}
AutoreleasePool::~AutoreleasePool() { objc_autoreleasePoolPop(token_); }

Object system_default_device() {
  void* device = MTLCreateSystemDefaultDevice();
  if (device == nullptr) throw Error("[metal] MTLCreateSystemDefaultDevice found no Metal device");
  return Object::adopt(device);
}

std::string device_name(void* device) {
  AutoreleasePool pool;
  return to_std_string(send<void*>(device, sel::name));
}

Object new_command_queue(void* device) {
  void* queue = send<void*>(device, sel::new_command_queue);
  if (queue == nullptr) throw Error("[metal] newCommandQueue returned nil");
  return Object::adopt(queue);
}

Object new_buffer(void* device, size_t length) {
  void* buffer = send<void*>(device, sel::new_buffer, static_cast<NSUInteger>(length),
                             kResourceStorageModeShared);
  if (buffer == nullptr) {
    throw Error("[metal] newBufferWithLength failed for " + std::to_string(length) + " bytes");
  }
  return Object::adopt(buffer);
}

Object new_buffer_no_copy(void* device, void* pointer, size_t length) {
  // A nil deallocator block: the caller keeps ownership of the memory.
  void* buffer = send<void*>(device, sel::new_buffer_no_copy, pointer,
                             static_cast<NSUInteger>(length), kResourceStorageModeShared,
                             static_cast<void*>(nullptr));
  if (buffer == nullptr) {
    throw Error("[metal] newBufferWithBytesNoCopy refused " + std::to_string(length) +
                " bytes: the pointer must be page-aligned and the length a multiple of the page size");
  }
  return Object::adopt(buffer);
}

void* buffer_contents(void* buffer) { return send<void*>(buffer, sel::contents); }

size_t buffer_length(void* buffer) { return send<NSUInteger>(buffer, sel::length); }

Object new_library_with_source(void* device, const std::string& source, unsigned metal_version) {
  AutoreleasePool pool;
  static Class compile_options_class = lookup_class("MTLCompileOptions");
  Object options = Object::adopt(
      send<void*>(send<void*>(compile_options_class, sel::alloc), sel::init));
  // Metal compiles with fast math on by default; Lily's kernels are tested without it.
  if (send<BOOL>(options.get(), sel::responds_to_selector, sel::set_math_mode)) {
    send<void>(options.get(), sel::set_math_mode, kMathModeSafe);
  } else {
    send<void>(options.get(), sel::set_fast_math_enabled, static_cast<BOOL>(false));
  }
  // An explicit version: the OS default would be Metal 4 on macOS 26 and 3.0 (no bfloat) on macOS 13.
  const NSUInteger language_version = (metal_version / 100) << 16 | (metal_version / 10 % 10);
  send<void>(options.get(), sel::set_language_version, language_version);
  void* error = nullptr;
  void* library = send<void*>(device, sel::new_library_with_source, make_ns_string(source),
                              options.get(), &error);
  return adopt_or_throw(library, error, "cannot compile the kernel library");
}

bool supports_tensor_ops(void* device) {
  constexpr long kGPUFamilyApple10 = 1010, kGPUFamilyMetal4 = 5002;  // MTLGPUFamily (macOS 26 SDK)
  return send<BOOL>(device, sel::supports_family, kGPUFamilyMetal4) &&
         send<BOOL>(device, sel::supports_family, kGPUFamilyApple10);
}

Object new_library_with_file(void* device, const std::string& path) {
  AutoreleasePool pool;
  static Class url_class = lookup_class("NSURL");
  void* url = send<void*>(url_class, sel::file_url_with_path, make_ns_string(path));
  void* error = nullptr;
  void* library = send<void*>(device, sel::new_library_with_url, url, &error);
  return adopt_or_throw(library, error, "cannot load the kernel library " + path);
}

Object new_function_constant_values() {
  static Class values_class = lookup_class("MTLFunctionConstantValues");
  return Object::adopt(send<void*>(send<void*>(values_class, sel::alloc), sel::init));
}

void set_function_constant(void* values, const void* value, DataType type, size_t index) {
  send<void>(values, sel::set_constant_value, value, static_cast<NSUInteger>(type),
             static_cast<NSUInteger>(index));
}

Object new_function(void* library, const std::string& name, void* constant_values) {
  AutoreleasePool pool;
  Object no_constants;
  if (constant_values == nullptr) {
    no_constants = new_function_constant_values();
    constant_values = no_constants.get();
  }
  void* error = nullptr;
  void* function =
      send<void*>(library, sel::new_function, make_ns_string(name), constant_values, &error);
  return adopt_or_throw(function, error, "cannot create kernel '" + name + "'");
}

Object new_compute_pipeline(void* device, void* function, const std::string& name) {
  AutoreleasePool pool;
  void* error = nullptr;
  void* pipeline = send<void*>(device, sel::new_pipeline, function, &error);
  return adopt_or_throw(pipeline, error, "cannot create the pipeline of kernel '" + name + "'");
}

size_t max_total_threads_per_threadgroup(void* pipeline) {
  return send<NSUInteger>(pipeline, sel::max_total_threads);
}

size_t thread_execution_width(void* pipeline) {
  return send<NSUInteger>(pipeline, sel::thread_execution_width);
}

Object new_command_buffer(void* queue) {
  AutoreleasePool pool;
  void* command_buffer = send<void*>(queue, sel::command_buffer);
  if (command_buffer == nullptr) throw Error("[metal] commandBuffer returned nil");
  return Object::retain(command_buffer);
}

Object new_compute_encoder(void* command_buffer, DispatchType type) {
  AutoreleasePool pool;
  void* encoder = send<void*>(command_buffer, sel::compute_encoder, static_cast<NSUInteger>(type));
  if (encoder == nullptr) throw Error("[metal] computeCommandEncoderWithDispatchType returned nil");
  return Object::retain(encoder);
}

void set_pipeline(void* encoder, void* pipeline) { send<void>(encoder, sel::set_pipeline, pipeline); }

void set_buffer(void* encoder, void* buffer, size_t offset, size_t index) {
  send<void>(encoder, sel::set_buffer, buffer, static_cast<NSUInteger>(offset),
             static_cast<NSUInteger>(index));
}

// NSRange: location and length, passed by value (two registers on arm64 and x86-64).
struct Range {
  NSUInteger location;
  NSUInteger length;
};

void set_buffers(void* encoder, void* const* buffers, const NSUInteger* offsets, size_t first, size_t count) {
  send<void>(encoder, sel::set_buffers, buffers, offsets, Range{first, count});
}

void set_bytes(void* encoder, const void* bytes, size_t length, size_t index) {
  if (length > 4096) {
    throw Error("[metal] setBytes takes at most 4096 bytes; got " + std::to_string(length) +
                " at index " + std::to_string(index));
  }
  send<void>(encoder, sel::set_bytes, bytes, static_cast<NSUInteger>(length),
             static_cast<NSUInteger>(index));
}

void set_threadgroup_memory_length(void* encoder, size_t length, size_t index) {
  if (length % 16 != 0) {
    throw Error("[metal] threadgroup memory length must be a multiple of 16 bytes; got " +
                std::to_string(length) + " at index " + std::to_string(index));
  }
  send<void>(encoder, sel::set_threadgroup_memory, static_cast<NSUInteger>(length),
             static_cast<NSUInteger>(index));
}

void dispatch_threadgroups(void* encoder, Size threadgroups, Size threads_per_threadgroup) {
  send<void>(encoder, sel::dispatch, threadgroups, threads_per_threadgroup);
}

void memory_barrier_buffers(void* encoder) {
  send<void>(encoder, sel::memory_barrier, kBarrierScopeBuffers);
}

void end_encoding(void* encoder) { send<void>(encoder, sel::end_encoding); }

void add_completed_handler(void* command_buffer, std::function<void(void*)> handler) {
  auto* box = new HandlerBox;
  box->handler = std::move(handler);
  CompletionBlock block = {_NSConcreteStackBlock, kBlockHasCopyDispose | kBlockHasSignature, 0,
                           invoke_completion_block, &completion_block_descriptor, box};
  // Metal copies the block (Block_copy), which takes its own reference to the box.
  send<void>(command_buffer, sel::add_completed_handler, static_cast<void*>(&block));
  release_box(box);
}

void commit(void* command_buffer) { send<void>(command_buffer, sel::commit); }

void wait_until_completed(void* command_buffer) {
  send<void>(command_buffer, sel::wait_until_completed);
}

CommandBufferStatus status(void* command_buffer) {
  return static_cast<CommandBufferStatus>(send<NSUInteger>(command_buffer, sel::status));
}

std::string error_description(void* command_buffer) {
  AutoreleasePool pool;
  void* error = send<void*>(command_buffer, sel::error);
  return error == nullptr ? "" : describe_error(error);
}

void check_succeeded(void* command_buffer) {
  if (status(command_buffer) == CommandBufferStatus::Error) {
    throw Error("[metal] command buffer failed: " + error_description(command_buffer));
  }
}

Object new_shared_event(void* device) {
  void* event = send<void*>(device, sel::new_shared_event);
  if (event == nullptr) throw Error("[metal] newSharedEvent returned nil");
  return Object::adopt(event);
}

void encode_signal_event(void* command_buffer, void* event, uint64_t value) {
  send<void>(command_buffer, sel::encode_signal, event, value);
}

void encode_wait_for_event(void* command_buffer, void* event, uint64_t value) {
  send<void>(command_buffer, sel::encode_wait, event, value);
}

uint64_t signaled_value(void* event) { return send<uint64_t>(event, sel::signaled_value); }

void set_signaled_value(void* event, uint64_t value) {
  send<void>(event, sel::set_signaled_value, value);
}

bool wait_until_signaled_value(void* event, uint64_t value, uint64_t timeout_ms) {
  return send<BOOL>(event, sel::wait_until_signaled, value, timeout_ms);
}

}  // namespace lily::mtl
