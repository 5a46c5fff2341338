#!/bin/bash
# Issue 21, twelfth session, call 5 ($1: seconds it may take): the tree of HEAD (the segmented staged GEMVs take one
# threadgroup per row block), cb3acd3's PTX (no kernel changed since). llama.cpp builds in the background (JOBS=12).
# decode_ab (depths 4096, 0): old (sw.seg_stream_groups=528, sw.conv_stream_groups=396: the rule before) new (the
# default) old2; then, once llama.cpp is built, the peer run of the default: lily bench -p 1,8,512,4096 -n 128
# -d 0,4096,32768 -r 3, run.sh's gguf bandwidth plan llama sampled table stages (REPS=3). Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-500}
root=$PWD; D=$root/.dev/d11; P=/tmp/p11/main; R=/tmp/r11/call5; rm -rf $R $P; mkdir -p $R $P
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
export PEER_OUT=/tmp/lily-peer/out; rm -rf $PEER_OUT; mkdir -p $PEER_OUT
finish() { mkdir -p $R/peer; cp $PEER_OUT/*.json $PEER_OUT/*.md $PEER_OUT/*.log $PEER_OUT/*.txt $PEER_OUT/llama.cpp.commit $R/peer/ 2>/dev/null; cp /tmp/lily-peer/build_stage.log $R/peer/ 2>/dev/null; tar czf $OUT/call5.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
[ -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] || (OUT=$PEER_OUT JOBS=12 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
tar xJf $D/main.tar.xz -C $P
python3 $D/jitwarm.py -j 16 $P/*.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
export LILY_CUDA_PTX_DIR=$P
timeout $(left 300) python3 scripts/decode_ab.py --depths 4096,0 --rounds 4 --profile 16 --top 16 \
  old=$P,sw.seg_stream_groups=528,sw.conv_stream_groups=396 new=$P old2=$P,sw.seg_stream_groups=528,sw.conv_stream_groups=396 \
  2>&1 | grep -v Warning > $R/ab.txt
t "A/B rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab.txt | grep -v "between\|timeline"
while [ ! -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] && [ $(left) -gt 150 ]; do sleep 3; done
t "llama-bench: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"
timeout $(left 85) bash -c 'lily bench --dummy-weights --full-size --backend cuda -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3 --no-expert-load -o json > $PEER_OUT/lily-bench.json 2> $PEER_OUT/lily-bench.log'; t "lily bench rc=$?"
grep -E "^\s+tg" $PEER_OUT/lily-bench.log
OUT=$PEER_OUT REPS=3 timeout $(left 3) bash scripts/peer_bench/run.sh build gguf bandwidth plan llama sampled table 2>&1 | tail -22; t "peer stages done"
t done
