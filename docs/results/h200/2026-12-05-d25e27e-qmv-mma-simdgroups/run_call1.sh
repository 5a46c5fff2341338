#!/bin/bash
# Issue 21, 2026-12-05 fifth session, call 1 (the tree of d25e27e; PTX of bb48e4f's kernels = this tree's).
# On an H200: the peer run (llama.cpp's build in the background; Lily built there; lily.selftest --device cuda;
# lily bench -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3; run.sh's gguf, bandwidth, plan, llama (REPS=3), table;
# greedy against sampled decode). Elsewhere: qmv_mma 16 outputs x 8 simdgroups against the committed 16 x 4
# (bench_kernels on the qmv and qmv_mma cases, twice each).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
export CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
END=${1:-560}
left() { local l=$(( ${1:-$END} - ($(date +%s)-T0) )); [ $l -gt 5 ] && echo $l || echo 5; }
root=$PWD
C=$root/.dev/c1
(cd $C && tar xJf full.tar.xz && tar xJf m16s8.tar.xz)
P=$C/full
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
if grep -q H200 $OUT/device.txt; then
  python3 $C/jitwarm.py -j 6 $P/*.ptx > $OUT/jitwarm.txt 2>&1 &
  JW=$!
  export PEER_OUT=/tmp/lily-peer/out; mkdir -p $PEER_OUT
  (OUT=$PEER_OUT JOBS=10 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
  python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
    -Ccmake.define.LILY_TEST_BUILD=ON . > $OUT/build.txt 2>&1; t "lily built rc=$?"
  wait $JW; t "jit warm"
  export LILY_CUDA_PTX_DIR=$P
  (cd /tmp && timeout $(left 60) python3 -m lily.selftest --device cuda > $OUT/selftest.txt 2>&1); t "selftest rc=$?"; tail -1 $OUT/selftest.txt
  timeout $(left $((END-150))) bash -c 'lily bench --dummy-weights --full-size --backend cuda -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3 --no-expert-load -o json > $PEER_OUT/lily-bench.json 2> $PEER_OUT/lily-bench.log'; t "lily bench rc=$?"
  grep -E "^\s+(tg|pp)" $PEER_OUT/lily-bench.log
  cp $PEER_OUT/lily-bench.json $PEER_OUT/lily-bench.log $OUT/
  while [ ! -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] && pgrep -f "ninja|cmake" > /dev/null && [ $(left) -gt 140 ]; do sleep 5; done
  t "build: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"; tail -2 /tmp/lily-peer/build_stage.log
  OUT=$PEER_OUT REPS=3 timeout $(left) bash scripts/peer_bench/run.sh build gguf bandwidth plan llama table 2>&1 | tail -22; t "peer stages done"
  cp $PEER_OUT/llama-bench.json $PEER_OUT/plan.json $PEER_OUT/bandwidth.json $PEER_OUT/table.md $PEER_OUT/llama-bench.log $PEER_OUT/llama.cpp.commit $OUT/ 2>&1
  [ $(left) -gt 65 ] && timeout $(left) python3 .dev/sampled.py 2>&1 | grep -v Warn > $OUT/sampled.txt; t sampled; tail -1 $OUT/sampled.txt
else
  python3 $C/jitwarm.py -j 3 $P/qmatmul.ptx $C/m16s8/qmatmul.ptx > $OUT/jitwarm.txt 2>&1 &
  JW=$!
  python3 -m pip install -q --no-build-isolation --no-deps -Ccmake.define.LILY_CUDA_KERNELS=OFF . > $OUT/install.log 2>&1; t "install rc=$?"
  wait $JW; t "jit warm"
  for v in "full 16 4" "m16s8 16 8" "full 16 4" "m16s8 16 8"; do set -- $v
    LILY_CUDA_PTX_DIR=$C/$1 timeout 100 python3 scripts/bench_kernels.py --repeats 20 --qmv-mma $2 $3 --kernels "^qmv (square|Delta|attention|lm_head)|^qmv_mma|short prompt qmv_mma" --json $OUT/bench_$1_$2x$3.$RANDOM.json > $OUT/bench_$1_$2x$3.$RANDOM.txt 2>&1; t "$v rc=$?"
  done
fi
t done
