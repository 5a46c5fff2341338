#!/bin/bash
# Issue 21, ninth session: everything in one call ($1: seconds it may take), since machines came rarely. The tree of
# f8365a4 (its PTX: new; new with e4be6f8's attention.ptx: old, the same host bindings; new with the lm_head stream
# loading its next block before its sums: lm). llama.cpp builds in the background. In order: the attention kernel tests
# on the GPU (new); compute-sanitizer memcheck over the matrix-unit attention and combine cases; the tg128 A/B old /
# new / lm at depths 4096 and 0 in one process, with each variant's per-token critical-path timeline at 4096; the
# peer run with the set the A/B chose (lm where its median is at least new's at both depths, else new: choice.txt):
# lily bench -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3, run.sh's gguf bandwidth plan llama sampled table stages
# (REPS=3); bench_kernels --json; Nsight Compute on the lm_head GEMV (new, lm) in the time left.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
export CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-580}
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $OUT/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }  # $1: seconds kept back
root=$PWD; C=$root/.dev/c1; P=/tmp/ptx9; NEW=$P/new; OLD=$P/old; LM=$P/lm
export PEER_OUT=/tmp/lily-peer/out
finish() { mkdir -p $OUT/peer; cp $PEER_OUT/*.json $PEER_OUT/*.md $PEER_OUT/*.log $PEER_OUT/*.txt $PEER_OUT/llama.cpp.commit $OUT/peer/ 2>/dev/null; cp /tmp/lily-peer/build_stage.log $OUT/peer/ 2>/dev/null; }
trap finish EXIT
rm -rf $P; mkdir -p $NEW $OLD $LM && tar xJf $C/new.tar.xz -C $NEW && cp $NEW/*.ptx $OLD/ && xz -dc $C/attention_e4.ptx.xz > $OLD/attention.ptx
cp $NEW/*.ptx $LM/ && xz -dc $C/qmatmul_lm.ptx.xz > $LM/qmatmul.ptx
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
cp $C/head.txt $OUT/head.txt
python3 $C/jitwarm.py -j 8 $NEW/*.ptx $OLD/attention.ptx $LM/qmatmul.ptx > $OUT/jitwarm.txt 2>&1 &
JW=$!
rm -rf $PEER_OUT; mkdir -p $PEER_OUT
(OUT=$PEER_OUT JOBS=8 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $OUT/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
cd /tmp
LILY_CUDA_PTX_DIR=$NEW LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider \
  --rootdir $root $root/tests/kernels/test_attention.py > $OUT/kernel_tests_attention.txt 2>&1
t "attention kernel tests rc=$?"; tail -1 $OUT/kernel_tests_attention.txt
LILY_CUDA_PTX_DIR=$NEW LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 90 /usr/local/cuda/bin/compute-sanitizer \
  --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider --rootdir $root \
  $root/tests/kernels/test_attention.py -k "mma or combine" > $OUT/sanitizer_memcheck.txt 2>&1
t "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $OUT/sanitizer_memcheck.txt | tail -2
cd $root
timeout $(left 300) python3 scripts/decode_ab.py --depths 4096,0 --rounds 4 --profile 16 --top 24 old=$OLD new=$NEW lm=$LM \
  2>&1 | grep -v Warning > $OUT/ab.txt
t "A/B rc=$?"; grep -E "^==|^ +(old|new|lm) +[0-9]" $OUT/ab.txt
choice=$(python3 - $OUT/ab.txt <<'PY'
import re, sys
med = {}
for block in open(sys.argv[1]).read().split("== tg")[1:]:
    for name, v in re.findall(r"^ +(new|lm) +([0-9.]+)", block, re.M):
        med.setdefault(name, []).append(float(v))
ok = len(med.get("lm", [])) == 2 and len(med.get("new", [])) == 2 and all(l >= n for l, n in zip(med["lm"], med["new"]))
print("lm" if ok else "new")
PY
)
echo $choice > $OUT/choice.txt; export LILY_CUDA_PTX_DIR=$P/$choice; t "peer run with $choice"
timeout $(left 170) bash -c 'lily bench --dummy-weights --full-size --backend cuda -p 1,8,512,4096 -n 128 -d 0,4096,32768 -r 3 --no-expert-load -o json > $PEER_OUT/lily-bench.json 2> $PEER_OUT/lily-bench.log'; t "lily bench rc=$?"
grep -E "^\s+(tg|pp)" $PEER_OUT/lily-bench.log
while [ ! -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] && pgrep -f "ninja|cmake" > /dev/null && [ $(left) -gt 120 ]; do sleep 5; done
t "build: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"; tail -2 /tmp/lily-peer/build_stage.log
OUT=$PEER_OUT REPS=3 timeout $(left 15) bash scripts/peer_bench/run.sh build gguf bandwidth plan llama sampled table 2>&1 | tail -22; t "peer stages done"
[ $(left) -gt 15 ] && timeout $(left 3) python3 scripts/bench_kernels.py --repeats 20 --json $OUT/bench_kernels.json > $OUT/bench_kernels.txt 2>&1; t "bench_kernels rc=$?"
for s in new lm; do
  [ $(left) -gt 30 ] || break
  LILY_CUDA_PTX_DIR=$P/$s timeout $(left 3) /usr/local/cuda/bin/ncu --kernel-name regex:qmv_norm_staged_q4_g64_bf16_of32_a16 \
    --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section Occupancy \
    --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats \
    python3 scripts/bench_kernels.py --repeats 2 --kernels "lm_head.*staged" > $OUT/ncu_lm_head_$s.txt 2>&1; t "ncu $s rc=$?"
done
t done
