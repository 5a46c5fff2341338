// The fake libcuda (see fake_cuda.h): device, memory, copies, modules, launches, streams and events.
#include "fake_cuda.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>

#include "msl_rt.h"
#include "registry.h"

namespace lily::cuda_fake {

namespace {

std::mutex& state_mutex() {
  static std::mutex m;
  return m;
}
// start address -> size, of every live allocation (device and pinned host: one address space, as with UVA)
std::map<uintptr_t, size_t>& allocations() {
  static std::map<uintptr_t, size_t> a;
  return a;
}
bool initialised = false;
thread_local std::string last_detail;
thread_local CUresult last_detail_code = CUDA_SUCCESS;
thread_local std::string error_string;

constexpr size_t kAlignment = 256;  // cuMemAlloc's alignment
constexpr size_t kPageBytes = 4096;

void* allocate(size_t bytes) {
  void* p = std::aligned_alloc(kAlignment, (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment);
  if (!p) return nullptr;
  std::memset(p, 0xFF, bytes);  // new device memory holds NaN bytes, so reading what was never written shows
  std::lock_guard<std::mutex> lock(state_mutex());
  allocations()[reinterpret_cast<uintptr_t>(p)] = bytes;
  return p;
}

bool release(void* p) {
  {
    std::lock_guard<std::mutex> lock(state_mutex());
    if (!allocations().erase(reinterpret_cast<uintptr_t>(p))) return false;
  }
  std::free(p);
  return true;
}

// Whether [ptr, ptr + bytes) lies inside one allocation.
bool in_device_memory(uintptr_t ptr, size_t bytes) { return bytes_to_end(reinterpret_cast<void*>(ptr)) >= bytes; }

struct Module {
  std::set<std::string> entries;
  std::map<std::string, std::pair<void*, size_t>> globals;  // initialised .global/.const byte arrays of the PTX
  std::map<std::string, Function> functions;
};

// The initialised byte arrays of a PTX module (`.visible .const .align 4 .b8 name[N] = {1, 0, ...};`), as the
// CUDA build exports each kernel's `<kernel>_msl_params`; each copied into fake device memory.
bool load_globals(const std::string& text, Module& m) {
  const std::string marker = " .b8 ";
  for (size_t at = text.find(marker); at != std::string::npos; at = text.find(marker, at + 1)) {
    const size_t line = text.rfind('\n', at) + 1;
    const std::string head = text.substr(line, at - line);
    if (head.find(".global") == std::string::npos && head.find(".const") == std::string::npos) continue;
    const size_t open = text.find('[', at), close = text.find(']', at), eol = text.find('\n', at);
    const size_t brace = text.find('{', at), end = text.find('}', at);
    if (open > eol || close > eol || brace > eol || end > eol) continue;  // declared without an initialiser
    const std::string name = text.substr(at + marker.size(), open - at - marker.size());
    const size_t bytes = std::strtoull(text.c_str() + open + 1, nullptr, 10);
    unsigned char* data = static_cast<unsigned char*>(allocate(bytes));
    if (!data) return false;
    std::memset(data, 0, bytes);
    const char* p = text.c_str() + brace + 1;
    for (size_t i = 0; i < bytes && p < text.c_str() + end; ++i) {
      char* next = nullptr;
      data[i] = static_cast<unsigned char>(std::strtoul(p, &next, 10));
      p = std::strchr(next, ',') ? std::strchr(next, ',') + 1 : text.c_str() + end;
    }
    m.globals[name] = {data, bytes};
  }
  return true;
}

struct Event {
  std::chrono::steady_clock::time_point recorded;
};

std::atomic<uint64_t> launches{0};

uint64_t base_seed() {
  const char* env = std::getenv("LILY_FAKE_CUDA_SEED");
  return env ? std::strtoull(env, nullptr, 10) : 0;
}

// msl_cuda_detail::ParamTable of a kernel as the harness's registry describes it: {count, {attribute, index, binding, size}}.
std::vector<uint32_t> params_table(const msl_rt::KernelVariant& v) {
  constexpr size_t kMaxParams = 32;
  std::vector<uint32_t> words(1 + 4 * kMaxParams, 0);
  words[0] = uint32_t(v.params.size());
  for (size_t i = 0; i < v.params.size() && i < kMaxParams; ++i) {
    words[1 + 4 * i] = uint32_t(v.attrs[i].kind);
    words[2 + 4 * i] = uint32_t(v.attrs[i].index);
    words[3 + 4 * i] = uint32_t(v.params[i].kind);
    words[4 + 4 * i] = uint32_t(v.params[i].pointee_size);
  }
  return words;
}

}  // namespace

CUresult fail(CUresult code, const std::string& detail) {
  last_detail = detail;
  last_detail_code = code;
  return code;
}

size_t bytes_to_end(const void* ptr) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(state_mutex());
  auto it = allocations().upper_bound(p);
  if (it == allocations().begin()) return 0;
  --it;
  const size_t end = it->first + it->second;
  return p < end ? end - p : 0;
}

uint64_t launch_seed(uint64_t n) { return base_seed() * 0x9E3779B97F4A7C15ull + n; }

// ---- Errors, driver, device, context ----

CUresult fake_GetErrorName(CUresult error, const char** name) {
  static const std::map<CUresult, const char*> names = {
      {CUDA_SUCCESS, "CUDA_SUCCESS"}, {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
      {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"}, {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
      {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"}, {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE"},
      {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX"}, {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
      {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"}, {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY"},
      {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
      {CUDA_ERROR_MISALIGNED_ADDRESS, "CUDA_ERROR_MISALIGNED_ADDRESS"},
      {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"},
      {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED"}, {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"}};
  auto it = names.find(error);
  if (it == names.end()) return CUDA_ERROR_INVALID_VALUE;
  *name = it->second;
  return CUDA_SUCCESS;
}

// CUDA's text for the code, then what the fake last said about that code on this thread (the harness's message).
CUresult fake_GetErrorString(CUresult error, const char** text) {
  const char* name = nullptr;
  if (fake_GetErrorName(error, &name) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
  error_string = std::string("fake libcuda (CPU harness)");
  if (error == last_detail_code && !last_detail.empty()) error_string += ": " + last_detail;
  last_detail.clear();  // said once: a later error with the same code has its own story
  *text = error_string.c_str();
  return CUDA_SUCCESS;
}

CUresult fake_Init(unsigned int flags) {
  if (flags != 0) return fail(CUDA_ERROR_INVALID_VALUE, "cuInit flags must be 0");
  initialised = true;
  return CUDA_SUCCESS;
}

CUresult fake_DriverGetVersion(int* version) {
  *version = 13000;
  return CUDA_SUCCESS;
}

CUresult fake_DeviceGetCount(int* count) {
  if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
  *count = 1;
  return CUDA_SUCCESS;
}

CUresult fake_DeviceGet(CUdevice* device, int ordinal) {
  if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
  if (ordinal != 0) return fail(CUDA_ERROR_INVALID_VALUE, "the fake has one device, 0");
  *device = 0;
  return CUDA_SUCCESS;
}

CUresult fake_DeviceGetName(char* name, int length, CUdevice) {
  std::snprintf(name, size_t(length), "%s", "Lily fake CUDA device (CPU harness)");
  return CUDA_SUCCESS;
}

CUresult fake_DeviceGetAttribute(int* value, int attribute, CUdevice) {
  switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 2; return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = 227 * 1024; return CUDA_SUCCESS;
    default: return fail(CUDA_ERROR_INVALID_VALUE, "device attribute " + std::to_string(attribute) + " not faked");
  }
}

CUresult fake_DeviceTotalMem(size_t* bytes, CUdevice) {
  *bytes = size_t(16) << 30;
  return CUDA_SUCCESS;
}

CUresult fake_DevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
  static int primary;
  if (device != 0) return fail(CUDA_ERROR_INVALID_VALUE, "the fake has one device, 0");
  *context = reinterpret_cast<CUcontext>(&primary);
  return CUDA_SUCCESS;
}

CUresult fake_DevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }
CUresult fake_CtxSetCurrent(CUcontext) { return CUDA_SUCCESS; }
CUresult fake_CtxSynchronize() { return CUDA_SUCCESS; }  // every operation finished when it was enqueued

// ---- Memory and copies (synchronous) ----

CUresult fake_MemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  fake_DeviceTotalMem(total_bytes, 0);
  *free_bytes = *total_bytes;
  return CUDA_SUCCESS;
}

CUresult fake_MemAlloc(CUdeviceptr* ptr, size_t bytes) {
  if (bytes == 0) return fail(CUDA_ERROR_INVALID_VALUE, "cuMemAlloc of 0 bytes");
  void* p = allocate(bytes);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult fake_MemFree(CUdeviceptr ptr) {
  if (!release(reinterpret_cast<void*>(ptr))) return fail(CUDA_ERROR_INVALID_VALUE, "cuMemFree of an unknown pointer");
  return CUDA_SUCCESS;
}

CUresult fake_MemHostAlloc(void** ptr, size_t bytes, unsigned int) {
  *ptr = allocate(std::max(bytes, kPageBytes));
  return *ptr ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult fake_MemFreeHost(void* ptr) {
  return release(ptr) ? CUDA_SUCCESS : fail(CUDA_ERROR_INVALID_VALUE, "cuMemFreeHost of an unknown pointer");
}

namespace {
CUresult copy(uintptr_t dst, bool dst_device, uintptr_t src, bool src_device, size_t bytes, const char* call) {
  if ((dst_device && !in_device_memory(dst, bytes)) || (src_device && !in_device_memory(src, bytes))) {
    return fail(CUDA_ERROR_INVALID_VALUE, std::string(call) + " of " + std::to_string(bytes) +
                                              " bytes reaches outside a device allocation");
  }
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
  return CUDA_SUCCESS;
}
uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }
}  // namespace

CUresult fake_MemcpyHtoD(CUdeviceptr dst, const void* src, size_t bytes) {
  return copy(dst, true, address(src), false, bytes, "cuMemcpyHtoD");
}
CUresult fake_MemcpyDtoH(void* dst, CUdeviceptr src, size_t bytes) {
  return copy(address(dst), false, src, true, bytes, "cuMemcpyDtoH");
}
CUresult fake_MemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  return copy(dst, true, src, true, bytes, "cuMemcpyDtoD");
}
CUresult fake_MemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t bytes, CUstream) {
  return fake_MemcpyHtoD(dst, src, bytes);
}
CUresult fake_MemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t bytes, CUstream) {
  return fake_MemcpyDtoH(dst, src, bytes);
}
CUresult fake_MemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream) {
  return fake_MemcpyDtoD(dst, src, bytes);
}

