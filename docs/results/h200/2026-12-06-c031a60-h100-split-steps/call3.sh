#!/bin/bash
# Issue 21, tenth session, call 3 ($1: seconds it may take): the tree of head.txt (EARLY_MOE_DOWN on, SPLIT_STEPS new),
# its PTX (cur). llama.cpp builds in the background for call 4. In order: qmatmul + moe kernel tests on the GPU,
# compute-sanitizer memcheck over the split-step, staged and moe staged cases; the engine tests of both switches and of
# early start on the GPU (from the repository root); lily.selftest --device cuda; the tg128 A/B nosplit / split /
# nosplit2 at depths 4096 and 0 in one process with each variant's critical-path timeline at 4096. Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-580}
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
root=$PWD; D=$root/.dev/d2; P=/tmp/ptx11/cur; R=/tmp/r11/call3; rm -rf $R; mkdir -p $R
finish() { tar czf $OUT/call3.tar.gz -C $R .; }
trap finish EXIT
rm -rf $P; mkdir -p $P && tar xJf $D/cur.tar.xz -C $P
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
cp $D/head.txt $R/
python3 $D/jitwarm.py -j 8 $P/*.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
export PEER_OUT=/tmp/lily-peer/out; rm -rf $PEER_OUT; mkdir -p $PEER_OUT
[ -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] || (OUT=$PEER_OUT JOBS=8 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
export LILY_CUDA_PTX_DIR=$P
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_qmatmul.py tests/kernels/test_moe.py > $R/kernel_tests_qmatmul_moe.txt 2>&1
t "qmatmul + moe kernel tests rc=$?"; tail -1 $R/kernel_tests_qmatmul_moe.txt
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 70 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
  --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qmatmul.py tests/kernels/test_moe.py \
  -k "staged" > $R/sanitizer_memcheck.txt 2>&1
t "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck.txt | tail -2
LILY_ENGINE_RUNTIMES=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/engine/test_ablation_split_steps.py \
  tests/engine/test_ablation_early_moe_down.py tests/engine/test_early_start.py > $R/engine_tests.txt 2>&1
t "engine tests rc=$?"; tail -1 $R/engine_tests.txt
timeout 100 python3 -m lily.selftest --device cuda > $R/selftest.txt 2>&1; t "selftest rc=$?"; tail -2 $R/selftest.txt
timeout $(left 5) python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 24 \
  nosplit=$P,LILY_DISABLE_SPLIT_STEPS=1 split=$P nosplit2=$P,LILY_DISABLE_SPLIT_STEPS=1 2>&1 | grep -v Warning > $R/ab.txt
t "A/B rc=$?"; grep -E "^==|^ +(nosplit|split|nosplit2) +[0-9]" $R/ab.txt | grep -v "between\|timeline"
t done
