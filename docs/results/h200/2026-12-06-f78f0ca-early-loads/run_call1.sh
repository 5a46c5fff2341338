#!/bin/bash
# Issue 21, eighth session, the one call the device time left allowed (any GPU; $1: seconds it may take). Two
# same-bits changes against e4be6f8's kernels ("old"): "new" = the decode attention kernels on matrix units with their
# first K/V steps fetched before the dependency wait, the query rows in 16-byte loads, the single pass's gate staged
# before the merge and the combine's loads issued before its weights (attention.ptx of this tree); "new2" = that and
# moe_down_combine_staged routing again and loading its first weights and residual before its wait (moe.ptx of this
# tree too: every kernel of this tree). In order of priority: the attention and MoE kernel tests on the GPU with new2;
# the tg128 A/B at depths 4096 and 0 in one process; compute-sanitizer memcheck over the changed kernels' cases;
# bench_kernels' attention and MoE decode cases, old and new2, in the time left.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
export CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $OUT/log.txt; }
END=${1:-360}
left() { local l=$(( ${1:-$END} - ($(date +%s)-T0) )); [ $l -gt 5 ] && echo $l || echo 5; }
root=$PWD; G=$root/.dev/g1
OLD=$root/.dev/f1/full; NEW=$G/new; NEW2=$G/new2
(cd .dev/f1 && tar xJf full.tar.xz) && mkdir -p $NEW $NEW2 && cp $OLD/*.ptx $NEW/ && xz -dc $G/attention.ptx.xz > $NEW/attention.ptx
cp $NEW/*.ptx $NEW2/ && xz -dc $G/moe.ptx.xz > $NEW2/moe.ptx
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
git log -1 --format=%H > $OUT/head.txt
python3 $G/jitwarm.py -j 6 $OLD/*.ptx $NEW/attention.ptx $NEW2/moe.ptx > $OUT/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $OUT/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
(cd /tmp && LILY_CUDA_PTX_DIR=$NEW2 LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_attention.py $root/tests/kernels/test_moe.py > $OUT/kernel_tests.txt 2>&1; t "kernel tests rc=$?"; tail -1 $OUT/kernel_tests.txt)
timeout $(left 90) python3 scripts/decode_ab.py --depths 4096,0 --rounds 4 old=$OLD new=$NEW new2=$NEW2 2>&1 | grep -v Warning > $OUT/ab.txt; t "A/B rc=$?"
grep -E "^==|^ +(old|new|new2) +[0-9]" $OUT/ab.txt
(cd /tmp && LILY_CUDA_PTX_DIR=$NEW2 LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout $(left 30) /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_attention.py $root/tests/kernels/test_moe.py -k "mma or combine" > $OUT/sanitizer_memcheck.txt 2>&1; t "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $OUT/sanitizer_memcheck.txt | tail -2)
if [ $(left) -gt 25 ]; then
  LILY_CUDA_PTX_DIR=$OLD timeout 15 python3 $G/bench_kernels_e4be6f8.py --repeats 20 --kernels "attention decode (64|4K)|moe down" > $OUT/bench_old.txt 2>&1; t "bench old rc=$?"
  LILY_CUDA_PTX_DIR=$NEW2 timeout 15 python3 scripts/bench_kernels.py --repeats 20 --kernels "attention decode (64|4K)|moe down" > $OUT/bench_new2.txt 2>&1; t "bench new2 rc=$?"
  grep -h -E "^\| (attention|moe)" $OUT/bench_old.txt $OUT/bench_new2.txt | cut -d'|' -f2,3,4
fi
t done