CUresult fake_MemsetD8(CUdeviceptr dst, unsigned char value, size_t bytes) {
  if (!in_device_memory(dst, bytes)) return fail(CUDA_ERROR_INVALID_VALUE, "cuMemsetD8 outside a device allocation");
  std::memset(reinterpret_cast<void*>(dst), value, bytes);
  return CUDA_SUCCESS;
}
CUresult fake_MemsetD8Async(CUdeviceptr dst, unsigned char value, size_t bytes, CUstream) {
  return fake_MemsetD8(dst, value, bytes);
}

// ---- Modules and functions ----

CUresult fake_ModuleLoadData(CUmodule* module, const void* image) {
  const std::string text(static_cast<const char*>(image));
  if (text.find(".version") == std::string::npos || text.find(".target") == std::string::npos) {
    return fail(CUDA_ERROR_INVALID_PTX, "the image is not PTX text (no .version/.target)");
  }
  auto m = std::make_unique<Module>();
  if (!load_globals(text, *m)) return CUDA_ERROR_OUT_OF_MEMORY;
  for (const std::string& name : lily::cuda::ptx_entry_names(text)) m->entries.insert(name);
  *module = reinterpret_cast<CUmodule>(m.release());
  return CUDA_SUCCESS;
}

CUresult fake_ModuleLoadDataEx(CUmodule* module, const void* image, unsigned int, int*, void**) {
  return fake_ModuleLoadData(module, image);  // JIT options change nothing on the CPU
}

