// The fake libcuda's shared state (docs/cuda.md, "The fake libcuda"): the CUDA driver functions of
// src/lily_ext/cuda/driver_abi.h implemented on the CPU, for tests without a GPU. Device memory is host memory;
// modules are PTX text whose `.entry` names are resolved to the CPU harness's kernels by host name; a launch runs
// the kernel on the harness from the same Params block a GPU would get; streams and events are synchronous; graph
// nodes run in a seeded random order that respects only the declared dependencies.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cuda/driver_abi.h"

namespace lily::cuda_fake {

using namespace lily::cuda;  // the driver ABI's names, as cuda.h spells them

// Every exported function is declared from the one table, with its exported symbol as an asm label: a definition
// whose signature differs from the table does not compile.
#define LILY_CUDA_FAKE_DECLARE(member, symbol, fallback, result, params) \
  extern "C" __attribute__((visibility("default"))) result fake_##member params __asm__(symbol);
LILY_CUDA_DRIVER_FUNCTIONS(LILY_CUDA_FAKE_DECLARE)
LILY_CUDA_OPTIONAL_DRIVER_FUNCTIONS(LILY_CUDA_FAKE_DECLARE)
#undef LILY_CUDA_FAKE_DECLARE

// Records `detail` as the explanation of `code` (cuGetErrorString appends it) and returns `code`.
CUresult fail(CUresult code, const std::string& detail);

// The bytes from `ptr` to the end of the allocation holding it (device or pinned host), or 0 if none does.
size_t bytes_to_end(const void* ptr);

// A kernel of a loaded module: its host name and the dynamic shared memory limit set by cuFuncSetAttribute.
struct Function {
  std::string name;
  int max_dynamic_shared = 48 * 1024;
};

// Runs `fn` on the CPU harness with the Params block `params` points to; the harness seed comes from
// $LILY_FAKE_CUDA_SEED (default 0) and a launch counter. Returns the CUDA error for a bad launch or a kernel fault.
CUresult run_kernel(const Function& fn, const unsigned grid[3], const unsigned block[3], unsigned shared_bytes,
                    const void* params);

// The seed of the n-th graph launch of the process: graph node order and harness schedules derive from it.
uint64_t launch_seed(uint64_t n);

}  // namespace lily::cuda_fake
