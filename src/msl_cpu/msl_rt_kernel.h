// Interface between kernels compiled through the shim (msl_cpu.h) and the fiber runtime (runtime.cpp).
// Plain C++ with no MSL macros, so both sides can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace msl_rt {

constexpr uint32_t kSimdWidth = 32;  // Apple GPUs: threadExecutionWidth is 32

// Position attributes a kernel parameter can carry, and [[buffer(i)]] / [[threadgroup(i)]].
enum class Attr : uint8_t {
  buffer,
  threadgroup_memory,  // [[threadgroup(i)]]
  thread_position_in_grid,
  thread_position_in_threadgroup,
  threadgroup_position_in_grid,
  threads_per_threadgroup,
  threadgroups_per_grid,
  threads_per_grid,
  thread_index_in_threadgroup,
  thread_index_in_simdgroup,
  simdgroup_index_in_threadgroup,
  threads_per_simdgroup,
  simdgroups_per_threadgroup,
  thread_execution_width,
};

struct ParamAttr {
  Attr kind;
  int index;  // buffer / threadgroup index; 0 otherwise
};

// How a parameter's C++ type binds, read from the kernel's function type.
enum class ParamKind : uint8_t { pointer, reference, value };
struct ParamInfo {
  ParamKind kind;
  size_t pointee_size;  // sizeof the referenced type (reference) or pointee (pointer)
};

// The alignment a GPU wants of a [[buffer]] argument's address: its pointee's (the size's lowest set bit, 16 bytes at
// most), as loads through a misaligned pointer fault on NVIDIA and Metal requires setBuffer offsets aligned to the
// type the kernel reads; 1 for what is not a pointer.
inline size_t buffer_alignment(const ParamInfo& param) {
  if (param.kind != ParamKind::pointer || param.pointee_size == 0) return 1;
  const size_t lowest_bit = param.pointee_size & ~(param.pointee_size - 1);
  return lowest_bit < 16 ? lowest_bit : 16;
}

// One function constant of a compiled variant: [[function_constant(index)]] defined or not, and its value.
struct FcState {
  int index;
  bool defined;
  bool value;
};

// What one GPU thread's kernel call is built from.
struct LaunchArgs {
  void* const* buffers;    // [[buffer(i)]]
  void* const* tg_memory;  // [[threadgroup(i)]]
  uint32_t thread_in_grid[3];
  uint32_t thread_in_tg[3];
  uint32_t tg_in_grid[3];
  uint32_t threads_per_tg[3];
  uint32_t tgs_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t index_in_tg;
  uint32_t lane;
  uint32_t simdgroup;
  uint32_t simdgroups_per_tg;
};

using LaunchFn = void (*)(const ParamAttr* attrs, const LaunchArgs& args);

// Registers one instantiated kernel (one function-constant variant of it) at load time.
struct KernelRegistrar {
  KernelRegistrar(const char* host_name, int registry, LaunchFn launch, const ParamAttr* attrs, int n_attrs,
                  std::vector<ParamInfo> params, const FcState* fcs, int n_fcs, const char* source);
};

// SIMD collective: every active lane posts `in`, the last one to arrive runs `combine` over all lanes,
// which writes every lane's `out`. in/out are indexed by lane; entries of inactive lanes are null.
using CombineFn = void (*)(void* const* in, void* const* out, uint32_t active_mask);
void simd_collective(CombineFn combine, void* in, void* out, const char* site, const char* what);
// `orders_threadgroup` is whether the barrier's mem_flags include mem_threadgroup.
void threadgroup_barrier(const char* site, bool orders_threadgroup);
void yield_for_atomic();   // lets the scheduler run others while a thread polls (deadlock detection)
void note_progress();      // an atomic write: someone polling may now advance
uint32_t current_lane();
void* threadgroup_alloc(const char* key, size_t size);
[[noreturn]] void kernel_fault(const char* what);

}  // namespace msl_rt
