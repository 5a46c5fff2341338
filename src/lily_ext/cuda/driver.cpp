// The CUDA driver layer (see driver.h): libcuda opened with dlopen, RAII handles, the PTX kernel set and graphs.
#include "driver.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <stdexcept>

namespace lily::cuda {

namespace {
constexpr uint32_t kMetalMaxThreads = 1024;          // Metal's threads per threadgroup, and CUDA's per block
constexpr uint32_t kDefaultSharedMemory = 48 * 1024;  // more needs cuFuncSetAttribute
constexpr int kRegistersFor1024Threads = 64;         // 65,536 registers per multiprocessor / 1024 threads
constexpr uint32_t kSliceAlignment = 16;             // Metal's threadgroup memory lengths are multiples of 16
}  // namespace

// ---- Driver ----

const Driver& Driver::get() {
  static std::atomic<const Driver*> ready{nullptr};  // every call after the first: one load, no lock
  if (const Driver* d = ready.load(std::memory_order_acquire)) return *d;
  static std::mutex mutex;
  static std::unique_ptr<Driver> driver;
  std::lock_guard<std::mutex> lock(mutex);
  if (!driver) {
    std::unique_ptr<Driver> opened(new Driver());
    opened->open();  // throws: the next call tries again
    driver = std::move(opened);
    ready.store(driver.get(), std::memory_order_release);
  }
  return *driver;
}

void Driver::open() {
  const char* env = std::getenv("LILY_LIBCUDA");
  library_ = env && *env ? env : "libcuda.so.1";
  handle_ = dlopen(library_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle_) {
    const char* why = dlerror();
    throw DriverError("no NVIDIA driver: " + library_ + " cannot be loaded (" + (why ? why : "dlopen failed") +
                          (env ? "; LILY_LIBCUDA names it" : "") + ")",
                      CUDA_ERROR_NOT_INITIALIZED);
  }
  std::vector<std::string> missing;
  auto resolve = [&](const char* symbol, const char* fallback) {
    void* p = dlsym(handle_, symbol);
    if (!p && fallback) p = dlsym(handle_, fallback);
    if (!p) missing.push_back(symbol);
    return p;
  };
#define LILY_CUDA_RESOLVE(member, symbol, fallback, result, params) \
  fn_.member = reinterpret_cast<result(*) params>(resolve(symbol, fallback));
  LILY_CUDA_DRIVER_FUNCTIONS(LILY_CUDA_RESOLVE)
#undef LILY_CUDA_RESOLVE
#define LILY_CUDA_RESOLVE_OPTIONAL(member, symbol, fallback, result, params) \
  fn_.member = reinterpret_cast<result(*) params>(dlsym(handle_, symbol));
  LILY_CUDA_OPTIONAL_DRIVER_FUNCTIONS(LILY_CUDA_RESOLVE_OPTIONAL)
#undef LILY_CUDA_RESOLVE_OPTIONAL
  if (!missing.empty()) {
    std::string names;
    for (const std::string& m : missing) names += (names.empty() ? "" : ", ") + m;
    dlclose(handle_);
    throw DriverError(library_ + " lacks driver functions Lily needs (" + names + "): the driver is too old",
                      CUDA_ERROR_NOT_FOUND);
  }
  check(fn_.Init(0), "cuInit");
  check(fn_.DriverGetVersion(&version_), "cuDriverGetVersion");
}

int Driver::device_count() const {
  int count = 0;
  check(fn_.DeviceGetCount(&count), "cuDeviceGetCount");
  return count;
}

std::string Driver::error_text(CUresult result) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (fn_.GetErrorName) fn_.GetErrorName(result, &name);
  if (fn_.GetErrorString) fn_.GetErrorString(result, &text);
  return std::string(name ? name : "CUDA error") + " (" + std::to_string(result) + "): " + (text ? text : "");
}

void Driver::check(CUresult result, const char* call, const std::string& kernel) const {
  if (result == CUDA_SUCCESS) return;
  const std::string where = kernel.empty() ? "" : "kernel " + kernel + ": ";
  throw DriverError(where + call + " failed: " + error_text(result), result);
}

// ---- Context ----

