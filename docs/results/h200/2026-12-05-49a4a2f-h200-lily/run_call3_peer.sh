#!/bin/bash
# Issue 21: the peer run (PTX of .dev/d6 = the kernels of 6ab15d6 and later: 1ab0eb6 + the sampler change 09dc27f).
# The peer run on whatever GPU is lent: llama.cpp built in the background; Lily built there; lily.selftest --device
# cuda; lily bench -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3; run.sh's gguf, bandwidth, plan, llama (REPS=3), sampled,
# table; bench_kernels --json in the time left. Everything comes back in one tarball.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
export CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
END=${1:-540}
left() { local l=$(( ${1:-$END} - ($(date +%s)-T0) )); [ $l -gt 5 ] && echo $l || echo 5; }
root=$PWD
C=$root/.dev/d6
R=/tmp/res; mkdir -p $R
finish() { cp $PEER_OUT/*.json $PEER_OUT/*.md $PEER_OUT/*.log $PEER_OUT/llama.cpp.commit $R/ 2>/dev/null; tar czf $OUT/results.tar.gz -C $R .; cp $R/table.md $R/log.txt $OUT/ 2>/dev/null; }
trap finish EXIT
(cd $C && tar xJf full.tar.xz)
P=$C/full
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
git log -1 --format=%H > $R/head.txt
python3 $C/jitwarm.py -j 6 $P/*.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
export PEER_OUT=/tmp/lily-peer/out; mkdir -p $PEER_OUT
(OUT=$PEER_OUT JOBS=10 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
export LILY_CUDA_PTX_DIR=$P
(cd /tmp && timeout $(left 60) python3 -m lily.selftest --device cuda > $R/selftest.txt 2>&1); t "selftest rc=$?"; tail -1 $R/selftest.txt
timeout $(left $((END-170))) bash -c 'lily bench --dummy-weights --full-size --backend cuda -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3 --no-expert-load -o json > $PEER_OUT/lily-bench.json 2> $PEER_OUT/lily-bench.log'; t "lily bench rc=$?"
grep -E "^\s+(tg|pp)" $PEER_OUT/lily-bench.log
while [ ! -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] && pgrep -f "ninja|cmake" > /dev/null && [ $(left) -gt 150 ]; do sleep 5; done
t "build: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"; tail -2 /tmp/lily-peer/build_stage.log
cp /tmp/lily-peer/build_stage.log $R/
OUT=$PEER_OUT REPS=3 timeout $(( $(left) - 25 )) bash scripts/peer_bench/run.sh build gguf bandwidth plan llama sampled table 2>&1 | tail -22; t "peer stages done"
[ $(left) -gt 40 ] && timeout $(left) python3 scripts/bench_kernels.py --repeats 20 --json $R/bench_kernels.json > $R/bench_kernels.txt 2>&1; t "bench_kernels rc=$?"
t done
