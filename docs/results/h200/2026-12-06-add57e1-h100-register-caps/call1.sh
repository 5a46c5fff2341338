#!/bin/bash
# Issue 21, eleventh session, call 1 (A/B of register caps): the tree of head.txt with its PTX (cur); variants whose
# PTX adds `.maxnreg N` (maxnreg.py) to the decode chain's staged kernels, so more of their threadgroups fit an SM
# beside the dispatch before. capt: 128 for moe gate/up + down, the q|k|v, router, conv and gated-norm GEMVs, and
# attention partial+prep; moe128 / qmv128 / attn128 its parts; cap96: the moe and qmv ones (and o_proj) at 96.
# decode_ab at depths 4096 and 0, one process, base loaded twice, with timelines. Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s)
root=$PWD; D=$root/.dev/d7; P=/tmp/ptx22; R=/tmp/r22/call1; rm -rf $R $P; mkdir -p $R $P/cur
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
trap 'tar czf $OUT/call1.tar.gz -C $R .' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
cp $D/head.txt $R/
tar xJf $D/cur.tar.xz -C $P/cur && tar xJf $D/caps.tar.xz -C $P
mkv() { mkdir -p $P/$1 && cp $P/cur/*.ptx $P/$1/ && shift_=$1 && shift && for f in "$@"; do cp $f $P/$shift_/; done; }
mkv all128 $P/capt/moe.ptx $P/capt/qmatmul.ptx $P/capt/attention.ptx
mkv moe128 $P/capt/moe.ptx
mkv qmv128 $P/capt/qmatmul.ptx
mkv attn128 $P/capt/attention.ptx
mkv all96 $P/cap96/moe.ptx $P/cap96/qmatmul.ptx $P/capt/attention.ptx
python3 $D/jitwarm.py -j 16 $P/cur/*.ptx $P/capt/*.ptx $P/cap96/*.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
timeout 420 python3 scripts/decode_ab.py --depths 4096,0 --rounds 5 --profile 16 --top 24 \
  base=$P/cur all128=$P/all128 moe128=$P/moe128 qmv128=$P/qmv128 attn128=$P/attn128 all96=$P/all96 base2=$P/cur \
  2>&1 | grep -v Warning > $R/ab.txt
t "A/B rc=$?"; grep -E "^==|^ +[a-z0-9]+ +[0-9]+\.[0-9] +[0-9]" $R/ab.txt | grep -v "between\|timeline"
t done
