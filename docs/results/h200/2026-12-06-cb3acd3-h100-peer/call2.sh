#!/bin/bash
# Issue 21, twelfth session, call 2 ($1: seconds it may take): the tree of cb3acd3 (QmvSlotLayout and attention_prep's
# early rotary angles merged), its PTX built here with clang 19 (main.tar.xz). llama.cpp builds in the background for
# call 3 (JOBS=14). In order: tests/kernels/test_attention.py on the GPU, compute-sanitizer memcheck over its prep
# cases, lily.selftest --device cuda, the engine tests on the CUDA runtime (the tiny checkpoints saved here:
# .dev/h200/checkpoints, as scripts/h200_engine_check.sh runs them), scripts/bench_kernels.py --json, a decode profile
# at depth 4096; then it waits for llama.cpp's build. Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-570}
root=$PWD; D=$root/.dev/d10; P=/tmp/p10/main; R=/tmp/r10/call2; rm -rf $R $P; mkdir -p $R $P
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
finish() { cp /tmp/lily-peer/build_stage.log /tmp/lily-peer/out/*.log $R/ 2>/dev/null; tar czf $OUT/call2.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
export PEER_OUT=/tmp/lily-peer/out; rm -rf $PEER_OUT; mkdir -p $PEER_OUT
[ -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] || (OUT=$PEER_OUT JOBS=14 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
tar xJf $D/main.tar.xz -C $P
python3 $D/jitwarm.py -j 16 $P/*.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
export LILY_CUDA_PTX_DIR=$P
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_attention.py > $R/kernel_tests_attention.txt 2>&1
t "attention kernel tests rc=$?"; tail -1 $R/kernel_tests_attention.txt
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
  --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py -k "prep" \
  > $R/sanitizer_memcheck.txt 2>&1
t "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck.txt | tail -2
timeout 100 python3 -m lily.selftest --device cuda > $R/selftest.txt 2>&1; t "selftest rc=$?"; tail -2 $R/selftest.txt
(cd /tmp && LILY_ENGINE_CHECKPOINTS=$root/.dev/h200/checkpoints LILY_ENGINE_RUNTIMES=cuda PYTHONPATH=$root \
  timeout 150 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/engine/test_metal_backend.py \
  $root/tests/engine/test_demo_metal.py $root/tests/engine/test_cuda_backend.py -k cuda --durations=5 \
  > $R/engine_tests.txt 2>&1); t "engine tests rc=$?"; tail -1 $R/engine_tests.txt
timeout $(left 100) python3 scripts/bench_kernels.py --repeats 20 --json $R/bench_kernels.json > $R/bench_kernels.txt 2>&1
t "bench_kernels rc=$?"
timeout $(left 50) python3 $D/profile_kernels.py --prompt 8 --decode 32 --depth 4096 2>&1 | grep -v Warning \
  > $R/profile_d4096.txt; t "profile rc=$?"
while [ ! -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] && [ $(left) -gt 10 ]; do sleep 5; done
t "llama-bench: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"; tail -2 /tmp/lily-peer/build_stage.log
t done
