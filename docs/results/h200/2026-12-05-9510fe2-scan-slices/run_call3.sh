#!/bin/bash
# Issue 21, 2026-12-05 fifth session, call 3: the decode token's DeltaNet scan (gated_delta_prefill at one token, one
# state row per simdgroup) on smaller threadgroups: 32 rows (1024 threads, the committed shape), 8 (256) or 4 (128)
# per threadgroup (LILY_EXP_SCAN_SIMDGROUPS: an uncommitted host override for this call only; the kernel takes its
# slice from its simdgroup count). tg128 at depths 0 and 4096, scripts/decode_ab.py, one process; 16-token profiles.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
root=$PWD; C=$root/.dev/c3
(cd $C && tar xJf full.tar.xz && cp gated_delta_prefill.ptx full/)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
python3 $C/jitwarm.py -j 8 $C/full/*.ptx > $OUT/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Ccmake.define.LILY_CUDA_KERNELS=OFF . > $OUT/install.log 2>&1; t "install rc=$?"
wait $JW; t "jit warm"
timeout 420 python3 scripts/decode_ab.py --depths 0,4096 --rounds 5 --profile 16 s32=$C/full s8=$C/full,LILY_EXP_SCAN_SIMDGROUPS=8 s4=$C/full,LILY_EXP_SCAN_SIMDGROUPS=4 2>&1 | grep -v Warning > $OUT/ab.txt; t "ab rc=$?"
grep -E "^==|^ +[a-z0-9]+ +[0-9]" $OUT/ab.txt | head -20
grep -E "gated_delta|qmv_norm_seg_conv|qmv_gated" $OUT/ab.txt | head -24
t done
