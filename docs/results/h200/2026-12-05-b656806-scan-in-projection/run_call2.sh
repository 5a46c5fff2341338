#!/bin/bash
# Issue 21, 2026-12-05 sixth session, call 2: SCAN_IN_PROJECTION (the DeltaNet decode scan inside the in_proj GEMV,
# qmv_norm_seg_conv_scan_staged) on against off, one PTX set (this tree's, every kernel), tg128 at depths 0 and 4096
# in one process (decode_ab: off, on, off2 as the noise floor; 16-token profiles); the new kernel's cases on the GPU,
# then under compute-sanitizer memcheck. llama.cpp builds in the background for the next call.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
root=$PWD; C=$root/.dev/d2; P=$C/full
(cd $C && tar xJf full.tar.xz)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
export PEER_OUT=/tmp/lily-peer/out; mkdir -p $PEER_OUT
(OUT=$PEER_OUT JOBS=6 setsid nohup bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
python3 $C/jitwarm.py -j 6 $P/*.ptx > $OUT/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $OUT/install.log 2>&1; t "install rc=$?"
wait $JW; t "jit warm"
timeout 420 python3 scripts/decode_ab.py --depths 0,4096 --rounds 7 --profile 16 off=$P,sw.scan_in_projection=0 \
  on=$P off2=$P,sw.scan_in_projection=0 2>&1 | grep -v Warning > $OUT/ab.txt; t "ab rc=$?"
grep -E "^==|^ +[a-zA-Z0-9]+ +[0-9]" $OUT/ab.txt | head -12
grep -E "conv|gated_delta|gated_norm" $OUT/ab.txt | head -24
(cd /tmp && LILY_CUDA_PTX_DIR=$P LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_qmatmul.py -k "conv_scan" > $OUT/kernel_tests_conv_scan.txt 2>&1; t "kernel tests rc=$?"; tail -1 $OUT/kernel_tests_conv_scan.txt)
(cd /tmp && LILY_CUDA_PTX_DIR=$P LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 90 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_qmatmul.py -k "conv_scan" > $OUT/sanitizer_memcheck_conv_scan.txt 2>&1; t "memcheck rc=$?"; tail -3 $OUT/sanitizer_memcheck_conv_scan.txt)
t "llama build: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"
t done
