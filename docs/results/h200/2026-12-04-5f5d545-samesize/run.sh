#!/bin/bash
# Issue 21: the kernel bandwidth targets against a copy of each kernel's own bytes (bench_kernels.py's new
# same-size-copy column), every case, cold and warm L2.
export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
(cd .dev && tar xJf ptx.tar.xz)
python3 -m pip install -q --no-build-isolation --no-deps -Ccmake.define.LILY_CUDA_KERNELS=OFF . > /tmp/install.log 2>&1; t "install rc=$?"
export LILY_CUDA_PTX_DIR=$PWD/.dev/ptx HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt 2>&1
timeout 400 python3 scripts/bench_kernels.py --repeats 20 --json $OUT/bench_kernels.json > $OUT/bench_kernels.txt 2>&1; t "bench rc=$?"
grep -E "copy 1 GiB|lm_head|square 2048x2048, M=1|gate/up|down" $OUT/bench_kernels.txt | cut -d'|' -f2,4,8,9,10 | head -30
t done
