#!/bin/bash
# Issue 21, tenth session, call 6 ($1: seconds it may take): the routing's top list (moe_top_list) against moe_pick's
# rounds. cur = c031a60's PTX; top = cur with the moe.ptx of head.txt (the routed gate/up and early down kernels take
# their k <= 8 experts from one merged top-8 list). The host of head.txt (no binding changed). In order: moe kernel
# tests on the GPU with top and memcheck over their staged and routed cases; lily.selftest --device cuda --kernels moe
# with top; the tg128 A/B cur / top / cur2 at depths 4096 and 0 with the critical-path timeline at 4096. Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-580}
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
root=$PWD; D=$root/.dev/d4; P=/tmp/ptx13; R=/tmp/r13/call6; rm -rf $R; mkdir -p $R
finish() { tar czf $OUT/call6.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
cp $D/head.txt $R/
rm -rf $P; mkdir -p $P/cur $P/top && tar xJf $D/cur.tar.xz -C $P/cur && cp $P/cur/*.ptx $P/top/ && xz -dc $D/moe_top.ptx.xz > $P/top/moe.ptx
python3 $D/jitwarm.py -j 8 $P/cur/*.ptx $P/top/moe.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
LILY_CUDA_PTX_DIR=$P/top LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_moe.py > $R/kernel_tests_moe.txt 2>&1; t "moe kernel tests rc=$?"; tail -1 $R/kernel_tests_moe.txt
LILY_CUDA_PTX_DIR=$P/top LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 50 /usr/local/cuda/bin/compute-sanitizer \
  --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py \
  -k "staged or routed" > $R/sanitizer_memcheck_moe.txt 2>&1
t "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck_moe.txt | tail -2
LILY_CUDA_PTX_DIR=$P/top timeout 40 python3 -m lily.selftest --device cuda --kernels moe > $R/selftest_moe.txt 2>&1
t "selftest rc=$?"; tail -2 $R/selftest_moe.txt
timeout $(left 5) python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 24 \
  cur=$P/cur top=$P/top cur2=$P/cur 2>&1 | grep -v Warning > $R/ab.txt
t "A/B rc=$?"; grep -E "^==|^ +(cur|top|cur2) +[0-9]" $R/ab.txt | grep -v "between\|timeline"
t done
