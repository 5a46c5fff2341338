#!/bin/bash
# Issue 21, 2026-12-05 sixth session, call 3. (1) SCAN_IN_PROJECTION again: off / on (b656806's kernel: every thread
# fences with membar.gl = fence.sc.gpu) / on2 (only the threads that take tickets fence, with fence.acq_rel.gpu);
# tg128 at depths 0 and 4096, decode_ab, one process; on2's kernel cases on the GPU. (2) The peer run on this GPU:
# lily bench (default switches) and llama.cpp (built in the background meanwhile): gguf, bandwidth, plan, llama
# (REPS=3), table. Results in one tarball.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); R=/tmp/res; mkdir -p $R
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
END=575
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
export PEER_OUT=/tmp/lily-peer/out; mkdir -p $PEER_OUT
finish() { cp $PEER_OUT/*.json $PEER_OUT/*.md $PEER_OUT/*.log $PEER_OUT/llama.cpp.commit $R/ 2>/dev/null; tar czf $OUT/results.tar.gz -C $R .; cp $R/table.md $R/log.txt $R/ab.txt $OUT/ 2>/dev/null; }
trap finish EXIT
root=$PWD; A=$root/.dev/d2/full; B=$root/.dev/d3/on2full
(OUT=$PEER_OUT JOBS=10 setsid nohup bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
(cd .dev/d2 && tar xJf full.tar.xz) && (cd .dev/d3 && tar xJf on2.tar.xz) && mkdir -p $B && cp $A/*.ptx $B/ && cp .dev/d3/on2/qmatmul.ptx $B/
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
git log -1 --format=%H > $R/head.txt
python3 .dev/d2/jitwarm.py -j 6 $A/*.ptx $B/qmatmul.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/install.log 2>&1; t "install rc=$?"
wait $JW; t "jit warm"
timeout 200 python3 scripts/decode_ab.py --depths 0,4096 --rounds 5 --profile 16 off=$A,sw.scan_in_projection=0 \
  on=$A on2=$B 2>&1 | grep -v Warning > $R/ab.txt; t "ab rc=$?"
grep -E "^==|^ +[a-zA-Z0-9]+ +[0-9]" $R/ab.txt | head -12
grep -E "conv_scan|gated_norm" $R/ab.txt | head -12
(cd /tmp && LILY_CUDA_PTX_DIR=$B LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 40 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_qmatmul.py -k "conv_scan" > $R/kernel_tests_conv_scan_on2.txt 2>&1; t "on2 kernel tests rc=$?"; tail -1 $R/kernel_tests_conv_scan_on2.txt)
export LILY_CUDA_PTX_DIR=$A
timeout $(left 200) bash -c 'lily bench --dummy-weights --full-size --backend cuda -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3 --no-expert-load -o json > $PEER_OUT/lily-bench.json 2> $PEER_OUT/lily-bench.log'; t "lily bench rc=$?"
grep -E "^\s+(tg|pp)" $PEER_OUT/lily-bench.log
while [ ! -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] && pgrep -f "ninja|cmake" > /dev/null && [ $(left) -gt 150 ]; do sleep 5; done
t "build: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"; cp /tmp/lily-peer/build_stage.log $R/
OUT=$PEER_OUT REPS=3 timeout $(left 5) bash scripts/peer_bench/run.sh gguf bandwidth plan llama table 2>&1 | tail -22; t "peer stages rc=$?"
t done