Context::Context(int ordinal) : driver_(Driver::get()), ordinal_(ordinal) {
  const DriverFunctions& cu = driver_.fn();
  const int count = driver_.device_count();
  if (ordinal < 0 || ordinal >= count) {
    throw std::invalid_argument("cuda: GPU " + std::to_string(ordinal) + " does not exist (" +
                                std::to_string(count) + " found)");
  }
  driver_.check(cu.DeviceGet(&device_, ordinal), "cuDeviceGet");
  driver_.check(cu.DevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain");
  make_current();
  char name[256] = {};
  driver_.check(cu.DeviceGetName(name, sizeof(name), device_), "cuDeviceGetName");
  name_ = name;
  compute_capability_ = {attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                         attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)};
  driver_.check(cu.DeviceTotalMem(&total_memory_, device_), "cuDeviceTotalMem");
}

Context::~Context() {
  if (context_) driver_.fn().DevicePrimaryCtxRelease(device_);
}

int Context::attribute(int device_attribute) const {
  int value = 0;
  driver_.check(driver_.fn().DeviceGetAttribute(&value, device_attribute, device_), "cuDeviceGetAttribute");
  return value;
}

void Context::make_current() const { driver_.check(driver_.fn().CtxSetCurrent(context_), "cuCtxSetCurrent"); }

void Context::synchronize() const { driver_.check(driver_.fn().CtxSynchronize(), "cuCtxSynchronize"); }

// ---- Memory and copies ----

DeviceMemory::DeviceMemory(size_t bytes) : size_(bytes) {
  const Driver& d = Driver::get();
  d.check(d.fn().MemAlloc(&ptr_, std::max<size_t>(bytes, 1)), "cuMemAlloc");
}

DeviceMemory::~DeviceMemory() {
  if (ptr_) Driver::get().fn().MemFree(ptr_);
}

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : ptr_(std::exchange(other.ptr_, 0)), size_(std::exchange(other.size_, 0)) {}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  std::swap(ptr_, other.ptr_);
  std::swap(size_, other.size_);
  return *this;
}

