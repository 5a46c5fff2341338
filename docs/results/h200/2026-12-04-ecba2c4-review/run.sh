#!/bin/bash
# Issue 21, review: the split-KV partial kernels share one partial store and empty-block helper; the mma partial's
# block stats come from the column totals it already holds. Attention kernel tests and compute-sanitizer on the GPU,
# the decode attention cases of bench_kernels.
export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
(cd .dev && tar xJf ptx.tar.xz)
python3 -m pip install -q --no-build-isolation --no-deps -Ccmake.define.LILY_CUDA_KERNELS=OFF . > /tmp/install.log 2>&1; t "install rc=$?"
export LILY_CUDA_PTX_DIR=$PWD/.dev/ptx HF_HUB_OFFLINE=1
LILY_KERNEL_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py > $OUT/kernel_tests.txt 2>&1; t "kernel tests rc=$?"; tail -1 $OUT/kernel_tests.txt
for tool in memcheck racecheck; do
  LILY_KERNEL_DEVICE=cuda timeout 40 /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py -k "partial or combine" -x > $OUT/sanitizer_$tool.txt 2>&1; t "$tool rc=$?"; grep -E "passed|failed|SUMMARY" $OUT/sanitizer_$tool.txt | tail -2
done
timeout 40 python3 scripts/bench_kernels.py --repeats 20 --kernels '^attention_decode' --json $OUT/bench_kernels_attention.json > $OUT/bench_kernels_attention.txt 2>&1; t "bench rc=$?"; grep attention $OUT/bench_kernels_attention.txt | cut -d'|' -f2,4,5
t done
