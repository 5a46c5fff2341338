#!/bin/bash
# Issue 21, twelfth session, call 1 ($1: seconds it may take): the tree of head.txt (main + test option
# seg_stream_groups). PTX built here with clang 19: main (this tree's 13 files), early (main with
# exp/prep-angles-early's attention_prep.ptx: rotary angles before the wait), slot (main with review/qmv-slot-layout's
# qmatmul.ptx). In order: qmatmul kernel tests on the GPU with slot, compute-sanitizer memcheck over its staged cases,
# lily.selftest --device cuda with slot; decode_ab A (depths 0, 4096): base early seg396 base2; decode_ab B (depths
# 4096, 0): base seg288 seg576 base2 (seg*: sw.seg_stream_groups, the q|k|v GEMV's streaming threadgroups, 528 by
# default of which 3 per SM fit at 160 registers). Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-560}
root=$PWD; D=$root/.dev/d9; P=/tmp/p9; R=/tmp/r9/call1; rm -rf $R $P; mkdir -p $R $P/main $P/early $P/slot
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
trap 'tar czf $OUT/call1.tar.gz -C $R .' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
git log -1 --format='%H %s' > $R/head.txt 2>/dev/null || cp $D/head.txt $R/
tar xJf $D/main.tar.xz -C $P/main && cp $P/main/*.ptx $P/early/ && cp $P/main/*.ptx $P/slot/
xz -dc $D/attention_prep_early.ptx.xz > $P/early/attention_prep.ptx; xz -dc $D/qmatmul_slot.ptx.xz > $P/slot/qmatmul.ptx
python3 $D/jitwarm.py -j 16 $P/main/*.ptx $P/early/attention_prep.ptx $P/slot/qmatmul.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
export LILY_CUDA_PTX_DIR=$P/slot
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_qmatmul.py > $R/kernel_tests_qmatmul.txt 2>&1
t "qmatmul kernel tests (slot) rc=$?"; tail -1 $R/kernel_tests_qmatmul.txt
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 70 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
  --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qmatmul.py -k "staged" \
  > $R/sanitizer_memcheck.txt 2>&1
t "memcheck (slot) rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck.txt | tail -2
timeout 100 python3 -m lily.selftest --device cuda > $R/selftest.txt 2>&1; t "selftest (slot) rc=$?"; tail -2 $R/selftest.txt
unset LILY_CUDA_PTX_DIR
timeout $(left 170) python3 scripts/decode_ab.py --depths 0,4096 --rounds 5 --profile 16 --top 16 \
  base=$P/main early=$P/early seg396=$P/main,sw.seg_stream_groups=396 base2=$P/main 2>&1 | grep -v Warning > $R/ab_a.txt
t "A/B a rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab_a.txt | grep -v "between\|timeline"
timeout $(left 5) python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 16 \
  base=$P/main seg288=$P/main,sw.seg_stream_groups=288 seg576=$P/main,sw.seg_stream_groups=576 base2=$P/main \
  2>&1 | grep -v Warning > $R/ab_b.txt
t "A/B b rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab_b.txt | grep -v "between\|timeline"
t done
