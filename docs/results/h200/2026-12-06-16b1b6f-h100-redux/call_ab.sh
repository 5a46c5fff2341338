#!/bin/bash
# Issue 21, fourteenth session, A/B call ($1: seconds it may take). redux.tar.xz: the 13 PTX files of the branch
# exp/redux (32-bit integer SIMD reductions as one redux.sync in the CUDA shim, integer prefix sums as a 5-step
# scan, moe_pick's round as two integer reductions); main.tar.xz: main's. With redux's PTX: the whole kernel test
# suite on the GPU, compute-sanitizer memcheck over the moe and sampling tests, lily.selftest --device cuda; then
# decode_ab --depths 4096,0 --rounds 5 --profile 16: base (main) redux base2 (main). llama.cpp builds in the
# background (JOBS=14) for call.sh's peer stage. Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-400}
root=$PWD; D=$root/.dev/d14; P=/tmp/p14ab; R=/tmp/r14/ab; rm -rf $R $P; mkdir -p $R $P/main $P/redux
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
finish() { cp /tmp/lily-peer/build_stage.log $R/ 2>/dev/null; tar czf $OUT/ab.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
cp $D/tree.txt $R/
export PEER_OUT=/tmp/lily-peer/out; mkdir -p $PEER_OUT /tmp/lily-peer
[ -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] || [ -e /tmp/lily-peer/build_stage.log ] || (OUT=$PEER_OUT JOBS=14 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
tar xJf $D/main.tar.xz -C $P/main; tar xJf $D/redux.tar.xz -C $P/redux
(cd $P && sha256sum main/*.ptx redux/*.ptx) > $R/ptx_sha256.txt
python3 $D/jitwarm.py -j 16 $P/main/*.ptx $P/redux/*.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
export LILY_CUDA_PTX_DIR=$P/redux
(cd /tmp && LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider \
  --rootdir $root $root/tests/kernels --ignore=$root/tests/kernels/test_registry.py > $R/kernel_tests_redux.txt 2>&1)
t "kernel tests (redux) rc=$?"; tail -1 $R/kernel_tests_redux.txt
(cd /tmp && LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 90 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
  --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_moe.py \
  $root/tests/kernels/test_sampling.py > $R/sanitizer_memcheck_redux.txt 2>&1)
t "memcheck (redux) rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck_redux.txt | tail -2
timeout 100 python3 -m lily.selftest --device cuda > $R/selftest_redux.txt 2>&1; t "selftest (redux) rc=$?"; tail -1 $R/selftest_redux.txt
export LILY_CUDA_PTX_DIR=$P/main
timeout $(left 5) python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 16 \
  base=$P/main redux=$P/redux base2=$P/main 2>&1 | grep -v Warning > $R/ab.txt
t "A/B rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab.txt | grep -v "between\|timeline"
grep -E "moe|sampl" $R/ab.txt | head -30
t done
