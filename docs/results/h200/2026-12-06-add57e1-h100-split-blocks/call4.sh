#!/bin/bash
# Issue 21, eleventh session, call 4: split-KV blocks at 1K and 4K keys (test option split_kv_min_keys: 256 the
# default, 128 and 64 split into more blocks, up to 64; at 4K keys the default's 32 blocks are 64 threadgroups on 132
# SMs). One process: base mk128 mk64 base2 at depths 4096 and 1024, with timelines. Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); root=$PWD; D=$root/.dev/d7; P=/tmp/ptx22; R=/tmp/r22/call4; rm -rf $R; mkdir -p $R $P/cur
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
trap 'tar czf $OUT/call4.tar.gz -C $R .' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
if [ ! -f $P/cur/qmatmul.ptx ]; then
  tar xJf $D/cur.tar.xz -C $P/cur
  python3 $D/jitwarm.py -j 16 $P/cur/*.ptx > $R/jitwarm.txt 2>&1 &
  python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
    -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"; wait; t "jit warm"
fi
C=$P/cur
timeout 330 python3 scripts/decode_ab.py --depths 4096,1024 --rounds 5 --profile 16 --top 16 \
  base=$C mk128=$C,sw.split_kv_min_keys=128 mk64=$C,sw.split_kv_min_keys=64 base2=$C 2>&1 | grep -v Warning > $R/ab.txt
t "A/B rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab.txt | grep -v "between\|timeline"
t done
