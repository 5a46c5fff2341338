// The subset of the CUDA driver API that Lily calls, declared from NVIDIA's published ABI (cuda.h, CUDA 12/13) so
// that nothing needs a CUDA header: opaque handles, the few structs, enum values, and the function table with each
// function's exported (versioned) symbol. Shared by the run-time loader (driver.cpp) and the fake libcuda
// (src/test_doubles/cuda_fake/), which implements exactly these symbols; one table, so their signatures cannot drift apart.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lily::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUkernel = struct CUkern_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUgraph = struct CUgraph_st*;
using CUgraphNode = struct CUgraphNode_st*;
using CUgraphExec = struct CUgraphExec_st*;
using CUarray = struct CUarray_st*;

// CUresult values Lily (and the fake) name.
constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
constexpr CUresult CUDA_ERROR_INVALID_IMAGE = 200;
constexpr CUresult CUDA_ERROR_INVALID_PTX = 218;
constexpr CUresult CUDA_ERROR_INVALID_HANDLE = 400;
constexpr CUresult CUDA_ERROR_NOT_FOUND = 500;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr CUresult CUDA_ERROR_ILLEGAL_ADDRESS = 700;
constexpr CUresult CUDA_ERROR_MISALIGNED_ADDRESS = 716;
constexpr CUresult CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701;
constexpr CUresult CUDA_ERROR_LAUNCH_FAILED = 719;
constexpr CUresult CUDA_ERROR_UNKNOWN = 999;

// Enum values (CUdevice_attribute, CUfunction_attribute, CUjit_option, flags).
constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97;
constexpr int CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0;
constexpr int CU_FUNC_ATTRIBUTE_NUM_REGS = 4;
constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr int CU_JIT_MAX_REGISTERS = 0;
constexpr unsigned CU_STREAM_NON_BLOCKING = 0x1;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;
constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 0x1;
constexpr unsigned CU_MEMHOSTALLOC_WRITECOMBINED = 0x4;
constexpr int CU_MEMORYTYPE_HOST = 1;
constexpr int CU_MEMORYTYPE_DEVICE = 2;

// CUDA_KERNEL_NODE_PARAMS_v2 (its first fields are the v1 struct, so the v1 entry point reads it too).
struct CUDA_KERNEL_NODE_PARAMS {
  CUfunction func;
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  void** kernelParams;
  void** extra;
  CUkernel kern;  // used only when func is null
  CUcontext ctx;
};

// CUDA_MEMCPY3D_v2; Lily fills it for one linear (1-D) copy.
struct CUDA_MEMCPY3D {
  size_t srcXInBytes, srcY, srcZ, srcLOD;
  int srcMemoryType;
  const void* srcHost;
  CUdeviceptr srcDevice;
  CUarray srcArray;
  void* reserved0;
  size_t srcPitch, srcHeight;
  size_t dstXInBytes, dstY, dstZ, dstLOD;
  int dstMemoryType;
  void* dstHost;
  CUdeviceptr dstDevice;
  CUarray dstArray;
  void* reserved1;
  size_t dstPitch, dstHeight;
  size_t WidthInBytes, Height, Depth;
};

// CUgraphEdgeData (CUDA 12.3): the edge of a graph dependency. Lily adds the programmatic kind only: the upstream
// kernel's programmatic port (all of its blocks have run griddepcontrol.launch_dependents, or exited) releases the
// downstream kernel, which waits for the rest with griddepcontrol.wait.
struct CUgraphEdgeData {
  unsigned char from_port, to_port, type;
  unsigned char reserved[5];
};
constexpr unsigned char CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1;
constexpr unsigned char CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1;

// CUDA_MEMSET_NODE_PARAMS_v1.
struct CUDA_MEMSET_NODE_PARAMS {
  CUdeviceptr dst;
  size_t pitch;
  unsigned int value;
  unsigned int elementSize;
  size_t width, height;
};

// msl_cuda_detail::Params (src/msl_cpu/include/msl_cuda_launch.h), the one by-value parameter of every entry point
// of Lily's PTX: the [[buffer(i)]] pointers and the byte offset of each [[threadgroup(i)]] slice in dynamic shared
// memory. Not a driver type, but the contract between the host, the kernels and the fake.
constexpr int kMaxBuffers = 31;
constexpr int kMaxThreadgroupSlices = 8;
struct KernelParams {
  CUdeviceptr buffers[kMaxBuffers];
  uint32_t threadgroup_offsets[kMaxThreadgroupSlices];
};
static_assert(sizeof(KernelParams) == 31 * 8 + 8 * 4, "Params layout of msl_cuda_launch.h");

