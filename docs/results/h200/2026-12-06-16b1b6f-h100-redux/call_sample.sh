#!/bin/bash
# Issue 21, fourteenth session, sampling call: the sampling and MoE routing kernels with four PTX sets on one GPU,
# scripts/bench_kernels.py --kernels "sample|moe_route|moe route|moe down" --repeats 50, one process per set, in the
# order main redux noadd nopre main redux. main: f33f72d's 13 PTX files; redux: exp/redux's (now main);
# noadd / nopre: redux's set with a sampling.ptx whose shim keeps integer sums as butterflies (noadd) or integer
# prefix sums in lane order (nopre). Tarred at exit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_CACHE_MAXSIZE=4294967296
T0=$(date +%s)
root=$PWD; D=$root/.dev/d14; P=/tmp/p14s; R=/tmp/r14/sample; rm -rf $R $P; mkdir -p $R
t() { echo "[$(( $(date +%s)-T0 ))s] $*" | tee -a $R/log.txt; }
finish() { tar czf $OUT/sample.tar.gz -C $R .; }
trap finish EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $R/device.txt
for s in main redux noadd nopre; do mkdir -p $P/$s; done
tar xJf $D/main.tar.xz -C $P/main; for s in redux noadd nopre; do tar xJf $D/redux.tar.xz -C $P/$s; done
xz -dc $D/sampling_noadd.ptx.xz > $P/noadd/sampling.ptx; xz -dc $D/sampling_nopre.ptx.xz > $P/nopre/sampling.ptx
(cd $P && sha256sum */moe.ptx */sampling.ptx) > $R/ptx_sha256.txt
python3 $D/jitwarm.py -j 16 $P/main/*.ptx $P/redux/*.ptx $P/noadd/sampling.ptx $P/nopre/sampling.ptx > $R/jitwarm.txt 2>&1 &
JW=$!
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu -Ccmake.define.LILY_CUDA_KERNELS=OFF \
  -Ccmake.define.LILY_TEST_BUILD=ON . > $R/build.txt 2>&1; t "lily built rc=$?"
wait $JW; t "jit warm"
i=0
for s in main redux noadd nopre main redux; do
  i=$((i+1))
  LILY_CUDA_PTX_DIR=$P/$s timeout 60 python3 scripts/bench_kernels.py --repeats 50 --kernels "sample|moe_route|moe route|moe down" \
    --json $R/bench_${i}_$s.json > $R/bench_${i}_$s.txt 2>&1; t "$i $s rc=$?"
  grep -E "^\| (sample|moe)" $R/bench_${i}_$s.txt | cut -d'|' -f2,4,5 | sed "s/^/$s /"
done
t done
