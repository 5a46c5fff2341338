#!/bin/bash
# Issue 21, 2026-12-05 fifth session, call 4: qmv_mma with the engine's simdgroups by output count (8 below 8192, else
# 4) and the 2-row rule: bench_kernels qmv/qmv_mma cases, short prompts through the engine with MMA_GEMV on and off
# (lily bench -p 1,2,4,8, two processes each, alternating), qmv_mma's kernel cases on the GPU and compute-sanitizer
# memcheck over them. PTX: bb48e4f's kernels with this tree's qmatmul.ptx.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
root=$PWD; C=$root/.dev/c4
(cd $C && tar xJf full.tar.xz && cp qmatmul.ptx full/)
export LILY_CUDA_PTX_DIR=$C/full
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
python3 $C/jitwarm.py -j 8 $C/full/*.ptx > $OUT/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $OUT/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
timeout 90 python3 scripts/bench_kernels.py --repeats 20 --kernels "^qmv (square|Delta|attention|lm_head)|qmv_mma" --json $OUT/bench_kernels.json > $OUT/bench_kernels.txt 2>&1; t "bench rc=$?"
for v in on off on off; do
  if [ $v = off ]; then export LILY_DISABLE_MMA_GEMV=1; else unset LILY_DISABLE_MMA_GEMV; fi
  f=$OUT/pp_mma_$v.$RANDOM
  timeout 100 lily bench --dummy-weights --full-size --backend cuda -p 1,2,4,8 -n 4 -d 0 -r 7 --no-expert-load -o json > $f.json 2> $f.log; t "pp $v rc=$?"
  grep -E "^\s+(pp)" $f.log
done
unset LILY_DISABLE_MMA_GEMV
cd /tmp
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_qmatmul.py -k "mma" > $OUT/kernel_tests_qmv_mma.txt 2>&1; t "kernel tests rc=$?"; tail -2 $OUT/kernel_tests_qmv_mma.txt
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_qmatmul.py -k "qmv_mma" > $OUT/sanitizer_memcheck_qmv_mma.txt 2>&1; t "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $OUT/sanitizer_memcheck_qmv_mma.txt | tail -2
t done
