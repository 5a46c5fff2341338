#!/bin/bash
# Issue 21, eleventh session, call A: the working tree (head.txt + the split-KV short blocks on CUDA and the fused
# partial kernel's rotary angles before its wait). PTX: cur (c031a60 + 4028912's moe.ptx, the old attention.ptx) and
# new (cur with this tree's attention.ptx). llama.cpp builds in the background for call B. Attention kernel tests on
# the GPU (new), compute-sanitizer memcheck over the fused prep cases, lily.selftest --device cuda (new); decode_ab at
# depths 4096 and 1024: base (cur, split_kv_block_keys=256: the old rule), blocks (cur, the new rule), rope (new),
# base2 (= base). Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); root=$PWD; D=$root/.dev/d8; P=/tmp/ptx23; R=/tmp/r23/call1; rm -rf $R $P; mkdir -p $R $P/cur $P/new
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
trap 'tar czf $OUT/call1.tar.gz -C $R .' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
cp $D/head.txt $R/; tar xJf $D/cur.tar.xz -C $P/cur && cp $P/cur/*.ptx $P/new/ && xz -dc $D/attention_new.ptx.xz > $P/new/attention.ptx
python3 $D/jitwarm.py -j 16 $P/cur/*.ptx $P/new/attention.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
export PEER_OUT=/tmp/lily-peer/out; rm -rf $PEER_OUT; mkdir -p $PEER_OUT
[ -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] || (OUT=$PEER_OUT JOBS=8 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
export LILY_CUDA_PTX_DIR=$P/new
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_attention.py > $R/kernel_tests_attention.txt 2>&1
t "attention kernel tests rc=$?"; tail -1 $R/kernel_tests_attention.txt
LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
  --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py -k "prep" \
  > $R/sanitizer_memcheck.txt 2>&1
t "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck.txt | tail -2
timeout 100 python3 -m lily.selftest --device cuda > $R/selftest.txt 2>&1; t "selftest rc=$?"; tail -2 $R/selftest.txt
unset LILY_CUDA_PTX_DIR
timeout 240 python3 scripts/decode_ab.py --depths 4096,1024 --rounds 5 --profile 16 --top 16 \
  base=$P/cur,sw.split_kv_block_keys=256 blocks=$P/cur rope=$P/new base2=$P/cur,sw.split_kv_block_keys=256 \
  2>&1 | grep -v Warning > $R/ab.txt
t "A/B rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab.txt | grep -v "between\|timeline"
t done
