#!/bin/bash
# Issue 21, tenth session, call 1 ($1: seconds it may take): the tree of 86dc13d (EARLY_MOE_DOWN back, on by
# default), its PTX (cur). llama.cpp builds in the background for call 2. In order: moe kernel tests on the GPU and
# compute-sanitizer memcheck over the staged moe cases; the EARLY_MOE_DOWN engine test on the GPU (same tokens and
# logits bits on and off); lily.selftest --device cuda; the tg128 A/B late / early / late2 at depths 4096 and 0 in one
# process with each variant's critical-path timeline at 4096. Everything under $OUT, tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-580}
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
root=$PWD; D=$root/.dev/d1; P=/tmp/ptx10/cur; R=/tmp/r10/call1; rm -rf $R; mkdir -p $R
finish() { tar czf $OUT/call1.tar.gz -C $R .; }
trap finish EXIT
rm -rf $P; mkdir -p $P && tar xJf $D/cur.tar.xz -C $P
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
cp $D/head.txt $R/
python3 $D/jitwarm.py -j 8 $P/*.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
export PEER_OUT=/tmp/lily-peer/out; rm -rf $PEER_OUT; mkdir -p $PEER_OUT
(OUT=$PEER_OUT JOBS=8 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
export LILY_CUDA_PTX_DIR=$P
cd /tmp
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --rootdir $root \
  $root/tests/kernels/test_moe.py > $R/kernel_tests_moe.txt 2>&1; t "moe kernel tests rc=$?"; tail -1 $R/kernel_tests_moe.txt
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
  --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_moe.py \
  -k "staged" > $R/sanitizer_memcheck_moe.txt 2>&1
t "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck_moe.txt | tail -2
LILY_ENGINE_RUNTIMES=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider --rootdir $root \
  $root/tests/engine/test_ablation_early_moe_down.py $root/tests/engine/test_early_start.py > $R/engine_tests_early.txt 2>&1
t "engine tests rc=$?"; tail -1 $R/engine_tests_early.txt
timeout 150 python3 -m lily.selftest --device cuda > $R/selftest.txt 2>&1; t "selftest rc=$?"; tail -2 $R/selftest.txt
cd $root
timeout $(left 5) python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 24 \
  late=$P,LILY_DISABLE_EARLY_MOE_DOWN=1 early=$P late2=$P,LILY_DISABLE_EARLY_MOE_DOWN=1 2>&1 | grep -v Warning > $R/ab.txt
t "A/B rc=$?"; grep -E "^==|^ +(late|early|late2) +[0-9]" $R/ab.txt | grep -v "between\|timeline"
t done
