#!/bin/bash
# Issue 21, 2026-12-05 fifth session, call 6: the staged GEMVs whose rows take two steps (4-bit K = 4096: the DeltaNet
# out_proj with its gated norm and the attention o_proj; 8-bit K = 2048: the router) load both steps before the
# dependency wait instead of the second after the first is summed. Sets (qmatmul.ptx; every other PTX file bb48e4f's):
# base (c32a49c), A (all three), B (o_proj and router only: the out_proj's 244 registers would keep it from starting
# beside the DeltaNet scan's 1024-thread threadgroups). tg128 at depths 0 and 4096, decode_ab, one process; profiles.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s); t() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
root=$PWD; C=$root/.dev/c7
(cd $C && tar xJf full.tar.xz && tar xJf sets.tar.xz)
for v in base A B; do mkdir -p $C/set_$v; cp $C/full/*.ptx $C/set_$v/; cp $C/$v/qmatmul.ptx $C/set_$v/; done
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
python3 $C/jitwarm.py -j 8 $C/set_base/*.ptx $C/set_A/qmatmul.ptx $C/set_B/qmatmul.ptx > $OUT/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $OUT/install.log 2>&1; t "install rc=$?"
wait $JW; t "jit warm"
timeout 450 python3 scripts/decode_ab.py --depths 0,4096 --rounds 7 --profile 16 base=$C/set_base A=$C/set_A B=$C/set_B 2>&1 | grep -v Warning > $OUT/ab.txt; t "ab rc=$?"
grep -E "^==|^ +[a-zA-Z0-9]+ +[0-9]" $OUT/ab.txt | head -12
grep -E "residual|norm_seg_staged_q8|gated_delta" $OUT/ab.txt | head -24
(cd /tmp && LILY_CUDA_PTX_DIR=$C/set_A LILY_CUDA_TESTS=gpu LILY_KERNEL_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider --rootdir $root $root/tests/kernels/test_qmatmul.py -k "staged" > $OUT/kernel_tests_staged_A.txt 2>&1; t "kernel tests A rc=$?"; tail -1 $OUT/kernel_tests_staged_A.txt)
t done
