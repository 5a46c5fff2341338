#!/bin/bash
# Issue 21: attention_decode_mma with its gate rows staged first: kernel tests on the GPU, the single pass over 2 / 4 / 8
# simdgroups at 64 and 200 keys, tg128 at depth 0 with the engine's single pass on 8 and on 4 simdgroups.
export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
(cd .dev && tar xJf ptx.tar.xz)
python3 -m pip install -q --no-build-isolation --no-deps -Ccmake.define.LILY_CUDA_KERNELS=OFF . > /tmp/install.log 2>&1; t "install rc=$?"
export LILY_CUDA_PTX_DIR=$PWD/.dev/ptx HF_HUB_OFFLINE=1
LILY_KERNEL_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py -k "decode_mma" > $OUT/kernel_tests.txt 2>&1; t "kernel tests rc=$?"; tail -1 $OUT/kernel_tests.txt
timeout 60 python3 .dev/sweep_single.py $OUT/sweep_single.json > $OUT/sweep_single.txt 2>&1; t "sweep rc=$?"; grep "simdgroups=" $OUT/sweep_single.txt | grep -v copy
for sg in 8 4; do
  sed -i "s/^#define LILY_ATTN_DECODE_MMA_SINGLE_SIMDGROUPS .*/#define LILY_ATTN_DECODE_MMA_SINGLE_SIMDGROUPS $sg/" metal/lily.h
  python3 -m pip install -q --no-build-isolation --no-deps -Ccmake.define.LILY_CUDA_KERNELS=OFF . > /tmp/install.log 2>&1; t "install sg=$sg rc=$?"
  timeout 70 lily bench --dummy-weights --full-size --backend cuda -p 1 -n 128 -d 0 -r 5 --no-expert-load -o json > $OUT/lily-bench-single$sg.json 2> $OUT/lily-bench-single$sg.log; t "lily bench rc=$?"
  grep -E "^\s+tg" $OUT/lily-bench-single$sg.log
done
t done