CUresult fake_ModuleUnload(CUmodule module) {
  Module* m = reinterpret_cast<Module*>(module);
  for (const auto& [name, global] : m->globals) release(global.first);
  delete m;
  return CUDA_SUCCESS;
}

CUresult fake_ModuleGetFunction(CUfunction* function, CUmodule module, const char* name) {
  Module& m = *reinterpret_cast<Module*>(module);
  if (!m.entries.count(name)) return fail(CUDA_ERROR_NOT_FOUND, std::string("no .entry ") + name + " in the module");
  if (!msl_rt::find_kernel(name)) {
    return fail(CUDA_ERROR_NOT_FOUND, std::string(name) + " is in the PTX but not in the CPU harness (stale PTX?)");
  }
  // The kernel's parameter table as the CUDA build compiled it must be the harness's: else the PTX is stale or the
  // two targets of the rewriter disagree, and a launch would bind the wrong arguments.
  auto table = m.globals.find(std::string(name) + "_msl_params");
  const std::vector<uint32_t> words = params_table(msl_rt::find_kernel(name)->front());
  if (table == m.globals.end() || table->second.second != words.size() * sizeof(uint32_t) ||
      std::memcmp(table->second.first, words.data(), table->second.second) != 0) {
    return fail(CUDA_ERROR_INVALID_PTX, std::string(name) + "_msl_params of the PTX differs from the CPU harness's "
                                                            "parameter table for the kernel (stale PTX?)");
  }
  Function& fn = m.functions[name];
  fn.name = name;
  *function = reinterpret_cast<CUfunction>(&fn);
  return CUDA_SUCCESS;
}

