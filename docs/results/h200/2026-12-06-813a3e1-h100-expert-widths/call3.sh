#!/bin/bash
# Issue 21, eleventh session, call 3: the staged decode experts' threadgroup widths (test options
# moe_gate_up_simdgroups / moe_down_simdgroups; the same bits, checked on the fake libcuda). The tree of this call
# (head.txt + the options), PTX cur. A: base gu3 gu2 gu5; B: base dn2 dn8 gu3dn2 (four full-size models a process).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); root=$PWD; D=$root/.dev/d7; P=/tmp/ptx22; R=/tmp/r22/call3; rm -rf $R $P; mkdir -p $R $P/cur
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
trap 'tar czf $OUT/call3.tar.gz -C $R .' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
tar xJf $D/cur.tar.xz -C $P/cur
python3 $D/jitwarm.py -j 16 $P/cur/*.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
C=$P/cur
timeout 250 python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 24 \
  base=$C gu3=$C,sw.moe_gate_up_simdgroups=3 gu2=$C,sw.moe_gate_up_simdgroups=2 gu5=$C,sw.moe_gate_up_simdgroups=5 \
  2>&1 | grep -v Warning > $R/ab_a.txt
t "A/B a rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab_a.txt | grep -v "between\|timeline"
timeout 250 python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 24 \
  base=$C dn2=$C,sw.moe_down_simdgroups=2 dn8=$C,sw.moe_down_simdgroups=8 \
  gu3dn2=$C,sw.moe_gate_up_simdgroups=3,sw.moe_down_simdgroups=2 2>&1 | grep -v Warning > $R/ab_b.txt
t "A/B b rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab_b.txt | grep -v "between\|timeline"
t done
