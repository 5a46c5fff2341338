#!/bin/bash
# Issue 21, call D (commit 0c3c83e, kernels of 5472caf): scripts/cuda_gpu_check.sh (driver tests, every kernel test
# on the GPU, lily.selftest --device cuda).
(cd .dev && tar xJf ptx.tar.xz)
OUT=$OUT bash scripts/cuda_gpu_check.sh .dev/ptx
