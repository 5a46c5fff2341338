#!/bin/bash
# Issue 21, 2026-12-05 sixth session, call 8: the sampler's radix passes counted in packed fields (sample_partial's
# digits in 4-bit fields, the top-k select's in 8-bit fields: fewer instructions, the same counts). bench_kernels'
# sampling cases with 1ab0eb6's sampling.ptx (old) and the new one (new), then the new one's kernel tests on the GPU,
# compute-sanitizer memcheck over them, sampled decode old against new through the engine (decode_ab --sampled, one
# process), and the new kernels' greedy against sampled decode (scripts/peer_bench/sampled.py).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
root=$PWD; OLD=$root/.dev/c8/full; NEW=$root/.dev/d5/new
(cd .dev/c8 && tar xJf full.tar.xz) && mkdir -p $NEW && cp $OLD/*.ptx $NEW/ && cp .dev/d5/sampling.ptx $NEW/
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
python3 .dev/d5/jitwarm.py -j 6 $OLD/*.ptx $NEW/sampling.ptx > $OUT/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > /tmp/install.log 2>&1; t "install rc=$?"
wait $JW; t "jit warm"
for v in old new; do d=$OLD; [ $v = new ] && d=$NEW
  LILY_CUDA_PTX_DIR=$d timeout 25 python3 scripts/bench_kernels.py --repeats 20 --kernels "sample|argmax" > $OUT/bench_$v.$RANDOM.txt 2>&1; t "bench $v rc=$?"
done
grep -h -E "^\| (sample|argmax)" $OUT/bench_*.txt | cut -c1-150
(cd /tmp && LILY_CUDA_PTX_DIR=$NEW LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_sampling.py > $OUT/kernel_tests_sampling.txt 2>&1; t "kernel tests rc=$?"; tail -1 $OUT/kernel_tests_sampling.txt)
timeout 150 python3 scripts/decode_ab.py --sampled --depths 0 --rounds 5 old=$OLD new=$NEW 2>&1 | grep -v Warning > $OUT/ab_sampled.txt; t "sampled A/B rc=$?"; grep -E "^==|^ +(old|new) " $OUT/ab_sampled.txt
LILY_CUDA_PTX_DIR=$NEW timeout 50 python3 scripts/peer_bench/sampled.py $OUT/sampled_new.json 2>&1 | grep -v Warn > $OUT/sampled_new.txt; t "sampled rc=$?"; tail -1 $OUT/sampled_new.txt
(cd /tmp && LILY_CUDA_PTX_DIR=$NEW LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 90 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_sampling.py -k "test_sampling" > $OUT/sanitizer_memcheck_sampling.txt 2>&1; t "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $OUT/sanitizer_memcheck_sampling.txt | tail -2)
t done
