#!/bin/bash
# Issue 21, thirteenth session, call 1 ($1: seconds it may take). PTX built here with clang 19: main.tar.xz (main
# 01839b5, kernels of cb3acd3), the qmatmul.ptx of exp/conv-next-block-first (7cc9d7b: the conv in_proj GEMV loads
# its next streamed block before the current block's sums) and the attention.ptx of exp/attn-split-dims (c8df5f5: the
# decode mma kernels without the simdgroup merge). llama.cpp builds in the background (JOBS=14) for call 2. In order:
# the GPU kernel tests of both branches (test_qmatmul.py -k conv with conv's PTX; test_attention.py with attn's)
# and compute-sanitizer memcheck over their staged conv / mma cases; then decode_ab --depths 4096,0 --rounds 5
# --profile 16: base (main) conv attn base2 (main). Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); END=${1:-500}
root=$PWD; D=$root/.dev/d13; P=/tmp/p13; R=/tmp/r13/call1; rm -rf $R $P; mkdir -p $R $P/main $P/conv $P/attn
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - ($(date +%s)-T0) - ${1:-0} )); [ $l -gt 5 ] && echo $l || echo 5; }
export PEER_OUT=/tmp/lily-peer/out; rm -rf $PEER_OUT; mkdir -p $PEER_OUT
finish() { cp /tmp/lily-peer/build_stage.log $R/ 2>/dev/null; tar czf $OUT/call1.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
git log --oneline -1 > $R/head.txt 2>&1
[ -x /tmp/lily-peer/llama.cpp/build/bin/llama-bench ] || (OUT=$PEER_OUT JOBS=14 setsid bash scripts/peer_bench/run.sh build > /tmp/lily-peer/build_stage.log 2>&1 &)
tar xJf $D/main.tar.xz -C $P/main; cp $P/main/*.ptx $P/conv/; cp $P/main/*.ptx $P/attn/
xz -dc $D/qmatmul_conv_next.ptx.xz > $P/conv/qmatmul.ptx; xz -dc $D/attention_split_dims.ptx.xz > $P/attn/attention.ptx
(cd $P && sha256sum main/*.ptx conv/qmatmul.ptx attn/attention.ptx) > $R/ptx_sha256.txt
python3 $D/jitwarm.py -j 16 $P/main/*.ptx $P/conv/qmatmul.ptx $P/attn/attention.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
export LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda
LILY_CUDA_PTX_DIR=$P/conv timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qmatmul.py -k conv \
  > $R/kernel_tests_conv.txt 2>&1; t "conv kernel tests rc=$?"; tail -1 $R/kernel_tests_conv.txt
LILY_CUDA_PTX_DIR=$P/conv timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qmatmul.py -k "conv and staged" > $R/sanitizer_memcheck_conv.txt 2>&1
t "memcheck conv rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck_conv.txt | tail -2
LILY_CUDA_PTX_DIR=$P/attn timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py \
  > $R/kernel_tests_attention.txt 2>&1; t "attention kernel tests rc=$?"; tail -1 $R/kernel_tests_attention.txt
LILY_CUDA_PTX_DIR=$P/attn timeout 90 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py -k "mma" > $R/sanitizer_memcheck_attention.txt 2>&1
t "memcheck attention rc=$?"; grep -E "passed|failed|ERROR SUMMARY" $R/sanitizer_memcheck_attention.txt | tail -2
unset LILY_CUDA_TESTS LILY_KERNEL_DEVICE
export LILY_CUDA_PTX_DIR=$P/main
timeout $(left 5) python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 16 \
  base=$P/main conv=$P/conv attn=$P/attn base2=$P/main 2>&1 | grep -v Warning > $R/ab.txt
t "A/B rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab.txt | grep -v "between\|timeline"
grep -E "timeline|attention|conv" $R/ab.txt | head -40
t "llama-bench: $(ls /tmp/lily-peer/llama.cpp/build/bin/llama-bench 2>&1)"
t done
