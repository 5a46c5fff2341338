#!/usr/bin/env bash
# Installs everything the tests need (apt, pip), builds Lily, and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages="clang-19 libclang-rt-19-dev"
if ! command -v clang++-19 >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y $apt_packages || { $SUDO apt-get update && $SUDO apt-get install -y $apt_packages; }
fi

python -m pip install --upgrade pip >/dev/null
# clang-19 builds the Metal test runtime (the kernels on the CPU harness, the fake Metal), so every test runs; any
# other C++17 compiler builds Lily without it.
# LILY_CUDA_KERNELS=OFF: no PTX in the package; tests/test_cuda_build.py compiles every kernel for CUDA once, and the
# CUDA tests use that.
CXX=clang++-19 python -m pip install ".[test]" -Ccmake.define.LILY_CUDA_KERNELS=OFF
export HF_HUB_OFFLINE=1
python -m pytest -q "$@"
