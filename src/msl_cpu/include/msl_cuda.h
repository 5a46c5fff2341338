// MSL shim, CUDA target: the CPU harness's shim (msl_cpu.h) compiled by clang in CUDA device mode, so the same
// Metal source runs on NVIDIA GPUs (docs/cuda.md). Only what needs a GPU differs: SIMD collectives are warp
// shuffles, barriers are bar.sync, kernels are __global__ entry points named by their host name
// (msl_cuda_sync.h, msl_cuda_launch.h). No CUDA headers: clang's __nvvm_* builtins and libdevice only.
#pragma once

#define MSL_CUDA 1
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))

// libdevice (linked as bitcode) supplies correctly specified maths; the __builtin_ forms would be approximations.
extern "C" {
__device__ float __nv_sqrtf(float);
__device__ float __nv_expf(float);
__device__ float __nv_exp2f(float);
__device__ float __nv_powf(float, float);
__device__ float __nv_logf(float);
__device__ float __nv_log2f(float);
__device__ float __nv_log10f(float);
__device__ float __nv_sinf(float);
__device__ float __nv_cosf(float);
__device__ float __nv_tanf(float);
__device__ float __nv_tanhf(float);
__device__ float __nv_fmodf(float, float);
__device__ float __nv_atan2f(float, float);
__device__ float __nv_roundf(float);
}
#define MSL_LIBM(f) __nv_##f
// `device` becomes an MSL address-space macro below: later device variables are spelled __attribute__((__device__)).
#undef __device__

// Host headers stay host code (their constexpr functions are usable on the device); every MSL function after them
// is device code without an annotation, as in Metal.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>
#pragma clang force_cuda_host_device begin
#include "msl_cpu.h"
