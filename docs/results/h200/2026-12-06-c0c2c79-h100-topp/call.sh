#!/bin/bash
# Issue 21, fifteenth session ($1: all | checks | peer; $2: seconds it may take; $3: the PTX set, main = main 48b181a).
# main.tar.xz: the 13 PTX files of main 48b181a; topp.tar.xz: the same with a7cd627's sampling.ptx (tree.txt names them).
# checks: starts llama.cpp's build in the background (JOBS=14), builds Lily, then
# lily.selftest --device cuda, the engine tests on the CUDA runtime, the whole kernel test suite on the GPU,
# scripts/bench_kernels.py --json, a decode profile at depth 4096 and nucleus.py (sampled decodes without top-k).
# peer (after checks, same machine): lily bench
# -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3 and run.sh's gguf bandwidth plan llama sampled table stages (REPS=3).
# all: both in one call; auto: checks, then the peer run on an H200, else compute-sanitizer memcheck over the
# sampling and MoE prefill kernel tests. Tars its folder at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
MODE=$1; T0=$(date +%s); END=${2:-560}; SET=${3:-main}
root=$PWD; D=$root/.dev/d15; P=/tmp/p15; R=/tmp/r15/$MODE; rm -rf $R; mkdir -p $R
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
export PEER_OUT=/tmp/lily-peer/out; mkdir -p $PEER_OUT /tmp/lily-peer
finish() { if [ $MODE != checks ]; then mkdir -p $R/peer; cp $PEER_OUT/*.json $PEER_OUT/*.md $PEER_OUT/*.log $PEER_OUT/*.txt $PEER_OUT/llama.cpp.commit $R/peer/ 2>/dev/null; fi
  cp /tmp/lily-peer/build_stage.log $R/ 2>/dev/null; tar czf $OUT/$MODE.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
cp $D/tree.txt $R/
export LILY_CUDA_PTX_DIR=$P
if [ $MODE != peer ]; then
  { [ $MODE = all ] || grep -q H200 $R/device.txt; } && { [ -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] || [ -e /tmp/lily-peer/build_stage.log ] || (OUT=$PEER_OUT JOBS=14 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &); }
  rm -rf $P; mkdir -p $P; tar xJf $D/$SET.tar.xz -C $P; (cd $P && sha256sum *.ptx) > $R/ptx_sha256.txt; echo "PTX set: $SET" > $R/ptx_set.txt
  python3 $D/jitwarm.py -j 16 $P/*.ptx > $R/jitwarm.txt 2>&1 &
  JW=$!
  python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
    -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
  wait $JW; t "jit warm"
  timeout 100 python3 -m lily.selftest --device cuda > $R/selftest.txt 2>&1; t "selftest rc=$?"; tail -2 $R/selftest.txt
  (cd /tmp && LILY_ENGINE_CHECKPOINTS=$root/.dev/h200/checkpoints LILY_ENGINE_RUNTIMES=cuda PYTHONPATH=$root \
    timeout 120 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/engine/test_metal_backend.py \
    $root/tests/engine/test_demo_metal.py $root/tests/engine/test_cuda_backend.py -k cuda --durations=5 \
    > $R/engine_tests.txt 2>&1); t "engine tests rc=$?"; tail -1 $R/engine_tests.txt
  (cd /tmp && LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider \
    --rootdir $root $root/tests/kernels --ignore=$root/tests/kernels/test_registry.py > $R/kernel_tests.txt 2>&1)
  t "kernel tests rc=$?"; tail -1 $R/kernel_tests.txt
  timeout 60 python3 scripts/bench_kernels.py --repeats 20 --json $R/bench_kernels.json > $R/bench_kernels.txt 2>&1
  t "bench_kernels rc=$?"
  timeout 90 python3 $D/profile_kernels.py --prompt 8 --decode 32 --depth 4096 2>&1 | grep -v Warning \
    > $R/profile_d4096.txt; t "profile rc=$?"
  timeout 75 python3 $D/nucleus.py $R/nucleus.json > $R/nucleus.txt 2>&1; t "nucleus rc=$?"; grep median $R/nucleus.txt
  t "llama-bench: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"; tail -3 /tmp/lily-peer/build_stage.log
fi
if [ $MODE = auto ] && ! grep -q H200 $R/device.txt; then  # not the bar's card: memcheck instead of the peer run
  (cd /tmp && LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout $(left 5) /usr/local/cuda/bin/compute-sanitizer \
    --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider --rootdir $root \
    $root/tests/kernels/test_sampling.py $root/tests/kernels/test_moe_prefill.py > $R/sanitizer_memcheck.txt 2>&1)
  t "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck.txt | tail -2
  MODE=checks
fi
if [ $MODE != checks ]; then
  while [ ! -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] && [ $(left) -gt 250 ]; do sleep 3; done
  t "llama-bench: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"
  timeout $(left 110) bash -c 'lily bench --dummy-weights --full-size --backend cuda -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3 --no-expert-load -o json > $PEER_OUT/lily-bench.json 2> $PEER_OUT/lily-bench.log'; t "lily bench rc=$?"
  grep -E "^\s+(tg|pp)" $PEER_OUT/lily-bench.log
  OUT=$PEER_OUT REPS=3 timeout $(left 3) bash scripts/peer_bench/run.sh build gguf bandwidth plan llama sampled table 2>&1 | tail -24; t "peer stages done"
fi
t done