// X(member, symbol, fallback symbol or nullptr, return type, parameter list): the functions Lily resolves. The
// symbol is the versioned name cuda.h maps the API name to (cuMemAlloc -> cuMemAlloc_v2); the fallback, where there
// is one, is the older export with the same calling convention, for drivers that predate the symbol.
#define LILY_CUDA_DRIVER_FUNCTIONS(X)                                                                            \
  X(Init, "cuInit", nullptr, CUresult, (unsigned int flags))                                                     \
  X(DriverGetVersion, "cuDriverGetVersion", nullptr, CUresult, (int* version))                                  \
  X(GetErrorName, "cuGetErrorName", nullptr, CUresult, (CUresult error, const char** name))                     \
  X(GetErrorString, "cuGetErrorString", nullptr, CUresult, (CUresult error, const char** text))                 \
  X(DeviceGetCount, "cuDeviceGetCount", nullptr, CUresult, (int* count))                                        \
  X(DeviceGet, "cuDeviceGet", nullptr, CUresult, (CUdevice * device, int ordinal))                              \
  X(DeviceGetName, "cuDeviceGetName", nullptr, CUresult, (char* name, int length, CUdevice device))             \
  X(DeviceGetAttribute, "cuDeviceGetAttribute", nullptr, CUresult, (int* value, int attribute, CUdevice device)) \
  X(DeviceTotalMem, "cuDeviceTotalMem_v2", nullptr, CUresult, (size_t * bytes, CUdevice device))                \
  X(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", nullptr, CUresult, (CUcontext * context, CUdevice device)) \
  X(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", nullptr, CUresult, (CUdevice device))             \
  X(CtxSetCurrent, "cuCtxSetCurrent", nullptr, CUresult, (CUcontext context))                                   \
  X(CtxSynchronize, "cuCtxSynchronize", nullptr, CUresult, ())                                                  \
  X(MemGetInfo, "cuMemGetInfo_v2", nullptr, CUresult, (size_t * free_bytes, size_t * total_bytes))              \
  X(MemAlloc, "cuMemAlloc_v2", nullptr, CUresult, (CUdeviceptr * ptr, size_t bytes))                            \
  X(MemFree, "cuMemFree_v2", nullptr, CUresult, (CUdeviceptr ptr))                                              \
  X(MemHostAlloc, "cuMemHostAlloc", nullptr, CUresult, (void** ptr, size_t bytes, unsigned int flags))          \
  X(MemFreeHost, "cuMemFreeHost", nullptr, CUresult, (void* ptr))                                               \
  X(MemcpyHtoD, "cuMemcpyHtoD_v2", nullptr, CUresult, (CUdeviceptr dst, const void* src, size_t bytes))         \
  X(MemcpyDtoH, "cuMemcpyDtoH_v2", nullptr, CUresult, (void* dst, CUdeviceptr src, size_t bytes))               \
  X(MemcpyDtoD, "cuMemcpyDtoD_v2", nullptr, CUresult, (CUdeviceptr dst, CUdeviceptr src, size_t bytes))         \
  X(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", nullptr, CUresult,                                                 \
    (CUdeviceptr dst, const void* src, size_t bytes, CUstream stream))                                          \
  X(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", nullptr, CUresult,                                                 \
    (void* dst, CUdeviceptr src, size_t bytes, CUstream stream))                                                \
  X(MemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", nullptr, CUresult,                                                 \
    (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream))                                          \
  X(MemsetD8, "cuMemsetD8_v2", nullptr, CUresult, (CUdeviceptr dst, unsigned char value, size_t bytes))         \
  X(MemsetD8Async, "cuMemsetD8Async", nullptr, CUresult,                                                        \
    (CUdeviceptr dst, unsigned char value, size_t bytes, CUstream stream))                                      \
  X(ModuleLoadData, "cuModuleLoadData", nullptr, CUresult, (CUmodule * module, const void* image))              \
  X(ModuleLoadDataEx, "cuModuleLoadDataEx", nullptr, CUresult,                                                  \
    (CUmodule * module, const void* image, unsigned int count, int* options, void** values))                    \
  X(ModuleUnload, "cuModuleUnload", nullptr, CUresult, (CUmodule module))                                       \
  X(ModuleGetFunction, "cuModuleGetFunction", nullptr, CUresult,                                                \
    (CUfunction * function, CUmodule module, const char* name))                                                 \
  X(ModuleGetGlobal, "cuModuleGetGlobal_v2", nullptr, CUresult,                                                 \
    (CUdeviceptr * ptr, size_t * bytes, CUmodule module, const char* name))                                     \
  X(FuncGetAttribute, "cuFuncGetAttribute", nullptr, CUresult, (int* value, int attribute, CUfunction function)) \
  X(FuncSetAttribute, "cuFuncSetAttribute", nullptr, CUresult, (CUfunction function, int attribute, int value)) \
  X(LaunchKernel, "cuLaunchKernel", nullptr, CUresult,                                                          \
    (CUfunction function, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z, unsigned int block_x,  \
     unsigned int block_y, unsigned int block_z, unsigned int shared_bytes, CUstream stream, void** params,     \
     void** extra))                                                                                              \
  X(StreamCreate, "cuStreamCreate", nullptr, CUresult, (CUstream * stream, unsigned int flags))                 \
  X(StreamDestroy, "cuStreamDestroy_v2", nullptr, CUresult, (CUstream stream))                                  \
  X(StreamSynchronize, "cuStreamSynchronize", nullptr, CUresult, (CUstream stream))                             \
  X(StreamWaitEvent, "cuStreamWaitEvent", nullptr, CUresult, (CUstream stream, CUevent event, unsigned int flags)) \
  X(EventCreate, "cuEventCreate", nullptr, CUresult, (CUevent * event, unsigned int flags))                     \
  X(EventDestroy, "cuEventDestroy_v2", nullptr, CUresult, (CUevent event))                                      \
  X(EventRecord, "cuEventRecord", nullptr, CUresult, (CUevent event, CUstream stream))                          \
  X(EventQuery, "cuEventQuery", nullptr, CUresult, (CUevent event))                                             \
  X(EventSynchronize, "cuEventSynchronize", nullptr, CUresult, (CUevent event))                                 \
  X(EventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime", CUresult,                                  \
    (float* milliseconds, CUevent start, CUevent end))                                                          \
  X(GraphCreate, "cuGraphCreate", nullptr, CUresult, (CUgraph * graph, unsigned int flags))                     \
  X(GraphDestroy, "cuGraphDestroy", nullptr, CUresult, (CUgraph graph))                                         \
  X(GraphAddKernelNode, "cuGraphAddKernelNode_v2", "cuGraphAddKernelNode", CUresult,                            \
    (CUgraphNode * node, CUgraph graph, const CUgraphNode* dependencies, size_t count,                          \
     const CUDA_KERNEL_NODE_PARAMS* params))                                                                     \
  X(GraphAddMemcpyNode, "cuGraphAddMemcpyNode", nullptr, CUresult,                                              \
    (CUgraphNode * node, CUgraph graph, const CUgraphNode* dependencies, size_t count,                          \
     const CUDA_MEMCPY3D* copy, CUcontext context))                                                             \
  X(GraphAddMemsetNode, "cuGraphAddMemsetNode", nullptr, CUresult,                                              \
    (CUgraphNode * node, CUgraph graph, const CUgraphNode* dependencies, size_t count,                          \
     const CUDA_MEMSET_NODE_PARAMS* params, CUcontext context))                                                 \
  X(GraphAddEmptyNode, "cuGraphAddEmptyNode", nullptr, CUresult,                                                \
    (CUgraphNode * node, CUgraph graph, const CUgraphNode* dependencies, size_t count))                         \
  X(GraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", nullptr, CUresult,                                \
    (CUgraphExec * exec, CUgraph graph, unsigned long long flags))                                              \
  X(GraphExecKernelNodeSetParams, "cuGraphExecKernelNodeSetParams_v2", "cuGraphExecKernelNodeSetParams",        \
    CUresult, (CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS* params))                      \
  X(GraphLaunch, "cuGraphLaunch", nullptr, CUresult, (CUgraphExec exec, CUstream stream))                       \
  X(GraphExecDestroy, "cuGraphExecDestroy", nullptr, CUresult, (CUgraphExec exec))

// The same for functions Lily uses when the driver has them (null otherwise): typed graph edges (CUDA 12.3).
#define LILY_CUDA_OPTIONAL_DRIVER_FUNCTIONS(X)                                                                   \
  X(GraphAddDependencies, "cuGraphAddDependencies_v2", nullptr, CUresult,                                       \
    (CUgraph graph, const CUgraphNode* from, const CUgraphNode* to, const CUgraphEdgeData* edges, size_t count))

// The kernel names of a PTX module: lines `[.visible|.weak] .entry NAME(`. A plain scan, not std::regex: libstdc++'s
// regex compiler crashed (SIGSEGV) in an extension built with g++ 13 and loaded by the GPU machine's Python.
inline std::vector<std::string> ptx_entry_names(std::string_view ptx) {
  const auto is_space = [](char c) { return c == ' ' || c == '\t'; };
  const auto is_name = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '$';
  };
  std::vector<std::string> names;
  for (size_t start = 0; start < ptx.size();) {
    size_t end = ptx.find('\n', start);
    if (end == std::string_view::npos) end = ptx.size();
    std::string_view line = ptx.substr(start, end - start);
    start = end + 1;
    for (std::string_view linkage : {".visible", ".weak"}) {
      if (line.substr(0, linkage.size()) == linkage && line.size() > linkage.size() && is_space(line[linkage.size()])) {
        line.remove_prefix(linkage.size());
        while (!line.empty() && is_space(line.front())) line.remove_prefix(1);
        break;
      }
    }
    constexpr std::string_view kEntry = ".entry";
    if (line.substr(0, kEntry.size()) != kEntry || line.size() == kEntry.size() || !is_space(line[kEntry.size()])) {
      continue;
    }
    line.remove_prefix(kEntry.size());
    while (!line.empty() && is_space(line.front())) line.remove_prefix(1);
    size_t n = 0;
    while (n < line.size() && is_name(line[n])) ++n;
    size_t after = n;
    while (after < line.size() && is_space(line[after])) ++after;
    if (n > 0 && after < line.size() && line[after] == '(') names.emplace_back(line.substr(0, n));
  }
  return names;
}

}  // namespace lily::cuda