PinnedMemory::PinnedMemory(size_t bytes) : size_(bytes) {
  const Driver& d = Driver::get();
  d.check(d.fn().MemHostAlloc(&data_, std::max<size_t>(bytes, 1), CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
}

PinnedMemory::~PinnedMemory() {
  if (data_) Driver::get().fn().MemFreeHost(data_);
}

PinnedMemory::PinnedMemory(PinnedMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

PinnedMemory& PinnedMemory::operator=(PinnedMemory&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(size_, other.size_);
  return *this;
}

void upload(CUdeviceptr dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  const Driver& d = Driver::get();
  d.check(d.fn().MemcpyHtoD(dst, src, bytes), "cuMemcpyHtoD");
}

void download(void* dst, CUdeviceptr src, size_t bytes) {
  if (bytes == 0) return;
  const Driver& d = Driver::get();
  d.check(d.fn().MemcpyDtoH(dst, src, bytes), "cuMemcpyDtoH");
}

void upload_async(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  if (bytes == 0) return;
  const Driver& d = Driver::get();
  d.check(d.fn().MemcpyHtoDAsync(dst, src, bytes, stream), "cuMemcpyHtoDAsync");
}

void download_async(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  if (bytes == 0) return;
  const Driver& d = Driver::get();
  d.check(d.fn().MemcpyDtoHAsync(dst, src, bytes, stream), "cuMemcpyDtoHAsync");
}

void copy_async(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  if (bytes == 0) return;
  const Driver& d = Driver::get();
  d.check(d.fn().MemcpyDtoDAsync(dst, src, bytes, stream), "cuMemcpyDtoDAsync");
}

void fill_async(CUdeviceptr dst, uint8_t value, size_t bytes, CUstream stream) {
  if (bytes == 0) return;
  const Driver& d = Driver::get();
  d.check(d.fn().MemsetD8Async(dst, value, bytes, stream), "cuMemsetD8Async");
}

// ---- Streams and events ----

Stream::Stream(bool non_blocking) {
  const Driver& d = Driver::get();
  d.check(d.fn().StreamCreate(&stream_, non_blocking ? CU_STREAM_NON_BLOCKING : 0), "cuStreamCreate");
}

Stream::~Stream() {
  if (stream_) Driver::get().fn().StreamDestroy(stream_);
}

void Stream::synchronize() const {
  const Driver& d = Driver::get();
  d.check(d.fn().StreamSynchronize(stream_), "cuStreamSynchronize");
}

void Stream::wait(const Event& event) const {
  const Driver& d = Driver::get();
  d.check(d.fn().StreamWaitEvent(stream_, event.handle(), 0), "cuStreamWaitEvent");
}

Event::Event(bool timing) {
  const Driver& d = Driver::get();
  d.check(d.fn().EventCreate(&event_, timing ? 0 : CU_EVENT_DISABLE_TIMING), "cuEventCreate");
}

Event::~Event() {
  if (event_) Driver::get().fn().EventDestroy(event_);
}

void Event::record(CUstream stream) const {
  const Driver& d = Driver::get();
  d.check(d.fn().EventRecord(event_, stream), "cuEventRecord");
}

bool Event::done() const {
  const Driver& d = Driver::get();
  const CUresult result = d.fn().EventQuery(event_);
  if (result == CUDA_ERROR_NOT_READY) return false;
  d.check(result, "cuEventQuery");
  return true;
}

void Event::synchronize() const {
  const Driver& d = Driver::get();
  d.check(d.fn().EventSynchronize(event_), "cuEventSynchronize");
}

float Event::elapsed_ms_since(const Event& start) const {
  const Driver& d = Driver::get();
  float ms = 0;
  d.check(d.fn().EventElapsedTime(&ms, start.event_, event_), "cuEventElapsedTime");
  return ms;
}

// ---- KernelSet ----

std::string KernelSet::default_ptx_dir() {
  const char* env = std::getenv("LILY_CUDA_PTX_DIR");
  if (env && *env) return env;
  Dl_info info{};  // the folder of the shared object this code is in: lily/ of the installed package
  if (!dladdr(reinterpret_cast<void*>(&KernelSet::default_ptx_dir), &info) || !info.dli_fname) return "cuda_kernels";
  return (std::filesystem::path(info.dli_fname).parent_path() / "cuda_kernels").string();
}

KernelSet::KernelSet(const Context& context, std::string ptx_dir)
    : context_(context), dir_(ptx_dir.empty() ? default_ptx_dir() : std::move(ptx_dir)) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(dir_, ec)) {
    for (const fs::directory_entry& entry : fs::directory_iterator(dir_, ec)) {
      if (entry.path().extension() != ".ptx") continue;
      std::ifstream in(entry.path(), std::ios::binary);
      // std::string keeps the NUL the driver needs
      images_[entry.path().filename().string()].assign(std::istreambuf_iterator<char>(in),
                                                       std::istreambuf_iterator<char>());
    }
  }
  if (images_.empty()) {
    throw DriverError("no CUDA kernels: no .ptx files in " + dir_ +
                          " (build them with tools/cuda_kernels.py, or set LILY_CUDA_PTX_DIR)",
                      CUDA_ERROR_NOT_FOUND);
  }
  for (const auto& [file, image] : images_) {
    for (const std::string& name : ptx_entry_names(image)) kernel_file_[name] = file;
    module(file, false);  // a PTX file the driver refuses fails here, naming it
  }
}

KernelSet::~KernelSet() {
  const DriverFunctions& cu = context_.driver().fn();
  for (const auto& [key, module] : modules_) cu.ModuleUnload(module);
}

std::vector<std::string> KernelSet::kernel_names() const {
  std::vector<std::string> names;
  for (const auto& [name, file] : kernel_file_) names.push_back(name);
  return names;
}

// The module of one PTX file; `capped`: JIT-compiled with at most 64 registers per thread, so each of its kernels
// launches with up to 1024 threads (Metal's limit) at some cost in spills.
CUmodule KernelSet::module(const std::string& file, bool capped) {
  auto found = modules_.find({file, capped});
  if (found != modules_.end()) return found->second;
  const DriverFunctions& cu = context_.driver().fn();
  CUmodule m = nullptr;
  const void* image = images_.at(file).c_str();
  CUresult result;
  if (capped) {
    int options[] = {CU_JIT_MAX_REGISTERS};
    void* values[] = {reinterpret_cast<void*>(static_cast<uintptr_t>(kRegistersFor1024Threads))};
    result = cu.ModuleLoadDataEx(&m, image, 1, options, values);
  } else {
    result = cu.ModuleLoadData(&m, image);
  }
  const std::string call = "cuModuleLoadData(" + file + (capped ? ", 64 registers)" : ")");
  context_.driver().check(result, call.c_str());
  modules_[{file, capped}] = m;
  return m;
}

CUfunction KernelSet::function(const std::string& kernel, uint32_t threads) {
  auto file = kernel_file_.find(kernel);
  if (file == kernel_file_.end()) {
    throw std::invalid_argument("cuda: no kernel named '" + kernel + "' in the PTX files of " + dir_);
  }
  const Driver& driver = context_.driver();
  int limit = 0;
  for (bool capped : {false, true}) {
    CUfunction& fn = functions_[{kernel, capped}];
    if (!fn) driver.check(driver.fn().ModuleGetFunction(&fn, module(file->second, capped), kernel.c_str()),
                          "cuModuleGetFunction", kernel);
    driver.check(driver.fn().FuncGetAttribute(&limit, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn),
                 "cuFuncGetAttribute", kernel);
    if (threads <= uint32_t(limit)) return fn;
  }
  throw std::invalid_argument("cuda: kernel " + kernel + ": " + std::to_string(threads) +
                              " threads per threadgroup exceed its limit " + std::to_string(limit));
}

const std::vector<KernelParameter>& KernelSet::parameters(const std::string& kernel) {
  auto found = parameters_.find(kernel);
  if (found != parameters_.end()) return found->second;
  function(kernel, 1);  // an unknown kernel is an invalid_argument naming it
  const Driver& driver = context_.driver();
  CUdeviceptr table = 0;
  size_t bytes = 0;
  const std::string symbol = kernel + "_msl_params";
  driver.check(driver.fn().ModuleGetGlobal(&table, &bytes, module(kernel_file_.at(kernel), false), symbol.c_str()),
               "cuModuleGetGlobal", kernel);
  std::vector<uint32_t> words(bytes / sizeof(uint32_t));
  download(words.data(), table, words.size() * sizeof(uint32_t));
  if (words.empty() || 1 + 4 * size_t(words[0]) > words.size()) {
    throw DriverError("kernel " + kernel + ": " + symbol + " is malformed", CUDA_ERROR_INVALID_IMAGE);
  }
  std::vector<KernelParameter> params(words[0]);
  for (size_t i = 0; i < params.size(); ++i) {
    params[i] = {words[1 + 4 * i], words[2 + 4 * i], words[3 + 4 * i], words[4 + 4 * i]};
  }
  return parameters_[kernel] = std::move(params);
}

void KernelSet::check_arguments(const std::string& kernel, const std::vector<BoundArgument>& arguments,
                                const std::vector<uint32_t>& threadgroup_memory) {
  const std::vector<KernelParameter>& params = parameters(kernel);
  for (size_t p = 0; p < params.size(); ++p) {
    const KernelParameter& param = params[p];
    const std::string where = kernel + " parameter " + std::to_string(p);
    if (param.attribute == kBufferParameter) {
      const std::string slot = where + " [[buffer(" + std::to_string(param.index) + ")]]";
      if (param.index >= arguments.size()) {
        throw std::invalid_argument(slot + " is not bound: only " + std::to_string(arguments.size()) +
                                    " args were given");
      }
      const BoundArgument& a = arguments[param.index];
      if (param.binding == kReferenceBinding && (a.is_bytes ? a.bytes != param.size : a.bytes < param.size)) {
        throw std::invalid_argument(slot + " expects " + std::to_string(param.size) +
                                    " bytes (one struct from metal/lily.h); got " + std::to_string(a.bytes));
      }
    } else if (param.attribute == kThreadgroupParameter &&
               (param.index >= threadgroup_memory.size() || threadgroup_memory[param.index] == 0)) {
      throw std::invalid_argument(where + " [[threadgroup(" + std::to_string(param.index) +
                                  ")]] needs a threadgroup memory length");
    }
  }
}

KernelLaunch KernelSet::prepare(const std::string& kernel, const std::vector<CUdeviceptr>& buffers, Dim3 threadgroups,
                                Dim3 threads_per_threadgroup, const std::vector<uint32_t>& threadgroup_memory) {
  const std::string where = "cuda: kernel " + kernel + ": ";
  if (buffers.size() > size_t(kMaxBuffers)) {
    throw std::invalid_argument(where + std::to_string(buffers.size()) + " buffers; at most " +
                                std::to_string(kMaxBuffers));
  }
  if (threadgroup_memory.size() > size_t(kMaxThreadgroupSlices)) {
    throw std::invalid_argument(where + std::to_string(threadgroup_memory.size()) + " threadgroup slices; at most " +
                                std::to_string(kMaxThreadgroupSlices));
  }
  const Dim3 g = threadgroups, t = threads_per_threadgroup;
  const uint64_t threads = uint64_t(t.x) * t.y * t.z;
  if (std::min({g.x, g.y, g.z, t.x, t.y, t.z}) < 1 || threads > kMetalMaxThreads) {
    // std::to_string, not an ostream: in the H200's g++ 13 build (libstdc++ linked into the module) formatting a
    // number through an ostream crashed in its locale's codecvt (cuda-gdb, 2026-12-04), as std::regex did.
    auto dims = [](const Dim3& d) {
      return "[" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + "]";
    };
    throw std::invalid_argument(where + "bad launch shape threadgroups=" + dims(g) + " threads=" + dims(t));
  }
  KernelLaunch launch;
  launch.kernel = kernel;
  launch.function = function(kernel, uint32_t(threads));
  launch.threadgroups = g;
  launch.threads_per_threadgroup = t;
  std::copy(buffers.begin(), buffers.end(), launch.params.buffers);
  uint64_t offset = 0;
  for (size_t i = 0; i < threadgroup_memory.size(); ++i) {  // slices in index order, each 16-byte aligned
    launch.params.threadgroup_offsets[i] = uint32_t(offset);
    offset += (uint64_t(threadgroup_memory[i]) + kSliceAlignment - 1) / kSliceAlignment * kSliceAlignment;
  }
  if (offset > UINT32_MAX) throw std::invalid_argument(where + "threadgroup memory lengths overflow");
  launch.shared_memory_bytes = uint32_t(offset);
  if (launch.shared_memory_bytes > kDefaultSharedMemory) {
    const Driver& driver = context_.driver();
    driver.check(driver.fn().FuncSetAttribute(launch.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                              int(launch.shared_memory_bytes)),
                 "cuFuncSetAttribute(max dynamic shared memory)", kernel);
  }
  return launch;
}

void KernelSet::launch(const KernelLaunch& launch, CUstream stream) const {
  KernelParams params = launch.params;  // the driver copies the argument block before returning
  void* args[] = {&params};
  const Dim3 g = launch.threadgroups, t = launch.threads_per_threadgroup;
  const Driver& driver = context_.driver();
  driver.check(driver.fn().LaunchKernel(launch.function, g.x, g.y, g.z, t.x, t.y, t.z, launch.shared_memory_bytes,
                                        stream, args, nullptr),
               "cuLaunchKernel", launch.kernel);
}

// ---- Graphs ----

namespace {
CUDA_KERNEL_NODE_PARAMS kernel_node_params(const KernelLaunch& launch, KernelParams& params, void** args) {
  params = launch.params;
  args[0] = &params;
  CUDA_KERNEL_NODE_PARAMS p{};
  p.func = launch.function;
  p.gridDimX = launch.threadgroups.x;
  p.gridDimY = launch.threadgroups.y;
  p.gridDimZ = launch.threadgroups.z;
  p.blockDimX = launch.threads_per_threadgroup.x;
  p.blockDimY = launch.threads_per_threadgroup.y;
  p.blockDimZ = launch.threads_per_threadgroup.z;
  p.sharedMemBytes = launch.shared_memory_bytes;
  p.kernelParams = args;
  return p;
}
}  // namespace

Graph::Graph(const Context& context) : context_(context) {
  context_.driver().check(context_.driver().fn().GraphCreate(&graph_, 0), "cuGraphCreate");
}

Graph::~Graph() {
  if (graph_) context_.driver().fn().GraphDestroy(graph_);
}

GraphNode Graph::add_kernel(const KernelLaunch& launch, const std::vector<GraphNode>& dependencies) {
  KernelParams params;
  void* args[1];
  const CUDA_KERNEL_NODE_PARAMS p = kernel_node_params(launch, params, args);  // copied into the node
  GraphNode node = nullptr;
  context_.driver().check(
      context_.driver().fn().GraphAddKernelNode(&node, graph_, dependencies.data(), dependencies.size(), &p),
      "cuGraphAddKernelNode", launch.kernel);
  ++nodes_;
  return node;
}

GraphNode Graph::add_kernel_after_start(const KernelLaunch& launch, GraphNode upstream) {
  const GraphNode node = add_kernel(launch, {});
  CUgraphEdgeData edge{};
  edge.from_port = CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC;
  edge.type = CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC;
  context_.driver().check(context_.driver().fn().GraphAddDependencies(graph_, &upstream, &node, &edge, 1),
                          "cuGraphAddDependencies_v2 (programmatic)", launch.kernel);
  return node;
}

GraphNode Graph::add_copy(CUdeviceptr dst, CUdeviceptr src, size_t bytes, const std::vector<GraphNode>& dependencies) {
  CUDA_MEMCPY3D copy{};
  copy.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  copy.srcDevice = src;
  copy.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  copy.dstDevice = dst;
  copy.srcPitch = copy.dstPitch = bytes;  // one row: the pitch is the row, as cudaGraphAddMemcpyNode1D sets it
  copy.srcHeight = copy.dstHeight = 1;
  copy.WidthInBytes = bytes;
  copy.Height = 1;
  copy.Depth = 1;
  GraphNode node = nullptr;
  context_.driver().check(context_.driver().fn().GraphAddMemcpyNode(&node, graph_, dependencies.data(),
                                                                    dependencies.size(), &copy, context_.handle()),
                          "cuGraphAddMemcpyNode");
  ++nodes_;
  return node;
}

GraphNode Graph::add_fill(CUdeviceptr dst, uint8_t value, size_t bytes, const std::vector<GraphNode>& dependencies) {
  CUDA_MEMSET_NODE_PARAMS fill{};
  fill.dst = dst;
  fill.value = value;
  fill.elementSize = 1;
  fill.width = bytes;
  fill.height = 1;
  GraphNode node = nullptr;
  context_.driver().check(context_.driver().fn().GraphAddMemsetNode(&node, graph_, dependencies.data(),
                                                                    dependencies.size(), &fill, context_.handle()),
                          "cuGraphAddMemsetNode");
  ++nodes_;
  return node;
}

GraphNode Graph::add_empty(const std::vector<GraphNode>& dependencies) {
  GraphNode node = nullptr;
  context_.driver().check(
      context_.driver().fn().GraphAddEmptyNode(&node, graph_, dependencies.data(), dependencies.size()),
      "cuGraphAddEmptyNode");
  ++nodes_;
  return node;
}

GraphExec::GraphExec(const Graph& graph) {
  const Driver& d = Driver::get();
  d.check(d.fn().GraphInstantiateWithFlags(&exec_, graph.handle(), 0), "cuGraphInstantiateWithFlags");
}

GraphExec::~GraphExec() {
  if (exec_) Driver::get().fn().GraphExecDestroy(exec_);
}

void GraphExec::launch(CUstream stream) const {
  const Driver& d = Driver::get();
  d.check(d.fn().GraphLaunch(exec_, stream), "cuGraphLaunch");
}

void GraphExec::set_kernel(GraphNode node, const KernelLaunch& launch) const {
  KernelParams params;
  void* args[1];
  const CUDA_KERNEL_NODE_PARAMS p = kernel_node_params(launch, params, args);
  const Driver& d = Driver::get();
  d.check(d.fn().GraphExecKernelNodeSetParams(exec_, node, &p), "cuGraphExecKernelNodeSetParams", launch.kernel);
}

}  // namespace lily::cuda
