#!/usr/bin/env bash
# The engine on a real NVIDIA GPU in one call (docs/verification.md, "The engine on the H200").
#
#   scripts/h200_engine_check.sh prepare   # here (clang-19, ptxas, mlx-lm): PTX and the tiny checkpoints into .dev/h200
#   scripts/h200_engine_check.sh run       # there (g++, no clang, no network): build with g++, run the engine tests
#
# `run` builds lily._ext with g++ (the Metal test runtime needs clang, so that build has only the CUDA runtime),
# then runs the engine tests that take `engine_backend` / `engine_runtime` on the CUDA runtime over the machine's
# libcuda (the tiny checkpoints in float32 and bf16, every switch, the demo model's top-1 and perplexity), with the PTX
# and checkpoints made by `prepare` (carry .dev/h200). It prints one summary line per step; the device call is:
#   run(command="scripts/h200_engine_check.sh run", carry=[".dev/h200"], timeout_s=300)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEV=$ROOT/.dev/h200

if [[ "${1:-}" == "prepare" ]]; then
  rm -rf "$DEV/ptx" "$DEV/checkpoints"
  mkdir -p "$DEV"
  python tools/cuda_kernels.py "$DEV/ptx"
  rm -rf "$DEV"/ptx/*.cu "$DEV"/ptx/check_*  # the PTX is what travels
  PYTHONPATH=$ROOT python -c "from pathlib import Path; from tests.engine.test_metal_backend import save_checkpoints; \
save_checkpoints(Path('$DEV/checkpoints'))"
  du -sh "$DEV"
  exit 0
fi
[[ "${1:-}" == "run" ]] || { echo "usage: $0 prepare|run" >&2; exit 2; }
ls "$DEV"/ptx/*.ptx >/dev/null && ls "$DEV"/checkpoints/mlx >/dev/null

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 --version
start=$(date +%s)
# Into the image's python3 (itself a venv holding torch and numpy); no PTX build there (no clang 19). A test build:
# the tests drive lily._ext._test_engine (pytest refuses a build without the test doubles).
CXX=g++ CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --no-deps --no-build-isolation \
  -Cbuild-dir=/tmp/lily-build -Ccmake.define.LILY_CUDA_KERNELS=OFF -Ccmake.define.LILY_TEST_BUILD=ON .
echo "build: $(( $(date +%s) - start )) s"
cd /tmp  # the installed lily, not python/ of the tree; the tree's tests import each other as `tests.*`
python3 -c "import lily._ext as e; print('lily._ext platform:', e.platform)"

export LILY_CUDA_PTX_DIR=$DEV/ptx LILY_ENGINE_CHECKPOINTS=$DEV/checkpoints LILY_ENGINE_RUNTIMES=cuda HF_HUB_OFFLINE=1
export PYTHONPATH=$ROOT
status=0
python3 -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/engine/test_metal_backend.py" \
  "$ROOT/tests/engine/test_demo_metal.py" "$ROOT/tests/engine/test_cuda_backend.py" -k "cuda" --durations=5 \
  >/tmp/engine_tests.txt 2>&1 || status=1
tail -40 /tmp/engine_tests.txt
# Host time per decode token (Lily's C++ between two tokens: finding the step, patching, upload and graph launch) and
# the tiny model's decode speed, bf16, 256 greedy tokens with two steps in flight.
python3 - <<'PY'
import os, statistics, time
from pathlib import Path
import numpy as np
from lily.backends.cuda import CudaBackend
from lily.checkpoint import load_checkpoint
backend = CudaBackend(load_checkpoint(Path(os.environ["LILY_ENGINE_CHECKPOINTS"]) / "mlx"))
state = backend.new_state()
logits = backend.forward(np.array([5, 17, 300, 2]), state, last_only=True)
backend.generate_greedy(state, int(np.argmax(logits[-1])), 16)  # warm: both token slots recorded
backend.host_timing(True)
start = time.perf_counter()
backend.generate_greedy(state, 1, 256)
seconds = time.perf_counter() - start
# The submit times of those tokens; then the engine's C++ alone, timed in a second run (it submits each step twice).
submit = statistics.median(backend.host_timing(False, cpp=True)["encode"]) / 1e3
backend.generate_greedy(state, 1, 256)
cpp = statistics.median(backend.host_timing(False)["cpp"]) / 1e3
print(f"tiny model bf16 decode: {256 / seconds:.0f} tok/s; host per token: submit median {submit:.1f} us, "
      f"engine C++ alone {cpp:.1f} us")
PY
# The files' git tree: on the GPU machine the copy's HEAD is the last landed commit while its files may be a later
# commit's (`git rev-parse COMMIT^{tree}` here names the commit whose files ran).
tree=$(cd "$ROOT" && index=$(mktemp -u) && GIT_INDEX_FILE=$index git add -A && GIT_INDEX_FILE=$index git write-tree;
       rm -f "$index")
echo "files of tree ${tree:-?} (HEAD $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')), " \
     "$(date -u '+%Y-%m-%d %H:%M UTC'), total $(( $(date +%s) - start )) s"
exit $status
