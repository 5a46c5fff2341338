#!/usr/bin/env bash
# Installs everything the tests need, builds Lily, and runs the test suite. Linux: apt (clang-19) and pip. macOS: pip
# only, with Xcode's command line tools; the kernels and the engine then run on the Mac's GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = Darwin ]; then
  if ! xcode-select -p >/dev/null 2>&1; then
    echo "scripts/test.sh: Lily builds with Xcode's command line tools; install them with: xcode-select --install" >&2
    exit 1
  fi
  python -m pip install --upgrade pip >/dev/null
  # Apple's clang (CXX unset) builds the engine on real Metal; the kernels compile at run time (no Metal Toolchain).
  # A test build (LILY_TEST_BUILD=ON) adds lily._ext._test_engine, which the engine tests drive.
  python -m pip install ".[test]" -Ccmake.define.LILY_TEST_BUILD=ON
  export HF_HUB_OFFLINE=1
  # Every kernel on this Mac's GPU against the reference first, then the suite: the engine tests (backend="metal")
  # run on the GPU, and what needs Linux (the CPU harness, the fake Metal, the CUDA toolchain) is skipped, saying why.
  selftest=0
  python -m lily.selftest || selftest=$?
  python -m pytest -q ${@+"$@"}  # macOS's bash 3.2 calls an empty "$@" unbound under set -u
  exit "$selftest"
fi

apt_packages="clang-19 libclang-rt-19-dev"
if ! command -v clang++-19 >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y $apt_packages || { $SUDO apt-get update && $SUDO apt-get install -y $apt_packages; }
fi

python -m pip install --upgrade pip >/dev/null
# A test build (LILY_TEST_BUILD=ON) links the test doubles (src/test_doubles/) that a plain `pip install .` leaves out;
# with clang-19 it builds the Metal test runtime (the kernels on the CPU harness, the fake Metal), so every test runs.
# LILY_CUDA_KERNELS=OFF: no PTX in the package; tests/test_cuda_build.py compiles every kernel for CUDA once, and the
# CUDA tests use that.
CXX=clang++-19 python -m pip install ".[test]" -Ccmake.define.LILY_TEST_BUILD=ON -Ccmake.define.LILY_CUDA_KERNELS=OFF
export HF_HUB_OFFLINE=1
python -m pytest -q "$@"