CUresult fake_ModuleGetGlobal(CUdeviceptr* ptr, size_t* bytes, CUmodule module, const char* name) {
  const Module& m = *reinterpret_cast<Module*>(module);
  auto it = m.globals.find(name);
  if (it == m.globals.end()) return fail(CUDA_ERROR_NOT_FOUND, std::string("no initialised global ") + name);
  if (ptr) *ptr = reinterpret_cast<CUdeviceptr>(it->second.first);
  if (bytes) *bytes = it->second.second;
  return CUDA_SUCCESS;
}

CUresult fake_FuncGetAttribute(int* value, int attribute, CUfunction) {
  switch (attribute) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *value = 32; return CUDA_SUCCESS;
    default: return fail(CUDA_ERROR_INVALID_VALUE, "function attribute " + std::to_string(attribute) + " not faked");
  }
}

CUresult fake_FuncSetAttribute(CUfunction function, int attribute, int value) {
  if (attribute != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    return fail(CUDA_ERROR_INVALID_VALUE, "function attribute " + std::to_string(attribute) + " not faked");
  }
  if (value < 0 || value > 227 * 1024) return fail(CUDA_ERROR_INVALID_VALUE, "dynamic shared memory above 227 KB");
  reinterpret_cast<Function*>(function)->max_dynamic_shared = value;
  return CUDA_SUCCESS;
}

// ---- Launches on the CPU harness ----

