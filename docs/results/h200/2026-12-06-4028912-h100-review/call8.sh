#!/bin/bash
# Issue 21, tenth session, call 8: the review's moe.ptx (the staged down kernel's late variant reads the ids through
# threadgroup memory; one load call for both). cur = c031a60's PTX with that moe.ptx; the host of head.txt. The moe
# kernel tests on the GPU and compute-sanitizer memcheck over their staged cases. Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
root=$PWD; D=$root/.dev/d5; P=/tmp/ptx14; R=/tmp/r14; rm -rf $R $P; mkdir -p $R $P
trap 'tar czf $OUT/call8.tar.gz -C $R .' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $R/device.txt; cp $D/head.txt $R/
tar xJf $D/cur.tar.xz -C $P && xz -dc $D/moe.ptx.xz > $P/moe.ptx
python3 $D/jitwarm.py -j 8 $P/moe.ptx > $R/jitwarm.txt 2>&1 &
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; echo "built rc=$?"; wait
export LILY_CUDA_PTX_DIR=$P LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py > $R/kernel_tests_moe.txt 2>&1
echo "moe tests rc=$?"; tail -1 $R/kernel_tests_moe.txt
timeout 50 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
  -p no:cacheprovider tests/kernels/test_moe.py -k staged > $R/sanitizer_memcheck_moe.txt 2>&1
echo "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck_moe.txt | tail -2
