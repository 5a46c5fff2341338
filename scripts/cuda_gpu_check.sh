#!/usr/bin/env bash
# The CUDA driver layer and the kernels on a real NVIDIA GPU, in one call on the GPU machine (docs/verification.md).
# That machine has no clang 19: the extension is built there with its own compiler (no CPU harness, no PTX build)
# and the PTX comes from this machine, carried in the working tree:
#
#   here:   python tools/cuda_kernels.py build/ptx --check-arch      (or use build/dev/cuda_kernels of a clang-19 build)
#   there:  scripts/cuda_gpu_check.sh build/ptx                       (carry build/ptx; logs go to $OUT when set)
#
# Runs: tests/test_cuda_driver.py on GPU 0 (graphs, set_kernel, events, errors), the kernel tests with every dispatch
# on the GPU, and `python -m lily.selftest --device cuda`. Exit status: non-zero if any of them failed.
set -uo pipefail
ptx=$(realpath "${1:?usage: scripts/cuda_gpu_check.sh PTX_DIR}")
logs=${OUT:-$(mktemp -d)}
cd "$(dirname "$0")/.."

start=$(date +%s)
# A test build: pytest refuses a build without the test doubles (tests/conftest.py).
if ! python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu \
    -Ccmake.define.LILY_CUDA_KERNELS=OFF -Ccmake.define.LILY_TEST_BUILD=ON . >"$logs/build.txt" 2>&1; then
  tail -40 "$logs/build.txt"
  exit 1
fi
echo "built lily in $(( $(date +%s) - start )) s; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"

export LILY_CUDA_PTX_DIR="$ptx" LILY_CUDA_TESTS=gpu HF_HUB_OFFLINE=1
cd /tmp  # the installed lily (with its extension), not the tree's python/
status=0
root=$OLDPWD
python3 -m pytest -q -p no:cacheprovider --rootdir "$root" "$root/tests/test_cuda_driver.py" \
  >"$logs/driver_tests.txt" 2>&1 || status=1
tail -3 "$logs/driver_tests.txt"
LILY_KERNEL_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --rootdir "$root" "$root/tests/kernels" \
  --ignore="$root/tests/kernels/test_registry.py" >"$logs/kernel_tests.txt" 2>&1 || status=1
tail -3 "$logs/kernel_tests.txt"
python3 -m lily.selftest --device cuda >"$logs/selftest.txt" 2>&1 || status=1
tail -2 "$logs/selftest.txt"
# The files' git tree: on the GPU machine the copy's HEAD is the last landed commit while its files may be a later
# commit's (`git rev-parse COMMIT^{tree}` here names the commit whose files ran).
tree=$(cd "$root" && index=$(mktemp -u) && GIT_INDEX_FILE=$index git add -A && GIT_INDEX_FILE=$index git write-tree;
       rm -f "$index")
echo "files of tree ${tree:-?} (HEAD $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')), " \
     "$(date -u '+%Y-%m-%d %H:%M UTC'), $(( $(date +%s) - start )) s in all; logs in $logs"
exit $status