CUresult run_kernel(const Function& fn, const unsigned grid[3], const unsigned block[3], unsigned shared_bytes,
                    const void* params_block) {
  if (int(shared_bytes) > fn.max_dynamic_shared) {
    return fail(CUDA_ERROR_INVALID_VALUE, fn.name + ": " + std::to_string(shared_bytes) +
                                              " bytes of dynamic shared memory above its limit (cuFuncSetAttribute)");
  }
  KernelParams p;
  std::memcpy(&p, params_block, sizeof(p));
  const msl_rt::KernelVariant& v = msl_rt::find_kernel(fn.name)->front();
  std::vector<msl_rt::Binding> bindings;
  std::vector<uint32_t> slices;  // offsets of the declared [[threadgroup(i)]] slices
  msl_rt::DispatchOptions options;
  for (size_t i = 0; i < v.params.size(); ++i) {
    const msl_rt::ParamAttr& a = v.attrs[i];
    if (a.kind == msl_rt::Attr::buffer) {
      void* ptr = reinterpret_cast<void*>(p.buffers[a.index]);
      const size_t size = bytes_to_end(ptr);
      if (!size) {
        return fail(CUDA_ERROR_ILLEGAL_ADDRESS, fn.name + ": [[buffer(" + std::to_string(a.index) +
                                                    ")]] is not device memory (" +
                                                    (ptr ? "an unknown address" : "null") + ")");
      }
      // A GPU load through a pointer faults unless the address is aligned to the pointee (to 16 bytes at most), as
      // the H200 showed for tensors of an MLX-written file at odd offsets; the CPU would read them anyway.
      const size_t alignment = msl_rt::buffer_alignment(v.params[i]);
      if (alignment > 1 && reinterpret_cast<uintptr_t>(ptr) % alignment) {
        return fail(CUDA_ERROR_MISALIGNED_ADDRESS, fn.name + ": [[buffer(" + std::to_string(a.index) +
                                                       ")]] is not aligned to its " + std::to_string(alignment) +
                                                       "-byte elements");
      }
      if (bindings.size() <= size_t(a.index)) bindings.resize(size_t(a.index) + 1, msl_rt::Binding{nullptr, 0, false});
      bindings[size_t(a.index)] = msl_rt::Binding{ptr, size, false};
    } else if (a.kind == msl_rt::Attr::threadgroup_memory) {
      if (options.threadgroup_memory_lengths.size() <= size_t(a.index)) {
        options.threadgroup_memory_lengths.resize(size_t(a.index) + 1, 0);
      }
      slices.push_back(uint32_t(a.index));
    }
  }
  for (uint32_t index : slices) {  // a slice ends where the next one starts, or at the end of shared memory
    uint32_t end = shared_bytes;
    for (uint32_t other : slices) {
      const uint32_t start = p.threadgroup_offsets[other];
      if (start > p.threadgroup_offsets[index] && start < end) end = start;
    }
    options.threadgroup_memory_lengths[index] = end - std::min(end, p.threadgroup_offsets[index]);
  }
  options.seed = launch_seed(launches++);
  const uint32_t tgs[3] = {grid[0], grid[1], grid[2]}, tpt[3] = {block[0], block[1], block[2]};
  try {
    msl_rt::dispatch(fn.name, bindings, tgs, tpt, {}, options);
  } catch (const std::invalid_argument& e) {
    return fail(CUDA_ERROR_INVALID_VALUE, e.what());
  } catch (const std::exception& e) {
    return fail(CUDA_ERROR_LAUNCH_FAILED, e.what());
  }
  return CUDA_SUCCESS;
}

CUresult fake_LaunchKernel(CUfunction function, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                           unsigned int block_x, unsigned int block_y, unsigned int block_z, unsigned int shared_bytes,
                           CUstream, void** params, void** extra) {
  if (!function || !params || extra) return fail(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel: function and params only");
  const unsigned grid[3] = {grid_x, grid_y, grid_z}, block[3] = {block_x, block_y, block_z};
  return run_kernel(*reinterpret_cast<Function*>(function), grid, block, shared_bytes, params[0]);
}

// ---- Streams and events: work runs when it is enqueued, so they only keep time ----

CUresult fake_StreamCreate(CUstream* stream, unsigned int) {
  *stream = reinterpret_cast<CUstream>(new char);
  return CUDA_SUCCESS;
}
CUresult fake_StreamDestroy(CUstream stream) {
  delete reinterpret_cast<char*>(stream);
  return CUDA_SUCCESS;
}
CUresult fake_StreamSynchronize(CUstream) { return CUDA_SUCCESS; }
CUresult fake_StreamWaitEvent(CUstream, CUevent, unsigned int) { return CUDA_SUCCESS; }

CUresult fake_EventCreate(CUevent* event, unsigned int) {
  *event = reinterpret_cast<CUevent>(new Event{});
  return CUDA_SUCCESS;
}
CUresult fake_EventDestroy(CUevent event) {
  delete reinterpret_cast<Event*>(event);
  return CUDA_SUCCESS;
}
CUresult fake_EventRecord(CUevent event, CUstream) {
  reinterpret_cast<Event*>(event)->recorded = std::chrono::steady_clock::now();
  return CUDA_SUCCESS;
}
CUresult fake_EventQuery(CUevent) { return CUDA_SUCCESS; }
CUresult fake_EventSynchronize(CUevent) { return CUDA_SUCCESS; }
CUresult fake_EventElapsedTime(float* milliseconds, CUevent start, CUevent end) {
  const auto d = reinterpret_cast<Event*>(end)->recorded - reinterpret_cast<Event*>(start)->recorded;
  *milliseconds = std::chrono::duration<float, std::milli>(d).count();
  return CUDA_SUCCESS;
}

}  // namespace lily::cuda_fake
