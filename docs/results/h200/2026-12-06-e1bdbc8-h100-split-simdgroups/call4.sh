#!/bin/bash
# Issue 21, twelfth session, call 4 ($1: seconds it may take): the tree of e1bdbc8 (test option split_mma_simdgroups),
# cb3acd3's PTX (no kernel changed since). llama.cpp builds in the background (JOBS=14) for a peer call after it.
# decode_ab A (depths 4096, 1024): base n4 n2 base2 (n*: sw.split_mma_simdgroups, the simdgroups of a split-KV partial
# threadgroup on matrix units: 8 by default, 255 registers each, so a threadgroup of 8 takes a whole SM's registers and
# starts only on an SM the q|k|v GEMV has left); decode_ab B (depth 32768): base n4 base2. Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-570}
root=$PWD; D=$root/.dev/d11; P=/tmp/p11/main; R=/tmp/r11/call4; rm -rf $R $P; mkdir -p $R $P
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
finish() { cp /tmp/lily-peer/build_stage.log $R/ 2>/dev/null; tar czf $OUT/call4.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
export PEER_OUT=/tmp/lily-peer/out; mkdir -p $PEER_OUT
[ -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] || (OUT=$PEER_OUT JOBS=14 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
tar xJf $D/main.tar.xz -C $P
python3 $D/jitwarm.py -j 16 $P/*.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
timeout $(left 120) python3 scripts/decode_ab.py --depths 4096,1024 --rounds 5 --profile 16 --top 16 \
  base=$P n4=$P,sw.split_mma_simdgroups=4 n2=$P,sw.split_mma_simdgroups=2 base2=$P 2>&1 | grep -v Warning > $R/ab_a.txt
t "A/B a rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab_a.txt | grep -v "between\|timeline"
timeout $(left 5) python3 scripts/decode_ab.py --depths 32768 --rounds 3 --top 16 \
  base=$P n4=$P,sw.split_mma_simdgroups=4 base2=$P 2>&1 | grep -v Warning > $R/ab_b.txt
t "A/B b rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab_b.txt | grep -v "between\|timeline"
t "llama-bench: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"
t done
