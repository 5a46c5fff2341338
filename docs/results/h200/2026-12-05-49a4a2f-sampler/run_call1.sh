#!/bin/bash
# Seventh session, call 1: the sixth session's call 8 (sampler old/new), then decode profiles of the current tree.
root=$PWD
bash .dev/d5/call8.sh
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
NEW=$root/.dev/d5/new
for d in 0 4096; do
  LILY_CUDA_PTX_DIR=$NEW timeout 100 python3 .dev/e1/profile_kernels.py --prompt 64 --decode 64 --depth $d --top 30 > $OUT/profile_d$d.txt 2>&1; t "profile d$d rc=$?"
  grep -A32 "== decode" $OUT/profile_d$d.txt | cut -c1-140
done
git rev-parse HEAD > $OUT/head.txt
